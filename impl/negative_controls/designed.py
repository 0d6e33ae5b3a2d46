"""Caches that differ from mlx-lm on purpose (a bfloat16 extract), with and
without a bug beside the designed difference."""

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvparity.impl.batch_quantized import BatchQuantizedKVCache

from kvparity.impl.negative_controls.members import TrimForgetsOffset


# Each names the check its difference shows in. Without an expectations file
# the gate fails them; with one declaring that check, every other check still
# gates (reports/expectations/).


class ExtractReturnsBfloat16(BatchQuantizedKVCache):
    """extract hands out the row dequantized, in mlx-lm's unquantized
    ``KVCache`` (bfloat16), as a cache that publishes rows for reuse by
    unquantized readers would: the rest of the protocol is the reference's."""

    differs_by = "extract"

    def extract(self, idx):
        row = super().extract(idx)
        cache = KVCache()
        if row.keys is not None:
            cache.keys, cache.values = self._dequantized(row.keys), self._dequantized(row.values)
        cache.offset = row.offset
        return cache

    def _dequantized(self, triple):
        packed = triple[0]
        if packed.shape[2] == 0:  # a row of no tokens (trimmed or rolled back empty): mx.dequantize cannot reshape it
            dim = packed.shape[3] * 32 // self.bits
            return mx.zeros((*packed.shape[:3], dim), dtype=mx.bfloat16)
        return mx.dequantize(*triple, group_size=self.group_size, bits=self.bits).astype(mx.bfloat16)


class ExtractReturnsBfloat16TrimForgetsOffset(ExtractReturnsBfloat16):
    """The designed difference above, and a bug beside it: trim forgets the
    RoPE offsets, as ``TrimForgetsOffset``. Declaring ``extract`` must not
    hide it."""

    def trim(self, n):
        return TrimForgetsOffset.trim(self, n)

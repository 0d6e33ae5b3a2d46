"""The cache-level (L1) oracle: one request alone, through mlx-lm's caches.

The request starts in mlx-lm's ``KVCache`` and is converted by mlx-lm's own
``maybe_quantize_kv_cache`` after every call, exactly when ``generate_step``
would convert it (offset >= quantized_kv_start); from then on mlx-lm's
``QuantizedKVCache`` stores it.
"""

import copy

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache

from kvparity.oracle.arrays import handles


class SoloCache:
    def __init__(self, bits: int, group_size: int, quantized_kv_start: int, cache=None):
        self.bits = bits
        self.group_size = group_size
        self.quantized_kv_start = quantized_kv_start
        # A one-layer prompt cache: mlx-lm converts layers in place in the list.
        self.layers = [cache if cache is not None else KVCache()]

    @classmethod
    def prefilled(cls, request, bits: int, group_size: int, draw, prompt_len=None):
        """The request's prompt appended in generate_step's chunks;
        ``draw(n)`` gives the next n tokens' keys and values."""
        solo = cls(bits, group_size, request.quantized_kv_start)
        for n in request.prefill_chunks(prompt_len):
            solo.append(*draw(n))
        return solo

    def fork(self) -> "SoloCache":
        """The same request holding the same bytes through handles of its own
        (no copy): mlx-lm writes a cache's arrays in place, so appending to
        one of the two leaves the other as it was."""
        cache = copy.copy(self.cache)
        for name, value in vars(cache).items():
            setattr(cache, name, tree_map(lambda x: handles([x])[0] if isinstance(x, mx.array) else x, value))
        return SoloCache(self.bits, self.group_size, self.quantized_kv_start, cache)

    @property
    def cache(self):
        return self.layers[0]

    @property
    def quantized(self) -> bool:
        return hasattr(self.cache, "bits")

    def append(self, keys, values):
        self.cache.update_and_fetch(keys, values)
        maybe_quantize_kv_cache(
            self.layers, self.quantized_kv_start, self.group_size, self.bits
        )

    def trim(self, n: int):
        self.cache.trim(n)

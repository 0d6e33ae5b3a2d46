"""rapid-mlx's ``QuantizedBatchKVCache`` (``rapid_mlx/quantized_batch_cache.py``,
rapid-mlx 0.16.10), as its own server joins it.

The class follows mlx-lm's protocol (``size``, ``nbytes``, ``bits`` and
``group_size`` included) except for what ``merge`` accepts:

* ``merge(caches, group_size=64, bits=8)`` (quantized_batch_cache.py:512)
  takes bits and group size as arguments, not from the rows; rapid-mlx calls
  it through its row class ``_QuantizableKVCache.merge`` (:599), which reads
  them from the first row (:600-603).
* It reads each row's length with ``size()`` and its keys as one array
  (:520, :524): it joins unquantized ``KVCache`` rows and quantizes them as
  it merges. A quantized row has no place in it: mlx-lm's ``QuantizedKVCache``
  answers 0 to ``size()``, and its keys are a triple. rapid-mlx's server never
  holds a quantized solo row: a stored prefix comes back dequantized
  (``Scheduler._reconstruct_cache_from_states``, scheduler.py:6671, with
  ``_dequantize``, quantized_batch_cache.py:135) and is re-typed by
  ``normalize_caches_for_quantization`` (:914) before ``BatchGenerator``
  merges it. So ``merge`` here does the same: each quantized row is
  dequantized with rapid-mlx's ``_dequantize`` into a ``KVCache``, re-typed
  by ``normalize_caches_for_quantization``, and merged as ``_QuantizableKVCache``
  merges (bits and group size from the rows), into this class.

Quantizing a dequantized row again does not give back its bytes (``mx.quantize``
re-derives scales and biases): that, and ``extract`` returning the row
dequantized (:487), are rapid-mlx's design, declared in
``reports/examples/matrix/rapid-mlx-0.16.10/expectations.json``.
Everything else is the package's own code, unchanged.
"""

from mlx_lm.models.cache import KVCache
from mlx_lm.models.cache import QuantizedKVCache as MlxLmQuantizedKVCache
from rapid_mlx import quantized_batch_cache as rapid


def as_rapid_row(row, group_size: int, bits: int):
    """A solo row as rapid-mlx's server hands it to ``merge``: unquantized,
    its row class ``_QuantizableKVCache``."""
    if isinstance(row, MlxLmQuantizedKVCache):
        restored = KVCache()  # as Scheduler._reconstruct_cache_from_states restores a quantized entry
        if row.keys is not None:
            keys, values = ([x[..., : row.offset, :] for x in triple] for triple in (row.keys, row.values))
            restored.keys = rapid._dequantize(keys, row.group_size, row.bits)
            restored.values = rapid._dequantize(values, row.group_size, row.bits)
            restored.offset = restored.keys.shape[2]
        row = restored
    return rapid.normalize_caches_for_quantization([row], group_size, bits)[0]


class QuantizedBatchKVCache(rapid.QuantizedBatchKVCache):
    @classmethod
    def merge(cls, caches):
        first = caches[0]
        group_size = getattr(first, "group_size", None) or first.q_group_size
        bits = getattr(first, "bits", None) or first.q_bits
        rows = [as_rapid_row(c, group_size, bits) for c in caches]
        return super().merge(rows, group_size=rows[0].q_group_size, bits=rows[0].q_bits)

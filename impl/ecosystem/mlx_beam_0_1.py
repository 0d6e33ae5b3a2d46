"""mlx-beam's batched quantized KV cache (a port of mlx-optiq's).

``mlx_beam._vendor.optiq.kv_batch.BatchQuantizedKVCache`` (0.1.0a11) is
built on mlx-beam's vendored copy of mlx-lm's cache classes, and follows
mlx-lm's batch cache protocol, with one difference of protocol: its
``merge`` reads each row's length from ``size()``
(mlx_beam/_vendor/optiq/kv_batch.py:192 @ 0.1.0a11), and mlx-lm's
``QuantizedKVCache`` inherits ``size() == 0``. mlx-beam's engine builds
every request's cache as its own ``MergeableQuantizedKVCache``, whose
``size()`` is its ``offset`` (kv_batch.py:285). The adapter re-types the
rows to that class, sharing their arrays, and joins through mlx-beam's own
``merge``. Nothing else is changed.
"""

from mlx_beam._vendor.optiq.kv_batch import BatchQuantizedKVCache, MergeableQuantizedKVCache

from kvparity.impl.ecosystem import retyped


class MlxBeamBatchQuantizedKVCache(BatchQuantizedKVCache):
    @classmethod
    def merge(cls, caches):
        # Rows re-typed to mlx-beam's row class (kv_batch.py:192 reads size()).
        return super().merge([retyped(c, MergeableQuantizedKVCache) for c in caches])

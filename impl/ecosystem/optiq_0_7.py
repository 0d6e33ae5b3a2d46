"""mlx-optiq's batched quantized KV cache, as ``optiq serve`` uses it.

``optiq.runtime.kv.batch.BatchQuantizedKVCache`` follows mlx-lm's batch
cache protocol itself, with one difference of protocol: its ``merge``
reads each row's length from ``size()``
(optiq/runtime/kv/batch.py:227 @ 0.7.7), and mlx-lm's ``QuantizedKVCache``
inherits ``size() == 0``, so plain rows would merge into an empty batch.
optiq's server never hands it plain rows: its batch hook builds every
request's cache as optiq's own ``MergeableQuantizedKVCache``
(batch.py:427), whose ``size()`` is its ``offset`` (batch.py:315). The
adapter re-types the rows to that class, sharing their arrays, and joins
through optiq's own ``merge``. Nothing else is changed.
"""

from optiq.runtime.kv.batch import BatchQuantizedKVCache, MergeableQuantizedKVCache

from kvparity.impl.ecosystem import retyped


class OptiqBatchQuantizedKVCache(BatchQuantizedKVCache):
    @classmethod
    def merge(cls, caches):
        # Rows re-typed to optiq's row class (batch.py:227 reads size()).
        return super().merge([retyped(c, MergeableQuantizedKVCache) for c in caches])

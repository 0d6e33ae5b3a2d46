"""gmlx's batched quantized KV cache, joined as gmlx's prefix cache joins it.

``gmlx.cache.kv_cache.BatchQuantizedKVCache`` (gmlx 0.5.3, an edited copy
of mlx-vlm 0.7.3's) is gmlx's own class tree, not mlx-lm's. Three
differences of protocol, each translated here and nothing else:

* It has no ``merge``. gmlx joins solo rows through the row class:
  ``QuantizedKVCache.prefix_cache_merge(rows, prefix_lens)``
  (gmlx/cache/kv_cache.py:507 @ 0.5.3), which gmlx's prefix cache calls
  (gmlx/_vendor/mlx_vlm/apc_adapters.py:527) with gmlx's own
  ``QuantizedKVCache`` rows. The adapter's ``merge`` re-types mlx-lm's rows
  to that class, sharing their arrays, and calls it; the batch it builds is
  hard-coded as gmlx's class (kv_cache.py:527), so it is re-typed to this
  adapter, which adds members only.
* ``size()`` is inherited from ``_BaseCache`` and is 0 (kv_cache.py:245);
  the batch width is ``_idx``, as its ``make_mask`` reads it.
* ``nbytes`` is inherited and raises ``NotImplementedError``
  (kv_cache.py:255); gmlx's own accounting, ``cache_nbytes``
  (kv_cache.py:142), then counts the arrays of ``state``. The adapter
  answers with the same.
"""

from gmlx.cache.kv_cache import BatchQuantizedKVCache, QuantizedKVCache, cache_nbytes


def as_gmlx_row(row) -> QuantizedKVCache:
    """``row``, an mlx-lm ``QuantizedKVCache``, as gmlx's row class: the
    same arrays, offset, bits and group size."""
    if isinstance(row, QuantizedKVCache):
        return row
    gmlx_row = QuantizedKVCache(group_size=row.group_size, bits=row.bits)
    gmlx_row.keys, gmlx_row.values, gmlx_row.offset = row.keys, row.values, row.offset
    return gmlx_row


class GmlxBatchQuantizedKVCache(BatchQuantizedKVCache):
    @classmethod
    def merge(cls, caches):
        rows = [as_gmlx_row(c) for c in caches]
        join = QuantizedKVCache(group_size=rows[0].group_size, bits=rows[0].bits)
        batch = join.prefix_cache_merge(rows, [r.offset for r in rows])
        if batch is None:  # gmlx's answer for rows it will not join
            raise ValueError("gmlx's QuantizedKVCache.prefix_cache_merge declined these rows")
        batch.__class__ = cls  # built as gmlx's class (kv_cache.py:527)
        return batch

    def size(self):
        return self._idx

    @property
    def nbytes(self):
        return cache_nbytes(self.state)

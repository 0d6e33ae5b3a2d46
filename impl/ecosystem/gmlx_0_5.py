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

Being a subclass changes one thing the adapter must undo: gmlx's
``_BaseCache.__init_subclass__`` resets ``_kv_routed`` and ``_kv_grid`` to
False on every subclass that does not set them (kv_cache.py:206-210), which
would switch off the append gmlx's class runs (kv_cache.py:2680-2681: the
capacity grid, and writes into fresh handles) for a slice write into the
arrays it holds. The adapter sets both back to the class's own values.
"""

from gmlx.cache.kv_cache import BatchQuantizedKVCache, QuantizedKVCache, cache_nbytes

from kvparity.impl.ecosystem import retyped


class GmlxBatchQuantizedKVCache(BatchQuantizedKVCache):
    # gmlx's own append, which its __init_subclass__ turns off in a subclass.
    _kv_routed = BatchQuantizedKVCache._kv_routed
    _kv_grid = BatchQuantizedKVCache._kv_grid

    @classmethod
    def merge(cls, caches):
        rows = [retyped(c, QuantizedKVCache) for c in caches]
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

"""mlx-vlm's ``BatchQuantizedKVCache`` (``mlx_vlm/models/cache.py``), as its
own engine joins it. Tested at mlx-vlm 0.7.10 and 0.7.2; line numbers are
given as ``0.7.10 / 0.7.2``.

The class stores and grows triples as mlx-lm's caches do, but three members
of mlx-lm's protocol are missing or spelled differently:

* ``merge``: the class has none. mlx-vlm joins filled quantized rows through
  ``QuantizedKVCache.prefix_cache_merge(rows, prefix_lens)`` (models/cache.py
  :445 / :446), as its prefix cache does (apc_adapters.py:527 in
  ``merge_cache_entries``); that method takes only mlx-vlm's own
  ``QuantizedKVCache`` rows (``isinstance`` at models/cache.py:458 / :459),
  answers ``None`` where the protocol raises, and builds its batch by name,
  ``BatchQuantizedKVCache(...)`` (models/cache.py:474 / :475). So ``merge``
  re-types mlx-lm's rows to mlx-vlm's row class (same arrays, same offset),
  calls ``prefix_cache_merge``, and re-types the batch it built to this class.
* ``size()``: inherited from ``_BaseCache``, it answers 0 (models/cache.py:197);
  the class keeps the batch width in ``_idx``, which its ``make_mask`` reads.
* ``nbytes``: inherited from ``_BaseCache``, it raises NotImplementedError
  (models/cache.py:207); mlx-vlm accounts a cache's bytes with
  ``cache_nbytes`` (models/cache.py:111), which falls back to ``state``.

Everything else is the package's own code, unchanged.
"""

from mlx_lm.models.cache import QuantizedKVCache as MlxLmQuantizedKVCache
from mlx_vlm.models import cache as vlm

from kvparity.impl.ecosystem import retyped


def as_vlm_row(row):
    """mlx-lm's solo quantized row as mlx-vlm's own row class, holding the
    same arrays (prefix_cache_merge checks isinstance of mlx-vlm's class)."""
    return retyped(row, vlm.QuantizedKVCache) if isinstance(row, MlxLmQuantizedKVCache) else row


class BatchQuantizedKVCache(vlm.BatchQuantizedKVCache):
    @classmethod
    def merge(cls, caches):
        rows = [as_vlm_row(c) for c in caches]
        batch = None
        if isinstance(rows[0], vlm.QuantizedKVCache):
            batch = rows[0].prefix_cache_merge(rows, [int(r.offset) for r in rows])
        if batch is None:  # prefix_cache_merge declines by answering None
            raise ValueError(
                "mlx-vlm's QuantizedKVCache.prefix_cache_merge declined these rows: "
                + ", ".join(f"{type(r).__name__}(bits={getattr(r, 'bits', None)}, "
                            f"group_size={getattr(r, 'group_size', None)})" for r in rows))
        batch.__class__ = cls  # built by name as the package's class; this one adds only protocol
        return batch

    def size(self):
        return self._idx

    @property
    def nbytes(self):
        return vlm.cache_nbytes(self.state)

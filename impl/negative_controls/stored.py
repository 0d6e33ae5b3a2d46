"""Controls caught only when a row is stored and joined from: an extracted
row that lends its columns, trims or counts its bytes wrong, or shares
buffers with its copy."""

import copy

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from kvparity.impl.batch_quantized import BatchQuantizedKVCache


# Each breaks what mlx-lm's server does with a row it stores (LRUPromptCache):
# ``extract`` it, count its ``nbytes``, deep-copy it, trim the copy.


class ExtractLendsItsColumns(BatchQuantizedKVCache):
    """extract hands out copies but keeps them as the row's own: a trim or
    rollback of the batch reclaims the dropped columns, zeroing them in
    place in every row it handed out too, so a stored row changes when its
    source row is trimmed later."""

    caught_by = "stored"

    def extract(self, idx):
        cache = super().extract(idx)
        self.__dict__.setdefault("lent", []).append(cache)
        return cache

    def trim(self, n):
        n = super().trim(n)
        self._reclaim(n)
        return n

    def rollback(self, amounts):
        super().rollback(amounts)
        self._reclaim(max(int(a) for a in amounts))

    def _reclaim(self, n):
        for cache in self.__dict__.get("lent", ()):
            if n and cache.keys is not None:
                for x in cache.keys + cache.values:
                    x[..., max(x.shape[2] - n, 0) :, :] = 0


class _RowCompactedOnTrim(QuantizedKVCache):
    """A row that gives memory back when trimmed: fresh buffers sized to its
    tokens, the packed words copied, the scales and biases forgotten (zero)."""

    def trim(self, n):
        n = super().trim(n)
        if self.keys is not None:
            self.keys, self.values = (
                (mx.array(packed[..., : self.offset, :]), mx.zeros_like(scales[..., : self.offset, :]),
                 mx.zeros_like(biases[..., : self.offset, :]))
                for packed, scales, biases in (self.keys, self.values)
            )
        return n


class _RowCountsPackedBytes(QuantizedKVCache):
    """A row whose nbytes counts only the packed words."""

    @property
    def nbytes(self):
        return sum(x[0].nbytes for x in (self.keys, self.values) if x is not None)


class _RowCopiedShallowly(QuantizedKVCache):
    """A row whose deep copy shares its arrays: what a join prefills into
    the copy it fetched is written into the stored row."""

    def __deepcopy__(self, memo):
        return copy.copy(self)


def _extract_as(row_class):
    """An extract that returns the reference's row as ``row_class``."""

    def extract(self, idx):
        cache = BatchQuantizedKVCache.extract(self, idx)
        cache.__class__ = row_class
        return cache

    return extract


class StoredRowTrimForgetsScales(BatchQuantizedKVCache):
    """extract returns a row whose trim (a store's longer prompt trimmed to
    the common prefix) compacts it and forgets its scales and biases."""

    caught_by = "stored"
    extract = _extract_as(_RowCompactedOnTrim)


class StoredNbytesCountsPacked(BatchQuantizedKVCache):
    """extract returns a row whose nbytes counts only the packed arrays: the
    store's byte budget undercounts it."""

    caught_by = "stored_nbytes"
    extract = _extract_as(_RowCountsPackedBytes)


class StoredCopySharesBuffers(BatchQuantizedKVCache):
    """extract returns a row whose deep copy shares its buffers: a join from
    a stored prompt writes the rest of its own prompt into the stored row."""

    caught_by = "stored"
    extract = _extract_as(_RowCopiedShallowly)


class _RowCountsNoBiases(QuantizedKVCache):
    """A row whose nbytes adds the packed words and the scales, not the biases."""

    @property
    def nbytes(self):
        return sum(packed.nbytes + scales.nbytes
                   for packed, scales, _ in (t for t in (self.keys, self.values) if t is not None))


class StoredNbytesSkipsBiases(BatchQuantizedKVCache):
    """extract returns a row whose nbytes leaves out the biases: a store's
    byte budget (LRUPromptCache) undercounts every stored row."""

    caught_by = "stored_nbytes"
    at_fault = "extract"
    extract = _extract_as(_RowCountsNoBiases)


STORE_VARIANTS = [ExtractLendsItsColumns, StoredRowTrimForgetsScales, StoredNbytesCountsPacked,
                  StoredCopySharesBuffers, StoredNbytesSkipsBiases]

"""Boundary controls: one-line bugs right at every value but one edge of a
member's integers (a padding of one, a row emptied, an empty side), which
the coverage model's value cells are there to reach."""

import mlx.core as mx

from kvparity.impl.batch_quantized import BatchQuantizedKVCache, _tokens


# Each is right at every padding, shift, amount or width but one (a padding of
# exactly one column, a row emptied, a side of rows holding no tokens): the
# coverage model's value cells (suites/search/coverage.py VALUES) are there to reach it.


class PrepareRightPaddingPastOne(BatchQuantizedKVCache):
    """prepare records the right padding only when the longest gap is more
    than one token: a prompt one token shorter than the longest in a padded
    prefill keeps the longest's offset, so its RoPE positions are wrong. It
    shows when finalize applies what prepare recorded."""

    caught_by = "offset"
    at_fault = "finalize"  # the first call after which a row can be seen wrong

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if right_padding is not None and max(right_padding) <= 1:
            right_padding = None  # the bug: "> 1" where it must be "> 0"
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)


class FilterDropsSharedPaddingFromTwo(BatchQuantizedKVCache):
    """filter drops the padding every survivor shares only when it is two
    columns or more: a single shared pad column stays."""

    caught_by = "shared_padding"
    at_fault = "filter"

    def filter(self, batch_indices):
        rows = mx.array([int(i) for i in batch_indices])
        if self.keys is not None:
            self.keys, self.values = (tuple(x[rows] for x in t) for t in (self.keys, self.values))
        self.offset, self.left_padding = self.offset[rows], self.left_padding[rows]
        shared = min(self.left_padding.tolist())
        if shared > 1:  # the bug: "> 1" where it must be "> 0"
            if self.keys is not None:
                self.keys, self.values = _tokens(self.keys, shared, None), _tokens(self.values, shared, None)
            self._idx -= shared
            self.left_padding = self.left_padding - shared


class RollbackRefusesToEmptyARow(BatchQuantizedKVCache):
    """rollback refuses an amount equal to the row's whole length (``<``
    where ``<=`` belongs): a row rolled back to nothing raises."""

    caught_by = "raised"
    at_fault = "rollback"

    def rollback(self, amounts):
        lengths = self._row_lengths()
        for row, (amount, length) in enumerate(zip(amounts, lengths)):
            if not 0 <= int(amount) < length:  # the bug
                raise ValueError(f"cannot roll back {amount} tokens of row {row}: it holds {length}")
        super().rollback(amounts)


class ExtendPadsNoEmptySide(BatchQuantizedKVCache):
    """extend gives a side whose rows hold no tokens no padding ("nothing to
    align"): rows a trim emptied keep left padding 0 in a batch that is now
    wider, so size() - left_padding is no longer their length."""

    caught_by = "left_padding"
    at_fault = "extend"

    def extend(self, other):
        empty = self._idx == 0  # the bug: an empty side still pads to the new width
        super().extend(other)
        if empty:
            self.left_padding = mx.concatenate([mx.zeros((self.batch_size - other.batch_size,), mx.int32),
                                                self.left_padding[self.batch_size - other.batch_size:]])


class TrimCountsWhatRemains(BatchQuantizedKVCache):
    """trim clamps the count it returns by what is left after the trim, not
    by what was there: right while the batch keeps at least n tokens, 0 where
    the trim empties it."""

    caught_by = "trimmed"
    at_fault = "trim"

    def trim(self, n):
        super().trim(n)
        return min(n, self._idx)  # the bug: mlx-lm's min(self._idx, n) belongs before the trim


class NbytesZeroWithoutTokens(BatchQuantizedKVCache):
    """nbytes takes a batch whose rows hold no tokens for an empty one and
    counts 0, while its buffers are still held (a store's or an engine's
    byte budget then under-counts it)."""

    caught_by = "nbytes"
    at_fault = "nbytes"

    @property
    def nbytes(self):
        if self._idx == 0:  # the bug: empty is ``keys is None``, as mlx-lm's caches test it
            return 0
        return super().nbytes


class MergePadsNoFreshRow(BatchQuantizedKVCache):
    """merge gives a row that holds no keys (a fresh cache beside rows from
    a stored prefix) no left padding ("nothing to align"): in a batch as wide
    as its longest row, size() - left_padding is no longer its length 0."""

    caught_by = "left_padding"
    at_fault = "merge"

    @classmethod
    def merge(cls, caches):
        batch = super().merge(caches)
        fresh = mx.array([c.keys is None for c in caches])  # the bug: a fresh row is padded to the width too
        batch.left_padding = mx.where(fresh, 0, batch.left_padding).astype(mx.int32)
        return batch


class ExtendPadsNoEmptyJoiners(BatchQuantizedKVCache):
    """extend takes joining rows whose batch holds no keys (merged from rows
    of no tokens) as having no padding to shift: they keep left padding 0
    in a batch that is as wide as the running rows."""

    caught_by = "left_padding"
    at_fault = "extend"

    def extend(self, other):
        joiners = other.left_padding
        super().extend(other)
        if other.keys is None:  # the bug: rows of no keys still pad to the new width
            self.left_padding = mx.concatenate([self.left_padding[:self.batch_size - other.batch_size], joiners])


class MergeStopsAtAFreshRow(BatchQuantizedKVCache):
    """merge stops placing rows at the first one that holds no keys (a fresh
    cache, "nothing more to copy"): right while fresh rows come last, as they
    do beside a stored prefix inserted first; the rows after a fresh one are
    left zero."""

    caught_by = "bytes"
    at_fault = "merge"

    @classmethod
    def merge(cls, caches):
        batch = super().merge(caches)
        first = next((i for i, c in enumerate(caches) if c.keys is None), len(caches))
        if batch.keys is not None and first < len(caches):  # the bug: a ``break`` where ``continue`` belongs
            placed = (mx.arange(len(caches)) < first)[:, None, None, None]
            batch.keys = tuple(mx.where(placed, x, mx.zeros((), dtype=x.dtype)) for x in batch.keys)
            batch.values = tuple(mx.where(placed, x, mx.zeros((), dtype=x.dtype)) for x in batch.values)
        return batch


class SaysUntrimmable(BatchQuantizedKVCache):
    """is_trimmable answers False (as a cache that cannot trim per row might):
    mlx-lm's trim_prompt_cache then trims nothing, and a speculative round's
    rejected tokens stay in every row."""

    caught_by = "trimmed"
    at_fault = "is_trimmable"

    def is_trimmable(self):
        return False  # the bug: trim works, and mlx-lm asks this before it calls trim


# The boundary controls: each one group at the default gate, naming its ``at_fault``.
BOUNDARY = [PrepareRightPaddingPastOne, FilterDropsSharedPaddingFromTwo, RollbackRefusesToEmptyARow,
            ExtendPadsNoEmptySide, TrimCountsWhatRemains, NbytesZeroWithoutTokens, MergePadsNoFreshRow,
            ExtendPadsNoEmptyJoiners, SaysUntrimmable, MergeStopsAtAFreshRow]

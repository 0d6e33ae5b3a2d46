"""Broken variants of the reference cache: each must be caught by L1.

Every class breaks one thing a real implementation gets wrong, and names the
check expected to catch it. ``test_negative_controls.py`` runs the catalog on
each and fails if any survives. They are also valid ``--impl`` targets, e.g.
``kvparity run --impl kvparity.impl.negative_controls:MaskIgnoresLeftPadding``.

Further down: caches that try to pass without evidence (``VACUITY``), a
cache with a member that never returns (``HANGS``), and classes that behave
differently when subclassed (``SUBCLASS_SENSITIVE``), which hold the harness
to running the class a user ships as itself.
"""

import copy
import time

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from kvparity.impl.batch_quantized import BatchQuantizedKVCache, _tokens
from kvparity.impl.minimal import MinimalBatchQuantizedKVCache
from kvparity.impl.minimal import _columns as minimal_columns


class LeftPaddingOffByOne(BatchQuantizedKVCache):
    """merge records one pad column too many for every padded row."""

    caught_by = "left_padding"

    @classmethod
    def merge(cls, caches):
        batch = super().merge(caches)
        padded = (batch.left_padding > 0).astype(mx.int32)
        batch.left_padding = batch.left_padding + padded
        return batch


class FilterKeepsSharedPadding(BatchQuantizedKVCache):
    """filter keeps the rows but forgets to drop the padding they all share."""

    caught_by = "shared_padding"

    def filter(self, batch_indices):
        rows = mx.array([int(i) for i in batch_indices])
        self.keys = tuple(x[rows] for x in self.keys)
        self.values = tuple(x[rows] for x in self.values)
        self.offset = self.offset[rows]
        self.left_padding = self.left_padding[rows]


class ExtractReturnsViews(BatchQuantizedKVCache):
    """extract hands out slices of the batch instead of copies."""

    caught_by = "alias"

    def extract(self, idx):
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        start = self.left_padding[idx].item()
        cache.offset = self._idx - start
        cache.keys = tuple(x[idx : idx + 1, :, start : self._idx] for x in self.keys)
        cache.values = tuple(x[idx : idx + 1, :, start : self._idx] for x in self.values)
        return cache


class RollbackByLargest(BatchQuantizedKVCache):
    """per-row rollback trims every row by the largest count."""

    caught_by = "offset"

    def rollback(self, amounts):
        self.trim(max(amounts))


class MergeRequantizes(BatchQuantizedKVCache):
    """merge dequantizes each row and quantizes it again."""

    caught_by = "bytes"

    @classmethod
    def merge(cls, caches):
        requantized = []
        for cache in caches:
            copy = QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
            copy.offset = cache.offset
            if cache.keys is not None:
                copy.keys, copy.values = (
                    mx.quantize(
                        mx.dequantize(*triple, group_size=cache.group_size, bits=cache.bits),
                        group_size=cache.group_size,
                        bits=cache.bits,
                    )
                    for triple in (cache.keys, cache.values)
                )
            requantized.append(copy)
        return super().merge(requantized)


class MergeWritesItsSources(BatchQuantizedKVCache):
    """merge is right, then zeroes each source's first token in place (as a
    cache that reuses the buffers it consumed would): the request's own
    prompt cache changes under it."""

    caught_by = "source"

    @classmethod
    def merge(cls, caches):
        batch = super().merge(caches)
        _zero_first_token(caches)
        return batch


def _zero_first_token(caches):
    """Zero each solo cache's first key token in place."""
    for cache in caches:
        if cache.keys is not None:
            cache.keys[0][..., :1, :] = 0


class ExtractWritesTheBatch(BatchQuantizedKVCache):
    """extract is right, then zeroes the row's first token in the batch in
    place (as an extract that recycles the row's columns would)."""

    caught_by = "extract"

    def extract(self, idx):
        cache = super().extract(idx)
        if self.keys is not None:
            start = self.left_padding.tolist()[idx]
            self.keys[0][idx : idx + 1, :, start : start + 1] = 0
        return cache


class MaskIgnoresLeftPadding(BatchQuantizedKVCache):
    """make_mask is causal but lets rows attend to their pad columns."""

    caught_by = "mask"

    def make_mask(self, N, return_array=False, window_size=None, **kwargs):
        return create_causal_mask(N, offset=self._idx, window_size=window_size)


class ExtendForgetsExistingPadding(BatchQuantizedKVCache):
    """extend shifts the existing rows' bytes right but not their left_padding."""

    caught_by = "left_padding"

    def extend(self, other):
        rows, before = self.batch_size, self.left_padding
        super().extend(other)
        self.left_padding = mx.concatenate([before, self.left_padding[rows:]])


class RopeOffsetIgnoresLeftPadding(BatchQuantizedKVCache):
    """offset (the RoPE position) counts from column 0, padding included."""

    caught_by = "offset"

    @property
    def offset(self):
        return mx.full((self.batch_size,), self._idx, dtype=mx.int32)

    @offset.setter
    def offset(self, value):
        pass  # derived from the width alone


class TrimForgetsOffset(BatchQuantizedKVCache):
    """trim drops the columns but leaves the RoPE offsets where they were."""

    caught_by = "offset"

    def trim(self, n):
        self._idx -= n
        return n


class FinalizeLeavesJunk(BatchQuantizedKVCache):
    """finalize rolls right-padded prefill into place but keeps the pad bytes."""

    caught_by = "pad"

    def _shift_rows_right(self, shifts):
        if max(shifts, default=0) == 0:
            return
        self.left_padding = self.left_padding + mx.array(shifts, dtype=mx.int32)
        width = self._idx
        source = (mx.arange(width)[None] - mx.array(shifts)[:, None]) % width
        source = source[:, None, :, None]
        roll = lambda x: mx.take_along_axis(x[..., :width, :], source, axis=2)
        self.keys = tuple(roll(x) for x in self.keys)
        self.values = tuple(roll(x) for x in self.values)
        self._drop_shared_padding()


class GrowthDropsTail(BatchQuantizedKVCache):
    """buffer growth past 256 tokens copies only the first full step."""

    caught_by = "bytes"

    def _grow(self, keys, values, num_steps):
        super()._grow(keys, values, num_steps)
        if self._idx > self.step:
            zero_tail = lambda x: mx.concatenate(
                [x[..., : self.step, :], mx.zeros_like(x[..., self.step :, :])], axis=2
            )
            self.keys = tuple(zero_tail(x) for x in self.keys)
            self.values = tuple(zero_tail(x) for x in self.values)


class EmptyBatchPacksWholeElementsPerWord(BatchQuantizedKVCache):
    """The first buffers of an empty batch hold ``head_dim // (32 // bits)``
    packed words per token, as mlx-lm's ``QuantizedKVCache`` sizes a new
    cache's and published batched caches copy: right where bits divides 32
    or head_dim is 64, a word too many at 5 and 6 bits for head_dim 96 and
    128, where the first write into the batch raises."""

    caught_by = "raised"

    def _grow(self, keys, values, num_steps):
        if self.keys is not None:
            return super()._grow(keys, values, num_steps)
        steps = (self.step + num_steps - 1) // self.step * self.step
        self.keys, self.values = (self._zeros(triple, steps) for triple in (keys, values))

    def _zeros(self, triple, steps):
        _, scales, biases = triple
        groups = scales.shape[-1]
        shape = (self.batch_size, scales.shape[1], steps)
        head_dim = groups * self.group_size
        return (mx.zeros((*shape, head_dim // (32 // self.bits)), dtype=mx.uint32),
                mx.zeros((*shape, groups), dtype=scales.dtype),
                mx.zeros((*shape, groups), dtype=biases.dtype))


class FilterSharedPaddingOffByOne(BatchQuantizedKVCache):
    """filter drops the padding every survivor shares from the bookkeeping,
    but slices the arrays one column short of it (``shared - 1``): every
    surviving row's bytes sit one column right of where its padding ends."""

    caught_by = "bytes"
    at_fault = "filter"

    def filter(self, batch_indices):
        rows = mx.array([int(i) for i in batch_indices])
        self.offset, self.left_padding = self.offset[rows], self.left_padding[rows]
        shared = min(self.left_padding.tolist())
        if self.keys is not None:
            start = max(shared - 1, 0)
            self.keys = _tokens(tuple(x[rows] for x in self.keys), start, None)
            self.values = _tokens(tuple(x[rows] for x in self.values), start, None)
        self._idx -= shared
        self.left_padding = self.left_padding - shared


class FilterKeepsAMarginColumn(MinimalBatchQuantizedKVCache):
    """A newcomer's bug, on the minimal cache: filter keeps one column of the
    padding every survivor shares "as a margin" (``shared - 1``). It shows as
    a column every row pads at L1, a wrong layout at L2, and a forward that
    raises at L3: one member to fix."""

    caught_by = "shared_padding"

    def filter(self, batch_indices):
        rows = mx.array(batch_indices)
        self.offset, self.left_padding = self.offset[rows], self.left_padding[rows]
        shared = min(self.left_padding.tolist()) - 1
        if self.keys is not None:
            self.keys, self.values = (minimal_columns(tuple(x[rows] for x in t), shared, self._size)
                                      for t in (self.keys, self.values))
        self._size, self.left_padding = self._size - shared, self.left_padding - shared


class TrimSlicesOnlyPackedWords(BatchQuantizedKVCache):
    """A cache that holds exactly its tokens (a write appends, a trim cuts)
    whose trim cuts the packed words but not the scales and biases: every
    check after the trim holds, and the next write appends after the stale
    scales and biases, so it shows one event after its cause."""

    caught_by = "bytes"
    at_fault = "trim"  # found by exposure: the write that shows it is not the member at fault

    def update_and_fetch(self, keys, values):
        new = [mx.quantize(x, group_size=self.group_size, bits=self.bits) for x in (keys, values)]
        if self.keys is None:
            self.keys, self.values = new
        else:
            self.keys, self.values = (tuple(mx.concatenate(pair, axis=2) for pair in zip(old, fresh))
                                      for old, fresh in zip((self.keys, self.values), new))
        self._idx += keys.shape[2]
        self.offset = self.offset + keys.shape[2]
        return self._fetch()

    def trim(self, n):
        n = super().trim(n)
        if self.keys is not None:
            self.keys, self.values = ((packed[..., : self._idx, :], scales, biases)
                                      for packed, scales, biases in (self.keys, self.values))
        return n


class EmptyBatchSizesValuesLikeKeys(BatchQuantizedKVCache):
    """The first buffers of an empty batch are shaped from the keys, the
    values' too, as caches written when keys and values had one head_dim:
    right wherever they do, while at keys 192 / values 128 (DeepSeek-V2) or
    96 / 64 (MiniCPM3) the first write of the values raises."""

    caught_by = "raised"

    def _grow(self, keys, values, num_steps):
        super()._grow(keys, keys if self.keys is None else values, num_steps)


# -- the member at fault: each of these is one failure group naming ``at_fault`` -------
# Bugs of kinds the failure groups were not first built on: a reader's own
# output, a batch's quantization, a buffer freed too far, an extracted row's
# description. The evidence after every call must name the member, whatever
# the check that sees it first or the event it is seen at.


class MaskUnmaskedForOneToken(BatchQuantizedKVCache):
    """make_mask gives no mask for a one-token step, as a solo cache may
    (one query attends to every column): in a batch, rows then attend to
    their own left padding at every decode step."""

    caught_by = "mask"
    at_fault = "make_mask"

    def make_mask(self, N, return_array=False, window_size=None, **kwargs):
        if N == 1:
            return None
        return super().make_mask(N, return_array=return_array, window_size=window_size, **kwargs)


class MergeOfEmptyRowsTakesDefaults(BatchQuantizedKVCache):
    """merge reads bits and group size off the first row that holds keys;
    where none does (a padded batched prefill merges never-filled rows) it
    builds the batch with the constructor's defaults (8 bits, group 64)."""

    caught_by = "quantized"
    at_fault = "merge"

    @classmethod
    def merge(cls, caches):
        if all(c.keys is None for c in caches):
            return cls([c.offset for c in caches])
        return super().merge(caches)


class TrimReleasesStepsRoundingDown(BatchQuantizedKVCache):
    """trim gives buffer memory back in whole steps, keeping the steps its
    tokens need counted by floor division: the last, partly filled step is
    given back with the tokens in it."""

    caught_by = "layout"
    at_fault = "trim"

    def trim(self, n):
        n = super().trim(n)
        kept = self._idx // self.step * self.step  # rounds down where it must round up
        if self.keys is not None and kept < self._capacity():
            self.keys, self.values = _tokens(self.keys, 0, kept), _tokens(self.values, 0, kept)
        return n


class ExtractDescribes8BitRowsAtGroup64(BatchQuantizedKVCache):
    """extract copies the row's bytes right but describes an 8-bit row with
    group size 64 (mlx-lm's default), whatever group it was quantized at:
    mlx-lm's own update_and_fetch then raises on the row's next token."""

    caught_by = "extract"
    at_fault = "extract"

    def extract(self, idx):
        row = super().extract(idx)
        described = QuantizedKVCache(group_size=64 if row.bits == 8 else row.group_size, bits=row.bits)
        described.offset, described.keys, described.values = row.offset, row.keys, row.values
        return described



# -- boundary values: one-line bugs that hold everywhere but at an edge ---------------
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


VARIANTS = [
    LeftPaddingOffByOne,
    FilterKeepsSharedPadding,
    ExtractReturnsViews,
    RollbackByLargest,
    MergeRequantizes,
    MergeWritesItsSources,
    ExtractWritesTheBatch,
    MaskIgnoresLeftPadding,
    ExtendForgetsExistingPadding,
    RopeOffsetIgnoresLeftPadding,
    TrimForgetsOffset,
    FinalizeLeavesJunk,
    GrowthDropsTail,
    EmptyBatchPacksWholeElementsPerWord,
    FilterSharedPaddingOffByOne,
    FilterKeepsAMarginColumn,
    TrimSlicesOnlyPackedWords,
    EmptyBatchSizesValuesLikeKeys,
    MaskUnmaskedForOneToken,
    MergeOfEmptyRowsTakesDefaults,
    TrimReleasesStepsRoundingDown,
    ExtractDescribes8BitRowsAtGroup64,
]
# The boundary controls: each one group at the default gate, naming its ``at_fault``.
BOUNDARY = [PrepareRightPaddingPastOne, FilterDropsSharedPaddingFromTwo, RollbackRefusesToEmptyARow,
            ExtendPadsNoEmptySide, TrimCountsWhatRemains, NbytesZeroWithoutTokens, MergePadsNoFreshRow,
            ExtendPadsNoEmptyJoiners, SaysUntrimmable, MergeStopsAtAFreshRow]
VARIANTS += BOUNDARY


# -- stored prompt caches: caught only when a row is stored and joined from -----------
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
# One failure group each, naming its ``at_fault``: the two the groups were first built on, and five others.
AT_FAULT = [FilterSharedPaddingOffByOne, TrimSlicesOnlyPackedWords, MaskUnmaskedForOneToken,
            MergeOfEmptyRowsTakesDefaults, TrimReleasesStepsRoundingDown, ExtractDescribes8BitRowsAtGroup64,
            StoredNbytesSkipsBiases]


# -- vacuity: caches that try to pass without evidence ------------------------------
# Each names the outcome a run of the catalog must reach. None may pass.


class RefusesUpdateAndFetch(BatchQuantizedKVCache):
    """A required member declines: every schedule is refused, a failure."""

    expected_outcome = "refused"

    def update_and_fetch(self, keys, values):
        raise NotImplementedError("update_and_fetch is not implemented")


class ZeroesMergeRefusesFilter(BatchQuantizedKVCache):
    """Wrong bytes from merge, then filter declines: the divergences already
    recorded stay, the schedule fails rather than reading "not supported"."""

    expected_outcome = "FAIL"

    @classmethod
    def merge(cls, caches):
        batch = super().merge(caches)
        batch.keys = tuple(mx.zeros_like(x) for x in batch.keys)
        return batch

    def filter(self, batch_indices):
        raise NotImplementedError("filter is not implemented")


class StateReturnsNone(BatchQuantizedKVCache):
    """``state`` gives nothing to compare: a layout failure, not a crash."""

    expected_outcome = "FAIL"

    @property
    def state(self):
        return None

    @state.setter
    def state(self, value):
        BatchQuantizedKVCache.state.fset(self, value)


class ZeroWidthState(BatchQuantizedKVCache):
    """``state`` holds arrays with no token columns: layout, under every policy."""

    expected_outcome = "FAIL"

    @property
    def state(self):
        keys, values, *rest = BatchQuantizedKVCache.state.fget(self)
        empty = lambda triple: tuple(x[..., :0, :] for x in triple)
        return (empty(keys), empty(values), *rest)

    @state.setter
    def state(self, value):
        BatchQuantizedKVCache.state.fset(self, value)


class WithoutPerRowRollback(BatchQuantizedKVCache):
    """No per-row rollback: the capability is detected as missing, so the
    schedules that need it are "not supported" and the rest must pass."""

    rollback = None


class RollbackRaisesNotImplemented(BatchQuantizedKVCache):
    """An optional member that declines when called: "not supported"."""

    def rollback(self, amounts):
        raise NotImplementedError("per-row rollback is not implemented")


VACUITY = [RefusesUpdateAndFetch, ZeroesMergeRefusesFilter, StateReturnsNone, ZeroWidthState]


# -- hangs: a member that never returns ------------------------------------------------
# Judged only by the kvparity executable, whose parent stops a member call that
# outruns --member-timeout (suites/core/flight.py); run in process, it would hang its caller.


class FilterNeverReturns(BatchQuantizedKVCache):
    """filter never returns, as a deadlock or a spin in native code would
    not: the cache's FAIL naming filter, one group, in one member timeout
    however many schedule runs call filter (the others are not judged)."""

    at_fault = "filter"

    def filter(self, batch_indices):
        while True:
            time.sleep(3600)


HANGS = [FilterNeverReturns]


# -- designed differences: caches that differ on purpose ----------------------------
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


# -- run as itself: classes that behave differently when subclassed -------------------
# A verdict is about the class a user ships, so the harness never runs a
# subclass of it. Each names the outcome a run of the catalog must reach;
# a broken one also names the check that catches it.


class BreaksItsSubclasses(BatchQuantizedKVCache):
    """Correct as shipped. Its ``__init_subclass__`` resets a class flag, as
    a published cache's does: a subclass is taken to own the buffers its
    merge consumed, so its merge writes into its sources in place. A harness
    that ran a subclass of it would see ``source`` break."""

    expected_outcome = "pass"
    owns_its_sources = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.owns_its_sources = True

    @classmethod
    def merge(cls, caches):
        batch = super().merge(caches)
        if cls.owns_its_sources:
            _zero_first_token(caches)
        return batch


class ChecksItsOwnType(BatchQuantizedKVCache):
    """Correct as shipped. Its members check ``type(self) is`` their class,
    as code that dispatches on exact types does, and raise for anything
    else: a harness that ran a subclass of it would see every member raise."""

    expected_outcome = "pass"

    @classmethod
    def merge(cls, caches):
        _exactly_this(cls)
        return super().merge(caches)

    def extend(self, other):
        _exactly_this(type(self))
        _exactly_this(type(other))
        super().extend(other)

    def update_and_fetch(self, keys, values):
        _exactly_this(type(self))
        return super().update_and_fetch(keys, values)

    def make_mask(self, N, return_array=False, window_size=None, **kwargs):
        _exactly_this(type(self))
        return super().make_mask(N, return_array=return_array, window_size=window_size, **kwargs)


def _exactly_this(cls):
    if cls is not ChecksItsOwnType:
        raise TypeError(f"{cls.__name__} is not ChecksItsOwnType")


class MaskRightOnlyInSubclasses(BatchQuantizedKVCache):
    """Broken as shipped: make_mask lets rows attend to their pad columns
    (as ``MaskIgnoresLeftPadding``) unless the class is a subclass, whose
    ``__init_subclass__`` turns the padding mask on. A harness that ran a
    subclass of it would pass it."""

    expected_outcome = "FAIL"
    caught_by = "mask"
    masks_padding = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.masks_padding = True

    def make_mask(self, N, return_array=False, window_size=None, **kwargs):
        if self.masks_padding:
            return super().make_mask(N, return_array=return_array, window_size=window_size, **kwargs)
        return MaskIgnoresLeftPadding.make_mask(self, N, return_array, window_size)


SUBCLASS_SENSITIVE = [BreaksItsSubclasses, ChecksItsOwnType, MaskRightOnlyInSubclasses]

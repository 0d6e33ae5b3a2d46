"""Controls that break one member the way a real implementation gets it
wrong (a padding off by one, views for copies, a mask without the left
padding, ...), each naming the check that catches it."""

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache

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

"""The reference batched, affine-quantized KV cache.

Rows are left-padded and right-aligned: row ``i`` owns token columns
``[left_padding[i], size())`` of every array. Keys and values are each a
triple ``(packed, scales, biases)`` as returned by ``mx.quantize``; since
quantization groups run along head_dim, the token axis (2) stays token
granular, so padding, concatenation and row selection move bytes and never
touch a quantization group.
"""

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)


def check_quantization(bits: int, group_size: int, head_dim: Optional[int] = None):
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported (choose from {SUPPORTED_BITS})")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(
            f"group_size={group_size} is not supported "
            f"(choose from {SUPPORTED_GROUP_SIZES})"
        )
    if head_dim is not None and head_dim % group_size != 0:
        raise ValueError(
            f"group_size={group_size} does not divide head_dim={head_dim}"
        )


def _tokens(triple, start, stop):
    return tuple(x[..., start:stop, :] for x in triple)


def _pad_tokens(triple, left, right):
    if left == 0 and right == 0:
        return triple
    widths = [(0, 0), (0, 0), (left, right), (0, 0)]
    return tuple(mx.pad(x, widths) for x in triple)


def _empty_triple(like, rows, width=0):
    """Zero triple with ``rows`` rows shaped like ``like`` on axes 1 and 3."""
    return tuple(
        mx.zeros((rows, x.shape[1], width, x.shape[3]), dtype=x.dtype) for x in like
    )


def _layout(keys, values, bits):
    """What two rows must share to live in one batch."""
    # bits per element in uint32 words: the packed width gives back head_dim.
    k_dim, v_dim = (x[0].shape[3] * 32 // bits for x in (keys, values))
    return keys[0].shape[1], k_dim, v_dim, keys[1].dtype


def _describe(layout):
    heads, k_dim, v_dim, dtype = layout
    dims = f"head_dim {k_dim}" if k_dim == v_dim else f"head_dim {k_dim} (keys) {v_dim} (values)"
    return f"{heads} kv heads, {dims}, {dtype}"


class BatchQuantizedKVCache(_BaseCache):
    step = 256

    def __init__(self, left_padding: List[int], group_size: int = 64, bits: int = 8):
        check_quantization(bits, group_size)
        self.keys = None
        self.values = None
        self.group_size = group_size
        self.bits = bits
        self.left_padding = mx.array(left_padding, dtype=mx.int32)
        self.offset = -self.left_padding
        self._idx = 0
        self._right_padding = None

    # -- shape -------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self.left_padding.shape[0]

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    def _capacity(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    def _row_lengths(self) -> List[int]:
        return self.offset.tolist()

    # -- growth ------------------------------------------------------------

    def update_and_fetch(self, keys, values):
        B, _, num_steps, k_head_dim = keys.shape
        if B != self.batch_size:
            raise ValueError(
                f"update_and_fetch got {B} rows but the batch holds {self.batch_size}"
            )
        check_quantization(self.bits, self.group_size, k_head_dim)
        check_quantization(self.bits, self.group_size, values.shape[-1])

        keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        prev = self._idx
        if prev + num_steps > self._capacity():
            self._grow(keys, values, num_steps)

        self._idx += num_steps
        self.offset = self.offset + num_steps
        for stored, new in zip(self.keys + self.values, keys + values):
            stored[..., prev : self._idx, :] = new
        return self._fetch()

    def _grow(self, keys, values, num_steps):
        # Same amortised growth as mlx-lm's caches: whole multiples of `step`.
        new_steps = (self.step + num_steps - 1) // self.step * self.step
        if self.keys is None:
            self.keys = _empty_triple(keys, self.batch_size, new_steps)
            self.values = _empty_triple(values, self.batch_size, new_steps)
            return
        if self._idx % self.step != 0:
            self.keys = _tokens(self.keys, 0, self._idx)
            self.values = _tokens(self.values, 0, self._idx)
        self.keys = _pad_tokens(self.keys, 0, new_steps)
        self.values = _pad_tokens(self.values, 0, new_steps)

    def _fetch(self):
        return _tokens(self.keys, 0, self._idx), _tokens(self.values, 0, self._idx)

    # -- batched prefill -----------------------------------------------------

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty batch")
            left_padding = mx.array(left_padding, dtype=mx.int32)
            self.left_padding = self.left_padding + left_padding
            self.offset = self.offset - left_padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = list(right_padding)

    def finalize(self):
        if self._right_padding is not None:
            padding, self._right_padding = self._right_padding, None
            self.offset = self.offset - mx.array(padding, dtype=mx.int32)
            self._shift_rows_right(padding)

    # -- masks ---------------------------------------------------------------

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        return create_causal_mask(
            N, offset=self._idx, window_size=window_size, left_padding=self.left_padding
        )

    # -- shrinking -----------------------------------------------------------

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens of every row."""
        shortest = min(self._row_lengths(), default=0)
        if not 0 <= n <= shortest:
            raise ValueError(
                f"cannot trim {n} tokens: the shortest row holds {shortest}"
            )
        self._idx -= n
        self.offset = self.offset - n
        return n

    def rollback(self, amounts: Sequence[int]):
        """Drop the last ``amounts[i]`` tokens of row ``i``, then re-align.

        Rows that dropped more than the least are shifted right so that every
        row again ends at ``size()``; the columns they vacate become padding.
        """
        amounts = [int(a) for a in amounts]
        lengths = self._row_lengths()
        if len(amounts) != len(lengths):
            raise ValueError(
                f"rollback got {len(amounts)} amounts for {len(lengths)} rows"
            )
        for row, (amount, length) in enumerate(zip(amounts, lengths)):
            if not 0 <= amount <= length:
                raise ValueError(
                    f"cannot roll back {amount} tokens of row {row}: it holds {length}"
                )
        common = min(amounts, default=0)
        self._idx -= common
        self.offset = self.offset - mx.array(amounts, dtype=mx.int32)
        self._shift_rows_right([a - common for a in amounts])

    def _shift_rows_right(self, shifts: List[int]):
        """Move row ``i`` right by ``shifts[i]`` columns within ``[0, size())``.

        The columns a row vacates on its left become padding and are zeroed,
        then the padding every row shares is dropped.
        """
        if max(shifts, default=0) == 0:
            return
        self.left_padding = self.left_padding + mx.array(shifts, dtype=mx.int32)
        if self.keys is not None:
            width = self._idx
            columns = mx.arange(width)
            source = (columns[None] - mx.array(shifts)[:, None]) % width
            source = source[:, None, :, None]
            keep = (columns[None] >= self.left_padding[:, None])[:, None, :, None]

            def shift(x):
                moved = mx.take_along_axis(x[..., :width, :], source, axis=2)
                return mx.where(keep, moved, mx.zeros((), dtype=x.dtype))

            self.keys = tuple(shift(x) for x in self.keys)
            self.values = tuple(shift(x) for x in self.values)
        self._drop_shared_padding()

    def _drop_shared_padding(self):
        shared = min(self.left_padding.tolist(), default=0)
        if shared > 0:
            if self.keys is not None:
                self.keys = _tokens(self.keys, shared, None)
                self.values = _tokens(self.values, shared, None)
            self._idx -= shared
            self.left_padding = self.left_padding - shared

    def filter(self, batch_indices):
        """Keep the given rows, in the given order, then drop shared padding."""
        indices = [int(i) for i in batch_indices]
        B = self.batch_size
        if any(not 0 <= i < B for i in indices):
            raise ValueError(f"filter indices {indices} out of range for {B} rows")
        if len(set(indices)) != len(indices):
            raise ValueError(f"filter indices {indices} repeat a row")
        if not indices:
            # As in mlx-lm, a batch with no rows is dropped, not kept empty.
            raise ValueError("filter must keep at least one row")
        rows = mx.array(indices)
        if self.keys is not None:
            self.keys = tuple(x[rows] for x in self.keys)
            self.values = tuple(x[rows] for x in self.values)
        self.offset = self.offset[rows]
        self.left_padding = self.left_padding[rows]
        self._drop_shared_padding()

    # -- growing by rows ------------------------------------------------------

    def extend(self, other: "BatchQuantizedKVCache"):
        """Append the rows of ``other``; existing padding only grows."""
        if (other.bits, other.group_size) != (self.bits, self.group_size):
            raise ValueError(
                f"cannot extend a {self.bits}-bit group-{self.group_size} batch "
                f"with a {other.bits}-bit group-{other.group_size} batch"
            )
        if self.keys is not None and other.keys is not None:
            mine = _layout(self.keys, self.values, self.bits)
            theirs = _layout(other.keys, other.values, other.bits)
            if mine != theirs:
                raise ValueError(
                    f"cannot extend a batch of {_describe(mine)} "
                    f"with one of {_describe(theirs)}"
                )
        width = max(self._idx, other._idx)
        capacity = max(self._capacity(), other._capacity(), width)
        like_keys = self.keys if self.keys is not None else other.keys
        like_values = self.values if self.values is not None else other.values

        def aligned(cache):
            left = width - cache._idx
            keys, values = cache.keys, cache.values
            if keys is None:
                keys = _empty_triple(like_keys, cache.batch_size)
                values = _empty_triple(like_values, cache.batch_size)
            else:
                keys = _tokens(keys, 0, capacity - left)
                values = _tokens(values, 0, capacity - left)
            right = capacity - left - keys[0].shape[2]
            return (
                _pad_tokens(keys, left, right),
                _pad_tokens(values, left, right),
                cache.left_padding + left,
            )

        if like_keys is not None:
            mine, theirs = aligned(self), aligned(other)
            self.keys = tuple(mx.concatenate(p) for p in zip(mine[0], theirs[0]))
            self.values = tuple(mx.concatenate(p) for p in zip(mine[1], theirs[1]))
            left_padding = (mine[2], theirs[2])
        else:
            left_padding = (self.left_padding, other.left_padding)
        self.left_padding = mx.concatenate(left_padding)
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = width

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row ``idx`` as a solo cache that owns copies of its bytes."""
        if not 0 <= idx < self.batch_size:
            raise ValueError(f"extract({idx}) out of range for {self.batch_size} rows")
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        start = self.left_padding.tolist()[idx]  # one host read; no graph node
        cache.offset = self._idx - start
        if self.keys is not None:
            # mx.array copies: the solo cache must not keep the batch alive.
            cache.keys = tuple(
                mx.array(x[idx : idx + 1, :, start : self._idx]) for x in self.keys
            )
            cache.values = tuple(
                mx.array(x[idx : idx + 1, :, start : self._idx]) for x in self.values
            )
        return cache

    @classmethod
    def merge(cls, caches: List[QuantizedKVCache]) -> "BatchQuantizedKVCache":
        """Left-pad solo quantized rows into one batch; the rows are untouched."""
        if not caches:
            raise ValueError("merge needs at least one row")
        for row, cache in enumerate(caches):
            if not hasattr(cache, "bits"):
                raise NotImplementedError(
                    f"row {row} is an unquantized {type(cache).__name__}: "
                    "per-row delayed conversion is not supported"
                )
        bits, group_size = caches[0].bits, caches[0].group_size
        filled = [c for c in caches if c.keys is not None]
        for row, cache in enumerate(caches):
            if (cache.bits, cache.group_size) != (bits, group_size):
                raise ValueError(
                    f"row {row} is {cache.bits}-bit group-{cache.group_size}, "
                    f"row 0 is {bits}-bit group-{group_size}"
                )
            if cache.keys is None:
                continue
            if cache.keys[0].shape[0] != 1:
                raise ValueError(f"row {row} holds {cache.keys[0].shape[0]} rows, not 1")
            layout = _layout(cache.keys, cache.values, bits)
            first = _layout(filled[0].keys, filled[0].values, bits)
            if layout != first:
                raise ValueError(
                    f"row {row} has {_describe(layout)}; "
                    f"the first filled row has {_describe(first)}"
                )
        lengths = [c.offset for c in caches]
        width = max(lengths)
        padding = [width - n for n in lengths]
        batch = cls(padding, group_size=group_size, bits=bits)
        if width == 0:
            return batch

        def stack(triples):
            # One unpadded row would come back as the source's own buffer.
            if len(triples) == 1 and padding == [0]:
                return tuple(mx.array(x) for x in triples[0])
            return tuple(mx.concatenate(arrays) for arrays in zip(*triples))

        keys, values = [], []
        for cache, n, left in zip(caches, lengths, padding):
            if cache.keys is None:
                keys.append(_empty_triple(filled[0].keys, 1, width))
                values.append(_empty_triple(filled[0].values, 1, width))
            else:
                keys.append(_pad_tokens(_tokens(cache.keys, 0, n), left, 0))
                values.append(_pad_tokens(_tokens(cache.values, 0, n), left, 0))
        batch.keys, batch.values = stack(keys), stack(values)
        batch.offset = batch.offset + width
        batch._idx = width
        return batch

    # -- serialisation ----------------------------------------------------------

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.left_padding = v

    @property
    def meta_state(self):
        return tuple(map(str, (self._idx, self.group_size, self.bits)))

    @meta_state.setter
    def meta_state(self, v):
        self._idx, self.group_size, self.bits = map(int, v)
        self._right_padding = None

    @classmethod
    def from_state(cls, state, meta_state):
        cache = cls.__new__(cls)
        cache.state = state
        cache.meta_state = meta_state
        return cache

    @property
    def nbytes(self) -> int:
        arrays = (self.keys or ()) + (self.values or ())
        return sum(x.nbytes for x in arrays)

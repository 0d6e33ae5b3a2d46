"""A second batched quantized KV cache, written the way mlx-lm writes its own.

This is mlx-lm's ``BatchKVCache`` carried over to quantized triples
``(packed uint32, scales, biases)`` as ``mx.quantize`` returns them, storing
and growing them as mlx-lm's ``QuantizedKVCache`` does. It follows mlx-lm's
idiom on purpose: ``merge`` slice-assigns rows into zeros, ``extend`` pads and
concatenates, ``filter`` slices the shared padding off, ``extract`` returns
``mx.contiguous`` slices (which may be views of the batch), ``finalize`` rolls
rows with ``dynamic_roll`` (leaving whatever the roll brings into the left
padding), and ``trim`` is uniform. It has no per-row rollback.

Why it exists: it is the false-alarm control. It shares no code with the
reference implementation or the harness, and it is parity-correct, so the
default gate must pass it; a parity check that fails it is a false alarm.
"""

from typing import List, Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache, dynamic_roll


def _slice_tokens(triple, start: Optional[int], stop: Optional[int]):
    return tuple(x[..., start:stop, :] for x in triple)


class MlxStyleBatchQuantizedKVCache(_BaseCache):
    step = 256

    def __init__(self, left_padding: List[int], group_size: int = 64, bits: int = 8):
        self.keys = None  # (packed, scales, biases), each [B, heads, capacity, *]
        self.values = None
        self.group_size = group_size
        self.bits = bits
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding = None

    def update_and_fetch(self, keys, values):
        num_steps = keys.shape[2]
        keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        prev = self._idx
        if self.keys is None or prev + num_steps > self.keys[0].shape[2]:
            # Grow in whole steps; shapes come from what mx.quantize returned,
            # so the packed width is right for every bits value.
            new_steps = (self.step + num_steps - 1) // self.step * self.step

            def zeros_like_tokens(x):
                return mx.zeros((*x.shape[:2], new_steps, x.shape[3]), dtype=x.dtype)

            if self.keys is None:
                self.keys = tuple(map(zeros_like_tokens, keys))
                self.values = tuple(map(zeros_like_tokens, values))
            else:
                if prev % self.step != 0:
                    self.keys = _slice_tokens(self.keys, None, prev)
                    self.values = _slice_tokens(self.values, None, prev)
                self.keys = tuple(
                    mx.concatenate([old, zeros_like_tokens(new)], axis=2)
                    for old, new in zip(self.keys, keys)
                )
                self.values = tuple(
                    mx.concatenate([old, zeros_like_tokens(new)], axis=2)
                    for old, new in zip(self.values, values)
                )

        self.offset = self.offset + num_steps
        self._idx += num_steps
        for stored, new in zip(self.keys + self.values, keys + values):
            stored[..., prev : self._idx, :] = new
        return self.keys_and_values()

    def keys_and_values(self):
        return (
            _slice_tokens(self.keys, None, self._idx),
            _slice_tokens(self.values, None, self._idx),
        )

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty cache")
            left_padding = mx.array(left_padding)
            self.left_padding += left_padding
            self.offset = self.offset - left_padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self):
        if self._right_padding is not None:
            shifts = self._right_padding[:, None]
            self.keys = tuple(dynamic_roll(x, shifts, axis=2) for x in self.keys)
            self.values = tuple(dynamic_roll(x, shifts, axis=2) for x in self.values)
            self.offset = self.offset - self._right_padding
            self.left_padding += self._right_padding
            self._right_padding = None

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

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(
            N, offset=self._idx, left_padding=self.left_padding, **kwargs
        )

    def filter(self, batch_indices):
        """Keep the given rows in place, then drop the padding they all share."""
        rows = mx.array(batch_indices)
        if self.keys is not None:
            self.keys = tuple(x[rows] for x in self.keys)
            self.values = tuple(x[rows] for x in self.values)
        self.offset = self.offset[rows]
        self.left_padding = self.left_padding[rows]

        shared = min(self.left_padding.tolist())
        if shared > 0:
            if self.keys is not None:
                self.keys = _slice_tokens(self.keys, shared, None)
                self.values = _slice_tokens(self.values, shared, None)
            self._idx -= shared
            self.left_padding -= shared

    def extend(self, other):
        """Append the rows of ``other`` in place, right-aligned at one width."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return

        max_idx = max(self._idx, other._idx)
        capacity = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like_keys = self.keys if self.keys is not None else other.keys
        like_values = self.values if self.values is not None else other.values

        def aligned(c):
            keys, values = c.keys, c.values
            if keys is None:
                rows = c.offset.shape[0]

                def empty(like):
                    return tuple(
                        mx.zeros((rows, x.shape[1], 0, x.shape[3]), dtype=x.dtype)
                        for x in like
                    )

                keys, values = empty(like_keys), empty(like_values)
            left = max_idx - c._idx
            right = capacity - keys[0].shape[2] - left
            if right < 0:
                keys = _slice_tokens(keys, None, right)
                values = _slice_tokens(values, None, right)
                right = 0
            if left != 0 or right != 0:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                keys = tuple(mx.pad(x, widths) for x in keys)
                values = tuple(mx.pad(x, widths) for x in values)
            return keys, values, c.offset, c.left_padding + left

        mine, theirs = aligned(self), aligned(other)
        self.keys = tuple(mx.concatenate(p) for p in zip(mine[0], theirs[0]))
        self.values = tuple(mx.concatenate(p) for p in zip(mine[1], theirs[1]))
        self.offset = mx.concatenate([mine[2], theirs[2]])
        self.left_padding = mx.concatenate([mine[3], theirs[3]])
        self._idx = max_idx

    def extract(self, idx):
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        padding = self.left_padding.tolist()[idx]
        if self.keys is not None:
            cache.keys = tuple(
                mx.contiguous(x[idx : idx + 1, :, padding : self._idx]) for x in self.keys
            )
            cache.values = tuple(
                mx.contiguous(x[idx : idx + 1, :, padding : self._idx]) for x in self.values
            )
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches):
        """Left-pad solo ``QuantizedKVCache`` rows into one new batch."""
        if not caches:
            raise ValueError("merge needs at least one row")
        settings = {(c.group_size, c.bits) for c in caches}
        if len(settings) != 1:
            raise ValueError(f"rows differ in (group_size, bits): {sorted(settings)}")
        (group_size, bits), = settings
        # mlx-lm's QuantizedKVCache.size() is 0; its offset is its length.
        lengths = [c.offset for c in caches]
        max_length = max(lengths)
        padding = [max_length - n for n in lengths]
        cache = cls(padding, group_size=group_size, bits=bits)
        if max_length == 0:
            return cache

        filled = next(c for c in caches if c.keys is not None)

        def zeros_batch(like):
            return tuple(
                mx.zeros((len(caches), x.shape[1], max_length, x.shape[3]), dtype=x.dtype)
                for x in like
            )

        keys, values = zeros_batch(filled.keys), zeros_batch(filled.values)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            for batch_part, row_part in zip(keys + values, c.keys + c.values):
                batch_part[i : i + 1, :, p : p + c.offset] = row_part[..., : c.offset, :]

        cache.keys, cache.values = keys, values
        cache.offset += max_length
        cache._idx = max_length
        return cache

    def size(self):
        return self._idx

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in self.keys + self.values)

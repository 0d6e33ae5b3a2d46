"""The smallest batched quantized KV cache that passes the gate: the example
docs/protocol.md gives cache authors. Rows are right-aligned; the triples hold exactly
``size()`` columns and grow by concatenation (simple, not fast)."""

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache, dynamic_roll


def _columns(triple, start, stop):
    return tuple(x[..., start:stop, :] for x in triple)


def _empty(like, rows):
    return tuple(mx.zeros((rows, x.shape[1], 0, x.shape[3]), x.dtype) for x in like)


def _pad_left(triple, n):
    return tuple(mx.pad(x, [(0, 0), (0, 0), (n, 0), (0, 0)]) for x in triple)


class MinimalBatchQuantizedKVCache(_BaseCache):
    def __init__(self, left_padding, group_size, bits):
        self.keys = self.values = None  # (packed, scales, biases), each [B, heads, size(), *]
        self.left_padding = mx.array(left_padding)
        self.offset = -self.left_padding  # per-row RoPE position
        self.group_size, self.bits = group_size, bits
        self._size, self._right_padding = 0, None

    @classmethod
    def merge(cls, caches):
        # mlx-lm's QuantizedKVCache.size() is 0: a row's length is its offset.
        width = max(c.offset for c in caches)
        batch = cls([width - c.offset for c in caches], caches[0].group_size, caches[0].bits)
        like = next((c for c in caches if c.keys is not None and c.offset), None)
        if like is not None:
            batch.keys, batch.values = (tuple(map(mx.concatenate, zip(*(
                _pad_left(_columns(getattr(c, name), 0, c.offset) if c.offset else _empty(getattr(like, name), 1),
                          width - c.offset) for c in caches)))) for name in ("keys", "values"))
            batch.offset, batch._size = batch.offset + width, width
        return batch

    def update_and_fetch(self, keys, values):
        new = [mx.quantize(x, group_size=self.group_size, bits=self.bits) for x in (keys, values)]
        old = [self.keys, self.values]
        self.keys, self.values = (tuple(n) if o is None else tuple(
            mx.concatenate([a, b], axis=2) for a, b in zip(_columns(o, 0, self._size), n)) for o, n in zip(old, new))
        self._size += keys.shape[2]
        self.offset = self.offset + keys.shape[2]
        return self.keys, self.values

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self):  # a right-padded prefill: move each row's tokens to the right edge
        if self._right_padding is not None:
            shift = self._right_padding[:, None]
            self.keys, self.values = (tuple(dynamic_roll(x, shift, axis=2) for x in t) for t in (self.keys, self.values))
            self.offset, self.left_padding = self.offset - self._right_padding, self.left_padding + self._right_padding
            self._right_padding = None

    def filter(self, batch_indices):
        rows = mx.array(batch_indices)
        self.offset, self.left_padding = self.offset[rows], self.left_padding[rows]
        shared = min(self.left_padding.tolist())  # columns every survivor pads
        if self.keys is not None:
            self.keys, self.values = (_columns(tuple(x[rows] for x in t), shared, self._size)
                                      for t in (self.keys, self.values))
        self._size, self.left_padding = self._size - shared, self.left_padding - shared

    def extend(self, other):
        width = max(self._size, other._size)
        like = self if self.keys is not None else other
        if like.keys is not None:
            def aligned(c, name):  # an empty batch's rows are all padding
                triple = getattr(c, name) or _empty(getattr(like, name), c.offset.shape[0])
                return _pad_left(_columns(triple, 0, c._size), width - c._size)
            self.keys, self.values = (tuple(map(mx.concatenate, zip(aligned(self, name), aligned(other, name))))
                                      for name in ("keys", "values"))
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([self.left_padding + width - self._size,
                                            other.left_padding + width - other._size])
        self._size = width

    def extract(self, idx):
        cache, start = QuantizedKVCache(group_size=self.group_size, bits=self.bits), self.left_padding.tolist()[idx]
        cache.keys, cache.values = (tuple(mx.contiguous(x[idx : idx + 1, :, start : self._size]) for x in t)
                                    for t in (self.keys, self.values))
        cache.offset = self._size - start
        return cache

    def trim(self, n):
        n = min(self._size, n)
        self._size, self.offset = self._size - n, self.offset - n
        return n

    def make_mask(self, N, return_array=False, **kwargs):
        return create_causal_mask(N, offset=self._size, left_padding=self.left_padding, **kwargs)

    def size(self):
        return self._size

    def empty(self):
        return self.keys is None

    def is_trimmable(self):
        return True

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding

    @property
    def nbytes(self):
        return 0 if self.keys is None else sum(x.nbytes for x in self.keys + self.values)

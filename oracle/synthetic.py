"""Deterministic synthetic keys and values for cache-level (L1) runs.

Each request has its own stream: the t-th token it ever writes (rolled-back
tokens included, so a rewritten position gets new bytes) is row t of the
stream. Streams are built in blocks from (seed, request id, block) so any
slice is cheap and identical for the engine and the oracle.

A token has keys and values in every layer, each layer with its own kv
heads, key dim and value dim (``LayerShape``); layers after the first draw
from seeds of their own, so no two layers hold the same bytes.
"""

import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Sequence, Tuple

import mlx.core as mx
import numpy as np

BLOCK = 256
_UINT = {2: np.uint16, 4: np.uint32}


@dataclass(frozen=True)
class LayerShape:
    """One layer's keys and values: [1, kv_heads, tokens, key_dim] and
    [1, kv_heads, tokens, value_dim]."""

    kv_heads: int
    key_dim: int
    value_dim: int

    def words(self) -> str:
        dims = (f"head_dim {self.key_dim}" if self.key_dim == self.value_dim
                else f"keys {self.key_dim}, values {self.value_dim}")
        return f"{self.kv_heads} kv heads, {dims}"


# A thousand generated L1 schedules draw about 530 distinct blocks (about 200 KiB
# each on average): at 512 a repeated run of them missed every block once.
@lru_cache(maxsize=1024)
def _block_bits(seeds: tuple, shape: LayerShape, dtype: str) -> Tuple[np.ndarray, np.ndarray]:
    """One block of a stream, keys [H, BLOCK, key_dim] and values
    [H, BLOCK, value_dim], converted to ``dtype`` by MLX and kept as their
    raw bits. Blocks depend only on their seeds, so every run (and every
    generated schedule) shares them."""
    rng = np.random.default_rng(list(seeds))
    # Keys, then values, from one generator: at key_dim == value_dim the
    # bytes of one [2, H, BLOCK, D] draw.
    keys = rng.standard_normal((shape.kv_heads, BLOCK, shape.key_dim), dtype=np.float32)
    values = rng.standard_normal((shape.kv_heads, BLOCK, shape.value_dim), dtype=np.float32)
    # A few loud channels, as real keys have, so groups differ in range.
    keys[:, :, :: max(shape.key_dim // 8, 1)] *= 6.0
    return tuple(_raw(x, dtype) for x in (keys, values))


def _raw(x: np.ndarray, dtype: str) -> np.ndarray:
    converted = mx.array(x).astype(getattr(mx, dtype))
    bits = converted.view(getattr(mx, f"uint{converted.dtype.size * 8}"))
    bits = np.array(bits)  # a copy: the cache must not keep MLX memory alive
    bits.flags.writeable = False
    return bits


class SyntheticKV:
    """Keys and values of every layer: ``shapes``, one ``LayerShape`` per
    layer. Every draw gives a list of (keys, values), one per layer."""

    def __init__(self, shapes: Sequence[LayerShape], dtype: str, seed: int = 0):
        self.shapes = tuple(shapes)
        self.dtype = getattr(mx, dtype)
        self.dtype_name = dtype
        self.seed = seed
        self.identity = (seed, self.shapes, dtype)  # streams are equal when these are

    def _block(self, layer: int, stream: str, seed: int, b: int):
        # Layer 0 keeps the seeds of one-layer streams: its bytes never changed.
        seeds = (self.seed, seed, zlib.crc32(stream.encode()), b) + ((layer,) if layer else ())
        return _block_bits(seeds, self.shapes[layer], self.dtype_name)

    def tokens(self, stream: str, start: int, n: int, seed: int = 0) -> List[tuple]:
        """Keys and values for tokens [start, start + n) of a stream, per
        layer: [(keys [1, H, n, key_dim], values [1, H, n, value_dim]), ...]."""
        return [self._layer_tokens(layer, stream, start, n, seed) for layer in range(len(self.shapes))]

    def _layer_tokens(self, layer: int, stream: str, start: int, n: int, seed: int):
        parts = []
        t = start
        while t < start + n:
            b, i = divmod(t, BLOCK)
            take = min(BLOCK - i, start + n - t)
            parts.append(tuple(x[:, i : i + take] for x in self._block(layer, stream, seed, b)))
            t += take
        if not parts:
            shape, uint = self.shapes[layer], _UINT[self.dtype.size]
            parts.append(tuple(np.zeros((shape.kv_heads, 0, dim), dtype=uint)
                               for dim in (shape.key_dim, shape.value_dim)))
        keys, values = (np.concatenate(xs, axis=1)[None] for xs in zip(*parts))
        if self.dtype != mx.bfloat16:  # numpy has the type: no view in MLX
            float_type = np.float16 if self.dtype == mx.float16 else np.float32
            return mx.array(keys.view(float_type)), mx.array(values.view(float_type))
        # Fresh MLX memory per draw (mx.array copies), as converting each draw did.
        return mx.array(keys).view(self.dtype), mx.array(values).view(self.dtype)

    def named(self, tokens, seeds: dict):
        """Keys and values of tokens named (stream, index), per layer as
        ``tokens``: a chat turn's prompt holds tokens of the streams before
        it. ``seeds``: each stream's seed."""
        runs = []  # [stream, start, n]: consecutive tokens of one stream, drawn together
        for stream, index in tokens:
            if runs and runs[-1][0] == stream and runs[-1][1] + runs[-1][2] == index:
                runs[-1][2] += 1
            else:
                runs.append([stream, index, 1])
        parts = [self.tokens(stream, start, n, seed=seeds[stream]) for stream, start, n in runs]
        if len(parts) == 1:
            return parts[0]
        return [tuple(mx.concatenate(list(xs), axis=2) for xs in zip(*layer)) for layer in zip(*parts)]

    def draw(self, written: dict, request, n: int):
        """The next n tokens of a request's stream; ``written`` counts what each
        reader (the engine, the oracle) has drawn so far, per request."""
        return self.tokens(request.id, self.advance(written, request, n), n, seed=request.seed)

    @staticmethod
    def advance(written: dict, request, n: int) -> int:
        """Where the request's next n tokens start in its stream; counts them
        in ``written`` as drawn (by a reader that may not need their bytes)."""
        start = written.get(request.id, 0)
        written[request.id] = start + n
        return start

    def padding(self, n: int):
        """Bytes for pad positions of a padded prefill: junk, never zeros."""
        return self.tokens("<pad>", 0, n)

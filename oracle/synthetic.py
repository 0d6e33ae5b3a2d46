"""Deterministic synthetic keys and values for cache-level (L1) runs.

Each request has its own stream: the t-th token it ever writes (rolled-back
tokens included, so a rewritten position gets new bytes) is row t of the
stream. Streams are built in blocks from (seed, request id, block) so any
slice is cheap and identical for the engine and the oracle.
"""

import zlib

import mlx.core as mx
import numpy as np

BLOCK = 256


class SyntheticKV:
    def __init__(self, kv_heads: int, head_dim: int, dtype: str, seed: int = 0):
        self.shape = (kv_heads, head_dim)
        self.dtype = getattr(mx, dtype)
        self.seed = seed
        self._blocks = {}

    def _block(self, stream: str, seed: int, b: int) -> np.ndarray:
        key = (stream, seed, b)
        if key not in self._blocks:
            rng = np.random.default_rng([self.seed, seed, zlib.crc32(stream.encode()), b])
            heads, dim = self.shape
            x = rng.standard_normal((2, heads, BLOCK, dim), dtype=np.float32)
            # A few loud channels, as real keys have, so groups differ in range.
            x[0, :, :, :: max(dim // 8, 1)] *= 6.0
            self._blocks[key] = x
        return self._blocks[key]

    def tokens(self, stream: str, start: int, n: int, seed: int = 0):
        """Keys and values for tokens [start, start + n) of a stream: [1, H, n, D]."""
        heads, dim = self.shape
        parts = [np.zeros((2, heads, 0, dim), dtype=np.float32)]
        t = start
        while t < start + n:
            b, i = divmod(t, BLOCK)
            take = min(BLOCK - i, start + n - t)
            parts.append(self._block(stream, seed, b)[:, :, i : i + take])
            t += take
        x = np.concatenate(parts, axis=2)[:, None]
        keys = mx.array(x[0]).astype(self.dtype)
        values = mx.array(x[1]).astype(self.dtype)
        return keys, values

    def draw(self, written: dict, request, n: int):
        """The next n tokens of a request's stream; ``written`` counts what each
        reader (the engine, the oracle) has drawn so far, per request."""
        start = written.get(request.id, 0)
        written[request.id] = start + n
        return self.tokens(request.id, start, n, seed=request.seed)

    def padding(self, n: int):
        """Bytes for pad positions of a padded prefill: junk, never zeros."""
        return self.tokens("<pad>", 0, n)

"""Deterministic synthetic keys and values for cache-level (L1) runs.

Each request has its own stream: the t-th token it ever writes (rolled-back
tokens included, so a rewritten position gets new bytes) is row t of the
stream. Streams are built in blocks from (seed, request id, block) so any
slice is cheap and identical for the engine and the oracle.
"""

import zlib
from functools import lru_cache

import mlx.core as mx
import numpy as np

BLOCK = 256
_UINT = {2: np.uint16, 4: np.uint32}


# A thousand generated L1 schedules draw about 530 distinct blocks (about 200 KiB
# each on average): at 512 a repeated run of them missed every block once.
@lru_cache(maxsize=1024)
def _block_bits(seeds: tuple, shape: tuple, dtype: str) -> np.ndarray:
    """One block of a stream, [2 (keys, values), H, BLOCK, D], converted to
    ``dtype`` by MLX and kept as its raw bits. Blocks depend only on their
    seeds, so every run (and every generated schedule) shares them."""
    heads, dim = shape
    x = np.random.default_rng(list(seeds)).standard_normal((2, heads, BLOCK, dim), dtype=np.float32)
    # A few loud channels, as real keys have, so groups differ in range.
    x[0, :, :, :: max(dim // 8, 1)] *= 6.0
    converted = mx.array(x).astype(getattr(mx, dtype))
    bits = converted.view(getattr(mx, f"uint{converted.dtype.size * 8}"))
    bits = np.array(bits)  # a copy: the cache must not keep MLX memory alive
    bits.flags.writeable = False
    return bits


class SyntheticKV:
    def __init__(self, kv_heads: int, head_dim: int, dtype: str, seed: int = 0):
        self.shape = (kv_heads, head_dim)
        self.dtype = getattr(mx, dtype)
        self.dtype_name = dtype
        self.seed = seed
        self.identity = (seed, self.shape, dtype)  # streams are equal when these are

    def _block(self, stream: str, seed: int, b: int) -> np.ndarray:
        return _block_bits((self.seed, seed, zlib.crc32(stream.encode()), b), self.shape, self.dtype_name)

    def tokens(self, stream: str, start: int, n: int, seed: int = 0):
        """Keys and values for tokens [start, start + n) of a stream: [1, H, n, D]."""
        parts = []
        t = start
        while t < start + n:
            b, i = divmod(t, BLOCK)
            take = min(BLOCK - i, start + n - t)
            parts.append(self._block(stream, seed, b)[:, :, i : i + take])
            t += take
        if not parts:
            heads, dim = self.shape
            parts.append(np.zeros((2, heads, 0, dim), dtype=_UINT[self.dtype.size]))
        x = np.concatenate(parts, axis=2)[:, None]
        if self.dtype != mx.bfloat16:  # numpy has the type: no view in MLX
            x = x.view(np.float16 if self.dtype == mx.float16 else np.float32)
            return mx.array(x[0]), mx.array(x[1])
        # Fresh MLX memory per draw (mx.array copies), as converting each draw did.
        return mx.array(x[0]).view(self.dtype), mx.array(x[1]).view(self.dtype)

    def named(self, tokens, seeds: dict):
        """Keys and values of tokens named (stream, index), [1, H, n, D]: a
        chat turn's prompt holds tokens of the streams before it. ``seeds``:
        each stream's seed."""
        runs = []  # [stream, start, n]: consecutive tokens of one stream, drawn together
        for stream, index in tokens:
            if runs and runs[-1][0] == stream and runs[-1][1] + runs[-1][2] == index:
                runs[-1][2] += 1
            else:
                runs.append([stream, index, 1])
        parts = [self.tokens(stream, start, n, seed=seeds[stream]) for stream, start, n in runs]
        if len(parts) == 1:
            return parts[0]
        return tuple(mx.concatenate(list(xs), axis=2) for xs in zip(*parts))

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

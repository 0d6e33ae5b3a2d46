"""The cache-level (L1) oracle: one request alone, through mlx-lm's caches.

The request starts in mlx-lm's ``KVCache`` (one per layer) and is converted
by mlx-lm's own ``maybe_quantize_kv_cache`` after every call, exactly when
``generate_step`` would convert it (offset >= quantized_kv_start); from then
on mlx-lm's ``QuantizedKVCache`` stores it. Converting an unquantized cache
quantizes the keys and values it holds, so the packed arrays have the widths
``mx.quantize`` gives at every dim (``QuantizedKVCache``'s own first
buffers, ``dim // (32 // bits)`` words, are never made here).
"""

import copy

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache

from kvparity.oracle.arrays import handles


class SoloCache:
    def __init__(self, bits: int, group_size: int, quantized_kv_start: int, caches=None, layers: int = 1):
        """``caches``: the layers to start from (a stored prefix, an
        extracted row), else ``layers`` empty ones."""
        self.bits = bits
        self.group_size = group_size
        self.quantized_kv_start = quantized_kv_start
        # A prompt cache: mlx-lm converts layers in place in the list.
        self.layers = list(caches) if caches is not None else [KVCache() for _ in range(layers)]

    @classmethod
    def prefilled(cls, request, bits: int, group_size: int, draw, prompt_len=None, layers: int = 1):
        """The request's prompt appended in generate_step's chunks;
        ``draw(n)`` gives the next n tokens' keys and values, per layer."""
        solo = cls(bits, group_size, request.quantized_kv_start, layers=layers)
        for n in request.prefill_chunks(prompt_len):
            solo.append(draw(n))
        return solo

    def fork(self) -> "SoloCache":
        """The same request holding the same bytes through handles of its own
        (no copy): mlx-lm writes a cache's arrays in place, so appending to
        one of the two leaves the other as it was."""
        return SoloCache(self.bits, self.group_size, self.quantized_kv_start, [_forked(c) for c in self.layers])

    @property
    def cache(self):
        """The first layer: offsets and conversion are every layer's."""
        return self.layers[0]

    @property
    def quantized(self) -> bool:
        return hasattr(self.cache, "bits")

    def append(self, per_layer):
        """``per_layer``: one (keys, values) per layer."""
        for cache, (keys, values) in zip(self.layers, per_layer, strict=True):
            cache.update_and_fetch(keys, values)
        self.convert()

    def convert(self):
        """mlx-lm's conversion, where generate_step makes it: once the row
        holds quantized_kv_start tokens."""
        maybe_quantize_kv_cache(
            self.layers, self.quantized_kv_start, self.group_size, self.bits
        )

    def trim(self, n: int):
        for cache in self.layers:
            cache.trim(n)


def _forked(cache):
    cache = copy.copy(cache)
    for name, value in vars(cache).items():
        setattr(cache, name, tree_map(lambda x: handles([x])[0] if isinstance(x, mx.array) else x, value))
    return cache

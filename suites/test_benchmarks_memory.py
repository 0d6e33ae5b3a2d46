"""The benchmark suite's memory figures (``test_benchmarks.py`` says how the
suite measures and records): bytes per token of the cache under test against
bf16, the peak memory of decoding at long context against mlx-lm's
BatchKVCache and the cache's own bytes, and what mlx-lm's quantized attention
allocates for grouped-query heads, per architecture of the zoo."""

import mlx.core as mx
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from kvparity.oracle.models import random_model_for
from kvparity.suites.test_benchmarks import (GROUP_SIZE, MARKS, QUICK, Ratio, _eval_cache, _model, _next_tokens,
                                             _pedantic, _record)

pytestmark = MARKS


# -- bytes per token ---------------------------------------------------------------

BYTES_PER_TOKEN = Ratio(
    "memory: quantized / bf16 bytes per token", "quantized", "bf16",
    quantity="bytes_per_token", targets=(("bits=4 head_dim=128", "<=", 0.3),),
)


@pytest.mark.parametrize("variant", ["quantized", "bf16"])
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("bits", (4, 8))
def test_bytes_per_token(benchmark, implementation, variant, bits, head_dim):
    """Append 256 tokens to 4 empty rows; bytes per token read from the arrays."""
    B, T, heads = 4, 256, 8
    k, v = (
        mx.random.normal((B, heads, T, head_dim), key=key).astype(mx.bfloat16)
        for key in mx.random.split(mx.random.key(head_dim + bits))
    )
    mx.eval(k, v)

    def append():
        if variant == "quantized":
            empty = QuantizedKVCache(group_size=GROUP_SIZE, bits=bits)
            cache = implementation.batch_class.merge([empty] * B)
        else:
            cache = BatchKVCache([0] * B)
        mx.eval(cache.update_and_fetch(k, v))
        return cache

    cache = _pedantic(benchmark, append)
    # 256 tokens fill the buffer exactly, so nbytes holds no spare capacity.
    _record(
        benchmark,
        "memory",
        f"bits={bits} head_dim={head_dim}",
        variant,
        [BYTES_PER_TOKEN] if variant == "quantized" else [],
        bits=bits,
        head_dim=head_dim,
        kv_heads=heads,
        bytes_per_token=cache.nbytes / (B * T),
    )


# -- long-context memory ------------------------------------------------------------
# Peak memory of decoding at long context, beyond what was held before the caches
# were built (the weights), for the cache under test and for mlx-lm's BatchKVCache
# in the model's dtype, against the floor: the cache's own bytes. The largest point
# (B=8, 16k tokens, head_dim 128) holds 260 MiB of bf16 keys and values (2 layers
# x K and V x 8 rows x 2 kv heads x 16.6k tokens x 128 x 2 bytes) and peaks under
# 400 MiB while its buffers grow.
LONG_BATCHES = (4,) if QUICK else (4, 8)
LONG_CONTEXTS = (8192,) if QUICK else (4096, 8192, 16384)
LONG_HEAD_DIMS = (64,) if QUICK else (64, 128)
LONG_BITS = (4,) if QUICK else (4, 8)
GROWTH = 256  # decoded tokens: one growth of every buffer (mlx-lm's step)


def _long_case(B, context, head_dim, bits):
    return f"B={B} context={context} head_dim={head_dim} bits={bits}"


LONG_DECODE = Ratio(
    "long context: quantized / dense decode peak", "quantized", "dense", quantity="decode_peak_bytes",
    targets=tuple((_long_case(B, 8192, d, 4), "<=", 0.35) for B in LONG_BATCHES for d in LONG_HEAD_DIMS),
)
LONG_STEP = Ratio("long context: quantized / dense step peak", "quantized", "dense", quantity="step_peak_bytes")
# How far the quantized decode stays above the cache's own bytes, and what the
# decode ratio would be if it used nothing beyond them.
LONG_FLOOR = Ratio(
    "long context: quantized decode peak / its floor", "quantized", "quantized",
    quantity="decode_peak_bytes", denominator_quantity="floor_bytes",
)
LONG_FLOOR_VS_DENSE = Ratio(
    "long context: quantized floor / dense decode peak", "quantized", "dense",
    quantity="floor_bytes", denominator_quantity="decode_peak_bytes",
)


def _long_caches(variant, Batch, loaded, B, context, bits):
    """One batch cache per layer, built one layer at a time: B rows of random
    keys and values, the longest ``context`` tokens, merged into full buffers."""
    caches = []
    for layer in range(loaded.num_layers):
        rows = []
        for row in range(B):
            length = context - (97 * row) % GROWTH  # rows differ: the batch is padded
            k, v = (
                mx.random.normal((1, loaded.n_kv_heads, length, loaded.head_dim), key=key).astype(loaded.dtype)
                for key in mx.random.split(mx.random.key(1000 * layer + row))
            )
            cache = KVCache()
            cache.update_and_fetch(k, v)
            if variant == "quantized":
                cache = cache.to_quantized(group_size=GROUP_SIZE, bits=bits)
            _eval_cache(cache)
            rows.append(cache)
        caches.append((Batch if variant == "quantized" else BatchKVCache).merge(rows))
        _eval_cache(caches[-1])
    return caches


def _peak_of(fn, base):
    """Peak memory while ``fn`` runs and its result is evaluated, beyond ``base``."""
    mx.synchronize()
    mx.reset_peak_memory()
    mx.eval(fn())
    mx.synchronize()
    return mx.get_peak_memory() - base


def _decode_through_growth(loaded, caches, base):
    """Peaks of each of GROWTH decoded tokens, from full buffers to full again.

    The model decodes the token that grows the buffers, the one after and the
    last one (the longest context); the tokens between are appended by the
    caches' own update_and_fetch: a model step at 16k tokens takes seconds on
    a CPU, and between those steps attention differs only by a token of context.
    """
    B = caches[0].offset.shape[0]
    tokens = _next_tokens(B, loaded.vocab_size)
    shape = (B, loaded.n_kv_heads, 1, loaded.head_dim)
    new = mx.random.normal(shape, key=mx.random.key(B)).astype(loaded.dtype)
    mx.eval(new)

    def append():
        return [c.update_and_fetch(new, new) for c in caches]

    peaks = []
    for token in range(GROWTH):
        if token in (0, 1, GROWTH - 1):
            peaks.append(_peak_of(lambda: loaded.model(tokens, cache=caches), base))
        else:
            peaks.append(_peak_of(append, base))
    return peaks


def _attention_peak(loaded, cache, base, n_heads=None):
    """What mlx-lm's attention over one layer's cache allocates beyond what is
    held: the cache's own keys and values, as the model would get them, read
    by ``n_heads`` query heads (the model's)."""
    cache.trim(1)  # the buffer is full: the token appended below must not grow it
    mask = cache.make_mask(1)
    shape = (cache.offset.shape[0], loaded.n_kv_heads, 1, loaded.head_dim)
    keys, values = cache.update_and_fetch(*(mx.zeros(shape, loaded.dtype),) * 2)
    queries = mx.random.normal((shape[0], n_heads or loaded.n_heads, 1, loaded.head_dim), key=mx.random.key(0))
    queries = queries.astype(loaded.dtype)
    mx.eval(mask, keys, values, queries)
    held = mx.get_active_memory() - base
    return _peak_of(
        lambda: scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=loaded.head_dim**-0.5, mask=mask
        ),
        base,
    ) - held


def test_memory_figures_are_bytes():
    """On this backend the memory API reads a known allocation as its size, so
    the long-context figures are bytes: 64 MiB of float32 held, then a copy."""
    size = 64 * 2**20
    mx.synchronize()
    base = mx.get_active_memory()
    held = mx.zeros((size // 4,), dtype=mx.float32)
    assert size <= _peak_of(lambda: held, base) < size + 2**20
    assert mx.get_active_memory() - base == size
    assert 2 * size <= _peak_of(lambda: held + 1, base) < 2 * size + 2**20


# Both variants of one case run back to back; dense does not depend on bits
# and runs again for each (a repeat, in the same conditions as its partner).
@pytest.mark.parametrize("variant", ["quantized", "dense"])
@pytest.mark.parametrize("bits", LONG_BITS)
@pytest.mark.parametrize("head_dim", LONG_HEAD_DIMS)
@pytest.mark.parametrize("context", LONG_CONTEXTS)
@pytest.mark.parametrize("B", LONG_BATCHES)
def test_long_context_memory(benchmark, implementation, variant, B, context, head_dim, bits):
    """Decode GROWTH tokens for B rows after ``context`` tokens of random keys and values."""
    loaded = _model(random_model_for(head_dim, "bfloat16"))
    mx.synchronize()
    base = mx.get_active_memory()  # the weights and whatever earlier benchmarks keep
    peaks = []

    def decode():
        caches = _long_caches(variant, implementation.batch_class, loaded, B, context, bits)
        peaks.extend(_decode_through_growth(loaded, caches, base))
        return caches

    caches = benchmark.pedantic(decode, rounds=1, iterations=1)
    floor = sum(c.nbytes for c in caches)  # full buffers: every column is a token or padding
    attention = _attention_peak(loaded, caches[0], base)
    case = _long_case(B, context, head_dim, bits)
    _record(
        benchmark, "long-context", case, variant,
        [LONG_DECODE, LONG_STEP, LONG_FLOOR, LONG_FLOOR_VS_DENSE] if variant == "quantized" else [],
        model=loaded.name, B=B, context=context, head_dim=head_dim,
        kv_dtype=f"{bits}-bit" if variant == "quantized" else str(loaded.dtype).split(".")[-1],
        floor_bytes=floor,
        step_peak_bytes=peaks[-1],
        decode_peak_bytes=max(peaks),
        attention_bytes=attention,
        layers=loaded.num_layers,
    )


# -- quantized attention for grouped-query heads, per architecture --------------------
# mlx-lm's quantized attention gives grouped-query keys and values a repeats axis
# of 1 and mx.quantized_matmul broadcasts them over the repeats, materialising a
# layer's packed keys and values about repeats times (oracle/mlx_lm_defects/
# gqa_quantized_attention_memory.py): the gap between the long-context decode
# peak and its floor. Per zoo architecture, one layer of the cache under test at
# the architecture's kv heads and head dim, read by mlx-lm's attention with the
# architecture's query heads ("grouped") and, over the same cache, with one query
# head per kv head ("per-kv-head"): what attention allocates beyond the layer,
# over the layer's bytes. An architecture with one query head per kv head is the control.


def _gqa_architectures(quick: bool):
    """The zoo's first architecture of each (query heads per kv head, head_dim)
    among those whose every layer is a KVCache with keys and values of one dim
    (the quick grid: the smallest and largest head_dim of each grouping)."""
    from kvparity.oracle.zoo import ZOO

    shapes = {}
    for architecture in ZOO.values():
        kv_heads, key_dim, value_dim = architecture.dims.get("KVCache", (0, 0, 1))
        heads = architecture.config.get("text_config", architecture.config).get("num_attention_heads")
        if set(architecture.layout) == {"KVCache"} and key_dim == value_dim and key_dim % GROUP_SIZE == 0 and heads:
            shapes.setdefault((heads // kv_heads, key_dim), architecture.name)
    if quick:
        kept = {}
        for repeats, dim in sorted(shapes):
            kept.setdefault(repeats, []).append(dim)
        shapes = {k: v for k, v in shapes.items() if k[1] in (min(kept[k[0]]), max(kept[k[0]]))}
    return tuple(shapes[k] for k in sorted(shapes))


GQA_ARCHITECTURES = _gqa_architectures(QUICK)
GQA_CONTEXTS = (8192,) if QUICK else (8192, 16384)
GQA_B, GQA_BITS = 4, 4
GQA_VARIANTS = ("grouped", "per-kv-head")


def _gqa_case(name, context):
    return f"{name} context={context}"


GQA_ATTENTION = tuple(
    Ratio(f"quantized attention ({variant} query heads): attention / layer bytes", variant, variant,
          quantity="attention_bytes", denominator_quantity="floor_bytes")
    for variant in GQA_VARIANTS
)


@pytest.mark.parametrize("variant", GQA_VARIANTS)
@pytest.mark.parametrize("context", GQA_CONTEXTS)
@pytest.mark.parametrize("name", GQA_ARCHITECTURES)
def test_grouped_query_attention_memory(benchmark, implementation, name, context, variant):
    """mlx-lm's attention over one quantized layer of GQA_B rows of ``context`` tokens."""
    loaded = _model(name)
    mx.synchronize()
    base = mx.get_active_memory()
    shape = (loaded.n_kv_heads, loaded.head_dim)
    rows = []
    for row in range(GQA_B):
        k = mx.random.normal((1, shape[0], context - (97 * row) % GROWTH, shape[1]), key=mx.random.key(row))
        cache = KVCache()
        cache.update_and_fetch(k.astype(loaded.dtype), k.astype(loaded.dtype))
        rows.append(cache.to_quantized(group_size=GROUP_SIZE, bits=GQA_BITS))
        _eval_cache(rows[-1])
    cache = implementation.batch_class.merge(rows)
    _eval_cache(cache)
    heads = loaded.n_heads if variant == "grouped" else loaded.n_kv_heads
    attention = benchmark.pedantic(
        lambda: _attention_peak(loaded, cache, base, n_heads=heads), rounds=1, iterations=1)
    _record(
        benchmark, "gqa-attention", _gqa_case(name, context), variant, GQA_ATTENTION, model=name, B=GQA_B,
        context=context, n_heads=heads, n_kv_heads=loaded.n_kv_heads, head_dim=loaded.head_dim,
        kv_dtype=f"{GQA_BITS}-bit", floor_bytes=cache.nbytes, attention_bytes=attention,
    )

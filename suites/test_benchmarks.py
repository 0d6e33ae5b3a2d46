"""Performance of a batch cache, measured with pytest-benchmark.

What matters is ratios of two benchmarks of one run, so that the machine's
speed cancels out. Every benchmark records what it measured in ``extra_info``
(``metric``, ``case``, ``variant``, and any byte counts); the variant a ratio
is about also records the ratio's definition and target under ``ratios``.
``kvparity.reports.bench`` turns the JSON into a table. Nothing here asserts
a time or a ratio: a benchmark fails only if the code under it fails (or, for
the memory figures, if MLX's memory counters do not read a known allocation).

Deselected by default; run with ``pytest -m benchmark_suite``, without
``-n``: under pytest-xdist every benchmark is skipped, saying why. Set
``KVPARITY_BENCH_QUICK=1`` for the short grids CI runs. ``--impl`` picks the
cache as for the other suites.
"""

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Optional

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, settings
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, make_prompt_cache

from kvparity.oracle.models import ModelUnavailable, load_model, random_model_for
from kvparity.reports.policy import load_policy
from kvparity.reports.verdicts import judge
from kvparity.suites.search.campaign import Campaign
from kvparity.suites.search.supervisor import run_campaign
from kvparity.suites.search.fuzz import generate, make_machine
from kvparity.suites.l1.run import run_l1
from kvparity.suites.format.schedule import catalog_paths
from kvparity.suites.core.loading import load

# pytest-benchmark turns itself off in a pytest-xdist worker (it reads the
# same variable), and a timing would share the cores with the other workers.
UNDER_XDIST = bool(os.environ.get("PYTEST_XDIST_WORKER"))
pytestmark = [
    pytest.mark.benchmark_suite,
    pytest.mark.skipif(UNDER_XDIST, reason="benchmarks do not run under pytest-xdist (-n): pytest-benchmark "
                       "is off in a worker and timings would share the cores; run them without -n or with kvparity bench"),
]

QUICK = os.environ.get("KVPARITY_BENCH_QUICK", "") not in ("", "0")

JOIN_BATCHES = (1, 4, 16) if QUICK else (1, 4, 16, 64)
LEAVE_BATCHES = tuple(b for b in JOIN_BATCHES if b > 1)  # filter keeps >= 1 row
WIDTHS = (128, 1024) if QUICK else (128, 1024, 4096)
DECODE_BATCHES = (1, 8) if QUICK else (1, 2, 4, 8, 16)
DECODE_MODELS = (
    ("llama-h64-bf16", "smollm2")
    if QUICK
    else ("llama-h64-bf16", "llama-h128-bf16", "qwen3-h64-bf16", "smollm2")
)
# Rounds per benchmark: as many as fit in BUDGET_S, within [MIN_ROUNDS, ROUNDS].
MIN_ROUNDS, ROUNDS, BUDGET_S = (3, 50, 0.5) if QUICK else (5, 200, 2.0)

# The layout the join, leave and decode benchmarks use: mlx-lm's default group
# size, 4 bits, and the random models' KV shape.
BITS, GROUP_SIZE, KV_HEADS, HEAD_DIM = 4, 64, 2, 128


@dataclass(frozen=True)
class Ratio:
    """``numerator / denominator``: one quantity of two variants of one case."""

    name: str
    numerator: str
    denominator: Optional[str]  # None: no ratio, the numerator's quantity itself (a rate)
    quantity: str = "time"  # "time": median seconds; otherwise an extra_info key
    targets: tuple = ()  # (case, ">=" or "<=", value)
    denominator_quantity: Optional[str] = None  # the denominator's, where it differs

    def record(self, case):
        target = next(([op, x] for c, op, x in self.targets if c == case), None)
        return {
            "name": self.name,
            "numerator": self.numerator,
            "denominator": self.denominator,
            "quantity": self.quantity,
            "denominator_quantity": self.denominator_quantity or self.quantity,
            "target": target,
        }


JOIN = Ratio(
    "join: re-merge / extend time", "remerge", "extend",
    targets=(("B=16 width=1024", ">=", 3.0),),
)
LEAVE = Ratio("leave: re-merge / filter time", "remerge", "filter")
BATCHED_VS_SOLO = Ratio(
    "decode: batched / solo tokens per second", "solo-quantized", "batch-quantized",
    targets=tuple((f"{m} B=8", ">=", 3.0) for m in DECODE_MODELS),
)
QUANTIZED_VS_DENSE = Ratio(
    "decode: quantized / unquantized BatchKVCache step time",
    "batch-quantized", "batch-dense",
    targets=(("smollm2 B=8", "<=", 1.5),),
)
DECODE_CACHE = Ratio(
    "decode: quantized / unquantized cache bytes",
    "batch-quantized", "batch-dense", quantity="cache_bytes",
)
DECODE_PEAK = Ratio(
    "decode: quantized / unquantized step peak memory",
    "batch-quantized", "batch-dense", quantity="step_peak_bytes",
)
BYTES_PER_TOKEN = Ratio(
    "memory: quantized / bf16 bytes per token", "quantized", "bf16",
    quantity="bytes_per_token", targets=(("bits=4 head_dim=128", "<=", 0.3),),
)


def _record(benchmark, metric, case, variant, ratios=(), **values):
    benchmark.extra_info.update(
        metric=metric,
        case=case,
        variant=variant,
        ratios=[r.record(case) for r in ratios],
        **values,
    )


def _pedantic(benchmark, fn, setup=None):
    """Time `fn`, after one untimed call that warms it up and sizes the rounds.

    Most functions here consume their input (extend, filter, a decode step),
    so `setup` gives each round a fresh one, as pytest-benchmark's pedantic
    mode allows.
    """
    args, kwargs = (setup() if setup else None) or ((), {})
    start = time.perf_counter()
    fn(*args, **kwargs)
    once = time.perf_counter() - start
    rounds = max(MIN_ROUNDS, min(ROUNDS, int(BUDGET_S / once)))
    return benchmark.pedantic(fn, setup=setup, rounds=rounds)


def _eval_cache(cache):
    mx.eval([x for x in cache.state if isinstance(x, (mx.array, tuple))])


# -- join and leave -----------------------------------------------------------


def _solo_row(length, key):
    """A solo quantized row as mlx-lm leaves it after a prefill (256-step buffer)."""
    k, v = (
        mx.random.normal((1, KV_HEADS, length, HEAD_DIM), key=key).astype(mx.bfloat16)
        for key in mx.random.split(key)
    )
    cache = QuantizedKVCache(group_size=GROUP_SIZE, bits=BITS)
    cache.update_and_fetch(k, v)
    mx.eval(cache.keys, cache.values)
    return cache


@lru_cache(maxsize=None)
def _rows(B, width):
    """B rows from `width` tokens down to about width/2, and a joiner of width/2."""
    keys = mx.random.split(mx.random.key(B * 100_000 + width), B + 1)
    rows = [_solo_row(width - width // 2 * i // B, keys[i]) for i in range(B)]
    return rows, _solo_row(width // 2, keys[B])


# The variants of one case run back to back (variant varies fastest), so
# that a change in the machine's load between them cannot bias their ratio.
@pytest.mark.parametrize("variant", ["extend", "remerge"])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("B", JOIN_BATCHES)
def test_join(benchmark, implementation, variant, B, width):
    """One row joins a batch of B: extend, or merge all B + 1 rows again."""
    Batch = implementation.batch_class
    rows, joiner = _rows(B, width)

    def fresh_batch():
        batch = Batch.merge(rows)
        _eval_cache(batch)
        return (batch,), {}

    def extend(batch):
        batch.extend(Batch.merge([joiner]))
        _eval_cache(batch)

    def remerge():
        _eval_cache(Batch.merge(rows + [joiner]))

    if variant == "extend":
        _pedantic(benchmark, extend, setup=fresh_batch)
    else:
        _pedantic(benchmark, remerge)
    ratios = [JOIN] if variant == "extend" else []
    _record(benchmark, "join", f"B={B} width={width}", variant, ratios, B=B, width=width)


@pytest.mark.parametrize("variant", ["filter", "remerge"])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("B", LEAVE_BATCHES)
def test_leave(benchmark, implementation, variant, B, width):
    """The longest row leaves a batch of B: filter, or merge the survivors."""
    Batch = implementation.batch_class
    rows, _ = _rows(B, width)
    survivors = list(range(1, B))

    def fresh_batch():
        batch = Batch.merge(rows)
        _eval_cache(batch)
        return (batch,), {}

    def filter_(batch):
        batch.filter(survivors)
        _eval_cache(batch)

    def remerge():
        _eval_cache(Batch.merge(rows[1:]))

    if variant == "filter":
        _pedantic(benchmark, filter_, setup=fresh_batch)
    else:
        _pedantic(benchmark, remerge)
    ratios = [LEAVE] if variant == "filter" else []
    _record(benchmark, "leave", f"B={B} width={width}", variant, ratios, B=B, width=width)


# -- decode ----------------------------------------------------------------------


def _model(name):
    try:
        return load_model(name)
    except ModelUnavailable as error:
        pytest.skip(f"{name} unavailable: {error}")


def _prompt_length(row):
    # 16 to 47 tokens, different for neighbouring rows, so the batch is padded.
    # Short: SmolLM2 costs about as much per prompt token as per decoded one.
    return 16 + (37 * row) % 32


@lru_cache(maxsize=None)
def _prefilled(name, row):
    """Row `row` of model `name` prefilled alone: one mlx-lm KVCache per layer."""
    loaded = _model(name)
    key = mx.random.key(1000 + row)
    prompt = mx.random.randint(0, loaded.vocab_size, (1, _prompt_length(row)), key=key)
    cache = make_prompt_cache(loaded.model)
    loaded.model(prompt, cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _next_tokens(B, vocab_size):
    return mx.random.randint(0, vocab_size, (B, 1), key=mx.random.key(B))


def _decode_setup(variant, name, B, Batch):
    """(step function, the caches it grows) for B rows of model `name`."""
    loaded = _model(name)
    model = loaded.model
    rows = [_prefilled(name, i) for i in range(B)]
    tokens = _next_tokens(B, loaded.vocab_size)

    def quantized(row):
        return [c.to_quantized(group_size=GROUP_SIZE, bits=BITS) for c in row]

    if variant == "solo-quantized":
        solo = [quantized(row) for row in rows]

        def step():
            # B independent requests: each one's forward is evaluated on its own.
            for i, cache in enumerate(solo):
                mx.eval(model(tokens[i : i + 1], cache=cache))

        caches = [c for cache in solo for c in cache]
    else:
        if variant == "batch-quantized":
            layers = zip(*(quantized(row) for row in rows))
            caches = [Batch.merge(list(layer)) for layer in layers]
        else:
            caches = [BatchKVCache.merge(list(layer)) for layer in zip(*rows)]

        def step():
            mx.eval(model(tokens, cache=caches))

    for cache in caches:
        _eval_cache(cache)
    return step, caches


def _kv_dtype(variant, activations):
    return str(activations).split(".")[-1] if variant == "batch-dense" else f"{BITS}-bit"


@pytest.mark.parametrize("variant", ["batch-quantized", "solo-quantized", "batch-dense"])
@pytest.mark.parametrize("B", DECODE_BATCHES)
@pytest.mark.parametrize("name", DECODE_MODELS)
def test_decode(benchmark, implementation, variant, name, B):
    """One decode step (one token for each of B rows) after 16-47 token prompts.

    batch-quantized: the cache under test; solo-quantized: B mlx-lm
    QuantizedKVCache requests one after another; batch-dense: mlx-lm's
    BatchKVCache in the model's activation dtype.
    """
    step, caches = _decode_setup(variant, name, B, implementation.batch_class)
    stepped = []

    def rewind():
        # Undo the previous round's token so that every round sees one context.
        for cache in caches:
            cache.trim(len(stepped))
        stepped[:] = [True]

    _pedantic(benchmark, step, setup=rewind)

    # What one step allocates on top of what is already held (weights, caches).
    rewind()
    mx.reset_peak_memory()
    active = mx.get_active_memory()
    step()
    peak = mx.get_peak_memory()

    ratios = [BATCHED_VS_SOLO, QUANTIZED_VS_DENSE, DECODE_CACHE, DECODE_PEAK]
    _record(
        benchmark,
        "decode",
        f"{name} B={B}",
        variant,
        ratios if variant == "batch-quantized" else [],
        model=name,
        B=B,
        tokens=B,
        kv_dtype=_kv_dtype(variant, _model(name).dtype),
        cache_bytes=sum(c.nbytes for c in caches),
        peak_bytes=peak,
        step_peak_bytes=peak - active,
    )


# -- memory ----------------------------------------------------------------------


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


# -- the harness itself ------------------------------------------------------------

# Generated L1 schedules per second: Hypothesis's state machine on the cache
# under test, each event applied and checked as it is generated (up to 10
# events a schedule, derandomized, so every round runs the same schedules).
# The target is 3x the 11.5/s measured before the replay core was rebuilt.
GENERATED = 50 if QUICK else 1000
GENERATED_ROUNDS = 2
GENERATOR = Ratio(
    "generator: L1 schedules per second", "generated", None, quantity="schedules_per_second",
    targets=((f"{GENERATED} examples", ">=", 34.5),),
)


def test_generated_schedules_per_second(benchmark, implementation, tmp_path):
    """``GENERATED`` examples of the L1 state machine with the cpu policy;
    a failing schedule fails the benchmark (it measures a broken cache)."""
    policy = load_policy("cpu")
    started = []

    def run_once():
        machine = make_machine(implementation, lambda result: judge(result, policy), tmp_path)
        generate(machine, settings=settings(
            max_examples=GENERATED, stateful_step_count=10, derandomize=True, database=None, deadline=None,
            suppress_health_check=list(HealthCheck), print_blob=False,
        ))
        started.append(machine.schedules_started)

    run_once()  # warm-up: imports, the synthetic blocks' cache
    benchmark.pedantic(run_once, rounds=GENERATED_ROUNDS, iterations=1)
    _record(benchmark, "generator", f"{GENERATED} examples", "generated", [GENERATOR],
            examples=GENERATED, stateful_step_count=10,
            schedules_per_second=GENERATED / benchmark.stats.stats.median,
            # Hypothesis also starts schedules it abandons (overruns): counted here, not in the rate.
            schedules_started=started[-1])


HARNESS = Ratio(
    "harness: cold / warm wall time", "cold", "warm", quantity="seconds",
    targets=(("kvparity run", ">=", 3.0),),
)


def time_command(argv, env=None, cwd=None) -> float:
    """Wall seconds of one run of ``argv``; raises CalledProcessError if it fails."""
    start = time.perf_counter()
    subprocess.run(list(argv), env=env, cwd=cwd, check=True)
    return time.perf_counter() - start


# Each command gates the implementation under test, named on its command line
# (its last argument): a wheel's package folder has no pyproject to name it.
COMMANDS = {
    "kvparity run": ["-m", "kvparity", "run", "--no-report", "--impl"],
    "default test suite": ["-m", "pytest", "-q", "--kvparity-impl"],
}


@pytest.fixture(scope="module")
def oracle_caches(tmp_path_factory):
    return tmp_path_factory.mktemp("oracle")


@pytest.mark.parametrize("variant", ["cold", "warm"])
@pytest.mark.parametrize("command", ["kvparity run", *([] if QUICK else ["default test suite"])])
def test_harness_wall_time(benchmark, implementation, oracle_caches, command, variant):
    """Wall time of a whole command with an empty oracle cache (cold) and with
    the cache a previous run filled (warm); one round each, they take seconds."""
    argv = [sys.executable, *COMMANDS[command], implementation.spec]
    cache = oracle_caches / command.replace(" ", "-")
    env = {**os.environ, "KVPARITY_ORACLE_CACHE": str(cache)}
    root = Path(__file__).parent.parent
    if variant == "cold":
        shutil.rmtree(cache, ignore_errors=True)
    elif not cache.exists():
        time_command(argv, env=env, cwd=root)  # fill it
    seconds = []
    benchmark.pedantic(lambda: seconds.append(time_command(argv, env=env, cwd=root)), rounds=1)
    _record(benchmark, "harness", command, variant, [HARNESS] if variant == "cold" else [],
            seconds=seconds[0])


EVIDENCE = Ratio(
    "L1 catalog: evidence after every protocol call / after every event only", "every call", "every event",
    targets=(("L1 catalog", "<=", 1.3),),
)


@pytest.mark.parametrize("variant", ["every call", "every event"])
def test_evidence_after_every_call(benchmark, implementation, variant):
    """The L1 catalog with the evidence after every protocol call, against
    the same with the checks after each event only: what naming the member
    at fault from evidence costs (the whole command: docs/performance.md)."""
    schedules = [load(path) for path in catalog_paths("L1")]
    every_call = variant == "every call"
    _pedantic(benchmark, lambda: [run_l1(schedule, implementation, every_call) for schedule in schedules])
    _record(benchmark, "evidence", "L1 catalog", variant, [EVIDENCE] if every_call else [])


# -- gate power: fuzz campaigns ------------------------------------------------------

# The controls the L1 state machine catches; the others are reached only by
# the catalog (ExtractReturnsViews and FinalizeLeavesJunk went uncaught in
# about 870 generated schedules, a minute of one worker).
GENERATED_CATCHES = (
    ("TrimForgetsOffset",) if QUICK else (
        "LeftPaddingOffByOne", "FilterKeepsSharedPadding", "RollbackByLargest", "MergeRequantizes",
        "MergeWritesItsSources", "ExtractWritesTheBatch", "MaskIgnoresLeftPadding", "ExtendForgetsExistingPadding",
        "RopeOffsetIgnoresLeftPadding", "TrimForgetsOffset", "GrowthDropsTail", "EmptyBatchPacksWholeElementsPerWord",
    )
)
FUZZ_SECONDS = 4 if QUICK else 30  # of generating, for the rate; the workers' start is not counted
WARM_UP = 5  # examples each worker runs on the reference before the clock starts
KILL_REPEATS = 1 if QUICK else 3  # campaigns per control and worker count, each from an empty database
KILL_LIMIT_S = 60  # a campaign that has not caught the control by then counts as not caught
WORKERS = {1: "1 worker", 2: "2 workers"}
FUZZ_CASE = f"L1, {FUZZ_SECONDS} s"
FUZZ_RATES = {
    1: Ratio("fuzz: schedules per second, 1 worker", WORKERS[1], None, quantity="schedules_per_second"),
    2: Ratio("fuzz: schedules per second, 2 workers", WORKERS[2], None, quantity="schedules_per_second"),
}
FUZZ_SCALING = Ratio(
    "fuzz: 2 / 1 workers schedules per second", WORKERS[2], WORKERS[1], quantity="schedules_per_second",
    targets=((FUZZ_CASE, ">=", 1.7),),
)
TIME_TO_KILL = {
    1: Ratio("fuzz: median seconds to the first failure, 1 worker", WORKERS[1], None,
             quantity="seconds_to_first_failure", targets=tuple((c, "<=", KILL_LIMIT_S) for c in GENERATED_CATCHES)),
    2: Ratio("fuzz: median seconds to the first failure, 2 workers", WORKERS[2], None,
             quantity="seconds_to_first_failure"),
}


def _campaign(implementation, tmp_path, **options):
    judge_cpu = partial(judge, policy=load_policy("cpu"))
    return run_campaign(Campaign(implementation, judge_cpu, found_dir=str(tmp_path), warm_up=WARM_UP, **options))


@pytest.mark.parametrize("workers", sorted(WORKERS))
def test_fuzz_schedules_per_second(benchmark, implementation, workers, tmp_path):
    """A time-boxed campaign of the L1 machine on the cache under test,
    without a database: its workers' schedules per second, added up."""
    results = []
    benchmark.pedantic(lambda: results.append(_campaign(
        implementation.spec, tmp_path, workers=workers, seconds=FUZZ_SECONDS, seed=workers)), rounds=1)
    (result,) = results
    if result.found:  # it measures a broken cache
        pytest.fail(f"the campaign found a failure: {result.found[0].message}")
    ratios = [FUZZ_RATES[workers]] + ([FUZZ_SCALING] if workers == 2 else [])
    _record(benchmark, "fuzz", FUZZ_CASE, WORKERS[workers], ratios, workers=workers,
            schedules=result.schedules, schedules_per_second=result.schedules_per_second)


@pytest.mark.parametrize("workers", sorted(WORKERS))
@pytest.mark.parametrize("control", GENERATED_CATCHES)
def test_fuzz_time_to_first_failure(benchmark, control, workers, tmp_path):
    """Campaigns on a negative control, each from an empty database and
    stopped at its first failing example (no shrinking): the median of the
    seconds to it, counted from the workers' start; one not caught within
    ``KILL_LIMIT_S`` counts as never, and a median of never is None ("n/a")."""
    times = []

    def run_once():
        for repeat in range(KILL_REPEATS):
            result = _campaign(f"kvparity.impl.negative_controls:{control}", tmp_path / str(repeat),
                               workers=workers, seconds=KILL_LIMIT_S, seed=100 + repeat,
                               database=str(tmp_path / str(repeat) / "db"), shrink=False)
            times.append(result.first_failure_s if result.found else float("inf"))

    benchmark.pedantic(run_once, rounds=1)
    median = sorted(times)[len(times) // 2]
    _record(benchmark, "fuzz-kill", control, WORKERS[workers], [TIME_TO_KILL[workers]], workers=workers,
            repeats=KILL_REPEATS, caught=sum(t != float("inf") for t in times),
            seconds_to_first_failure=None if median == float("inf") else median)

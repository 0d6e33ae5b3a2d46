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

The suite is three modules, by what is measured: this one, the cache's
speed (join, leave, decode) and what every benchmark module imports from it
(its marks, ``Ratio``, how a benchmark is timed and recorded);
``test_benchmarks_memory.py``, the cache's memory (bytes per token, long
context, grouped-query attention); and ``test_benchmarks_harness.py``, the
harness's own speed (generated schedules, wall time, evidence, fuzz
campaigns). ``kvparity bench`` runs all three (``reports/bench.py``'s ``SUITE``).
"""

import os
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache, make_prompt_cache

from kvparity.oracle.models import ModelUnavailable, load_model

# pytest-benchmark turns itself off in a pytest-xdist worker (it reads the
# same variable), and a timing would share the cores with the other workers.
UNDER_XDIST = bool(os.environ.get("PYTEST_XDIST_WORKER"))
# Every benchmark module's marks (its pytestmark).
MARKS = [
    pytest.mark.benchmark_suite,
    pytest.mark.skipif(UNDER_XDIST, reason="benchmarks do not run under pytest-xdist (-n): pytest-benchmark "
                       "is off in a worker and timings would share the cores; run them without -n or with kvparity bench"),
]
pytestmark = MARKS

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

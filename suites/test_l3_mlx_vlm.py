"""L3 through mlx-vlm's own engine (``suites/l3/engine_mlx_vlm.py``): its
``BatchGenerator(kv_bits)`` serving random mlx-lm models with its own
quantized batch cache. Marked ``matrix``: they run where mlx-vlm is
installed (``python -m pytest -m matrix suites/test_l3_mlx_vlm.py`` in the
mlx-vlm row's environment) and skip elsewhere."""

from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed here")

from kvparity.reports.expectations import load_expectations  # noqa: E402
from kvparity.reports.policy import load_policy  # noqa: E402
from kvparity.reports.verdicts import judge  # noqa: E402
from kvparity.suites.core.adapter import load_implementation  # noqa: E402
from kvparity.suites.format.arrivals import catalog_paths, load  # noqa: E402
from kvparity.suites.core.evidence import EXPECTED_DIVERGENCE, FAIL, NOT_SUPPORTED, PASS  # noqa: E402
from kvparity.suites.l3.judging import explain
from kvparity.suites.l3.run import run_l3

pytestmark = pytest.mark.matrix

ENGINE = "kvparity.suites.l3.engine_mlx_vlm:batch_generator"
ADAPTER = "kvparity.impl.ecosystem.mlx_vlm_cache:BatchQuantizedKVCache"
DEEP_EXPECTATIONS = (Path(__file__).resolve().parent.parent / "reports" / "examples" / "matrix" / "mlx-vlm-0.7.10"
                     / "engine-3layers-expectations.json")


def catalog(name):
    return load(next(p for p in catalog_paths() if p.stem == name))


@pytest.fixture(scope="module")
def vlm_cache():
    return load_implementation(ADAPTER)


def test_mlx_vlm_engine_is_bit_exact_and_quantized_in_every_layer(vlm_cache):
    schedule = catalog("staggered")
    judged = judge(run_l3(schedule, vlm_cache, ENGINE), load_policy("cpu"))
    assert judged.verdict == PASS, explain(judged)
    rows = judged.evidence.rows
    assert all(row.compared("tokens") == schedule.requests[row.request].max_tokens for row in rows)
    assert {row.compared("quantized") for row in rows} <= {0, 2} and any(row.compared("quantized") for row in rows)


def test_mlx_vlm_engine_keeps_the_last_of_three_layers_bf16(vlm_cache):
    result = run_l3(catalog("staggered"), vlm_cache, ENGINE, model_name="llama-h64-bf16-3layers")
    assert judge(result, load_policy("cpu")).verdict == FAIL
    found = [d for d in result.divergences if d.check == "quantized"]
    assert found and {(d.layer, d.tensor) for d in found} == {(2, "keys"), (2, "values")}
    assert "layer 2 holds a BatchKVCache whose keys are an unquantized bfloat16 array" in found[0].message()
    # by design (should_quantize_kv_layer): declared, it no longer gates
    declared = judge(result, load_policy("cpu"), load_expectations(DEEP_EXPECTATIONS))
    assert declared.verdict == EXPECTED_DIVERGENCE, explain(declared)


def test_mlx_vlm_engine_runs_only_its_own_cache():
    result = run_l3(catalog("staggered"), load_implementation(), ENGINE)
    assert result.stopped == NOT_SUPPORTED and "builds mlx-vlm's own BatchQuantizedKVCache" in result.reason


def test_mlx_vlm_engine_admits_nothing_when_completion_batch_is_below_prefill_batch(vlm_cache):
    # completion_batch_size 4 with mlx-vlm's default prefill_batch_size 8:
    # no request is ever taken (ar.py:3119 needs 8 free rows of 4)
    schedule = catalog("burst-over-completion-batch").with_engine(prefill_batch_size=None)
    result = run_l3(schedule, vlm_cache, ENGINE)
    assert judge(result, load_policy("cpu")).verdict == FAIL and "engine stalled" in result.reason

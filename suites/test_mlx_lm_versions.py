"""mlx-lm's own defects: found by running mlx-lm's code, named in the L0
probe, and turning L2 and L3 runs they reach into 'mlx-lm defect' instead
of a FAIL of the cache (or a pass)."""

import inspect
from typing import Optional

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from kvparity.oracle import mlx_lm_versions, probes
from kvparity.oracle.mlx_lm_versions import (
    BATCH_GENERATOR_OWN_CACHE, GQA_LEFT_PADDING_MASK, batch_generator_serves_its_own_cache, defects_for,
    has_gqa_left_padding_mask_defect, installed_batch_generator_defect,
)
from kvparity.oracle.probes import MLX_LM_OPS, ProbeShapes, probe_notes, probe_table, run_probes
from kvparity.reports.policy import load_policy
from kvparity.reports.verdicts import EXIT_CANNOT_JUDGE, judge, verdict_of_run
from kvparity.suites.l3 import engines
from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.format.arrivals import catalog_paths as arrivals_paths
from kvparity.suites.format.arrivals import load as load_arrivals
from kvparity.suites.core.evidence import MLX_LM_DEFECT, PASS, ScheduleResult
from kvparity.suites.l2.run import run_l2
from kvparity.suites.l3.run import run_l3
from kvparity.suites.format.schedule import CATALOG
from kvparity.suites.core.loading import load


def attention_of_mlx_lm_0_31_3(queries, q_keys, q_values, scale, mask: Optional[mx.array], group_size=64, bits=8,
                               expand_mask=False):
    """mlx-lm 0.31.3's quantized_scaled_dot_product_attention (models/base.py);
    ``expand_mask`` adds 0.32.0's fix."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = q_keys[0].shape[-3]
    n_repeats = n_q_heads // n_kv_heads
    queries *= scale
    if n_repeats > 1:
        queries = mx.reshape(queries, (B, n_kv_heads, n_repeats, L, D))
        q_keys = tree_map(lambda x: mx.expand_dims(x, axis=-3), q_keys)
        q_values = tree_map(lambda x: mx.expand_dims(x, axis=-3), q_values)
    scores = mx.quantized_matmul(queries, *q_keys, transpose=True, group_size=group_size, bits=bits)
    if mask is not None:
        if isinstance(mask, str):
            qL, kL = scores.shape[-2:]
            q_indices = mx.arange(kL - qL, kL)
            k_indices = mx.arange(kL)
            mask = q_indices[:, None] >= k_indices[None]
        if expand_mask and n_repeats > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores += mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *q_values, transpose=False, group_size=group_size, bits=bits)
    if n_repeats > 1:
        out = mx.reshape(out, (B, n_q_heads, L, D))
    return out


def attention_of_mlx_lm_0_32(*args, **kwargs):
    return attention_of_mlx_lm_0_31_3(*args, **kwargs, expand_mask=True)


@pytest.fixture
def installed_attention(monkeypatch):
    """Make ``attention`` the installed mlx-lm's, for the probe and the detector."""

    def install(attention):
        monkeypatch.setattr(probes, "quantized_scaled_dot_product_attention", attention)
        monkeypatch.setattr(mlx_lm_versions, "quantized_scaled_dot_product_attention", attention)
        mlx_lm_versions._installed_has_gqa_defect.cache_clear()

    yield install
    mlx_lm_versions._installed_has_gqa_defect.cache_clear()


def test_the_detector_tells_0_31_3s_attention_from_0_32s():
    assert has_gqa_left_padding_mask_defect(attention_of_mlx_lm_0_31_3)
    assert not has_gqa_left_padding_mask_defect(attention_of_mlx_lm_0_32)


def test_the_installed_mlx_lm_is_judged_by_what_it_does():
    # Its source has 0.32.0's fix exactly when running it shows no defect.
    fixed = "mask = mx.expand_dims(mask, -3)" in inspect.getsource(quantized_scaled_dot_product_attention)
    assert has_gqa_left_padding_mask_defect() is not fixed
    assert (defects_for(4, 2) == [GQA_LEFT_PADDING_MASK]) is not fixed
    assert defects_for(4, 4) == []


def shapes(n_kv_heads):
    return ProbeShapes.from_args(hidden_size=128, n_heads=4, n_kv_heads=n_kv_heads, head_dim=64, vocab_size=256,
                                 dtype=mx.bfloat16)


def test_the_probe_attributes_a_defective_attention_to_mlx_lm(installed_attention):
    installed_attention(attention_of_mlx_lm_0_31_3)
    results = run_probes(shapes(2), (1, 2, 3), device="cpu")
    sdpa = {r.batch_size: r for r in results if r.op in MLX_LM_OPS}
    # B=1 has no padding to misplace; B=2 (= kv heads) silently diverges; B=3 raises.
    assert sdpa[1].invariant and sdpa[1].attribution is None
    assert not sdpa[2].invariant and sdpa[2].error is None and sdpa[2].max_abs_diff > 0
    assert sdpa[3].error.startswith("ValueError") and "broadcast" in sdpa[3].error
    for r in (sdpa[2], sdpa[3]):
        assert GQA_LEFT_PADDING_MASK.name in r.attribution and "fixed in mlx-lm 0.32.0" in r.attribution
    assert all(r.attribution is None for r in results if r.op not in MLX_LM_OPS)
    _, rows = probe_table(results)
    assert [cell.endswith("[mlx-lm defect]") for cell in rows[-1][1:]] == [False, True, True]
    (note,) = probe_notes(results)
    assert "quantized_sdpa_left_padding B=2, quantized_sdpa_left_padding B=3" in note
    assert "logits diverge through mlx-lm's attention" in note


def test_the_same_attention_with_a_kv_head_per_query_head_is_not_attributed(installed_attention):
    installed_attention(attention_of_mlx_lm_0_31_3)
    results = run_probes(shapes(4), (1, 2, 3), device="cpu")
    assert all(r.invariant and r.attribution is None for r in results)
    assert probe_notes(results) == []


def test_a_correct_attention_is_not_attributed(installed_attention):
    installed_attention(attention_of_mlx_lm_0_32)
    results = run_probes(shapes(2), (1, 2, 3), device="cpu")
    assert all(r.invariant and r.attribution is None for r in results)


def test_l2_on_a_model_the_defect_reaches_is_an_mlx_lm_defect_not_a_verdict_on_the_cache(monkeypatch):
    schedule = load(CATALOG / "join-longer-joiner.json")
    reference = load_implementation()
    monkeypatch.setattr(mlx_lm_versions, "_installed_has_gqa_defect", lambda: True)
    result = run_l2(schedule, reference)
    assert result.stopped == MLX_LM_DEFECT and result.reason == GQA_LEFT_PADDING_MASK.attribution()
    assert result.reason.startswith(f"mlx-lm {mlx_lm_versions.mlx_lm_version()} defect (gqa-left-padding-mask)")
    assert result.rows and not any(row.checks for row in result.rows)
    # A kv head per query head: mlx-lm's attention is right there, and L2 judges.
    model = result.model + "-mha"
    judged = run_l2(schedule, reference, model_name=model)
    assert judged.model == model and not judged.stopped and not judged.divergences
    assert all(row.checks for row in judged.rows)


def test_run_verdict_does_not_count_an_mlx_lm_defect_as_a_pass_or_a_failure():
    defect = ScheduleResult("s", "L2", "Cache", ["join"], model="m")
    defect.row("a")
    defect.stop(MLX_LM_DEFECT, GQA_LEFT_PADDING_MASK.attribution())
    run = verdict_of_run([judge(defect, load_policy("cpu"))], policy=load_policy("cpu"))
    assert run.counts[MLX_LM_DEFECT] == 1 and run.counts[PASS] == 0
    assert run.exit_status == EXIT_CANNOT_JUDGE and "1 mlx-lm defect" in run.headline


class DropsItsCaches(BatchGenerator):
    """The installed BatchGenerator, serving from caches of its own."""

    def insert(self, prompts, max_tokens=None, caches=None, **options):
        return super().insert(prompts, max_tokens=max_tokens, **options)


def test_the_batch_generator_detector_finds_a_generator_that_ignores_the_cache_given():
    assert batch_generator_serves_its_own_cache(DropsItsCaches)


def test_the_installed_batch_generator_is_judged_by_what_it_does():
    # mlx-lm 0.30's own-cache branch (not supported) is in its source exactly when running it shows the defect.
    own_cache = "if all(c[0].empty() for c in caches)" in inspect.getsource(inspect.getmodule(BatchGenerator))
    assert batch_generator_serves_its_own_cache() is own_cache
    assert (installed_batch_generator_defect() is BATCH_GENERATOR_OWN_CACHE) is own_cache


def test_l3_on_a_batch_generator_with_its_own_cache_is_an_mlx_lm_defect(monkeypatch):
    monkeypatch.setattr(engines, "installed_batch_generator_defect", lambda: BATCH_GENERATOR_OWN_CACHE)
    schedule = load_arrivals(next(p for p in arrivals_paths() if p.stem == "staggered"))
    result = run_l3(schedule, load_implementation(), model_name="llama-h64-bf16-mha")
    assert result.stopped == MLX_LM_DEFECT and "(batch-generator-own-cache)" in result.reason
    assert result.reason.endswith("L3 on this BatchGenerator cannot judge a cache")
    assert not any(row.checks for row in result.rows)

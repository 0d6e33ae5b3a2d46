"""Every layer judged as mlx-lm's own solo run lays it out: the per-layer
plan (``oracle/plan.py``) on architectures of mlx-lm's zoo, at L2 and L3.

A hybrid's SSM layers are mlx-lm's own ``ArraysCache``, compared bit-exact
(and a corrupted one fails); keys and values of different widths are judged
at their own dims; where mlx-lm's solo kv_bits run cannot exist the outcome
is mlx-lm's, never a pass; an engine that leaves a layer dense fails naming
the layer, the request and the event."""

import json

import pytest
from mlx_lm.models import cache as mlx_lm_cache

from kvparity.oracle.mlx_lm_versions import defect_for_model
from kvparity.oracle.models import load_model
from kvparity.reports.cli import main
from kvparity.reports.verdicts import EXIT_OK, EXIT_USAGE
from kvparity.suites.format import arrivals
from kvparity.suites.format.checks import BYTES, QUANTIZED
from kvparity.suites.core.evidence import FAIL, MLX_LM_DEFECT, NOT_SUPPORTED, PASS
from kvparity.suites.l2.run import run_l2
from kvparity.suites.l3.run import run_l3
from kvparity.suites.runners import RUNNERS, RunOptions, architecture_axis, model_set
from kvparity.suites.format.schedule import CATALOG
from kvparity.suites.core.loading import load

HYBRID, KEYS_WIDER, SLIDING = "qwen3_5", "deepseek_v2", "gemma3_text"
TEST_ENGINES = "kvparity.suites.l3.engines_for_tests"
L3_CATALOG = CATALOG / "l3"


def compared(result, check):
    return sum(at[check] for row in result.rows for at in row.counts.values())


def test_the_plan_is_read_off_mlx_lm_s_prompt_cache():
    hybrid = load_model(HYBRID).plan
    assert [layer.cache for layer in hybrid.layers] == ["ArraysCache"] * 3 + ["KVCache"]
    assert [layer.quantized for layer in hybrid.layers] == [False] * 3 + [True]
    assert hybrid.attention == 3 and not hybrid.trimmable
    assert {layer.batched for layer in hybrid.layers if not layer.quantized} == {"ArraysCache"}
    assert (hybrid.layers[3].kv_heads, hybrid.layers[3].key_dim, hybrid.layers[3].value_dim) == (1, 256, 256)
    wider = load_model(KEYS_WIDER).plan
    assert wider.dims == [128, 192] and wider.summary() == "Q(2x192/128)*2"
    assert wider.group_sizes_fit(64) is None and "head_dim=192" in wider.group_sizes_fit(128)


@pytest.mark.gqa_batched
def test_a_hybrid_s_ssm_state_is_compared_bit_exact(implementation, judged, monkeypatch):
    schedule = load(CATALOG / "join-longer-joiner.json")
    result = run_l2(schedule, implementation, HYBRID, use_cache=False)
    assert judged(result).verdict == PASS
    assert compared(result, BYTES) >= 4 * sum(len(r.counts) for r in result.rows)  # every layer, SSM ones too

    extend = mlx_lm_cache.ArraysCache.extend

    def drifts(self, other):  # mlx-lm's own class, broken here: the comparison must see it
        extend(self, other)
        self.cache[0] = self.cache[0] * 1.0001

    monkeypatch.setattr(mlx_lm_cache.ArraysCache, "extend", drifts)
    broken = run_l2(schedule, implementation, HYBRID, use_cache=False)
    assert judged(broken).verdict == FAIL
    first = next(d for row in broken.rows for d in row.divergences)
    assert first.check == BYTES and first.layer == 0 and first.tensor == "state.0"


@pytest.mark.gqa_batched
def test_rollback_on_ssm_state_is_not_supported_by_name(implementation, judged):
    result = run_l2(load(CATALOG / "spec-round-even.json"), implementation, HYBRID, use_cache=False)
    assert judged(result).verdict == NOT_SUPPORTED
    assert "layer 0 is an ArraysCache" in result.reason and "cannot trim" in result.reason


def test_keys_and_values_of_different_widths_are_judged_at_their_own_dims(implementation, judged):
    result = run_l3(arrivals.load(L3_CATALOG / "staggered.json"), implementation, None, KEYS_WIDER,
                    use_cache=False)
    assert judged(result).verdict == PASS and compared(result, QUANTIZED) > 0


@pytest.mark.gqa_batched
def test_no_pass_where_mlx_lm_s_solo_kv_bits_run_cannot_exist(implementation, judged):
    l2 = run_l2(load(CATALOG / "join-empty.json"), implementation, SLIDING, use_cache=False)
    l3 = run_l3(arrivals.load(L3_CATALOG / "staggered.json"), implementation, None, SLIDING, use_cache=False)
    for result in (l2, l3):
        assert judged(result).verdict == MLX_LM_DEFECT
        assert "RotatingKVCache Quantization NYI" in result.reason and "mlx_lm/models/cache.py" in result.reason


@pytest.mark.gqa_batched
@pytest.mark.parametrize("engine, model, layer", [
    ("leaves_batch_dense", KEYS_WIDER, 0),
    ("converts_if_layer0_attention", HYBRID, 3),
])
def test_an_engine_that_leaves_a_layer_dense_fails_naming_it(implementation, judged, engine, model, layer):
    result = run_l3(arrivals.load(L3_CATALOG / "staggered.json"), implementation, f"{TEST_ENGINES}:{engine}",
                    model, use_cache=False)
    assert judged(result).verdict == FAIL
    found = [d for row in result.rows for d in row.divergences if d.check == QUANTIZED]
    assert found and found[0].layer == layer and found[0].request is not None
    assert f"layer {layer} holds a BatchKVCache" in found[0].message() and "#0 serve" in found[0].message()


@pytest.mark.gqa_batched
def test_converting_when_layer_0_is_attention_passes_where_it_is(implementation, judged):
    result = run_l3(arrivals.load(L3_CATALOG / "staggered.json"), implementation,
                    f"{TEST_ENGINES}:converts_if_layer0_attention", "llama-h64-bf16", use_cache=False)
    assert judged(result).verdict == PASS


@pytest.mark.gqa_batched
def test_kvparity_models_lists_plans_and_limits(capsys):
    assert main(["models", HYBRID, SLIDING, "--json"]) == EXIT_OK
    records = {r["model"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    assert records[HYBRID]["plan"] == "ArraysCache*3, Q(1x256)" and records[HYBRID]["limit"] is None
    assert records[SLIDING]["solo_kv_bits"] == "solo-kv-bits-raises"
    assert "RotatingKVCache Quantization NYI" in records[SLIDING]["limit"]
    assert main(["models", "no-such-model"]) == EXIT_USAGE


def test_the_axis_names_catalog_schedules_that_fit_its_models():
    axis = architecture_axis()
    assert set(axis.default) == {HYBRID, KEYS_WIDER, "gemma"}
    options = RunOptions(models=axis.default)
    for level, names in axis.schedules.items():
        runner = RUNNERS[level]
        catalog = {s.name: s for s in runner.catalog(options)}
        for name in names:
            variants = runner.variants(catalog[name], options)
            assert [suffix for suffix, _ in variants] == [""] + [f" on {m}" for m in axis.default]
            for _, variant in variants[1:]:
                assert runner.unfit(catalog[name], load_model(runner.model_name(catalog[name], variant))) is None


def test_model_sets():
    assert model_set(None) == model_set("default") == architecture_axis().default
    assert model_set("none") == () and len(model_set("all")) >= 35
    with pytest.raises(ValueError, match="not-a-model"):
        model_set("qwen3_5,not-a-model")


@pytest.mark.slow
def test_the_whole_zoo_on_two_workers(tmp_path):
    """L2 and L3 on every architecture: none fails, and none passes where
    mlx-lm's solo kv_bits run cannot exist or mlx-lm cannot batch it."""
    assert main(["run", "--level", "L2,L3", "--models", "all", "--workers", "2", "--out", str(tmp_path)]) == EXIT_OK
    (report,) = tmp_path.glob("*/report.json")
    results = json.loads(report.read_text())["results"]
    on_axis = [r for r in results if " on " in r["schedule"]]
    assert {r["model"] for r in on_axis} == set(model_set("all"))
    for r in on_axis:
        limit = defect_for_model(load_model(r["model"]))
        assert r["verdict"] != FAIL, r["schedule"]
        if limit is not None:
            assert r["verdict"] in (MLX_LM_DEFECT, NOT_SUPPORTED), r["schedule"]
            assert r["verdict"] == NOT_SUPPORTED or limit.name in r["reason"], r["schedule"]
    assert sum(r["verdict"] == PASS for r in on_axis) > len(on_axis) // 2


# -- per-file fit, and architectures kvparity never listed (published config.json files) ----

from kvparity.oracle.zoo import PUBLISHED_DIR  # noqa: E402

# The sixteen published configs held to a pass or a named limit on three files each; every
# published config (and every module of mlx-lm) is swept in suites/test_sweep.py.
PUBLISHED = ["afmoe", "apertus", "baichuan_m1", "bailing_moe", "dots1", "ernie4_5", "exaone_moe", "gemma3n", "jamba",
             "kimi_linear", "minimax", "olmo_hybrid", "phi", "qwen2_moe", "seed_oss", "stablelm"]


def _catalog_run(level, model, path):
    schedule = load(path) if level == "L2" else arrivals.load(path)
    return RUNNERS[level].runs(schedule, RunOptions(model=model))


def test_a_catalog_file_that_does_not_fit_is_not_supported_and_a_user_s_own_is_refused(implementation, capsys):
    # Keys of 192 (DeepSeek-V2) are not a multiple of 128: that file is "not supported" there, by name.
    (_, run), = _catalog_run("L2", KEYS_WIDER, CATALOG / "group-128.json")
    result = run(implementation)
    assert result.stopped == NOT_SUPPORTED and "group_size=128 does not divide head_dim=192" in result.reason
    label, run = _catalog_run("L3", "lfm2", L3_CATALOG / "chunked-prefill-joiners.json")[0]
    assert run(implementation).stopped == NOT_SUPPORTED
    # The same file named by the user is a usage error before anything runs.
    assert main(["check", "--level", "L2", "--model", KEYS_WIDER, "--schedule",
                 str(CATALOG / "group-128.json")]) == EXIT_USAGE
    assert "does not divide head_dim=192" in capsys.readouterr().err


@pytest.mark.gqa_batched
def test_a_published_config_of_an_unlisted_architecture_runs_at_l2(capsys):
    config = str(PUBLISHED_DIR / "ernie4_5.json")
    assert "ernie4_5" not in model_set("all")
    assert main(["check", "--level", "L2", "--model", config, "--schedule",
                 str(CATALOG / "join-longer-joiner.json")]) == EXIT_OK
    assert "1 passed, 0 failed" in capsys.readouterr().out


def test_models_all_names_every_module_with_a_plan_or_a_reason(capsys, monkeypatch):
    """A module with a config gets its plan (a published one, its checkpoint); one
    without, the reason published/index.json gives; only a module that neither
    knows (a later mlx-lm's) is asked for a config."""
    from kvparity.reports.commands import models

    monkeypatch.setattr(models, "mlx_lm_modules", lambda: ["activations", "ernie4_5", "llama", "newarch",
                                                           "prism_hadamard_qwen35", "rope_utils_2"])
    monkeypatch.setattr(models, "architecture_modules", lambda: ["ernie4_5", "llama", "newarch",
                                                                 "prism_hadamard_qwen35"])
    assert main(["models", "--all", "--json"]) == EXIT_OK
    records = {r["module"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    assert records["ernie4_5"]["plan"] == "Q(2x128)*2" and records["llama"]["model"] == "llama"
    assert records["ernie4_5"]["checkpoint"] == "baidu/ERNIE-4.5-0.3B-PT"
    assert records["activations"]["plan"].startswith("not a language model: ")
    assert records["prism_hadamard_qwen35"]["plan"].startswith("not a twin: ")
    assert records["newarch"]["plan"] == "pass your config.json" and records["newarch"]["model"] is None
    assert "rope_utils_2" not in records  # a helper module kvparity has not met: no model, not listed


@pytest.mark.slow
@pytest.mark.parametrize("name", PUBLISHED)
def test_every_published_config_gets_a_verdict_or_a_named_mlx_lm_limit(implementation, judged, name):
    """At its published sizes, shrunk: L2 on two catalog files and L3 on one, each a
    pass or mlx-lm's named limit (or a file that does not fit), never a crash."""
    model = str(PUBLISHED_DIR / f"{name}.json")
    loaded = load_model(model)
    limit = defect_for_model(loaded)
    why = loaded.plan.nothing_to_judge()  # the model's own fact: Phi-2's head dim of 80, which no group size divides
    outcomes = []
    for level, path in (("L2", CATALOG / "join-longer-joiner.json"), ("L2", CATALOG / "spec-round-even.json"),
                        ("L3", L3_CATALOG / "staggered.json")):
        for _, run in _catalog_run(level, model, path):
            result = judged(run(implementation))
            outcomes.append(result.verdict)
            if limit is not None:
                assert result.verdict in (MLX_LM_DEFECT, NOT_SUPPORTED), (name, result.verdict)
            else:
                assert result.verdict in (PASS, NOT_SUPPORTED), (name, result.verdict)
    assert PASS in outcomes or limit is not None or (why and set(outcomes) == {NOT_SUPPORTED}), name

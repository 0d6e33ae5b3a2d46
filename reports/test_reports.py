"""Reports tell the truth: report.json against its schema, the first
divergence, and the report directory itself, on a sample run that shows every
outcome. Results come from real L1 runs of catalog schedules where one shows
the outcome, and are built by hand where none can (L2 logit statistics, an
oracle that cannot run). The rendered formats (junit.xml, report.md,
report.html) read the same sample in reports/test_report_formats.py."""

import dataclasses
import json

import jsonschema
import pytest

from kvparity.oracle.mlx_lm_versions import GQA_LEFT_PADDING_MASK
from kvparity.impl.batch_quantized import BatchQuantizedKVCache
from kvparity.reports import html as html_report
from kvparity.reports.expectations import EXAMPLES, load_expectations
from kvparity.reports.policy import load_policy
from kvparity.reports.verdicts import EXIT_BROKEN, judge, verdict_of_run
from kvparity.reports.report_json import SCHEMA, SCHEMA_PATH, build_record
from kvparity.reports.markdown import summary_rows
from kvparity.reports.writer import write_report
from kvparity.suites.core.members import REQUIRED_MEMBERS
from kvparity.suites.core.adapter import Implementation, detect_capabilities, load_implementation
from kvparity.suites.core.compare import Divergence
from kvparity.suites.core.evidence import (
    EXPECTED_DIVERGENCE, FAIL, MLX_LM_DEFECT, NO_EVIDENCE, NOT_JUDGED, NOT_SUPPORTED, ORACLE_CANNOT_RUN,
    ORACLE_NONDETERMINISTIC, OUTCOMES, PASS, REFUSED, ScheduleResult,
)
from kvparity.suites.core.flight import FLIGHT
from kvparity.suites.l1.run import run_l1
from kvparity.suites.format.schedule import CATALOG
from kvparity.suites.core.loading import load

CPU, STRICT = load_policy("cpu"), load_policy("strict")
# extract (everywhere) and bytes (in three schedules, none of them below) declared
EXPECTATIONS = load_expectations(EXAMPLES / "extract-bfloat16.json")
ENV = {
    "kvparity": "0.1.0", "mlx": "0.32.4", "mlx_lm": "0.32.2", "python": "3.11.7", "platform": "Linux",
    "backend": "cpu", "device": "cpu (test)", "knobs": {"MLX_ENABLE_TF32": None}, "git_commit": None,
    "implementation": "pkg.mod:Cache", "capabilities": {"per_row_rollback": False},
    # the probes' model, which no schedule below ran
    "model": "probe-model", "model_sha256": "f" * 64,
}
EXACT = {"positions": 4, "bit_exact": 4, "top1_agree": 4, "max_abs_diff": 0.0, "max_ulp": 0, "comparable": True,
         "kl_mean": 0.0, "kl_max": 0.0, "kl_p99": 0.0, "kl_p95": 0.0, "kl_median": 0.0}
FLIPPED = dict(EXACT, bit_exact=1, top1_agree=3, max_abs_diff=float("nan"), max_ulp=900, kl_mean=1e-3,
               kl_max=float("inf"))
# dtype or shape differed: no distance exists
NOT_COMPARABLE = dict(EXACT, positions=2, bit_exact=0, top1_agree=0, max_ulp=None, comparable=False)


class NoRollback(BatchQuantizedKVCache):
    """The reference without the optional per-row rollback."""

    rollback = None


class RefusesUpdate(BatchQuantizedKVCache):
    def update_and_fetch(self, keys, values):
        raise NotImplementedError("not today")


def by_hand(cls) -> Implementation:
    return Implementation(f"{__name__}:{cls.__name__}", cls, detect_capabilities(cls))


def l1(schedule, implementation):
    return run_l1(load(CATALOG / f"{schedule}.json"), implementation)


def logits(rid, event, step):
    return Divergence("logits", f"#{event} step 1", rid, tensor="logits", step=step, index=0,
                      expected=-1.25, actual=-1.5, detail="max abs diff 0.25")


def cache(rid, event, step, layer, part="packed"):
    return Divergence("bytes", f"#{event} step 1", rid, tensor=f"keys.{part}", layer=layer, step=step,
                      index=7, expected=3, actual=5)


def mask(rid, event):
    return Divergence("mask", f"#{event} step 1", rid, tensor="make_mask(1)", index=0, expected=False,
                      actual=True)


def l2_by_hand():
    """Row a fails (logits at step 1, layer 1 cache bytes at steps 2 and 3),
    row b is bit-exact, row c's logits had another dtype."""
    result = ScheduleResult("rollback-uneven", "L2", "Cache", ["join", "step", "step", "step"],
                            model="tiny-llama", model_sha256="a" * 64, seconds=1.25)
    for event in range(4):
        result.note(event, "logits", ["a", "b", "c"])
        result.note(event, "bytes", ["a", "b", "c"])
        result.note(event, "offset", ["a", "b", "c"])
    for d in (logits("a", 1, 1), cache("a", 2, 2, 1), cache("a", 2, 2, 1, "scales"), cache("a", 3, 3, 1),
              logits("a", 3, 3), Divergence("layout", "#1 step 1", "c", tensor="logits", expected="float32",
                                            actual="float16")):
        result.row(d.request).divergences.append(d)
    result.row("a").metrics = dict(FLIPPED)
    result.row("a").series = {"kl_max": [0.0, 0.01, 0.02, float("nan")]}
    result.row("b").metrics = dict(EXACT)
    result.row("c").metrics = dict(NOT_COMPARABLE)
    return result


def earliest_across_rows():
    """Row 'a' (listed first) diverges after event #2, row 'b' after event #0."""
    result = ScheduleResult("earliest", "L1", "Cache", ["join", "step", "step"])
    for event in range(3):
        for check in ("bytes", "offset", "left_padding", "mask"):
            result.note(event, check, ["a", "b"])
    result.note(2, "mask", [], found=[mask("a", 2)])
    result.note(0, "mask", [], found=[mask("b", 0)])
    return result


def unjudged():
    """One schedule run per outcome, and more where the format has more to show."""
    reference = load_implementation()
    never_ran = l1("join-longer-joiner", reference)
    never_ran.row("d")  # a request the schedule names that never joined
    oracle = ScheduleResult("oracle-down", "L2", "Cache", ["join", "step"], model="other-model",
                            model_sha256="b" * 64)
    oracle.row("a")
    oracle.stop(ORACLE_CANNOT_RUN, "event #0 join [\"a\"]: quantized_matmul has no kernel here")
    unstable = ScheduleResult("oracle-unstable", "L2", "Cache", ["join", "step"], model="other-model",
                              model_sha256="b" * 64)
    unstable.row("a")
    unstable.stop(ORACLE_NONDETERMINISTIC, "mlx-lm's solo path for 'a' differs from itself between two runs")
    defect = ScheduleResult("mlx-lm-defect", "L2", "Cache", ["join", "step"], model="other-model",
                            model_sha256="b" * 64)
    defect.row("a")
    defect.stop(MLX_LM_DEFECT, GQA_LEFT_PADDING_MASK.attribution())
    FLIGHT.hung = {"filter": "L1 join-longer-joiner after 2 s (--member-timeout)"}  # as an earlier child found
    try:
        after_a_hang = l1("leave-longest", reference)
    finally:
        FLIGHT.hung = {}
    return [
        l1("join-longer-joiner", load_implementation("kvparity.impl.negative_controls:MaskIgnoresLeftPadding")),
        l1("join-longer-joiner", reference),
        l1("join-longer-joiner", load_implementation("kvparity.impl.negative_controls:ExtractReturnsViews")),
        l1("rollback-uneven", by_hand(NoRollback)),
        l1("join-longer-joiner", by_hand(RefusesUpdate)),
        never_ran,
        earliest_across_rows(),
        l2_by_hand(),
        oracle,
        unstable,
        l1("join-longer-joiner", load_implementation("kvparity.impl.negative_controls:ExtractReturnsBfloat16")),
        defect,
        after_a_hang,
    ]


@pytest.fixture(scope="module")
def results():
    return [judge(r, CPU, EXPECTATIONS) for r in unjudged()]


@pytest.fixture(scope="module")
def run_verdict(results):
    return verdict_of_run(results, expectations=EXPECTATIONS, policy=CPU)


def options(results, policy=CPU, expectations=None):
    return dict(policy=policy, run_verdict=verdict_of_run(results, expectations=expectations, policy=policy),
                expectations=expectations)


@pytest.fixture(scope="module")
def report(results, run_verdict, tmp_path_factory):
    probes = [{"op": "matmul", "batch_size": 8, "invariant": True, "max_abs_diff": 0.0, "first_row": None,
               "error": None}]
    return write_report(results, ENV, tmp_path_factory.mktemp("reports"), policy=CPU, run_verdict=run_verdict,
                        probes=probes, sections=[("Extra", ["k", "v"], [["x", 1]])], expectations=EXPECTATIONS)


@pytest.fixture(scope="module")
def record(report):
    return json.loads((report / "report.json").read_text())


def validator():
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_each_outcome_is_shown_by_the_sample(results):
    assert [r.verdict for r in results] == [FAIL, PASS, PASS, NOT_SUPPORTED, REFUSED, NO_EVIDENCE, FAIL, FAIL,
                                            ORACLE_CANNOT_RUN, ORACLE_NONDETERMINISTIC, EXPECTED_DIVERGENCE,
                                            MLX_LM_DEFECT, NOT_JUDGED]
    assert {row.verdict for r in results for row in r.rows} == set(OUTCOMES)


# --- report.json ---------------------------------------------------------------


def test_a_report_directory_holds_four_files_and_the_record_validates(report, record, run_verdict):
    assert sorted(p.name for p in report.iterdir()) == ["junit.xml", "report.html", "report.json", "report.md"]
    validator().validate(record)
    assert record["schema"] == SCHEMA == "kvparity.report/2"
    assert record["exit_status"] == EXIT_BROKEN and record["passed"] is False
    assert record["headline"] == run_verdict.headline
    assert record["summary"]["schedules"] == {PASS: 2, FAIL: 3, REFUSED: 1, NO_EVIDENCE: 1, NOT_SUPPORTED: 1,
                                              ORACLE_CANNOT_RUN: 1, ORACLE_NONDETERMINISTIC: 1,
                                              MLX_LM_DEFECT: 1, EXPECTED_DIVERGENCE: 1, NOT_JUDGED: 1}
    assert record["summary"]["rows"][NO_EVIDENCE] == 1 and record["summary"]["rows"][REFUSED] == 3
    l2 = record["results"][7]
    row = l2["rows"][0]
    assert row["metrics"]["kl_max"] == "Infinity" and row["metrics"]["max_abs_diff"] == "NaN"
    assert row["series"]["kl_max"][-1] == "NaN" and row["tier"] == "diverged" and row["required"] == "bit-exact"
    assert row["counts"]["0"] == {"logits": 1, "bytes": 1, "offset": 1} and row["checks"] == 12
    assert row["first"]["message"].startswith("logits: after event #1 step 1, row 'a', step 1")
    assert l2["rows"][2]["metrics"]["max_ulp"] is None and l2["rows"][2]["verdict"] == FAIL
    assert record["probes"][0]["op"] == "matmul" and record["capabilities"] == {"per_row_rollback": False}


def test_each_schedule_names_its_own_model_and_the_header_none(record):
    assert "model" not in record["environment"] and "model_sha256" not in record["environment"]
    assert record["probe_model"] == {"model": "probe-model", "model_sha256": "f" * 64}
    assert [(r["model"], r["model_sha256"]) for r in record["results"][7:9]] == [
        ("tiny-llama", "a" * 64), ("other-model", "b" * 64)]
    assert record["models"] == [{"model": "tiny-llama", "model_sha256": "a" * 64, "schedules": 1},
                                {"model": "other-model", "model_sha256": "b" * 64, "schedules": 3}]


def test_coverage_members_and_gaps_come_from_the_run(record, run_verdict):
    assert record["coverage"] == {kind: dict(c) for kind, c in run_verdict.coverage.items()}
    assert record["coverage"]["join"]["bytes"] > 0
    assert set(REQUIRED_MEMBERS) <= set(record["members"])
    assert record["members"]["merge"] == run_verdict.members["merge"] > 0
    assert record["members"]["rollback"] == 0  # optional, and never called here
    assert record["gaps"] == run_verdict.gaps


def test_hygiene_is_counted_with_the_bytes_retained(results, record):
    assert results[2].verdict == PASS  # reported, not gating under cpu
    views = results[2].evidence
    alias = [d for row in views.rows for d in row.divergences if d.check == "alias"]
    assert alias and all(isinstance(d.actual, int) and d.actual > 0 for d in alias)
    hygiene = record["hygiene"]
    assert hygiene["gates"] is False and hygiene["totals"]["alias"] == len(alias)
    found = {f["request"]: f for f in hygiene["findings"] if f["schedule"] == views.schedule}
    for row in views.rows:
        mine = [d for d in row.divergences if d.check == "alias"]
        assert found[row.request]["findings"] == len(mine)
        assert found[row.request]["bytes_retained"] == max(d.actual for d in mine)
        assert found[row.request]["compared"] == row.compared("alias")
        assert found[row.request]["first"] == min(mine, key=lambda d: d.order).message()
    assert all(d["kind"] == "hygiene" for r in record["results"][2]["rows"] for d in r["divergences"])
    assert record["results"][2]["first"] is None  # hygiene is not a parity divergence under cpu


def test_hygiene_gates_under_strict(tmp_path):
    views = l1("join-longer-joiner", load_implementation("kvparity.impl.negative_controls:ExtractReturnsViews"))
    judged = judge(views, STRICT)
    assert judged.verdict == FAIL
    path = write_report([judged], ENV, tmp_path, **options([judged], STRICT))
    record = json.loads((path / "report.json").read_text())
    assert record["hygiene"]["gates"] is True and record["results"][0]["first"]["check"] == "alias"
    assert "## Hygiene (gating under policy strict)" in (path / "report.md").read_text()


def test_every_schema_property_is_documented():
    schema = json.loads(SCHEMA_PATH.read_text())
    missing = []

    def walk(node, where):
        if isinstance(node, dict):
            for name, sub in node.get("properties", {}).items():
                if "description" not in sub:
                    missing.append(f"{where}/{name}")
            for key, sub in node.items():
                walk(sub, f"{where}/{key}")
        elif isinstance(node, list):
            for i, sub in enumerate(node):
                walk(sub, f"{where}/{i}")

    walk(schema, "#")
    assert not missing


TAMPERINGS = {
    "an outcome of the old format": lambda r: r["results"][0].update(verdict="skipped"),
    "wrong schema version": lambda r: r.update(schema="kvparity.report/1"),
    "metrics missing their percentiles": lambda r: r["results"][7]["rows"][1]["metrics"].pop("kl_p99"),
    "step as a string": lambda r: r["results"][7]["rows"][0]["divergences"][0].update(step="1"),
    "field the schema does not know": lambda r: r["results"][0]["rows"][0].update(note="x"),
    "NaN written as a bare string": lambda r: r["results"][7]["rows"][0]["metrics"].update(kl_max="nan"),
    "tier outside the ladder": lambda r: r["results"][0]["rows"][0].update(tier="close enough"),
    "summary without tiers": lambda r: r["summary"].pop("tiers"),
    "an exit status no run has": lambda r: r.update(exit_status=3),
    "a header naming one model for all": lambda r: r["environment"].update(model="smollm2"),
    "comparisons that are not counts": lambda r: r["coverage"]["join"].update(bytes=-1),
    "row counts keyed by something other than an event": lambda r: r["results"][0]["rows"][0]["counts"]
    .update(join={"bytes": 1}),
    "a hygiene check that is not one": lambda r: r["hygiene"]["findings"][0].update(check="mask"),
    "a divergence neither parity nor hygiene": lambda r: r["results"][0]["rows"][0]["divergences"][0]
    .update(kind="other"),
}


@pytest.mark.parametrize("name", sorted(TAMPERINGS))
def test_a_tampered_record_fails_validation(name, results):
    record = build_record(results, ENV, **options(results))
    check = validator()
    check.validate(record)
    TAMPERINGS[name](record)
    with pytest.raises(jsonschema.ValidationError):
        check.validate(record)


def test_results_must_be_judged_before_they_are_reported():
    with pytest.raises(ValueError, match="not judged"):
        build_record([earliest_across_rows()], ENV, policy=CPU, run_verdict=verdict_of_run([]))


def test_judging_and_reporting_never_write_the_evidence():
    evidence = [earliest_across_rows(), l2_by_hand(), l1("join-longer-joiner", by_hand(RefusesUpdate))]
    before = json.dumps([r.to_json() for r in evidence], default=str)
    results = [judge(r, CPU, EXPECTATIONS) for r in evidence]
    assert all(v.evidence is r for v, r in zip(results, evidence))
    assert [v.verdict for v in results] == [FAIL, FAIL, REFUSED]
    build_record(results, ENV, **options(results))
    assert json.dumps([r.to_json() for r in evidence], default=str) == before
    assert not any(hasattr(r, "verdict") or hasattr(row, "verdict") for r in evidence for row in r.rows)


def test_a_verdict_is_frozen():
    verdict = judge(earliest_across_rows(), CPU)
    for judged, field in ((verdict, "verdict"), (verdict, "rows"), (verdict.rows[0], "verdict"),
                          (verdict.rows[0], "tier")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(judged, field, None)
    with pytest.raises(TypeError):
        verdict.rows[0].declared[0] = 0


# --- the first divergence --------------------------------------------------------


def test_the_first_divergence_is_the_earliest_across_rows(results, record, report):
    earliest = results[6].evidence
    assert [row.request for row in earliest.rows] == ["a", "b"]
    expected = mask("b", 0).message()
    assert record["results"][6]["first"]["message"] == expected
    _, rows = summary_rows(results, CPU)
    assert rows[6][-1] == expected
    assert [r["first"]["request"] for r in record["results"][6]["rows"]] == ["a", "b"]


def test_without_a_divergence_the_summary_says_why(results):
    _, rows = summary_rows(results, CPU)
    by_name = {(row[0], row[5]): row for row in rows}
    assert "refused" in by_name[("join-longer-joiner", REFUSED)][-1]
    assert by_name[("rollback-uneven", NOT_SUPPORTED)][-1] == "needs per_row_rollback"
    assert "row 'd'" in by_name[("join-longer-joiner", NO_EVIDENCE)][-1]
    assert "no kernel" in by_name[("oracle-down", ORACLE_CANNOT_RUN)][-1]
    assert by_name[("oracle-down", ORACLE_CANNOT_RUN)][2] == "other-model"


# --- the directory itself --------------------------------------------------------


def test_an_interrupted_report_leaves_nothing_and_earlier_ones_stay(results, tmp_path, monkeypatch):
    first = write_report(results, ENV, tmp_path, **options(results))
    second = write_report(results, ENV, tmp_path, **options(results))
    assert first != second and (first / "report.json").exists()

    def broken(*args):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(html_report, "render", broken)
    before = sorted(tmp_path.iterdir())
    with pytest.raises(RuntimeError):
        write_report(results, ENV, tmp_path, **options(results))
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.gqa_batched
def test_a_conversation_run_at_l3_writes_a_record_that_validates(tmp_path):
    # Its timeline has the steps' arrivals from the prompt cache and its stores.
    from kvparity.suites.format import arrivals
    from kvparity.suites.l3.run import run_l3

    result = run_l3(arrivals.load(CATALOG / "l3" / "stored-prompt-longer.json"), load_implementation())
    verdict = judge(result, CPU)
    out = write_report([verdict], ENV, tmp_path, policy=CPU, run_verdict=verdict_of_run([verdict], policy=CPU))
    record = json.loads((out / "report.json").read_text())
    assert any(step.get("from_store") for run in record["results"] for step in run["timeline"])
    validator().validate(record)


def test_the_per_event_chart_counts_what_gates_and_its_labels_fit():
    """Hygiene findings under a policy that reports them, and declared
    divergences, are listed but not counted in the bars: a failure at event 6
    is not drawn as bars from event 0. A large tick fits the margin."""
    from kvparity.reports.html import _gates, _steps_chart, _tick

    hygiene = {"kind": "hygiene", "declared": None, "event_index": 0, "step": None}
    declared = {"kind": "parity", "declared": 0, "event_index": 1, "step": None}
    parity = {"kind": "parity", "declared": None, "event_index": 6, "step": None}
    assert [_gates(d, False) for d in (hygiene, declared, parity)] == [False, False, True]
    assert _gates(hygiene, True)
    rows = [{"request": "a", "divergences": [parity]}]
    chart = _steps_chart("k", {"level": "L1"}, rows, {"a": "#000"})
    assert 'data-step="6"' in chart and 'data-step="0"' not in chart and "gating divergences per event" in chart
    assert [_tick(v) for v in (0, 0.5, 12.5, 25000, 2.5e6, 1e-5)] == ["0", "0.5", "12.5", "25k", "2.5M", "1e-05"]

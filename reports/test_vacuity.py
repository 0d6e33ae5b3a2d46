"""Negative controls for vacuity: ways to pass without evidence, each of which
must fail (or be refused) with a message that says what happened.

A green gate is worth what it compared. Each test here takes an
implementation, a candidate trace or a selection that tries to get a 0
without comparing anything, and holds the command line to the exit status and
message a user would act on.
"""

import json
import shutil
from collections import Counter

import pytest

from kvparity.reports import verdicts
from kvparity.reports.cli import EXIT_BROKEN, EXIT_CANNOT_JUDGE, EXIT_OK, EXIT_USAGE, main
from kvparity.suites.core.members import REQUIRED_MEMBERS
from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.core.evidence import FAIL, NOT_SUPPORTED, PASS
from kvparity.suites.format.events import EVENT_KINDS
from kvparity.suites.runners import architecture_axis
from kvparity.suites.format.levels import LEVELS
from kvparity.suites.format.schedule import CATALOG, catalog_paths
from kvparity.suites.core.loading import load

CONTROLS = "kvparity.impl.negative_controls"


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def verdict_of(monkeypatch):
    """The RunVerdict the command line computed, for assertions on evidence."""
    seen = []
    original = verdicts.verdict_of_run

    def keep(results, **kwargs):
        seen.append((results, original(results, **kwargs)))
        return seen[-1][1]

    monkeypatch.setattr(verdicts, "verdict_of_run", keep)
    return seen


# -- implementations that compare nothing ----------------------------------------------


def test_refusing_update_and_fetch_is_a_failure_naming_the_member_and_event(capsys):
    code, out, err = run(capsys, "replay", str(CATALOG / "join-longer-joiner.json"), "--level", "L1",
                         "--impl", f"{CONTROLS}:RefusesUpdateAndFetch")
    assert code == EXIT_BROKEN, out + err
    assert "L1 join-longer-joiner: refused (event #" in out
    assert "required member update_and_fetch refused" in out
    assert "not supported" not in out and "0 passed" in out


def test_refusing_filter_after_divergences_keeps_them(capsys):
    # merge zeroes the keys, then filter declines: the bytes divergences
    # recorded before the refusal decide the schedule, not "not supported".
    code, out, err = run(capsys, "replay", str(CATALOG / "leave-longest.json"), "--level", "L1",
                         "--impl", f"{CONTROLS}:ZeroesMergeRefusesFilter")
    assert code == EXIT_BROKEN, out + err
    assert f"L1 leave-longest: {FAIL}" in out
    assert "bytes: after event #0 join" in out and "divergence(s)" in out
    assert "not supported" not in out


def test_refusing_filter_fails_the_catalog(capsys):
    code, out, err = run(capsys, "check", "--level", "L1", "--impl", f"{CONTROLS}:ZeroesMergeRefusesFilter")
    assert code == EXIT_BROKEN, out + err
    assert "0 passed" in out and "not supported" not in out


@pytest.mark.parametrize("level", ["L1", "L2"])  # L2 read the state as triples and crashed (exit 128)
@pytest.mark.gqa_batched
def test_state_returning_none_is_a_layout_failure_not_a_crash(capsys, level):
    code, out, err = run(capsys, "check", "--level", level, "--schedule", str(CATALOG / "join-longer-joiner.json"),
                         "--impl", f"{CONTROLS}:StateReturnsNone")
    assert "Traceback" not in err, err
    assert code == EXIT_BROKEN, out + err
    assert "layout" in out and "state returned no" in out  # the summary cuts the message


@pytest.mark.gqa_batched
def test_zero_width_state_fails_l2_under_the_gpu_policy(capsys):
    # gpu.json tolerates logit moves and reports model-written bytes; layout gates regardless
    code, out, err = run(capsys, "check", "--level", "L2", "--policy", "gpu",
                         "--schedule", str(CATALOG / "rollback-uneven.json"), "--impl", f"{CONTROLS}:ZeroWidthState")
    assert code == EXIT_BROKEN, out + err
    assert "FAIL" in out and "layout: after event #0" in out


@pytest.mark.slow  # the whole default check, about 12 s on 2 cores (the README's test command stays near 2 min)
def test_an_optional_member_that_declines_is_not_supported_and_the_rest_passes(capsys, verdict_of):
    code, out, err = run(capsys, "check", "--level", "L1", "--impl", f"{CONTROLS}:RollbackRaisesNotImplemented")
    (results, run_verdict), = verdict_of
    by_name = {r.evidence.schedule: r for r in results}
    assert by_name["rollback-uneven"].verdict == NOT_SUPPORTED
    assert "rollback is not implemented (per_row_rollback)" in by_name["rollback-uneven"].evidence.reason
    assert {r.verdict for r in results} == {PASS, NOT_SUPPORTED}
    uneven = {r.evidence.schedule for r in results if r.verdict == NOT_SUPPORTED}
    assert uneven == {load(p).name for p in catalog_paths("L1") if "per_row_rollback" in load(p).needs}
    # a missing optional capability with everything else passing is a pass
    assert code == EXIT_OK and "not supported" in out, out + err


@pytest.mark.slow  # the whole default check, about 30 s on 2 cores (the README's test command stays near 2 min)
@pytest.mark.gqa_batched
def test_the_default_check_on_the_reference_exercises_every_member_and_event_kind(capsys, verdict_of):
    code, out, err = run(capsys, "check")
    assert code == EXIT_OK, out + err
    (results, run_verdict), = verdict_of
    assert not run_verdict.gaps
    cells = run_verdict.cells  # the catalog alone reaches every cell of the coverage model at L1
    assert cells["missing"] == [] and cells["reached"] == cells["requirements"] > 200
    assert f"coverage model (L1): {cells['reached']} of {cells['requirements']} requirements reached" in out
    assert {m for m in REQUIRED_MEMBERS if not run_verdict.members[m]} == set()
    silent = [k for k in EVENT_KINDS if not sum(run_verdict.coverage.get(k, {}).values())]
    assert silent == [], f"no comparison after any {silent} event"
    evidence = [r.evidence for r in results]
    levels = {r.level for r in evidence}
    assert levels == {"L1", "L2", "L3"}  # the default selection is every level
    assert set(architecture_axis().default) <= {r.model for r in evidence}  # and the architecture axis
    for level in levels:  # every check a row needs to pass was made somewhere
        made = Counter()
        for r in evidence:
            if r.level == level:
                for row in r.rows:
                    for per_event in row.counts.values():
                        made.update(per_event)
        assert all(made[c] for c in LEVELS[level].requires), (level, made)


# -- selections that run nothing --------------------------------------------------------


def test_a_selection_that_runs_nothing_is_a_usage_error(capsys):
    l1_only = next(p for p in catalog_paths("L1") if "L2" not in load(p).levels)
    code, out, err = run(capsys, "check", "--level", "L2", "--schedule", str(l1_only))
    assert code == EXIT_USAGE, out + err
    assert "nothing would be compared" in err and out == ""


def test_a_request_that_never_joins_is_a_usage_error(tmp_path, capsys):
    path = tmp_path / "never.json"
    path.write_text(json.dumps({
        "name": "never-joins", "levels": ["L1"],
        "requests": {"a": {"prompt_len": 2}, "b": {"prompt_len": 3}},
        "events": [{"join": ["a"]}, {"step": 1}],
    }))
    code, out, err = run(capsys, "check", "--schedule", str(path))
    assert code == EXIT_USAGE, out + err
    assert "request 'b': never joins" in err


# -- events judged by what comes after them ----------------------------------------------


def schedule_file(tmp_path, name, levels, events, prompts=(6, 9, 4)):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({
        "name": name, "levels": levels,
        "requests": {rid: {"prompt_len": n} for rid, n in zip("abc", prompts)},
        "events": events,
    }))
    return str(path)


REFILL = [{"join": ["a"]}, {"step": 2}, {"leave": ["a"]}, {"join": ["b", "c"]}, {"step": 3}, {"trim": 1},
          {"step": 1}]


@pytest.mark.parametrize("level", ["L1", "L2"])
@pytest.mark.gqa_batched
def test_a_leave_that_empties_the_batch_is_judged_by_the_refill_after_it(tmp_path, capsys, verdict_of, level):
    # Nothing is compared right after the leave (no row is left), but every
    # row of the refill is: the leave's effects were observed.
    code, out, err = run(capsys, "check", "--level", level,
                         "--schedule", schedule_file(tmp_path, "refill", [level], REFILL))
    assert code == EXIT_OK, out + err
    (results, run_verdict), = verdict_of
    assert not run_verdict.gaps
    assert not sum(run_verdict.coverage.get("leave", Counter()).values())  # none right after it


@pytest.mark.parametrize("level", ["L1", "L2"])
@pytest.mark.gqa_batched
def test_a_leave_that_nothing_is_compared_after_is_never_judged(tmp_path, capsys, level):
    ends = [{"join": ["a"]}, {"step": 2}, {"leave": ["a"]}]
    code, out, err = run(capsys, "check", "--level", level,
                         "--schedule", schedule_file(tmp_path, "ends-with-leave", [level], ends, prompts=(6,)))
    assert code == EXIT_CANNOT_JUDGE, out + err
    assert "no comparison was made after any leave event" in out + err


# -- candidate traces that hold less than the golden -----------------------------------

SCHEDULES = ["rollback-uneven", "join-longer-joiner"]


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    path = tmp_path_factory.mktemp("vacuity") / "golden"
    paths = [arg for name in SCHEDULES for arg in ("--schedule", str(CATALOG / f"{name}.json"))]
    assert main(["record", str(path), *paths]) == EXIT_OK
    return path


def _edit_manifests(directory, edit):
    """Apply ``edit(manifest)`` (returning tensor names to forget) to every
    trace; the sha256 table loses exactly those names, so the candidate is
    consistent, not tampered with: it simply holds less."""
    for manifest_path in directory.glob("*/*/manifest.json"):
        manifest = json.loads(manifest_path.read_text())
        for name in edit(manifest):
            del manifest["sha256"][name]
        manifest_path.write_text(json.dumps(manifest))


def _no_snapshots(manifest):
    dropped = [n for snap in manifest["snapshots"].values() for layer in snap["layers"] for n in layer.values()]
    manifest["snapshots"] = {}
    return dropped


def _one_layer(manifest):
    dropped = []
    for snap in manifest["snapshots"].values():
        dropped += [n for layer in snap["layers"][1:] for n in layer.values()]
        snap["layers"] = snap["layers"][:1]
    return dropped


def test_the_golden_holds_what_the_edits_remove(golden):
    manifests = [json.loads(p.read_text()) for p in golden.glob("*/*/manifest.json")]
    assert manifests and all(m["snapshots"] for m in manifests)
    assert all(len(s["layers"]) == 2 for m in manifests for s in m["snapshots"].values())


@pytest.mark.parametrize("edit", [_no_snapshots, _one_layer], ids=["no snapshots", "one of two layers"])
def test_a_candidate_holding_less_than_the_golden_fails(golden, tmp_path, capsys, edit):
    candidate = tmp_path / "candidate"
    shutil.copytree(golden, candidate)
    _edit_manifests(candidate, edit)
    code, out, err = run(capsys, "compare", str(golden), str(candidate))
    assert code == EXIT_BROKEN, out + err
    assert "cache snapshot layers in the candidate" in out or "layout" in out
    assert f"0 passed, {len(SCHEDULES)} failed" in out


def test_a_candidate_missing_a_schedule_has_no_evidence(golden, tmp_path, capsys):
    candidate = tmp_path / "candidate"
    shutil.copytree(golden, candidate)
    doc = json.loads((candidate / "golden.json").read_text())
    del doc["schedules"][SCHEDULES[1]]
    (candidate / "golden.json").write_text(json.dumps(doc))
    shutil.rmtree(candidate / SCHEDULES[1])
    code, out, err = run(capsys, "compare", str(golden), str(candidate))
    assert code == EXIT_CANNOT_JUDGE, out + err
    assert "1 passed" in out and "1 no evidence" in out
    assert "the candidate has no trace of this schedule" in out


@pytest.mark.gqa_batched
def test_an_oracle_that_differs_from_itself_is_never_judged(monkeypatch, capsys, tmp_path):
    """--repeat-oracle runs every solo trace twice; when mlx-lm's own path
    differs from itself nothing can be judged: exit 125, never 0 nor 1."""
    import mlx.core as mx

    from kvparity.suites.l2 import run as l2

    monkeypatch.setenv("KVPARITY_ORACLE_CACHE", str(tmp_path))
    real, runs = l2.run_solo, []

    def every_other_run_differs(model, schedule, rid, *args, **kwargs):
        trace = real(model, schedule, rid, *args, **kwargs)
        runs.append(rid)
        if len(runs) % 2 == 0:
            last = trace.calls[-1]
            last.logits = mx.concatenate([last.logits[:, :-1], last.logits[:, -1:] + 1], axis=1)
        return trace

    monkeypatch.setattr(l2, "run_solo", every_other_run_differs)
    code, out, err = run(capsys, "check", "--level", "L2", "--schedule", str(CATALOG / "join-empty.json"),
                         "--repeat-oracle")
    assert code == EXIT_CANNOT_JUDGE, out + err
    assert "oracle nondeterministic" in out


def test_a_whole_catalog_run_that_misses_a_cell_of_the_coverage_model_cannot_judge():
    # One schedule standing in for the catalog: everything it compared held,
    # but most cells of the model were never reached.
    from kvparity.reports.policy import load_policy
    from kvparity.suites.l1.run import run_l1

    result = verdicts.judge(run_l1(load(CATALOG / "join-longer-joiner.json"), load_implementation()),
                            load_policy("cpu"))
    run_verdict = verdicts.verdict_of_run([result], whole_catalog=True)
    assert result.verdict == PASS and run_verdict.cells["missing"]
    assert run_verdict.exit_status == EXIT_CANNOT_JUDGE
    assert any(gap.startswith("the coverage model's cells not reached at L1") for gap in run_verdict.gaps)


def test_a_schedule_built_in_memory_is_judged_and_reaches_no_cell():
    # A generated schedule has no file to read its cells from; it still gets its verdict.
    from kvparity.reports.policy import load_policy
    from kvparity.suites.l1.run import run_l1
    from kvparity.suites.core.loading import parse

    doc = load(CATALOG / "join-empty.json").to_json()
    result = run_l1(parse(doc, source="<generated L1>"), load_implementation())
    run_verdict = verdicts.verdict_of_run([verdicts.judge(result, load_policy("cpu"))])
    assert run_verdict.cells is None and run_verdict.exit_status == EXIT_OK

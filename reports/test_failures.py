"""Failures that say what to fix: the two realistic bugs of the negative
controls each make one group at L1 that names the member at fault (for the
trim, the trim and the write that exposed it), with the full expected and
got values and a bisect command that works; no summary cuts a message; a
level that judged nothing says so in the headline, and --require-levels
makes such a run one that cannot be judged. Failures seen at L2 and L3, and
how they join these groups, are in test_failures_across_levels.py."""

import json
from dataclasses import replace
import shlex
from collections import Counter

import pytest

from kvparity.impl import negative_controls
from kvparity.impl.batch_quantized import BatchQuantizedKVCache
from kvparity.reports import failures, verdicts
from kvparity.reports.cli import main
from kvparity.reports.policy import load_policy
from kvparity.reports.verdicts import EXIT_CANNOT_JUDGE, EXIT_OK, EXIT_USAGE
from kvparity.reports.markdown import summary_rows
from kvparity.reports.writer import write_report
from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.core.evidence import FAIL, NOT_SUPPORTED, ScheduleResult
from kvparity.suites.l1.run import run_l1
from kvparity.suites.format.schedule import CATALOG, catalog_paths
from kvparity.suites.core.loading import load

CPU = load_policy("cpu")
CONTROLS = "kvparity.impl.negative_controls"
# Catalog schedules whose failures start at different events (a leave, an
# extract, a spec round, a step, a store joined from) for the two bugs.
SCHEDULES = ("leave-longest", "kv-heads-1", "extract-decode-reinsert", "bits-2", "spec-round-even",
             "rollback-even", "trim-all-rows", "prefix-evict-by-bytes")
# And where the other controls of the member at fault show: a padded prefill of empty rows, an 8-bit row at group 32.
AT_FAULT_SCHEDULES = SCHEDULES + ("batched-join-empty-bits-8-group-128", "growth-bits-8-h128")


def judged_runs(name, schedules=SCHEDULES):
    spec = f"{CONTROLS}:{name}"
    impl = load_implementation(spec)
    run = lambda schedule: verdicts.judge(run_l1(schedule, impl), CPU)  # noqa: E731
    results = [run(load(CATALOG / f"{s}.json")) for s in schedules]
    groups = failures.group(results, {"impl": spec})
    failures.explain(groups, lambda level: run)
    return spec, results, groups


@pytest.fixture(scope="module")
def filter_bug():
    return judged_runs("FilterSharedPaddingOffByOne")


@pytest.fixture(scope="module")
def trim_bug():
    return judged_runs("TrimSlicesOnlyPackedWords")


def one_group(results, groups):
    failing = [r for r in results if r.verdict == FAIL]
    assert len(failing) >= 4, [(r.evidence.schedule, r.verdict) for r in results]
    assert len(groups) == 1, failures.lines(groups)
    group = groups[0]
    assert group.schedules == len(failing)
    assert group.rows == sum(row.verdict == FAIL for r in failing for row in r.rows)
    return group


def test_an_off_by_one_in_filter_is_one_group_naming_filter(filter_bug):
    spec, results, groups = filter_bug
    group = one_group(results, groups)
    # Seen after leave and extract events alike: the member, not the event, is what to fix.
    kinds = {f.first.event.split()[1] for f in group.failures}
    assert {"leave", "extract"} <= kinds, kinds
    assert group.member == group.at_fault == "filter" and group.exposure is None
    assert (group.check, group.tensor) == ("bytes", "keys.packed")


def test_a_trim_that_forgets_the_scales_names_the_trim_and_the_write(trim_bug):
    _, results, groups = trim_bug
    group = one_group(results, groups)
    assert group.member == "update_and_fetch"  # where it showed
    assert group.exposure is not None and group.at_fault == "trim"
    assert group.exposure.exposed_by == "update_and_fetch"
    assert group.title().startswith("trim, exposed by update_and_fetch at a later event"), group.title()
    assert (group.check, group.tensor) == ("bytes", "keys.scales")
    # The shrunk schedule holds the trim's event just before the failing write.
    assert group.shrunk[-1] == group.exposure.exposed_at and group.exposure.cause_event in group.shrunk


@pytest.mark.parametrize("bug", ["filter_bug", "trim_bug"])
def test_a_group_gives_the_full_values_and_a_bisect_command_that_shrinks_it(bug, request, tmp_path):
    spec, _, groups = request.getfixturevalue(bug)
    doc = groups[0].to_json()
    example = doc["example"]
    first = groups[0].example.first
    assert example["expected"] == repr(first.expected) and example["actual"] == repr(first.actual)
    assert example["expected"] != example["actual"]
    text = "\n".join(failures.lines(groups))
    assert f"expected: {example['expected']}" in text and f"got:      {example['actual']}" in text
    assert example["message"] in text  # whole, however long
    words = shlex.split(doc["bisect"])
    assert words[:2] == ["kvparity", "bisect"] and "--impl" in words and spec in words
    assert words[words.index("--level") + 1] == "L1"
    out = tmp_path / "min.json"
    assert main([*words[1:], "--out", str(out)]) == 1
    assert json.loads(out.read_text())["events"]


def test_no_summary_cuts_a_message(trim_bug, tmp_path):
    _, results, groups = trim_bug
    verdict = verdicts.verdict_of_run(results, policy=CPU)
    verdict.failures = groups
    long = [r for r in results if r.verdict == FAIL]
    messages = [failures.failure_of(r).message for r in long]
    assert max(len(m) for m in messages) > 90, messages
    _, rows = summary_rows(results, CPU)
    shown = {row[-1] for row in rows}
    path = write_report(results, {"implementation": "trim"}, tmp_path, policy=CPU, run_verdict=verdict)
    markdown, page = (path / "report.md").read_text(), (path / "report.html").read_text()
    record = json.loads((path / "report.json").read_text())
    assert record["failures"][0]["at_fault"] == "trim"
    assert 'id="failures"' in page and "Failures by root cause" in markdown
    for r in long:
        message = min((d for row in r.rows for d in row.failing), key=lambda d: d.order).message()
        assert message in shown
        assert message in markdown
        assert message.replace("'", "&#x27;").replace('"', "&quot;") in page
    assert "…" not in markdown


def unjudged(level, outcome):
    result = ScheduleResult("needs-rollback", level, "impl", ["join"])
    result.row("a")
    result.stop(outcome, "event #0 join: needs per_row_rollback")
    return verdicts.judge(result, CPU)


def test_a_level_that_judged_nothing_says_so_in_the_headline():
    passed = verdicts.judge(run_l1(load(CATALOG / "leave-longest.json"),
                                   load_implementation(None)), CPU)
    runs = [passed, unjudged("L2", NOT_SUPPORTED), unjudged("L2", NOT_SUPPORTED)]
    verdict = verdicts.verdict_of_run(runs, policy=CPU)
    assert verdict.exit_status == EXIT_OK  # it judged L1, and L2 could not be: not a failure
    assert verdict.unjudged_levels == {"L2": Counter({NOT_SUPPORTED: 2})}
    assert "L2 not judged (2 not supported)" in verdict.headline
    required = verdicts.verdict_of_run(runs, policy=CPU, required_levels=("L1", "L2"))
    assert required.exit_status == EXIT_CANNOT_JUDGE
    assert any("L2" in gap and "--require-levels" in gap for gap in required.gaps), required.gaps
    assert verdicts.verdict_of_run(runs, policy=CPU, required_levels=("L1",)).exit_status == EXIT_OK
    assert "not judged" not in verdicts.verdict_of_run([passed], policy=CPU).headline


def test_require_levels_on_the_command_line(tmp_path, capsys):
    """Not judged there is 125 with --require-levels, 0 without; a level the
    run does not select, or an unknown one, is a usage error."""
    rollback = str(CATALOG / "rollback-uneven.json")
    plain = str(CATALOG / "leave-longest.json")
    lacking = f"{CONTROLS}:WithoutPerRowRollback"
    args = ["check", "--level", "L1", "--schedule", plain, "--schedule", rollback, "--impl", lacking]
    assert main(args) == EXIT_OK  # rollback-uneven is not supported; leave-longest passes
    assert main([*args, "--require-levels", "L1"]) == EXIT_OK
    only = ["check", "--level", "L1", "--schedule", rollback, "--impl", lacking]
    assert main(only) == EXIT_CANNOT_JUDGE
    assert "L1 not judged (1 not supported)" in capsys.readouterr().out
    assert main([*args, "--require-levels", "L2"]) == EXIT_USAGE
    assert main([*args, "--require-levels", "L9"]) == EXIT_USAGE


@pytest.mark.parametrize("control", negative_controls.AT_FAULT, ids=lambda c: c.__name__)
def test_each_control_is_one_group_naming_its_member_with_values_and_an_agreeing_bisect(control, tmp_path, capsys):
    """Each control (a mask missing for one-token steps, a merge of empty rows
    taking default bits, a trim freeing its buffer by floor division, an
    extract describing 8-bit rows at group 64, a stored row's nbytes without
    biases, and the two the groups were first built on) is one group naming
    the member to fix, whatever check and event showed it first; the group
    has the full expected and got values; its bisect command exits 1 and
    names the same member."""
    spec, results, groups = judged_runs(control.__name__, AT_FAULT_SCHEDULES)
    assert any(r.verdict == FAIL for r in results)
    assert len(groups) == 1, failures.lines(groups)
    (group,) = groups
    assert group.at_fault == control.at_fault, failures.lines(groups)
    assert group.title().startswith(control.at_fault), group.title()
    example = group.to_json()["example"]
    assert example["expected"] is not None and example["actual"] is not None and example["expected"] != example["actual"]
    assert control.caught_by in {f.first.check for f in group.failures}
    capsys.readouterr()
    words = shlex.split(group.bisect_command())
    assert main([*words[1:], "--out", str(tmp_path / "min.json")]) == 1
    said = capsys.readouterr().out
    assert f"member at fault: {control.at_fault}" in said, said


def test_a_group_whose_shrunk_schedule_names_another_member_says_both(filter_bug):
    """The group is named from the shrunk schedule's first failing call;
    where that is another member's than the full run's, it says both."""
    _, _, groups = filter_bug
    group = groups[0]
    group.shrunk_first = replace(group.example.first, member="extend", call=0)
    assert group.at_fault == "extend" and group.shrunk_differs
    text = "\n".join(failures.lines([group]))
    assert "first failing call, shrunk: " in text and "(the full run's names filter)" in text
    assert group.to_json()["shrunk_first"] == group.shrunk_first.message()
    group.shrunk_first = None


def test_the_html_row_says_its_verdict_and_its_logits_tier_only_as_logits(tmp_path):
    """An L2 row whose cache bytes diverged while its logits stayed
    bit-exact reads FAIL and "logits bit-exact", never "tier bit-exact"; its
    gating divergences are listed before its hygiene findings."""
    import mlx.core as mx

    from kvparity.suites.core.compare import Divergence
    from kvparity.suites.core.metrics import LogitStats

    result = ScheduleResult("made-up", "L2", "impl", ["join", "step"])
    row = result.row("a")
    stats = LogitStats()
    logits = mx.zeros((2, 8))
    stats.add(logits, logits, 0)
    row.metrics.update(stats.as_dict())
    result.note(1, "pad", ["a"], 1, [Divergence("pad", "#1 step 1", "a", tensor="batch.keys.packed", index=0,
                                                expected=0, actual=7)])
    result.note(1, "bytes", ["a"], 1, [Divergence("bytes", "#1 step 1", "a", tensor="keys.packed", layer=0,
                                                  index=3, expected=1, actual=2)])
    result.note(1, "logits", ["a"], 2)
    judged = verdicts.judge(result, CPU)
    assert judged.verdict == FAIL and judged.rows[0].tier == "bit-exact"
    path = write_report([judged], {"implementation": "x"}, tmp_path, policy=CPU,
                        run_verdict=verdicts.verdict_of_run([judged], policy=CPU))
    page = (path / "report.html").read_text()
    assert "tier bit-exact" not in page and "FAIL, 2 divergence(s), logits bit-exact" in page
    listed = page[page.index('<ol class="divergences">'):]
    assert listed.index("bytes:") < listed.index("(hygiene, not gating) pad:")
    assert "overflow-wrap:anywhere" not in page  # names in the failure table break at their ends


class MergeReturnsNothing(BatchQuantizedKVCache):
    @classmethod
    def merge(cls, caches):
        return None


class ExtractReturnsNothing(BatchQuantizedKVCache):
    def extract(self, idx):
        return None


class SizeIsNotAnInt(BatchQuantizedKVCache):
    def size(self):
        return None


class OffsetIsOneNumber(BatchQuantizedKVCache):
    offset = property(lambda self: 3, lambda self, value: None)


@pytest.mark.parametrize("cls, member", [(MergeReturnsNothing, "merge"), (ExtractReturnsNothing, "extract"),
                                         (SizeIsNotAnInt, "size"), (OffsetIsOneNumber, "offset")],
                         ids=lambda v: getattr(v, "__name__", v))
def test_a_member_returning_what_the_protocol_does_not_allow_is_its_failure(cls, member, capsys):
    """kvparity's code reading what a member returned (a merge's batch, an
    extracted row, a width, per-row offsets) does not raise on a bad value:
    the run fails (1, never 128), one group naming the member and the value."""
    spec = f"{__name__}:{cls.__name__}"
    assert main(["check", "--level", "L1", "--impl", spec, "--schedule", str(CATALOG / "extract-decode-reinsert.json"),
                 "--schedule", str(CATALOG / "leave-longest.json")]) == 1
    out = capsys.readouterr().out
    assert "internal error" not in out and "root cause(s):\n[1] " + member + ":" in out, out
    assert "[2] " not in out, out


# -- boundary controls: a bug at one edge of a member's integers ---------------------------

# The catalog's schedules that reach the value cells the controls break (suites/search/coverage.py VALUES).
BOUNDARY_SCHEDULES = ("boundary-pads-by-one", "boundary-rows-emptied", "boundary-rollback-empties-a-row",
                      "boundary-join-stored-beside-fresh", "boundary-extend-empty-side",
                      "boundary-join-fresh-before-stored")


@pytest.mark.parametrize("control", negative_controls.BOUNDARY, ids=lambda c: c.__name__)
def test_a_boundary_control_is_one_group_naming_its_member(control):
    """Each is right at every value but one edge (a padding or a shift of
    exactly one column, a row emptied, a side of rows holding no tokens, the
    count of a trim that empties the batch, nbytes of a batch of no tokens):
    the schedules made to reach those cells fail it in one group naming the
    member, caught by its check."""
    _, results, groups = judged_runs(control.__name__, BOUNDARY_SCHEDULES)
    assert any(r.verdict == FAIL for r in results)
    assert len(groups) == 1, failures.lines(groups)
    (group,) = groups
    assert group.at_fault == control.at_fault, failures.lines(groups)
    assert control.caught_by in {f.first.check for f in group.failures}


@pytest.mark.slow  # the default gate once per control: about 25 s each on 2 quiet cores, 60-100 s under load
@pytest.mark.parametrize("control", negative_controls.BOUNDARY, ids=lambda c: c.__name__)
def test_the_default_gate_kills_each_boundary_control_in_one_group(control, tmp_path, capsys):
    """``kvparity check`` with its defaults (the whole catalog, every level):
    exit 1, one failure group, naming the member."""
    assert main(["check", "--impl", f"{CONTROLS}:{control.__name__}", "--out", str(tmp_path)]) == 1
    capsys.readouterr()
    (report,) = tmp_path.glob("*/report.json")
    groups = json.loads(report.read_text())["failures"]
    assert [g["at_fault"] for g in groups] == [control.at_fault], groups


@pytest.mark.slow  # L1 over the catalog twice: about 20 s on 2 quiet cores
@pytest.mark.parametrize("control", [negative_controls.PrepareRightPaddingPastOne,
                                     negative_controls.FilterDropsSharedPaddingFromTwo], ids=lambda c: c.__name__)
def test_issue_42s_two_bugs_pass_the_catalog_without_its_boundary_schedules(control, judged):
    """Why the value cells: both pass every other L1 schedule of the
    catalog (the whole gate passed them, 179 of 180, before the cells)."""
    impl = load_implementation(f"{CONTROLS}:{control.__name__}")
    others = [p for p in catalog_paths("L1") if not p.stem.startswith("boundary-")]
    assert others and all(judged(run_l1(load(p), impl)).verdict != FAIL for p in others)


def test_a_bug_in_what_prepare_records_is_named_by_finalize_which_says_prepare_too():
    """finalize is where the wrong offset first shows (the evidence); what
    prepare keeps no check can read, so the group names prepare beside it."""
    _, _, groups = judged_runs(negative_controls.PrepareRightPaddingPastOne.__name__, ("boundary-pads-by-one",))
    (group,) = groups
    assert group.at_fault == negative_controls.PrepareRightPaddingPastOne.at_fault == "finalize"
    said = "\n".join(failures.lines(groups))
    assert "finalize applies what prepare recorded before it" in said, said

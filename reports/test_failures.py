"""Failures that say what to fix: the two realistic bugs of the negative
controls each make one group at L1 that names the member at fault (for the
trim, the trim and the write that exposed it), with the full expected and
got values and a bisect command that works; no summary cuts a message; a
level that judged nothing says so in the headline, and --require-levels
makes such a run one that cannot be judged."""

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


@pytest.mark.gqa_batched  # L2 on the default (grouped-query) model
def test_one_root_cause_at_l1_and_l2_is_one_group():
    """The filter bug seen in L1's bytes and in L2's is one group, which
    names both levels and takes its example (and bisect) from L1."""
    from kvparity.suites.l2.run import run_l2

    spec = f"{CONTROLS}:FilterSharedPaddingOffByOne"
    impl = load_implementation(spec)
    schedule = load(CATALOG / "leave-longest.json")
    assert {"L1", "L2"} <= set(schedule.levels)
    results = [verdicts.judge(run_l1(schedule, impl), CPU), verdicts.judge(run_l2(schedule, impl), CPU)]
    assert [r.verdict for r in results] == [FAIL, FAIL]
    (group,) = failures.group(results, {"impl": spec})
    assert group.levels == ["L1", "L2"] and group.level == "L1" and group.member == "filter"
    assert "(L1, L2; 2 schedule runs" in group.title()
    assert "--level L1" in group.bisect_command()


@pytest.mark.gqa_batched  # L3's engine batches the grouped-query model
def test_the_filter_bug_seen_at_l3_joins_its_group_through_the_members_the_engine_called():
    """L3 compares outputs and the engine makes the calls, so its failures
    name no member; the engine's filter calls before each divergence put them
    with the L1 group at filter. Alone (no lower level) they stay unattributed,
    and a run whose L3 divergence no filter preceded would stay apart."""
    from kvparity.suites.format.arrivals import load as load_arrivals
    from kvparity.suites.format.arrivals import L3_CATALOG
    from kvparity.suites.l3.run import run_l3

    spec = f"{CONTROLS}:FilterSharedPaddingOffByOne"
    impl = load_implementation(spec)
    l1 = verdicts.judge(run_l1(load(CATALOG / "leave-longest.json"), impl), CPU)
    l3 = [verdicts.judge(run_l3(load_arrivals(L3_CATALOG / f"{name}.json"), impl), CPU)
          for name in ("staggered", "prompt-length-1")]
    assert [r.verdict for r in l3] == [FAIL, FAIL]
    for run in l3:
        first = failures.failure_of(run).first
        assert "filter" in first.reshaped and first.check in ("logprobs", "tokens")
    (group,) = failures.group([l1, *l3], {"impl": spec})
    assert group.levels == ["L1", "L3"] and group.member == "filter" and group.schedules == 3
    assert group.level == "L1" and "--level L1" in group.bisect_command()
    (alone,) = failures.group(l3)
    assert alone.member == "" and "member not known" in alone.title()
    # Had the engine never called filter before those divergences, nothing ties them to it.
    unrelated = [replace(run, rows=tuple(replace(row, failing=tuple(replace(d, reshaped=("extend",))
                                                                    for d in row.failing)) for row in run.rows))
                 for run in l3]
    assert len(failures.group([l1, *unrelated])) == 2


@pytest.mark.gqa_batched  # L2 on the default (grouped-query) model
def test_the_trim_bug_seen_only_in_l2_logits_joins_the_trim_group():
    """At L2 the trim bug can show in the logits before any cache bytes are
    compared; logits name no tensor, so those runs join the group of the
    member that the failing event called, or, once explain has named it,
    the member at fault (the trim of rollback-even's spec round)."""
    from kvparity.suites.l2.run import run_l2

    spec = f"{CONTROLS}:TrimSlicesOnlyPackedWords"
    impl = load_implementation(spec)
    l1 = [verdicts.judge(run_l1(load(CATALOG / f"{name}.json"), impl), CPU) for name in ("spec-round-even", "bits-4")]
    l2 = [verdicts.judge(run_l2(load(CATALOG / f"{name}.json"), impl), CPU)
          for name in ("spec-round-even", "rollback-even")]
    assert [failures.failure_of(r).first.check for r in l2] == ["logits", "logits"]
    assert [failures.failure_of(r).member for r in l2] == ["update_and_fetch", "trim"]
    runs = [*l1, *l2]
    by_member = failures.group(runs, {"impl": spec})
    assert len(by_member) == 2  # rollback-even's logits wait for the member at fault
    run = lambda level: lambda schedule: verdicts.judge(run_l1(schedule, impl), CPU)  # noqa: E731
    failures.explain(by_member, run)
    (group,) = by_member
    assert group.at_fault == "trim" and group.levels == ["L1", "L2"] and group.schedules == 4
    assert (group.check, group.tensor) == ("bytes", "keys.scales")


@pytest.mark.gqa_batched  # L2 and L3 on grouped-query models
def test_one_member_seen_three_ways_is_one_group():
    """A newcomer's filter bug shows as shared padding at L1, a layout at L2
    and a forward that raises at L3 (the engine's calls put filter before it):
    one member to fix, one group, saying what each level saw first."""
    from kvparity.suites.format.arrivals import L3_CATALOG
    from kvparity.suites.format.arrivals import load as load_arrivals
    from kvparity.suites.l2.run import run_l2
    from kvparity.suites.l3.run import run_l3

    spec = f"{CONTROLS}:FilterKeepsAMarginColumn"
    impl = load_implementation(spec)
    runs = [verdicts.judge(run_l1(load(CATALOG / "kv-heads-1.json"), impl), CPU),
            verdicts.judge(run_l2(load(CATALOG / "head-dim-128.json"), impl), CPU),
            verdicts.judge(run_l3(load_arrivals(L3_CATALOG / "long-prompt-crosses-256.json")
                                  .with_engine(prefill_batch_size=1), impl), CPU)]
    assert [failures.failure_of(r).what[0] for r in runs] == ["shared_padding", "layout", "raised"]
    (group,) = failures.group(runs, {"impl": spec})
    assert group.at_fault == "filter" and group.levels == ["L1", "L2", "L3"] and group.level == "L1"
    assert group.seen_as == ["shared_padding (L1)", "layout on keys.packed (L2)", "raised (L3)"]
    assert "seen as: shared_padding (L1); layout on keys.packed (L2); raised (L3)" in "\n".join(failures.lines([group]))


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


@pytest.mark.gqa_batched  # L3's engine batches the grouped-query model
def test_a_member_declining_what_mlx_lms_engine_never_hands_is_the_engines_finding():
    """An engine that hands merge its stored rows dense: the reference's merge
    declines (NotImplementedError), which is a refusal only where the engine
    handed what mlx-lm's own engine would. Here it is the engine's finding:
    a FAIL naming the engine and what it handed, one group, not refused."""
    from kvparity.suites.core.raised import ForwardRaised
    from kvparity.suites.format.arrivals import L3_CATALOG
    from kvparity.suites.format.arrivals import load as load_arrivals
    from kvparity.suites.l3.run import run_l3

    result = run_l3(load_arrivals(L3_CATALOG / "chat-shared-system-prompt.json"), load_implementation(None),
                    "kvparity.suites.l3.engines_for_tests:keeps_stored_rows_dense")
    judged = verdicts.judge(result, CPU)
    assert judged.verdict == FAIL and result.raised_by == ForwardRaised.ENGINE, result.reason
    assert "the engine handed merge an unquantized" in result.reason and "mlx-lm's own engine never does" in result.reason
    (group,) = failures.group([judged])
    assert group.at_fault == ForwardRaised.ENGINE and "refused" not in group.title()


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


class ExtractTakesValuesOfTheLastRow(BatchQuantizedKVCache):
    """Not a control, and no grouping was built around it: extract copies
    its row's keys, but its values from the batch's last row."""

    def extract(self, idx):
        import mlx.core as mx

        cache = super().extract(idx)
        last, start = self.batch_size - 1, self.left_padding.tolist()[idx]
        if self.values is not None and last != idx:
            cache.values = tuple(mx.array(x[last:last + 1, :, start:self._idx]) for x in self.values)
        return cache


@pytest.mark.gqa_batched  # L2 on the random models
def test_a_bug_seen_at_l2_alone_is_named_by_each_schedules_replay_at_l1():
    """``--level L2`` runs no L1: each failing schedule, whether its file
    lists L1 too (head-dim-128, extract-decode-reinsert) or not
    (llama-f32-mixed), is replayed at L1 to name the member at fault from
    the evidence after every call: one group, extract, not the filter its
    extract event calls after it (as named before, by the last member
    called, for the files that list L1), nor the extend of a stored row."""
    from kvparity.suites.l2.run import run_l2

    impl = load_implementation("kvparity.reports.test_failures:ExtractTakesValuesOfTheLastRow")
    names = ("head-dim-128", "extract-decode-reinsert", "llama-f32-mixed", "prefix-hit-spec-rollback")
    runs = [verdicts.judge(run_l2(load(CATALOG / f"{name}.json"), impl), CPU) for name in names]
    assert [r.verdict for r in runs] == [FAIL] * 4
    groups = failures.group(runs, {"impl": impl.spec})
    at_l1 = lambda level: lambda schedule: verdicts.judge(run_l1(schedule, impl), CPU)  # noqa: E731
    failures.explain(groups, at_l1)
    (group,) = groups
    assert group.at_fault == "extract" and group.levels == ["L2"] and group.schedules == 4, failures.lines(groups)


class ExtractCountsOneMore(BatchQuantizedKVCache):
    """extract's row holds the row's tokens but says it holds one more."""

    def extract(self, idx):
        cache = super().extract(idx)
        cache.offset += 1
        return cache


class ExtractCountsOneMoreInAnArray(BatchQuantizedKVCache):
    """extract's row says it holds one more token, in an array (as the batch
    keeps its per-row offsets), where mlx-lm's QuantizedKVCache keeps an int:
    the engine's later merge of the stored row raises on it."""

    def extract(self, idx):
        import mlx.core as mx

        cache = super().extract(idx)
        cache.offset = mx.array(cache.offset + 1)
        return cache


@pytest.mark.gqa_batched  # L3's engine batches the grouped-query model
@pytest.mark.parametrize("bug, raised", [
    pytest.param("ExtractCountsOneMore", "", marks=pytest.mark.slow),  # the array one is seen the same way first
    ("ExtractCountsOneMoreInAnArray", "the engine's call of merge raised"),
])
def test_an_extract_bug_seen_at_l3_through_the_store_joins_extracts_group(bug, raised):
    """What the engine stored is what extract returned: at L3 it is held to
    mlx-lm's own cache of the request alone on the tokens it is stored
    under, before anything consumes it (the engine and the oracle then both
    start from it). A wrong offset is the first divergence there, made by
    the members that shaped the row and extract, and a merge that later
    raises on the stored row follows from it: one group with L1's, naming
    extract. Before, the first passed L3 (both sides started from the same
    wrong row) and the second was a group of its own naming merge."""
    from kvparity.suites.format.arrivals import L3_CATALOG
    from kvparity.suites.format.arrivals import load as load_arrivals
    from kvparity.suites.l3.run import run_l3

    impl = load_implementation(f"kvparity.reports.test_failures:{bug}")
    stored = load_arrivals(L3_CATALOG / "stored-prompt-longer.json").with_engine(prefill_batch_size=1)
    l3 = verdicts.judge(run_l3(stored, impl), CPU)
    first = failures.failure_of(l3).first
    assert l3.verdict == FAIL and (first.check, first.tensor) == ("extract", "stored entry #0: offset")
    assert "extract" in first.reshaped and first.expected == 15 and first.actual == 16, first.message()
    assert raised in l3.evidence.reason and (not raised or "which diverged as extract returned it" in l3.evidence.reason)
    runs = [verdicts.judge(run_l1(load(CATALOG / "extract-decode-reinsert.json"), impl), CPU), l3]
    (group,) = failures.group(runs, {"impl": impl.spec})
    assert group.at_fault == "extract" and group.levels == ["L1", "L3"], failures.lines([group])
    # The reference: each entry compared, none diverged.
    reference = run_l3(stored, load_implementation(None))
    assert verdicts.judge(reference, CPU).verdict == "pass"
    assert reference.row("long").compared("extract") > 0


@pytest.mark.slow  # kvparity check on every level: about 110 s on 2 shared cores
@pytest.mark.gqa_batched
def test_kvparity_check_on_an_extract_bug_seen_through_the_store_is_one_group(tmp_path, capsys):
    """The whole default gate (L1, L2, L3, the catalog and its architectures)
    on an extract whose row says one token more, in an array: L1 sees the
    offset, L2 the row mlx-lm cannot take (it exited 128 there before), L3
    the stored entry, and the engine's merge raising on it. One group,
    naming extract, at every level."""
    status = main(["check", "--impl", "kvparity.reports.test_failures:ExtractCountsOneMoreInAnArray",
                   "--out", str(tmp_path)])
    said = capsys.readouterr().out
    assert status == 1, said
    (report,) = tmp_path.glob("*/report.json")
    groups = json.loads(report.read_text())["failures"]
    assert [(g["at_fault"], g["levels"]) for g in groups] == [("extract", ["L1", "L2", "L3"])], said


@pytest.mark.gqa_batched  # L2 on the random models
def test_an_extracted_row_whose_offset_is_an_array_is_extracts_failure_at_l2():
    """mlx-lm slices a solo row by its offset, an int: a row whose offset is
    an array is no row the protocol allows, extract's FAIL naming it, where
    L2's reading of the row raised before (exit 128)."""
    from kvparity.suites.l2.run import run_l2

    impl = load_implementation(f"{__name__}:ExtractCountsOneMoreInAnArray")
    result = run_l2(load(CATALOG / "extract-decode-reinsert.json"), impl)
    assert verdicts.judge(result, CPU).verdict == FAIL and result.raised_by == "extract", result.reason
    assert "extract returned QuantizedKVCache(offset array(" in result.reason, result.reason


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

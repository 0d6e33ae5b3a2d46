"""Failures seen above L1 join the group of the member at fault: one root
cause seen at L1, L2 and L3 is one group, its example and bisect from L1;
L3's failures, which name no member, are put with it through the calls the
engine made and the rows it stored; a failure seen at L2 alone is named by
replaying its schedule at L1; an engine that hands what mlx-lm's never does
is the engine's finding. The bugs written here are loaded by this module's
name."""

import json
from dataclasses import replace

import pytest

from kvparity.impl.batch_quantized import BatchQuantizedKVCache
from kvparity.reports import failures, verdicts
from kvparity.reports.cli import main
from kvparity.reports.test_failures import CONTROLS, CPU
from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.core.evidence import FAIL
from kvparity.suites.l1.run import run_l1
from kvparity.suites.format.schedule import CATALOG
from kvparity.suites.core.loading import load


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

    impl = load_implementation("kvparity.reports.test_failures_across_levels:ExtractTakesValuesOfTheLastRow")
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

    impl = load_implementation(f"kvparity.reports.test_failures_across_levels:{bug}")
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
    status = main(["check", "--impl", "kvparity.reports.test_failures_across_levels:ExtractCountsOneMoreInAnArray",
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

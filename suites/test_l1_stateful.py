"""L1 over generated schedules, and proof that the generator finds and
shrinks real bugs into replayable files."""

import gc
import os

import pytest
from hypothesis import HealthCheck, Phase, settings

from kvparity.impl import negative_controls
from kvparity.impl.minimal import MinimalBatchQuantizedKVCache
from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.core.evidence import FAIL, PASS
from kvparity.suites.search.fuzz import YOUNG_THRESHOLD, ConversationMachine, fewer_collections, generate, make_machine
from kvparity.suites.l1.run import run_l1
from kvparity.suites.core.loading import load

def fuzz_settings(examples, steps=10, **overrides):
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        # The machine writes its own replayable file: Hypothesis's line tracing of a failure is not needed.
        phases=[p for p in Phase if p != Phase.explain],
        **overrides,
    )


@pytest.mark.slow  # about 15 s on 2 cores (the README's test command stays near 2 min)
def test_generated_schedules(implementation, policy, judged, generated_examples, tmp_path):
    machine = make_machine(implementation, lambda r: judged(r, policy),
                           os.environ.get("KVPARITY_FOUND_DIR", tmp_path))
    generate(machine, settings=fuzz_settings(generated_examples))
    assert machine.schedules_started >= generated_examples
    # Most generated rows go through the batch; waiting-only ones have no evidence.
    assert machine.row_outcomes.get(PASS, 0) >= generated_examples, machine.row_outcomes
    # The shapes of real models are drawn: keys apart from values, wide heads, one kv head, several layers.
    for feature in ("keys != values", "head_dim 256 or 512", "one kv head", "several layers"):
        assert machine.shapes_drawn.get(feature, 0) >= generated_examples // 10, machine.shapes_drawn
    # Every event kind is made: rows stored, and requests joining from a stored prefix.
    assert machine.resumed >= 1, "no generated request joined from a stored prefix"


# Each finds one bug and shrinks it: 2 to 13 s on a 2-core machine. The first runs in the README's
# test command, which stays near 2 minutes; the others in CI's slow step.
@pytest.mark.parametrize(
    "variant",
    [
        negative_controls.MaskIgnoresLeftPadding,
        pytest.param(negative_controls.TrimForgetsOffset, marks=pytest.mark.slow),
        # the default machine stores rows too
        pytest.param(negative_controls.StoredNbytesSkipsBiases, marks=pytest.mark.slow),
        pytest.param(negative_controls.RollbackByLargest, marks=pytest.mark.slow),
        pytest.param(negative_controls.ExtendForgetsExistingPadding, marks=pytest.mark.slow),
    ],
    ids=lambda v: v.__name__,
)
def test_generator_finds_shrinks_and_writes_a_replayable_schedule(variant, judged, tmp_path):
    broken = load_implementation(f"kvparity.impl.negative_controls:{variant.__name__}")
    machine = make_machine(broken, judged, tmp_path)
    # One bug: with several, Hypothesis goes on generating for 10 s of wall time after the first, so
    # what it finds (and which file is written last) would depend on the machine's load.
    with pytest.raises(AssertionError, match="replay with: kvparity replay"):
        generate(
            machine, settings=fuzz_settings(300, database=None, derandomize=True, print_blob=False,
                                            report_multiple_bugs=False)
        )
    (path,) = tmp_path.glob("*.json")
    schedule = load(path)
    assert len(schedule.events) <= 4, f"not shrunk: {[e.label for e in schedule.events]}"
    replayed = run_l1(schedule, broken)
    assert judged(replayed).verdict == FAIL
    assert variant.caught_by in {d.check for d in replayed.divergences}
    assert judged(run_l1(schedule, load_implementation())).verdict == PASS


CONVERSATIONS = int(os.environ.get("KVPARITY_CONVERSATION_EXAMPLES", "20"))


@pytest.mark.parametrize("examples", [CONVERSATIONS, pytest.param(200, marks=pytest.mark.slow)])
def test_generated_conversations(examples, implementation, policy, judged, tmp_path):
    """Chat turns and shared prefixes joining from a store with drawn limits."""
    machine = make_machine(implementation, lambda r: judged(r, policy),
                           os.environ.get("KVPARITY_FOUND_DIR", tmp_path), base=ConversationMachine)
    generate(machine, settings=fuzz_settings(examples, steps=6))
    assert machine.schedules_started >= examples
    assert machine.resumed >= examples // 4, "few generated requests joined from a stored prefix"
    assert machine.row_outcomes.get(PASS, 0) >= examples, machine.row_outcomes


# Each store control shrinks to a conversation of a few events.
@pytest.mark.parametrize(
    "variant",
    [
        negative_controls.StoredNbytesCountsPacked,
        pytest.param(negative_controls.ExtractLendsItsColumns, marks=pytest.mark.slow),
        pytest.param(negative_controls.StoredRowTrimForgetsScales, marks=pytest.mark.slow),
        pytest.param(negative_controls.StoredCopySharesBuffers, marks=pytest.mark.slow),
    ],
    ids=lambda v: v.__name__,
)
def test_conversation_generator_finds_and_shrinks_store_bugs(variant, judged, tmp_path):
    broken = load_implementation(f"kvparity.impl.negative_controls:{variant.__name__}")
    machine = make_machine(broken, judged, tmp_path, base=ConversationMachine)
    with pytest.raises(AssertionError, match="replay with: kvparity replay"):
        generate(machine, settings=fuzz_settings(300, steps=6, database=None, derandomize=True,
                                                 print_blob=False))
    (path,) = tmp_path.glob("*.json")
    schedule = load(path)
    assert len(schedule.events) <= 6, f"not shrunk: {[e.label for e in schedule.events]}"
    replayed = run_l1(schedule, broken)
    assert judged(replayed).verdict == FAIL
    assert variant.caught_by in {d.check for d in replayed.divergences}
    assert judged(run_l1(schedule, load_implementation())).verdict == PASS


def test_the_collector_is_tuned_for_a_generated_run_only():
    """``fewer_collections`` changes the process's garbage collector: it must
    be as it was after the run, also when the run fails."""
    before = gc.get_threshold(), gc.get_freeze_count()
    with pytest.raises(RuntimeError):
        with fewer_collections():
            assert gc.get_threshold()[0] == YOUNG_THRESHOLD
            assert gc.get_freeze_count() > 0
            raise RuntimeError("a failing run")
    assert (gc.get_threshold(), gc.get_freeze_count()) == before


class MinimalMaskMissingForOneToken(MinimalBatchQuantizedKVCache):
    """The minimal cache (its extract's mx.contiguous leaves views: alias
    findings, hygiene) with no mask for one-token steps: gating."""

    def make_mask(self, N, return_array=False, **kwargs):
        return None if N == 1 else super().make_mask(N, return_array=return_array, **kwargs)


def test_a_generated_failure_leads_with_its_first_gating_divergence(judged, tmp_path):
    """Hygiene findings come first in time here (an alias after the first
    join); the failure's headline is the mask that gates, and says the alias
    after it, as not gating."""
    broken = load_implementation(f"{__name__}:MinimalMaskMissingForOneToken")
    machine = make_machine(broken, judged, tmp_path)
    with pytest.raises(AssertionError) as failed:
        generate(machine, settings=fuzz_settings(100, database=None, derandomize=True, print_blob=False))
    headline = str(failed.value).splitlines()[0]
    assert ": FAIL: mask: " in headline, headline
    assert "alias" not in headline.split("(also, not gating:")[0], headline

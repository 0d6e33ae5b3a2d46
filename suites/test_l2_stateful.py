"""L2 over generated schedules on the seeded random models: joins, leaves,
steps, verify windows (uneven where the cache supports it), extract/solo/
reinsert, rows crossing quantized_kv_start at different steps and prompts
past 256 tokens, each replayed through the model against the solo oracle."""

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.core.evidence import FAIL, PASS
from kvparity.suites.search.fuzz import ConversationMachine, generate, make_machine
from kvparity.suites.l2.run import run_l2
from kvparity.suites.core.loading import load

EXAMPLES = int(os.environ.get("KVPARITY_L2_FUZZ_EXAMPLES", "30"))


def fuzz_settings(examples, **overrides):
    # The machine writes its own replayable file: Hypothesis's line tracing of a failure is not needed.
    return settings(max_examples=examples, stateful_step_count=6, deadline=None,
                    suppress_health_check=list(HealthCheck), phases=[p for p in Phase if p != Phase.explain],
                    **overrides)


@pytest.mark.slow  # about 26 s on 2 cores (the README's test command stays near 2 min)
@pytest.mark.gqa_batched
def test_generated_schedules_at_l2(implementation, policy, judged, tmp_path):
    machine = make_machine(implementation, lambda r: judged(r, policy),
                           os.environ.get("KVPARITY_FOUND_DIR", tmp_path), level="L2", run_l2=run_l2)
    generate(machine, settings=fuzz_settings(EXAMPLES))
    assert machine.schedules_started >= EXAMPLES
    # Rows that leave before any batched call have no evidence, and are counted so.
    assert machine.row_outcomes.get(PASS, 0) >= EXAMPLES, machine.row_outcomes


@pytest.mark.slow
def test_generated_conversations_at_l2(implementation, policy, judged, tmp_path):
    """Chat turns and shared prefixes through the model: each resumed request
    against itself alone from mlx-lm's store holding the same entries."""
    examples = int(os.environ.get("KVPARITY_L2_CONVERSATION_EXAMPLES", "12"))
    machine = make_machine(implementation, lambda r: judged(r, policy), os.environ.get("KVPARITY_FOUND_DIR", tmp_path),
                           level="L2", run_l2=run_l2, base=ConversationMachine)
    generate(machine, settings=fuzz_settings(examples))
    assert machine.schedules_started >= examples
    assert machine.resumed >= examples // 4, "few generated requests joined from a stored prefix"
    assert machine.row_outcomes.get(PASS, 0) >= examples, machine.row_outcomes


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["RopeOffsetIgnoresLeftPadding", "MaskIgnoresLeftPadding"])
def test_l2_generator_finds_rope_and_mask_bugs(variant, judged, tmp_path):
    broken = load_implementation(f"kvparity.impl.negative_controls:{variant}")
    machine = make_machine(broken, judged, tmp_path, level="L2", run_l2=run_l2)
    with pytest.raises(AssertionError, match="replay with: kvparity replay"):
        generate(machine, settings=fuzz_settings(60, database=None, derandomize=True, print_blob=False))
    (path,) = tmp_path.glob("*.json")
    schedule = load(path)
    assert judged(run_l2(schedule, broken)).verdict == FAIL
    # The reference does not fail it (a shrunk schedule may leave a row without evidence).
    assert judged(run_l2(schedule, load_implementation())).verdict not in (FAIL, "refused")

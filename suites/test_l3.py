"""L3: mlx-lm's BatchGenerator (and engines plugged in through the adapter)
serve arrivals with the cache under test; every request must come out exactly
as it does alone through generate_step."""

import json

import pytest
from hypothesis import HealthCheck, given, settings

from kvparity.suites.adapter import load_implementation
from kvparity.suites.evidence import FAIL, PASS
from kvparity.suites.arrivals import catalog_paths, load, parse
from kvparity.suites.arrivals_strategy import arrival_documents, check_document
from kvparity.suites.engines import EngineError, load_engine_factory, quantized_row_class
from kvparity.suites.l3 import (
    FAILED,
    ORACLE_CANNOT_RUN,
    PASSED,
    UNSUPPORTED,
    explain,
    prefill_modes,
    run_l3,
    to_schedule_result,
)

PATHS = catalog_paths()
TEST_ENGINES = "kvparity.suites.l3_test_engines"
CONTROLS = "kvparity.impl.negative_controls"


def small(name="tiny", engine=None, **requests):
    doc = {"kind": "arrivals", "name": name, "model": "llama-h64-bf16", "kv": {"bits": 4, "group_size": 64},
           "requests": requests or {"a": {"arrival": 0, "prompt_len": 6, "max_tokens": 4},
                                    "b": {"arrival": 1, "prompt_len": 3, "max_tokens": 5, "seed": 1}}}
    if engine:
        doc["engine"] = engine
    return parse(doc, source=f"<{name}>")


def assert_passed(outcome):
    assert outcome.verdict == PASSED, explain(outcome)


# -- the catalog on mlx-lm's BatchGenerator ------------------------------------------


def test_catalog_covers_the_issue():
    names = {p.stem for p in PATHS}
    assert {"staggered", "burst-over-completion-batch", "finishing-at-different-times", "long-prompt-crosses-256",
            "prompt-length-1", "prefill-one-at-a-time", "engine-defaults"} <= names
    schedules = [load(p) for p in PATHS]
    assert any(max(r.prompt_len for r in s.requests.values()) > 256 for s in schedules)
    assert {r.bits for s in schedules for r in s.requests.values()} == {2, 3, 4, 5, 6, 8}


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_catalog_on_batch_generator(path, implementation):
    schedule = load(path)
    outcome = run_l3(schedule, implementation)
    assert_passed(outcome)
    for rid, request in schedule.requests.items():
        evidence = outcome.comparisons[rid]
        # every token and every full log-prob vector was compared
        assert evidence.tokens_compared == evidence.logprob_vectors_compared == request.max_tokens
    timeline = outcome.run.timeline
    assert sorted(r for s in timeline for r in s.finished) == sorted(schedule.requests)
    assert max(s.generation_width for s in timeline) <= outcome.run.settings["completion_batch_size"]


def test_burst_waits_for_free_rows(implementation):
    schedule = load(next(p for p in PATHS if p.stem == "burst-over-completion-batch"))
    outcome = run_l3(schedule, implementation)
    assert_passed(outcome)
    widths = [s.generation_width for s in outcome.run.timeline]
    assert max(widths) == 4 < len(schedule.requests)


@pytest.mark.parametrize("name", ["engine-defaults", "chunked-prefill-joiners"])
def test_both_prefill_modes_are_bit_exact(name, implementation):
    schedule = load(next(p for p in PATHS if p.stem == name))
    outcomes = {label: run_l3(variant, implementation) for label, variant in prefill_modes(schedule).items()}
    for outcome in outcomes.values():
        assert_passed(outcome)
    assert outcomes["prefill_batch_size=1"].batched_prefill_steps == 0
    assert outcomes["engine default"].batched_prefill_steps > 0  # several prompts in one padded call happened


def test_divergence_names_request_token_and_engine_step(judged):
    mask_bug = load_implementation(f"{CONTROLS}:MaskIgnoresLeftPadding")
    schedule = load(next(p for p in PATHS if p.stem == "staggered"))
    outcome = run_l3(schedule, mask_bug)
    assert outcome.verdict == FAILED
    judged_run = judged(to_schedule_result(outcome))
    assert judged_run.evidence.level == "L3" and judged_run.verdict == FAIL
    first = judged_run.evidence.divergences[0]
    assert first.request in schedule.requests
    assert first.check == "logprobs" and first.step is not None and "engine step" in first.event
    assert f"token {first.step} at engine step" in first.message()


# -- the engine adapter --------------------------------------------------------------


def test_serial_engine_passes(implementation):
    outcome = run_l3(small(), implementation, f"{TEST_ENGINES}:serial")
    assert_passed(outcome)
    assert outcome.run.timeline is None
    assert sum(c.logprob_vectors_compared for c in outcome.comparisons.values()) == 9


def test_chosen_logprob_engine_passes_on_values(implementation):
    outcome = run_l3(small(), implementation, f"{TEST_ENGINES}:chosen_logprob_only")
    assert_passed(outcome)
    assert [c.logprob_values_compared for c in outcome.comparisons.values()] == [4, 5]


def test_engine_dropping_a_last_token_fails(implementation, judged):
    result = to_schedule_result(run_l3(small(), implementation, f"{TEST_ENGINES}:drops_last_token"))
    assert judged(result).verdict == FAIL
    (divergence,) = result.divergences
    assert (divergence.check, divergence.request, divergence.step) == ("length", "a", 3)


def test_engine_swapping_outputs_fails(implementation, judged):
    result = to_schedule_result(run_l3(small(), implementation, f"{TEST_ENGINES}:swaps_outputs"))
    assert judged(result).verdict == FAIL
    assert {d.request for d in result.divergences} == {"a", "b"}
    assert all(d.step == 0 for d in result.divergences if d.check == "logprobs")


def test_bad_engine_spec_is_refused():
    for spec, reason in (("nodots", "expected"), ("kvparity.nothing_here:x", "cannot import"),
                         (f"{TEST_ENGINES}:missing", "has no")):
        with pytest.raises(EngineError, match=reason):
            load_engine_factory(spec)


def test_row_class_merges_into_the_batch_class(implementation):
    row = quantized_row_class(implementation.batch_class)(group_size=64, bits=4)
    assert row.size() == 0
    assert isinstance(type(row).merge([row]), implementation.batch_class)


def test_batch_generator_cannot_convert_late(implementation):
    schedule = small(a={"arrival": 0, "prompt_len": 9, "max_tokens": 4, "kv": {"quantized_kv_start": 4}})
    outcome = run_l3(schedule, implementation)
    assert outcome.verdict == UNSUPPORTED and "quantized_kv_start" in outcome.reason
    # an engine that does convert is compared with mlx-lm's delayed conversion
    assert_passed(run_l3(schedule, implementation, f"{TEST_ENGINES}:serial"))


def test_batch_generator_refuses_mixed_bit_widths(implementation):
    schedule = small(a={"arrival": 0, "prompt_len": 5, "max_tokens": 2},
                     b={"arrival": 0, "prompt_len": 5, "max_tokens": 2, "kv": {"bits": 8}})
    assert run_l3(schedule, implementation).verdict == UNSUPPORTED
    assert_passed(run_l3(schedule, implementation, f"{TEST_ENGINES}:serial"))


def test_oracle_that_cannot_run_is_never_a_pass(implementation, judged):
    # mlx-lm 0.32.2's QuantizedKVCache sizes its packed buffer as head_dim // (32 // bits):
    # wrong when bits does not divide 32 (6-bit, head_dim 128: 25 words for 24).
    doc = {"kind": "arrivals", "name": "six-bit-h128", "model": "llama-h128-f32", "kv": {"bits": 6, "group_size": 64},
           "requests": {"a": {"arrival": 0, "prompt_len": 4, "max_tokens": 2}}}
    calls_before = dict(implementation.calls)
    outcome = run_l3(parse(doc), implementation)
    assert outcome.verdict == ORACLE_CANNOT_RUN
    assert judged(to_schedule_result(outcome)).verdict != PASS
    # The oracle runs first: where it cannot, the engine is not asked (it rides the same path).
    assert outcome.run is None and implementation.calls_since(calls_before) == {}


def test_a_cache_that_refuses_a_required_member_is_refused_at_l3(judged):
    refuses = load_implementation(f"{CONTROLS}:RefusesUpdateAndFetch")
    result = to_schedule_result(run_l3(small(), refuses))
    assert judged(result).verdict == "refused" and "update_and_fetch" in result.reason


# -- negative controls ----------------------------------------------------------------

# Which controls L3 catches on the catalog, and for the rest, why not (tested
# below on the members BatchGenerator actually calls).
CAUGHT_AT_L3 = {"MaskIgnoresLeftPadding", "RopeOffsetIgnoresLeftPadding", "ExtendForgetsExistingPadding",
                "GrowthDropsTail"}


@pytest.mark.parametrize("control", ["MaskIgnoresLeftPadding", "RopeOffsetIgnoresLeftPadding"])
def test_negative_control_caught(control):
    outcome = run_l3(load(next(p for p in PATHS if p.stem == "engine-defaults")),
                     load_implementation(f"{CONTROLS}:{control}"))
    assert outcome.verdict == FAILED


def test_members_batch_generator_calls(implementation):
    from collections import Counter

    counts = Counter()
    for path in PATHS:
        if path.stem != "long-prompt-crosses-256":  # slow, and calls nothing the others do not
            outcome = run_l3(load(path), implementation)
            assert_passed(outcome)
            counts.update(outcome.members)
    # what it exercises ...
    for member in ("merge", "extend", "filter", "extract", "update_and_fetch", "make_mask", "prepare", "finalize"):
        assert counts[member] > 0, member
    # ... and what it never reaches: rollback and trim are never called.
    assert counts["trim"] == 0 and counts["rollback"] == 0


@pytest.mark.slow
def test_every_negative_control_on_the_catalog():
    from kvparity.impl.negative_controls import VARIANTS

    caught = set()
    for control in VARIANTS:
        implementation = load_implementation(f"{CONTROLS}:{control.__name__}")
        if any(run_l3(load(p), implementation).verdict != PASSED for p in PATHS):
            caught.add(control.__name__)
    # FilterKeepsSharedPadding only "fails" by raising on a batch without keys;
    # that is the control's own crash, not its padding bug.
    assert caught - {"FilterKeepsSharedPadding"} == CAUGHT_AT_L3


# -- generated arrivals -----------------------------------------------------------------


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=arrival_documents())
def test_generated_arrivals(doc, implementation, tmp_path_factory):
    check_document(doc, implementation, folder=tmp_path_factory.getbasetemp() / "found")


def test_failing_document_is_written_and_replays(tmp_path):
    mask_bug = load_implementation(f"{CONTROLS}:MaskIgnoresLeftPadding")
    doc = {"kind": "arrivals", "name": "two-rows", "model": "llama-h64-bf16", "kv": {"bits": 4, "group_size": 64},
           "requests": {"r0": {"arrival": 0, "prompt_len": 13, "max_tokens": 1},
                        "r1": {"arrival": 0, "prompt_len": 2, "max_tokens": 1, "seed": 1}}}
    with pytest.raises(AssertionError, match="written to"):
        check_document(doc, mask_bug, folder=tmp_path)
    (found,) = tmp_path.glob("*.json")
    assert run_l3(load(found), mask_bug).verdict == FAILED
    check_document(doc, load_implementation(), folder=tmp_path / "reference")  # the reference passes it
    assert not (tmp_path / "reference").exists()


@pytest.mark.slow
def test_generated_arrivals_find_and_write_a_bug(tmp_path):
    mask_bug = load_implementation(f"{CONTROLS}:MaskIgnoresLeftPadding")

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(doc=arrival_documents(max_requests=3))
    def search(doc):
        check_document(doc, mask_bug, folder=tmp_path)

    with pytest.raises(AssertionError, match="written to"):
        search()
    (found,) = tmp_path.glob("*.json")
    doc = json.loads(found.read_text())
    assert run_l3(parse(doc, str(found)), mask_bug).verdict == FAILED  # replays
    assert len(doc["requests"]) >= 2  # shrunk, yet a left-padding bug needs two rows

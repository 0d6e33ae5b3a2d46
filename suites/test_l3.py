"""L3: mlx-lm's BatchGenerator (and engines plugged in through the adapter)
serve arrivals with the cache under test; every request must come out exactly
as it does alone through generate_step."""

import inspect
import json

import pytest
from hypothesis import HealthCheck, given, settings
from mlx_lm.generate import BatchGenerator

from kvparity.suites.adapter import load_implementation
from kvparity.suites.checks import CHECKS
from kvparity.suites.evidence import FAIL, NOT_SUPPORTED, ORACLE_CANNOT_RUN, PASS, REFUSED
from kvparity.suites.arrivals import catalog_paths, load, parse
from kvparity.suites.arrivals_strategy import arrival_documents, check_document
from kvparity.suites.engines import EngineError, load_engine_factory, quantized_row_class
from kvparity.suites.l3 import explain, prefill_modes, run_l3

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


def assert_passed(judged):
    """The evidence of a judged run that passed."""
    assert judged.verdict == PASS, explain(judged)
    return judged.evidence


def completion_batch_size(schedule) -> int:
    default = inspect.signature(BatchGenerator).parameters["completion_batch_size"].default
    return schedule.engine.completion_batch_size or default


# -- the catalog on mlx-lm's BatchGenerator ------------------------------------------


def test_catalog_covers_the_issue():
    names = {p.stem for p in PATHS}
    assert {"staggered", "burst-over-completion-batch", "finishing-at-different-times", "long-prompt-crosses-256",
            "prompt-length-1", "prefill-one-at-a-time", "engine-defaults"} <= names
    schedules = [load(p) for p in PATHS]
    assert any(max(r.prompt_len for r in s.requests.values()) > 256 for s in schedules)
    assert {r.bits for s in schedules for r in s.requests.values()} == {2, 3, 4, 5, 6, 8}


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
@pytest.mark.gqa_batched
def test_catalog_on_batch_generator(path, implementation, judged):
    schedule = load(path)
    result = assert_passed(judged(run_l3(schedule, implementation)))
    for row in result.rows:
        # every token and every full log-prob vector was compared
        assert (row.compared("tokens") == row.compared("logprobs") == row.metrics["log-prob vectors compared"]
                == schedule.requests[row.request].max_tokens)
    timeline = result.timeline
    assert sorted(r for s in timeline for r in s["finished"]) == sorted(schedule.requests)
    assert max(s["generation_width"] for s in timeline) <= completion_batch_size(schedule)


@pytest.mark.gqa_batched
def test_burst_waits_for_free_rows(implementation, judged):
    schedule = load(next(p for p in PATHS if p.stem == "burst-over-completion-batch"))
    result = assert_passed(judged(run_l3(schedule, implementation)))
    widths = [s["generation_width"] for s in result.timeline]
    assert max(widths) == 4 < len(schedule.requests)


@pytest.mark.parametrize("name", ["engine-defaults", "chunked-prefill-joiners"])
@pytest.mark.gqa_batched
def test_both_prefill_modes_are_bit_exact(name, implementation, judged):
    schedule = load(next(p for p in PATHS if p.stem == name))
    results = {label: assert_passed(judged(run_l3(variant, implementation)))
               for label, variant in prefill_modes(schedule).items()}
    batched = {label: sum(s["prompt_width"] >= 2 for s in r.timeline) for label, r in results.items()}
    assert batched["prefill_batch_size=1"] == 0
    assert batched["engine default"] > 0  # several prompts in one padded call happened


@pytest.mark.gqa_batched
def test_divergence_names_request_token_and_engine_step(judged):
    mask_bug = load_implementation(f"{CONTROLS}:MaskIgnoresLeftPadding")
    schedule = load(next(p for p in PATHS if p.stem == "staggered"))
    result = run_l3(schedule, mask_bug)
    assert result.level == "L3" and judged(result).verdict == FAIL
    first = result.divergences[0]
    assert first.request in schedule.requests
    assert first.check == "logprobs" and first.step is not None and "engine step" in first.event
    assert f"token {first.step} at engine step" in first.message()


# -- the engine adapter --------------------------------------------------------------


@pytest.mark.gqa_batched
def test_serial_engine_passes(implementation, judged):
    result = assert_passed(judged(run_l3(small(), implementation, f"{TEST_ENGINES}:serial")))
    assert result.timeline == []
    assert sum(row.metrics["log-prob vectors compared"] for row in result.rows) == 9


@pytest.mark.gqa_batched
def test_chosen_logprob_engine_passes_on_values(implementation, judged):
    result = assert_passed(judged(run_l3(small(), implementation, f"{TEST_ENGINES}:chosen_logprob_only")))
    assert [row.metrics["log-prob values compared"] for row in result.rows] == [4, 5]
    assert [row.compared("logprobs") for row in result.rows] == [4, 5]  # values are log-prob evidence too


@pytest.mark.gqa_batched
def test_engine_dropping_a_last_token_fails(implementation, judged):
    result = run_l3(small(), implementation, f"{TEST_ENGINES}:drops_last_token")
    assert judged(result).verdict == FAIL
    (divergence,) = result.divergences
    assert (divergence.check, divergence.request, divergence.step) == ("length", "a", 3)
    # noted under declared checks only, the divergence under its own
    assert {c for row in result.rows for at in row.counts.values() for c in at} == {"tokens", "logprobs", "length"}
    assert set(CHECKS) >= {"tokens", "logprobs", "length"}


@pytest.mark.gqa_batched
def test_engine_swapping_outputs_fails(implementation, judged):
    result = run_l3(small(), implementation, f"{TEST_ENGINES}:swaps_outputs")
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


@pytest.mark.gqa_batched
def test_batch_generator_cannot_convert_late(implementation, judged):
    schedule = small(a={"arrival": 0, "prompt_len": 9, "max_tokens": 4, "kv": {"quantized_kv_start": 4}})
    result = run_l3(schedule, implementation)
    assert judged(result).verdict == NOT_SUPPORTED and "quantized_kv_start" in result.reason
    # an engine that does convert is compared with mlx-lm's delayed conversion
    assert_passed(judged(run_l3(schedule, implementation, f"{TEST_ENGINES}:serial")))


@pytest.mark.gqa_batched
def test_batch_generator_refuses_mixed_bit_widths(implementation, judged):
    schedule = small(a={"arrival": 0, "prompt_len": 5, "max_tokens": 2},
                     b={"arrival": 0, "prompt_len": 5, "max_tokens": 2, "kv": {"bits": 8}})
    assert judged(run_l3(schedule, implementation)).verdict == NOT_SUPPORTED
    assert_passed(judged(run_l3(schedule, implementation, f"{TEST_ENGINES}:serial")))


@pytest.mark.gqa_batched
def test_oracle_that_cannot_run_is_never_a_pass(implementation, judged):
    # mlx-lm 0.32.2's QuantizedKVCache sizes its packed buffer as head_dim // (32 // bits):
    # wrong when bits does not divide 32 (6-bit, head_dim 128: 25 words for 24).
    doc = {"kind": "arrivals", "name": "six-bit-h128", "model": "llama-h128-f32", "kv": {"bits": 6, "group_size": 64},
           "requests": {"a": {"arrival": 0, "prompt_len": 4, "max_tokens": 2}}}
    calls_before = dict(implementation.calls)
    result = run_l3(parse(doc), implementation)
    assert judged(result).verdict == ORACLE_CANNOT_RUN
    # The oracle runs first: where it cannot, the engine is not asked (it rides the same path).
    assert result.members == {} and implementation.calls_since(calls_before) == {}


@pytest.mark.gqa_batched
def test_a_cache_that_refuses_a_required_member_is_refused_at_l3(judged):
    refuses = load_implementation(f"{CONTROLS}:RefusesUpdateAndFetch")
    result = run_l3(small(), refuses)
    assert judged(result).verdict == REFUSED and "update_and_fetch" in result.reason


# -- negative controls ----------------------------------------------------------------

# Which controls L3 catches on the catalog, and for the rest, why not (tested
# below on the members BatchGenerator actually calls).
CAUGHT_AT_L3 = {"MaskIgnoresLeftPadding", "RopeOffsetIgnoresLeftPadding", "ExtendForgetsExistingPadding",
                "GrowthDropsTail"}


@pytest.mark.parametrize("control", ["MaskIgnoresLeftPadding", "RopeOffsetIgnoresLeftPadding"])
@pytest.mark.gqa_batched
def test_negative_control_caught(control, judged):
    result = judged(run_l3(load(next(p for p in PATHS if p.stem == "engine-defaults")),
                           load_implementation(f"{CONTROLS}:{control}")))
    assert result.verdict == FAIL


@pytest.mark.gqa_batched
def test_members_batch_generator_calls(implementation, judged):
    from collections import Counter

    counts = Counter()
    for path in PATHS:
        if path.stem != "long-prompt-crosses-256":  # slow, and calls nothing the others do not
            counts.update(assert_passed(judged(run_l3(load(path), implementation))).members)
    # what it exercises ...
    for member in ("merge", "extend", "filter", "extract", "update_and_fetch", "make_mask", "prepare", "finalize"):
        assert counts[member] > 0, member
    # ... and what it never reaches: rollback and trim are never called.
    assert counts["trim"] == 0 and counts["rollback"] == 0


@pytest.mark.slow
def test_every_negative_control_on_the_catalog(judged):
    from kvparity.impl.negative_controls import VARIANTS

    caught = set()
    for control in VARIANTS:
        implementation = load_implementation(f"{CONTROLS}:{control.__name__}")
        if any(judged(run_l3(load(p), implementation)).verdict != PASS for p in PATHS):
            caught.add(control.__name__)
    # FilterKeepsSharedPadding only "fails" by raising on a batch without keys;
    # that is the control's own crash, not its padding bug.
    assert caught - {"FilterKeepsSharedPadding"} == CAUGHT_AT_L3


# -- generated arrivals -----------------------------------------------------------------


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=arrival_documents())
@pytest.mark.gqa_batched
def test_generated_arrivals(doc, implementation, judged, tmp_path_factory):
    check_document(doc, implementation, judged, folder=tmp_path_factory.getbasetemp() / "found")


@pytest.mark.gqa_batched
def test_failing_document_is_written_and_replays(tmp_path, judged):
    mask_bug = load_implementation(f"{CONTROLS}:MaskIgnoresLeftPadding")
    doc = {"kind": "arrivals", "name": "two-rows", "model": "llama-h64-bf16", "kv": {"bits": 4, "group_size": 64},
           "requests": {"r0": {"arrival": 0, "prompt_len": 13, "max_tokens": 1},
                        "r1": {"arrival": 0, "prompt_len": 2, "max_tokens": 1, "seed": 1}}}
    with pytest.raises(AssertionError, match="written to"):
        check_document(doc, mask_bug, judged, folder=tmp_path)
    (found,) = tmp_path.glob("*.json")
    assert judged(run_l3(load(found), mask_bug)).verdict == FAIL
    check_document(doc, load_implementation(), judged, folder=tmp_path / "reference")  # the reference passes it
    assert not (tmp_path / "reference").exists()


@pytest.mark.slow
def test_generated_arrivals_find_and_write_a_bug(tmp_path, judged):
    mask_bug = load_implementation(f"{CONTROLS}:MaskIgnoresLeftPadding")

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(doc=arrival_documents(max_requests=3))
    def search(doc):
        check_document(doc, mask_bug, judged, folder=tmp_path)

    with pytest.raises(AssertionError, match="written to"):
        search()
    (found,) = tmp_path.glob("*.json")
    doc = json.loads(found.read_text())
    assert judged(run_l3(parse(doc, str(found)), mask_bug)).verdict == FAIL  # replays
    assert len(doc["requests"]) >= 2  # shrunk, yet a left-padding bug needs two rows

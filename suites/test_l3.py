"""L3: mlx-lm's BatchGenerator (and engines plugged in through the adapter)
serve arrivals with the cache under test; every request must come out exactly
as it does alone through generate_step. What L3 catches on kvparity's own
broken caches, and what it refuses before anything runs, is in
test_l3_controls.py, which gates nothing."""

import inspect

import pytest
from hypothesis import HealthCheck, given, settings
from mlx_lm.generate import BatchGenerator

from kvparity.suites.format.checks import CHECKS
from kvparity.oracle import generation
from kvparity.oracle.mlx_lm_versions import first_write_breaks
from kvparity.suites.core.evidence import FAIL, MLX_LM_DEFECT, NOT_SUPPORTED, ORACLE_CANNOT_RUN, PASS
from kvparity.suites.format.arrivals import catalog_paths, load, parse
from kvparity.suites.search.arrivals_strategy import arrival_documents, check_document, conversation_documents
from kvparity.suites.l3.engines import quantized_row_class
from kvparity.suites.l3.trail import FROM_STORE
from kvparity.suites.l3.judging import explain
from kvparity.suites.l3.run import prefill_modes, run_l3

PATHS = catalog_paths()
CONVERSATIONS = [p for p in PATHS if load(p).conversation]
TEST_ENGINES = "kvparity.suites.l3.engines_for_tests"


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
    # conversations: several users with several turns sharing a system prompt, a trim, store limits
    assert {"chat-shared-system-prompt", "stored-prompt-longer", "prompt-cache-evicts"} <= names
    assert any(s.system and len({r.id for r in s.requests.values() if r.system}) >= 3
               and sum(r.continues is not None for r in s.requests.values()) >= 3 for s in schedules)
    assert any(s.engine.prompt_cache_bytes for s in schedules)


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
    if schedule.conversation:  # turns started from stored entries, and the oracle from the same ones
        started = {r for s in timeline for r in s["from_store"]}
        assert started and {row.request for row in result.rows if row.metrics[FROM_STORE] > 0} == started


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


@pytest.mark.gqa_batched
def test_batch_generator_runs_a_quantized_cache_in_every_layer(implementation, judged):
    result = assert_passed(judged(run_l3(small(), implementation)))
    # the rows of the first step that generated a token, one comparison per layer
    assert sorted(row.compared("quantized") for row in result.rows) in ([0, 2], [2, 2])


@pytest.mark.gqa_batched
def test_engine_keeping_a_layer_bf16_fails_the_quantized_check(implementation, judged):
    result = run_l3(small(), implementation, f"{TEST_ENGINES}:keeps_last_layer_bf16")
    assert judged(result).verdict == FAIL
    found = [d for d in result.divergences if d.check == "quantized"]
    assert found and {(d.layer, d.tensor) for d in found} == {(1, "keys"), (1, "values")}
    assert ("layer 1 holds a BatchKVCache whose keys are an unquantized bfloat16 array"
            in found[0].message()), found[0].message()
    assert "triples of 4 bits, group size 64 at key dim 64 were asked for" in found[0].message()


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
def test_mlx_lm_first_write_defect_is_never_a_pass(implementation, judged):
    # mlx-lm 0.32.2's QuantizedKVCache sizes its packed buffer as head_dim // (32 // bits):
    # wrong when bits does not divide 32 (6-bit, head_dim 128: 25 words for 24).
    doc = {"kind": "arrivals", "name": "six-bit-h128", "model": "llama-h128-f32", "kv": {"bits": 6, "group_size": 64},
           "requests": {"a": {"arrival": 0, "prompt_len": 4, "max_tokens": 2}}}
    calls_before = dict(implementation.calls)
    result = run_l3(parse(doc), implementation)
    if first_write_breaks(6, 64, 128):
        assert judged(result).verdict == MLX_LM_DEFECT
        assert "quantized-kv-first-write-width" in result.reason and "dims 128" in result.reason
        # Where mlx-lm's own path cannot run, the engine is not asked (it rides the same path).
        assert result.members == {} and implementation.calls_since(calls_before) == {}
    else:  # an mlx-lm without the defect: the run is judged
        assert judged(result).verdict == PASS


@pytest.mark.gqa_batched
def test_oracle_that_cannot_run_is_never_a_pass(implementation, judged, monkeypatch):
    def raises(model, request):
        raise ValueError("no kernel for this shape")

    monkeypatch.setattr(generation, "generate_alone", raises)
    calls_before = dict(implementation.calls)
    result = run_l3(small(), implementation, use_cache=False)
    assert judged(result).verdict == ORACLE_CANNOT_RUN and "no kernel for this shape" in result.reason
    # The oracle runs first: where it cannot, the engine is not asked (it rides the same path).
    assert result.members == {} and implementation.calls_since(calls_before) == {}


# -- the members BatchGenerator calls -------------------------------------------------


@pytest.mark.gqa_batched
def test_members_batch_generator_calls(implementation, judged):
    from collections import Counter

    counts = Counter()
    for path in PATHS:
        # long-prompt-crosses-256 is slow and calls nothing the others do not;
        # conversations add only merges of filled rows (test_conversation_* below)
        if path.stem != "long-prompt-crosses-256" and path not in CONVERSATIONS:
            counts.update(assert_passed(judged(run_l3(load(path), implementation))).members)
    # what it exercises ...
    for member in ("merge", "extend", "filter", "extract", "update_and_fetch", "make_mask", "prepare", "finalize"):
        assert counts[member] > 0, member
    # ... and what it never reaches: rollback and trim are never called.
    assert counts["trim"] == 0 and counts["rollback"] == 0


# -- generated arrivals -----------------------------------------------------------------


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=arrival_documents())
@pytest.mark.gqa_batched
def test_generated_arrivals(doc, implementation, judged, tmp_path_factory):
    check_document(doc, implementation, judged, folder=tmp_path_factory.getbasetemp() / "found")


# -- conversations: mlx-lm's server loop and its prompt cache ---------------------------


TRIM = next(p for p in CONVERSATIONS if p.stem == "stored-prompt-longer")


@pytest.mark.gqa_batched
def test_stored_prompts_longer_than_the_new_one_are_trimmed_by_mlx_lm(implementation, judged):
    result = assert_passed(judged(run_l3(load(TRIM), implementation)))
    # 'long' stores its prompt less its last token (15 tokens) when its prefill
    # ends: 'exact' is that prompt (an exact hit gives back one token to feed),
    # 'prefix' its first 9 tokens (trimmed to 8), 'branch' shares 12.
    assert {row.request: row.metrics[FROM_STORE] for row in result.rows} == {
        "long": 0, "exact": 14, "prefix": 8, "branch": 12}
    assert all("from stored entry #0 (user, 15 tokens of 'long'" in row.metrics["oracle"]
               for row in result.rows if row.request != "long")


@pytest.mark.gqa_batched
def test_a_stored_entry_that_changes_after_storing_fails(implementation, judged):
    # The oracle starts from the bytes as they were stored, not as fetched.
    result = run_l3(load(TRIM), implementation, f"{TEST_ENGINES}:stored_entries_change")
    assert judged(result).verdict == FAIL
    assert {d.request for d in result.divergences} == {"exact", "prefix", "branch"}


@pytest.mark.gqa_batched
def test_an_engine_without_conversations_is_not_supported(implementation, judged):
    result = run_l3(load(TRIM), implementation, f"{TEST_ENGINES}:serial")
    assert judged(result).verdict == NOT_SUPPORTED and "serves_conversations" in result.reason


@pytest.mark.slow
@pytest.mark.parametrize("path", CONVERSATIONS, ids=[p.stem for p in CONVERSATIONS])
def test_conversations_in_both_prefill_modes(path, implementation, judged):
    for variant in prefill_modes(load(path)).values():
        assert_passed(judged(run_l3(variant, implementation)))


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=conversation_documents())
def test_generated_conversations(doc, implementation, judged, tmp_path_factory):
    check_document(doc, implementation, judged, folder=tmp_path_factory.getbasetemp() / "found")

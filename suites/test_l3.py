"""L3: mlx-lm's BatchGenerator (and engines plugged in through the adapter)
serve arrivals with the cache under test; every request must come out exactly
as it does alone through generate_step."""

import copy
import inspect
import json

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache

from kvparity.impl.batch_quantized import BatchQuantizedKVCache
from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.format.checks import CHECKS, EXTRACT
from kvparity.oracle import generation
from kvparity.oracle.mlx_lm_versions import first_write_breaks
from kvparity.suites.core.evidence import FAIL, MLX_LM_DEFECT, NOT_SUPPORTED, ORACLE_CANNOT_RUN, PASS, REFUSED
from kvparity.suites.format.arrivals import catalog_paths, load, parse
from kvparity.suites.format.errors import ScheduleError
from kvparity.suites.search.arrivals_strategy import (arrival_documents, check_document, conversation_documents,
                                               no_idle_arrivals)
from kvparity.suites.l3.engines import EngineError, load_engine_factory, quantized_row_class
from kvparity.suites.l3.trail import FROM_STORE
from kvparity.suites.l3.judging import explain
from kvparity.suites.l3.run import prefill_modes, run_l3

PATHS = catalog_paths()
CONVERSATIONS = [p for p in PATHS if load(p).conversation]
TEST_ENGINES = "kvparity.suites.l3.engines_for_tests"
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


@pytest.mark.gqa_batched
def test_a_cache_that_refuses_a_required_member_is_refused_at_l3(judged):
    refuses = load_implementation(f"{CONTROLS}:RefusesUpdateAndFetch")
    result = run_l3(small(), refuses)
    assert judged(result).verdict == REFUSED and "update_and_fetch" in result.reason


# -- negative controls ----------------------------------------------------------------

# Which controls L3 catches on the catalog, and for the rest, why not (tested
# below on the members BatchGenerator actually calls).
CAUGHT_AT_L3 = {"MaskIgnoresLeftPadding", "RopeOffsetIgnoresLeftPadding", "ExtendForgetsExistingPadding",
                "GrowthDropsTail", "FilterSharedPaddingOffByOne", "FilterKeepsAMarginColumn",
                # only with conversations: merge then sees filled rows of different
                # lengths, and a row extracted into the store keeps decoding
                "LeftPaddingOffByOne", "MergeRequantizes", "ExtractWritesTheBatch",
                # BatchGenerator decodes one token a step, and its batched prefill merges empty rows
                "MaskUnmaskedForOneToken", "MergeOfEmptyRowsTakesDefaults",
                # BatchGenerator extends a prompt batch holding tokens with rows merged fresh (_make_batch)
                "ExtendPadsNoEmptyJoiners"}


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
        # long-prompt-crosses-256 is slow and calls nothing the others do not;
        # conversations add only merges of filled rows (test_conversation_* below)
        if path.stem != "long-prompt-crosses-256" and path not in CONVERSATIONS:
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


@settings(max_examples=1000, deadline=None)
@given(doc=st.one_of(arrival_documents(), conversation_documents()))
def test_every_generated_document_is_one_parse_accepts(doc):
    """The strategies generate only what a file may hold: what they find is
    then the engine's or the cache's, never a refusal of the input."""
    parse(doc, source="<generated arrivals>")


def test_a_generated_arrival_comes_while_the_requests_can_fill_the_steps():
    """One request of a one-token prompt and answer fills 3 steps: an
    arrival drawn at 6 is brought to 3, which parse accepts (a later one it
    refuses, as it refused the slow test's generated r0 at step 4)."""
    doc = {"kind": "arrivals", "name": "late", "model": "llama-h64-bf16", "kv": {"bits": 4, "group_size": 64},
           "requests": {"r0": {"arrival": 6, "prompt_len": 1, "max_tokens": 1, "seed": 0}}}
    with pytest.raises(ScheduleError, match="later than the 3 steps"):
        parse(copy.deepcopy(doc))
    doc["requests"] = no_idle_arrivals(doc["requests"])
    assert doc["requests"]["r0"]["arrival"] == 3
    parse(doc)


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


# -- conversations: mlx-lm's server loop and its prompt cache ---------------------------


class MergeReadsRowBufferLength(BatchQuantizedKVCache):
    """merge takes a filled row's length from its key buffer, not its offset:
    right for every row BatchGenerator makes (empty, or exactly sized by
    extract), wrong for a stored row that mlx-lm trimmed (the buffer keeps the
    trimmed tokens). Caught only where a stored prompt is longer than the new one."""

    @classmethod
    def merge(cls, caches):
        rows = []
        for cache in caches:
            row = copy.copy(cache)
            if cache.keys is not None:
                row.offset = cache.keys[0].shape[-2]
            rows.append(row)
        return super().merge(rows)


class ExtractDequantizes(BatchQuantizedKVCache):
    """extract hands out the row dequantized, in mlx-lm's ``KVCache``, and
    merge quantizes such rows again (at the trim file's 5 bits, group 64): it
    serves stored rows that mlx-lm's ``QuantizedKVCache`` cannot hold as they
    were stored."""

    def extract(self, idx):
        row = super().extract(idx)
        cache = KVCache()
        cache.keys, cache.values = (mx.dequantize(*triple, group_size=self.group_size, bits=self.bits)
                                    for triple in (row.keys, row.values))
        cache.offset = row.offset
        return cache

    @classmethod
    def merge(cls, caches):
        return super().merge([c.to_quantized(group_size=64, bits=5) if isinstance(c, KVCache) else c
                              for c in caches])


THIS_MODULE = "kvparity.suites.test_l3"
TRIM = next(p for p in CONVERSATIONS if p.stem == "stored-prompt-longer")


def conversation(*edits):
    """A valid two-turn conversation, with ``(path, value)`` edits (value
    None: the key removed)."""
    doc = {"kind": "arrivals", "name": "turns", "engine": {"prompt_cache_size": 4},
           "system": {"prompt_len": 5},
           "requests": {"a": {"arrival": 0, "system": True, "prompt_len": 3, "max_tokens": 2},
                        "a2": {"continues": "a", "arrival": 0, "prompt_len": 2, "max_tokens": 2}}}
    for path, value in edits:
        *parents, key = path
        target = doc
        for parent in parents:
            target = target[parent]
        if value is None:
            del target[key]
        else:
            target[key] = value
    return doc


A, A2 = ("requests", "a"), ("requests", "a2")


@pytest.mark.parametrize("edits, message", [
    ([(A2 + ("continues",), "zz")], "request 'a2' continues: no request 'zz'"),
    ([(A2 + ("continues",), 3)], "request 'a2' continues: expected a request id"),
    ([(A + ("continues",), "a2"), (A + ("system",), None)],
     "request 'a' continues: turns continue each other in a cycle: a -> a2 -> a"),
    ([(A2 + ("kv",), {"bits": 8})], "request 'a2' kv: differs from 'a', which it continues"),
    ([(A2 + ("system",), True)], "request 'a2' system: a turn that continues another already starts with its prompt"),
    ([(A + ("system",), "yes")], "request 'a' system: expected true or false"),
    ([(A + ("stream",), 1)], "request 'a' stream: expected true or false"),
    ([(("system",), None)], "request 'a' system: the file has no \"system\" prompt"),
    ([(("system", "size"), 1)], "system: unknown field 'size'"),
    ([(("system", "prompt_len"), None)], "system: give exactly one of prompt_len, prompt"),
    ([(("engine", "prompt_cache_size"), None)],
     "request 'a2' continues: a conversation needs engine.prompt_cache_size"),
    ([(("engine", "prompt_cache_size"), None), (("engine", "prompt_cache_bytes"), 100)],
     "engine.prompt_cache_bytes: needs engine.prompt_cache_size"),
    ([(("engine", "prompt_cache_size"), 0)], "engine.prompt_cache_size: expected an integer >= 1"),
])
def test_bad_conversation_files_are_refused_before_anything_runs(edits, message):
    with pytest.raises(ScheduleError) as error:
        parse(conversation(*edits), source="chat.json")
    assert str(error.value).startswith(f"chat.json: {message}"), str(error.value)
    parse(conversation(), source="chat.json")  # the unchanged file is valid


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
def test_merge_that_reads_a_row_buffer_fails_on_trimmed_entries(judged):
    broken = load_implementation(f"{THIS_MODULE}:MergeReadsRowBufferLength")
    result = run_l3(load(TRIM), broken)
    assert judged(result).verdict == FAIL
    # every request whose stored entry mlx-lm trimmed, and only those
    assert {d.request for d in result.divergences} == {"exact", "prefix", "branch"}
    first = next(d for d in result.divergences if d.request == "prefix")
    assert "#0 serve, engine step" in first.event
    assert "from stored entry #0 (user, 15 tokens of 'long', step 0): 8 prompt tokens" in first.message()


@pytest.mark.gqa_batched
def test_a_stored_entry_that_changes_after_storing_fails(implementation, judged):
    # The oracle starts from the bytes as they were stored, not as fetched.
    result = run_l3(load(TRIM), implementation, f"{TEST_ENGINES}:stored_entries_change")
    assert judged(result).verdict == FAIL
    assert {d.request for d in result.divergences} == {"exact", "prefix", "branch"}


@pytest.mark.gqa_batched
def test_a_stored_entry_that_is_no_quantized_cache_fails_under_extract(judged):
    result = run_l3(load(TRIM), load_implementation(f"{THIS_MODULE}:ExtractDequantizes"))
    assert judged(result).verdict == FAIL
    assert {(d.check, d.request) for d in result.divergences} == {
        ("extract", "exact"), ("extract", "prefix"), ("extract", "branch")}
    prefix = next(d for d in result.divergences if d.request == "prefix")
    assert ("stored entry #0 (user, 15 tokens of 'long', step 0), which 'prefix' started from, is no solo "
            "QuantizedKVCache: layer 0 is a KVCache") in prefix.message()


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


@pytest.mark.slow
def test_generated_conversations_find_a_merge_that_reads_a_trimmed_row(tmp_path, judged):
    broken = load_implementation(f"{THIS_MODULE}:MergeReadsRowBufferLength")

    # A trimmed entry needs two first turns sharing the system prompt: always give one.
    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(doc=conversation_documents(max_users=2, max_turns=2, system_lengths=st.integers(8, 30)))
    def search(doc):
        check_document(doc, broken, judged, folder=tmp_path)

    with pytest.raises(AssertionError, match="written to"):
        search()
    (found,) = tmp_path.glob("*.json")
    doc = json.loads(found.read_text())
    result = run_l3(parse(doc, str(found)), broken)
    assert judged(result).verdict == FAIL  # replays
    # Only rows started from the store diverge: in their tokens (said so), and in
    # the entries extract stored from them (the merge damaged the row it held).
    from_store = {row.request for row in result.rows if row.metrics[FROM_STORE] > 0}
    assert any("from stored entry" in d.message() for d in result.divergences)
    assert all(d.request in from_store and ("from stored entry" in d.message() or d.check == EXTRACT)
               for d in result.divergences), [d.message() for d in result.divergences]

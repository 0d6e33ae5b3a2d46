"""What L3 catches and refuses, shown on kvparity's own caches and engines
rather than the implementation under test: the negative controls, and caches
broken only where conversations reach them, fail naming the request, the token
and the engine step; a cache refusing a member is refused; bad engine names and
conversation files are refused before anything runs; the generated-arrival search
finds a bug and writes a file that replays. (What gates the implementation under
test at L3 is ``test_l3.py``, a gate module; this one is not.)"""

import copy
import json

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

from kvparity.impl.batch_quantized import BatchQuantizedKVCache
from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.format.checks import EXTRACT
from kvparity.suites.core.evidence import FAIL, PASS, REFUSED
from kvparity.suites.format.arrivals import load, parse
from kvparity.suites.format.errors import ScheduleError
from kvparity.suites.search.arrivals_strategy import (arrival_documents, check_document, conversation_documents,
                                               no_idle_arrivals)
from kvparity.suites.l3.engines import EngineError, load_engine_factory
from kvparity.suites.l3.trail import FROM_STORE
from kvparity.suites.l3.run import run_l3
from kvparity.suites.test_l3 import PATHS, TEST_ENGINES, TRIM, small

CONTROLS = "kvparity.impl.negative_controls"


# -- a divergence, a refusal, a bad engine name ---------------------------------------


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


@pytest.mark.gqa_batched
def test_a_cache_that_refuses_a_required_member_is_refused_at_l3(judged):
    refuses = load_implementation(f"{CONTROLS}:RefusesUpdateAndFetch")
    result = run_l3(small(), refuses)
    assert judged(result).verdict == REFUSED and "update_and_fetch" in result.reason


def test_bad_engine_spec_is_refused():
    for spec, reason in (("nodots", "expected"), ("kvparity.nothing_here:x", "cannot import"),
                         (f"{TEST_ENGINES}:missing", "has no")):
        with pytest.raises(EngineError, match=reason):
            load_engine_factory(spec)


# -- negative controls ----------------------------------------------------------------

# Which controls L3 catches on the catalog, and for the rest, why not (tested
# in test_l3.py on the members BatchGenerator actually calls).
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


# -- conversations: caches broken where mlx-lm's prompt cache reaches them, bad files ---


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


THIS_MODULE = "kvparity.suites.test_l3_controls"


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
def test_a_stored_entry_that_is_no_quantized_cache_fails_under_extract(judged):
    result = run_l3(load(TRIM), load_implementation(f"{THIS_MODULE}:ExtractDequantizes"))
    assert judged(result).verdict == FAIL
    assert {(d.check, d.request) for d in result.divergences} == {
        ("extract", "exact"), ("extract", "prefix"), ("extract", "branch")}
    prefix = next(d for d in result.divergences if d.request == "prefix")
    assert ("stored entry #0 (user, 15 tokens of 'long', step 0), which 'prefix' started from, is no solo "
            "QuantizedKVCache: layer 0 is a KVCache") in prefix.message()


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

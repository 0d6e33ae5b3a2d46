"""The serial oracle is mlx-lm: it equals generate_step token for token and
log-probability for log-probability, bit for bit."""

import json

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kvparity.oracle.models import load_model
from kvparity.suites.core.compare import first_difference
from kvparity.oracle.generation import GENERATION_FILE, cached_generate_alone, generate_alone, generation_key
from kvparity.oracle.solo import greedy, log_probs, prompt_tokens, run_solo
from kvparity.oracle.trace import TraceError, load_trace, save_trace
from kvparity.oracle.arrays import Reading, digest, owned_arrays
from kvparity.oracle.solo_cache import SoloCache
from kvparity.oracle.synthetic import LayerShape, SyntheticKV
from kvparity.suites.l1.solo import SoloStates, layer_parts
from kvparity.suites.format.schedule import Request
from kvparity.suites.core.loading import parse

TOKENS = 10


def solo_schedule(prompt_len, start, step_size, bits=4, group_size=64):
    return parse(
        {
            "name": "solo",
            "levels": ["L2"],
            "kv": {"bits": bits, "group_size": group_size},
            "requests": {"a": {"prompt_len": prompt_len, "quantized_kv_start": start, "prefill_step_size": step_size}},
            "events": [{"join": ["a"]}, {"step": TOKENS - 1}],
        }
    )


@pytest.mark.parametrize(
    "model_name, prompt_len, start, step_size, bits",
    [
        ("llama-h64-bf16", 12, 0, 2048, 4),  # quantized from the first call
        ("llama-h64-bf16", 12, 0, 4, 4),  # several prefill chunks
        ("llama-h64-bf16", 23, 9, 5, 8),  # converts inside the prompt, mid-prefill
        ("llama-h64-bf16", 12, 16, 3, 4),  # converts after the prompt, while decoding
        ("qwen3-h128-f32", 30, 0, 7, 3),
        ("llama-h128-f32", 1, 0, 2048, 2),  # a one-token prompt
    ],
)
def test_oracle_equals_generate_step(model_name, prompt_len, start, step_size, bits):
    model = load_model(model_name)
    schedule = solo_schedule(prompt_len, start, step_size, bits)
    prompt = prompt_tokens(schedule.requests["a"], model.vocab_size)
    reference = [
        (int(token), logprobs)
        for token, logprobs in generate_step(
            mx.array(prompt), model.model, max_tokens=TOKENS, kv_bits=bits, kv_group_size=64,
            quantized_kv_start=start, prefill_step_size=step_size,
        )
    ]
    trace = run_solo(model.model, schedule, "a", model.vocab_size)
    calls = [c for c in trace.calls if c.logits is not None]
    assert len(calls) == len(reference) == TOKENS
    for step, (call, (token, logprobs)) in enumerate(zip(calls, reference)):
        ours = log_probs(call.logits[-1])
        assert greedy(call.logits[-1]) == token, f"token differs at step {step}"
        assert first_difference(logprobs, ours) is None, f"log-probabilities differ at step {step}"
    # the cache ends quantized exactly when mlx-lm's rule says it should
    final = trace.snapshots[max(trace.snapshots)][0]
    assert ("keys.packed" in final) == (prompt_len + TOKENS - 1 >= start)


def test_oracle_detects_a_different_code_path():
    """Sanity of the equality above: a different prefill chunking changes the
    bits on bf16 (so the comparison is not vacuous)."""
    model = load_model("llama-h64-bf16")
    one = run_solo(model.model, solo_schedule(40, 0, 2048), "a", model.vocab_size)
    many = run_solo(model.model, solo_schedule(40, 0, 3), "a", model.vocab_size)
    assert len(one.calls) == len(many.calls)
    assert any(
        first_difference(a.logits, b.logits) is not None for a, b in zip(one.calls, many.calls)
    )


def test_trace_round_trip_and_tamper_detection(tmp_path):
    model = load_model("llama-h64-bf16")
    trace = run_solo(model.model, solo_schedule(9, 0, 4), "a", model.vocab_size)
    save_trace(trace, tmp_path / "t")
    loaded = load_trace(tmp_path / "t")
    assert len(loaded.calls) == len(trace.calls)
    for a, b in zip(trace.calls, loaded.calls):
        assert (a.event, a.op, a.inputs) == (b.event, b.op, b.inputs)
        assert (a.logits is None and b.logits is None) or first_difference(a.logits, b.logits) is None
    assert sorted(loaded.snapshots) == sorted(trace.snapshots) and loaded.offsets == trace.offsets
    for event, layers in trace.snapshots.items():
        assert len(loaded.snapshots[event]) == len(layers)
        for expected, got in zip(layers, loaded.snapshots[event]):
            assert sorted(expected) == sorted(got)
            assert all(first_difference(expected[name], got[name]) is None for name in expected)
    data = bytearray((tmp_path / "t" / "trace.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (tmp_path / "t" / "trace.safetensors").write_bytes(bytes(data))
    with pytest.raises(TraceError, match="does not match its sha256"):
        load_trace(tmp_path / "t")


def test_l3_generations_are_cached_by_content_and_recomputed_when_damaged(tmp_path, monkeypatch):
    from kvparity.suites.l3.engines import EngineRequest

    monkeypatch.setenv("KVPARITY_ORACLE_CACHE", str(tmp_path))
    model = load_model("llama-h64-bf16")
    request = EngineRequest("a", (1, 2, 3, 4), 0, 3, 4, 64, None, 2048)
    fresh = generate_alone(model.model, request)
    assert len(fresh.tokens) == 3 and all(v.size == model.vocab_size for v in fresh.logprobs)
    stored = cached_generate_alone(model.model, request, model.sha256)
    (directory,) = (tmp_path / "l3").iterdir()
    assert directory.name == generation_key(request, model.sha256)
    # id and arrival are the engine's business, not the generation's
    assert generation_key(EngineRequest("b", (1, 2, 3, 4), 5, 3, 4, 64, None, 2048), model.sha256) == directory.name
    assert generation_key(EngineRequest("a", (1, 2, 3, 4), 0, 3, 8, 64, None, 2048), model.sha256) != directory.name
    data = bytearray((directory / GENERATION_FILE).read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")  # a byte of the cache's tensors, not the log-probs'
    data[header + json.loads(data[8:header])["cache0.keys.packed"]["data_offsets"][0]] ^= 0xFF
    (directory / GENERATION_FILE).write_bytes(bytes(data))
    again = cached_generate_alone(model.model, request, model.sha256)  # damaged: computed afresh, not read
    read = cached_generate_alone(model.model, request, model.sha256)  # read back: the cache it ended with too
    for run in (stored, again, read):
        assert run.tokens == fresh.tokens
        assert all(first_difference(a, b) is None for a, b in zip(fresh.logprobs, run.logprobs))
    assert [c.offset for c in read.cache] == [c.offset for c in fresh.cache]
    assert all(c.offset > len(request.prompt) for c in read.cache)
    for want, got in zip(fresh.cache, read.cache):
        assert (got.bits, got.group_size) == (want.bits, want.group_size)
        for x, y in zip((*want.keys, *want.values), (*got.keys, *got.values)):
            assert x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item()


@pytest.mark.gqa_batched
def test_solo_runs_are_cached_by_content(tmp_path, monkeypatch, implementation, gate):
    """A second run of a schedule reuses the stored solo traces instead of
    recomputing them; a changed request gets a new key."""
    from kvparity.suites.l2 import run as l2
    from kvparity.suites.format.schedule import CATALOG
    from kvparity.suites.core.loading import load

    monkeypatch.setenv("KVPARITY_ORACLE_CACHE", str(tmp_path))
    schedule = load(CATALOG / "rollback-uneven.json")
    gate(l2.run_l2(schedule, implementation))
    stored = sorted(p.name for p in tmp_path.iterdir())
    assert len(stored) == len(schedule.requests)

    def recompute(*args, **kwargs):
        raise RuntimeError("the oracle ran again")

    monkeypatch.setattr(l2, "run_solo", recompute)
    gate(l2.run_l2(schedule, implementation))
    assert sorted(p.name for p in tmp_path.iterdir()) == stored
    doc = schedule.to_json()
    doc["requests"]["a"]["prompt_len"] += 1
    changed = l2.run_l2(parse(doc), implementation)
    assert "the oracle ran again" in changed.reason


@pytest.mark.gqa_batched
def test_an_oracle_that_cannot_run_is_never_a_pass_nor_a_failure(monkeypatch, implementation, judged):
    """mlx-lm's own solo path raising (as it does for some shapes on CUDA)
    is "oracle cannot run", naming the error; the cache is not blamed."""
    from kvparity.suites.l2 import run as l2
    from kvparity.suites.core.evidence import ORACLE_CANNOT_RUN
    from kvparity.suites.format.schedule import CATALOG
    from kvparity.suites.core.loading import load

    def no_kernel(*args, **kwargs):
        raise ValueError("No implementation for problem shape")

    monkeypatch.setattr(l2, "run_solo", no_kernel)
    result = l2.run_l2(load(CATALOG / "join-empty.json"), implementation, use_cache=False)
    verdict = judged(result)
    assert verdict.verdict == ORACLE_CANNOT_RUN
    assert all(row.verdict == ORACLE_CANNOT_RUN for row in verdict.rows)
    assert "No implementation for problem shape" in result.reason and "mlx-lm's solo path" in result.reason


def _flaky_solo(monkeypatch, l2, flip_call=1, flip_index=3):
    """mlx-lm's solo path, except that the second run of each request
    returns logits with one element changed at ``flip_call``."""
    real, runs = l2.run_solo, {}

    def flaky(model, schedule, rid, *args, **kwargs):
        trace = real(model, schedule, rid, *args, **kwargs)
        runs[rid] = runs.get(rid, 0) + 1
        if runs[rid] == 2:
            logits = trace.calls[flip_call].logits
            flat = logits.reshape(-1)
            flat[flip_index] = flat[flip_index] + 1.0
            trace.calls[flip_call].logits = flat.reshape(logits.shape)
        return trace

    monkeypatch.setattr(l2, "run_solo", flaky)
    return runs


@pytest.mark.gqa_batched
def test_an_oracle_that_differs_from_itself_is_reported_where_and_never_blamed(monkeypatch, implementation,
                                                                                 judged):
    """Run twice, mlx-lm's solo path gives other bytes the second time: the
    outcome is "oracle nondeterministic" with the request, call, tensor,
    flat index and both values; no row fails, none passes (under the strictest
    policy too)."""
    from kvparity.suites.l2 import run as l2
    from kvparity.suites.core.evidence import ORACLE_NONDETERMINISTIC, OUTCOMES
    from kvparity.suites.format.schedule import CATALOG
    from kvparity.suites.core.loading import load

    assert ORACLE_NONDETERMINISTIC in OUTCOMES
    runs = _flaky_solo(monkeypatch, l2)
    schedule = load(CATALOG / "join-empty.json")
    result = l2.run_l2(schedule, implementation, use_cache=False, repeat_oracle=True)
    verdict = judged(result, "strict")
    first = next(iter(schedule.requests))
    assert runs[first] == 2
    assert verdict.verdict == ORACLE_NONDETERMINISTIC
    assert all(row.verdict == ORACLE_NONDETERMINISTIC and not row.evidence.divergences for row in verdict.rows)
    assert f"for {first!r} differs from itself" in result.reason
    assert "call 1, logits, flat index 3: first run " in result.reason and "second run " in result.reason


@pytest.mark.gqa_batched
def test_the_oracle_cache_does_not_hide_nondeterminism(tmp_path, monkeypatch, implementation, gate):
    """A stored solo trace is compared with a fresh second run, never with
    itself; a trace found to differ is dropped from the cache."""
    from kvparity.suites.l2 import run as l2
    from kvparity.suites.core.evidence import ORACLE_NONDETERMINISTIC
    from kvparity.suites.format.schedule import CATALOG
    from kvparity.suites.core.loading import load

    monkeypatch.setenv("KVPARITY_ORACLE_CACHE", str(tmp_path))
    schedule = load(CATALOG / "join-empty.json")
    gate(l2.run_l2(schedule, implementation, repeat_oracle=True))  # deterministic: stored, and a pass
    stored = sorted(p.name for p in tmp_path.iterdir())
    assert len(stored) == len(schedule.requests)

    real = l2.run_solo
    fresh = []

    def drifted(model, schedule, rid, *args, **kwargs):  # every fresh run now differs from what is stored
        trace = real(model, schedule, rid, *args, **kwargs)
        fresh.append(rid)
        last = trace.calls[-1]
        last.logits = mx.concatenate([last.logits[:, :-1], last.logits[:, -1:] * 2 + 1], axis=1)
        return trace

    monkeypatch.setattr(l2, "run_solo", drifted)
    result = l2.run_l2(schedule, implementation, repeat_oracle=True)
    assert result.stopped == ORACLE_NONDETERMINISTIC
    assert fresh == [next(iter(schedule.requests))]  # the first request was loaded, then run once, fresh
    assert "logits, flat index" in result.reason
    assert len(list(tmp_path.iterdir())) == len(stored) - 1  # its stored trace is gone


@pytest.mark.gqa_batched
def test_the_oracle_runs_once_on_the_cpu_and_twice_when_asked(monkeypatch, implementation, gate):
    from kvparity.suites.l2 import run as l2
    from kvparity.suites.format.schedule import CATALOG
    from kvparity.suites.core.loading import load

    assert mx.default_device().type == mx.DeviceType.cpu and not l2.repeat_oracle_default()
    real, runs = l2.run_solo, []

    def counted(model, schedule, rid, *args, **kwargs):
        runs.append(rid)
        return real(model, schedule, rid, *args, **kwargs)

    monkeypatch.setattr(l2, "run_solo", counted)
    schedule = load(CATALOG / "join-empty.json")
    gate(l2.run_l2(schedule, implementation, use_cache=False))
    assert sorted(runs) == sorted(schedule.requests)
    runs.clear()
    gate(l2.run_l2(schedule, implementation, use_cache=False, repeat_oracle=True))  # deterministic here: a pass
    assert sorted(runs) == sorted(list(schedule.requests) * 2)
    monkeypatch.setattr(l2, "repeat_oracle_default", lambda: True)  # as on a GPU
    runs.clear()
    gate(l2.run_l2(schedule, implementation, use_cache=False))
    assert len(runs) == 2 * len(schedule.requests)


# -- L1: each solo state computed once, handed out as forks ------------------------------


def _cache_digest(solo):
    cache = solo.cache
    return type(cache).__name__, cache.offset, digest(owned_arrays(cache))


@pytest.mark.parametrize("start", [0, 9, 40], ids=["quantized", "converts mid-prompt", "waits unquantized"])
def test_a_solo_state_is_computed_once_and_forks_are_independent(start):
    kv = SyntheticKV([LayerShape(2, 64, 64)], "bfloat16")
    request = Request("a", prompt_len=23, quantized_kv_start=start, prefill_step_size=5)
    states = SoloStates()
    first_written, second_written, fresh_written = {}, {}, {}
    first = states.prefilled(kv, first_written, request, 4, 64, 23)
    second = states.prefilled(kv, second_written, request, 4, 64, 23)
    fresh = SoloCache.prefilled(request, 4, 64, lambda n: kv.draw(fresh_written, request, n))
    assert first is second and len(states.kept) == 1
    assert first_written == second_written == fresh_written == {"a": 23}
    assert _cache_digest(first.solo) == _cache_digest(fresh)
    # Later calls: the same calls at the same place in the stream are the
    # same state; each equals mlx-lm run on the request by hand.
    appended = states.after(first, kv, first_written, request, "append", 3)
    assert states.after(second, kv, second_written, request, "append", 3) is appended
    assert first_written == second_written == {"a": 26}
    fresh.append(kv.draw(fresh_written, request, 3))
    assert _cache_digest(appended.solo) == _cache_digest(fresh)
    trimmed = states.after(appended, kv, first_written, request, "trim", 2)
    assert first_written == {"a": 26}  # a trim draws nothing: rewritten positions get new bytes
    fresh.trim(2)
    assert _cache_digest(trimmed.solo) == _cache_digest(fresh)
    rewritten = states.after(trimmed, kv, first_written, request, "append", 3)
    assert rewritten is not appended and len(states.kept) == 4
    fresh.append(kv.draw(fresh_written, request, 3))
    assert _cache_digest(rewritten.solo) == _cache_digest(fresh)
    # What a holder of a fork writes in place (mlx-lm's appends, a member
    # that writes its source) reaches neither another fork nor the kept state.
    before = _cache_digest(first.solo)
    fork, other = first.solo.fork(), first.solo.fork()
    fork.append(kv.draw({"a": 23}, request, 3))
    keys = fork.cache.keys[0] if isinstance(fork.cache.keys, (tuple, list)) else fork.cache.keys
    keys[..., :1, :] = 0
    assert _cache_digest(other) == _cache_digest(first.solo) == before
    assert _cache_digest(states.prefilled(kv, {}, request, 4, 64, 23).solo) == before


def test_a_solo_state_keeps_what_was_read_and_rereads_what_never_was():
    """A state's bytes are read once and kept for later events; bytes taken
    into a reading that was never evaluated (its checks raised) are dropped
    and read again, not served unread."""
    kv = SyntheticKV([LayerShape(1, 64, 64)], "float16")
    request = Request("a", prompt_len=9, quantized_kv_start=0, prefill_step_size=4)
    state = SoloStates().prefilled(kv, {}, request, 4, 64, 9)
    fresh = Reading()
    expected = layer_parts(fresh, state.solo.cache)
    fresh.evaluate()
    state.parts(Reading())  # never evaluated
    state.keep()
    assert state.layers is None
    reading = Reading()
    parts = state.parts(reading)
    assert state.parts(Reading()) is parts  # the same parts until kept
    reading.evaluate()
    state.keep()
    (kept,) = state.layers
    assert state.parts(Reading())[0] is kept and all(part.reading is None for part in kept.values())
    assert {name: (part.bits.shape, part.bits.tobytes()) for name, part in kept.items()} == {
        name: (part.bits.shape, part.bits.tobytes()) for name, part in expected.items()}

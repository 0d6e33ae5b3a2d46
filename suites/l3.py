"""L3, a real engine: an engine (mlx-lm's BatchGenerator by default) serves an
arrivals schedule with the cache under test, deciding joins, batched prefill,
finishes and leaves by itself; every request's tokens and log-probs are then
compared with the request run alone.

The oracle is ``mlx_lm.generate.generate_step`` (greedy), alone, with the
cache semantics the engine uses:

* ``quantized_kv_start`` absent (the default): ``prompt_cache=[QuantizedKVCache(
  group_size, bits) per layer]``, quantized from the first token. This is
  what BatchGenerator computes when each request's caches are quantized rows:
  it never converts a cache, so every key a request attends to, prompt
  included, is quantized. ``generate_step(..., kv_bits, quantized_kv_start=0)``
  is a different computation: it prefills its first chunk into a dense
  ``KVCache`` and converts afterwards, so that chunk attends unquantized keys
  (measured: its log-probs differ from BatchGenerator's).
* ``quantized_kv_start: N``: ``generate_step(..., kv_bits, kv_group_size,
  quantized_kv_start=N)``, mlx-lm's delayed conversion. BatchGenerator cannot
  serve it (not supported); an engine that converts can.

Comparison, per request: tokens position by position, and at each position
the log-probs bit for bit (dtype, shape and bytes; the full vector when the
engine gives one, else the chosen token's value against the oracle vector's
entry). Comparison stops after the first differing token: from there on the
engine and the oracle condition on different text. Every comparison made is
counted; nothing compared is never a pass. Solo runs are cached by content
hash, like the L2 oracle's traces.
"""

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

from kvparity.oracle.arrays import digest
from kvparity.oracle.solo import prompt_tokens
from kvparity.oracle.trace import oracle_cache
from kvparity.oracle.atomic import AtomicDirectory
from kvparity.oracle.machine import machine
from kvparity.suites.adapter import ForwardRaised, MemberRaised, in_forward, layer_of
from kvparity.suites.compare import Divergence, first_difference
from kvparity.suites.arrivals import ArrivalSchedule, check_fits
from kvparity.suites.engines import (
    EngineRequest,
    EngineRun,
    EngineSettings,
    EngineUnsupported,
    make_engine,
)

SOLO_FORMAT = "kvparity.l3-solo/1"

PASSED, FAILED, UNSUPPORTED, SKIPPED_HERE, REFUSED = "pass", "fail", "not supported", "skipped", "refused"
ORACLE_CANNOT_RUN = "oracle cannot run here"  # mlx-lm's own solo path raised


# -- the oracle ---------------------------------------------------------------------


@dataclass
class SoloGeneration:
    tokens: List[int]
    logprobs: List[mx.array]  # full vectors, as generate_step yields them


def semantics(request: EngineRequest) -> str:
    if request.quantized_kv_start is None:
        return f"quantized from the first token ({request.bits}-bit, group {request.group_size})"
    return (f"mlx-lm kv_bits={request.bits} kv_group_size={request.group_size} "
            f"quantized_kv_start={request.quantized_kv_start}")


def run_solo(model, request: EngineRequest) -> SoloGeneration:
    """The request alone through generate_step, greedy (its default sampler)."""
    kwargs = dict(max_tokens=request.max_tokens, prefill_step_size=request.prefill_step_size)
    if request.quantized_kv_start is None:
        kwargs["prompt_cache"] = [QuantizedKVCache(group_size=request.group_size, bits=request.bits)
                                  for _ in model.layers]
    else:
        kwargs.update(kv_bits=request.bits, kv_group_size=request.group_size,
                      quantized_kv_start=request.quantized_kv_start)
    tokens, logprobs = [], []
    for token, vector in generate_step(mx.array(request.prompt), model, **kwargs):
        tokens.append(token)
        logprobs.append(vector)
    mx.eval(logprobs)
    return SoloGeneration(tokens, logprobs)


def solo_key(request: EngineRequest, model_sha256: str) -> str:
    spec = {
        "format": SOLO_FORMAT,
        "model": model_sha256,
        "request": {k: getattr(request, k) for k in request.__dataclass_fields__ if k not in ("id", "arrival")},
        "machine": machine(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=list).encode()).hexdigest()


def cached_run_solo(model, request: EngineRequest, model_sha256: str, use_cache: bool = True) -> SoloGeneration:
    """``run_solo``, reusing a stored result with the same content hash; a
    stored result whose tensors do not match their sha256 is recomputed."""
    if not use_cache:
        return run_solo(model, request)
    directory = oracle_cache() / "l3" / solo_key(request, model_sha256)
    manifest_path = directory / "manifest.json"
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
            tensors = mx.load(str(directory / "logprobs.safetensors"))
            vectors = [tensors[f"logprobs{i}"] for i in range(len(manifest["tokens"]))]
            if manifest["format"] == SOLO_FORMAT and digest(vectors) == manifest["sha256"]:
                return SoloGeneration(manifest["tokens"], vectors)
        except (OSError, ValueError, KeyError, RuntimeError):
            pass
        shutil.rmtree(directory, ignore_errors=True)
    solo = run_solo(model, request)
    try:
        with AtomicDirectory(directory.parent, directory.name) as staging:
            mx.save_safetensors(str(staging / "logprobs.safetensors"),
                                {f"logprobs{i}": v for i, v in enumerate(solo.logprobs)})
            (staging / "manifest.json").write_text(json.dumps({
                "format": SOLO_FORMAT, "tokens": solo.tokens, "sha256": digest(solo.logprobs),
                "semantics": semantics(request),
            }))
    except FileExistsError:
        pass  # another run stored the same result
    return solo


# -- comparison -------------------------------------------------------------------


@dataclass
class Mismatch:
    what: str  # "tokens", "logprobs", "length"
    request: str
    token_index: int
    engine_step: Optional[int]
    index: Optional[int] = None  # flat index in the log-prob vector
    expected: object = None
    actual: object = None
    detail: str = ""


@dataclass
class RequestComparison:
    request: str
    semantics: str
    tokens_compared: int = 0
    logprob_vectors_compared: int = 0
    logprob_values_compared: int = 0  # engines that give the chosen token's log-prob only
    mismatches: List[Mismatch] = field(default_factory=list)

    @property
    def comparisons(self) -> int:
        return self.tokens_compared + self.logprob_vectors_compared + self.logprob_values_compared


def compare_request(rid: str, expected: SoloGeneration, actual, request: EngineRequest) -> RequestComparison:
    found = RequestComparison(rid, semantics(request))
    steps = actual.steps if actual is not None else []
    got_tokens = actual.tokens if actual is not None else []
    for i, want in enumerate(expected.tokens):
        step = steps[i] if i < len(steps) else None
        if i >= len(got_tokens):
            found.mismatches.append(Mismatch("length", rid, i, step, expected=len(expected.tokens),
                                             actual=len(got_tokens), detail=f"token {i} ({want}) never came"))
            break
        found.tokens_compared += 1
        vector, got = expected.logprobs[i], actual.logprobs[i] if i < len(actual.logprobs) else None
        if got is None:
            found.mismatches.append(Mismatch("logprobs", rid, i, step, detail="no log-probs for this token"))
        else:
            if got.size == 1 and vector.size != 1:
                # the engine's chosen token's entry of the oracle's vector
                vector = vector[got_tokens[i]].reshape(got.shape)
                found.logprob_values_compared += 1
            else:
                found.logprob_vectors_compared += 1
            diff = first_difference(vector, got)
            if diff is not None:
                index, e, a = diff
                found.mismatches.append(Mismatch("logprobs", rid, i, step, index, e, a))
        if got_tokens[i] != want:
            found.mismatches.append(Mismatch("tokens", rid, i, step, expected=want, actual=got_tokens[i]))
            break  # later tokens follow different text
    else:
        if len(got_tokens) > len(expected.tokens):
            i = len(expected.tokens)
            found.mismatches.append(Mismatch("length", rid, i, steps[i] if i < len(steps) else None,
                                             expected=len(expected.tokens), actual=len(got_tokens),
                                             detail="more tokens than max_tokens"))
    return found


# -- a run ------------------------------------------------------------------------


@dataclass
class L3Outcome:
    schedule: str
    path: Optional[str]
    engine: str
    implementation: str
    model: str
    requests: List[str] = field(default_factory=list)
    verdict: str = PASSED
    reason: str = ""
    raised: str = ""  # what the implementation's path raised, where mlx-lm alone did not
    run: Optional[EngineRun] = None
    comparisons: Dict[str, RequestComparison] = field(default_factory=dict)
    seconds: float = 0.0
    members: Dict[str, int] = field(default_factory=dict)  # protocol member -> calls the engine made
    model_sha256: str = ""

    @property
    def batched_prefill_steps(self) -> int:
        """Engine steps that prefilled two or more prompts in one call."""
        return sum(s.prompt_width >= 2 for s in (self.run.timeline or [])) if self.run else 0


def engine_requests(schedule: ArrivalSchedule, vocab_size: int, tokenizer=None) -> List[EngineRequest]:
    return [
        EngineRequest(
            id=r.id,
            prompt=tuple(prompt_tokens(r, vocab_size, tokenizer)),
            arrival=r.arrival,
            max_tokens=r.max_tokens,
            bits=r.bits,
            group_size=r.group_size,
            quantized_kv_start=r.quantized_kv_start,
            prefill_step_size=r.prefill_step_size,
        )
        for r in schedule.requests.values()
    ]


def run_l3(schedule: ArrivalSchedule, implementation, engine_spec: Optional[str] = None,
           model_name: Optional[str] = None, use_cache: bool = True) -> L3Outcome:
    """Serve ``schedule`` on the engine with ``implementation``'s batch cache
    and compare every request with its solo run."""
    from kvparity.oracle.models import load_model

    loaded = load_model(model_name or schedule.model)
    outcome = L3Outcome(schedule.name, schedule.path, engine_spec or "BatchGenerator",
                        implementation.name, loaded.name, list(schedule.requests), model_sha256=loaded.sha256)
    start = time.perf_counter()
    unfit = check_fits(schedule, loaded.head_dim, loaded.vocab_size, loaded.tokenizer is not None)
    if unfit:
        outcome.verdict, outcome.reason = SKIPPED_HERE, unfit
        return outcome
    requests = engine_requests(schedule, loaded.vocab_size, loaded.tokenizer)
    # The oracle first: where mlx-lm's own path cannot run (a backend without
    # the kernel), the engine, built on the same path, says nothing either.
    solos = {}
    for request in requests:
        try:
            solos[request.id] = cached_run_solo(loaded.model, request, loaded.sha256, use_cache)
        except Exception as error:
            outcome.verdict = ORACLE_CANNOT_RUN
            outcome.reason = (f"request {request.id!r}: mlx-lm's solo generate_step raised "
                              f"{type(error).__name__}: {error}")
            return outcome
    settings = EngineSettings(**vars(schedule.engine))
    # The engine gets the class itself; while it serves, the class counts
    # the members the engine calls and names what raises.
    calls_before = dict(implementation.calls)
    with implementation.watching():
        engine = make_engine(engine_spec, loaded.model, implementation.batch_class, settings)
        outcome.engine = engine.name
        try:
            outcome.run = engine.serve(requests)
        except EngineUnsupported as error:
            outcome.verdict, outcome.reason = UNSUPPORTED, str(error)
            return outcome
        except MemberRaised as raised:  # the cache under test declined or broke
            raised.layer = layer_of(raised, loaded.model.layers)
            outcome.verdict = UNSUPPORTED if raised.capability else REFUSED if raised.refused else FAILED
            outcome.raised = f"the engine's call of {raised}"
            outcome.reason = f"L3 {schedule.name}, event #0 serve: {outcome.raised}"
            return outcome
        except Exception as error:  # the engine or the model's forward broke where mlx-lm alone did not
            raised = ForwardRaised(error, ForwardRaised.FRAME if in_forward(error, loaded.model) else "the engine")
            raised.layer = layer_of(error, loaded.model.layers)
            outcome.verdict, outcome.raised = FAILED, str(raised)
            outcome.reason = f"L3 {schedule.name}, event #0 serve: {outcome.raised}"
            return outcome
    outcome.members = implementation.calls_since(calls_before)
    for request in requests:
        outcome.comparisons[request.id] = compare_request(
            request.id, solos[request.id], outcome.run.outputs.get(request.id), request)
    found = [m for c in outcome.comparisons.values() for m in c.mismatches]
    if found:
        outcome.verdict = FAILED
    elif not any(c.comparisons for c in outcome.comparisons.values()):
        outcome.verdict, outcome.reason = FAILED, "no evidence: nothing was compared"
    outcome.seconds = time.perf_counter() - start
    return outcome


def describe_timeline(run: EngineRun) -> List[str]:
    """One line per engine step, for reports and failure messages."""
    if run is None or run.timeline is None:
        return ["(the engine gives no timeline)"]
    lines = []
    for s in run.timeline:
        parts = [f"step {s.step:3d}"]
        for label, ids in (("arrive", s.arrived), ("prefill", s.prompt_rows), ("join", s.joined),
                           ("generate", s.generation_rows), ("finish", s.finished)):
            if ids:
                parts.append(f"{label} {','.join(ids)}")
        lines.append("  ".join(parts))
    return lines


# -- reports ------------------------------------------------------------------------


def to_schedule_result(outcome: L3Outcome):
    """The one conversion from an L3 outcome to the harness's evidence."""
    from kvparity.suites.evidence import FAIL, NOT_SUPPORTED, ORACLE_CANNOT_RUN as CANNOT, REFUSED as REFUSED_OUTCOME
    from kvparity.suites.evidence import ScheduleResult

    result = ScheduleResult(outcome.schedule, "L3", outcome.implementation, ["serve"], path=outcome.path,
                            model=outcome.model, model_sha256=outcome.model_sha256, seconds=outcome.seconds,
                            members=dict(outcome.members))
    if outcome.run is not None and outcome.run.timeline:
        result.timeline = [
            {"step": s.step, "arrived": s.arrived, "prompt_batch": s.prompt_rows, "joined": s.joined,
             "generation_batch": s.generation_rows, "finished": s.finished,
             "prompt_width": s.prompt_width, "generation_width": s.generation_width}
            for s in outcome.run.timeline]
    for rid in outcome.requests:
        result.row(rid)
    if outcome.verdict in (UNSUPPORTED, SKIPPED_HERE):
        result.stop(NOT_SUPPORTED, outcome.reason)
    elif outcome.verdict == ORACLE_CANNOT_RUN:
        result.stop(CANNOT, outcome.reason)
    elif outcome.verdict == REFUSED:
        result.stop(REFUSED_OUTCOME, outcome.reason)
    elif outcome.verdict == FAILED and not outcome.comparisons:  # the engine raised
        result.stop(FAIL, outcome.reason)
        result.note(0, "raised", outcome.requests, 0, [Divergence("raised", "#0 serve", detail=outcome.raised or outcome.reason)])
    for rid, comparison in outcome.comparisons.items():
        row = result.row(rid)
        row.metrics = {"tokens compared": comparison.tokens_compared,
                       "log-prob vectors compared": comparison.logprob_vectors_compared,
                       "log-prob values compared": comparison.logprob_values_compared,
                       "oracle": comparison.semantics}
        result.note(0, "tokens", [rid], comparison.tokens_compared)
        result.note(0, "logprobs", [rid], comparison.logprob_vectors_compared)
        result.note(0, "mismatch", [rid], 0, [Divergence(
            m.what, f"#0 serve, engine step {m.engine_step}", rid, tensor="logprobs" if m.what == "logprobs" else "tokens",
            step=m.token_index, index=m.index, expected=m.expected, actual=m.actual,
            detail=f"token {m.token_index} at engine step {m.engine_step}" + (f"; {m.detail}" if m.detail else ""))
            for m in comparison.mismatches])
    return result


def explain(outcome: L3Outcome) -> str:
    """What an outcome that did not pass found, for failure messages."""
    lines = [f"L3 {outcome.schedule}: {outcome.verdict}" + (f" ({outcome.reason})" if outcome.reason else "")]
    for rid, comparison in outcome.comparisons.items():
        for m in comparison.mismatches[:3]:
            lines.append(f"  {m.what}: request {rid!r}, token {m.token_index}, engine step {m.engine_step}: "
                         f"expected {m.expected!r}, got {m.actual!r}")
    return "\n".join(lines + describe_timeline(outcome.run)[:40])


PREFILL_MODES = {"prefill_batch_size=1": 1, "engine default": None}


def prefill_modes(schedule: ArrivalSchedule) -> Dict[str, ArrivalSchedule]:
    """The schedule with each prompt prefilled alone (then ``extend``), and with
    the engine's default batched prefill (several right-padded prompts per call)."""
    return {label: schedule.with_engine(prefill_batch_size=size) for label, size in PREFILL_MODES.items()}

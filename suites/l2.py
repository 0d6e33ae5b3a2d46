"""L2, the model per row: the engine replays a schedule on a model while the
oracle replays each request alone; per row and call, logits must be
bit-identical, greedy tokens identical, and per layer the cache bytes
bit-identical at every event boundary.
"""

import time
from typing import Dict, List, Optional

import mlx.core as mx

from kvparity.impl.adapter import Implementation
from kvparity.impl.engine import Engine
from kvparity.oracle.models import load_model
from kvparity.oracle.parity import compare_named, first_difference
from kvparity.oracle.solo import Call, SoloTrace, greedy, run_solo
from kvparity.oracle.trace import cached_solo
from kvparity.reports.metrics import LogitStats
from kvparity.reports.policy import Policy, load_policy, row_tier
from kvparity.reports.results import FAIL, NOT_SUPPORTED, SKIPPED, Divergence, ScheduleResult
from kvparity.suites.schedule import parse

DTYPE_SUFFIX = {"bfloat16": "bf16", "float32": "f32"}


def model_for(schedule, forced=None) -> str:
    """The schedule's model: forced, named in the file, or the default llama
    random model with the schedule's head_dim and dtype."""
    if forced:
        return forced
    if schedule.model:
        return schedule.model
    return f"llama-h{schedule.head_dim}-{DTYPE_SUFFIX.get(schedule.dtype, 'bf16')}"


def fit_to_model(schedule, model):
    """Tokenize text prompts and check the kv settings fit the model;
    returns (schedule, reason it cannot run on this model or None)."""
    if model.head_dim % schedule.group_size:
        return schedule, (
            f"kv.group_size={schedule.group_size} does not divide head_dim={model.head_dim} of {model.name}"
        )
    if any(r.text is not None for r in schedule.requests.values()):
        if model.tokenizer is None:
            return schedule, f"text prompts need a tokenizer; {model.name} has none"
        doc = schedule.to_json()
        for rid, request in schedule.requests.items():
            if request.text is not None:
                doc["requests"][rid].pop("text")
                doc["requests"][rid]["prompt"] = list(model.tokenizer.encode(request.text))
        schedule = parse(doc, source=schedule.path)
    return schedule, None


def run_l2(schedule, implementation: Implementation, model_name=None, use_cache=True,
           policy: Policy = None, capture: Optional[dict] = None) -> ScheduleResult:
    """Replay ``schedule`` on the model; ``capture``, when given, receives the
    engine's own trace per request (same format as the oracle's)."""
    policy = policy or load_policy()
    model = load_model(model_for(schedule, model_name))
    result = ScheduleResult(schedule.name, "L2", implementation.name, len(schedule.events), path=schedule.path)
    for rid in schedule.requests:
        result.row(rid)
    schedule, unfit = fit_to_model(schedule, model)
    missing = [c for c in schedule.needs if not implementation.supports(c)]
    if unfit or missing:
        result.verdict = SKIPPED if unfit else NOT_SUPPORTED
        result.reason = unfit or f"needs {', '.join(missing)}"
        for row in result.rows:
            row.verdict = result.verdict
        return result

    start = time.perf_counter()
    traces = {}
    for rid in schedule.requests:
        run = lambda rid=rid: run_solo(model.model, schedule, rid, model.vocab_size, model.tokenizer)
        traces[rid] = cached_solo(run, schedule, rid, model) if use_cache else run()
    if capture is not None:
        capture.update({rid: SoloTrace(rid, [Call(c.event, c.op, c.inputs) for c in t.calls]) for rid, t in traces.items()})
    engine = Engine(model.model, implementation, schedule, traces, model.vocab_size, model.tokenizer)
    stats: Dict[str, LogitStats] = {rid: LogitStats() for rid in schedule.requests}
    for event in schedule.events:
        label = event.describe()
        try:
            outputs = engine.apply(event)
        except NotImplementedError as error:
            result.verdict, result.reason = NOT_SUPPORTED, f"event {label}: {error}"
            break
        except Exception as error:  # the implementation under test broke
            result.reason = f"event {label} raised {type(error).__name__}: {error}"
            for rid in engine.rows or list(schedule.requests):
                result.row(rid).divergences.append(Divergence("raised", label, rid, detail=result.reason))
            break
        found = []
        for out in outputs:
            expected = traces[out.request].calls[out.step].logits
            stats[out.request].add(expected, out.logits, out.step)
            found += compare_logits(expected, out.logits, label, out.request, out.step)
            if capture is not None:
                capture[out.request].calls[out.step].logits = out.logits
        found += compare_caches(engine, traces, label, event.index)
        if capture is not None:
            for rid in engine.running() + list(engine.preempted):
                capture[rid].snapshots[event.index], capture[rid].offsets[event.index] = engine.row_bytes(rid)
        for divergence in found:
            result.row(divergence.request).divergences.append(divergence)
        for rid in engine.running():
            result.row(rid).checks += 1
    finish(result, stats, policy)
    result.seconds = time.perf_counter() - start
    return result


def finish(result: ScheduleResult, stats: Dict[str, LogitStats], policy: Policy):
    """Row and schedule verdicts: a divergence fails a row only if the
    policy says it gates."""
    for row in result.rows:
        row.metrics = stats[row.request].as_dict()
        row.series = stats[row.request].series if row.metrics["positions"] else {}
        row.required = policy.required()
        if result.verdict == NOT_SUPPORTED:
            row.verdict = NOT_SUPPORTED
        elif any(policy.gates(d, row.metrics) for d in row.divergences):
            row.verdict = FAIL
        row.tier = row_tier(row)
    if result.verdict != NOT_SUPPORTED and (result.reason or any(r.verdict == FAIL for r in result.rows)):
        result.verdict = FAIL


def compare_traces(name: str, golden: Dict[str, SoloTrace], candidate: Dict[str, SoloTrace],
                   source: str, policy: Policy = None) -> ScheduleResult:
    """The L2 comparison between two recorded trace sets: logits per call,
    cache bytes per layer at every recorded event boundary."""
    policy = policy or load_policy()
    events = max((c.event for t in golden.values() for c in t.calls), default=-1) + 1
    result = ScheduleResult(name, "L2", source, events)
    stats = {rid: LogitStats() for rid in golden}
    for rid, expected in golden.items():
        row = result.row(rid)
        got = candidate.get(rid)
        if got is None or len(got.calls) != len(expected.calls):
            row.divergences.append(Divergence("layout", "trace", rid, detail="the candidate's calls differ in number"))
            continue
        for step, (e, a) in enumerate(zip(expected.calls, got.calls)):
            if e.logits is None:
                continue
            if a.logits is None:
                row.divergences.append(Divergence("layout", f"#{e.event}", rid, tensor="logits", step=step,
                                                  detail="missing in the candidate"))
                continue
            stats[rid].add(e.logits, a.logits, step)
            row.divergences += compare_logits(e.logits, a.logits, f"#{e.event}", rid, step)
        for event, layers in sorted(expected.snapshots.items()):
            actual, _ = got.snapshot_at(event)
            if actual is None:
                continue
            if got.offsets.get(event, expected.offsets[event]) != expected.offsets[event]:
                row.divergences.append(Divergence("offset", f"#{event}", rid, expected=expected.offsets[event],
                                                  actual=got.offsets[event]))
            for layer, (e, a) in enumerate(zip(layers, actual)):
                row.divergences += compare_named(e, a, event=f"#{event}", request=rid, layer=layer)
        row.checks = len(expected.snapshots)
    finish(result, stats, policy)
    return result


def compare_logits(expected: mx.array, actual: mx.array, event: str, rid: str, step: int) -> List[Divergence]:
    diff = first_difference(expected, actual)
    found = []
    if diff is not None:
        index, want, got = diff
        e32, a32 = expected.astype(mx.float32), actual.astype(mx.float32)
        max_abs = mx.abs(e32 - a32).max().item() if expected.shape == actual.shape else None
        positions = expected.shape[0]
        agree = sum(greedy(expected[p]) == greedy(actual[p]) for p in range(positions)) \
            if expected.shape == actual.shape else 0
        found.append(
            Divergence(
                "logits" if index is not None else "layout",
                event,
                rid,
                tensor="logits",
                step=step,
                index=index,
                expected=want,
                actual=got,
                detail=f"max abs diff {max_abs}, top-1 agree {agree}/{positions}",
            )
        )
    if expected.shape == actual.shape:
        for p in range(expected.shape[0]):
            if greedy(expected[p]) != greedy(actual[p]):
                found.append(
                    Divergence("tokens", event, rid, tensor="argmax", step=step, index=p,
                               expected=greedy(expected[p]), actual=greedy(actual[p]))
                )
                break
    return found


def compare_caches(engine: Engine, traces, event: str, event_index: int) -> List[Divergence]:
    """Every layer of every row, batched or preempted, against its solo bytes."""
    found = []
    for rid in engine.running() + list(engine.preempted):
        expected, offset = traces[rid].snapshot_at(event_index)
        actual, actual_offset = engine.row_bytes(rid)
        prefix = "extracted." if rid in engine.preempted else "waiting." if rid in engine.waiting else ""
        where = dict(event=event, request=rid, step=engine.consumed[rid] - 1)
        if actual_offset != offset:
            found.append(Divergence("offset", expected=offset, actual=actual_offset, detail="RoPE offset", **where))
        for layer, (e, a) in enumerate(zip(expected, actual)):
            found += compare_named(e, a, prefix, layer=layer, **where)
    return found

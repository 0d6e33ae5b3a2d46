"""L2, the model per row: the engine replays a schedule on a model while the
oracle replays each request alone; per row and call, logits must be
bit-identical, greedy tokens identical, and per layer the cache bytes
bit-identical at every event boundary.
"""

import time
from typing import Dict, List

import mlx.core as mx

from kvparity.impl.adapter import Implementation
from kvparity.impl.engine import Engine
from kvparity.oracle.models import load_model
from kvparity.oracle.parity import compare_batch_row, compare_triples, first_difference
from kvparity.oracle.solo import greedy, run_solo
from kvparity.oracle.trace import cached_solo
from kvparity.reports.metrics import LogitStats
from kvparity.reports.results import FAIL, NOT_SUPPORTED, PASS, SKIPPED, Divergence, ScheduleResult
from kvparity.suites.schedule import parse

TRIPLE = ("packed", "scales", "biases")
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


def run_l2(schedule, implementation: Implementation, model_name=None, use_cache=True) -> ScheduleResult:
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
            stats[out.request].add(expected, out.logits)
            found += compare_logits(expected, out.logits, label, out.request, out.step)
        found += compare_caches(engine, traces, label, event.index)
        for divergence in found:
            result.row(divergence.request).divergences.append(divergence)
        for rid in engine.rows:
            result.row(rid).checks += 1
    for row in result.rows:
        row.metrics = stats[row.request].as_dict()
        if result.verdict == NOT_SUPPORTED:
            row.verdict = NOT_SUPPORTED
        elif row.divergences:
            row.verdict = FAIL
    if result.verdict != NOT_SUPPORTED and (result.divergences or result.reason):
        result.verdict = FAIL
    result.seconds = time.perf_counter() - start
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
    if engine.layers is not None:
        size = engine.layers[0].size()
        for i, rid in enumerate(engine.rows):
            snapshot, offset = traces[rid].snapshot_at(event_index)
            step = engine.consumed[rid] - 1
            for layer, batch in enumerate(engine.layers):
                where = dict(event=event, request=rid, layer=layer, step=step)
                row_offset = int(batch.offset[i].item())
                pad = int(batch.left_padding[i].item())
                if row_offset != offset or size - pad != offset:
                    found.append(Divergence("offset", expected=offset, actual=row_offset,
                                            detail=f"left padding {pad} of size() {batch.size()}", **where))
                    break
                expected = {n: tuple(snapshot[layer][f"{n}.{p}"] for p in TRIPLE) for n in ("keys", "values")}
                state = {"keys": batch.state[0], "values": batch.state[1]}
                found += compare_batch_row(state, i, pad, batch.size(), expected, "", **where)
    for rid, caches in engine.preempted.items():
        snapshot, _ = traces[rid].snapshot_at(event_index)
        for layer, cache in enumerate(caches):
            for n in ("keys", "values"):
                expected = tuple(snapshot[layer][f"{n}.{p}"] for p in TRIPLE)
                got = tuple(x[..., : cache.offset, :] for x in getattr(cache, n))
                found += compare_triples(expected, got, f"extracted.{n}", event=event, request=rid,
                                         layer=layer, step=engine.consumed[rid] - 1)
    return found

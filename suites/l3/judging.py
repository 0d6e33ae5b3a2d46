"""L3's judging: each request's tokens and logits against its solo run,
and, where it diverged, the timeline and the member calls that explain
it."""

from dataclasses import replace
from typing import List, Optional, Tuple

import mlx.core as mx

from kvparity.oracle.generation import SoloGeneration, semantics
from kvparity.suites.format.checks import LENGTH, LOGPROBS, QUANTIZED, TOKENS
from kvparity.suites.core.compare import Divergence, a_triple, first_difference, in_words
from kvparity.suites.l3.engines import EngineRequest, EngineRun, Generated
from kvparity.suites.core.evidence import ScheduleResult

from kvparity.suites.l3.trail import SERVE_LABEL, CallTrail
from kvparity.suites.l3.stored import check_stored


def wrong_so_far(result: ScheduleResult, loaded, requests, engine, made: Tuple[str, ...], use_cache: bool) -> str:
    """Where the engine raised: the first entry it had stored that
    ``check_stored`` finds wrong (``engine.so_far``, what it stored until
    then), in words; empty where none was, or the engine does not say."""
    so_far = getattr(engine, "so_far", None)
    try:
        wrong = (check_stored(result, loaded, requests, so_far, lambda entry: made, use_cache)
                 if so_far is not None else [])
    except Exception:  # mlx-lm's own path cannot say what the entries should hold: the raise stands as it is
        return ""
    return f"{wrong[0].describe()}, which diverged as extract returned it" if wrong else ""


def check_quantized(result: ScheduleResult, run: EngineRun, requests: List[EngineRequest], plan,
                    calls: Optional[CallTrail] = None):
    """After the engine's first step that generated a token, every layer that
    mlx-lm's solo run quantizes (``plan``, a ``CachePlan``) holds (packed,
    scales, biases) triples of each request's bits and group size at its own
    key and value dims, and every other layer holds mlx-lm's own batched
    class for it: an engine that was asked for a quantized cache and keeps a
    layer in bf16 is caught here, whatever its tokens."""
    first = run.first_step
    if first is None:  # the engine does not say what its caches held
        return
    asked = {r.id: r for r in requests}
    where = f"{SERVE_LABEL}, engine step {first.step}"
    for rid in first.rows:
        request, found = asked[rid], []
        if first.layers and len(first.layers) != len(plan.layers):  # none: the batch was gone already
            found.append(Divergence(QUANTIZED, where, rid, expected=len(plan.layers), actual=len(first.layers),
                                    detail="layers in the engine's batch, where mlx-lm's prompt cache has "
                                           f"{len(plan.layers)}"))
        for planned, layer in zip(plan.layers, first.layers):
            number = planned.index
            if not planned.quantized:
                if layer.cache != planned.batched:
                    found.append(Divergence(
                        QUANTIZED, where, rid, tensor="state", layer=number, expected=planned.batched,
                        actual=layer.cache,
                        detail=f"layer {number} holds a {layer.cache}, where mlx-lm batches its {planned.cache} "
                               f"as a {planned.batched} (mlx-lm does not quantize this layer)"))
                continue
            for tensor, dim in (("keys", planned.key_dim), ("values", planned.value_dim)):
                held = held_otherwise(getattr(layer, tensor), request.bits, request.group_size, dim)
                if held is not None:
                    found.append(Divergence(
                        QUANTIZED, where, rid, tensor=tensor, layer=number,
                        detail=f"layer {number} holds a {layer.cache} whose {tensor} are {held}, where "
                               f"(packed, scales, biases) triples of {request.bits} bits, group size "
                               f"{request.group_size} at {tensor[:-1]} dim {dim} were asked for"))
        # The members that made this batch: where its bits and group size came from.
        made = calls.reshaped(rid, first.step) if calls is not None else ()
        result.note(0, QUANTIZED, [rid], len(first.layers), [replace(d, reshaped=made) for d in found])


def held_otherwise(held, bits: int, group_size: int, head_dim: int) -> Optional[str]:
    """None when ``held`` is a triple of ``bits`` and ``group_size`` (what
    ``mx.quantize`` makes of ``head_dim`` columns), else what it is, in words."""
    if not (isinstance(held, (tuple, list)) and len(held) == 3 and all(isinstance(x, mx.array) for x in held)):
        return in_words(held, where_a_triple=True)
    packed, scales, biases = held
    held_bits, held_group = packed.shape[-1] * 32 / head_dim, head_dim / scales.shape[-1]
    if packed.dtype != mx.uint32 or biases.shape != scales.shape or (held_bits, held_group) != (bits, group_size):
        return f"{a_triple(held)} ({held_bits:g} bits, group size {held_group:g})"
    return None


def compare_request(result: ScheduleResult, request: EngineRequest, expected: SoloGeneration,
                    actual: Optional[Generated], origin: str = "", calls: Optional[CallTrail] = None):
    """Note one request's tokens and log-probs against its generation alone,
    up to and including the first differing token. ``origin``: the stored
    entry both started from, in words (empty: from nothing); ``calls``: the
    members the engine called, which name the one most likely at fault."""
    rid = request.id
    tokens = actual.tokens if actual is not None else []
    logprobs = actual.logprobs if actual is not None else []
    steps = actual.steps if actual is not None else []
    made = {"tokens": 0, "vectors": 0, "values": 0}
    found = []

    def diverged(check, i, index=None, want=None, got=None, detail=""):
        step = steps[i] if i < len(steps) else None
        found.append(Divergence(
            check, f"{SERVE_LABEL}, engine step {step}", rid, tensor=LOGPROBS if check == LOGPROBS else TOKENS,
            step=i, index=index, expected=want, actual=got,
            detail="; ".join(part for part in (f"token {i} at engine step {step}", origin, detail) if part),
            reshaped=calls.reshaped(rid, step) if calls is not None else ()))

    for i, want in enumerate(expected.tokens):
        if i >= len(tokens):
            diverged(LENGTH, i, None, len(expected.tokens), len(tokens), f"token {i} ({want}) never came")
            break
        made["tokens"] += 1
        vector, got = expected.logprobs[i], logprobs[i] if i < len(logprobs) else None
        if got is None:
            diverged(LOGPROBS, i, detail="no log-probs for this token")
        else:
            if got.size == 1 and vector.size != 1:
                vector = vector[tokens[i]].reshape(got.shape)  # the engine's chosen token's entry
                made["values"] += 1
            else:
                made["vectors"] += 1
            difference = first_difference(vector, got)
            if difference is not None:
                diverged(LOGPROBS, i, *difference)
        if tokens[i] != want:
            diverged(TOKENS, i, None, want, tokens[i])
            break  # later tokens follow different text
    else:
        if len(tokens) > len(expected.tokens):
            n = len(expected.tokens)
            diverged(LENGTH, n, None, n, len(tokens), "more tokens than max_tokens")
    result.row(rid).metrics = {"tokens compared": made["tokens"], "log-prob vectors compared": made["vectors"],
                               "log-prob values compared": made["values"], "oracle": ", ".join(part for part in (semantics(request), origin) if part)}
    result.note(0, TOKENS, [rid], made["tokens"])
    result.note(0, LOGPROBS, [rid], made["vectors"] + made["values"])
    for divergence in found:  # each under its own check, in the order found
        result.note(0, divergence.check, [rid], 0, [divergence])


def describe_timeline(timeline: List[dict]) -> List[str]:
    """One line per engine step, for failure messages."""
    if not timeline:
        return ["(the engine gives no timeline)"]
    lines = []
    for s in timeline:
        parts = [f"step {s['step']:3d}"]
        for label, key in (("arrive", "arrived"), ("from store", "from_store"), ("prefill", "prompt_batch"),
                           ("join", "joined"), ("generate", "generation_batch"), ("finish", "finished"),
                           ("store", "stored")):
            if s.get(key):
                parts.append(f"{label} {','.join(s[key])}")
        lines.append("  ".join(parts))
    return lines


def explain(judged) -> str:
    """What a judged run (a ScheduleVerdict) that did not pass found, with the engine's timeline."""
    result = judged.evidence
    lines = [f"L3 {result.schedule}: {judged.verdict}" + (f" ({result.reason})" if result.reason else "")]
    for row in result.rows:
        lines += [f"  {d.message()}" for d in row.divergences[:3]]
    return "\n".join(lines + describe_timeline(result.timeline)[:40])

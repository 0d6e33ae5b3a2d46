"""L3, a real engine: an engine (mlx-lm's BatchGenerator by default) serves an
arrivals schedule with the cache under test, deciding joins, batched prefill,
finishes and leaves by itself; every request's tokens and log-probs are then
compared with the request generated alone.

The oracle is ``mlx_lm.generate.generate_step`` (greedy), alone, with the
cache semantics the engine uses (``oracle/generation.py``): quantized from
the first token, as BatchGenerator computes it, or with ``quantized_kv_start:
N`` mlx-lm's delayed conversion, which BatchGenerator cannot serve (not
supported) and an engine that converts can.

Conversations (a prompt cache in the engine block): a request the engine
started from a stored entry is compared with the same prompt alone from the
same entry (``generate_from_prefix``). "The same entry" is the bytes the
engine stored, as they were when it stored them: what ``extract`` returned,
copied at that moment into mlx-lm's own ``QuantizedKVCache``. Not the
entry's bytes when it is fetched (an entry that changed after it was stored
is the bug to catch), and not an entry the oracle computes itself (a prefix
computed in another call need not be bit-identical; the finished turn that stored
it is compared on its own). mlx-lm's ``LRUPromptCache`` then does its own
deep copy and trim of it.

Comparison, per request: tokens position by position, and at each position
the log-probs bit for bit (dtype, shape and bytes; the full vector when the
engine gives one, else the chosen token's value against the oracle vector's
entry). Comparison stops after the first differing token: from there on the
engine and the oracle condition on different text. Every comparison made is
noted in the run's evidence, as at L1 and L2, under the one event an engine
run has, ``#0 serve``; ``reports/verdicts.judge`` says what it means.
"""

import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from kvparity.oracle.generation import (
    SoloGeneration, StoredPrefix, cached_generate_alone, generate_from_prefix, semantics,
)
from kvparity.oracle.mlx_lm_versions import MlxLmDefectFound, defect_for_model, first_write_defect
from kvparity.oracle.models import load_model
from kvparity.oracle.solo import prompt_tokens
from kvparity.suites.core.members import RESHAPING_MEMBERS, WRITE
from kvparity.suites.core.raised import ForwardRaised, HungEarlier, MemberRaised, handed_unlike_mlx_lm, in_forward, layer_of
from kvparity.suites.core.adapter import calls_made
from kvparity.suites.format.arrivals import ArrivalSchedule, check_fits
from kvparity.suites.format.checks import CHECKS, EXTRACT, LENGTH, LOGPROBS, MASK, OUTPUT_CHECKS, QUANTIZED, TOKENS
from kvparity.suites.core.compare import Divergence, a_triple, compare_named, first_difference, in_words
from kvparity.suites.l3.engines import (
    EngineRequest,
    EngineRun,
    EngineUnsupported,
    Generated,
    make_engine,
)
from kvparity.suites.core.evidence import (
    MLX_LM_DEFECT, NOT_SUPPORTED, ORACLE_CANNOT_RUN, REFUSED, ScheduleResult, note_not_judged, note_raised,
)
from kvparity.suites.core.flight import FLIGHT
from kvparity.suites.format.levels import L3

SERVE = "serve"  # an engine run is one event: the engine serves the whole schedule
SERVE_LABEL = f"#0 {SERVE}"
FROM_STORE = "prompt tokens from a stored entry"  # a row metric of conversations


def engine_requests(schedule: ArrivalSchedule, vocab_size: int, tokenizer=None) -> List[EngineRequest]:
    """The requests as an engine gets them: a first turn's prompt starts with
    the system prompt when it asks for it; a next turn's holds its own tokens."""
    system = tuple(prompt_tokens(schedule.system, vocab_size, tokenizer)) if schedule.system else ()
    return [
        EngineRequest(
            id=r.id,
            prompt=(system if r.system else ()) + tuple(prompt_tokens(r, vocab_size, tokenizer)),
            arrival=r.arrival,
            max_tokens=r.max_tokens,
            bits=r.bits,
            group_size=r.group_size,
            quantized_kv_start=r.quantized_kv_start,
            prefill_step_size=r.prefill_step_size,
            continues=r.continues,
        )
        for r in schedule.requests.values()
    ]


def run_l3(schedule: ArrivalSchedule, implementation, engine_spec: Optional[str] = None,
           model_name: Optional[str] = None, use_cache: bool = True) -> ScheduleResult:
    """Serve ``schedule`` on the engine with ``implementation``'s batch cache
    and note every request's comparisons with its generation alone."""
    loaded = load_model(model_name or schedule.model)
    result = ScheduleResult(schedule.name, L3, implementation.name, [SERVE], path=schedule.path,
                            model=loaded.name, model_sha256=loaded.sha256, model_source=loaded.source())
    for rid in schedule.requests:
        result.row(rid)
    start = time.perf_counter()
    unfit = check_fits(schedule, loaded.plan, loaded.vocab_size, loaded.tokenizer is not None)
    if unfit:
        result.stop(NOT_SUPPORTED, unfit)
        return result
    defect = defect_for_model(loaded) or next(
        (found for r in schedule.requests.values() if r.quantized_kv_start is None
         for found in [first_write_defect(r.bits, r.group_size, loaded.plan.dims)] if found), None)
    if defect is not None:
        result.stop(MLX_LM_DEFECT, defect.attribution())
        return result
    requests = engine_requests(schedule, loaded.vocab_size, loaded.tokenizer)
    first_turns = [r for r in requests if r.continues is None]
    solos = generate_solos(result, loaded, first_turns, use_cache)
    served = (serve(result, schedule, implementation, engine_spec, loaded, requests, use_cache)
              if solos is not None else None)
    run, calls = served or (None, None)
    if run is not None:
        check_quantized(result, run, requests, loaded.plan, calls)
        ran = {}  # request -> its solo generation, whose cache its stored entries are held to
        for request in requests:
            if request.continues is not None:  # a next turn: its prompt as the engine served it
                if request.id not in run.prompts:
                    result.stop(NOT_SUPPORTED, f"the engine served {request.id!r}, a next turn, without "
                                               f"saying its prompt (EngineRun.prompts)")
                    return result
                request = replace(request, prompt=run.prompts[request.id], continues=None)
            use = run.prefixes.get(request.id)
            if use is None:  # from nothing: the solo from scratch
                origin = ""
                if request.id not in solos:  # a next turn the store had nothing for
                    solos.update(generate_solos(result, loaded, [request], use_cache) or {})
                solo = solos.get(request.id)
            else:  # from a stored entry: the oracle starts from the same one
                entry = run.stored[use.entry]
                origin = f"from {entry.describe()}: {use.cached} prompt tokens"
                solo = solo_from_entry(result, loaded, request, entry, use)
            if solo is None:  # the oracle could not run (the run stopped), or noted why not
                if result.stopped:
                    return result
                continue
            compare_request(result, request, solo, run.outputs.get(request.id), origin, calls)
            if tuple(request.prompt) == tuple(run.prompts.get(request.id, request.prompt)):  # as check_stored asks
                ran[request.id] = solo
            if schedule.conversation:
                result.row(request.id).metrics[FROM_STORE] = use.cached if use else 0
        check_stored(result, loaded, requests, run, lambda entry: calls.by(entry.step), use_cache, ran)
        result.seconds = time.perf_counter() - start
    return result


def generate_solos(result: ScheduleResult, loaded, requests, use_cache) -> Optional[Dict[str, SoloGeneration]]:
    """The oracle first: where mlx-lm's own path cannot run (a backend without
    the kernel), the engine, built on the same path, says nothing either."""
    solos = {}
    for request in requests:
        try:
            solos[request.id] = cached_generate_alone(loaded.model, request, loaded.sha256, use_cache)
        except Exception as error:
            result.stop(ORACLE_CANNOT_RUN, f"request {request.id!r}: mlx-lm's solo generate_step raised "
                                           f"{type(error).__name__}: {error}")
            return None
    return solos


def solo_from_entry(result: ScheduleResult, loaded, request: EngineRequest, entry, use) -> Optional[SoloGeneration]:
    """The request alone from the entry the engine started it from; None (and
    a divergence noted) when mlx-lm's QuantizedKVCache cannot hold that entry."""
    if entry.layers is None:
        result.note(0, EXTRACT, [request.id], 0, [Divergence(
            EXTRACT, SERVE_LABEL, request.id, detail=f"{entry.describe()}, which {request.id!r} started from, "
                                                     f"is no solo QuantizedKVCache: {entry.unusable}")])
        return None
    solo, cached = generate_from_prefix(loaded.model, request, request.prompt, entry)
    if cached != use.cached:  # one entry, one trie: mlx-lm picks the same prefix
        raise RuntimeError(f"request {request.id!r}: the engine took {use.cached} prompt tokens from "
                           f"{entry.describe()}, the oracle {cached}")
    return solo


@dataclass
class CallTrail:
    """The protocol members the engine called, in order, and where each of
    its steps ended in that list (where the engine notes ``EngineStep.calls``)."""

    members: List[str]
    ends: Dict[int, int]  # engine step -> members called by its end
    arrived: Dict[str, int]  # request -> the engine step it arrived at

    def by(self, step: int) -> Tuple[str, ...]:
        """The members that reshaped the batch or made its mask until the end
        of engine ``step`` (all of them where the engine does not note its
        steps): what can have left a row wrong by then, whichever request's."""
        return reshaping(self.members[:self.ends.get(step, len(self.members))])

    def reshaped(self, rid: str, bad_step: Optional[int]) -> Tuple[str, ...]:
        """The members that reshaped the batch from the request's arrival up
        to the write that made its wrong token at ``bad_step``, in order of
        first call: where its state can have gone wrong (a member leaves
        wrong state that a later write exposes, as at L1). Empty when the
        engine does not note its steps."""
        if bad_step not in self.ends or rid not in self.arrived:
            return ()
        begin, end = self.ends.get(bad_step - 1, 0), self.ends[bad_step]
        writes = [i for i in range(begin, end) if self.members[i] == WRITE]
        return reshaping(self.members[self.ends.get(self.arrived[rid] - 1, 0):writes[-1] + 1 if writes else end])


MASK_MEMBER = CHECKS[MASK].reads  # make_mask: every forward reads what it returned
EXTRACT_MEMBER = CHECKS[EXTRACT].reads  # extract: a stored entry is what it returned


def reshaping(members) -> Tuple[str, ...]:
    """The members among ``members`` that reshape a batch or make the mask
    its forward reads, once each, in order of first call."""
    return tuple(dict.fromkeys(m for m in members if m in RESHAPING_MEMBERS or m == MASK_MEMBER))


def serve(result: ScheduleResult, schedule: ArrivalSchedule, implementation, engine_spec, loaded,
          requests, use_cache: bool) -> Optional[Tuple[EngineRun, CallTrail]]:
    """The engine's run and the members it called, or None when it stopped:
    what raised is worded as at every level (level, schedule, event, layer and frame)."""
    settings = schedule.engine
    everyone = list(schedule.requests)
    # The engine gets the class itself; while it serves, the class counts
    # the members the engine calls and names what raises.
    calls_before = dict(implementation.calls)
    with implementation.watching():
        first_call, trail_start = calls_made(implementation.batch_class), len(implementation.trail)
        engine = make_engine(engine_spec, loaded.model, implementation.batch_class, settings)
        if schedule.conversation and not getattr(engine, "serves_conversations", False):
            result.stop(NOT_SUPPORTED, f"the engine {engine.name} does not serve conversations "
                                       f"(no serves_conversations = True): this file needs a prompt cache")
            return None
        try:
            FLIGHT.event(SERVE_LABEL, 0, everyone)
            run = engine.serve(requests)
            members = implementation.trail[trail_start:]
        except EngineUnsupported as error:
            result.stop(NOT_SUPPORTED, str(error))
            return None
        except MlxLmDefectFound as found:
            result.stop(MLX_LM_DEFECT, str(found))
            return None
        except HungEarlier as skipped:
            note_not_judged(result, SERVE_LABEL, skipped)
            return None
        except MemberRaised as raised:  # the cache under test declined or broke
            raised.layer = layer_of(raised, loaded.model.layers)
            what = f"the engine's call of {raised}"
            unlike = handed_unlike_mlx_lm(raised, implementation.batch_class)
            if unlike:  # the engine's finding, not the cache's refusal: mlx-lm's engine hands no such thing
                note_raised(result, 0, SERVE_LABEL, ForwardRaised(raised.error, ForwardRaised.ENGINE), everyone,
                            said=f"the engine handed {raised.member} {unlike}, which mlx-lm's own engine never "
                                 f"does; {what}")
            elif raised.capability or raised.refused:
                result.stop(NOT_SUPPORTED if raised.capability else REFUSED,
                            f"{result.level} {result.schedule}, event {SERVE_LABEL}: {what}")
            else:
                made = reshaping(implementation.trail[trail_start:])
                wrong = wrong_so_far(result, loaded, requests, engine, made, use_cache)
                if wrong:  # a row stored before it raised was wrong already: that is the first divergence
                    consumed = ForwardRaised(raised.error, ForwardRaised.ENGINE)
                    consumed.layer = raised.layer
                    note_raised(result, 0, SERVE_LABEL, consumed, everyone, said=f"{what}, after {wrong}",
                                reshaped=made + (EXTRACT_MEMBER,) * (EXTRACT_MEMBER not in made))
                else:
                    note_raised(result, 0, SERVE_LABEL, raised, everyone, said=what)
            return None
        except Exception as error:  # the engine or the model's forward broke where mlx-lm alone did not
            frame = ForwardRaised.FRAME if in_forward(error, loaded.model) else ForwardRaised.ENGINE
            raised = ForwardRaised(error, frame)
            raised.layer = layer_of(error, loaded.model.layers)
            # What reshaped the batch before it broke: a member's wrong state can make the forward raise.
            made = reshaping(implementation.trail[trail_start:])
            wrong = wrong_so_far(result, loaded, requests, engine, made, use_cache)
            note_raised(result, 0, SERVE_LABEL, raised, everyone, said=f"{raised}, after {wrong}" if wrong else "",
                        reshaped=made + (EXTRACT_MEMBER,) * (bool(wrong) and EXTRACT_MEMBER not in made))
            return None
    result.members = implementation.calls_since(calls_before)
    result.timeline = [
        {"step": s.step, "arrived": s.arrived, "prompt_batch": s.prompt_rows, "joined": s.joined,
         "generation_batch": s.generation_rows, "finished": s.finished,
         "prompt_width": s.prompt_width, "generation_width": s.generation_width,
         "stored": s.stored, "from_store": s.from_store}
        for s in run.timeline or ()]
    ends = {s.step: s.calls - first_call for s in run.timeline or () if s.calls is not None and first_call is not None}
    arrived = {rid: s.step for s in run.timeline or () for rid in s.arrived}
    return run, CallTrail(members, ends, arrived)


def check_stored(result: ScheduleResult, loaded, requests: List[EngineRequest], run: EngineRun,
                 made: Callable[[StoredPrefix], Tuple[str, ...]], use_cache: bool,
                 ran: Optional[Dict[str, SoloGeneration]] = None) -> List[StoredPrefix]:
    """Each entry the engine stored, as ``extract`` returned it, against
    mlx-lm's own cache of its request generated alone (from the entry that
    request started from, as the oracle starts it), on the tokens it is
    stored under: its offset is their count, its bits and group size the
    request's, and every quantized layer's bytes on them mlx-lm's. What the
    engine and the oracle later start from is that entry, so a wrong row
    would be judged against itself; here it is a divergence before anything
    that consumed it, carrying the members that can have made it wrong
    (``made(entry)``: those that reshaped the batch until it was stored, and
    ``extract``), which join it to the group of the one among them at
    fault, as a request's wrong token joins. Unless the request's own output
    diverged before the entry was stored: that output is then the first
    divergence. Entries of a request that started from a wrong one are not
    checked again: their first divergence is that entry's. ``ran``: the solo
    generations the requests' outputs were compared with, whose caches are
    those (a request not among them is generated, or read from the solo-run
    cache, here). Returns the entries that diverged."""
    asked, wrong = {r.id: r for r in requests}, []
    alone = {rid: solo.cache for rid, solo in (ran or {}).items()}
    for number in sorted(run.stored):
        entry = run.stored[number]
        source = asked.get(entry.source)
        use = run.prefixes.get(entry.source)
        started_wrong = use is not None and any(w.number == use.entry for w in wrong)
        if entry.layers is None or source is None or started_wrong:  # unusable: said where a request starts from it
            continue
        if entry.source not in alone:
            alone[entry.source] = mlx_lm_cache_alone(loaded, source, run, use_cache)
        found, compared = entry_divergences(entry, alone[entry.source], loaded.plan)
        if found:
            wrong.append(entry)
            if output_diverged_by(result, run, entry.source, entry.step):  # its first divergence is that output's
                continue
            members = tuple(made(entry))
            found = [replace(d, reshaped=members + (EXTRACT_MEMBER,) * (EXTRACT_MEMBER not in members))
                     for d in found]
        result.note(0, EXTRACT, [entry.source], compared, found)
    return wrong


def output_diverged_by(result: ScheduleResult, run: EngineRun, rid: str, step: int) -> bool:
    """Whether a token or log-prob of ``rid`` that came out at engine step
    ``step`` or before diverged from its generation alone."""
    steps = run.outputs[rid].steps if rid in run.outputs else []
    return any(d.check in OUTPUT_CHECKS and d.step is not None and d.step < len(steps) and steps[d.step] <= step
               for d in result.row(rid).divergences)


def mlx_lm_cache_alone(loaded, request: EngineRequest, run: EngineRun, use_cache: bool) -> list:
    """mlx-lm's prompt cache of ``request`` generated alone to its end (a
    next turn with the prompt the engine served it, from the entry it
    started from): every token it holds, as mlx-lm computes it. From nothing,
    it is the cache the solo run its tokens are compared with ended with (one
    oracle cache entry); from an entry, computed here, as that solo run is."""
    prompt = run.prompts.get(request.id, request.prompt)
    request = replace(request, prompt=tuple(prompt), continues=None)
    use = run.prefixes.get(request.id)
    if use is None:
        return cached_generate_alone(loaded.model, request, loaded.sha256, use_cache).cache
    return generate_from_prefix(loaded.model, request, prompt, run.stored[use.entry])[0].cache


def entry_divergences(entry: StoredPrefix, alone: list, plan) -> Tuple[List[Divergence], int]:
    """(divergences, comparisons) of a stored entry's quantized layers
    against mlx-lm's cache ``alone`` on the entry's tokens."""
    n, found, compared = len(entry.tokens), [], 0
    where = dict(request=entry.source, detail=f"{entry.describe()}, as extract returned it, against mlx-lm's "
                                              "cache of that request alone")
    for planned, stored, solo in zip(plan.layers, entry.layers, alone):
        if not planned.quantized:
            continue
        compared += 1
        layer, name = planned.index, f"stored entry #{entry.number}"
        described, asked = (stored.offset, stored.bits, stored.group_size), (n, solo.bits, solo.group_size)
        if described != asked:
            found += [Divergence(EXTRACT, SERVE_LABEL, tensor=f"{name}: {what}", layer=layer, expected=e, actual=a,
                                 **where)
                      for what, e, a in zip(("offset", "bits", "group_size"), asked, described) if e != a]
            continue
        found += [replace(d, check=EXTRACT, detail=where["detail"]) for d in compare_named(
            tokens_of(solo, n), tokens_of(stored, n), f"{name}: ", event=SERVE_LABEL, request=entry.source,
            layer=layer)]
    return found, compared


def tokens_of(cache, n: int) -> dict:
    """A quantized layer's keys and values triples on its first ``n`` tokens, by name."""
    return {f"{side}.{part}": x[..., :n, :] for side in ("keys", "values")
            for part, x in zip(("packed", "scales", "biases"), getattr(cache, side))}


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


PREFILL_MODES = {"prefill_batch_size=1": 1, "engine default": None}


def prefill_modes(schedule: ArrivalSchedule) -> Dict[str, ArrivalSchedule]:
    """The schedule with each prompt prefilled alone (then ``extend``), and with
    the engine's default batched prefill (several right-padded prompts per call)."""
    return {label: schedule.with_engine(prefill_batch_size=size) for label, size in PREFILL_MODES.items()}

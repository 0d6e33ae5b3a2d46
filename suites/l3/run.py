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
from dataclasses import replace
from typing import Dict, List, Optional

from kvparity.oracle.generation import SoloGeneration, cached_generate_alone
from kvparity.oracle.mlx_lm_versions import defect_for_model, first_write_defect
from kvparity.oracle.models import load_model
from kvparity.oracle.solo import prompt_tokens
from kvparity.suites.format.arrivals import ArrivalSchedule, check_fits
from kvparity.suites.l3.engines import EngineRequest
from kvparity.suites.core.evidence import MLX_LM_DEFECT, NOT_SUPPORTED, ORACLE_CANNOT_RUN, ScheduleResult
from kvparity.suites.format.levels import L3

from kvparity.suites.l3.trail import SERVE, FROM_STORE
from kvparity.suites.l3.stored import solo_from_entry, check_stored
from kvparity.suites.l3.judging import check_quantized, compare_request
from kvparity.suites.l3.serving import serve


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


PREFILL_MODES = {"prefill_batch_size=1": 1, "engine default": None}


def prefill_modes(schedule: ArrivalSchedule) -> Dict[str, ArrivalSchedule]:
    """The schedule with each prompt prefilled alone (then ``extend``), and with
    the engine's default batched prefill (several right-padded prompts per call)."""
    return {label: schedule.with_engine(prefill_batch_size=size) for label, size in PREFILL_MODES.items()}

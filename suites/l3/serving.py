"""L3's serving: an engine drives the arrivals with the implementation
under test as its batch cache, every call it makes recorded, stopping at
the first request that goes wrong."""

from typing import Optional, Tuple
from kvparity.oracle.mlx_lm_versions import MlxLmDefectFound
from kvparity.suites.core.raised import (
    ForwardRaised, HungEarlier, MemberRaised, handed_unlike_mlx_lm, in_forward, layer_of,
)
from kvparity.suites.core.adapter import calls_made
from kvparity.suites.format.arrivals import ArrivalSchedule
from kvparity.suites.l3.engines import EngineRun, EngineUnsupported, make_engine
from kvparity.suites.core.evidence import (
    MLX_LM_DEFECT, NOT_SUPPORTED, REFUSED, ScheduleResult, note_not_judged, note_raised,
)
from kvparity.suites.core.flight import FLIGHT

from kvparity.suites.l3.trail import SERVE_LABEL, CallTrail, EXTRACT_MEMBER, reshaping
from kvparity.suites.l3.judging import wrong_so_far


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

"""The event loop every level's run shares (``drive``): the events applied
through a replay, each checked after it, until the implementation refuses
or cannot go on."""

from kvparity.suites.core.adapter import HungEarlier, MemberRaised
from kvparity.suites.core.flight import FLIGHT
from kvparity.suites.core.evidence import (
    NOT_SUPPORTED, ORACLE_CANNOT_RUN, REFUSED, OracleFailed, ScheduleResult, note_not_judged, note_raised,
)

from kvparity.suites.core.replay import NotSupported, Replay


def drive(result: ScheduleResult, replay: Replay, events, check) -> bool:
    """Apply ``events`` through ``replay``, calling ``check(event)`` after
    each; stop at what the implementation refuses or cannot do. Returns
    False once the run stopped. Anything else that raises is the harness's
    own failure and propagates."""
    trail = getattr(replay.backend.implementation, "trail", None)  # the members called, in order
    for event in events:
        label = event.label
        FLIGHT.event(label, event.index, replay.running() or list(replay.schedule.requests))
        mark = len(trail) if trail is not None else 0
        try:
            try:
                replay.apply(event)
            finally:  # what the event called, not what the checks call after it
                if trail is not None:
                    result.called[event.index] = trail[mark:]
            check(event)
        except NotSupported as error:
            result.stop(NOT_SUPPORTED, f"event {label}: {error}")
            return False
        except MemberRaised as raised:
            result.raised_by = raised.member
            if raised.capability:
                result.stop(NOT_SUPPORTED, f"event {label}: {raised.member} is not implemented "
                                           f"({raised.capability})")
            elif raised.refused:
                result.stop(REFUSED, f"event {label}: required member {raised.member} refused: {raised.error}")
            else:
                note_raised(result, event.index, label, raised, replay.running() or list(replay.schedule.requests))
            return False
        except OracleFailed as error:
            result.stop(ORACLE_CANNOT_RUN, f"event {label}: {error}")
            return False
        except HungEarlier as skipped:
            note_not_judged(result, label, skipped)
            return False
    return True

"""What L3 records of an engine's run: the protocol calls the engine made
on the batch under test, in order (``CallTrail``), each request's tokens,
and the names every L3 module gives a request's serving."""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple
from kvparity.suites.core.members import RESHAPING_MEMBERS, WRITE
from kvparity.suites.format.checks import CHECKS, EXTRACT, MASK, OUTPUT_CHECKS
from kvparity.suites.l3.engines import EngineRun
from kvparity.suites.core.evidence import ScheduleResult


SERVE = "serve"  # an engine run is one event: the engine serves the whole schedule
SERVE_LABEL = f"#0 {SERVE}"
FROM_STORE = "prompt tokens from a stored entry"  # a row metric of conversations


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


def output_diverged_by(result: ScheduleResult, run: EngineRun, rid: str, step: int) -> bool:
    """Whether a token or log-prob of ``rid`` that came out at engine step
    ``step`` or before diverged from its generation alone."""
    steps = run.outputs[rid].steps if rid in run.outputs else []
    return any(d.check in OUTPUT_CHECKS and d.step is not None and d.step < len(steps) and steps[d.step] <= step
               for d in result.row(rid).divergences)


def tokens_of(cache, n: int) -> dict:
    """A quantized layer's keys and values triples on its first ``n`` tokens, by name."""
    return {f"{side}.{part}": x[..., :n, :] for side in ("keys", "values")
            for part, x in zip(("packed", "scales", "biases"), getattr(cache, side))}

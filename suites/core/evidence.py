"""What a run finds: per schedule and row, the comparisons actually made
and every divergence, plus why a run stopped early.

This is evidence, not a verdict: ``reports/verdicts.py`` turns it into
outcomes under a policy. A row's evidence is a count per event and check of
comparisons made on what the implementation under test produced; a row with
nothing compared has no evidence, whatever else happened.
"""

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from kvparity.suites.core.raised import ForwardRaised, HungEarlier, MemberRaised
from kvparity.suites.format.checks import RAISED
from kvparity.suites.core.compare import Divergence
from kvparity.suites.core.flight import FLIGHT, MemberHung, ProcessDied

# Outcomes, shared by rows and schedules.
PASS = "pass"
FAIL = "FAIL"  # a gating divergence
REFUSED = "refused"  # a required member raised NotImplementedError: a failure
NO_EVIDENCE = "no evidence"  # nothing the policy requires was compared
NOT_SUPPORTED = "not supported"  # an optional capability is missing
ORACLE_CANNOT_RUN = "oracle cannot run"  # mlx-lm's own solo path fails on this backend
ORACLE_NONDETERMINISTIC = "oracle nondeterministic"  # mlx-lm's solo path differs from itself: nothing to judge by
# The installed mlx-lm's own batched path is wrong for this model whatever the
# cache holds (oracle/mlx_lm_versions.py names the defect): nothing to judge.
MLX_LM_DEFECT = "mlx-lm defect"
# Every divergence was declared in an expectations file, and the evidence is complete: does not gate.
EXPECTED_DIVERGENCE = "expected divergence"
# The run called a member that hung earlier in the same run (past --member-timeout): it was
# stopped there, not waited on again; the hang itself is the FAIL that judges the cache.
NOT_JUDGED = "not judged"
OUTCOMES = (PASS, FAIL, REFUSED, NO_EVIDENCE, NOT_SUPPORTED, ORACLE_CANNOT_RUN, ORACLE_NONDETERMINISTIC,
            MLX_LM_DEFECT, EXPECTED_DIVERGENCE, NOT_JUDGED)
FAILURES = (FAIL, REFUSED)
# What ends a schedule run early (ScheduleResult.stopped; "" when it ran to the end).
STOPS = (FAIL, REFUSED, NOT_SUPPORTED, ORACLE_CANNOT_RUN, ORACLE_NONDETERMINISTIC, MLX_LM_DEFECT, NOT_JUDGED)


@dataclass
class RowResult:
    request: str
    divergences: List[Divergence] = field(default_factory=list)
    # event index -> check -> comparisons made
    counts: Dict[int, Counter] = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)  # L2: logit statistics
    series: dict = field(default_factory=dict)  # L2: per-step logit series (index = step)
    # The checks this row stands on where its answer's form limits them, in
    # place of its level's (L4: a server that streams text without per-token
    # log-probs is judged on the text); empty: the level's.
    requires: Tuple[str, ...] = ()

    def compared(self, check: str = None) -> int:
        return sum(n for per_event in self.counts.values() for c, n in per_event.items()
                   if check is None or c == check)

    @property
    def checks(self) -> int:
        return self.compared()

    def compared_checks(self) -> set:
        """The checks that compared something for this row."""
        return {c for per_event in self.counts.values() for c, n in per_event.items() if n}

    @property
    def first(self) -> Optional[Divergence]:
        return min(self.divergences, key=lambda d: d.order, default=None)


@dataclass
class ScheduleResult:
    schedule: str
    level: str
    implementation: str
    event_kinds: List[str] = field(default_factory=list)  # kind of each event, in order
    rows: List[RowResult] = field(default_factory=list)
    stopped: str = ""  # one of STOPS when it ended early
    reason: str = ""  # why it stopped, or what raised
    path: Optional[str] = None
    model: Optional[str] = None
    model_sha256: Optional[str] = None
    # A model given by path (--model DIR or CONFIG.json): its path and the sha256 of
    # its config.json and of its weights; empty for kvparity's own models.
    model_source: dict = field(default_factory=dict)
    members: Dict[str, int] = field(default_factory=dict)  # protocol member -> calls made
    called: Dict[int, List[str]] = field(default_factory=dict)  # event index -> members its replay called, in order
    raised_by: str = ""  # the protocol member whose raising stopped the run (or the model's forward), if one did
    timeline: List[dict] = field(default_factory=list)  # L3: what the engine did, per engine step
    server: dict = field(default_factory=dict)  # L4: the server, its log's end, throughput and latency
    # How the oracle's stored solo runs were had (oracle/sealed.py): reused,
    # computed, dropped for not proving whole (and why); empty where none were.
    solo_cache: dict = field(default_factory=dict)
    seconds: float = 0.0

    def __post_init__(self):
        FLIGHT.result(self)  # under isolation, a crash from here on is this run's

    @property
    def events(self) -> int:
        return len(self.event_kinds)

    @property
    def divergences(self) -> List[Divergence]:
        return [d for row in self.rows for d in row.divergences]

    @property
    def first(self) -> Optional[Divergence]:
        return min(self.divergences, key=lambda d: d.order, default=None)

    def row(self, request: str) -> RowResult:
        for row in self.rows:
            if row.request == request:
                return row
        self.rows.append(RowResult(request))
        return self.rows[-1]

    def note(self, event_index: int, check: str, requests, made: int = 1, found=()):
        """``made`` comparisons of ``check`` for each of ``requests`` after an
        event; divergences for the batch as a whole go to every row named."""
        for rid in requests:
            counts = self.row(rid).counts
            at = counts.get(event_index)
            if at is None:
                at = counts[event_index] = Counter()
            at[check] += made
        for divergence in found:
            targets = [divergence.request] if divergence.request is not None else requests
            for rid in targets:
                self.row(rid).divergences.append(divergence)

    def last_called(self, event_index: int):
        """(event index, member) of the last protocol member the replay called
        at or before ``event_index``; None when nothing was recorded."""
        for index in sorted((i for i in self.called if i <= event_index), reverse=True):
            if self.called[index]:
                return index, self.called[index][-1]
        return None

    def stop(self, outcome: str, reason: str):
        """The run ends early; what was recorded stays recorded."""
        self.stopped, self.reason = outcome, reason

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["events"] = self.events
        for row, row_doc in zip(self.rows, doc["rows"]):
            row_doc["counts"] = {str(e): dict(c) for e, c in row.counts.items()}
            row_doc["checks"] = row.checks
        return doc


class OracleFailed(Exception):
    """mlx-lm's own solo path raised on this backend."""


class OracleNondeterministic(Exception):
    """mlx-lm's own solo path, run twice on the same request, produced
    different bytes: the oracle differs from itself, so nothing the
    implementation produced can be judged against it."""

    def __init__(self, request, call, tensor, index, first, second, detail=""):
        self.request, self.call, self.tensor, self.index = request, call, tensor, index
        self.first, self.second, self.detail = first, second, detail
        where = f"call {call}" if isinstance(call, int) else str(call)
        at = f", flat index {index}" if index is not None else ""
        super().__init__(f"mlx-lm's solo path for {request!r} differs from itself between two runs: "
                         f"{where}, {tensor}{at}: first run {first!r}, second run {second!r}"
                         + (f" ({detail})" if detail else ""))


def died(result: ScheduleResult) -> bool:
    """Whether the run's process died or hung in it (``crashed``): running it again would too."""
    return any(f"{kind.__name__}:" in result.reason for kind in (ProcessDied, MemberHung))


def crashed(record: dict) -> ScheduleResult:
    """The FAIL of a schedule run whose process died, or was stopped because
    a member hung (``record``: the flight recorder's last word,
    ``suites/core/flight.py``), naming the event and the protocol member it died
    or hung in."""
    level, _, name = record["label"].partition(" ")
    result = ScheduleResult(**{"schedule": name, "level": level, "implementation": "", **record.get("result", {})})
    member = record.get("member")
    label = record.get("event") or "#0 (before its first event)"
    how = f"the process died of {record['signal']}"
    if record.get("hung") is not None and member is not None:
        raised = MemberRaised(member, MemberHung(f"{member} did not return within {record['hung']:g} s "
                                                 "(--member-timeout): a hang inside the implementation; the "
                                                 "process running it was stopped"))
    elif member is None:
        raised = ForwardRaised(ProcessDied(f"{how}, while no protocol member was running (the model's forward or "
                                           "the engine on the batch, or mlx-lm's solo path)"), "the process")
    else:
        raised = MemberRaised(member, ProcessDied(f"{how} while {member} ran: a crash inside the implementation"))
    if member is not None:  # it was called: the evidence that it ran
        result.members = {member: 1}
    note_raised(result, record.get("index") or 0, label, raised, record.get("requests") or ["(the batch)"])
    return result


def note_not_judged(result: ScheduleResult, label: str, skipped: HungEarlier):
    """The run called a member that hung earlier in this run: it stops
    there, not judged; what it found before stays recorded (a divergence
    found before still fails it)."""
    result.stop(NOT_JUDGED, f"{result.level} {result.schedule}, event {label} {skipped}")


def note_raised(result: ScheduleResult, event_index: int, label: str, raised: MemberRaised, requests,
                said: str = "", reshaped=()):
    """The implementation's path raised where mlx-lm's solo path did not: a
    failure, worded the same at every level (``said``: how, where the
    raising member alone does not tell it)."""
    result.raised_by = raised.member
    said = said or str(raised)
    result.stop(FAIL, f"{result.level} {result.schedule}, event {label}: {said}")
    result.note(event_index, RAISED, requests, made=0, found=[Divergence(RAISED, label, detail=said,
                                                                         reshaped=tuple(reshaped))])

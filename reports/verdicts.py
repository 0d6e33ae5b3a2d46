"""Verdicts from evidence: what a run's comparisons mean under a policy.

A row passes only when nothing gating diverged and every check its level
requires compared something on what the implementation produced. A recorded
divergence is never overwritten by a later refusal or missing capability.
Divergences an expectations file declares (``reports/expectations.py``) do
not gate: a row whose only divergences were declared, with the same
evidence, is an expected divergence.

``judge`` reads a run's evidence and returns a new, frozen verdict beside
it; the evidence records are never written.
"""

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Dict, List, Mapping, Optional, Tuple

from kvparity.reports.expectations import UNEXPECTEDLY_PASSING
from kvparity.reports.policy import BIT_EXACT, DIVERGED as TIER_DIVERGED, GATE, Policy
from kvparity.suites.search import coverage as coverage_model
from kvparity.suites.core.members import REQUIRED_MEMBERS
from kvparity.suites.format.checks import CHECKS, LOGITS
from kvparity.suites.core.evidence import (
    EXPECTED_DIVERGENCE, FAIL, FAILURES, MLX_LM_DEFECT, NO_EVIDENCE, NOT_JUDGED, NOT_SUPPORTED, ORACLE_CANNOT_RUN,
    ORACLE_NONDETERMINISTIC, OUTCOMES, PASS, REFUSED, RowResult, ScheduleResult,
)
from kvparity.suites.format.levels import L1, LEVELS, Level
from kvparity.suites.core.loading import load

EXIT_OK, EXIT_BROKEN, EXIT_USAGE, EXIT_CANNOT_JUDGE = 0, 1, 129, 125
EXIT_INTERRUPTED = 130
# What each exit status of a run means, as the report header says it.
STATUS = {EXIT_OK: "parity holds", EXIT_BROKEN: "parity broken",
          EXIT_CANNOT_JUDGE: "cannot judge: no evidence or coverage gaps",
          EXIT_INTERRUPTED: "interrupted: what finished is reported, the rest did not run"}
# The outcomes that judge a schedule run; the others say why it could not be judged.
JUDGED = (PASS, FAIL, REFUSED, EXPECTED_DIVERGENCE)
# What became of one check in a row or schedule, for the per-check table.
HELD, DIVERGED, NOT_COMPARED = "held", "diverged", "not compared"
CHECK_STATES = (HELD, DIVERGED, EXPECTED_DIVERGENCE, NOT_COMPARED)


@dataclass(frozen=True)
class RowVerdict:
    """What one row's evidence means under a policy."""

    evidence: RowResult
    verdict: str  # one of OUTCOMES
    reason: str
    tier: Optional[str]  # the strongest tier the row reached
    required: str  # the tier the policy asked for
    declared: Mapping[int, int]  # divergence position -> declaration expecting it
    failing: Tuple = ()  # the divergences that made it FAIL: gating ones, or logits short of the tier


@dataclass(frozen=True)
class ScheduleVerdict:
    """What a schedule run's evidence means under a policy: its outcome, and
    each row's in the evidence's row order. The evidence is only read."""

    evidence: ScheduleResult
    verdict: str  # one of OUTCOMES
    rows: Tuple[RowVerdict, ...]


def judge(result: ScheduleResult, policy: Policy, expectations=None) -> ScheduleVerdict:
    """Every row's verdict and tier, then the schedule's; ``expectations``
    (``reports.expectations.Expectations``) declares divergences that do not gate."""
    level = LEVELS[result.level]
    rows = tuple(_judge_row(result, row, level, policy, expectations) for row in result.rows)
    verdicts = {row.verdict for row in rows}
    if FAIL in verdicts:
        verdict = FAIL
    elif result.stopped:
        verdict = result.stopped
    elif NO_EVIDENCE in verdicts or not rows:
        verdict = NO_EVIDENCE
    elif EXPECTED_DIVERGENCE in verdicts:
        verdict = EXPECTED_DIVERGENCE
    else:
        verdict = PASS
    return ScheduleVerdict(result, verdict, rows)


def _judge_row(result: ScheduleResult, row: RowResult, level: Level, policy: Policy, expectations) -> RowVerdict:
    declared = {} if expectations is None else {
        i: n for i, n in ((i, expectations.declared(d, result)) for i, d in enumerate(row.divergences))
        if n is not None}
    undeclared = [d for i, d in enumerate(row.divergences) if i not in declared]
    gating = [d for d in undeclared if gates(d, level, policy)]
    if level.logit_tiers:
        tier, required = policy.logit_tier(row.metrics), policy.required()
        # A tier short of the gate is expected when every logits divergence was declared.
        logits = [i for i, d in enumerate(row.divergences) if d.check == LOGITS]
        logits_ok = policy.accepts(tier) or bool(logits) and all(i in declared for i in logits)
    else:
        tier = None if not row.checks else (TIER_DIVERGED if gating else BIT_EXACT)
        required, logits_ok = BIT_EXACT, True
    missing = [c for c in required_checks(row, level) if not row.compared(c)]
    failing = tuple(gating) if logits_ok else tuple(gating) + tuple(
        d for d in undeclared if d.check == LOGITS and d not in gating)
    if gating or not logits_ok:
        verdict = FAIL
        reason = (min(gating, key=lambda d: d.order).message() if gating else
                  f"logits reached {tier}, the policy requires {policy.required()}")
    elif result.stopped:
        verdict, reason = result.stopped, result.reason
    elif missing:
        verdict = NO_EVIDENCE
        reason = f"nothing compared for {', '.join(missing)} on the implementation's output"
    elif declared:
        verdict, reason = EXPECTED_DIVERGENCE, _declared(declared, expectations)
    else:
        verdict, reason = PASS, ""
    failing = failing if verdict == FAIL else ()
    return RowVerdict(row, verdict, reason, tier, required, MappingProxyType(declared), failing)


def required_checks(row, level: Level) -> Tuple[str, ...]:
    """The checks a row must have compared to pass: its own where its answer's form limits them, else its level's."""
    return row.requires or level.requires


def gates(divergence, level: Level, policy: Policy) -> bool:
    """Whether a divergence, when not declared, fails its row by itself; a
    check judged by the logit tier does not (the row's tier does)."""
    return level.every_divergence_gates or policy.gates(divergence, level.name)


def _declared(declared: Mapping[int, int], expectations) -> str:
    """Which declarations a row's divergences matched, with their reasons."""
    matched = Counter(declared.values())
    return "; ".join(f"{n} {expectations.declarations[i].check} divergence(s) declared: "
                     f"{expectations.declarations[i].reason}" for i, n in sorted(matched.items()))


@dataclass
class RunVerdict:
    """A whole run: counts per outcome, coverage, and the exit status."""

    counts: Dict[str, int]
    coverage: Dict[str, Counter]  # event kind -> check -> comparisons
    members: Counter  # protocol member -> calls
    gaps: List[str] = field(default_factory=list)  # what the run should have shown and did not
    checks: Dict[str, Dict[str, Counter]] = field(default_factory=dict)  # see check_table
    declarations: List[dict] = field(default_factory=list)  # Expectations.applied: each declaration's fate
    unexpected_passes_gate: bool = False  # the policy fails a run with a declaration unexpectedly passing
    cells: Optional[dict] = None  # the coverage model at L1: see model_coverage
    failures: Optional[list] = None  # reports.failures.FailureGroup: set by the command that ran the schedules
    levels: Dict[str, Counter] = field(default_factory=dict)  # level -> outcome -> schedule runs
    # A run stopped by a signal: {"signal": its name, "finished": runs, "planned": runs or None}; what
    # finished is judged as ever, and the run's status is EXIT_INTERRUPTED whatever they say.
    interrupted: Optional[dict] = None
    # The generated budget run after the catalog (reports/commands/generated.py's record); None where none ran.
    # Its failing runs are among the run's; what passed is counted here.
    generated: Optional[dict] = None

    @property
    def unexpectedly_passing(self) -> List[dict]:
        return [d for d in self.declarations if d["status"] == UNEXPECTEDLY_PASSING]

    @property
    def exit_status(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        if any(self.counts[v] for v in FAILURES):
            return EXIT_BROKEN
        if self.unexpected_passes_gate and self.unexpectedly_passing:
            return EXIT_BROKEN
        if self.gaps or self.counts[NO_EVIDENCE] or not (self.counts[PASS] or self.counts[EXPECTED_DIVERGENCE]):
            return EXIT_CANNOT_JUDGE
        return EXIT_OK

    @property
    def unjudged_levels(self) -> Dict[str, Counter]:
        """The levels that ran and of which no schedule run was judged (all
        mlx-lm defect, not supported, ...): level -> those runs' outcomes."""
        return {level: outcomes for level, outcomes in self.levels.items()
                if sum(outcomes.values()) and not any(outcomes[v] for v in JUDGED)}

    @property
    def headline(self) -> str:
        parts = [f"{self.counts[PASS]} passed", f"{self.counts[FAIL]} failed"]
        parts += [f"{self.counts[v]} {v}"
                  for v in (EXPECTED_DIVERGENCE, REFUSED, NO_EVIDENCE, NOT_SUPPORTED, ORACLE_CANNOT_RUN,
                            ORACLE_NONDETERMINISTIC, MLX_LM_DEFECT, NOT_JUDGED)
                  if self.counts[v]]
        text = ", ".join(parts) + f" ({sum(self.counts.values())} schedule runs)"
        unjudged = self.unjudged_levels
        if unjudged:
            text += "; " + ", ".join(f"{level} not judged ({_outcomes(outcomes)})"
                                     for level, outcomes in sorted(unjudged.items()))
        stale = len(self.unexpectedly_passing)
        text += f"; {stale} declared divergence(s) unexpectedly passing" if stale else ""
        if self.interrupted:
            stop = self.interrupted
            planned = f" of {stop['planned']}" if stop["planned"] is not None else ""
            text = f"interrupted by {stop['signal']} after {stop['finished']}{planned} schedule runs: " + text
        return text


def _outcomes(outcomes: Counter) -> str:
    return ", ".join(f"{n} {v}" for v, n in outcomes.most_common() if n)


def coverage(results: List[ScheduleResult]) -> Dict[str, Counter]:
    """Per event kind and check, the comparisons made after events of that kind."""
    table: Dict[str, Counter] = {}
    for result in results:
        for row in result.rows:
            for index, checks in row.counts.items():
                kind = result.event_kinds[index] if index < len(result.event_kinds) else "trace"
                table.setdefault(kind, Counter()).update(checks)
    return table


def observed_kinds(result: ScheduleResult) -> set:
    """Event kinds whose effects some comparison saw: a comparison at an
    event, or at any later event of the same schedule, observes what the
    event did (a leave that empties the batch is judged by the refill after
    it). An event followed by no comparison at all was never judged."""
    compared_at = {index for row in result.rows for index, checks in row.counts.items() if sum(checks.values())}
    last = max(compared_at, default=-1)
    return {kind for index, kind in enumerate(result.event_kinds) if index <= last and kind != "trace"}


def check_state(row: RowVerdict, check: str) -> str:
    """Whether ``check`` held in a row, diverged (anything not declared),
    diverged only as declared, or compared nothing."""
    found = [i for i, d in enumerate(row.evidence.divergences) if d.check == check]
    if any(i not in row.declared for i in found):
        return DIVERGED
    if found:
        return EXPECTED_DIVERGENCE
    return HELD if row.evidence.compared(check) else NOT_COMPARED


def check_table(verdicts: List[ScheduleVerdict]) -> Dict[str, Dict[str, Counter]]:
    """Per check: how many schedule runs and rows it held in, diverged in,
    diverged in only as declared, or compared nothing in, so one diverging
    check never hides what held. A schedule takes its rows' worst state
    (diverged, expected divergence, held, not compared, in that order).
    Lists every check the run compared or found, and those its levels require."""
    seen = {c for v in verdicts for row in v.evidence.rows
            for c in row.compared_checks() | {d.check for d in row.divergences}}
    seen |= {c for v in verdicts for c in LEVELS[v.evidence.level].requires}
    order = list(CHECKS) + sorted(seen - set(CHECKS))
    table = {}
    for check in (c for c in order if c in seen):
        rows, schedules = Counter({s: 0 for s in CHECK_STATES}), Counter({s: 0 for s in CHECK_STATES})
        for verdict in verdicts:
            states = {check_state(row, check) for row in verdict.rows}
            rows.update(check_state(row, check) for row in verdict.rows)
            schedules[next((s for s in (DIVERGED, EXPECTED_DIVERGENCE, HELD) if s in states), NOT_COMPARED)] += 1
        table[check] = {"schedules": schedules, "rows": rows}
    return table


def model_coverage(results: List[ScheduleResult]) -> Optional[dict]:
    """The coverage model's requirements (paths x settings, values) that the L1
    schedule runs reached: only a run that went to its end reached the cells
    of its schedule, read again from its file (a schedule built in memory,
    such as a generated one, has none and reaches no cell). None when no L1
    schedule from a file ran."""
    runs = [r for r in results if r.level == L1 and r.path and Path(r.path).is_file()]
    if not runs:
        return None
    return coverage_model.judged(load(r.path) for r in runs if not r.stopped)


def verdict_of_run(verdicts: List[ScheduleVerdict], whole_catalog: bool = False, expectations=None,
                   policy: Policy = None, required_levels=()) -> RunVerdict:
    """``verdicts``: each schedule run's, from ``judge``. ``whole_catalog``:
    the default selection, which must exercise every required member of the
    protocol. ``expectations``: the declarations the runs were judged with,
    reported each with what it matched; ``policy`` says whether one
    unexpectedly passing fails the run. ``required_levels``: levels that
    must be judged (``--require-levels``): one that ran and of which no
    schedule run was judged is a gap, so the run cannot be judged (125)."""
    counts = Counter({v: 0 for v in OUTCOMES})
    counts.update(v.verdict for v in verdicts)
    results = [v.evidence for v in verdicts]
    table = coverage(results)
    members = Counter()
    for r in results:
        members.update(r.members)
    gaps = []
    if not results:
        gaps.append("no schedule ran")
    # Event kinds of schedules that ran to their end: one that stopped (before it began, or at
    # what raised) never ran its later events, and its outcome already says why.
    ran = [r for r in results if not r.stopped]
    kinds = {k for r in ran for k in r.event_kinds if k != "trace"}
    observed = {k for r in ran for k in observed_kinds(r)}
    silent = sorted(kinds - observed)
    if silent:
        gaps.append(f"no comparison was made after any {', '.join(silent)} event")
    if whole_catalog and any(r.level == L1 for r in results):
        unused = [m for m in REQUIRED_MEMBERS if not members[m]]
        if unused:
            gaps.append(f"required members never called: {', '.join(unused)}")
    levels = {}
    for v in verdicts:
        levels.setdefault(v.evidence.level, Counter())[v.verdict] += 1
    for level in required_levels:
        outcomes = levels.get(level, Counter())
        if not any(outcomes[v] for v in JUDGED):
            found = f" ({_outcomes(outcomes)})" if outcomes else " (no schedule ran at it)"
            gaps.append(f"level {level} is required (--require-levels) and was not judged{found}")
    cells = model_coverage(results)
    if whole_catalog and cells and cells["missing"]:
        gaps.append(f"the coverage model's cells not reached at L1 ({len(cells['missing'])} of "
                    f"{cells['requirements']}): {', '.join(cells['missing'][:5])}"
                    + (", ..." if len(cells["missing"]) > 5 else ""))
    return RunVerdict(dict(counts), table, members, gaps, check_table(verdicts),
                      expectations.applied(verdicts) if expectations else [],
                      policy is not None and policy.unexpected_passes == GATE, cells, levels=levels)

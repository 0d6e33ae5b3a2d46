"""Verdicts from evidence: what a run's comparisons mean under a policy.

A row passes only when nothing gating diverged and every check its level
requires compared something on what the implementation produced. A recorded
divergence is never overwritten by a later refusal or missing capability.
"""

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List

from kvparity.reports.policy import Policy
from kvparity.suites.adapter import REQUIRED_MEMBERS
from kvparity.suites.evidence import (
    FAIL, FAILURES, NO_EVIDENCE, NOT_SUPPORTED, ORACLE_CANNOT_RUN, ORACLE_NONDETERMINISTIC, OUTCOMES, PASS, REFUSED,
    ScheduleResult,
)

# What a row must have compared, per level, to pass.
REQUIRED_EVIDENCE = {
    "L1": ("bytes", "offset", "left_padding", "mask"),
    "L2": ("logits", "bytes", "offset"),
    "L3": ("tokens", "logprobs"),
}
EXIT_OK, EXIT_BROKEN, EXIT_USAGE, EXIT_CANNOT_JUDGE = 0, 1, 2, 125


def judge(result: ScheduleResult, policy: Policy) -> ScheduleResult:
    """Set every row's verdict and tier, then the schedule's."""
    required = REQUIRED_EVIDENCE.get(result.level, ())
    for row in result.rows:
        # L3 compares tokens and log-probs bit for bit under every policy (no tiers yet).
        gating = [d for d in row.divergences if result.level == "L3" or policy.gates(d, result.level)]
        if result.level in ("L1", "L3"):
            row.tier = None if not row.checks else ("diverged" if gating else "bit-exact")
            row.required = "bit-exact"
            logits_ok = True
        else:
            row.tier = policy.logit_tier(row.metrics)
            row.required = policy.required()
            logits_ok = policy.accepts(row.tier)
        missing = [c for c in required if not row.compared(c)]
        if gating or not logits_ok:
            row.verdict = FAIL
            row.reason = (min(gating, key=lambda d: d.order).message() if gating else
                          f"logits reached {row.tier}, the policy requires {policy.required()}")
        elif result.stopped:
            row.verdict, row.reason = result.stopped, result.reason
        elif missing:
            row.verdict = NO_EVIDENCE
            row.reason = f"nothing compared for {', '.join(missing)} on the implementation's output"
        else:
            row.verdict, row.reason = PASS, ""
    verdicts = {row.verdict for row in result.rows}
    if FAIL in verdicts:
        result.verdict = FAIL
    elif result.stopped:
        result.verdict = result.stopped
    elif NO_EVIDENCE in verdicts or not result.rows:
        result.verdict = NO_EVIDENCE
    else:
        result.verdict = PASS
    return result


@dataclass
class RunVerdict:
    """A whole run: counts per outcome, coverage, and the exit status."""

    counts: Dict[str, int]
    coverage: Dict[str, Counter]  # event kind -> check -> comparisons
    members: Counter  # protocol member -> calls
    gaps: List[str] = field(default_factory=list)  # what the run should have shown and did not

    @property
    def exit_status(self) -> int:
        if any(self.counts[v] for v in FAILURES):
            return EXIT_BROKEN
        if self.gaps or self.counts[NO_EVIDENCE] or not self.counts[PASS]:
            return EXIT_CANNOT_JUDGE
        return EXIT_OK

    @property
    def headline(self) -> str:
        parts = [f"{self.counts[PASS]} passed", f"{self.counts[FAIL]} failed"]
        parts += [f"{self.counts[v]} {v}"
                  for v in (REFUSED, NO_EVIDENCE, NOT_SUPPORTED, ORACLE_CANNOT_RUN, ORACLE_NONDETERMINISTIC)
                  if self.counts[v]]
        return ", ".join(parts) + f" ({sum(self.counts.values())} schedule runs)"


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


def verdict_of_run(results: List[ScheduleResult], whole_catalog: bool = False) -> RunVerdict:
    """``whole_catalog``: the default selection, which must exercise every
    required member of the protocol."""
    counts = Counter({v: 0 for v in OUTCOMES})
    counts.update(r.verdict for r in results)
    table = coverage(results)
    members = Counter()
    for r in results:
        members.update(r.members)
    gaps = []
    if not results:
        gaps.append("no schedule ran")
    # Event kinds of schedules that ran: one stopped before it began compares nothing by design.
    ran = [r for r in results if r.verdict not in (NOT_SUPPORTED, ORACLE_CANNOT_RUN, ORACLE_NONDETERMINISTIC)]
    kinds = {k for r in ran for k in r.event_kinds if k != "trace"}
    observed = {k for r in ran for k in observed_kinds(r)}
    silent = sorted(kinds - observed)
    if silent:
        gaps.append(f"no comparison was made after any {', '.join(silent)} event")
    if whole_catalog and any(r.level == "L1" for r in results):
        unused = [m for m in REQUIRED_MEMBERS if not members[m]]
        if unused:
            gaps.append(f"required members never called: {', '.join(unused)}")
    return RunVerdict(dict(counts), table, members, gaps)

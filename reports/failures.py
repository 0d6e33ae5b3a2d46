"""Failures grouped by root cause, each saying what to fix.

One bug fails many schedules the same way. A failing schedule run is keyed
by the member its first failing divergence blames: at L1 from the evidence
after every protocol call (``suites/l1/calls.py``: the first call after
which something diverged, or the member whose own output the check read),
else the member that raised, else the last one the replay called before it
(L2). Runs blaming one member are one group, whatever check or level saw
them first (``seen_as``): one root cause, with how many schedule runs and
rows it explains, its first divergence in full (expected and got, never
cut) and the ``kvparity bisect`` command that shrinks it. What a level sees
only in a request's output (logits, tokens, log-probs, a forward that
raised) joins the group of the member at fault on that request.

``explain`` shrinks a group's example: the member the shrunk schedule's first
failing call blames is the group's, both are said where they differ, and
where that call is a write running into state an earlier member left
(``suites.shrink.exposure``), the group names the earlier member.
"""

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from kvparity.oracle.models import SCHEDULE_DTYPES, random_model
from kvparity.reports.settings import Settings
from kvparity.reports.verdicts import ScheduleVerdict
from kvparity.suites.core.members import APPLIES_WHAT_RECORDED, WRITE
from kvparity.suites.core.raised import ForwardRaised
from kvparity.suites.format.checks import OUTPUT_CHECKS
from kvparity.suites.core.compare import Divergence
from kvparity.suites.core.evidence import FAIL, REFUSED, died
from kvparity.suites.l3.run import PREFILL_MODES
from kvparity.suites.l4.run import SERVER
from kvparity.suites.format.levels import L1, L2, L3, L4, LEVELS
from kvparity.suites.format.errors import ScheduleError
from kvparity.suites.core.loading import load, parse
from kvparity.suites.search.shrink import Exposure, Shrinker, exposure, first_failure

# keys.packed, values.scales, ... inside a tensor's name ("batch.keys.packed",
# "resumed from stored entry ...: keys.scales")
LEVEL_ORDER = list(LEVELS)
_TENSOR = re.compile(r"(keys|values)\.(packed|scales|biases)")
OUTSIDE_MEMBERS = (ForwardRaised.FRAME, ForwardRaised.ENGINE)  # what raises where no protocol member runs


@dataclass
class Failure:
    """One failing schedule run, as its group sees it."""

    verdict: ScheduleVerdict
    first: Optional[Divergence]  # its earliest failing divergence; None for a refusal
    member: str  # the protocol member its first failure blames ("" when not known)
    member_event: str  # the label of the event that called it

    @property
    def rows(self) -> int:
        return sum(row.verdict in (FAIL, REFUSED) for row in self.verdict.rows)

    @property
    def what(self) -> Tuple[str, str]:
        """(check, tensor) of its first failure: keys.packed, values.scales, ... (its row and event do not count,
        nor which stored entry it was)."""
        if self.first is None:
            return self.verdict.verdict, ""
        found = _TENSOR.search(self.first.tensor) if self.first.tensor else None
        return self.first.check, found.group(0) if found else self.first.tensor.split(" '")[0]

    @property
    def message(self) -> str:
        if self.first is not None:
            return self.first.message()
        return self.verdict.evidence.reason


@dataclass
class FailureGroup:
    """Failing schedule runs with one root cause."""

    level: str
    check: str  # the check that diverged (or the outcome, for a refusal)
    tensor: str  # keys.packed, values.scales, ...; "" when none
    member: str  # the member at the failing event ("" when not known, as at L3)
    failures: List[Failure] = field(default_factory=list)
    exposure: Optional[Exposure] = None  # set by explain: an earlier member left what this one exposed
    options: Dict[str, str] = field(default_factory=dict)  # what its bisect command repeats (options_of)
    shrunk: List[str] = field(default_factory=list)  # the shrunk schedule's events, when explain shrank one
    # The shrunk schedule's first failing divergence, when explain shrank one.
    shrunk_first: Optional[Divergence] = None

    @property
    def schedules(self) -> int:
        return len({(f.verdict.evidence.schedule, f.verdict.evidence.path, f.verdict.evidence.level)
                    for f in self.failures})

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.failures)

    @property
    def levels(self) -> List[str]:
        return sorted({f.verdict.evidence.level for f in self.failures}, key=LEVEL_ORDER.index)

    @property
    def seen_as(self) -> List[str]:
        """What its runs saw first, each with its levels: "layout on keys.packed (L2)"."""
        seen: Dict[str, set] = {}
        for f in self.failures:
            check, tensor = f.what
            seen.setdefault(check + (f" on {tensor}" if tensor not in ("", check) else ""), set()).add(
                f.verdict.evidence.level)
        return [f"{what} ({', '.join(sorted(levels, key=LEVEL_ORDER.index))})" for what, levels in seen.items()]

    @property
    def example(self) -> Failure:
        """The member to read first: at the lowest level (the cheapest to
        shrink), the shortest schedule, then the earliest."""
        return min(self.failures, key=lambda f: (LEVEL_ORDER.index(f.verdict.evidence.level),
                                                 f.verdict.evidence.events, len(f.verdict.rows)))

    @property
    def at_fault(self) -> str:
        """The member at fault: the exposure's cause, else the member the
        evidence names on the shrunk schedule, else on the full run."""
        if self.exposure:
            return self.exposure.cause
        if self.shrunk_first is not None and self.shrunk_first.member:
            return self.shrunk_first.member
        return self.member

    @property
    def shrunk_differs(self) -> bool:
        """The shrunk schedule's first failing call names another member than the full run's."""
        return self.shrunk_first is not None and self.shrunk_first.member != self.member

    def title(self) -> str:
        return title(self.to_json())

    def bisect_command(self) -> Optional[str]:
        """The command that shrinks the example; None when it is not from a file."""
        return bisect_command(self.example.verdict.evidence, self.options)

    def to_json(self) -> dict:
        example = self.example
        first = example.first
        return {
            "level": self.level, "levels": self.levels, "check": self.check, "tensor": self.tensor,
            "member": self.member,
            "at_fault": self.at_fault,
            "exposure": None if self.exposure is None else {
                "cause": self.exposure.cause, "cause_event": self.exposure.cause_event,
                "exposed_by": self.exposure.exposed_by, "exposed_at": self.exposure.exposed_at,
                "sentence": self.exposure.sentence()},
            "shrunk_events": list(self.shrunk),
            "shrunk_first": None if self.shrunk_first is None else self.shrunk_first.message(),
            "seen_as": self.seen_as,
            "schedules": self.schedules, "rows": self.rows,
            "members": sorted({f.verdict.evidence.schedule for f in self.failures}),
            "example": {
                "schedule": example.verdict.evidence.schedule, "path": example.verdict.evidence.path,
                "event": first.event if first is not None else example.member_event,
                "request": first.request if first is not None else None,
                "message": example.message,
                # A raise has neither: its message says what happened.
                "expected": None if first is None or first.expected is None else repr(first.expected),
                "actual": None if first is None or first.actual is None else repr(first.actual),
            },
            "bisect": self.bisect_command(),
        }


def title(group: dict) -> str:
    """A group's one line, from its JSON form (a report's ``failures``): the
    member at fault, what diverged, where, and how much it explains."""
    what = group["check"] + (f" on {group['tensor']}" if group["tensor"] not in ("", group["check"]) else "")
    levels = group.get("levels") or [group["level"]]
    where = group["at_fault"] or (SERVER if levels == [L4] else "member not known")
    if group["exposure"]:
        where += f", exposed by {group['exposure']['exposed_by']} at a later event"
    schedules, rows = group["schedules"], group["rows"]
    return (f"{where}: {what} ({', '.join(levels)}; {schedules} schedule run{'s' if schedules != 1 else ''}, "
            f"{rows} row{'s' if rows != 1 else ''})")


def failure_of(verdict: ScheduleVerdict) -> Optional[Failure]:
    """A failing schedule run's first failure, or None when it did not fail.
    Its member: the one the evidence names (L1: the call after which it was
    seen, or the member whose own output the check read), else the member
    that raised, else the last one the replay called before it (L2)."""
    if verdict.verdict not in (FAIL, REFUSED):
        return None
    result = verdict.evidence
    first = first_failure(verdict)
    if first is not None and first.member:
        return Failure(verdict, first, first.member, first.event)
    if result.raised_by and (first is None or first.check == "raised"):
        index = first.event_index if first is not None else max(result.called, default=-1)
        return Failure(verdict, first, result.raised_by, _label(result, index))
    last = None if first is None else result.last_called(first.event_index)
    if last is None:
        return Failure(verdict, first, "", "")
    return Failure(verdict, first, last[1], _label(result, last[0]))


def _label(result, index: int) -> str:
    """An event as ``#3 leave``; "" for none."""
    if 0 <= index < len(result.event_kinds):
        return f"#{index} {result.event_kinds[index]}"
    return ""


def group(verdicts: List[ScheduleVerdict], options: Dict[str, str] = None) -> List[FailureGroup]:
    """The failing schedule runs grouped by root cause, the largest group
    first; ``options``: what their bisect commands repeat (``options_of``)."""
    groups: Dict[Tuple, FailureGroup] = {}
    for verdict in verdicts:
        failure = failure_of(verdict)
        if failure is None:
            continue
        check, tensor = failure.what
        # One root cause seen at several levels (L1's bytes and L2's, both after filter) is one group;
        # where no member is known (L3: the engine makes the calls) the level stays apart.
        key = (check, tensor, failure.member, "" if failure.member else verdict.evidence.level)
        group = groups.setdefault(key, FailureGroup(verdict.evidence.level, check, tensor, failure.member,
                                                    options=dict(options or {})))
        group.failures.append(failure)
    return _ordered(fold_outputs(list(groups.values())))


def _ordered(groups: List[FailureGroup]) -> List[FailureGroup]:
    """One group per member at fault, the largest first; each group's level is its example's."""
    for group in groups:
        group.level = group.example.verdict.evidence.level
    return sorted(_by_member(groups), key=lambda g: (-g.schedules, -g.rows, LEVEL_ORDER.index(g.level), g.check))


def _by_member(groups: List[FailureGroup]) -> List[FailureGroup]:
    """Groups whose member at fault is one protocol member are one root cause
    to fix, whatever each saw first (filter's shared padding at L1, its
    layout at L2): the group whose example is the lowest level's (then the
    largest) takes the others' runs, and ``seen_as`` keeps what each saw."""
    homes: Dict[str, FailureGroup] = {}
    kept = []
    for group in sorted(groups, key=lambda g: (LEVEL_ORDER.index(g.level), -g.schedules, -g.rows)):
        member = group.at_fault
        if not member or member in OUTSIDE_MEMBERS:
            kept.append(group)
        elif member in homes:
            home = homes[member]
            home.failures.extend(group.failures)
            home.check, home.tensor = home.example.what  # the title says what its example shows
        else:
            homes[member] = group
            kept.append(group)
    return kept


def fold_outputs(groups: List[FailureGroup]) -> List[FailureGroup]:
    """Logits, tokens and log-probs say that a request's output broke, not
    which tensor did; a bug in the cache shows there after its bytes, or
    makes the forward raise. Such a failure joins the largest group of the
    member (or, once ``explain`` named it, the member at fault) that touched
    the request before it diverged, where one member does: at L1 and L2 the
    member the failing event called, at L3 (the engine makes the calls) the
    members that reshaped its batch since it arrived, and the write. The
    others stay."""
    groups = [g for g in _to_l1(groups) if g.failures]
    homes = [g for g in groups if not _output_only(g) and g.member]
    kept = []
    for outputs in groups:
        if not _output_only(outputs) or outputs in homes:
            kept.append(outputs)
            continue
        for failure in list(outputs.failures):
            touched = _touched(failure)
            found = [g for g in homes if {g.member, g.at_fault} & touched]
            if len({g.at_fault for g in found}) == 1:  # one member at fault: its largest group
                max(found, key=lambda g: (g.schedules, g.rows)).failures.append(failure)
                outputs.failures.remove(failure)
        if outputs.failures:
            kept.append(outputs)
    return kept


def _to_l1(groups: List[FailureGroup]) -> List[FailureGroup]:
    """A run at a higher level of a schedule whose L1 run failed joins the
    group of that L1 failure on the same row (else on the schedule): L1's
    evidence after every call names the member at fault there, where the
    model's logits and the bytes its later layers wrote only follow from it."""
    at_l1 = {}  # (schedule, request or None) -> the group of its L1 run's failure
    for group in groups:
        for f in group.failures:
            if f.verdict.evidence.level == L1 and f.member:
                at_l1.setdefault((_schedule_of(f), f.first.request if f.first else None), group)
                at_l1.setdefault((_schedule_of(f), None), group)
    for group in groups:
        for failure in list(group.failures):
            if failure.verdict.evidence.level == L1:
                continue
            schedule = _schedule_of(failure)
            home = at_l1.get((schedule, failure.first.request if failure.first else None)) or at_l1.get((schedule, None))
            if home is not None and home is not group:
                home.failures.append(failure)
                group.failures.remove(failure)
    return groups


def _output_only(group: FailureGroup) -> bool:
    """Seen only in what the model returned, where it raised outside every
    protocol member (the forward or the engine, on a batch a member left
    wrong), or where no member is known (L3's engine held a batch of other
    bits): the evidence names no member of its own."""
    return group.check in OUTPUT_CHECKS or group.member in OUTSIDE_MEMBERS or not group.member


def _schedule_of(failure: Failure):
    """What a failure's schedule run replayed: its file, else its name."""
    return failure.verdict.evidence.path or failure.verdict.evidence.schedule


def _touched(failure: Failure) -> set:
    """The members that acted on a failing request before its first divergence."""
    if failure.first is not None and failure.first.reshaped:
        return set(failure.first.reshaped) | {WRITE}
    return {failure.member} - {""}


def explain(groups: List[FailureGroup], run: Callable, levels=(L1,), most: int = 8) -> None:
    """For up to ``most`` groups at ``levels`` (shrinking reruns the schedule
    many times: cheap at L1), shrink the example and name the earlier
    member when the failure shows one event after its cause. ``run(level)``:
    a function schedule -> its judged verdict at that level (as the shrinker takes)."""
    if L1 in levels:
        groups[:] = _evidence_at_l1(groups, run(L1))
    for chosen in [g for g in groups if g.level in levels and g.member][:most]:
        result = chosen.example.verdict.evidence
        if not result.path or not Path(result.path).is_file() or died(result):
            continue
        at_level = run(chosen.level)
        shrinker = Shrinker(at_level, load(result.path))
        if shrinker.first is None:
            continue
        minimal = shrinker.parse(shrinker.shrink(load(result.path)))
        chosen.shrunk = [e.label for e in minimal.events]
        chosen.shrunk_first = first_failure(at_level(minimal))
        chosen.exposure = exposure(at_level, minimal)
    groups[:] = _ordered(fold_outputs(groups))  # a member at fault named now may take output-only failures


def _evidence_at_l1(groups: List[FailureGroup], at_l1: Callable) -> List[FailureGroup]:
    """A schedule run that failed at L2 with no failing L1 run of its file
    in the run (an L2-only schedule, or one whose L1 run was not selected:
    ``--level L2``) is replayed at L1 with its synthetic keys and values:
    where that fails, the evidence after each call names its member, and the
    run joins that member's group. Where it passes (a bug its synthetic
    shapes do not reach), the run keeps what its own level says."""
    failed_at_l1 = {f.verdict.evidence.path for g in groups for f in g.failures if f.verdict.evidence.level == L1}
    twins = {}  # schedule file -> the first failure of its L1 twin (or None)
    for group in groups:
        for failure in list(group.failures):
            result = failure.verdict.evidence
            if result.level != L2 or (failure.first is not None and failure.first.call is not None):
                continue  # L1 has its evidence; L3's arrivals are no events to replay at L1
            if not result.path or result.path in failed_at_l1 or not Path(result.path).is_file() or died(result):
                continue  # its own L1 failure names the member (_to_l1)
            if result.path not in twins:
                twins[result.path] = _first_at_l1(load(result.path), at_l1)
            found = twins[result.path]
            if found is None or not found.member or found.member == failure.member:
                continue
            failure.member, failure.member_event = found.member, found.event
            home = next((g for g in groups if g.failures and found.member in (g.member, g.at_fault)), None)
            if home is None:
                home = FailureGroup(group.level, group.check, group.tensor, found.member, options=dict(group.options))
                groups.append(home)
            group.failures.remove(failure)
            home.failures.append(failure)
    return [g for g in groups if g.failures]


def _first_at_l1(schedule, at_l1: Callable) -> Optional[Divergence]:
    """The first failing divergence of ``schedule`` replayed at L1 (its own
    synthetic block gives its shapes; an L2-only schedule's, its model's);
    None where it passes or cannot be."""
    doc = {**schedule.to_json(), "levels": [L1]}
    model = random_model(schedule.model) if schedule.model and L1 not in schedule.levels else None
    if model is not None:  # the model's head dim and dtype, where its synthetic block left the defaults
        dtype = {short: name for name, short in SCHEDULE_DTYPES.items()}.get(model.dtype, schedule.dtype)
        doc["synthetic"] = {"kv_heads": schedule.kv_heads, "head_dim": model.head_dim, "dtype": dtype}
    try:
        twin = parse(doc, source=schedule.path)
    except ScheduleError:
        return None
    return first_failure(at_l1(twin))


def bisect_command(result, options: Dict[str, str]) -> Optional[str]:
    """``kvparity bisect`` for a schedule run from a file, with the options
    (``--impl``, ``--model``, ...: name -> value) the run was given; None
    for a run whose process died (bisect replays in its own process)."""
    if not result.path or died(result) or result.level == L4:  # bisect replays a cache, not a server
        return None
    words = ["kvparity", "bisect", _shown(result.path), "--level", result.level]
    # An L3 run of the catalog is one of its prefill variants: the command repeats it.
    size = next((size for mode, size in PREFILL_MODES.items() if f"({mode})" in result.schedule), None)
    if result.level == L3 and size is not None:
        words += ["--prefill-batch-size", str(size)]
    for name, value in options.items():
        if value is not None:
            words += [f"--{name}", str(value)]
    return shlex.join(words)


def _shown(path: str) -> str:
    """A path as short as it reads: relative to the working directory when under it."""
    try:
        return os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd()) else path
    except ValueError:
        return path


def options_of(settings: Settings) -> Dict[str, str]:
    """The options of a run that its bisect needs (name -> value)."""
    names = ("impl", "model", "policy", "expectations", "engine", "device")
    return {name: getattr(settings, name) for name in names}


def lines(groups: List[FailureGroup]) -> List[str]:
    """The groups as the console and report.md say them, nothing cut."""
    if not groups:
        return []
    failing = sum(g.schedules for g in groups)
    out = [f"{failing} failing schedule run(s), {len(groups)} root cause(s):"]
    for number, g in enumerate(groups, 1):
        doc = g.to_json()
        example = doc["example"]
        out.append(f"[{number}] {g.title()}")
        if g.exposure:
            out.append(f"    cause: {g.exposure.sentence()}")
        elif g.at_fault in APPLIES_WHAT_RECORDED:
            out.append(f"    {g.at_fault} applies what {APPLIES_WHAT_RECORDED[g.at_fault]} recorded before it, which "
                       f"no check can read: the bug may be in either")
        if g.shrunk:
            out.append(f"    shrunk schedule: {'; '.join(g.shrunk)}")
        if g.shrunk_differs:  # the full run's is the first seen, below
            out.append(f"    first failing call, shrunk: {g.shrunk_first.message()} (the full run's names "
                       f"{g.member})")
        if len(doc["seen_as"]) > 1:
            out.append(f"    seen as: {'; '.join(doc['seen_as'])}")
        out.append(f"    first seen: {example['schedule']}: {example['message']}")
        if example["expected"] is not None or example["actual"] is not None:
            out.append(f"    expected: {example['expected']}")
            out.append(f"    got:      {example['actual']}")
        if doc["bisect"]:
            out.append(f"    shrink it: {doc['bisect']}")
        others = [m for m in doc["members"] if m != example["schedule"]]
        if others:
            out.append(f"    also: {', '.join(others)}")
    return out

"""Event-level bisection: the first event after which parity breaks, and a
minimal schedule that still breaks the same way.

Parity is checked after every event, so the first failing event is read off
one run. Shrinking is greedy delta debugging on the schedule document: drop
events after the first failure, then drop single events, lower counts and
shorten prompts while the schedule stays valid and still fails with the same
check; last, forget requests no event names.

The evidence after every call (``suites/l1/calls.py``) names the member at
fault: the first call after which something diverged. One case it cannot
see: a write that runs into state an earlier member left where no check
reads (a trim that keeps stale scales past ``size()``; ``state`` may hold
columns past ``size()``). ``exposure`` asks about it on a shrunk schedule,
only where the first failing call is a write, by making the batch again
from what each of its rows can observe (every row extracted, then
reinserted in its order) before the failing event and before the earlier
member's.

``shrunk_found`` shrinks the failures a fuzz campaign found, for ``kvparity
fuzz`` and for the generated budget of ``kvparity run`` and ``check``.
"""

import json
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional

from kvparity.suites.format import arrivals
from kvparity.suites.core.members import RESHAPING_MEMBERS, WRITE
from kvparity.suites.core.evidence import FAIL, PASS
from kvparity.suites.format.events import parse_event
from kvparity.suites.core.replay import Replay
from kvparity.suites.core.dry_run import dry_backend
from kvparity.suites.format.errors import ScheduleError
from kvparity.suites.core.loading import parse


def first_failure(judged):
    """The earliest divergence that failed a row of a judged run (a
    ``reports.verdicts.ScheduleVerdict``), or None. Hygiene findings and
    declared divergences inform but do not fail a row, so shrinking never
    follows them."""
    found = [d for row in judged.rows for d in row.failing]
    return min(found, key=lambda d: d.order, default=None)


class Shrinker:
    """Greedy delta debugging on a schedule document: take the first smaller
    candidate that still fails with the same check, until none does."""

    def __init__(self, run: Callable, schedule):
        self.run = run  # schedule -> its verdict (reports.verdicts.judge of its run)
        self.source = schedule.path
        self.original = run(schedule)
        self.first = first_failure(self.original)
        self.tries = 0

    def parse(self, doc):
        return parse(_named_only(doc, self.source), source=self.source)

    def start(self, schedule) -> dict:
        """The document shrinking starts from: nothing after the first failure."""
        doc = schedule.to_json()
        doc["events"] = doc["events"][: self.first.event_index + 1]
        return doc

    def finish(self, doc) -> dict:
        return _named_only(doc, self.source)

    def still_fails(self, doc) -> bool:
        self.tries += 1
        try:
            schedule = self.parse(json.loads(json.dumps(doc)))
        except ScheduleError:
            return False
        result = self.run(schedule)
        first = first_failure(result)
        # The same way: the same check, and where the evidence names one, the same member.
        return (result.verdict == FAIL and first is not None and first.check == self.first.check
                and first.member == self.first.member)

    def shrink(self, schedule) -> Optional[dict]:
        if self.first is None:
            return None
        doc = {**self.start(schedule), "name": f"{schedule.name}-min"}
        changed = True
        while changed:
            changed = False
            for candidate in self.candidates(doc):
                if self.still_fails(candidate):
                    doc, changed = candidate, True
                    break
        doc = self.finish(doc)
        doc["description"] = f"shrunk from {schedule.name}: fails with {self.first.check}"
        return doc

    def candidates(self, doc):
        events = doc["events"]
        for i in reversed(range(len(events))):  # drop an event
            yield {**doc, "events": events[:i] + events[i + 1 :]}
        for i, j in _preemptions(events):  # drop an extract with its reinsert: neither goes alone
            yield {**doc, "events": events[:i] + events[i + 1 : j] + events[j + 1 :]}
        if len(doc["requests"]) > 1:
            for rid in doc["requests"]:  # drop a request everywhere
                yield _without_request(doc, rid, self.source)
        for i, event in enumerate(_events(doc, self.source)):  # lower a count
            for smaller in event.smaller():
                yield {**doc, "events": events[:i] + [smaller.to_json()] + events[i + 1 :]}
        for rid, request in doc["requests"].items():  # shorten a prompt
            n = request.get("prompt_len", 0)
            for shorter in ({n // 2, n - 1} - {0, n}) if n > 1 else ():
                smaller = {**request, "prompt_len": shorter}
                if smaller.get("quantized_kv_start", 0) > shorter:
                    smaller["quantized_kv_start"] = shorter
                yield {**doc, "requests": {**doc["requests"], rid: smaller}}
        for rid, request in doc["requests"].items():  # a chat turn: fewer new tokens, less of what it continues
            for key, least in (("new_tokens", 0), ("keep", 1)):
                n = request.get(key, least)
                for fewer in sorted({n // 2, n - 1} - {n}) if n > least else ():
                    yield {**doc, "requests": {**doc["requests"], rid: {**request, key: max(fewer, least)}}}


def _preemptions(events):
    """(index of an extract, index of the reinsert of the same request after it)."""
    for i, event in enumerate(events):
        if isinstance(event, dict) and "extract" in event:
            j = next((j for j in range(i + 1, len(events))
                      if isinstance(events[j], dict) and events[j].get("reinsert") == event["extract"]), None)
            if j is not None:
                yield i, j


def _events(doc, source):
    """The document's events as typed objects: shrinking asks each what it names and how it gets smaller."""
    return [parse_event(source, i, e) for i, e in enumerate(doc["events"])]


def _without_request(doc, rid, source):
    kept = (event.without(rid) for event in _events(doc, source))
    requests = {r: x for r, x in doc["requests"].items() if r != rid}
    return {**doc, "requests": requests, "events": [e.to_json() for e in kept if e is not None]}


class ArrivalShrinker(Shrinker):
    """The same for an arrivals schedule (L3): fewer requests, fewer tokens,
    shorter prompts, earlier arrivals."""

    def parse(self, doc):
        return arrivals.parse(doc, source=self.source)

    def start(self, schedule) -> dict:
        return json.loads(json.dumps(schedule.doc))

    def finish(self, doc) -> dict:
        return doc

    def candidates(self, doc):
        requests = doc["requests"]

        def changed(rid, **fields):
            return {**doc, "requests": {**requests, rid: {**requests[rid], **fields}}}

        if len(requests) > 1:
            for rid in requests:
                yield {**doc, "requests": {r: x for r, x in requests.items() if r != rid}}
        for rid, request in requests.items():
            if request["max_tokens"] > 1:
                yield changed(rid, max_tokens=request["max_tokens"] - 1)
            n = request.get("prompt_len", 0)
            for shorter in sorted({n // 2, n - 1} - {0, n}) if n > 1 else ():
                yield changed(rid, prompt_len=shorter)
            if request["arrival"] > 0:
                yield changed(rid, arrival=request["arrival"] - 1)


def _named_only(doc, source):
    """The document without requests that no event names."""
    used = {rid for event in _events(doc, source) for rid in event.named}
    return {**doc, "requests": {rid: r for rid, r in doc["requests"].items() if rid in used}}


@dataclass(frozen=True)
class Exposure:
    """A failure that shows at a write after its cause, in a shrunk schedule."""

    cause: str  # the member the batch's hidden state came from
    cause_event: str  # the label of the event that called it
    exposed_by: str  # the member of the failing call (a write)
    exposed_at: str  # the failing event's label

    def sentence(self) -> str:
        return (f"{self.cause} (event {self.cause_event}) left state no check sees; "
                f"{self.exposed_by} exposed it at a later event ({self.exposed_at})")


def batch_calls(result, event_index: int) -> List[str]:
    """The protocol calls the replay made on the batch at that event, in
    order (``Divergence.call`` counts them): what it called, less what was
    only read (``state``, ``size``, ...)."""
    return [m for m in result.called.get(event_index, ()) if m in RESHAPING_MEMBERS or m == WRITE]


def last_reshaping(result, before: int):
    """(event index, member) of the last call before event ``before`` that
    reshaped the batch (an extract only reads it); None when none did."""
    for index in sorted((i for i in result.called if i < before), reverse=True):
        found = [m for m in batch_calls(result, index) if m in RESHAPING_MEMBERS and m != "extract"]
        if found:
            return index, found[-1]
    return None


def rebuilt_before(schedule, index: int):
    """``schedule`` with the batch made again just before event ``index``:
    every row in the batch there extracted, then reinserted in its order.
    None when no row is in the batch there."""
    replay = Replay(schedule, dry_backend(schedule))
    for event in schedule.events[:index]:
        replay.apply(event)
    rows = list(replay.rows)
    if not rows:
        return None
    doc = schedule.to_json()
    again = [{"extract": rid} for rid in rows] + [{"reinsert": rid} for rid in rows]
    doc["events"] = doc["events"][:index] + again + doc["events"][index:]
    try:
        return parse(doc, source=schedule.path)
    except ScheduleError:
        return None


def exposure(run: Callable, schedule) -> Optional[Exposure]:
    """Whether the failure of ``schedule`` (best a shrunk one) is a write
    running into state an earlier member left, which no check can see (a
    trim that keeps stale scales past ``size()``). ``run``: schedule -> its
    judged verdict, as for ``Shrinker``. Only a write's failure is asked
    about: a member whose own call diverged is at fault by the evidence.
    The earlier member R is named when both hold: the batch made again from
    what its rows can observe just before the failing event passes (the
    write is right on a batch R did not leave), and made again just before
    R's event still fails (R leaves that state whatever batch it is given).
    None otherwise, or where it cannot be told."""
    judged = run(schedule)
    first = first_failure(judged)
    if judged.verdict != FAIL or first is None or first.member != WRITE or first.event_index <= 0:
        return None
    result = judged.evidence
    before = batch_calls(result, first.event_index)[: first.call or 0]
    earlier = last_reshaping(result, first.event_index)
    if earlier is None or any(m != WRITE for m in before):  # something else reshaped it in the same event
        return None
    variant = rebuilt_before(schedule, first.event_index)
    if variant is None or run(variant).verdict != PASS:
        return None  # fails as well (the write itself is at fault), or cannot be told
    again = rebuilt_before(schedule, earlier[0])
    if again is not None:
        still = first_failure(run(again))
        if still is None or still.member != WRITE:
            return None  # the earlier member on a fresh batch leaves nothing wrong: not shown
    labels = [e.label for e in schedule.events]
    return Exposure(earlier[1], labels[earlier[0]], WRITE, labels[first.event_index])


def shrunk_found(result, run):
    """The distinct failures a campaign found, each shrunk to an event-level
    fixed point (as ``kvparity bisect``; ``run(schedule)`` judges one): (their
    documents, {the index of one a worker died or hung in: its flight
    record}), that one kept as it was found (running it here would crash or
    hang this process)."""
    docs, died_in = [], {}
    for found in result.found:
        print(found.message.splitlines()[0], file=sys.stderr)
        if found.record is not None:
            died_in[len(docs)] = found.record
            docs.append(found.doc)
            continue
        schedule = parse(found.doc, source=f"<worker {found.worker}>")
        shrunk = Shrinker(run, schedule).shrink(schedule)  # None: no divergence to shrink towards
        doc = shrunk or found.doc
        if doc not in docs:
            docs.append(doc)
    return docs, died_in

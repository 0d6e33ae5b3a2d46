"""Where a run is, written where a crash of the process cannot take it.

A cache under test that crashes in native code (a segfault, an abort, the
kernel's out-of-memory killer) ends the Python process with it: no exception,
no report; one that hangs there never returns. The ``kvparity`` command
therefore runs ``run`` and ``check`` in a child process whose flight
recorder names, before each step, the schedule run, the event and the
protocol member now running (with its call's number and the member timeout),
in one record of a file (one ``os.pwrite`` at offset 0, up to its newline: a
process that dies between two system calls leaves a whole record). When a
crash's signal ends the child, or the parent, watching the record, stops it
because one member call outlasted the timeout, the next child judges that
schedule run as the implementation's FAIL (it died or hung in that member at
that event) and goes on with the rest; the runs finished before it are kept
(``IsolatedState``). A member that hung is not called again in the run
(``Flight.hung``): a later schedule run that calls it stops there, not
judged, so that one hang costs one timeout, not one per schedule run.

Nothing is written unless ``KVPARITY_ISOLATED`` names the state folder, or
a fuzz worker opens a folder of its own (``suites/search/campaign.py``), where the
schedule it is running is kept too (``SCHEDULE_FILE``): a generated schedule
exists nowhere else.
"""

import json
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Dict, Optional

from kvparity.oracle.signals import signal_name

STATE_ENV = "KVPARITY_ISOLATED"  # the folder the parent and its children share
# --member-timeout's default, in seconds: the slowest member call of the
# catalog on a 2-core CPU took 109 ms (an extract on the real model; 12 ms
# on every architecture of the zoo; docs/ci-and-bisect.md).
MEMBER_TIMEOUT_S = 60.0
RECORD = 8192  # bytes at most: a record of very many requests leaves them out
FLIGHT_FILE, DONE_FILE, CRASHES_FILE, PARENT_FILE = "flight", "done.pickle", "crashes.jsonl", "parent"
SCHEDULE_FILE = "in-flight.json"  # a fuzz worker's schedule now running


class ProcessDied(Exception):
    """The process running the implementation died: of a signal (a crash in
    native code, an abort, a kill by the out-of-memory killer), or, for a
    cache in a process of its own, by exiting."""


class MemberHung(ProcessDied):
    """A protocol member did not return within the member timeout, and the
    process running it was stopped."""


class Flight:
    """The record: the schedule run (its label and its result's identity),
    the event (label, index, the requests in the batch), the outermost
    protocol member running now with the number of its call (a member
    called again is a new call, whose time starts again), and the
    ``--member-timeout`` the parent holds each call to."""

    def __init__(self, folder: Optional[str]):
        self.fd, self.folder, self.schedule_fd = None, None, None
        self.state: dict = {}  # the run, its result and the event; the member and its call are kept apart
        self.head = "{"  # the state encoded, without its closing brace: one encoding per event, not per call
        self.running: Optional[str] = None
        # The member that last wrote or reshaped a batch: what the lazy arrays a check reads came from.
        self.last_change: Optional[str] = None
        self.calls = 0
        self.timeout: Optional[float] = None
        # member -> where it hung earlier in this run, in words (IsolatedState.hung): not called again
        self.hung: Dict[str, str] = {}
        if folder:
            self.open(folder)

    def open(self, folder):
        """Record in ``folder`` from now on."""
        self.folder = Path(folder)
        self.fd = os.open(self.folder / FLIGHT_FILE, os.O_RDWR | os.O_CREAT, 0o644)

    def limit(self, seconds: Optional[float]):
        """Each member call from now on may take ``seconds`` (None: no limit)."""
        self.timeout = seconds

    def _write(self, state_changed: bool = True):
        if state_changed:
            head = json.dumps(self.state)
            if len(head) > RECORD:  # a batch of very many requests: the record keeps the rest
                head = json.dumps({**self.state, "requests": None})
            self.head = head[:-1]
        member = f'"member": {json.dumps(self.running)}, "call": {self.calls}}}'
        record = f"{self.head}, {member}" if len(self.head) > 1 else "{" + member
        os.pwrite(self.fd, record.encode() + b"\n", 0)  # the record ends at its newline; older bytes may follow

    def run(self, label: str):
        self.state, self.running = {"label": label, "timeout": self.timeout}, None
        if self.fd is not None:
            self._write()

    def result(self, result):
        """A schedule run's result was made: what a crash's FAIL is named by."""
        if self.fd is not None:
            self.state["result"] = {"schedule": result.schedule, "level": result.level,
                                    "implementation": result.implementation, "path": result.path,
                                    "model": result.model}
            self._write()

    def event(self, label: str, index: int, requests):
        if self.fd is not None:
            self.state.update(event=label, index=index, requests=list(requests))
            self.running = None
            self._write()

    def schedule(self, schedule):
        """The schedule about to run, as far as it has grown (a fuzz
        worker's: it exists nowhere else), in ``SCHEDULE_FILE``. Written in
        place, not atomically: its reader waits for the writer's death,
        which comes in the cache under test, never in this write."""
        if self.fd is not None:
            if self.schedule_fd is None:
                self.schedule_fd = os.open(self.folder / SCHEDULE_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            data = json.dumps(schedule.to_json()).encode()
            os.pwrite(self.schedule_fd, data, 0)
            os.ftruncate(self.schedule_fd, len(data))

    def hung_here(self, member: str):
        """``member`` hung in this process and was stopped at the timeout
        (a cache process's: this one lives on): not called again in the run."""
        label = self.state.get("label") or "an earlier schedule run"
        after = self.timeout if self.timeout else MEMBER_TIMEOUT_S
        self.hung.setdefault(member, f"{label} after {after:g} s (--member-timeout)")

    def member(self, name: Optional[str]):
        """The outermost protocol member now running; None once it returned."""
        if self.fd is not None:
            if name is not None:
                self.calls += 1
            self.running = name
            self._write(state_changed=False)


FLIGHT = Flight(os.environ.get(STATE_ENV))


def read_flight(folder) -> Optional[dict]:
    """The last record ({} before the first); None where it was read while
    being written (a reader watching a live child may meet half a record)."""
    try:
        data = (Path(folder) / FLIGHT_FILE).read_bytes()
    except FileNotFoundError:
        return {}
    data = data.split(b"\n", 1)[0]
    try:
        return json.loads(data) if data else {}
    except ValueError:
        return None


def clear_flight(folder):
    """No record: a child about to start has run nothing yet. The last
    record of the one before it (a member it hung in) must not be read as
    the new child's while that one starts up."""
    (Path(folder) / FLIGHT_FILE).write_bytes(b"")


class Watch:
    """A parent's look at a child's flight record: which member call is
    running, since when, and whether it has outrun the member timeout the
    record states."""

    def __init__(self, folder):
        self.folder = folder
        self.call, self.since = None, time.monotonic()

    def overrun(self) -> Optional[dict]:
        """The record, where its member call has run past its timeout; else None."""
        record = read_flight(self.folder)
        if record is None:  # half a record: read it at the next look
            return None
        now = time.monotonic()
        running = (record.get("label"), record.get("call")) if record.get("member") else None
        if running != self.call:
            self.call, self.since = running, now
        elif running and record.get("timeout") and now - self.since >= record["timeout"]:
            return record
        return None


def mark_parent(folder):
    """The parent that made ``folder`` (and removes it) is this process."""
    (Path(folder) / PARENT_FILE).write_text(str(os.getpid()))


def remove_if_orphaned(folder):
    """The child's last word: where the parent that made ``folder`` died
    (SIGKILL, which it could not hand on), the child removes the folder."""
    try:
        parent = int((Path(folder) / PARENT_FILE).read_text())
    except (OSError, ValueError):
        return
    if os.getppid() != parent:
        shutil.rmtree(folder, ignore_errors=True)


def ended(record: dict, returncode: int, hung: Optional[float] = None) -> dict:
    """``record`` of a run that died of signal ``-returncode``; ``hung``: the
    parent stopped it because its member did not return within that many seconds."""
    noted = {**record, "signal": signal_name(returncode)}
    if hung is not None:
        noted["hung"] = hung
    return noted


def how_it_ended(noted: dict, in_a_run: bool = True) -> str:
    """An ``ended`` record in words: the member call that outran its
    timeout, or the signal the process died of, and (``in_a_run``) where."""
    where = "" if not in_a_run else f" at event {noted['event']}" if noted.get("event") else " before its first event"
    if noted.get("hung") is not None:
        return f"{noted.get('member')} did not return within {noted['hung']:g} s (--member-timeout){where}"
    member = f" in {noted['member']}" if noted.get("member") and in_a_run else ""
    return f"the process died of {noted['signal']}{member}{where}"


def note_crash(folder, noted: dict):
    """The run of an ``ended`` record is the next child's FAIL."""
    with open(Path(folder) / CRASHES_FILE, "a", encoding="utf-8") as crashes:
        crashes.write(json.dumps(noted) + "\n")


class IsolatedState:
    """What the children of one isolated command share: each finished
    schedule run's result (kept as it finishes) and each crash."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.done: Dict[str, object] = {}
        if (self.folder / DONE_FILE).exists():
            with open(self.folder / DONE_FILE, "rb") as kept:
                while True:
                    try:
                        label, result = pickle.load(kept)
                    except (EOFError, pickle.UnpicklingError):  # the end, or a child killed mid-write
                        break
                    self.done[label] = result
        self.crashes: Dict[str, dict] = {}
        if (self.folder / CRASHES_FILE).exists():
            for line in (self.folder / CRASHES_FILE).read_text(encoding="utf-8").splitlines():
                record = json.loads(line)
                self.crashes[record["label"]] = record

    def hung(self) -> Dict[str, str]:
        """Each member that hung in an earlier child -> in which schedule run
        and after how long, in words (its first hang)."""
        found: Dict[str, str] = {}
        for label, record in self.crashes.items():
            member = record.get("member")
            if record.get("hung") is not None and member and member not in found:
                found[member] = f"{label} after {record['hung']:g} s (--member-timeout)"
        return found

    @classmethod
    def from_env(cls) -> Optional["IsolatedState"]:
        folder = os.environ.get(STATE_ENV)
        return cls(folder) if folder else None

    def keep(self, label: str, result):
        with open(self.folder / DONE_FILE, "ab") as kept:
            pickle.dump((label, result), kept)

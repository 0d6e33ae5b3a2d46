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
(``IsolatedState``).

Nothing is written unless ``KVPARITY_ISOLATED`` names the state folder.
"""

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Dict, Optional

from kvparity.suites.processes import signal_name

STATE_ENV = "KVPARITY_ISOLATED"  # the folder the parent and its children share
# --member-timeout's default, in seconds: the slowest member call of the
# catalog on a 2-core CPU took 109 ms (an extract on the real model; 12 ms
# on every architecture of the zoo; docs/ci-and-bisect.md).
MEMBER_TIMEOUT_S = 60.0
RECORD = 8192  # bytes at most: a record of very many requests leaves them out
FLIGHT_FILE, DONE_FILE, CRASHES_FILE, PARENT_FILE = "flight", "done.pickle", "crashes.jsonl", "parent"


class Flight:
    """The record: the schedule run (its label and its result's identity),
    the event (label, index, the requests in the batch), the outermost
    protocol member running now with the number of its call (a member
    called again is a new call, whose time starts again), and the
    ``--member-timeout`` the parent holds each call to."""

    def __init__(self, folder: Optional[str]):
        self.fd = os.open(Path(folder) / FLIGHT_FILE, os.O_RDWR | os.O_CREAT, 0o644) if folder else None
        self.state: dict = {}
        self.calls = 0
        self.timeout: Optional[float] = None

    def limit(self, seconds: Optional[float]):
        """Each member call from now on may take ``seconds`` (None: no limit)."""
        self.timeout = seconds

    def _write(self):
        data = json.dumps(self.state).encode()
        if len(data) > RECORD:  # a batch of very many requests: the record keeps the rest
            data = json.dumps({**self.state, "requests": None}).encode()
        os.pwrite(self.fd, data + b"\n", 0)  # the record ends at its newline; older bytes may follow

    def run(self, label: str):
        if self.fd is not None:
            self.state = {"label": label, "timeout": self.timeout}
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
            self.state.update(event=label, index=index, requests=list(requests), member=None)
            self._write()

    def member(self, name: Optional[str]):
        """The outermost protocol member now running; None once it returned."""
        if self.fd is not None:
            if name is not None:
                self.calls += 1
                self.state["call"] = self.calls
            self.state["member"] = name
            self._write()


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


def note_crash(folder, record: dict, returncode: int, hung: Optional[float] = None):
    """The run of ``record`` died of signal ``-returncode``; ``hung``: the
    parent stopped it because its member did not return within that many seconds."""
    noted = {**record, "signal": signal_name(returncode)}
    if hung is not None:
        noted["hung"] = hung
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

    @classmethod
    def from_env(cls) -> Optional["IsolatedState"]:
        folder = os.environ.get(STATE_ENV)
        return cls(folder) if folder else None

    def keep(self, label: str, result):
        with open(self.folder / DONE_FILE, "ab") as kept:
            pickle.dump((label, result), kept)

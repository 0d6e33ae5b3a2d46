"""Fuzz campaigns: the generated-schedule state machines (``suites/search/fuzz.py``)
on several worker processes, each with its own seeds, sharing one Hypothesis
example database.

A worker runs its machine in short rounds (a few seconds of examples each,
a fresh seed each) until the campaign's time or examples are spent or a
failure is found; between rounds it reports its counts. Hypothesis replays
what the database holds for the machine before it generates anything, so a
failure one worker saved is the first thing every later round (on any
worker, on any machine sharing the database) runs. The database is a
directory on one machine, or a Redis server for workers on several. A
database that goes away mid-campaign (the server stopped, the disk gone) is
reported, and each worker goes on with its examples in memory: the campaign
finishes on what it has.

A fixed campaign (``Campaign.fixed``: the generated budget of ``kvparity
run`` and ``check``) is derandomized instead: each worker runs its examples
in one round seeded by the campaign's seed alone, after a round of the
database's saved failures where there is a database.
"""

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from kvparity.oracle.atomic import FOUND_DIR
from kvparity.suites.core.evidence import PASS
from kvparity.suites.core.flight import MEMBER_TIMEOUT_S
from kvparity.suites.format.levels import L1, L2, SCHEDULE_LEVELS


LEVELS = SCHEDULE_LEVELS  # the state machine generates schedules
# Events per generated schedule, as the generated tests use them.
STEP_COUNT = {L1: 10, L2: 6}
# A worker's rounds: the first is small, later ones last about ROUND_S.
FIRST_ROUND, ROUND_S, MAX_ROUND = 5, 3.0, 500
# How often a worker sends its counts.
TALLY_S = 2.0


class CampaignError(RuntimeError):
    """A worker failed in the harness itself (its traceback is the message)."""


@dataclass(frozen=True)
class Campaign:
    implementation: str  # package.module:factory
    judge: Callable  # ScheduleResult -> its verdict; picklable (it travels to the workers)
    level: str = L1
    workers: int = 1
    seconds: Optional[float] = None  # a time box, or
    examples: Optional[int] = None  # a number of examples, over all workers
    database: Optional[str] = None  # a directory, a redis:// URL, or None
    seed: int = 0
    found_dir: str = str(FOUND_DIR)  # where the machines write failing schedules, a folder per worker
    shrink: bool = True  # False: stop at the first failing example (time to first failure)
    device: Optional[str] = None  # "cpu", "gpu" or MLX's default
    warm_up: int = 0  # examples each worker runs on the reference before the start, outside the counts
    member_timeout: Optional[float] = MEMBER_TIMEOUT_S  # a member call running longer hangs: the worker is stopped
    # Derandomized: each worker runs its share of the examples in one round seeded by the campaign's seed
    # alone, so the same campaign generates the same schedules every time (the gate's generated budget);
    # a database's saved failures are replayed before it, in a round of their own.
    fixed: bool = False
    reach: bool = False  # note the coverage model's cells of every finished schedule (Tally.cells)

    @property
    def starting_workers(self) -> int:
        """The workers it starts with: no more than its examples."""
        return min(self.workers, self.examples or self.workers)

    def share(self, worker: int) -> Optional[int]:
        """Worker ``worker``'s examples, when the campaign counts them."""
        if self.examples is None:
            return None
        return self.examples // self.workers + (worker < self.examples % self.workers)


@dataclass
class Tally:
    """One worker's counts so far."""

    schedules: int = 0  # judged generated schedules (not Hypothesis's abandoned overruns, nor shrinking's)
    outcomes: Counter = field(default_factory=Counter)  # schedule verdicts
    rows: Counter = field(default_factory=Counter)  # row verdicts
    seconds: float = 0.0  # generating, since the campaign started
    first_failure_s: Optional[float] = None  # when a schedule first failed, since the start
    cells: frozenset = frozenset()  # the coverage model's cells reached, where the campaign notes them
    values: frozenset = frozenset()  # there, the value cells reached, by name
    digest: str = ""  # there, a sha256 of the schedules judged, in their order (fuzz.make_machine's reach)

    @property
    def rows_passed(self) -> int:
        return self.rows.get(PASS, 0)


@dataclass
class Found:
    worker: int
    doc: dict  # the failing schedule, shrunk by Hypothesis unless the campaign does not shrink
    message: str
    # Where the worker died of a crash or hung in the cache under test: its
    # flight recorder's last word, with the signal (and the timeout it
    # overran), as ``suites.evidence.crashed`` reads it. ``doc`` is then the
    # schedule as far as it had grown, not shrunk: running it again would
    # crash or hang whoever runs it.
    record: Optional[dict] = None


@dataclass
class CampaignResult:
    campaign: Campaign
    tallies: Dict[int, Tally]
    found: List[Found]
    seconds: float  # wall time since the workers started generating
    lost: List[str] = field(default_factory=list)  # workers that died, each in words (what it kept, its replacement)
    database_lost: List[str] = field(default_factory=list)  # the example database going away, per worker, in words
    interrupted: Optional[str] = None  # the signal that stopped the campaign, by name

    @property
    def schedules(self) -> int:
        return sum(t.schedules for t in self.tallies.values())

    @property
    def rows_passed(self) -> int:
        return sum(t.rows_passed for t in self.tallies.values())

    @property
    def schedules_per_second(self) -> float:
        """The workers' rates added up: each worker's schedules over its own generating time."""
        return sum(t.schedules / t.seconds for t in self.tallies.values() if t.seconds > 0)

    @property
    def first_failure_s(self) -> Optional[float]:
        times = [t.first_failure_s for t in self.tallies.values() if t.first_failure_s is not None]
        return min(times, default=None)

    @property
    def cells(self) -> frozenset:
        return frozenset().union(*(t.cells for t in self.tallies.values()))

    @property
    def values(self) -> frozenset:
        return frozenset().union(*(t.values for t in self.tallies.values()))

    @property
    def digest(self) -> str:
        """The workers' digests of their schedules, in the workers' order, as one."""
        digests = [self.tallies[w].digest for w in sorted(self.tallies)]
        return digests[0] if len(digests) == 1 else hashlib.sha256(" ".join(digests).encode()).hexdigest()

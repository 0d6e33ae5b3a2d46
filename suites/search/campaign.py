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

import functools
import hashlib
import json
import multiprocessing
import queue as queues
import signal
import time
import traceback
import unittest
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from kvparity.oracle.atomic import FOUND_DIR, make_folder
from kvparity.oracle.signals import signal_name
from kvparity.suites.core.evidence import FAILURES, PASS
from kvparity.suites.core.flight import FLIGHT, MEMBER_TIMEOUT_S, SCHEDULE_FILE, Watch, ended, how_it_ended, read_flight
from kvparity.suites.format.levels import L1, L2, SCHEDULE_LEVELS
from kvparity.suites.core.processes import (
    STOP_GRACE_S, die_with_parent, died_of_a_crash, oom_kills, stop_signal,
)

LEVELS = SCHEDULE_LEVELS  # the state machine generates schedules
# Events per generated schedule, as the generated tests use them.
STEP_COUNT = {L1: 10, L2: 6}
# A worker's rounds: the first is small, later ones last about ROUND_S.
FIRST_ROUND, ROUND_S, MAX_ROUND = 5, 3.0, 500
# How long a worker may take to import and load before the campaign starts.
START_TIMEOUT_S = 300
# How often a worker sends its counts.
TALLY_S = 2.0
REDIS_PREFIX = b"kvparity-example:"
# A Redis server that stops answering fails a call after this, not never.
REDIS_TIMEOUT_S = 10


class DatabaseError(Exception):
    """The --database given cannot be used as written (a usage error)."""


class DatabaseUnavailable(Exception):
    """The database cannot be reached or opened here (cannot judge)."""


class CampaignError(RuntimeError):
    """A worker failed in the harness itself (its traceback is the message)."""


def open_database(spec: Optional[str]):
    """The example database ``spec`` names: None for none, ``redis://...``
    for a Redis server, anything else a directory."""
    if spec is None:
        return None
    if spec.startswith(("redis://", "rediss://", "unix://")):
        try:
            import redis
            from hypothesis.extra.redis import RedisExampleDatabase
        except ImportError as error:
            raise DatabaseUnavailable(f"--database {spec}: needs the redis package "
                                      f"(pip install 'kvparity[redis]'): {error}")
        try:
            client = redis.Redis.from_url(spec, socket_timeout=REDIS_TIMEOUT_S,
                                          socket_connect_timeout=REDIS_TIMEOUT_S)
        except ValueError as error:
            raise DatabaseError(f"--database {spec}: not a Redis URL: {error}")
        return RedisExampleDatabase(client, key_prefix=REDIS_PREFIX)
    if "://" in spec:
        raise DatabaseError(f"--database {spec}: a directory or redis://host:port[/db]")
    from hypothesis.database import DirectoryBasedExampleDatabase

    path = Path(spec)
    if path.exists() and not path.is_dir():
        raise DatabaseError(f"--database {spec}: not a directory")
    return DirectoryBasedExampleDatabase(path)


def check_database(spec: Optional[str]):
    """Open ``spec`` and, for Redis, reach the server: refused before any worker starts."""
    database = open_database(spec)
    if database is not None and hasattr(database, "redis"):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        try:  # one try: the workers' own client retries, the check need not
            redis.Redis.from_url(spec, retry=Retry(NoBackoff(), 0)).ping()
        except redis.RedisError as error:
            raise DatabaseUnavailable(f"--database {spec}: cannot reach the server: {error}")
    return database


def database_errors() -> tuple:
    """What a database that went away raises: OSError for a directory, and
    Redis's errors where the redis package is installed."""
    try:
        import redis
    except ImportError:
        return (OSError,)
    return (OSError, redis.RedisError)


def fallible(database, spec: str, lost: Callable[[str], None]):
    """``database`` that, should it fail, says so once through ``lost`` and
    from then on keeps the worker's examples in memory."""
    from hypothesis.database import ExampleDatabase, InMemoryExampleDatabase

    class FallibleDatabase(ExampleDatabase):
        def __init__(self):
            super().__init__()
            self.memory, self.gone = InMemoryExampleDatabase(), False

        def _call(self, name, *args):
            if not self.gone:
                try:
                    return list(getattr(database, name)(*args) or ())
                except database_errors() as error:
                    self.gone = True
                    lost(f"the example database {spec} went away ({type(error).__name__}: {error}); "
                         "from then on the worker kept its examples in memory, so what it found after is "
                         "in this run's report, not in the database")
            return list(getattr(self.memory, name)(*args) or ())

        def fetch(self, key):
            yield from self._call("fetch", key)

        def save(self, key, value):
            self._call("save", key, value)

        def delete(self, key, value):
            self._call("delete", key, value)

        def move(self, src, dest, value):
            self._call("move", src, dest, value)

    return FallibleDatabase()


def database_key(level: str, implementation: str) -> bytes:
    """The key of one machine's examples: a failure replays on the same
    level and implementation (a control's failures never reach the
    reference's campaign, where a pass would delete them)."""
    return f"kvparity fuzz {level} {implementation}".encode()


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


def run_campaign(campaign: Campaign, on_progress: Optional[Callable] = None,
                 progress_s: float = 5.0) -> CampaignResult:
    """Run the campaign's workers to the end; ``on_progress(result)`` every
    ``progress_s`` seconds and once at the end. The first failure found
    stops the other workers after their current round; a stop signal
    (Ctrl-C, SIGTERM, SIGHUP) stops them at once, and the result so far is
    returned, ``interrupted``."""
    if campaign.level not in LEVELS:
        raise ValueError(f"level {campaign.level!r}: one of {', '.join(LEVELS)}")
    context = multiprocessing.get_context("spawn")  # MLX in a forked child is not safe
    messages, ready, go, stop = context.Queue(), context.Queue(), context.Event(), context.Event()
    workers = campaign.starting_workers

    watches = {}  # each worker's flight record, as the campaign looks at it

    def started(worker, share=None):
        process = context.Process(target=work, args=(campaign, worker, messages, ready, go, stop, share),
                                  daemon=True)
        process.start()
        watches[worker] = Watch(worker_folder(campaign, worker))
        return process

    processes = {w: started(w) for w in range(workers)}
    result = CampaignResult(campaign, {w: Tally() for w in range(workers)}, [], 0.0)
    oom_before = oom_kills()

    def failed_in_the_cache(worker, record) -> bool:
        """``record`` (``flight.ended``) a failure found, where the worker was running a schedule."""
        found = found_dead(campaign, worker, record)
        if found is not None:
            result.found.append(found)
            stop.set()
        return found is not None

    def crashed_in_the_cache(worker, exitcode) -> bool:
        return (exitcode is not None and exitcode < 0 and died_of_a_crash(exitcode, oom_before, oom_kills())
                and failed_in_the_cache(worker, ended(read_flight(watches[worker].folder) or {}, exitcode)))

    try:
        for _ in range(workers):  # every worker imported and loaded: start them together
            kind, worker, payload = ready.get(timeout=START_TIMEOUT_S)
            if kind == "error":
                raise CampaignError(f"worker {worker} could not start:\n{payload}")
        start = time.perf_counter()
        go.set()
        running, last = set(range(workers)), start
        while running:
            try:
                kind, worker, payload = messages.get(timeout=1.0)
            except queues.Empty:
                for dead in [w for w in running if not processes[w].is_alive()] if messages.empty() else ():
                    running.discard(dead)
                    exitcode = processes[dead].exitcode
                    if crashed_in_the_cache(dead, exitcode):
                        continue
                    replacement = replace_dead(campaign, result, dead, exitcode,
                                               len(processes), time.perf_counter() - start, stop.is_set())
                    if replacement is not None:
                        worker, share = replacement
                        processes[worker], result.tallies[worker] = started(worker, share), Tally()
                        running.add(worker)
                kind = None
            if kind == "tally":
                result.tallies[worker] = payload
            elif kind == "found":
                result.found.append(payload)
                stop.set()
            elif kind == "done":
                running.discard(worker)
            elif kind == "database":
                result.database_lost.append(f"worker {worker}: {payload}")
            elif kind == "error":
                raise CampaignError(f"worker {worker} failed:\n{payload}")
            for hung, record in [(w, watches[w].overrun()) for w in running]:
                if record is not None:  # its member call outran the member timeout
                    processes[hung].kill()
                    processes[hung].join()
                    running.discard(hung)
                    failed_in_the_cache(hung, ended(record, processes[hung].exitcode, record["timeout"]))
            result.seconds = time.perf_counter() - start
            if on_progress and time.perf_counter() - last >= progress_s:
                on_progress(result)
                last = time.perf_counter()
        if on_progress:
            on_progress(result)
    except KeyboardInterrupt:  # what the workers reported so far is the campaign's result
        result.interrupted = stop_signal() or "SIGINT"
    finally:
        stop.set()
        go.set()
        for process in processes.values():  # interrupted: SIGTERM now, not after their round
            process.join(timeout=0 if result.interrupted else 30)
            if process.is_alive():
                process.terminate()
                process.join(timeout=STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
    return result


def worker_folder(campaign: Campaign, worker: int) -> Path:
    """Where worker ``worker`` writes its failing schedules and its flight record."""
    return Path(campaign.found_dir) / f"worker-{worker}"


def found_dead(campaign: Campaign, worker: int, record: dict) -> Optional[Found]:
    """A worker that died of a crash or was stopped hung (``record``: its
    flight recorder's last word, with the signal and the timeout it
    overran) while it ran a schedule of the cache under test: that failure,
    with the schedule as far as it had grown. None where no schedule was
    running: nothing to blame it on."""
    try:
        doc = json.loads((worker_folder(campaign, worker) / SCHEDULE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not record.get("label"):
        return None
    return Found(worker, doc, f"{record['label']}: {how_it_ended(record)}; worker {worker} was stopped"
                 if record.get("hung") is not None else f"{record['label']}: {how_it_ended(record)}", record)


def replace_dead(campaign: Campaign, result: CampaignResult, dead: int, exitcode: int, made: int,
                 elapsed: float, stopping: bool) -> Optional[Tuple[int, Tuple[Optional[int], Optional[float]]]]:
    """A worker that ended without a word (killed from outside, or a crash
    in native code): noted in ``result.lost`` with what its last tally kept,
    and replaced by a new worker for what it had left (examples, seconds),
    up to one replacement per worker the campaign started with. Returns
    (the new worker's number, its share) or None."""
    kept = result.tallies[dead]
    how = signal_name(exitcode) if exitcode is not None and exitcode < 0 else f"exit {exitcode}"
    said = (f"worker {dead} died ({how}) after {kept.schedules} generated schedules; what it judged up to "
            f"its last report is kept, the schedules it was running are lost")
    share = campaign.share(dead)
    left = None if share is None else max(share - kept.schedules, 0)
    seconds = None if campaign.seconds is None else campaign.seconds - elapsed
    replaced = made - campaign.starting_workers
    if stopping or left == 0 or (seconds is not None and seconds <= 0) or replaced >= campaign.workers:
        result.lost.append(said + "; not replaced")
        return None
    result.lost.append(f"{said}; worker {made} took its place")
    return made, (left, seconds)


def work(campaign: Campaign, worker: int, messages, ready, go, stop, share=None):
    """One worker process: load, wait for the start, then rounds of the
    machine (``share``: a replacement's examples and seconds left). Ctrl-C
    at a terminal reaches the whole process group: the campaign stops its
    workers, which do not take it for an error of their own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()  # a campaign killed outright takes its workers with it
    FLIGHT.open(make_folder(worker_folder(campaign, worker)))  # a crash or a hang names its schedule, event, member
    FLIGHT.limit(campaign.member_timeout)
    try:
        machine, round_settings = prepare(campaign, worker, functools.partial(tell, messages, "database", worker))
        if campaign.warm_up:
            warm_up(campaign, machine, round_settings)
    except BaseException:
        ready.put(("error", worker, traceback.format_exc()))
        return
    ready.put(("ready", worker, None))
    go.wait()
    try:
        generate_rounds(campaign, worker, machine, round_settings, messages, stop, share)
    except BaseException:
        messages.put(("error", worker, traceback.format_exc()))
    else:
        messages.put(("done", worker, None))


def tell(messages, kind: str, worker: int, payload):
    messages.put((kind, worker, payload))


def prepare(campaign: Campaign, worker: int, database_lost: Callable[[str], None]):
    """The worker's machine class and a function from a round's examples and
    seed to its settings; everything a worker imports is imported here.
    ``database_lost(words)`` hears of the example database going away."""
    import mlx.core as mx
    from hypothesis import HealthCheck, Phase, settings

    from kvparity.suites.core.adapter import load_implementation
    from kvparity.suites.search.fuzz import make_machine

    if campaign.device is not None:
        mx.set_default_device({"cpu": mx.cpu, "gpu": mx.gpu}[campaign.device])
    implementation = load_implementation(campaign.implementation)
    run_l2 = None
    if campaign.level == L2:  # the models' imports, only where they are used
        from kvparity.suites.l2.run import run_l2
    machine = make_machine(
        implementation, WorkerJudge(campaign.judge), Path(campaign.found_dir) / f"worker-{worker}",
        level=campaign.level, run_l2=run_l2, database_key=database_key(campaign.level, implementation.spec),
        reach=campaign.reach,
    )
    machine.judge.machine = machine
    database = open_database(campaign.database)
    if database is not None:
        database = fallible(database, campaign.database, database_lost)
    # The machine writes its own replayable file: Hypothesis's line tracing of a failure is not needed.
    phases = [p for p in Phase if p != Phase.explain and (campaign.shrink or p != Phase.shrink)]

    def round_settings(examples, shared=True, only=None):
        """``only``: the phases of this round (of those the campaign runs)."""
        return settings(max_examples=examples, stateful_step_count=STEP_COUNT[campaign.level], deadline=None,
                        database=database if shared else None, print_blob=False,
                        phases=[p for p in phases if only is None or p in only],
                        suppress_health_check=list(HealthCheck))
    return machine, round_settings


def warm_up(campaign: Campaign, machine, round_settings):
    """Examples on the reference, without a database: MLX's kernels and the
    synthetic blocks' cache are ready before the campaign's clock starts (a
    benchmark's rate is then the campaign's, not the first seconds')."""
    from kvparity.suites.core.adapter import load_implementation
    from kvparity.suites.search.fuzz import generate, make_machine

    reference = make_machine(load_implementation(), campaign.judge, Path(campaign.found_dir) / "warm-up",
                             level=campaign.level, run_l2=machine.run_l2)
    generate(reference, round_settings(campaign.warm_up, shared=False))


class WorkerJudge:
    """The campaign's judge in a worker: it notes when a schedule first
    failed and the machine's counts then (what shrinking runs after it is
    not generation), and sends the counts every ``TALLY_S`` seconds, also
    in the middle of a round."""

    def __init__(self, judge):
        self.judge, self.first, self.counts = judge, None, None
        self.machine = self.start = self.send = None  # set once the machine exists and the campaign starts
        self.sent = 0.0

    def __call__(self, result):
        judged = self.judge(result)
        now = time.perf_counter()
        if judged.verdict in FAILURES and self.first is None:
            self.first = now - self.start
            self.counts = tally(self.machine, self.start)
        if self.send is not None and now - self.sent >= TALLY_S:
            self.send(tally(self.machine, self.start))
            self.sent = now
        return judged


def generate_rounds(campaign: Campaign, worker: int, machine, round_settings, messages, stop, share=None):
    from hypothesis import seed

    from kvparity.suites.search.fuzz import generate

    start = time.perf_counter()
    machine.judge.start = start
    machine.judge.send = lambda counts: messages.put(("tally", worker, counts))
    left, seconds = share if share is not None else (campaign.share(worker), campaign.seconds)
    if campaign.fixed:
        return fixed_rounds(campaign, worker, machine, round_settings, messages, left, start)
    size, number = FIRST_ROUND, 0
    while not stop.is_set() and (left is None or left > 0):
        elapsed = time.perf_counter() - start
        if seconds is not None and elapsed >= seconds:
            break
        examples = size if left is None else min(size, left)
        before = sum(machine.outcomes.values())
        # Distinct seeds: across workers, rounds and campaigns (the campaign's own seed).
        seed(f"{campaign.seed}/{worker}/{number}")(machine)
        round_start = time.perf_counter()
        try:
            generate(machine, round_settings(examples))
        except Exception as error:  # a ScheduleFailed, or a group of them
            put_found(error, worker, messages)
            break
        finally:
            messages.put(("tally", worker, tally(machine, start)))
        number += 1
        if left is not None:
            left -= examples
        judged = sum(machine.outcomes.values()) - before
        rate = judged / max(time.perf_counter() - round_start, 1e-3)
        size = max(1, min(MAX_ROUND, int(rate * ROUND_S)))
        if seconds is not None:  # the last round ends near the time box
            size = max(1, min(size, int(rate * (seconds - (time.perf_counter() - start))) + 1))


def put_found(error: Exception, worker: int, messages):
    """The failures a round raised, each sent as found; anything else it
    raised is the harness's own error, raised again."""
    from kvparity.suites.search.fuzz import ScheduleFailed, found_in, leaves

    failures = found_in(error, ScheduleFailed)
    if not failures or len(failures) < leaves(error):
        raise error
    for failure in failures:
        messages.put(("found", worker, Found(worker, failure.doc, str(failure))))


def fixed_rounds(campaign: Campaign, worker: int, machine, round_settings, messages, examples: int, start):
    """A derandomized campaign's worker: the database's saved failures
    replayed first (where there is a database), then its ``examples`` in one
    round seeded by the campaign's seed and the worker's number alone. The
    generated round is the same whatever the database holds; it saves what
    fails into the database for the next campaign."""
    from hypothesis import Phase, seed

    from kvparity.suites.search.fuzz import generate

    seed(f"{campaign.seed}/{worker}/0")(machine)
    rounds = [(Phase.reuse, Phase.shrink)] if campaign.database is not None else []
    for only in rounds + [(Phase.generate, Phase.shrink)]:
        try:
            generate(machine, round_settings(examples, only=only))
        except unittest.SkipTest:  # Hypothesis's word for a round that ran nothing: the database held none
            continue
        except Exception as error:  # a ScheduleFailed, or a group of them
            put_found(error, worker, messages)
            return
        finally:
            messages.put(("tally", worker, tally(machine, start)))


def tally(machine, start) -> Tally:
    """The worker's counts: up to its first failure once it has one."""
    if machine.judge.counts is not None:
        return machine.judge.counts
    return Tally(
        schedules=sum(machine.outcomes.values()), outcomes=Counter(machine.outcomes),
        rows=Counter(machine.row_outcomes), seconds=time.perf_counter() - start,
        first_failure_s=machine.judge.first, cells=frozenset(machine.reached or ()),
        values=frozenset(machine.reached_values or ()),
        digest=machine.digest.hexdigest() if machine.digest is not None else "",
    )

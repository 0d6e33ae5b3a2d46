"""A campaign's worker process: its machine, its rounds (short ones with
fresh seeds, or the fixed budget's one derandomized round), what it found
and its counts, sent to the supervisor."""

import functools
import os
import signal
import time
import traceback
import unittest
from collections import Counter
from pathlib import Path
from typing import Callable

from hypothesis.configuration import set_hypothesis_home_dir

from kvparity.oracle.atomic import make_folder
from kvparity.oracle.gguf import cache_dir
from kvparity.suites.core.evidence import FAILURES
from kvparity.suites.core.flight import FLIGHT
from kvparity.suites.format.levels import L2
from kvparity.suites.core.processes import die_with_parent

from kvparity.suites.search.campaign import (
    STEP_COUNT, FIRST_ROUND, ROUND_S, MAX_ROUND, TALLY_S, Campaign, Tally, Found,
)
from kvparity.suites.search.database import open_database, fallible, database_key


def worker_folder(campaign: Campaign, worker: int) -> Path:
    """Where worker ``worker`` writes its failing schedules and its flight record."""
    return Path(campaign.found_dir) / f"worker-{worker}"


def work(campaign: Campaign, worker: int, messages, ready, go, stop, share=None):
    """One worker process: load, wait for the start, then rounds of the
    machine (``share``: a replacement's examples and seconds left). Ctrl-C
    at a terminal reaches the whole process group: the campaign stops its
    workers, which do not take it for an error of their own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()  # a campaign killed outright takes its workers with it
    keep_hypothesis_out_of_the_working_directory()
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


def keep_hypothesis_out_of_the_working_directory():
    """Hypothesis keeps what it caches (each local module's constants) under
    its home, ``.hypothesis/`` in the working directory by default: a
    campaign runs in the user's repository (the gate's generated budget,
    kvparity fuzz), so it keeps them in kvparity's cache instead, unless
    HYPOTHESIS_STORAGE_DIRECTORY says where."""
    if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        set_hypothesis_home_dir(cache_dir() / "hypothesis")


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

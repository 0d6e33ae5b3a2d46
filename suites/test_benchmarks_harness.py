"""The benchmark suite's figures of the harness itself (``test_benchmarks.py``
says how the suite measures and records): generated L1 schedules per second,
the wall time of whole commands with the oracle cache cold and warm, what the
evidence after every protocol call costs, and fuzz campaigns' schedules per
second and time to a negative control's first failure."""

import os
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from kvparity.reports.policy import load_policy
from kvparity.reports.verdicts import judge
from kvparity.suites.search.campaign import Campaign
from kvparity.suites.search.supervisor import run_campaign
from kvparity.suites.search.fuzz import generate, make_machine
from kvparity.suites.l1.run import run_l1
from kvparity.suites.format.schedule import catalog_paths
from kvparity.suites.core.loading import load
from kvparity.suites.test_benchmarks import MARKS, QUICK, Ratio, _pedantic, _record

pytestmark = MARKS


# -- the harness itself ------------------------------------------------------------

# Generated L1 schedules per second: Hypothesis's state machine on the cache
# under test, each event applied and checked as it is generated (up to 10
# events a schedule, derandomized, so every round runs the same schedules).
# The target is 3x the 11.5/s measured before the replay core was rebuilt.
GENERATED = 50 if QUICK else 1000
GENERATED_ROUNDS = 2
GENERATOR = Ratio(
    "generator: L1 schedules per second", "generated", None, quantity="schedules_per_second",
    targets=((f"{GENERATED} examples", ">=", 34.5),),
)


def test_generated_schedules_per_second(benchmark, implementation, tmp_path):
    """``GENERATED`` examples of the L1 state machine with the cpu policy;
    a failing schedule fails the benchmark (it measures a broken cache)."""
    policy = load_policy("cpu")
    started = []

    def run_once():
        machine = make_machine(implementation, lambda result: judge(result, policy), tmp_path)
        generate(machine, settings=settings(
            max_examples=GENERATED, stateful_step_count=10, derandomize=True, database=None, deadline=None,
            suppress_health_check=list(HealthCheck), print_blob=False,
        ))
        started.append(machine.schedules_started)

    run_once()  # warm-up: imports, the synthetic blocks' cache
    benchmark.pedantic(run_once, rounds=GENERATED_ROUNDS, iterations=1)
    _record(benchmark, "generator", f"{GENERATED} examples", "generated", [GENERATOR],
            examples=GENERATED, stateful_step_count=10,
            schedules_per_second=GENERATED / benchmark.stats.stats.median,
            # Hypothesis also starts schedules it abandons (overruns): counted here, not in the rate.
            schedules_started=started[-1])


HARNESS = Ratio(
    "harness: cold / warm wall time", "cold", "warm", quantity="seconds",
    targets=(("kvparity run", ">=", 3.0),),
)


def time_command(argv, env=None, cwd=None) -> float:
    """Wall seconds of one run of ``argv``; raises CalledProcessError if it fails."""
    start = time.perf_counter()
    subprocess.run(list(argv), env=env, cwd=cwd, check=True)
    return time.perf_counter() - start


# Each command gates the implementation under test, named on its command line
# (its last argument): a wheel's package folder has no pyproject to name it.
COMMANDS = {
    "kvparity run": ["-m", "kvparity", "run", "--no-report", "--impl"],
    "default test suite": ["-m", "pytest", "-q", "--kvparity-impl"],
}


@pytest.fixture(scope="module")
def oracle_caches(tmp_path_factory):
    return tmp_path_factory.mktemp("oracle")


@pytest.mark.parametrize("variant", ["cold", "warm"])
@pytest.mark.parametrize("command", ["kvparity run", *([] if QUICK else ["default test suite"])])
def test_harness_wall_time(benchmark, implementation, oracle_caches, command, variant):
    """Wall time of a whole command with an empty oracle cache (cold) and with
    the cache a previous run filled (warm); one round each, they take seconds."""
    argv = [sys.executable, *COMMANDS[command], implementation.spec]
    cache = oracle_caches / command.replace(" ", "-")
    env = {**os.environ, "KVPARITY_ORACLE_CACHE": str(cache)}
    root = Path(__file__).parent.parent
    if variant == "cold":
        shutil.rmtree(cache, ignore_errors=True)
    elif not cache.exists():
        time_command(argv, env=env, cwd=root)  # fill it
    seconds = []
    benchmark.pedantic(lambda: seconds.append(time_command(argv, env=env, cwd=root)), rounds=1)
    _record(benchmark, "harness", command, variant, [HARNESS] if variant == "cold" else [],
            seconds=seconds[0])


EVIDENCE = Ratio(
    "L1 catalog: evidence after every protocol call / after every event only", "every call", "every event",
    targets=(("L1 catalog", "<=", 1.3),),
)


@pytest.mark.parametrize("variant", ["every call", "every event"])
def test_evidence_after_every_call(benchmark, implementation, variant):
    """The L1 catalog with the evidence after every protocol call, against
    the same with the checks after each event only: what naming the member
    at fault from evidence costs (the whole command: docs/performance.md)."""
    schedules = [load(path) for path in catalog_paths("L1")]
    every_call = variant == "every call"
    _pedantic(benchmark, lambda: [run_l1(schedule, implementation, every_call) for schedule in schedules])
    _record(benchmark, "evidence", "L1 catalog", variant, [EVIDENCE] if every_call else [])


# -- gate power: fuzz campaigns ------------------------------------------------------

# The controls the L1 state machine catches; the others are reached only by
# the catalog (ExtractReturnsViews and FinalizeLeavesJunk went uncaught in
# about 870 generated schedules, a minute of one worker).
GENERATED_CATCHES = (
    ("TrimForgetsOffset",) if QUICK else (
        "LeftPaddingOffByOne", "FilterKeepsSharedPadding", "RollbackByLargest", "MergeRequantizes",
        "MergeWritesItsSources", "ExtractWritesTheBatch", "MaskIgnoresLeftPadding", "ExtendForgetsExistingPadding",
        "RopeOffsetIgnoresLeftPadding", "TrimForgetsOffset", "GrowthDropsTail", "EmptyBatchPacksWholeElementsPerWord",
    )
)
FUZZ_SECONDS = 4 if QUICK else 30  # of generating, for the rate; the workers' start is not counted
WARM_UP = 5  # examples each worker runs on the reference before the clock starts
KILL_REPEATS = 1 if QUICK else 3  # campaigns per control and worker count, each from an empty database
KILL_LIMIT_S = 60  # a campaign that has not caught the control by then counts as not caught
WORKERS = {1: "1 worker", 2: "2 workers"}
FUZZ_CASE = f"L1, {FUZZ_SECONDS} s"
FUZZ_RATES = {
    1: Ratio("fuzz: schedules per second, 1 worker", WORKERS[1], None, quantity="schedules_per_second"),
    2: Ratio("fuzz: schedules per second, 2 workers", WORKERS[2], None, quantity="schedules_per_second"),
}
FUZZ_SCALING = Ratio(
    "fuzz: 2 / 1 workers schedules per second", WORKERS[2], WORKERS[1], quantity="schedules_per_second",
    targets=((FUZZ_CASE, ">=", 1.7),),
)
TIME_TO_KILL = {
    1: Ratio("fuzz: median seconds to the first failure, 1 worker", WORKERS[1], None,
             quantity="seconds_to_first_failure", targets=tuple((c, "<=", KILL_LIMIT_S) for c in GENERATED_CATCHES)),
    2: Ratio("fuzz: median seconds to the first failure, 2 workers", WORKERS[2], None,
             quantity="seconds_to_first_failure"),
}


def _campaign(implementation, tmp_path, **options):
    judge_cpu = partial(judge, policy=load_policy("cpu"))
    return run_campaign(Campaign(implementation, judge_cpu, found_dir=str(tmp_path), warm_up=WARM_UP, **options))


@pytest.mark.parametrize("workers", sorted(WORKERS))
def test_fuzz_schedules_per_second(benchmark, implementation, workers, tmp_path):
    """A time-boxed campaign of the L1 machine on the cache under test,
    without a database: its workers' schedules per second, added up."""
    results = []
    benchmark.pedantic(lambda: results.append(_campaign(
        implementation.spec, tmp_path, workers=workers, seconds=FUZZ_SECONDS, seed=workers)), rounds=1)
    (result,) = results
    if result.found:  # it measures a broken cache
        pytest.fail(f"the campaign found a failure: {result.found[0].message}")
    ratios = [FUZZ_RATES[workers]] + ([FUZZ_SCALING] if workers == 2 else [])
    _record(benchmark, "fuzz", FUZZ_CASE, WORKERS[workers], ratios, workers=workers,
            schedules=result.schedules, schedules_per_second=result.schedules_per_second)


@pytest.mark.parametrize("workers", sorted(WORKERS))
@pytest.mark.parametrize("control", GENERATED_CATCHES)
def test_fuzz_time_to_first_failure(benchmark, control, workers, tmp_path):
    """Campaigns on a negative control, each from an empty database and
    stopped at its first failing example (no shrinking): the median of the
    seconds to it, counted from the workers' start; one not caught within
    ``KILL_LIMIT_S`` counts as never, and a median of never is None ("n/a")."""
    times = []

    def run_once():
        for repeat in range(KILL_REPEATS):
            result = _campaign(f"kvparity.impl.negative_controls:{control}", tmp_path / str(repeat),
                               workers=workers, seconds=KILL_LIMIT_S, seed=100 + repeat,
                               database=str(tmp_path / str(repeat) / "db"), shrink=False)
            times.append(result.first_failure_s if result.found else float("inf"))

    benchmark.pedantic(run_once, rounds=1)
    median = sorted(times)[len(times) // 2]
    _record(benchmark, "fuzz-kill", control, WORKERS[workers], [TIME_TO_KILL[workers]], workers=workers,
            repeats=KILL_REPEATS, caught=sum(t != float("inf") for t in times),
            seconds_to_first_failure=None if median == float("inf") else median)

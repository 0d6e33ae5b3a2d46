"""``kvparity fuzz``: a campaign of generated schedules on several worker
processes sharing an example database; each failure found is shrunk,
written as a schedule file and replayed into a report directory."""

import functools
import random
import shlex
import sys
import tempfile
from pathlib import Path

from kvparity.oracle.atomic import OUTPUT_ROOT
from kvparity.reports import verdicts
from kvparity.reports.commands.base import (
    DEVICE_HELP, IMPL_HELP, CannotRun, UsageError, check_impl_spec, implementation, model_or_default, policy,
    print_configuration, use_device, writable_directory,
)
from kvparity.reports.commands.runs import member_timeout_option, report_written
from kvparity.reports.environment import describe
from kvparity.reports.verdicts import EXIT_OK
from kvparity.reports.writer import write_report
from kvparity.suites.search.campaign import LEVELS, Campaign
from kvparity.suites.search.database import DatabaseError, DatabaseUnavailable, check_database
from kvparity.suites.search.supervisor import run_campaign
from kvparity.suites.core.evidence import FAILURES, crashed
from kvparity.suites.core.flight import MEMBER_TIMEOUT_S
from kvparity.suites.format.levels import L1
from kvparity.suites.runners import RUNNERS, RunOptions
from kvparity.suites.format.schedule import atomic_write_json
from kvparity.suites.core.loading import parse
from kvparity.suites.search.shrink import shrunk_found

NAME = "fuzz"
HELP = "run generated schedules for minutes on several processes; shrink and report what fails"
DESCRIPTION = ("A fuzz campaign: the generated-schedule state machine of a level on N worker processes with "
               "distinct seeds, sharing a Hypothesis example database (a directory, or redis://host:port for "
               "workers on several machines), so a failure one worker found is replayed first by every later "
               "run. Each failure is shrunk, written as a schedule file and replayed into a report directory.")
DEFAULT_DATABASE = ".hypothesis/examples"

# The settings it reads (reports/settings.py): the command line, else [tool.kvparity], else the default.
SETTINGS = ("impl", "device", "policy")  # it generates at one --level of its own
REQUIRED = ("impl",)


def arguments(command):
    command.add_argument("--impl", metavar="MODULE:FACTORY", help=IMPL_HELP)
    command.add_argument("--level", choices=LEVELS, default=L1,
                         help="L1 cache bytes or L2 model per row (default: %(default)s)")
    budget = command.add_mutually_exclusive_group(required=True)
    budget.add_argument("--minutes", type=float, metavar="M", help="run for M minutes")
    budget.add_argument("--examples", type=int, metavar="N", help="run N generated schedules over all workers")
    command.add_argument("--workers", type=int, default=1, metavar="N",
                         help="worker processes, each with its own seeds (default: %(default)s)")
    command.add_argument("--database", metavar="DIR|URL", default=DEFAULT_DATABASE,
                         help="Hypothesis example database: a directory, redis://host:port[/db], or 'none' "
                         "(default: %(default)s)")
    command.add_argument("--seed", type=int, metavar="N", help="the campaign's seed (default: a random one)")
    command.add_argument("--device", choices=("cpu", "gpu"), help=DEVICE_HELP)
    command.add_argument("--policy", metavar="NAME|FILE",
                         help="verdict policy: cpu, gpu, strict or a policy file (default: this backend's)")
    command.add_argument("--out", metavar="DIR", default=str(OUTPUT_ROOT),
                         help="where the report directory of what failed goes (default: %(default)s)")
    member_timeout_option(command)


def check_budget(workers: int, minutes, examples):
    if workers < 1:
        raise UsageError(f"--workers {workers}: at least 1")
    if minutes is not None and not minutes > 0:
        raise UsageError(f"--minutes {minutes:g}: more than 0")
    if examples is not None and examples < 1:
        raise UsageError(f"--examples {examples}: at least 1")


def database_spec(given: str):
    """--database, checked before any worker starts: None for 'none'."""
    spec = None if given.lower() == "none" else given
    try:
        check_database(spec)
    except DatabaseError as error:
        raise UsageError(str(error))
    except DatabaseUnavailable as error:
        raise CannotRun(str(error))
    if spec is not None and "://" not in spec:  # a directory the workers will write
        writable_directory(spec, "--database")
    return spec


def show_progress(result):
    failures = len(result.found)
    print(f"fuzz {result.campaign.level}: {result.seconds:.0f} s, {len(result.tallies)} worker(s): "
          f"{result.schedules} schedules ({result.schedules_per_second:.1f}/s), {result.rows_passed} rows "
          f"passed, {failures} failure{'s' * (failures != 1)}", file=sys.stderr, flush=True)


def handle(args, settings):
    check_budget(args.workers, args.minutes, args.examples)
    chosen_policy = policy(settings)
    check_impl_spec(settings.impl)
    writable_directory(settings.out, "--out")
    database = database_spec(args.database)
    use_device(settings.device)
    chosen = implementation(settings.impl)  # refused here, before any worker starts
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    print_configuration(settings, policy=chosen_policy.name)
    print(f"fuzz {settings.level} on {chosen.spec}: {args.workers} worker(s), seed {seed}, "
          f"database {database or 'none'}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="kvparity-fuzz-") as found_dir:
        campaign = Campaign(
            implementation=chosen.spec, judge=functools.partial(verdicts.judge, policy=chosen_policy),
            level=settings.level, workers=args.workers, examples=args.examples,
            seconds=None if args.minutes is None else args.minutes * 60, database=database, seed=seed,
            found_dir=found_dir, device=settings.device, member_timeout=settings.member_timeout,
        )
        result = run_campaign(campaign, on_progress=show_progress)
    for lost in result.lost + result.database_lost:
        print(f"kvparity fuzz: {lost}", file=sys.stderr)
    if result.interrupted:
        return report_interrupted(settings, result, chosen, chosen_policy)
    if not result.found:
        return nothing_found(result)
    return report_failures(settings, result, chosen, chosen_policy)


def nothing_found(result) -> int:
    if result.rows_passed == 0:
        raise CannotRun(f"{result.schedules} generated schedules and no row compared: no evidence")
    lost = f"; {len(result.lost)} worker(s) died, their last rounds unjudged" if result.lost else ""
    if result.database_lost:
        lost += "; the example database went away and the workers finished with their examples in memory"
    print(f"no failure in {result.schedules} generated {result.campaign.level} schedules "
          f"({result.rows_passed} rows passed); parity holds on what was generated{lost}")
    return EXIT_OK


def campaign_section(result):
    campaign = result.campaign
    rows = [["level", campaign.level], ["workers", len(result.tallies)], ["seed", campaign.seed],
            ["database", campaign.database or "none"], ["seconds", round(result.seconds, 1)],
            ["generated schedules", result.schedules],
            ["schedules per second", round(result.schedules_per_second, 1)],
            ["rows passed", result.rows_passed], ["failures found", len(result.found)],
            *(["worker lost", lost] for lost in result.lost),
            *(["example database lost", lost] for lost in result.database_lost)]
    return "Fuzz campaign", ["", "value"], rows


def campaign_report(settings, result, chosen, chosen_policy, results, run_verdict, docs, names):
    """The report directory of a campaign: the replayed ``results``, the
    campaign's counts, and the failing schedules ``docs``, each a replayable
    file ``found/NAME.json``."""

    def found_files(directory):
        (directory / "found").mkdir()
        for doc, name in zip(docs, names):
            atomic_write_json({**doc, "name": name}, directory / "found" / f"{name}.json")

    return write_report(results, describe(chosen, model_or_default(None)), settings.out, policy=chosen_policy,
                        run_verdict=run_verdict, capabilities=chosen.capabilities, extra=found_files,
                        sections=[campaign_section(result)], configuration=settings.configuration)


def report_interrupted(settings, result, chosen, chosen_policy) -> int:
    """A campaign a signal stopped: its counts so far and the failures it
    found, as found (shrinking and replaying them is not done once a signal
    said stop), in a report marked interrupted; the interrupted status."""
    docs = [found.doc for found in result.found]
    names = [f"{doc['name']}-{i + 1}" for i, doc in enumerate(docs)]
    run_verdict = verdicts.verdict_of_run([], policy=chosen_policy)
    run_verdict.interrupted = {"signal": result.interrupted, "finished": result.schedules,
                               "planned": result.campaign.examples}
    print(f"fuzz {result.campaign.level}: interrupted by {result.interrupted} after {result.schedules} generated "
          f"schedules ({result.rows_passed} rows passed, {len(docs)} failures found, not shrunk)")
    report_written(lambda: campaign_report(settings, result, chosen, chosen_policy, [], run_verdict, docs, names))
    return run_verdict.exit_status


def report_failures(settings, result, chosen, chosen_policy) -> int:
    """Shrink each distinct failure (``shrunk_found``), replay it, and write
    the schedules into a report."""
    level, runner = settings.level, RUNNERS[settings.level]
    options = RunOptions(use_cache=False)

    def run(schedule):
        return verdicts.judge(runner.run(schedule, chosen, options), chosen_policy)

    docs, died_in = shrunk_found(result, run)
    schedules = [parse(doc, source=doc["name"]) for doc in docs]
    results = [verdicts.judge(crashed(died_in[i]), chosen_policy) if i in died_in else run(s)
               for i, s in enumerate(schedules)]
    run_verdict = verdicts.verdict_of_run(results, policy=chosen_policy)
    names = [f"{s.name}-{i + 1}" if len(schedules) > 1 else s.name for i, s in enumerate(schedules)]
    path = report_written(lambda: campaign_report(settings, result, chosen, chosen_policy, results, run_verdict,
                                                  docs, names))
    timeout = (f" --member-timeout {settings.member_timeout:g}" if settings.member_timeout != MEMBER_TIMEOUT_S
               else "")
    for i, (name, judged) in enumerate(zip(names, results)):
        replay = (shlex.join(["kvparity", "replay", f"{Path(path) / 'found' / name}.json", "--level", level,
                              "--impl", chosen.spec]) + (timeout if i in died_in else ""))
        print(f"{name}: {judged.verdict}" + (f"; replay with: {replay}" if path else ""))
    if not any(judged.verdict in FAILURES for judged in results):
        raise CannotRun("the failures found did not fail when replayed: the implementation is not deterministic")
    return run_verdict.exit_status

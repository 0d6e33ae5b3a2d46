"""The generated budget of ``kvparity run`` and ``kvparity check``: after
the catalog, the generated-schedule state machine (``suites/search/fuzz.py``) on
one worker process of a fuzz campaign (``suites/search/campaign.py``),
derandomized: its seed is made of kvparity's version, the level and the
budget, so every commit a bisection judges gets the same schedules.

Each failure it finds is shrunk as ``kvparity fuzz`` shrinks one, written
as a schedule file with the command that replays it, and replayed here:
that run joins the catalog's, so it counts as theirs (exit 1) and is
grouped with them by the member at fault. What passed is counted, not
listed: schedules, rows compared, and the coverage model's requirements
their cells reached. A budget that compared nothing is no evidence.
"""

import functools
import hashlib
import tempfile
import time
from collections import Counter
from pathlib import Path

from kvparity import __version__
from kvparity.oracle.atomic import FOUND_DIR
from kvparity.reports import verdicts
from kvparity.reports.settings import COMMAND_LINE, GENERATED, TABLE, Settings
from kvparity.reports.commands.base import CannotRun, UsageError, writable_directory
from kvparity.suites.core.members import CAPABILITIES
from kvparity.suites.search import coverage
from kvparity.suites.search.campaign import Campaign
from kvparity.suites.search.database import DatabaseError, DatabaseUnavailable, check_database
from kvparity.suites.search.supervisor import run_campaign
from kvparity.suites.core.evidence import FAILURES, crashed
from kvparity.suites.core.flight import MEMBER_TIMEOUT_S
from kvparity.suites.format.levels import L1
from kvparity.suites.runners import RUNNERS, RunOptions
from kvparity.suites.format.schedule import atomic_write_json
from kvparity.suites.core.loading import parse
from kvparity.suites.search.shrink import shrunk_found

LEVEL = L1  # generated schedules are judged where every protocol call is: cache bytes
DEFAULT_GENERATED = GENERATED


def generated_options(command):
    command.add_argument("--generated", metavar="N",
                         help=f"after the catalog, run N generated {LEVEL} schedules, the same ones for the same "
                         f"kvparity version and N; 0: none (default: generated in [tool.kvparity], else "
                         f"{DEFAULT_GENERATED}; with --schedule, none unless given here)")
    command.add_argument("--generated-database", metavar="DIR",
                         help="a Hypothesis example database (a directory, kept between runs): the failures it "
                         "saved are tried first, and those found are saved into it (default: none)")


def budget_of(settings: Settings, files=None) -> int:
    """The number of generated schedules a command runs: 0 where it runs no
    catalog at L1 (schedule files of its own, unless --generated is given on
    the command line; a shard; levels without L1). A value that is not a
    whole number of 0 or more is a usage error, before any work."""
    if not settings.reads("generated"):  # a command without the budget (replay: one file)
        return 0
    value, source = settings.generated, settings.source("generated")
    if value is None:
        budget = DEFAULT_GENERATED
    else:
        text = str(value).strip()
        if not text.isdigit():
            where = "--generated" if source == COMMAND_LINE else f"{source}: {TABLE} generated"
            raise UsageError(f"{where} {value!r}: expected a whole number of generated schedules, 0 or more")
        budget = int(text)
    if files and source != COMMAND_LINE:
        return 0
    if settings.shard or LEVEL not in settings.levels:
        return 0
    return budget


def database_of(settings: Settings):
    """--generated-database, checked before any work."""
    spec = settings.generated_database
    if spec is None:
        return None
    try:
        check_database(spec)
    except DatabaseError as error:
        raise UsageError(str(error).replace("--database", "--generated-database"))
    except DatabaseUnavailable as error:
        raise CannotRun(str(error).replace("--database", "--generated-database"))
    if "://" not in spec:
        writable_directory(spec, "--generated-database")
    return spec


def seed_of(budget: int) -> int:
    """The campaign's seed: kvparity's version, the level and the budget."""
    digest = hashlib.sha256(f"kvparity {__version__} generated {LEVEL} {budget}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def run_generated(settings: Settings, implementation, policy, declared, budget: int, database=None):
    """The budget run on ``implementation``: (its record for the run verdict,
    the replayed failing runs, each a ``verdicts.ScheduleVerdict`` of a
    schedule file written under ``--out``'s ``found/``, else the reports
    folder's). A signal stops it: the record says so (``interrupted``)."""
    seed = seed_of(budget)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvparity-generated-") as folder:
        campaign = Campaign(
            implementation=implementation.spec, level=LEVEL, workers=1, examples=budget, database=database,
            judge=functools.partial(verdicts.judge, policy=policy, expectations=declared), seed=seed,
            found_dir=folder, device=settings.device, fixed=True, reach=True,
            member_timeout=member_timeout_of(settings),
        )
        result = run_campaign(campaign)
    # The catalog's model, with the value cells of the capabilities the search draws for this cache
    found = coverage.met(result.cells, result.values, [c for c in CAPABILITIES if implementation.supports(c)])
    record = {
        "level": LEVEL, "budget": budget, "seed": seed, "database": database,
        "schedules": result.schedules, "rows": dict(sum((t.rows for t in result.tallies.values()), Counter())),
        "rows_passed": result.rows_passed,
        "cells": {"requirements": found["requirements"], "reached": found["reached"]},
        "digest": result.digest,
        "failures": [], "lost": result.lost + result.database_lost, "interrupted": result.interrupted,
    }
    found = []
    if result.found and not result.interrupted:
        found = replayed(settings, result, implementation, policy, declared, record)
    record["seconds"] = round(time.perf_counter() - started, 1)
    return record, found


def member_timeout_of(settings: Settings) -> float:
    """The member timeout the budget runs under: the command's, else the flight's default."""
    return MEMBER_TIMEOUT_S if settings.member_timeout is None else settings.member_timeout


def replayed(settings: Settings, result, implementation, policy, declared, record):
    """Each failure found shrunk, written and replayed; the record lists them
    with their replay commands."""
    runner, options = RUNNERS[LEVEL], RunOptions(use_cache=False)

    def run(schedule):
        return verdicts.judge(runner.run(schedule, implementation, options), policy, declared)

    docs, died_in = shrunk_found(result, run)
    folder = Path(settings.out) / FOUND_DIR.name if settings.out else FOUND_DIR  # written with the report
    folder.mkdir(parents=True, exist_ok=True)
    timeout = member_timeout_of(settings)
    judged_runs = []
    for i, doc in enumerate(docs):
        name = doc["name"].replace("found-", "generated-", 1) + (f"-{i + 1}" if len(docs) > 1 else "")
        path = folder / f"{name}.json"
        atomic_write_json({**doc, "name": name}, path)
        schedule = parse({**doc, "name": name}, source=str(path))
        judged = verdicts.judge(crashed(died_in[i]), policy, declared) if i in died_in else run(schedule)
        command = (f"kvparity replay {path} --level {LEVEL} --impl {implementation.spec}"
                   + (f" --member-timeout {timeout:g}" if i in died_in and timeout != MEMBER_TIMEOUT_S else ""))
        record["failures"].append({"schedule": name, "file": str(path), "verdict": judged.verdict,
                                   "replay": command})
        judged_runs.append(judged)
    return [judged for judged in judged_runs if judged.verdict in FAILURES]


def gaps_of(record) -> list:
    """What the budget should have shown and did not: a budget that compared
    nothing, and failures that did not fail again when replayed."""
    gaps = []
    if not record["rows_passed"] and not record["failures"]:
        gaps.append(f"the generated budget compared nothing ({record['schedules']} generated {record['level']} "
                    "schedules, no row passed)")
    again = [f["schedule"] for f in record["failures"] if f["verdict"] not in FAILURES]
    if again:
        gaps.append(f"generated failures that did not fail when replayed (the implementation is not "
                    f"deterministic): {', '.join(again)}")
    return gaps


def line(record) -> str:
    """The budget in one line, for the console."""
    if record is None:
        return ""
    failures = len(record["failures"])
    said = (f"generated ({record['level']}, seed {record['seed']}): {record['schedules']} schedules ran in "
            f"{record['seconds']:g} s, {record['rows_passed']} rows passed, reached {record['cells']['reached']} "
            f"of {record['cells']['requirements']} requirements of the coverage model (schedules' sha256 "
            f"{record['digest'][:12]}); "
            f"{failures} failure{'s' * (failures != 1)}")
    for failure in record["failures"]:
        said += f"\n  {failure['schedule']}: {failure['verdict']}; replay with: {failure['replay']}"
    for lost in record["lost"]:
        said += f"\n  {lost}"
    return said

"""``kvparity coverage``: the coverage model against a set of schedules
(the catalog by default), from their dry runs: how many of its paths x
settings requirements they reach, and each value cell (a member's integers
at an edge) with whether mlx-lm's engine makes that call and which
schedules reach it. Nothing runs on a cache."""

import json
from pathlib import Path

from tabulate import tabulate

from kvparity.reports.commands.base import UsageError
from kvparity.reports.verdicts import EXIT_CANNOT_JUDGE, EXIT_OK
from kvparity.suites.search import coverage
from kvparity.suites.format.levels import L1
from kvparity.suites.format.schedule import CATALOG, catalog_paths
from kvparity.suites.core.loading import load

NAME = "coverage"
HELP = "which cells of the coverage model the catalog (or your schedules) reaches: paths x settings and boundary values"
DESCRIPTION = ("Walk the dry run of every L1 schedule (the catalog, or the files and folders given) and say which "
               "requirements of the coverage model it reaches: every path at every setting, and the value cells, the "
               "integers each member is handed at its edges (paddings of 0, 1 and more, shared shifts, trim and "
               "rollback amounts up to a row's whole length, sides of rows holding no tokens, lengths around "
               "quantized_kv_start and the 256-token step, what trim, nbytes and size() give on a batch of one row "
               "or of no tokens). Each value cell says whether mlx-lm's own engine makes that call or only the "
               "protocol allows it. Exit 0 when every cell is reached, 125 naming each cell that is not.")
MAX_NAMED = 3  # schedules named per cell in the table


def arguments(command):
    command.add_argument("paths", nargs="*", metavar="PATH",
                         help="schedule files or folders of them (default: the catalog)")
    command.add_argument("--json", action="store_true", help="one JSON document instead of tables")


def schedule_files(paths) -> list:
    files = []
    for given in paths or [CATALOG]:
        path = Path(given)
        if path.is_dir():
            files += catalog_paths(folder=path)
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"{given}: no such schedule file or folder")
    return files


def record(files) -> dict:
    """The model against the L1 schedules among ``files``."""
    schedules = [s for s in (load(f) for f in files) if L1 in s.levels]
    if not schedules:
        raise UsageError("no L1 schedule among the schedules given: the coverage model is judged at L1")
    reaching = {name: [] for name in coverage.VALUES}
    for schedule in schedules:
        for name in coverage.values_of(schedule):
            reaching[name].append(schedule.name)
    judged = coverage.judged(schedules)
    return {
        "schedules": len(schedules),
        **judged,
        "values": [{"cell": name, "member": value.member, "value": value.value, "by": value.by, "why": value.why,
                    "needs": value.needs or None, "reached_by": reaching[name]}
                   for name, value in coverage.VALUES.items()],
    }


def handle(args, settings):
    found = record(schedule_files(args.paths))
    if args.json:
        print(json.dumps(found, indent=1))
    else:
        rows = [(v["cell"], v["value"], v["by"], len(v["reached_by"]),
                 ", ".join(v["reached_by"][:MAX_NAMED]) + (", ..." if len(v["reached_by"]) > MAX_NAMED else ""))
                for v in found["values"]]
        print(tabulate(rows, ("value cell", "value", "mlx-lm's engine", "schedules", "reached by"),
                       tablefmt="simple", maxcolwidths=[None, 48, None, None, 60]))
        print(f"\ncoverage model (L1): {found['reached']} of {found['requirements']} requirements reached by "
              f"{found['schedules']} L1 schedules ({len(coverage.VALUES)} value cells; \"protocol only\": mlx-lm's "
              "engine never makes that call)")
        for name in found["missing"]:
            print(f"not reached: {name}")
    return EXIT_CANNOT_JUDGE if found["missing"] else EXIT_OK

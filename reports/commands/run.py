"""``kvparity run``: the catalog (or given schedules), a summary and a report directory."""

import sys

from kvparity.reports.bench import BenchmarkFailed
from kvparity.reports.commands.base import RUN_SETTINGS, common_options, expectations_option, writable_directory
from kvparity.reports.commands.bench import benchmarks
from kvparity.reports.commands.runs import (
    print_summary, require_levels_option, select_and_run, shard_of, shard_option, write_run_report,
)
from kvparity.reports.verdicts import EXIT_BROKEN

NAME = "run"
HELP = "run the schedule catalog and write a report"
DESCRIPTION = ("Run the schedule catalog (L1 cache bytes and L2 per-row model parity) against an implementation, "
               "print a summary and write a report directory.")

# The settings it reads (reports/settings.py): the command line, else [tool.kvparity], else the default.
SETTINGS = RUN_SETTINGS
REQUIRED = ("impl",)


def arguments(command):
    common_options(command)
    command.add_argument("--schedule", metavar="FILE", action="append",
                         help="run this schedule file instead of the catalog (repeatable)")
    command.add_argument("--out", metavar="DIR", default="reports/out",
                         help="where report directories go (default: %(default)s)")
    command.add_argument("--no-report", action="store_true", help="print the summary only")
    expectations_option(command)
    require_levels_option(command)
    command.add_argument("--bench", action="store_true",
                         help="also run the benchmarks into the report directory (minutes)")
    command.add_argument("--quick", action="store_true", help="with --bench: the short benchmark grid")
    shard_option(command)


def handle(args):
    shard = shard_of(args, writes_report=not args.no_report)
    if not args.no_report:
        writable_directory(args.out, "--out")
    implementation, policy, results, verdict, expectations, plan = select_and_run(args, args.schedule, shard)
    print_summary(results, verdict, policy)
    status = verdict.exit_status
    if args.no_report:
        return status
    failed = []

    def bench(directory):  # a failing suite keeps the report (the parity verdict stands) but fails the run
        try:
            failed.append(benchmarks(directory, args.quick, args.impl))
        except BenchmarkFailed as error:
            failed.append(str(error))
    path = write_run_report(args, implementation, policy, results, verdict, expectations, shard=plan,
                            extra=bench if args.bench else None)
    print(f"report: {path}")
    if any(failed):
        print(f"kvparity: {failed[0]}; its results are in {path}", file=sys.stderr)
        status = status or EXIT_BROKEN
    return status

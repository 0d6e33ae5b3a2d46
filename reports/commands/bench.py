"""``kvparity bench``: the benchmark suite into a new report directory, and its ratios."""

import sys

from tabulate import tabulate

from kvparity.oracle.atomic import OUTPUT_ROOT
from kvparity.reports import bench
from kvparity.reports.commands.base import (
    IMPL_HELP, check_impl_spec, implementation, print_configuration, writable_directory,
)
from kvparity.reports.verdicts import EXIT_BROKEN, EXIT_OK
from kvparity.reports.writer import ReportDirectory

NAME = "bench"
HELP = "run the benchmarks and write their ratios to a report directory"
DESCRIPTION = ("Run the pytest-benchmark suite (join, leave, decode throughput, memory, the harness itself) and "
               "write benchmark.json and a table of ratios measured in one run into a new report directory.")

# The settings it reads (reports/settings.py): the command line, else [tool.kvparity], else the default.
SETTINGS = ("impl",)
REQUIRED = ("impl",)


def arguments(command):
    command.add_argument("--impl", metavar="MODULE:FACTORY", help=IMPL_HELP)
    command.add_argument("--quick", action="store_true", help="the short grid CI runs")
    command.add_argument("--out", metavar="DIR", default=str(OUTPUT_ROOT),
                         help="where report directories go (default: %(default)s)")


def benchmarks(directory, quick, impl):
    """Run the suite into ``directory`` and print its ratios. Returns why the
    suite failed, or None; a suite that measured nothing raises."""
    try:
        bench.run_benchmarks(directory, quick, impl)
    except bench.BenchmarkFailed as error:
        if not error.measured:
            raise
        return str(error)
    finally:
        json_path = directory / "benchmark.json"
        if json_path.exists():
            headers, rows = bench.ratio_table(json_path)
            print(tabulate(rows, headers, tablefmt="simple"))
    return None


def handle(args, settings):
    check_impl_spec(settings.impl)
    writable_directory(settings.out, "--out")
    implementation(settings.impl)  # refuse an unusable one before minutes of benchmarks
    print_configuration(settings)
    report = ReportDirectory(settings.out)
    try:
        with report as directory:
            failed = benchmarks(directory, args.quick, settings.impl)
    except bench.BenchmarkFailed as error:  # nothing measured: no directory is left behind
        print(f"kvparity: {error}", file=sys.stderr)
        return EXIT_BROKEN
    # Only the final path is printed: the staging directory is gone by now.
    if failed:
        print(f"kvparity: {failed}; what it measured is in {report.path}", file=sys.stderr)
        return EXIT_BROKEN
    print(f"benchmarks: {report.path}")
    return EXIT_OK

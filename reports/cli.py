"""The kvparity command line.

Exit status: 0 parity holds, 1 parity broken, 2 bad usage or bad input,
125 cannot run here (implementation, model or backend unavailable), so that
``git bisect run kvparity ...`` skips commits it cannot judge.
"""

import argparse
import sys
from pathlib import Path

from tabulate import tabulate

EXIT_OK, EXIT_BROKEN, EXIT_USAGE, EXIT_CANNOT_RUN = 0, 1, 2, 125


class CannotRun(Exception):
    """Raised for exit 125: nothing is wrong with parity, it cannot be judged here."""


def _implementation(spec):
    from kvparity.impl.adapter import ImplementationError, load_implementation

    try:
        return load_implementation(spec)
    except ImplementationError as error:
        raise CannotRun(str(error))


def _schedules(paths, level):
    from kvparity.suites.schedule import catalog_paths, load

    return [load(p) for p in (paths or catalog_paths(level))]


class Progress:
    """One line that rewrites itself on a terminal; silent elsewhere."""

    def __init__(self, total, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.live = self.stream.isatty()

    def advance(self, label):
        self.done += 1
        if self.live:
            width = 30
            filled = width * self.done // max(self.total, 1)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label[:40]:40s}")
            self.stream.flush()

    def close(self):
        if self.live:
            self.stream.write("\r" + " " * 90 + "\r")
            self.stream.flush()


def run_l1_schedules(schedules, implementation, progress=None):
    from kvparity.suites.l1 import run_l1

    results = []
    for schedule in schedules:
        results.append(run_l1(schedule, implementation))
        if progress:
            progress.advance(schedule.name)
    return results


def _print_summary(results, out=None):
    from kvparity.reports.results import FAIL, NOT_SUPPORTED, PASS
    from kvparity.reports.writer import summary_rows

    out = out or sys.stdout
    headers, rows = summary_rows(results)
    print(tabulate(rows, headers, tablefmt="simple"), file=out)
    counts = {v: sum(r.verdict == v for r in results) for v in (PASS, FAIL, NOT_SUPPORTED)}
    print(
        f"\n{counts[PASS]} passed, {counts[FAIL]} failed, "
        f"{counts[NOT_SUPPORTED]} not supported ({len(results)} schedules)",
        file=out,
    )
    return counts[FAIL] == 0


def cmd_run(args):
    from kvparity.reports.environment import describe
    from kvparity.reports.writer import write_report

    implementation = _implementation(args.impl)
    schedules = _schedules(args.schedule, "L1")
    progress = Progress(len(schedules))
    results = run_l1_schedules(schedules, implementation, progress)
    progress.close()
    ok = _print_summary(results)
    if not args.no_report:
        path = write_report(results, describe(implementation), args.out)
        print(f"report: {path}")
    return EXIT_OK if ok else EXIT_BROKEN


def cmd_replay(args):
    from kvparity.suites.verdicts import describe_failure

    implementation = _implementation(args.impl)
    schedules = _schedules([args.file], "L1")
    results = run_l1_schedules(schedules, implementation)
    ok = _print_summary(results)
    for result in results:
        if result.divergences or result.reason:
            print("\n" + describe_failure(result))
    return EXIT_OK if ok else EXIT_BROKEN


def build_parser():
    parser = argparse.ArgumentParser(
        prog="kvparity",
        description="Parity harness for batched, affine-quantized KV caches on MLX: "
        "every row of a batch must match the same request run alone through mlx-lm, byte for byte.",
        epilog="Exit status: 0 parity holds, 1 parity broken, 2 usage error, 125 cannot run here.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    impl_help = "implementation under test as package.module:factory (default: the reference)"

    run = sub.add_parser("run", help="run the schedule catalog and write a report",
                         description="Run the L1 schedule catalog against an implementation, "
                         "print a summary and write a report directory.")
    run.add_argument("--impl", metavar="MODULE:FACTORY", help=impl_help)
    run.add_argument("--schedule", metavar="FILE", action="append",
                     help="run this schedule file instead of the catalog (repeatable)")
    run.add_argument("--out", metavar="DIR", default="reports/out",
                     help="where report directories go (default: %(default)s)")
    run.add_argument("--no-report", action="store_true", help="print the summary only")
    run.set_defaults(func=cmd_run)

    replay = sub.add_parser("replay", help="replay one schedule file and show each row's first divergence",
                            description="Replay one schedule file row by row.")
    replay.add_argument("file", metavar="FILE", help="schedule file (JSON)")
    replay.add_argument("--impl", metavar="MODULE:FACTORY", help=impl_help)
    replay.set_defaults(func=cmd_replay)
    return parser


def main(argv=None) -> int:
    from kvparity.suites.schedule import ScheduleError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CannotRun as error:
        print(f"kvparity: cannot run here: {error}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except ScheduleError as error:
        print(f"kvparity: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvparity: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

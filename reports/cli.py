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


def _use_device(name):
    import mlx.core as mx

    if name is None:
        return
    device = {"cpu": mx.cpu, "gpu": mx.gpu}[name]
    if not mx.is_available(device):
        raise CannotRun(f"--device {name}: this MLX build has no {name} backend")
    mx.set_default_device(device)


def run_schedules(runs, progress=None):
    """``runs`` is a list of (schedule, callable returning its result)."""
    from kvparity.oracle.models import ModelUnavailable

    results = []
    for schedule, run in runs:
        try:
            results.append(run())
        except ModelUnavailable as error:
            raise CannotRun(str(error))
        if progress:
            progress.advance(f"{results[-1].level} {schedule.name}")
    return results


def plan(args, implementation, files=None):
    """The (schedule, run) pairs a command asks for, validated up front."""
    from kvparity.suites.l1 import run_l1
    from kvparity.suites.l2 import run_l2
    from kvparity.suites.schedule import CATALOG, REAL_CATALOG, catalog_paths, load

    levels = ("L1", "L2") if args.level == "all" else (args.level,)
    runs = []
    if "L1" in levels:
        for schedule in [load(p) for p in (files or catalog_paths("L1"))]:
            if "L1" in schedule.levels:
                runs.append((schedule, lambda s=schedule: run_l1(s, implementation)))
    if "L2" in levels:
        folder = REAL_CATALOG if args.model == "smollm2" else CATALOG
        forced = args.model if args.model != "smollm2" else None
        for schedule in [load(p) for p in (files or catalog_paths("L2", folder))]:
            if "L2" in schedule.levels:
                runs.append((schedule, lambda s=schedule: run_l2(s, implementation, forced)))
    return runs


def _print_summary(results, out=None):
    from kvparity.reports.results import FAIL, NOT_SUPPORTED, PASS, SKIPPED
    from kvparity.reports.writer import summary_rows

    out = out or sys.stdout
    headers, rows = summary_rows(results)
    print(tabulate(rows, headers, tablefmt="simple"), file=out)
    counts = {v: sum(r.verdict == v for r in results) for v in (PASS, FAIL, NOT_SUPPORTED, SKIPPED)}
    print(
        f"\n{counts[PASS]} passed, {counts[FAIL]} failed, {counts[NOT_SUPPORTED]} not supported, "
        f"{counts[SKIPPED]} skipped ({len(results)} schedule runs)",
        file=out,
    )
    return counts[FAIL] == 0


def cmd_run(args):
    from kvparity.reports.environment import describe
    from kvparity.reports.writer import write_report

    _use_device(args.device)
    implementation = _implementation(args.impl)
    runs = plan(args, implementation, args.schedule)
    progress = Progress(len(runs))
    results = run_schedules(runs, progress)
    progress.close()
    ok = _print_summary(results)
    if not args.no_report:
        path = write_report(results, describe(implementation), args.out)
        print(f"report: {path}")
    return EXIT_OK if ok else EXIT_BROKEN


def cmd_replay(args):
    from kvparity.suites.verdicts import describe_failure

    _use_device(args.device)
    implementation = _implementation(args.impl)
    results = run_schedules(plan(args, implementation, [args.file]))
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

    def common(command):
        command.add_argument("--impl", metavar="MODULE:FACTORY", help=impl_help)
        command.add_argument("--level", choices=("L1", "L2", "all"), default="all",
                             help="L1 cache bytes, L2 model per row, or both (default: %(default)s)")
        command.add_argument("--model", metavar="NAME",
                             help="run L2 on this model (smollm2: the real-model schedules); "
                             "default: each schedule's own, a seeded random model")
        command.add_argument("--device", choices=("cpu", "gpu"), help="MLX device (default: MLX's default)")

    run = sub.add_parser("run", help="run the schedule catalog and write a report",
                         description="Run the schedule catalog (L1 cache bytes and L2 per-row model "
                         "parity) against an implementation, print a summary and write a report directory.")
    common(run)
    run.add_argument("--schedule", metavar="FILE", action="append",
                     help="run this schedule file instead of the catalog (repeatable)")
    run.add_argument("--out", metavar="DIR", default="reports/out",
                     help="where report directories go (default: %(default)s)")
    run.add_argument("--no-report", action="store_true", help="print the summary only")
    run.set_defaults(func=cmd_run)

    replay = sub.add_parser("replay", help="replay one schedule file and show each row's first divergence",
                            description="Replay one schedule file row by row.")
    replay.add_argument("file", metavar="FILE", help="schedule file (JSON)")
    common(replay)
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

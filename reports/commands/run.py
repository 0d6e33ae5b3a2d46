"""``kvparity run``: the catalog (or given schedules), a summary and a report directory."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvparity.oracle.atomic import OUTPUT_ROOT
from kvparity.reports.bench import BenchmarkFailed
from kvparity.reports.settings import Settings
from kvparity.reports.commands import merge
from kvparity.reports.commands.base import (
    GATE_SETTINGS, CannotRun, DeviceUntrusted, UsageError, common_options, expectations_option, writable_directory,
)
from kvparity.reports.commands.bench import benchmarks
from kvparity.reports.commands.generated import generated_options
from kvparity.reports.commands.runs import (
    member_timeout_option, print_summary, report_written, require_levels_option, select_and_run, shard_of,
    shard_option, write_run_report, write_untrusted_report,
)
from kvparity.reports.verdicts import EXIT_BROKEN, EXIT_USAGE
from kvparity.suites.core.flight import STATE_ENV
from kvparity.suites.core.processes import STOP_GRACE_S, become_subreaper, die_with_parent, sweep

NAME = "run"
HELP = "run the schedule catalog and write a report"
DESCRIPTION = ("Run the schedule catalog (L1 cache bytes and L2 per-row model parity) against an implementation, "
               "print a summary and write a report directory.")

# The settings it reads (reports/settings.py): the command line, else [tool.kvparity], else the default.
SETTINGS = GATE_SETTINGS
REQUIRED = ("impl",)


def arguments(command):
    common_options(command)
    command.add_argument("--schedule", metavar="FILE", action="append",
                         help="run this schedule file instead of the catalog (repeatable)")
    command.add_argument("--out", metavar="DIR", default=str(OUTPUT_ROOT),
                         help="where report directories go (default: %(default)s)")
    command.add_argument("--no-report", action="store_true", help="print the summary only")
    expectations_option(command)
    require_levels_option(command)
    member_timeout_option(command)
    generated_options(command)
    command.add_argument("--bench", action="store_true",
                         help="also run the benchmarks into the report directory (minutes)")
    command.add_argument("--quick", action="store_true", help="with --bench: the short benchmark grid")
    shard_option(command)
    command.add_argument("--workers", type=int, default=1, metavar="N",
                         help="run the plan on N worker processes (N shards of it, merged into one report as "
                         "kvparity merge merges them; default: %(default)s)")


# What a worker is not given of the run's own command line: it runs a shard into a folder of its own.
NOT_FORWARDED = {"--workers": 1, "--out": 1, "--shard": 1, "--no-report": 0, "--bench": 0, "--quick": 0}


def forwarded(argv):
    """``argv`` without the options a worker does not take (``--out DIR`` and ``--out=DIR`` alike)."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in NOT_FORWARDED:
            skip = NOT_FORWARDED[name] if "=" not in arg else 0
            continue
        out.append(arg)
    return out


def in_workers(settings: Settings, count: int) -> int:
    """The run on ``count`` worker processes, each a shard of the plan run
    as the kvparity executable runs it (isolated: a crash or a hang is its
    run's FAIL), then their reports merged into one under ``settings.out``. A
    signal stops the workers, and what they finished is merged, marked
    interrupted."""
    given = list(settings.argv)
    argv = forwarded(given[1:] if given[:1] == ["run"] else given)
    become_subreaper()  # what a killed worker leaves is re-parented here and swept
    environment = {k: v for k, v in os.environ.items() if k != STATE_ENV}  # each worker isolates its own runs
    with tempfile.TemporaryDirectory(prefix="kvparity-workers-") as folder:
        workers, interrupted = [], False
        try:
            for k in range(1, count + 1):
                log = open(Path(folder) / f"worker-{k}.log", "w")
                command = [sys.executable, "-m", "kvparity.reports.cli", "run", *argv, "--shard",
                           f"{k}/{count}", "--out", str(Path(folder) / f"shard-{k}")]
                workers.append((k, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment,
                                                    preexec_fn=die_with_parent), log))
            for k, worker, log in workers:
                worker.wait()
        except KeyboardInterrupt:  # each worker reports what it finished, or is killed
            interrupted = True
            stop_workers([worker for _, worker, _ in workers])
        finally:
            for _, _, log in workers:
                log.close()
        shards_run = [str(Path(folder) / f"shard-{k}") for k in range(1, count + 1)]
        if interrupted:
            shards_run = [d for d in shards_run if list(Path(d).glob("*/report.json"))]
            if not shards_run:
                raise KeyboardInterrupt
        else:
            broken = [(k, w.returncode) for k, w, _ in workers if w.returncode not in (0, 1, 125)]
            if broken:
                k, status = broken[0]
                tail = (Path(folder) / f"worker-{k}.log").read_text().splitlines()[-12:]
                why = (f"worker {k} of {count} ended with exit status {status}; its last lines:\n"
                       + "\n".join(tail))
                raise UsageError(why) if status == EXIT_USAGE else CannotRun(why)
        return merge.merge(shards_run, settings.out, settings.required_levels)


def stop_workers(workers):
    """SIGTERM each worker (it hands the signal on to its child, which
    reports what it finished); whatever is left a grace later is killed."""
    for worker in workers:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S + 1.0  # the workers' own grace, then theirs to end
    for worker in workers:
        try:
            worker.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            pass
    sweep()


def handle(args, settings: Settings):
    started = time.perf_counter()
    try:
        if args.workers < 1:
            raise UsageError(f"--workers {args.workers}: expected 1 or more")
        if args.workers > 1:
            if args.no_report or args.shard or args.bench:
                raise UsageError("--workers: each worker writes a shard's report that the run merges into --out "
                                 "(not with --no-report, --shard or --bench)")
            writable_directory(settings.out, "--out")
            return in_workers(settings, args.workers)
        return run(settings, args.schedule, writes_report=not args.no_report, bench=args.bench, quick=args.quick)
    finally:
        print(f"wall time: {time.perf_counter() - started:.1f} s on {args.workers} worker process"
              f"{'es' if args.workers > 1 else ''}")


def run(settings: Settings, files, writes_report: bool, bench: bool, quick: bool) -> int:
    """The run in this process: ``files`` (None: the catalog), a summary, and a report directory
    unless not ``writes_report`` (with ``bench``, the benchmarks in it too, ``quick`` their short grid)."""
    shard = shard_of(settings, writes_report=writes_report)
    if writes_report:
        writable_directory(settings.out, "--out")
    try:
        implementation, policy, results, verdict, expectations, plan = select_and_run(settings, files, shard)
    except DeviceUntrusted as untrusted:
        if writes_report:
            report_written(lambda: write_untrusted_report(settings, untrusted))
        raise
    print_summary(results, verdict, policy)
    status = verdict.exit_status
    if not writes_report:
        return status
    failed = []

    def measured(directory):  # a failing suite keeps the report (the parity verdict stands) but fails the run
        try:
            failed.append(benchmarks(directory, quick, settings.impl))
        except BenchmarkFailed as error:
            failed.append(str(error))
    path = report_written(lambda: write_run_report(settings, implementation, policy, results, verdict, expectations,
                                                   shard=plan, extra=measured if bench else None))
    if any(failed):
        print(f"kvparity: {failed[0]}" + (f"; its results are in {path}" if path else ""), file=sys.stderr)
        status = status or EXIT_BROKEN
    return status

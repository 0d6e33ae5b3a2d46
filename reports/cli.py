"""The kvparity command line.

Exit status: 0 parity holds, 1 parity broken, 2 bad usage or bad input,
125 cannot run here (implementation, model or backend unavailable), so that
``git bisect run kvparity ...`` skips commits it cannot judge.
"""

import argparse
import os
import sys

from tabulate import tabulate

EXIT_OK, EXIT_BROKEN, EXIT_USAGE, EXIT_CANNOT_RUN = 0, 1, 2, 125

EXAMPLES = """examples:
  kvparity run                                   the catalog against the reference cache
  kvparity run --impl myserver.cache:BatchCache  ... against your implementation
  kvparity run --model smollm2                   L2 on the real SmolLM2-135M
  kvparity replay found.json --level L1          one schedule, row by row
  git bisect run kvparity check --impl myserver.cache:BatchCache
                                                 find the commit that broke parity

exit status: 0 parity holds, 1 parity broken, 2 usage error, 125 cannot run here
"""


class CannotRun(Exception):
    """Raised for exit 125: nothing is wrong with parity, it cannot be judged here."""


def _implementation(spec):
    from kvparity.impl.adapter import ImplementationError, load_implementation

    # The repository under test is the working directory (as under git bisect run).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return load_implementation(spec)
    except ImplementationError as error:
        raise CannotRun(str(error))


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
    policy = _policy(args)
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
                runs.append((schedule, lambda s=schedule: run_l2(s, implementation, forced, policy=policy)))
    return runs


def _print_summary(results, out=None, quiet=False):
    from kvparity.reports.results import FAIL, NOT_SUPPORTED, PASS, SKIPPED
    from kvparity.reports.writer import summary_rows

    out = out or sys.stdout
    headers, rows = summary_rows(results)
    if quiet:  # only what failed
        rows = [row for row, r in zip(rows, results) if r.verdict == FAIL]
    if rows:
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
        model = _probe_model(args)
        bench = None
        if args.bench:
            bench = lambda directory: _benchmarks(directory, args.quick, args.impl)
        path = write_report(
            results, describe(implementation, model), args.out, policy=_policy(args),
            probes=_probes(model, args.device), capabilities=implementation.capabilities, extra=bench,
        )
        print(f"report: {path}")
    return EXIT_OK if ok else EXIT_BROKEN


def _probe_model(args):
    from kvparity.oracle.models import DEFAULT_MODEL, load_model

    return load_model(args.model or DEFAULT_MODEL)


def _probes(model, device, batch_sizes=(1, 2, 4, 8, 16), kv_bits=4, kv_group_size=64):
    """L0 for the model's shapes: explains L2 outcomes in the report."""
    from kvparity.oracle.probes import ProbeShapes, ProbeUnavailable, run_probes

    shapes = ProbeShapes.from_args(
        hidden_size=model.hidden_size, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads,
        head_dim=model.head_dim, vocab_size=model.vocab_size, dtype=model.dtype,
        kv_bits=kv_bits, kv_group_size=kv_group_size,
    )
    try:
        return run_probes(shapes, batch_sizes=batch_sizes, device=device)
    except ProbeUnavailable as error:
        raise CannotRun(str(error))


def _policy(args):
    from kvparity.reports.policy import PolicyError, load_policy

    try:
        return load_policy(getattr(args, "policy", None))
    except PolicyError as error:
        raise UsageError(str(error))


class UsageError(Exception):
    """Exit 2: the command line or an input file is wrong."""


def cmd_check(args):
    """Like run, for scripts and git bisect: the summary and an exit status."""
    _use_device(args.device)
    implementation = _implementation(args.impl)
    results = run_schedules(plan(args, implementation, args.schedule))
    return EXIT_OK if _print_summary(results, quiet=True) else EXIT_BROKEN


def cmd_probe(args):
    from kvparity.oracle.models import ModelUnavailable
    from kvparity.oracle.probes import probe_table

    try:
        model = _probe_model(args)
    except ModelUnavailable as error:
        raise CannotRun(str(error))
    results = _probes(model, args.device, args.batch_sizes, args.kv_bits, args.kv_group_size)
    headers, rows = probe_table(results)
    print(f"L0 batch invariance on {model.name} shapes, {args.device or 'default device'}: "
          "is row i of a batch byte-identical to the op run on row i alone?")
    print(tabulate(rows, headers, tablefmt="simple"))
    return EXIT_OK


def cmd_record(args):
    from kvparity.oracle.golden import GoldenError, write_golden
    from kvparity.oracle.models import load_model
    from kvparity.oracle.solo import run_solo
    from kvparity.suites.l2 import fit_to_model, model_for, run_l2

    _use_device(args.device)
    implementation = _implementation(args.impl) if args.engine else None
    args.level = "L2"
    recorded, schedules, model = {}, [], None
    for schedule, _ in plan(args, _implementation(None), args.schedule):
        model = load_model(model_for(schedule, args.model if args.model != "smollm2" else None))
        schedule, unfit = fit_to_model(schedule, model)
        if unfit or (implementation and any(not implementation.supports(c) for c in schedule.needs)):
            continue
        if args.engine:
            capture = {}
            run_l2(schedule, implementation, model.name, capture=capture)
            recorded[schedule.name] = capture
        else:
            recorded[schedule.name] = {
                rid: run_solo(model.model, schedule, rid, model.vocab_size, model.tokenizer)
                for rid in schedule.requests
            }
        schedules.append(schedule)
    source = f"engine:{implementation.spec}" if args.engine else "oracle"
    try:
        path = write_golden(args.out, source, model, recorded, schedules)
    except GoldenError as error:
        raise UsageError(str(error))
    print(f"recorded {len(recorded)} schedules ({source}) in {path}")
    return EXIT_OK


def missing(name, traces, source):
    from kvparity.reports.results import SKIPPED, RowResult, ScheduleResult

    rows = [RowResult(rid, SKIPPED) for rid in traces]
    return ScheduleResult(name, "L2", source, 0, rows, SKIPPED, "the candidate has no trace of this schedule")


def cmd_compare(args):
    from kvparity.oracle.golden import GoldenError, check_same_machine, load_traces, read_golden
    from kvparity.suites.l2 import compare_traces

    try:
        golden, candidate = read_golden(args.golden), read_golden(args.candidate)
        check_same_machine(golden, candidate)
        golden_traces = load_traces(args.golden, golden)
        candidate_traces = load_traces(args.candidate, candidate)
    except GoldenError as error:
        raise CannotRun(str(error)) if "refusing" in str(error) else UsageError(str(error))
    policy = _policy(args)
    results = [
        compare_traces(name, traces, candidate_traces[name], candidate["source"], policy)
        if name in candidate_traces else missing(name, traces, candidate["source"])
        for name, traces in golden_traces.items()
    ]
    return EXIT_OK if _print_summary(results) else EXIT_BROKEN


def cmd_bisect(args):
    from kvparity.suites.bisect import Shrinker, event_index
    from kvparity.suites.l1 import run_l1
    from kvparity.suites.l2 import run_l2
    from kvparity.suites.schedule import load, save

    _use_device(args.device)
    implementation = _implementation(args.impl)
    schedule = load(args.schedule)
    policy = _policy(args)
    if args.level == "L2":
        run = lambda s: run_l2(s, implementation, args.model, use_cache=False, policy=policy)
    else:
        run = lambda s: run_l1(s, implementation)
    shrinker = Shrinker(run, schedule)
    if shrinker.first is None:
        print(f"{schedule.name}: parity holds at {args.level}; nothing to bisect")
        return EXIT_OK
    first = shrinker.first
    print(f"first event after which parity breaks: {schedule.events[event_index(first)].describe()}")
    print(f"  {first.message()}")
    doc = shrinker.shrink(schedule)
    from kvparity.suites.schedule import parse

    minimal = parse(doc, source=args.schedule)
    out = args.out or f"reports/out/bisect/{minimal.name}.json"
    save(minimal, out)
    print(f"shrunk to {len(minimal.events)} of {len(schedule.events)} events and "
          f"{len(minimal.requests)} of {len(schedule.requests)} requests in {shrinker.tries} tries")
    replay = f"kvparity replay {out} --level {args.level}" + (f" --impl {args.impl}" if args.impl else "")
    print(f"written to {out}; replay with: {replay}")
    return EXIT_BROKEN


def _benchmarks(directory, quick, impl):
    from kvparity.reports.bench import ratio_table, run_benchmarks

    try:
        run_benchmarks(directory, quick, impl)
    except RuntimeError as error:
        print(f"kvparity: {error}", file=sys.stderr)
    headers, rows = ratio_table(directory / "benchmark.json")
    print(tabulate(rows, headers, tablefmt="simple"))


def cmd_bench(args):
    from kvparity.reports.writer import ReportDirectory

    _implementation(args.impl)  # refuse an unusable one before minutes of benchmarks
    report = ReportDirectory(args.out)
    with report as directory:
        _benchmarks(directory, args.quick, args.impl)
    print(f"benchmarks: {report.path}")
    return EXIT_OK


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
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    impl_help = "implementation under test as package.module:factory (default: the reference)"

    def common(command, levels=("L1", "L2", "all"), default_level="all"):
        command.add_argument("--impl", metavar="MODULE:FACTORY", help=impl_help)
        if levels:
            command.add_argument("--level", choices=levels, default=default_level,
                                 help="L1 cache bytes, L2 model per row (default: %(default)s)")
        command.add_argument("--model", metavar="NAME",
                             help="run L2 on this model (smollm2: the real-model schedules); "
                             "default: each schedule's own, a seeded random model")
        command.add_argument("--device", choices=("cpu", "gpu"), help="MLX device (default: MLX's default)")
        command.add_argument("--policy", metavar="NAME|FILE",
                             help="verdict policy: cpu, gpu or a policy file (default: this backend's)")

    run = sub.add_parser("run", help="run the schedule catalog and write a report",
                         description="Run the schedule catalog (L1 cache bytes and L2 per-row model "
                         "parity) against an implementation, print a summary and write a report directory.")
    common(run)
    run.add_argument("--schedule", metavar="FILE", action="append",
                     help="run this schedule file instead of the catalog (repeatable)")
    run.add_argument("--out", metavar="DIR", default="reports/out",
                     help="where report directories go (default: %(default)s)")
    run.add_argument("--no-report", action="store_true", help="print the summary only")
    run.add_argument("--bench", action="store_true",
                     help="also run the benchmarks into the report directory (minutes)")
    run.add_argument("--quick", action="store_true", help="with --bench: the short benchmark grid")
    run.set_defaults(func=cmd_run)

    bench = sub.add_parser("bench", help="run the benchmarks and write their ratios to a report directory",
                           description="Run the pytest-benchmark suite (join, leave, decode throughput, memory, "
                           "the harness itself) and write benchmark.json and a table of ratios measured in one "
                           "run into a new report directory.")
    bench.add_argument("--impl", metavar="MODULE:FACTORY", help=impl_help)
    bench.add_argument("--quick", action="store_true", help="the short grid CI runs")
    bench.add_argument("--out", metavar="DIR", default="reports/out",
                       help="where report directories go (default: %(default)s)")
    bench.set_defaults(func=cmd_bench)

    check = sub.add_parser("check", help="exit 0 if parity holds, 1 if it breaks, 125 if it cannot run (for git bisect run)",
                           description="Run the catalog quietly and answer with the exit status: 0 parity holds, "
                           "1 parity broken, 125 cannot run here. Made for `git bisect run kvparity check ...`.")
    common(check)
    check.add_argument("--schedule", metavar="FILE", action="append", help="check these schedule files only")
    check.set_defaults(func=cmd_check)

    replay = sub.add_parser("replay", help="replay one schedule file and show each row's first divergence",
                            description="Replay one schedule file row by row.")
    replay.add_argument("file", metavar="FILE", help="schedule file (JSON)")
    common(replay)
    replay.set_defaults(func=cmd_replay)

    bisect = sub.add_parser("bisect", help="find the first breaking event of a schedule and shrink it",
                            description="For a failing schedule: find the first event after which parity breaks, "
                            "then shrink the schedule to a minimal one that fails the same way and write it out.")
    bisect.add_argument("schedule", metavar="SCHEDULE", help="the failing schedule file")
    common(bisect, levels=("L1", "L2"), default_level="L1")
    bisect.add_argument("--out", metavar="FILE", help="where the minimal schedule goes "
                        "(default: reports/out/bisect/NAME-min.json)")
    bisect.set_defaults(func=cmd_bisect)

    probe = sub.add_parser("probe", help="L0: which backend ops are batch-invariant for a model's shapes",
                           description="For the model's shapes on the chosen device, check whether each op "
                           "(matmul, quantized_matmul, quantize, fast.rope with per-row offsets, quantized SDPA "
                           "with a left-padding mask) gives row i of a batch byte-identical to row i alone.")
    probe.add_argument("--model", metavar="NAME", help="whose shapes (default: llama-h64-bf16)")
    probe.add_argument("--device", choices=("cpu", "gpu"), help="MLX device (default: MLX's default)")
    probe.add_argument("--batch-sizes", type=lambda t: [int(b) for b in t.split(",")], default=[1, 2, 4, 8, 16],
                       metavar="B,B,...", help="batch sizes (default: 1,2,4,8,16)")
    probe.add_argument("--kv-bits", type=int, default=4, help="KV bits for the quantized ops (default: 4)")
    probe.add_argument("--kv-group-size", type=int, default=64, help="KV group size (default: 64)")
    probe.set_defaults(func=cmd_probe)

    record = sub.add_parser("record", help="record solo (golden) or engine traces of the L2 catalog",
                            description="Write traces (safetensors + JSON manifest with the sha256 of every tensor "
                            "and the environment) of the L2 schedules into a new directory: the oracle's solo runs "
                            "by default, or the engine's batched run with --engine.")
    record.add_argument("out", metavar="DIR", help="new directory for the traces (never overwritten)")
    common(record, levels=None)
    record.add_argument("--engine", action="store_true", help="record the engine's batched run of --impl")
    record.add_argument("--schedule", metavar="FILE", action="append", help="record these schedule files only")
    record.set_defaults(func=cmd_record)

    compare = sub.add_parser("compare", help="compare a candidate trace directory with a golden one",
                             description="Compare two trace directories (from `kvparity record` or any engine "
                             "writing the same format) with the L2 metrics. Traces from another device, backend "
                             "or MLX version are refused.")
    compare.add_argument("golden", metavar="GOLDEN", help="the golden trace directory")
    compare.add_argument("candidate", metavar="CANDIDATE", help="the candidate trace directory")
    compare.add_argument("--policy", metavar="NAME|FILE", help="verdict policy (default: this backend's)")
    compare.set_defaults(func=cmd_compare)
    return parser


def main(argv=None) -> int:
    from kvparity.suites.schedule import ScheduleError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CannotRun as error:
        print(f"kvparity: cannot run here: {error}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except (ScheduleError, UsageError) as error:
        print(f"kvparity: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvparity: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

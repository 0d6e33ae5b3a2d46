"""The kvparity command line.

Exit status, so that ``git bisect run kvparity check ...`` can trust it:
0 parity holds (with evidence), 1 parity broken (a divergence or a refusal),
2 bad usage or bad input (before any work), 125 cannot judge here (the
implementation's module does not import, a backend or model is missing, a
golden comes from another machine, or the run gathered no evidence), and 128
for an error inside the harness itself, which aborts a bisection rather than
blaming a commit.
"""

import argparse
import os
import sys
import tempfile
import traceback
from pathlib import Path

from tabulate import tabulate

from kvparity.reports.verdicts import EXIT_BROKEN, EXIT_CANNOT_JUDGE, EXIT_OK, EXIT_USAGE

EXIT_CANNOT_RUN = EXIT_CANNOT_JUDGE
EXIT_HARNESS_ERROR = 128

EXAMPLES = """examples:
  kvparity run                                   the catalog against the reference cache
  kvparity run --impl myserver.cache:BatchCache  ... against your implementation
  kvparity run --model smollm2                   L2 on the real SmolLM2-135M
  kvparity replay found.json --level L1          one schedule, row by row
  git bisect run kvparity check --impl myserver.cache:BatchCache
                                                 find the commit that broke parity

models: {models}

exit status: 0 parity holds, 1 parity broken, 2 usage error, 125 cannot judge here,
128 the harness itself failed (aborts git bisect run)
"""


class CannotRun(Exception):
    """Exit 125: nothing is wrong with parity, it cannot be judged here."""


class UsageError(Exception):
    """Exit 2: the command line or an input file is wrong."""


def _implementation(spec):
    from kvparity.suites.adapter import ImplementationError, ImplementationUnavailable, load_implementation

    # The repository under test is the working directory (as under git bisect run).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return load_implementation(spec)
    except ImplementationUnavailable as error:
        raise CannotRun(str(error))
    except ImplementationError as error:
        raise UsageError(str(error))


def _check_model_name(name):
    from kvparity.oracle.models import available_models

    if name is not None and name not in available_models():
        raise UsageError(f"--model {name!r}: unknown model (available: {', '.join(available_models())})")


def _load_model(name):
    from kvparity.oracle.models import ModelUnavailable, load_model

    _check_model_name(name)
    try:
        return load_model(name)
    except ModelUnavailable as error:
        raise CannotRun(str(error))


def _writable_directory(path, what):
    """Refuse an --out that cannot be written, before any work."""
    path = Path(path)
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{what} {path}: {existing} is not a directory")
    if existing == path:
        try:
            tempfile.TemporaryFile(dir=path).close()
        except OSError as error:
            raise UsageError(f"{what} {path}: not writable ({error.strerror})")
    elif not os.access(existing, os.W_OK):
        raise UsageError(f"{what} {path}: cannot create it under {existing} (not writable)")


def _new_path(path, what):
    """Refuse an output path that exists or cannot be created, before any work."""
    path = Path(path)
    if path.exists():
        raise UsageError(f"{what} {path}: exists (never overwritten)")
    _writable_directory(path.parent, what)


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


def _policy(args):
    from kvparity.reports.policy import PolicyError, load_policy

    try:
        return load_policy(getattr(args, "policy", None))
    except PolicyError as error:
        raise UsageError(str(error))


def _levels(args):
    return ("L1", "L2") if args.level == "all" else (args.level,)


def plan(args, implementation, files=None):
    """The (label, run) pairs a command asks for, every schedule validated and
    fitted to its model up front. Selecting nothing is a usage error."""
    from kvparity.suites.l1 import run_l1
    from kvparity.suites.l2 import fit_to_model, model_for, run_l2
    from kvparity.suites.schedule import CATALOG, REAL_CATALOG, catalog_paths, load

    _check_model_name(args.model)
    levels = _levels(args)
    runs = []
    if "L1" in levels:
        for schedule in [load(p) for p in (files or catalog_paths("L1"))]:
            if "L1" in schedule.levels:
                runs.append((f"L1 {schedule.name}", lambda s=schedule: run_l1(s, implementation)))
    if "L2" in levels:
        folder = REAL_CATALOG if args.model == "smollm2" else CATALOG
        forced = args.model if args.model != "smollm2" else None
        for schedule in [load(p) for p in (files or catalog_paths("L2", folder))]:
            if "L2" not in schedule.levels:
                continue
            name = model_for(schedule, forced)
            _, unfit = fit_to_model(schedule, _load_model(name))
            if unfit:
                raise UsageError(f"{schedule.path}: cannot run on {name}: {unfit}")
            runs.append((f"L2 {schedule.name}", lambda s=schedule: run_l2(s, implementation, forced)))
    if not runs:
        what = ", ".join(str(f) for f in files) if files else "the catalog"
        raise UsageError(f"--level {args.level}: {what} holds no schedule for {' or '.join(levels)}; "
                         "nothing would be compared")
    return runs


def run_all(runs, policy, progress=None):
    """Run and judge each planned schedule."""
    from kvparity.oracle.models import ModelUnavailable
    from kvparity.reports.verdicts import judge

    results = []
    for label, run in runs:
        try:
            results.append(judge(run(), policy))
        except ModelUnavailable as error:
            raise CannotRun(str(error))
        if progress:
            progress.advance(label)
    return results


def _print_summary(results, verdict, out=None, quiet=False):
    from kvparity.reports.writer import summary_rows
    from kvparity.suites.evidence import PASS

    out = out or sys.stdout
    headers, rows = summary_rows(results)
    if quiet:  # only what did not pass
        rows = [row for row, r in zip(rows, results) if r.verdict != PASS]
    if rows:
        print(tabulate(rows, headers, tablefmt="simple"), file=out)
    print(f"\n{verdict.headline}", file=out)
    for gap in verdict.gaps:
        print(f"no evidence: {gap}", file=out)


def _select_and_run(args, implementation, files):
    from kvparity.reports.verdicts import verdict_of_run

    policy = _policy(args)
    runs = plan(args, implementation, files)
    progress = Progress(len(runs))
    results = run_all(runs, policy, progress)
    progress.close()
    return policy, results, verdict_of_run(results, whole_catalog=not files)


def cmd_run(args):
    from kvparity.reports.environment import describe
    from kvparity.reports.writer import write_report

    _use_device(args.device)
    implementation = _implementation(args.impl)
    if not args.no_report:
        _writable_directory(args.out, "--out")
    policy, results, verdict = _select_and_run(args, implementation, args.schedule)
    _print_summary(results, verdict)
    if not args.no_report:
        model = _load_model(args.model or _default_model())
        bench = None
        if args.bench:
            bench = lambda directory: _benchmarks(directory, args.quick, args.impl)
        path = write_report(
            results, describe(implementation, model), args.out, policy=policy, run_verdict=verdict,
            probes=_probes(model, args.device), capabilities=implementation.capabilities, extra=bench,
        )
        print(f"report: {path}")
    return verdict.exit_status


def _default_model():
    from kvparity.oracle.models import DEFAULT_MODEL

    return DEFAULT_MODEL


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


def cmd_check(args):
    """Like run, for scripts and git bisect: the summary and an exit status."""
    _use_device(args.device)
    implementation = _implementation(args.impl)
    _, results, verdict = _select_and_run(args, implementation, args.schedule)
    _print_summary(results, verdict, quiet=True)
    return verdict.exit_status


def cmd_replay(args):
    from kvparity.reports.verdicts import verdict_of_run

    _use_device(args.device)
    implementation = _implementation(args.impl)
    policy, results, verdict = _select_and_run(args, implementation, [args.file])
    _print_summary(results, verdict)
    for result in results:
        print(f"\n{result.level} {result.schedule}: {result.verdict}" + (f" ({result.reason})" if result.reason else ""))
        for row in result.rows:
            line = f"  row {row.request!r}: {row.verdict}, {row.checks} comparisons"
            if row.divergences:
                line += f", {len(row.divergences)} divergence(s); first:"
            print(line)
            for d in sorted(row.divergences, key=lambda d: d.order)[:5]:
                print(f"    {d.message()}")
    return verdict.exit_status


def cmd_probe(args):
    from kvparity.oracle.probes import probe_table

    _use_device(args.device)
    model = _load_model(args.model or _default_model())
    results = _probes(model, args.device, args.batch_sizes, args.kv_bits, args.kv_group_size)
    headers, rows = probe_table(results)
    print(f"L0 batch invariance on {model.name} shapes, {args.device or 'default device'}: "
          "is row i of a batch byte-identical to the op run on row i alone?")
    print(tabulate(rows, headers, tablefmt="simple"))
    return EXIT_OK


def cmd_record(args):
    from kvparity.oracle.golden import GoldenError, write_golden
    from kvparity.oracle.solo import run_solo
    from kvparity.suites.l2 import fit_to_model, model_for, run_l2
    from kvparity.suites.schedule import CATALOG, REAL_CATALOG, catalog_paths, load

    _use_device(args.device)
    _new_path(args.out, "record")
    implementation = _implementation(args.impl) if args.engine else None
    args.level = "L2"
    _check_model_name(args.model)
    forced = args.model if args.model != "smollm2" else None
    folder = REAL_CATALOG if args.model == "smollm2" else CATALOG
    recorded, schedules, model = {}, [], None
    for path in args.schedule or catalog_paths("L2", folder):
        schedule = load(path)
        if "L2" not in schedule.levels:
            continue
        model = _load_model(model_for(schedule, forced))
        schedule, unfit = fit_to_model(schedule, model)
        if unfit:
            raise UsageError(f"{schedule.path}: cannot run on {model.name}: {unfit}")
        if implementation and any(not implementation.supports(c) for c in schedule.needs):
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
    if not recorded:
        raise UsageError("record: the selection holds no L2 schedule this implementation supports")
    source = f"engine:{implementation.spec}" if args.engine else "oracle"
    try:
        path = write_golden(args.out, source, model, recorded, schedules)
    except GoldenError as error:
        raise UsageError(str(error))
    print(f"recorded {len(recorded)} schedules ({source}) in {path}")
    return EXIT_OK


def cmd_compare(args):
    from kvparity.oracle.golden import GoldenError, check_same_machine, load_traces, read_golden
    from kvparity.reports.verdicts import judge, verdict_of_run
    from kvparity.suites.evidence import ScheduleResult
    from kvparity.suites.l2 import compare_traces

    policy = _policy(args)
    try:
        golden, candidate = read_golden(args.golden), read_golden(args.candidate)
        check_same_machine(golden, candidate)
        golden_traces = load_traces(args.golden, golden)
        candidate_traces = load_traces(args.candidate, candidate)
    except GoldenError as error:
        raise CannotRun(str(error)) if "refusing" in str(error) else UsageError(str(error))
    results = []
    for name, traces in golden_traces.items():
        if name in candidate_traces:
            result = compare_traces(name, traces, candidate_traces[name], candidate["source"])
        else:  # nothing to compare: no evidence, never a pass
            result = ScheduleResult(name, "L2", candidate["source"], ["trace"],
                                    reason="the candidate has no trace of this schedule")
            for rid in traces:
                result.row(rid)
        results.append(judge(result, policy))
    verdict = verdict_of_run(results)
    _print_summary(results, verdict)
    return verdict.exit_status


def cmd_bisect(args):
    from kvparity.reports.verdicts import judge
    from kvparity.suites.l1 import run_l1
    from kvparity.suites.l2 import run_l2
    from kvparity.suites.schedule import load, parse, save
    from kvparity.suites.shrink import Shrinker

    _use_device(args.device)
    implementation = _implementation(args.impl)
    schedule = load(args.schedule)
    policy = _policy(args)
    out = Path(args.out or f"reports/out/bisect/{schedule.name}-min.json")
    if out.exists() and not out.is_file():
        raise UsageError(f"--out {out}: not a file")
    _writable_directory(out.parent, "--out")
    if args.level not in schedule.levels:
        raise UsageError(f"{args.schedule}: not an {args.level} schedule (levels: {', '.join(schedule.levels)})")
    _check_model_name(args.model)
    if args.level == "L2":
        run = lambda s: judge(run_l2(s, implementation, args.model, use_cache=False), policy)
    else:
        run = lambda s: judge(run_l1(s, implementation), policy)
    shrinker = Shrinker(run, schedule)
    if shrinker.first is None:
        print(f"{schedule.name}: {shrinker.original.verdict} at {args.level}; nothing to bisect")
        return EXIT_OK if shrinker.original.verdict == "pass" else EXIT_CANNOT_JUDGE
    first = shrinker.first
    print(f"first event after which parity breaks: {schedule.events[first.event_index].describe()}")
    print(f"  {first.message()}")
    minimal = parse(shrinker.shrink(schedule), source=args.schedule)
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
    finally:
        json_path = directory / "benchmark.json"
        if json_path.exists():
            headers, rows = ratio_table(json_path)
            print(tabulate(rows, headers, tablefmt="simple"))


def cmd_bench(args):
    from kvparity.reports.writer import ReportDirectory

    _implementation(args.impl)  # refuse an unusable one before minutes of benchmarks
    _writable_directory(args.out, "--out")
    report = ReportDirectory(args.out)
    try:
        with report as directory:
            _benchmarks(directory, args.quick, args.impl)
    except RuntimeError as error:  # the suite failed: no report directory is left
        print(f"kvparity: {error}", file=sys.stderr)
        return EXIT_BROKEN
    print(f"benchmarks: {report.path}")
    return EXIT_OK


def build_parser():
    from kvparity.oracle.models import available_models

    parser = argparse.ArgumentParser(
        prog="kvparity",
        description="Parity harness for batched, affine-quantized KV caches on MLX: "
        "every row of a batch must match the same request run alone through mlx-lm, byte for byte.",
        epilog=EXAMPLES.format(models=", ".join(available_models())),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    impl_help = "implementation under test as package.module:factory (default: the reference)"
    model_help = (f"run L2 on this model (one of {', '.join(available_models())}; smollm2 runs the real-model "
                  "schedules); default: each schedule's own, a seeded random model")

    def common(command, levels=("L1", "L2", "all"), default_level="all"):
        command.add_argument("--impl", metavar="MODULE:FACTORY", help=impl_help)
        if levels:
            command.add_argument("--level", choices=levels, default=default_level,
                                 help="L1 cache bytes, L2 model per row (default: %(default)s)")
        command.add_argument("--model", metavar="NAME", help=model_help)
        command.add_argument("--device", choices=("cpu", "gpu"), help="MLX device (default: MLX's default)")
        command.add_argument("--policy", metavar="NAME|FILE",
                             help="verdict policy: cpu, gpu, strict or a policy file (default: this backend's)")

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

    check = sub.add_parser("check", help="exit 0 if parity holds, 1 if it breaks, 125 if it cannot be judged "
                           "(for git bisect run)",
                           description="Run the catalog quietly and answer with the exit status: 0 parity holds, "
                           "1 parity broken, 2 usage error, 125 cannot judge here. Made for "
                           "`git bisect run kvparity check ...`.")
    common(check)
    check.add_argument("--schedule", metavar="FILE", action="append", help="check these schedule files only")
    check.set_defaults(func=cmd_check)

    replay = sub.add_parser("replay", help="replay one schedule file and show each row's first divergences",
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
    probe.add_argument("--model", metavar="NAME", help=f"whose shapes (default: {_default_model()}); {model_help}")
    probe.add_argument("--device", choices=("cpu", "gpu"), help="MLX device (default: MLX's default)")
    probe.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 2, 4, 8, 16],
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


def _batch_sizes(text):
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch sizes like 1,2,8, got {text!r}")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return sizes


def main(argv=None) -> int:
    from kvparity.suites.schedule import ScheduleError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CannotRun as error:
        print(f"kvparity: cannot judge here: {error}", file=sys.stderr)
        return EXIT_CANNOT_JUDGE
    except (ScheduleError, UsageError) as error:
        print(f"kvparity: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvparity: interrupted", file=sys.stderr)
        return 130
    except Exception:  # the harness's own bug: never blame the commit under test
        traceback.print_exc()
        print("kvparity: internal error (a bug in kvparity, not a parity verdict)", file=sys.stderr)
        return EXIT_HARNESS_ERROR


if __name__ == "__main__":
    sys.exit(main())

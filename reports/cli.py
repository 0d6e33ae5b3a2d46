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

# Spelled out here rather than imported so that a harness that cannot even
# import its own modules still exits 128 (see main), not Python's 1, which
# git bisect run would read as "this commit is bad". verdicts.py defines the
# same values; a test holds them equal.
EXIT_OK, EXIT_BROKEN, EXIT_USAGE, EXIT_CANNOT_JUDGE = 0, 1, 2, 125
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


def _check_impl_spec(spec):
    """The shape of --impl, checked before any work (the import is later)."""
    from kvparity.suites.adapter import ImplementationError, split_spec

    if spec is not None:
        try:
            split_spec("--impl", spec)
        except ImplementationError as error:
            raise UsageError(str(error))


def _implementation(spec):
    from kvparity.suites.adapter import ImplementationError, ImplementationUnavailable, load_implementation

    _check_impl_spec(spec)
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


def _writable_directory(path, what, shown=None):
    """Refuse an --out that cannot be written, before any work. Tried, not
    inferred from permission bits (which say nothing for root, or for a
    read-only file system): a directory is made and removed where the output
    would go, or under the nearest folder that exists."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{what} {shown or path}: {existing} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvparity-probe-", dir=existing))
    except OSError as error:
        where = "not writable" if existing == path else f"cannot create it under {existing}"
        raise UsageError(f"{what} {shown or path}: {where} ({error.strerror or error})")


def _new_path(path, what):
    """Refuse an output path that exists or cannot be created, before any work."""
    path = Path(path)
    if path.exists():
        raise UsageError(f"{what} {path}: exists (never overwritten)")
    _writable_directory(path.parent, what, shown=path)


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


def _expectations(args):
    """The --expectations file, checked whole before anything runs; None without one."""
    from kvparity.reports.expectations import ExpectationsError, load_expectations

    path = getattr(args, "expectations", None)
    if path is None:
        return None
    try:
        return load_expectations(path)
    except ExpectationsError as error:
        raise UsageError(str(error))


def _levels(args):
    return ("L1", "L2", "L3") if args.level == "all" else (args.level,)


def _load_schedule(path):
    """A schedule file of either kind: events (L1, L2) or arrivals (L3)."""
    from kvparity.suites import arrivals
    from kvparity.suites.schedule import parse, read_document

    doc = read_document(path)
    kind = doc.get("kind") if isinstance(doc, dict) else None
    return (arrivals.parse if kind == arrivals.KIND else parse)(doc, source=str(path))


def _is_arrivals(schedule):
    from kvparity.suites.arrivals import ArrivalSchedule

    return isinstance(schedule, ArrivalSchedule)


def select(args, files=None):
    """The (level, schedule) pairs a command asks for, every file validated;
    nothing is run. Selecting nothing is a usage error."""
    from kvparity.suites import arrivals
    from kvparity.suites.schedule import CATALOG, REAL_CATALOG, catalog_paths

    _check_model_name(args.model)
    levels = _levels(args)
    real = args.model == "smollm2"
    if files:
        loaded = [_load_schedule(f) for f in files]
        by_level = {"L1": [s for s in loaded if not _is_arrivals(s)],
                    "L2": [s for s in loaded if not _is_arrivals(s)],
                    "L3": [s for s in loaded if _is_arrivals(s)]}
    else:  # the real model has schedules of its own at L2 and L3
        by_level = {"L1": [_load_schedule(p) for p in catalog_paths(folder=CATALOG)],
                    "L2": [_load_schedule(p) for p in catalog_paths(folder=REAL_CATALOG if real else CATALOG)],
                    "L3": [_load_schedule(p) for p in
                           arrivals.catalog_paths(arrivals.L3_REAL_CATALOG if real else arrivals.L3_CATALOG)]}
    chosen = [(level, s) for level in levels for s in by_level[level]
              if level == "L3" or level in s.levels]
    if not chosen:
        what = ", ".join(str(f) for f in files) if files else "the catalog"
        raise UsageError(f"--level {args.level}: {what} holds no schedule for {' or '.join(levels)}; "
                         "nothing would be compared")
    return chosen


def plan(args, selected):
    """(label, run) pairs, ``run(implementation)`` a ScheduleResult; each L2
    and L3 schedule fitted to its model up front (a text prompt on a model
    without a tokenizer is a usage error, not a skipped schedule). An L3
    schedule runs twice: each prompt prefilled alone, and the engine's own
    batched prefill."""
    from kvparity.suites.arrivals import check_fits
    from kvparity.suites.l1 import run_l1
    from kvparity.suites.l2 import fit_to_model, model_for, run_l2
    from kvparity.suites.l3 import prefill_modes, run_l3

    forced = args.model if args.model != "smollm2" else None
    engine = getattr(args, "engine", None)
    runs = []
    for level, schedule in selected:
        if level == "L1":
            runs.append((f"L1 {schedule.name}", lambda impl, s=schedule: run_l1(s, impl)))
            continue
        name = forced or (schedule.model if level == "L3" else model_for(schedule))
        model = _load_model(name)
        if level == "L2":
            _, unfit = fit_to_model(schedule, model)
            if unfit:
                raise UsageError(f"{schedule.path}: cannot run on {name}: {unfit}")
            runs.append((f"L2 {schedule.name}", lambda impl, s=schedule: run_l2(
                s, impl, forced, repeat_oracle=getattr(args, "repeat_oracle", None))))
            continue
        unfit = check_fits(schedule, model.head_dim, model.vocab_size, model.tokenizer is not None)
        if unfit:
            raise UsageError(f"cannot run on {name}: {unfit}")
        for mode, variant in prefill_modes(schedule).items():
            def serve(impl, s=variant, mode=mode):
                result = run_l3(s, impl, engine, forced)
                result.schedule = f"{s.name} ({mode})"
                return result
            runs.append((f"L3 {schedule.name} ({mode})", serve))
    return runs


def _check_engine(spec):
    from kvparity.suites.engines import EngineError, load_engine_factory

    try:
        load_engine_factory(spec)
    except EngineError as error:
        raise UsageError(str(error))


def prepare(args, files=None):
    """Everything that can be refused before a schedule runs, usage (2)
    before what cannot run here (125): (policy, runs, implementation)."""
    policy = _policy(args)
    _check_impl_spec(args.impl)
    selected = select(args, files)
    if any(level == "L3" for level, _ in selected):
        _check_engine(getattr(args, "engine", None))
    _use_device(args.device)
    runs = plan(args, selected)
    return policy, runs, _implementation(args.impl)


def run_all(runs, implementation, policy, progress=None, expectations=None):
    """Run and judge each planned schedule."""
    from kvparity.oracle.models import ModelUnavailable
    from kvparity.reports.verdicts import judge

    results = []
    for label, run in runs:
        try:
            results.append(judge(run(implementation), policy, expectations))
        except ModelUnavailable as error:
            raise CannotRun(str(error))
        if progress:
            progress.advance(label)
    return results


def _print_summary(results, verdict, policy, out=None, quiet=False):
    from tabulate import tabulate

    from kvparity.reports.writer import check_rows, declaration_rows, summary_rows
    from kvparity.suites.evidence import PASS

    out = out or sys.stdout
    headers, rows = summary_rows(results, policy)
    if quiet:  # only what did not pass
        rows = [row for row, r in zip(rows, results) if r.verdict != PASS]
    if rows:
        print(tabulate(rows, headers, tablefmt="simple"), file=out)
    # What held beside what diverged: one diverging check never hides the rest.
    if verdict.checks and (not quiet or rows):
        print("\nper check, schedule runs (rows):", file=out)
        headers, rows = check_rows(verdict)
        print(tabulate(rows, headers, tablefmt="simple"), file=out)
    if verdict.declarations:
        print("\ndeclared divergences:", file=out)
        headers, rows = declaration_rows(verdict)
        print(tabulate(rows, headers, tablefmt="simple"), file=out)
    if verdict.cells:
        print(f"\ncoverage model (L1): {verdict.cells['reached']} of {verdict.cells['requirements']} "
              "requirements reached", file=out)
    print(f"\n{verdict.headline}", file=out)
    for gap in verdict.gaps:
        print(f"no evidence: {gap}", file=out)


def _select_and_run(args, files):
    from kvparity.reports.verdicts import verdict_of_run

    expectations = _expectations(args)  # a bad file is refused before anything else
    policy, runs, implementation = prepare(args, files)
    progress = Progress(len(runs))
    results = run_all(runs, implementation, policy, progress, expectations)
    progress.close()
    verdict = verdict_of_run(results, whole_catalog=not files, expectations=expectations, policy=policy)
    return implementation, policy, results, verdict, expectations


def cmd_run(args):
    from kvparity.reports.environment import describe
    from kvparity.reports.writer import write_report

    if not args.no_report:
        _writable_directory(args.out, "--out")
    implementation, policy, results, verdict, expectations = _select_and_run(args, args.schedule)
    _print_summary(results, verdict, policy)
    status = verdict.exit_status
    if not args.no_report:
        model = _load_model(args.model or _default_model())
        failed = []

        def bench(directory):  # a failing suite keeps the report (the parity verdict stands) but fails the run
            from kvparity.reports.bench import BenchmarkFailed

            try:
                failed.append(_benchmarks(directory, args.quick, args.impl))
            except BenchmarkFailed as error:
                failed.append(str(error))
        path = write_report(
            results, describe(implementation, model), args.out, policy=policy, run_verdict=verdict,
            probes=_probes(model, args.device), capabilities=implementation.capabilities,
            expectations=expectations,
            extra=bench if args.bench else None,
        )
        print(f"report: {path}")
        if any(failed):
            print(f"kvparity: {failed[0]}; its results are in {path}", file=sys.stderr)
            status = status or EXIT_BROKEN
    return status


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
    _, policy, results, verdict, _ = _select_and_run(args, args.schedule)
    _print_summary(results, verdict, policy, quiet=True)
    return verdict.exit_status


def cmd_replay(args):
    _, policy, results, verdict, _ = _select_and_run(args, [args.file])
    _print_summary(results, verdict, policy)
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
    from tabulate import tabulate

    from kvparity.oracle.probes import probe_table

    _check_model_name(args.model)
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

    _policy(args)  # refused like everywhere else, though recording applies none
    if args.engine:
        _check_impl_spec(args.impl)
    args.level = "L2"
    _new_path(args.out, "record")
    selected = select(args, args.schedule)
    _use_device(args.device)
    forced = args.model if args.model != "smollm2" else None
    fitted = []
    for _, schedule in selected:
        model = _load_model(model_for(schedule, forced))
        schedule, unfit = fit_to_model(schedule, model)
        if unfit:
            raise UsageError(f"{schedule.path}: cannot run on {model.name}: {unfit}")
        fitted.append((schedule, model))
    implementation = _implementation(args.impl) if args.engine else None
    recorded, schedules, model = {}, [], None
    for schedule, model in fitted:
        if implementation and implementation.missing(schedule.needs):
            continue
        if args.engine:
            capture = {}
            run_l2(schedule, implementation, model.name, capture=capture, repeat_oracle=args.repeat_oracle)
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
    _print_summary(results, verdict, policy)
    return verdict.exit_status


def cmd_bisect(args):
    from kvparity.reports.verdicts import judge, verdict_of_run
    from kvparity.suites.l1 import run_l1
    from kvparity.suites.l2 import run_l2
    from kvparity.suites.l3 import run_l3
    from kvparity.suites.schedule import atomic_write_json
    from kvparity.suites.shrink import ArrivalShrinker, Shrinker

    policy = _policy(args)
    _check_impl_spec(args.impl)
    _check_model_name(args.model)
    schedule = _load_schedule(args.schedule)
    level = "L3" if _is_arrivals(schedule) else args.level
    if level == "L3" and args.level != "L3":
        raise UsageError(f"{args.schedule}: an arrivals schedule: bisect it with --level L3")
    if level != "L3" and level not in schedule.levels:
        raise UsageError(f"{args.schedule}: not an {level} schedule (levels: {', '.join(schedule.levels)})")
    out = Path(args.out or f"reports/out/bisect/{schedule.name}-min.json")
    if out.exists() and not out.is_file():
        raise UsageError(f"--out {out}: not a file")
    _writable_directory(out.parent, "--out")
    _use_device(args.device)
    if level == "L3":
        _check_engine(args.engine)
    plan(args, [(level, schedule)])  # an L2 or L3 schedule must fit its model
    implementation = _implementation(args.impl)
    forced = args.model if args.model != "smollm2" else None
    runs = {
        "L1": lambda s: run_l1(s, implementation),
        "L2": lambda s: run_l2(s, implementation, args.model, use_cache=False, repeat_oracle=args.repeat_oracle),
        "L3": lambda s: run_l3(s, implementation, args.engine, forced),
    }
    shrinker = (ArrivalShrinker if level == "L3" else Shrinker)(lambda s: judge(runs[level](s), policy), schedule)
    if shrinker.first is None:
        original = shrinker.original
        if original.verdict == "pass":
            print(f"{schedule.name}: parity holds at {level}; nothing to bisect")
        else:  # refused, no evidence, ...: no divergence to shrink towards, still not a pass
            why = original.reason or next((r.reason for r in original.rows if r.reason), "")
            print(f"{schedule.name}: {original.verdict} at {level}, no divergence to bisect"
                  + (f" ({why})" if why else ""))
        return verdict_of_run([original]).exit_status
    first = shrinker.first
    if level != "L3":
        print(f"first event after which parity breaks: {schedule.events[first.event_index].label}")
    print(f"  {first.message()}")
    doc = shrinker.shrink(schedule)
    minimal = shrinker.parse(doc)
    atomic_write_json(doc, out)
    print(f"shrunk to {len(minimal.requests)} of {len(schedule.requests)} requests"
          + ("" if level == "L3" else f" and {len(minimal.events)} of {len(schedule.events)} events")
          + f" in {shrinker.tries} tries")
    replay = f"kvparity replay {out} --level {level}" + (f" --impl {args.impl}" if args.impl else "")
    print(f"written to {out}; replay with: {replay}")
    return EXIT_BROKEN


def _benchmarks(directory, quick, impl):
    """Run the suite into ``directory`` and print its ratios. Returns why the
    suite failed, or None; a suite that measured nothing raises."""
    from tabulate import tabulate

    from kvparity.reports.bench import BenchmarkFailed, ratio_table, run_benchmarks

    try:
        run_benchmarks(directory, quick, impl)
    except BenchmarkFailed as error:
        if not error.measured:
            raise
        return str(error)
    finally:
        json_path = directory / "benchmark.json"
        if json_path.exists():
            headers, rows = ratio_table(json_path)
            print(tabulate(rows, headers, tablefmt="simple"))
    return None


def cmd_bench(args):
    from kvparity.reports.bench import BenchmarkFailed
    from kvparity.reports.writer import ReportDirectory

    _check_impl_spec(args.impl)
    _writable_directory(args.out, "--out")
    _implementation(args.impl)  # refuse an unusable one before minutes of benchmarks
    report = ReportDirectory(args.out)
    try:
        with report as directory:
            failed = _benchmarks(directory, args.quick, args.impl)
    except BenchmarkFailed as error:  # nothing measured: no directory is left behind
        print(f"kvparity: {error}", file=sys.stderr)
        return EXIT_BROKEN
    # Only the final path is printed: the staging directory is gone by now.
    if failed:
        print(f"kvparity: {failed}; what it measured is in {report.path}", file=sys.stderr)
        return EXIT_BROKEN
    print(f"benchmarks: {report.path}")
    return EXIT_OK


def expectations_option(command):
    command.add_argument("--expectations", metavar="FILE",
                         help="declared divergences (JSON): what matches one is an expected divergence and does not "
                         "gate; every other check still gates (see README)")


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

    def common(command, levels=("L1", "L2", "L3", "all"), default_level="all"):
        command.add_argument("--impl", metavar="MODULE:FACTORY", help=impl_help)
        if levels:
            command.add_argument("--level", choices=levels, default=default_level,
                                 help="L1 cache bytes, L2 model per row, L3 a real engine serving arrivals "
                                 "(default: %(default)s)")
        if levels is None or "L2" in levels:
            command.add_argument("--repeat-oracle", action=argparse.BooleanOptionalAction, default=None,
                                 help="run every solo trace twice and require equal bytes "
                                 "(default: on when the device is a GPU)")
        if levels and "L3" in levels:
            command.add_argument("--engine", metavar="MODULE:FACTORY",
                                 help="L3 engine as package.module:factory (default: mlx-lm's BatchGenerator)")
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
    expectations_option(run)
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
                           "1 parity broken, 2 usage error (found before any work), 125 cannot judge here "
                           "(git bisect run skips the commit), 128 kvparity itself failed (aborts the "
                           "bisection). Made for `git bisect run kvparity check ...`.")
    common(check)
    check.add_argument("--schedule", metavar="FILE", action="append", help="check these schedule files only")
    expectations_option(check)
    check.set_defaults(func=cmd_check)

    replay = sub.add_parser("replay", help="replay one schedule file and show each row's first divergences",
                            description="Replay one schedule file row by row.")
    replay.add_argument("file", metavar="FILE", help="schedule file (JSON)")
    common(replay)
    expectations_option(replay)
    replay.set_defaults(func=cmd_replay)

    bisect = sub.add_parser("bisect", help="find the first breaking event of a schedule and shrink it",
                            description="For a failing schedule: find the first event after which parity breaks, "
                            "then shrink the schedule to a minimal one that fails the same way and write it out.")
    bisect.add_argument("schedule", metavar="SCHEDULE", help="the failing schedule file")
    common(bisect, levels=("L1", "L2", "L3"), default_level="L1")
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

    calibrate = sub.add_parser("calibrate", help="measure batched-vs-solo logit distances on this device and "
                               "propose GPU policy thresholds",
                               description="Sweep batch sizes 1-16 and batch compositions of the reference against "
                               "mlx-lm's own solo path on this device, measure the RoPE and mask negative controls, "
                               "and propose a kl tier with its margin, or none where no setting qualifies.")
    from kvparity.suites.calibration import add_arguments as calibration_arguments

    calibration_arguments(calibrate)
    calibrate.set_defaults(func=cmd_calibrate)

    compare = sub.add_parser("compare", help="compare a candidate trace directory with a golden one",
                             description="Compare two trace directories (from `kvparity record` or any engine "
                             "writing the same format) with the L2 metrics. Traces from another device, backend "
                             "or MLX version are refused.")
    compare.add_argument("golden", metavar="GOLDEN", help="the golden trace directory")
    compare.add_argument("candidate", metavar="CANDIDATE", help="the candidate trace directory")
    compare.add_argument("--policy", metavar="NAME|FILE", help="verdict policy (default: this backend's)")
    compare.set_defaults(func=cmd_compare)
    return parser


def cmd_calibrate(args):
    import json

    from kvparity.suites.calibration import from_args

    _use_device(args.device)
    _writable_directory(Path(args.out).parent, "--out")
    try:
        data = from_args(args)
    except ValueError as error:
        raise UsageError(str(error))
    print(json.dumps(data["proposal"], indent=1))
    return EXIT_OK


def _batch_sizes(text):
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch sizes like 1,2,8, got {text!r}")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return sizes


def _internal_error() -> int:
    traceback.print_exc()
    print("kvparity: internal error (a bug in kvparity, not a parity verdict)", file=sys.stderr)
    return EXIT_HARNESS_ERROR


def main(argv=None) -> int:
    try:  # a harness that cannot import itself is its own failure, never the commit's
        from kvparity.suites.schedule import ScheduleError

        parser = build_parser()
    except Exception:
        return _internal_error()
    args = parser.parse_args(argv)
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
        return _internal_error()


if __name__ == "__main__":
    sys.exit(main())

"""What run, check and replay share: the schedules a command selects, the
runs planned for them (each level's runner, from ``suites.runners``), running
and judging them, and the summary printed after."""

import sys
from dataclasses import replace

from tabulate import tabulate

from kvparity.oracle.models import ModelUnavailable
from kvparity.oracle.sealed import LEDGER, SOLO_CACHE_COUNTS
import mlx.core as mx

from kvparity.reports import failures, shards, verdicts
from kvparity.reports.commands import generated
from kvparity.reports.commands.base import (
    CannotRun, UsageError, check_engine, check_impl_spec, check_model_name, expectations, implementation,
    load_model_or_refuse, model_or_default, policy, print_configuration, seconds, use_device,
)
from kvparity.reports.commands.probe import probes, unprobed
from kvparity.reports.environment import describe
from kvparity.reports.settings import Settings
from kvparity.reports.writer import ReportUnwritten, write_report
from kvparity.reports.markdown import check_rows, declaration_rows, summary_rows
from kvparity.suites.l4.server import release_model_dirs
from kvparity.suites.core.adapter import Implementation
from kvparity.suites.core.evidence import FAILURES, PASS, crashed
from kvparity.suites.core.flight import FLIGHT, MEMBER_TIMEOUT_S, IsolatedState
from kvparity.suites.format.levels import L3, L4, LEVELS
from kvparity.suites.core.processes import stop_signal
from kvparity.suites.l4.server_process import ServerNeverReady
from kvparity.suites.runners import RUNNERS, RunOptions, load_schedule


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


def require_levels_option(command):
    command.add_argument("--require-levels", metavar=",".join(LEVELS),
                         help="levels that must be judged: a run in which one of them judged no schedule run "
                         "(every one mlx-lm defect, not supported, oracle cannot run, ...) cannot be judged "
                         "(exit 125) instead of passing on the other levels; a shard leaves it to kvparity merge")


def exit_first_option(command):
    command.add_argument("--exit-first", action="store_true",
                         help="stop at the first schedule run that fails and exit 1: the rest is not run, and the "
                         "failure is neither grouped nor shrunk (kvparity mutate's gate: a verdict, fast)")


def member_timeout_option(command):
    command.add_argument("--member-timeout", type=seconds, default=MEMBER_TIMEOUT_S, metavar="SECONDS",
                         help="a protocol member call that does not return within SECONDS is the implementation's "
                         "FAIL (a hang), naming the member and the event; the process running it is stopped and "
                         "the rest goes on in a new one (the kvparity executable; default: %(default)g)")


def select(settings: Settings, files=None):
    """The (level, schedule) pairs a command asks for, every file validated;
    nothing is run. Selecting nothing is a usage error."""
    check_model_name(settings.model)
    levels = settings.levels
    options = RunOptions(model=settings.model)  # which catalog: the real model's or the others
    loaded = [load_schedule(f) for f in files] if files else None
    chosen = [(level, s) for level in levels
              for s in (loaded if files else RUNNERS[level].catalog(options)) if RUNNERS[level].takes(s)]
    if not chosen:
        what = ", ".join(str(f) for f in files) if files else "the catalog"
        raise UsageError(f"levels {settings.levels_said}: {what} holds no schedule for {' or '.join(levels)}; "
                         "nothing would be compared")
    return chosen


def plan(settings: Settings, selected, options=None, own_files=True):
    """(label, run) pairs, ``run(implementation)`` a ScheduleResult; each L2
    and L3 schedule fitted to its model up front. A file of the user's own
    (``own_files``) that does not fit its model (a text prompt on a model
    without a tokenizer, a group size that does not divide its dims) is a
    usage error; a catalog file that does not fit is "not supported" there,
    and the rest runs. A model the user chose that leaves nothing to judge
    cannot run here at all (``refuse_nothing_to_judge``)."""
    options = options or settings.run_options()
    if own_files or settings.model:  # a model the user chose
        refuse_nothing_to_judge(selected, options)
    runs = []
    for level, schedule in selected:
        runner = RUNNERS[level]
        name = runner.model_name(schedule, options)
        if name is not None and own_files:
            unfit = runner.unfit(schedule, load_model_or_refuse(name))
            if unfit:
                raise UsageError(unfit)
        runs += runner.runs(schedule, options)  # a run that does not fit is "not supported" there
    return runs


def prepare(settings: Settings, files=None):
    """Everything that can be refused before a schedule runs, usage (129)
    before what cannot run here (125): (policy, runs, implementation)."""
    chosen_policy = policy(settings)
    check_impl_spec(settings.impl)
    selected = select(settings, files)
    if any(level == L3 for level, _ in selected):
        check_engine(settings.engine)
    if any(level == L4 for level, _ in selected) and settings.server is None:
        raise UsageError("L4 judges a server: give --server 'COMMAND {model} {port}' or --url http://127.0.0.1:PORT")
    use_device(settings.device)
    options = settings.run_options()
    if files:  # the axis names catalog schedules: a file of the same name is the user's own
        options = replace(options, models=())
    runs = plan(settings, selected, options, own_files=bool(files))
    if settings.judges_a_server_only:  # the server is under test, not a class
        return chosen_policy, runs, Implementation(options.server.name, object)
    return chosen_policy, runs, implementation(settings.impl)


def refuse_nothing_to_judge(selected, options):
    """A model the user chose (``--model``, or named by a file of theirs)
    that itself leaves nothing to judge (``CachePlan.nothing_to_judge``):
    one line, cannot run here, before any schedule runs."""
    for name in dict.fromkeys(RUNNERS[level].model_name(s, options) for level, s in selected):
        why = name and load_model_or_refuse(name).plan.nothing_to_judge()
        if why:
            raise CannotRun(f"{name}: {why}")


class RunInterrupted(KeyboardInterrupt):
    """A signal stopped the runs: ``results`` are the ones that finished."""

    def __init__(self, results, signal: str, planned: int):
        super().__init__(signal)
        self.results, self.signal, self.planned = results, signal, planned

    @property
    def record(self) -> dict:
        """``RunVerdict.interrupted``."""
        return {"signal": self.signal, "finished": len(self.results), "planned": self.planned}


def run_all(runs, implementation, policy, progress=None, expectations=None, exit_first=False):
    """Run and judge each planned schedule (with ``exit_first``, up to the
    first that fails). In an isolated child (the
    ``kvparity`` command's, ``suites/core/flight.py``) the runs an earlier child
    finished are taken as it kept them, the one it died in is that run's
    FAIL, a member that hung in one is not called again (the runs that
    call it are not judged), and each run this one finishes is kept. A signal raises
    RunInterrupted with the runs finished before it."""
    results, isolated = [], IsolatedState.from_env()
    # a member that hung in an earlier child, or earlier in this process (a cache process's), is not called again
    FLIGHT.hung = isolated.hung() if isolated is not None else {}
    for label, run in runs:
        try:
            if isolated is None:
                FLIGHT.run(label)
                result = solo_cache_noted(run, implementation)
            elif label in isolated.done:
                result = isolated.done[label]
            elif label in isolated.crashes:
                result = crashed(isolated.crashes[label])
            else:
                FLIGHT.run(label)
                result = solo_cache_noted(run, implementation)
                isolated.keep(label, result)
            results.append(verdicts.judge(result, policy, expectations))
        except ModelUnavailable as error:
            raise CannotRun(str(error))
        except ServerNeverReady as error:
            raise CannotRun(f"{label}: {error}" + (f"\n{error.log_tail}" if error.log_tail else ""))
        except KeyboardInterrupt:  # the run it stopped is not reported; the finished ones are
            raise RunInterrupted(results, stop_signal() or "SIGINT", len(runs)) from None
        if progress:
            progress.advance(label)
        if exit_first and results[-1].verdict in FAILURES:
            break
    return results


def solo_cache_noted(run, implementation):
    """``run(implementation)``, its result saying how its stored solo runs were had."""
    mark = LEDGER.mark()
    result = run(implementation)
    used = LEDGER.since(mark)
    if any(used[how] for how in SOLO_CACHE_COUNTS):
        result.solo_cache = used
    return result


def solo_cache_line(results) -> str:
    """One line for the console when stored solo runs did not prove whole,
    or computed ones could not be stored (a full disk); else empty."""
    dropped = [reason for r in results for reason in r.evidence.solo_cache.get("reasons", ())]
    lines = []
    if dropped:
        lines.append(f"solo-run cache: {len(dropped)} stored entr{'y' if len(dropped) == 1 else 'ies'} did not prove "
                     f"whole and were recomputed (first: {dropped[0]})")
    if LEDGER.unstored:
        lines.append(f"solo-run cache: {len(LEDGER.unstored)} solo run(s) computed here could not be stored, and "
                     f"were used as computed (first: {LEDGER.unstored[0]})")
    return "\n".join(lines)


def shard_option(command):
    command.add_argument("--shard", metavar="K/N",
                         help="run only the K-th of N deterministic shares of the schedule runs, balanced by "
                         "measured cost, into a report that kvparity merge combines with the other shards'; its "
                         "exit status speaks for its share, kvparity merge gives the run's")


def shard_of(settings: Settings, writes_report: bool):
    """--shard as a ``shards.Shard`` (None without one); a shard must write its report."""
    if not settings.shard:
        return None
    try:
        shard = shards.parse_shard(settings.shard)
    except shards.ShardError as error:
        raise UsageError(str(error))
    if not writes_report:
        raise UsageError(f"--shard {settings.shard}: needs a report directory (--out DIR): kvparity merge reads it")
    return shard


def select_and_run(settings: Settings, files, shard=None):
    """Run what the command selects (with ``shard``, a ``shards.Shard``, its
    share of the plan): (implementation, policy, results, run verdict,
    expectations, the shard block or None)."""
    try:
        return _select_and_run(settings, files, shard)
    finally:
        release_model_dirs()  # the servers' model directories: the run is done with them


def _select_and_run(settings: Settings, files, shard):
    declared = expectations(settings)  # a bad file is refused before anything else
    required = settings.required_levels
    budget, database = generated.budget_of(settings, files), generated.database_of(settings)
    chosen_policy, runs, chosen = prepare(settings, files)
    plan = None
    if shard is not None:
        try:
            plan = shards.plan_doc([label for label, _ in runs], shard, not files, shards.load_costs())
        except shards.ShardError as error:
            raise UsageError(str(error))
        runs = shards.share(runs, plan)
    print_configuration(settings, policy=chosen_policy.name, device=mx.default_device().type.name)
    FLIGHT.limit(settings.member_timeout)
    progress = Progress(len(runs))
    try:
        results = run_all(runs, chosen, chosen_policy, progress, declared, exit_first=settings.exit_first)
        interrupted = None
    except RunInterrupted as stop:
        results, interrupted = stop.results, stop.record
    finally:
        progress.close()
    cut = len(results) < len(runs)  # --exit-first stopped at a failure (or a signal stopped the runs)
    budget_run = None
    if budget and not cut and FLIGHT.hung:  # its schedules would call the member and wait the timeout out again
        print(f"generated ({generated.LEVEL}): not run: " + "; ".join(
            f"{member} hung in {where}" for member, where in FLIGHT.hung.items()))
    elif budget and not cut:  # after the catalog: its runs are judged whatever the budget finds
        try:
            budget_run, found = generated.run_generated(settings, chosen, chosen_policy, declared, budget, database)
            results = results + found
        except KeyboardInterrupt:
            budget_run, found = None, []
        if budget_run is None or budget_run["interrupted"]:
            interrupted = RunInterrupted(results, stop_signal() or "SIGINT", len(runs)).record
    # A shard speaks for its share: the whole catalog's members and coverage model are the merge's to judge;
    # an interrupted run, for what finished.
    verdict = verdicts.verdict_of_run(results, whole_catalog=not files and plan is None and not interrupted
                                      and not cut, expectations=declared, policy=chosen_policy,
                                      required_levels=required if plan is None and not cut else ())
    verdict.generated = budget_run
    if budget_run is not None and not interrupted:
        verdict.gaps += generated.gaps_of(budget_run)
    if not interrupted and not cut:  # grouping shrinks at L1, which runs schedules: not once a signal said stop
        try:
            verdict.failures = grouped_failures(settings, results, chosen, chosen_policy, declared)
        except KeyboardInterrupt:
            interrupted = RunInterrupted(results, stop_signal() or "SIGINT", len(runs)).record
    verdict.interrupted = interrupted
    return chosen, chosen_policy, results, verdict, declared, plan


def grouped_failures(settings: Settings, results, implementation, policy, declared):
    """The failing runs grouped by root cause; at L1, each group's example
    shrunk to name an earlier member its failure exposed (cheap there)."""
    groups = failures.group(results, failures.options_of(settings))
    options = settings.run_options(use_cache=False)

    def at(level):
        return lambda s: verdicts.judge(RUNNERS[level].run(s, implementation, options), policy, declared)

    failures.explain(groups, at)
    return groups


def write_run_report(settings: Settings, implementation, policy, results, verdict, declared, shard=None, extra=None):
    """The report directory of a run (or a shard of one) under ``settings.out``."""
    model = model_or_default(settings.model)
    # Once a signal said stop, nothing more is computed: the backend probes are left out (as where the
    # model has no attention shapes to probe).
    return write_report(
        results, describe(implementation, model), settings.out, policy=policy, run_verdict=verdict,
        probes=[] if verdict.interrupted or unprobed(model) else probes(model, settings.device),
        capabilities=implementation.capabilities,
        expectations=declared, shard=shard, extra=extra, configuration=settings.configuration,
    )


def report_written(write):
    """The report directory ``write()`` makes, said as ``report: PATH``; one
    that cannot be written (a full disk) is said instead, and the verdict
    already printed stands: None."""
    try:
        path = write()
    except ReportUnwritten as error:
        print(f"kvparity: {error}; the verdict printed above stands", file=sys.stderr)
        return None
    print(f"report: {path}")
    return path


def write_untrusted_report(settings: Settings, untrusted):
    """The report of a run that judged nothing because its device failed the
    known-answer check: no schedule ran, and its first gap says why."""
    verdict = verdicts.verdict_of_run([])
    verdict.gaps.insert(0, str(untrusted))
    return write_report([], describe(), settings.out, policy=policy(settings), run_verdict=verdict, probes=[],
                        configuration=settings.configuration)


def print_summary(results, verdict, policy, out=None, quiet=False):
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
    if verdict.generated:
        print(generated.line(verdict.generated), file=out)
    groups = verdict.failures if verdict.failures is not None else failures.group(results)
    if groups:
        print("", *failures.lines(groups), sep="\n", file=out)
    if solo_cache_line(results):
        print(solo_cache_line(results), file=out)
    print(f"\n{verdict.headline}", file=out)
    for gap in verdict.gaps:
        print(f"no evidence: {gap}", file=out)

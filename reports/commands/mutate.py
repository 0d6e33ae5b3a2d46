"""``kvparity mutate``: the lines of a cache the gate does not constrain,
found by mutation testing (reports/mutants.py): each mutant of the cache's
file judged by the gate, and the survivors listed by file and line."""

import argparse
import inspect
import os
import sys
import tempfile
import time
from pathlib import Path

from kvparity.reports.commands.base import (
    RUN_SETTINGS, CannotRun, UsageError, common_options, expectations, expectations_option, implementation, policy,
    print_configuration, seconds, use_device, writable_directory,
)
from kvparity.reports.commands.runs import member_timeout_option
from kvparity.reports.mutants import (
    KILLED, NOT_A_PROGRAM, NOT_JUDGED, SURVIVED, TIMEOUT, Gate, MutantsError, campaign, entry_of, listed_in, load_equivalents,
    match_equivalents, mutants_of, outcome_counts, report, sample, vouched_for,
)
from kvparity.reports.settings import SETTINGS as DECLARED, Settings
from kvparity.reports.verdicts import EXIT_BROKEN, EXIT_INTERRUPTED, EXIT_OK
from kvparity.suites.format.levels import CACHE_LEVELS, L1
from kvparity.suites.format.schedule import atomic_write_json
from kvparity.suites.runners import model_set

NAME = "mutate"
HELP = "mutation testing: the lines of your cache that the gate does not constrain"
DESCRIPTION = ("Mutation testing of the cache under test: cosmic-ray makes every one-line mutant of the file "
               "that holds the --impl class (or of the files given), each in a temporary copy, never in your "
               "tree; the gate (kvparity check with your settings, L1 first, then the other levels) judges each "
               "as a fresh process, on --workers processes. A mutant the gate fails is killed; one it passes "
               "survives, and is listed by file and line: an equivalent mutant (list it with its reason in the "
               "--equivalents file), dead code, or a gap in the gate. Exit 1 when a survivor is not listed, or "
               "a listed one is killed; 0 only when mutants ran and every one was killed or listed.")
MUTATE_MEMBER_TIMEOUT_S = 10.0  # a mutant that loops is found in 10 s, not 60 (the slowest call is ~0.1 s)
# The default per-mutant timeout, from the unmutated gate's time. A mutant that hangs in a member is
# stopped by --member-timeout; this catches one that is only slow, so it is far from a busy machine's
# spread: at 4x, two mutants of impl/minimal.py (one a signature's * made /, which changes nothing)
# were killed by timeout on a 2-core machine whose load doubled during the campaign.
TIMEOUT_FACTOR, TIMEOUT_SLACK_S = 10.0, 60.0

SETTINGS = (*RUN_SETTINGS, "equivalents")
REQUIRED = ("impl",)


def arguments(command):
    command.add_argument("files", nargs="*", metavar="FILE",
                         help="the source files to mutate, each imported by the --impl class's module or the "
                         "modules it imports (default: the file that holds the --impl class)")
    common_options(command, levels=(*CACHE_LEVELS, "all"))
    expectations_option(command)
    command.add_argument("--equivalents", metavar="FILE",
                         help="the mutants no caller can observe, each with its reason (TOML, [[equivalent]] "
                         "entries; default: equivalents in [tool.kvparity], else none)")
    command.add_argument("--workers", type=int, default=os.cpu_count() or 1, metavar="N",
                         help="mutants judged at once, a gate process each (default: the cores, %(default)s)")
    command.add_argument("--sample", type=int, metavar="N",
                         help="judge a fixed share of N mutants: the same N for the same code (default: all)")
    command.add_argument("--lines", type=line_numbers, metavar="N[,N...]",
                         help="judge only the mutants of these lines (e.g. the lines a change touched)")
    command.add_argument("--timeout", type=seconds, metavar="SECONDS",
                         help="a mutant whose gate takes longer is killed by timeout (default: "
                         f"{TIMEOUT_FACTOR:g} times the unmutated cache's gate, plus {TIMEOUT_SLACK_S:g} s)")
    member_timeout_option(command)
    command.set_defaults(member_timeout=MUTATE_MEMBER_TIMEOUT_S)
    command.add_argument("--out", metavar="FILE", help="also write every mutant and its outcome as JSON")


def line_numbers(text: str) -> frozenset:
    """--lines: line numbers, 1 or more, comma-separated."""
    try:
        numbers = frozenset(int(n) for n in text.split(","))
    except ValueError:
        numbers = frozenset()
    if not numbers or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected line numbers (1 or more), comma-separated")
    return numbers


def stages(levels) -> list:
    """The gate's levels as stages, L1 first: a mutant the L1 catalog kills needs no more."""
    if any(level not in CACHE_LEVELS for level in levels):
        raise UsageError(f"--level {','.join(levels)}: mutate runs the cache levels, {', '.join(CACHE_LEVELS)}")
    rest = [level for level in levels if level != L1]
    return ([L1] if L1 in levels else []) + ([",".join(rest)] if rest else [])


def forwarded(settings: Settings) -> list:
    """The gate's arguments: the class and every setting as resolved here."""
    argv = ["--impl", settings.impl, "--member-timeout", f"{settings.member_timeout:g}"]
    for name in ("engine", "model", "device", "policy", "expectations"):
        value = getattr(settings, name)
        if value is not None:
            argv += [DECLARED[name].option, value]
    if settings.repeat_oracle is not None:
        argv.append("--repeat-oracle" if settings.repeat_oracle else "--no-repeat-oracle")
    if not settings.model and settings.models != model_set("default"):
        argv += ["--models", ",".join(settings.models) or "none"]
    return argv


def files_to_mutate(files, impl: str, batch_class) -> list:
    """(path, module) of each file (``files``; none: the class's own), found
    among the modules that loading the class (``impl``) imported."""
    if not files:
        return [(Path(inspect.getsourcefile(batch_class)), batch_class.__module__)]
    loaded = {Path(m.__file__).resolve(): name for name, m in list(sys.modules.items())
              if getattr(m, "__file__", None)}
    chosen = []
    for given in files:
        path = Path(given)
        if not path.is_file() or path.suffix != ".py":
            raise UsageError(f"{given}: not a Python source file")
        module = loaded.get(path.resolve())
        if module is None:
            raise UsageError(f"{given}: not imported by --impl {impl}: no mutant of it could change "
                             "what the gate runs")
        chosen.append((path, module))
    return chosen


def handle(args, settings: Settings):
    if args.workers < 1:
        raise UsageError(f"--workers {args.workers}: at least 1")
    if args.sample is not None and args.sample < 1:
        raise UsageError(f"--sample {args.sample}: at least 1")
    gate_stages = stages(settings.levels)
    chosen_policy = policy(settings)
    expectations(settings)
    if settings.out:
        writable_directory(Path(settings.out).absolute().parent, "--out", shown=settings.out)
    try:
        listed = load_equivalents(settings.equivalents) if settings.equivalents else []
    except MutantsError as error:
        raise UsageError(str(error))
    try:
        import cosmic_ray  # noqa: F401 (the mutation tool, an optional extra)
    except ImportError:
        raise CannotRun("kvparity mutate needs cosmic-ray: pip install 'kvparity[mutate]'")
    use_device(settings.device)
    chosen = implementation(settings.impl)
    mutants = [m for path, module in files_to_mutate(args.files, settings.impl, chosen.batch_class)
               for m in mutants_of(path, module)]
    if not mutants:
        raise CannotRun("no mutant: the files hold nothing cosmic-ray mutates, so nothing is judged")
    try:
        equivalents = match_equivalents(listed, mutants)
    except MutantsError as error:
        raise UsageError(str(error))
    if args.lines:
        mutants = [m for m in mutants if m.line in args.lines]
        if not mutants:
            raise UsageError(f"--lines {','.join(map(str, sorted(args.lines)))}: no mutant on these lines, so "
                             "nothing would be judged")
    chosen_mutants = sample(mutants, args.sample)
    print_configuration(settings, policy=chosen_policy.name)

    gate = Gate(gate_stages, forwarded(settings), args.timeout or 24 * 3600.0, Path.cwd())
    with tempfile.TemporaryDirectory(prefix="kvparity-mutate-") as folder:
        unmutated = gate.judge(None, Path(folder))
    if unmutated.outcome != SURVIVED:
        return unmutated_fails(unmutated)
    gate.timeout = args.timeout or TIMEOUT_FACTOR * unmutated.seconds + TIMEOUT_SLACK_S
    share = f", a fixed sample of {len(chosen_mutants)}" if len(chosen_mutants) < len(mutants) else ""
    print(f"mutate: {len(mutants)} mutants of {', '.join(sorted({m.path.name for m in mutants}))}{share}; the "
          f"unmutated gate passes in {unmutated.seconds:.1f} s (stages {' then '.join(gate_stages)}); "
          f"{args.workers} worker(s), {gate.timeout:.0f} s per mutant at most", file=sys.stderr, flush=True)

    judged, started = [], time.monotonic()

    def progress(one):
        judged.append(one)
        at = f" at {one.stage}" if one.stage and one.outcome != NOT_JUDGED else ""
        status = f" (exit {one.status})" if one.outcome == NOT_JUDGED else ""
        print(f"[{len(judged)}/{len(chosen_mutants)}] {one.mutant.where} {one.mutant.operator}: "
              f"{one.outcome}{at}{status} ({one.seconds:.1f} s): {one.mutant.now}", file=sys.stderr, flush=True)

    try:
        campaign(gate, chosen_mutants, args.workers, progress)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    elapsed = time.monotonic() - started
    judged.sort(key=lambda j: (str(j.mutant.path), j.mutant.line, j.mutant.column, j.mutant.operator))
    if settings.out:
        atomic_write_json(report(judged, equivalents, elapsed, args.workers), settings.out)
    status = summary(judged, equivalents, elapsed, args.workers, settings.equivalents)
    if interrupted:
        print(f"mutate: interrupted after {len(judged)} of {len(chosen_mutants)} mutants", file=sys.stderr)
        return EXIT_INTERRUPTED
    return status


def unmutated_fails(unmutated) -> int:
    """The cache must pass the gate before its mutants can say anything."""
    why = f"the unmutated cache does not pass the gate at {unmutated.stage}"
    if unmutated.outcome == KILLED:
        print(f"kvparity mutate: {why} (exit 1): run kvparity check and mend it first", file=sys.stderr)
        return EXIT_BROKEN
    if unmutated.status == EXIT_INTERRUPTED:
        raise KeyboardInterrupt
    raise CannotRun(f"{why} (exit {unmutated.status}); its last lines:\n{unmutated.tail}")


def summary(judged, equivalents, elapsed, workers: int, equivalents_file) -> int:
    """The counts, the cost (``elapsed`` on ``workers``), each survivor not listed in
    ``equivalents_file``, each listed one killed; the exit status."""
    folder = Path(equivalents_file).parent if equivalents_file else Path.cwd()  # an entry's paths start there
    counts = outcome_counts(judged)
    survived = [j for j in judged if j.outcome == SURVIVED]
    listed = [j for j in survived if listed_in(equivalents, j.mutant)]
    gaps = [j for j in survived if not listed_in(equivalents, j.mutant)]
    wrong = [j for j in judged if j.outcome in (KILLED, TIMEOUT) and vouched_for(equivalents, j.mutant)]
    unjudged = [j for j in judged if j.outcome == NOT_JUDGED]
    at_l1 = sum(j.outcome == KILLED and j.stage == L1 for j in judged)
    each = elapsed * workers / max(len(judged), 1)
    print(f"{len(judged)} mutants: {counts[KILLED]} killed ({at_l1} at {L1}), {counts[TIMEOUT]} killed by timeout, "
          f"{counts[SURVIVED]} survived ({len(listed)} listed as equivalent), {counts[NOT_JUDGED]} not judged, "
          f"{counts[NOT_A_PROGRAM]} not a program (cosmic-ray's mutation does not compile: no gate ran)")
    print(f"cost: {elapsed:.0f} s on {workers} worker(s), {each:.1f} s of a worker per mutant")
    for title, group in (("survived, not listed as equivalent: a line the gate does not constrain", gaps),
                         ("listed as equivalent, but the gate kills it: the entry is wrong", wrong),
                         ("not judged (never counted as killed)", unjudged)):
        if group:
            print(f"\n{title}:")
        for j in group:
            print(f"  {j.mutant.where} {j.mutant.operator}" + (f" (exit {j.status} at {j.stage})" if j in unjudged else ""))
            print(f"      was: {j.mutant.was}\n      now: {j.mutant.now}")
            if j in unjudged and j.tail:
                print("      " + j.tail.replace("\n", "\n      "))
    if gaps:
        where = equivalents_file or "an equivalents file (--equivalents, or equivalents in [tool.kvparity])"
        print(f"\neach is equivalent (no caller can observe it: list it in {where} with the reason), dead code, "
              f"or a gap in the gate (report it). An entry for the first:\n\n{entry_of(gaps[0].mutant, folder)}")
    if gaps or wrong:
        return EXIT_BROKEN
    if unjudged:
        raise CannotRun(f"{len(unjudged)} mutant(s) not judged: the gate exited "
                        f"{', '.join(sorted({str(j.status) for j in unjudged}))} on them")
    if not any(j.outcome in (KILLED, TIMEOUT, SURVIVED) for j in judged):
        raise CannotRun("no mutant was judged: no evidence")
    return EXIT_OK

"""``kvparity bisect``: the first event after which a schedule breaks, and a minimal schedule that breaks the same way."""

import copy
import shlex
from pathlib import Path

from kvparity.oracle.atomic import OUTPUT_ROOT
from kvparity.reports import failures, verdicts
from kvparity.reports.commands.base import (
    RUN_SETTINGS, UsageError, check_engine, check_impl_spec, check_model_name, common_options, expectations,
    expectations_option, implementation, policy, print_configuration, use_device, writable_directory,
)
from kvparity.reports.commands.runs import plan
from kvparity.reports.verdicts import EXIT_BROKEN
from kvparity.suites.format import arrivals
from kvparity.suites.format.levels import CACHE_LEVELS, L1, L3
from kvparity.suites.runners import RUNNERS, is_arrivals, load_schedule
from kvparity.suites.format.schedule import atomic_write_json
from kvparity.suites.core.members import READING_MEMBERS
from kvparity.suites.format.checks import RAISED
from kvparity.suites.search.shrink import ArrivalShrinker, Shrinker, exposure, first_failure

NAME = "bisect"
HELP = "find the first breaking event of a schedule and shrink it"
DESCRIPTION = ("For a failing schedule: find the first event after which parity breaks, then shrink the schedule "
               "to a minimal one that fails the same way and write it out.")

# The settings it reads (reports/settings.py): the command line, else [tool.kvparity], else the default.
SETTINGS = tuple(s for s in RUN_SETTINGS if s != "levels")  # it bisects at one --level of its own
REQUIRED = ("impl",)


def arguments(command):
    command.add_argument("schedule", metavar="SCHEDULE", help="the failing schedule file")
    common_options(command, levels=CACHE_LEVELS, default_level=L1)  # a replay of a cache: not a server (L4)
    expectations_option(command)  # declared divergences are not what a shrink follows
    command.add_argument("--prefill-batch-size", type=int, metavar="N",
                         help="L3: the engine's prefill batch size, over the file's engine block (the run's "
                         "'prefill_batch_size=1' variant is 1)")
    command.add_argument("--out", metavar="FILE", help="where the minimal schedule goes "
                         f"(default: {OUTPUT_ROOT / 'bisect' / 'NAME-min.json'})")


def level_of(asked: str, path: str, schedule):
    """The level to bisect the schedule file ``path`` at (``asked``: --level):
    an arrivals schedule only at L3, an event schedule only at a level it
    declares."""
    level = L3 if is_arrivals(schedule) else asked
    if level == L3 and asked != L3:
        raise UsageError(f"{path}: an arrivals schedule: bisect it with --level L3")
    if level != L3 and level not in schedule.levels:
        raise UsageError(f"{path}: not an {level} schedule (levels: {', '.join(schedule.levels)})")
    return level


def with_prefill_batch_size(size, path: str, schedule):
    """The arrivals schedule (from ``path``) with --prefill-batch-size
    ``size`` written into its engine block, so that the minimal schedule
    written holds it too."""
    if size is None:
        return schedule
    if not is_arrivals(schedule) or size < 1:
        raise UsageError(f"--prefill-batch-size {size}: a number of 1 or more, for an arrivals schedule (L3)")
    doc = copy.deepcopy(schedule.doc)
    doc.setdefault("engine", {})["prefill_batch_size"] = size
    return arrivals.parse(doc, source=path)


def output_path(given, schedule) -> Path:
    """Where the minimal schedule goes: ``given`` (--out), else under the output folder."""
    out = Path(given or OUTPUT_ROOT / "bisect" / f"{schedule.name}-min.json")
    if out.exists() and not out.is_file():
        raise UsageError(f"--out {out}: not a file")
    writable_directory(out.parent, "--out")
    return out


def nothing_to_bisect(schedule, level, original) -> int:
    if original.verdict == "pass":
        print(f"{schedule.name}: parity holds at {level}; nothing to bisect")
    else:  # refused, no evidence, ...: no divergence to shrink towards, still not a pass
        why = original.evidence.reason or next((r.reason for r in original.rows if r.reason), "")
        print(f"{schedule.name}: {original.verdict} at {level}, no divergence to bisect" + (f" ({why})" if why else ""))
    return verdicts.verdict_of_run([original]).exit_status


def at_fault_words(first, member: str) -> str:
    """The member a first failing divergence blames, and why, in words."""
    if first.call is None:  # no call evidence (L2, L3): the last member called before it, or the one that raised
        return f"{member} (the last protocol member called before it)"
    if member in READING_MEMBERS and first.check != RAISED:
        return f"{member} (its own output diverged)"
    return f"{member} (the last protocol call before the first divergence: call {first.call + 1} of its event)"


def handle(args, settings):
    chosen_policy, declared = policy(settings), expectations(settings)
    check_impl_spec(settings.impl)
    check_model_name(settings.model)
    schedule = with_prefill_batch_size(args.prefill_batch_size, args.schedule, load_schedule(args.schedule))
    level = level_of(settings.level, args.schedule, schedule)
    out = output_path(settings.out, schedule)
    use_device(settings.device)
    if level == L3:
        check_engine(settings.engine)
    plan(settings, [(level, schedule)])  # an L2 or L3 schedule must fit its model
    chosen = implementation(settings.impl)
    print_configuration(settings, policy=chosen_policy.name)
    # The variants the shrinker tries run fresh at L2: none is stored as a golden.
    runner, options = RUNNERS[level], settings.run_options(use_cache=False)
    shrinker = (ArrivalShrinker if level == L3 else Shrinker)(
        lambda s: verdicts.judge(runner.run(s, chosen, options), chosen_policy, declared), schedule)
    if shrinker.first is None:
        return nothing_to_bisect(schedule, level, shrinker.original)
    first = shrinker.first
    if level != L3:
        print(f"first event after which parity breaks: {schedule.events[first.event_index].label}")
    print(f"  {first.message()}")
    member = failures.failure_of(shrinker.original).member
    if member:
        print(f"  first failing call: {at_fault_words(first, member)}")
    doc = shrinker.shrink(schedule)
    minimal = shrinker.parse(doc)
    atomic_write_json(doc, out)
    print(f"shrunk to {len(minimal.requests)} of {len(schedule.requests)} requests"
          + ("" if level == L3 else f" and {len(minimal.events)} of {len(schedule.events)} events")
          + f" in {shrinker.tries} tries")
    shrunk = first_failure(shrinker.run(minimal))
    at_fault = member
    if shrunk is not None and shrunk.member and shrunk.member != member:  # say both
        print(f"  on the shrunk schedule: {shrunk.message()}")
        print(f"  first failing call there: {at_fault_words(shrunk, shrunk.member)}")
        at_fault = shrunk.member
    found = exposure(shrinker.run, minimal) if level != L3 else None
    if found:
        print(f"member at fault: {found.cause}, exposed by {found.exposed_by}: {found.sentence()}")
    elif at_fault:
        print(f"member at fault: {at_fault}")
    replay = shlex.join(["kvparity", "replay", str(out), "--level", level]
                        + (["--impl", settings.impl] if settings.impl else [])
                        + (["--expectations", settings.expectations] if settings.expectations else [])
                        + (["--engine", settings.engine] if settings.engine else []))
    print(f"written to {out}; replay with: {replay}")
    return EXIT_BROKEN

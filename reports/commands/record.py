"""``kvparity record``: solo (golden) or engine traces of the L2 schedules into a new directory."""

from dataclasses import replace

from kvparity.oracle import solo
from kvparity.oracle.golden import GoldenError, write_golden
from kvparity.reports.commands.base import (
    UsageError, check_impl_spec, common_options, implementation, load_model_or_refuse, new_path, policy, use_device,
)
from kvparity.reports.commands.runs import select
from kvparity.reports.verdicts import EXIT_OK
from kvparity.suites.l2 import run as l2
from kvparity.suites.format.levels import L2
from kvparity.suites.runners import RUNNERS, RunOptions

NAME = "record"
HELP = "record solo (golden) or engine traces of the L2 catalog"
DESCRIPTION = ("Write traces (safetensors + JSON manifest with the sha256 of every tensor and the environment) of "
               "the L2 schedules into a new directory: the oracle's solo runs by default, or the engine's batched "
               "run with --engine.")

# The settings it reads (reports/settings.py): the command line, else [tool.kvparity], else the default.
SETTINGS = ("impl", "model", "device", "policy")
REQUIRED = ()  # impl only with --engine


def arguments(command):
    command.add_argument("out", metavar="DIR", help="new directory for the traces (never overwritten)")
    common_options(command, levels=None)
    command.add_argument("--engine", action="store_true", help="record the engine's batched run of --impl")
    command.add_argument("--schedule", metavar="FILE", action="append", help="record these schedule files only")


def fitted(settings, selected):
    """Every selected L2 schedule fitted to its model: (schedule, model) pairs."""
    runner, options = RUNNERS[L2], RunOptions(model=settings.model)  # --engine here is a flag, not an L3 engine
    out = []
    for _, schedule in selected:
        model = load_model_or_refuse(runner.model_name(schedule, options))
        schedule, unfit = runner.fit(schedule, model)
        if unfit:
            raise UsageError(unfit)
        out.append((schedule, model))
    return out


def handle(args, settings):
    policy(settings)  # refused like everywhere else, though recording applies none
    if args.engine:
        check_impl_spec(settings.impl)
    settings = replace(settings, levels_said=L2)  # what it records: the L2 solo runs
    new_path(args.out, "record")
    selected = select(settings, args.schedule)
    use_device(settings.device)
    schedules = fitted(settings, selected)
    chosen = implementation(settings.impl) if args.engine else None
    recorded, kept, model = {}, [], None
    for schedule, model in schedules:
        if chosen and chosen.missing(schedule.needs):
            continue
        if args.engine:
            capture = {}
            l2.run_l2(schedule, chosen, model.name, capture=capture, repeat_oracle=settings.repeat_oracle)
            recorded[schedule.name] = capture
        else:
            recorded[schedule.name] = {
                rid: solo.run_solo(model.model, schedule, rid, model.vocab_size, model.tokenizer)
                for rid in schedule.requests
            }
        kept.append(schedule)
    if not recorded:
        raise UsageError("record: the selection holds no L2 schedule this implementation supports")
    source = f"engine:{chosen.spec}" if args.engine else "oracle"
    try:
        path = write_golden(args.out, source, model, recorded, kept)
    except GoldenError as error:
        raise UsageError(str(error))
    print(f"recorded {len(recorded)} schedules ({source}) in {path}")
    return EXIT_OK

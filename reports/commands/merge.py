"""``kvparity merge``: shard report directories into one report and one exit status."""

import shutil
from pathlib import Path

from kvparity.oracle.atomic import OUTPUT_ROOT
from kvparity.reports import records, shards, verdicts
from kvparity.reports.commands.base import UsageError, writable_directory
from kvparity.reports.commands.runs import print_summary, report_written, require_levels_option
from kvparity.reports.settings import Configuration, Value
from kvparity.reports.writer import write_report
from kvparity.suites.l4.server_process import SERVER_LOGS

NAME = "merge"
HELP = "merge the report directories of kvparity check --shard K/N into one report and one exit status"
DESCRIPTION = ("Read the report directories that kvparity check --shard K/N wrote (each DIR a report directory or a "
               "folder of them), judge their evidence together and write one report directory under --out, in "
               "every format a run writes. The exit status is the whole run's: a shard missing from the plan is "
               "a gap (its schedule runs were not run), so the merge has no evidence (125), as a run without "
               "those schedules would. It reads no setting of its own: the class under test and the settings "
               "are the shards', as their reports record them (and where each came from); --impl makes sure "
               "they gated that class.")

# It reads no setting (reports/settings.py): what it merges carries the shards'.
SETTINGS = REQUIRED = ()


def arguments(command):
    command.add_argument("directories", metavar="DIR", nargs="+", help="shard report directories, or folders of them")
    command.add_argument("--impl", metavar="MODULE:FACTORY", help="refuse shards that gated another class "
                         "(default: whichever class the shards gated, printed and reported)")
    command.add_argument("--out", metavar="DIR", default=str(OUTPUT_ROOT),
                         help="where the merged report directory goes (default: %(default)s)")
    require_levels_option(command)


def copy_server_logs(directories, report: Path):
    """L4: the shards' server logs, where their records point (``server-logs/``)."""
    for log in (log for directory in directories for log in (Path(directory) / SERVER_LOGS).glob("*")):
        (report / SERVER_LOGS).mkdir(exist_ok=True)
        shutil.copyfile(log, report / SERVER_LOGS / log.name)


def shown_configuration(doc):
    """The shards' settings as a run prints them (``settings.Configuration.lines``)."""
    values = {name: Value(s["value"], s["from"]) for name, s in doc["settings"].items()}
    return Configuration(values, doc["pyproject"]).lines()


def handle(args, settings):
    return merge(args.directories, settings.out, settings.required_levels, impl=args.impl)


def merge(directories, out, required, impl=None) -> int:
    """The shard reports under ``directories`` merged into one report under
    ``out``, one verdict (``required``: the levels that must be judged); with
    ``impl``, shards that gated another class are refused."""
    writable_directory(out, "--out")
    try:
        paths = records.report_files(directories)
        found = [records.read_record(path) for path in paths]
        merged = shards.gather(found, [path.parent for path in paths])
    except (records.RecordError, shards.ShardError) as error:
        raise UsageError(str(error))
    first = merged.records[0]
    gated = first["environment"].get("implementation")
    if impl is not None and gated != impl:
        raise UsageError(f"{merged.directories[0]}: the shards gated {gated}, not --impl {impl}")
    configuration = first.get("configuration")
    print(f"under test: {gated} (as the shards ran it)" if configuration is None else
          "\n".join(shown_configuration(configuration)))
    policy, declared = records.policy_of(first), records.expectations_of(first)
    results = shards.in_plan_order([v for r in merged.records for v in records.judged(r)], merged.plan)
    verdict = verdicts.verdict_of_run(results, whole_catalog=merged.whole_catalog and not merged.interrupted,
                                      expectations=declared, policy=policy, required_levels=required)
    verdict.gaps[:0] = merged.gaps()
    verdict.interrupted = merged.interrupted
    print_summary(results, verdict, policy, quiet=True)
    environment = {**first["environment"], **(first["probe_model"] or {})}
    shown = [[d["index"], d["directory"], d["device"], d["exit_status"]] for d in shards.merged_doc(merged)["merged"]]
    shown += [[k, "(missing)", "", ""] for k in merged.missing]
    report_written(lambda: write_report(
        results, environment, out, policy=policy, run_verdict=verdict, probes=first["probes"],
        capabilities=first["capabilities"], expectations=declared, shard=shards.merged_doc(merged),
        configuration=configuration,
        sections=[(f"Shards merged ({len(merged.records)} of {merged.count})",
                   ["shard", "report directory", "device", "its own exit status"], sorted(shown))],
        extra=lambda report: copy_server_logs(merged.directories, report)))
    return verdict.exit_status

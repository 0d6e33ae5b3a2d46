"""``kvparity check``: the catalog quietly, answered with the exit status (for git bisect run);
with ``--shard K/N``, a deterministic share of it for ``kvparity merge``."""

from kvparity.reports.commands.base import (
    GATE_SETTINGS, UsageError, common_options, expectations_option, writable_directory,
)
from kvparity.reports.commands.generated import generated_options
from kvparity.reports.commands.runs import (
    exit_first_option, member_timeout_option, print_summary, report_written, require_levels_option, select_and_run,
    shard_of, shard_option, write_run_report,
)

NAME = "check"
HELP = "exit 0 if parity holds, 1 if it breaks, 125 if it cannot be judged (for git bisect run)"
DESCRIPTION = ("Run the catalog quietly and answer with the exit status: 0 parity holds, 1 parity broken, "
               "125 cannot judge here (git bisect run skips the commit), and above 127, which aborts a bisection "
               "rather than blaming a commit: 128 kvparity itself failed, 129 usage error (found before any work), "
               "130 interrupted. Made for `git bisect run kvparity check`, as it is. "
               "With --shard K/N it runs the K-th of N shares of the planned schedule runs (balanced by measured "
               "cost) and writes a report that kvparity merge combines with the other shards' into one verdict.")

# The settings it reads (reports/settings.py): the command line, else [tool.kvparity], else the default.
SETTINGS = GATE_SETTINGS
REQUIRED = ("impl",)


def arguments(command):
    common_options(command)
    command.add_argument("--schedule", metavar="FILE", action="append", help="check these schedule files only")
    expectations_option(command)
    require_levels_option(command)
    member_timeout_option(command)
    generated_options(command)
    exit_first_option(command)
    shard_option(command)
    command.add_argument("--out", metavar="DIR", help="also write a report directory under DIR")


def handle(args, settings):
    """Like run, for scripts and git bisect: the summary and an exit status."""
    shard = shard_of(settings, writes_report=bool(settings.out))
    if shard is not None and settings.exit_first:
        raise UsageError("--exit-first and --shard: a shard's report must hold its whole share for kvparity merge")
    if settings.out:
        writable_directory(settings.out, "--out")
    implementation, policy, results, verdict, declared, plan = select_and_run(settings, args.schedule, shard)
    print_summary(results, verdict, policy, quiet=True)
    if settings.out:
        report_written(lambda: write_run_report(settings, implementation, policy, results, verdict, declared,
                                                shard=plan))
    return verdict.exit_status

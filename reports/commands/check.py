"""``kvparity check``: the catalog quietly, answered with the exit status (for git bisect run)."""

from kvparity.reports.commands.base import common_options, expectations_option
from kvparity.reports.commands.runs import print_summary, select_and_run

NAME = "check"
HELP = "exit 0 if parity holds, 1 if it breaks, 125 if it cannot be judged (for git bisect run)"
DESCRIPTION = ("Run the catalog quietly and answer with the exit status: 0 parity holds, 1 parity broken, "
               "2 usage error (found before any work), 125 cannot judge here (git bisect run skips the commit), "
               "128 kvparity itself failed (aborts the bisection), 130 interrupted. Made for `git bisect run kvparity check ...`.")


def arguments(command):
    common_options(command)
    command.add_argument("--schedule", metavar="FILE", action="append", help="check these schedule files only")
    expectations_option(command)


def handle(args):
    """Like run, for scripts and git bisect: the summary and an exit status."""
    _, policy, results, verdict, _ = select_and_run(args, args.schedule)
    print_summary(results, verdict, policy, quiet=True)
    return verdict.exit_status

"""``kvparity replay``: one schedule file, row by row, with each row's first divergences."""

from kvparity.reports.commands.base import RUN_SETTINGS, common_options, expectations_option
from kvparity.reports.commands.runs import member_timeout_option, print_summary, select_and_run
from kvparity.suites.format.checks import HYGIENE, HYGIENE_CHECKS

NAME = "replay"
HELP = "replay one schedule file and show each row's first divergences"
DESCRIPTION = "Replay one schedule file row by row."

# The settings it reads (reports/settings.py): the command line, else [tool.kvparity], else the default.
SETTINGS = RUN_SETTINGS
REQUIRED = ("impl",)


def arguments(command):
    command.add_argument("file", metavar="FILE", help="schedule file (JSON)")
    common_options(command)
    expectations_option(command)
    member_timeout_option(command)


def handle(args, settings):
    _, policy, results, verdict, _, _ = select_and_run(settings, [args.file])
    print_summary(results, verdict, policy)
    for judged in results:
        result = judged.evidence
        print(f"\n{result.level} {result.schedule}: {judged.verdict}" + (f" ({result.reason})" if result.reason else ""))
        for row_verdict in judged.rows:
            row = row_verdict.evidence
            line = f"  row {row.request!r}: {row_verdict.verdict}, {row.checks} comparisons"
            if row.divergences:
                line += f", {len(row.divergences)} divergence(s); first:"
            print(line)
            # What failed the row first, then what informs (hygiene, declared), said not to gate.
            gating = sorted(row_verdict.failing, key=lambda d: d.order)[:5]
            informing = sorted(((k, d) for k, d in enumerate(row.divergences) if d not in row_verdict.failing),
                               key=lambda kd: kd[1].order)
            for d in gating:
                print(f"    {d.message()}")
            for k, d in informing[:max(5 - len(gating), 1)]:
                why = ("declared" if k in row_verdict.declared else
                       HYGIENE if d.check in HYGIENE_CHECKS else "within the policy's tier")
                print(f"    not gating ({why}): {d.message()}")
    return verdict.exit_status

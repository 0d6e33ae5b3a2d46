"""``kvparity compare``: a candidate trace directory against a golden one, with the L2 metrics."""

from kvparity.oracle.golden import GoldenError, check_same_machine, load_traces, read_golden
from kvparity.reports import verdicts
from kvparity.reports.commands.base import CannotRun, UsageError, policy
from kvparity.reports.commands.runs import print_summary
from kvparity.suites.core.evidence import ScheduleResult
from kvparity.suites.l2.run import compare_traces
from kvparity.suites.format.levels import L2

NAME = "compare"
HELP = "compare a candidate trace directory with a golden one"
DESCRIPTION = ("Compare two trace directories (from `kvparity record` or any engine writing the same format) with "
               "the L2 metrics. Traces from another device, backend or MLX version are refused.")

# The settings it reads (reports/settings.py): the command line, else [tool.kvparity], else the default.
SETTINGS = ("policy",)
REQUIRED = ()


def arguments(command):
    command.add_argument("golden", metavar="GOLDEN", help="the golden trace directory")
    command.add_argument("candidate", metavar="CANDIDATE", help="the candidate trace directory")
    command.add_argument("--policy", metavar="NAME|FILE", help="verdict policy (default: this backend's)")


def handle(args, settings):
    chosen_policy = policy(settings)
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
            result = ScheduleResult(name, L2, candidate["source"], ["trace"],
                                    reason="the candidate has no trace of this schedule")
            for rid in traces:
                result.row(rid)
        results.append(verdicts.judge(result, chosen_policy))
    verdict = verdicts.verdict_of_run(results)
    print_summary(results, verdict, chosen_policy)
    return verdict.exit_status

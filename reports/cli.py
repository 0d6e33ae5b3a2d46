"""The kvparity command line: ``main`` and its exit status.

Exit status, so that ``git bisect run kvparity check`` can trust it as it
is, with no mode to remember: 0 parity holds (with evidence), 1 parity
broken (a divergence or a refusal), 125 cannot judge here (the
implementation's module does not import, a backend or model is missing, a
golden comes from another machine, or the run gathered no evidence), and
above 127, which git bisect run takes as "abort the bisection", for what no
commit is to blame for: 128 an error inside the harness itself, 129 bad
usage or bad input (before any work; argparse's own errors too), 130
interrupted. The commands themselves live in ``kvparity.reports.commands``,
one module each.
"""

import os
import subprocess
import sys
import tempfile
import traceback

# Spelled out here rather than imported so that a harness that cannot even
# import its own modules still exits 128 (see main), not Python's 1, which
# git bisect run would read as "this commit is bad". verdicts.py defines the
# same values; a test holds them equal.
EXIT_OK, EXIT_BROKEN, EXIT_USAGE, EXIT_CANNOT_JUDGE = 0, 1, 129, 125
EXIT_HARNESS_ERROR = 128
EXIT_INTERRUPTED = 130


def internal_error() -> int:
    traceback.print_exc()
    print("kvparity: internal error (a bug in kvparity, not a parity verdict)", file=sys.stderr)
    return EXIT_HARNESS_ERROR


def main(argv=None) -> int:
    try:  # a harness that cannot import itself is its own failure, never the commit's
        from kvparity.reports.commands.base import CannotRun, UsageError, configure
        from kvparity.reports.commands.parser import build_parser
        from kvparity.reports.settings import SettingsError
        from kvparity.suites.schedule import ScheduleError

        parser = build_parser()
    except Exception:
        return internal_error()
    args = parser.parse_args(argv)  # a bad command line exits EXIT_USAGE (parser.py)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: run --workers hands it on
    try:
        configure(args, args.reads_settings, args.requires_settings)
        return args.func(args)
    except CannotRun as error:
        print(f"kvparity: cannot judge here: {error}", file=sys.stderr)
        return EXIT_CANNOT_JUDGE
    except (ScheduleError, SettingsError, UsageError) as error:
        print(f"kvparity: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvparity: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception:  # the harness's own bug: never blame the commit under test
        return internal_error()


# The commands the ``kvparity`` executable runs in a child process, so that a
# cache that crashes the process is that schedule run's FAIL and the rest
# goes on (suites/flight.py). ``python -m kvparity`` and ``main()`` run in
# process: the workers of --workers, and tests that patch the process.
ISOLATED_COMMANDS = ("run", "check")


def console() -> int:
    """The ``kvparity`` executable."""
    from kvparity.suites.flight import STATE_ENV

    argv = sys.argv[1:]
    # --workers runs its shards in processes of their own already.
    if (not argv or argv[0] not in ISOLATED_COMMANDS or os.environ.get(STATE_ENV)
            or any(a.startswith("--workers") for a in argv)):
        return main(argv)
    return isolated(argv)


def isolated(argv) -> int:
    """``kvparity ARGV`` in a child process, again after each crash: a child
    that a signal ends is named by its flight record (the schedule run, event
    and member it died in), and the next child judges that run a FAIL and
    goes on. Every other exit status is the child's own."""
    from kvparity.suites.flight import STATE_ENV, note_crash, read_flight, signal_name

    with tempfile.TemporaryDirectory(prefix="kvparity-isolated-") as state:
        environment = {**os.environ, STATE_ENV: state}
        crashed_in = set()
        while True:
            child = subprocess.Popen([sys.executable, "-m", "kvparity", *argv], env=environment)
            try:
                status = child.wait()
            except KeyboardInterrupt:  # the child has its own and ends with 130
                status = child.wait()
            if status >= 0:
                return status
            record = read_flight(state)
            label = record.get("label")
            if label is None or label in crashed_in:  # no schedule was running: nothing of ours to blame it on
                print(f"kvparity: the process died of {signal_name(status)} outside every schedule run",
                      file=sys.stderr)
                return EXIT_HARNESS_ERROR
            crashed_in.add(label)
            note_crash(state, record, status)
            where = f"at event {record['event']}" if record.get("event") else "before its first event"
            member = f" in {record['member']}" if record.get("member") else ""
            print(f"kvparity: {label}: the process died of {signal_name(status)}{member} {where}; "
                  "that run is a FAIL and the rest goes on in a new process", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())

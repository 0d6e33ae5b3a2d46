"""The kvparity command line: ``main`` and its exit status.

Exit status, so that ``git bisect run kvparity check`` can trust it as it
is, with no mode to remember: 0 parity holds (with evidence), 1 parity
broken (a divergence or a refusal), 125 cannot judge here (the
implementation's module does not import, a backend or model is missing, a
golden comes from another machine, or the run gathered no evidence), and
above 127, which git bisect run takes as "abort the bisection", for what no
commit is to blame for: 128 an error inside the harness itself, 129 bad
usage or bad input (before any work; argparse's own errors too), 130
interrupted (Ctrl-C, SIGTERM, SIGHUP: what finished is reported as such). A
disk that is full or read-only where kvparity must write is 125; a report
directory that cannot be written keeps the verdict's status and says so. The
commands themselves live in ``kvparity.reports.commands``, one module each.
"""

import errno
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Spelled out here rather than imported so that a harness that cannot even
# import its own modules still exits 128 (see main), not Python's 1, which
# git bisect run would read as "this commit is bad". verdicts.py defines the
# same values; a test holds them equal.
EXIT_OK, EXIT_BROKEN, EXIT_USAGE, EXIT_CANNOT_JUDGE = 0, 1, 129, 125
EXIT_HARNESS_ERROR = 128
EXIT_INTERRUPTED = 130
# A disk that is full, over quota, read-only or failing: the machine's
# state, not kvparity's bug (report directories say so themselves: writer.py).
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


def internal_error() -> int:
    traceback.print_exc()
    print("kvparity: internal error (a bug in kvparity, not a parity verdict)", file=sys.stderr)
    return EXIT_HARNESS_ERROR


def main(argv=None) -> int:
    try:  # a harness that cannot import itself is its own failure, never the commit's
        from kvparity.reports.commands.base import CannotRun, UsageError, settings_of
        from kvparity.reports.commands.parser import build_parser
        from kvparity.reports.settings import SettingsError
        from kvparity.suites.core.flight import STATE_ENV, remove_if_orphaned
        from kvparity.suites.core.processes import stop_signal, stopping_on_signals
        from kvparity.suites.format.errors import ScheduleError

        parser = build_parser()
    except KeyboardInterrupt:  # Ctrl-C while kvparity starts
        return EXIT_INTERRUPTED
    except Exception:
        return internal_error()
    if os.environ.get(STATE_ENV):  # an isolated child: its temporary folders go where its parent removes them
        tempfile.tempdir = str(Path(os.environ[STATE_ENV]) / "tmp")
    args = parser.parse_args(argv)  # a bad command line exits EXIT_USAGE (parser.py)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: run --workers hands it on
    try:
        # SIGTERM and SIGHUP stop a run as Ctrl-C does: through every finally and with exit.
        with stopping_on_signals():
            return args.func(args, settings_of(args))
    except CannotRun as error:
        print(f"kvparity: cannot judge here: {error}", file=sys.stderr)
        return EXIT_CANNOT_JUDGE
    except (ScheduleError, SettingsError, UsageError) as error:
        print(f"kvparity: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"kvparity: interrupted ({stop_signal() or 'SIGINT'})", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as error:
        where = f" {error.filename}" if error.filename else ""
        if error.errno == errno.ENAMETOOLONG:  # a path given (--out, --policy, ...) no file system takes
            print(f"kvparity:{where}: {error.strerror}", file=sys.stderr)
            return EXIT_USAGE
        if error.errno not in DISK_ERRORS:
            return internal_error()
        print(f"kvparity: cannot judge here: cannot write{where}: {error.strerror}", file=sys.stderr)
        return EXIT_CANNOT_JUDGE
    except Exception:  # the harness's own bug: never blame the commit under test
        return internal_error()
    finally:
        if os.environ.get(STATE_ENV):  # an isolated child
            remove_if_orphaned(os.environ[STATE_ENV])


# The commands the ``kvparity`` executable runs in a child process, so that a
# cache that crashes the process or hangs in a member is that schedule run's
# FAIL and the rest goes on (suites/core/flight.py); ``replay`` too, as a fuzz
# campaign's crash or hang is replayed. ``python -m kvparity`` and
# ``main()`` run in process: the children themselves, and tests that patch
# the process. ``run --workers`` runs each worker so (run.in_workers).
ISOLATED_COMMANDS = ("run", "check", "replay")
POLL_S = 0.1  # how often the parent looks at its child and its flight record


def console() -> int:
    """The ``kvparity`` executable."""
    from kvparity.suites.core.flight import STATE_ENV

    argv = sys.argv[1:]
    if (not argv or argv[0] not in ISOLATED_COMMANDS or os.environ.get(STATE_ENV)
            or any(a.startswith("--workers") for a in argv)):
        return main(argv)
    return isolated(argv)


class Stop:
    """The parent's side of a stop signal: the first one's name and time;
    each one is handed on to the child, which unwinds and reports."""

    def __init__(self):
        self.signal, self.since, self.child = None, None, None

    def __call__(self, signum, frame):
        import signal

        if self.signal is None:
            self.signal, self.since = signal.Signals(signum).name, time.monotonic()
        if self.child is not None and self.child.returncode is None:
            try:
                os.kill(self.child.pid, signum)
            except ProcessLookupError:
                pass


def isolated(argv) -> int:
    """``kvparity ARGV`` in a child process, again after each crash or hang:
    a child that a crash ends (suites/core/processes.py says which signals are a
    crash's) is named by its flight record (the schedule run, event and
    member it died in), and so is one whose member does not return within
    the member timeout the record states (this process kills it); the next
    child judges that run a FAIL and goes on. A signal to this process is
    handed on to the child, which reports what finished as interrupted; a
    child that has not ended ``STOP_GRACE_S`` later is killed with all it
    started. Every other exit status is the child's own. Nothing it or its
    children started outlives it: it is their subreaper, and the child's
    temporary folders are in its state folder (Python's; MLX's compiled
    kernels stay where they are kept between runs)."""
    import signal

    from kvparity.oracle.signals import signal_name
    from kvparity.suites.core.flight import (
        STATE_ENV, clear_flight, ended, how_it_ended, mark_parent, note_crash, read_flight,
    )
    from kvparity.suites.core.processes import (
        STOP_GRACE_S, STOP_SIGNALS, become_subreaper, die_with_parent, died_of_a_crash, oom_kills, sweep,
    )

    become_subreaper()
    stop = Stop()
    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        with tempfile.TemporaryDirectory(prefix="kvparity-isolated-") as state:
            (Path(state) / "tmp").mkdir()
            mark_parent(state)
            environment = {**os.environ, STATE_ENV: state}
            crashed_in = set()
            while stop.signal is None:
                before = oom_kills()
                clear_flight(state)  # the last child's record is not this one's
                stop.child = subprocess.Popen([sys.executable, "-m", "kvparity", *argv], env=environment,
                                              preexec_fn=die_with_parent)
                status, hung = supervise(stop.child, state, stop)
                sweep()  # what it left: L4 servers and daemons re-parented here
                if status >= 0:  # the child's own (an interrupted one's is EXIT_INTERRUPTED)
                    return status
                if stop.signal is not None:  # the signal ended it before its handler was in, or the grace did
                    print(f"kvparity: interrupted ({stop.signal}); the process running the schedules ended by "
                          f"{signal_name(status)} before it reported (it has {STOP_GRACE_S:g} s)", file=sys.stderr)
                    return EXIT_INTERRUPTED
                record = ended(read_flight(state) or {}, status, hung)
                label = record.get("label")
                if hung is None and not died_of_a_crash(status, before, oom_kills()):
                    print(f"kvparity: the process running the schedules was stopped by {signal_name(status)} "
                          "from outside: interrupted", file=sys.stderr)
                    return EXIT_INTERRUPTED
                if label is None or label in crashed_in:  # no schedule was running: nothing of ours to blame it on
                    print(f"kvparity: {how_it_ended(record, in_a_run=False)} outside every schedule run",
                          file=sys.stderr)
                    return EXIT_HARNESS_ERROR
                crashed_in.add(label)
                note_crash(state, record)
                how = how_it_ended(record) + ("; it was stopped" if hung is not None else "")
                print(f"kvparity: {label}: {how}; that run is a FAIL and the rest goes on in a new process",
                      file=sys.stderr, flush=True)
            print(f"kvparity: interrupted ({stop.signal})", file=sys.stderr)
            return EXIT_INTERRUPTED
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def supervise(child, state, stop: Stop):
    """Wait for ``child``: (its status, the member timeout it overran or
    None). It is killed with everything below it once it overruns the
    member timeout its flight record states, or ``STOP_GRACE_S`` after a
    stop signal."""
    from kvparity.suites.core.flight import Watch
    from kvparity.suites.core.processes import STOP_GRACE_S, descendants, kill_all

    def kill():
        kill_all(descendants(child.pid))
        child.kill()

    watch, hung = Watch(state), None
    while True:
        try:
            return child.wait(timeout=POLL_S), hung
        except subprocess.TimeoutExpired:
            pass
        if stop.since is not None:
            if time.monotonic() - stop.since >= STOP_GRACE_S:
                kill()
            continue
        overrun = watch.overrun() if hung is None else None
        if overrun is not None:
            hung = overrun["timeout"]
            kill()


if __name__ == "__main__":  # python -m kvparity.reports.cli: as the kvparity executable (run --workers' workers)
    sys.exit(console())

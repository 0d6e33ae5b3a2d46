"""The processes a run starts, and how everything it started is stopped.

A run starts children (the isolated child of ``kvparity run`` and
``check``, the workers of ``--workers`` and ``fuzz``, L4's servers), and
they start their own: a server's workers, a daemon that double-forks out of
its group. What stops a run from outside is one of ``STOP_SIGNALS``:
Ctrl-C, what ``timeout``, ``kill``, systemd and CI runners send (SIGTERM),
a closed terminal (SIGHUP). Inside ``stopping_on_signals`` the first of
them is a ``KeyboardInterrupt`` that unwinds the run through its
``finally`` blocks and ``with`` exits (servers stopped, temporary folders
removed, what finished reported as interrupted); later ones are held, so
that a signal sent to a whole process group (parent and child both get it)
or Ctrl-C pressed twice does not cut that report short. The process that
watches the others becomes the child subreaper of its tree where Linux
offers it (``prctl(PR_SET_CHILD_SUBREAPER)``): what a child leaves behind is
re-parented to it, not to init, and ``sweep`` finds it in /proc and stops it.

A child that a signal ended was stopped from outside, unless the signal is
one a crash gives: ``CRASH_SIGNALS``, or SIGKILL where memory ran out (the
kernel's count of out-of-memory kills rose while the child ran; where the
kernel keeps no count, a SIGKILL is taken for the out-of-memory killer's).
"""

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
CRASH_SIGNALS = tuple(getattr(signal, name) for name in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")
                      if hasattr(signal, name))
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36  # linux/prctl.h
REAP_S = 2.0  # how long a sweep waits for what it killed to be gone
# How long a process kvparity stopped with a signal has to unwind and report
# what finished before it is killed with all it started. 3 s was too short on a
# 2-core CI machine under load: the stopped run's report was not written in time.
STOP_GRACE_S = 10.0


# -- stop signals, made Ctrl-C ------------------------------------------------------


class _Stopping:
    depth = 0  # stopping_on_signals blocks open, one inside another
    first: Optional[str] = None  # the first stop signal the outermost block received


def stop_signal() -> Optional[str]:
    """The name of the first stop signal received inside the outermost
    ``stopping_on_signals`` now open (or the last one closed), else None."""
    return _Stopping.first


def _interrupt(signum, frame):
    if _Stopping.first is None:
        _Stopping.first = signal.Signals(signum).name
        raise KeyboardInterrupt(_Stopping.first)
    # Later ones are held: the run is already winding down.


@contextmanager
def stopping_on_signals():
    """While inside, the first of SIGINT, SIGTERM and SIGHUP raises
    KeyboardInterrupt (its argument: the signal's name), and later ones are
    held, so that the run unwinds once, through its ``finally`` blocks and
    ``with`` exits. Only the main thread receives signals; elsewhere this
    does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _Stopping.depth == 0:
        _Stopping.first = None
    previous = {signum: signal.signal(signum, _interrupt) for signum in STOP_SIGNALS}
    _Stopping.depth += 1
    try:
        yield
    finally:
        _Stopping.depth -= 1
        for signum, handler in previous.items():
            # None: a handler not installed from Python; the default is what it was.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


@contextmanager
def signals_deferred():
    """The stop signals are held until the block ends, then delivered: a
    second Ctrl-C while something is being stopped must not leave it half
    stopped. (Handlers, not a signal mask: Python runs its handlers in the
    main thread whichever thread the kernel picks.)"""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread is interrupted by signals
        return
    held: List[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: held.append(signum)) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(held):  # each once, in the order they came
            signal.raise_signal(signum)


# -- the process tree, through /proc (Linux) -------------------------------------------
# A process is named by its pid and its start time, so that a pid reused
# after its process ended is never taken for it.


def _proc_stat(pid: int) -> Optional[Tuple[str, int, str]]:
    """(state, ppid, start time) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            line = stat.read()
    except OSError:
        return None
    # The command name, in parentheses, may hold spaces and parentheses.
    fields = line[line.rfind(")") + 2:].split()
    return fields[0], int(fields[1]), fields[19]


def _living() -> Dict[int, Tuple[int, str]]:
    """Every living process -> (its parent, its start time); {} without /proc."""
    found = {}
    if os.path.isdir("/proc"):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = _proc_stat(int(entry))
                if stat is not None and stat[0] != "Z":
                    found[int(entry)] = stat[1], stat[2]
    return found


def descendants(root: int) -> Dict[int, str]:
    """Every living process below ``root`` -> its start time; {} without /proc."""
    children: Dict[int, List[Tuple[int, str]]] = {}
    for pid, (parent, started) in _living().items():
        children.setdefault(parent, []).append((pid, started))
    found: Dict[int, str] = {}
    frontier = [root]
    while frontier:  # each pid is visited once: bounded by the table
        for pid, started in children.get(frontier.pop(), ()):
            if pid not in found:
                found[pid] = started
                frontier.append(pid)
    return found


def marked(name: str, value: str) -> Dict[int, str]:
    """Every living process whose environment holds ``name=value`` -> its
    start time: what a server started inherits, even a daemon that left its
    process group and its parent; {} without /proc."""
    wanted = f"{name}={value}".encode()
    found = {}
    for pid, (_, started) in _living().items():
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if wanted in environ.read().split(b"\0"):
                    found[pid] = started
        except OSError:  # gone, or another user's
            pass
    return found


def still_running(pid: int, started: str) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z" and stat[2] == started


def kill_all(processes: Dict[int, str], signum: int = signal.SIGKILL):
    """Signal each process of ``processes`` (pid -> start time) still running as itself."""
    for pid, started in processes.items():
        if still_running(pid, started):
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass


def _prctl(option: int, value: int) -> bool:
    """Linux's prctl(option, value); False where the system has none."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux):
    an orphan among them is re-parented here, not to init. False where the
    system offers none."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent() -> bool:
    """SIGTERM this process when its parent dies (Linux), as if the stop
    that killed the parent (a SIGKILL it cannot hand on) had reached it: a
    ``Popen`` preexec_fn, or a worker's first call."""
    return _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def sweep(timeout: float = REAP_S) -> List[int]:
    """SIGKILL every process below this one and reap those re-parented
    here (a subreaper's), for up to ``timeout`` seconds; the pids killed."""
    killed: List[int] = []
    deadline = time.monotonic() + timeout
    while True:
        left = descendants(os.getpid())
        if not left:
            break
        kill_all(left)
        killed += [pid for pid in left if pid not in killed]
        for pid in left:
            try:
                os.waitpid(pid, os.WNOHANG)  # ours once adopted; another's child is its parent's to reap
            except ChildProcessError:
                pass
        if time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    return killed


# -- how a child ended -----------------------------------------------------------------


def oom_kills() -> Optional[int]:
    """The kernel's count of processes killed for want of memory (Linux's
    /proc/vmstat oom_kill, every cgroup's), or None where it keeps none."""
    try:
        with open("/proc/vmstat") as vmstat:
            for line in vmstat:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def died_of_a_crash(returncode: int, oom_before: Optional[int], oom_after: Optional[int]) -> bool:
    """Whether a child that signal ``-returncode`` ended crashed (a fault
    in native code, an abort, the out-of-memory killer) rather than being
    stopped from outside."""
    signum = -returncode
    if signum in CRASH_SIGNALS:
        return True
    if signum == signal.SIGKILL:
        return oom_before is None or oom_after is None or oom_after > oom_before
    return False

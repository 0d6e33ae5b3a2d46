"""The HTTP server under test at L4: started, waited for, and stopped.

``LaunchedServer`` runs a command template (``python -m mlx_lm.server
--model {model} --port {port}``) on a free loopback port, in its own session
so that the server and every process it starts form one process group, with
its output appended to a log file. It is ready when ``GET /v1/models``
answers OpenAI's model list. Leaving the ``with`` block, however it is left,
stops the whole group; descendants that left the group, and daemons that
double-forked away from it, are found through ``/proc`` where there is one
(the ones it saw, and every process holding the launch's ``MARK`` in its
environment); a stop that an interrupted run makes gives the server
``INTERRUPTED_GRACE`` to exit, not ``STOP_GRACE``. ``AttachedServer`` is the same interface for a
server the user runs (``--url``): checked, never stopped.

Problems are ``ServerProblem``s whose message is one line and whose
``log_tail`` holds the server's last lines of output.
"""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from kvparity.oracle.signals import signal_name
from kvparity.suites.core.processes import descendants, kill_all, marked, signals_deferred

READY_PATH = "/v1/models"  # every OpenAI-compatible server lists its models here
SERVER_LOGS = "server-logs"  # the report directory's folder of the servers' logs
PROBE_TIMEOUT = 2.0  # seconds per readiness request
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
TAIL_BYTES = 64 * 1024  # how much of the log's end is read for its last lines
REAP_TIMEOUT = 10.0  # seconds to wait for a SIGKILLed server to be reaped
STOP_GRACE = 10.0  # seconds a server has to exit after SIGTERM
INTERRUPTED_GRACE = 1.0  # ... when the run was interrupted: what stops a run must stop it soon
# Every process a launched server starts inherits this variable, whose value
# is that launch's own: a daemon that left the server's group and parent is
# still found by it.
MARK = "KVPARITY_SERVER"
# Loopback only, never through a proxy: urllib honours http_proxy, which
# would send the probe to another machine.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerProblem(Exception):
    """The server under test could not be used; ``log_tail`` is the end of
    its log ("" if there is none)."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


class ServerUsageError(ServerProblem):
    """The user's input is wrong: the command template or the --url."""


class ServerNeverReady(ServerProblem):
    """Still running, but its readiness endpoint never answered in time."""


class ServerDied(ServerProblem):
    """The server exited before it was ready, or while serving."""


class ServerGarbage(ServerProblem):
    """The readiness endpoint answered 200 with something other than
    OpenAI's model list."""


def command_line(template: str, model, port: int, search_path: Optional[str] = None) -> List[str]:
    """The template split as a shell would (no shell runs it), with
    ``{model}`` and ``{port}`` replaced inside each word; its executable is
    looked up on ``search_path`` (default: this process's PATH)."""

    def refuse(reason: str):
        raise ServerUsageError(f"server command {template!r}: {reason}")

    if not template.strip():
        refuse("the command is empty")
    try:
        words = shlex.split(template)
    except ValueError as error:  # "No closing quotation"
        refuse(f"cannot be split into words ({error})")
    if not any("{port}" in word for word in words):
        refuse("has no {port} placeholder (the harness chooses a free port and must tell the server)")
    values = {"model": str(model), "port": str(port)}
    # One pass, so a model path that happens to contain "{port}" stays as it is.
    argv = [re.sub(r"\{(model|port)\}", lambda match: values[match.group(1)], word) for word in words]
    executable = argv[0]
    if os.sep in executable:  # a path: taken as it is, relative to the working directory
        if not os.path.exists(executable):
            refuse(f"executable {executable!r} does not exist")
        if os.path.isdir(executable) or not os.access(executable, os.X_OK):
            refuse(f"{executable!r} is not an executable file")
    elif shutil.which(executable, path=search_path) is None:
        refuse(f"executable {executable!r} is not found on PATH")
    return argv


def loopback_url(url: str) -> str:
    """``url`` as a base URL without a trailing slash, if it is plain http to
    this machine's loopback with a port: the harness talks to no other host."""

    def refuse(reason: str):
        raise ServerUsageError(f"--url {url!r}: {reason}; give e.g. http://127.0.0.1:8080")

    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme != "http":
        refuse("the scheme must be http")
    if parts.hostname not in LOOPBACK_HOSTS or parts.username or parts.password:
        refuse("the host must be 127.0.0.1, localhost or [::1]")
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        port = 0
    if not port:
        refuse("a port between 1 and 65535 is needed")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        refuse(f"only the server's base URL, without a path ({READY_PATH} is added)")
    host = "[::1]" if parts.hostname == "::1" else parts.hostname
    return f"http://{host}:{port}"


def free_port() -> int:
    """A port nothing listens on now (the kernel's choice). Another process
    could take it before the server binds it; the server then dies of
    "address in use", which the log tail shows."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def probe(url: str, timeout: float = PROBE_TIMEOUT) -> Tuple[bool, str]:
    """(ready, what was seen) for one ``GET {url}/v1/models``. Not answering
    or answering an error status is "not ready yet" (a server may answer
    503 while it loads); a 200 that is not OpenAI's list raises ServerGarbage."""
    try:
        with _OPENER.open(url + READY_PATH, timeout=timeout) as response:
            status, body = response.status, response.read(TAIL_BYTES)
    except urllib.error.HTTPError as error:
        error.close()
        return False, f"HTTP {error.code}"
    except (urllib.error.URLError, OSError) as error:  # refused, reset, timed out
        reason = getattr(error, "reason", error)
        return False, str(reason) or type(reason).__name__
    if status != 200:
        return False, f"HTTP {status}"
    try:
        listing = json.loads(body)
    except ValueError:
        listing = None
    if not (isinstance(listing, dict) and isinstance(listing.get("data"), list)):
        got = repr(body[:200].decode("utf-8", "replace")) if body else "an empty body"
        raise ServerGarbage(f"{url}{READY_PATH} answered HTTP 200 but not with OpenAI's model list "
                            f'{{"data": [...]}}; it answered {got}')
    return True, "HTTP 200"


def how_it_ended(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal_name(returncode)}"
    return f"exited with status {returncode}"


def _signal_group(pgid: int, signum: int):
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):  # the group is gone
        pass


class LaunchedServer:
    """A server this process starts from ``template`` and stops on leaving
    the ``with`` block. ``env`` is the server's whole environment (None:
    this process's); PYTHONUNBUFFERED=1 is added unless it is set, so that a
    Python server's log is complete up to the moment it dies."""

    def __init__(self, template: str, model, log_path, ready_timeout: float = 300.0, poll: float = 0.2,
                 env: Optional[Dict[str, str]] = None, shown_log: Optional[str] = None):
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.env[MARK] = uuid.uuid4().hex
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = command_line(template, model, self.port, search_path=self.env.get("PATH"))
        self.log_path = Path(log_path)
        self.shown_log = shown_log or str(self.log_path)  # how messages name the log: where the user finds it
        self.ready_timeout = ready_timeout
        self.poll = max(poll, 0.01)
        self.process: Optional[subprocess.Popen] = None
        self._log = None
        self._log_start = 0  # where this run's output begins in an appended log
        self._seen: Dict[int, str] = {}  # descendants seen so far -> start time
        self._stopped = False

    def __enter__(self):
        self._start()
        try:
            self._wait_until_ready()
        except ServerProblem as problem:
            self.stop()
            problem.log_tail = self.log_tail()  # after stopping: the server's last words included
            raise
        except BaseException:  # Ctrl-C while waiting
            self.stop(INTERRUPTED_GRACE)
            raise
        return self

    def __exit__(self, kind, error, trace):
        self.stop(INTERRUPTED_GRACE if kind is not None and issubclass(kind, KeyboardInterrupt) else STOP_GRACE)
        return False

    def _start(self):
        if self.process is not None:
            raise RuntimeError("a LaunchedServer starts once; make another")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._log.write(f"[kvparity] starting: {shlex.join(self.command)}\n".encode())
        self._log.flush()
        self._log_start = self._log.tell()
        try:
            # Its own session: the server and its children are one process
            # group, stopped together, and a Ctrl-C at the terminal reaches
            # only this process, which stops them in order.
            self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self._log,
                                            stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        except OSError as error:  # found by command_line, yet not runnable (no #! line, a race)
            self._log.close()
            raise ServerUsageError(f"server command {shlex.join(self.command)!r} cannot be run: {error}")

    def _wait_until_ready(self):
        deadline = time.monotonic() + self.ready_timeout
        seen = "nothing yet"
        for _ in range(int(self.ready_timeout / self.poll) + 2):  # the deadline ends it sooner
            self._remember_descendants()
            if self.process.poll() is not None:
                raise ServerDied(f"the server {how_it_ended(self.process.returncode)} before it was ready "
                                 f"at {self.url}{self._last_line()}; log: {self.shown_log}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                ready, seen = probe(self.url, timeout=min(PROBE_TIMEOUT, remaining))
            except ServerGarbage as garbage:  # the server's log often says why
                raise ServerGarbage(f"{garbage}{self._last_line()}; log: {self.shown_log}") from None
            if ready:
                return
            time.sleep(min(self.poll, max(deadline - time.monotonic(), 0)))
        raise ServerNeverReady(f"the server did not answer {self.url}{READY_PATH} within "
                               f"{self.ready_timeout:g} s (last: {seen}){self._last_line()}; it was stopped; "
                               f"log: {self.shown_log}")

    def check_alive(self):
        """Raise ServerDied if the server has exited (or was never started)."""
        if self.process is None:
            raise ServerDied(f"the server for {self.url} was never started")
        self._remember_descendants()
        if self.process.poll() is not None:
            message = "was stopped" if self._stopped else how_it_ended(self.process.returncode)
            self.stop()  # its children may still run
            raise ServerDied(f"the server at {self.url} {message} while serving{self._last_line()}; "
                             f"log: {self.shown_log}", self.log_tail())

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines this run wrote to the log."""
        try:
            with open(self.log_path, "rb") as log:
                size = log.seek(0, os.SEEK_END)
                log.seek(max(self._log_start, size - TAIL_BYTES))
                text = log.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _last_line(self) -> str:
        # The last line with words: a traceback's log ends in a row of dashes.
        last = next((line for line in reversed(self.log_tail().splitlines()) if any(c.isalnum() for c in line)), "")
        return f"; its last line: {last.strip()[:200]!r}" if last else ""

    def _remember_descendants(self):
        # Taken while the server lives: once it exits, its children are
        # adopted by init and no ppid link leads to them any more.
        if self.process is not None and self.process.poll() is None:
            self._seen.update(descendants(self.process.pid))

    def stop(self, grace: float = STOP_GRACE):
        """SIGTERM the server's process group, SIGKILL it after ``grace``
        seconds, SIGKILL the descendants that left the group and every
        process that carries this launch's mark (a daemon that double-forked
        away), reap the server. Does nothing if it is not running or was stopped."""
        if self.process is None or self._stopped:
            return
        with signals_deferred():
            self._remember_descendants()
            group = self.process.pid  # the session leader's pid is its group's id
            _signal_group(group, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            # Whatever of the group outlived the server, or the grace.
            _signal_group(group, signal.SIGKILL)
            kill_all(self._seen)  # those that left the group (setsid)
            kill_all(marked(MARK, self.env[MARK]))
            try:
                self.process.wait(timeout=REAP_TIMEOUT)
            except subprocess.TimeoutExpired:  # stuck in the kernel; Popen reaps it later
                pass
            if self._log is not None:
                self._log.close()
            self._stopped = True


class AttachedServer:
    """A server the user already runs (``--url``): checked once on entering,
    never stopped, no log."""

    def __init__(self, url: str):
        self.url = loopback_url(url)
        self.command: List[str] = []
        self.process = None

    def __enter__(self):
        ready, seen = probe(self.url)
        if not ready:
            raise ServerNeverReady(f"nothing answers at {self.url}{READY_PATH} ({seen}); "
                                   "is the server running on that port?")
        return self

    def __exit__(self, *exc):
        return False

    def check_alive(self):
        """ServerDied only when the port refuses connections: a busy server
        may be slow to answer, and that is not death."""
        try:
            with socket.create_connection(self._address(), timeout=PROBE_TIMEOUT):
                pass
        except ConnectionRefusedError:
            raise ServerDied(f"nothing listens at {self.url} any more")
        except OSError:
            pass

    def _address(self) -> Tuple[str, int]:
        parts = urllib.parse.urlsplit(self.url)
        return parts.hostname, parts.port

    def log_tail(self, lines: int = 20) -> str:
        return ""

    def stop(self, grace: float = STOP_GRACE):
        pass  # not ours to stop

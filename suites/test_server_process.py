"""The L4 server's start and stop, against a small fake OpenAI server: ready
when /v1/models answers, each way of failing named with the log's tail, and
no process left behind however the ``with`` block is left (normally, by an
exception, by a signal)."""

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import kvparity
from kvparity.suites.core.processes import stopping_on_signals
from kvparity.suites.l4.server_process import (AttachedServer, LaunchedServer, ServerDied, ServerGarbage,
                                            ServerNeverReady, ServerProblem, ServerUsageError, command_line, free_port,
                                            loopback_url)

# argv: MODE PORT [PIDFILE]. Modes: ok, never (sleeps, never listens), dies
# (exit 3), garbage (HTML on /v1/models), stubborn (ignores SIGTERM), grandchild / escaped (starts a
# sleeping child, in its group or in a session of its own, pid to PIDFILE), daemon (double-forks one:
# its parent exits at once, so no parent link leads from the server to it).
FAKE_SERVER = textwrap.dedent('''
    import json, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "never":
        print("fake server: loading forever", flush=True)
        time.sleep(300)
    if mode == "dies":
        print("fake server: cannot load the model", file=sys.stderr, flush=True)
        sys.exit(3)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode in ("grandchild", "escaped"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                 start_new_session=mode == "escaped")
        with open(sys.argv[3], "w") as pidfile:
            pidfile.write(str(child.pid))
    if mode == "daemon":
        import os
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                with open(sys.argv[3], "w") as pidfile:
                    pidfile.write(str(os.getpid()))
                time.sleep(300)
            os._exit(0)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/v1/models":
                self.send_error(404)
                return
            if mode == "garbage":
                body, kind = b"<html><body>It works!</body></html>", "text/html"
            else:
                body, kind = json.dumps({"object": "list", "data": [{"id": "m"}]}).encode(), "application/json"
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    print(f"fake server: listening on {port}", flush=True)
    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')

# Run by test_a_signal_stops_the_server: the harness's own use, in a child process.
SIGNALLED = textwrap.dedent('''
    import signal, sys, time
    from pathlib import Path
    from kvparity.suites.core.processes import stopping_on_signals
    from kvparity.suites.l4.server_process import LaunchedServer

    template, model, log, pidfile = sys.argv[1:5]
    # As at a terminal: a background job may start with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with stopping_on_signals(), LaunchedServer(template, model, log, ready_timeout=15, poll=0.05) as server:
        Path(pidfile).write_text(str(server.process.pid))
        time.sleep(60)
''')

HAS_PROC = os.path.isdir("/proc")


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie whose parent has not reaped it yet
    holds no resources, and os.kill(pid, 0) still succeeds on it)."""
    if HAS_PROC:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat[stat.rfind(")") + 2] != "Z"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def gone(*pids: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    for _ in range(int(within / 0.02) + 1):
        if not any(running(pid) for pid in pids) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return not any(running(pid) for pid in pids)


def wait_for_file(path: Path, within: float = 15.0) -> str:
    deadline = time.monotonic() + within
    for _ in range(int(within / 0.02) + 1):
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    raise AssertionError(f"{path} was not written within {within} s")


@pytest.fixture
def fake(tmp_path):
    """A template for the fake server in ``mode``; {model} names its pid file."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)

    def template(mode: str) -> str:
        return f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {mode} {{port}} {{model}}"
    return template


def launched(template: str, tmp_path, **options) -> LaunchedServer:
    options = {"ready_timeout": 10.0, "poll": 0.05, **options}
    return LaunchedServer(template, tmp_path / "grandchild.pid", tmp_path / "logs" / "server.log", **options)


def refused(server, problem: type) -> ServerProblem:
    """What entering ``server`` raised, of type ``problem``, its message on one line."""
    with pytest.raises(problem) as raised:
        with server:
            pytest.fail(f"entered a server that should have raised {problem.__name__}")
    assert "\n" not in str(raised.value), str(raised.value)
    return raised.value


def models(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/models", timeout=5) as response:
        return json.loads(response.read())


def test_ready_then_stopped_with_its_output_in_the_log(fake, tmp_path):
    server = launched(fake("ok"), tmp_path)
    with server:
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert server.command[-2:] == [str(server.port), str(tmp_path / "grandchild.pid")]
        assert models(server.url)["data"] == [{"id": "m"}]
        server.check_alive()
        pid = server.process.pid
    assert gone(pid)
    log = (tmp_path / "logs" / "server.log").read_text()
    assert f"fake server: listening on {server.port}" in log
    assert '"GET /v1/models HTTP/1.1" 200' in log  # the server's own stderr
    assert f"listening on {server.port}" in server.log_tail()
    server.stop()  # again: nothing to do
    with pytest.raises(ServerDied, match="was stopped"):
        server.check_alive()


def test_never_ready_is_stopped_and_named(fake, tmp_path):
    server = launched(fake("never"), tmp_path, ready_timeout=0.5)
    started = time.monotonic()
    problem = refused(server, ServerNeverReady)
    assert time.monotonic() - started < 5
    message = str(problem)
    assert "within 0.5 s" in message and "refused" in message, message
    assert "fake server: loading forever" in problem.log_tail
    assert gone(server.process.pid)


def test_died_at_start_names_its_status_and_last_words(fake, tmp_path):
    problem = refused(launched(fake("dies"), tmp_path, shown_log="server-logs/x.log in the report directory"),
                      ServerDied)
    message = str(problem)
    assert "exited with status 3 before it was ready" in message, message
    assert message.endswith("; log: server-logs/x.log in the report directory"), message  # where the user finds it
    assert "cannot load the model" in message
    assert "fake server: cannot load the model" in problem.log_tail


def test_a_second_run_appends_and_its_tail_is_its_own(fake, tmp_path):
    for _ in range(2):
        with pytest.raises(ServerDied) as raised:
            with launched(fake("dies"), tmp_path):
                pass
        assert raised.value.log_tail.count("cannot load the model") == 1
    assert (tmp_path / "logs" / "server.log").read_text().count("cannot load the model") == 2


def test_garbage_says_what_it_got(fake, tmp_path):
    server = launched(fake("garbage"), tmp_path)
    problem = refused(server, ServerGarbage)
    message = str(problem)
    assert "<html><body>It works!" in message and '{"data": [...]}' in message, message
    assert "listening on" in problem.log_tail
    assert gone(server.process.pid)


def test_an_empty_200_is_garbage_and_the_servers_last_words_are_named(tmp_path):
    # As mlx-lm 0.32's server does where the Hugging Face cache folder is
    # missing: 200 and its headers, then a traceback instead of the body.
    script = tmp_path / "empty.py"
    script.write_text(textwrap.dedent('''
        import sys
        from http.server import BaseHTTPRequestHandler, HTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()
                raise FileNotFoundError("Cache directory not found")

        HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
    '''))
    problem = refused(launched(f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {{port}}", tmp_path),
                      ServerGarbage)
    message = str(problem)
    assert "it answered an empty body" in message, message
    assert "its last line: 'FileNotFoundError: Cache directory not found'" in message, message
    assert "Traceback" in problem.log_tail


@pytest.mark.parametrize("mode", ["grandchild", *(pytest.param(mode, marks=pytest.mark.skipif(
    not HAS_PROC, reason="a child in its own session is found through /proc")) for mode in ("escaped", "daemon"))])
def test_no_process_left_after_the_block(fake, tmp_path, mode):
    with launched(fake(mode), tmp_path) as server:
        grandchild = int(wait_for_file(tmp_path / "grandchild.pid"))
        assert running(grandchild)
    assert gone(server.process.pid, grandchild)


def test_no_process_left_after_an_exception_and_the_exception_kept(fake, tmp_path):
    with pytest.raises(RuntimeError, match="the test failed"):
        with launched(fake("grandchild"), tmp_path) as server:
            grandchild = int(wait_for_file(tmp_path / "grandchild.pid"))
            raise RuntimeError("the test failed")
    assert gone(server.process.pid, grandchild)


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace_and_a_signal_waits(fake, tmp_path):
    with stopping_on_signals(), launched(fake("stubborn"), tmp_path) as server:
        # A SIGTERM from another thread while stopping: held until the server is gone.
        timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM))
        started = time.monotonic()
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
                server.stop(grace=0.5)
            # The stop was finished when the KeyboardInterrupt came.
            assert server.process.returncode == -signal.SIGKILL
            assert time.monotonic() - started >= 0.5
        finally:
            timer.join(timeout=5)
            server.stop(grace=0)


def test_check_alive_names_a_death_while_serving(fake, tmp_path):
    with launched(fake("grandchild"), tmp_path) as server:
        grandchild = int(wait_for_file(tmp_path / "grandchild.pid"))
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=5)
        with pytest.raises(ServerDied) as raised:
            server.check_alive()
        assert "was killed by SIGKILL (9) while serving" in str(raised.value)
        assert "listening on" in raised.value.log_tail
    assert gone(grandchild)  # the orphan of its group, too


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_stops_the_server(fake, tmp_path, signum):
    script, pidfile = tmp_path / "signalled.py", tmp_path / "server.pid"
    script.write_text(SIGNALLED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(kvparity.__file__).parent.parent)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    harness = subprocess.Popen([sys.executable, str(script), fake("grandchild"), str(tmp_path / "grandchild.pid"),
                                str(tmp_path / "server.log"), str(pidfile)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        server = int(wait_for_file(pidfile))
        grandchild = int(wait_for_file(tmp_path / "grandchild.pid"))
        assert running(server) and running(grandchild)
        harness.send_signal(signum)
        output, _ = harness.communicate(timeout=15)
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.communicate(timeout=5)
    assert "KeyboardInterrupt" in output, output
    assert harness.returncode != 0
    assert gone(server, grandchild)


def test_stopping_on_signals_turns_sigterm_into_keyboardinterrupt_and_restores():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with stopping_on_signals():
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)  # or it would kill pytest
            signal.raise_signal(signal.SIGTERM)
            time.sleep(2)  # the handler runs before this ends
    assert {s: signal.getsignal(s) for s in before} == before


def test_stopping_on_signals_off_the_main_thread_does_nothing():
    before, inside, errors = signal.getsignal(signal.SIGTERM), [], []

    def worker():
        try:
            with stopping_on_signals():
                inside.append(signal.getsignal(signal.SIGTERM))
        except Exception as error:  # reported below
            errors.append(error)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=5)
    assert not errors and inside == [before]


def test_attached_server_is_checked_and_never_stopped(fake, tmp_path):
    with launched(fake("ok"), tmp_path) as launched_server:
        with AttachedServer(launched_server.url + "/") as attached:
            assert attached.url == launched_server.url
            attached.check_alive()
        assert attached.log_tail() == ""
        launched_server.check_alive()  # leaving the attached one stopped nothing
    with pytest.raises(ServerDied, match="nothing listens"):
        attached.check_alive()


def test_attached_server_where_nothing_answers(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerNeverReady, match=f"nothing answers at {url}/v1/models"):
        with AttachedServer(url):
            pytest.fail("entered where nothing listens")


def test_command_line_substitutes_inside_words():
    template = f"{shlex.quote(sys.executable)} -m server --model {{model}} --port={{port}} --name 'a {{port}}'"
    assert command_line(template, Path("/models/a b"), 8080) == [
        sys.executable, "-m", "server", "--model", "/models/a b", "--port=8080", "--name", "a 8080"]
    assert command_line(f"{sys.executable} {{port}}", "{port}", 1)[1] == "1"


@pytest.mark.parametrize("template, reason", [
    ("", "empty"),
    ("   ", "empty"),
    (f"{sys.executable} -m mlx_lm.server --model {{model}}", "no {port} placeholder"),
    (f"{sys.executable} -m server --port {{port}} --name 'unclosed", "cannot be split"),
    ("kvparity-no-such-server --port {port}", "not found on PATH"),
    ("/nonexistent/kvparity/server --port {port}", "does not exist"),
    ("/ --port {port}", "not an executable file"),
])
def test_bad_templates_are_usage_errors(template, reason):
    with pytest.raises(ServerUsageError) as raised:
        command_line(template, "/models/m", 8080)
    assert reason in str(raised.value) and repr(template) in str(raised.value)


def test_a_file_without_execute_permission_is_a_usage_error(tmp_path):
    script = tmp_path / "server.sh"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(ServerUsageError, match="not an executable file"):
        command_line(f"{script} --port {{port}}", "m", 8080)
    with pytest.raises(ServerUsageError, match="not an executable file"):
        LaunchedServer(f"{script} --port {{port}}", "m", tmp_path / "log")


@pytest.mark.parametrize("url, base", [
    ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
    ("http://127.0.0.1:8080/", "http://127.0.0.1:8080"),
    ("http://localhost:1", "http://localhost:1"),
    ("http://LOCALHOST:65535/", "http://localhost:65535"),
    ("http://[::1]:8080/", "http://[::1]:8080"),
])
def test_loopback_urls_are_accepted(url, base):
    assert loopback_url(url) == base


@pytest.mark.parametrize("url, reason", [
    ("https://127.0.0.1:8080", "scheme must be http"),
    ("ftp://127.0.0.1:8080", "scheme must be http"),
    ("127.0.0.1:8080", "scheme must be http"),
    ("http://example.com:8080", "host must be"),
    ("http://10.0.0.1:8080", "host must be"),
    ("http://0.0.0.0:8080", "host must be"),
    ("http://user:pw@127.0.0.1:8080", "host must be"),
    ("http://127.0.0.1", "port"),
    ("http://127.0.0.1:0", "port"),
    ("http://127.0.0.1:99999", "port"),
    ("http://127.0.0.1:80a", "port"),
    ("http://127.0.0.1:8080/v1", "without a path"),
])
def test_other_urls_are_refused(url, reason):
    with pytest.raises(ServerUsageError, match=reason):
        loopback_url(url)


def test_free_port_can_be_bound():
    import socket
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))

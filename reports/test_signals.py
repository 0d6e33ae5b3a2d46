"""A signal stops everything a run started. SIGTERM, SIGHUP or SIGINT to
the ``kvparity`` executable, or SIGTERM to its whole process group (what
``timeout`` and CI runners send), ends ``run``, an L4 run, ``run --workers
2`` and ``fuzz --workers 2`` with the interrupted status, what finished in a
report marked interrupted, and no process and no temporary folder left
behind (``suites/core/processes.py``)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvparity.reports.cli import EXIT_INTERRUPTED
from kvparity.oracle.signals import signal_name
from kvparity.suites.core.processes import stopping_on_signals
from kvparity.suites.runners import L4_CATALOG

KVPARITY = Path(sys.executable).with_name("kvparity")  # the console script, as users run it
REFERENCE = "kvparity.impl.batch_quantized:BatchQuantizedKVCache"
MLX_LM = f"{sys.executable} -m mlx_lm server --model {{model}} --port {{port}}"


def ours(root: Path) -> list:
    """Living processes whose temporary folder lies under ``root``: all
    that a run started with TMPDIR=root started (a double-forked daemon too)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2] != "Z" and any(e.startswith(f"TMPDIR={root}".encode()) for e in environ):
            found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
    return found


def eventually(run, what, within: float = 120.0):
    deadline = time.monotonic() + within
    while not what():
        if run.process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what.__doc__} did not happen: {run.stderr.read_text()}")
        time.sleep(0.1)


class Run:
    """``kvparity ARGV`` in a session of its own (so that a signal to its
    group reaches none of the test's processes), its temporary folder and
    output under ``tmp_path``."""

    def __init__(self, tmp_path: Path, *argv: str):
        self.root = tmp_path / "tmp"
        self.root.mkdir()
        self.out, self.stderr = tmp_path / "out", tmp_path / "stderr"
        with open(self.stderr, "w") as stderr:
            self.process = subprocess.Popen([str(KVPARITY), *argv, "--impl", REFERENCE, "--out", str(self.out)],
                                            cwd=tmp_path, env=dict(os.environ, TMPDIR=str(self.root)),
                                            stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)

    def finished_a_run(self) -> bool:
        """a schedule run finished (kept by an isolated child)"""
        try:
            return any(kept.stat().st_size for kept in self.root.glob("kvparity-isolated-*/done.pickle"))
        except FileNotFoundError:  # the run ended meanwhile
            return False

    def stop(self, signum, group: bool = False):
        if group:
            os.killpg(self.process.pid, signum)
        else:
            self.process.send_signal(signum)
        self.stdout, _ = self.process.communicate(timeout=120)
        return self.process.returncode

    def report(self) -> dict:
        found = list(self.out.glob("*/report.json"))
        assert len(found) == 1, f"{found}: {self.stdout}\n{self.stderr.read_text()}"
        (report,) = found
        return json.loads(report.read_text())

    def left(self) -> list:
        return ours(self.root) + [str(p) for p in self.root.glob("**/kvparity-*")]


@pytest.mark.slow
@pytest.mark.parametrize("signum, group", [(signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGINT, False),
                                           (signal.SIGTERM, True)],
                         ids=["SIGTERM", "SIGHUP", "SIGINT", "SIGTERM to the group"])
def test_a_stopped_run_reports_what_finished_as_interrupted_and_leaves_nothing(tmp_path, signum, group):
    run = Run(tmp_path, "run", "--level", "L1")
    eventually(run, run.finished_a_run)
    assert run.stop(signum, group) == EXIT_INTERRUPTED, run.stderr.read_text()
    record = run.report()
    stopped = record["interrupted"]
    assert stopped["signal"] == signum.name and 1 <= stopped["finished"] < stopped["planned"], stopped
    assert record["exit_status"] == EXIT_INTERRUPTED and len(record["results"]) == stopped["finished"]
    assert record["headline"].startswith(f"interrupted by {signum.name} after {stopped['finished']} of ")
    assert record["probes"] == []  # nothing more is computed once stopped (SmolLM2's probes take 12 s)
    assert not run.left()


@pytest.mark.slow
def test_a_stopped_l4_run_stops_its_server(tmp_path):
    run = Run(tmp_path, "run", "--level", "L4", "--schedule", str(L4_CATALOG / "burst.json"), "--server", MLX_LM)

    def serving():
        """a server runs (not only named in kvparity's command line)"""
        return any("mlx_lm server" in line and "{model}" not in line for line in ours(run.root))
    eventually(run, serving)
    assert run.stop(signal.SIGTERM, group=True) == EXIT_INTERRUPTED, run.stderr.read_text()
    assert run.report()["interrupted"]["finished"] == 0
    assert not run.left()


@pytest.mark.slow
def test_a_stopped_run_on_workers_merges_what_they_finished(tmp_path):
    run = Run(tmp_path, "run", "--level", "L1", "--workers", "2")
    eventually(run, run.finished_a_run)
    assert run.stop(signal.SIGTERM) == EXIT_INTERRUPTED, run.stderr.read_text()
    record = run.report()
    assert record["interrupted"]["signal"] == "SIGTERM" and record["shard"]["merged"], record["interrupted"]
    assert record["interrupted"]["finished"] == len(record["results"]) >= 1
    assert not run.left()


@pytest.mark.slow
def test_a_stopped_fuzz_campaign_stops_its_workers(tmp_path):
    run = Run(tmp_path, "fuzz", "--workers", "2", "--minutes", "10", "--database", "none")

    def generating():
        """the workers generate schedules"""
        return "rows passed" in run.stderr.read_text()
    eventually(run, generating)
    assert run.stop(signal.SIGTERM) == EXIT_INTERRUPTED, run.stderr.read_text()
    record = run.report()
    assert record["interrupted"]["finished"] >= 1 and record["interrupted"]["planned"] is None
    assert [s["title"] for s in record["sections"]] == ["Fuzz campaign"]
    assert "interrupted by SIGTERM after" in run.stdout
    assert not run.left()


def test_only_a_crash_signal_is_a_crash():
    from kvparity.suites.core.processes import died_of_a_crash

    for name in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT"):
        assert died_of_a_crash(-getattr(signal, name), 3, 3), name
    for name in ("SIGTERM", "SIGHUP", "SIGINT", "SIGQUIT", "SIGUSR1"):
        assert not died_of_a_crash(-getattr(signal, name), 3, 4), name
    assert died_of_a_crash(-signal.SIGKILL, 3, 4)  # the out-of-memory killer's
    assert not died_of_a_crash(-signal.SIGKILL, 3, 3)  # someone's kill -9
    assert died_of_a_crash(-signal.SIGKILL, None, None)  # no count kept here: the OOM killer's, as macOS's
    assert signal_name(-signal.SIGKILL) == "SIGKILL (9)"


def test_the_first_stop_signal_interrupts_and_later_ones_wait(tmp_path):
    """A group signal reaches parent and child: the second must not cut the
    report the first one's unwinding writes."""
    wrote = []
    with pytest.raises(KeyboardInterrupt, match="SIGHUP"):
        with stopping_on_signals():
            try:
                signal.raise_signal(signal.SIGHUP)
                time.sleep(2)  # the handler runs before this ends
            finally:
                signal.raise_signal(signal.SIGTERM)  # held
                wrote.append("report")
    assert wrote == ["report"]
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):  # a new block: a new first signal
        with stopping_on_signals():
            signal.raise_signal(signal.SIGTERM)
            time.sleep(2)

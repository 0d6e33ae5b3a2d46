"""A cache that crashes the process (an abort, a segfault, a kill) is that
schedule run's FAIL, naming the schedule, event and member it died in, with a
report, and the rest of the run goes on: the ``kvparity`` executable runs
``run`` and ``check`` in a child process with a flight recorder
(``suites/flight.py``)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvparity.reports.cli import EXIT_BROKEN, EXIT_HARNESS_ERROR
from kvparity.suites.schedule import CATALOG

KVPARITY = Path(sys.executable).with_name("kvparity")  # the console script, as users run it
CRASHING = """\
import ctypes, os, signal
from kvparity.impl.batch_quantized import BatchQuantizedKVCache


class CrashesInFilter(BatchQuantizedKVCache):
    def filter(self, batch_indices):
        {crash}
"""
LEAVES = CATALOG / "leave-longest.json"  # filter runs at its event #2
STAYS = CATALOG / "join-empty.json"  # no filter


def check(tmp_path, crash, *schedules):
    (tmp_path / "crashing.py").write_text(CRASHING.format(crash=crash))
    argv = [str(KVPARITY), "check", "--impl", "crashing:CrashesInFilter", "--level", "L1", "--out", "out"]
    for schedule in schedules:
        argv += ["--schedule", str(schedule)]
    return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("crash, died", [
    ("os.abort()", "SIGABRT (6)"),
    pytest.param("ctypes.string_at(0)", "SIGSEGV (11)", marks=pytest.mark.slow),
    pytest.param("os.kill(os.getpid(), signal.SIGKILL)", "SIGKILL (9)", marks=pytest.mark.slow),
])
def test_a_cache_that_crashes_the_process_fails_naming_schedule_event_and_member(tmp_path, crash, died):
    done = check(tmp_path, crash, LEAVES, STAYS)
    assert done.returncode == EXIT_BROKEN, done.stdout + done.stderr
    assert (f'kvparity: L1 leave-longest: the process died of {died} in filter at event #2 leave ["a"]; '
            "that run is a FAIL and the rest goes on") in done.stderr
    said = f"filter raised ProcessDied: the process died of {died} while filter ran: a crash inside the implementation"
    assert said in done.stdout and "1 passed, 1 failed (2 schedule runs)" in done.stdout, done.stdout
    assert "shrink it: kvparity bisect" not in done.stdout  # bisect would die with it
    (report,) = (tmp_path / "out").glob("*/report.json")
    results = {r["schedule"]: r for r in json.loads(report.read_text())["results"]}
    assert results["leave-longest"]["verdict"] == "FAIL" and results["join-empty"]["verdict"] == "pass"
    assert said in results["leave-longest"]["reason"] and results["leave-longest"]["raised_by"] == "filter"


def test_a_crash_outside_every_schedule_run_is_not_blamed_on_a_run(tmp_path):
    (tmp_path / "crashing.py").write_text("import os\nos.abort()\n")
    done = subprocess.run([str(KVPARITY), "check", "--impl", "crashing:Cache", "--level", "L1", "--schedule",
                           str(STAYS), "--out", "out"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_HARNESS_ERROR, done.stdout + done.stderr
    assert "the process died of SIGABRT (6) outside every schedule run" in done.stderr

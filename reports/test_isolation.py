"""A cache that crashes the process (an abort, a segfault, the
out-of-memory killer) or hangs in a member is that schedule run's FAIL,
naming the schedule, event and member it died or hung in, with a report, and
the rest of the run goes on: the ``kvparity`` executable runs ``run`` and
``check`` in a child process with a flight recorder (``suites/core/flight.py``). A
signal from outside that ends the child is no crash: the run is
interrupted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvparity.reports.cli import EXIT_BROKEN, EXIT_HARNESS_ERROR, EXIT_INTERRUPTED
from kvparity.suites.format.schedule import CATALOG

KVPARITY = Path(sys.executable).with_name("kvparity")  # the console script, as users run it
CRASHING = """\
import ctypes, os, signal, time
from kvparity.impl.batch_quantized import BatchQuantizedKVCache


class CrashesInFilter(BatchQuantizedKVCache):
    def filter(self, batch_indices):
        {crash}
"""
LEAVES = CATALOG / "leave-longest.json"  # filter runs at its event #2
STAYS = CATALOG / "join-empty.json"  # no filter
# The kvparity executable, on a machine whose count of out-of-memory kills
# rises while its child runs: the child's SIGKILL is then the OOM killer's.
OOM_KILLING = ("import itertools, sys; from kvparity.suites.core import processes; kills = itertools.count(); "
               "processes.oom_kills = lambda: next(kills); from kvparity.reports.cli import console; "
               "sys.exit(console())")


def check(tmp_path, crash, *schedules, options=(), memory_ran_out=False):
    (tmp_path / "crashing.py").write_text(CRASHING.format(crash=crash))
    kvparity = [sys.executable, "-c", OOM_KILLING] if memory_ran_out else [str(KVPARITY)]
    argv = [*kvparity, "check", "--impl", "crashing:CrashesInFilter", "--level", "L1", "--out", "out", *options]
    for schedule in schedules:
        argv += ["--schedule", str(schedule)]
    return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("crash, died, memory_ran_out", [
    ("os.abort()", "SIGABRT (6)", False),
    pytest.param("ctypes.string_at(0)", "SIGSEGV (11)", False, marks=pytest.mark.slow),
    pytest.param("os.kill(os.getpid(), signal.SIGKILL)", "SIGKILL (9)", True, marks=pytest.mark.slow),
])
def test_a_cache_that_crashes_the_process_fails_naming_schedule_event_and_member(tmp_path, crash, died,
                                                                                  memory_ran_out):
    done = check(tmp_path, crash, LEAVES, STAYS, memory_ran_out=memory_ran_out)
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


@pytest.mark.slow
def test_a_member_that_never_returns_fails_naming_it_and_the_run_goes_on(tmp_path):
    """A hang in native code (here: a sleep that never ends) is the member's FAIL."""
    done = check(tmp_path, "time.sleep(10**6)", LEAVES, STAYS, options=("--member-timeout", "2"))
    assert done.returncode == EXIT_BROKEN, done.stdout + done.stderr
    assert ('kvparity: L1 leave-longest: filter did not return within 2 s (--member-timeout) at event #2 leave '
            '["a"]; it was stopped; that run is a FAIL and the rest goes on') in done.stderr, done.stderr
    said = ("filter raised MemberHung: filter did not return within 2 s (--member-timeout): a hang inside the "
            "implementation")
    assert said in done.stdout and "1 passed, 1 failed (2 schedule runs)" in done.stdout, done.stdout
    assert "shrink it: kvparity bisect" not in done.stdout  # bisect would hang with it
    (report,) = (tmp_path / "out").glob("*/report.json")
    results = {r["schedule"]: r for r in json.loads(report.read_text())["results"]}
    assert results["leave-longest"]["raised_by"] == "filter" and results["join-empty"]["verdict"] == "pass"


HANGING = "kvparity.impl.negative_controls:FilterNeverReturns"
FILTERS = (LEAVES, CATALOG / "batched-prefill.json", CATALOG / "batched-join-empty-k192-v128.json")  # each calls filter


def hung_waits(record: dict) -> list:
    """The schedule runs a member hang stopped: one member timeout waited each."""
    return [r for r in record["results"] if r["verdict"] == "FAIL" and "raised MemberHung:" in r["reason"]]


def test_a_hung_member_costs_one_timeout_for_the_whole_run(tmp_path):
    """Once filter hung, the runs after it that call filter are not judged
    (stopped at that call, never waited on again), and say why; the hang is
    the cache's one FAIL, one group naming filter. Without the cut, each of
    the three runs that call filter waited the timeout out. A timeout
    shorter than a child's start-up holds too that the hung child's last
    record is never read as the next child's (it was, before: 128)."""
    argv = [str(KVPARITY), "check", "--impl", HANGING, "--level", "L1", "--out", "out", "--member-timeout", "1",
            "--generated", "20"]  # the generated schedules would call filter again: not run
    for schedule in (*FILTERS, STAYS):
        argv += ["--schedule", str(schedule)]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_BROKEN, done.stdout + done.stderr
    assert done.stderr.count("did not return within 1 s (--member-timeout)") == 1, done.stderr
    assert "1 passed, 1 failed, 2 not judged (4 schedule runs)" in done.stdout, done.stdout
    assert "generated (L1): not run: filter hung in L1 leave-longest after 1 s (--member-timeout)" in done.stdout
    (report,) = (tmp_path / "out").glob("*/report.json")
    record = json.loads(report.read_text())
    assert [r["schedule"] for r in hung_waits(record)] == ["leave-longest"]
    results = {r["schedule"]: r for r in record["results"]}
    assert results["join-empty"]["verdict"] == "pass"
    why = "calls filter, which hung in L1 leave-longest after 1 s (--member-timeout): not called again"
    for name in ("batched-prefill", "batched-join-empty-k192-v128"):
        assert results[name]["verdict"] == "not judged" and why in results[name]["reason"], results[name]
    assert "L1 batched-prefill, event #4 leave" in results["batched-prefill"]["reason"]
    assert [(g["at_fault"], g["schedules"]) for g in record["failures"]] == [("filter", 1)]
    junit = (report.parent / "junit.xml").read_text()
    assert junit.count(f"not judged: L1 batched-prefill, event #4 leave") == 4  # its four rows, skipped
    assert why in (report.parent / "report.md").read_text()


@pytest.mark.slow
def test_a_hung_member_fails_the_default_check_within_one_default_timeout(tmp_path):
    """kvparity check as a team runs it (every level, the whole catalog, the
    default --member-timeout) on a cache whose filter never returns: one
    wait of the timeout, then every run that calls filter (every L3 run:
    the engine filters out finished requests) is not judged; the verdict is
    the hang, one group naming filter. About 60 s beside the run's ~30 s
    of work (2 cores), where waiting once per run took over an hour."""
    done = subprocess.run([str(KVPARITY), "check", "--impl", HANGING, "--out", "out"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == EXIT_BROKEN, done.stdout + done.stderr
    assert done.stderr.count("did not return within 60 s (--member-timeout)") == 1, done.stderr
    (report,) = (tmp_path / "out").glob("*/report.json")
    record = json.loads(report.read_text())
    assert len(hung_waits(record)) == 1 and record["summary"]["schedules"]["FAIL"] == 1
    assert [g["at_fault"] for g in record["failures"]] == ["filter"]
    not_judged = [r for r in record["results"] if r["verdict"] == "not judged"]
    assert {r["level"] for r in not_judged} == {"L1", "L2", "L3"}
    assert all("calls filter, which hung in L1 " in r["reason"] for r in not_judged)
    assert record["summary"]["schedules"]["pass"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["signal.SIGKILL", "signal.SIGTERM"])
def test_a_signal_from_outside_that_ends_the_child_is_no_fail(tmp_path, stop):
    """Sent from inside filter, the signal reaches the process running the
    schedules and nothing else, as ``kill`` from outside would: the run is
    interrupted (130), never the implementation's FAIL, whatever the member
    running then. SIGTERM lets it report what finished; SIGKILL does not."""
    done = check(tmp_path, f"os.kill(os.getpid(), {stop}); time.sleep(5)", STAYS, LEAVES)
    assert done.returncode == EXIT_INTERRUPTED, done.stdout + done.stderr
    assert "FAIL" not in done.stdout + done.stderr
    if stop == "signal.SIGKILL":
        assert "was stopped by SIGKILL (9) from outside: interrupted" in done.stderr
        assert not (tmp_path / "out").exists()
    else:
        (report,) = (tmp_path / "out").glob("*/report.json")
        record = json.loads(report.read_text())
        assert record["interrupted"] == {"signal": "SIGTERM", "finished": 1, "planned": 2}
        assert [r["verdict"] for r in record["results"]] == ["pass"]


def fuzz(tmp_path, crash, *options):
    (tmp_path / "crashing.py").write_text(CRASHING.format(crash=crash))
    return subprocess.run([str(KVPARITY), "fuzz", "--impl", "crashing:CrashesInFilter", "--minutes", "1", "--seed", "1",
                           "--database", "none", "--out", "out", *options],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("crash, said, raised, options", [
    pytest.param("os.abort()", "the process died of SIGABRT (6) in filter at event #", "ProcessDied", (),
                 marks=pytest.mark.slow),  # a minute's campaign and its replay: about 11 s on 2 cores
    pytest.param("time.sleep(10**6)", "filter did not return within 2 s (--member-timeout) at event #", "MemberHung",
                 ("--member-timeout", "2"), marks=pytest.mark.slow),
])
def test_a_fuzz_campaign_the_cache_crashes_or_hangs_fails_naming_the_member_and_replays(tmp_path, crash, said,
                                                                                       raised, options):
    """A fuzz worker that the cache under test crashes, or that hangs in a
    member past the member timeout, is the cache's FAIL (not a worker lost),
    with the schedule it was running, which ``kvparity replay`` (isolated
    too) replays as the same FAIL."""
    done = fuzz(tmp_path, crash, *options)
    assert done.returncode == EXIT_BROKEN, done.stdout + done.stderr
    assert said in done.stderr and "died (" not in done.stderr, done.stderr
    (report,) = (tmp_path / "out").glob("*/report.json")
    (result,) = json.loads(report.read_text())["results"]
    assert result["verdict"] == "FAIL" and result["raised_by"] == "filter"
    assert f"filter raised {raised}:" in result["reason"]
    (found,) = (tmp_path / "out").glob("*/found/*.json")
    assert f"replay with: kvparity replay {found.relative_to(tmp_path)}" in done.stdout
    again = subprocess.run([str(KVPARITY), "replay", str(found), "--level", "L1", "--impl", "crashing:CrashesInFilter",
                            *options], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == EXIT_BROKEN, again.stdout + again.stderr
    assert f"filter raised {raised}:" in again.stdout and "0 passed, 1 failed" in again.stdout

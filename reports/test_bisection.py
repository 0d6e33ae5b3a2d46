"""Bisection: `git bisect run kvparity check` lands on the commit that broke
an implementation, and `kvparity bisect` shrinks a failing schedule to a
minimal one that replays to the same failure."""

import json
import subprocess
import sys

from kvparity.impl.adapter import load_implementation
from kvparity.reports.cli import EXIT_BROKEN, main
from kvparity.suites.bisect import first_failure
from kvparity.suites.l1 import run_l1
from kvparity.suites.schedule import CATALOG, load

GOOD = "from kvparity.impl.batch_quantized import BatchQuantizedKVCache as Cache\n"
BAD = "from kvparity.suites.negative_controls import MaskIgnoresLeftPadding as Cache\n"


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def commit(repo, source, message):
    (repo / "mycache.py").write_text(source)
    git(repo, "add", "mycache.py")
    git(repo, "commit", "-qm", message)
    return git(repo, "rev-parse", "HEAD").strip()


def test_git_bisect_run_lands_on_the_breaking_commit(tmp_path):
    repo = tmp_path / "server"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "dev@example.com")
    git(repo, "config", "user.name", "dev")
    first = commit(repo, GOOD, "cache: first version")
    commit(repo, GOOD + "# faster extend\n", "cache: faster extend")
    breaking = commit(repo, BAD, "cache: simpler mask")
    commit(repo, "this is not python\n", "wip: does not import")  # 125: skipped
    last = commit(repo, BAD + "# docs\n", "cache: docs")

    git(repo, "bisect", "start", last, first)
    check = [sys.executable, "-m", "kvparity", "check", "--impl", "mycache:Cache", "--level", "L1",
             "--schedule", str(CATALOG / "join-longer-joiner.json")]
    out = subprocess.run(["git", "-C", str(repo), "bisect", "run", *check], capture_output=True, text=True)
    assert f"{breaking} is the first bad commit" in out.stdout, out.stdout + out.stderr


def test_check_exit_codes(capsys):
    one = ["--level", "L1", "--schedule", str(CATALOG / "rollback-uneven.json")]
    assert main(["check", *one]) == 0
    assert main(["check", *one, "--impl", "kvparity.suites.negative_controls:RollbackByLargest"]) == 1
    assert main(["check", *one, "--impl", "nowhere:Cache"]) == 125


def test_bisect_finds_the_first_event_and_writes_a_minimal_replayable_schedule(tmp_path, capsys):
    spec = "kvparity.suites.negative_controls:RollbackByLargest"
    source = CATALOG / "rollback-uneven.json"
    out = tmp_path / "min.json"
    assert main(["bisect", str(source), "--impl", spec, "--out", str(out)]) == EXIT_BROKEN
    printed = capsys.readouterr().out
    assert 'first event after which parity breaks: #2 spec_round' in printed
    assert f"replay with: kvparity replay {out}" in printed

    original, minimal = load(source), load(out)
    assert len(minimal.events) < len(original.events)
    assert len(minimal.requests) <= 2
    broken = load_implementation(spec)
    assert first_failure(run_l1(minimal, broken)).check == first_failure(run_l1(original, broken)).check
    assert run_l1(minimal, load_implementation()).verdict == "pass"
    assert main(["replay", str(out), "--level", "L1", "--impl", spec]) == EXIT_BROKEN


def test_bisect_on_a_passing_schedule_says_so(capsys):
    assert main(["bisect", str(CATALOG / "join-empty.json")]) == 0
    assert "parity holds" in capsys.readouterr().out


def test_bisect_at_l2(tmp_path, capsys):
    spec = "kvparity.suites.negative_controls:MaskIgnoresLeftPadding"
    out = tmp_path / "min.json"
    main(["bisect", str(CATALOG / "join-longer-joiner.json"), "--level", "L2", "--impl", spec, "--out", str(out)])
    doc = json.loads(out.read_text())
    assert len(doc["events"]) <= 2 and len(doc["requests"]) == 2

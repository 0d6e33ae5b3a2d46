"""Bisection: `git bisect run kvparity check` lands on the commit that broke
an implementation, skips the commits it cannot judge, aborts when the harness
itself fails, and `kvparity bisect` shrinks a failing schedule to a minimal
one that replays to the same failure.

Each exit class is exercised under a real `git bisect run` in a throwaway
repository, since that is the contract the codes exist for: 1..127 but 125
marks a commit bad, 125 skips it, anything above 127 aborts the bisection.
"""

import json
import subprocess
import sys

import pytest

from kvparity.reports.cli import EXIT_BROKEN, EXIT_CANNOT_JUDGE, EXIT_OK, EXIT_USAGE, main
from kvparity.impl.negative_controls import ExtractReturnsViews, TrimForgetsOffset
from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.core.evidence import FAIL, PASS
from kvparity.suites.l1.run import run_l1
from kvparity.reports.policy import load_policy
from kvparity.reports.verdicts import judge
from kvparity.suites.format.schedule import CATALOG
from kvparity.suites.format.errors import ScheduleError
from kvparity.suites.core.loading import load, parse
from kvparity.suites.search.shrink import first_failure

GOOD = "from kvparity.impl.batch_quantized import BatchQuantizedKVCache as Cache\n"
BAD = "from kvparity.impl.negative_controls import MaskIgnoresLeftPadding as Cache\n"
DOES_NOT_PARSE = "this is not python\n"
DOES_NOT_IMPORT = "import mycache_helpers_not_written_yet\n" + GOOD
CHECK = ["check", "--impl", "mycache:Cache", "--level", "L1", "--schedule", str(CATALOG / "join-longer-joiner.json")]
CPU = load_policy("cpu")


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def commit(repo, source, message):
    (repo / "mycache.py").write_text(source)
    git(repo, "add", "mycache.py")
    git(repo, "commit", "-qm", message)
    return git(repo, "rev-parse", "HEAD").strip()


def bisect_run(repo, good, bad, command):
    """`git bisect run command` between good and bad: (process, bisect log)."""
    git(repo, "bisect", "start", bad, good)
    done = subprocess.run(["git", "-C", str(repo), "bisect", "run", *command], capture_output=True, text=True)
    log = git(repo, "bisect", "log")
    git(repo, "bisect", "reset")
    return done, log


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """good, good, broken, two commits that cannot be imported, broken x3."""
    repo = tmp_path_factory.mktemp("bisect") / "server"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "dev@example.com")
    git(repo, "config", "user.name", "dev")
    shas = {
        "first": commit(repo, GOOD, "cache: first version"),
        "faster": commit(repo, GOOD + "# faster extend\n", "cache: faster extend"),
        "breaking": commit(repo, BAD, "cache: simpler mask"),
        "wip": commit(repo, DOES_NOT_PARSE, "wip: does not parse"),
        "helpers": commit(repo, DOES_NOT_IMPORT, "wip: helpers not committed"),
        "docs": commit(repo, BAD + "# docs\n", "cache: docs"),
        "tests": commit(repo, BAD + "# docs\n# tests\n", "cache: tests"),
        # git's first pick between first and last is "wip": the skip is exercised
        "last": commit(repo, BAD + "# docs\n# tests\n# typing\n", "cache: typing"),
    }
    return repo, shas


def _skipped(log):
    return {line.split("[")[1].split("]")[0] for line in log.splitlines() if line.startswith("# skip:")}


@pytest.mark.slow
def test_git_bisect_run_lands_on_the_breaking_commit_skipping_what_cannot_import(history):
    repo, shas = history
    done, log = bisect_run(repo, shas["first"], shas["last"], [sys.executable, "-m", "kvparity", *CHECK])
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{shas['breaking']} is the first bad commit" in done.stdout, done.stdout + done.stderr
    skipped = _skipped(log)
    # 125, never "bad": a commit whose module does not import is skipped
    assert skipped and skipped <= {shas["wip"], shas["helpers"]}, log
    assert "cannot judge here" in done.stdout + done.stderr


@pytest.mark.slow
def test_a_harness_error_aborts_git_bisect_run(history, tmp_path):
    repo, shas = history
    wrapper = tmp_path / "broken_harness.py"
    wrapper.write_text(
        "import sys\n"
        "import kvparity.suites.l1.run as l1\n"
        "def bug(*args, **kwargs):\n"
        "    raise KeyError('a bug in the harness, not in the cache')\n"
        "l1.check_event = bug\n"
        "from kvparity.reports.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    done, log = bisect_run(repo, shas["first"], shas["last"], [sys.executable, str(wrapper), *CHECK])
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "first bad commit" not in output
    assert "exit code 128" in output, output  # git names the status it aborted on
    # no commit was judged: only the bad and good the bisection started from
    # (the unimportable commits are skipped before the harness gets to fail)
    assert log.count("# bad:") == 1 and log.count("# good:") == 1, log
    assert _skipped(log) <= {shas["wip"], shas["helpers"]}, log


@pytest.mark.slow
def test_a_usage_error_under_git_bisect_run_aborts_it(history):
    repo, shas = history
    typo = [sys.executable, "-m", "kvparity", "check", "--impl", "mycache", "--level", "L1"]
    done, log = bisect_run(repo, shas["first"], shas["last"], typo)
    output = done.stdout + done.stderr
    # git aborts on the first commit it tries, blaming none, with the one-line reason in its output
    assert done.returncode != 0 and "first bad commit" not in output, output
    assert f"exit code {EXIT_USAGE}" in output, output
    assert "kvparity: --impl 'mycache': expected 'package.module:factory'" in output
    assert log.count("# bad:") == 1 and log.count("# good:") == 1 and not _skipped(log), log


def new_repository(path):
    path.mkdir(parents=True)
    git(path, "init", "-q")
    git(path, "config", "user.email", "dev@example.com")
    git(path, "config", "user.name", "dev")
    return path


def commit_files(repo, files, message):
    for name, text in files.items():
        (repo / name).write_text(text)
    git(repo, "add", *files)
    git(repo, "commit", "-qm", message)
    return git(repo, "rev-parse", "HEAD").strip()


def pyproject(impl):
    return f'[project]\nname = "server"\n\n[tool.kvparity]\nimpl = "{impl}"\n'


# The one documented command: the class under test from the repository's pyproject.toml.
CHECK_FROM_PYPROJECT = [sys.executable, "-m", "kvparity", "check", "--level", "L1",
                        "--schedule", str(CATALOG / "join-longer-joiner.json")]


@pytest.mark.slow
def test_git_bisect_run_aborts_on_a_class_name_typo_instead_of_blaming_a_commit(tmp_path):
    repo = new_repository(tmp_path / "server")
    typo = pyproject("mycache:Cahce")  # the class is Cache
    first = commit_files(repo, {"mycache.py": GOOD, "pyproject.toml": typo}, "cache: first version")
    commit_files(repo, {"mycache.py": GOOD + "# faster extend\n"}, "cache: faster extend")
    commit_files(repo, {"mycache.py": BAD}, "cache: simpler mask")
    last = commit_files(repo, {"mycache.py": BAD + "# docs\n"}, "cache: docs")
    done, log = bisect_run(repo, first, last, CHECK_FROM_PYPROJECT)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "first bad commit" not in output, output
    assert f"exit code {EXIT_USAGE}" in output and "mycache has no Cahce" in output, output
    assert log.count("# bad:") == 1 and log.count("# good:") == 1 and not _skipped(log), log


@pytest.mark.slow
def test_git_bisect_run_skips_the_commits_before_the_module_exists(tmp_path):
    repo = new_repository(tmp_path / "server")
    settings = {"pyproject.toml": pyproject("mycache:Cache")}
    shas = [commit_files(repo, {**settings, "README.md": "a server\n"}, "the server, its cache to come")]
    shas += [commit_files(repo, {"README.md": f"a server\n{'.' * i}\n"}, f"docs {i}") for i in range(3)]
    module_first = len(shas)
    shas += [commit_files(repo, {"mycache.py": GOOD}, "cache: first version")]
    breaking = len(shas)
    shas += [commit_files(repo, {"mycache.py": BAD + "#\n" * i}, f"cache: change {i}") for i in range(3)]
    done, log = bisect_run(repo, shas[0], shas[-1], CHECK_FROM_PYPROJECT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"{shas[breaking]} is the first bad commit" in done.stdout, output
    skipped = _skipped(log)
    assert skipped and skipped <= set(shas[1:module_first]), log  # 125: never "bad", never "good"
    assert "cannot judge here" in output and "cannot import mycache" in output


def test_under_a_bisection_a_module_in_no_commit_is_a_usage_error_not_a_skip(tmp_path, monkeypatch, capsys):
    """A module typo: not importable here, and not in the bisection's bad
    commit either, so no commit can be judged: abort (a usage error), where
    a module the bad commit has is only not there yet (125, skipped)."""
    repo = new_repository(tmp_path / "server")
    good = commit_files(repo, {"README.md": "a server\n"}, "the server")
    commit_files(repo, {"README.md": "a server\n.\n"}, "docs")
    bad = commit_files(repo, {"mycache.py": BAD}, "cache")
    git(repo, "bisect", "start", bad, good)  # checks out the commit between: no mycache.py there
    monkeypatch.chdir(repo)
    one = ["check", "--level", "L1", "--schedule", str(CATALOG / "join-longer-joiner.json")]
    try:
        assert not (repo / "mycache.py").exists()
        assert main([*one, "--impl", "mycache:Cache"]) == EXIT_CANNOT_JUDGE
        assert "cannot import mycache" in capsys.readouterr().err
        assert main([*one, "--impl", "mycahce:Cache"]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert f"the bisection's bad commit {bad[:12]} has no mycahce either: a typo" in err, err
    finally:
        git(repo, "bisect", "reset")
    # No bisection running: a module that does not import cannot be judged here, as before.
    assert main([*one, "--impl", "mycahce:Cache"]) == EXIT_CANNOT_JUDGE


def test_check_exit_codes(capsys):
    one = ["--level", "L1", "--schedule", str(CATALOG / "rollback-uneven.json")]
    assert main(["check", *one]) == 0
    assert main(["check", *one, "--impl", "kvparity.impl.negative_controls:RollbackByLargest"]) == 1
    assert main(["check", *one, "--impl", "nowhere:Cache"]) == 125
    assert main(["check", *one, "--impl", "nowhere"]) == EXIT_USAGE > 127  # aborts git bisect run


def test_bisect_finds_the_first_event_and_writes_a_minimal_replayable_schedule(tmp_path, capsys):
    spec = "kvparity.impl.negative_controls:RollbackByLargest"
    source = CATALOG / "rollback-uneven.json"
    out = tmp_path / "min.json"
    assert main(["bisect", str(source), "--impl", spec, "--out", str(out)]) == EXIT_BROKEN
    printed = capsys.readouterr().out
    assert "first event after which parity breaks: #2 spec_round" in printed
    assert f"replay with: kvparity replay {out}" in printed

    original, minimal = load(source), load(out)
    assert len(minimal.events) < len(original.events)
    assert len(minimal.requests) <= 2
    broken = load_implementation(spec)
    shrunk, full = judge(run_l1(minimal, broken), CPU), judge(run_l1(original, broken), CPU)
    assert shrunk.verdict == full.verdict == FAIL
    assert first_failure(shrunk).check == first_failure(full).check
    assert judge(run_l1(minimal, load_implementation()), CPU).verdict == PASS
    assert main(["replay", str(out), "--level", "L1", "--impl", spec]) == EXIT_BROKEN


def test_a_shrunk_schedule_is_a_fixed_point(tmp_path, capsys):
    # Three requests, an extend that forgets the running rows' padding: two suffice.
    spec = "kvparity.impl.negative_controls:ExtendForgetsExistingPadding"
    source = tmp_path / "extend-three.json"
    source.write_text(json.dumps({
        "name": "extend-three", "levels": ["L1"],
        "requests": {"a": {"prompt_len": 5}, "b": {"prompt_len": 9}, "c": {"prompt_len": 20}},
        "events": [{"join": ["a", "b"]}, {"step": 2}, {"join": ["c"]}, {"step": 2}],
    }))
    out = tmp_path / "min.json"
    assert main(["bisect", str(source), "--impl", spec, "--out", str(out)]) == EXIT_BROKEN
    assert "shrunk to 2 of 3 requests" in capsys.readouterr().out
    # Nothing more can go: removing any one request or event no longer fails the same way.
    minimal, broken = json.loads(out.read_text()), load_implementation(spec)
    check = first_failure(judge(run_l1(load(out), broken), CPU)).check
    for smaller in ([{**minimal, "events": minimal["events"][:i] + minimal["events"][i + 1:]}
                     for i in range(len(minimal["events"]))]
                    + [{**minimal, "requests": {r: x for r, x in minimal["requests"].items() if r != rid},
                        "events": [e for e in minimal["events"] if rid not in json.dumps(e)]}
                       for rid in minimal["requests"]]):
        try:
            verdict = judge(run_l1(parse(smaller), broken), CPU)
        except ScheduleError:
            continue
        assert verdict.verdict != FAIL or first_failure(verdict).check != check, smaller


def test_bisect_on_a_passing_schedule_says_so(tmp_path, capsys):
    assert main(["bisect", str(CATALOG / "join-empty.json"), "--out", str(tmp_path / "min.json")]) == EXIT_OK
    assert "parity holds" in capsys.readouterr().out
    assert not (tmp_path / "min.json").exists()


def test_bisect_on_a_refused_schedule_fails_without_a_schedule_to_shrink(tmp_path, capsys):
    spec = "kvparity.impl.negative_controls:RefusesUpdateAndFetch"
    out = tmp_path / "min.json"
    assert main(["bisect", str(CATALOG / "join-longer-joiner.json"), "--impl", spec, "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "refused" in printed and "update_and_fetch" in printed
    assert not out.exists()


@pytest.mark.gqa_batched
def test_bisect_at_l2(tmp_path, capsys):
    spec = "kvparity.impl.negative_controls:MaskIgnoresLeftPadding"
    out = tmp_path / "min.json"
    code = main(["bisect", str(CATALOG / "join-longer-joiner.json"), "--level", "L2", "--impl", spec,
                 "--out", str(out)])
    assert code == EXIT_BROKEN, capsys.readouterr()
    doc = json.loads(out.read_text())
    assert len(doc["events"]) <= 2 and len(doc["requests"]) == 2


class ViewsThenTrimForgetsOffset(ExtractReturnsViews, TrimForgetsOffset):
    """A hygiene finding (extract shares the batch's memory) before a parity
    failure (trim leaves the offsets)."""


def test_bisect_follows_the_failure_not_an_earlier_hygiene_finding(tmp_path):
    spec = f"{__name__}:ViewsThenTrimForgetsOffset"
    source = tmp_path / "views-then-trim.json"
    source.write_text(json.dumps({
        "name": "views-then-trim", "levels": ["L1"],
        "requests": {"a": {"prompt_len": 12}, "b": {"prompt_len": 5}},
        "events": [{"join": ["a", "b"]}, {"step": 2}, {"extract": "b"}, {"reinsert": "b"},
                   {"step": 1}, {"trim": 2}, {"step": 1}],
    }))
    broken = load_implementation(spec)
    full = judge(run_l1(load(source), broken), CPU)
    assert {d.check for row in full.rows for d in row.evidence.divergences} >= {"alias", "offset"}
    assert first_failure(full).check == "offset"
    out = tmp_path / "min.json"
    assert main(["bisect", str(source), "--impl", spec, "--out", str(out)]) == EXIT_BROKEN
    assert main(["replay", str(out), "--level", "L1", "--impl", spec]) == EXIT_BROKEN

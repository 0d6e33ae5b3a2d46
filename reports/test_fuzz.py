"""``kvparity fuzz``: usage refused before any worker starts, a campaign on the
reference that passes with evidence counted, and one on a negative control
that writes a shrunk schedule ``kvparity replay`` fails."""

import json

import pytest

from kvparity.reports.cli import EXIT_BROKEN, EXIT_CANNOT_JUDGE, EXIT_OK, EXIT_USAGE, main

CONTROL = "kvparity.impl.negative_controls:TrimForgetsOffset"


@pytest.fixture
def no_campaign(monkeypatch):
    """Fails the test if a worker would start."""
    import kvparity.reports.commands.fuzz

    def forbidden(*args, **kwargs):
        raise AssertionError("a campaign started before the error was found")

    monkeypatch.setattr(kvparity.reports.commands.fuzz, "run_campaign", forbidden)


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0", "--examples", "5"], "--workers 0: at least 1"),
    (["--examples", "0"], "--examples 0: at least 1"),
    (["--minutes", "0"], "--minutes 0: more than 0"),
    (["--examples", "5", "--database", "ftp://host/db"], "ftp://host/db: a directory or redis://"),
    (["--examples", "5", "--policy", "no-such-policy"], "no-such-policy"),
    (["--examples", "5", "--database", "FILE/db"], "is not a directory"),
    (["--examples", "5", "--impl", "no_colon"], "expected 'package.module:factory'"),
])
def test_usage_errors_exit_129_before_any_worker_starts(argv, message, tmp_path, no_campaign, capsys):
    (tmp_path / "FILE").write_text("")
    argv = [arg.replace("FILE", str(tmp_path / "FILE")) for arg in argv]
    assert main(["fuzz", "--out", str(tmp_path), *argv]) == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_a_budget_is_required(no_campaign, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fuzz", "--workers", "2"])
    assert exit_.value.code == EXIT_USAGE
    assert "--minutes" in capsys.readouterr().err


def test_a_database_that_cannot_be_reached_cannot_judge_here(tmp_path, no_campaign, capsys):
    argv = ["fuzz", "--examples", "5", "--database", "redis://127.0.0.1:1", "--out", str(tmp_path)]
    assert main(argv) == EXIT_CANNOT_JUDGE
    assert "redis://127.0.0.1:1" in capsys.readouterr().err


@pytest.mark.slow
def test_a_campaign_on_the_reference_passes_with_evidence(tmp_path, capsys):
    argv = ["fuzz", "--workers", "2", "--examples", "40", "--database", str(tmp_path / "db"), "--seed", "5",
            "--out", str(tmp_path / "out")]
    assert main(argv) == EXIT_OK
    out, err = capsys.readouterr()
    assert "no failure in" in out and "rows passed" in out
    assert "schedules (" in err  # the progress line
    assert not (tmp_path / "out").exists()  # nothing failed: no report


@pytest.mark.slow
def test_a_campaign_on_a_control_writes_a_shrunk_schedule_that_replays_as_a_failure(tmp_path, capsys):
    argv = ["fuzz", "--impl", CONTROL, "--workers", "2", "--examples", "400", "--database", str(tmp_path / "db"),
            "--seed", "5", "--out", str(tmp_path / "out")]
    assert main(argv) == EXIT_BROKEN
    out, _ = capsys.readouterr()
    assert "replay with: kvparity replay" in out
    (report,) = (tmp_path / "out").iterdir()
    found = sorted((report / "found").glob("*.json"))
    assert found
    record = json.loads((report / "report.json").read_text())
    assert record["exit_status"] == EXIT_BROKEN and record["summary"]["schedules"]["FAIL"] == len(found)
    assert [s["title"] for s in record["sections"]] == ["Fuzz campaign"]
    for path in found:
        schedule = json.loads(path.read_text())
        assert len(schedule["events"]) <= 4, f"not shrunk: {schedule['events']}"
        assert main(["replay", str(path), "--level", "L1", "--impl", CONTROL]) == EXIT_BROKEN
        assert main(["replay", str(path), "--level", "L1"]) == EXIT_OK  # the reference passes it

"""The kvparity command: exit codes, summary, reports."""

import json

import pytest

from kvparity.reports.cli import EXIT_BROKEN, EXIT_CANNOT_RUN, EXIT_OK, EXIT_USAGE, main
from kvparity.suites.schedule import CATALOG


def test_run_passes_the_catalog_and_writes_a_report(tmp_path, capsys):
    assert main(["run", "--out", str(tmp_path)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "join-longer-joiner" in out and "0 failed" in out
    (report,) = [p for p in tmp_path.iterdir()]
    record = json.loads((report / "report.json").read_text())
    assert record["schema"] == "kvparity.report/1"
    assert record["environment"]["implementation"].endswith("BatchQuantizedKVCache")
    assert "## Summary" in (report / "report.md").read_text()


def test_run_exits_1_when_parity_breaks(capsys):
    code = main(["run", "--no-report", "--impl", "kvparity.suites.negative_controls:MaskIgnoresLeftPadding"])
    assert code == EXIT_BROKEN
    assert "FAIL" in capsys.readouterr().out


def test_unusable_implementation_exits_125(capsys):
    assert main(["run", "--no-report", "--impl", "no.such.module:Cache"]) == EXIT_CANNOT_RUN
    assert "cannot import no.such.module" in capsys.readouterr().err


def test_bad_schedule_exits_2_naming_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "requests": {"a": {"prompt_len": 2}}, "events": [{"leave": ["a"]}]}))
    assert main(["run", "--no-report", "--schedule", str(bad)]) == EXIT_USAGE
    assert f"{bad}: event #0 leave" in capsys.readouterr().err


def test_replay_prints_first_divergences(capsys):
    path = CATALOG / "rollback-uneven.json"
    code = main(["replay", str(path), "--impl", "kvparity.suites.negative_controls:RollbackByLargest"])
    assert code == EXIT_BROKEN
    assert "offset: after event #2 spec_round" in capsys.readouterr().out


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert "run" in out and "replay" in out and "125" in out

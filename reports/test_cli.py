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


def test_probe_prints_the_l0_table(capsys):
    assert main(["probe", "--batch-sizes", "1,4"]) == EXIT_OK
    out = capsys.readouterr().out
    for op in ("matmul", "quantized_matmul", "quantize", "rope_per_row_offset", "quantized_sdpa_left_padding"):
        assert op in out
    assert "B=4" in out


def test_run_l2_reports_logit_agreement(capsys):
    code = main(["run", "--no-report", "--level", "L2", "--schedule", str(CATALOG / "rollback-uneven.json")])
    assert code == EXIT_OK
    out = capsys.readouterr().out
    assert "logits bit-exact" in out and "39/39" in out


def test_missing_backend_exits_125(capsys):
    import mlx.core as mx

    if mx.is_available(mx.gpu):
        pytest.skip("this machine has a GPU backend")
    assert main(["run", "--no-report", "--device", "gpu"]) == EXIT_CANNOT_RUN
    assert "no gpu backend" in capsys.readouterr().err

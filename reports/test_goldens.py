"""Goldens: record solo traces, record an engine's traces in the same format,
compare them; other machines' goldens and damaged traces are refused."""

import json

import pytest

from kvparity.reports.cli import EXIT_BROKEN, EXIT_CANNOT_JUDGE, EXIT_OK, EXIT_USAGE, main
from kvparity.suites.format.schedule import CATALOG

SCHEDULES = ["--schedule", str(CATALOG / "rollback-uneven.json"), "--schedule", str(CATALOG / "qwen3-h64-mixed.json")]


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "golden"
    assert main(["record", str(path), *SCHEDULES]) == EXIT_OK
    return path


def test_golden_layout(golden):
    doc = json.loads((golden / "golden.json").read_text())
    assert doc["format"] == "kvparity.golden/1" and doc["source"] == "oracle"
    assert set(doc["machine"]) == {"backend", "device", "mlx", "mlx_lm", "knobs"}
    manifest = json.loads((golden / "rollback-uneven" / "a" / "manifest.json").read_text())
    assert all(len(h) == 64 for h in manifest["sha256"].values())
    assert (golden / "rollback-uneven" / "a" / "trace.safetensors").exists()


@pytest.mark.gqa_batched
def test_engine_traces_compare_equal_to_the_golden(golden, tmp_path, capsys):
    candidate = tmp_path / "candidate"
    assert main(["record", str(candidate), "--engine", *SCHEDULES]) == EXIT_OK
    assert json.loads((candidate / "golden.json").read_text())["source"].startswith("engine:")
    assert main(["compare", str(golden), str(candidate)]) == EXIT_OK
    assert "2 passed, 0 failed" in capsys.readouterr().out


@pytest.mark.gqa_batched
def test_a_broken_engine_fails_the_comparison(golden, tmp_path, capsys):
    candidate = tmp_path / "broken"
    spec = "kvparity.impl.negative_controls:MaskIgnoresLeftPadding"
    assert main(["record", str(candidate), "--engine", "--impl", spec, *SCHEDULES]) == EXIT_OK
    assert main(["compare", str(golden), str(candidate)]) == EXIT_BROKEN
    out = capsys.readouterr().out
    # the summary names each schedule's earliest divergence, whichever check saw it
    assert "0 passed, 2 failed" in out and ": after event #" in out


def test_a_golden_from_another_machine_is_refused(golden, tmp_path, capsys):
    other = tmp_path / "other"
    import shutil

    shutil.copytree(golden, other)
    doc = json.loads((other / "golden.json").read_text())
    doc["machine"]["device"] = "gpu (Apple M2 Max)"
    (other / "golden.json").write_text(json.dumps(doc))
    assert main(["compare", str(other), str(golden)]) == EXIT_CANNOT_JUDGE
    assert "golden recorded with device='gpu (Apple M2 Max)'" in capsys.readouterr().err


def test_a_tampered_or_truncated_trace_is_refused(golden, tmp_path, capsys):
    import shutil

    tampered = tmp_path / "tampered"
    shutil.copytree(golden, tampered)
    tensors = tampered / "rollback-uneven" / "b" / "trace.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-5] ^= 0x01
    tensors.write_bytes(bytes(data))
    assert main(["compare", str(golden), str(tampered)]) == EXIT_USAGE
    assert "does not match its sha256" in capsys.readouterr().err

    truncated = tmp_path / "truncated"
    shutil.copytree(golden, truncated)
    tensors = truncated / "rollback-uneven" / "b" / "trace.safetensors"
    tensors.write_bytes(tensors.read_bytes()[: len(data) // 2])
    assert main(["compare", str(golden), str(truncated)]) == EXIT_USAGE
    assert "rollback-uneven/b" in capsys.readouterr().err


def test_record_never_overwrites(golden, capsys):
    assert main(["record", str(golden), *SCHEDULES]) == EXIT_USAGE
    assert "never overwritten" in capsys.readouterr().err

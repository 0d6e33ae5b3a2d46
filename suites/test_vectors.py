"""Conformance vectors (``suites/l1/vectors.py``): exported byte for byte the
same every time, held against the current oracle, and read by a cache in
another language (impl/node/, its own ``node --test``)."""

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest

from kvparity.impl.negative_controls import MaskIgnoresLeftPadding
from kvparity.oracle import tensor_file
from kvparity.oracle.gguf import sha256_file
from kvparity.reports.cli import EXIT_BROKEN, EXIT_OK, EXIT_USAGE, main
from kvparity.suites.l1 import vectors
from kvparity.suites.core.adapter import Implementation
from kvparity.suites.format.schedule import CATALOG
from kvparity.suites.core.loading import load

# Small schedules that between them join, prefill padded, decode, verify, roll back, leave, extract and reinsert.
FEW = [str(CATALOG / name) for name in ("bits-3.json", "batched-prefill.json", "extract-decode-reinsert.json")]
NODE = shutil.which("node")
ROOT = Path(__file__).resolve().parents[1]
NODE_DIR = ROOT / "impl" / "node"
SCHEMA = ROOT / "reports" / "schema" / "vectors.schema.json"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path, _ = vectors.export(tmp_path_factory.mktemp("vectors") / "set", FEW)
    return path


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """One schedule's vectors: each check of them exports it again."""
    path, _ = vectors.export(tmp_path_factory.mktemp("vectors") / "one", FEW[:1])
    return path


def test_export_is_deterministic(exported, tmp_path):
    again, manifest = vectors.export(tmp_path / "again", FEW)
    names = sorted(p.name for p in exported.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert len(names) == 2 * len(FEW) + 1
    for name in names:
        assert (exported / name).read_bytes() == (again / name).read_bytes(), name
    assert [s["name"] for s in manifest["schedules"]] == ["bits-3", "batched-prefill", "extract-decode-reinsert"]
    assert set(manifest["versions"]) >= {"kvparity", "mlx", "mlx_lm"}


def test_the_files_are_what_the_manifest_and_the_schema_say(exported):
    schema = json.loads(SCHEMA.read_text())
    assert schema["$defs"]["format"]["const"] == vectors.FORMAT
    assert schema["$defs"]["format_version"]["const"] == vectors.FORMAT_VERSION
    for path in exported.glob("*.json"):
        jsonschema.validate(json.loads(path.read_text()), schema)
    wrong = json.loads((exported / "bits-3.json").read_text())
    wrong["calls"][0]["member"] = "reset"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, schema)
    manifest = json.loads((exported / vectors.MANIFEST).read_text())
    for name, digest in manifest["files"].items():
        assert sha256_file(exported / name) == digest
    cases = json.loads((exported / "bits-3.json").read_text())
    tensors, _ = tensor_file.read(exported / cases["tensors"])
    members = [c["member"] for c in cases["calls"]]
    assert members[0] == "merge" and "update_and_fetch" in members and "filter" in members
    write = next(c for c in cases["calls"] if c["member"] == "update_and_fetch")
    assert tensors[write["args"]["keys"]][0] == "BF16"  # the dense keys, in the schedule's dtype
    assert tensors["tape/L0/a/keys.packed"][0] == "U32"


def test_check_passes_an_exported_set_and_names_what_was_edited(one, tmp_path, capsys):
    exported = one
    assert main(["vectors", "check", str(exported)]) == EXIT_OK
    assert "identical to the current oracle's export" in capsys.readouterr().out

    edited = tmp_path / "edited"
    shutil.copytree(exported, edited)
    cases = json.loads((edited / "bits-3.json").read_text())
    cases["calls"][1]["expected"]["rows"][0]["length"] += 1
    (edited / "bits-3.json").write_text(json.dumps(cases))
    assert main(["vectors", "check", str(edited)]) == EXIT_BROKEN
    assert "bits-3.json: sha256" in capsys.readouterr().out

    # The same edit with the manifest's sha256 made to match: stale against the oracle, named by its path.
    manifest = json.loads((edited / vectors.MANIFEST).read_text())
    manifest["files"]["bits-3.json"] = sha256_file(edited / "bits-3.json")
    (edited / vectors.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(vectors.VectorsDiffer, match=r"bits-3.json: at /calls/1/expected/rows/0/length: 23, the "
                                                    r"current oracle gives 22"):
        vectors.check(edited)

    # One byte of one tape: the tensor and the index named.
    tensors, metadata = tensor_file.read(exported / "bits-3.safetensors")
    code, tape = tensors["tape/L0/b/values.scales"]
    tape = tape.copy()
    tape.reshape(-1)[3] ^= 1
    tensors["tape/L0/b/values.scales"] = (code, tape)
    tensor_file.write(edited / "bits-3.safetensors", tensors, metadata)
    shutil.copyfile(exported / "bits-3.json", edited / "bits-3.json")
    manifest["files"]["bits-3.json"] = sha256_file(edited / "bits-3.json")
    manifest["files"]["bits-3.safetensors"] = sha256_file(edited / "bits-3.safetensors")
    (edited / vectors.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(vectors.VectorsDiffer, match=r"bits-3.safetensors: tensor 'tape/L0/b/values.scales' "
                                                    r"differs at flat index 3"):
        vectors.check(edited)


def test_no_manifest_is_bad_input(tmp_path, capsys):
    assert main(["vectors", "check", str(tmp_path)]) == EXIT_USAGE
    assert "no manifest" in capsys.readouterr().err
    assert main(["vectors", "export", str(tmp_path)]) == EXIT_USAGE  # never over an existing directory
    own = tmp_path / "own.json"
    shutil.copyfile(FEW[0], own)
    assert main(["vectors", "export", str(tmp_path / "v"), "--schedule", str(own)]) == EXIT_USAGE
    assert "not a schedule file of the catalog" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()


def test_no_vectors_from_a_run_that_fails():
    """The export gates on the run's checks: a cache the oracle disagrees with writes nothing."""
    broken = Implementation("MaskIgnoresLeftPadding", MaskIgnoresLeftPadding, {"per_row_rollback": True})
    with pytest.raises(vectors.VectorsError, match="does not pass it"):
        vectors.record_schedule(load(FEW[0]), broken)


def node_test(directory, bug: str = ""):
    env = {**os.environ, "KVPARITY_VECTORS": str(directory), "KVPARITY_NODE_BUG": bug}
    return subprocess.run([NODE, "--test", str(NODE_DIR)], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_the_node_cache_passes_the_vectors_and_its_bug_control_is_named(exported):
    passed = node_test(exported)
    assert passed.returncode == 0, passed.stdout[-3000:]
    assert f"# pass {len(FEW) + 1}" in passed.stdout  # each schedule and the manifest

    failed = node_test(exported, bug="extract")
    assert failed.returncode != 0
    assert f"# fail {len(FEW)}" in failed.stdout  # every row is extracted at each event's end
    named = re.findall(r"0: '([\w-]+): after call \d+ \((\w+), layer 0, event \d+\)", failed.stdout)
    assert sorted(named) == sorted((Path(f).stem, "extract") for f in FEW), failed.stdout[-3000:]


def raw_bits(x) -> list:
    """An array's elements as their bits (unsigned integers of the element's width)."""
    import numpy as np

    array = tensor_file.bits_of(x)[1]
    return array.view({4: np.uint32, 2: np.uint16}[array.dtype.itemsize]).reshape(-1).tolist()


def quantize_cases() -> list:
    """Groups that reach each branch of MLX's affine quantization, answered by mx.quantize."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(44)
    ties = np.tile(np.array([0, 3, 0.5, 1.5, 2.5, 1, 2, 3], np.float32), 16)  # (3 - w) / 1 lands on halves
    groups = {
        "normal": lambda: rng.standard_normal(128), "tiny": lambda: rng.standard_normal(128) * 1e-8,
        "large": lambda: rng.standard_normal(128) * 1e4, "zeros": lambda: np.zeros(128),
        "constant": lambda: np.full(128, -0.37), "positive": lambda: np.abs(rng.standard_normal(128)),
        "negative": lambda: -np.abs(rng.standard_normal(128)), "ties": lambda: ties,
        "subnormal": lambda: rng.standard_normal(128) * 1e-6,
    }
    cases = []
    for dtype in ("bfloat16", "float16", "float32"):
        for bits in (2, 3, 4, 5, 6, 8):
            for group_size in (32, 64, 128):
                for label, draw in groups.items():
                    x = mx.array(np.stack([draw(), draw()]).astype(np.float32)).astype(getattr(mx, dtype))
                    triple = mx.quantize(x, group_size=group_size, bits=bits)
                    raw = [raw_bits(a) for a in (x, *triple)]
                    cases.append(dict(zip(("x", "packed", "scales", "biases"), raw), dtype=dtype, bits=bits,
                                      group_size=group_size, rows=2, dim=128, label=label))
    return cases


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_the_node_quantization_is_mlxs_bit_for_bit():
    cases = quantize_cases()
    done = subprocess.run([NODE, str(NODE_DIR / "quantize-cases.mjs")], input=json.dumps(cases), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert f"{len(cases)} of {len(cases)} cases bit-exact" in done.stdout


@pytest.mark.slow  # 4 s a level here: the catalog's prefill and extract schedules, passing and with the bug
@pytest.mark.skipif(NODE is None, reason="node is not installed")
@pytest.mark.parametrize("level", ["L1", "L2"])
def test_the_node_cache_through_the_process_protocol(level, monkeypatch, capsys):
    """kvparity check on the Node cache as a process: it passes, and its bug
    control fails with one root cause, extract (needs the process protocol)."""
    pytest.importorskip("kvparity.suites.core.process_cache", reason="the process protocol (--impl exec:) is not here")
    impl = f"exec:{shlex.quote(NODE)} {shlex.quote(str(NODE_DIR / 'cache.mjs'))}"
    schedules = [a for f in FEW[1:] for a in ("--schedule", f)]
    assert main(["check", "--level", level, *schedules, "--impl", impl]) == EXIT_OK, capsys.readouterr().out
    monkeypatch.setenv("KVPARITY_NODE_BUG", "extract")
    assert main(["check", "--level", level, *schedules, "--impl", impl]) == EXIT_BROKEN
    out = capsys.readouterr().out
    assert "1 root cause(s):" in out and "[1] extract:" in out, out[-3000:]


@pytest.mark.slow  # the whole L1 catalog: export 9 s and node 10 s on an idle 2-core machine (63 s and 20 s at load 15)
@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_the_node_cache_passes_the_whole_catalogs_vectors(tmp_path):
    path, manifest = vectors.export(tmp_path / "all")
    assert manifest["catalog"] == vectors.WHOLE and len(manifest["schedules"]) >= 80
    passed = node_test(path)
    assert passed.returncode == 0, passed.stdout[-3000:]
    assert f"# pass {len(manifest['schedules']) + 1}" in passed.stdout

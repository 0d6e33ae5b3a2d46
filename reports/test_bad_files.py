"""Every bad input is one line and exit 129, before any work; a disk that
fills keeps the verdict printed. What kvparity reads from its user
(schedules, arrivals files, expectations, policies, pyproject's settings,
report records to merge) goes through one reader (``oracle/inputs.py``): a
FIFO, a file over the size limit, bytes that are not UTF-8, a key given
twice, NaN or Infinity, an integer of thousands of digits and nesting ten
thousand deep are each refused naming the file and the reason. A property
test mutates catalog files at random: the exit status is always one the
README names, never 128, never a traceback."""

import contextlib
import io
import json
import os
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from kvparity.oracle.inputs import LIMIT_ENV, MAX_DEPTH, MAX_DIGITS
from kvparity.reports import writer
from kvparity.reports.cli import EXIT_BROKEN, EXIT_CANNOT_JUDGE, EXIT_OK, EXIT_USAGE, main
from kvparity.suites.format.arrivals import L3_CATALOG
from kvparity.suites.format.schedule import CATALOG

REFERENCE = "kvparity.impl.batch_quantized:BatchQuantizedKVCache"
CONTROL = "kvparity.impl.negative_controls:MaskIgnoresLeftPadding"
SCHEDULE = CATALOG / "join-empty.json"
ARRIVALS = L3_CATALOG / "staggered.json"
SHORTER = CATALOG / "join-shorter-joiner.json"  # MaskIgnoresLeftPadding fails it at L2


def added(text: str, more: str) -> str:
    """A JSON object's text with ``more`` (``"key": value``) at its end."""
    return text.rstrip()[:-1] + ", " + more + "}"


# Each bad input: what it makes of a document's text, and what its refusal says.
BAD = {
    "nested ten thousand deep": (lambda text: added(text, '"x": ' + "[" * 10_000 + "]" * 10_000),
                                 f"nested more than {MAX_DEPTH} deep"),
    "a byte that is not UTF-8": (lambda text: text.replace('"description": "', '"description": "\udcff', 1),
                                 "not UTF-8: byte 0xff at offset"),
    "an integer of 5,000 digits": (lambda text: added(text, '"x": ' + "7" * 5000),
                                   f"an integer of 5000 digits (at most {MAX_DIGITS})"),
    "a key given twice": (lambda text: added(text, '"name": "another"'),
                          "the key 'name' is given twice in one object"),
    "NaN as a name": (lambda text: text.replace('"name": "', '"name": NaN, "_": "', 1),
                      "NaN is not a number kvparity reads"),
    "Infinity deep inside": (lambda text: added(text, '"x": [{"y": [-Infinity]}]'),
                             "-Infinity is not a number kvparity reads"),
    "a number too large for a float": (lambda text: added(text, '"x": 1e999'), "the number 1e999 is too large"),
}


def bad_file(tmp_path, source: Path, bad: str) -> Path:
    make, _ = BAD[bad]
    path = tmp_path / source.name
    path.write_bytes(make(source.read_text()).encode("utf-8", "surrogateescape"))
    return path


def kvparity(*argv):
    """main(argv) in this process: (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


def refused(*argv) -> str:
    """The one line a usage error prints."""
    status, out, err = kvparity(*argv)
    assert status == EXIT_USAGE, out + err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("source, level", [(SCHEDULE, "L1"), (ARRIVALS, "L3")], ids=["schedule", "arrivals"])
def test_a_bad_schedule_or_arrivals_file_is_one_line(tmp_path, source, level, bad):
    path = bad_file(tmp_path, source, bad)
    said = refused("check", "--impl", REFERENCE, "--level", level, "--schedule", str(path))
    assert said.startswith(f"kvparity: {path}: ") and BAD[bad][1] in said, said


@pytest.mark.parametrize("model, said", [
    ("[" * 2000 + "llama-h64-f32", "unknown model"),
    ("models/" + "a" * 5000, "no such model directory or config.json"),
    ("a" * 5000 + ".json", "no such model directory or config.json"),
], ids=["a name", "a directory", "a config.json"])
def test_a_model_named_longer_than_any_file_name_is_one_line(tmp_path, model, said):
    """The property test's find: a model name no file system takes (over
    255 bytes) was looked for as a path, and the file system's refusal
    (ENAMETOOLONG) was kvparity's internal error, 128."""
    doc = json.loads(ARRIVALS.read_text())
    path = tmp_path / ARRIVALS.name
    path.write_text(json.dumps({**doc, "model": model}))
    assert said in refused("check", "--impl", REFERENCE, "--level", "L3", "--schedule", str(path))
    assert said in refused("check", "--impl", REFERENCE, "--level", "L2", "--model", model)


@pytest.mark.parametrize("option", ["--policy", "--out"])
def test_a_path_longer_than_any_file_name_is_one_line(tmp_path, option):
    """A path given that no file system takes is bad usage (129), not kvparity's error."""
    long = str(tmp_path / ("a" * 5000 + ".json"))
    said = refused("check", "--impl", REFERENCE, "--level", "L1", "--schedule", str(SCHEDULE), option, long)
    assert "File name too long" in said or "name too long" in said.lower(), said


@pytest.mark.parametrize("bad", ["a key given twice", "NaN as a name", "an integer of 5,000 digits"])
def test_a_bad_expectations_policy_or_record_is_one_line(tmp_path, bad):
    expectations = tmp_path / "expectations.json"
    expectations.write_text(BAD[bad][0](json.dumps({"divergences": [], "name": "e"})))
    said = refused("check", "--impl", REFERENCE, "--level", "L1", "--schedule", str(SCHEDULE),
                   "--expectations", str(expectations))
    assert BAD[bad][1] in said and str(expectations) in said, said
    policy = tmp_path / "policy.json"
    policy.write_text(BAD[bad][0](json.dumps({"backend": "cpu", "name": "p"})))
    said = refused("check", "--impl", REFERENCE, "--level", "L1", "--schedule", str(SCHEDULE),
                   "--policy", str(policy))
    assert BAD[bad][1] in said and str(policy) in said, said
    record = tmp_path / "shard" / "report.json"
    record.parent.mkdir()
    record.write_text(BAD[bad][0](json.dumps({"schema": "kvparity.report/2", "name": "r"})))
    said = refused("merge", str(record.parent), "--out", str(tmp_path / "merged"))
    assert BAD[bad][1] in said and str(record) in said, said


@pytest.mark.parametrize("table, said", [
    ('impl = nan', "nan is not a number kvparity reads"),
    ('levels = "L1"\nlevels = "L2"', "not TOML"),
    ("device = " + "9" * 5000, "Exceeds the limit"),
    ("model = " + "[" * 100 + "]" * 100, f"nested more than {MAX_DEPTH} deep"),
    ("model = " + "[" * 10_000 + "]" * 10_000, f"nested more than {MAX_DEPTH} deep"),
])
def test_bad_settings_are_one_line(tmp_path, monkeypatch, table, said):
    (tmp_path / "pyproject.toml").write_text(f"[tool.kvparity]\n{table}\n")
    monkeypatch.chdir(tmp_path)
    line = refused("check", "--level", "L1", "--schedule", str(SCHEDULE))
    assert said in line and "pyproject.toml" in line, line


def test_settings_that_are_not_utf8_are_one_line(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_bytes(b'[tool.kvparity]\nimpl = "caf\xe9:Cache"\n')
    monkeypatch.chdir(tmp_path)
    assert "not UTF-8: byte 0xe9" in refused("check", "--level", "L1", "--schedule", str(SCHEDULE))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_given_as_a_schedule_is_refused_without_reading_it(tmp_path):
    fifo = tmp_path / "schedule.json"
    os.mkfifo(fifo)  # nothing writes it: a read would wait forever
    said = refused("check", "--impl", REFERENCE, "--level", "L1", "--schedule", str(fifo))
    assert f"{fifo}: not a regular file (a FIFO)" in said


def test_a_file_over_the_size_limit_is_refused_by_its_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no pyproject.toml to read first
    schedule = tmp_path / "long.json"
    schedule.write_text(json.dumps({**json.loads(SCHEDULE.read_text()), "description": "x" * 10_000}))
    size = schedule.stat().st_size
    monkeypatch.setenv(LIMIT_ENV, str(size - 1))
    said = refused("check", "--impl", REFERENCE, "--level", "L1", "--schedule", str(schedule))
    assert f"{schedule}: {size} bytes, more than the {size - 1} bytes kvparity reads" in said
    monkeypatch.setenv(LIMIT_ENV, str(size))
    assert kvparity("check", "--impl", REFERENCE, "--level", "L1", "--schedule", str(schedule))[0] == EXIT_OK
    monkeypatch.setenv(LIMIT_ENV, "many")
    assert f"{LIMIT_ENV}='many': expected a number of bytes" in refused(
        "check", "--impl", REFERENCE, "--level", "L1", "--schedule", str(schedule))


@pytest.mark.gqa_batched
def test_an_unwritable_report_keeps_the_printed_verdict(tmp_path, monkeypatch):
    """A disk that fills while the report is written: said in one line, nothing half-written, the verdict's status."""
    def full(*args, **kwargs):  # the disk fills after report.json and report.md are written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer.html, "render", full)
    status, out, err = kvparity("run", "--impl", CONTROL, "--level", "L2", "--schedule", str(SHORTER),
                                "--out", str(tmp_path))
    assert status == EXIT_BROKEN and "1 failed" in out, out + err
    assert "the report could not be written under" in err and "No space left on device" in err, err
    assert "Traceback" not in err and not list(tmp_path.iterdir())


@pytest.mark.gqa_batched
@pytest.mark.parametrize("impl, expected", [(REFERENCE, EXIT_OK), (CONTROL, EXIT_BROKEN)])
def test_a_solo_run_cache_on_a_full_disk_changes_no_verdict(tmp_path, monkeypatch, impl, expected):
    """MLX reports a write to a full disk as RuntimeError: the solo runs
    stand as computed, never 'oracle cannot run'."""
    def full(*args, **kwargs):
        raise RuntimeError("[write] Unable to write 488 bytes to file.")

    monkeypatch.setenv("KVPARITY_ORACLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(mx, "save_safetensors", full)
    status, out, err = kvparity("check", "--impl", impl, "--level", "L2", "--schedule", str(SHORTER))
    assert status == expected, out + err
    assert "oracle cannot run" not in out and "could not be stored, and were used as computed" in out, out


# -- the property: whatever the bytes, a status the README names ---------------------------

SOURCES = [(CATALOG / "join-empty.json", "L1"), (CATALOG / "leave-longest.json", "L1"),
           (CATALOG / "extract-decode-reinsert.json", "L1"), (L3_CATALOG / "prompt-length-1.json", "L3")]
NAMED = {EXIT_OK, EXIT_BROKEN, EXIT_CANNOT_JUDGE, EXIT_USAGE}

# Counts a run finishes in moments, and sizes no run could hold (refused by the memory estimate, the
# arrival bound or the digit limit): a valid file asking for a million decode steps is a long run, not bad input.
values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 64) | st.sampled_from([2**63, -2**63, 2**70, 10**40])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


@st.composite
def mutated(draw, text: str) -> bytes:
    """``text`` with one mutation: bytes flipped, cut, copied or inserted,
    or a value anywhere in the document replaced by another (of any type)."""
    data = text.encode()
    how = draw(st.sampled_from(["flip", "cut", "copy", "insert", "value", "key"]))
    at = draw(st.integers(0, len(data) - 1))
    if how == "flip":
        return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
    if how == "cut":
        return data[:at] + data[at + draw(st.integers(1, 40)):]
    if how == "copy":
        return data[:at] + data[at:at + draw(st.integers(1, 40))] + data[at:]
    if how == "insert":
        return data[:at] + draw(st.binary(min_size=1, max_size=6) | st.sampled_from(
            [b"NaN", b"-Infinity", b"[" * 2000, b"9" * 5000, b'"name": 1, ', b"\xc3"])) + data[at:]
    doc = json.loads(text)
    node, parents = doc, []
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        parents.append((node, key))
        node = node[key]
    if not parents:
        return json.dumps(draw(values), allow_nan=True).encode()
    parent, key = parents[-1]
    if how == "key" and isinstance(parent, dict):
        parent[draw(st.text(max_size=6))] = parent.pop(key)
    else:
        parent[key] = draw(values)
    return json.dumps(doc, allow_nan=True).encode()


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_a_mutated_catalog_file_exits_with_a_named_status_and_no_traceback(tmp_path_factory, data):
    source, level = data.draw(st.sampled_from(SOURCES), label="source")
    path = tmp_path_factory.mktemp("mutated") / source.name
    path.write_bytes(data.draw(mutated(source.read_text()), label="bytes"))
    status, out, err = kvparity("check", "--impl", REFERENCE, "--level", level, "--schedule", str(path))
    event(f"exit {status}")
    assert status in NAMED and "Traceback" not in out + err, (status, out[-2000:], err[-2000:])
    if status == EXIT_USAGE:
        assert len(err.strip().splitlines()) == 1, err

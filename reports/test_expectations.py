"""Declared divergences: a cache that differs by design keeps the rest of the
gate. The designed difference is the control ExtractReturnsBfloat16 (its
extract hands out the row dequantized, in a bfloat16 KVCache); with the
shipped expectations file it passes every other check, a bug beside it still
fails, a declaration that no longer happens is reported (and fails under
strict), and a bad file is refused before anything runs."""

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from kvparity.reports.cli import EXIT_BROKEN, EXIT_OK, EXIT_USAGE, main
from kvparity.reports.expectations import (
    EXAMPLES, LEVELS, MATCHED, NOT_EXERCISED, UNEXPECTEDLY_PASSING, load_expectations,
)
from kvparity.reports.policy import load_policy
from kvparity.reports.verdicts import DIVERGED, HELD, judge, verdict_of_run
from kvparity.reports.report_json import SCHEMA_PATH, build_record
from kvparity.reports.writer import write_report
from kvparity.suites.core.adapter import load_implementation
from kvparity.suites.format.checks import CHECKS
from kvparity.suites.core.evidence import EXPECTED_DIVERGENCE, FAIL
from kvparity.suites.format.events import Reinsert
from kvparity.suites.l1.run import run_l1
from kvparity.suites.format.schedule import CATALOG, catalog_paths
from kvparity.suites.core.loading import load

CONTROLS = "kvparity.impl.negative_controls"
BF16 = f"{CONTROLS}:ExtractReturnsBfloat16"
BF16_AND_OFFSET = f"{CONTROLS}:ExtractReturnsBfloat16TrimForgetsOffset"
EXAMPLE = str(EXAMPLES / "extract-bfloat16.json")
ONE = str(CATALOG / "join-longer-joiner.json")
REPO = Path(__file__).resolve().parents[1]


# A row extracted from a float16 batch comes back bfloat16; decoding alone,
# mlx-lm promotes it to float32, and extend refuses it at its reinsert: a
# consequence of the design that a request does observe, so it stays a FAIL.
L1_CATALOG = {path: load(path) for path in catalog_paths("L1")}
FLOAT16_REINSERTS = sorted(path.stem for path, s in L1_CATALOG.items()
                           if s.dtype == "float16" and any(isinstance(e, Reinsert) for e in s.events))
# A stored row comes back bfloat16 too: a request that joins from it holds
# its keys and values quantized again, and observes that (check stored).
STORED_ROWS = sorted(path.stem for path, s in L1_CATALOG.items() if any(e.kind == "store" for e in s.events))
# A batched join from a store prefills the rests of the rows together: the row quantized again is seen
# in the prefill's write (check bytes), where the stored check reads a joined row only once its rest is in.
BATCHED_FROM_STORE = sorted(path.stem for path, s in L1_CATALOG.items()
                            if any(e.kind == "batched_join_stored" for e in s.events))
ELSEWHERE = [str(path) for path in L1_CATALOG if path.stem not in FLOAT16_REINSERTS + STORED_ROWS]


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def check_line(out, check):
    """The per-check table's line for ``check``: [held, diverged, expected, not compared] schedule counts."""
    table = out.split("per check, schedule runs (rows):")[1]
    line = next(line for line in table.splitlines() if line.split()[:1] == [check])
    return [int(cell.split()[0]) for cell in line.split("  ")[1:] if cell.strip()]


# -- the designed difference -----------------------------------------------------------


@pytest.mark.slow  # about 8 s on 2 cores (the README's test command stays near 2 min)
def test_without_expectations_the_designed_difference_fails_and_the_table_shows_what_held(capsys):
    code, out, err = run(capsys, "check", "--level", "L1", "--impl", BF16)
    assert code == EXIT_BROKEN, out + err
    assert "extract(0) returned an unquan" in out  # the summary cuts the message at 90 characters
    schedules = sum(check_line(out, "extract"))
    assert check_line(out, "extract") == [0, schedules, 0, 0]
    for held in ("offset", "left_padding", "mask", "shared_padding", "nbytes"):
        assert check_line(out, held) == [schedules, 0, 0, 0], held


@pytest.mark.slow  # about 8 s on 2 cores (the README's test command stays near 2 min)
def test_with_the_expectations_file_only_the_float16_reinserts_fail(capsys):
    # The catalog's schedules, which the file names: generated ones reinsert rows too, under names it cannot list.
    code, out, err = run(capsys, "check", "--level", "L1", "--impl", BF16, "--expectations", EXAMPLE,
                         "--generated", "0")
    assert code == EXIT_BROKEN, out + err
    failing = {line.split()[0]: line for line in out.splitlines() if f"  {FAIL}  " in line}
    assert FLOAT16_REINSERTS and STORED_ROWS and sorted(failing) == sorted(FLOAT16_REINSERTS + STORED_ROWS), out
    # first the row's scales come back float32 after decoding alone, then extend refuses the row
    assert all("layout: after event" in failing[name] and "solo_step" in failing[name]
               for name in FLOAT16_REINSERTS), out
    assert BATCHED_FROM_STORE and all("stored: after event" in failing[name] for name in STORED_ROWS
                                      if name not in BATCHED_FROM_STORE), out
    assert all("bytes: after event" in failing[name] and "batched_join_stored" in failing[name]
               for name in BATCHED_FROM_STORE), out
    assert f"{len(FLOAT16_REINSERTS) + len(STORED_ROWS)} failed" in out


def test_with_the_expectations_file_it_passes_and_every_other_check_still_gates(capsys):
    code, out, err = run(capsys, "check", "--level", "L1", "--impl", BF16, "--expectations", EXAMPLE,
                         *(arg for path in ELSEWHERE for arg in ("--schedule", path)))
    assert code == EXIT_OK, out + err
    assert "0 failed" in out and EXPECTED_DIVERGENCE in out
    schedules = sum(check_line(out, "extract"))
    assert check_line(out, "extract") == [0, 0, schedules, 0]
    for held in ("offset", "left_padding", "mask", "shared_padding", "nbytes", "source"):
        assert check_line(out, held)[1:3] == [0, 0], held
    assert "unexpectedly passing" not in out


def test_a_bug_beside_the_declared_difference_still_fails(capsys):
    code, out, err = run(capsys, "check", "--level", "L1", "--impl", BF16_AND_OFFSET, "--expectations", EXAMPLE,
                         *(arg for path in ELSEWHERE for arg in ("--schedule", path)))
    assert code == EXIT_BROKEN, out + err
    assert check_line(out, "offset")[1] > 0
    # The failure shown first is the undeclared one, though extract diverged earlier.
    failing = [line for line in out.splitlines() if f"  {FAIL}  " in line]
    assert failing and all(" offset: after event" in line for line in failing)


def test_a_declaration_that_no_longer_happens_is_reported_and_fails_under_strict(capsys):
    code, out, err = run(capsys, "check", "--level", "L1", "--schedule", ONE, "--expectations", EXAMPLE)
    assert code == EXIT_OK, out + err
    assert UNEXPECTEDLY_PASSING in out and NOT_EXERCISED in out  # extract held; bytes' schedules did not run
    assert "1 declared divergence(s) unexpectedly passing" in out
    code, out, err = run(capsys, "check", "--level", "L1", "--schedule", ONE, "--expectations", EXAMPLE,
                         "--policy", "strict")
    assert code == EXIT_BROKEN, out + err
    assert "0 failed" in out and UNEXPECTEDLY_PASSING in out


def test_replay_takes_expectations(capsys):
    code, out, err = run(capsys, "replay", ONE, "--level", "L1", "--impl", BF16, "--expectations", EXAMPLE)
    assert code == EXIT_OK, out + err
    assert f"L1 join-longer-joiner: {EXPECTED_DIVERGENCE}" in out



def test_bisect_takes_expectations_and_follows_the_bug_not_the_declared_difference(tmp_path, capsys):
    source = tmp_path / "extract-then-trim.json"
    source.write_text(json.dumps({
        "name": "extract-then-trim", "levels": ["L1"],
        "requests": {"a": {"prompt_len": 12}, "b": {"prompt_len": 5}},
        "events": [{"join": ["a", "b"]}, {"step": 2}, {"extract": "b"}, {"step": 1}, {"trim": 2}, {"step": 1}],
    }))
    out = tmp_path / "min.json"
    code, printed, err = run(capsys, "bisect", str(source), "--impl", BF16_AND_OFFSET,
                             "--expectations", EXAMPLE, "--out", str(out))
    assert code == EXIT_BROKEN, printed + err
    assert "  offset:" in printed and f"--expectations {EXAMPLE}" in printed, printed
    minimal = json.loads(out.read_text())
    assert [e for e in minimal["events"] if "trim" in e], minimal
    code, printed, err = run(capsys, "replay", str(out), "--level", "L1", "--impl", BF16_AND_OFFSET,
                             "--expectations", EXAMPLE)
    assert code == EXIT_BROKEN, printed + err

# -- the file: refused whole, before anything runs -------------------------------------

GOOD = {"check": "extract", "reason": "by design"}
BAD = {
    "an unknown check": ({"divergences": [dict(GOOD, check="extrct")]}, "divergences[0].check: unknown check 'extrct'"),
    "an unknown level": ({"divergences": [dict(GOOD, levels=["L9"])]}, "divergences[0].levels: unknown level 'L9'"),
    "an unknown event kind": ({"divergences": [GOOD, dict(GOOD, events=["jion"])]},
                              "divergences[1].events: unknown event 'jion'"),
    "an unknown field in a declaration": ({"divergences": [dict(GOOD, schedule="x")]},
                                          "divergences[0]: unknown field 'schedule'"),
    "an unknown field at the top": ({"divergences": [GOOD], "notes": "x"}, "the file: unknown field 'notes'"),
    "no reason": ({"divergences": [{"check": "extract"}]}, "divergences[0]: missing field 'reason'"),
    "an empty reason": ({"divergences": [dict(GOOD, reason="")]}, "divergences[0].reason:"),
    "no declarations": ({"divergences": []}, "divergences:"),
    "a schedule that is not a name": ({"divergences": [dict(GOOD, schedules=[3])]}, "divergences[0].schedules[0]:"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_expectations_file_is_a_usage_error_naming_file_entry_and_field(name, tmp_path, capsys):
    doc, said = BAD[name]
    path = tmp_path / "expectations.json"
    path.write_text(json.dumps(doc))
    code, out, err = run(capsys, "check", "--level", "L1", "--impl", BF16, "--expectations", str(path))
    assert code == EXIT_USAGE, out + err
    assert f"kvparity: {path}: {said}" in err
    assert out == ""  # nothing ran


def test_a_missing_or_unparsable_file_is_a_usage_error(tmp_path, capsys):
    code, _, err = run(capsys, "run", "--no-report", "--expectations", str(tmp_path / "none.json"))
    assert code == EXIT_USAGE and "none.json: cannot read it" in err
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    code, _, err = run(capsys, "check", "--expectations", str(broken))
    assert code == EXIT_USAGE and f"{broken}: not JSON" in err


def test_the_shipped_file_and_the_schema_agree_with_the_harness():
    schema = json.loads((EXAMPLES.parent.parent / "schema" / "expectations.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    loaded = load_expectations(EXAMPLE)
    assert [d.check for d in loaded.declarations] == ["extract", "bytes"]
    fields = schema["properties"]["divergences"]["items"]["properties"]
    assert all(name in fields["levels"]["description"] for name in LEVELS)
    assert all(name in fields["check"]["description"] for name in CHECKS)
    assert {c for level in LEVELS.values() for c in level.requires} <= set(CHECKS)


# -- matching --------------------------------------------------------------------------


def test_a_declaration_matches_its_check_levels_schedules_and_event_kinds(tmp_path):
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"divergences": [
        {"check": "extract", "levels": ["L1"], "schedules": ["join-*"], "events": ["join"], "reason": "r"}]}))
    declared = load_expectations(path)
    result = run_l1(load(ONE), load_implementation(BF16))
    extract = [d for d in result.divergences if d.check == "extract"]
    after_join = [d for d in extract if result.event_kinds[d.event_index] == "join"]
    assert after_join and len(after_join) < len(extract)
    assert all(declared.declared(d, result) == 0 for d in after_join)
    assert all(declared.declared(d, result) is None for d in extract if d not in after_join)
    assert judge(result, load_policy("cpu"), declared).verdict == FAIL  # the extracts after a step were not declared
    result.schedule = "other"
    assert declared.declared(after_join[0], result) is None


def test_an_expected_row_still_needs_evidence_for_every_other_required_check():
    declared = load_expectations(EXAMPLE)
    result = run_l1(load(ONE), load_implementation(BF16))
    for row in result.rows:  # as if the masks had never been compared
        for per_event in row.counts.values():
            per_event.pop("mask", None)
    assert judge(result, load_policy("cpu"), declared).verdict == "no evidence"


# -- reports ---------------------------------------------------------------------------


def test_every_report_format_shows_the_checks_and_the_declarations(tmp_path):
    declared, cpu = load_expectations(EXAMPLE), load_policy("cpu")
    results = [judge(run_l1(load(CATALOG / f"{name}.json"), load_implementation(BF16)), cpu, declared)
               for name in ("join-longer-joiner", "head-dim-64")]
    verdict = verdict_of_run(results, expectations=declared, policy=cpu)
    assert verdict.exit_status == EXIT_OK and {r.verdict for r in results} == {EXPECTED_DIVERGENCE}
    assert verdict.checks["offset"]["schedules"][HELD] == 2 and verdict.checks["extract"]["rows"][DIVERGED] == 0
    assert [d["status"] for d in verdict.declarations] == [MATCHED, MATCHED]
    env = {"kvparity": "0", "mlx": "0", "python": "3", "platform": "p", "backend": "cpu", "device": "cpu"}
    path = write_report(results, env, tmp_path, policy=cpu, run_verdict=verdict, expectations=declared)
    record = json.loads((path / "report.json").read_text())
    jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text())).validate(record)
    assert record["checks"]["extract"]["schedules"][EXPECTED_DIVERGENCE] == 2
    assert record["expectations"]["declarations"][1]["matched"] > 0
    assert all(d["declared"] == 0 for r in record["results"] for row in r["rows"] for d in row["divergences"]
               if d["check"] == "extract")
    text = (path / "report.md").read_text()
    assert "## Checks: schedule runs (rows)" in text and "## Declared divergences" in text
    assert "| expected divergence" in text
    junit = (path / "junit.xml").read_text()
    assert 'classname="kvparity.expectations"' in junit and f'message="{EXPECTED_DIVERGENCE}: ' in junit
    html = (path / "report.html").read_text()
    assert 'id="checks"' in html and 'id="declared-divergences"' in html and 'class="badge expected"' in html
    record["expectations"]["declarations"][0]["status"] = "stale"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text())).validate(record)
    assert build_record(results, env, policy=cpu, run_verdict=verdict)["expectations"] is None


# -- messages a user can read ----------------------------------------------------------


def messages(control, schedule=ONE):
    return [d.message() for d in run_l1(load(schedule), load_implementation(f"{CONTROLS}:{control}")).divergences]


def test_messages_name_what_was_returned_in_words():
    padding = [m for m in messages("LeftPaddingOffByOne") if m.startswith("left_padding")]
    assert padding and all("size() - left_padding[" in m and "should be the row's" in m for m in padding)
    assert not [m for m in padding if "expected -" in m]
    state = [m for m in messages("StateReturnsNone") if m.startswith("layout")]
    assert state and all("state returned nothing (None)" in m for m in state)
    assert not [m for m in state if "'NoneType'" in m or "'tuple'" in m]


# -- pytest ----------------------------------------------------------------------------


@pytest.mark.slow  # two pytest processes
def test_the_pytest_gate_takes_expectations():
    def pytest_run(*extra):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "suites/test_l1_catalog.py", "-k", "test_catalog_schedule and join-longer-joiner",
                               "--impl", BF16, *extra], cwd=REPO, capture_output=True, text=True, timeout=300)

    failed = pytest_run()
    assert failed.returncode == 1 and "extract(0) returned an unquantized" in failed.stdout, failed.stdout[-3000:]
    passed = pytest_run("--expectations", EXAMPLE)
    assert passed.returncode == 0 and "1 passed" in passed.stdout, passed.stdout[-3000:]

"""``kvparity mutate`` and its parts: cosmic-ray's mutants of a file, the
fixed sample, the equivalents file (bad input refused in one line, before any
gate runs), the gate's exit status read as an outcome (a real child process
per stage, a hang killed by the timeout), the campaign's exit status, the
mutated module imported from its copy, and ``check --exit-first``."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvparity.reports.cli import EXIT_BROKEN, EXIT_USAGE, main
from kvparity.reports.commands.base import CannotRun

pytest.importorskip("cosmic_ray")

from kvparity.reports import mutants  # noqa: E402 (after the skip: it needs cosmic-ray's mutants)
from kvparity.reports.commands.mutate import summary  # noqa: E402
from kvparity.reports.mutants import (  # noqa: E402
    KILLED, NOT_JUDGED, SURVIVED, TIMEOUT, Gate, Judged, MutantsError, load_equivalents, match_equivalents,
    mutants_of, sample,
)

SOURCE = textwrap.dedent("""\
    def shift(a, b):
        if a > b:
            return a - 1
        return b
""")
ENTRY = """[[equivalent]]
file = "shift.py"
line = 3
operator = "core/ReplaceBinaryOperator_Sub_Add"
mutant = "return a + 1"
reason = "a test's"
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mutants") / "shift.py"
    path.write_text(SOURCE)
    return path


@pytest.fixture(scope="module")
def found(source):
    """cosmic-ray's mutants of ``source``, made once (its plugins load in about a second)."""
    return mutants_of(source, "shift")


@pytest.fixture
def plus(found):
    return next(m for m in found if m.now == "return a + 1")


def test_cosmic_rays_mutants_of_a_file_in_line_order(source, found):
    assert [m.line for m in found] == sorted(m.line for m in found)
    plus = [m for m in found if m.operator == "core/ReplaceBinaryOperator_Sub_Add"]
    assert [(m.line, m.was, m.now) for m in plus] == [(3, "return a - 1", "return a + 1")]
    assert {m.operator for m in found if m.line == 2} >= {"core/ReplaceComparisonOperator_Gt_GtE", "core/AddNot"}
    numbers = [m.now for m in found if m.operator == "core/NumberReplacer"]
    assert sorted(numbers) == ["return a - 0", "return a - 2"]
    for m in found:  # each compiles and differs from the original on its own line only
        compile(m.source, "shift.py", "exec")
        changed = [i for i, (a, b) in enumerate(zip(SOURCE.splitlines(), m.source.splitlines()), 1) if a != b]
        assert changed == [m.line], m
    assert source.read_text() == SOURCE  # cosmic-ray never wrote the file


def test_the_sample_is_fixed_and_a_share(source, found):
    chosen = sample(found, 5)
    assert len(chosen) == 5 and set(chosen) <= set(found)
    again = [mutants.Mutant(m.path, m.module, m.line, m.column, m.operator, m.occurrence) for m in found]
    assert sample(again[::-1], 5) == chosen[::-1]  # derandomized: the same share, whatever the order
    assert sample(found, None) == found == sample(found, len(found) + 1)


@pytest.mark.parametrize("text, message", [
    ("[[equivalent]]\nfile = 'shift.py'\n", "entry 1: missing line, operator, mutant, reason"),
    (ENTRY.replace('reason = "a test\'s"', 'reason = " "'), "entry 1: reason: expected a non-empty string"),
    (ENTRY.replace("line = 3", "line = 0"), "entry 1: line: expected a line number, got 0"),
    (ENTRY.replace("line = 3", "line = true"), "entry 1: line: expected a line number, got True"),
    (ENTRY + "why = 1\n", "entry 1: unknown why"),
    (ENTRY + ENTRY, "entry 2: the same mutant as entry 1"),
    ("[equivalent]\nfile = 'x'\n", "expected [[equivalent]] entries"),
    ("equivalents = []\n", "unknown key equivalents"),
    ("[[equivalent]\n", "TOML"),
    ("[[equivalent]]\nfile = 'shift.py'\nlines = [3, 2]\nreason = 'r'\n",
     "entry 1: lines: expected [first, last], line numbers in order, got [3, 2]"),
    ("[[equivalent]]\nfile = 'shift.py'\nlines = ['a', 2]\nreason = 'r'\n", "entry 1: lines: expected [first, last]"),
    ("[[equivalent]]\nfile = 'shift.py'\nlines = [2, 3]\nline = 2\nreason = 'r'\n", "entry 1: unknown line"),
])
def test_a_bad_equivalents_file_is_one_line_naming_the_entry(text, message, tmp_path):
    path = tmp_path / "eq.toml"
    path.write_text(text)
    with pytest.raises(MutantsError) as error:
        load_equivalents(path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_region_names_lines_and_one_that_holds_no_mutant_is_refused(source, found):
    path = source.parent / "region.toml"
    path.write_text('[[equivalent]]\nfile = "shift.py"\nlines = [2, 3]\nreason = "a test\'s"\n')
    listed = match_equivalents(load_equivalents(path), found)
    assert {m.line for m in found if mutants.listed_in(listed, m)} == {2, 3}
    assert not any(mutants.vouched_for(listed, m) for m in found)
    path.write_text('[[equivalent]]\nfile = "shift.py"\nlines = [5, 9]\nreason = "a test\'s"\n')
    with pytest.raises(MutantsError, match="entry 1: shift.py:5-9 hold no mutant"):
        match_equivalents(load_equivalents(path), found)


def test_an_entry_names_one_mutant_and_a_stale_one_is_refused(source, found, tmp_path):
    path = source.parent / "eq.toml"  # its entries' files are read from its folder
    path.write_text(ENTRY)
    listed = match_equivalents(load_equivalents(path), found)
    assert [m.now for m in found if mutants.listed_in(listed, m)] == ["return a + 1"]
    path.write_text(ENTRY.replace("line = 3", "line = 4"))  # the code moved
    with pytest.raises(MutantsError, match="entry 1: shift.py:4 has no core/ReplaceBinaryOperator_Sub_Add mutant"):
        match_equivalents(load_equivalents(path), found)
    other = [mutants.Mutant(tmp_path / "other.py", "other", m.line, m.column, m.operator, m.occurrence) for m in found]
    assert match_equivalents(load_equivalents(path), other) == mutants.Listing()  # an entry for a file not mutated is left alone


class ScriptedGate(Gate):
    """The gate's stages as small Python programs: each exits with the status
    its stage is given, after checking that the mutant is what it imports."""

    def __init__(self, statuses, timeout=30.0, sleep=0.0, said="stage output"):
        super().__init__(list(statuses), [], timeout, Path.cwd())
        self.statuses, self.sleep, self.said = statuses, sleep, said

    def command(self, stage):
        program = (f"import json, os, sys, time; time.sleep({self.sleep}); "
                   f"sources = json.loads(os.environ.get({mutants.MUTANT_ENV!r}, '{{}}')); "
                   "texts = [open(p).read() for p in sources.values()]; "
                   f"print({self.said!r}); "
                   f"sys.exit({self.statuses[stage]} if all('a + 1' in t for t in texts) else 3)")
        return [sys.executable, "-c", program]


@pytest.mark.parametrize("statuses, outcome, stage, status", [
    ({"L1": 1, "L2,L3": 0}, KILLED, "L1", 1),
    ({"L1": 0, "L2,L3": 1}, KILLED, "L2,L3", 1),
    ({"L1": 0, "L2,L3": 0}, SURVIVED, None, 0),
    ({"L1": 0, "L2,L3": 128}, NOT_JUDGED, "L2,L3", 128),
    ({"L1": 129, "L2,L3": 1}, NOT_JUDGED, "L1", 129),
])
def test_each_stage_exit_status_is_an_outcome(statuses, outcome, stage, status, source, plus, tmp_path):
    judged = ScriptedGate(statuses).judge(plus, tmp_path)
    assert (judged.outcome, judged.stage, judged.status) == (outcome, stage, status)
    assert ("stage output" in judged.tail) == (outcome == NOT_JUDGED)
    assert source.read_text() == SOURCE  # the mutant was written to its copy only


def test_a_mutant_whose_module_raises_as_it_is_imported_is_killed_there(plus, tmp_path):
    said = "kvparity: cannot judge here: --impl 'shift:C': importing shift raised AttributeError: no setter"
    judged = ScriptedGate({"L1": 125, "L2,L3": 0}, said=said).judge(plus, tmp_path)
    assert (judged.outcome, judged.stage, judged.status) == (KILLED, mutants.IMPORT_STAGE, 125)
    other = ScriptedGate({"L1": 125, "L2,L3": 0}, said="kvparity: cannot judge here: no such device").judge(
        plus, tmp_path)
    assert (other.outcome, other.status) == (NOT_JUDGED, 125)  # the machine, not the mutant


def test_a_mutant_that_does_not_compile_is_no_program_and_runs_no_gate(tmp_path):
    path = tmp_path / "star.py"
    path.write_text("def f(a, *, b):\n    return a\n")
    star = [m for m in mutants_of(path, "star") if m.line == 1 and "Mul" in m.operator]
    assert star, "cosmic-ray no longer mutates a signature's *: drop NOT_A_PROGRAM"
    (tmp_path / "gate").mkdir()
    judged = ScriptedGate({"L1": 1}).judge(star[0], tmp_path / "gate")
    assert judged.outcome == mutants.NOT_A_PROGRAM and not list((tmp_path / "gate").iterdir())


def test_a_gate_that_outruns_the_timeout_is_killed_by_timeout(plus, tmp_path):
    judged = ScriptedGate({"L1": 0}, timeout=1.0, sleep=60).judge(plus, tmp_path)
    assert (judged.outcome, judged.stage, judged.status) == (TIMEOUT, "L1", None)
    assert judged.seconds < 10


def test_a_stop_ends_the_running_gates_and_judges_nothing(plus, tmp_path):
    gate = ScriptedGate({"L1": 0}, sleep=60)
    outcome = []

    def judge():
        try:
            outcome.append(gate.judge(plus, tmp_path))
        except KeyboardInterrupt:
            outcome.append("interrupted")

    worker = threading.Thread(target=judge)
    worker.start()
    while not gate.running:
        time.sleep(0.05)
    child = next(iter(gate.running.values()))
    gate.stop()
    worker.join(timeout=30)
    assert outcome == ["interrupted"] and child.poll() is not None


def campaign_status(judged, listed=(), regions=()):
    entries = [mutants.Equivalent(m.path, m.line, m.operator, m.now, "a test's", "entry") for m in listed]
    entries += [mutants.Equivalent(path, first, "", "", "a test's", "region", last) for path, first, last in regions]
    return summary(judged, mutants.Listing(tuple(entries)), 1.0, 1, None)


def test_the_campaigns_exit_status(found, plus, capsys):
    minus = next(m for m in found if m.now == "return a - 2")
    assert campaign_status([Judged(plus, KILLED, "L1", 1), Judged(minus, TIMEOUT, "L1")]) == 0
    assert campaign_status([Judged(plus, KILLED, "L1", 1), Judged(minus, SURVIVED)]) == EXIT_BROKEN
    out = capsys.readouterr().out
    assert "shift.py:3 core/NumberReplacer" in out and "now: return a - 2" in out and "[[equivalent]]" in out
    assert campaign_status([Judged(minus, SURVIVED)], listed=[minus]) == 0
    assert campaign_status([Judged(minus, KILLED, "L1", 1)], listed=[minus]) == EXIT_BROKEN  # the entry is wrong
    assert "the entry is wrong" in capsys.readouterr().out
    # A region lets its lines' mutants survive and vouches for none: a killed one is no error.
    region = [(minus.path, 2, 3)]
    assert campaign_status([Judged(plus, KILLED, "L1", 1), Judged(minus, SURVIVED)], regions=region) == 0
    assert campaign_status([Judged(plus, SURVIVED)], regions=[(minus.path, 4, 4)]) == EXIT_BROKEN
    with pytest.raises(CannotRun, match="1 mutant"):
        campaign_status([Judged(plus, KILLED, "L1", 1), Judged(minus, NOT_JUDGED, "L1", 125)])
    with pytest.raises(CannotRun, match="no evidence"):
        campaign_status([])
    assert campaign_status([Judged(plus, KILLED, "L1", 1), Judged(minus, mutants.NOT_A_PROGRAM)]) == 0


def test_the_gate_imports_the_mutant_from_its_copy(tmp_path):
    package = tmp_path / "tree" / "userpkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "helper.py").write_text("VALUE = 2\n")
    (package / "cache.py").write_text("from .helper import VALUE\nclass Cache:\n    value = VALUE\n")
    copy = tmp_path / "copy" / "cache.py"
    copy.parent.mkdir()
    copy.write_text("from .helper import VALUE\nclass Cache:\n    value = VALUE + 1\n")
    program = ("from kvparity.suites.core.adapter import resolve; cls = resolve('--impl', 'userpkg.cache:Cache'); "
               "import userpkg.cache as c; print(cls.value, c.__file__)")
    run = subprocess.run([sys.executable, "-c", program], cwd=tmp_path / "tree", capture_output=True, text=True,
                         env={**os.environ, mutants.MUTANT_ENV: json.dumps({"userpkg.cache": str(copy)})})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["3", str(copy)]  # its relative import still finds the package


def test_usage_errors_exit_129_before_any_gate_runs(tmp_path, monkeypatch, capsys):
    def forbidden(*args, **kwargs):
        raise AssertionError("a gate ran before the error was found")

    monkeypatch.setattr(Gate, "judge", forbidden)
    bad = tmp_path / "eq.toml"
    bad.write_text("[[equivalent]]\nfile = 'minimal.py'\n")
    impl = "kvparity.impl.minimal:MinimalBatchQuantizedKVCache"
    for argv, message in ((["--equivalents", str(bad)], "entry 1: missing line"),
                          (["--workers", "0"], "--workers 0: at least 1"),
                          (["--sample", "0"], "--sample 0: at least 1"),
                          (["--level", "L4"], "mutate runs the cache levels"),
                          (["--out", str(bad / "x.json")], "is not a directory")):
        assert main(["mutate", "--impl", impl, *argv]) == EXIT_USAGE
        assert message in capsys.readouterr().err


def test_check_exit_first_stops_at_the_first_failing_run(capsys):
    import kvparity

    catalog = Path(kvparity.__file__).resolve().parent.parent / "suites" / "catalog"
    files = sorted(str(p) for p in catalog.glob("batched-join-empty-bits-*.json"))[:3]
    argv = ["check", "--exit-first", "--level", "L1", "--impl",
            "kvparity.impl.negative_controls:FilterKeepsSharedPadding"] + [a for f in files for a in ("--schedule", f)]
    assert main(argv) == EXIT_BROKEN
    assert "0 passed, 1 failed (1 schedule runs)" in capsys.readouterr().out
    assert main(["check", "--exit-first", "--shard", "1/2", "--out", "x"]) == EXIT_USAGE


TINY = textwrap.dedent("""\
    from kvparity.impl.minimal import MinimalBatchQuantizedKVCache


    class Cache(MinimalBatchQuantizedKVCache):
        def trim(self, n):
            return super().trim(n) if True else 0
""")


@pytest.mark.slow
def test_mutate_lists_the_survivors_of_a_users_cache_and_never_writes_it(tmp_path):
    """The executable on a cache of one line: the branch's condition is
    constrained (a trim that trims nothing is killed), its dead ``else`` is
    not, until the equivalents file lists it. Two campaigns of 4 mutants at L1: 388 s measured on a
    2-core machine at load average 20 (the gate's L1 run was 8x slower than when quiet); bounded at
    15 minutes each."""
    (tmp_path / "tiny.py").write_text(TINY)
    command = [sys.executable, "-m", "kvparity.reports.cli", "mutate", "--impl", "tiny:Cache", "--level", "L1",
               "--workers", "2", "--out", "campaign.json"]
    first = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert first.returncode == EXIT_BROKEN, first.stdout + first.stderr
    assert (tmp_path / "tiny.py").read_text() == TINY and sorted(p.name for p in tmp_path.iterdir()) == [
        "campaign.json", "tiny.py"]
    judged = json.loads((tmp_path / "campaign.json").read_text())["mutants"]
    survivors = [m for m in judged if m["outcome"] == SURVIVED]
    assert {m["mutant"] for m in survivors} == {"return super().trim(n) if True else 1",
                                               "return super().trim(n) if True else -1"}, first.stdout
    assert any(m["outcome"] == KILLED and m["stage"] == "L1" and "if False" in m["mutant"] for m in judged)
    assert "tiny.py:6 core/NumberReplacer" in first.stdout
    (tmp_path / "eq.toml").write_text("".join(
        f'[[equivalent]]\nfile = "tiny.py"\nline = 6\noperator = "{m["operator"]}"\nmutant = "{m["mutant"]}"\n'
        'reason = "the else branch is dead: its condition is the constant True"\n' for m in survivors))
    second = subprocess.run(command + ["--equivalents", "eq.toml"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=900)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"{len(survivors)} listed as equivalent" in second.stdout

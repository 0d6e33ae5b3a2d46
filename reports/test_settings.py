"""One configuration for every entry point (reports/settings.py): the
command line, else [tool.kvparity] of the nearest pyproject.toml, else the
environment or the default, each value with where it came from, resolved
once into an immutable ``Settings``; no command gates the
reference unless a setting names it; what is under test is printed, reported
and in junit."""

import dataclasses
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest

from kvparity.reports import pytest_plugin, settings
from kvparity.reports.cli import EXIT_BROKEN, EXIT_USAGE, main
from kvparity.reports.commands.base import UsageError, settings_of
from kvparity.reports.commands.parser import build_parser
from kvparity.reports.report_json import SCHEMA_PATH
from kvparity.suites.format.schedule import CATALOG

BROKEN = "kvparity.impl.negative_controls:MaskIgnoresLeftPadding"
REFERENCE = "kvparity.impl.batch_quantized:BatchQuantizedKVCache"
ONE_L1 = ["--level", "L1", "--schedule", str(CATALOG / "join-longer-joiner.json")]


def repository(folder: Path, table: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(f'[project]\nname = "theirs"\n\n[tool.kvparity]\n{table}')
    return folder


def test_the_command_line_then_the_nearest_pyproject_then_the_default(tmp_path):
    repo = repository(tmp_path / "repo", f'impl = "{BROKEN}"\nlevels = ["L1", "L2"]\nexpectations = "ours.json"\n')
    below = repo / "tests" / "deeper"
    below.mkdir(parents=True)
    found = settings.resolve({"impl": REFERENCE}, start=below)  # found from a folder below, as pytest's rootdir
    assert found.pyproject == repo / "pyproject.toml"
    assert (found["impl"], found.source("impl")) == (REFERENCE, settings.COMMAND_LINE)
    assert (found["levels"], found.source("levels")) == ("L1,L2", str(repo / "pyproject.toml"))
    # a path in the file is read from the file's folder, not from where the command runs
    assert found["expectations"] == str(repo / "ours.json")
    assert (found["engine"], found.source("engine")) == (None, settings.DEFAULT)
    assert found.to_json()["settings"]["levels"] == {"value": "L1,L2", "from": str(repo / "pyproject.toml")}
    assert "under test: impl kvparity.impl.batch_quantized:BatchQuantizedKVCache (command line)" in found.lines()
    # The nearest pyproject.toml is the repository's, even without a [tool.kvparity] table.
    inner = repo / "sub"
    inner.mkdir()
    (inner / "pyproject.toml").write_text('[project]\nname = "sub"\n')
    assert settings.resolve({}, start=inner)["impl"] is None


@pytest.mark.parametrize("table, message", [
    ('imp = "x:Y"\n', "[tool.kvparity]: unknown imp (known: impl, levels"),
    ("impl = 3\n", "[tool.kvparity] impl: expected a string, got 3"),
    ('levels = "L1,L9"\n', "[tool.kvparity] levels 'L1,L9': expected some of L1, L2, L3, L4, or all"),
    ('impl = "x:Y"\n[tool.kvparity.extra]\n', "unknown extra"),
])
def test_a_bad_table_is_a_usage_error_naming_the_file_and_key(tmp_path, monkeypatch, capsys, table, message):
    repo = repository(tmp_path, table)
    with pytest.raises(settings.SettingsError, match=None) as error:
        settings.resolve({}, start=repo)
    assert str(repo / "pyproject.toml") in str(error.value) and message in str(error.value)
    monkeypatch.chdir(repo)
    assert main(["check", *ONE_L1]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_without_an_implementation_every_command_refuses_naming_both_ways(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no pyproject.toml above a temporary folder
    for argv in (["run", "--no-report"], ["check"], ["replay", str(CATALOG / "join-empty.json")],
                 ["bisect", str(CATALOG / "join-empty.json")], ["fuzz", "--examples", "1"], ["bench"]):
        assert main(argv) == EXIT_USAGE, argv
        err = capsys.readouterr().err
        assert "no implementation under test (no pyproject.toml from" in err, argv
        assert "--impl package.module:factory" in err and '[tool.kvparity] impl = "package.module:factory"' in err
    repository(tmp_path, 'levels = "L1"\n')
    assert main(["check"]) == EXIT_USAGE
    assert f"{tmp_path / 'pyproject.toml'} has no [tool.kvparity] impl" in capsys.readouterr().err


def test_in_kvparitys_own_checkout_its_pyproject_names_the_reference():
    found = settings.resolve({}, start=Path(__file__).parent)
    assert found["impl"] == REFERENCE and found.source("impl").endswith("pyproject.toml")


def test_a_fresh_repository_whose_pyproject_names_a_broken_cache_fails_check_naming_it(tmp_path, monkeypatch,
                                                                                     capsys):
    repo = repository(tmp_path / "theirs", f'impl = "{BROKEN}"\npolicy = "cpu"\n')
    monkeypatch.chdir(repo)  # kvparity check run there, no --impl
    code = main(["check", *ONE_L1, "--out", "out"])
    out = capsys.readouterr().out
    assert code == EXIT_BROKEN, out
    pyproject = str(repo / "pyproject.toml")
    assert f"under test: impl {BROKEN} (from {pyproject})" in out
    assert f"policy cpu (from {pyproject})" in out and "levels L1 (command line)" in out
    assert "engine mlx-lm's BatchGenerator (default)" in out
    (report,) = (repo / "out").iterdir()
    record = json.loads((report / "report.json").read_text())
    jsonschema.validate(record, json.loads(SCHEMA_PATH.read_text()))
    assert record["environment"]["implementation"] == BROKEN
    assert record["configuration"]["pyproject"] == pyproject
    assert record["configuration"]["settings"]["impl"] == {"value": BROKEN, "from": pyproject}
    assert record["configuration"]["settings"]["model"] == {"value": None, "from": "default"}
    markdown = (report / "report.md").read_text()
    assert any(line.split("|")[1:4] == [" impl ", f" {BROKEN} ", f" {pyproject} "]
               for line in (" ".join(x.split()) for x in markdown.splitlines()) if line.startswith("| impl")), markdown
    properties = {p.get("name"): p.get("value") for p in ET.parse(report / "junit.xml").iter("property")}
    assert properties["implementation"] == properties["kvparity.impl"] == BROKEN
    assert properties["kvparity.impl.from"] == pyproject
    assert (properties["kvparity.engine"], properties["kvparity.engine.from"]) == ("(default)", "default")
    assert properties["kvparity.policy.from"] == pyproject


def test_the_plugin_declares_no_setting_of_its_own():
    assert all(pytest_plugin.SETTINGS[name] is settings.SETTINGS[name] for name in pytest_plugin.SETTINGS)
    assert {"impl", "levels", "engine", "policy", "expectations"} <= set(pytest_plugin.SETTINGS)


@pytest.mark.slow  # a pytest process running one catalog test
def test_the_plugin_names_the_class_and_sources_in_its_header_and_junit(tmp_path):
    repo = repository(tmp_path, f'impl = "{BROKEN}"\nlevels = "L1"\n')
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--junitxml", "junit.xml",
                           "--pyargs", "kvparity.suites.test_l1_catalog", "-k", "join-longer-joiner"],
                          cwd=repo, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout + done.stderr
    pyproject = str(repo / "pyproject.toml")
    assert f"kvparity under test: impl {BROKEN} (from {pyproject})" in done.stdout, done.stdout
    assert "policy this backend's (default)" in done.stdout
    properties = {p.get("name"): p.get("value") for p in ET.parse(repo / "junit.xml").iter("property")}
    assert (properties["kvparity.impl"], properties["kvparity.impl.from"]) == (BROKEN, pyproject)
    assert (properties["kvparity.levels"], properties["kvparity.policy.from"]) == ("L1", "default")


def test_commands_that_read_no_setting_do_not_read_the_file(tmp_path, monkeypatch, capsys):
    repo = repository(tmp_path / "repo", 'imp = "a typo"\n')
    monkeypatch.chdir(repo)
    (repo / "empty").mkdir()
    assert main(["merge", "empty", "--out", "merged"]) == EXIT_USAGE  # nothing to merge: its own refusal
    err = capsys.readouterr().err
    assert "pyproject.toml" not in err and "empty" in err, err


# -- one immutable object, resolved once -----------------------------------------------------


def settings_for(folder: Path, monkeypatch, *argv) -> settings.Settings:
    """What ``kvparity ARGV`` run in ``folder`` resolves before its handler starts."""
    monkeypatch.chdir(folder)
    return settings_of(build_parser().parse_args(list(argv)))


def test_each_declared_setting_is_a_field_of_the_one_settings_object():
    held = {field.name for field in dataclasses.fields(settings.Settings)}
    assert set(settings.SETTINGS) - {"levels"} <= held and "levels_said" in held  # levels, as given
    assert isinstance(settings.Settings.levels, property)  # read from them


def test_the_settings_are_resolved_once_and_never_change(tmp_path, monkeypatch):
    repository(tmp_path, f'impl = "{BROKEN}"\nlevels = "L1"\ngenerated = 7\n')
    chosen = settings_for(tmp_path, monkeypatch, "check", "--require-levels", "L1", "--member-timeout", "5")
    assert (chosen.impl, chosen.levels, chosen.generated, chosen.required_levels) == (BROKEN, ("L1",), "7", ("L1",))
    assert (chosen.source("impl"), chosen.member_timeout) == (str(tmp_path / "pyproject.toml"), 5.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chosen.impl = REFERENCE
    # A command's own choice of one level, and the options a command does not have, keep their defaults.
    bisect = settings_for(tmp_path, monkeypatch, "bisect", "found.json", "--level", "L2")
    assert (bisect.levels, bisect.level, bisect.generated, bisect.server) == (("L2",), "L2", None, None)


@pytest.mark.parametrize("argv, message", [
    (["check", "--level", "L2", "--require-levels", "L1"], "--require-levels L1: --level L2 does not run L1"),
    (["check", "--models", "nope"], "--models 'nope': nope is not"),
    (["run", "--level", "L4", "--url", "http://127.0.0.1:1", "--server", "x {model} {port}"], "give one"),
    (["run", "--level", "L4", "--server", "python {model} {port}", "--quantized-kv-start", "soon"],
     "--quantized-kv-start soon: expected a token index"),
])
def test_a_setting_that_cannot_be_used_is_refused_before_the_handler(tmp_path, monkeypatch, argv, message):
    repository(tmp_path, f'impl = "{REFERENCE}"\n')
    with pytest.raises(UsageError, match=re.escape(message)):
        settings_for(tmp_path, monkeypatch, *argv)


def test_the_environment_gives_a_setting_below_the_command_line_and_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPARITY_FUZZ_EXAMPLES", "12")
    monkeypatch.chdir(tmp_path)
    found = settings.resolve({}, ("examples",))
    assert (found["examples"], found.source("examples")) == ("12", "environment KVPARITY_FUZZ_EXAMPLES")
    assert settings.resolve({"examples": "3"}, ("examples",))["examples"] == "3"
    repository(tmp_path, "examples = 5\n")
    assert settings.resolve({}, ("examples",))["examples"] == "5"

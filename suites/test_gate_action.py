"""The gate action (action.yml): its inputs and output; its steps in order
(kvparity installed from the action's own checkout, the user's project
through its install input, a device it cannot run on refused, the gate run,
CPU by default, and the report uploaded). The action's scripts (action/) run
here as the action runs them."""

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvparity.reports.verdicts import EXIT_USAGE
from kvparity.suites.test_workflows import ACTION, INPUTS, REFERENCE_IMPL, ROOT, load

SCRIPTS = ROOT / "action"


def action_steps():
    action = load(ACTION)
    assert action["runs"]["using"] == "composite"
    return action, {s.get("id") or s["name"]: s for s in action["runs"]["steps"]}


def test_action_inputs_and_output():
    action, steps = action_steps()
    assert set(action["inputs"]) == INPUTS
    # impl may be left to [tool.kvparity] in the user's pyproject.toml, as kvparity run reads it.
    assert action["inputs"]["impl"]["required"] is False and action["inputs"]["impl"]["default"] == ""
    defaults = {name: spec.get("default") for name, spec in action["inputs"].items()}
    assert (defaults["device"], defaults["install"], defaults["policy"]) == ("cpu", "auto", "")
    assert defaults["levels"] == "all" and defaults["python-version"] == "3.12"
    assert "steps.gate.outputs.exit-status" in action["outputs"]["exit-status"]["value"]
    # Every input but python-version reaches the gate through env, and nothing else does.
    gate_env = steps["gate"]["env"]
    passed = {re.fullmatch(r"\$\{\{ inputs\.([\w-]+) \}\}", v).group(1) for v in gate_env.values() if "inputs." in v}
    assert passed == INPUTS - {"python-version", "install"}, passed
    assert steps["install"]["env"] == {"KVPARITY_INSTALL": "${{ inputs.install }}"}
    assert steps["device"]["env"] == {"KVPARITY_DEVICE": "${{ inputs.device }}"}


def test_action_installs_checks_the_device_gates_and_uploads_in_order():
    _, steps = action_steps()
    order = list(steps)
    setup = next(s for s in steps.values() if str(s.get("uses", "")).startswith("actions/setup-python@"))
    assert setup["with"]["python-version"] == "${{ inputs.python-version }}"
    installs = [(name, shlex.split(s["run"])) for name, s in steps.items() if "pip install" in s.get("run", "")]
    assert installs == [("Install kvparity", ["python", "-m", "pip", "install", "$GITHUB_ACTION_PATH"])], \
        f"kvparity is installed from the action's checkout, not editable: {installs}"
    assert order.index("Install kvparity") < order.index("install") < order.index("device") < order.index("gate")
    assert not {"if"} & (set(steps["install"]) | set(steps["device"]) | set(steps["gate"])), \
        "a project that did not install, or a refused device, must not gate"
    for step in ("install", "gate"):
        assert steps[step]["working-directory"] == "${{ github.workspace }}", "the user's repository is there"
    (cache,) = [s for s in steps.values() if str(s.get("uses", "")).startswith("actions/cache@")]
    assert cache["with"]["path"] == steps["gate"]["env"]["KVPARITY_ORACLE_CACHE"], "the solo runs are cached"
    assert order.index(cache["name"]) < order.index("gate")
    for name, step in steps.items():
        for script in re.findall(r"\$GITHUB_ACTION_PATH/(action/\w+\.py)", step.get("run", "")):
            assert (ROOT / script).is_file(), f"{name}: {script} is missing"
    # The example database: restored before the gate, saved after it also when it failed, under one key.
    (restore,) = [s for s in steps.values() if str(s.get("uses", "")).startswith("actions/cache/restore@")]
    (save,) = [s for s in steps.values() if str(s.get("uses", "")).startswith("actions/cache/save@")]
    assert restore["with"]["path"] == save["with"]["path"] == steps["gate"]["env"]["KVPARITY_EXAMPLES"]
    assert restore["with"]["key"] == save["with"]["key"] and save["with"]["key"].startswith(
        restore["with"]["restore-keys"])
    assert order.index(restore["name"]) < order.index("gate") < order.index(save["name"])
    assert "steps.gate.outcome == 'success'" in save["if"] and "inputs.keep-failures == 'true'" in save["if"]
    (upload,) = [s for s in steps.values() if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert upload["with"]["path"].startswith(steps["gate"]["env"]["KVPARITY_OUT"]), upload["with"]["path"]
    last = action_steps()[0]["runs"]["steps"][-1]
    for step in (upload, last, steps["Failures in the job summary"]):
        assert "!cancelled()" in step["if"] and "steps.gate.outcome == 'success'" in step["if"], step
    assert last["env"]["KVPARITY_EXIT_STATUS"] == "${{ steps.gate.outputs.exit-status }}"
    assert 'exit "$KVPARITY_EXIT_STATUS"' in last["run"]


# The action's scripts, run here as the action runs them.

def script(name: str, monkeypatch):
    """action/NAME.py as a module (its sibling imports resolved as on the runner)."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(f"kvparity_action_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, tmp_path, cwd=None, **env):
    output = tmp_path / "github_output"
    done = subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py")], cwd=cwd or tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "GITHUB_OUTPUT": str(output), **env})
    return done, output.read_text() if output.exists() else ""


def test_a_gpu_gate_is_refused_on_a_runner_without_metal(tmp_path):
    import mlx.core as mx
    if mx.metal.is_available():
        pytest.skip("this machine has Metal: the refusal cannot be seen here")
    done, output = run_script("device", tmp_path, KVPARITY_DEVICE="gpu")
    assert done.returncode == 125, done.stdout + done.stderr
    assert done.stdout.startswith("::error title=kvparity refuses to gate::MLX "), done.stdout
    assert "has no Metal GPU on this runner" in done.stdout and "self-hosted Apple-silicon runner" in done.stdout
    assert output == "exit-status=125\n"


@pytest.mark.parametrize("device, metal, status", [("gpu", True, 0), ("gpu", False, 125), ("cpu", False, 0),
                                                   ("cpu", True, 0), ("", False, 0), ("tpu", True, EXIT_USAGE)])
def test_device_check_follows_the_input_and_mlx(device, metal, status, monkeypatch, capsys):
    import mlx.core as mx
    monkeypatch.setattr(mx.metal, "is_available", lambda: metal)
    monkeypatch.delenv("GITHUB_OUTPUT", raising=False)
    monkeypatch.setenv("KVPARITY_DEVICE", device)
    assert script("device", monkeypatch).main() == status
    printed = capsys.readouterr().out
    assert ("::error" in printed) == (status != 0), printed


@pytest.mark.parametrize("spec, files, expected", [
    ("auto", ["pyproject.toml"], "{python} -m pip install -e ."),
    ("", ["setup.py"], "{python} -m pip install -e ."),
    ("auto", [], None),
    ("none", ["pyproject.toml"], None),
    (" pip install -e '.[serve]' ", ["pyproject.toml"], "pip install -e '.[serve]'"),
])
def test_install_command_from_the_input(spec, files, expected, tmp_path, monkeypatch):
    for name in files:
        (tmp_path / name).write_text("")
    command = script("install", monkeypatch).install_command(spec, tmp_path)
    assert command == (expected and expected.format(python=shlex.quote(sys.executable)))


def test_a_project_that_does_not_install_is_not_gated(tmp_path):
    done, output = run_script("install", tmp_path, KVPARITY_INSTALL="touch ran && exit 3")
    assert done.returncode == 125 and output == "exit-status=125\n", done.stdout + done.stderr
    assert (tmp_path / "ran").exists(), "the command runs with bash in the repository's root"
    assert "::error title=kvparity gate::your project did not install (exit 3): touch ran && exit 3" in done.stdout


def site_dirs():
    import site
    return [d for d in site.getsitepackages() if Path(d).is_dir()]


@pytest.mark.slow  # a virtual environment, a pip install and a kvparity run
def test_a_src_layout_project_is_installed_and_gated(tmp_path):
    """The action's two steps as a user's repository meets them: install.py
    installs a src/ layout (not importable from the root), gate.py gates it."""
    repo = tmp_path / "repo"
    (repo / "src" / "mycache").mkdir(parents=True)
    (repo / "src" / "mycache" / "__init__.py").write_text(
        "from kvparity.impl.batch_quantized import BatchQuantizedKVCache as Batch\n")
    (repo / "pyproject.toml").write_text(
        '[project]\nname = "mycache"\nversion = "0.1"\n[tool.setuptools.packages.find]\nwhere = ["src"]\n')
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # The new environment sees this one's packages (kvparity, mlx) as a runner sees what it installed.
    (site,) = (venv / "lib").glob("python*/site-packages")
    (site / "this-environment.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in site_dirs()))
    done = subprocess.run([str(python), str(SCRIPTS / "install.py")], cwd=repo, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "KVPARITY_INSTALL": "auto"})
    assert done.returncode == 0, done.stdout + done.stderr
    output = tmp_path / "github_output"
    env = {**os.environ, **GATE_ENV, "KVPARITY_IMPL": "mycache:Batch", "KVPARITY_DEVICE": "", "KVPARITY_POLICY": "",
           "KVPARITY_OUT": str(tmp_path / "out"), "GITHUB_OUTPUT": str(output)}
    done = subprocess.run([str(python), str(SCRIPTS / "gate.py")], cwd=repo, capture_output=True, text=True,
                          timeout=600, env=env)
    assert output.read_text() == "exit-status=0\n", done.stdout + done.stderr
    assert "--device cpu --policy cpu" in done.stdout and "known-answer check passed" in done.stdout


GATE_ENV = dict(KVPARITY_IMPL="mycache:Batch", KVPARITY_DEVICE="gpu", KVPARITY_LEVELS="L1", KVPARITY_POLICY="gpu",
                KVPARITY_OUT="out")


def test_gate_command_from_inputs(monkeypatch):
    gate = script("gate", monkeypatch)
    command = gate.gate_command({**GATE_ENV, "KVPARITY_ENGINE": "", "KVPARITY_EXPECTATIONS": " "})
    assert command == [sys.executable, "-m", "kvparity", "run", "--impl", "mycache:Batch", "--level", "L1",
                       "--device", "gpu", "--policy", "gpu", "--out", "out"]
    # impl left empty: kvparity run reads [tool.kvparity] in the repository's pyproject.toml.
    assert "--impl" not in gate.gate_command({**GATE_ENV, "KVPARITY_IMPL": " "})
    # Left empty: the CPU gate under the cpu policy; a policy given is kept.
    command = gate.gate_command({**GATE_ENV, "KVPARITY_DEVICE": " ", "KVPARITY_POLICY": ""})
    assert command[command.index("--device"):command.index("--out")] == ["--device", "cpu", "--policy", "cpu"]
    command = gate.gate_command({**GATE_ENV, "KVPARITY_DEVICE": "cpu", "KVPARITY_POLICY": "strict"})
    assert command[command.index("--device"):command.index("--out")] == ["--device", "cpu", "--policy", "strict"]
    command = gate.gate_command({**GATE_ENV, "KVPARITY_ENGINE": "eng:E", "KVPARITY_EXPECTATIONS": "exp.json",
                                 "KVPARITY_SHARD": "2/4"})
    assert command[-8:] == ["--engine", "eng:E", "--expectations", "exp.json", "--shard", "2/4", "--out", "out"]
    # The generated budget: kvparity's default unless given; the example database where the action keeps one.
    command = gate.gate_command({**GATE_ENV, "KVPARITY_GENERATED": "50", "KVPARITY_KEEP_FAILURES": "true",
                                 "KVPARITY_EXAMPLES": "/tmp/examples"})
    assert command[-6:] == ["--generated", "50", "--generated-database", "/tmp/examples", "--out", "out"]
    command = gate.gate_command({**GATE_ENV, "KVPARITY_KEEP_FAILURES": "false", "KVPARITY_EXAMPLES": "/tmp/e"})
    assert "--generated" not in command and "--generated-database" not in command


@pytest.mark.slow  # three kvparity processes
def test_gate_records_kvparity_status_and_succeeds(tmp_path):
    """The step itself exits 0 so the summary and upload run; the status is
    kvparity's own (here 125: this MLX has no GPU, or the usage status: a bad level)."""
    import mlx.core as mx
    done, output = run_script("gate", tmp_path, **{**GATE_ENV, "KVPARITY_LEVELS": "L9"})
    assert done.returncode == 0 and output == f"exit-status={EXIT_USAGE}\n", done.stdout + done.stderr + output
    assert "levels 'L9': expected some of L1, L2, L3" in done.stderr
    if not mx.metal.is_available():
        done, output = run_script("gate", tmp_path, **{**GATE_ENV, "KVPARITY_IMPL": REFERENCE_IMPL})
        assert output.endswith("exit-status=125\n"), done.stdout + done.stderr
        assert "no gpu backend" in done.stderr
    # No impl input and no [tool.kvparity] from here upward: kvparity run's own usage error, said as an annotation.
    done, output = run_script("gate", tmp_path, **{**GATE_ENV, "KVPARITY_IMPL": " "})
    assert done.returncode == 0 and output.endswith(f"exit-status={EXIT_USAGE}\n")
    assert "no implementation under test" in done.stderr and "::error title=kvparity gate::" in done.stdout
    # With [tool.kvparity] naming the class, the empty input is read from there.
    (tmp_path / "pyproject.toml").write_text(f'[tool.kvparity]\nimpl = "{REFERENCE_IMPL}"\n')
    done, output = run_script("gate", tmp_path, **{**GATE_ENV, "KVPARITY_IMPL": "", "KVPARITY_LEVELS": "L9"})
    assert "no implementation under test" not in done.stderr and "levels 'L9'" in done.stderr


JUNIT_WITH_A_FAILURE = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="2" failures="1" errors="0" skipped="0">
<testcase classname="tests.test_cache" name="test_merge[a,b]"/>
<testcase classname="tests.test_cache" name="test_extend[4:64]">
<failure message="bytes | differ at 100% ::warning::injected&#10;second line">trace</failure>
</testcase></testsuite></testsuites>
"""


def test_summary_of_a_report_and_a_failing_junit(tmp_path):
    reports = tmp_path / "reports"
    done = subprocess.run([sys.executable, "-m", "kvparity", "run", "--impl", REFERENCE_IMPL, "--level", "L1",
                           "--schedule", str(ROOT / "suites" / "catalog" / "join-empty.json"), "--out", str(reports)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (report,) = reports.glob("*/report.md")
    (tmp_path / "junit.xml").write_text(JUNIT_WITH_A_FAILURE)
    summary = tmp_path / "summary.md"
    done = subprocess.run([sys.executable, str(SCRIPTS / "summary.py"), "--title", "kvparity gate", "--reports",
                           str(reports), "junit.xml", "absent.xml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "GITHUB_STEP_SUMMARY": str(summary)})
    assert done.returncode == 0, done.stderr
    # One annotation, one line: the message's "%" and ":" cannot start a command.
    assert done.stdout.splitlines() == [
        "::error title=failure%3A tests.test_cache%3A%3Atest_extend[4%3A64]::bytes | differ at 100%25 ::warning::injected"]
    assert summary.read_text() == "\n".join([
        "## kvparity gate", "",
        "3 test cases, 1 failed, 0 errors, 0 skipped", "",
        "| file | test case | first line |", "|---|---|---|",
        "| `junit.xml` | `tests.test_cache::test_extend[4:64]` | bytes \\| differ at 100% ::warning::injected |",
        "", report.read_text(encoding="utf-8")]) + "\n"


def test_escaping_keeps_an_annotation_on_one_line(monkeypatch):
    commands = script("workflow_commands", monkeypatch)
    assert commands.error("a:b,c", "x%0Ay\r\nz") == "::error title=a%3Ab%2Cc::x%250Ay%0D%0Az"

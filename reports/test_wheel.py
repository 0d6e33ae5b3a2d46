"""kvparity from its wheel, as a team uses it in its own repository: the
wheel is built from this checkout, installed into a fresh virtual
environment, and run from a directory holding only a cache module
(``theircache.py``, a copy of impl/mlx_style.py) and docs/protocol.md's example
test file. The plugin, ``check``, ``run`` and ``bench`` must each hold for the
cache and break for a negative control; every path printed exists."""

import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

import kvparity

ROOT = Path(kvparity.__file__).resolve().parent.parent
SOURCES = ("impl", "kvparity", "oracle", "suites", "reports", "pyproject.toml", "README.md")
CACHE = "theircache:MlxStyleBatchQuantizedKVCache"
BROKEN = "kvparity.impl.negative_controls:MaskIgnoresLeftPadding"
ONE_CATALOG_TEST = ["-k", "test_catalog_schedule and join-longer-joiner"]  # at L1 and at L2
# Read at run time from the installed package: each must be in the wheel.
DATA = ("suites/catalog", "reports/policies", "reports/schema", "reports/examples/expectations")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (ROOT / "pyproject.toml").is_file(), reason="builds the wheel from a checkout"),
]


PROTOCOL_PAGE = ROOT / "docs" / "protocol.md"


def example_test_file() -> str:
    """The protocol page's complete test file, as a user copies it."""
    found = re.search(r"```python\n(# test_cache_parity\.py.*?)```", PROTOCOL_PAGE.read_text(), re.S)
    assert found, f"{PROTOCOL_PAGE.name} shows no test file starting '# test_cache_parity.py'"
    return found.group(1)


class Installed:
    """A virtual environment with kvparity's wheel, and a user's repository."""

    def __init__(self, base: Path):
        source, self.venv, self.repo = base / "source", base / "venv", base / "repo"
        source.mkdir()
        for name in SOURCES:  # a copy: pip builds in the tree, and this one stays clean
            if (ROOT / name).is_dir():
                shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("out", "__pycache__"))
            else:
                shutil.copy(ROOT / name, source / name)
        pip = [sys.executable, "-m", "pip", "-q"]
        subprocess.run([*pip, "wheel", "--no-deps", "-w", base / "dist", source], check=True)
        (self.wheel,) = (base / "dist").glob("kvparity-*.whl")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", self.venv], check=True)
        self.python = self.venv / "bin" / "python"
        subprocess.run([*pip, "--python", self.python, "install", "--no-deps", "--no-index", self.wheel], check=True)
        # Fast, and still a fresh environment: the wheel goes in without its
        # dependencies, which the venv then reads from this interpreter's
        # site-packages through a .pth file (added after the install, so pip
        # saw an empty environment). Not --system-site-packages: nothing else
        # of this interpreter is visible, and kvparity itself comes from the wheel.
        purelib = Path(subprocess.run([self.python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                      check=True, capture_output=True, text=True).stdout.strip())
        (purelib / "kvparity-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
        self.package = purelib / "kvparity"
        self.repo.mkdir()
        shutil.copy(ROOT / "impl" / "mlx_style.py", self.repo / "theircache.py")
        (self.repo / "test_cache_parity.py").write_text(example_test_file())

    def run(self, *argv, timeout=600):
        """A command of the venv's, from the user's repository."""
        env = {"PATH": f"{self.venv / 'bin'}:/usr/bin:/bin", "HOME": str(Path.home()),
               "PYTHONDONTWRITEBYTECODE": "1"}
        done = subprocess.run(argv, cwd=self.repo, env=env, capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout + done.stderr

    def pytest(self, *args):
        return self.run(self.python, "-m", "pytest", "-p", "no:cacheprovider", *args)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return Installed(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_everything_read_at_run_time(installed):
    code, out = installed.run(installed.python, "-c", "import kvparity; print(kvparity.__file__)")
    assert code == 0 and Path(out.strip()).parent == installed.package, out
    for folder in DATA:
        shipped = {p.relative_to(ROOT / folder) for p in (ROOT / folder).rglob("*.json")}
        assert shipped, folder
        installed_files = {p.relative_to(installed.package / folder)
                           for p in (installed.package / folder).rglob("*.json")}
        assert shipped == installed_files, f"{folder}: missing from the wheel: {sorted(shipped - installed_files)}"
    assert (installed.package / "reports" / "shard-costs.json").is_file(), "the shards' cost table"
    scripts = {p.name for p in (ROOT / "oracle" / "mlx_lm_defects").glob("*.py")}
    assert scripts and scripts == {p.name for p in (installed.package / "oracle" / "mlx_lm_defects").glob("*.py")}, (
        "the mlx-lm defect reproductions an attribution names")


def test_the_plugin_runs_kvparity_suites_on_their_cache(installed):
    code, out = installed.pytest("--kvparity-impl", CACHE, "-m", "kvparity", "--pyargs", "kvparity", "-x", "-q",
                                 *ONE_CATALOG_TEST)
    assert code == 0 and re.search(r"\b2 passed\b", out), out
    code, out = installed.pytest("--kvparity-impl", BROKEN, "-m", "kvparity", "--pyargs", "kvparity", "-x", "-q",
                                 *ONE_CATALOG_TEST)
    assert code == 1 and "mask:" in out, out


def test_installed_only_the_gate_suites_are_collected(installed):
    code, out = installed.pytest("--kvparity-impl", CACHE, "--pyargs", "kvparity", "--collect-only", "-q")
    assert code == 0, out
    modules = set(re.findall(r"(test_\w+)\.py::", out))
    assert {"test_l1_catalog", "test_l1_stateful", "test_l2_catalog", "test_negative_controls", "test_l3",
            "test_l3_controls"} <= modules
    assert not modules & {"test_structure", "test_workflows", "test_gate_action", "test_wheel", "test_cli"}, \
        sorted(modules)


def test_without_an_implementation_nothing_runs(installed):
    code, out = installed.pytest("-m", "kvparity", "--pyargs", "kvparity", "-q", *ONE_CATALOG_TEST)
    assert code == 4 and "--kvparity-impl" in out, out


def test_their_own_test_passes_and_fails_with_the_cache(installed):
    code, out = installed.pytest("--kvparity-impl", CACHE, "test_cache_parity.py", "-q")
    assert code == 0 and re.search(r"\b1 passed\b", out), out
    code, out = installed.pytest("--kvparity-impl", BROKEN, "test_cache_parity.py", "-q")
    assert code == 1 and "L1 longer-joiner: FAIL" in out and "mask:" in out, out


def test_settings_come_from_their_pyproject(installed):
    (installed.repo / "pyproject.toml").write_text(f'[tool.kvparity]\nimpl = "{BROKEN}"\n')
    try:
        code, out = installed.pytest("test_cache_parity.py", "-q")
        assert code == 1 and "mask:" in out, out
        code, out = installed.pytest("--kvparity-impl", CACHE, "test_cache_parity.py", "-q")  # the command line wins
        assert code == 0, out
    finally:
        (installed.repo / "pyproject.toml").unlink()


def test_check_and_run_from_their_repository(installed):
    kvparity = installed.venv / "bin" / "kvparity"
    assert installed.run(kvparity, "check", "--level", "L1", "--impl", CACHE)[0] == 0
    assert installed.run(kvparity, "check", "--level", "L1", "--impl", BROKEN)[0] == 1
    code, out = installed.run(kvparity, "run", "--level", "L1", "--impl", CACHE, "--out", "out")
    assert code == 0, out
    (report,) = re.findall(r"^report: (.+)$", out, re.M)
    assert (installed.repo / report / "report.json").is_file(), out


def test_bench_from_their_repository(installed):
    code, out = installed.run(installed.venv / "bin" / "kvparity", "bench", "--quick", "--impl", CACHE,
                              "--out", "out")
    assert code == 0, out[-4000:]
    assert ".partial" not in out, "a staging path was printed: it is gone after the run"
    (report,) = re.findall(r"^benchmarks: (.+)$", out, re.M)
    assert {"benchmark.json", "benchmarks.md"} <= {p.name for p in (installed.repo / report).iterdir()}, out

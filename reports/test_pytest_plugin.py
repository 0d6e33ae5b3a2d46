"""The kvparity pytest plugin in this checkout: loaded once (its entry point,
not again by the root conftest, whose --impl is the same setting), and its
settings read from a team's own files, with the command line first."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvparity.reports import pytest_plugin
from kvparity.suites.format.schedule import CATALOG

CACHE = "kvparity.impl.mlx_style:MlxStyleBatchQuantizedKVCache"
BROKEN = "kvparity.impl.negative_controls:MaskIgnoresLeftPadding"


def test_the_plugin_is_registered_once(pytestconfig):
    names = [name for name, plugin in pytestconfig.pluginmanager.list_name_plugin() if plugin is pytest_plugin]
    assert names == ["kvparity"]
    assert pytestconfig.getoption("--impl") is pytestconfig.getoption("--kvparity-impl")


def pytest_in(repo: Path, *args):
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
                          cwd=repo, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.slow  # pytest processes at two levels
def test_their_schedule_folders_run_at_the_chosen_levels(tmp_path):
    """Their own schedules gate like the catalog, from [tool.kvparity] or the command line."""
    folder = tmp_path / "schedules"
    folder.mkdir()
    shutil.copy(CATALOG / "join-longer-joiner.json", folder)  # L1 and L2
    (tmp_path / "pyproject.toml").write_text(
        f'[tool.kvparity]\nimpl = "{CACHE}"\nschedules = ["schedules"]\nlevels = "L1"\n')
    args = ["--pyargs", "kvparity.suites.test_schedule_dirs"]
    code, out = pytest_in(tmp_path, *args, "-rA")
    assert code == 0 and re.search(r"PASSED .*test_schedule\[join-longer-joiner-L1\]", out), out
    assert "1 passed" in out and "-L2]" not in out, out
    code, out = pytest_in(tmp_path, *args, "--kvparity-impl", BROKEN)
    assert code == 1 and "mask:" in out, out
    (folder / "bad.json").write_text(json.dumps({"name": "bad", "requests": {"a": {"prompt_len": 3}}, "events": [{"fly": 1}]}))
    code, out = pytest_in(tmp_path, *args)
    assert code == 4 and re.search(r"bad\.json: .*fly", out), out


def test_levels_deselect_the_other_levels_suites(tmp_path):
    code, out = pytest_in(tmp_path, "--kvparity-impl", CACHE, "--kvparity-levels", "L2", "--collect-only",
                          "--pyargs", "kvparity.suites.test_l1_catalog", "kvparity.suites.test_l2_catalog")
    assert code == 0 and "test_l2_catalog_covers_models_and_settings" in out, out
    assert "test_catalog_covers_the_design_list" not in out, out  # an L1 test
    code, out = pytest_in(tmp_path, "--kvparity-levels", "L9", "--pyargs", "kvparity.suites.test_l1_catalog")
    assert code == 4 and "expected some of L1, L2, L3, L4" in out, out


def test_every_marker_is_registered_under_strict_markers(tmp_path):
    """A team's project that sets --strict-markers collects kvparity's suites
    and its own tests using kvparity's markers with no error and no warning:
    the plugin registers every marker its tests carry or it applies."""
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "--strict-markers"\n')
    (tmp_path / "test_theirs.py").write_text(
        "import pytest\n\n\n@pytest.mark.gqa_batched\n@pytest.mark.kvparity\n@pytest.mark.slow\n"
        "def test_theirs():\n    pass\n")
    used = {name for path in pytest_plugin.TEST_FOLDERS for test in path.glob("test_*.py")
            for name in re.findall(r"pytest\.mark\.(\w+)", test.read_text())}
    builtin = {"parametrize", "skip", "skipif", "usefixtures", "xfail", "filterwarnings"}
    registered = {marker.split(":")[0] for marker in pytest_plugin.MARKERS}
    assert used - builtin <= registered, sorted(used - builtin - registered)
    code, out = pytest_in(tmp_path, "--collect-only", "-W", "error::pytest.PytestUnknownMarkWarning",
                          "test_theirs.py", "--pyargs", "kvparity.suites.test_l3", "kvparity.suites.test_oracle")
    assert code == 0, out
    assert "warning" not in out.lower() and "error" not in out.lower(), out
    assert re.search(r"\d+ tests? collected", out), out

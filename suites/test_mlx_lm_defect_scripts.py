"""mlx-lm's own defects, reproduced by plain scripts (oracle/mlx_lm_defects/).

Each script exits 1 while its defect is there and 0 once it is gone; the runs
(about 3 s each: an mlx-lm import and a tiny model) are ``slow``. By default:
each is plain mlx-lm, the README's table lists each, and an attribution built
from what mlx-lm raises names the script that reproduces it.
"""

import ast
import re
import subprocess
import sys
from functools import lru_cache
from importlib.metadata import version

import pytest
from mlx_lm.models.cache import RotatingKVCache

from kvparity.oracle.mlx_lm_versions import (
    DEFECT_SCRIPTS, GQA_LEFT_PADDING_MASK, QUANTIZED_FIRST_WRITE, kv_bits_leaves_dense, script_links, script_path,
    solo_kv_bits_raises, with_script,
)

SCRIPTS = sorted(DEFECT_SCRIPTS.glob("*.py"))
README = DEFECT_SCRIPTS / "README.md"
MAY_IMPORT = {"mlx", "mlx_lm", "numpy"} | set(sys.stdlib_module_names)
# The README's exit column, measured on this mlx-lm: the slow runs hold each script to it.
MEASURED_ON = "0.32.2"


def readme_exits() -> dict:
    """script -> the exit code the README's table gives it on MEASURED_ON."""
    rows = re.findall(r"^\| `(\w+\.py)` \|.*\| (\d+) \|$", README.read_text(), re.M)
    return {name: int(status) for name, status in rows}


def test_each_script_is_plain_mlx_lm_and_in_the_readme_table():
    assert SCRIPTS, f"no scripts in {DEFECT_SCRIPTS}"
    assert f"mlx-lm {MEASURED_ON}" in README.read_text()
    assert sorted(readme_exits()) == [s.name for s in SCRIPTS], "README.md's table and the scripts differ"
    for script in SCRIPTS:
        tree = ast.parse(script.read_text(), str(script))
        assert ast.get_docstring(tree), f"{script.name}: no docstring saying what it shows"
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] in MAY_IMPORT, f"{script.name} imports {name}: plain mlx-lm only"


def test_each_link_names_a_defect_and_texts():
    links = script_links()
    assert links
    for name, script, texts in links:
        assert re.fullmatch(r"[a-z-]+", name) and texts, f"{script}: a kvparity-defect line needs match lines"


def test_an_attribution_from_what_mlx_lm_raises_names_its_script():
    try:
        RotatingKVCache(max_size=16).to_quantized(group_size=64, bits=4)
    except NotImplementedError as error:
        raised = solo_kv_bits_raises(error, "converting layer 0's RotatingKVCache")
    else:
        pytest.skip("this mlx-lm quantizes a RotatingKVCache")
    linked = with_script(raised)
    assert linked.script == script_path("rotating_kv_cache_quantization_nyi.py")
    assert f"reproduced by {linked.script}" in linked.attribution()
    assert with_script(kv_bits_leaves_dense(["CacheList"])).script == script_path("kv_bits_leaves_cache_list_dense.py")
    # Another limit of the same name whose text matches no script names none.
    assert with_script(kv_bits_leaves_dense(["SomeOtherCache"])).script == ""
    assert with_script(None) is None
    for defect in (GQA_LEFT_PADDING_MASK, QUANTIZED_FIRST_WRITE):
        assert (DEFECT_SCRIPTS / defect.script.rsplit("/", 1)[1]).is_file()


@lru_cache(maxsize=None)
def run_script(name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEFECT_SCRIPTS / name)], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("name, status", sorted(readme_exits().items()))
def test_script_exits_as_the_readme_says(name, status):
    if version("mlx-lm") != MEASURED_ON:
        pytest.skip(f"the table is measured on mlx-lm {MEASURED_ON}, {version('mlx-lm')} is installed")
    run = run_script(name)
    lines = run.stdout.strip().splitlines()
    assert run.returncode == status, f"{name} exited {run.returncode}, the table says {status}\n{run.stdout}{run.stderr}"
    assert len(lines) == 1 and lines[0].startswith("DEFECT:" if status else "fixed:"), run.stdout + run.stderr


@pytest.mark.slow
def test_every_script_a_zoo_limit_names_shows_its_defect():
    """Every zoo model's limit that names a script names one that exits 1 here."""
    from kvparity.oracle.models import load_model
    from kvparity.oracle.zoo import ZOO

    named = {}
    for architecture in ZOO:
        limit = load_model(architecture).limit
        if limit is not None and limit.script:
            named.setdefault(limit.script.rsplit("/", 1)[1], []).append(architecture)
    assert named, "no zoo model's limit names a script"
    for name, architectures in sorted(named.items()):
        run = run_script(name)
        assert run.returncode == 1, f"{name} (named for {', '.join(architectures)}) exited {run.returncode}\n{run.stdout}"

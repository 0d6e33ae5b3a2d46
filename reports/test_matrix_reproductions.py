"""The matrix's reproductions: for each FAIL of a published cache, a
standalone script in plain mlx, mlx-lm and the package (no kvparity) under
``reports/examples/matrix/<row>/``, which exits 1 while the defect is there.

The scripts run in their row's environment, not in kvparity's: the
interpreter of row ``mlx-vlm-0.7.10`` is named by the environment variable
``KVPARITY_MATRIX_PYTHON_MLX_VLM_0_7_10`` (the row's name upper-cased, every
other character ``_``). The tests marked ``matrix`` run each script there
(``python -m pytest -m matrix``), and skip, saying which variable, where it
is not set. The default run only checks that every reproduction is listed
and complete.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

MATRIX = Path(__file__).parent / "examples" / "matrix"

# (row whose environment runs it, script, the exit status it gives there)
REPRODUCTIONS = [
    ("mlx-vlm-0.7.10", "mlx-vlm-0.7.10/single_row_merge_shares_buffers.py", 1),
    ("mlx-vlm-0.7.2", "mlx-vlm-0.7.10/single_row_merge_shares_buffers.py", 1),
    ("mlx-vlm-0.7.2", "mlx-vlm-0.7.2/packed_width_5_6_bits.py", 1),
    ("rapid-mlx-0.16.10", "rapid-mlx-0.16.10/packed_width_5_6_bits.py", 1),
    # The negative control: fixed in mlx-vlm 0.7.10, where the same script passes.
    ("mlx-vlm-0.7.10", "mlx-vlm-0.7.2/packed_width_5_6_bits.py", 0),
]


def python_variable(row: str) -> str:
    return "KVPARITY_MATRIX_PYTHON_" + re.sub(r"[^A-Z0-9]", "_", row.upper())


@pytest.mark.matrix
@pytest.mark.parametrize("row, script, status", REPRODUCTIONS,
                         ids=[f"{row}:{Path(script).name}" for row, script, _ in REPRODUCTIONS])
def test_the_reproduction_shows_the_defect_in_its_rows_environment(row, script, status):
    variable = python_variable(row)
    python = os.environ.get(variable)
    if not python:
        pytest.skip(f"{variable} is not set: no interpreter with {row} installed")
    run = subprocess.run([python, str(MATRIX / script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == status, (
        f"{script} in {row}'s environment ({python}) exited {run.returncode}, expected {status}:\n"
        f"{run.stdout}{run.stderr}")


def test_every_reproduction_is_listed_with_its_report_and_shrunk_schedule():
    on_disk = {p.relative_to(MATRIX).as_posix() for p in MATRIX.glob("*/*.py")}
    showing_a_defect = {script for _, script, status in REPRODUCTIONS if status == 1}
    assert on_disk == showing_a_defect, "each script is run where it shows its defect, and exists"
    for row in {row for row, _, status in REPRODUCTIONS if status == 1}:
        folder = MATRIX / row
        assert any(folder.glob("*.md")), f"{row}: no bug report"
        assert any(folder.glob("*-min.json")), f"{row}: no shrunk schedule"

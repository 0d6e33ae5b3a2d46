"""The matrix's findings, shipped as upstream-ready reproductions.

Each folder of reports/examples/matrix/ is named PACKAGE-VERSION and holds,
for one defect the gate found in that package: a standalone script in plain
mlx, mlx-lm and the package (exit 1 while the defect is there), the bug
report, and the schedule `kvparity bisect` shrank. Their shape is checked
here by default; the scripts run (marker ``matrix``) only in an environment
where that very version of the package is installed, such as the package's
row of impl/ecosystem/rows.toml: elsewhere they skip, naming what is missing.
"""

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from kvparity.suites.runners import load_schedule

MATRIX = Path(__file__).parent / "examples" / "matrix"
FINDINGS = sorted(p for p in MATRIX.iterdir() if p.is_dir()) if MATRIX.is_dir() else []
SCRIPTS = [script for finding in FINDINGS for script in sorted(finding.glob("repro_*.py"))]


def package_of(finding: Path):
    """``mlx-optiq-0.7.7`` -> ("mlx-optiq", "0.7.7")."""
    name, _, version = finding.name.rpartition("-")
    return name, version


def test_each_finding_has_its_script_report_and_shrunk_schedule():
    assert FINDINGS, f"no findings under {MATRIX}"
    for finding in FINDINGS:
        name, version = package_of(finding)
        assert name and version[:1].isdigit(), f"{finding.name}: expected PACKAGE-VERSION"
        assert list(finding.glob("repro_*.py")), f"{finding.name}: no repro_*.py script"
        report = (finding / "report.md").read_text()
        assert f"{name} {version}" in report, f"{finding.name}/report.md does not name {name} {version}"
        schedules = list(finding.glob("*.json"))
        assert schedules, f"{finding.name}: no shrunk schedule"
        for schedule in schedules:
            load_schedule(schedule)  # raises, naming the file, on a malformed one


@pytest.mark.matrix
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_reproduction_still_shows_the_defect(script: Path):
    name, version = package_of(script.parent)
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed here; run in its row's environment (impl/ecosystem/rows.toml)")
    if installed != version:
        pytest.skip(f"{name} {installed} is installed here, the finding is for {version}")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=None)
    out = run.stdout + run.stderr
    assert run.returncode != 0 or "DEFECT" in out, (
        f"{script.parent.name}/{script.name} exits 0: the defect is gone in {name} {version}; "
        f"the matrix's finding is stale\n{out}")
    assert run.returncode == 1 and "DEFECT" in out, f"{script.name} did not show the defect cleanly:\n{out}"

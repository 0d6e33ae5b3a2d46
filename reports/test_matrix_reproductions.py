"""The matrix's findings, shipped as upstream-ready reproductions.

Each folder of reports/examples/matrix/ is named PACKAGE-VERSION and holds,
for each defect the gate found in that package: a standalone script in plain
mlx, mlx-lm and the package (no kvparity) that exits 1 while the defect is
there, its bug report, and the schedule `kvparity bisect` shrank
(``*-min.json``). Their shape is checked by default; the scripts run (marker
``matrix``) only where that very version of the package is installed, as in
the package's row environment (impl/ecosystem/rows.toml, `nox -s ecosystem`):
elsewhere they skip, naming what is missing.
"""

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from kvparity.suites.runners import load_schedule

MATRIX = Path(__file__).parent / "examples" / "matrix"
PAGE = ("page", "rows")  # the rendered matrix and its rows' reports (nox -s matrix), beside the findings
FINDINGS = sorted(p for p in MATRIX.iterdir() if p.is_dir() and p.name not in PAGE) if MATRIX.is_dir() else []


def package_of(finding: Path):
    """``mlx-optiq-0.7.7`` -> ("mlx-optiq", "0.7.7")."""
    name, _, version = finding.name.rpartition("-")
    return name, version


# A script also run against another version of its package: the same defect
# there (exit 1), or fixed there (exit 0, the negative control).
ELSEWHERE = [
    ("mlx-vlm-0.7.10/single_row_merge_shares_buffers.py", "0.7.2", 1),
    ("mlx-vlm-0.7.2/packed_width_5_6_bits.py", "0.7.10", 0),
    ("mlx-vlm-0.7.10/completion_below_prefill_admits_nothing.py", "0.7.2", 1),
]
RUNS = ([(script, package_of(finding)[1], 1) for finding in FINDINGS for script in sorted(finding.glob("*.py"))]
        + [(MATRIX / script, version, status) for script, version, status in ELSEWHERE])


def test_each_finding_has_its_script_report_and_shrunk_schedule():
    assert FINDINGS, f"no findings under {MATRIX}"
    scripts_of = {f: {s for s, _, status in RUNS if status == 1 and package_of(s.parent)[0] == package_of(f)[0]
                      and v == package_of(f)[1]} for f, v in ((f, package_of(f)[1]) for f in FINDINGS)}
    for finding in FINDINGS:
        name, version = package_of(finding)
        assert name and version[:1].isdigit(), f"{finding.name}: expected PACKAGE-VERSION"
        assert scripts_of[finding], f"{finding.name}: no script shows a defect in {name} {version}"
        reports = [p.read_text() for p in finding.glob("*.md")]
        assert reports, f"{finding.name}: no bug report"
        assert all(f"{name} {version}" in r for r in reports), f"{finding.name}: a report does not name {name} {version}"
        schedules = list(finding.glob("*-min.json"))
        assert schedules, f"{finding.name}: no shrunk schedule"
        for schedule in schedules:
            load_schedule(schedule)  # raises, naming the file, on a malformed one


@pytest.mark.matrix
@pytest.mark.parametrize("script, version, status", RUNS,
                         ids=[f"{s.parent.name}/{s.name}@{v}" for s, v, _ in RUNS])
def test_reproduction_shows_the_defect_where_its_package_is_installed(script: Path, version, status):
    name, _ = package_of(script.parent)
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed here; run in its row's environment (impl/ecosystem/rows.toml)")
    if installed != version:
        pytest.skip(f"{name} {installed} is installed here, this run is for {version}")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    if run.returncode == 125:
        pytest.skip(f"{script.name} cannot run here:\n{run.stdout}{run.stderr}")
    assert run.returncode == status, (
        f"{script.parent.name}/{script.name} in {name} {version} exited {run.returncode}, expected {status}"
        + (" (the defect is gone: the matrix's finding is stale)" if status == 1 else "") + f"\n{run.stdout}{run.stderr}")

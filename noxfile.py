"""One virtual environment per mlx-lm minor and per matrix row (docs/matrix.md,
"Supported mlx-lm versions" and "One environment per row").

    nox -s gate-0.31                      the reference's gate on mlx-lm 0.31
    nox -s ecosystem                      every row of impl/ecosystem/rows.toml
    nox -s "ecosystem(reference-mlx-lm-0.31)"   one row

uv installs (nox's uv backend); it uses the Python that runs nox and never
downloads one. Reports go under $KVPARITY_MATRIX_OUT (default
reports/out/matrix), one directory per session or row.
"""

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
ROWS = ROOT / "impl" / "ecosystem" / "rows.toml"
OUT = Path(os.environ.get("KVPARITY_MATRIX_OUT", ROOT / "reports" / "out" / "matrix"))

nox.options.default_venv_backend = "uv"
# The interpreter that runs nox: uv never downloads one.
PYTHON = sys.executable
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")

# Each supported mlx-lm minor and the release of it the gate installs (its
# newest): the oldest is oracle/mlx_lm_versions.py's OLDEST_SUPPORTED.
MLX_LM_MINORS = {"0.31": "0.31.3", "0.32": "0.32.2"}

# L2 on a model with a kv head per query head: judged on every supported
# mlx-lm, also where mlx-lm's grouped-query attention has its own defect.
MHA_MODEL = "llama-h128-bf16-mha"

# rows.toml is read by kvparity's own reader (stdlib only), loaded from the
# checkout: nox's environment has no kvparity.
_spec = importlib.util.spec_from_file_location("ecosystem_rows", ROOT / "reports" / "ecosystem_rows.py")
ecosystem_rows = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ecosystem_rows)
ROW_LIST = ecosystem_rows.load_rows(ROWS)

# --- what a session writes --------------------------------------------------


def write_json(doc: dict, path: Path):
    """Whole or not at all, as suites/format/schedule.py's atomic_write_json."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def cannot_install(session, row, reason: str):
    """The row's cell says why; the session itself has done its job."""
    write_json(row.cannot_install(reason, session.name), OUT / row.name / ecosystem_rows.CANNOT_INSTALL)
    session.skip(f"cannot install: {reason}")


def _uv() -> str:
    """The uv that nox's uv backend uses: nox[uv] installs it beside nox."""
    try:
        from uv import find_uv_bin
    except ImportError:
        return shutil.which("uv") or "uv"
    return find_uv_bin()


def _uv_install(session, environment, *args) -> subprocess.CompletedProcess:
    """uv into ``environment``, the output kept for a reason."""
    command = [_uv(), "pip", "install", "--python", str(environment), *args]
    session.log(" ".join(command))
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True)


def _why(process: subprocess.CompletedProcess) -> str:
    """The installer's own words: its error lines, without the hints after them."""
    lines = [line.strip() for line in process.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if not line.startswith(("hint:", "help:", "Using Python"))]
    return " ".join(errors)[-600:] or f"the installer exited {process.returncode}"


def _interpreter_for(row) -> "str | None":
    """A python3.N on PATH that runs and that the row supports, newest first
    (uv never downloads one here)."""
    for minor in range(14, 9, -1):
        found = shutil.which(f"python3.{minor}")
        if found is None:
            continue
        probe = subprocess.run([found, "-c", "import platform; print(platform.python_version())"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and row.python_supported(probe.stdout.strip()):
            return found
    return None


# --- sessions ---------------------------------------------------------------


def _gate(minor: str):
    def gate(session):
        release = MLX_LM_MINORS[minor]
        out = OUT / f"gate-{minor}"
        session.install("-e", ".[parallel]", f"mlx-lm=={release}")
        session.run("python", "-c", "import mlx_lm, mlx.core as mx; print('mlx-lm', mlx_lm.__version__, 'mlx', mx.__version__)")
        session.run("python", "-m", "pytest", "-q", "-n", "auto", *session.posargs)  # the README's test command
        session.run("kvparity", "run", "--out", str(out / "catalog"))
        session.run("kvparity", "run", "--level", "L2", "--model", MHA_MODEL, "--out", str(out / "mha"))

    gate.__doc__ = f"The reference's gate on mlx-lm {MLX_LM_MINORS[minor]}: the default tests, then kvparity run."
    return nox.session(name=f"gate-{minor}", python=PYTHON)(gate)


GATES = [f"gate-{minor}" for minor in MLX_LM_MINORS]
nox.options.sessions = GATES
for _minor in MLX_LM_MINORS:
    globals()[f"gate_{_minor.replace('.', '_')}"] = _gate(_minor)


@nox.session(python=PYTHON)
@nox.parametrize("name", [row.name for row in ROW_LIST], ids=[row.name for row in ROW_LIST])
def ecosystem(session, name):
    """One matrix row: its own environment, then `kvparity run` on its implementation."""
    row = next(r for r in ROW_LIST if r.name == name)
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)  # the row's folder holds this session's one cell
    environment, bin_dir = Path(session.virtualenv.location), None
    here = platform.python_version()
    if not row.python_supported(here):
        interpreter = _interpreter_for(row)
        if interpreter is None:
            cannot_install(session, row, f"needs Python {row.python}; this interpreter is {here}, "
                                         "and no python3.N on PATH is one it supports")
        # The row's own environment on that interpreter, beside the session's.
        environment = environment.with_name(environment.name + "-row")
        made = subprocess.run([_uv(), "venv", "--clear", "--python", interpreter, str(environment)],
                              cwd=ROOT, capture_output=True, text=True)
        if made.returncode != 0:
            cannot_install(session, row, _why(made))
        bin_dir = environment / "bin"
    installed = _uv_install(session, environment, "-e", ".", *row.install)
    if installed.returncode == 0 and row.install_no_deps:
        installed = _uv_install(session, environment, "--no-deps", *row.install_no_deps)
    if installed.returncode != 0:
        cannot_install(session, row, _why(installed))
    kvparity = str(bin_dir / "kvparity") if bin_dir else "kvparity"
    env = {}
    if row.server:  # L4: the server from the row's environment, found on its PATH
        command = [kvparity, "run", "--level", "L4", "--server", row.server, *row.declares, "--out", str(out)]
        env["PATH"] = f"{environment / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    else:
        command = [kvparity, "run", "--impl", row.impl, "--out", str(out)]
    if row.models:  # the architecture axis: every architecture of the zoo on a worker per core
        command += ["--models", row.models, "--workers", str(max(1, os.cpu_count() or 1))]
    if row.engine:
        command += ["--engine", row.engine]
    if row.expectations:
        command += ["--expectations", str(ROOT / row.expectations)]
    # A verdict (0 holds, 1 broken, 125 cannot judge) is the row's cell, in
    # its report; usage errors (129) and kvparity's own bugs fail the session.
    session.run(*command, *session.posargs, success_codes=[0, 1, 125], external=bin_dir is not None, env=env)


PAGE = ROOT / "reports" / "examples" / "matrix"  # the checked-in matrix: rows/ and page/


@nox.session(python=PYTHON)
def matrix(session):
    """The checked-in conformance matrix, made anew: every row in its own
    environment (the ecosystem sessions, writing reports/examples/matrix/rows/),
    then `kvparity matrix` over them (reports/examples/matrix/page/)."""
    rows, page = PAGE / "rows", PAGE / "page"
    shutil.rmtree(rows, ignore_errors=True)
    shutil.rmtree(page, ignore_errors=True)
    session.install("-e", ".")
    session.run(PYTHON, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "-s", "ecosystem",
                env={"KVPARITY_MATRIX_OUT": str(rows)}, external=True)
    # The rows' reports name this machine's folders and are not checked in: the page names them, unlinked.
    session.run("kvparity", "matrix", str(rows.relative_to(ROOT)), "--out", str(page.relative_to(ROOT)),
                "--no-report-links")


"""``kvparity matrix``: the conformance matrix from the report directories of per-row sessions."""

import shutil
import subprocess
import sys

from kvparity.oracle.atomic import OUTPUT_ROOT
from kvparity.reports import matrix, matrix_page
from kvparity.reports.commands.base import CannotRun, UsageError, new_path

NAME = "matrix"
HELP = "render the conformance matrix (matrix.md, matrix.json, matrix.html) from per-row report directories"
DESCRIPTION = ("Gather the rows under each DIR (a row's folder holds one report directory written by kvparity check "
               "--out, or a cannot-install.json) and render matrix.md, matrix.json and a self-contained matrix.html "
               "into --out: implementation @ version x mlx-lm version against L1, L2, L3 and every check. With "
               "--session, first run those nox sessions (which write the rows). Exit status: 0 rendered with "
               "evidence (FAILs included), 125 when no row compared anything; with --gate, the rows' gate: 1 when a "
               "row's parity broke, else 125 when a row could not be installed or judged, else 0. 2: bad input.")


def arguments(command):
    command.add_argument("directories", metavar="DIR", nargs="+", help="row folders, or folders of them")
    command.add_argument("--out", metavar="DIR", default=str(OUTPUT_ROOT / "matrix"),
                         help="the matrix directory to create (never overwritten; default: %(default)s)")
    command.add_argument("--gate", action="store_true",
                         help="exit with the rows' gate (1 if any row's parity broke) instead of the render's")
    command.add_argument("--session", metavar="NAME", action="append",
                         help="run this nox session first (repeatable): nox -s NAME... writes the rows")
    command.add_argument("--noxfile", metavar="FILE", help="the noxfile of --session (default: nox's, ./noxfile.py)")
    command.add_argument("--no-report-links", action="store_true",
                         help="the rows' report directories are not published beside the page: name them, do not "
                         "link them (a page links only what its readers can open)")


def run_sessions(sessions, noxfile=None) -> int:
    """``nox [-f FILE] -s NAME...``, its output shown. A session whose
    kvparity check found a FAIL fails in nox; its row is still gathered."""
    nox = shutil.which("nox")
    if nox is None:
        raise CannotRun("--session needs nox (pip install nox); or run the sessions yourself and gather their folders")
    command = [nox, *(["-f", noxfile] if noxfile else []), "-s", *sessions]
    print("+", " ".join(command), file=sys.stderr, flush=True)
    return subprocess.run(command).returncode


def handle(args, settings):
    new_path(args.out, "--out")
    if args.session:
        status = run_sessions(args.session, args.noxfile)
        if status:
            print(f"kvparity matrix: nox exited {status}; gathering what the sessions wrote", file=sys.stderr)
    try:
        rows = matrix.gather(args.directories)
    except matrix.MatrixError as error:
        raise UsageError(str(error))
    path, doc = matrix_page.write_matrix(rows, args.out, gate=args.gate, report_links=not args.no_report_links)
    for row in doc["rows"]:
        state = (f"cannot install: {row['cannot_install']['reason']}" if row["cannot_install"]
                 else f"{row['headline']} (exit {row['exit_status']})")
        print(f"{row['name']} on mlx-lm {row['mlx_lm']} ({row['implementation']}): {state}")
    print(f"matrix: {path}")
    return doc["exit_status"]

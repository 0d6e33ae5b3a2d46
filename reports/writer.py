"""Report directories, written atomically.

A run writes into a hidden temporary directory beside its destination and
renames it into place only when every file is complete, so an interrupted
run leaves no half-written report and never overwrites an earlier one.
"""

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import List

from tabulate import tabulate

from kvparity.reports.results import ScheduleResult

SCHEMA = "kvparity.report/1"


class ReportDirectory:
    """``with ReportDirectory(root) as staging:`` write files into ``staging``;
    on success it is renamed to ``.path``, a new directory under ``root``."""

    def __init__(self, root):
        self.root = Path(root)
        self.path = None

    def __enter__(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        self.staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=self.root))
        return self.staging

    def __exit__(self, kind, error, trace):
        if kind is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            return False
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for n in range(1000):
            final = self.root / (stamp if n == 0 else f"{stamp}-{n}")
            try:
                os.mkdir(final)  # claims the name: an earlier report is never overwritten
            except FileExistsError:
                continue
            os.replace(self.staging, final)  # replaces only the empty directory just made
            self.path = final
            return False
        shutil.rmtree(self.staging, ignore_errors=True)
        raise RuntimeError(f"cannot name a new report directory under {self.root}")


def summary_rows(results: List[ScheduleResult]):
    headers = ["schedule", "level", "rows", "events", "verdict", "logits bit-exact", "top-1", "first divergence"]
    rows = []
    for r in results:
        first = next((d for d in r.divergences), None)
        note = first.message() if first else r.reason
        positions = sum(row.metrics.get("positions", 0) for row in r.rows)
        exact = sum(row.metrics.get("bit_exact", 0) for row in r.rows)
        top1 = sum(row.metrics.get("top1_agree", 0) for row in r.rows)
        logit_cols = [f"{exact}/{positions}", f"{top1}/{positions}"] if positions else ["", ""]
        rows.append([r.schedule, r.level, len(r.rows), r.events, r.verdict, *logit_cols, _short(note)])
    return headers, rows


def row_rows(results: List[ScheduleResult]):
    headers = ["schedule", "level", "row", "verdict", "checks", "divergences", "first divergence"]
    rows = []
    for r in results:
        for row in r.rows:
            first = row.first.message() if row.first else ""
            rows.append([r.schedule, r.level, row.request, row.verdict, row.checks, len(row.divergences), first])
    return headers, rows


def _short(text, width=90):
    text = text or ""
    return text if len(text) <= width else text[: width - 1] + "…"


def write_report(results: List[ScheduleResult], environment: dict, root, sections=()) -> Path:
    """Write report.md and report.json into a new directory under ``root``.

    ``sections`` are extra (title, headers, rows) tables for report.md.
    """
    report = ReportDirectory(root)
    with report as directory:
        (directory / "report.json").write_text(
            json.dumps(
                {
                    "schema": SCHEMA,
                    "environment": environment,
                    "results": [r.to_json() for r in results],
                },
                indent=2,
                default=str,
            )
            + "\n"
        )
        lines = ["# kvparity report", "", "## Environment", ""]
        lines.append(tabulate(_flatten(environment).items(), headers=["key", "value"], tablefmt="github"))
        lines += ["", "## Summary", "", tabulate(summary_rows(results)[1], summary_rows(results)[0], tablefmt="github")]
        lines += ["", "## Rows", "", tabulate(row_rows(results)[1], row_rows(results)[0], tablefmt="github")]
        for title, headers, rows in sections:
            lines += ["", f"## {title}", "", tabulate(rows, headers, tablefmt="github")]
        (directory / "report.md").write_text("\n".join(lines) + "\n")
    return report.path


def _flatten(d, prefix=""):
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out

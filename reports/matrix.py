"""The conformance matrix: report directories of many rows, one page.

A row is an implementation at a version on an mlx-lm version, each read
from its report's environment (``reports/environment.py``). Rows come from
folders that per-row sessions write (one environment each), in this layout
(documented in docs/matrix.md, "The conformance matrix"):

    ROOT/<row>/<stamp>/report.json ...   kvparity check --out ROOT/<row>  (one report directory)
    ROOT/<row>/bisect/NAME-min.json       optional: what kvparity bisect shrank a FAIL to
    ROOT/<row>/cannot-install.json        instead, for a row that could not be installed

Columns are the levels (``suites/format/levels.py``) and the checks
(``suites/format/checks.py``). A level's cell counts its schedule runs by outcome;
a check's cell counts, per schedule run where the check applies, what
became of it. The architecture table counts, per model a row's runs ran on
(its results' ``model``), schedule runs by outcome with the mlx-lm limits
that stopped them, by the run report's own code (``report_json.architectures``).
The runs are judged again from their evidence by the verdicts' own code
(``reports/records.py``), never read from a summary.
"""

import os
import shlex
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import Dict, List, Optional
from kvparity.reports import failures, records
from kvparity.reports.documents import load_checked
from kvparity.reports.ecosystem_rows import CANNOT_INSTALL, ROWS_FILE, RowsError, load_rows
from kvparity.reports.verdicts import (
    EXIT_BROKEN, EXIT_CANNOT_JUDGE, EXIT_OK, ScheduleVerdict, gates, required_checks,
)
from kvparity.reports.report_json import Architecture, architectures, model_order
from kvparity.suites.format.checks import BY_TIER, CHECKS
from kvparity.suites.core.evidence import (
    EXPECTED_DIVERGENCE, FAIL, FAILURES, NO_EVIDENCE, NOT_SUPPORTED, ORACLE_CANNOT_RUN,
    ORACLE_NONDETERMINISTIC, OUTCOMES, PASS,
)
from kvparity.suites.format.levels import L4, LEVELS
from kvparity.suites.search.shrink import first_failure


SCHEMA = "kvparity.matrix/1"
BISECTED = "bisect"  # a row folder's minimal failing schedules, NAME-min.json as kvparity bisect names them
SCHEMAS = Path(files(__package__) / "schema")  # package data
# A check that diverged where the policy does not gate it (hygiene under "report", logits within the tier).
REPORTED = "reported, not gating"
# What a cell counts, in the order it shows them; the first five always, the others where not zero.
SHOWN = (PASS, FAIL, EXPECTED_DIVERGENCE, NOT_SUPPORTED, NO_EVIDENCE)
CELL_OUTCOMES = SHOWN + tuple(o for o in OUTCOMES if o not in SHOWN) + (REPORTED,)
STOPPED = (NOT_SUPPORTED, ORACLE_CANNOT_RUN, ORACLE_NONDETERMINISTIC)


class MatrixError(ValueError):
    """Exit 2: a folder or file that is not what a row's session writes; the message names it."""


@dataclass
class Row:
    implementation: str  # MODULE:FACTORY
    version: Optional[str]  # of the implementation's distribution
    mlx_lm: Optional[str]
    folder: Path  # the row's folder
    record: Optional[dict] = None  # report.json; None for a row that cannot be installed
    report: Optional[Path] = None  # the report directory
    cannot_install: Optional[dict] = None  # cannot-install.json
    cells: Dict[str, Optional[Counter]] = field(default_factory=dict)  # column -> outcome -> schedule runs
    failing: List[dict] = field(default_factory=list)
    findings: List[dict] = field(default_factory=list)  # the report's failure groups, each with its schedule
    # model -> its schedule runs; None where the row ran none on a model (L1 only, or cannot install)
    architectures: Optional[Dict[str, Architecture]] = None

    @property
    def key(self):
        return (self.implementation, self.version or "", self.mlx_lm or "")

    @property
    def label(self) -> str:
        return f"{self.implementation} @ {self.version or 'unknown version'}"

    @property
    def name(self) -> str:
        """What the matrix calls the row: the package and its version, as
        rows.toml names it, else as the report's environment does."""
        listed = listed_rows().get(self.folder.name)
        if listed is not None and (listed.impl == self.implementation if listed.impl
                                   else self.implementation == listed.server  # a server that cannot install
                                   or self.implementation.startswith(f"{listed.server} (")):
            return f"{listed.implementation} {listed.version}"
        package = (self.record or {}).get("environment", {}).get("implementation_package")
        version = self.version or "unknown version"
        if package:
            return f"{package} {self.implementation.split(':')[-1]} {version}"
        return f"{self.implementation} {version}"

    @property
    def language(self) -> Optional[str]:
        """The language the cache is written in: the report's word (a process
        cache's hello), else Python for a MODULE:FACTORY it imported; None
        where neither says."""
        said = (self.record or {}).get("environment", {}).get("implementation_language")
        if said:
            return said
        module, colon, factory = self.implementation.partition(":")
        return "python" if colon and module and factory and " " not in module else None

    @property
    def exit_status(self) -> int:
        return EXIT_CANNOT_JUDGE if self.record is None else self.record["exit_status"]


@lru_cache(maxsize=None)
def listed_rows() -> dict:
    """rows.toml's rows by name; none where it is not there or not readable."""
    try:
        return {row.name: row for row in load_rows(ROWS_FILE)}
    except (RowsError, OSError):
        return {}


def columns() -> List[str]:
    return list(LEVELS) + list(CHECKS)


# -- reading the rows -----------------------------------------------------------------


def read_cannot_install(path: Path) -> dict:
    """cannot-install.json, checked against its schema."""
    return load_checked(path, SCHEMAS / "cannot-install.schema.json", MatrixError)


def gather(paths) -> List[Row]:
    """Every row under ``paths`` (row folders, or folders of them), in a
    stable order; a row given twice, a folder with a report and a
    cannot-install.json, or nothing at all is an error naming the folders."""
    rows = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise MatrixError(f"{path}: not a directory")
        found = sorted(path.rglob(CANNOT_INSTALL)) + sorted(path.rglob(records.REPORT))
        found = [f for f in found if not any(part.startswith(".") for part in f.relative_to(path).parts)]
        if not found:
            raise MatrixError(f"{path}: holds no {records.REPORT} and no {CANNOT_INSTALL}")
        for file in found:
            rows.append(_cannot_install_row(file) if file.name == CANNOT_INSTALL else _report_row(file))
    seen = {}
    for row in rows:
        if row.folder in seen or row.key in seen:
            other = seen.get(row.folder) or seen[row.key]
            raise MatrixError(f"{row.folder}: the row {row.label} x mlx-lm {row.mlx_lm} is also in {other.folder}; "
                              "one report per row (merge the shards of one row with kvparity merge first)")
        seen[row.folder] = seen[row.key] = row
    return sorted(rows, key=lambda r: r.key)


def _cannot_install_row(file: Path) -> Row:
    doc = read_cannot_install(file)
    return Row(doc["implementation"], doc["version"], doc["mlx_lm"], file.parent, cannot_install=doc,
               cells={c: None for c in columns()})


def _report_row(file: Path) -> Row:
    try:
        record = records.read_record(file)
    except records.RecordError as error:
        raise MatrixError(str(error))
    env = record["environment"]
    if (record.get("shard") or {}).get("index"):
        raise MatrixError(f"{file}: the report of shard {record['shard']['index']}/{record['shard']['count']}, one "
                          "part of a run: merge the shards with kvparity merge and gather the merged report")
    if not env.get("implementation"):
        raise MatrixError(f"{file}: environment.implementation is missing: not a run of kvparity run or check")
    row = Row(env["implementation"], env.get("implementation_version") or _commit(env), env.get("mlx_lm"),
              file.parent.parent, record=record, report=file.parent)
    verdicts = records.judged(record)
    policy = records.policy_of(record)
    row.cells = {c: _level_cell(verdicts, c) for c in LEVELS}
    row.cells.update({c: _check_cell(verdicts, c, policy) for c in CHECKS})
    row.failing = [_failing(row, v) for v in verdicts if v.verdict in FAILURES]
    groups = record.get("failures")
    if groups is None:  # a report from before failure groups
        groups = [g.to_json() for g in failures.group(verdicts)]
    row.findings = [_finding(row, g) for g in groups]
    row.architectures = {a.model: a for a in architectures(verdicts)} or None
    return row


def _commit(env) -> Optional[str]:
    return env.get("git_commit") and f"git {env['git_commit'][:12]}"


def _level_cell(verdicts: List[ScheduleVerdict], level: str) -> Optional[Counter]:
    """Schedule runs of the level by outcome; None when the row ran none."""
    ran = [v.verdict for v in verdicts if v.evidence.level == level]
    return Counter(ran) if ran else None


def check_outcome(verdict: ScheduleVerdict, check: str, policy) -> Optional[str]:
    """What became of ``check`` in a schedule run, its rows' worst: FAIL
    (a divergence not declared that fails its row, as the verdict judged
    it), reported (one the policy does not gate), expected divergence (all
    declared), pass (compared, held), the run's own outcome where it stopped
    before comparing it, no evidence (nothing compared where the level
    requires it); None where the check does not apply."""
    level = LEVELS[verdict.evidence.level]
    states = set()
    for row in verdict.rows:
        found = [i for i, d in enumerate(row.evidence.divergences) if d.check == check]
        undeclared = [row.evidence.divergences[i] for i in found if i not in row.declared]
        if CHECKS[check].gates == BY_TIER and not level.every_divergence_gates:
            failing = bool(undeclared) and not policy.accepts(row.tier)
        else:
            failing = any(gates(d, level, policy) for d in undeclared)
        if failing:
            states.add(FAIL)
        elif undeclared:
            states.add(REPORTED)
        elif found:
            states.add(EXPECTED_DIVERGENCE)
        elif row.evidence.compared(check):
            states.add(PASS)
    for state in (FAIL, REPORTED, EXPECTED_DIVERGENCE):
        if state in states:
            return state
    required = any(check in required_checks(row.evidence, level) for row in verdict.rows) if verdict.rows \
        else check in level.requires
    stopped = verdict.evidence.stopped
    if stopped in STOPPED:
        return stopped if required or states else None
    if PASS in states:
        return PASS
    return NO_EVIDENCE if required else None


def _check_cell(verdicts, check, policy) -> Optional[Counter]:
    found = [o for o in (check_outcome(v, check, policy) for v in verdicts) if o is not None]
    return Counter(found) if found else None


def _minimal_file(row: Row, name: str) -> Path:
    return row.folder / BISECTED / f"{name.split(' (')[0]}-min.json"  # an L3 run is "NAME (prefill mode)"


def _schedule_of(row: Row, name: str, path: Optional[str], level: str):
    """(the schedule file, whether it is the minimal one kvparity bisect wrote
    in the row's folder, the command that replays it)."""
    minimal = _minimal_file(row, name)
    schedule = minimal if minimal.is_file() else (path and Path(path))
    if not schedule:
        return None, False, None
    schedule = _from_here(schedule)
    served = next((r["server"] for r in row.record["results"] if r.get("server", {}).get("command")), None)
    if level == L4 and served:  # a server: the same command and declarations, on that schedule and model alone
        model = next((r["model"] for r in row.record["results"] if r["schedule"] == name and r.get("model")), None)
        return schedule, minimal.is_file(), shlex.join(
            ["kvparity", "run", "--level", L4, "--schedule", str(schedule), *(["--model", model] if model else []),
             "--server", served["command"], *served["declares"]])
    replay = f"kvparity replay {schedule} --level {level} --impl {row.implementation}"
    policy = row.record["policy"]
    replay += f" --policy {_from_here(policy['path']) if policy['path'] else policy['name']}"
    if row.record["expectations"]:
        replay += f" --expectations {_from_here(row.record['expectations']['path'])}"
    return schedule, minimal.is_file(), replay


def _failing(row: Row, verdict: ScheduleVerdict) -> dict:
    """A failing schedule run: the minimal schedule kvparity bisect wrote for
    it in the row's folder, else the schedule itself, and its replay command."""
    result = verdict.evidence
    schedule, minimal, replay = _schedule_of(row, result.schedule, result.path, result.level)
    first = first_failure(verdict)  # what failed the run, not an earlier hygiene finding
    return {"level": result.level, "schedule": result.schedule, "outcome": verdict.verdict,
            "file": str(schedule) if schedule else None, "minimal": minimal, "replay": replay,
            "first": first.message() if first else result.reason}


def _finding(row: Row, group: dict) -> dict:
    """A failure group of the row's report (one root cause), with its
    example's schedule (the minimal one where kvparity bisect wrote it)."""
    example = group["example"]
    shrunk = [m for m in group["members"] if _minimal_file(row, m).is_file()]  # kvparity bisect's, where it ran
    name, path = (shrunk[0], None) if shrunk else (example["schedule"], example["path"])
    schedule, minimal, replay = _schedule_of(row, name, path, group["level"])
    return {"title": failures.title(group), "level": group["level"], "at_fault": group["at_fault"],
            "schedules": group["schedules"], "members": group["members"], "first": example["message"],
            "expected": example["expected"], "actual": example["actual"],
            "shrunk_events": group.get("shrunk_events") or [],
            "seen_as": group["seen_as"] if len(group.get("seen_as") or []) > 1 else [],
            "file": str(schedule) if schedule else None,
            "minimal": minimal, "replay": replay}


# -- the verdict of the matrix ---------------------------------------------------------


def gate_status(rows: List[Row]) -> int:
    """As a CI gate over every row: 1 when a row's parity broke, else 125
    when a row could not be installed or judged, else 0."""
    statuses = [r.exit_status for r in rows]
    if EXIT_BROKEN in statuses:
        return EXIT_BROKEN
    if any(s != EXIT_OK for s in statuses) or not rows:
        return EXIT_CANNOT_JUDGE
    return EXIT_OK


def render_status(rows: List[Row]) -> int:
    """Rendering: 0 when some row holds evidence (FAILs included: the page
    shows them), 125 when no row compared anything (every row could not be
    installed or has no evidence: an empty page is not a result)."""
    judged = [r for r in rows if r.record is not None and any(
        (r.cells[level] or Counter())[o] for level in LEVELS for o in (PASS, FAIL, EXPECTED_DIVERGENCE))]
    return EXIT_OK if judged else EXIT_CANNOT_JUDGE


# -- the documents ---------------------------------------------------------------------


def _from_here(path) -> Path:
    """``path`` relative to the working directory where it lies below it (a
    checkout's catalog, its rows), so a page names no machine's folders."""
    path = Path(path).resolve()
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def _link(path: Optional[Path], out: Path) -> Optional[str]:
    """``path`` relative to the page; None where it is not there (a page links only what exists)."""
    if path is None or not Path(path).is_file():
        return None
    return os.path.relpath(Path(path).resolve(), out.resolve())


def build(rows: List[Row], out: Path, gate: bool, report_links: bool = True) -> dict:
    """matrix.json's content, as described by schema/matrix.schema.json; links relative to ``out``
    (to the rows' reports only with ``report_links``: they are published beside the page)."""
    status = gate_status(rows) if gate else render_status(rows)
    docs = []
    for r in rows:
        env = r.record["environment"] if r.record else {}
        docs.append({
            "implementation": r.implementation, "name": r.name, "language": r.language, "version": r.version,
            "mlx_lm": r.mlx_lm,
            "mlx": env.get("mlx"),
            "device": env.get("device"), "folder": str(r.folder),
            "report": _link(r.report / "report.html", out) if r.report and report_links else None,
            "created": r.record["created"] if r.record else None,
            "exit_status": r.record["exit_status"] if r.record else None,
            "headline": r.record["headline"] if r.record else None,
            "cannot_install": r.cannot_install and {"reason": r.cannot_install["reason"],
                                                    "command": r.cannot_install.get("command")},
            "cells": {c: None if n is None else {o: n[o] for o in CELL_OUTCOMES} for c, n in r.cells.items()},
            "failing": [{**f, "link": _link(f["file"], out)} for f in r.failing],
            "findings": [{**f, "link": _link(f["file"], out)} for f in r.findings],
            "architectures": r.architectures and {m: _architecture_doc(a) for m, a in r.architectures.items()},
        })
    return {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "columns": [{"name": c, "kind": "level" if c in LEVELS else "check"} for c in columns()],
            "outcomes": list(CELL_OUTCOMES), "architectures": architecture_names(rows),
            "architecture_outcomes": list(OUTCOMES), "gate": gate, "exit_status": status, "rows": docs}


def architecture_names(rows: List[Row]) -> List[str]:
    """Every model some row's runs ran on, as kvparity lists its models."""
    names = {m: None for r in rows for m in (r.architectures or {})}
    return sorted(names, key=model_order)


def _architecture_doc(entry: Architecture) -> dict:
    return {"cell": {o: entry.outcomes[o] for o in OUTCOMES},
            "limits": [{"name": n, "attribution": a} for n, a in entry.limits.items()]}

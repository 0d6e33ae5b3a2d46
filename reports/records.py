"""Report directories read back: a report.json's evidence, policy and
declarations as the objects a run judged with, so that what several report
directories hold (shards of one run, rows of a matrix) is judged again by
the same code, ``verdicts.judge`` and ``verdicts.verdict_of_run``, never by
a copy of it.

report.json keeps every comparison count and divergence of each schedule
run (``ScheduleResult.to_json``); the verdict fields written beside them
are recomputed here, not trusted.
"""

import dataclasses
import math
from collections import Counter
from pathlib import Path
from typing import List, Optional


from kvparity.oracle.inputs import read_json
from kvparity.reports.documents import check_schema
from kvparity.reports.expectations import Declaration, Expectations
from kvparity.reports.policy import Policy
from kvparity.reports.verdicts import ScheduleVerdict, judge
from kvparity.reports.report_json import SCHEMA, SCHEMA_PATH
from kvparity.suites.core.compare import Divergence
from kvparity.suites.core.evidence import RowResult, ScheduleResult
from kvparity.suites.format.schedule import CATALOG

REPORT = "report.json"
# _json_safe writes non-finite floats as these strings: JSON has no literal for them.
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class RecordError(ValueError):
    """A report directory that cannot be read back: the message names the file and the reason."""


def report_files(paths) -> List[Path]:
    """Every report.json at or under ``paths``, in a stable order; a path
    that holds none is an error naming it."""
    found = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise RecordError(f"{path}: not a directory")
        here = sorted(p for p in path.rglob(REPORT) if not any(part.startswith(".") for part in p.parts[-2:]))
        if not here:
            raise RecordError(f"{path}: holds no {REPORT} (a report directory, or a folder of them)")
        found += here
    return found


def read_record(path) -> dict:
    """report.json, checked against its schema."""
    path = Path(path)
    record = read_json(path, RecordError)
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        found = record.get("schema") if isinstance(record, dict) else None
        raise RecordError(f"{path}: schema {found!r}, expected {SCHEMA!r} (a report of another kvparity version)")
    check_schema(record, SCHEMA_PATH, path, RecordError)
    return record


def policy_of(record: dict) -> Policy:
    doc = record["policy"]
    return Policy(**{f.name: doc[f.name] for f in dataclasses.fields(Policy) if f.name in doc})


def expectations_of(record: dict) -> Optional[Expectations]:
    """The declarations the run was judged with, or None without a file."""
    doc = record.get("expectations")
    if doc is None:
        return None
    return Expectations(doc["path"], tuple(
        Declaration(d["check"], d["reason"], tuple(d["levels"]), tuple(d["schedules"]), tuple(d["events"]))
        for d in doc["declarations"]), doc.get("implementation") or "")


def _finite(value):
    if isinstance(value, str) and value in NON_FINITE:
        return NON_FINITE[value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _fields(cls, doc: dict) -> dict:
    return {f.name: doc[f.name] for f in dataclasses.fields(cls) if f.name in doc}


def local_path(path: Optional[str]) -> Optional[str]:
    """A schedule's file as this machine has it: a catalog file written on
    another machine (a shard's runner, with kvparity installed elsewhere) is
    read from this installation's catalog, so the coverage model can read it."""
    if path is None or Path(path).is_file():
        return path
    parts = Path(path).parts
    ends = [i for i in range(len(parts) - 1) if parts[i:i + 2] == ("suites", "catalog")]
    if ends:
        here = CATALOG.joinpath(*parts[ends[-1] + 2:])
        if here.is_file():
            return str(here)
    return path


def evidence_of(doc: dict) -> ScheduleResult:
    """A schedule run's evidence from its report.json entry."""
    result = ScheduleResult(**_fields(ScheduleResult, {**doc, "rows": [], "path": local_path(doc.get("path"))}))
    result.called = {int(e): list(members) for e, members in (doc.get("called") or {}).items()}
    for row_doc in doc["rows"]:
        row = RowResult(row_doc["request"], metrics=_finite(row_doc.get("metrics") or {}),
                        series=_finite(row_doc.get("series") or {}),
                        requires=tuple(row_doc.get("requires") or ()))
        row.divergences = [Divergence(**{**_fields(Divergence, d), "reshaped": tuple(d.get("reshaped") or ())})
                           for d in row_doc["divergences"]]
        row.counts = {int(e): Counter(c) for e, c in row_doc["counts"].items()}
        result.rows.append(row)
    return result


def judged(record: dict) -> List[ScheduleVerdict]:
    """Each schedule run of a record, judged again under its own policy and declarations."""
    policy, expectations = policy_of(record), expectations_of(record)
    return [judge(evidence_of(doc), policy, expectations) for doc in record["results"]]

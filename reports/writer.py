"""Report directories, written atomically, and what goes in them.

A run writes into a hidden temporary directory beside its destination and
renames it into place only when every file is complete, so an interrupted
run leaves no half-written report and never overwrites an earlier one.

Each directory holds report.md (tables), report.json (the machine record,
described by schema/report.schema.json), junit.xml (CI) and report.html
(one self-contained page with plots).
"""

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Callable, List, Mapping, Optional

from tabulate import tabulate

from kvparity.reports.atomic import AtomicDirectory
from kvparity.reports.policy import TIER_FAMILIES, bytes_ok, row_tier, tier_family
from kvparity.reports.results import FAIL, NOT_SUPPORTED, PASS, SKIPPED, ScheduleResult

SCHEMA = "kvparity.report/1"
SCHEMA_PATH = Path(__file__).parent / "schema" / "report.schema.json"
VERDICTS = (PASS, FAIL, NOT_SUPPORTED, SKIPPED)



class ReportDirectory(AtomicDirectory):
    """``with ReportDirectory(root) as staging:`` write files into ``staging``;
    on success it becomes ``.path``, a new directory under ``root`` named by
    the time (an earlier report is never overwritten)."""

    def names(self):
        stamp = time.strftime("%Y%m%d-%H%M%S")
        yield stamp
        yield from (f"{stamp}-{n}" for n in range(1, 1000))


# --- the machine record ----------------------------------------------------


def build_record(results: List[ScheduleResult], environment: dict, policy=None, probes=None,
                 capabilities=None, sections=()) -> dict:
    """report.json's content, as described by schema/report.schema.json."""
    if capabilities is None:
        capabilities = environment.get("capabilities") or {}
    schedules = []
    for result in results:
        doc = result.to_json()
        for row, row_doc in zip(result.rows, doc["rows"]):
            row_doc["tier"] = row_tier(row)
            row_doc["required"] = getattr(row, "required", None)
            row_doc["bytes_ok"] = bytes_ok(row)
            row_doc["series"] = getattr(row, "series", None) or {}
            for d, d_doc in zip(row.divergences, row_doc["divergences"]):
                d_doc["message"] = d.message()
        schedules.append(doc)
    rows = [row for r in schedules for row in r["rows"]]
    record = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "passed": all(r.verdict != FAIL for r in results),
        "summary": {
            "schedules": {v: sum(r.verdict == v for r in results) for v in VERDICTS},
            "rows": {v: sum(row["verdict"] == v for row in rows) for v in VERDICTS},
            "tiers": {f: sum(tier_family(row["tier"]) == f for row in rows) for f in TIER_FAMILIES},
        },
        "environment": environment,
        "policy": _as_dict(policy),
        "capabilities": dict(capabilities),
        "probes": [_as_dict(p) for p in probes or ()],
        "sections": [{"title": t, "headers": list(h), "rows": [list(r) for r in rows_]} for t, h, rows_ in sections],
        "results": schedules,
    }
    return _json_safe(record)


def _as_dict(value):
    if value is None or isinstance(value, dict):
        return value
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return dict(value)


def _json_safe(value):
    """Plain JSON: NaN and infinities become strings (JSON has no literal for
    them), tuples lists, numpy scalars numbers, anything else its str()."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy or mlx scalar
        try:
            return _json_safe(value.item())
        except (TypeError, ValueError):
            pass
    return str(value)


# --- tables (report.md and report.html share them) -------------------------


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
    headers = ["schedule", "level", "row", "verdict", "tier", "required", "bytes", "checks", "divergences",
               "first divergence"]
    rows = []
    for r in results:
        for row in r.rows:
            first = row.first.message() if row.first else (r.reason if row.verdict != PASS else "")
            tier = row_tier(row)
            compared = tier is not None
            rows.append([r.schedule, r.level, row.request, row.verdict, tier or "",
                         getattr(row, "required", "") if compared else "",
                         ("ok" if bytes_ok(row) else "differ") if compared else "",
                         row.checks, len(row.divergences), first])
    return headers, rows


def logit_rows(results: List[ScheduleResult]):
    """L2 rows: how far batched logits are from solo, llama.cpp-style."""
    headers = ["schedule", "row", "tier", "positions", "bit-exact", "top-1", "max abs diff", "max ULP",
               "KL mean", "KL max", "KL median", "KL p95", "KL p99"]
    rows = []
    for r in results:
        for row in r.rows:
            m = row.metrics
            if not m.get("positions"):
                continue
            rows.append([r.schedule, row.request, row_tier(row), m["positions"], m["bit_exact"],
                         f"{m['top1_agree']}/{m['positions']}", _g(m["max_abs_diff"]), m["max_ulp"],
                         *(_g(m[k]) for k in ("kl_mean", "kl_max", "kl_median", "kl_p95", "kl_p99"))])
    return headers, rows


def capability_rows(capabilities: Mapping[str, bool], implementation: str = ""):
    headers = ["capability", implementation or "supported"]
    return headers, [[name, "yes" if ok else "no (not supported)"] for name, ok in capabilities.items()]


def probe_rows(probes):
    """L0 probe records (dataclasses or dicts) as a table, fields as columns."""
    records = [_as_dict(p) for p in probes]
    headers = list(records[0]) if records else []
    return headers, [[record.get(h) for h in headers] for record in records]


def tables(results, environment, policy=None, probes=None, capabilities=None, sections=()):
    """Every (title, headers, rows) table of a report, in order."""
    if capabilities is None:
        capabilities = environment.get("capabilities") or {}
    out = [("Summary", *summary_rows(results)), ("Rows", *row_rows(results))]
    logits = logit_rows(results)
    if logits[1]:
        out.append(("Logits (L2): KL(solo || batched) in nats", *logits))
    if policy is not None:
        policy = _as_dict(policy)
        out.append(("Policy", ["key", "value"], [[k, v] for k, v in policy.items()]))
    if capabilities:
        out.append(("Capabilities", *capability_rows(capabilities, environment.get("implementation", ""))))
    if probes:
        out.append(("L0 backend probes", *probe_rows(probes)))
    return out + [(title, list(headers), list(rows)) for title, headers, rows in sections]


def _g(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _short(text, width=90):
    text = text or ""
    return text if len(text) <= width else text[: width - 1] + "…"


def flatten(d, prefix=""):
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def render_markdown(record: dict, report_tables) -> str:
    lines = ["# kvparity report", "", f"Written {record['created']} ({SCHEMA}).", "", "## Environment", ""]
    lines.append(tabulate(flatten(record["environment"]).items(), headers=["key", "value"], tablefmt="github"))
    for title, headers, rows in report_tables:
        lines += ["", f"## {title}", "", tabulate(rows, headers, tablefmt="github")]
    return "\n".join(lines) + "\n"


def write_report(results: List[ScheduleResult], environment: dict, root, sections=(), *, policy=None,
                 probes=None, capabilities=None, extra: Optional[Callable[[Path], None]] = None) -> Path:
    """Write report.md, report.json, junit.xml and report.html into a new
    directory under ``root``; returns that directory.

    ``sections`` are extra (title, headers, rows) tables; ``policy`` the
    per-backend policy (dataclass or dict), ``probes`` L0 probe records,
    ``capabilities`` {name: supported} (default: the environment's);
    ``extra(directory)`` adds files (benchmarks) before the directory appears.
    """
    from kvparity.reports import html, junit

    record = build_record(results, environment, policy, probes, capabilities, sections)
    report_tables = tables(results, environment, policy, probes, capabilities, sections)
    report = ReportDirectory(root)
    with report as directory:
        text = json.dumps(record, indent=2, allow_nan=False) + "\n"
        (directory / "report.json").write_text(text)
        (directory / "report.md").write_text(render_markdown(record, report_tables))
        (directory / "junit.xml").write_bytes(junit.render(record))
        (directory / "report.html").write_text(html.render(record, report_tables))
        if extra is not None:
            extra(directory)
    return report.path

"""report.md: the record as tables (``tables``), the summary, the failure
groups, each row, logits, models, timelines, coverage, checks, members,
hygiene and probes."""

import dataclasses
from typing import List, Mapping

from tabulate import tabulate
from kvparity.reports.environment import flatten, split_environment
from kvparity.reports.policy import GATE, Policy
from kvparity.reports.verdicts import CHECK_STATES, STATUS, RowVerdict, RunVerdict, ScheduleVerdict
from kvparity.suites.core.members import REQUIRED_MEMBERS
from kvparity.suites.format.levels import L1

from kvparity.reports.report_json import (
    SCHEMA, counts_against, first_of, why, hygiene_findings, models, architecture_rows, member_calls,
    configuration_doc, configuration_rows, _as_dict, _groups,
)


# --- tables (report.md and report.html share them) -------------------------


def summary_rows(verdicts: List[ScheduleVerdict], policy: Policy):
    headers = ["schedule", "level", "model", "rows", "events", "verdict", "logits bit-exact", "top-1",
               "first divergence"]
    rows = []
    for v in verdicts:
        r = v.evidence
        first = first_of(v.rows, policy)
        positions = sum(row.metrics.get("positions", 0) for row in r.rows)
        exact = sum(row.metrics.get("bit_exact", 0) for row in r.rows)
        top1 = sum(row.metrics.get("top1_agree", 0) for row in r.rows)
        logit_cols = [f"{exact}/{positions}", f"{top1}/{positions}"] if positions else ["", ""]
        rows.append([r.schedule, r.level, r.model or "", len(r.rows), r.events, v.verdict, *logit_cols,
                     first.message() if first else why(v)])
    return headers, rows


def failure_rows(groups):
    """One row per root cause: the member at fault, what diverged, how many
    runs it explains, its first divergence in full and the command that shrinks it."""
    headers = ["at fault", "check", "level", "schedule runs", "rows", "first seen", "expected", "got",
               "shrink it with"]
    rows = []
    for g in groups:
        doc = g.to_json()
        fault = doc["at_fault"] or "not known"
        if g.exposure:
            fault = f"{g.exposure.sentence()} (shrunk: {'; '.join(g.shrunk)})"
        example = doc["example"]
        rows.append([fault, doc["check"] + (f" on {doc['tensor']}" if doc["tensor"] else ""), doc["level"],
                     doc["schedules"], doc["rows"], f"{example['schedule']}: {example['message']}",
                     "" if example["expected"] is None else example["expected"],
                     "" if example["actual"] is None else example["actual"], doc["bisect"] or ""])
    return headers, rows


def row_rows(verdicts: List[ScheduleVerdict], policy: Policy):
    headers = ["schedule", "level", "row", "verdict", "tier", "required", "comparisons", "divergences",
               "first divergence"]
    rows = []
    for v in verdicts:
        r = v.evidence
        for row in v.rows:
            counted = sum(counts_against(d, policy) for d in row.evidence.divergences)
            first = first_of([row], policy)
            rows.append([r.schedule, r.level, row.evidence.request, row.verdict, row.tier or "", _required(r, row),
                         row.evidence.checks, counted, first.message() if first else row.reason])
    return headers, rows


def _required(result, row: RowVerdict) -> str:
    # L1 bytes are data movement: bit-exact under every policy.
    if result.level == L1 and row.tier is not None:
        return row.required or "bit-exact"
    return row.required


def logit_rows(verdicts: List[ScheduleVerdict]):
    """L2 rows: how far batched logits are from solo, llama.cpp-style."""
    headers = ["schedule", "row", "tier", "positions", "comparable", "bit-exact", "top-1", "max abs diff",
               "max ULP", "KL mean", "KL max", "KL median", "KL p95", "KL p99"]
    rows = []
    for v in verdicts:
        r = v.evidence
        for row_verdict in v.rows:
            row = row_verdict.evidence
            m = row.metrics
            if not m.get("positions"):
                continue
            # No ULP distance means no position was comparable: then no distance is a measurement.
            measured = m.get("max_ulp") is not None
            distances = [m[k] for k in ("max_abs_diff", "max_ulp", "kl_mean", "kl_max", "kl_median", "kl_p95",
                                        "kl_p99")]
            rows.append([r.schedule, row.request, row_verdict.tier or "", m["positions"],
                         "yes" if m.get("comparable", True) else "no (dtype or shape differ)", m["bit_exact"],
                         f"{m['top1_agree']}/{m['positions']}",
                         *(_g(x) if measured else "n/a" for x in distances)])
    return headers, rows


def model_rows(verdicts: List[ScheduleVerdict]):
    return ["model", "sha256", "config.json sha256", "weights sha256", "schedule runs"], [
        [m["model"], m["model_sha256"] or "", m.get("config_sha256") or "", m.get("weights_sha256") or "",
         m["schedules"]] for m in models(verdicts)]


def timeline_rows(verdicts: List[ScheduleVerdict]):
    """L3: per schedule run and engine step, what the engine did."""
    names = lambda ids: ", ".join(ids)
    # conversations: arrivals that started from the prompt cache, rows stored into it
    return (["schedule", "step", "arrived", "from store", "prompt batch", "joined", "generation batch", "finished",
             "stored", "widths"],
            [[r.schedule, s["step"], names(s["arrived"]), names(s.get("from_store", [])), names(s["prompt_batch"]),
              names(s["joined"]), names(s["generation_batch"]), names(s["finished"]), names(s.get("stored", [])),
              f"{s['prompt_width']}/{s['generation_width']}"]
             for r in (v.evidence for v in verdicts) for s in r.timeline])


def coverage_rows(run_verdict: RunVerdict):
    """Comparisons made per event kind (rows) and check (columns)."""
    checks = sorted({c for per_kind in run_verdict.coverage.values() for c in per_kind})
    rows = [[kind, *(per_kind.get(c, 0) for c in checks), sum(per_kind.values())]
            for kind, per_kind in run_verdict.coverage.items()]
    return ["event kind", *checks, "total"], rows


GENERATED_TITLE = "Generated schedules (after the catalog, derandomized)"


def model_coverage_rows(run_verdict: RunVerdict):
    """The coverage model's requirements the L1 runs reached, and any they missed."""
    cells = run_verdict.cells
    return ["requirements", "reached", "not reached"], [
        [cells["requirements"], cells["reached"], ", ".join(cells["missing"]) or "none"]]


def generated_rows(record):
    """The generated budget run after the catalog (``reports/commands/generated.py``'s record)."""
    cells = record["cells"]
    out = [["level", record["level"]], ["budget (--generated)", record["budget"]], ["seed", record["seed"]],
           ["example database", record["database"] or "none"], ["seconds", record["seconds"]],
           ["generated schedules judged", record["schedules"]], ["rows passed", record["rows_passed"]],
           ["coverage model requirements reached", f"{cells['reached']} of {cells['requirements']}"],
           ["sha256 of the schedules", record["digest"]],
           *(["failure", f"{f['schedule']}: {f['verdict']}; replay with: {f['replay']}"] for f in record["failures"]),
           *(["worker lost", lost] for lost in record["lost"])]
    return ["", "value"], out


def check_rows(run_verdict: RunVerdict):
    """Per check, schedule runs (and rows) in which it held, diverged, diverged
    only as declared, or compared nothing: verdicts.check_table."""
    headers = ["check", *CHECK_STATES]
    return headers, [[check, *(f"{states['schedules'][s]} ({states['rows'][s]})" for s in CHECK_STATES)]
                     for check, states in run_verdict.checks.items()]


def declaration_rows(run_verdict: RunVerdict):
    """Each declared divergence: where it applies, why, and what became of it."""
    headers = ["check", "where", "reason", "divergences matched", "comparisons in scope", "status"]
    return headers, [[d["check"], d["scope"], d["reason"], d["matched"], d["compared"], d["status"]]
                     for d in run_verdict.declarations]


def member_rows(run_verdict: RunVerdict):
    return ["member", "kind", "calls"], [[m, "required" if m in REQUIRED_MEMBERS else "optional", n]
                                         for m, n in member_calls(run_verdict).items()]


def hygiene_rows(verdicts: List[ScheduleVerdict]):
    headers = ["schedule", "level", "row", "check", "findings", "comparisons", "max bytes retained",
               "first occurrence"]
    return headers, [[f["schedule"], f["level"], f["request"], f["check"], f["findings"], f["compared"],
                      "" if f["bytes_retained"] is None else f["bytes_retained"], f["first"]]
                     for f in hygiene_findings(verdicts)]


def capability_rows(capabilities: Mapping[str, bool], implementation: str = ""):
    headers = ["capability", implementation or "supported"]
    return headers, [[name, "yes" if ok else "no (not supported)"] for name, ok in capabilities.items()]


def probe_rows(probes):
    """L0 probe records (dataclasses or dicts) as a table, fields as columns."""
    records = [_as_dict(p) for p in probes]
    headers = list(records[0]) if records else []
    return headers, [[record.get(h) for h in headers] for record in records]


FAILURES_TITLE = "Failures by root cause: the member at fault, and how to shrink each"
ARCHITECTURES_TITLE = "Architectures: schedule runs per model by outcome, and mlx-lm's limits met"
CHECKS_TITLE = ("Checks: schedule runs (rows) in which each held, diverged, diverged only as declared, "
                "or compared nothing")


def tables(verdicts, environment, *, policy: Policy, run_verdict: RunVerdict, probes=None, capabilities=None,
           sections=(), expectations=None, failures=None, configuration=None):
    """Every (title, headers, rows) table of a report, in order."""
    if capabilities is None:
        capabilities = environment.get("capabilities") or {}
    doc = configuration_doc(configuration)
    out = [(f"Settings (under test: {environment.get('implementation', '')}; an empty value is the default)",
            *configuration_rows(doc))] if doc else []
    out.append(("Summary", *summary_rows(verdicts, policy)))
    groups = _groups(verdicts, failures, run_verdict)
    if groups:
        out.append((FAILURES_TITLE, *failure_rows(groups)))
    out += [(CHECKS_TITLE, *check_rows(run_verdict)), ("Rows", *row_rows(verdicts, policy))]
    if expectations is not None:
        gating = "failing the run" if run_verdict.unexpected_passes_gate else "reported"
        out.append((f"Declared divergences ({expectations.path}; unexpectedly passing: {gating} "
                    f"under policy {policy.name})", *declaration_rows(run_verdict)))
    logits = logit_rows(verdicts)
    if logits[1]:
        out.append(("Logits (L2): KL(solo || batched) in nats", *logits))
    used = model_rows(verdicts)
    if used[1]:
        out.append(("Models (each L2 schedule ran its own)", *used))
    archs = architecture_rows(verdicts)
    if archs[1]:
        out.append((ARCHITECTURES_TITLE, *archs))
    timeline = timeline_rows(verdicts)
    if timeline[1]:
        out.append(("L3 timeline: what the engine did per step (widths: prompt/generation batch)", *timeline))
    out.append(("Coverage: comparisons per event kind and check", *coverage_rows(run_verdict)))
    if run_verdict.cells:
        out.append(("Coverage model (L1): paths x settings", *model_coverage_rows(run_verdict)))
    if run_verdict.generated:
        out.append((GENERATED_TITLE, *generated_rows(run_verdict.generated)))
    out.append(("Protocol members called", *member_rows(run_verdict)))
    if run_verdict.gaps:
        out.append(("Coverage gaps", ["gap"], [[gap] for gap in run_verdict.gaps]))
    gating = "gating" if policy.hygiene == GATE else "reported, not gating"
    out.append((f"Hygiene ({gating} under policy {policy.name})", *hygiene_rows(verdicts)))
    out.append(("Policy", ["key", "value"], [[k, v] for k, v in dataclasses.asdict(policy).items()]))
    if capabilities:
        out.append(("Capabilities", *capability_rows(capabilities, environment.get("implementation", ""))))
    if probes:
        _, probe_model = split_environment(environment)
        shaped = f" (shapes of {probe_model['model']})" if probe_model and "model" in probe_model else ""
        out.append((f"L0 backend probes{shaped}", *probe_rows(probes)))
    return out + [(title, list(headers), list(rows)) for title, headers, rows in sections]


def _g(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def render_markdown(record: dict, report_tables) -> str:
    status = record["exit_status"]
    lines = ["# kvparity report", "", f"Written {record['created']} ({SCHEMA}).", "",
             f"**{record['headline']}**: exit status {status}, {STATUS.get(status, '')}.", ""]
    lines += ["## Environment", "",
              tabulate(flatten(record["environment"]).items(), headers=["key", "value"], tablefmt="github")]
    for title, headers, rows in report_tables:
        table = tabulate(rows, headers, tablefmt="github") if rows else "(none)"
        lines += ["", f"## {title}", "", table]
    return "\n".join(lines) + "\n"

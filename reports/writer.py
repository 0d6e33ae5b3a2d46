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
from collections import Counter
from importlib.resources import files
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional

from tabulate import tabulate

from kvparity.oracle.atomic import AtomicDirectory
from kvparity.oracle.mlx_lm_versions import defect_named
from kvparity.oracle.models import available_models
from kvparity.reports import failures as failures_of, html, junit
from kvparity.reports.environment import flatten, split_environment
from kvparity.reports.policy import GATE, Policy, TIER_FAMILIES, tier_family
from kvparity.reports.verdicts import CHECK_STATES, EXIT_OK, STATUS, RowVerdict, RunVerdict, ScheduleVerdict
from kvparity.suites.core.members import OPTIONAL_MEMBERS, REQUIRED_MEMBERS
from kvparity.suites.format.checks import ALIAS, CHECKS, HYGIENE_CHECKS
from kvparity.suites.core.compare import Divergence
from kvparity.suites.core.evidence import FAIL, MLX_LM_DEFECT, OUTCOMES, PASS
from kvparity.suites.format.levels import L1
from kvparity.suites.core.processes import signals_deferred
from kvparity.suites.l4.server_process import SERVER_LOGS

SCHEMA = "kvparity.report/2"
SCHEMA_PATH = Path(files(__package__) / "schema" / "report.schema.json")  # package data


class ReportUnwritten(Exception):
    """The report directory could not be written (a full disk, a folder
    made read-only during the run): what the command printed stands."""


class ReportDirectory(AtomicDirectory):
    """``with ReportDirectory(root) as staging:`` write files into ``staging``;
    on success it becomes ``.path``, a new directory under ``root`` named by
    the time (an earlier report is never overwritten)."""

    def names(self):
        stamp = time.strftime("%Y%m%d-%H%M%S")
        yield stamp
        yield from (f"{stamp}-{n}" for n in range(1, 1000))


# --- what the tables and the record share -----------------------------------


def counts_against(divergence: Divergence, policy: Policy) -> bool:
    """Whether a divergence is named as a row's or schedule's first: parity
    always; hygiene only where the policy gates it (else its own table shows it)."""
    return divergence.check not in HYGIENE_CHECKS or policy.hygiene == GATE


def earliest(divergences, policy: Policy) -> Optional[Divergence]:
    """The earliest divergence by event, then step, among those that count."""
    return min((d for d in divergences if counts_against(d, policy)), key=lambda d: d.order, default=None)


def first_of(rows: List[RowVerdict], policy: Policy) -> Optional[Divergence]:
    """The rows' earliest divergence that was not declared; with none, the
    earliest declared one (an expected divergence never hides a failure)."""
    undeclared = [d for row in rows for i, d in enumerate(row.evidence.divergences) if i not in row.declared]
    return (earliest(undeclared, policy)
            or earliest([d for row in rows for d in row.evidence.divergences], policy))


def why(verdict: ScheduleVerdict) -> str:
    """Why a schedule without a divergence to name did not pass."""
    return verdict.evidence.reason or next(
        (f"row {row.evidence.request!r}: {row.reason}" for row in verdict.rows if row.reason), "")


def hygiene_findings(verdicts: List[ScheduleVerdict]) -> List[dict]:
    """Per schedule, row and hygiene check with findings: how many, of how
    many comparisons, the first, and for sharing the most batch or source
    buffer bytes one finding kept alive (a Divergence's ``actual``)."""
    found = []
    for result in (v.evidence for v in verdicts):
        for row in result.rows:
            for check in HYGIENE_CHECKS:
                hits = [d for d in row.divergences if d.check == check]
                if not hits:
                    continue
                retained = [d.actual for d in hits if isinstance(d.actual, int)]
                found.append({
                    "schedule": result.schedule, "level": result.level, "request": row.request, "check": check,
                    "findings": len(hits), "compared": row.compared(check),
                    "bytes_retained": max(retained) if check == ALIAS and retained else None,
                    "first": min(hits, key=lambda d: d.order).message(),
                })
    return found


def models(verdicts: List[ScheduleVerdict]) -> List[dict]:
    """Each model the schedules ran, with its hash, where a model given by path
    came from, and how many schedule runs used it."""
    runs = Counter((v.evidence.model, v.evidence.model_sha256, tuple(sorted(v.evidence.model_source.items())))
                   for v in verdicts if v.evidence.model)
    return [{"model": m, "model_sha256": sha, **dict(source), "schedules": n} for (m, sha, source), n in runs.items()]


@dataclasses.dataclass
class Architecture:
    """The schedule runs of one model: how many per outcome, and the mlx-lm
    defects or limits that stopped them (name -> its attribution)."""

    model: str
    outcomes: Counter
    limits: Dict[str, str]


UNNAMED = "unnamed"  # an mlx-lm defect whose reason names none (a report written before names)


def architectures(verdicts: List[ScheduleVerdict]) -> List[Architecture]:
    """Per model the schedule runs ran on (a catalog default and a zoo
    architecture alike), in ``model_order``, read from each run's judged
    verdict and its evidence; runs without a model (L1) have none."""
    found = {}
    for v in verdicts:
        model = v.evidence.model
        if not model:
            continue
        entry = found.setdefault(model, Architecture(model, Counter(), {}))
        entry.outcomes[v.verdict] += 1
        if v.verdict == MLX_LM_DEFECT:
            reason = v.evidence.reason
            entry.limits.setdefault(defect_named(reason) or UNNAMED, reason)
    return sorted(found.values(), key=lambda a: model_order(a.model))


def model_order(name: str) -> int:
    """Where a model sorts: as kvparity lists its models (the catalog's,
    then the zoo's), a name it does not know (another version's) after them."""
    known = available_models()
    return known.index(name) if name in known else len(known)


def architecture_rows(verdicts: List[ScheduleVerdict]):
    """Per model: schedule runs by outcome (pass and FAIL always, the others
    where some model has them; empty for none) and mlx-lm's limits met."""
    entries = architectures(verdicts)
    shown = [o for o in OUTCOMES if o in (PASS, FAIL) or any(a.outcomes[o] for a in entries)]
    headers = ["model", "schedule runs", *shown, "mlx-lm limits", "attribution"]
    return headers, [[a.model, sum(a.outcomes.values()), *(a.outcomes[o] or "" for o in shown),
                      ", ".join(a.limits), "; ".join(a.limits.values())] for a in entries]


def member_calls(run_verdict: RunVerdict) -> dict:
    """Calls per protocol member, every member listed (0: never exercised)."""
    names = REQUIRED_MEMBERS + tuple(OPTIONAL_MEMBERS)
    return {**{m: 0 for m in names}, **dict(run_verdict.members)}


# --- the machine record ----------------------------------------------------


def build_record(verdicts: List[ScheduleVerdict], environment: dict, *, policy: Policy, run_verdict: RunVerdict,
                 probes=None, capabilities=None, sections=(), expectations=None, shard=None,
                 failures=None, configuration=None) -> dict:
    """report.json's content, as described by schema/report.schema.json.
    ``shard``: a shard's plan (``reports/shards.py``), or a merge's.
    ``failures``: the failing runs grouped by root cause (``reports/failures.py``;
    default: the run verdict's, else grouped here without shrinking).
    ``configuration``: the settings and where each came from
    (``settings.Configuration.to_json()``, or a record's)."""
    unjudged = [str(getattr(v, "schedule", v)) for v in verdicts if not isinstance(v, ScheduleVerdict)]
    if unjudged:  # a wiring bug: writers report verdicts, they do not make them
        raise ValueError(f"results not judged: {', '.join(unjudged)}")
    if capabilities is None:
        capabilities = environment.get("capabilities") or {}
    env, probe_model = split_environment(environment)
    schedules = [_schedule_doc(v, policy) for v in verdicts]
    rows = [row for s in schedules for row in s["rows"]]
    findings = hygiene_findings(verdicts)
    record = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "passed": run_verdict.exit_status == EXIT_OK,
        "exit_status": run_verdict.exit_status,
        "headline": run_verdict.headline,
        "interrupted": run_verdict.interrupted,
        "summary": {
            "schedules": {v: run_verdict.counts.get(v, 0) for v in OUTCOMES},
            "rows": {v: sum(row["verdict"] == v for row in rows) for v in OUTCOMES},
            "tiers": {f: sum(tier_family(row["tier"]) == f for row in rows) for f in TIER_FAMILIES},
        },
        "environment": env,
        "configuration": configuration_doc(configuration),
        "models": models(verdicts),
        "probe_model": probe_model,
        "policy": {**dataclasses.asdict(policy), "name": policy.name},
        "capabilities": dict(capabilities),
        "probes": [_as_dict(p) for p in probes or ()],
        "coverage": {kind: dict(checks) for kind, checks in run_verdict.coverage.items()},
        "checks": {check: {k: dict(v) for k, v in states.items()} for check, states in run_verdict.checks.items()},
        "expectations": expectations_doc(run_verdict, expectations),
        "members": member_calls(run_verdict),
        "gaps": list(run_verdict.gaps),
        "failures": [g.to_json() for g in _groups(verdicts, failures, run_verdict)],
        "model_coverage": run_verdict.cells,
        "generated": run_verdict.generated,
        "hygiene": {
            "gates": policy.hygiene == GATE,
            "totals": {c: sum(f["findings"] for f in findings if f["check"] == c) for c in HYGIENE_CHECKS},
            "findings": findings,
        },
        "sections": [{"title": t, "headers": list(h), "rows": [list(r) for r in rows_]} for t, h, rows_ in sections],
        "results": schedules,
        "shard": shard,
    }
    return _json_safe(record)


def configuration_doc(configuration) -> Optional[dict]:
    """The settings of the run as report.json holds them; None where the
    writer was given none (a report written without the command line)."""
    if configuration is None or isinstance(configuration, dict):
        return configuration
    return configuration.to_json()


def configuration_rows(doc: dict):
    """Each setting, its value and where it came from."""
    return ["setting", "value", "from"], [[name, "" if s["value"] is None else s["value"], s["from"]]
                                          for name, s in doc["settings"].items()]


def expectations_doc(run_verdict: RunVerdict, expectations) -> Optional[dict]:
    """The expectations file the run was judged with, each declaration with
    what it matched; None without one."""
    if expectations is None:
        return None
    return {"path": expectations.path, "implementation": expectations.implementation,
            "gates": run_verdict.unexpected_passes_gate, "declarations": list(run_verdict.declarations)}


def _schedule_doc(verdict: ScheduleVerdict, policy: Policy) -> dict:
    """A schedule run's evidence with its verdict, each row's beside the row's evidence."""
    doc = verdict.evidence.to_json()
    logs = doc["server"].pop("logs", None)  # L4: written as files beside report.json (write_report)
    if logs is not None:
        doc["server"]["log_files"] = [f"{SERVER_LOGS}/{name}" for name in logs]
    # Each verdict field just before the evidence's totals, where report.json has always had it.
    doc.update(verdict=verdict.verdict, events=doc.pop("events"))
    for row, row_doc in zip(verdict.rows, doc["rows"]):
        row_doc.update(verdict=row.verdict, tier=row.tier, required=row.required, reason=row.reason,
                       checks=row_doc.pop("checks"))
        row_doc["divergences"] = [_divergence_doc(d, row.declared.get(i))
                                  for i, d in enumerate(row.evidence.divergences)]
        first = first_of([row], policy)
        row_doc["first"] = _divergence_doc(first, _declaration_of(row, first))
    first = first_of(verdict.rows, policy)
    owner = next((row for row in verdict.rows if any(d is first for d in row.evidence.divergences)), None)
    doc["first"] = _divergence_doc(first, _declaration_of(owner, first) if owner else None)
    return doc


def _declaration_of(row: RowVerdict, divergence) -> Optional[int]:
    return next((row.declared.get(i) for i, d in enumerate(row.evidence.divergences) if d is divergence), None)


def _divergence_doc(d: Optional[Divergence], declared: Optional[int] = None) -> Optional[dict]:
    if d is None:
        return None
    kind = CHECKS[d.check].kind
    return {**dataclasses.asdict(d), "event_index": d.event_index, "kind": kind, "declared": declared,
            "message": d.message()}


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


def _groups(verdicts, failures, run_verdict):
    """The failure groups given, else the run verdict's, else those of ``verdicts`` (not shrunk)."""
    if failures is None:
        failures = run_verdict.failures
    return failures_of.group(verdicts) if failures is None else failures


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


def server_logs(verdicts: List[ScheduleVerdict]) -> Dict[str, str]:
    """L4: each server's log (file name -> its end) the schedule runs kept."""
    return {name: text for v in verdicts for name, text in v.evidence.server.get("logs", {}).items()}


def write_report(verdicts: List[ScheduleVerdict], environment: dict, root, *, policy: Policy,
                 run_verdict: RunVerdict, probes=None, capabilities=None, sections=(), expectations=None,
                 shard=None, extra: Optional[Callable[[Path], None]] = None, failures=None,
                 configuration=None) -> Path:
    """Write report.md, report.json, junit.xml and report.html into a new
    directory under ``root``; returns that directory.

    ``verdicts`` are the schedule runs' (``verdicts.judge``) and
    ``run_verdict`` is ``verdicts.verdict_of_run`` over them; ``policy`` is
    the one they were judged under. ``probes`` are L0 probe records, ``capabilities``
    {name: supported} (default: the environment's), ``sections`` extra
    (title, headers, rows) tables, and ``extra(directory)`` adds files
    (benchmarks) before the directory appears. ``expectations`` is the
    expectations file the runs were judged with, if any; ``shard`` the
    shard block of a shard's or a merge's report (``reports/shards.py``).
    ``failures``: as for ``build_record``; ``configuration`` the run's
    settings (``settings.Configuration``, or a record's ``configuration``).
    """
    options = dict(policy=policy, run_verdict=run_verdict, probes=probes, capabilities=capabilities,
                   sections=sections, expectations=expectations,
                   failures=_groups(verdicts, failures, run_verdict), configuration=configuration)
    record = build_record(verdicts, environment, shard=shard, **options)
    report_tables = tables(verdicts, environment, **options)
    report = ReportDirectory(root)
    # A stop signal waits for the report: a run that finished is reported whole.
    with signals_deferred():
        try:
            with report as directory:
                text = json.dumps(record, indent=2, allow_nan=False) + "\n"
                (directory / "report.json").write_text(text)
                (directory / "report.md").write_text(render_markdown(record, report_tables))
                (directory / "junit.xml").write_bytes(junit.render(record))
                (directory / "report.html").write_text(html.render(record, report_tables))
                for name, text in server_logs(verdicts).items():
                    (directory / SERVER_LOGS).mkdir(exist_ok=True)
                    (directory / SERVER_LOGS / name).write_text(text)
                if extra is not None:
                    extra(directory)
        except OSError as error:  # a full disk, a folder made read-only meanwhile: nothing half-written stays
            raise ReportUnwritten(f"the report could not be written under {root}: "
                                  f"{error.strerror or error}{f' ({error.filename})' if error.filename else ''}")
    return report.path

"""report.json: the machine record of a run, built once from its verdict
(``build_record``), described by schema/report.schema.json; every other
format is made from it."""

import dataclasses
import math
import time
from collections import Counter
from importlib.resources import files
from pathlib import Path
from typing import Dict, List, Optional
from kvparity.oracle.mlx_lm_versions import defect_named
from kvparity.oracle.models import available_models
from kvparity.reports import failures as failures_of
from kvparity.reports.environment import split_environment
from kvparity.reports.policy import GATE, Policy, TIER_FAMILIES, tier_family
from kvparity.reports.verdicts import EXIT_OK, RowVerdict, RunVerdict, ScheduleVerdict
from kvparity.suites.core.members import OPTIONAL_MEMBERS, REQUIRED_MEMBERS
from kvparity.suites.format.checks import ALIAS, CHECKS, HYGIENE_CHECKS
from kvparity.suites.core.compare import Divergence
from kvparity.suites.core.evidence import FAIL, MLX_LM_DEFECT, OUTCOMES, PASS
from kvparity.suites.l4.server_process import SERVER_LOGS


SCHEMA = "kvparity.report/2"
SCHEMA_PATH = Path(files(__package__) / "schema" / "report.schema.json")  # package data


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


def _groups(verdicts, failures, run_verdict):
    """The failure groups given, else the run verdict's, else those of ``verdicts`` (not shrunk)."""
    if failures is None:
        failures = run_verdict.failures
    return failures_of.group(verdicts) if failures is None else failures

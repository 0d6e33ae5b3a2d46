"""Shards of one run, and merging them into one verdict.

``kvparity check --shard K/N`` runs a deterministic share of the planned
schedule runs; every shard's report.json records which shard it is and the
whole plan (each run and its shard), so that ``kvparity merge`` can tell a
missing shard from a smaller run. The merge reads the shards' evidence back
(``reports/records.py``), judges it again and builds one verdict over all of
it with ``verdicts.verdict_of_run``: evidence is counted across shards, and
a schedule run of the plan that no shard brought is a gap, so a merge
missing a shard has no evidence, as a run missing those schedules would.

Shares are balanced by measured cost: ``shard-costs.json`` holds the
seconds each catalog run took in a real ``kvparity run`` (its
``results[].seconds``). A run's cost varies a hundredfold between levels (an
L2 schedule loads a model and runs the oracle, an L1 schedule moves bytes),
which a schedule's size does not predict. A run the table does not list
costs the median of its level's measured runs.
"""

import json
import statistics
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Dict, List, Optional, Sequence

COSTS_PATH = Path(files(__package__) / "shard-costs.json")  # package data
FORMAT = "kvparity.shard/1"


class ShardError(ValueError):
    """Exit 2: a bad --shard, or shard directories that are not shards of one run."""


@dataclass(frozen=True)
class Shard:
    index: int  # 1-based
    count: int

    def __str__(self):
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """``K/N`` with 1 <= K <= N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ShardError(f"--shard {text!r}: expected K/N, such as 1/4")
    if not 1 <= index <= count:
        raise ShardError(f"--shard {text}: K must be between 1 and N")
    return Shard(index, count)


def load_costs(path=COSTS_PATH) -> Dict[str, float]:
    """Run label ("L1 bits-4", "L3 x (batched)") -> measured seconds."""
    return {label: float(s) for label, s in json.loads(Path(path).read_text())["seconds"].items()}


def measured_costs(report: dict) -> Dict[str, float]:
    """A cost table from a run's report.json: each schedule run's seconds."""
    return {run_label(doc): round(doc["seconds"], 4) for doc in report["results"]}


def cost_table(report: dict) -> dict:
    """shard-costs.json's content from a run's report.json, saying where it was measured."""
    env = report["environment"]
    return {"measured": f"kvparity run of {env.get('implementation')} on {env['device']} (mlx {env['mlx']}, "
                        f"mlx-lm {env.get('mlx_lm')}, commit {(env.get('git_commit') or '?')[:7]}): seconds per "
                        "schedule run, from the report's results[].seconds",
            "seconds": measured_costs(report)}


def run_label(result) -> str:
    """The label a planned run and its result share (``commands.runs.plan``)."""
    if isinstance(result, dict):
        return f"{result['level']} {result['schedule']}"
    return f"{result.level} {result.schedule}"


def cost(label: str, costs: Dict[str, float]) -> float:
    if label in costs:
        return costs[label]
    level = label.split()[0]
    same = [s for known, s in costs.items() if known.split()[0] == level]
    return statistics.median(same or list(costs.values()) or [1.0])


def assign(labels: Sequence[str], count: int, costs: Dict[str, float]) -> List[int]:
    """The shard (1-based) of each run: the costliest first, each to the
    least loaded shard (the lowest-numbered on a tie). Deterministic: the
    same plan and table give the same shares on every machine."""
    loads = [0.0] * count
    shards = [0] * len(labels)
    for i in sorted(range(len(labels)), key=lambda i: (-cost(labels[i], costs), i)):
        target = min(range(count), key=lambda k: (loads[k], k))
        loads[target] += cost(labels[i], costs)
        shards[i] = target + 1
    return shards


def plan_doc(labels: Sequence[str], shard: Shard, whole_catalog: bool, costs: Dict[str, float]) -> dict:
    """What a shard's report.json records: itself and the whole plan."""
    if shard.count > len(labels):
        raise ShardError(f"--shard {shard}: the selection plans {len(labels)} schedule run(s), "
                         f"fewer than {shard.count} shards; a shard would compare nothing")
    shards = assign(labels, shard.count, costs)
    return {"format": FORMAT, "index": shard.index, "count": shard.count, "whole_catalog": whole_catalog,
            "costs": "measured seconds per run (shard-costs.json); a run it does not list: its level's median",
            "plan": [{"run": label, "shard": k, "cost": round(cost(label, costs), 4)}
                     for label, k in zip(labels, shards)]}


def share(runs, doc: dict):
    """The planned (label, run) pairs of the shard ``doc`` names."""
    return [run for run, entry in zip(runs, doc["plan"]) if entry["shard"] == doc["index"]]


# -- merging ---------------------------------------------------------------------------

# What every shard of one run shares; a difference means they are not one run.
SAME_ENVIRONMENT = ("implementation", "kvparity", "mlx", "mlx_lm", "git_commit", "backend")


@dataclass
class Merged:
    records: List[dict]  # the shards' report.json, by shard index
    directories: List[Path]
    count: int
    plan: List[dict]
    whole_catalog: bool
    missing: List[int]  # shard indexes no directory brought

    @property
    def interrupted(self) -> Optional[dict]:
        """``RunVerdict.interrupted`` of the merged run where a signal stopped a shard it merges, else None."""
        stopped = [r["interrupted"] for r in self.records if r.get("interrupted")]
        if not stopped:
            return None
        return {"signal": stopped[0]["signal"], "finished": sum(len(r["results"]) for r in self.records),
                "planned": len(self.plan)}

    def gaps(self) -> List[str]:
        out = []
        for k in self.missing:
            runs = [entry["run"] for entry in self.plan if entry["shard"] == k]
            shown = ", ".join(runs[:3]) + (", ..." if len(runs) > 3 else "")
            out.append(f"shard {k}/{self.count} is missing: its {len(runs)} schedule run(s) were not run ({shown})")
        return out


def gather(records: List[dict], directories: List[Path]) -> Merged:
    """Check that ``records`` are distinct shards of one run and line them up."""
    if not records:
        raise ShardError("nothing to merge")
    for record, directory in zip(records, directories):
        if not record.get("shard") or "index" not in record["shard"]:
            raise ShardError(f"{directory}: not a shard's report (no shard block: written by kvparity check "
                             "without --shard, or by kvparity merge)")
    first, first_dir = records[0], directories[0]
    for record, directory in zip(records[1:], directories[1:]):
        for name, a, b in _shared(record, first):
            if a != b:
                raise ShardError(f"{directory}: {name} {a!r} differs from {first_dir}'s {b!r}: "
                                 "the shards are not of one run")
    by_index = {}
    for record, directory in zip(records, directories):
        index = record["shard"]["index"]
        if index in by_index:
            raise ShardError(f"{directory}: shard {index}/{record['shard']['count']} is given twice "
                             f"(also {by_index[index][1]})")
        by_index[index] = (record, directory)
        labels = sorted(run_label(doc) for doc in record["results"])
        expected = sorted(e["run"] for e in record["shard"]["plan"] if e["shard"] == index)
        # An interrupted shard holds the runs that finished before the signal.
        if labels != expected and not (record.get("interrupted") and set(labels) <= set(expected)):
            raise ShardError(f"{directory}: shard {index} holds other schedule runs than its plan gives it")
    ordered = sorted(by_index)
    count = first["shard"]["count"]
    return Merged([by_index[k][0] for k in ordered], [by_index[k][1] for k in ordered], count,
                  first["shard"]["plan"], first["shard"]["whole_catalog"],
                  [k for k in range(1, count + 1) if k not in by_index])


def _shared(record: dict, other: dict):
    shard, first = record["shard"], other["shard"]
    yield "shard count", shard["count"], first["count"]
    yield "plan", shard["plan"], first["plan"]
    yield "whole_catalog", shard["whole_catalog"], first["whole_catalog"]
    yield "policy", record["policy"], other["policy"]
    yield "expectations", _declarations(record), _declarations(other)
    for key in SAME_ENVIRONMENT:
        yield f"environment.{key}", record["environment"].get(key), other["environment"].get(key)


def _declarations(record: dict) -> Optional[list]:
    doc = record["expectations"]
    if doc is None:
        return None
    return [{k: d[k] for k in ("check", "reason", "levels", "schedules", "events")} for d in doc["declarations"]]


def merged_doc(merged: Merged) -> dict:
    """The merged report's shard block: the shards it read and those it lacks."""
    return {"format": FORMAT, "count": merged.count, "whole_catalog": merged.whole_catalog,
            "costs": merged.records[0]["shard"]["costs"], "plan": merged.plan,
            "merged": [{"index": r["shard"]["index"], "directory": str(d), "created": r["created"],
                        "exit_status": r["exit_status"], "device": r["environment"].get("device")}
                       for r, d in zip(merged.records, merged.directories)],
            "missing": merged.missing}


def in_plan_order(results, plan: List[dict]):
    """Results in the order of the plan, as one unsharded run lists them."""
    position = {}
    for i, entry in enumerate(plan):
        position.setdefault(entry["run"], i)
    return sorted(results, key=lambda r: position.get(run_label(r.evidence), len(plan)))


if __name__ == "__main__":  # python -m kvparity.reports.shards REPORT.json > reports/shard-costs.json
    import sys

    print(json.dumps(cost_table(json.loads(Path(sys.argv[1]).read_text())), indent=1))

"""Verdicts before and after a change to the harness: a snapshot of what the
gate says, and the difference between two snapshots.

A refactor of kvparity must not change a verdict. A snapshot runs
``kvparity run`` on the catalog at every level, and on a fixed set of
generated schedules, for the reference, the second implementation and every
negative control (the designed-difference controls with their expectations
file), and keeps from each report what a verdict is made of: outcomes,
reasons, comparison counts per event and check, and divergence messages.
Timings and the environment are left out.

    python -m kvparity.reports.snapshot schedules DIR [--examples N]
    python -m kvparity.reports.snapshot write OUT.json [--schedules DIR]
    python -m kvparity.reports.snapshot diff BEFORE.json AFTER.json

Write the generated schedules once, take a snapshot, change the code, take
another with the same schedules, and diff: exit 0 when identical.
"""

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
from importlib.resources import files
from pathlib import Path

CONTROLS = "kvparity.impl.negative_controls"
EXPECTATIONS = Path(files(__package__) / "examples" / "expectations" / "extract-bfloat16.json")
# Every field of a result and a row that a verdict is made of.
RESULT_FIELDS = ("schedule", "level", "implementation", "verdict", "stopped", "reason", "event_kinds", "members")
ROW_FIELDS = ("request", "verdict", "tier", "required", "reason", "counts")


def implementations():
    """(label, --impl spec, extra arguments) for every implementation the gate is proven on."""
    controls = importlib.import_module(CONTROLS)  # by name, as --impl loads it: impl only through the adapter

    yield "reference", None, ()
    yield "mlx_style", "kvparity.impl.mlx_style:MlxStyleBatchQuantizedKVCache", ()
    classes = {name for name, obj in vars(controls).items()
               if isinstance(obj, type) and obj.__module__ == controls.__name__}
    for name in sorted(classes):
        extra = ("--expectations", str(EXPECTATIONS)) if name.startswith("ExtractReturnsBfloat16") else ()
        yield name, f"{CONTROLS}:{name}", extra


def write_schedules(directory: Path, examples: int):
    """``examples`` L1 schedules from the state machine, derandomized, as files."""
    from hypothesis import HealthCheck, settings

    from kvparity.reports.policy import load_policy
    from kvparity.reports.verdicts import judge
    from kvparity.suites.core.adapter import load_implementation
    from kvparity.suites.search.fuzz import generate, make_machine
    from kvparity.suites.format.schedule import save

    directory.mkdir(parents=True, exist_ok=True)
    cpu = load_policy("cpu")
    machine = make_machine(load_implementation(), lambda result: judge(result, cpu), found_dir=directory / "found")
    written = []

    class Keeping(machine):
        def teardown(self):
            super().teardown()
            if self.schedule.events:
                self.schedule.name = f"generated-{len(written):04d}"
                written.append(save(self.schedule, directory / f"{self.schedule.name}.json"))

    generate(Keeping, settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                               stateful_step_count=10, suppress_health_check=list(HealthCheck)))
    return written


def run_report(spec, extra, schedules, out: Path) -> dict:
    argv = [sys.executable, "-m", "kvparity.reports.cli", "run", "--level", "all", "--out", str(out)]
    argv += ["--impl", spec] if spec else []
    argv += list(extra)
    for path in schedules:
        argv += ["--schedule", str(path)]
    done = subprocess.run(argv, capture_output=True, text=True)
    reports = sorted(out.glob("*/report.json"))
    if not reports:  # kept as it is: a harness that crashed before is a difference once it does not
        last = done.stderr.strip().splitlines()[-2:]
        return {"exit": done.returncode, "results": [], "no report": last}
    record = json.loads(reports[-1].read_text())
    return {"exit": done.returncode, "results": [_kept(r) for r in record["results"]]}


def _kept(result: dict) -> dict:
    kept = {k: result.get(k) for k in RESULT_FIELDS}
    kept["rows"] = []
    for row in result.get("rows", []):
        entry = {k: row.get(k) for k in ROW_FIELDS}
        # Which array of a triple an alias finding names varies between runs: keep its check and place.
        entry["divergences"] = [
            d["check"] + ": " + (d.get("event") or "") if d["check"] == "alias" else _message(d)
            for d in row.get("divergences", [])]
        kept["rows"].append(entry)
    return kept


def _message(divergence: dict) -> str:
    return json.dumps({k: v for k, v in divergence.items() if k != "order"}, sort_keys=True)


def write_snapshot(out: Path, schedule_dir: Path = None):
    generated = sorted(schedule_dir.glob("*.json")) if schedule_dir else []
    snapshot = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, spec, extra in implementations():
            print(f"snapshot: {label}", file=sys.stderr)
            snapshot[f"{label} catalog"] = run_report(spec, extra, [], Path(tmp) / label / "catalog")
            if generated:
                snapshot[f"{label} generated"] = run_report(spec, extra, generated, Path(tmp) / label / "generated")
    out.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")


def diff(before: dict, after: dict) -> list:
    lines = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if a is None or b is None:
            lines.append(f"{key}: only in {'after' if a is None else 'before'}")
            continue
        if a["exit"] != b["exit"] or a.get("no report") != b.get("no report"):
            lines.append(f"{key}: exit {a['exit']} -> {b['exit']}"
                         + "".join(f"\n  {side}: {' / '.join(x['no report'])}" for side, x in (("before", a), ("after", b))
                                   if x.get("no report")))
        ra = {(r["level"], r["schedule"]): r for r in a["results"]}
        rb = {(r["level"], r["schedule"]): r for r in b["results"]}
        for name in sorted(set(ra) | set(rb)):
            if ra.get(name) != rb.get(name):
                lines.append(f"{key}: {' '.join(name)} differs:\n  before {json.dumps(ra.get(name))[:600]}"
                             f"\n  after  {json.dumps(rb.get(name))[:600]}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvparity.reports.snapshot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    schedules = sub.add_parser("schedules", help="write the fixed set of generated schedules")
    schedules.add_argument("directory", type=Path)
    schedules.add_argument("--examples", type=int, default=60)
    write = sub.add_parser("write", help="take a snapshot of the verdicts")
    write.add_argument("out", type=Path)
    write.add_argument("--schedules", type=Path, help="a directory written by 'schedules'")
    compare = sub.add_parser("diff", help="exit 0 when two snapshots say the same")
    compare.add_argument("before", type=Path)
    compare.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "schedules":
        print(f"{len(write_schedules(args.directory, args.examples))} schedules in {args.directory}")
        return 0
    if args.command == "write":
        write_snapshot(args.out, args.schedules)
        return 0
    lines = diff(json.loads(args.before.read_text()), json.loads(args.after.read_text()))
    print("\n".join(lines) if lines else "identical")
    return 1 if lines else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())

"""Goldens: trace directories recorded on one machine, compared on the same kind.

A trace directory holds ``golden.json`` (format, environment, machine key,
source, schedules) and, per schedule and request, a trace in the format of
``oracle/trace.py`` (``trace.safetensors`` + ``manifest.json`` with the sha256
of every tensor). ``source`` is ``oracle`` for solo mlx-lm runs or
``engine:<impl>`` for a batched run; an engine in another language that
writes the same files can be compared against a golden.

Traces from different machines are never compared: the machine key (backend,
device, mlx and mlx-lm versions, numeric knobs) must match, and the refusal
names the key that differs.
"""

import json
from pathlib import Path
from typing import Dict

from kvparity.oracle.solo import SoloTrace
from kvparity.oracle.trace import TraceError, load_trace, save_trace
from kvparity.oracle.atomic import AtomicDirectory
from kvparity.oracle.inputs import read_json
from kvparity.oracle.machine import environment, machine

FORMAT = "kvparity.golden/1"


class GoldenError(Exception):
    """A trace directory that cannot be compared: the message says why."""


def write_golden(out, source: str, model, recorded: Dict[str, Dict[str, SoloTrace]], schedules) -> Path:
    """``recorded`` maps schedule name -> request -> trace. Written atomically."""
    out = Path(out)
    recorded_on = {**environment(), "model": model.name, "model_sha256": model.sha256}
    try:
        with AtomicDirectory(out.parent, out.name) as staging:
            for name, traces in recorded.items():
                for rid, trace in traces.items():
                    save_trace(trace, staging / name / rid)
            doc = {
                "format": FORMAT,
                "source": source,
                "environment": recorded_on,
                "machine": machine(),
                "schedules": {s.name: s.to_json() for s in schedules if s.name in recorded},
            }
            (staging / "golden.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    except FileExistsError:
        raise GoldenError(f"{out} exists: traces are never overwritten")
    return out


def read_golden(directory) -> dict:
    directory = Path(directory)
    if not (directory / "golden.json").exists():
        raise GoldenError(f"{directory}: not a trace directory (no golden.json)")
    doc = read_json(directory / "golden.json", GoldenError)
    found = doc.get("format") if isinstance(doc, dict) else None
    if found != FORMAT:
        raise GoldenError(f"{directory}: format {found!r}, expected {FORMAT!r}")
    return doc


def load_traces(directory, doc) -> Dict[str, Dict[str, SoloTrace]]:
    directory = Path(directory)
    out = {}
    for name, schedule in doc["schedules"].items():
        out[name] = {}
        for rid in schedule["requests"]:
            try:
                out[name][rid] = load_trace(directory / name / rid)
            except TraceError as error:
                raise GoldenError(str(error))
    return out


def check_same_machine(golden: dict, candidate: dict):
    """Refuse traces from another machine, naming the key that differs."""
    for key in sorted(set(golden["machine"]) | set(candidate["machine"])):
        if golden["machine"].get(key) != candidate["machine"].get(key):
            raise GoldenError(
                f"golden recorded with {key}={golden['machine'].get(key)!r}, "
                f"candidate has {key}={candidate['machine'].get(key)!r}: refusing to compare"
            )

"""Solo traces on disk: safetensors plus a JSON manifest, keyed by content.

``trace.safetensors`` holds every tensor (logits as produced, cache bytes per
layer at event boundaries); ``manifest.json`` holds the calls, the offsets,
the sha256 of every tensor and what produced it. A trace whose tensors do not
match their hashes is refused, never compared.

Solo runs are cached under ``<cache dir>/oracle/<key>/`` where the key hashes
the model, the request, the calls it sees, the kv settings, the mlx and
mlx-lm versions and the device: a second run of a suite reuses them, once
the entry proves whole (``oracle/sealed.py``: its seal, its key, every byte).
Several processes may share the cache (``pytest -n``, two CI jobs): an entry
appears complete or not at all, and leaves the same way.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import mlx.core as mx

from kvparity.oracle.gguf import cache_dir
from kvparity.oracle.inputs import read_json
from kvparity.oracle.arrays import digest
from kvparity.oracle.solo import SoloCall, SoloTrace
from kvparity.oracle.sealed import cached
from kvparity.oracle.machine import machine

FORMAT = "kvparity.trace/2"  # 2: entries sealed


class TraceError(Exception):
    """A trace that cannot be trusted: missing, truncated or tampered with."""


def request_key(schedule, rid: str, model) -> str:
    """Everything a solo run depends on, hashed."""
    request = schedule.requests[rid]
    spec = {
        "format": FORMAT,
        "model": model.sha256,
        "request": {k: getattr(request, k) for k in request.__dataclass_fields__},
        "bits": schedule.bits,
        "group_size": schedule.group_size,
        "calls": [[c.event, c.op, c.n] for c in schedule.calls[rid]],
        "machine": machine(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


def _tensors(trace: SoloTrace):
    tensors, calls, snapshots = {}, [], {}
    for j, call in enumerate(trace.calls):
        entry = {"event": call.event, "op": call.op, "inputs": call.inputs, "logits": None}
        if call.logits is not None:
            entry["logits"] = name = f"call{j}.logits"
            tensors[name] = call.logits
        calls.append(entry)
    for event, layers in trace.snapshots.items():
        names = []
        for layer, arrays in enumerate(layers):
            names.append({})
            for part, x in arrays.items():
                name = f"event{event}.layer{layer}.{part}"
                tensors[name] = mx.contiguous(x)
                names[-1][part] = name
        snapshots[str(event)] = {"offset": trace.offsets[event], "layers": names}
    return tensors, calls, snapshots


def save_trace(trace: SoloTrace, directory, metadata: Optional[dict] = None) -> Path:
    """Write the trace's two files into ``directory`` (made if missing; the
    caller makes it appear atomically)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, calls, snapshots = _tensors(trace)
    mx.save_safetensors(str(directory / "trace.safetensors"), tensors)
    manifest = {
        "format": FORMAT,
        "request": trace.request,
        "calls": calls,
        "snapshots": snapshots,
        "sha256": {name: digest([x]) for name, x in tensors.items()},
        **(metadata or {}),
    }
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str))
    return directory


def load_trace(directory) -> SoloTrace:
    directory = Path(directory)
    manifest = read_json(directory / "manifest.json", TraceError)
    try:
        tensors = mx.load(str(directory / "trace.safetensors"))
    except (OSError, ValueError, RuntimeError) as error:
        raise TraceError(f"{directory}: unreadable trace: {error}") from None
    try:
        return _trace_of(manifest, tensors, directory)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
        raise TraceError(f"{directory}: malformed manifest: {type(error).__name__}: {error}") from None


def _trace_of(manifest: dict, tensors: dict, directory: Path) -> SoloTrace:
    if manifest.get("format") != FORMAT:
        raise TraceError(f"{directory}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    missing = sorted(set(manifest["sha256"]) - set(tensors))
    if missing:  # tensors the manifest does not name are no part of the trace
        raise TraceError(f"{directory}: tensor {missing[0]} is missing (truncated trace)")
    for name, expected in manifest["sha256"].items():
        if digest([tensors[name]]) != expected:
            raise TraceError(f"{directory}: tensor {name} does not match its sha256 (tampered trace)")
    trace = SoloTrace(manifest["request"])
    for entry in manifest["calls"]:
        logits = tensors[entry["logits"]] if entry["logits"] else None
        trace.calls.append(SoloCall(entry["event"], entry["op"], entry["inputs"], logits))
    for event, snap in manifest["snapshots"].items():
        trace.snapshots[int(event)] = [
            {part: tensors[name] for part, name in layer.items()} for layer in snap["layers"]
        ]
        trace.offsets[int(event)] = snap["offset"]
    return trace


def oracle_cache() -> Path:
    return Path(os.environ.get("KVPARITY_ORACLE_CACHE", cache_dir() / "oracle"))


def cached_solo(run, schedule, rid: str, model) -> SoloTrace:
    """``run()`` computes the trace; a stored one with the same key is used
    only once its entry proves whole (``oracle/sealed.py``)."""
    store = lambda trace, staging: save_trace(trace, staging, {"model": model.name, "model_sha256": model.sha256})
    return cached(oracle_cache(), request_key(schedule, rid, model), load_trace, run, store)

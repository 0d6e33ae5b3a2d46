"""Solo traces on disk: safetensors plus a JSON manifest, keyed by content.

``trace.safetensors`` holds every tensor (logits as produced, cache bytes per
layer at event boundaries); ``manifest.json`` holds the calls, the offsets,
the sha256 of every tensor and what produced it. A trace whose tensors do not
match their hashes is refused, never compared.

Solo runs are cached under ``<cache dir>/oracle/<key>/`` where the key hashes
the model, the request, the calls it sees, the kv settings, the mlx and
mlx-lm versions and the device: a second run of a suite reuses them.
Several processes may share the cache (``pytest -n``, two CI jobs): an entry
appears complete or not at all, and leaves the same way (``drop_entry``).
"""

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import mlx.core as mx

from kvparity.oracle.gguf import cache_dir
from kvparity.oracle.arrays import digest
from kvparity.oracle.solo import SoloCall, SoloTrace
from kvparity.oracle.atomic import STAGING, AtomicDirectory
from kvparity.oracle.machine import machine

FORMAT = "kvparity.trace/1"


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
    """Write atomically: the directory appears complete or not at all. If it
    already exists (another run wrote the same trace), theirs is kept."""
    directory = Path(directory)
    tensors, calls, snapshots = _tensors(trace)
    try:
        with AtomicDirectory(directory.parent, directory.name) as staging:
            mx.save_safetensors(str(staging / "trace.safetensors"), tensors)
            manifest = {
                "format": FORMAT,
                "request": trace.request,
                "calls": calls,
                "snapshots": snapshots,
                "sha256": {name: digest([x]) for name, x in tensors.items()},
                **(metadata or {}),
            }
            (staging / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str))
    except FileExistsError:
        pass
    return directory


def load_trace(directory) -> SoloTrace:
    directory = Path(directory)
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
        tensors = mx.load(str(directory / "trace.safetensors"))
    except (OSError, ValueError, RuntimeError) as error:
        raise TraceError(f"{directory}: unreadable trace: {error}") from None
    if manifest.get("format") != FORMAT:
        raise TraceError(f"{directory}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    for name, expected in manifest["sha256"].items():
        if name not in tensors:
            raise TraceError(f"{directory}: tensor {name} is missing (truncated trace)")
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


def drop_entry(directory):
    """Remove a cache entry at once: it is renamed to a staging name of this
    process, where no reader looks (and which the next writer removes should
    this process die), then deleted. Deleting it in place would let another
    process read it half gone, or leave a half-deleted entry that is never
    stored again if this process were killed. Another process dropping the
    same entry first is no error."""
    directory = Path(directory)
    if not directory.parent.is_dir():
        return
    doomed = Path(tempfile.mkdtemp(prefix=f"{STAGING}{os.getpid()}-", dir=directory.parent))
    try:
        os.replace(directory, doomed)  # onto the empty staging directory: one rename
    except FileNotFoundError:
        pass
    shutil.rmtree(doomed, ignore_errors=True)


def cached_solo(run, schedule, rid: str, model) -> SoloTrace:
    """``run()`` computes the trace; reuse a stored one with the same key."""
    directory = oracle_cache() / request_key(schedule, rid, model)
    if (directory / "manifest.json").exists():
        try:
            return load_trace(directory)
        except TraceError:
            drop_entry(directory)  # recompute a damaged entry
    trace = run()
    save_trace(trace, directory, {"model": model.name, "model_sha256": model.sha256})
    return trace

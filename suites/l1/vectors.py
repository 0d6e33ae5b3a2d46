"""Conformance vectors: the L1 catalog as data any test runner reads, the
way test262 gives every JavaScript engine the same cases (docs/vectors.md).

``export`` runs each L1 schedule through the one replay (``suites/l1/run.py``)
on the reference cache and records, per protocol call, what the replay
handed the cache (the dense keys and values of every ``update_and_fetch``
included) and what must hold after it. What must hold is the oracle's, never
the reference's: each row's length and bytes are mlx-lm's
``QuantizedKVCache`` holding that request alone (``suites/l1/solo.py``), and
the layout and masks follow from those lengths as the L1 checks say. The
run must pass, else nothing is written.

A row's bytes are given as spans over tapes: per layer and token stream,
mlx-lm's quantized bytes of each token, which every row holding that token
holds (quantization groups run along head_dim, so a token's bytes never
depend on its neighbours). Every row state the vectors name was compared
with the tapes as the export ran, so the spans say exactly what mlx-lm held.

``check`` holds a directory against the current oracle: each file against
its sha256 in the manifest (edited), then against a fresh export (stale),
naming the file and the first thing that differs.
"""

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from kvparity.oracle import tensor_file
from kvparity.oracle.atomic import AtomicDirectory
from kvparity.oracle.gguf import sha256_file
from kvparity.oracle.machine import machine, package_version
from kvparity.suites.format.levels import L1
from kvparity.suites.format.schedule import CATALOG, catalog_paths
from kvparity.suites.format.errors import ScheduleError
from kvparity.suites.core.loading import load

from kvparity.suites.l1.recorder import (
    FORMAT, FORMAT_VERSION, MANIFEST, WHOLE, SELECTED, VectorsError, record_schedule,
)


class VectorsDiffer(Exception):
    """A directory that is not what the current oracle gives: the file and what differs."""


# -- a directory of vectors -----------------------------------------------------------------


def l1_schedules(files: Optional[List[str]] = None) -> list:
    """The L1 schedules of the catalog, or those of its files named in
    ``files``, in file order. A file of one's own is refused (ScheduleError):
    ``check`` makes the vectors again from the catalog by name."""
    catalog = catalog_paths(folder=CATALOG)
    if not files:
        return [s for s in (load(p) for p in catalog) if L1 in s.levels]
    chosen = []
    for file in files:
        path = Path(file)
        if not any(path.is_file() and path.samefile(p) for p in catalog):
            raise ScheduleError(f"--schedule {file}: not a schedule file of the catalog ({CATALOG}); the vectors "
                                "are the catalog's, which kvparity vectors check makes again by name")
        schedule = load(path)
        if L1 not in schedule.levels:
            raise ScheduleError(f"--schedule {file}: {schedule.name} is no L1 schedule (levels "
                                f"{', '.join(schedule.levels)})")
        chosen.append(schedule)
    return chosen


def versions() -> dict:
    found = machine()
    return {"kvparity": package_version("kvparity"), "mlx": found["mlx"], "mlx_lm": found["mlx_lm"],
            "backend": found["backend"]}


def dump_json(doc) -> bytes:
    return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()


def write_vectors(folder: Path, schedules, whole_catalog: bool, progress=None) -> dict:
    """Every schedule's cases and tensors into ``folder``, then the manifest;
    returns it. ``progress(name)`` is told of each schedule written."""
    files, listed = {}, []
    for schedule in schedules:
        recorded = record_schedule(schedule)
        cases_file, tensors_file = f"{recorded.name}.json", recorded.cases["tensors"]
        (folder / cases_file).write_bytes(dump_json(recorded.cases))
        tensor_file.write(folder / tensors_file, recorded.tensors, {"format": FORMAT, "schedule": recorded.name})
        for name in (cases_file, tensors_file):
            files[name] = sha256_file(folder / name)
        listed.append({"name": recorded.name, "source": recorded.cases["source"], "cases": cases_file,
                       "tensors": tensors_file, "calls": len(recorded.cases["calls"]),
                       "events": len(recorded.cases["events"])})
        if progress:
            progress(recorded.name)
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "versions": versions(),
                "catalog": WHOLE if whole_catalog else SELECTED, "schedules": listed, "files": files}
    (folder / MANIFEST).write_bytes(dump_json(manifest))
    return manifest


def export(directory, files: Optional[List[str]] = None, progress=None) -> Tuple[Path, dict]:
    """A new directory of vectors (atomic: complete or absent; never over an existing one)."""
    directory = Path(directory)
    schedules = l1_schedules(files)
    writer = AtomicDirectory(directory.parent, directory.name)
    with writer as staging:
        manifest = write_vectors(staging, schedules, not files, progress)
    return writer.path, manifest


def read_manifest(directory) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise VectorsError(f"{path}: no manifest (is {directory} a directory kvparity vectors export wrote?)")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise VectorsError(f"{path}: not JSON ({error})")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise VectorsError(f"{path}: format is not {FORMAT!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise VectorsError(f"{path}: format_version {manifest.get('format_version')!r}, this kvparity reads "
                           f"{FORMAT_VERSION}")
    for key in ("schedules", "files", "catalog"):
        if key not in manifest:
            raise VectorsError(f"{path}: missing field {key!r}")
    return manifest


@dataclass
class Checked:
    files: int  # files compared byte for byte with a fresh export
    tensors: int  # tensors among them
    schedules: int


def check(directory, progress=None) -> Checked:
    """``directory`` against the current oracle; raises VectorsDiffer naming
    the file and what differs, VectorsError where it cannot be read."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for name, digest in sorted(manifest["files"].items()):
        path = directory / name
        if not path.is_file():
            raise VectorsDiffer(f"{path}: listed in the manifest, missing")
        actual = sha256_file(path)
        if actual != digest:
            raise VectorsDiffer(f"{path}: sha256 {actual} is not the manifest's {digest} (edited after export)")
    if manifest["catalog"] == WHOLE:
        schedules = l1_schedules()
    else:
        known = {s.name: s for s in l1_schedules()}
        missing = [s["name"] for s in manifest["schedules"] if s["name"] not in known]
        if missing:
            raise VectorsDiffer(f"{directory / MANIFEST}: schedule {missing[0]!r} is no L1 schedule of the catalog now")
        schedules = [known[s["name"]] for s in manifest["schedules"]]
    with tempfile.TemporaryDirectory(prefix="kvparity-vectors-") as scratch:
        fresh = write_vectors(Path(scratch), schedules, manifest["catalog"] == WHOLE, progress)
        tensors = compare_directories(directory, Path(scratch), manifest, fresh)
    return Checked(len(fresh["files"]) + 1, tensors, len(schedules))


def compare_directories(given: Path, fresh_dir: Path, manifest: dict, fresh: dict) -> int:
    """Each file of the fresh export against the given one; the tensors compared."""
    ours, theirs = set(fresh["files"]), set(manifest["files"])
    for name in sorted(ours - theirs):
        raise VectorsDiffer(f"{given / name}: missing (the current oracle's export has it)")
    for name in sorted(theirs - ours):
        raise VectorsDiffer(f"{given / name}: the current oracle's export has no such file")
    tensors = 0
    for name in sorted(ours):
        a, b = given / name, fresh_dir / name
        if a.read_bytes() == b.read_bytes():
            tensors += len(tensor_file.read(a)[0]) if name.endswith(".safetensors") else 0
            continue
        if name.endswith(".safetensors"):
            raise VectorsDiffer(f"{a}: {tensor_difference(a, b)}")
        raise VectorsDiffer(f"{a}: {json_difference(json.loads(a.read_text()), json.loads(b.read_text()))}")
    a, b = (json.loads((d / MANIFEST).read_text()) for d in (given, fresh_dir))
    if a != b:
        raise VectorsDiffer(f"{given / MANIFEST}: {json_difference(a, b)}")
    return tensors


def json_difference(given, fresh, path: str = "") -> str:
    """The first place two JSON documents differ, in words."""
    if type(given) is not type(fresh):
        return f"at {path or '/'}: {json.dumps(given)[:80]}, the current oracle gives {json.dumps(fresh)[:80]}"
    if isinstance(given, dict):
        for key in sorted(set(given) | set(fresh)):
            if key not in given or key not in fresh:
                return f"at {path}/{key}: {'missing' if key not in given else 'not in the current export'}"
            if given[key] != fresh[key]:
                return json_difference(given[key], fresh[key], f"{path}/{key}")
    if isinstance(given, list):
        if len(given) != len(fresh):
            return f"at {path}: {len(given)} items, the current oracle gives {len(fresh)}"
        for i, (x, y) in enumerate(zip(given, fresh)):
            if x != y:
                return json_difference(x, y, f"{path}/{i}")
    return f"at {path or '/'}: {json.dumps(given)[:80]}, the current oracle gives {json.dumps(fresh)[:80]}"


def tensor_difference(given: Path, fresh: Path) -> str:
    try:
        (a, _), (b, _) = tensor_file.read(given), tensor_file.read(fresh)
    except tensor_file.TensorFileError as error:
        return str(error)
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            return f"tensor {name!r} {'missing' if name not in a else 'not in the current export'}"
        (ca, xa), (cb, xb) = a[name], b[name]
        if (ca, xa.shape) != (cb, xb.shape):
            return f"tensor {name!r} is {ca} {list(xa.shape)}, the current oracle gives {cb} {list(xb.shape)}"
        if xa.tobytes() != xb.tobytes():
            flat = int(np.flatnonzero(xa.reshape(-1).view(np.uint8 if xa.dtype == np.bool_ else xa.dtype)
                                      != xb.reshape(-1).view(np.uint8 if xb.dtype == np.bool_ else xb.dtype))[0])
            return (f"tensor {name!r} differs at flat index {flat}: {xa.reshape(-1)[flat]!r}, the current oracle "
                    f"gives {xb.reshape(-1)[flat]!r}")
    return "the header or padding differs (the tensors are equal)"

"""``kvparity vectors``: the L1 catalog as conformance vectors any test
runner reads (``export``), and a directory of them held against the current
oracle (``check``). The format is docs/vectors.md's and
reports/schema/vectors.schema.json's; the vectors are ``suites/l1/vectors.py``'s."""

import time
from pathlib import Path

from kvparity.reports.commands.base import UsageError, writable_directory
from kvparity.reports.commands.runs import Progress
from kvparity.reports.verdicts import EXIT_BROKEN, EXIT_OK
from kvparity.suites.l1 import vectors

NAME = "vectors"
HELP = "export the L1 catalog as conformance vectors (safetensors + JSON) any test runner reads, or check a set"
DESCRIPTION = ("export DIR: run every L1 schedule of the catalog (or --schedule FILE ...) on the reference cache "
               "and write, per schedule, the protocol calls in order with their arguments (the dense keys and "
               "values of every update_and_fetch included) and after every call the state the oracle, mlx-lm's "
               "QuantizedKVCache holding each request alone, says the batch must hold: safetensors files and "
               "JSON, with a manifest (format version, kvparity, MLX and mlx-lm versions, sha256 per file). DIR "
               "must not exist; it appears complete or not at all, and two exports are identical byte for byte. "
               "check DIR: exit 0 when DIR is exactly what the current oracle exports, 1 naming the first file "
               "and what differs (edited after export: its sha256; stale: against a fresh export), 129 when DIR "
               "is no set of vectors. See docs/vectors.md.")
SETTINGS = REQUIRED = ()


def arguments(command):
    actions = command.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    export = actions.add_parser("export", help="write the vectors into a new directory DIR")
    export.add_argument("directory", metavar="DIR")
    export.add_argument("--schedule", metavar="FILE", action="append",
                        help="these L1 schedule files of the catalog only (default: the whole L1 catalog)")
    check = actions.add_parser("check", help="hold DIR against the current oracle")
    check.add_argument("directory", metavar="DIR")


def handle(args, settings):
    return export(args.directory, args.schedule) if args.action == "export" else check(args.directory)


def export(directory, schedules) -> int:
    """The L1 catalog (or ``schedules`` of it) as vectors in the new ``directory``."""
    path = Path(directory)
    if path.exists():
        raise UsageError(f"{path}: exists; kvparity vectors export writes a new directory, never over one")
    writable_directory(path.parent if str(path.parent) else Path("."), "DIR", shown=path)
    start = time.perf_counter()
    progress = Progress(len(vectors.l1_schedules(schedules)))
    try:
        written, manifest = vectors.export(path, schedules, progress.advance)
    except vectors.VectorsError as error:
        print(f"kvparity vectors: {error}")
        return EXIT_BROKEN
    finally:
        progress.close()
    size = sum(p.stat().st_size for p in written.iterdir())
    calls = sum(s["calls"] for s in manifest["schedules"])
    print(f"{written}: {len(manifest['schedules'])} schedules, {calls} protocol calls, "
          f"{len(manifest['files']) + 1} files, {size / 2**20:.1f} MiB in {time.perf_counter() - start:.1f} s")
    return EXIT_OK


def check(directory) -> int:
    """The vectors in ``directory`` held against the current oracle's export."""
    start = time.perf_counter()
    try:
        progress = Progress(len(vectors.read_manifest(directory)["schedules"]))
    except vectors.VectorsError as error:
        raise UsageError(str(error))
    try:
        checked = vectors.check(directory, progress.advance)
    except vectors.VectorsError as error:
        raise UsageError(str(error))
    except vectors.VectorsDiffer as error:
        print(f"kvparity vectors: FAIL {error}")
        return EXIT_BROKEN
    finally:
        progress.close()
    print(f"{directory}: identical to the current oracle's export ({checked.schedules} schedules, "
          f"{checked.files} files, {checked.tensors} tensors compared byte for byte, "
          f"{time.perf_counter() - start:.1f} s)")
    return EXIT_OK

"""Entries of the solo-run cache, proven whole before they are used.

The cache travels between CI jobs and machines (``actions/cache``), so an
entry written by another job, another kvparity or a bad disk is the normal
case. An entry is a folder named by its key; beside its files lies a seal
(``seal.json``) naming the store's format, the key the entry was written
under and the size and sha256 of every other file. An entry is used only
when the seal's bytes are exactly the canonical encoding of what it says,
its key is the key asked for and the folder's name, the folder holds exactly
the files it names, and every file's bytes hash as sealed. Whatever does not
verify, does not parse or raises while it loads is dropped and recomputed
(``Ledger`` counts it for the report): a fresh run of mlx-lm is the only
source of an oracle outcome, never a stored entry.
"""

import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Tuple, TypeVar

from kvparity.oracle.atomic import STAGING, AtomicDirectory

SEAL = "seal.json"
SEAL_FORMAT = "kvparity.sealed/1"
T = TypeVar("T")

# How an entry was had: read back after it verified, computed afresh
# (nothing stored yet), or dropped because it did not verify and then computed.
REUSED, COMPUTED, DROPPED = "reused", "computed", "dropped"
SOLO_CACHE_COUNTS = (REUSED, COMPUTED, DROPPED)


class Unproven(Exception):
    """A stored entry that does not prove what it holds."""


def _canonical(seal: dict) -> bytes:
    return json.dumps(seal, sort_keys=True, separators=(",", ":")).encode()


def _file_digest(path: Path) -> Tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def seal(staging: Path, key: str):
    """Seal the files written into ``staging`` under ``key``."""
    files = {}
    for path in sorted(staging.iterdir()):
        if path.name != SEAL:
            size, sha = _file_digest(path)
            files[path.name] = {"bytes": size, "sha256": sha}
    (staging / SEAL).write_bytes(_canonical({"format": SEAL_FORMAT, "key": key, "files": files}))


def _reject_constant(name):
    raise ValueError(f"non-finite number {name}")


def verify(directory: Path, key: str):
    """Raise ``Unproven`` unless the entry at ``directory`` is whole and was
    written under ``key``."""
    if directory.name != key:
        raise Unproven(f"folder {directory.name} is not the key {key}")
    try:
        raw = (directory / SEAL).read_bytes()
        stated = json.loads(raw, parse_constant=_reject_constant)
    except (OSError, ValueError, RecursionError) as error:
        raise Unproven(f"unreadable seal: {error}") from None
    if not isinstance(stated, dict) or _canonical(stated) != raw:
        raise Unproven("the seal is not in its canonical form (altered bytes)")
    if stated.get("format") != SEAL_FORMAT:
        raise Unproven(f"sealed as {stated.get('format')!r}, expected {SEAL_FORMAT!r}")
    if stated.get("key") != key:
        raise Unproven(f"sealed under key {stated.get('key')!r}, asked for {key}")
    files = stated.get("files")
    if not isinstance(files, dict):
        raise Unproven("the seal names no files")
    present = {p.name for p in directory.iterdir()} - {SEAL}
    if present != set(files):
        raise Unproven(f"holds {sorted(present)}, sealed {sorted(files)}")
    for name, expected in files.items():
        try:
            size, sha = _file_digest(directory / name)
        except OSError as error:
            raise Unproven(f"{name}: {error}") from None
        if not isinstance(expected, dict) or (size, sha) != (expected.get("bytes"), expected.get("sha256")):
            raise Unproven(f"{name} does not match its seal ({size} bytes)")


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
    except OSError:  # not a folder: a stray file under the entry's name
        try:
            os.remove(directory)
        except OSError:
            pass
    shutil.rmtree(doomed, ignore_errors=True)


@dataclass
class Ledger:
    """How this process had its cache entries, and why it dropped any."""

    counts: Counter = field(default_factory=Counter)
    dropped: List[str] = field(default_factory=list)  # "<key>: <reason>", in order
    unstored: List[str] = field(default_factory=list)  # entries computed but not written, and why

    def since(self, mark: Tuple[Counter, int]) -> dict:
        """The counts since ``mark`` (``self.mark()``), as the report records them."""
        counts, seen = mark
        now = self.counts - counts
        return {**{how: now[how] for how in SOLO_CACHE_COUNTS}, "reasons": self.dropped[seen:]}

    def mark(self) -> Tuple[Counter, int]:
        return Counter(self.counts), len(self.dropped)


LEDGER = Ledger()


def cached(root: Path, key: str, load: Callable[[Path], T], compute: Callable[[], T],
           store: Callable[[T, Path], None]) -> T:
    """The value stored under ``key`` in ``root`` if its entry verifies and
    ``load`` reads it; else ``compute()``, stored through ``store(value,
    staging)`` and sealed. An entry that fails either way is dropped and
    counted, never used; what ``compute`` raises is the caller's."""
    directory = Path(root) / key
    if os.path.lexists(directory):
        try:
            verify(directory, key)
            value = load(directory)
        except Exception as error:  # whatever a damaged entry makes the loader raise
            LEDGER.counts[DROPPED] += 1
            LEDGER.dropped.append(f"{key[:16]}: {type(error).__name__}: {error}"[:300])
            drop_entry(directory)
        else:
            LEDGER.counts[REUSED] += 1
            return value
    value = compute()
    LEDGER.counts[COMPUTED] += 1
    try:
        with AtomicDirectory(directory.parent, directory.name) as staging:
            store(value, staging)
            seal(staging, key)
    except FileExistsError:
        pass  # another run stored the same entry
    except (OSError, RuntimeError) as error:  # a full or read-only disk (MLX's writes raise RuntimeError): the
        LEDGER.unstored.append(f"{key[:16]}: {error}"[:300])  # value stands, unstored
    return value

"""Mutation testing of a cache against the gate: how much of the cache the
gate constrains (``kvparity mutate``).

cosmic-ray, an established mutation tool, finds every mutation of a source
file (its operators: a comparison, a constant plus or minus one, ``+`` for
``-``, ``not`` added, a decorator removed, ...) and writes each mutant. The
gate judges each mutant as a fresh process, ``kvparity check`` with the
settings the user's gate runs with: L1 first, whose catalog is the cheapest
(a mutant it kills needs no more), then the gate's other levels. The mutant
lives in a copy of its file in a temporary folder, and the gate imports it in
place of the original (``suites.adapter.MUTANT_ENV``): nothing in the user's
tree is written.

A mutant ends as one of ``OUTCOMES``:

* killed: a stage exits 1 (a divergence, a refusal, a crash or a hang in a
  member), the mutated module raises as the gate imports it (stage
  "import": no caller can load it), or the mutant's gate outruns its
  timeout (killed by timeout);
* survived: every stage exits 0. Its line is one the gate does not
  constrain: an equivalent mutant (no caller through mlx-lm or the protocol
  can observe it), dead code, or a gap in the gate;
* not judged: a stage exits 125 for another reason, 128 or 129; never
  counted as killed;
* not a program: cosmic-ray's mutation does not compile (it mutated the
  ``*`` of a signature); no gate runs, and it counts for nothing.

The equivalents file (TOML) lists the survivors that are equivalent, each
with its reason; an entry names its file (from the equivalents file's
folder), line, operator and the mutated line, as the campaign prints them.
A region entry names a file's ``lines = [first, last]`` instead: every
mutant of those lines may survive, for one reason (a block no caller's
call reaches, say); it vouches for none of them, so a killed one is no error.
"""

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from kvparity.oracle.inputs import read_toml
from kvparity.reports.verdicts import EXIT_BROKEN, EXIT_CANNOT_JUDGE, EXIT_INTERRUPTED, EXIT_OK
from kvparity.suites.core.adapter import MUTANT_ENV
from kvparity.suites.core.flight import STATE_ENV
from kvparity.suites.format.levels import L1
from kvparity.suites.core.processes import STOP_GRACE_S, descendants, die_with_parent, kill_all

KILLED, TIMEOUT, SURVIVED, NOT_JUDGED = "killed", "killed by timeout", "survived", "not judged"
# cosmic-ray also mutates what is no operator: the ``*`` that ends a signature's positional
# parameters becomes ``//`` or ``<<``. Such a mutant does not compile: it is no program, never judged.
NOT_A_PROGRAM = "not a program"
OUTCOMES = (KILLED, TIMEOUT, SURVIVED, NOT_JUDGED, NOT_A_PROGRAM)
# The stage of a mutant that makes the --impl module raise as it is imported (a decorator removed
# from a property whose setter follows, say): the gate cannot load the class (125), nor can anyone.
IMPORT_STAGE = "import"
IMPORT_RAISED = re.compile(r"cannot judge here: --impl '[^']*': importing \S+ raised ")
ENTRY_KEYS = ("file", "line", "operator", "mutant", "reason")
REGION_KEYS = ("file", "lines", "reason")


class MutantsError(Exception):
    """Bad input for a campaign (the equivalents file, a file to mutate): a usage error."""


@dataclass(frozen=True)
class Mutant:
    """One mutation of one file, as cosmic-ray makes it. Its mutated source
    is made when first asked for: cosmic-ray parses and walks the whole file
    for each mutant (0.4 to 0.6 s each for impl/'s caches on a busy 2-core
    machine), which for every mutant of a file up front would cost minutes."""

    path: Path  # the original file
    module: str  # the module the gate imports it as
    line: int
    column: int
    operator: str  # cosmic-ray's operator name
    occurrence: int  # cosmic-ray's index of this operator's mutations in the file
    operator_args: tuple = ()  # cosmic-ray's arguments of the operator, as (name, value) pairs

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"

    @functools.cached_property
    def source(self) -> str:
        """The whole mutated file."""
        from cosmic_ray.mutating import mutate_code
        from cosmic_ray.plugins import get_operator

        operator = get_operator(self.operator)(**dict(self.operator_args))
        return mutate_code(self.path.read_text(), operator, self.occurrence) or ""

    @property
    def was(self) -> str:
        """The line before the mutation, stripped."""
        return line_of(self.path.read_text(), self.line)

    @functools.cached_property
    def now(self) -> str:
        """The line after it, stripped."""
        return line_of(self.source, self.line)

    def key(self) -> tuple:
        """What an equivalents entry names: file, line, operator, the mutated line."""
        return (self.path.resolve(), self.line, self.operator, self.now)

    def sample_rank(self) -> str:
        """A stable place in the fixed sample: the same mutants for the same code."""
        text = f"{self.path.name}\n{self.line}\n{self.column}\n{self.operator}\n{self.occurrence}"
        return hashlib.sha256(text.encode()).hexdigest()


def line_of(code: str, number: int) -> str:
    lines = code.splitlines()
    return lines[number - 1].strip() if number <= len(lines) else ""


def mutants_of(path: Path, module: str) -> List[Mutant]:
    """Every mutant cosmic-ray makes of ``path`` (imported as ``module``),
    in line order. cosmic-ray keeps its work items in a session database,
    made here in a temporary folder."""
    from cosmic_ray.commands.init import init
    from cosmic_ray.work_db import use_db

    with tempfile.TemporaryDirectory(prefix="kvparity-mutants-") as folder:
        with use_db(str(Path(folder) / "session.sqlite")) as db:
            init([path], db, {})
            specs = [item.mutations[0] for item in db.work_items]
    return [Mutant(path, module, s.start_pos[0], s.start_pos[1], s.operator_name, s.occurrence,
                   tuple(sorted(s.operator_args.items())))
            for s in sorted(specs, key=lambda s: (s.start_pos, s.operator_name, s.occurrence))]


def compiles(mutant: Mutant) -> bool:
    try:
        compile(mutant.source, str(mutant.path), "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def sample(mutants: Sequence[Mutant], size: Optional[int]) -> List[Mutant]:
    """A derandomized share of ``size`` mutants (all without a size), in line order."""
    if size is None or size >= len(mutants):
        return list(mutants)
    chosen = set(sorted(range(len(mutants)), key=lambda i: mutants[i].sample_rank())[:size])
    return [m for i, m in enumerate(mutants) if i in chosen]


# -- the equivalents file --------------------------------------------------------------


@dataclass(frozen=True)
class Equivalent:
    """A mutant listed as equivalent: no caller can observe it, and why."""

    path: Path
    line: int
    operator: str  # "" for a region
    mutant: str  # "" for a region
    reason: str
    shown: str  # the entry, for messages: FILE entry N
    last: Optional[int] = None  # a region's last line (every mutant of lines line..last); None: one mutant

    def key(self) -> tuple:
        return (self.path.resolve(), self.line, self.operator, self.mutant, self.last)

    def covers(self, mutant: "Mutant") -> bool:
        if self.last is None:
            return (self.path.resolve(), self.line, self.operator, self.mutant) == mutant.key()
        return mutant.path.resolve() == self.path.resolve() and self.line <= mutant.line <= self.last


@dataclass(frozen=True)
class Listing:
    """The entries for the files being mutated."""

    entries: tuple = ()

    def entry_for(self, mutant: "Mutant") -> Optional[Equivalent]:
        """The one-mutant entry for ``mutant``, else a region that holds it, else None."""
        covering = [e for e in self.entries if e.covers(mutant)]
        return next((e for e in covering if e.last is None), covering[0] if covering else None)


def load_equivalents(path) -> List[Equivalent]:
    """The ``[[equivalent]]`` entries of a TOML file, each checked whole;
    a bad one is one line naming the entry and the field."""
    path = Path(path)
    doc = read_toml(path, MutantsError)
    unknown = sorted(set(doc) - {"equivalent"})
    if unknown:
        raise MutantsError(f"{path}: unknown key {', '.join(unknown)} (expected [[equivalent]] entries)")
    entries = doc.get("equivalent", [])
    if not isinstance(entries, list):
        raise MutantsError(f"{path}: equivalent: expected [[equivalent]] entries")
    found, seen = [], {}
    for n, entry in enumerate(entries, 1):
        shown = f"{path}: equivalent entry {n}"
        if not isinstance(entry, dict):
            raise MutantsError(f"{shown}: expected a table")
        region = "lines" in entry
        keys = REGION_KEYS if region else ENTRY_KEYS
        missing = [k for k in keys if k not in entry]
        extra = sorted(set(entry) - set(keys))
        if missing or extra:
            raise MutantsError(f"{shown}: " + "; ".join(
                ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(extra)}"] if extra else [])))
        name = "lines" if region else "line"
        numbers = entry[name] if region else [entry[name]]
        if not (isinstance(numbers, list) and len(numbers) == (2 if region else 1) and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in numbers) and numbers == sorted(numbers)):
            expected = "[first, last], line numbers in order" if region else "a line number"
            raise MutantsError(f"{shown}: {name}: expected {expected}, got {entry[name]!r}")
        for key in keys:
            if key != name and (not isinstance(entry[key], str) or not entry[key].strip()):
                raise MutantsError(f"{shown}: {key}: expected a non-empty string")
        equivalent = Equivalent(path.parent / entry["file"], numbers[0], "" if region else entry["operator"].strip(),
                                "" if region else entry["mutant"].strip(), entry["reason"].strip(), shown,
                                numbers[1] if region else None)
        if equivalent.key() in seen:
            raise MutantsError(f"{shown}: the same {'lines' if region else 'mutant'} as entry {seen[equivalent.key()]}")
        seen[equivalent.key()] = n
        found.append(equivalent)
    return found


def match_equivalents(equivalents: Sequence[Equivalent], mutants: Sequence[Mutant]) -> Listing:
    """The entries of the files being mutated. One that names no mutant of
    its file (the line moved, the code changed), or a region of lines that
    hold none, is bad input: it would vouch for nothing."""
    files = {m.path.resolve() for m in mutants}
    named = [e for e in equivalents if e.path.resolve() in files]
    ones = {(e.path.resolve(), e.line, e.operator) for e in named if e.last is None}
    # Only the mutants an entry could name are made (making one costs a read of the file).
    candidates = [m for m in mutants if (m.path.resolve(), m.line, m.operator) in ones
                  or any(e.last is not None and e.covers(m) for e in named)]
    stale = [e for e in named if not any(e.covers(m) for m in candidates)]
    if stale:
        e = stale[0]
        what = (f"{e.path.name}:{e.line} has no {e.operator} mutant {e.mutant!r}" if e.last is None
                else f"{e.path.name}:{e.line}-{e.last} hold no mutant")
        raise MutantsError(f"{e.shown}: {what} (the code changed? {len(stale)} stale "
                           f"entr{'y' if len(stale) == 1 else 'ies'})")
    return Listing(tuple(named))


def listed_in(listing: Listing, mutant: Mutant) -> bool:
    return listing.entry_for(mutant) is not None


def vouched_for(listing: Listing, mutant: Mutant) -> bool:
    """Listed by an entry for this one mutant (a region vouches for none)."""
    entry = listing.entry_for(mutant)
    return entry is not None and entry.last is None


def entry_of(mutant: Mutant, folder: Path) -> str:
    """The equivalents file's entry for a survivor, its reason still to write."""
    try:
        shown = mutant.path.resolve().relative_to(folder.resolve())
    except ValueError:
        shown = mutant.path.resolve()
    return (f"[[equivalent]]\nfile = {json.dumps(str(shown))}\nline = {mutant.line}\n"
            f"operator = {json.dumps(mutant.operator)}\nmutant = {json.dumps(mutant.now)}\n"
            f"reason = \"\"\"why no caller through mlx-lm or the protocol can observe it\"\"\"\n")


# -- judging mutants --------------------------------------------------------------------


@dataclass
class Judged:
    mutant: Mutant
    outcome: str
    stage: Optional[str] = None  # the levels of the stage that ended it
    status: Optional[int] = None  # that stage's exit status (None: timed out)
    seconds: float = 0.0
    tail: str = ""  # the gate's last lines, where it was not judged

    def to_json(self) -> dict:
        m = self.mutant
        return {"file": str(m.path), "line": m.line, "column": m.column, "operator": m.operator, "was": m.was,
                "mutant": m.now, "outcome": self.outcome, "stage": self.stage, "status": self.status,
                "seconds": round(self.seconds, 2)}


@dataclass
class Gate:
    """The gate a mutant must pass: ``kvparity check`` as a fresh process per
    stage (each a list of levels, L1 first), with the arguments given."""

    stages: List[str]
    arguments: List[str]  # --impl and the settings, as check takes them
    timeout: float  # for a whole mutant, every stage together
    cwd: Path
    running: Dict[int, subprocess.Popen] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopping: bool = False

    def command(self, stage: str) -> List[str]:
        return [sys.executable, "-m", "kvparity.reports.cli", "check", "--exit-first", "--level", stage,
                *self.arguments]

    def run(self, stage: str, environment: dict, log: Path, deadline: float) -> Optional[int]:
        """One stage's exit status; None where it outran ``deadline`` (it is
        killed with all it started)."""
        with open(log, "w") as out:
            with self.lock:
                if self.stopping:
                    raise KeyboardInterrupt
                child = subprocess.Popen(self.command(stage), cwd=self.cwd, env=environment, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=die_with_parent)
                self.running[child.pid] = child
            try:
                status = child.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                kill_all(descendants(child.pid))
                child.kill()
                child.wait()
                status = None
            finally:
                with self.lock:
                    self.running.pop(child.pid, None)
        if self.stopping:  # a gate the stop ended judged nothing
            raise KeyboardInterrupt
        return status

    def judge(self, mutant: Optional[Mutant], folder: Path) -> Judged:
        """``mutant`` (None: the unmutated cache) through the stages, in a
        folder of its own; the first stage that does not pass ends it."""
        # Each gate isolates its own runs (a state folder of its own), and imports this mutant only.
        environment = {k: v for k, v in os.environ.items() if k not in (MUTANT_ENV, STATE_ENV)}
        if mutant is not None and not mutant.source:
            return Judged(mutant, NOT_JUDGED, tail="cosmic-ray made no mutation here")
        if mutant is not None and not compiles(mutant):
            return Judged(mutant, NOT_A_PROGRAM)
        if mutant is not None:
            copy = folder / mutant.path.name
            copy.write_text(mutant.source)
            environment[MUTANT_ENV] = json.dumps({mutant.module: str(copy)})
        started = time.monotonic()
        deadline = started + self.timeout
        log = folder / "gate.log"
        for stage in self.stages:
            status = self.run(stage, environment, log, deadline)
            seconds = time.monotonic() - started
            if status is None:
                return Judged(mutant, TIMEOUT, stage, None, seconds)
            if status == EXIT_INTERRUPTED:
                raise KeyboardInterrupt
            if status == EXIT_BROKEN:
                return Judged(mutant, KILLED, stage, status, seconds)
            if status == EXIT_CANNOT_JUDGE and mutant is not None and IMPORT_RAISED.search(
                    log.read_text(errors="replace")):
                # The unmutated cache imports (it passed), so the mutant broke the import: every caller sees it.
                return Judged(mutant, KILLED, IMPORT_STAGE, status, seconds)
            if status != EXIT_OK:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-6:])
                return Judged(mutant, NOT_JUDGED, stage, status, seconds, tail)
        return Judged(mutant, SURVIVED, None, EXIT_OK, time.monotonic() - started)

    def stop(self):
        """SIGTERM every running gate (each reports and ends); kill what is left a grace later."""
        with self.lock:
            self.stopping = True
            children = list(self.running.values())
        for child in children:
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + STOP_GRACE_S + 2.0  # the gate's own grace for its child, then its own
        for child in children:
            try:
                child.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                kill_all(descendants(child.pid))
                child.kill()


def campaign(gate: Gate, mutants: Sequence[Mutant], workers: int,
             on_judged: Callable[[Judged], None] = lambda judged: None) -> List[Judged]:
    """Every mutant judged, ``workers`` at a time, in a temporary folder each
    (removed after). A stop signal stops the gates running and raises;
    ``on_judged`` has had every mutant judged before it."""
    root = Path(tempfile.mkdtemp(prefix="kvparity-mutate-"))
    lock = threading.Lock()

    def one(index: int) -> Judged:
        folder = root / f"mutant-{index}"
        folder.mkdir()
        try:
            judged = gate.judge(mutants[index], folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        with lock:
            on_judged(judged)
        return judged

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mutant")
    try:
        futures = [pool.submit(one, i) for i in range(len(mutants))]
        return [f.result() for f in futures]
    except KeyboardInterrupt:
        gate.stop()
        for f in futures:
            f.cancel()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(root, ignore_errors=True)


def outcome_counts(judged: Sequence[Judged]) -> Dict[str, int]:
    return {outcome: sum(j.outcome == outcome for j in judged) for outcome in OUTCOMES}


def report(judged: Sequence[Judged], listed: Listing, seconds: float, workers: int) -> dict:
    """The campaign as data (``--out``): every mutant, whether it is listed, and the counts."""
    return {"workers": workers, "seconds": round(seconds, 1), "counts": outcome_counts(judged),
            "mutants": [{**j.to_json(), "listed_equivalent": listed_in(listed, j.mutant)}
                        for j in judged]}


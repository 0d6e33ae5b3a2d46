"""Declared divergences: what an implementation differs in by design.

An expectations file (JSON, described by schema/expectations.schema.json)
names checks, each optionally narrowed to levels, schedules (names or
globs) and event kinds, with the reason it differs. A divergence that a
declaration matches is reported as "expected divergence" and does not gate;
every other divergence gates as before, and a row still needs evidence for
every check its level requires. A declaration whose check was compared in
its scope and never diverged is "unexpectedly passing": the file is out of
date, which fails the run under a policy with ``unexpected_passes: gate``
(strict).
"""

from dataclasses import dataclass
from fnmatch import fnmatchcase
from importlib.resources import files
from pathlib import Path
from typing import List, Optional, Tuple


from kvparity.reports.documents import load_checked
from kvparity.suites.format.checks import CHECKS
from kvparity.suites.format.events import EVENT_KINDS
from kvparity.suites.format.levels import LEVELS

SCHEMA_PATH = Path(files(__package__) / "schema" / "expectations.schema.json")  # package data
EXAMPLES = Path(files(__package__) / "examples" / "expectations")  # shipped expectations files
# What became of a declaration in a run.
MATCHED = "matched"
UNEXPECTEDLY_PASSING = "unexpectedly passing"  # its check was compared in its scope and never diverged
NOT_EXERCISED = "not exercised"  # nothing in its scope compared its check


class ExpectationsError(ValueError):
    """Exit 2: the message names the file, the declaration and the field."""


@dataclass(frozen=True)
class Declaration:
    check: str
    reason: str
    levels: Tuple[str, ...] = ()  # empty: every level
    schedules: Tuple[str, ...] = ()  # names or globs; empty: every schedule
    events: Tuple[str, ...] = ()  # event kinds; empty: every event

    def in_scope(self, result) -> bool:
        """Whether a schedule run is one this declaration speaks of."""
        return ((not self.levels or result.level in self.levels)
                and (not self.schedules or any(fnmatchcase(result.schedule, s) for s in self.schedules)))

    def covers(self, result, event_index: int) -> bool:
        """Whether it speaks of what was seen after event ``event_index`` of ``result``."""
        if not self.events:
            return True
        kinds = result.event_kinds
        return 0 <= event_index < len(kinds) and kinds[event_index] in self.events

    def matches(self, divergence, result) -> bool:
        return (divergence.check == self.check and self.in_scope(result)
                and self.covers(result, divergence.event_index))

    @property
    def scope(self) -> str:
        """Where it applies, in words."""
        parts = [f"{name} {', '.join(values)}" for name, values in
                 (("levels", self.levels), ("schedules", self.schedules), ("events", self.events)) if values]
        return "; ".join(parts) or "everywhere"


@dataclass(frozen=True)
class Expectations:
    path: str
    declarations: Tuple[Declaration, ...]
    implementation: str = ""

    def declared(self, divergence, result) -> Optional[int]:
        """The index of the first declaration matching ``divergence``, or None."""
        return next((i for i, d in enumerate(self.declarations) if d.matches(divergence, result)), None)

    def applied(self, verdicts) -> List[dict]:
        """Per declaration: the divergences it matched (``verdicts``, from
        ``verdicts.judge``), the comparisons of its check made in its scope,
        and what became of it."""
        out = []
        for i, declaration in enumerate(self.declarations):
            matched = compared = 0
            for verdict in verdicts:
                result = verdict.evidence
                if not declaration.in_scope(result):
                    continue
                for row in verdict.rows:
                    matched += sum(1 for n in row.declared.values() if n == i)
                    compared += sum(per_event.get(declaration.check, 0)
                                    for event, per_event in row.evidence.counts.items()
                                    if declaration.covers(result, event))
            status = MATCHED if matched else UNEXPECTEDLY_PASSING if compared else NOT_EXERCISED
            out.append({"check": declaration.check, "reason": declaration.reason,
                        "levels": list(declaration.levels), "schedules": list(declaration.schedules),
                        "events": list(declaration.events), "scope": declaration.scope,
                        "matched": matched, "compared": compared, "status": status})
        return out


def load_expectations(path) -> Expectations:
    """An expectations file, checked whole before anything runs: its shape
    against the schema, then every check, level and event kind by name."""
    path = Path(path)
    doc = load_checked(path, SCHEMA_PATH, ExpectationsError, shown=f"--expectations {path}")
    declarations = []
    for i, entry in enumerate(doc["divergences"]):
        where = f"{path}: divergences[{i}]"
        _known(where, "check", [entry["check"]], CHECKS)
        _known(where, "levels", entry.get("levels", ()), LEVELS)
        _known(where, "events", entry.get("events", ()), EVENT_KINDS)
        declarations.append(Declaration(entry["check"], entry["reason"], tuple(entry.get("levels", ())),
                                        tuple(entry.get("schedules", ())), tuple(entry.get("events", ()))))
    return Expectations(str(path), tuple(declarations), doc.get("implementation", ""))


def _known(where, field, values, known):
    for value in values:
        if value not in known:
            raise ExpectationsError(f"{where}.{field}: unknown {field.rstrip('s')} {value!r} "
                                    f"(known: {', '.join(known)})")



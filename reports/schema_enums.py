"""The schemas' enums, generated from the harness's declarations.

Each (schema file, JSON pointer) below holds the values of one declared
table: levels, outcomes, checks, policy choices, ... A word added to its
table reaches the schema with ``python -m kvparity.reports.schema_enums``
(which rewrites the files); ``reports/test_schema_enums.py`` fails while a
schema and its table differ.
"""

import json
import sys
from pathlib import Path

from kvparity.oracle.quantization import BITS, DTYPES, GROUP_SIZES
from kvparity.reports.expectations import MATCHED, NOT_EXERCISED, UNEXPECTEDLY_PASSING
from kvparity.reports.policy import CHOICES, GATES
from kvparity.reports.verdicts import STATUS
from kvparity.suites.format.checks import CHECKS, HYGIENE, HYGIENE_CHECKS, PARITY
from kvparity.suites.core.evidence import OUTCOMES, STOPS
from kvparity.suites.format.levels import LEVELS, SCHEDULE_LEVELS
from kvparity.suites.l1.recorder import LAYOUTS, RECORDED, SELECTED, WHOLE

SCHEMAS = Path(__file__).parent / "schema"

ENUMS = {
    ("report.schema.json", "/properties/exit_status"): list(STATUS),
    ("report.schema.json", "/properties/policy/properties/gate"): list(GATES),
    **{("report.schema.json", f"/properties/policy/properties/{key}"): list(values)
       for key, values in CHOICES.items()},
    ("report.schema.json", "/properties/expectations/oneOf/1/properties/declarations/items/properties/status"):
        [MATCHED, UNEXPECTEDLY_PASSING, NOT_EXERCISED],
    ("report.schema.json", "/properties/hygiene/properties/findings/items/properties/level"): list(SCHEDULE_LEVELS),
    ("report.schema.json", "/properties/hygiene/properties/findings/items/properties/check"): list(HYGIENE_CHECKS),
    ("report.schema.json", "/$defs/outcome"): list(OUTCOMES),
    ("report.schema.json", "/$defs/scheduleResult/properties/level"): list(LEVELS),
    ("report.schema.json", "/$defs/scheduleResult/properties/stopped"): ["", *STOPS],
    ("report.schema.json", "/$defs/failureGroup/properties/level"): list(LEVELS),
    ("report.schema.json", "/$defs/failureGroup/properties/levels/items"): list(LEVELS),
    ("report.schema.json", "/$defs/divergence/properties/kind"): [PARITY, HYGIENE],
    ("report.schema.json", "/$defs/check"): list(CHECKS),
    ("matrix.schema.json", "/properties/exit_status"): list(STATUS),
    ("vectors.schema.json", "/$defs/manifest/properties/catalog"): [WHOLE, SELECTED],
    ("vectors.schema.json", "/$defs/cases/properties/bits"): list(BITS),
    ("vectors.schema.json", "/$defs/cases/properties/group_size"): list(GROUP_SIZES),
    ("vectors.schema.json", "/$defs/cases/properties/dtype"): list(DTYPES),
    ("vectors.schema.json", "/$defs/layout/properties/layout"): list(LAYOUTS),
    ("vectors.schema.json", "/$defs/call/properties/member"): list(RECORDED),
}


def node(doc, pointer: str) -> dict:
    for part in pointer.strip("/").split("/"):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def differences() -> list:
    """(schema, pointer, in the schema, declared) wherever they differ."""
    found = []
    for (name, pointer), declared in ENUMS.items():
        written = node(json.loads((SCHEMAS / name).read_text()), pointer)["enum"]
        if written != declared:
            found.append((name, pointer, written, declared))
    return found


def write() -> list:
    """Rewrite each schema's enums from the declarations; the files changed."""
    changed = []
    for name in sorted({name for name, *_ in differences()}):  # the others keep their layout
        path = SCHEMAS / name
        doc = json.loads(path.read_text())
        for (file, pointer), declared in ENUMS.items():
            if file == name:
                node(doc, pointer)["enum"] = declared
        text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
        if text != path.read_text():
            path.write_text(text)
            changed.append(name)
    return changed


if __name__ == "__main__":
    print("\n".join(f"rewrote {name}" for name in write()) or "the schemas' enums match the declarations")
    sys.exit(0)

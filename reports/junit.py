"""junit.xml for CI: one testcase per schedule run and row.

Rendered from the report.json record, so a stored record can be turned into
JUnit again. classname is ``kvparity.<level>.<schedule>`` and name the row id;
a failed row carries every divergence, a row that was not supported or
skipped is <skipped>, never a pass.
"""

import re
import xml.etree.ElementTree as ET

from kvparity.reports.results import FAIL, NOT_SUPPORTED, SKIPPED

# Characters XML 1.0 cannot hold at all, even escaped.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")
# Environment keys worth repeating as <properties> on every suite.
PROPERTIES = ("implementation", "backend", "device", "mlx", "mlx_lm", "model", "git_commit")


def _text(value) -> str:
    return _NOT_XML.sub("?", "" if value is None else str(value))


def _set(element, **attributes):
    for key, value in attributes.items():
        element.set(key, _text(value))
    return element


def render(record: dict) -> bytes:
    root = ET.Element("testsuites", name="kvparity")
    totals = dict(tests=0, failures=0, skipped=0)
    seconds = 0.0
    environment = record.get("environment", {})
    for result in record["results"]:
        suite = _suite(root, result, environment)
        for key in totals:
            totals[key] += int(suite.get(key))
        seconds += result.get("seconds") or 0.0
    _set(root, **totals, errors=0, time=f"{seconds:.3f}")
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def _suite(root, result, environment):
    classname = f"kvparity.{result['level']}.{result['schedule']}"
    suite = ET.SubElement(root, "testsuite")
    properties = ET.SubElement(suite, "properties")
    for key in PROPERTIES:
        if environment.get(key) is not None:
            _set(ET.SubElement(properties, "property"), name=key, value=environment[key])
    if result.get("path"):
        _set(ET.SubElement(properties, "property"), name="schedule_file", value=result["path"])
    failures = skipped = 0
    cases = [(row["request"], row) for row in result["rows"]]
    if result["verdict"] == FAIL and not any(row["verdict"] == FAIL for row in result["rows"]):
        # A schedule can fail without a failing row (it raised before any
        # row existed): a testcase of its own keeps the failure visible.
        cases.append(("(schedule)", {"verdict": FAIL, "divergences": [], "tier": None}))
    for name, row in cases:
        case = _set(ET.SubElement(suite, "testcase"), classname=classname, name=name)
        if row["verdict"] == FAIL:
            failures += 1
            divergences = row["divergences"]
            first = divergences[0] if divergences else None
            failure = _set(ET.SubElement(case, "failure"),
                           message=first["message"] if first else result["reason"] or "parity broken",
                           type=first["check"] if first else "error")
            lines = [f"tier reached: {row.get('tier')}, required: {row.get('required') or 'bit-exact'}"]
            if result["reason"]:
                lines.append(result["reason"])
            lines += [d["message"] for d in divergences]
            failure.text = _text("\n".join(lines))
        elif row["verdict"] in (NOT_SUPPORTED, SKIPPED):
            skipped += 1
            _set(ET.SubElement(case, "skipped"), message=f"{row['verdict']}: {result['reason']}")
    return _set(suite, name=classname, tests=len(cases), failures=failures, errors=0, skipped=skipped,
                time=f"{result.get('seconds') or 0.0:.3f}")

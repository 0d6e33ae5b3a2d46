"""junit.xml for CI: one testcase per schedule run and row.

Rendered from the report.json record, so a stored record can be turned into
JUnit again. classname is ``kvparity.<level>.<schedule>`` and name the row id.
What a CI dashboard shows must match the gate: a failed or refused row and a
row with no evidence are <failure> (none of them passes the gate); a row whose
capability is not supported, or whose oracle cannot run on this backend, or
that was not judged (it calls a member that hung earlier in the run), is
<skipped>, never a pass. A row whose divergences were all declared in an
expectations file is <skipped> too (it does not fail the gate, and it is not
a plain pass), its message naming the declarations. The expectations file
gets a suite of its own, one testcase per declaration: one unexpectedly
passing is a <failure> where the policy gates on it, else <skipped>.
"""

import re
import xml.etree.ElementTree as ET

from kvparity.reports.expectations import MATCHED, UNEXPECTEDLY_PASSING
from kvparity.suites.core.evidence import (
    EXPECTED_DIVERGENCE, FAIL, MLX_LM_DEFECT, NO_EVIDENCE, NOT_JUDGED, NOT_SUPPORTED, ORACLE_CANNOT_RUN,
    ORACLE_NONDETERMINISTIC, PASS, REFUSED,
)

FAILED = (FAIL, REFUSED, NO_EVIDENCE)
SKIPPED = (NOT_SUPPORTED, ORACLE_CANNOT_RUN, ORACLE_NONDETERMINISTIC, MLX_LM_DEFECT, EXPECTED_DIVERGENCE, NOT_JUDGED)
# Characters XML 1.0 cannot hold at all, even escaped.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")
# Environment keys worth repeating as <properties> on every suite; the model
# is each schedule's own.
PROPERTIES = ("implementation", "backend", "device", "mlx", "mlx_lm", "git_commit")


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
    for result in record["results"]:
        suite = _suite(root, result, record)
        for key in totals:
            totals[key] += int(suite.get(key))
        seconds += result.get("seconds") or 0.0
    if record.get("expectations"):
        suite = _expectations_suite(root, record["expectations"])
        for key in totals:
            totals[key] += int(suite.get(key))
    if record.get("generated"):
        suite = _generated_suite(root, record["generated"])
        for key in totals:
            totals[key] += int(suite.get(key))
    _set(root, **totals, errors=0, time=f"{seconds:.3f}")
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def _suite(root, result, record):
    classname = f"kvparity.{result['level']}.{result['schedule']}"
    suite = ET.SubElement(root, "testsuite")
    properties = ET.SubElement(suite, "properties")
    environment = record.get("environment", {})
    named = {key: environment.get(key) for key in PROPERTIES}
    named.update(model=result.get("model"), model_sha256=result.get("model_sha256"),
                 policy=(record.get("policy") or {}).get("name"), schedule_file=result.get("path"))
    # Each setting of the run and where it came from (command line, a pyproject.toml, default).
    for name, setting in ((record.get("configuration") or {}).get("settings") or {}).items():
        named[f"kvparity.{name}"] = setting["value"] if setting["value"] is not None else "(default)"
        named[f"kvparity.{name}.from"] = setting["from"]
    for key, value in named.items():
        if value is not None:
            _set(ET.SubElement(properties, "property"), name=key, value=value)
    cases = [(row["request"], row) for row in result["rows"]]
    if result["verdict"] != PASS and not any(row["verdict"] == result["verdict"] for row in result["rows"]):
        # The schedule's outcome shows in no row (it has none, or it stopped
        # before any row existed): a testcase of its own keeps it visible.
        cases.append(("(schedule)", {"verdict": result["verdict"], "reason": result["reason"], "divergences": [],
                                     "tier": None, "required": ""}))
    failures = skipped = 0
    for name, row in cases:
        case = _set(ET.SubElement(suite, "testcase"), classname=classname, name=name)
        verdict = row["verdict"]
        if verdict in FAILED:
            failures += 1
            failure = _set(ET.SubElement(case, "failure"), message=_message(row, result), type=verdict)
            failure.text = _text("\n".join(_details(row, result)))
        elif verdict in SKIPPED:
            skipped += 1
            skip = _set(ET.SubElement(case, "skipped"), message=_message(row, result))
            if verdict == EXPECTED_DIVERGENCE:
                skip.text = _text("\n".join(_details(row, result)))
    return _set(suite, name=classname, tests=len(cases), failures=failures, errors=0, skipped=skipped,
                time=f"{result.get('seconds') or 0.0:.3f}")


def _generated_suite(root, generated):
    """The generated budget as one testcase, its counts as properties: it
    passes where its schedules passed (each failing one is a suite of its
    own, with the catalog's), and fails where it compared nothing."""
    suite = ET.SubElement(root, "testsuite")
    properties = ET.SubElement(suite, "properties")
    cells = generated["cells"]
    for name, value in (("generated.level", generated["level"]), ("generated.budget", generated["budget"]),
                        ("generated.seed", generated["seed"]), ("generated.schedules", generated["schedules"]),
                        ("generated.rows_passed", generated["rows_passed"]), ("generated.sha256", generated["digest"]),
                        ("generated.cells_reached", f"{cells['reached']} of {cells['requirements']}")):
        _set(ET.SubElement(properties, "property"), name=name, value=value)
    case = _set(ET.SubElement(suite, "testcase"), classname=f"kvparity.generated.{generated['level']}",
                name=f"{generated['schedules']} generated schedules", time=f"{generated['seconds']:.3f}")
    failed = not generated["rows_passed"] and not generated["failures"]
    if failed:
        _set(ET.SubElement(case, "failure"), message="the generated budget compared nothing", type=NO_EVIDENCE)
    elif generated["failures"]:
        ET.SubElement(case, "system-out").text = _text("\n".join(
            f"{f['schedule']}: {f['verdict']}; replay with: {f['replay']}" for f in generated["failures"]))
    return _set(suite, name="kvparity.generated", tests=1, failures=int(failed), errors=0, skipped=0,
                time=f"{generated['seconds']:.3f}")


def _expectations_suite(root, expectations):
    """One testcase per declaration: matched passes; unexpectedly passing
    fails where the policy gates on it; anything else is skipped."""
    suite = ET.SubElement(root, "testsuite")
    _set(ET.SubElement(ET.SubElement(suite, "properties"), "property"), name="expectations_file",
         value=expectations["path"])
    failures = skipped = 0
    for i, d in enumerate(expectations["declarations"]):
        case = _set(ET.SubElement(suite, "testcase"), classname="kvparity.expectations",
                    name=f"divergences[{i}] {d['check']} ({d['scope']})")
        message = (f"{d['status']}: {d['matched']} divergence(s) matched, {d['compared']} comparison(s) "
                   f"in scope; reason: {d['reason']}")
        if d["status"] == UNEXPECTEDLY_PASSING and expectations["gates"]:
            failures += 1
            _set(ET.SubElement(case, "failure"), message=message, type=UNEXPECTEDLY_PASSING)
        elif d["status"] != MATCHED:
            skipped += 1
            _set(ET.SubElement(case, "skipped"), message=message)
    return _set(suite, name="kvparity.expectations", tests=len(expectations["declarations"]), failures=failures,
                errors=0, skipped=skipped, time="0.000")


def _message(row, result) -> str:
    """One line: a failure's reason as the verdict gave it; any other outcome
    prefixed with its name ("no evidence: ...", "not supported: ...")."""
    reason = row.get("reason") or result["reason"]
    if row["verdict"] == FAIL:
        return reason or "parity broken"
    return f"{row['verdict']}: {reason}" if reason else row["verdict"]


def _details(row, result):
    lines = []
    if row.get("tier") or row.get("required"):
        lines.append(f"tier reached: {row.get('tier')}, required: {row.get('required') or 'bit-exact'}")
    if result["reason"]:
        lines.append(result["reason"])
    lines += [("(hygiene) " if d["kind"] == "hygiene" else "") + ("(declared) " if d.get("declared") is not None
                                                                   else "") + d["message"]
              for d in row["divergences"]]
    return lines

"""The job summary and annotations of a kvparity CI run.

Reads pytest's and kvparity's junit.xml files and the newest report.md under
a reports directory (``kvparity run --out DIR`` writes one directory per run
inside DIR). Prints one ``::error`` annotation per failed or errored test
case and appends to the job summary (``$GITHUB_STEP_SUMMARY``) a line of
totals, a table of the failures and report.md itself.

    python action/summary.py --title TITLE [--reports DIR] [JUNIT.xml ...]
"""

import argparse
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from workflow_commands import error

TOTALS = ("tests", "failures", "errors", "skipped")
MAX_ROWS = 200
MAX_CELL = 300
# GitHub takes at most 1 MiB of summary per step; report.md can be longer.
MAX_REPORT = 700_000


def junit_files(paths, reports):
    """The given junit files that exist, then each report directory's."""
    found = [Path(p) for p in paths if Path(p).exists()]
    if reports and Path(reports).is_dir():
        found += sorted(Path(reports).glob("*/junit.xml"))
    return found


def newest_report(reports):
    if not reports or not Path(reports).is_dir():
        return None
    return max(Path(reports).glob("*/report.md"), key=os.path.getmtime, default=None)


def failures(path):
    """(totals, [(test case, first line of its failure, kind)]) of one junit file."""
    root = ET.parse(path).getroot()
    totals = dict.fromkeys(TOTALS, 0)
    for suite in root.iter("testsuite"):
        for key in TOTALS:
            totals[key] += int(suite.get(key, 0))
    found = []
    for case in root.iter("testcase"):
        for bad in case.findall("failure") + case.findall("error"):
            name = "::".join(filter(None, (case.get("classname"), case.get("name"))))
            lines = (bad.get("message") or bad.text or "").strip().splitlines() or [bad.tag]
            found.append((name, lines[0], bad.tag))
    return totals, found


def summarize(title, junits, report):
    """(summary markdown, annotation lines)."""
    totals, rows, annotations = dict.fromkeys(TOTALS, 0), [], []
    for path in junits:
        counts, found = failures(path)
        for key in TOTALS:
            totals[key] += counts[key]
        for name, first_line, kind in found:
            annotations.append(error(f"{kind}: {name}", first_line))
            cell = first_line.replace("|", "\\|")[:MAX_CELL]
            rows.append(f"| `{path}` | `{name}` | {cell} |")
    out = [f"## {title}", "",
           "{tests} test cases, {failures} failed, {errors} errors, {skipped} skipped".format(**totals), ""]
    if rows:
        out += ["| file | test case | first line |", "|---|---|---|"] + rows[:MAX_ROWS]
        if len(rows) > MAX_ROWS:
            out.append(f"\n({len(rows) - MAX_ROWS} more failures; every one is in the junit files)")
        out.append("")
    if report is not None:
        text = report.read_text(encoding="utf-8")
        if len(text) > MAX_REPORT:
            text = text[:MAX_REPORT] + "\n\n(cut; the full report is in the artifact)"
        out.append(text)
    return "\n".join(out) + "\n", annotations


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--title", required=True, help="the summary's heading")
    parser.add_argument("--reports", metavar="DIR", help="kvparity run's --out directory")
    parser.add_argument("junit", nargs="*", help="more junit.xml files (those missing are left out)")
    args = parser.parse_args(argv)
    markdown, annotations = summarize(args.title, junit_files(args.junit, args.reports), newest_report(args.reports))
    for line in annotations:
        print(line)
    target = os.environ.get("GITHUB_STEP_SUMMARY")
    if target:
        with open(target, "a", encoding="utf-8") as summary:
            summary.write(markdown)
    else:
        sys.stdout.write(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

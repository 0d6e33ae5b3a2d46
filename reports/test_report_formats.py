"""The rendered report formats tell the truth: junit.xml parsed back
outcome by outcome, report.md tables, and report.html rendered in a headless
browser, each read from the sample run and report directory of
reports/test_reports.py."""

import xml.etree.ElementTree as ET
from html.parser import HTMLParser

from kvparity.reports import junit
from kvparity.reports.headless import browser, dom, overflow, screenshot
from kvparity.reports.verdicts import judge
from kvparity.reports.report_json import build_record
from kvparity.reports.markdown import logit_rows
from kvparity.suites.core.evidence import (
    EXPECTED_DIVERGENCE, FAIL, MLX_LM_DEFECT, NO_EVIDENCE, NOT_JUDGED, NOT_SUPPORTED, ORACLE_CANNOT_RUN,
    ORACLE_NONDETERMINISTIC, OUTCOMES, PASS, REFUSED, ScheduleResult,
)
from kvparity.reports import test_reports
from kvparity.reports.test_reports import CPU, ENV, l2_by_hand, options

results, run_verdict, report, record = (test_reports.results, test_reports.run_verdict, test_reports.report,
                                        test_reports.record)  # its module fixtures, built here once too


# --- junit.xml -----------------------------------------------------------------


def junit_cases(report):
    root = ET.parse(report / "junit.xml").getroot()
    return root, [(suite, case) for suite in root.findall("testsuite") for case in suite.findall("testcase")]


def test_junit_has_a_testcase_per_schedule_and_row(report, results):
    root, cases = junit_cases(report)
    *suites, declared = root.findall("testsuite")
    cases = [(s, c) for s, c in cases if s is not declared]
    evidence = [v.evidence for v in results]
    assert [s.get("name") for s in suites] == [f"kvparity.{r.level}.{r.schedule}" for r in evidence]
    assert [(s.get("name"), c.get("name")) for s, c in cases] == [
        (f"kvparity.{r.level}.{r.schedule}", row.request) for r in evidence for row in r.rows]
    for suite in suites:
        assert int(suite.get("tests")) == len(suite.findall("testcase"))
        assert int(suite.get("failures")) == len(suite.findall("testcase/failure"))
        assert int(suite.get("skipped")) == len(suite.findall("testcase/skipped"))
    rows = [row for r in results for row in r.rows]
    # The expectations file's suite: a testcase per declaration, the one not exercised skipped.
    assert declared.get("name") == "kvparity.expectations" and declared.get("tests") == "2"
    assert declared.get("skipped") == "1" and declared.get("failures") == "0"
    assert root.get("tests") == str(len(rows) + 2)
    assert root.get("failures") == str(sum(row.verdict in (FAIL, REFUSED, NO_EVIDENCE) for row in rows))
    assert root.get("skipped") == str(1 + sum(row.verdict in (NOT_SUPPORTED, ORACLE_CANNOT_RUN, ORACLE_NONDETERMINISTIC,
                                                              MLX_LM_DEFECT, EXPECTED_DIVERGENCE, NOT_JUDGED)
                                              for row in rows))


def test_each_outcome_maps_to_its_junit_element(report, results):
    _, cases = junit_cases(report)
    cases = [(s, c) for s, c in cases if s.get("name") != "kvparity.expectations"]
    rows = [row for r in results for row in r.rows]
    seen = set()
    for (suite, case), row in zip(cases, rows):
        failure, skipped = case.find("failure"), case.find("skipped")
        seen.add(row.verdict)
        if row.verdict == PASS:
            assert failure is None and skipped is None
        elif row.verdict == FAIL:
            assert skipped is None and failure.get("type") == FAIL and failure.get("message") == row.reason
            assert all(d.message() in failure.text for d in row.evidence.divergences)
        elif row.verdict in (REFUSED, NO_EVIDENCE):
            assert skipped is None and failure.get("type") == row.verdict
            assert failure.get("message") == f"{row.verdict}: {row.reason}"
        else:
            assert failure is None and skipped.get("message") == f"{row.verdict}: {row.reason}"
            if row.verdict == EXPECTED_DIVERGENCE:  # declared, and listed as such
                assert "extract divergence(s) declared" in row.reason and "(declared) extract:" in skipped.text
    assert seen == set(OUTCOMES)
    refusals = [c.find("failure") for s, c in cases if c.find(f"failure[@type='{REFUSED}']") is not None]
    assert refusals and all("update_and_fetch" in f.get("message") for f in refusals)
    never = next(c for s, c in cases if c.get("name") == "d")
    assert never.find("failure").get("message").startswith("no evidence: ")


def test_each_junit_suite_names_its_own_model(report, results):
    root, _ = junit_cases(report)
    for suite, result in zip(root.findall("testsuite"), (v.evidence for v in results)):
        properties = {p.get("name"): p.get("value") for p in suite.iter("property")}
        assert properties.get("model") == result.model and properties.get("model_sha256") == result.model_sha256
        assert properties["policy"] == "cpu" and properties["implementation"] == ENV["implementation"]


def test_a_schedule_whose_outcome_shows_in_no_row_gets_its_own_testcase():
    empty = judge(ScheduleResult("nothing", "L1", "Cache", ["join"]), CPU)
    assert empty.verdict == NO_EVIDENCE
    root = ET.fromstring(junit.render(build_record([empty], ENV, **options([empty]))))
    (case,) = root.iter("testcase")
    assert case.get("name") == "(schedule)" and case.find("failure").get("message").startswith("no evidence")
    assert root.get("failures") == "1"


# --- report.md -----------------------------------------------------------------


def test_markdown_tables(report, run_verdict):
    text = (report / "report.md").read_text()
    for heading in ("## Environment", "## Summary", "## Rows", "## Logits (L2)", "## Models", "## Coverage:",
                    "## Protocol members called", "## Hygiene (reported, not gating under policy cpu)",
                    "## Policy", "## Capabilities", "## L0 backend probes (shapes of probe-model)", "## Extra"):
        assert heading in text, heading
    assert f"**{run_verdict.headline}**: exit status 1, parity broken." in text
    columns = {cell.strip() for line in text.splitlines() if line.startswith("|") for cell in line.split("|")}
    assert {"model", "tier", "required", "comparisons", "max abs diff", "max ULP", "KL mean", "KL max",
            "KL median", "KL p95", "KL p99", "top-1", "first divergence", "event kind", "calls",
            "max bytes retained", "first occurrence"} <= columns
    assert {REFUSED, NO_EVIDENCE, NOT_SUPPORTED, ORACLE_CANNOT_RUN, "n/a", "no (dtype or shape differ)",
            "bit-exact", "diverged"} <= columns
    assert "| per_row_rollback " in text and "no (not supported)" in text
    _, logit_table = logit_rows([judge(l2_by_hand(), CPU)])
    assert logit_table[2][7:] == ["n/a"] * 7  # row c: nothing was comparable, so no distance is shown as 0
    assert "probe-model" not in text.split("## Summary")[0]  # the header names no model


# --- report.html ---------------------------------------------------------------


class Elements(HTMLParser):
    """Every element's tag and attributes, in document order; an element
    inside an svg also gets that svg's id as ``svg``."""

    def __init__(self, text):
        super().__init__()
        self.found = []
        self.svg = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "svg":
            self.svg = attrs.get("id")
        self.found.append((tag, {**attrs, "svg": self.svg}))


def test_html_is_self_contained_and_tells_outcomes_apart(report):
    text = (report / "report.html").read_text()
    assert "http" not in text  # no links, scripts, fonts or namespaces fetched from anywhere
    for external in ("<script", "<link", "<img", "<iframe", "@import", "url("):
        assert external not in text
    found = Elements(text).found
    badges = {a["class"] for t, a in found if a.get("class", "").startswith("badge")}
    assert badges == {"badge pass", "badge fail", "badge refused", "badge noevidence", "badge muted",
                      "badge oracle", "badge expected"}
    cells = {a.get("class") for t, a in found if t == "td"}
    assert {"pass", "fail", "refused", "noevidence", "muted", "oracle", "expected"} <= cells
    ids = {a["id"] for t, a in found if "id" in a}
    assert {"summary", "rows", "logits", "coverage", "protocol-members", "hygiene", "environment",
            "status", "checks", "declared-divergences"} <= ids
    assert {a.get("class") for t, a in found if t == "li"} >= {"declared", "parity", "hygiene"}
    assert "probe-model" not in text.split('id="summary"')[0]
    # What failed and why comes first, right under the header's verdict.
    assert text.index('id="failures"') < text.index('id="summary"') < text.index('id="plots"')


def check_plots(found):
    """The plots, read back from a page's elements."""
    by_id = {attrs["id"]: tag for tag, attrs in found if "id" in attrs}
    for svg in ("steps-L1-join-longer-joiner-0", "steps-L1-earliest-6", "steps-L2-rollback-uneven-7",
                "series-L2-rollback-uneven-7-kl_max", "heat-L2-rollback-uneven-7-a"):
        assert by_id.get(svg) == "svg", svg
    bars = {(a["svg"], a["data-row"], a["data-step"]): a["data-count"] for t, a in found if a.get("class") == "bar"}
    l2 = "steps-L2-rollback-uneven-7"
    # L2 row a: a logits divergence at steps 1 and 3, two cache tensors at step 2, one at 3.
    assert bars[(l2, "a", "1")] == "1" and bars[(l2, "a", "2")] == "2" and bars[(l2, "a", "3")] == "2"
    assert bars[("steps-L1-earliest-6", "b", "0")] == "1" and bars[("steps-L1-earliest-6", "a", "2")] == "1"
    cells = [a for t, a in found if a.get("class") == "cell"]
    first = [(c["data-layer"], c["data-step"]) for c in cells if c["data-first"] == "1"]
    assert first == [("", "1")]  # row a's earliest: the logits track, step 1
    assert {(c["data-layer"], c["data-step"]): c["data-count"] for c in cells}[("1", "2")] == "2"
    points = [a for t, a in found if a.get("class") == "point"]
    assert [p["data-value"] for p in points] == ["0", "0.01", "0.02"]  # the NaN is left out
    srcs = [a.get(k, "") for t, a in found for k in ("src", "href")]
    assert not [s for s in srcs if "://" in s]


def test_html_plots(report):
    check_plots(Elements((report / "report.html").read_text()).found)


def test_html_renders_its_plots_in_a_browser(report, tmp_path):
    binary = browser()
    page = report / "report.html"
    check_plots(Elements(dom(binary, tmp_path / "profile", page)).found)
    assert overflow(binary, tmp_path / "profile", page) <= 0  # read at 1280 px: it wraps, hides nothing
    shot = screenshot(binary, tmp_path / "profile", page, tmp_path / "report-1280.png", height=1600)
    assert shot.stat().st_size > 20_000

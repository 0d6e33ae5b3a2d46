"""Report formats: tiers, report.json against its schema, junit.xml parsed
back, report.md tables, and report.html rendered in a headless browser."""

import json
import shutil
import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import jsonschema
import pytest

from kvparity.reports import html as html_report
from kvparity.reports import junit
from kvparity.reports.results import FAIL, NOT_SUPPORTED, PASS, Divergence, RowResult, ScheduleResult
from kvparity.reports.policy import _round_up, row_tier, tier_of
from kvparity.reports.writer import SCHEMA_PATH, build_record, write_report

ENV = {
    "kvparity": "0.1.0", "mlx": "0.32.4", "mlx_lm": "0.32.2", "python": "3.11.7", "platform": "Linux",
    "backend": "cpu", "device": "cpu (test)", "knobs": {"MLX_ENABLE_TF32": None}, "git_commit": None,
    "implementation": "pkg.mod:Cache", "capabilities": {"per_row_rollback": True, "delayed_conversion": False},
}
EXACT = {"positions": 4, "bit_exact": 4, "top1_agree": 4, "max_abs_diff": 0.0, "max_ulp": 0,
         "kl_mean": 0.0, "kl_max": 0.0, "kl_p99": 0.0, "kl_p95": 0.0, "kl_median": 0.0}
CLOSE = dict(EXACT, bit_exact=1, max_abs_diff=0.0078, max_ulp=3, kl_mean=1e-6, kl_max=2.5e-6)
FLIPPED = dict(CLOSE, top1_agree=3, max_ulp=900, kl_max=0.02)


def logits(step, rid="a"):
    return Divergence("logits", f"#{step} step 1", rid, tensor="logits", step=step, index=0,
                      expected=-1.25, actual=-1.5, detail="max abs diff 0.25")


def cache(step, layer, part="packed", rid="a"):
    return Divergence("bytes", f"#{step} step 1", rid, tensor=f"keys.{part}", layer=layer, step=step,
                      index=7, expected=3, actual=5)


def sample_results():
    """L1 with a failing row, L2 with a failing row (logits at step 1, layer 1
    cache bytes at steps 2 and 3), and an L2 run that was not supported."""
    l1 = ScheduleResult("join-longer", "L1", "Cache", 4, path="catalog/join-longer.json", verdict=FAIL, seconds=0.5)
    l1.rows = [
        RowResult("a", PASS, checks=4),
        RowResult("b", FAIL, [Divergence("mask", "#2 join [\"c\"]", "b", tensor="make_mask(1)", index=0,
                                         expected=False, actual=True),
                              Divergence("bytes", "#3 step 1", "b", tensor="keys.scales", index=2,
                                         expected=0.5, actual=0.25)], checks=4),
    ]
    l2 = ScheduleResult("rollback-uneven", "L2", "Cache", 6, verdict=FAIL, seconds=1.25)
    failing = [logits(1), cache(2, 1), cache(2, 1, "scales"), cache(3, 1), logits(3)]
    l2.rows = [
        RowResult("a", FAIL, failing, checks=6,
                  metrics=dict(FLIPPED, kl_max=float("inf"), max_abs_diff=float("nan"))),
        RowResult("b", PASS, checks=6, metrics=dict(EXACT)),
    ]
    l2.rows[0].series = {"kl": [0.0, 0.01, 0.02, float("nan")]}  # read through getattr until RowResult has it
    unsupported = ScheduleResult("kv-start-after-join", "L2", "Cache", 2, verdict=NOT_SUPPORTED,
                                 reason="needs delayed_conversion")
    unsupported.rows = [RowResult("a", NOT_SUPPORTED), RowResult("b", NOT_SUPPORTED)]
    return [l1, l2, unsupported]


@pytest.fixture
def report(tmp_path):
    probes = [{"op": "matmul", "batch_size": 8, "invariant": True, "max_abs_diff": 0.0, "first_row": None,
               "error": None}]
    path = write_report(sample_results(), ENV, tmp_path, sections=[("Extra", ["k", "v"], [["x", 1]])],
                        policy={"backend": "cpu", "logits_tier": "bit-exact"}, probes=probes)
    return path


def validator():
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


# --- tiers -------------------------------------------------------------------


def test_tier_ladder():
    assert tier_of(EXACT, bytes_ok=True) == "bit-exact"
    assert tier_of(EXACT, bytes_ok=False) == "ulp<=0"  # logits exact, model-written bytes moved
    assert tier_of(CLOSE, bytes_ok=True) == "ulp<=3"
    assert tier_of(dict(CLOSE, max_ulp=-1), bytes_ok=True) == "kl<=2.5e-06 and top-1 agree"
    assert tier_of(FLIPPED, bytes_ok=True) == "diverged"
    assert tier_of({}, bytes_ok=True) == "bit-exact"  # L1: bytes are the whole story
    assert tier_of({}, bytes_ok=False) == "diverged"


@pytest.mark.parametrize("x", [2.5e-6, 0.0012345, 0.999999, 1.0, 123456.0, 9.9951e-3])
def test_printed_kl_bound_is_still_a_bound(x):
    text = _round_up(x)
    assert float(text) >= x and float(text) == float(f"{float(text):.3g}")


def test_structural_divergence_is_diverged_whatever_the_logits():
    raised = RowResult("a", FAIL, [Divergence("raised", "#1 step 1", "a")], metrics=dict(EXACT))
    assert row_tier(raised) == "diverged"
    assert row_tier(RowResult("a", NOT_SUPPORTED)) is None
    assert row_tier(RowResult("a", FAIL, [cache(1, 0)], metrics=dict(CLOSE))) == "ulp<=3"


# --- report.json ---------------------------------------------------------------


def test_a_report_directory_holds_four_files_and_the_record_validates(report):
    assert sorted(p.name for p in report.iterdir()) == ["junit.xml", "report.html", "report.json", "report.md"]
    record = json.loads((report / "report.json").read_text())
    validator().validate(record)
    assert record["schema"] == "kvparity.report/1" and record["passed"] is False
    assert record["summary"]["schedules"] == {"pass": 0, "FAIL": 2, "not supported": 1, "skipped": 0}
    assert record["summary"]["tiers"] == {"bit-exact": 2, "ulp": 0, "kl": 0, "diverged": 2}
    l2 = record["results"][1]["rows"][0]
    assert l2["metrics"]["kl_max"] == "Infinity" and l2["metrics"]["max_abs_diff"] == "NaN"
    assert l2["series"]["kl"][-1] == "NaN" and l2["bytes_ok"] is False
    assert l2["divergences"][0]["message"].startswith("logits: after event #1 step 1, row 'a', step 1")
    assert record["probes"][0]["op"] == "matmul" and record["capabilities"]["delayed_conversion"] is False


def test_every_schema_property_is_documented():
    schema = json.loads(SCHEMA_PATH.read_text())
    missing = []

    def walk(node, where):
        if isinstance(node, dict):
            for name, sub in node.get("properties", {}).items():
                if "description" not in sub:
                    missing.append(f"{where}/{name}")
            for key, sub in node.items():
                walk(sub, f"{where}/{key}")
        elif isinstance(node, list):
            for i, sub in enumerate(node):
                walk(sub, f"{where}/{i}")

    walk(schema, "#")
    assert not missing


TAMPERINGS = {
    "unknown verdict": lambda r: r["results"][0].update(verdict="ok"),
    "wrong schema version": lambda r: r.update(schema="kvparity.report/2"),
    "metrics missing their percentiles": lambda r: r["results"][1]["rows"][1]["metrics"].pop("kl_p99"),
    "step as a string": lambda r: r["results"][1]["rows"][0]["divergences"][0].update(step="1"),
    "field the schema does not know": lambda r: r["results"][0]["rows"][0].update(note="x"),
    "NaN written as a bare string": lambda r: r["results"][1]["rows"][0]["metrics"].update(kl_max="nan"),
    "tier outside the ladder": lambda r: r["results"][0]["rows"][0].update(tier="close enough"),
    "summary without tiers": lambda r: r["summary"].pop("tiers"),
}


@pytest.mark.parametrize("name", sorted(TAMPERINGS))
def test_a_tampered_record_fails_validation(name):
    record = build_record(sample_results(), ENV)
    check = validator()
    check.validate(record)
    TAMPERINGS[name](record)
    with pytest.raises(jsonschema.ValidationError):
        check.validate(record)


def test_a_real_l1_run_validates_and_fails_in_junit():
    from kvparity.impl.adapter import load_implementation
    from kvparity.suites.l1 import run_l1
    from kvparity.suites.schedule import CATALOG, load

    result = run_l1(load(CATALOG / "join-longer-joiner.json"),
                    load_implementation("kvparity.suites.negative_controls:MaskIgnoresLeftPadding"))
    assert result.verdict == FAIL
    record = build_record([result], ENV)
    validator().validate(record)
    suite = ET.fromstring(junit.render(record)).find("testsuite")
    assert int(suite.get("failures")) == sum(r.verdict == FAIL for r in result.rows) > 0


# --- junit.xml -----------------------------------------------------------------


def test_junit_has_a_testcase_per_schedule_and_row(report):
    root = ET.parse(report / "junit.xml").getroot()
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == [
        "kvparity.L1.join-longer", "kvparity.L2.rollback-uneven", "kvparity.L2.kv-start-after-join"]
    cases = {(c.get("classname"), c.get("name")): c for c in root.iter("testcase")}
    assert len(cases) == 6
    failure = cases[("kvparity.L2.rollback-uneven", "a")].find("failure")
    results = sample_results()
    assert failure.get("message") == results[1].rows[0].divergences[0].message()
    assert all(d.message() in failure.text for d in results[1].rows[0].divergences)
    assert cases[("kvparity.L2.rollback-uneven", "b")].find("failure") is None
    skipped = cases[("kvparity.L2.kv-start-after-join", "a")].find("skipped")
    assert skipped.get("message") == "not supported: needs delayed_conversion"
    for suite in suites:
        assert int(suite.get("tests")) == len(suite.findall("testcase"))
        assert int(suite.get("failures")) == len(suite.findall("testcase/failure"))
        assert int(suite.get("skipped")) == len(suite.findall("testcase/skipped"))
    assert (root.get("tests"), root.get("failures"), root.get("skipped")) == ("6", "2", "2")


def test_a_schedule_that_failed_without_a_failing_row_still_fails_in_junit():
    broken = ScheduleResult("s", "L2", "Cache", 1, [RowResult("a", PASS)], FAIL, reason="event #0 raised")
    root = ET.fromstring(junit.render(build_record([broken], ENV)))
    (failure,) = root.iter("failure")
    assert failure.get("message") == "event #0 raised" and root.get("failures") == "1"


# --- report.md -----------------------------------------------------------------


def test_markdown_tables(report):
    text = (report / "report.md").read_text()
    for heading in ("## Environment", "## Summary", "## Rows", "## Logits (L2)", "## Policy", "## Capabilities",
                    "## L0 backend probes", "## Extra"):
        assert heading in text
    columns = {cell.strip() for line in text.splitlines() if line.startswith("|") for cell in line.split("|")}
    assert {"tier", "bytes", "max abs diff", "max ULP", "KL mean", "KL max", "KL median", "KL p95", "KL p99",
            "top-1", "first divergence"} <= columns
    assert "| delayed_conversion " in text and "no (not supported)" in text
    assert "diverged" in text and "bit-exact" in text


# --- report.html ---------------------------------------------------------------


def test_html_is_self_contained(report):
    text = (report / "report.html").read_text()
    assert "http" not in text  # no links, scripts, fonts or namespaces fetched from anywhere
    for external in ("<script", "<link", "<img", "<iframe", "@import", "url("):
        assert external not in text
    assert text.count("<svg") == 4  # steps L1, steps L2, series L2, heatmap of row a


class Elements(HTMLParser):
    """Every element's tag and attributes, in document order."""

    def __init__(self):
        super().__init__()
        self.found = []

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, dict(attrs)))


BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def browser():
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if found is None:
        pytest.skip("no chromium binary found (CI installs Debian's chromium)")
    return found


def headless(binary, profile, *args):
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}"]
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=120)


def test_html_renders_its_plots_in_a_browser(report, tmp_path):
    binary = browser()
    page = (report / "report.html").as_uri()
    dom = headless(binary, tmp_path / "profile", "--dump-dom", page)
    assert dom.returncode == 0, dom.stderr[-2000:]
    parser = Elements()
    parser.feed(dom.stdout)
    by_id = {attrs["id"]: tag for tag, attrs in parser.found if "id" in attrs}
    for svg in ("steps-L1-join-longer-0", "steps-L2-rollback-uneven-1", "series-L2-rollback-uneven-1-kl",
                "heat-L2-rollback-uneven-1-a"):
        assert by_id.get(svg) == "svg", svg
    assert "summary" in by_id and "environment" in by_id
    bars = {(a["data-row"], a["data-step"]): a["data-count"] for t, a in parser.found if a.get("class") == "bar"}
    # L2 row a: a logits divergence at steps 1 and 3, two cache tensors at step 2, one at 3.
    assert bars[("a", "1")] == "1" and bars[("a", "2")] == "2" and bars[("a", "3")] == "2"
    assert bars[("b", "3")] == "1"  # L1 row b: the bytes divergence after event #3
    cells = [a for t, a in parser.found if a.get("class") == "cell"]
    first = [(c["data-layer"], c["data-step"]) for c in cells if c["data-first"] == "1"]
    assert first == [("", "1")]  # the logits track, step 1
    assert {(c["data-layer"], c["data-step"]): c["data-count"] for c in cells}[("1", "2")] == "2"
    points = [a for t, a in parser.found if a.get("class") == "point"]
    assert [p["data-value"] for p in points] == ["0", "0.01", "0.02"]  # the NaN is left out
    srcs = [a.get(k, "") for t, a in parser.found for k in ("src", "href")]
    assert not [s for s in srcs if "://" in s]

    shot = tmp_path / "report.png"
    run = headless(binary, tmp_path / "profile", "--hide-scrollbars", "--window-size=1280,1600",
                   f"--screenshot={shot}", page)
    assert run.returncode == 0, run.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


# --- the directory itself --------------------------------------------------------


def test_an_interrupted_report_leaves_nothing_and_earlier_ones_stay(tmp_path, monkeypatch):
    first = write_report(sample_results(), ENV, tmp_path)
    second = write_report(sample_results(), ENV, tmp_path)
    assert first != second and (first / "report.json").exists()

    def broken(*args):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(html_report, "render", broken)
    before = sorted(tmp_path.iterdir())
    with pytest.raises(RuntimeError):
        write_report(sample_results(), ENV, tmp_path)
    assert sorted(tmp_path.iterdir()) == before


def test_record_does_not_mutate_results():
    results = sample_results()
    before = json.dumps([r.to_json() for r in results], default=str)
    build_record(results, ENV)
    assert json.dumps([r.to_json() for r in results], default=str) == before

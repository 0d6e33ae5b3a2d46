"""The matrix page (matrix.html) in a real headless browser: at 1280 px it
fits its window, links only files that are there and loads nothing from
elsewhere; its architecture table colours each cell by its outcomes, as
matrix_page.architecture_class says. The rows and the render are
reports/test_matrix.py's."""

from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from kvparity.reports import matrix_page, test_matrix
from kvparity.reports.headless import browser, dom, overflow, screenshot
from kvparity.reports.test_matrix import CANNOT, CONTROL, REFERENCE, ArchitecturePage, render

# test_matrix.py's module fixtures: a test's parameter of that name reads them.
rows, arch_rows = test_matrix.rows, test_matrix.arch_rows


class Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.cells, self.links, self.sources = [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "td" and "data-column" in attrs:
            self.cells.append(attrs)
        if tag == "a":
            self.links.append(attrs["href"])
        self.sources += [attrs[k] for k in ("src", "href") if k in attrs and tag != "a"]


@pytest.mark.slow  # a browser start, seconds
def test_the_page_in_a_headless_browser(rows, tmp_path, capsys):
    """At 1280 px the page fits its window (it wraps, no column hidden), and
    its first table says which rows failed and why; it links only files that
    are there and loads nothing from elsewhere."""
    binary = browser()
    _, doc, out = render(rows, tmp_path)
    page = out / "matrix.html"
    parsed = Page()
    parsed.feed(dom(binary, tmp_path / "profile", page))
    assert len(parsed.cells) == len(doc["rows"]) * len(doc["columns"])
    control = next(i for i, r in enumerate(doc["rows"]) if r["implementation"] == CONTROL)
    cell = next(c for c in parsed.cells if c["data-row"] == str(control) and c["data-column"] == "L1")
    assert (cell["data-fail"], cell["data-pass"]) == ("2", "1") and "FAIL" in cell["class"]
    assert not [s for s in parsed.sources + parsed.links if "://" in s and not s.startswith("file://")]
    resolved = [Path(unquote(urlparse(link).path)) if link.startswith("file://") else (out / link)
                for link in parsed.links]
    assert len(resolved) == 3 + 1 and all(p.is_file() for p in resolved), resolved  # reports, the finding
    assert overflow(binary, tmp_path / "profile", page) <= 0
    screenshot(binary, tmp_path / "profile", page, tmp_path / "matrix-1280.png")
    first_table = page.read_text().split('<table id="matrix">')[1].split("</table>")[0]
    control_row = first_table.split(f'<tr data-row="{control}">')[1].split("</tr>")[0]
    assert "parity broken" in control_row and "left_padding" in control_row, control_row


@pytest.mark.parametrize("counts, css", [
    ({"pass": 3}, "pass"), ({"pass": 2, "expected divergence": 1}, "expected"),
    ({"pass": 2, "not supported": 1}, "partial"), ({"pass": 2, "mlx-lm defect": 1}, "partial"),
    ({"pass": 2, "FAIL": 1}, "FAIL"), ({"refused": 1}, "FAIL"), ({"pass": 2, "no evidence": 1}, "noevidence"),
    ({"no evidence": 1}, "noevidence"), ({"mlx-lm defect": 2}, "defect"), ({"oracle cannot run": 1}, "defect"),
    ({"not supported": 1}, "muted"), ({"not supported": 1, "mlx-lm defect": 1}, "defect"),
])
def test_an_architecture_cell_reads_pass_only_where_every_run_passed(counts, css):
    from kvparity.suites.core.evidence import OUTCOMES

    entry = {"cell": {o: counts.get(o, 0) for o in OUTCOMES}, "limits": []}
    assert matrix_page.architecture_class(entry, None) == css
    assert matrix_page.architecture_class(None, None) == "nothing" and matrix_page.architecture_class(entry, CANNOT) == "cannot"


@pytest.mark.slow  # a browser start, seconds
@pytest.mark.gqa_batched
def test_the_architecture_table_in_a_headless_browser(arch_rows, tmp_path, capsys):
    binary = browser()
    _, doc, out = render(arch_rows, tmp_path)
    page = ArchitecturePage()
    page.feed(dom(binary, tmp_path / "profile", out / "matrix.html"))
    assert len(page.cells) == len(doc["rows"]) * len(doc["architectures"])
    reference = str(next(i for i, r in enumerate(doc["rows"]) if r["implementation"] == REFERENCE))
    classes = {c["data-architecture"]: c["class"].split() for c in page.cells if c["data-row"] == reference}
    assert ("pass" in classes["llama-h64-bf16"] and "partial" in classes["qwen3_5"]
            and "defect" in classes["gemma3_text"])
    assert {limit["data-limit"] for limit in page.limits} == {"solo-kv-bits-raises"}

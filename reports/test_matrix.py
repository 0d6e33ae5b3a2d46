"""kvparity matrix: rows gathered from real report directories (the
reference, the second implementation and a negative control, three L1
schedules each, plus a row that cannot be installed), rendered as
matrix.md, matrix.json (schema-checked) and matrix.html; the exit status as
a render and as a gate. The page in a real headless browser is
reports/test_matrix_page.py's."""

import json
import os
import shlex
import shutil
import stat
import sys
from html.parser import HTMLParser
from pathlib import Path

import jsonschema
import pytest

from kvparity.oracle.models import available_models
from kvparity.reports import matrix, matrix_page
from kvparity.reports.cli import EXIT_BROKEN, EXIT_CANNOT_JUDGE, EXIT_OK, EXIT_USAGE, main
from kvparity.reports.commands import runs
from kvparity.suites.format.schedule import CATALOG

SCHEDULES = ["--level", "L1", *(a for name in ("bits-4", "join-empty", "leave-longest")
                                  for a in ("--schedule", str(CATALOG / f"{name}.json")))]
REFERENCE = "kvparity.impl.batch_quantized:BatchQuantizedKVCache"
SECOND = "kvparity.impl.mlx_style:MlxStyleBatchQuantizedKVCache"
CONTROL = "kvparity.impl.negative_controls:LeftPaddingOffByOne"
CANNOT = {"format": "kvparity.cannot-install/1", "implementation": "mlx_vlm.models.cache:BatchQuantizedKVCache",
          "package": "mlx-vlm", "version": "0.7.10", "mlx_lm": "0.31.3",
          "reason": "needs Python >= 3.12 (this is 3.11)", "command": "uv pip install mlx-vlm==0.7.10"}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """Row folders as the sessions write them: kvparity check --out ROW, a
    bisected minimal schedule for the control, and a cannot-install.json."""
    root = tmp_path_factory.mktemp("rows")
    with pytest.MonkeyPatch.context() as patch:  # the L0 probes are no part of the matrix
        patch.setattr(runs, "probes", lambda model, device: [])
        statuses = {name: main(["check", *SCHEDULES, "--impl", impl, "--out", str(root / name)])
                    for name, impl in (("reference", REFERENCE), ("second", SECOND), ("control", CONTROL))}
    assert statuses == {"reference": EXIT_OK, "second": EXIT_OK, "control": EXIT_BROKEN}
    minimal = root / "control" / matrix.BISECTED / "bits-4-min.json"
    main(["bisect", str(CATALOG / "bits-4.json"), "--level", "L1", "--impl", CONTROL, "--out", str(minimal)])
    assert minimal.is_file()
    (root / "vlm").mkdir()
    (root / "vlm" / matrix.CANNOT_INSTALL).write_text(json.dumps(CANNOT))
    return root


def render(rows, tmp_path, *args, folders=None) -> (int, dict, Path):
    out = tmp_path / "matrix"
    given = [str(rows / f) for f in folders] if folders else [str(rows)]
    status = main(["matrix", *given, "--out", str(out), *args])
    doc = json.loads((out / "matrix.json").read_text()) if (out / "matrix.json").exists() else None
    return status, doc, out


def by_implementation(doc):
    return {row["implementation"]: row for row in doc["rows"]}


def test_rows_columns_and_cells_from_real_reports(rows, tmp_path, capsys):
    status, doc, out = render(rows, tmp_path)
    assert status == EXIT_OK  # rendered, FAILs included
    jsonschema.validate(doc, json.loads((matrix.SCHEMAS / "matrix.schema.json").read_text()))
    assert [c["name"] for c in doc["columns"]][:3] == ["L1", "L2", "L3"]
    found = by_implementation(doc)
    assert set(found) == {REFERENCE, SECOND, CONTROL, CANNOT["implementation"]}
    for impl in (REFERENCE, SECOND, CONTROL):
        row = found[impl]
        record = json.loads((out / row["report"]).with_name("report.json").read_text())
        assert (row["version"], row["mlx_lm"]) == (record["environment"]["implementation_version"],
                                                   record["environment"]["mlx_lm"])
        # The level's cell is the row's run, outcome by outcome; L2 and L3 did not run.
        assert {o: n for o, n in row["cells"]["L1"].items() if n} == {
            o: n for o, n in record["summary"]["schedules"].items() if n}
        assert row["cells"]["L2"] is None and row["cells"]["L3"] is None and row["cells"]["logits"] is None
    assert found[REFERENCE]["cells"]["left_padding"]["pass"] == 3 and not found[REFERENCE]["failing"]
    control = found[CONTROL]
    assert control["cells"]["L1"]["FAIL"] == 2 and control["cells"]["left_padding"]["FAIL"] == 2
    assert control["cells"]["bytes"] == found[REFERENCE]["cells"]["bytes"]  # one broken check hides no other
    vlm = found[CANNOT["implementation"]]
    assert vlm["cannot_install"]["reason"] == CANNOT["reason"] and set(vlm["cells"].values()) == {None}
    markdown = (out / "matrix.md").read_text()
    assert "cannot install: needs Python >= 3.12" in markdown and "1 pass, 2 FAIL" in markdown


def test_a_hygiene_finding_is_reported_not_gating_and_gates_under_strict(tmp_path, capsys):
    """A check that diverged where the policy does not gate it is not a FAIL
    in its cell, and is one where the policy gates it."""
    views = "kvparity.impl.negative_controls:ExtractReturnsViews"
    one = ["--level", "L1", "--schedule", str(CATALOG / "extract-decode-reinsert.json"), "--impl", views]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runs, "probes", lambda model, device: [])
        assert main(["check", *one, "--policy", "cpu", "--out", str(tmp_path / "cpu" / "row")]) == EXIT_OK
        assert main(["check", *one, "--policy", "strict", "--out", str(tmp_path / "strict" / "row")]) == EXIT_BROKEN
    for policy, alias, status in (("cpu", {matrix.REPORTED: 1}, EXIT_OK), ("strict", {"FAIL": 1}, EXIT_BROKEN)):
        gate, doc, _ = render(tmp_path / policy, tmp_path / f"m-{policy}", "--gate")
        (row,) = doc["rows"]
        assert {o: n for o, n in row["cells"]["alias"].items() if n} == alias and gate == status
        assert {o: n for o, n in row["cells"]["bytes"].items() if n} == {"pass": 1}


def test_failing_schedules_link_their_minimal_schedule_and_replay_it(rows, tmp_path, capsys):
    _, doc, out = render(rows, tmp_path)
    failing = {f["schedule"]: f for f in by_implementation(doc)[CONTROL]["failing"]}
    assert set(failing) == {"bits-4", "leave-longest"}
    shrunk, plain = failing["bits-4"], failing["leave-longest"]
    assert shrunk["minimal"] and (out / shrunk["link"]).resolve() == (rows / "control/bisect/bits-4-min.json")
    assert not plain["minimal"] and (out / plain["link"]).resolve() == (CATALOG / "leave-longest.json").resolve()
    for entry in (shrunk, plain):
        argv = shlex.split(entry["replay"])
        assert argv[:2] == ["kvparity", "replay"] and CONTROL in argv
        assert main(argv[1:]) == EXIT_BROKEN  # the command fails as the matrix says
    assert "bits-4-min.json" in (out / "matrix.md").read_text()


def test_exit_status_as_a_render_and_as_a_gate(rows, tmp_path, capsys):
    assert render(rows, tmp_path / "a", "--gate")[0] == EXIT_BROKEN
    assert render(rows, tmp_path / "b", "--gate", folders=["reference", "second"])[0] == EXIT_OK
    assert render(rows, tmp_path / "c", "--gate", folders=["reference", "vlm"])[0] == EXIT_CANNOT_JUDGE
    assert render(rows, tmp_path / "d", folders=["reference", "vlm"])[0] == EXIT_OK
    status, doc, _ = render(rows, tmp_path / "e", folders=["vlm"])  # nothing compared is never 0
    assert status == EXIT_CANNOT_JUDGE and doc["exit_status"] == EXIT_CANNOT_JUDGE


def test_bad_rows_are_refused_naming_the_folder(rows, tmp_path, capsys):
    twice = tmp_path / "twice"
    shutil.copytree(rows / "reference", twice / "reference")
    shutil.copytree(rows / "reference", twice / "again")
    assert render(twice, tmp_path / "a")[0] == EXIT_USAGE
    assert "is also in" in capsys.readouterr().err
    bad = tmp_path / "bad" / "row"
    bad.mkdir(parents=True)
    (bad / matrix.CANNOT_INSTALL).write_text(json.dumps({k: v for k, v in CANNOT.items() if k != "reason"}))
    assert render(bad.parent, tmp_path / "b")[0] == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{bad / matrix.CANNOT_INSTALL}: the file: missing field 'reason'" in err, err
    (tmp_path / "empty").mkdir()
    assert render(tmp_path / "empty", tmp_path / "c")[0] == EXIT_USAGE
    assert "holds no report.json and no cannot-install.json" in capsys.readouterr().err
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runs, "probes", lambda model, device: [])
        assert main(["check", *SCHEDULES, "--shard", "1/2", "--out", str(tmp_path / "shard" / "row")]) == EXIT_OK
    assert render(tmp_path / "shard", tmp_path / "s")[0] == EXIT_USAGE
    assert "merge the shards with kvparity merge" in capsys.readouterr().err
    (tmp_path / "exists" / "matrix").mkdir(parents=True)
    assert render(rows, tmp_path / "exists")[0] == EXIT_USAGE
    assert "never overwritten" in capsys.readouterr().err


def test_sessions_mode_runs_nox_then_gathers(rows, tmp_path, monkeypatch, capsys):
    """A stand-in nox on PATH records its arguments and writes a row, as a session would."""
    bin_dir, written = tmp_path / "bin", tmp_path / "written"
    bin_dir.mkdir()
    fake = bin_dir / "nox"
    fake.write_text(f"#!{sys.executable}\nimport json, pathlib, sys\n"
                    f"row = pathlib.Path({str(written)!r}) / 'vlm'\nrow.mkdir(parents=True)\n"
                    f"(row / 'cannot-install.json').write_text(json.dumps({CANNOT!r}))\n"
                    f"(row.parent / 'argv.json').write_text(json.dumps(sys.argv[1:]))\nsys.exit(1)\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    written.mkdir()
    status = main(["matrix", str(written), "--session", "row-a", "--session", "row-b", "--noxfile", "nf.py",
                   "--out", str(tmp_path / "m")])
    assert json.loads((written / "argv.json").read_text()) == ["-f", "nf.py", "-s", "row-a", "row-b"]
    assert status == EXIT_CANNOT_JUDGE  # the one row it wrote cannot be installed
    assert "nox exited 1" in capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert main(["matrix", str(written), "--session", "x", "--out", str(tmp_path / "n")]) == EXIT_CANNOT_JUDGE
    assert "needs nox" in capsys.readouterr().err


def test_rows_are_named_by_package_and_version_and_no_evidence_is_not_green(rows, tmp_path, capsys):
    _, doc, out = render(rows, tmp_path)
    names = {row["implementation"]: row["name"] for row in doc["rows"]}
    assert names[REFERENCE] == "kvparity BatchQuantizedKVCache " + doc["rows"][0]["version"], names
    assert matrix_page.outcome_class({"pass": 75, "no evidence": 42}, None) == "noevidence"
    assert matrix_page.outcome_class({"pass": 75, "FAIL": 1, "no evidence": 42}, None) == "FAIL"
    assert matrix_page.outcome_class({"pass": 3}, None) == "pass"
    assert matrix_page.outcome_class({"pass": 3, "not supported": 1}, None) == "partial"


def test_a_page_links_only_what_is_there(rows, tmp_path, capsys):
    """A row whose report directory is gone (the checked-in page's rows are
    not checked in) is shown without a link to it."""
    moved = tmp_path / "rows"
    shutil.copytree(rows, moved)
    _, doc, out = render(moved, tmp_path / "a")
    report = next(row["report"] for row in doc["rows"] if row["implementation"] == REFERENCE)
    assert report and (out / report).is_file()
    path = (out / report).resolve()
    path.unlink()
    assert matrix._link(path, out) is None
    _, doc, out = render(moved, tmp_path / "b", "--no-report-links")
    assert [row["report"] for row in doc["rows"]] == [None] * len(doc["rows"])
    assert "not published" in (out / "matrix.html").read_text()


@pytest.mark.parametrize("name", ["matrix.schema.json", "cannot-install.schema.json"])
def test_every_schema_property_is_documented(name):
    missing = []

    def walk(node, where):
        if isinstance(node, dict):
            missing.extend(f"{where}/{key}" for key, sub in node.get("properties", {}).items()
                           if "description" not in sub)
            for key, sub in node.items():
                walk(sub, f"{where}/{key}")
        elif isinstance(node, list):
            for i, sub in enumerate(node):
                walk(sub, f"{where}/{i}")

    walk(json.loads((matrix.SCHEMAS / name).read_text()), "#")
    assert not missing


def test_an_adapters_row_carries_the_version_of_the_package_it_adapts():
    from importlib.metadata import version

    from mlx_lm.models.cache import QuantizedKVCache

    from kvparity.reports.environment import implementation_version

    adapter = type("Adapter", (QuantizedKVCache,), {"__module__": "kvparity.impl.ecosystem.some_package"})
    assert implementation_version("kvparity.impl.ecosystem.some_package:Adapter", adapter) == version("mlx-lm")
    assert implementation_version("kvparity.impl.batch_quantized:BatchQuantizedKVCache") == version("kvparity")


# -- the architecture table ------------------------------------------------------------

ARCH_SCHEDULES = ("join-longer-joiner", "spec-round-even")  # of the axis's L2 schedules: a pass, a not supported
ARCH_MODELS = "qwen3_5,gemma3_text"  # a hybrid that mlx-lm batches; one where its solo kv_bits run cannot exist


@pytest.fixture(scope="module")
def arch_rows(rows, tmp_path_factory):
    """Rows whose reports ran L2 on the architecture axis (the reference and
    a control that fails), beside an L1 row (no architecture runs) and a row
    that cannot be installed, copied from ``rows``."""
    from kvparity.suites import runners

    root = tmp_path_factory.mktemp("arch-rows")
    whole = runners.catalog_paths
    with pytest.MonkeyPatch.context() as patch:  # two of the axis's schedules keep the runs few
        patch.setattr(runs, "probes", lambda model, device: [])
        patch.setattr(runners, "catalog_paths", lambda level=None, folder=CATALOG: [
            p for p in whole(level, folder) if p.stem in ARCH_SCHEDULES])
        statuses = {name: main(["check", "--level", "L2", "--models", ARCH_MODELS, "--impl", impl,
                                "--out", str(root / name)])
                    for name, impl in (("reference", REFERENCE), ("control", CONTROL))}
    assert statuses == {"reference": EXIT_OK, "control": EXIT_BROKEN}
    for name in ("second", "vlm"):
        shutil.copytree(rows / name, root / name)
    return root


def runs_on(record, model):
    return [r for r in record["results"] if r["model"] == model]


@pytest.mark.gqa_batched
def test_architecture_cells_from_real_reports(arch_rows, tmp_path, capsys):
    _, doc, out = render(arch_rows, tmp_path)
    jsonschema.validate(doc, json.loads((matrix.SCHEMAS / "matrix.schema.json").read_text()))
    ran = {"llama-h64-bf16", "qwen3_5", "gemma3_text"}
    assert doc["architectures"] == [m for m in available_models() if m in ran]  # as kvparity models lists them
    found = by_implementation(doc)
    reference = found[REFERENCE]
    record = json.loads((out / reference["report"]).with_name("report.json").read_text())
    for model in doc["architectures"]:
        ran = runs_on(record, model)
        assert {o: n for o, n in reference["architectures"][model]["cell"].items() if n} == {
            o: sum(r["verdict"] == o for r in ran) for o in {r["verdict"] for r in ran}}
    assert reference["architectures"]["qwen3_5"]["cell"]["pass"] == 1  # join; rollback is not supported on SSM layers
    assert reference["architectures"]["qwen3_5"]["cell"]["not supported"] == 1
    (limit,) = reference["architectures"]["gemma3_text"]["limits"]
    defect = runs_on(record, "gemma3_text")[0]
    assert limit == {"name": "solo-kv-bits-raises", "attribution": defect["reason"]}
    assert "RotatingKVCache Quantization NYI" in limit["attribution"]
    assert reference["architectures"]["gemma3_text"]["cell"]["mlx-lm defect"] == 2
    assert found[CONTROL]["architectures"]["qwen3_5"]["cell"]["FAIL"] == 2
    # A report without architecture runs (L1 only) and a row that cannot be installed have no cells.
    assert found[SECOND]["architectures"] is None and found[CANNOT["implementation"]]["architectures"] is None
    markdown = (out / "matrix.md").read_text()
    table = markdown.split("## Architectures")[1].split("## Failing schedules")[0]
    line = next(line for line in table.splitlines() if line.startswith("| gemma3_text "))
    assert "2 mlx-lm defect (solo-kv-bits-raises [1])" in line and "cannot install" in line
    assert line.count("—") == 1  # the L1 row's cell: not run, never a count
    assert f"1. `solo-kv-bits-raises` (gemma3_text): {defect['reason']}" in table


class ArchitecturePage(HTMLParser):
    """The architecture table's cells and the limits named in them."""

    def __init__(self):
        super().__init__()
        self.cells, self.limits, self.notes, self._cell = [], [], [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "td" and "data-architecture" in attrs:
            self._cell = {**attrs, "text": ""}
            self.cells.append(self._cell)
        if tag == "abbr" and "data-limit" in attrs:
            self.limits.append(attrs)
        if tag == "li" and "data-limit" in attrs:
            self.notes.append(attrs)

    def handle_data(self, data):
        if self._cell is not None:
            self._cell["text"] += data

    def handle_endtag(self, tag):
        if tag == "td":
            self._cell = None


@pytest.mark.gqa_batched
def test_architecture_page_colours_each_cell_by_its_outcomes(arch_rows, tmp_path, capsys):
    _, doc, out = render(arch_rows, tmp_path)
    page = ArchitecturePage()
    page.feed((out / "matrix.html").read_text())
    assert len(page.cells) == len(doc["rows"]) * len(doc["architectures"])
    index = {r["implementation"]: str(i) for i, r in enumerate(doc["rows"])}
    cell = {(c["data-row"], c["data-architecture"]): c for c in page.cells}
    reference = lambda model: cell[index[REFERENCE], model]
    assert "pass" in reference("llama-h64-bf16")["class"].split()
    assert "partial" in reference("qwen3_5")["class"].split()  # a pass beside a not supported
    defect = reference("gemma3_text")
    assert "defect" in defect["class"].split() and defect["data-mlx-lm-defect"] == "2" and defect["data-pass"] == "0"
    assert "FAIL" in cell[index[CONTROL], "qwen3_5"]["class"].split()
    for model in doc["architectures"]:  # no false cells: not run, or cannot install
        second, vlm = cell[index[SECOND], model], cell[index[CANNOT["implementation"]], model]
        assert (second["class"], second["text"]) == ("cell nothing", "—") and "data-pass" not in second
        assert (vlm["class"], vlm["text"]) == ("cell cannot", "cannot install") and "data-pass" not in vlm
    named = {limit["data-limit"]: limit["title"] for limit in page.limits}
    attribution = doc["rows"][int(index[REFERENCE])]["architectures"]["gemma3_text"]["limits"][0]["attribution"]
    assert named == {"solo-kv-bits-raises": attribution}  # the attribution on hover
    assert [n["data-limit"] for n in page.notes] == ["solo-kv-bits-raises"]  # the same text once in the list


@pytest.mark.gqa_batched
def test_a_tampered_verdict_is_judged_again_from_its_evidence(arch_rows, tmp_path, capsys):
    """The cells come from the evidence: a report.json whose gemma3_text
    runs claim to pass still shows mlx-lm's limit."""
    row = tmp_path / "rows" / "reference"
    shutil.copytree(arch_rows / "reference", row)
    (path,) = row.rglob("report.json")
    record = json.loads(path.read_text())
    for result in runs_on(record, "gemma3_text"):
        result["verdict"] = "pass"
    path.write_text(json.dumps(record))
    _, doc, _ = render(tmp_path / "rows", tmp_path / "m")
    (entry,) = doc["rows"]
    assert entry["architectures"]["gemma3_text"]["cell"]["mlx-lm defect"] == 2
    assert entry["architectures"]["gemma3_text"]["cell"]["pass"] == 0


@pytest.mark.gqa_batched
def test_the_run_report_shows_the_architecture_axis(arch_rows):
    """report.md and report.html: a table of model x outcome counts with
    mlx-lm's limits, from the same code as the matrix's (report_json.architectures)."""
    (report,) = (arch_rows / "reference").glob("*/report.md")
    markdown = report.read_text()
    table = markdown.split("## Architectures")[1].split("\n## ")[0]
    header = next(line for line in table.splitlines() if line.startswith("| model"))
    assert [h.strip() for h in header.strip("|").split("|")] == [
        "model", "schedule runs", "pass", "FAIL", "not supported", "mlx-lm defect", "mlx-lm limits", "attribution"]
    gemma = next(line for line in table.splitlines() if line.startswith("| gemma3_text "))
    assert [c.strip() for c in gemma.strip("|").split("|")][:7] == [
        "gemma3_text", "2", "", "", "", "2", "solo-kv-bits-raises"]

    class Section(HTMLParser):
        """The architectures section's rows: (class, text) per cell."""
        inside, rows = False, []

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            self.inside = self.inside or (tag == "section" and attrs.get("id") == "architectures")
            if self.inside and tag == "tr":
                self.rows.append([])
            if self.inside and tag == "td":
                self.rows[-1].append([attrs.get("class", ""), ""])

        def handle_data(self, data):
            if self.inside and self.rows and self.rows[-1]:
                self.rows[-1][-1][1] += data

        def handle_endtag(self, tag):
            self.inside = self.inside and tag != "section"

    page = Section()
    page.feed(report.with_name("report.html").read_text())
    cells = {row[0][1]: dict(zip(["model", "runs", "pass", "FAIL", "not supported", "mlx-lm defect"], row))
             for row in page.rows if row}
    assert cells["gemma3_text"]["mlx-lm defect"] == ["oracle", "2"]  # coloured as mlx-lm's, never as a pass
    assert cells["gemma3_text"]["pass"] == ["", ""] and cells["qwen3_5"]["pass"] == ["pass", "1"]
    assert cells["qwen3_5"]["not supported"] == ["muted", "1"]


def test_an_l4_finding_on_an_architecture_is_reproduced_on_that_model(tmp_path):
    """A server row's run on an axis architecture ("burst on qwen3_5") replays
    its file with --model, or it would replay on the file's own model."""
    served = {"command": "serve {model} {port}", "declares": ["--kv-bits", "4"]}
    record = {"results": [{"schedule": "burst", "model": "llama-h64-f32", "server": served},
                          {"schedule": "burst on qwen3_5", "model": "qwen3_5", "server": served}]}
    row = matrix.Row("serve {model} {port}", "1.0", "0.32.2", tmp_path, record=record)
    burst = CATALOG / "l4" / "burst.json"
    for name, model in (("burst on qwen3_5", "qwen3_5"), ("burst", "llama-h64-f32")):
        _, _, replay = matrix._schedule_of(row, name, str(burst), "L4")
        words = shlex.split(replay)
        assert words[words.index("--model") + 1] == model and words[words.index("--server") + 1] == served["command"]


def test_a_cache_in_another_language_is_a_row_beside_the_python_ones(rows, tmp_path, capsys):
    """The language column: a process cache's own word for its language (its
    hello, in the report's environment), Python for a class kvparity imports."""
    given = tmp_path / "rows"
    shutil.copytree(rows / "reference", given / "reference")
    shutil.copytree(rows / "reference", given / "node")
    (given / "vlm").mkdir()
    (given / "vlm" / matrix.CANNOT_INSTALL).write_text(json.dumps(CANNOT))
    report = next((given / "node").rglob("report.json"))
    record = json.loads(report.read_text())
    record["environment"].update(implementation="exec:node impl/node/cache.mjs", implementation_language="javascript")
    report.write_text(json.dumps(record))
    status, doc, out = render(given, tmp_path)
    assert status == EXIT_OK
    jsonschema.validate(doc, json.loads((matrix.SCHEMAS / "matrix.schema.json").read_text()))
    assert {row["implementation"]: row["language"] for row in doc["rows"]} == {
        REFERENCE: "python", "exec:node impl/node/cache.mjs": "javascript", CANNOT["implementation"]: "python"}
    assert "| language |" in (out / "matrix.md").read_text().replace("  ", " ").replace("  ", " ")
    assert '<td class="language nowrap">javascript</td>' in (out / "matrix.html").read_text()

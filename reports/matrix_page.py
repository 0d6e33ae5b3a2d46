"""The conformance matrix's page: its rows and checks as markdown and as one
self-contained HTML page with the architectures and the findings, written
atomically beside matrix.json (``write_matrix``)."""

import html
import json
from pathlib import Path
from typing import List, Optional

from tabulate import tabulate

from kvparity.oracle.atomic import AtomicDirectory
from kvparity.reports.documents import check_schema
from kvparity.reports.verdicts import STATUS
from kvparity.suites.core.evidence import (
    EXPECTED_DIVERGENCE, FAILURES, MLX_LM_DEFECT, NO_EVIDENCE, ORACLE_CANNOT_RUN, ORACLE_NONDETERMINISTIC,
    PASS,
)

from kvparity.reports.matrix import SCHEMA, SCHEMAS, REPORTED, SHOWN, CELL_OUTCOMES, Row, build


def cell_text(cell: Optional[dict], cannot_install: Optional[dict] = None) -> str:
    if cannot_install is not None:
        return "cannot install"
    if cell is None:
        return "—"
    parts = [f"{cell[o]} {o}" for o in CELL_OUTCOMES if cell[o] or o in SHOWN[:2]]
    return ", ".join(parts)


# -- the architecture table: a row per model, a column per row of the matrix -----------


def architecture_cell(row: dict, model: str) -> Optional[dict]:
    """A matrix row's entry for ``model``: None where its report ran nothing on it."""
    return (row.get("architectures") or {}).get(model)


def architecture_text(entry: Optional[dict], cannot_install, footnote=lambda limit: "") -> str:
    if cannot_install is not None:
        return "cannot install"
    if entry is None:
        return "—"
    text = ", ".join(f"{n} {o}" for o, n in entry["cell"].items() if n)
    limits = ", ".join(f"{limit['name']}{footnote(limit)}" for limit in entry["limits"])
    return f"{text} ({limits})" if limits else text


def architecture_class(entry: Optional[dict], cannot_install) -> str:
    return outcome_class(None if entry is None else entry["cell"], cannot_install)


def outcome_class(counts: Optional[dict], cannot_install) -> str:
    """A cell's colour from its counts by outcome: FAIL where a run failed;
    pass only where every run passed; no evidence, an mlx-lm defect or limit,
    and not supported each their own, never a pass; runs that passed beside
    runs that stopped, partial."""
    if cannot_install is not None:
        return "cannot"
    if counts is None:
        return "nothing"
    ran = {o for o, n in counts.items() if n}
    judged = ran & {PASS, EXPECTED_DIVERGENCE, REPORTED}
    if ran & set(FAILURES):
        return "FAIL"
    if NO_EVIDENCE in ran:
        return "noevidence"
    if judged and ran == judged:
        return "expected" if ran & {EXPECTED_DIVERGENCE, REPORTED} else "pass"
    if judged:
        return "partial"
    if ran & {MLX_LM_DEFECT, ORACLE_CANNOT_RUN, ORACLE_NONDETERMINISTIC}:
        return "defect"
    return "muted"


def limit_notes(doc: dict) -> List[dict]:
    """Each distinct mlx-lm limit on the page, numbered from 1, with the
    architectures it stopped: the footnotes the cells point to."""
    notes = {}
    for row in doc["rows"]:
        for model, entry in (row.get("architectures") or {}).items():
            for limit in entry["limits"]:
                note = notes.setdefault((limit["name"], limit["attribution"]), {**limit, "architectures": []})
                if model not in note["architectures"]:
                    note["architectures"].append(model)
    return [{**note, "number": i} for i, note in enumerate(notes.values(), 1)]


def _numbering(notes):
    number = {(n["name"], n["attribution"]): n["number"] for n in notes}
    return lambda limit: f" [{number[limit['name'], limit['attribution']]}]"


def _row_label(row: dict) -> str:
    return row.get("name") or f"{row['implementation']} {row['version'] or 'unknown version'}"


def language_text(row: dict) -> str:
    """A row's language (matrix.json from before the column has none)."""
    return row.get("language") or "—"


def verdict_text(row: dict) -> str:
    """A row's verdict in words: cannot install (why), or its exit status's meaning."""
    if row["cannot_install"] is not None:
        return f"cannot install: {row['cannot_install']['reason']}"
    return STATUS.get(row["exit_status"], f"exit status {row['exit_status']}")


SHOWN_FINDINGS = 3  # in the first table; every one is in the findings below it


def finding_titles(row: dict) -> List[str]:
    titles = [f["title"] for f in row.get("findings", [])]
    more = len(titles) - SHOWN_FINDINGS
    return titles[:SHOWN_FINDINGS] + ([f"{more} more below"] if more > 0 else [])


ARCHITECTURES_NOTE = ("Each cell counts a row's schedule runs on the model by outcome, with the mlx-lm limits that "
                      "stopped them (numbered below; — : the row ran nothing on it).")


def _architectures_markdown(doc: dict) -> List[str]:
    lines = ["## Architectures", "", ARCHITECTURES_NOTE, ""]
    if not doc["architectures"]:
        return lines + ["(no row ran a schedule on a model)", ""]
    notes = limit_notes(doc)
    footnote = _numbering(notes)
    table = [[model] + [architecture_text(architecture_cell(row, model), row["cannot_install"], footnote)
                        for row in doc["rows"]] for model in doc["architectures"]]
    headers = ["architecture"] + [f"{_row_label(row)} x mlx-lm {row['mlx_lm'] or ''}" for row in doc["rows"]]
    lines += [tabulate(table, headers, tablefmt="github"), ""]
    lines += [f"{n['number']}. `{n['name']}` ({', '.join(n['architectures'])}): {n['attribution']}" for n in notes]
    return lines + ([""] if notes else [])


INTRO = ("Each cell counts schedule runs: a level's by outcome, a check's by what became of it where it applies "
         "(— : not run, or does not apply). A row is a package at a version on an mlx-lm version.")


def render_markdown(doc: dict) -> str:
    lines = ["# kvparity conformance matrix", "", f"Written {doc['created']} ({SCHEMA}). {INTRO}", ""]
    levels = [c["name"] for c in doc["columns"] if c["kind"] == "level"]
    checks = [c["name"] for c in doc["columns"] if c["kind"] == "check"]
    table = [[_row_label(row), language_text(row), row["mlx_lm"] or "", verdict_text(row)]
             + [cell_text(row["cells"][c], row["cannot_install"]) for c in levels]
             + ["; ".join(finding_titles(row)) or "—", f"[report]({row['report']})" if row["report"] else "not published"]
             for row in doc["rows"]]
    lines += ["## Rows", "", tabulate(table, ["row", "language", "mlx-lm", "verdict", *levels, "findings", "report"],
                                      tablefmt="github"), ""]
    table = [[_row_label(row), row["mlx_lm"] or ""] + [cell_text(row["cells"][c], row["cannot_install"])
                                                       for c in checks] for row in doc["rows"]]
    lines += ["## Checks", "", tabulate(table, ["row", "mlx-lm", *checks], tablefmt="github"), ""]
    lines += _architectures_markdown(doc)
    lines += ["## Findings", "", "One per root cause in each row, with the schedule to replay (the minimal one "
              "where kvparity bisect shrank it).", ""]
    found = [row for row in doc["rows"] if row.get("findings")]
    if not found:
        lines += ["(none)", ""]
    for row in found:
        lines += [f"### {_row_label(row)} on mlx-lm {row['mlx_lm']}", ""]
        for f in row["findings"]:
            what = "minimal schedule" if f["minimal"] else "schedule"
            lines += [f"- **{f['title']}**", f"  - first divergence: {f['first']}"]
            if f["expected"] is not None:
                lines += [f"  - expected `{f['expected']}`, got `{f['actual']}`"]
            if f["shrunk_events"]:
                lines += [f"  - shrunk schedule: {'; '.join(f['shrunk_events'])}"]
            if f["seen_as"]:
                lines += [f"  - seen as: {'; '.join(f['seen_as'])}"]
            if f["link"]:
                lines += [f"  - [{what}]({f['link']})" + (f": `{f['replay']}`" if f["replay"] else "")]
            if f["schedules"] > 1:
                lines += [f"  - also: {', '.join(m for m in f['members'])}"]
        lines += [""]
    lines += [f"Exit status {doc['exit_status']} ({'as a gate' if doc['gate'] else 'rendered'})."]
    return "\n".join(lines) + "\n"


STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 13px; width: 100%; margin-bottom: 1em; }
th, td { border: 1px solid #ccc; padding: 4px 6px; vertical-align: top; overflow-wrap: anywhere; }
th[scope="row"] { min-width: 11em; overflow-wrap: normal; } td.nowrap { white-space: nowrap; }
th { background: #f3f3f3; text-align: left; }
.pass { background: #e3f4e1; } .FAIL { background: #f8d7d5; } .expected { background: #fdf1d0; }
.nothing { background: #ffffff; color: #777; } .cannot { background: #e5e5f5; }
.noevidence { background: #fbe0c0; } .defect { background: #d6e4f2; } .muted { background: #eeeeee; color: #555; }
.partial { background: repeating-linear-gradient(135deg, #e3f4e1 0 6px, #eeeeee 6px 12px); }
.legend span { display: inline-block; padding: 1px 6px; margin: 0 4px 4px 0; border: 1px solid #ccc; }
abbr.limit { text-decoration: underline dotted; cursor: help; }
code { font-size: 12px; overflow-wrap: anywhere; }
ul.findings > li { margin-bottom: .6em; }
"""
LEGEND = (("pass", "every run passed"), ("FAIL", "a run failed"), ("expected", "declared divergences only"),
          ("noevidence", "no evidence: nothing compared where the level requires it"),
          ("partial", "passes beside runs that could not be judged"),
          ("defect", "mlx-lm's own defect or limit"), ("muted", "not supported"), ("cannot", "cannot install"),
          ("nothing", "not run, or does not apply"))


def _cells_html(row: dict, i: int, names: List[str]) -> str:
    e = html.escape
    return "".join(
        f'<td class="cell {outcome_class(row["cells"][c], row["cannot_install"])}" data-row="{i}" '
        f'data-column="{e(c)}"' + "".join(f' data-{o.replace(" ", "-").replace(",", "")}="{row["cells"][c][o]}"'
                                          for o in CELL_OUTCOMES if row["cells"][c] is not None)
        + f'>{e(cell_text(row["cells"][c], row["cannot_install"]))}</td>' for c in names)


def _findings_html(doc: dict) -> str:
    e = html.escape
    out = []
    for i, row in enumerate(doc["rows"]):
        if not row.get("findings"):
            continue
        items = []
        for f in row["findings"]:
            what = "minimal schedule" if f["minimal"] else "schedule"
            parts = [f"<strong>{e(f['title'])}</strong>", f"<div>first divergence: {e(f['first'] or '')}</div>"]
            if f["expected"] is not None:
                parts.append(f"<div>expected <code>{e(f['expected'])}</code>, got <code>{e(f['actual'])}</code></div>")
            if f["shrunk_events"]:
                parts.append(f"<div>shrunk schedule: <code>{e('; '.join(f['shrunk_events']))}</code></div>")
            if f["seen_as"]:
                parts.append(f"<div>seen as: {e('; '.join(f['seen_as']))}</div>")
            if f["link"]:
                parts.append(f'<div><a class="schedule" href="{e(f["link"])}">{what}</a>'
                             + (f': <code class="replay">{e(f["replay"])}</code>' if f["replay"] else "") + "</div>")
            if f["schedules"] > 1:
                parts.append(f"<details><summary>{f['schedules']} schedule runs</summary>"
                             f"{e(', '.join(f['members']))}</details>")
            items.append(f'<li data-row="{i}">{"".join(parts)}</li>')
        out.append(f"<h3>{e(_row_label(row))} on mlx-lm {e(row['mlx_lm'] or '')}</h3>"
                   f'<ul class="findings">{"".join(items)}</ul>')
    return ("<h2>Findings</h2><p>One per root cause in each row, with the schedule to replay (the minimal one where "
            "kvparity bisect shrank it).</p>" + ("".join(out) or '<p id="no-findings">none</p>'))


def render_html(doc: dict) -> str:
    """One self-contained page: no script, no style sheet or font from elsewhere.
    Its first table says which rows failed and why; it reads at 1280 px."""
    e = html.escape
    levels = [c["name"] for c in doc["columns"] if c["kind"] == "level"]
    checks = [c["name"] for c in doc["columns"] if c["kind"] == "check"]
    rows, check_rows = [], []
    for i, row in enumerate(doc["rows"]):
        name = f'<th scope="row" title="{e(row["implementation"])}">{e(_row_label(row))}</th>'
        mlx_lm = f'<td class="nowrap">{e(row["mlx_lm"] or "")}</td>'
        report = f'<a class="report" href="{e(row["report"])}">report</a>' if row["report"] else "not published"
        language = f'<td class="language nowrap">{e(language_text(row))}</td>'
        findings = "<br>".join(e(t) for t in finding_titles(row)) or "—"
        rows.append(f'<tr data-row="{i}">{name}{language}{mlx_lm}<td class="verdict">{e(verdict_text(row))}</td>'
                    f'{_cells_html(row, i, levels)}<td>{findings}</td><td class="nowrap">{report}</td></tr>')
        check_rows.append(f'<tr data-row="{i}">{name}{mlx_lm}{_cells_html(row, i, checks)}</tr>')
    legend = "".join(f'<span class="{css}">{e(words)}</span>' for css, words in LEGEND)
    level_head = "".join(f'<th class="level">{e(c)}</th>' for c in levels)
    check_head = "".join(f'<th class="check">{e(c)}</th>' for c in checks)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>kvparity conformance matrix</title>'
            f'<meta name="viewport" content="width=device-width"><style>{STYLE}</style></head><body>'
            f"<h1>kvparity conformance matrix</h1><p>Written {e(doc['created'])}. {e(INTRO)}</p>"
            f'<p class="legend">{legend}</p>'
            f'<table id="matrix"><thead><tr><th>row</th><th>language</th><th>mlx-lm</th><th>verdict</th>{level_head}'
            f"<th>findings</th><th>report</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
            f'<h2>Checks</h2><table id="checks"><thead><tr><th>row</th><th>mlx-lm</th>{check_head}</tr></thead>'
            f"<tbody>{''.join(check_rows)}</tbody></table>{_architectures_html(doc)}{_findings_html(doc)}"
            f"<p>Exit status {doc['exit_status']} ({'as a gate' if doc['gate'] else 'rendered'}).</p>"
            "</body></html>\n")


def _architectures_html(doc: dict) -> str:
    """The architecture table: a row per model, a cell per matrix row, each
    limit named with its attribution on hover and in the list below."""
    e = html.escape
    intro = f"<h2>Architectures</h2><p>{e(ARCHITECTURES_NOTE)}</p>"
    if not doc["architectures"]:
        return intro + '<p id="architectures">(no row ran a schedule on a model)</p>'
    notes = limit_notes(doc)
    number = _numbering(notes)

    head = "".join(f"<th>{e(_row_label(row))}<br>mlx-lm {e(row['mlx_lm'] or '')}</th>" for row in doc["rows"])
    body = []
    for model in doc["architectures"]:
        cells = []
        for i, row in enumerate(doc["rows"]):
            entry = architecture_cell(row, model)
            counts = "".join(f' data-{o.replace(" ", "-")}="{n}"' for o, n in (entry or {}).get("cell", {}).items())
            text = e(architecture_text(entry, row["cannot_install"]))
            if entry and entry["limits"] and row["cannot_install"] is None:
                counts_text = e(", ".join(f"{n} {o}" for o, n in entry["cell"].items() if n))
                limits = ", ".join(
                    f'<abbr class="limit" data-limit="{e(limit["name"])}" title="{e(limit["attribution"])}">'
                    f'{e(limit["name"])}</abbr><sup>{e(number(limit).strip())}</sup>' for limit in entry["limits"])
                text = f"{counts_text} ({limits})"
            cells.append(f'<td class="cell {architecture_class(entry, row["cannot_install"])}" data-row="{i}" '
                         f'data-architecture="{e(model)}"{counts}>{text}</td>')
        body.append(f'<tr data-architecture="{e(model)}"><th scope="row">{e(model)}</th>{"".join(cells)}</tr>')
    items = "".join(f'<li data-limit="{e(n["name"])}" value="{n["number"]}"><code>{e(n["name"])}</code> '
                    f'({e(", ".join(n["architectures"]))}): {e(n["attribution"])}</li>' for n in notes)
    return (intro + f'<table id="architectures"><thead><tr><th>architecture</th>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>" + (f'<ol id="limits">{items}</ol>' if items else ""))


class MatrixDirectory(AtomicDirectory):
    """The matrix directory, appearing whole; never overwritten."""


def check_document(doc: dict):
    check_schema(doc, SCHEMAS / "matrix.schema.json", "matrix.json", RuntimeError)


def write_matrix(rows: List[Row], out, gate: bool = False, report_links: bool = True) -> (Path, dict):
    """matrix.md, matrix.json and matrix.html in the new directory ``out``."""
    out = Path(out)
    doc = build(rows, out, gate, report_links)
    check_document(doc)  # a wiring bug here is kvparity's own: it raises
    directory = MatrixDirectory(out.parent, out.name)
    with directory as staging:
        (staging / "matrix.json").write_text(json.dumps(doc, indent=2) + "\n")
        (staging / "matrix.md").write_text(render_markdown(doc))
        (staging / "matrix.html").write_text(render_html(doc))
    return directory.path, doc

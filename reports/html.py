"""report.html: one self-contained page (inline CSS and SVG, no script, no
network) with the environment, the tables, and per schedule the divergences
over steps and a layer x step heatmap of where each row first diverged.

Rendered from the report.json record. Each outcome has its own colour and
label, so "refused", "no evidence", "not supported" and "oracle cannot run"
never read as one another or as a pass. SVG elements carry ids and data-*
attributes (row, step, layer, count) so tests can read the plots back out of
a browser's DOM.
"""

import math
import re
from collections import Counter
from html import escape

from kvparity.reports.environment import flatten
from kvparity.reports.expectations import UNEXPECTEDLY_PASSING
from kvparity.reports.policy import GATE
from kvparity.reports.verdicts import DIVERGED, EXIT_BROKEN, EXIT_OK, HELD, NOT_COMPARED, STATUS
from kvparity.suites.format.checks import LOGITS, TOKENS
from kvparity.suites.core.evidence import (
    EXPECTED_DIVERGENCE, FAIL, MLX_LM_DEFECT, NO_EVIDENCE, NOT_JUDGED, NOT_SUPPORTED, ORACLE_CANNOT_RUN,
    ORACLE_NONDETERMINISTIC, PASS, REFUSED,
)
from kvparity.suites.format.levels import L2, LEVELS

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
# outcome -> (css class, what it means, shown on hover)
OUTCOME = {
    PASS: ("pass", "every required check compared something and nothing gating diverged"),
    FAIL: ("fail", "a gating divergence: parity broken"),
    REFUSED: ("refused", "a required member raised NotImplementedError: a failure"),
    NO_EVIDENCE: ("noevidence", "nothing the policy requires was compared: not a pass"),
    NOT_SUPPORTED: ("muted", "needs an optional capability the implementation lacks"),
    ORACLE_CANNOT_RUN: ("oracle", "mlx-lm's own solo path cannot run on this backend"),
    ORACLE_NONDETERMINISTIC: ("oracle", "mlx-lm's own solo path differs from itself between two runs"),
    MLX_LM_DEFECT: ("oracle", "the installed mlx-lm's own batched path is wrong for this model whatever the cache holds"),
    EXPECTED_DIVERGENCE: ("expected", "every divergence was declared in the expectations file; evidence complete"),
    NOT_JUDGED: ("muted", "it calls a member that hung earlier in the run, which is not called again"),
}
# Columns of the per-check table: a non-zero count is coloured as its state.
CHECK_CLASS = {HELD: "pass", DIVERGED: "fail", EXPECTED_DIVERGENCE: "expected", NOT_COMPARED: "muted"}
STATUS_CLASS = {EXIT_OK: "pass", EXIT_BROKEN: "fail"}  # anything else: cannot judge
TIER_CLASS = (("bit-exact", "pass"), ("ulp", "warn"), ("kl", "warn"), ("diverged", "fail"))
SHOWN = 25  # divergences listed per row; report.json has them all

STYLE = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1d2733;color:#eee;padding:16px 24px}
header h1{margin:0 0 4px;font-size:22px}
.meta{color:#aab;margin:0 0 10px}
.env{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:2px 24px;margin:8px 0 0;font-size:12px}
.env div{display:flex;gap:8px;overflow:hidden}.env dt{color:#aab;white-space:nowrap}.env dd{margin:0;word-break:break-all}
main{padding:8px 24px 40px}
h2{margin:28px 0 8px;font-size:18px}
.badge{display:inline-block;padding:2px 10px;border-radius:10px;margin-right:6px;font-weight:600;background:#445}
.badge.pass{background:#2e7d32}.badge.fail{background:#c62828}.badge.muted{background:#666}
.badge.refused{background:#6a1b9a}.badge.noevidence{background:#b26a00}.badge.oracle{background:#37618a}
.badge.expected{background:#00796b}
.status{font-weight:600}.status.pass{color:#8fd694}.status.fail{color:#ff8a80}.status.cannot{color:#ffcc80}
.scroll{overflow-x:auto}
table{border-collapse:collapse;font-size:12px;background:#fff}
th,td{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top;white-space:nowrap}
td:last-child{white-space:normal;min-width:320px}
#failures td{white-space:normal;overflow-wrap:break-word;word-break:normal;min-width:0}
th{background:#eef0f3;position:sticky;top:0}
td.pass{color:#2e7d32;font-weight:600}td.fail{color:#c62828;font-weight:600}
td.warn{color:#b26a00;font-weight:600}td.muted{color:#777}
td.refused{color:#6a1b9a;font-weight:600}td.noevidence{color:#b26a00;font-weight:600}td.oracle{color:#37618a}
td.expected{color:#00796b;font-weight:600}
li.hygiene{color:#777}li.declared{color:#00796b}
details.schedule{background:#fff;border:1px solid #ddd;border-radius:6px;margin:10px 0;padding:6px 12px}
details.schedule>summary{cursor:pointer;font-weight:600}
details.row>summary{cursor:pointer;font-size:13px}
.plots{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start;margin:8px 0}
figure{margin:0}figcaption{font-size:12px;color:#555}
figure.heat{max-width:340px}
svg text{font-family:inherit;font-size:11px;fill:#333}
ol.divergences{font:11px/1.35 ui-monospace,Menlo,Consolas,monospace;margin:4px 0;padding-left:28px}
.note{color:#666}
"""


def render(record: dict, tables) -> str:
    """The page; ``tables`` are report.md's (title, headers, rows), Summary first."""
    env = record["environment"]
    counts = record["summary"]["schedules"]
    badges = "".join(
        f'<span class="badge {OUTCOME[v][0]}" title="{escape(OUTCOME[v][1])}">{counts[v]} {escape(v)}</span>'
        for v in counts if counts[v]
    )
    items = "".join(
        f"<div><dt>{escape(k)}</dt><dd>{escape(_str(v)) or '—'}</dd></div>" for k, v in flatten(env).items()
    )
    status = record["exit_status"]
    title = f"kvparity report: {env.get('implementation') or ''}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>",
        f'<header><h1>kvparity report</h1><p class="meta">written {escape(record["created"])} · '
        f'{escape(record["schema"])} · <span id="status" class="status {STATUS_CLASS.get(status, "cannot")}" '
        f'data-exit="{status}">{escape(STATUS.get(status, ""))} (exit {status})</span> · '
        f'{escape(record["headline"])}</p>',
        f'<div id="verdicts">{badges}</div><dl class="env" id="environment">{items}</dl></header><main>',
    ]
    (summary, *rest) = tables
    # Why the run failed or could not be judged, on the first screen.
    for title, anchor in (("Failures", "failures"), ("Coverage gaps", "gaps")):
        found = [t for t in rest if t[0].startswith(title)]
        if found:
            parts.append(_table_section(found[0], anchor))
            rest.remove(found[0])
    parts.append(_table_section(summary, "summary"))
    parts.append(_schedules_section(record["results"], record["policy"].get("hygiene") == GATE))
    parts += [_table_section(t, _anchor(t[0], i)) for i, t in enumerate(rest)]
    parts.append("</main></body></html>\n")
    return "\n".join(parts)


def _anchor(title, index) -> str:
    """Stable ids for the sections tests and readers link to."""
    for name in ("Coverage gaps", "Coverage model", "Coverage", "Protocol members", "Hygiene", "Rows", "Logits", "Checks",
                 "Declared divergences", "Architectures"):
        if title.startswith(name):
            return _slug(name.lower()).replace("_", "-")
    return f"table-{index}"


# --- tables ----------------------------------------------------------------


def _table_section(table, anchor) -> str:
    title, headers, rows = table
    head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_cell(h, v) for h, v in zip(headers, row)) + "</tr>" for row in rows)
    return (f'<section id="{anchor}"><h2>{escape(title)}</h2><div class="scroll"><table>'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div></section>")


def _cell(header, value) -> str:
    """A cell, coloured in the columns that judge: verdict, tier, calls,
    a check's states, a declaration's status."""
    text = _str(value)
    css = ""
    if header == "verdict":
        css = OUTCOME.get(text, ("",))[0]
    elif header in OUTCOME:  # a count of schedule runs with that outcome: coloured where not none
        css = OUTCOME[header][0] if text.split(" ")[0] not in ("", "0") else ""
    elif header in CHECK_CLASS and not text.startswith("0 "):
        css = CHECK_CLASS[header]
    elif header == "status" and text == UNEXPECTEDLY_PASSING:
        css = "warn"
    elif header == "tier":
        css = next((c for prefix, c in TIER_CLASS if text.startswith(prefix)), "")
    elif header == "calls" and text == "0":
        css = "warn"  # a protocol member the run never exercised
    return f'<td class="{css}">{escape(text)}</td>' if css else f"<td>{escape(text)}</td>"


def _str(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# --- per schedule: plots and divergences -----------------------------------


def _schedules_section(results, hygiene_gates: bool) -> str:
    cards = [_schedule_card(i, r, hygiene_gates) for i, r in enumerate(results)]
    cards = [c for c in cards if c]
    if not cards:
        return ('<section id="plots"><h2>Divergence over steps</h2>'
                '<p class="note">No divergences: every row matched its solo run.</p></section>')
    return '<section id="plots"><h2>Divergence over steps</h2>' + "".join(cards) + "</section>"


def _schedule_card(index, result, hygiene_gates: bool) -> str:
    """Plots and divergence lists of a schedule with divergences; its
    per-step series only there (elsewhere they are flat at zero). The bars
    count what gates: hygiene findings (unless the policy gates them) and
    declared divergences are in the lists, not the bars."""
    rows = result["rows"]
    diverged = [row for row in rows if row["divergences"]]
    if not diverged:
        return ""
    series = sorted({name for row in rows for name in (row.get("series") or {})})
    key = f"{result['level']}-{_slug(result['schedule'])}-{index}"
    colors = {row["request"]: PALETTE[i % len(PALETTE)] for i, row in enumerate(rows)}
    gating = [{**row, "divergences": [d for d in row["divergences"] if _gates(d, hygiene_gates)]} for row in diverged]
    figures = [_steps_chart(key, result, [row for row in gating if row["divergences"]], colors)]
    figures += [_series_chart(key, name, rows, colors) for name in series]
    if result["level"] == L2:
        figures += [_heatmap(key, result, row) for row in diverged]
    lists = "".join(_divergence_list(row, hygiene_gates, LEVELS[result["level"]].logit_tiers) for row in diverged)
    parity = sum(any(d["kind"] == "parity" for d in row["divergences"]) for row in rows)
    hygiene = sum(d["kind"] == "hygiene" for row in rows for d in row["divergences"])
    found = f"{parity} of {len(rows)} rows diverged" + (f", {hygiene} hygiene finding(s)" if hygiene else "")
    opened = " open" if result["verdict"] == FAIL else ""
    return (f'<details class="schedule" id="schedule-{key}"{opened}><summary>{escape(result["level"])} '
            f'{escape(result["schedule"])}: {escape(result["verdict"])} ({found})</summary>'
            f'<div class="plots">{"".join(f for f in figures if f)}</div>{lists}</details>')


def _divergence_list(row, hygiene_gates: bool, logit_tiers: bool) -> str:
    """A row's divergences, what gates first (in the order seen), then what
    does not, said so; the row's verdict, and its logits' tier where the
    level has one (a logits tier says nothing of the cache's bytes)."""
    ordered = sorted(row["divergences"], key=lambda d: not _gates(d, hygiene_gates))
    shown = ordered[:SHOWN]
    more = len(ordered) - len(shown)
    items = "".join(f'<li class="{_kind(d)}">{"(hygiene, not gating) " if d["kind"] == "hygiene" else ""}'
                    f'{"(declared, not gating) " if d.get("declared") is not None else ""}{escape(d["message"])}</li>'
                    for d in shown)
    tail = f'<p class="note">… {more} more in report.json</p>' if more > 0 else ""
    tier = f", logits {escape(str(row['tier']))}" if logit_tiers and row.get("tier") else ""
    return (f"<details class=\"row\"><summary>row <b>{escape(row['request'])}</b>: "
            f"{escape(str(row.get('verdict', '')))}, {len(row['divergences'])} divergence(s){tier}</summary>"
            f"<ol class=\"divergences\">{items}</ol>{tail}</details>")


def _gates(divergence, hygiene_gates: bool) -> bool:
    return divergence.get("declared") is None and (divergence["kind"] != "hygiene" or hygiene_gates)


def _kind(divergence) -> str:
    return "declared" if divergence.get("declared") is not None else divergence["kind"]


def _x(divergence):
    """The step of a divergence: its request's step (L2) or, where it has
    none (L1), the index of the event after which it was seen."""
    if divergence.get("step") is not None:
        return divergence["step"]
    return divergence["event_index"] if divergence["event_index"] >= 0 else None


# Plot geometry (px): the drawing area sits inside these margins.
W, H, LEFT, RIGHT, TOP, BOTTOM = 460, 200, 52, 10, 40, 34


def _steps_chart(key, result, rows, colors) -> str:
    """Grouped bars: gating divergences per step, one bar per row."""
    if not rows:
        return ""
    counts = {row["request"]: Counter(x for x in map(_x, row["divergences"]) if x is not None) for row in rows}
    xs = [x for c in counts.values() for x in c]
    if not xs:
        return ""
    lo, hi = min(xs), max(xs)
    peak = _nice(max(n for c in counts.values() for n in c.values()))
    axis = "step" if result["level"] == L2 else "event"
    slot = (W - LEFT - RIGHT) / (hi - lo + 1)
    bar = slot * 0.8 / len(rows)
    out = [_frame(f"steps-{key}", "gating divergences per " + axis, axis, lo, hi, peak, slot)]
    for r, (rid, c) in enumerate(counts.items()):
        color = colors[rid]
        for x, n in sorted(c.items()):
            h = (H - TOP - BOTTOM) * n / peak
            px = LEFT + (x - lo) * slot + slot * 0.1 + r * bar
            out.append(f'<rect class="bar" data-row="{escape(rid)}" data-step="{x}" data-count="{n}" '
                       f'x="{px:.1f}" y="{H - BOTTOM - h:.1f}" width="{max(bar, 1):.1f}" height="{h:.1f}" '
                       f'fill="{color}"><title>row {escape(rid)}, {axis} {x}: {n} divergence(s)</title></rect>')
    out.append(_legend({rid: colors[rid] for rid in counts}))
    out.append("</svg>")
    return f"<figure>{''.join(out)}</figure>"


def _series_chart(key, name, rows, colors) -> str:
    """Lines: a per-step series of each row (e.g. KL or max abs logit diff)."""
    lines = {}
    for row in rows:
        values = (row.get("series") or {}).get(name) or []
        points = [(i, float(v)) for i, v in enumerate(values) if _finite(v)]
        if points:
            lines[row["request"]] = points
    if not lines:
        return ""
    xs = [x for pts in lines.values() for x, _ in pts]
    lo, hi = min(xs), max(xs)
    peak = _nice(max(y for pts in lines.values() for _, y in pts))
    slot = (W - LEFT - RIGHT) / (hi - lo + 1)
    out = [_frame(f"series-{key}-{_slug(name)}", name + " per step", "step", lo, hi, peak, slot)]
    for rid, points in lines.items():
        color = colors[rid]
        xy = [(LEFT + (x - lo + 0.5) * slot, H - BOTTOM - (H - TOP - BOTTOM) * y / peak) for x, y in points]
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                   f'points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in xy)}"/>')
        for (x, y), (a, b) in zip(points, xy):
            out.append(f'<circle class="point" data-row="{escape(rid)}" data-step="{x}" data-value="{y:.6g}" '
                       f'cx="{a:.1f}" cy="{b:.1f}" r="2.5" fill="{color}">'
                       f"<title>row {escape(rid)}, step {x}: {escape(name)} {y:.4g}</title></circle>")
    out.append(_legend({rid: colors[rid] for rid in lines}))
    out.append("</svg>")
    return f"<figure>{''.join(out)}</figure>"


def _frame(svg_id, title, axis, lo, hi, peak, slot) -> str:
    """An svg's opening tag, title, axes, grid and tick labels."""
    bottom, plot_h = H - BOTTOM, H - TOP - BOTTOM
    out = [f'<svg id="{svg_id}" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" role="img"><rect width="{W}" height="{H}" fill="#fff"/>',
           f'<text x="{LEFT}" y="14" font-weight="600">{escape(title)}</text>']
    for frac in (0, 0.5, 1):
        y = bottom - plot_h * frac
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e4e4e4"/>'
                   f'<text x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{_tick(peak * frac)}</text>')
    every = max(1, math.ceil((hi - lo + 1) / 12))  # at most a dozen step labels
    for x in range(lo, hi + 1, every):
        px = LEFT + (x - lo + 0.5) * slot
        out.append(f'<text x="{px:.1f}" y="{bottom + 14}" text-anchor="middle">{x}</text>')
    out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{bottom}" y2="{bottom}" stroke="#888"/>'
               f'<text x="{(LEFT + W - RIGHT) / 2:.0f}" y="{H - 4}" text-anchor="middle">{axis}</text>')
    return "".join(out)


def _legend(colors) -> str:
    out = []
    for r, (label, color) in enumerate(colors.items()):  # one line under the title
        x = LEFT + 70 * r
        out.append(f'<rect x="{x}" y="20" width="10" height="10" fill="{color}"/>'
                   f'<text x="{x + 14}" y="29">{escape(_clip(label, 8))}</text>')
    return "".join(out)


# Heatmap cell size (px) and the left gutter for its labels.
CELL, GUTTER = 18, 52


def _heatmap(key, result, row) -> str:
    """Rows are the logits track then layers 0..L, columns steps; a cell's
    colour counts the row's divergences there, and the row's first
    divergence is outlined."""
    placed = [d for d in row["divergences"] if d.get("step") is not None
              and (d.get("layer") is not None or d["check"] in (LOGITS, TOKENS))]
    if not placed:
        return ""
    every_divergence = [d for r in result["rows"] for d in r["divergences"]]
    layers = [d["layer"] for d in every_divergence if d.get("layer") is not None]
    tracks = ["logits"] + [f"layer {n}" for n in range(max(layers) + 1 if layers else 0)]
    steps = [d["step"] for d in every_divergence if d.get("step") is not None]
    lo, hi = min(steps), max(steps)  # one step axis for all rows of the schedule

    def track(d):
        return 0 if d.get("layer") is None else d["layer"] + 1

    counts = Counter((track(d), d["step"]) for d in placed)
    first = min(placed, key=lambda d: (d["event_index"], d["step"]))  # earliest, as in the tables
    peak = max(counts.values())
    cell = CELL if hi - lo < 40 else max(6, 640 // (hi - lo + 1))
    width, height = max(GUTTER + cell * (hi - lo + 1) + 4, 240), 22 + cell * len(tracks) + 18
    rid = row["request"]
    out = [f'<svg id="heat-{key}-{_slug(rid)}" width="{width}" '
           f'height="{height}" viewBox="0 0 {width} {height}" role="img">'
           f'<rect width="{width}" height="{height}" fill="#fff"/><text x="0" y="13" font-weight="600">'
           f"row {escape(_clip(rid, 24))}: divergences by layer and step</text>"]
    for t, label in enumerate(tracks):
        out.append(f'<text x="{GUTTER - 4}" y="{22 + cell * t + cell * 0.7:.1f}" text-anchor="end">{label}</text>')
        for step in range(lo, hi + 1):
            n = counts.get((t, step), 0)
            is_first = (t, step) == (track(first), first["step"])
            stroke = ' stroke="#000" stroke-width="2"' if is_first else ' stroke="#fff"'
            layer = "" if t == 0 else t - 1
            out.append(f'<rect class="cell" data-layer="{layer}" data-step="{step}" data-count="{n}" '
                       f'data-first="{int(is_first)}" x="{GUTTER + cell * (step - lo)}" y="{22 + cell * t}" '
                       f'width="{cell}" height="{cell}" fill="{_heat(n, peak)}"{stroke}>'
                       f"<title>{label}, step {step}: {n} divergence(s){' (first)' if is_first else ''}</title></rect>")
    every = max(1, math.ceil((hi - lo + 1) * cell / 300))
    for step in range(lo, hi + 1, every):
        out.append(f'<text x="{GUTTER + cell * (step - lo + 0.5):.1f}" y="{height - 4}" '
                   f'text-anchor="middle">{step}</text>')
    out.append("</svg>")
    caption = escape(f"outlined, the first: {first['message']}")
    return f'<figure class="heat">{"".join(out)}<figcaption>{caption}</figcaption></figure>'


def _heat(n, peak) -> str:
    """White-grey for none, then light orange to dark red with the count."""
    if n == 0:
        return "#f1f1f1"
    t = n / peak
    low, high = (253, 208, 162), (165, 15, 21)
    return "#" + "".join(f"{round(a + (b - a) * t):02x}" for a, b in zip(low, high))


def _nice(x) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is >= x (> 0)."""
    if not x or x <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(x))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= x)


def _tick(v) -> str:
    """A tick label of at most 5 characters, so the left margin holds it: 25k, not 2.5e+04."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{suffix}"
    return f"{v:.3g}" if v == 0 or abs(v) >= 1e-3 else f"{v:.0e}"


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _slug(text) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "_", str(text))


def _clip(text, width) -> str:
    text = str(text)
    return text if len(text) <= width else text[: width - 1] + "…"

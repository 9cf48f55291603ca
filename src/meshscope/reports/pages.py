"""``meshscope report``: one self-contained HTML file that says which axis costs the job time, and because of whom.

The report is read by a performance engineer, often on a machine with no network: it is one file with inline CSS and
inline SVG (no scripts, fonts or CDNs), and it stays a few MB even for a 16k-rank job. It shows, in order: the job
summary, partial-data warnings, the findings, the cost table (with a bar of where the median step goes), a per-rank
step timeline of the slowest and a median step (drawn by :mod:`meshscope.reports.timelines`), and expected vs measured
collective bytes and memory.

Numbers come from three inputs and nowhere else: the records (:class:`~meshscope.records.RecordTable`), their
breakdown (:class:`~meshscope.analysis.breakdown.Breakdown`) and the analysis dict (``Analysis.to_dict()``, the JSON of
``meshscope analyze``). This module formats; it must not analyse. All text from the inputs (job, node and group names
come from users) is HTML-escaped; every number carries its unit.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from meshscope import __version__
from meshscope.analysis import SYNC_WAIT
from meshscope.formatting import human_bytes, human_seconds, human_si, percent
from meshscope.reports.timelines import COLORS, DEFAULT_TIMELINE_RANKS, HATCH_ID, svg_defs, timeline_section
from meshscope.reports.traces import check_breakdown, degrees

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from meshscope.analysis import Breakdown
    from meshscope.records import RecordTable

_HATCH_CSS = "repeating-linear-gradient(135deg,rgba(122,31,31,.85) 0 2px,rgba(255,255,255,.25) 2px 5px)"
_MAX_TABLE_ROWS = 200


def _e(value: object) -> str:
    """Escape any value for HTML text and attributes."""
    return html.escape(str(value), quote=True)


# ====================================================================== public API


def render_report(
    table: RecordTable,
    bd: Breakdown,
    analysis: Mapping[str, Any],
    *,
    title: str | None = None,
    max_ranks: int = DEFAULT_TIMELINE_RANKS,
) -> str:
    """The HTML report as one self-contained string.

    Args:
        table: the step records.
        bd: their breakdown (``break_down(table)`` or ``Analysis.breakdown``).
        analysis: ``Analysis.to_dict()``: job, summary, rows (the cost table), findings, expected vs measured.
        title: page title; default ``meshscope report — <job>``.
        max_ranks: most rank rows per timeline step (>= 1).

    Returns:
        The HTML document.

    Raises:
        ValueError: if ``bd`` is not the breakdown of ``table`` or ``max_ranks`` < 1.
    """
    check_breakdown(table, bd)
    if max_ranks < 1:
        raise ValueError(f"max_ranks = {max_ranks}; the timeline needs at least 1 row")
    job = str(analysis.get("job") or table.job)
    heading = title if title is not None else f"meshscope report — {job}"
    sections = [
        _header(table, analysis, heading),
        _partial_data(analysis),
        _summary(table, analysis),
        _findings(analysis),
        _cost_table(analysis),
        timeline_section(table, bd, analysis, max_ranks=max_ranks),
        _expected_vs_measured(analysis),
        _footer(table),
    ]
    body = "\n".join(s for s in sections if s)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<meta name="generator" content="meshscope {_e(__version__)}">\n'
        f"<title>{_e(heading)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"{svg_defs()}\n<main>\n{body}\n</main>\n</body>\n</html>\n"
    )


def write_report(
    path: str | Path,
    table: RecordTable,
    bd: Breakdown,
    analysis: Mapping[str, Any],
    *,
    title: str | None = None,
    max_ranks: int = DEFAULT_TIMELINE_RANKS,
) -> Path:
    """Write :func:`render_report`'s document to ``path`` (UTF-8); return the path.

    Raises:
        ValueError: as :func:`render_report`.
        OSError: if the file cannot be written.
    """
    out = Path(path)
    out.write_text(render_report(table, bd, analysis, title=title, max_ranks=max_ranks), encoding="utf-8")
    return out


# ====================================================================== formatting helpers


def _num(value: object) -> float | None:
    """A finite float, or None for null/NaN/non-numbers."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def _secs(value: object) -> str:
    v = _num(value)
    return "–" if v is None else human_seconds(v)


def _pct(value: object) -> str:
    v = _num(value)
    return "–" if v is None else percent(v)


def _fmt_key(key: str, value: object) -> str:  # noqa: C901, PLR0911 - one unit rule per line
    """Format a value by its key's unit suffix (the analysis JSON keeps base units and names them)."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    v = _num(value)
    if v is None:
        return str(value)
    k = key.lower()
    if k.endswith(("_seconds", "_s")):
        return human_seconds(v)
    if k.endswith("_us"):
        return human_seconds(v / 1e6)
    if "bytes" in k:
        return human_bytes(v)
    if "flops" in k and "per_byte" not in k:
        return human_si(v, "FLOP")
    if k.endswith(("share", "ratio", "fraction", "efficiency", "util", "_share_of_step")):
        return percent(v)
    if "gpu_hours" in k:
        return f"{v:,.1f} GPU·h/day"
    if isinstance(value, int) or v.is_integer():
        return f"{int(v):,}"
    return f"{v:.3g}"


def _fmt_header(key: str) -> str:
    return key.replace("_per_", "/").replace("_", " ")


def _rank_text(rank: object) -> str:
    return "–" if rank is None else f"rank {_e(rank)}"


def _swatch(category: str) -> str:
    """A small colour box for a cost-table category (hatched for sync wait)."""
    color, hatched = _category_color(category)
    hatch = f'<rect width="14" height="14" fill="url(#{HATCH_ID})"/>' if hatched else ""
    return (
        f'<svg class="sw" width="14" height="14" aria-hidden="true"><rect width="14" height="14" rx="2" '
        f'fill="{color}"/>{hatch}</svg>'
    )


def _category_color(category: str) -> tuple[str, bool]:
    """Colour of a breakdown category and whether it is drawn hatched."""
    parts = category.split(".")
    if len(parts) == 3 and parts[0] == "comm":
        return COLORS.get(parts[1], COLORS["other"]), parts[2] == SYNC_WAIT
    if category == "compute":
        return COLORS["backward"], False
    return COLORS.get(category, COLORS["other"]), False


# ====================================================================== sections


def _header(table: RecordTable, analysis: Mapping[str, Any], heading: str) -> str:
    steps = analysis.get("steps") or {}
    world = analysis.get("world_size")
    seen = analysis.get("ranks_seen")
    bits = []
    if world is not None:
        bits.append(f"{_fmt_key('n', world)} ranks")
    if seen is not None and seen != world:
        bits.append(f"{_fmt_key('n', seen)} with records")
    if steps:
        bits.append(
            f"steps {_e(steps.get('first', '?'))}–{_e(steps.get('last', '?'))} ({_fmt_key('n', steps.get('count'))})"
        )
    deg = degrees(table)
    layout = " · ".join(f"{a}={d}" for a, d in deg.items() if d > 1) or "one rank"
    bits.append(f"layout seen in records: {_e(layout)}")
    nodes = int(np.unique(table.steps.node).size) if table.n_rows else 0
    bits.append(f"{nodes:,} nodes")
    return f'<header><h1>{_e(heading)}</h1><p class="sub">{" · ".join(bits)}</p></header>'


def _partial_data(analysis: Mapping[str, Any]) -> str:
    notes = analysis.get("partial_data") or []
    if not notes:
        return ""
    items = "".join(
        f"<li><code>{_e(n.get('code', ''))}</code> ({_fmt_key('count', n.get('count'))}): {_e(n.get('message', ''))}"
        "</li>"
        for n in notes
    )
    return (
        '<section class="notice"><h2>Partial data</h2><p>Some input was left out or adjusted; '
        f"the numbers below account for it.</p><ul>{items}</ul></section>"
    )


def _summary(table: RecordTable, analysis: Mapping[str, Any]) -> str:
    s = analysis.get("summary") or {}
    slowest = s.get("slowest_rank")
    slowest_where = ""
    if slowest is not None:
        hit = np.flatnonzero(table.steps.rank == int(slowest))
        if hit.size:
            slowest_where = _e(table.node_name(int(table.steps.node[hit[0]])))
    tiles = [
        ("median step", _secs(s.get("median_step_seconds")), ""),
        ("slowest step", _secs(s.get("max_step_seconds")), ""),
        ("straggler gap", _secs(s.get("straggler_gap_seconds")), "own time beyond its stage's median rank, per step"),
        ("slowest rank", _rank_text(slowest), slowest_where),
        ("efficiency", _pct(s.get("efficiency")), f"ideal step {_secs(s.get('ideal_step_seconds'))}"),
    ]
    cards = "".join(
        f'<div class="tile"><div class="k">{_e(k)}</div><div class="v">{v}</div><div class="n">{n}</div></div>'
        for k, v, n in tiles
    )
    util = _util_tile(s, str(analysis.get("device") or "GPU"))
    return f'<section><h2>Summary</h2><div class="tiles">{cards}{util}</div>{_step_bar(analysis)}</section>'


def _util_tile(s: Mapping[str, Any], device: str) -> str:
    """Useful compute beside reported GPU utilisation: a spinning NCCL kernel reads as busy."""
    useful, util = _num(s.get("useful_compute_share")), _num(s.get("reported_gpu_util"))

    def bar(label: str, value: float | None, color: str) -> str:
        width = 0.0 if value is None else max(0.0, min(1.0, value)) * 100
        shown = "–" if value is None else percent(value)
        return (
            f'<div class="ub"><span class="ul">{_e(label)}</span><span class="ut"><span class="uf" '
            f'style="width:{width:.1f}%;background:{color}"></span></span><span class="uv">{shown}</span></div>'
        )

    gap = ""
    if useful is not None and util is not None and util > useful:
        gap = f"{percent(util - useful)} of the step reads busy but is not useful compute"
    return (
        f'<div class="tile wide"><div class="k">{_e(device)} time: useful vs reported</div>'
        f"{bar('useful compute', useful, COLORS['backward'])}{bar('reported GPU util', util, '#9aa3ad')}"
        f'<div class="n">{_e(gap)}</div></div>'
    )


def _step_bar(analysis: Mapping[str, Any]) -> str:
    """Where the median step goes: one stacked bar of the cost table's shares (HTML, so labels never stretch)."""
    segments = []
    for row in analysis.get("rows") or []:
        share = _num(row.get("share_of_step"))
        if share is None or share <= 0:
            continue
        segments.append((str(row.get("category", "")), str(row.get("label") or row.get("category", "")), share))
    if not segments:
        return ""
    total = sum(v for _, _, v in segments)
    scale = 1.0 / total if total > 1.0 else 1.0
    parts = []
    for category, label, share in segments:
        color, hatched = _category_color(category)
        background = f"{_HATCH_CSS},{color}" if hatched else color
        tip = f"{label}: {percent(share)} of the median step"
        ink = "light" if _is_light(color) else "dark"
        parts.append(
            f'<span class="seg {ink}" style="width:{share * scale * 100:.2f}%;background:{background}" '
            f'title="{_e(tip)}">{_e(label)} {_e(percent(share))}</span>'
        )
    return (
        '<div class="stepbar"><div class="k">where the median step goes (share of step time)</div>'
        f'<div class="bar" role="img" aria-label="share of the median step per category">{"".join(parts)}</div></div>'
    )


def _is_light(color: str) -> bool:
    """Whether a ``#rrggbb`` colour needs dark text (relative luminance above ~0.5)."""
    r, g, b = (int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.55


def _findings(analysis: Mapping[str, Any]) -> str:
    findings = analysis.get("findings") or []
    if not findings:
        return '<section><h2>Findings</h2><p class="muted">No findings: nothing stood out.</p></section>'
    items = []
    for f in findings:
        severity = str(f.get("severity", "info")).lower()
        cls = {"critical": "crit", "error": "crit", "warning": "warn", "warn": "warn"}.get(severity, "info")
        suspects = f.get("suspects") or []
        chips = "".join(_suspect_chip(s) for s in suspects[:12])
        if len(suspects) > 12:
            chips += f'<span class="chip more">+{len(suspects) - 12:,} more</span>'
        items.append(
            f'<li class="finding {cls}"><span class="sev">{_e(severity)}</span> <code>{_e(f.get("code", ""))}</code>'
            f'<div class="msg">{_e(f.get("message", ""))}</div>{_evidence(f.get("evidence"))}'
            f"{f'<div class=chips>{chips}</div>' if chips else ''}</li>"
        )
    return f'<section><h2>Findings ({len(findings)})</h2><ul class="findings">{"".join(items)}</ul></section>'


def _suspect_chip(s: Mapping[str, Any]) -> str:
    parts = [f"rank {s.get('rank')}"] if s.get("rank") is not None else []
    parts += [str(s[k]) for k in ("node", "group") if s.get(k)]
    return f'<span class="chip">{_e(" · ".join(parts) or "?")}</span>'


def _evidence(evidence: object) -> str:
    if evidence is None or evidence in ("", {}, []):
        return ""
    if isinstance(evidence, dict):
        inner = " · ".join(f"{_e(_fmt_header(str(k)))}: {_e(_fmt_key(str(k), v))}" for k, v in evidence.items())
    elif isinstance(evidence, list):
        inner = " · ".join(_e(x) for x in evidence)
    else:
        inner = _e(evidence)
    return f'<div class="ev">{inner}</div>'


def _cost_table(analysis: Mapping[str, Any]) -> str:
    rows = analysis.get("rows") or []
    if not rows:
        return ""
    # Without a plan every expected value is null: drop the expected and delta columns rather than print dashes.
    planned = any(_num(r.get("expected_seconds")) is not None for r in rows)
    device = _e(analysis.get("device") or "GPU")
    max_share = max((_num(r.get("share_of_step")) or 0.0 for r in rows), default=0.0) or 1.0
    body = []
    for r in rows:
        category = str(r.get("category", ""))
        share = _num(r.get("share_of_step"))
        bar_w = 0.0 if share is None else max(0.0, share) / max_share * 40
        worst_rank = r.get("worst_rank")
        worst = _secs(r.get("worst_seconds"))
        if worst_rank is not None:
            worst += f' <span class="muted">{_rank_text(worst_rank)}</span>'
        gpu_h = _num(r.get("gpu_hours_per_day"))
        cells = [
            f'<td class="cat">{_swatch(category)} {_e(r.get("label") or category)}</td>',
            f'<td class="num">{_secs(r.get("expected_seconds"))}</td>' if planned else "",
            f'<td class="num">{_secs(r.get("measured_median_seconds"))}</td>',
            f'<td class="num">{_secs(r.get("measured_p95_seconds"))}</td>',
            f'<td class="num">{worst}</td>',
            f'<td class="num share"><span class="sbar" style="width:{bar_w:.1f}px"></span>{_pct(share)}</td>',
            _delta_cell(_num(r.get("delta_seconds"))) if planned else "",
            f'<td class="num">{"–" if gpu_h is None else f"{gpu_h:,.1f} {device}·h"}</td>',
            f'<td class="sus">{_suspect_cell(r.get("suspect"))}</td>',
        ]
        body.append(f"<tr>{''.join(cells)}</tr>")
    heads = [
        "category",
        "expected" if planned else "",
        "measured median",
        "p95",
        "worst rank",
        "share of step",
        "delta vs expected" if planned else "",
        "cost / day at job scale",
    ]
    head = "".join(f"<th>{h}</th>" for h in heads if h) + '<th class="l">top suspect</th>'
    expected = (
        "expected from the planner; delta = measured median − expected"
        if planned
        else "no plan to compare with (meshscope report --spec FILE adds the expected numbers)"
    )
    bases = "".join(
        f'<p class="muted">{_e(r.get("label") or r.get("category"))} expected: {_e(r["expected_basis"])}</p>'
        for r in rows
        if r.get("expected_basis")
    )
    return (
        f'<section><h2>Cost table</h2><p class="muted">Per step and per {device}, measured over every rank-step; '
        f"{expected}; cost = {device}-hours per day the category takes across the whole job.</p>"
        f'<table class="cost"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>{bases}</section>'
    )


def _delta_cell(delta: float | None) -> str:
    if delta is None:
        return '<td class="num">–</td>'
    cls = "" if abs(delta) < 1e-9 else (" worse" if delta > 0 else " better")
    return f'<td class="num{cls}">{_e(("+" if delta > 0 else "") + human_seconds(delta))}</td>'


def _suspect_cell(suspect: Mapping[str, Any] | None) -> str:
    if not suspect:
        return '<span class="muted">–</span>'
    who = " · ".join([f"rank {suspect.get('rank')}"] + [str(suspect[k]) for k in ("node", "group") if suspect.get(k)])
    return f'<span class="who">{_e(who)}</span><div class="why">{_e(suspect.get("message") or "")}</div>'


def _expected_vs_measured(analysis: Mapping[str, Any]) -> str:
    evm = analysis.get("expected_vs_measured") or {}
    parts = []
    collectives = evm.get("collectives") or []
    title = "Collective bytes per GPU per step, by pipeline stage"
    if collectives and all("expected_bytes_per_step" in r for r in collectives):
        parts.append(_collectives_table(collectives, title))
    elif collectives:  # an analysis dict of an older shape: show what it has
        parts.append(_record_table(collectives, title))
    else:
        parts.append(f'<h3>{_e(title)}</h3><p class="muted">Nothing to compare (no plan or no measurement).</p>')
    exact = evm.get("collectives_by_size") or []
    if exact:
        parts.append(_record_table(exact, "Collectives per stage and message size: instances per step (meshscope run)"))
    memory = evm.get("memory") or []
    title = "Memory per pipeline stage"
    if memory:
        parts.append(_record_table(memory, title))
    else:
        parts.append(f'<h3>{_e(title)}</h3><p class="muted">Nothing to compare (no plan or no measurement).</p>')
    return f"<section><h2>Expected vs measured</h2>{''.join(parts)}</section>"


_STATUS_CELL = {
    "match": ("match", ""),
    "differs": ("differs", "worse"),
    "partial_sizes": ("some intervals carry no bytes", "worse"),
    "no_sizes": ("no sizes recorded", "muted"),
    "plan_only": ("not in the records", "worse"),
    "records_only": ("not in the plan", "worse"),
}


def _collectives_table(rows: Sequence[Mapping[str, Any]], title: str) -> str:
    """The per-stage collectives table of ``Analysis.to_dict()`` (docs/cost-table.md, "Expected vs measured").

    Over :data:`_MAX_TABLE_ROWS` rows, the rows that do not match are kept first (in table order) and the matching
    ones left out are counted.
    """
    keep = list(range(len(rows)))
    if len(rows) > _MAX_TABLE_ROWS:
        off = [i for i, r in enumerate(rows) if r.get("status") != "match"]
        fill = [i for i, r in enumerate(rows) if r.get("status") == "match"]
        keep = sorted((off + fill)[:_MAX_TABLE_ROWS])
    body = []
    for i in keep:
        r = rows[i]
        text, cls = _STATUS_CELL.get(str(r.get("status")), (str(r.get("status")), ""))
        share = _num(r.get("share_of_rank_steps"))
        if share is not None and share < 1.0:
            text += f", on {percent(share)} of rank-steps"
        low, high = _num(r.get("measured_min_bytes_per_step")), _num(r.get("measured_max_bytes_per_step"))
        if low is not None and high is not None and low != high:
            text += f"; rank-steps differ: {human_bytes(low)} to {human_bytes(high)}"
        delta = _num(r.get("delta_bytes_per_step"))
        delta_text = "–" if delta is None else ("+" if delta > 0 else "") + human_bytes(delta)
        cells = [
            f'<td class="num">{_e(r.get("pp_rank"))}</td>',
            f"<td>{_e(r.get('axis'))}</td>",
            f"<td>{_e(r.get('op'))}</td>",
            f'<td class="num">{_e(_fmt_key("bytes", r.get("expected_bytes_per_step")))}</td>',
            f'<td class="num">{_e(_fmt_key("bytes", r.get("measured_bytes_per_step")))}</td>',
            f'<td class="num">{_ratio_cell(r.get("expected_bytes_per_step"), r.get("measured_bytes_per_step"))}</td>',
            f'<td class="num">{_e(delta_text)}</td>',
            f'<td class="num">{_e(_count_text(r.get("expected_count_per_step")))}</td>',
            f'<td class="num">{_e(_count_text(r.get("measured_count_per_step")))}</td>',
            f'<td class="num">{_e(_fmt_key("bytes", r.get("expected_message_bytes")))}</td>',
            f'<td class="num">{_e(_fmt_key("bytes", r.get("measured_message_bytes")))}</td>',
            f'<td class="{cls}">{_e(text)}</td>',
        ]
        body.append(f"<tr>{''.join(cells)}</tr>")
    heads = ["stage", "axis", "op", "expected / step", "measured / step", "measured / expected", "delta / step"]
    heads += ["count / step, plan", "count / step, records", "mean message, plan", "mean message, records"]
    head = "".join(f'<th class="{"l" if h in {"axis", "op"} else ""}">{_e(h)}</th>' for h in heads)
    head += '<th class="l">status</th>'
    more = ""
    if len(keep) < len(rows):
        more = f'<p class="muted">{len(rows) - len(keep):,} matching rows left out.</p>'
    return (
        f"<h3>{_e(title)}</h3>"
        '<p class="muted">Bytes are NCCL message sizes S (the array a call passes) summed over a step\'s instances on '
        "one GPU, not the bus bytes a ring moves. Expected: the plan's message × count of the stage; measured: the "
        "median over the stage's rank-steps of the summed <code>bytes</code> of its intervals (point-to-point: the "
        "sends, or the receives where a stage records no send). Counts and mean messages differ from the plan's "
        "when the recorder aggregates several collectives into one interval (the simulator records one per "
        "collective phase); bytes per step do not.</p>"
        f'<table class="evm"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>{more}'
    )


def _count_text(value: object) -> str:
    v = _num(value)
    return "–" if v is None else f"{v:,g}"


def _flatten(row: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                flat[f"{k}.{k2}"] = v2
        else:
            flat[str(k)] = v
    return flat


def _record_table(rows: Sequence[Mapping[str, Any]], title: str) -> str:
    """A table of JSON rows whose columns are the union of their keys; values formatted by their key's unit."""
    flat = [_flatten(r) for r in rows[:_MAX_TABLE_ROWS]]
    columns: list[str] = []
    for r in flat:
        columns.extend(k for k in r if k not in columns)
    ratio = _ratio_columns(columns)
    numeric = {c for c in columns if any(_num(r.get(c)) is not None for r in flat)}
    head = "".join(f'<th class="{"" if c in numeric else "l"}">{_e(_fmt_header(c))}</th>' for c in columns)
    if ratio:
        head += "<th>measured / expected</th>"
    body = []
    for r in flat:
        cells = "".join(
            f'<td class="{"num" if c in numeric else ""}">{_e(_fmt_key(c, r.get(c)))}</td>' for c in columns
        )
        if ratio:
            cells += f'<td class="num">{_ratio_cell(r.get(ratio[0]), r.get(ratio[1]))}</td>'
        body.append(f"<tr>{cells}</tr>")
    more = ""
    if len(rows) > _MAX_TABLE_ROWS:
        more = f'<p class="muted">{len(rows) - _MAX_TABLE_ROWS:,} more rows left out.</p>'
    return (
        f'<h3>{_e(title)}</h3><table class="evm"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
        f"{more}"
    )


def _ratio_columns(columns: Sequence[str]) -> tuple[str, str] | None:
    """The first (expected_X, measured_X) pair of columns, if any."""
    for c in columns:
        if c.startswith("expected_"):
            rest = c.removeprefix("expected_")
            for m in columns:
                if m.startswith("measured") and m.endswith(rest):
                    return c, m
    return None


def _ratio_cell(expected: object, measured: object) -> str:
    e, m = _num(expected), _num(measured)
    if e is None or m is None or e <= 0:
        return "–"
    ratio = m / e
    cls = "worse" if ratio > 1.1 else ("better" if ratio < 0.9 else "")
    width = min(ratio, 2.0) / 2.0 * 60
    return (
        f'<span class="rbar"><span style="width:{width:.1f}px"></span><i></i></span>'
        f'<span class="{cls}">{ratio:.2f}×</span>'
    )


def _footer(table: RecordTable) -> str:
    files = ", ".join(Path(f).name for f in table.source_files[:3])
    if len(table.source_files) > 3:
        files += f" and {len(table.source_files) - 3:,} more"
    source = f" from {_e(files)}" if files else ""
    return (
        f"<footer>meshscope {_e(__version__)} · {table.n_rows:,} rank-steps, {table.n_intervals:,} intervals{source}. "
        "The per-interval view of every rank is in <code>trace.json</code> next to this file: open it in "
        "Perfetto UI (ui.perfetto.dev, works offline once loaded) or chrome://tracing.</footer>"
    )


_CSS = (
    """
:root{--fg:#1d2430;--muted:#5f6b7a;--line:#e3e7ec;--bg:#f6f7f9;--card:#fff;--bad:#b42318;--good:#1a7f37}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);
font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans","Helvetica Neue",Arial,sans-serif}
main{max-width:1340px;margin:0 auto;padding:18px 20px 40px}
header h1{font-size:22px;margin:4px 0 2px;word-break:break-word}
.sub,.muted{color:var(--muted)}
h2{font-size:16px;margin:0 0 8px}h3{font-size:14px;margin:14px 0 6px}
section{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:14px 16px;margin:14px 0;
overflow-x:auto}
section.notice{background:#fff8e6;border-color:#f0d58c}
.notice ul{margin:4px 0 0 18px;padding:0}
.tiles{display:flex;flex-wrap:wrap;gap:10px}
.tile{flex:1 1 150px;border:1px solid var(--line);border-radius:6px;padding:8px 10px;min-width:140px}
.tile.wide{flex:2 1 300px}
.tile .k,.stepbar .k{font-size:12px;color:var(--muted);text-transform:uppercase;letter-spacing:.03em}
.tile .v{font-size:22px;font-weight:600;font-variant-numeric:tabular-nums}
.tile .n{font-size:12px;color:var(--muted);min-height:1em}
.ub{display:flex;align-items:center;gap:8px;margin:4px 0;font-size:13px}
.ul{width:130px}.ut{flex:1;height:10px;background:#eef0f3;border-radius:5px;overflow:hidden}
.uf{display:block;height:100%}.uv{width:60px;text-align:right;font-variant-numeric:tabular-nums}
.stepbar{margin-top:12px}
.bar{display:flex;height:26px;border-radius:4px;overflow:hidden;margin-top:4px;background:#eef0f3}
.seg{display:block;overflow:hidden;white-space:nowrap;text-overflow:clip;color:#fff;font-size:12px;line-height:26px;
padding-left:4px}
.seg.dark{text-shadow:0 0 2px rgba(0,0,0,.6)}.seg.light{color:#1d2430}
ul.findings{list-style:none;margin:0;padding:0}
.finding{border-left:4px solid #8aa0b8;padding:6px 10px;margin:6px 0;background:#fafbfc;border-radius:0 6px 6px 0}
.finding.crit{border-color:var(--bad)}.finding.warn{border-color:#d08700}
.sev{font-size:11px;text-transform:uppercase;font-weight:700;color:var(--muted)}
.crit .sev{color:var(--bad)}.warn .sev{color:#a15c00}
.msg{margin:2px 0}.ev{font-size:12px;color:var(--muted)}
.chip{display:inline-block;font-size:12px;background:#eef2f7;border-radius:10px;padding:1px 8px;margin:3px 4px 0 0}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th{font-size:12px;font-weight:600;color:var(--muted);text-align:right;border-bottom:2px solid var(--line);
padding:5px 8px;vertical-align:bottom}
th:first-child,th.l{text-align:left}
td{border-bottom:1px solid var(--line);padding:5px 8px;vertical-align:top}
tbody tr:nth-child(even){background:#fafbfc}
td.num{text-align:right;white-space:nowrap}
td.cat{min-width:150px}
.sw{vertical-align:-2px;margin-right:4px}
.sbar{display:inline-block;height:8px;background:#9db4cf;border-radius:2px;margin-right:6px;vertical-align:0}
.worse{color:var(--bad);font-weight:600}.better{color:var(--good)}
.who{font-weight:600}.why{font-size:12px;color:var(--muted)}td.sus{min-width:190px}
table.cost{font-size:13px}table.cost td{padding:5px 6px}.small{font-size:12px}
.rbar{display:inline-block;position:relative;width:60px;height:8px;background:#eef0f3;margin-right:6px}
.rbar span{position:absolute;left:0;top:0;bottom:0;background:#9db4cf}
.rbar i{position:absolute;left:30px;top:-2px;bottom:-2px;border-left:1px solid #555}
.legend{display:flex;flex-wrap:wrap;gap:6px 16px;margin:8px 0 4px;font-size:12px}
.li{display:inline-flex;align-items:center;gap:5px}
figure.panel{margin:12px 0 4px;overflow-x:auto}
figcaption{margin-bottom:2px}
svg.tl{display:block;font-size:11px;width:100%;height:auto}
.tl .grid{stroke:#e6e9ee;stroke-width:1}
.tl .tick{fill:var(--muted);text-anchor:middle;font-size:10px}
.tl .rl{font-weight:600;fill:var(--fg)}.tl .rl.sus{fill:var(--bad)}
.tl .rs{fill:var(--muted);font-size:10px}
.tl .rt{fill:var(--muted)}
.tl .tag{font-size:10px;font-weight:700}
.tl .nodeline{stroke:#b9c1cb;stroke-dasharray:3 3}
.bg{fill:#eceff3}
.k-wait{fill:url(#"""
    + HATCH_ID
    + """)}
footer{color:var(--muted);font-size:12px;margin:18px 4px}
"""
    + "".join(f".k-{name}{{fill:{color}}}" for name, color in COLORS.items())
    + "\n"
)

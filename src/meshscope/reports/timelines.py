"""The per-rank step timeline of the HTML report: inline SVG, one row per rank, sync wait hatched.

The timeline shows the slowest and a median step, one row per rank (a bounded selection for big jobs: the slowest
ranks, the suspects and a sample of every pipeline stage, saying how many were left out), with phases coloured by
category and the **sync-wait** part of every collective hatched: from the member's arrival until its last member's
arrival, on the aligned clock. Bars closer than half a pixel are merged, so the SVG stays small whatever the
interval count. It also owns the palette the rest of the report shares (:data:`COLORS`, :data:`HATCH_ID`).

Like :mod:`meshscope.reports.pages`, it formats and must not analyse: every number comes from the records, their
breakdown and the analysis dict. All text from the inputs is HTML-escaped.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from meshscope.analysis import BUBBLE, CATEGORY_INDEX, SYNC_WAIT, TICKS_PER_US, comm_category
from meshscope.formatting import human_bytes, human_seconds
from meshscope.records import KINDS, PHASES, IntervalKind
from meshscope.reports.traces import coord_text, degrees, interval_name, row_offsets_us, step_times, sync_waits
from meshscope.topology import AXES

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from numpy.typing import NDArray

    from meshscope.analysis import Breakdown
    from meshscope.records import RecordTable
    from meshscope.reports.traces import SyncWaits

DEFAULT_TIMELINE_RANKS = 48
"""Most rank rows the timeline draws per step; bigger jobs get a selection (slowest, suspects, pp-stage samples)."""

# ====================================================================== colours (one palette for table and timeline)

COLORS: dict[str, str] = {
    "forward": "#8dbbe6",
    "backward": "#2f6fb3",
    "recompute": "#b9a5e0",
    "compute": "#4a86c5",
    "data": "#e9b949",
    "optimizer": "#3f9b5a",
    "checkpoint": "#6e6e6e",
    "dp": "#e8743b",
    "tp": "#a355b8",
    "pp": "#1a9e9e",
    "cp": "#d4507c",
    "ep": "#94783c",
    "bubble": "#a7dede",
    "other": "#cfd3d8",
}
"""Fill colour of every phase, axis and category; the cost table's swatches and the timeline's bars share it."""
_LEGEND: tuple[tuple[str, str], ...] = (
    ("forward", "compute: forward"),
    ("backward", "compute: backward"),
    ("recompute", "compute: recompute"),
    ("compute", "compute (phase unknown)"),
    ("data", "data wait"),
    ("optimizer", "optimizer"),
    ("checkpoint", "checkpoint"),
    ("dp", "comm dp"),
    ("tp", "comm tp"),
    ("pp", "p2p / comm pp"),
    ("cp", "comm cp"),
    ("ep", "comm ep"),
)
HATCH_ID = "ms-hatch"
"""Document-wide id of the sync-wait hatch pattern (:func:`svg_defs` defines it once per page)."""

# Timeline geometry, px.
_LABEL_W = 250
_PLOT_W = 930
_RIGHT_W = 90
_SVG_W = _LABEL_W + _PLOT_W + _RIGHT_W
_ROW_H = 26
_AXIS_H = 24
_MIN_RECT_PX = 1.0
_MERGE_GAP_PX = 0.5
_TITLE_MIN_PX = 3.0


def _e(value: object) -> str:
    """Escape any value for HTML text and attributes."""
    return html.escape(str(value), quote=True)


# ====================================================================== the timeline


@dataclass(frozen=True, slots=True, kw_only=True)
class _Selection:
    """Which ranks the timeline draws, and why."""

    ranks: tuple[int, ...]
    """Ranks drawn, ascending."""
    tags: dict[int, tuple[str, ...]]
    """Why a rank is drawn or marked: ``slowest``, ``suspect``."""
    total: int
    """Ranks with records."""
    reasons: dict[str, int]
    """How many ranks each reason brought in (subset mode only)."""


def _suspect_ranks(analysis: Mapping[str, Any]) -> list[int]:
    """Ranks the analysis points at: the slowest rank, the findings' suspects, the ranks that caused sync wait.

    Other cost-table rows name their worst rank as the suspect even when the cost is spread evenly; those do not
    make a rank a suspect on the timeline.
    """
    out: list[int] = []

    def add(rank: object) -> None:
        if isinstance(rank, int) and not isinstance(rank, bool) and rank not in out:
            out.append(rank)

    add((analysis.get("summary") or {}).get("slowest_rank"))
    for f in analysis.get("findings") or []:
        for s in f.get("suspects") or []:
            add(s.get("rank"))
    for row in analysis.get("rows") or []:
        if str(row.get("category", "")).endswith(SYNC_WAIT):
            add((row.get("suspect") or {}).get("rank"))
    return out


def _busy_us(bd: Breakdown) -> NDArray[np.float64]:
    """Step time minus waiting for others (sync wait on every axis, pipeline bubble): what the rank itself needed."""
    waiting = [CATEGORY_INDEX[comm_category(a, SYNC_WAIT)] for a in AXES] + [CATEGORY_INDEX[BUBBLE]]
    busy: NDArray[np.float64] = bd.step_us - bd.ticks[:, waiting].sum(axis=1) / TICKS_PER_US
    return busy


def _select_ranks(
    table: RecordTable, bd: Breakdown, analysis: Mapping[str, Any], step: int, max_ranks: int
) -> _Selection:
    s = table.steps
    all_ranks = np.unique(s.rank)
    suspects = [r for r in _suspect_ranks(analysis) if r in set(all_ranks.tolist())]
    in_step = np.flatnonzero(s.step == step)
    busy = _busy_us(bd)[in_step]
    # Only ranks that needed more than the median rank are "slow": in a job without a straggler nobody is tagged.
    above = busy > np.median(busy) if busy.size else busy.astype(bool)
    by_busy = s.rank[in_step][above][np.argsort(-busy[above], kind="stable")].tolist()
    tags: dict[int, list[str]] = {}
    if all_ranks.size <= max_ranks:
        for r in suspects:
            tags.setdefault(r, []).append("suspect")
        if by_busy:
            tags.setdefault(by_busy[0], []).insert(0, "slowest")
        return _Selection(
            ranks=tuple(all_ranks.tolist()),
            tags={r: tuple(t) for r, t in tags.items()},
            total=int(all_ranks.size),
            reasons={},
        )
    chosen: list[int] = []
    reasons = {"slowest": 0, "suspect": 0, "sampled across pipeline stages": 0}

    def take(rank: int, reason: str) -> None:
        if len(chosen) < max_ranks and rank not in chosen:
            chosen.append(rank)
            reasons[reason] += 1
        if rank in chosen:
            tags.setdefault(rank, []).append(reason)

    n_slow = max(1, max_ranks // 6)
    for r in by_busy[:n_slow]:
        take(r, "slowest")
    for r in suspects[: max(1, max_ranks // 4)]:
        take(r, "suspect")
    rest = all_ranks[~np.isin(all_ranks, chosen)]
    for r in _stage_samples(table, rest, max_ranks - len(chosen)):
        take(r, "sampled across pipeline stages")
    return _Selection(
        ranks=tuple(sorted(chosen)),
        tags={r: tuple(dict.fromkeys(t)) for r, t in tags.items() if r in chosen},
        total=int(all_ranks.size),
        reasons=reasons,
    )


def _stage_samples(table: RecordTable, ranks: NDArray[np.int64], room: int) -> list[int]:
    """About ``room`` ranks spread evenly over every pipeline stage (stages spread evenly when there are more)."""
    s = table.steps
    pp_of = dict(zip(s.rank.tolist(), s.coord[:, AXES.index("pp")].tolist(), strict=True))
    stages: dict[int, list[int]] = {}
    for r in ranks.tolist():
        stages.setdefault(pp_of[r], []).append(r)
    stage_ids = sorted(stages)
    if room > 0 and len(stage_ids) > room:
        stage_ids = [stage_ids[i] for i in np.linspace(0, len(stage_ids) - 1, room).round().astype(int).tolist()]
    per_stage, extra = divmod(max(room, 0), max(len(stage_ids), 1))
    out: list[int] = []
    for k, st in enumerate(stage_ids):
        members = stages[st]
        want = min(per_stage + (k < extra), len(members))
        picks = np.linspace(0, len(members) - 1, want).round().astype(int).tolist() if want else []
        out.extend(members[i] for i in picks)
    return out


def timeline_section(table: RecordTable, bd: Breakdown, analysis: Mapping[str, Any], *, max_ranks: int) -> str:
    """The report's timeline section: the slowest and a median step, at most ``max_ranks`` rank rows each.

    Args:
        table: the step records.
        bd: their breakdown (aligned clocks, sync wait per collective member).
        analysis: ``Analysis.to_dict()``; its slowest rank, findings and sync-wait suspects are drawn and marked.
        max_ranks: most rank rows per step (>= 1; the caller checks).

    Returns:
        One ``<section>`` of HTML with inline SVG (the hatch pattern comes from :func:`svg_defs`).
    """
    times = step_times(table)
    chosen = times.representative()
    if not chosen:
        return '<section><h2>Step timeline</h2><p class="muted">No step records.</p></section>'
    selection = _select_ranks(table, bd, analysis, chosen[0], max_ranks)
    waits = sync_waits(table, bd)
    panels = []
    for i, step in enumerate(chosen):
        kind = "Slowest step" if i == 0 else "Median step"
        panels.append(
            _panel(
                table=table,
                bd=bd,
                waits=waits,
                step=step,
                selection=selection,
                caption=f"{kind}: step {step}",
                step_us=times.us(step),
            )
        )
    shown = len(selection.ranks)
    if shown < selection.total:
        why = ", ".join(f"{n:,} {k}" for k, n in selection.reasons.items() if n)
        scope = (
            f"Showing {shown:,} of {selection.total:,} ranks ({why}); {selection.total - shown:,} ranks left out "
            "(the Perfetto trace that meshscope report writes beside this file has every rank)."
        )
    else:
        scope = f"Showing all {shown:,} ranks."
    return (
        '<section><h2>Per-rank step timeline</h2><p class="muted">'
        f"One row per {'GPU' if table.on_gpu else 'rank'}, on clocks aligned on collective completions. Upper "
        "lane: compute, data, optimizer, checkpoint; lower lane: communication. The hatched part of "
        "a collective is <b>sync wait</b>: from the rank's arrival until the last member arrived. ▲ slowest: needed "
        "the most time in the slowest step, waits for others not counted; ● suspect: named by the analysis. "
        f"{_e(scope)} Hover a bar for details.</p>{_legend(table)}{''.join(panels)}</section>"
    )


def _legend(table: RecordTable) -> str:
    iv = table.intervals
    used: set[str] = set()
    for k in np.unique(iv.kind).tolist():
        kind = KINDS[k]
        if kind is IntervalKind.COMPUTE:
            phases = np.unique(iv.phase[iv.kind == k]).tolist()
            used.update(PHASES[p].value if p >= 0 else "compute" for p in phases)
        elif kind in (IntervalKind.COMM, IntervalKind.P2P):
            used.update(AXES[a].value for a in np.unique(iv.axis[iv.kind == k]).tolist())
        else:
            used.add(kind.value)
    items = [
        f'<span class="li"><svg width="22" height="12" aria-hidden="true"><rect width="22" height="12" rx="2" '
        f'fill="{COLORS[key]}"/></svg>{_e(label)}</span>'
        for key, label in _LEGEND
        if key in used
    ]
    items.append(
        f'<span class="li"><svg width="22" height="12" aria-hidden="true"><rect width="22" height="12" rx="2" '
        f'fill="{COLORS["dp"]}"/><rect width="22" height="12" fill="url(#{HATCH_ID})"/></svg>sync wait '
        "(waiting for the last member)</span>"
    )
    items.append(
        '<span class="li"><svg width="22" height="12" aria-hidden="true"><rect width="22" height="12" rx="2" '
        'class="bg"/></svg>in the step, no recorded interval (other)</span>'
    )
    return f'<div class="legend">{"".join(items)}</div>'


@dataclass(slots=True)
class _Bar:
    x0: float
    x1: float
    lane: int
    cls: str
    name: str
    count: int
    dur_us: int
    detail: str


def _panel(
    *,
    table: RecordTable,
    bd: Breakdown,
    waits: SyncWaits,
    step: int,
    selection: _Selection,
    caption: str,
    step_us: int,
) -> str:
    s, iv = table.steps, table.intervals
    offset = row_offsets_us(table, bd)
    ranks = np.asarray(selection.ranks, dtype=np.int64)
    rows = np.flatnonzero((s.step == step) & np.isin(s.rank, ranks))
    row_of_rank = dict(zip(s.rank[rows].tolist(), rows.tolist(), strict=True))
    t0 = int((s.start_us[rows] - offset[rows]).min())
    t1 = int((s.end_us[rows] - offset[rows]).max())
    span = max(t1 - t0, 1)
    px_per_us = _PLOT_W / span
    degree = degrees(table)

    # Intervals of the drawn rows, grouped by row.
    idx = np.flatnonzero(np.isin(iv.row, rows))
    idx = idx[np.argsort(iv.row[idx], kind="stable")]
    bounds = np.searchsorted(iv.row[idx], rows, side="left"), np.searchsorted(iv.row[idx], rows, side="right")
    span_of_row = {int(r): (int(a), int(b)) for r, a, b in zip(rows.tolist(), *bounds, strict=True)}
    wait_sel = np.isin(iv.row[waits.interval], rows)
    wait_rows = iv.row[waits.interval[wait_sel]].tolist()
    wait_lo, wait_hi = waits.start_us[wait_sel].tolist(), waits.end_us[wait_sel].tolist()
    wait_late = waits.late_rank[wait_sel].tolist()
    waits_by_row: dict[int, list[tuple[int, int, int]]] = {}
    for r, a, b, late in zip(wait_rows, wait_lo, wait_hi, wait_late, strict=True):
        waits_by_row.setdefault(r, []).append((a, b, late))

    height = _AXIS_H + _ROW_H * len(selection.ranks) + 6
    out = [
        (
            f'<figure class="panel"><figcaption><b>{_e(caption)}</b> · {_e(human_seconds(step_us / 1e6))} '
            "(longest rank-step)</figcaption>"
        ),
        (
            f'<svg class="tl" width="100%" viewBox="0 0 {_SVG_W} {height}" role="img" '
            f'aria-label="{_e(caption)} timeline">'
        ),
        _time_axis(span, height),
        f'<text x="{_LABEL_W + _PLOT_W + 8}" y="{_AXIS_H - 8}" class="tick" text-anchor="start">step time</text>',
    ]
    prev_node = None
    for i, rank in enumerate(selection.ranks):
        y = _AXIS_H + i * _ROW_H
        row = row_of_rank.get(rank)
        out.append(f'<g transform="translate(0,{y})">')
        if row is None:
            out.append(_row_label(rank, None, "", selection.tags.get(rank, ())))
            out.append(f'<text x="{_LABEL_W + 6}" y="16" class="muted">no record for this step</text></g>')
            continue
        node = table.node_name(int(s.node[row]))
        if prev_node is not None and node != prev_node:
            out.append(f'<line x1="0" x2="{_SVG_W}" y1="0" y2="0" class="nodeline"/>')
        prev_node = node
        where = f"{node} · {coord_text(s.coord[row].tolist(), degree)}"
        out.append(_row_label(rank, row, where, selection.tags.get(rank, ())))
        shift = int(offset[row]) + t0
        lo, hi = int(s.start_us[row]) - shift, int(s.end_us[row]) - shift
        out.append(
            f'<rect x="{_LABEL_W + lo * px_per_us:.1f}" y="2" width="{max((hi - lo) * px_per_us, _MIN_RECT_PX):.1f}" '
            f'height="21" class="bg"/>'
        )
        a, b = span_of_row[row]
        bars = _row_bars(table, idx[a:b], shift=shift, lo=lo, hi=hi, px_per_us=px_per_us)
        bars += _wait_bars(waits_by_row.get(row, []), t0, lo, hi, px_per_us)
        out.extend(_draw_bars(bars, rank))
        out.append(
            f'<text x="{_LABEL_W + _PLOT_W + 8}" y="16" class="rt">{_e(human_seconds((hi - lo) / 1e6))}</text></g>'
        )
    out.append("</svg></figure>")
    return "".join(out)


_TAG_MARK = {"slowest": "▲", "suspect": "●"}


def _row_label(rank: int, row: int | None, where: str, tags: Sequence[str]) -> str:
    marks = "".join(f'<tspan class="tag {t}"> {_TAG_MARK[t]} {_e(t)}</tspan>' for t in tags if t in _TAG_MARK)
    cls = "rl sus" if "suspect" in tags or "slowest" in tags else "rl"
    sub = f'<text x="8" y="22" class="rs">{_e(where)}</text>' if row is not None else ""
    return f'<text x="8" y="11" class="{cls}">rank {rank}{marks}</text>{sub}'


def _time_axis(span_us: int, height: int) -> str:
    """Ticks at 1-2-5 steps, labelled in ms (µs for sub-ms steps, s for long ones)."""
    raw = span_us / 8
    mag = 10 ** math.floor(math.log10(max(raw, 1)))
    tick = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    unit, div = ("s", 1e6) if span_us >= 5e6 else ("ms", 1e3) if span_us >= 5e3 else ("µs", 1.0)
    parts = []
    t = 0
    while t <= span_us:
        x = _LABEL_W + t * _PLOT_W / span_us
        value = t / div
        text = f"{value:g} {unit}"
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_AXIS_H - 4}" y2="{height}" class="grid"/>')
        if x <= _LABEL_W + _PLOT_W - 25:  # keep clear of the "step time" header at the right edge
            parts.append(f'<text x="{x:.1f}" y="{_AXIS_H - 8}" class="tick">{_e(text)}</text>')
        t += tick
    return "".join(parts)


_DETAIL_KINDS = (IntervalKind.COMM, IntervalKind.P2P)


def _row_bars(
    table: RecordTable, idx: NDArray[np.intp], *, shift: int, lo: int, hi: int, px_per_us: float
) -> list[_Bar]:
    iv = table.intervals
    bars = []
    cols = zip(
        iv.kind[idx].tolist(),
        np.clip(iv.start_us[idx] - shift, lo, hi).tolist(),
        np.clip(iv.end_us[idx] - shift, lo, hi).tolist(),
        iv.phase[idx].tolist(),
        iv.axis[idx].tolist(),
        iv.op[idx].tolist(),
        iv.group[idx].tolist(),
        iv.seq[idx].tolist(),
        iv.size_bytes[idx].tolist(),
        iv.peer[idx].tolist(),
        strict=True,
    )
    for kind, a, b, phase, axis, op, group, seq, size, peer in cols:
        k = KINDS[kind]
        if k in _DETAIL_KINDS:
            cls, lane = AXES[axis].value, 1
            bits = [table.group_name(group) if group >= 0 else "", f"seq {seq}" if seq >= 0 else ""]
            bits.append(human_bytes(size) if size >= 0 else "")
            detail = " · ".join(b for b in bits if b)
        else:
            cls = (PHASES[phase].value if phase >= 0 else "compute") if k is IntervalKind.COMPUTE else k.value
            lane, detail = 0, ""
        bars.append(
            _Bar(
                x0=_LABEL_W + a * px_per_us,
                x1=_LABEL_W + b * px_per_us,
                lane=lane,
                cls=cls,
                name=interval_name(kind, phase, axis, op if k in _DETAIL_KINDS else -1, peer),
                count=1,
                dur_us=b - a,
                detail=detail,
            )
        )
    return bars


def _wait_bars(waits: list[tuple[int, int, int]], t0: int, lo: int, hi: int, px_per_us: float) -> list[_Bar]:
    bars = []
    for a, b, late in waits:
        a2, b2 = max(a - t0, lo), min(b - t0, hi)
        if b2 > a2:
            bars.append(
                _Bar(
                    x0=_LABEL_W + a2 * px_per_us,
                    x1=_LABEL_W + b2 * px_per_us,
                    lane=2,
                    cls="wait",
                    name=f"sync wait for rank {late}",
                    count=1,
                    dur_us=b2 - a2,
                    detail="",
                )
            )
    return bars


def _merge(bars: Iterable[_Bar]) -> list[_Bar]:
    """Coalesce bars of one lane and class closer than half a pixel: bounds the SVG whatever the interval count."""
    merged: list[_Bar] = []
    groups: dict[tuple[int, str], list[_Bar]] = {}
    for bar in bars:
        groups.setdefault((bar.lane, bar.cls), []).append(bar)
    for key in sorted(groups):
        current: _Bar | None = None
        for bar in sorted(groups[key], key=lambda b: b.x0):
            if current is not None and bar.x0 - current.x1 < _MERGE_GAP_PX:
                current.x1 = max(current.x1, bar.x1)
                current.count += bar.count
                current.dur_us += bar.dur_us
                if bar.name != current.name:
                    current.name = current.cls if current.cls not in COLORS else _merged_name(current.cls)
                current.detail = ""
            else:
                current = _Bar(bar.x0, bar.x1, bar.lane, bar.cls, bar.name, bar.count, bar.dur_us, bar.detail)
                merged.append(current)
    return merged


def _merged_name(cls: str) -> str:
    return f"{cls} comm" if cls in {a.value for a in AXES} else cls


_LANE_Y = {0: (3, 11), 1: (14, 8), 2: (14, 8)}


def _draw_bars(bars: list[_Bar], rank: int) -> list[str]:
    out = []
    for bar in _merge(bars):
        y, h = _LANE_Y[bar.lane]
        w = max(bar.x1 - bar.x0, _MIN_RECT_PX)
        cls = "k-wait" if bar.cls == "wait" else f"k-{bar.cls}"
        title = ""
        if w >= _TITLE_MIN_PX:
            what = bar.name if bar.count == 1 else f"{bar.name} ×{bar.count:,}"
            text = f"rank {rank} · {what} · {human_seconds(bar.dur_us / 1e6)}"
            if bar.detail:
                text += f" · {bar.detail}"
            title = f"<title>{_e(text)}</title>"
        out.append(f'<rect x="{bar.x0:.1f}" y="{y}" width="{w:.1f}" height="{h}" class="{cls}">{title}</rect>')
    return out


def svg_defs() -> str:
    """The hatch pattern, defined once for every inline SVG of the page (ids are document-wide)."""
    return (
        '<svg width="0" height="0" style="position:absolute" aria-hidden="true"><defs>'
        f'<pattern id="{HATCH_ID}" patternUnits="userSpaceOnUse" width="6" height="6" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#ffffff" fill-opacity="0.35"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#7a1f1f" stroke-width="3"/></pattern></defs></svg>'
    )

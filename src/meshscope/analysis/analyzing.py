"""``analyze()``: records in; cost table, summary, expected vs measured and findings out. And ``meshscope analyze``.

Exists as the one entry point that the CLI (``meshscope analyze``, the end of ``meshscope run``), reports and the
operator call to go from a :class:`~meshscope.records.RecordTable` (and optionally the job's spec) to everything
DESIGN.md's "The cost table" promises. It puts :mod:`meshscope.analysis.breakdown`, :mod:`meshscope.analysis.costs` and
:mod:`meshscope.analysis.diagnosis` together, plans the spec when one is given (:func:`meshscope.plan.plan_job`), and
renders the result for people (:func:`render_analysis`: a unit on every number) or machines (:meth:`Analysis.to_dict`:
base units, the JSON shape documented in ``docs/cost-table.md``).

It must not compute categories itself (the breakdown does), must not hide partial data (every note reaches
``partial_data`` and the rows it touches say so), and on bad input the command exits 2 with one line, no traceback.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from meshscope.analysis.breakdown import break_down
from meshscope.analysis.collectives import MATCH_TOLERANCE
from meshscope.analysis.costs import (
    CollectiveComparison,
    CostRow,
    MemoryComparison,
    RankSteps,
    Summary,
    compare_collectives,
    compare_memory,
    cost_rows,
    index_rank_steps,
    layout_order_notes,
    missing_traffic_notes,
    partial_categories,
    partial_notes,
    summarise,
)
from meshscope.analysis.diagnosis import CPU_CONTENTION, WARM_UP, Finding, diagnose, runqueue_contention
from meshscope.errors import ParseCode, ParseError
from meshscope.formatting import human_bytes, human_seconds, percent, render_table
from meshscope.plan import PlanAssumptions, plan_job
from meshscope.progress import NO_PROGRESS
from meshscope.records import RAISED_STEPS
from meshscope.topology import AXES, EMULATED_GPU, Link

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from meshscope.analysis.breakdown import Breakdown, P2PBandwidth
    from meshscope.jobs import JobSpec
    from meshscope.plan import Plan
    from meshscope.progress import Progress
    from meshscope.records import Note, RecordTable
    from meshscope.topology import ParallelLayout


@dataclass(frozen=True, slots=True, kw_only=True)
class Analysis:
    """Everything ``meshscope analyze`` reports about one job's records."""

    job: str
    """Job name from the records."""
    world_size: int
    """GPUs in the job: the spec's (or plan's) world size, else the ranks seen."""
    ranks_seen: int
    """Distinct ranks in the records."""
    first_step: int
    """Lowest step number seen."""
    last_step: int
    """Highest step number seen."""
    step_count: int
    """Distinct steps seen."""
    partial_data: tuple[Note, ...]
    """What the numbers had to do without (docs/cost-table.md, "Partial data")."""
    summary: Summary
    """Step time, straggler gap, efficiency, useful compute vs reported utilisation."""
    rows: tuple[CostRow, ...]
    """The cost table."""
    collectives: tuple[CollectiveComparison, ...]
    """Per pipeline stage and (axis, op): bytes, count and mean message per GPU per step, plan vs records (empty
    without a plan)."""
    memory: tuple[MemoryComparison, ...]
    """Memory per pipeline stage, plan vs records (empty without a plan)."""
    findings: tuple[Finding, ...]
    """Diagnosis, most costly first."""
    rank_steps: RankSteps = field(repr=False, compare=False)
    """The indexed breakdown behind every number (for reports and traces)."""
    plan: Plan | None = field(default=None, repr=False, compare=False)
    """The plan the expected numbers come from."""

    @property
    def breakdown(self) -> Breakdown:
        """The step breakdown."""
        return self.rank_steps.breakdown

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of docs/cost-table.md (base units: seconds, bytes, ratios)."""
        return {
            "job": self.job,
            "world_size": self.world_size,
            "ranks_seen": self.ranks_seen,
            "device": self.rank_steps.device,
            "steps": {"first": self.first_step, "last": self.last_step, "count": self.step_count},
            "partial_data": [{"code": n.code, "message": n.message, "count": n.count} for n in self.partial_data],
            "summary": self.summary.to_dict(),
            "rows": [r.to_dict() for r in self.rows],
            "expected_vs_measured": {
                "collectives": [c.to_dict() for c in self.collectives],
                "memory": [m.to_dict() for m in self.memory],
            },
            "findings": [f.to_dict() for f in self.findings],
        }


def p2p_bandwidth(spec: JobSpec | None, plan: Plan | None) -> P2PBandwidth:
    """Effective pipeline bandwidth per link for the breakdown, bytes/s; ``None`` without a spec.

    The spec's per-direction link bandwidth times the plan's link efficiency (``nvlink_efficiency``,
    ``network_efficiency``), the rate the planner expects a message to move at.
    """
    if spec is None:
        return None
    hw = spec.hardware
    assumptions = plan.assumptions if plan is not None else PlanAssumptions()
    return {
        link.value: hw.link_bandwidth_bytes_per_s(link.value) * assumptions.link_efficiency(link.value)
        for link in (Link.NVLINK, Link.NETWORK)
    }


def plan_fits_run(rs: RankSteps, spec: JobSpec | None) -> bool:
    """Whether the plan's seconds are those of the hardware the ranks ran on.

    They are where the ranks ran on GPUs, or on this machine's CPU cores under the emulated accelerator that models
    them; a spec for a catalogue GPU beside CPU ranks gives another machine's seconds. A plan without its spec is taken
    to fit.
    """
    return spec is None or rs.on_gpu or spec.hardware.gpu.name == EMULATED_GPU


def analyze(
    table: RecordTable,
    *,
    spec: JobSpec | None = None,
    plan: Plan | None = None,
    notes: Sequence[Note] = (),
    one_clock: bool = False,
    progress: Progress = NO_PROGRESS,
) -> Analysis:
    """Break ``table`` down and build the cost table, summary, expected vs measured and findings.

    Args:
        table: the step records of one job.
        spec: the job's spec; enables the expected column, the memory and collective comparison, the bubble and
            placement findings and the p2p bandwidth that splits pipeline transfer from bubble.
        plan: a plan to compare with; default ``plan_job(spec)`` when a spec is given.
        notes: notes from reading (e.g. files of another job left out); listed first under partial data.
        one_clock: every record was timed on one host's clock (``meshscope run``: its emulated nodes share the
            machine), so node clocks are not aligned on collective completions; an alignment estimated from
            completions that CPU contention delays can only add error.
        progress: told of the phases: those of :func:`break_down`, then "costing" (the cost table, summary and
            comparisons with the plan) and "diagnosing" (the findings).

    Returns:
        The analysis.

    Raises:
        ParseError: if the table has no records.
        PlanError: if the spec cannot be planned.
    """
    if table.n_rows == 0:
        cut = next((n for n in table.notes if n.code == RAISED_STEPS), None)
        if cut is not None:  # every record there was is a step an exception cut short
            raise ParseError(
                f"no step records to analyse, every one was cut short: {cut.message}", code=ParseCode.INVALID
            )
        raise ParseError("no step records to analyse (the input is empty)", code=ParseCode.INVALID)
    if spec is not None:
        check_records_match_layout(table, spec.layout, origin=f"spec {spec.name!r}")
    if plan is None and spec is not None:
        plan = plan_job(spec)
    bd = break_down(
        table, p2p_bandwidth_bytes_per_s=p2p_bandwidth(spec, plan), align_clocks=not one_clock, progress=progress
    )
    with progress.phase(f"costing {bd.ticks.shape[0]:,} rank-steps"):
        rs = index_rank_steps(bd)
        planned_world = spec.world_size if spec is not None else (plan.world_size if plan is not None else None)
        world = planned_world if planned_world is not None else rs.n_ranks
        partial = (
            *partial_notes(rs, world_size=planned_world, extra=notes),
            *missing_traffic_notes(rs, plan),
            *layout_order_notes(rs),
        )
        measured = None if any(n.code == CPU_CONTENTION for n in partial) else runqueue_contention(rs)
        partial = partial if measured is None else (*partial, measured)
        summary = summarise(rs, plan=plan, plan_fits_run=plan_fits_run(rs, spec))
        rows = cost_rows(rs, plan=plan, world_size=world, partial=partial_categories(rs, partial))
        collectives = compare_collectives(rs.breakdown.table, plan) if plan is not None else ()
        memory = compare_memory(rs, plan) if plan is not None else ()
    with progress.phase("diagnosing"):
        findings = diagnose(rs, plan=plan, spec=spec, notes=partial)
    return Analysis(
        job=table.job,
        world_size=world,
        ranks_seen=rs.n_ranks,
        first_step=int(rs.steps[0]),
        last_step=int(rs.steps[-1]),
        step_count=rs.n_steps,
        partial_data=partial,
        summary=summary,
        rows=rows,
        collectives=collectives,
        memory=memory,
        findings=findings,
        rank_steps=rs,
        plan=plan,
    )


def check_records_match_layout(table: RecordTable, layout: ParallelLayout, *, origin: str) -> None:
    """Refuse to compare records with a spec of another layout: every number would be silently wrong.

    A rank beyond the spec's world size, or a rank whose recorded coord differs from the one the spec's layout gives
    it, means the records come from another job (missing ranks are fine: that is partial data, reported as such).

    Raises:
        ParseError: naming the first rank that does not fit, its recorded coord and the spec's.
    """
    ranks = table.steps.rank
    beyond = ranks >= layout.world_size
    if beyond.any():
        first = int(ranks[beyond][0])
        raise ParseError(
            f"the records hold rank {first} but {origin} has {layout.world_size} ranks ({layout.describe()}): "
            f"they come from another job or layout; drop --spec or give the job's own spec",
            code=ParseCode.INCONSISTENT,
        )
    known = (table.steps.coord >= 0).all(axis=1)
    if not known.any():
        return
    coords = layout.coords_array(ranks[known])
    expected = np.stack([coords[a] for a in AXES], axis=1)
    recorded = table.steps.coord[known]
    bad = np.nonzero((expected != recorded).any(axis=1))[0]
    if bad.size:
        i = int(bad[0])
        rank = int(ranks[known][i])
        got = " ".join(f"{a.value}={int(v)}" for a, v in zip(AXES, recorded[i], strict=True))
        want = " ".join(f"{a.value}={int(v)}" for a, v in zip(AXES, expected[i], strict=True))
        raise ParseError(
            f"rank {rank} was recorded at {got} but {origin} ({layout.describe()}) puts it at {want}: the records "
            f"come from another layout; drop --spec or give the job's own spec",
            code=ParseCode.INCONSISTENT,
        )


# ====================================================================== rendering


def _seconds(value: float | None) -> str:
    return "-" if value is None else human_seconds(value)


def _signed_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return ("+" if value > 0 else "") + human_seconds(value)


_MAX_UNEVEN_LINES = 10
"""Most "rank-steps differ" lines under the collectives table; the JSON has min and max for every row."""
_STATUS_TEXT = {
    "match": "match",
    "differs": "DIFFERS",
    "partial_sizes": "PARTIAL SIZES",
    "no_sizes": "no sizes recorded",
    "plan_only": "NOT IN RECORDS",
    "records_only": "NOT IN PLAN",
}


def _bytes(value: float | None) -> str:
    return "-" if value is None else human_bytes(value)


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:,g}"


def render_collectives(collectives: Sequence[CollectiveComparison]) -> str:
    """The per-stage collectives table (docs/cost-table.md, "Expected vs measured"), with a line on what differs."""
    return _render_collectives([c.to_dict() for c in collectives])


def _render_collectives(collectives: Sequence[Mapping[str, Any]]) -> str:
    """:func:`render_collectives` from the rows' JSON form (``Analysis.to_dict()["expected_vs_measured"]``)."""
    rows = []
    for c in collectives:
        status = _STATUS_TEXT[c["status"]]
        if c["status"] == "partial_sizes" and c["sized_share"] is not None:
            status += f" ({percent(c['sized_share'])} of intervals carry bytes)"
        if c["share_of_rank_steps"] is not None and c["share_of_rank_steps"] < 1.0:
            status += f", on {percent(c['share_of_rank_steps'])} of rank-steps"
        delta, ratio = c["delta_bytes_per_step"], c["ratio"]
        rows.append(
            [
                str(c["pp_rank"]),
                c["axis"],
                c["op"],
                _bytes(c["expected_bytes_per_step"]),
                _bytes(c["measured_bytes_per_step"]),
                "-" if ratio is None else (f"{ratio:.3f}x" if ratio >= 0.1 else f"{ratio:.3g}x"),
                "-" if delta is None else ("+" if delta > 0 else "") + human_bytes(delta),
                _count(c["expected_count_per_step"]),
                _count(c["measured_count_per_step"]),
                _bytes(c["expected_message_bytes"]),
                _bytes(c["measured_message_bytes"]),
                status,
            ]
        )
    headers = ["stage", "axis", "op", "expected/step", "measured/step", "ratio", "delta", "count exp", "count meas"]
    headers += ["mean msg exp", "mean msg meas", "status"]
    title = (
        "\nCollectives per GPU per step, by pipeline stage: plan vs records (bytes: NCCL message size S summed over "
        "the step's instances, not bus bytes; measured: median over the stage's rank-steps)"
    )
    lines = [render_table(headers, rows, title=title)]
    compared = [c for c in collectives if c["status"] in {"match", "differs"}]
    matched = sum(c["status"] == "match" for c in compared)
    others = Counter(c["status"] for c in collectives if c["status"] not in {"match", "differs"})
    left = ", ".join(f"{n} {_STATUS_TEXT[status].lower()}" for status, n in sorted(others.items()))
    lines.append(
        f"  {matched} of {len(compared)} compared rows match within {percent(MATCH_TOLERANCE)} in bytes per step"
        + (f"; not compared: {left}" if left else "")
    )
    aggregated = [
        c
        for c in compared
        if c["status"] == "match"
        and c["expected_count_per_step"] is not None
        and c["measured_count_per_step"] is not None
        and c["measured_count_per_step"] < c["expected_count_per_step"]
    ]
    uneven = [
        c
        for c in collectives
        if c["measured_min_bytes_per_step"] is not None
        and c["measured_min_bytes_per_step"] != c["measured_max_bytes_per_step"]
    ]
    lines.extend(
        f"  stage {c['pp_rank']} {c['axis']} {c['op']}: rank-steps differ, from "
        f"{_bytes(c['measured_min_bytes_per_step'])} to {_bytes(c['measured_max_bytes_per_step'])} per step "
        f"(median {_bytes(c['measured_bytes_per_step'])})"
        for c in uneven[:_MAX_UNEVEN_LINES]
    )
    if len(uneven) > _MAX_UNEVEN_LINES:
        lines.append(f"  ... and {len(uneven) - _MAX_UNEVEN_LINES} more rows whose rank-steps differ (see --json)")
    if aggregated:
        lines.append(
            f"  {len(aggregated)} matching rows have fewer, larger collectives per step than the plan counts, the "
            "same bytes in all: the job issues them merged or in another split (DDP's buckets, a coalesced or fused "
            "call, an MoE dispatcher of its own; the simulator records one per collective phase)"
        )
    return "\n".join(lines)


def render_analysis(analysis: Analysis) -> str:
    """The analysis for people: findings, the cost table, the summary, expected vs measured, partial data.

    Every number carries its unit. The same text as :func:`render_analysis_dict` of ``analysis.to_dict()``.
    """
    return render_analysis_dict(analysis.to_dict())


def _between_steps_lines(s: Mapping[str, Any]) -> list[str]:
    """The summary's line for the time between steps, where the records measured it and it is not negligible."""
    between = s.get("between_steps_seconds")
    step = s.get("median_step_seconds")
    if between is None or not step or between < BETWEEN_STEPS_SAID_SHARE * step:
        return []
    kinds = s.get("between_steps_kinds_seconds") or {}
    parts = ", ".join(f"{kind} {human_seconds(v)}" for kind, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
    comm = s.get("between_steps_comm_seconds")
    if comm and comm >= BETWEEN_STEPS_SAID_SHARE * step:
        parts += f"; {human_seconds(comm)} of it blocked in collectives"
    return [
        (
            f"  between steps: {human_seconds(between)} per step at the median rank ({parts}), "
            f"{percent(between / step)} on top of the median step: outside every step, so not in the table above"
        )
    ]


BETWEEN_STEPS_SAID_SHARE = 0.01
"""The summary says the time between steps from this share of the median step up."""


def render_analysis_dict(data: Mapping[str, Any]) -> str:
    """:func:`render_analysis` from the analysis' JSON form (:meth:`Analysis.to_dict`, docs/cost-table.md).

    For a table stored away from its records: ``kubectl meshscope cost`` prints what the operator's deep tier kept
    in a ConfigMap exactly as ``meshscope analyze`` prints it.

    Raises:
        KeyError, TypeError, ValueError: for data not of that shape.
    """
    s = data["summary"]
    steps = data["steps"]
    memory = data["expected_vs_measured"]["memory"]
    collectives = data["expected_vs_measured"]["collectives"]
    planned = s.get("ideal_step_source", "plan" if memory else "measured") == "plan"  # older JSON: no source
    seen = f"{data['ranks_seen']} of {data['world_size']} ranks seen"
    span = f"steps {steps['first']}..{steps['last']} ({steps['count']})"
    out = [f"meshscope analyze: job {data['job']!r}: {seen}, {span}"]
    # CPU contention is no data missing but a caveat on every timing: said at the top, not counted as partial data.
    contention = [n for n in data["partial_data"] if n["code"] == CPU_CONTENTION]
    warm_up = [n for n in data["partial_data"] if n["code"] == WARM_UP]
    partial = [n for n in data["partial_data"] if n["code"] not in {CPU_CONTENTION, WARM_UP}]
    out.extend(f"CPU CONTENTION: {n['message']}" for n in contention)
    out.extend(f"WARM-UP: {n['message']}" for n in warm_up)
    if partial:
        n = len(partial)
        marked = any(str(r["label"]).endswith("(partial data)") for r in data["rows"])
        pointer = ": rows marked '(partial data)'" if marked else ""  # a note of what was left out may mark none
        out.append(f"PARTIAL DATA ({n} note{'' if n == 1 else 's'}, listed at the end){pointer}")
    findings = data["findings"]
    if findings:
        lines = [f"\nFindings ({len(findings)}, most costly first)"]
        for i, f in enumerate(findings, 1):
            lines.append(f"{i}. [{str(f['severity']).upper()}] {f['code']}: {f['message']}")
        out.append("\n".join(lines))
    else:
        out.append("\nFindings: none")
    out.append(_render_rows(data))
    gpu_util = "not reported" if s["reported_gpu_util"] is None else percent(s["reported_gpu_util"])
    out.append(
        "\n".join(
            [
                "\nSummary",
                (
                    f"  step time: median {human_seconds(s['median_step_seconds'])}, "
                    f"max {human_seconds(s['max_step_seconds'])}"
                ),
                (
                    f"  straggler gap: {human_seconds(s['straggler_gap_seconds'])} per step (slowest rank "
                    f"{s['slowest_rank']}: its mean own time, without waiting, beyond its stage's median rank)"
                ),
                (
                    f"  efficiency: {percent(s['efficiency'])} (ideal step {human_seconds(s['ideal_step_seconds'])} = "
                    f"compute + optimizer{' as planned' if planned else ' of the median rank'})"
                ),
                (
                    f"  useful compute: {percent(s['useful_compute_share'])} of the step; reported GPU utilisation: "
                    f"{gpu_util} (a GPU waiting in a collective reads as busy)"
                ),
                *_between_steps_lines(s),
            ]
        )
    )
    if collectives:
        out.append(_render_collectives(collectives))
    if memory:
        rows = [
            [
                str(m["pp_rank"]),
                "-" if m["expected_bytes"] is None else human_bytes(m["expected_bytes"]),
                "not measured" if m["measured_peak_bytes"] is None else human_bytes(m["measured_peak_bytes"]),
            ]
            for m in memory
        ]
        out.append(render_table(["stage", "planned", "measured peak"], rows, title="\nMemory per GPU per stage"))
    if partial:
        out.append("\nPartial data")
        out.extend(f"  {n['code']} ({n['count']:,}): {n['message']}" for n in partial)
    return "\n".join(out)


def _render_rows(data: Mapping[str, Any]) -> str:
    device = data["device"]
    rows_data = data["rows"]
    headers = ["category", "expected", "median", "p95", "worst rank", "worst", "share", "delta", f"{device}-h/day"]
    rows = [
        [
            r["label"],
            _seconds(r["expected_seconds"]),
            human_seconds(r["measured_median_seconds"]),
            human_seconds(r["measured_p95_seconds"]),
            "-" if r["worst_rank"] is None else str(r["worst_rank"]),
            human_seconds(r["worst_seconds"]),
            percent(r["share_of_step"]),
            _signed_seconds(r["delta_seconds"]),
            f"{r['gpu_hours_per_day']:,.1f} {device}-h",
        ]
        for r in rows_data
    ]
    units = "GPUs" if device == "GPU" else "ranks"
    title = f"\nCost table (per step; median over rank-steps; {device}-hours per day at {data['world_size']} {units})"
    table = render_table(headers, rows, title=title).split("\n")
    # Top suspects go after the numbers, left-aligned: title, header and rule lines come first.
    width = max(len(line) for line in table[2:])
    body = [*table[:2], table[2].ljust(width) + "  top suspect", table[3]]
    for line, r in zip(table[4:], rows_data, strict=True):
        body.append(line.ljust(width) + "  " + ("" if r["suspect"] is None else r["suspect"]["message"]))
    body.extend(f"  {r['label']} expected: {r['expected_basis']}" for r in rows_data if r["expected_basis"])
    return "\n".join(body)

"""The cost table: what each breakdown category costs the job, expected vs measured, and who to suspect.

Exists to turn a :class:`~meshscope.analysis.breakdown.Breakdown` (one row of category times per rank-step) into the
numbers people act on (DESIGN.md, "The cost table"): per category the plan's expectation, the measured median, p95 and
worst rank, the share of the step, the delta, what it costs at job scale in GPU-hours per day and the top suspect (rank,
node, group); beside it a summary (step time, straggler gap, efficiency, useful compute vs reported GPU utilisation),
collective bytes per GPU per step and memory, per pipeline stage, against the plan, and every partial-data note.
Definitions are in ``docs/cost-table.md``.

It works on numpy columns, vectorised over rank-steps and intervals (per-rank aggregates by ``bincount`` and one sort
per grouped median); loops run over categories, axes and plan entries, never over ranks. It must not read files,
must not diagnose (that is :mod:`meshscope.analysis.diagnosis`) and must never print a number computed on partial data
without saying so: such rows carry ``partial=True`` and the reason is in the notes.

Three parts live in modules of their own and are re-exported here: the per-collective transfer measurement
(:mod:`meshscope.analysis.transfers`), the grouped quantile, median and mean (:mod:`meshscope.analysis.grouping`) and
the collectives' bytes per stage, plan vs records (:mod:`meshscope.analysis.collectives`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from meshscope.analysis.breakdown import (
    BUBBLE,
    CATEGORIES,
    CATEGORY_INDEX,
    CHECKPOINT,
    COMPUTE,
    DATA,
    OPTIMIZER,
    OTHER,
    SYNC_WAIT,
    TICKS_PER_US,
    TRANSFER,
    comm_category,
)
from meshscope.analysis.collectives import SEND_RECV, CollectiveComparison, compare_collectives
from meshscope.analysis.grouping import grouped_mean, grouped_median, grouped_quantile, median_rank_value
from meshscope.analysis.transfers import MIN_TRANSFER_BYTES, Transfers, bus_factor, measure_transfers, place_of_rows
from meshscope.formatting import human_seconds, percent
from meshscope.records import BETWEEN_KINDS, COMM_CODE, P2P_CODE, Note
from meshscope.topology import AXES, MeshAxis

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from numpy.typing import NDArray

    from meshscope.analysis.breakdown import Breakdown
    from meshscope.plan import Plan

__all__ = [
    "EVEN_SPREAD",
    "HOURS_PER_DAY",
    "MIN_TRANSFER_BYTES",
    "SEND_RECV",
    "WHOLE_TABLE_NOTES",
    "CollectiveComparison",
    "CostRow",
    "MemoryComparison",
    "PipelineExpectation",
    "RankSteps",
    "Summary",
    "Suspect",
    "Transfers",
    "WaitCaused",
    "axes_in_use",
    "bus_factor",
    "category_label",
    "compare_collectives",
    "compare_memory",
    "cost_rows",
    "expected_by_category",
    "expected_pipeline",
    "grouped_mean",
    "grouped_median",
    "grouped_quantile",
    "index_rank_steps",
    "layout_order_notes",
    "measure_transfers",
    "missing_traffic_notes",
    "own_time_us",
    "partial_categories",
    "partial_notes",
    "place_of_rows",
    "stage_expected",
    "summarise",
    "wait_caused",
]

HOURS_PER_DAY = 24.0
EVEN_SPREAD = 1.05
"""A worst rank within this factor of the median rank is reported as "spread evenly", not as a suspect to chase."""

WHOLE_TABLE_NOTES = frozenset(
    {
        "missing_ranks",
        "missing_rank_steps",
        "truncated_line",
        "truncated_file",
        "rejected_job_files",
        "layout_order_mismatch",
    }
)
"""Notes that make every row partial: rank-steps the medians and percentiles could not see."""
_P2P_NOTES = frozenset({"p2p_without_bandwidth", "p2p_without_bytes"})


def _dense_codes(values: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.intp]]:
    """Distinct values (sorted) and each value's index into them."""
    uniq, inverse = np.unique(values, return_inverse=True)
    return uniq, inverse.reshape(-1)


# ====================================================================== rank-steps, indexed


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSteps:
    """A breakdown indexed by rank and step, with the per-rank aggregates the cost table and diagnosis share.

    Rows are aligned with ``breakdown.table.steps``; "rank index" means the position in :attr:`ranks`.
    """

    breakdown: Breakdown
    """The breakdown."""
    ranks: NDArray[np.int64]
    """Distinct ranks seen, sorted."""
    rank_index: NDArray[np.intp]
    """Rank index of each rank-step."""
    steps: NDArray[np.int64]
    """Distinct steps seen, sorted."""
    step_index: NDArray[np.intp]
    """Step index of each rank-step."""
    steps_per_rank: NDArray[np.int64]
    """Rank-steps of each rank."""
    node_of_rank: NDArray[np.int64]
    """Node code of each rank (its first record's)."""
    coord_of_rank: NDArray[np.int64]
    """Shape ``(ranks, 5)``, axes in :data:`meshscope.topology.layout.AXES` order."""
    category_us: NDArray[np.float64]
    """Shape ``(rows, len(CATEGORIES))``, µs."""
    step_us: NDArray[np.float64]
    """Step time of each rank-step, µs."""
    rank_mean_us: NDArray[np.float64]
    """Shape ``(ranks, len(CATEGORIES))``: each rank's mean over its steps, µs."""
    caused_per_step_us: NDArray[np.float64]
    """Shape ``(ranks, 5)``: sync wait each rank is charged with per axis (it caused it, directly or through ranks that
    waited for it: ``Breakdown.wait_paid_us``), summed over members, per step of that rank."""
    group_of_rank: NDArray[np.int64]
    """Shape ``(ranks, 5)``: a collective group code of each rank on each axis, -1 if none."""
    median_step_us: float
    """Median step time over rank-steps, µs."""
    on_gpu: bool = True
    """Whether the records come from GPUs (a GPU index or a reported utilisation on any record)."""

    @property
    def device(self) -> str:
        """``GPU``, or ``rank`` for a run without GPUs: the word before "time" and "-hours" in every message."""
        return "GPU" if self.on_gpu else "rank"

    @property
    def n_ranks(self) -> int:
        """Distinct ranks seen."""
        return int(self.ranks.shape[0])

    @property
    def n_steps(self) -> int:
        """Distinct steps seen."""
        return int(self.steps.shape[0])

    def node_name(self, rank_index: int) -> str:
        """Node name of the rank at ``rank_index``."""
        return self.breakdown.table.node_name(int(self.node_of_rank[rank_index]))

    def group_name(self, rank_index: int, axis: int) -> str | None:
        """Name of a group of the rank at ``rank_index`` on ``axis``, or ``None``."""
        code = int(self.group_of_rank[rank_index, axis])
        return self.breakdown.table.group_name(code) if code >= 0 else None

    def us(self, category: str) -> NDArray[np.float64]:
        """One category for every rank-step, µs."""
        return self.category_us[:, CATEGORY_INDEX[category]]


def index_rank_steps(breakdown: Breakdown) -> RankSteps:
    """Index ``breakdown`` by rank and step and aggregate per rank (vectorised).

    Raises:
        ValueError: for an empty table (nothing to index).
    """
    table = breakdown.table
    s = table.steps
    if table.n_rows == 0:
        raise ValueError("the table has no rank-steps")
    ranks, rank_index = _dense_codes(s.rank)
    steps, step_index = _dense_codes(s.step)
    n_ranks = int(ranks.shape[0])
    steps_per_rank = np.bincount(rank_index, minlength=n_ranks).astype(np.int64)
    first_row = np.full(n_ranks, -1, dtype=np.int64)
    first_row[rank_index[::-1]] = np.arange(table.n_rows - 1, -1, -1)
    category_us = breakdown.ticks / float(TICKS_PER_US)
    rank_sum = np.stack(
        [np.bincount(rank_index, weights=category_us[:, k], minlength=n_ranks) for k in range(len(CATEGORIES))],
        axis=1,
    )
    per_rank = steps_per_rank[:, None].astype(np.float64)
    caused = np.stack(
        [np.bincount(rank_index, weights=breakdown.wait_paid_us[:, a], minlength=n_ranks) for a in range(len(AXES))],
        axis=1,
    )
    step_us = (s.end_us - s.start_us).astype(np.float64)
    return RankSteps(
        breakdown=breakdown,
        ranks=ranks,
        rank_index=rank_index,
        steps=steps,
        step_index=step_index,
        steps_per_rank=steps_per_rank,
        node_of_rank=s.node[first_row].astype(np.int64),
        coord_of_rank=s.coord[first_row],
        category_us=category_us,
        step_us=step_us,
        rank_mean_us=rank_sum / per_rank,
        caused_per_step_us=caused / per_rank,
        group_of_rank=_group_of_rank(breakdown, rank_index, n_ranks),
        median_step_us=float(np.median(step_us)),
        on_gpu=table.on_gpu,
    )


def _group_of_rank(breakdown: Breakdown, rank_index: NDArray[np.intp], n_ranks: int) -> NDArray[np.int64]:
    iv = breakdown.table.intervals
    out = np.full(n_ranks * len(AXES), -1, dtype=np.int64)
    comm = np.flatnonzero((iv.kind == COMM_CODE) & (iv.group >= 0))
    if comm.size:
        out[rank_index[iv.row[comm]] * len(AXES) + iv.axis[comm]] = iv.group[comm]
    return out.reshape(n_ranks, len(AXES))


# ====================================================================== partial data


def partial_notes(rs: RankSteps, *, world_size: int | None, extra: Sequence[Note] = ()) -> tuple[Note, ...]:
    """Everything the numbers had to do without: missing ranks and rank-steps, then the breakdown's notes.

    Args:
        rs: the indexed breakdown.
        world_size: ranks the job has (from the spec or plan); ``None``: assume ranks ``0 .. max rank seen``.
        extra: notes from reading (e.g. files of another job left out), listed first.
    """
    notes = list(extra)
    expected = world_size if world_size is not None else int(rs.ranks.max()) + 1
    missing = expected - int(np.count_nonzero(rs.ranks < expected))
    if missing > 0:
        absent = np.setdiff1d(np.arange(expected), rs.ranks)
        example = ", ".join(str(int(r)) for r in absent[:5]) + (", ..." if absent.size > 5 else "")
        source = "the spec's world size" if world_size is not None else "ranks 0 .. the highest rank seen"
        notes.append(
            Note(
                code="missing_ranks",
                count=missing,
                message=(
                    f"{missing} of {expected} ranks ({source}) have no records (e.g. rank {example}); medians, "
                    f"percentiles and suspects cover the {rs.n_ranks - int(np.count_nonzero(rs.ranks >= expected))} "
                    f"ranks seen"
                ),
            )
        )
    beyond = int(np.count_nonzero(rs.ranks >= expected))
    if beyond:
        notes.append(
            Note(
                code="ranks_beyond_world_size",
                count=beyond,
                message=f"{beyond} ranks seen are >= the world size {expected} (e.g. rank {int(rs.ranks.max())})",
            )
        )
    grid = rs.n_ranks * rs.n_steps
    holes = grid - rs.breakdown.table.n_rows
    if holes:
        short = int(np.count_nonzero(rs.steps_per_rank < rs.n_steps))
        notes.append(
            Note(
                code="missing_rank_steps",
                count=holes,
                message=(
                    f"{holes} of {grid} rank-steps ({rs.n_ranks} ranks x {rs.n_steps} steps) have no record; "
                    f"{short} ranks miss at least one step"
                ),
            )
        )
    seen = {n.code for n in notes}
    notes.extend(n for n in rs.breakdown.notes if n.code not in seen)
    return tuple(notes)


_MISSING_CAUSES = {
    "dp": (
        "the script never wrapped the model for data parallelism (Accelerate and the Hugging Face Trainer go "
        "distributed on a machine without GPUs only with Accelerator(cpu=True) or TrainingArguments(use_cpu=True)), "
        "the model was wrapped in DDP with a builtin comm hook before the tracker started (the ranks' uncaptured_ddp "
        "counter says so), or the dp groups were neither registered nor inferable from the layout"
    ),
    "pp": "the stages' sends and receives ran on groups the SDK could not attribute to pp",
}
_DEFAULT_CAUSE = "its process groups were neither registered (tracker.register_groups) nor inferable from the layout"


def missing_traffic_notes(rs: RankSteps, plan: Plan | None) -> tuple[Note, ...]:
    """One note per axis the layout enables whose traffic appears in no record: its comm rows read zero, wrongly.

    The layout is the plan's when there is one, else what the records' coords show (an axis on which some rank sits
    at index 1 or more has a degree above 1).
    """
    table = rs.breakdown.table
    iv = table.intervals
    if plan is not None:
        degrees = {a.value: plan.layout.degree(a) for a in AXES}
        source = "the layout enables"
    else:
        coord = table.steps.coord
        top = coord.max(axis=0) if coord.size else np.zeros(len(AXES), dtype=np.int64)
        degrees = {a.value: int(top[i]) + 1 for i, a in enumerate(AXES)}
        source = "the records' coords enable"
    net = iv.kind >= COMM_CODE
    seen = {AXES[a].value for a in np.unique(iv.axis[net]).tolist() if a >= 0}
    notes = []
    for axis, degree in degrees.items():
        if degree <= 1 or axis in seen:
            continue
        size = f"{axis}={degree}" if plan is not None else f"{axis} >= {degree}"
        notes.append(
            Note(
                code="missing_axis_traffic",
                count=table.n_rows,
                message=(
                    f"{source} {axis} ({size}) but no record holds a {axis} collective: its communication was "
                    f"not captured and its rows read zero; likely cause: {_MISSING_CAUSES.get(axis, _DEFAULT_CAUSE)}"
                ),
            )
        )
    return tuple(notes)


def layout_order_notes(rs: RankSteps) -> tuple[Note, ...]:
    """A note where the records' own traffic says their coordinates follow another rank order than the script's.

    Pipeline stages exchange activations point to point; data-parallel replicas never do. Sends and receives that
    the records put on dp, in a job whose layout has pipeline stages and no pp traffic of its own, are a pipeline's
    under a layout whose rank order is not the script's: ``init_device_mesh(..., ("dp", "pp"))`` varies pp fastest,
    the layout's default order (Megatron's) dp. Then every axis, stage and peer comparison reads the wrong ranks.
    """
    table = rs.breakdown.table
    iv = table.intervals
    p2p = iv.kind == P2P_CODE
    on = {AXES[a].value for a in np.unique(iv.axis[p2p]).tolist() if a >= 0}
    pp_degree = int(table.steps.coord[:, AXES.index(MeshAxis.PP)].max()) + 1 if table.n_rows else 1
    if "dp" not in on or "pp" in on or pp_degree <= 1:
        return ()
    count = int(np.count_nonzero(p2p & (iv.axis == AXES.index(MeshAxis.DP))))
    return (
        Note(
            code="layout_order_mismatch",
            count=count,
            message=(
                f"{count} point-to-point sends and receives lie on dp, none on pp, in a layout with "
                f"{pp_degree} pipeline stages: the layout's rank order is likely not the script's (a DeviceMesh "
                "built as (dp, pp) varies pp fastest, the layout's default order, Megatron's, dp), so every axis, "
                "stage and peer here may be another's; give the layout the mesh's order (--layout ...,order=pp-dp-"
                "tp-cp-ep for a (dp, pp) mesh) or call tracker.register_mesh(mesh) (docs/sdk.md §1.2)"
            ),
        ),
    )


def partial_categories(rs: RankSteps, notes: Iterable[Note]) -> frozenset[str]:
    """The categories whose numbers rest on partial data, given the notes."""
    codes = {n.code for n in notes}
    if codes & WHOLE_TABLE_NOTES:
        return frozenset(CATEGORIES)
    out: set[str] = set()
    join = rs.breakdown.collectives
    if "incomplete_collectives" in codes and len(join):
        for a in np.unique(join.axis[~join.complete]).tolist():
            out.update(comm_category(AXES[a], p) for p in (TRANSFER, SYNC_WAIT))
    if codes & _P2P_NOTES:
        out.update({BUBBLE, comm_category("pp", TRANSFER)})
    return frozenset(out)


# ====================================================================== the table


@dataclass(frozen=True, slots=True, kw_only=True)
class Suspect:
    """Who to look at first: a rank, its node and a group (any may be unknown)."""

    rank: int | None
    """Global rank."""
    node: str | None
    """Node name."""
    group: str | None
    """Process group, e.g. ``dp:2``."""
    message: str = ""
    """One sentence with the numbers (cost-table rows only)."""

    def to_dict(self, *, message: bool = True) -> dict[str, Any]:
        """``{rank, node, group[, message]}``."""
        out: dict[str, Any] = {"rank": self.rank, "node": self.node, "group": self.group}
        if message:
            out["message"] = self.message
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class CostRow:
    """One breakdown category: expected vs measured and what it costs at job scale."""

    category: str
    """Breakdown category, e.g. ``comm.dp.sync_wait``."""
    label: str
    """For people, e.g. ``dp sync wait``; ends in ``(partial data)`` when :attr:`partial`."""
    expected_seconds: float | None
    """From the plan; ``None`` without one, or for a category the plan does not model."""
    measured_median_seconds: float
    """Median over rank-steps (checkpoint: the mean, i.e. amortised per step)."""
    measured_p95_seconds: float
    """95th percentile over rank-steps (checkpoint: over the ranks' means, amortised as the median is)."""
    worst_rank: int | None
    """Rank with the largest mean over its steps; ``None`` when the category is zero everywhere."""
    worst_seconds: float
    """That rank's mean per step."""
    share_of_step: float
    """``measured_median_seconds`` ÷ the median step time."""
    delta_seconds: float | None
    """``measured − expected``; ``None`` when nothing is expected."""
    gpu_hours_per_day: float
    """``share_of_step × world_size × 24``."""
    suspect: Suspect | None
    """Top suspect; ``None`` when the category is zero everywhere."""
    partial: bool = False
    """Computed on partial data (see the analysis' notes)."""
    expected_basis: str | None = None
    """How :attr:`expected_seconds` was scaled to the run's own measurements (like for like); ``None``: the plan's
    number as planned."""

    def to_dict(self) -> dict[str, Any]:
        """The row's JSON form (docs/cost-table.md)."""
        return {
            "category": self.category,
            "label": self.label,
            "expected_seconds": self.expected_seconds,
            "expected_basis": self.expected_basis,
            "measured_median_seconds": self.measured_median_seconds,
            "measured_p95_seconds": self.measured_p95_seconds,
            "worst_rank": self.worst_rank,
            "worst_seconds": self.worst_seconds,
            "share_of_step": self.share_of_step,
            "delta_seconds": self.delta_seconds,
            "gpu_hours_per_day": self.gpu_hours_per_day,
            "suspect": None if self.suspect is None else self.suspect.to_dict(),
        }


def category_label(category: str) -> str:
    """``comm.dp.sync_wait`` -> ``dp sync wait``; ``bubble`` -> ``pipeline bubble``; ``data`` -> ``data wait``."""
    if category.startswith("comm."):
        _, axis, part = category.split(".")
        return f"{axis} {part.replace('_', ' ')}"
    return {BUBBLE: "pipeline bubble", DATA: "data wait", CHECKPOINT: "checkpoint (amortised)"}.get(category, category)


def stage_expected(plan: Plan, pp_rank: int) -> dict[str, float | None]:
    """The plan's expected seconds per category for one GPU of stage ``pp_rank``.

    Compute, exposed comm per axis and optimizer are the stage's own; sync wait expects the calibrated
    sync wait per collective of the axis (``PlanAssumptions.sync_wait_per_collective``) x its collectives per step
    (0 by default); data and other expect the
    assumptions' ``data_wait_seconds`` and ``host_overhead_seconds`` (other is ``None``, not planned, while that is 0);
    checkpoint is not planned (``None``). The bubble is the plan's bubble plus the time the stage waits for the slowest
    stage every step (the critical stage's expected step minus this stage's): a synchronous step lasts as long as
    its slowest stage, and a faster stage spends the difference waiting on its pipeline neighbours.
    """
    critical = plan.expected_step_time
    t = plan.stages[pp_rank].step_time if 0 <= pp_rank < len(plan.stages) else critical
    out: dict[str, float | None] = {
        COMPUTE: t.compute_seconds,
        BUBBLE: t.bubble_seconds + max(0.0, critical.total_seconds - t.total_seconds),
        DATA: t.data_seconds,
        OPTIMIZER: t.optimizer_seconds,
        CHECKPOINT: None,
        OTHER: t.other_seconds if plan.assumptions.host_overhead_seconds > 0 else None,
    }
    for axis in AXES:
        out[comm_category(axis, TRANSFER)] = float(t.exposed_comm_seconds.get(axis.value, 0.0))
        out[comm_category(axis, SYNC_WAIT)] = float((t.sync_wait_seconds or {}).get(axis.value, 0.0))
    return out


def expected_by_category(plan: Plan | None, pp_of_row: NDArray[np.int64] | None = None) -> dict[str, float | None]:
    """The expected column (docs/cost-table.md): the median over rank-steps of their stage's expectation.

    Per category, each rank-step expects its own stage's :func:`stage_expected`; the median of that compares with the
    measured median like for like.

    Args:
        plan: the plan; all ``None`` without one.
        pp_of_row: the pipeline stage of every rank-step; ``None`` (or no row inside the plan's stages): the
            plan's critical stage.
    """
    if plan is None:
        return dict.fromkeys(CATEGORIES)
    if pp_of_row is None:
        return stage_expected(plan, plan.expected_step_time.pp_rank)
    weights = np.bincount(pp_of_row[(pp_of_row >= 0) & (pp_of_row < len(plan.stages))], minlength=len(plan.stages))
    if weights.sum() == 0:
        return stage_expected(plan, plan.expected_step_time.pp_rank)
    per_stage = [stage_expected(plan, r) for r in range(len(plan.stages))]
    out: dict[str, float | None] = {}
    for category in CATEGORIES:
        values = [st[category] for st in per_stage]
        if any(v is None for v in values):
            out[category] = None
            continue
        out[category] = _weighted_median(np.array(values, dtype=np.float64), weights)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineExpectation:
    """Pipeline waiting expected of every rank-step, on the run's own measured compute (like for like).

    The plan's bubble is an absolute time computed from the plan's compute; when the job computes slower or faster
    than planned (another GPU, a host's own CPU work, an emulated accelerator on shared cores), the bubble scales
    with it. So the expectation keeps the plan's *shape* and takes the times from the measurement: per rank-step,
    the plan's bubble fraction ÷ (pp - 1) x the measured passes of the step's other stages than its slowest (their
    compute plus the exposed tensor, context and expert parallel transfers inside them, on the pipeline's critical
    path: a micro-batch fills and drains through them while the slowest stage idles), plus the measured wait
    for the slowest stage (its passes + optimizer minus this stage's, in the same step), plus the plan's exposed pp
    transfer of the stage (bytes over the spec's link, the same bandwidth the breakdown splits transfer off with).
    """

    bubble_us: NDArray[np.float64]
    """Expected pipeline bubble of every rank-step, µs."""
    transfer_us: NDArray[np.float64]
    """The plan's exposed pp transfer of every rank-step's stage, µs."""
    compute_scale: float
    """Median over steps of the slowest stage's measured compute ÷ the plan's compute of its critical stage."""
    planned_bubble_seconds: float
    """The plan's own bubble (absolute, on the plan's compute), seconds."""

    @property
    def waiting_us(self) -> NDArray[np.float64]:
        """Expected bubble + exposed pp transfer of every rank-step, µs."""
        return self.bubble_us + self.transfer_us

    def basis(self, plan: Plan) -> str:
        """How the expectation was made, for people (the cost table's note, the finding's evidence)."""
        return (
            f"the plan's bubble fraction {plan.bubble_fraction:.3g} ÷ (pp - 1) x the measured passes of the stages "
            f"the slowest waits on (compute {self.compute_scale:.2f}x the plan's, plus their exposed tp/cp/ep "
            f"transfers and waits), plus each stage's measured wait for the slowest stage; the "
            f"plan alone expects {human_seconds(self.planned_bubble_seconds)}"
        )


def expected_pipeline(rs: RankSteps, plan: Plan | None) -> PipelineExpectation | None:
    """The like-for-like pipeline expectation (:class:`PipelineExpectation`); ``None`` without a pipeline."""
    if plan is None or plan.layout.pp < 2 or not plan.stages:
        return None
    n_stages = len(plan.stages)
    stage = np.clip(rs.breakdown.table.steps.coord[:, AXES.index("pp")], 0, n_stages - 1).astype(np.int64)
    key = rs.step_index.astype(np.int64) * n_stages + stage
    n_groups = rs.n_steps * n_stages
    # A micro-batch's pass is its compute plus the exposed communication inside it (tensor, context and expert
    # parallel: on the pipeline's critical path), transfer and sync wait: the bubble scales with the pass as the
    # neighbour stages see it, not with compute alone. The sync wait counts too: a stage's pass ends when the last of
    # its ranks is done, and on shared cores the ranks of a stage wait for each other with no straggler (the demo
    # beside two spinning processes: 73 ms of tp sync wait a rank-step, and pipeline waiting 1.51x what the passes
    # without it implied, a false finding in 1 of 6 runs). A straggler or an imbalance that causes such waits is
    # found as itself, and its delay explains the bubble it adds (diagnosis._bubble).
    in_pass = sum(rs.us(comm_category(a, kind)) for a in ("tp", "cp", "ep") for kind in (TRANSFER, SYNC_WAIT))
    compute = rs.us(COMPUTE)
    busy = compute + in_pass + rs.us(OPTIMIZER)
    passes = grouped_median(key, compute + in_pass, n_groups).reshape(rs.n_steps, n_stages)
    stage_compute = grouped_median(key, compute, n_groups).reshape(rs.n_steps, n_stages)
    stage_busy = grouped_median(key, busy, n_groups)
    with np.errstate(all="ignore"):
        slowest_compute = np.nanmax(stage_compute, axis=1)
        slowest_pass = np.nanmax(passes, axis=1)
        # the slowest stage idles while a micro-batch fills and drains through the other stages (planning's
        # _bubble_seconds): fraction ÷ (p - 1) x their passes; a stage with no record that step counts as the slowest
        other_passes = np.nansum(np.where(np.isnan(passes), slowest_pass[:, None], passes), axis=1) - slowest_pass
        slowest_busy = np.nanmax(stage_busy.reshape(rs.n_steps, n_stages), axis=1)
    step = rs.step_index
    fill = plan.bubble_fraction / (n_stages - 1) * other_passes
    bubble = fill[step] + np.maximum(0.0, slowest_busy[step] - stage_busy[key])
    pp_transfer = comm_category("pp", TRANSFER)
    per_stage = np.array([stage_expected(plan, r)[pp_transfer] or 0.0 for r in range(n_stages)])
    critical = plan.expected_step_time
    planned_us = critical.compute_seconds * 1e6
    scale = float(np.median(slowest_compute)) / planned_us if planned_us > 0 else math.nan
    return PipelineExpectation(
        bubble_us=bubble,
        transfer_us=per_stage[stage] * 1e6,
        compute_scale=scale,
        planned_bubble_seconds=critical.bubble_seconds,
    )


def _weighted_median(values: NDArray[np.float64], weights: NDArray[np.int64]) -> float:
    """Median of ``values`` repeated ``weights`` times (the midpoint of the two middle ones for an even count)."""
    order = np.argsort(values, kind="stable")
    v, cum = values[order], np.cumsum(weights[order])
    total = int(cum[-1])
    lo = v[int(np.searchsorted(cum, (total - 1) // 2, side="right"))]
    hi = v[int(np.searchsorted(cum, total // 2, side="right"))]
    return float(0.5 * (lo + hi))


def axes_in_use(rs: RankSteps, plan: Plan | None) -> frozenset[str]:
    """Axes the layout enables (with a plan) or the records communicate on."""
    iv = rs.breakdown.table.intervals
    net = iv.kind >= COMM_CODE
    used = {AXES[a].value for a in np.unique(iv.axis[net]).tolist() if a >= 0}
    if plan is not None:
        used.update(a.value for a in AXES if plan.layout.enabled(a))
    return frozenset(used)


def cost_rows(
    rs: RankSteps,
    *,
    plan: Plan | None,
    world_size: int,
    partial: frozenset[str] = frozenset(),
) -> tuple[CostRow, ...]:
    """The cost table: one row per category, comm rows of unused axes left out when zero everywhere.

    Args:
        rs: the indexed breakdown.
        plan: the plan for the expected column, or ``None``.
        world_size: GPUs the GPU-hours are scaled to.
        partial: categories computed on partial data (:func:`partial_categories`).
    """
    expected = expected_by_category(plan, rs.breakdown.table.steps.coord[:, AXES.index("pp")])
    basis: dict[str, str] = {}
    pipeline = expected_pipeline(rs, plan)
    if pipeline is not None and plan is not None:
        expected[BUBBLE] = float(np.median(pipeline.bubble_us)) / 1e6
        basis[BUBBLE] = pipeline.basis(plan)
    in_use = axes_in_use(rs, plan)
    median_step = rs.median_step_us
    stats = np.percentile(rs.category_us, [50.0, 95.0], axis=0)
    means = rs.category_us.mean(axis=0)
    rows = []
    for k, category in enumerate(CATEGORIES):
        worst_index = int(np.argmax(rs.rank_mean_us[:, k]))
        worst_us = float(rs.rank_mean_us[worst_index, k])
        if category.startswith("comm."):
            axis = category.split(".")[1]
            if axis not in in_use and worst_us == 0.0:
                continue
        median_us = float(means[k]) if category == CHECKPOINT else float(stats[0, k])
        # amortised too: the 95th percentile of the ranks' means (of rank-steps it is 0 or a whole save, and one save
        # in 50 steps put it under the row's own amortised figure)
        p95_us = float(np.percentile(rs.rank_mean_us[:, k], 95.0)) if category == CHECKPOINT else float(stats[1, k])
        share = median_us / median_step if median_step > 0 else 0.0
        exp = expected[category]
        label = category_label(category) + (" (partial data)" if category in partial else "")
        rows.append(
            CostRow(
                category=category,
                label=label,
                expected_seconds=exp,
                measured_median_seconds=median_us / 1e6,
                measured_p95_seconds=p95_us / 1e6,
                worst_rank=int(rs.ranks[worst_index]) if worst_us > 0 else None,
                worst_seconds=worst_us / 1e6,
                share_of_step=share,
                delta_seconds=None if exp is None else median_us / 1e6 - exp,
                gpu_hours_per_day=share * world_size * HOURS_PER_DAY,
                suspect=_suspect(rs, k, worst_index, worst_us) if worst_us > 0 else None,
                partial=category in partial,
                expected_basis=basis.get(category),
            )
        )
    return tuple(rows)


def _suspect(rs: RankSteps, k: int, worst_index: int, worst_us: float) -> Suspect:
    category = CATEGORIES[k]
    if category.endswith(SYNC_WAIT):
        axis = category.split(".")[1]
        caused = _wait_suspect(rs, AXES.index(axis))
        if caused is not None:
            return caused
    if category == BUBBLE:
        slow_stage = _bubble_suspect(rs)
        if slow_stage is not None:
            return slow_stage
    median_us = median_rank_value(rs.rank_mean_us[:, k])
    axis_code = AXES.index(category.split(".")[1]) if category.startswith("comm.") else -1
    rank = int(rs.ranks[worst_index])
    node = rs.node_name(worst_index)
    label = category_label(category)
    if worst_us <= EVEN_SPREAD * median_us:
        message = (
            f"spread evenly over ranks: median rank {human_seconds(median_us / 1e6)}, worst rank {rank} on {node} "
            f"{human_seconds(worst_us / 1e6)} per step"
        )
    else:
        message = (
            f"rank {rank} on {node} spends {human_seconds(worst_us / 1e6)} per step in {label} (median rank "
            f"{human_seconds(median_us / 1e6)})"
        )
    return Suspect(
        rank=rank,
        node=node,
        group=rs.group_name(worst_index, axis_code) if axis_code >= 0 else None,
        message=message,
    )


def _bubble_suspect(rs: RankSteps) -> Suspect | None:
    """The rank the other pipeline stages wait for, where one stage's own time stands out; else ``None``.

    A stage idles in the bubble while its neighbours work: with even stages that is the schedule's fill and drain,
    and the rank with the most bubble (the generic suspect) is only the one that waits the most. Where one stage takes
    longer per step in its own time (:func:`own_time_us`: not waiting for others) than every other stage's slowest
    rank by more than :data:`EVEN_SPREAD`, the others wait for it: its slowest rank is the suspect (a pipeline stage
    has no peers to be a straggler against, so this is where a slow stage is named). A stage's time is its slowest
    rank's: a stage waits for the last of its tensor-parallel ranks.
    """
    stage_of_rank = rs.coord_of_rank[:, AXES.index("pp")]
    stages = np.unique(stage_of_rank)
    if stages.size < 2:
        return None
    own = grouped_median(rs.rank_index, own_time_us(rs), rs.n_ranks)
    slowest = np.array([own[stage_of_rank == s].max() for s in stages])
    order = np.argsort(slowest)
    top, runner_up = float(slowest[order[-1]]), float(slowest[order[-2]])
    if top <= EVEN_SPREAD * runner_up:
        return None
    stage = int(stages[order[-1]])
    members = np.flatnonzero(stage_of_rank == stage)
    index = int(members[np.argmax(own[members])])
    rest = float(np.median(np.delete(slowest, order[-1])))
    rank, node = int(rs.ranks[index]), rs.node_name(index)
    return Suspect(
        rank=rank,
        node=node,
        group=rs.group_name(index, AXES.index("pp")),
        message=(
            f"the other stages wait for pipeline stage {stage}: rank {rank} on {node} takes "
            f"{human_seconds(top / 1e6)} per step of its own time (the step less its waits: its transfers in it), "
            f"the other stages' slowest ranks {human_seconds(rest / 1e6)}"
        ),
    )


ONE_STEP_SHARE = 1 / 3
"""A rank's sync-wait charge said to lie largely in one step when that step holds at least this share of it: beside
two burners an FSDP2 run's dp row named rank 0 at 4.85 ms a step, 35 % of it from one step (two reduce-scatters it
reached 10 ms late), over the imbalanced rank 3's steady 4.38 ms."""
ONE_STEP_MIN_STEPS = 4
"""... over at least this many steps of the rank (in fewer, one step is a large share by construction)."""
ONE_STEP_RATIO = 2.0
"""... and at least this x any other of its steps (two checkpoints in four steps are a pattern, not one step)."""
ALL_OF_IT = 0.9995
"""A share said as "all" (what rounds to 100.0 %)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitCaused:
    """The sync wait one rank caused on one axis by arriving last: one definition for the table and the findings."""

    rank: int
    """The late rank."""
    node: str
    """Its node."""
    axis: str
    """The axis of the collectives it was late to."""
    group: str
    """The group it made wait most."""
    groups: int
    """Groups of that axis it made wait."""
    total_seconds: float
    """Sync wait of all the members it made wait, per step of the late rank (what the job lost), seconds."""
    waiting_ranks: int
    """Members that waited for it: per group, the median over the instances it was late to; summed over groups, at
    most the ranks of those groups less itself (a rank in two groups of the same ranks waits once, not twice: the
    world group beside DeepSpeed's dp group over the same ranks halved the cost per waiting rank)."""
    device: str
    """``GPU`` or ``rank`` (a run without GPUs)."""
    through_rank: int | None = None
    """A rank that arrived last only because it waited for this one (the wait was passed on), if any."""
    one_step: tuple[int, float] | None = None
    """``(step, share)`` where one of the rank's steps holds at least :data:`ONE_STEP_SHARE` of it and
    :data:`ONE_STEP_RATIO` x any other step's (over at least :data:`ONE_STEP_MIN_STEPS` steps): a mean per step that
    one step makes, which a reader must not take for a steady cost."""

    @property
    def per_member_seconds(self) -> float:
        """What each waiting member waited per step, seconds."""
        return self.total_seconds / max(self.waiting_ranks, 1)

    def sentence(self) -> str:
        """``rank 2 on node-0 makes its dp group dp:2 wait 26.00 ms per step (182.00 ms of GPU time over 7 ...)``."""
        whom = f"its {self.axis} group {self.group}" if self.groups == 1 else f"{self.groups} {self.axis} groups"
        through = (
            ""
            if self.through_rank is None
            else f"; some of it through rank {self.through_rank}, last to arrive only because it had waited for rank "
            f"{self.rank}"
        )
        once = ""
        if self.one_step is not None:
            step, share = self.one_step
            once = f"; {'all' if share >= ALL_OF_IT else percent(share)} of it in step {step}"
        return (
            f"rank {self.rank} on {self.node} makes {whom} wait {human_seconds(self.per_member_seconds)} per step "
            f"({human_seconds(self.total_seconds)} of {self.device} time over {self.waiting_ranks} waiting "
            f"rank{'' if self.waiting_ranks == 1 else 's'}"
            f"{through}{once})"
        )


def wait_caused(rs: RankSteps, rank_index: int, axis: int) -> WaitCaused | None:
    """The sync wait the rank at ``rank_index`` caused on ``axis``; ``None`` if it never made anyone wait."""
    caused = float(rs.caused_per_step_us[rank_index, axis])
    if caused <= 0:
        return None
    rank = int(rs.ranks[rank_index])
    join = rs.breakdown.collectives
    mine = np.flatnonzero((join.axis == axis) & (join.paying_rank == rank) & (join.wait_caused_us > 0))
    if mine.size == 0:  # pragma: no cover - caused > 0 implies charged instances
        return None
    groups, inverse = np.unique(join.group[mine], return_inverse=True)
    inverse = inverse.reshape(-1)
    per_group = np.bincount(inverse, weights=join.wait_caused_us[mine])
    waiting = (join.members[mine] - join.n_last[mine]).astype(np.float64)
    waiting_ranks = round(float(np.nansum(grouped_median(inverse, waiting, int(groups.size)))))
    if groups.size > 1:  # groups of the same ranks (the world group beside a dp group over it): each rank once
        waiting_ranks = min(waiting_ranks, _distinct_members(rs, groups) - 1)
    passed = mine[join.last_rank[mine] != rank]
    rows = np.flatnonzero(rs.rank_index == rank_index)
    paid = rs.breakdown.wait_paid_us[rows, axis]
    order = np.argsort(paid)
    top, second = float(paid[order[-1]]), float(paid[order[-2]]) if paid.size > 1 else 0.0
    one_step = None
    if rows.size >= ONE_STEP_MIN_STEPS and top >= ONE_STEP_SHARE * paid.sum() > 0 and top >= ONE_STEP_RATIO * second:
        one_step = (int(rs.breakdown.table.steps.step[rows[order[-1]]]), top / float(paid.sum()))
    return WaitCaused(
        rank=rank,
        node=rs.node_name(rank_index),
        axis=AXES[axis].value,
        group=rs.breakdown.table.group_name(int(groups[int(np.argmax(per_group))])),
        groups=int(groups.size),
        total_seconds=caused / 1e6,
        waiting_ranks=max(waiting_ranks, 1),
        device=rs.device,
        through_rank=int(join.last_rank[passed[int(np.argmax(join.wait_caused_us[passed]))]]) if passed.size else None,
        one_step=one_step,
    )


def _distinct_members(rs: RankSteps, groups: NDArray[np.integer[Any]]) -> int:
    """How many ranks recorded a collective in any of ``groups`` (group codes of the table)."""
    table = rs.breakdown.table
    iv = table.intervals
    rows = iv.row[np.isin(iv.group, groups)]
    return int(np.unique(table.steps.rank[rows]).size)


WAIT_SPREAD = 1.5
"""A sync-wait row's top rank that caused at most this x the median rank's charge is no suspect to chase: the last
rank to arrive varies from step to step (noise, shared cores), and the row says so rather than name it."""


def _wait_suspect(rs: RankSteps, axis: int) -> Suspect | None:
    """The rank that caused most of ``axis``' sync wait, the group it made wait most, and how long per step."""
    charged = rs.caused_per_step_us[:, axis]
    top = int(np.argmax(charged))
    caused = wait_caused(rs, top, axis)
    if caused is None:
        return None
    median_us = median_rank_value(charged)
    if float(charged[top]) <= WAIT_SPREAD * median_us:
        return Suspect(
            rank=caused.rank,
            node=caused.node,
            group=caused.group,
            message=(
                f"spread over ranks (the last to arrive varies): median rank {human_seconds(median_us / 1e6)} caused "
                f"per step, the most rank {caused.rank} on {caused.node} {human_seconds(float(charged[top]) / 1e6)}"
            ),
        )
    return Suspect(rank=caused.rank, node=caused.node, group=caused.group, message=caused.sentence())


# ====================================================================== summary


@dataclass(frozen=True, slots=True, kw_only=True)
class Summary:
    """The step in a few numbers (definitions in docs/cost-table.md, "Summary definitions")."""

    median_step_seconds: float
    """Median step time over rank-steps."""
    max_step_seconds: float
    """Longest rank-step."""
    straggler_gap_seconds: float
    """The slowest rank's mean own time per step (step − sync wait − bubble) minus its pipeline stage's median rank's
    (:func:`straggler_gap_us`)."""
    slowest_rank: int
    """The rank with the largest own time beyond its stage's median."""
    efficiency: float
    """``ideal_step_seconds ÷ median_step_seconds``."""
    ideal_step_seconds: float
    """Compute + optimizer: the plan's, else the median measured (:attr:`ideal_step_source`)."""
    ideal_step_source: str = "measured"
    """``plan``: the plan's critical stage, planned for the hardware the ranks ran on; ``measured``: the median
    rank-step's (no plan, or a plan for other hardware: a GPU's seconds beside ranks that ran on CPU cores)."""
    useful_compute_share: float
    """Median over rank-steps of compute ÷ step time."""
    reported_gpu_util: float | None
    """Median reported GPU utilisation, 0–1; ``None`` if no record has it."""
    between_steps_seconds: float | None = None
    """Time between two steps per step, outside every step's breakdown (evaluation, saves, logging, the loop's own
    work): the median rank's mean ``gap_before_us``; ``None`` when no record has it."""
    between_steps_kinds_seconds: dict[str, float] | None = None
    """That rank's mean per step by ``between_steps`` kind (``eval``, ``checkpoint``, ...; the rest ``unlabelled``),
    kinds with no time left out."""
    between_steps_comm_seconds: float | None = None
    """Of that rank's time between steps, its mean per step blocked in collectives there (``between_steps.comm``:
    inside the kinds, waiting for peers in an evaluation's all-reduce, a barrier); ``None`` when unmeasured."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form (docs/cost-table.md)."""
        return {
            "median_step_seconds": self.median_step_seconds,
            "max_step_seconds": self.max_step_seconds,
            "straggler_gap_seconds": self.straggler_gap_seconds,
            "slowest_rank": self.slowest_rank,
            "efficiency": self.efficiency,
            "ideal_step_seconds": self.ideal_step_seconds,
            "ideal_step_source": self.ideal_step_source,
            "useful_compute_share": self.useful_compute_share,
            "reported_gpu_util": self.reported_gpu_util,
            "between_steps_seconds": self.between_steps_seconds,
            "between_steps_kinds_seconds": self.between_steps_kinds_seconds,
            "between_steps_comm_seconds": self.between_steps_comm_seconds,
        }


def own_time_us(rs: RankSteps) -> NDArray[np.float64]:
    """Each rank-step's own time: step time minus all sync wait and pipeline bubble (waiting for others), µs."""
    waiting = rs.us(BUBBLE).copy()
    for axis in AXES:
        waiting += rs.us(comm_category(axis, SYNC_WAIT))
    return rs.step_us - waiting


def straggler_gap_us(rs: RankSteps) -> tuple[float, int]:
    """The job's straggler gap, µs per step, and the rank index it is of: the live metrics' definition.

    Per rank its mean own time per step (:func:`own_time_us`); per pipeline stage, the largest of them minus the
    stage's median rank's (:func:`~meshscope.analysis.grouping.median_rank_value`: a rank's own figure, the lower
    middle of an even count; stages do different work, so a rank is compared with its stage's); the gap is the
    largest over stages. ``job:meshscope_straggler_gap_seconds:max_rate5m`` computes the same from the sidecars'
    counters (a rate over steps is a mean; the median rank as the largest own time at or under PromQL's interpolated
    median). A mean, not a median: a rank that stalls one step in five makes the others wait in those steps, and the
    gap says so.
    """
    own = grouped_mean(rs.rank_index, own_time_us(rs), rs.n_ranks)
    stage = rs.coord_of_rank[:, AXES.index(MeshAxis.PP)]
    gaps = np.zeros_like(own)
    for p in np.unique(stage).tolist():
        mine = stage == p
        gaps[mine] = own[mine] - median_rank_value(own[mine])
    slowest = int(np.argmax(gaps))
    return float(gaps[slowest]), slowest


def summarise(rs: RankSteps, *, plan: Plan | None, plan_fits_run: bool = True) -> Summary:
    """The summary numbers of ``rs``.

    The ideal step is the plan's where one is given and planned for the hardware the ranks ran on (``plan_fits_run``),
    else the measured compute and optimizer of the median rank-step.
    """
    gap_us, slowest = straggler_gap_us(rs)
    median_step = rs.median_step_us / 1e6
    if plan is not None and plan_fits_run:
        ideal = plan.expected_step_time.compute_seconds + plan.expected_step_time.optimizer_seconds
    else:
        ideal = float(np.median(rs.us(COMPUTE) + rs.us(OPTIMIZER))) / 1e6
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(rs.step_us > 0, rs.us(COMPUTE) / rs.step_us, np.nan)
    util = rs.breakdown.gpu_util
    util = util[~np.isnan(util)]
    share = share[~np.isnan(share)]
    return Summary(
        median_step_seconds=median_step,
        max_step_seconds=float(rs.step_us.max()) / 1e6,
        straggler_gap_seconds=gap_us / 1e6,
        slowest_rank=int(rs.ranks[slowest]),
        efficiency=ideal / median_step if median_step > 0 else math.nan,
        ideal_step_seconds=ideal,
        ideal_step_source="plan" if plan is not None and plan_fits_run else "measured",
        useful_compute_share=float(np.median(share)) if share.size else math.nan,
        reported_gpu_util=float(np.median(util)) if util.size else None,
        **_between_steps(rs),
    )


def _between_steps(rs: RankSteps) -> dict[str, Any]:
    """:attr:`Summary.between_steps_seconds` and its kinds: the median rank's (by its mean gap) means per step."""
    s = rs.breakdown.table.steps
    known = s.gap_before_us >= 0
    if not known.any():
        return {}
    rows = rs.rank_index[known]
    counts = np.bincount(rows, minlength=rs.n_ranks).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_rank = np.bincount(rows, weights=s.gap_before_us[known], minlength=rs.n_ranks) / counts
    ranks = np.flatnonzero(counts > 0)
    order = ranks[np.argsort(per_rank[ranks], kind="stable")]
    median = int(order[(order.size - 1) // 2])  # the lower middle: a rank's own figure
    mine = known & (rs.rank_index == median)
    kinds: dict[str, float] = {}
    labelled = 0.0
    for k, kind in enumerate(BETWEEN_KINDS):
        us = float(np.clip(s.between_us[mine, k], 0, None).sum()) / counts[median]
        if us > 0:
            kinds[kind] = us / 1e6
            labelled += us
    rest = max(float(per_rank[median]) - labelled, 0.0)
    if rest > 0:
        kinds["unlabelled"] = rest / 1e6
    comm = s.between_comm_us[mine]
    comm_s = float(comm[comm >= 0].sum()) / counts[median] / 1e6 if (comm >= 0).any() else None
    return {
        "between_steps_seconds": float(per_rank[median]) / 1e6,
        "between_steps_kinds_seconds": kinds,
        "between_steps_comm_seconds": comm_s,
    }


# ====================================================================== expected vs measured


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryComparison:
    """One pipeline stage: the plan's peak memory per GPU vs the largest measured peak."""

    pp_rank: int
    """Pipeline stage."""
    expected_bytes: int | None
    """Plan: the stage's total memory per GPU."""
    measured_peak_bytes: int | None
    """Records: the largest ``peak_memory_bytes`` of any rank-step of the stage; ``None`` if none is measured."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "pp_rank": self.pp_rank,
            "expected_bytes": self.expected_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
        }


def compare_memory(rs: RankSteps, plan: Plan) -> tuple[MemoryComparison, ...]:
    """Per pipeline stage: the plan's memory per GPU vs the largest measured peak."""
    s = rs.breakdown.table.steps
    pp = s.coord[:, AXES.index("pp")]
    peak = s.peak_memory_bytes
    known = peak >= 0
    stages = plan.layout.pp
    top = np.full(stages, -1, dtype=np.int64)
    inside = known & (pp < stages)
    np.maximum.at(top, pp[inside], peak[inside])
    return tuple(
        MemoryComparison(
            pp_rank=st.pp_rank,
            expected_bytes=st.memory.total_bytes,
            measured_peak_bytes=int(top[st.pp_rank]) if top[st.pp_rank] >= 0 else None,
        )
        for st in plan.stages
    )

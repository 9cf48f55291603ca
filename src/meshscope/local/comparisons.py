"""Expected vs measured on a real run, per pipeline stage: collectives, model state, activations, step time.

Why it exists: the cost table compares the plan with the records category by category for the job as a whole. A run
launched by ``meshscope run`` carries more: every rank's records say exactly which collectives of which size it ran
in which step, and the SDK's measurements (``OUT/measurements.json``: model-state bytes counted from the real
modules and optimizer, activation bytes from saved-tensor hooks) say what each rank held. This module lays those
beside the planner's numbers for the same pipeline stage, so that every difference is visible and either zero or
explained:

* **collectives**: per stage, axis, operation and message size, the plan's instances per step against the median
  over the stage's rank-steps (first step apart: it carries one-off setup traffic). Point-to-point traffic counts the
  sends (a receive is the neighbour's send). Deterministic collectives must match exactly; all-to-all messages
  depend on routing, so they are compared by count and mean size.
* **model state**: per stage, weights, gradients and optimizer state at rest (what the plan's
  ``resting_state`` says a GPU keeps between steps) against the counted bytes; the plan's peak (which adds what
  ZeRO-3 gathers during a step) is shown beside it.
* **activations**: per micro-batch, the stage's transformer layers, its embedding and its output layer plus loss,
  against the plan's per-micro-batch terms.
* **step time**: per stage, expected compute, optimizer, bubble and exposed communication against the medians of
  the breakdown.

It reads nothing and prints nothing: :func:`compare_run` builds a :class:`RunComparison`, which renders itself for
people (:meth:`RunComparison.render`, every number with its unit) and machines (:meth:`RunComparison.to_dict`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from meshscope.analysis import (
    BUBBLE,
    COMPUTE,
    OPTIMIZER,
    SYNC_WAIT,
    TRANSFER,
    comm_category,
    expected_pipeline,
    stage_traffic,
)
from meshscope.formatting import human_bytes, human_seconds, percent, render_table
from meshscope.jobs import PipelineSchedule
from meshscope.records import OP_CODE, OPS, P2P_CODE
from meshscope.topology import AXES

if TYPE_CHECKING:
    from collections.abc import Mapping

    from numpy.typing import NDArray

    from meshscope.analysis import Analysis
    from meshscope.plan import Plan

ACTIVATION_TOLERANCE = 0.10
"""Measured activation bytes within this fraction of the plan count as agreeing."""

_PLAN_OP = {
    "all-reduce": "all_reduce",
    "reduce-scatter": "reduce_scatter",
    "all-gather": "all_gather",
    "all-to-all": "all_to_all",
    "send-recv": "send",
}
_VARIABLE_SIZE_OPS = frozenset({"all_to_all"})
"""Operations whose message sizes depend on the data (routing): compared by count and mean size."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveCheck:
    """One stage, axis, operation and message size: instances per step, plan vs records."""

    pp_rank: int
    """Pipeline stage."""
    axis: str
    """Mesh axis."""
    op: str
    """Operation in the records' spelling; point-to-point traffic is ``send``."""
    message_bytes: float
    """Message size (NCCL's array size ``S``); for all-to-all the plan's or the measured mean."""
    expected_count_per_step: int | None
    """Plan: instances per step on one GPU of the stage; ``None``: the plan has none of this size."""
    measured_count_per_step: float | None
    """Records: median over the stage's rank-steps after the first step; ``None``: none measured."""
    first_step_count: int | None
    """Records: median instances in the first step (setup traffic shows here)."""
    measured_message_bytes: float | None = None
    """All-to-all only: the measured mean message."""
    share_of_rank_steps: float = 1.0
    """Share of the stage's rank-steps (after the first step) that ran it; below 1 the count is the median of those."""

    @property
    def setup_only(self) -> bool:
        """Whether it ran in the first step only (one-off setup traffic the plan does not count)."""
        return self.measured_count_per_step is None and bool(self.first_step_count) and not self.expected_count_per_step

    @property
    def exact(self) -> bool:
        """Whether count (and, for all-to-all, mean size to 0.5 %) match on every rank-step of the stage."""
        if self.expected_count_per_step is None or self.measured_count_per_step is None:
            return False
        if self.share_of_rank_steps < 1.0:
            return False
        if self.expected_count_per_step != self.measured_count_per_step:
            return False
        if self.measured_message_bytes is None:
            return True
        return abs(self.measured_message_bytes - self.message_bytes) <= 0.005 * self.message_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON form (bytes)."""
        return {
            "pp_rank": self.pp_rank,
            "axis": self.axis,
            "op": self.op,
            "message_bytes": self.message_bytes,
            "measured_message_bytes": self.measured_message_bytes,
            "expected_count_per_step": self.expected_count_per_step,
            "measured_count_per_step": self.measured_count_per_step,
            "first_step_count": self.first_step_count,
            "share_of_rank_steps": self.share_of_rank_steps,
            "match": self.exact,
            "setup_only": self.setup_only,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class StateCheck:
    """One stage and model-state field: bytes per GPU at rest, plan vs counted."""

    pp_rank: int
    """Pipeline stage."""
    field: str
    """``weights``, ``gradients``, ``optimizer`` or ``optimizer step counters``."""
    expected_bytes: float | None
    """Plan: bytes at rest (after the optimizer step); ``None`` where the plan has no such term."""
    measured_bytes: int | None
    """Counted on the stage's ranks (the largest, when they differ)."""
    peak_bytes: float | None
    """Plan: the field's peak during a step."""
    ranks_agree: bool
    """Whether every rank of the stage counted the same."""

    @property
    def exact(self) -> bool:
        """Whether plan and count agree to the byte."""
        return (
            self.expected_bytes is not None
            and self.measured_bytes is not None
            and round(self.expected_bytes) == self.measured_bytes
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form (bytes)."""
        return {
            "pp_rank": self.pp_rank,
            "field": self.field,
            "expected_bytes": self.expected_bytes,
            "measured_bytes": self.measured_bytes,
            "planned_peak_bytes": self.peak_bytes,
            "ranks_agree": self.ranks_agree,
            "match": self.exact,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationCheck:
    """One stage and part of the model: activation bytes kept per micro-batch, plan vs saved-tensor hooks."""

    pp_rank: int
    """Pipeline stage."""
    part: str
    """``layers`` (all the stage's transformer layers), ``embedding``, ``output`` (final norm, output layer, loss)."""
    expected_bytes: float
    """Plan: bytes per micro-batch."""
    measured_bytes: float | None
    """Measured: bytes per micro-batch (median rank of the stage)."""

    @property
    def ratio(self) -> float | None:
        """Measured ÷ expected."""
        if self.measured_bytes is None or self.expected_bytes <= 0:
            return None
        return self.measured_bytes / self.expected_bytes

    @property
    def within_tolerance(self) -> bool:
        """Whether measured is within :data:`ACTIVATION_TOLERANCE` of expected."""
        r = self.ratio
        return r is not None and abs(r - 1.0) <= ACTIVATION_TOLERANCE

    def to_dict(self) -> dict[str, Any]:
        """JSON form (bytes per micro-batch)."""
        return {
            "pp_rank": self.pp_rank,
            "part": self.part,
            "expected_bytes": self.expected_bytes,
            "measured_bytes": self.measured_bytes,
            "ratio": self.ratio,
            "within_tolerance": self.within_tolerance,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeCheck:
    """One stage and breakdown category: expected seconds per step vs the median measured."""

    pp_rank: int
    """Pipeline stage."""
    category: str
    """``compute``, ``optimizer``, ``bubble`` or ``exposed comm <axis>``."""
    expected_seconds: float
    """Plan."""
    measured_seconds: float
    """Median over the stage's rank-steps."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form (seconds)."""
        return {
            "pp_rank": self.pp_rank,
            "category": self.category,
            "expected_seconds": self.expected_seconds,
            "measured_seconds": self.measured_seconds,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class RunComparison:
    """Everything :func:`compare_run` lays side by side, plus the notes that explain the differences."""

    collectives: tuple[CollectiveCheck, ...]
    """Per stage, axis, op and size."""
    state: tuple[StateCheck, ...]
    """Per stage and field; empty without model-state measurements."""
    activations: tuple[ActivationCheck, ...]
    """Per stage and part; empty without activation measurements."""
    step_time: tuple[TimeCheck, ...]
    """Per stage and category."""
    notes: tuple[str, ...]
    """Sentences explaining every difference (and what was not measured)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form: the ``expected_vs_measured`` keys a real run adds (base units)."""
        return {
            "collectives_by_stage": [c.to_dict() for c in self.collectives],
            "model_state": [s.to_dict() for s in self.state],
            "activations_per_microbatch": [a.to_dict() for a in self.activations],
            "step_time_by_stage": [t.to_dict() for t in self.step_time],
            "notes": list(self.notes),
        }

    def report_rows(self) -> dict[str, list[dict[str, Any]]]:
        """Rows for the HTML report's expected-vs-measured tables.

        ``collectives_by_size`` goes beside the analysis' per-stage bytes (``collectives``); ``memory`` (model state
        and activations) replaces the analysis' job-wide peak per stage.
        """
        collectives = [
            {
                "stage": c.pp_rank,
                "axis": c.axis,
                "op": c.op,
                "message_bytes": c.message_bytes,
                "expected_count": c.expected_count_per_step,
                "measured_count": c.measured_count_per_step,
                "match": c.exact,
            }
            for c in self.collectives
        ]
        memory: list[dict[str, Any]] = [
            {
                "stage": s.pp_rank,
                "what": f"{s.field} (at rest)",
                "expected_bytes": s.expected_bytes,
                "measured_bytes": s.measured_bytes,
            }
            for s in self.state
        ]
        memory += [
            {
                "stage": a.pp_rank,
                "what": f"activations of the {a.part} per micro-batch",
                "expected_bytes": a.expected_bytes,
                "measured_bytes": a.measured_bytes,
            }
            for a in self.activations
        ]
        return {"collectives_by_size": collectives, "memory": memory}

    def render(self) -> str:
        """The comparison for people: four tables and the notes; every number with its unit."""
        out: list[str] = []
        if self.collectives:
            rows = [
                [
                    str(c.pp_rank),
                    c.axis,
                    c.op,
                    human_bytes(c.message_bytes)
                    + (
                        ""
                        if c.measured_message_bytes is None
                        else f" (measured {human_bytes(c.measured_message_bytes)})"
                    ),
                    "-" if c.expected_count_per_step is None else f"{c.expected_count_per_step:,}",
                    "-"
                    if c.measured_count_per_step is None
                    else f"{c.measured_count_per_step:,g}"
                    + ("" if c.share_of_rank_steps == 1.0 else f" on {percent(c.share_of_rank_steps)}"),
                    "-" if c.first_step_count is None else f"{c.first_step_count:,}",
                    "yes" if c.exact else ("setup" if c.setup_only else "NO"),
                ]
                for c in self.collectives
            ]
            matched = sum(c.exact for c in self.collectives)
            compared = sum(not c.setup_only for c in self.collectives)
            out.append(
                render_table(
                    ["stage", "axis", "op", "message", "expected/step", "measured/step", "first step", "match"],
                    rows,
                    title=(
                        f"\nCollectives per GPU per step, by stage: plan vs records ({matched} of "
                        f"{compared} match exactly)"
                    ),
                )
            )
        if self.state:
            rows = [
                [
                    str(s.pp_rank),
                    s.field,
                    "-" if s.expected_bytes is None else _bytes(s.expected_bytes),
                    "not measured" if s.measured_bytes is None else _bytes(s.measured_bytes),
                    "yes" if s.exact else ("-" if s.expected_bytes is None else "NO"),
                    "-" if s.peak_bytes is None else _bytes(s.peak_bytes),
                ]
                for s in self.state
            ]
            out.append(
                render_table(
                    ["stage", "field", "expected at rest", "counted", "match", "planned peak"],
                    rows,
                    title="\nModel state per GPU (after the optimizer step): plan vs counted in the training process",
                )
            )
        if self.activations:
            rows = [
                [
                    str(a.pp_rank),
                    a.part,
                    _bytes(a.expected_bytes),
                    "not measured" if a.measured_bytes is None else _bytes(a.measured_bytes),
                    "-" if a.ratio is None else f"{a.ratio:.3f}",
                ]
                for a in self.activations
            ]
            out.append(
                render_table(
                    ["stage", "part", "expected", "measured", "measured/expected"],
                    rows,
                    title="\nActivations kept for backward per micro-batch: plan vs saved-tensor hooks",
                )
            )
        if self.step_time:
            rows = [
                [str(t.pp_rank), t.category, human_seconds(t.expected_seconds), human_seconds(t.measured_seconds)]
                for t in self.step_time
            ]
            out.append(
                render_table(
                    ["stage", "category", "expected", "measured median"],
                    rows,
                    title="\nStep time per stage: plan vs breakdown",
                )
            )
        if self.notes:
            out.append("\nWhy expected and measured differ")
            out.extend(f"  - {n}" for n in self.notes)
        return "\n".join(out)


def _bytes(value: float) -> str:
    return f"{human_bytes(value)} ({round(value):,} B)"


# ====================================================================== building


def compare_run(
    analysis: Analysis,
    measurements: Mapping[int, Mapping[str, Any]] | None = None,
    *,
    emulated: bool = False,
    planned_gpu: str | None = None,
) -> RunComparison:
    """Lay the plan of ``analysis`` beside its records and the SDK's measurements, stage by stage.

    Args:
        analysis: an analysis made with a plan (``analyze(table, spec=..., plan=...)``).
        measurements: rank -> the rank's ``measurements`` message (``OUT/measurements.json``); ``None`` or empty:
            model state and activations are left out (and said so).
        emulated: the plan is for emulated accelerators (:mod:`meshscope.local.emulation`): say how its seconds relate
            to the measured ones.
        planned_gpu: the GPU the plan is for (the spec's hardware): where the ranks ran without GPUs and not under
            emulation, say that its seconds are that GPU's, not this machine's.

    Returns:
        The comparison.

    Raises:
        ValueError: if the analysis has no plan.
    """
    plan = analysis.plan
    if plan is None:
        raise ValueError("compare_run needs an analysis made with a plan (give the spec)")
    notes: list[str] = []
    collectives = _collectives(analysis, plan, notes)
    state: tuple[StateCheck, ...] = ()
    activations: tuple[ActivationCheck, ...] = ()
    if measurements:
        state = _state(plan, measurements, notes)
        activations = _activations(plan, measurements, notes)
    else:
        notes.append(
            "model state and activations were not measured (the training script did not call "
            "tracker.count_model_state / tracker.saved_activations, or its measurements were lost)"
        )
    step_time = _step_time(analysis, plan, notes, emulated=emulated)
    if planned_gpu is not None and not emulated and not analysis.rank_steps.on_gpu and step_time:
        notes.append(
            f"step time: the plan is for {planned_gpu} GPUs (the spec's hardware) and these ranks ran on CPU cores: "
            "its seconds are that hardware's, not this machine's, so only the counts, bytes and memory above "
            "compare (the summary's ideal step is the measured compute and optimizer)"
        )
    return RunComparison(
        collectives=collectives,
        state=state,
        activations=activations,
        step_time=step_time,
        notes=tuple(notes),
    )


def _stage_of_row(analysis: Analysis) -> NDArray[np.int64]:
    table = analysis.rank_steps.breakdown.table
    return table.steps.coord[:, AXES.index("pp")].astype(np.int64)


def _collectives(analysis: Analysis, plan: Plan, notes: list[str]) -> tuple[CollectiveCheck, ...]:  # noqa: C901, PLR0915 - one pass per source, then the join
    table = analysis.rank_steps.breakdown.table
    iv, steps = table.intervals, table.steps
    stage_of_row = _stage_of_row(analysis)
    first_step = int(steps.step.min())
    later = steps.step > first_step
    # measured: (stage, axis, op, size or -1) -> the stage's rank-steps and the key's count in each (vectorised)
    send_code, recv_code = OP_CODE["send"], OP_CODE["recv"]
    traffic = stage_traffic(table, stage_of_row, split_sizes_except=_VARIABLE_SIZE_OPS)
    counts: dict[tuple[int, str, str, int], tuple[NDArray[np.intp], NDArray[np.int64]]] = {}
    mean_size: dict[tuple[int, str, str, int], float] = {}
    for j in range(len(traffic)):
        op_code = int(traffic.op[j])
        if op_code == recv_code:
            continue  # a receive is the neighbour's send
        op = OPS[op_code].value
        key = (int(traffic.pp_rank[j]), AXES[int(traffic.axis[j])].value, op, int(traffic.size_bytes[j]))
        seg = traffic.segment(j)
        counts[key] = (traffic.rows[seg], traffic.count[seg])
        n_sized = int(traffic.sized[seg].sum())
        if op in _VARIABLE_SIZE_OPS and n_sized:
            mean_size[key] = float(traffic.total_bytes[seg].sum()) / n_sized
    recv_mismatch = 0
    p2p = np.flatnonzero(iv.kind == P2P_CODE)
    if p2p.size:
        n_sends = int(np.count_nonzero(iv.op[p2p] == send_code))
        recv_mismatch = abs(n_sends - int(np.count_nonzero(iv.op[p2p] == recv_code)))
    # expected: (stage, axis, op, size) -> count; all-to-all keyed by size -1 with its mean message
    expected: dict[tuple[int, str, str, int], int] = defaultdict(int)
    expected_mean: dict[tuple[int, str, str, int], tuple[float, int]] = {}
    for stage in plan.stages:
        for c in stage.collectives:
            op = _PLAN_OP.get(c.op.value, c.op.value)
            if op in _VARIABLE_SIZE_OPS:
                key = (stage.pp_rank, c.axis, op, -1)
                total, n_inst = expected_mean.get(key, (0.0, 0))
                expected_mean[key] = (total + c.message_bytes * c.count_per_step, n_inst + c.count_per_step)
            else:
                key = (stage.pp_rank, c.axis, op, int(c.message_bytes))
            expected[key] += c.count_per_step
    out = []
    keys = sorted(
        set(expected) | set(counts),
        key=lambda k: (k[0], AXES.index(k[1]) if k[1] in AXES else 9, k[2], k[3]),
    )
    for key in keys:
        pp_rank, axis, op, size = key
        measured_rows = counts.get(key)
        measured: float | None = None
        first: int | None = None
        share = 1.0
        if measured_rows is not None:
            rows, per_row = measured_rows  # every rank-step of the stage
            steady_rows = later[rows]
            steady = per_row[steady_rows] if steady_rows.any() else per_row
            present = steady[steady > 0]
            share = present.size / steady.size if steady.size else 0.0
            # On every rank-step (deterministic collectives): the median over all; on some: over those that ran it.
            measured = (
                float(np.median(steady)) if share == 1.0 else (float(np.median(present)) if present.size else None)
            )
            first_rows = per_row[~steady_rows]
            first = int(np.median(first_rows)) if first_rows.size else None
        exp = expected.get(key)
        message: float = float(size)
        measured_mean: float | None = None
        if size < 0:
            e_total, e_n = expected_mean.get(key, (0.0, 0))
            message = e_total / e_n if e_n else mean_size.get(key, 0.0)
            measured_mean = mean_size.get(key)
        out.append(
            CollectiveCheck(
                pp_rank=pp_rank,
                axis=axis,
                op=op,
                message_bytes=message,
                expected_count_per_step=exp,
                measured_count_per_step=measured,
                first_step_count=first,
                measured_message_bytes=measured_mean,
                share_of_rank_steps=share,
            )
        )
    _explain_collectives(out, notes, recv_mismatch=recv_mismatch, first_step=first_step)
    _explain_context_parallel(out, notes, cp=plan.layout.cp)
    return tuple(out)


def _explain_collectives(
    checks: list[CollectiveCheck], notes: list[str], *, recv_mismatch: int, first_step: int
) -> None:
    matched = [c for c in checks if c.exact]
    compared = [c for c in checks if not c.setup_only]
    notes.append(
        f"collectives: {len(matched)} of {len(compared)} (stage, axis, op, message size) entries match the plan "
        f"exactly in count per step after step {first_step}; sends are counted for point-to-point traffic"
        + ("" if not recv_mismatch else f" ({recv_mismatch} sends and receives do not pair up)")
    )
    setup = [c for c in checks if c.setup_only]
    for c in setup:
        what = (
            "torch.distributed.pipelining's first-step vote on static vs dynamic shapes (one int32 each way)"
            if c.axis == "pp" and c.message_bytes <= 8
            else "one-off setup traffic of the first step"
        )
        notes.append(
            f"stage {c.pp_rank} {c.axis} {c.op} of {human_bytes(c.message_bytes)} runs only in the first step "
            f"({c.first_step_count}x): {what}; the plan counts steady-state steps"
        )
    for c in checks:
        if c.exact or c in setup:
            continue
        what = f"stage {c.pp_rank} {c.axis} {c.op} of {human_bytes(c.message_bytes)}"
        planned = f"{c.expected_count_per_step or 0} per step planned"
        measured = "none measured" if c.measured_count_per_step is None else f"{c.measured_count_per_step:g} measured"
        if c.share_of_rank_steps < 1.0 and c.measured_count_per_step is not None:
            measured += f" on {percent(c.share_of_rank_steps)} of the stage's rank-steps"
        if c.op in _VARIABLE_SIZE_OPS:
            notes.append(
                f"{what} (mean): {planned}, {measured} of mean {human_bytes(c.measured_message_bytes or 0)}: "
                "all-to-all messages follow the router's uneven splits on each rank-step, so they are compared by "
                "count and by their mean over the stage; the plan counts Megatron-core's alltoall dispatcher (per "
                "MoE layer and micro-batch: tokens out and back and the routing probabilities with them, forward and "
                "backward), and a dispatcher that exchanges other metadata by all-to-all adds instances"
            )
        else:
            reason = ""
            if c.share_of_rank_steps < 1.0:
                reason = (
                    " (ranks of the stage differ: a replica with more or larger micro-batches than its peers, or "
                    "rank-steps cut short by a failure or left out, issue it another number of times)"
                )
            notes.append(f"{what}: {planned}, {measured}{reason}")


_CP_COMM_TYPE_OF_OP = {"send": "p2p", "all_gather": "all_gather", "reduce_scatter": "all_gather", "all_to_all": "a2a"}
"""Which context-parallel communication type (``spec.parallelism.cpCommType``) runs each cp operation."""


def _explain_context_parallel(checks: list[CollectiveCheck], notes: list[str], *, cp: int) -> None:
    """Context parallelism that ran another ``cpCommType`` than the plan's: name both, their bytes, and the fix."""
    for stage in sorted({c.pp_rank for c in checks if c.axis == "cp"}):
        mine = [c for c in checks if c.pp_rank == stage and c.axis == "cp"]
        planned = {_CP_COMM_TYPE_OF_OP.get(c.op) for c in mine if c.expected_count_per_step}
        ran = {_CP_COMM_TYPE_OF_OP.get(c.op) for c in mine if c.measured_count_per_step}
        if len(planned) != 1 or len(ran) != 1 or planned == ran:
            continue

        def moved(rows: list[CollectiveCheck], *, measured: bool) -> float:
            total = 0.0
            for c in rows:
                count = c.measured_count_per_step if measured else c.expected_count_per_step
                size = (c.measured_message_bytes or c.message_bytes) if measured else c.message_bytes
                total += (count or 0) * size * (1.0 if c.op == "send" else (cp - 1) / cp)
            return total

        notes.append(
            f"stage {stage} cp: the plan models cpCommType {planned.pop()!r}, but the job's context-parallel "
            f"collectives are those of {ran.pop()!r} ({human_bytes(moved(mine, measured=True))} per GPU per step "
            f"against the plan's {human_bytes(moved(mine, measured=False))}); declare the type the job runs in "
            "spec.parallelism.cpCommType (docs/planner.md, Collectives)"
        )


def _ranks_by_stage(plan: Plan) -> dict[int, list[int]]:
    out: dict[int, list[int]] = defaultdict(list)
    for rank in range(plan.world_size):
        out[plan.layout.coord(rank).pp].append(rank)
    return out


def _state(plan: Plan, measurements: Mapping[int, Mapping[str, Any]], notes: list[str]) -> tuple[StateCheck, ...]:
    out: list[StateCheck] = []
    by_stage = _ranks_by_stage(plan)
    step_counters = 0
    for stage in plan.stages:
        counted = [
            measurements[r]["model_state"]
            for r in by_stage[stage.pp_rank]
            if r in measurements and isinstance(measurements[r].get("model_state"), dict)
        ]
        rest, peak = stage.resting_state, stage.memory
        for name, expected, peak_bytes, key in (
            ("weights", rest.weights_bytes, float(peak.weights_bytes), "parameter_bytes"),
            ("gradients", rest.gradients_bytes, float(peak.gradients_bytes), "gradient_bytes"),
            ("optimizer", rest.optimizer_bytes, float(peak.optimizer_bytes), "optimizer_bytes"),
            ("optimizer step counters", None, None, "optimizer_step_bytes"),
        ):
            values = [int(c[key]) for c in counted if isinstance(c.get(key), int)]
            out.append(
                StateCheck(
                    pp_rank=stage.pp_rank,
                    field=name,
                    expected_bytes=expected,
                    measured_bytes=max(values) if values else None,
                    peak_bytes=peak_bytes,
                    ranks_agree=len(set(values)) <= 1,
                )
            )
            if key == "optimizer_step_bytes" and values:
                step_counters = max(step_counters, *values)
        if not counted:
            notes.append(f"stage {stage.pp_rank}: no rank sent its model-state counts")
    fields = [s for s in out if s.expected_bytes is not None]
    notes.append(
        f"model state: {sum(s.exact for s in fields)} of {len(fields)} (stage, field) entries match the plan's "
        "bytes at rest exactly (DTensor shards counted at their local size: FSDP2 and tensor parallelism)"
    )
    if step_counters:
        notes.append(
            f"the optimizer also keeps step counters ({human_bytes(step_counters)} per GPU: one 4-byte fp32 tensor per "
            "parameter tensor in torch's AdamW); the planner counts only the moments (and master weights)"
        )
    if any(s.peak_bytes is not None and s.expected_bytes is not None and s.peak_bytes != s.expected_bytes for s in out):
        notes.append(
            "planned peak vs at rest: ZeRO-3 gathers weights during the step (one layer at a time without a pipeline; "
            "under a pipeline schedule every unit stays gathered after backward and gradients accumulate unsharded "
            "until the last micro-batch), so the plan's peak is higher than what a GPU keeps between steps"
        )
    return tuple(out)


def _activations(
    plan: Plan, measurements: Mapping[int, Mapping[str, Any]], notes: list[str]
) -> tuple[ActivationCheck, ...]:
    out: list[ActivationCheck] = []
    by_stage = _ranks_by_stage(plan)
    m = plan.micro_batches
    gpipe = plan.schedule is PipelineSchedule.GPIPE and plan.layout.pp > 1
    for stage in plan.stages:
        act = stage.activations
        parts: list[tuple[str, float]] = [("layers", act.per_microbatch_layers_bytes)]
        if act.embedding_bytes > 0:
            parts.append(("embedding", act.embedding_bytes / max(act.in_flight_microbatches, 1e-9)))
        if act.output_bytes > 0:
            parts.append(("output", act.output_bytes / (m if gpipe else 1)))
        for part, expected in parts:
            per_rank = [
                b / m for r in by_stage[stage.pp_rank] if (b := _median_step_bytes(measurements.get(r, {}), part))
            ]
            out.append(
                ActivationCheck(
                    pp_rank=stage.pp_rank,
                    part=part,
                    expected_bytes=expected,
                    measured_bytes=float(np.median(per_rank)) if per_rank else None,
                )
            )
    measured = [a for a in out if a.measured_bytes is not None]
    if measured:
        worst = max(measured, key=lambda a: abs((a.ratio or 1.0) - 1.0))
        gap = (worst.measured_bytes or 0.0) - worst.expected_bytes
        notes.append(
            f"activations: {sum(a.within_tolerance for a in measured)} of {len(measured)} (stage, part) entries within "
            f"{percent(ACTIVATION_TOLERANCE)} of the plan; the largest gap is stage {worst.pp_rank} {worst.part}, "
            f"{'+' if gap >= 0 else ''}{human_bytes(gap)} per micro-batch ({percent(abs((worst.ratio or 1.0) - 1.0))})"
        )
    notes.extend(
        f"stage {a.pp_rank} embedding: the token ids the embedding keeps are views of the step's whole input "
        f"batch (the pipeline schedule splits it into {m} micro-batches without copying), so each micro-batch "
        f"keeps the storage of all {m}: {human_bytes(a.measured_bytes or 0)} instead of the plan's "
        f"{human_bytes(a.expected_bytes)} (8 bytes per token of one micro-batch)"
        for a in measured
        if a.part == "embedding" and m > 1 and a.ratio is not None and abs(a.ratio - m) < 0.5
    )
    missing = [a for a in out if a.measured_bytes is None]
    if missing:
        notes.append(f"activations not measured for {len(missing)} (stage, part) entries (no saved_activations scope)")
    return tuple(out)


def _median_step_bytes(measured: Mapping[str, Any], part: str) -> float | None:
    """Median over the measured steps of the bytes a rank's ``part`` scopes saved per step, ``None`` if none."""
    entries = measured.get("activations", {}).get(part)
    if not isinstance(entries, list):
        return None
    per_step = [e["bytes"] for e in entries if isinstance(e, dict) and isinstance(e.get("bytes"), int)]
    return float(np.median(per_step)) if per_step else None


def _step_time(analysis: Analysis, plan: Plan, notes: list[str], *, emulated: bool) -> tuple[TimeCheck, ...]:
    rs = analysis.rank_steps
    stage_of_row = _stage_of_row(analysis)
    pipeline = expected_pipeline(rs, plan)
    out: list[TimeCheck] = []
    for stage in plan.stages:
        mine = stage_of_row == stage.pp_rank
        if not mine.any():
            continue
        t = stage.step_time

        def median(category: str, rows: NDArray[np.bool_] = mine) -> float:
            return float(np.median(rs.us(category)[rows])) / 1e6

        out.append(TimeCheck(pp_rank=stage.pp_rank, category="compute", expected_seconds=t.compute_seconds,
                             measured_seconds=median(COMPUTE)))  # fmt: skip
        out.append(TimeCheck(pp_rank=stage.pp_rank, category="optimizer", expected_seconds=t.optimizer_seconds,
                             measured_seconds=median(OPTIMIZER)))  # fmt: skip
        if pipeline is not None:
            bubble = float(np.median(pipeline.bubble_us[mine])) / 1e6
            out.append(TimeCheck(pp_rank=stage.pp_rank, category="bubble", expected_seconds=bubble,
                                 measured_seconds=median(BUBBLE)))  # fmt: skip
        for axis in plan.layout.enabled_axes:
            exposed = rs.us(comm_category(axis, TRANSFER))[mine] + rs.us(comm_category(axis, SYNC_WAIT))[mine]
            out.append(
                TimeCheck(
                    pp_rank=stage.pp_rank,
                    category=f"exposed comm {axis.value}",
                    expected_seconds=float(t.exposed_comm_seconds.get(axis.value, 0.0)),
                    measured_seconds=float(np.median(exposed)) / 1e6,
                )
            )
    if pipeline is not None and out:
        notes.append(f"step time: the bubble expected is {pipeline.basis(plan)}")
    if emulated and out:
        compute = [t for t in out if t.category == "compute"]
        extra = [t.measured_seconds - t.expected_seconds for t in compute]
        notes.append(
            "step time: expected compute is the emulated accelerator time the trainer sleeps (FLOPs ÷ the emulated "
            "peak, backward 2x); measured compute adds the host's own CPU work for the real tensors, shared by every "
            f"rank on this machine's cores ({human_seconds(min(extra))} to {human_seconds(max(extra))} per step here). "
            "Collectives and the optimizer step are not emulated: their expectations use the emulated hardware's "
            "nominal link and memory bandwidths and are indicative only"
        )
    return tuple(out)

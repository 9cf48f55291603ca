"""Calibration: the :class:`~meshscope.plan.PlanAssumptions` a measured run can tell, fitted to its step breakdown.

Exists so that the planner's expected seconds for *another* layout of a job rest on what this job measured, not on
datasheet fractions (issue 12; ``meshscope calibrate`` and ``meshscope predict``). From the breakdown the core already
computes, and the plan of the layout that ran, it fits:

* **compute**: the flat ``compute_efficiency`` (when the base assumptions use the flat model, as the emulated
  accelerator of ``meshscope run`` does): the median over rank-steps of planned compute at efficiency 1 ÷ measured
  compute; under the per-operation roofline, one ``gemm_efficiency`` (the GEMM ceiling) that makes the planned
  compute of the measured layout equal the measured mean (bisection: planned compute falls as the ceiling rises);
* **links**, per link class (``nvlink``: a group inside one NVLink domain; ``network``: one that crosses it): every
  complete collective instance's transfer time (its last member's arrival to its end, so never sync wait) against
  the planner's ring model ``hops x hop latency + bus bytes / bus bandwidth`` (hops as NCCL's ring counts them,
  :func:`ring_hops`), fitted by Huber-weighted least squares, so that a time-sliced outlier does not drag the fit;
* **host compute** on the emulated accelerator (``train_tiny --emulate``), whose kernels take exactly FLOPs ÷ peak:
  ``host_seconds_per_layer_pass``, the median of (measured - planned compute) ÷ (micro-batches x layers), with the
  micro-batch's tokens and the tensor-parallel degree it was measured at (``host_reference_tokens``,
  ``host_reference_tp``: the planner scales it to another micro-batch and to a layout with or without tp);
* **optimizer**: ``optimizer_hbm_efficiency``, the median of planned optimizer time at efficiency 1 ÷ measured;
* **sync wait**: ``sync_wait_per_collective_seconds``, the mean sync wait per step ÷ the plan's collectives per step;
* **overlap** per axis whose exposed time the job's settings let a fraction move: the fraction at which the
  calibrated plan's exposed transfer equals the measured one (bisection);
* **data wait** and **host overhead**: the mean per step of the breakdown's ``data`` and ``other``.

Every value comes with a 90 % bootstrap interval (rank-steps, or collective instances, resampled with replacement,
:data:`BOOTSTRAP_SAMPLES` times, seeded) and, after the fit, the residual per category (the calibrated plan of the
measured layout minus the measured mean). It refuses, with a sentence, what the run cannot tell and keeps the base
value: a network term from a run that never crossed an NVLink domain; latency apart from bandwidth when every
instance of a link class has the same bytes per hop; compute per operation class (records carry one compute interval
per pass, so attention and element-wise work stay at their defaults and the GEMM ceiling absorbs them).

Pure: numpy and the planner; it reads no files (the command does) and must not change the breakdown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from meshscope.analysis.analyzing import check_records_match_layout, p2p_bandwidth
from meshscope.analysis.breakdown import (
    BUBBLE,
    CHECKPOINT,
    COMPUTE,
    DATA,
    OPTIMIZER,
    OTHER,
    SYNC_WAIT,
    TRANSFER,
    break_down,
    comm_category,
)
from meshscope.analysis.collectives import stage_of_rows
from meshscope.analysis.costs import index_rank_steps
from meshscope.analysis.transfers import place_of_rows
from meshscope.errors import MeshscopeError, ParseCode, ParseError
from meshscope.formatting import human_seconds, render_table
from meshscope.plan import (
    SYNC_WAIT_AXIS_FIELDS,
    NcclProtocolCosts,
    PlanAssumptions,
    cpu_contention,
    cpu_stage_contention,
    micro_batch_tokens_per_rank,
    plan_job,
)
from meshscope.records import OPS, CommOp
from meshscope.topology import AXES, Link, MeshAxis

if TYPE_CHECKING:
    from collections.abc import Callable

    from numpy.typing import NDArray

    from meshscope.analysis.costs import RankSteps
    from meshscope.jobs import JobSpec
    from meshscope.plan import Plan
    from meshscope.records import RecordTable

BOOTSTRAP_SAMPLES: Final = 200
"""Bootstrap resamples behind every interval."""
INTERVAL: Final = (5.0, 95.0)
"""Percentiles of the bootstrap distribution reported as a value's interval (a 90 % interval)."""
SEED: Final = 12
"""Seed of the resampling: the same records give the same file."""
HUBER_K: Final = 1.345
"""Huber's tuning constant, in robust standard deviations (1.4826 x the median absolute residual): 95 % efficiency
under normal noise (Huber 1964; Holland and Welsch 1977)."""
MIN_SPREAD: Final = 2.0
"""Latency and bandwidth of a link class are told apart only if its instances' bytes per hop span at least this
factor (95th over 5th percentile); below it the fit is a line through one cluster of points."""
MIN_INSTANCES: Final = 8
"""Collective instances of a link class needed to fit it at all."""
PRED_CATEGORIES: Final = ("compute", *(f"comm.{a.value}" for a in AXES), BUBBLE, OPTIMIZER, DATA, CHECKPOINT, OTHER)
"""The categories calibration and prediction compare: exposed comm per axis as a whole (transfer + sync wait; the
calibrated plan prices sync wait per collective, ``sync_wait_per_collective_seconds``)."""
_FITTED_OPS: Final = (CommOp.ALL_REDUCE, CommOp.ALL_GATHER, CommOp.REDUCE_SCATTER, CommOp.ALL_TO_ALL)


class CalibrationError(MeshscopeError):
    """Records that cannot be calibrated against the spec (no rank-steps, another layout)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FittedValue:
    """One assumption as the run told it, or why it could not."""

    name: str
    """The assumption (a :class:`PlanAssumptions` field; ``ring_simple.nvlink_hop_latency_s`` for a nested one)."""
    value: float | None
    """Fitted value; ``None`` when refused (the base value is kept)."""
    low: float | None
    """Lower end of the 90 % bootstrap interval."""
    high: float | None
    """Upper end."""
    base: float | None
    """The base assumptions' value (kept when refused)."""
    unit: str
    """``s``, ``B/s`` or ``""`` (a fraction)."""
    basis: str
    """Where the value came from: what was measured, how many samples."""
    refused: str | None = None
    """Why the run cannot tell it (one sentence), else ``None``."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "name": self.name,
            "value": self.value,
            "interval": None if self.low is None else [self.low, self.high],
            "base": self.base,
            "unit": self.unit,
            "basis": self.basis,
            "refused": self.refused,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkFit:
    """Latency and bandwidth of one link class, fitted to its collective instances."""

    link: str
    """``nvlink`` or ``network``."""
    instances: int
    """Complete collective instances of this class fitted."""
    hop_latency_s: float
    """Seconds per ring hop (fitted, or the base value when latency could not be told from bandwidth)."""
    hop_latency_interval_s: tuple[float, float] | None
    """Its 90 % interval; ``None`` when not fitted."""
    bandwidth_bytes_per_s: float
    """Bus bandwidth, bytes/s."""
    bandwidth_interval_bytes_per_s: tuple[float, float]
    """Its 90 % interval."""
    residual_median_s: float
    """Median absolute residual of the instances' transfer times, seconds."""
    latency_refused: str | None
    """Why latency was not told apart from bandwidth, else ``None``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCategories:
    """Seconds per step of one pipeline stage by :data:`PRED_CATEGORIES`, measured (a mean) or expected."""

    pp_rank: int
    seconds: dict[str, float]
    """Category -> seconds per step (the categories add up to :attr:`total_seconds`)."""

    @property
    def total_seconds(self) -> float:
        """The step."""
        return sum(self.seconds.values())


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """What a run told about the assumptions, and how well the calibrated plan reproduces it."""

    spec: JobSpec
    """The job that ran."""
    base: PlanAssumptions
    """The assumptions calibrated from (kept where the run cannot tell)."""
    assumptions: PlanAssumptions
    """The calibrated assumptions."""
    values: tuple[FittedValue, ...]
    """Every value fitted or refused, in file order."""
    links: tuple[LinkFit, ...]
    """The link fits behind the link values."""
    measured: tuple[StepCategories, ...]
    """Measured mean seconds per category, per pipeline stage."""
    plan: Plan
    """The calibrated plan of the layout that ran."""
    rank_steps: int
    """Rank-steps the fit saw."""
    steps: int
    """Distinct steps."""
    measured_step_seconds: float
    """Mean step time over rank-steps, seconds."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """The mapping the file holds (what :func:`~meshscope.plan.assumptions_from_mapping` loads over ``base``)."""

    @property
    def critical(self) -> StepCategories:
        """Measured categories of the stage the calibrated plan says is slowest."""
        return measured_stage(self.measured, self.plan.expected_step_time.pp_rank)

    def residuals(self) -> dict[str, tuple[float, float]]:
        """Category -> (measured, calibrated plan) seconds per step, on :attr:`critical`'s stage."""
        expected = expected_categories(self.plan)
        got = self.critical.seconds
        return {c: (got.get(c, 0.0), expected.get(c, 0.0)) for c in PRED_CATEGORIES}

    def to_dict(self) -> dict[str, Any]:
        """JSON form: values, links, residuals, the overrides (base units)."""
        return {
            "job": self.spec.name,
            "layout": self.spec.layout.describe(),
            "rank_steps": self.rank_steps,
            "steps": self.steps,
            "measured_step_seconds": self.measured_step_seconds,
            "values": [v.to_dict() for v in self.values],
            "links": [
                {
                    "link": lf.link,
                    "instances": lf.instances,
                    "hop_latency_s": lf.hop_latency_s,
                    "hop_latency_interval_s": lf.hop_latency_interval_s,
                    "bandwidth_bytes_per_s": lf.bandwidth_bytes_per_s,
                    "bandwidth_interval_bytes_per_s": list(lf.bandwidth_interval_bytes_per_s),
                    "residual_median_s": lf.residual_median_s,
                    "latency_refused": lf.latency_refused,
                }
                for lf in self.links
            ],
            "residuals": {
                c: {"measured_s": m, "calibrated_s": e, "residual_s": e - m} for c, (m, e) in self.residuals().items()
            },
            "calibrated_step_seconds": self.plan.expected_step_time.total_seconds,
            "assumptions": self.overrides,
        }


# ====================================================================== categories


def measured_stages(rs: RankSteps) -> tuple[StepCategories, ...]:
    """Mean seconds per step of every :data:`PRED_CATEGORIES` category, per pipeline stage (recorded ``pp`` coord)."""
    stage = stage_of_rows(rs.breakdown.table)
    out = []
    for s in np.unique(stage).tolist():
        rows = stage == s
        seconds = {COMPUTE: float(rs.us(COMPUTE)[rows].mean()) / 1e6}
        for a in AXES:
            both = rs.us(comm_category(a, TRANSFER))[rows] + rs.us(comm_category(a, SYNC_WAIT))[rows]
            seconds[f"comm.{a.value}"] = float(both.mean()) / 1e6
        for c in (BUBBLE, OPTIMIZER, DATA, CHECKPOINT, OTHER):
            seconds[c] = float(rs.us(c)[rows].mean()) / 1e6
        out.append(StepCategories(pp_rank=int(s), seconds=seconds))
    return tuple(out)


def measured_stage(stages: tuple[StepCategories, ...], pp_rank: int) -> StepCategories:
    """The stage ``pp_rank`` of ``stages``, else the one with the longest step (a layout without that stage)."""
    for s in stages:
        if s.pp_rank == pp_rank:
            return s
    return max(stages, key=lambda s: s.total_seconds)


def expected_categories(plan: Plan) -> dict[str, float]:
    """The plan's expected seconds per :data:`PRED_CATEGORIES` category, on its slowest stage."""
    t = plan.expected_step_time
    out = {COMPUTE: t.compute_seconds}
    sync = t.sync_wait_seconds or {}
    out.update(
        {f"comm.{a.value}": float(t.exposed_comm_seconds.get(a.value, 0.0) + sync.get(a.value, 0.0)) for a in AXES}
    )
    out.update({BUBBLE: t.bubble_seconds, OPTIMIZER: t.optimizer_seconds, DATA: t.data_seconds, CHECKPOINT: 0.0})
    out[OTHER] = t.other_seconds
    return out


# ====================================================================== robust statistics


def _rng() -> np.random.Generator:
    return np.random.default_rng(SEED)


def _interval(samples: NDArray[np.float64]) -> tuple[float, float]:
    low, high = np.percentile(samples, INTERVAL)
    return float(low), float(high)


def _bootstrap_median(values: NDArray[np.float64]) -> tuple[float, float, float]:
    """Median of ``values`` and its 90 % bootstrap interval."""
    idx = _rng().integers(0, values.size, size=(BOOTSTRAP_SAMPLES, values.size))
    return (float(np.median(values)), *_interval(np.median(values[idx], axis=1)))


def _bootstrap_mean(values: NDArray[np.float64]) -> tuple[float, float, float]:
    """Mean of ``values`` and its 90 % bootstrap interval."""
    idx = _rng().integers(0, values.size, size=(BOOTSTRAP_SAMPLES, values.size))
    return (float(values.mean()), *_interval(values[idx].mean(axis=1)))


def _solve_nonnegative(a: NDArray[np.float64], b: NDArray[np.float64]) -> NDArray[np.float64]:
    """Solve the ``(B, 2, 2)`` normal equations ``a c = b`` with ``c >= 0``.

    A negative term is set to 0 and the other refitted alone: both are physical (seconds per hop, seconds per byte).
    """
    det = a[:, 0, 0] * a[:, 1, 1] - a[:, 0, 1] * a[:, 1, 0]
    ok = np.abs(det) > 1e-300 * np.maximum(a[:, 0, 0] * a[:, 1, 1], 1e-300)
    safe = np.where(ok, det, 1.0)
    c0 = np.where(ok, (a[:, 1, 1] * b[:, 0] - a[:, 0, 1] * b[:, 1]) / safe, 0.0)
    c1 = np.where(ok, (a[:, 0, 0] * b[:, 1] - a[:, 1, 0] * b[:, 0]) / safe, 0.0)
    only0 = np.maximum(b[:, 0] / np.where(a[:, 0, 0] > 0, a[:, 0, 0], np.inf), 0.0)
    only1 = np.maximum(b[:, 1] / np.where(a[:, 1, 1] > 0, a[:, 1, 1], np.inf), 0.0)
    drop0 = ~ok | (c0 < 0)
    drop1 = ~drop0 & (c1 < 0)
    c0, c1 = np.where(drop0, 0.0, np.where(drop1, only0, c0)), np.where(drop0, only1, np.where(drop1, 0.0, c1))
    return np.stack([c0, c1], axis=1)


def _normal(x: NDArray[np.float64], y: NDArray[np.float64], w: NDArray[np.float64]) -> tuple[NDArray[np.float64], ...]:
    """``(B, 2, 2)`` and ``(B, 2)`` weighted normal equations for ``(B, n)`` weights (matrix products, no loop)."""
    outer = np.stack([x[:, 0] * x[:, 0], x[:, 0] * x[:, 1], x[:, 1] * x[:, 1]], axis=1)
    sums = w @ outer
    a = np.stack([sums[:, [0, 1]], sums[:, [1, 2]]], axis=1)
    return a, w @ (x * y[:, None])


def huber_fit(
    x: NDArray[np.float64], y: NDArray[np.float64], *, iterations: int = 25
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Non-negative Huber regression of ``y`` on the two columns of ``x`` (no intercept).

    Iteratively reweighted least squares with Huber's weights ``min(1, k·s/|r|)``, ``s`` = 1.4826 x the median
    absolute residual, ``k`` = :data:`HUBER_K`.

    Args:
        x: ``(n, 2)`` regressors.
        y: ``(n,)`` responses.
        iterations: IRLS iterations (1: ordinary least squares).

    Returns:
        The two coefficients, and the final robust weight of every point (for :func:`bootstrap_fit`).
    """
    robust = np.ones(y.size)
    coef = np.zeros(2)
    for i in range(iterations):
        coef = _solve_nonnegative(*_normal(x, y, robust[None, :]))[0]
        if i == iterations - 1:
            break
        residual = np.abs(y - x @ coef)
        scale = 1.4826 * float(np.median(residual))
        if scale <= 0:
            break
        robust = np.minimum(1.0, HUBER_K * scale / np.maximum(residual, np.finfo(float).tiny))
    return coef, robust


def bootstrap_fit(
    x: NDArray[np.float64], y: NDArray[np.float64], robust: NDArray[np.float64], multiplicities: NDArray[np.float64]
) -> NDArray[np.float64]:
    """The weighted fit redone on every resample (``(B, n)`` multiplicities), the robust weights held fixed.

    Holding the final Huber weights keeps a resample's cost to two matrix products; outliers stay down-weighted.

    Returns:
        ``(B, 2)`` coefficients.
    """
    return _solve_nonnegative(*_normal(x, y, multiplicities * robust[None, :]))


# ====================================================================== links


def ring_hops(op: str, members: int, nodes: int) -> tuple[int, int]:
    """``(hops, hops that cross a domain)`` the planner's ring charges a collective (:mod:`meshscope.plan.nccl`).

    All-reduce ``2(n-1)`` steps, of which ``2·nodes`` cross the network across nodes; all-gather and reduce-scatter
    ``n-1``, of which ``nodes - 1``; all-to-all (grouped point-to-point) one hop, over the network if it spans nodes.
    """
    if op == CommOp.ALL_TO_ALL.value:
        return 1, 1 if nodes > 1 else 0
    if op == CommOp.ALL_REDUCE.value:
        steps, inter = 2 * (members - 1), (2 * nodes if nodes > 1 else 0)
    else:
        steps, inter = members - 1, nodes - 1
    return steps, min(steps, inter)


@dataclass(frozen=True, slots=True, kw_only=True)
class Instances:
    """Every complete collective instance of a fitted op, with what the link model needs."""

    op: NDArray[np.int64]
    members: NDArray[np.int64]
    nodes: NDArray[np.int64]
    """NVLink domains (or, without domains, nodes) it spans."""
    bus_bytes: NDArray[np.float64]
    """Bytes each member moves (the nccl-tests bus factor x the message)."""
    transfer_s: NDArray[np.float64]
    """Last member's arrival to the end, seconds."""
    hops: NDArray[np.float64]
    inter_hops: NDArray[np.float64]
    axis: NDArray[np.int64]
    """Axis code (an index into :data:`meshscope.topology.AXES`)."""


def collective_instances(rs: RankSteps) -> Instances:
    """Complete instances of all-reduce, all-gather, reduce-scatter and all-to-all, their bytes and transfer times."""
    bd = rs.breakdown
    table, join = bd.table, bd.collectives
    iv = table.intervals
    idx = table.collective_order
    empty = np.zeros(0)
    if idx.size == 0:
        return Instances(op=empty.astype(np.int64), members=empty.astype(np.int64), nodes=empty.astype(np.int64),
                         bus_bytes=empty, transfer_s=empty, hops=empty, inter_hops=empty,
                         axis=empty.astype(np.int64))  # fmt: skip
    g, q = iv.group[idx], iv.seq[idx]
    new = np.ones(idx.size, dtype=bool)
    new[1:] = (g[1:] != g[:-1]) | (q[1:] != q[:-1])
    starts = np.flatnonzero(new)
    rows = iv.row[idx].astype(np.int64)
    node = table.steps.node[rows].astype(np.int64)
    place = place_of_rows(table)[rows]
    end = np.maximum.reduceat(iv.end_us[idx] - bd.clock.offset_us[node], starts)
    inst = np.cumsum(new) - 1
    # Distinct places per instance: sort (instance, place) pairs and count the changes.
    key = np.unique(inst.astype(np.int64) * (int(place.max()) + 1) + place)
    nodes = np.bincount(key // (int(place.max()) + 1), minlength=starts.size).astype(np.int64)
    size = iv.size_bytes[idx[starts]].astype(np.float64)
    transfer = (end - join.last_arrival_us).astype(np.float64) / 1e6
    fitted = np.isin(join.op, [OPS.index(o) for o in _FITTED_OPS])
    keep = np.flatnonzero(join.complete & fitted & (join.members > 1) & (size > 0) & (transfer >= 0))
    op, members = join.op[keep].astype(np.int64), join.members[keep].astype(np.int64)
    n = members.astype(np.float64)
    factor = np.where(op == OPS.index(CommOp.ALL_REDUCE), 2 * (n - 1) / n, (n - 1) / n)
    combos, inverse = np.unique(np.stack([op, members, nodes[keep]], axis=1), axis=0, return_inverse=True)
    table_hops = np.array([ring_hops(OPS[o].value, m, k) for o, m, k in combos.tolist()], dtype=np.float64)
    pairs = table_hops.reshape(-1, 2)[inverse.reshape(-1)] if keep.size else np.zeros((0, 2))
    return Instances(
        op=op,
        members=members,
        nodes=nodes[keep],
        bus_bytes=size[keep] * factor,
        transfer_s=transfer[keep],
        hops=pairs[:, 0],
        inter_hops=pairs[:, 1],
        axis=iv.axis[idx[starts]][keep].astype(np.int64),
    )


def fit_link(
    link: str, x_hops: NDArray[np.float64], bus_bytes: NDArray[np.float64], y: NDArray[np.float64], *,
    base_hop_latency_s: float,
) -> LinkFit:  # fmt: skip
    """Fit ``y = hops x hop latency + bus bytes / bandwidth`` robustly, with bootstrap intervals.

    When the instances' bytes per hop do not spread by :data:`MIN_SPREAD`, latency is not told apart from
    bandwidth: the base hop latency is kept and only the bandwidth fitted given it (``latency_refused`` says so).
    """
    n = y.size
    multiplicities = _rng().multinomial(n, np.full(n, 1.0 / n), size=BOOTSTRAP_SAMPLES).astype(np.float64)
    ratio = bus_bytes / np.maximum(x_hops, 1e-12)
    lo, hi = np.percentile(ratio, [5, 95])
    refused = None
    if not (lo > 0 and hi / lo >= MIN_SPREAD):
        refused = (
            f"every {link} instance moves about {_bytes_text(float(np.median(ratio)))} per hop: one message size "
            f"cannot separate latency from bandwidth, so the base hop latency ({base_hop_latency_s * 1e6:.3g} µs) is "
            "kept and only the bandwidth is fitted given it"
        )
        x = np.stack([np.zeros(n), bus_bytes], axis=1)
        target = y - x_hops * base_hop_latency_s
    else:
        x, target = np.stack([x_hops, bus_bytes], axis=1), y
    main, robust = huber_fit(x, target)
    coef = np.vstack([main, bootstrap_fit(x, target, robust, multiplicities)])
    if refused:
        coef[:, 0] = base_hop_latency_s
    hop, per_byte = coef[0]
    residual = float(np.median(np.abs(y - hop * x_hops - per_byte * bus_bytes)))
    per_byte_boot = np.maximum(coef[1:, 1], 1e-300)
    bandwidth = 1.0 / per_byte if per_byte > 0 else math.inf
    return LinkFit(
        link=link,
        instances=n,
        hop_latency_s=float(hop),
        hop_latency_interval_s=None if refused else _interval(coef[1:, 0]),
        bandwidth_bytes_per_s=bandwidth,
        bandwidth_interval_bytes_per_s=_interval(1.0 / per_byte_boot),
        residual_median_s=residual,
        latency_refused=refused,
    )


def _bytes_text(value: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g} B"


# ====================================================================== the fit


def _planned_with(spec: JobSpec, assumptions: PlanAssumptions) -> Plan:
    return plan_job(spec, assumptions=assumptions)


def calibrate(
    table: RecordTable,
    spec: JobSpec,
    *,
    base: PlanAssumptions | None = None,
    one_clock: bool = False,
    emulated: bool = False,
) -> Calibration:
    """Fit the assumptions ``table``'s run can tell, over ``base``.

    Args:
        table: the run's step records (warm-up already left out, if wanted).
        spec: the job that ran (its layout must be the records').
        base: the assumptions fitted from and kept where the run cannot tell (default :class:`PlanAssumptions()`;
            the emulated accelerator's for ``meshscope run`` of ``train_tiny``).
        one_clock: every record was timed on one host clock (``analyze``'s ``one_clock``).
        emulated: the run's compute is the emulated accelerator's (``train_tiny --emulate``): its kernels take
            exactly FLOPs ÷ peak, so the efficiency stays ``base``'s and what the host adds on top is fitted as
            ``host_seconds_per_layer_pass``.

    Returns:
        The calibration.

    Raises:
        CalibrationError: for records of another layout than the spec's, or no rank-steps.
        PlanError: if the spec cannot be planned.
    """
    base = PlanAssumptions() if base is None else base
    if table.n_rows == 0:
        raise ParseError("no step records to calibrate from (the input is empty)", code=ParseCode.INVALID)
    try:
        check_records_match_layout(table, spec.layout, origin=f"spec {spec.name!r}")
    except MeshscopeError as exc:
        raise CalibrationError(str(exc)) from None
    values: list[FittedValue] = []
    changes: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    given = base
    base = _fit_contention(spec, base=base, values=values, overrides=overrides)
    plan0 = _planned_with(spec, base)
    bd = break_down(table, p2p_bandwidth_bytes_per_s=p2p_bandwidth(spec, plan0), align_clocks=not one_clock)
    rs = index_rank_steps(bd)
    stage = stage_of_rows(table)

    if emulated and base.flat_compute:
        _fit_host_compute(spec, base=base, rs=rs, stage=stage, values=values, changes=changes, overrides=overrides)
    else:
        _fit_compute(spec, base=base, rs=rs, stage=stage, values=values, changes=changes, overrides=overrides)
    links = _fit_links(spec, base=base, rs=rs, values=values, changes=changes, overrides=overrides)
    _fit_optimizer(spec, base=base, rs=rs, stage=stage, values=values, changes=changes, overrides=overrides)
    _fit_sync_wait(spec, base=base, rs=rs, stage=stage, values=values, changes=changes, overrides=overrides)
    _fit_overlaps(
        spec,
        calibrated=replace(base, **changes),
        rs=rs,
        stage=stage,
        values=values,
        changes=changes,
        overrides=overrides,
    )
    for name, category, what in (
        ("data_wait_seconds", DATA, "data wait"),
        ("host_overhead_seconds", OTHER, "other (host overhead)"),
    ):
        per_row = rs.us(category) / 1e6
        mean, low, high = _bootstrap_mean(per_row)
        values.append(FittedValue(name=name, value=mean, low=low, high=high, base=getattr(base, name), unit="s",
                                  basis=f"mean {what} per step over {per_row.size:,} rank-steps"))  # fmt: skip
        changes[name] = mean
        overrides[name] = mean
    calibrated = replace(base, **changes)
    plan = _planned_with(spec, calibrated)
    return Calibration(
        spec=spec,
        base=given,
        assumptions=calibrated,
        values=tuple(values),
        links=links,
        measured=measured_stages(rs),
        plan=plan,
        rank_steps=int(table.n_rows),
        steps=rs.n_steps,
        measured_step_seconds=float(rs.step_us.mean()) / 1e6,
        overrides=overrides,
    )


def _planned_compute(spec: JobSpec, assumptions: PlanAssumptions) -> NDArray[np.float64]:
    """Planned compute seconds per step of every stage."""
    plan = _planned_with(spec, assumptions)
    return np.array([s.step_time.compute_seconds for s in plan.stages])


def _fit_compute(
    spec: JobSpec,
    *,
    base: PlanAssumptions,
    rs: RankSteps,
    stage: NDArray[np.int64],
    values: list[FittedValue],
    changes: dict[str, Any],
    overrides: dict[str, Any],
) -> None:
    measured = rs.us(COMPUTE) / 1e6
    if not (measured > 0).any():
        values.append(FittedValue(name="compute_efficiency" if base.flat_compute else "gemm_efficiency", value=None,
                                  low=None, high=None, base=base.compute_efficiency, unit="",
                                  basis="no compute intervals in the records",
                                  refused="the records hold no compute: nothing to fit compute against"))  # fmt: skip
        return
    if base.flat_compute:
        _fit_flat_compute(spec, base=base, measured=measured, stage=stage, values=values, changes=changes,
                          overrides=overrides)  # fmt: skip
        return
    # The roofline: one GEMM ceiling, by bisection on the measured mean compute (planned compute falls as it rises).
    target = float(measured.mean())
    low_t, high_t = _bootstrap_mean(measured)[1:]
    counts = np.bincount(np.clip(stage, 0, spec.layout.pp - 1), minlength=spec.layout.pp).astype(np.float64)

    def planned_mean(g: float) -> float:
        return float((_planned_compute(spec, replace(base, gemm_efficiency=g)) * counts).sum() / counts.sum())

    def solve(goal: float) -> float:
        lo, hi = 1e-3, 1.0
        if planned_mean(hi) >= goal:
            return 1.0
        if planned_mean(lo) <= goal:
            return lo
        for _ in range(40):
            mid = math.sqrt(lo * hi)
            if planned_mean(mid) > goal:
                lo = mid
            else:
                hi = mid
        return math.sqrt(lo * hi)

    g = solve(target)
    gpu_ceiling = spec.hardware.gpu.matmul_ceiling(spec.training.precision.value)
    default = base.gemm_efficiency if base.gemm_efficiency is not None else gpu_ceiling
    at_one = planned_mean(1.0)
    if g >= 1.0 and at_one > high_t:
        # Even GEMMs at the spec's peak leave the plan slower than the run: its memory-bound classes at the spec's HBM
        # bandwidth take longer than the whole measured compute. No GEMM ceiling can fit that; one efficiency for every
        # FLOP can, and it scales each layout's compute with its FLOPs, which is what a prediction needs.
        why = (
            f"the roofline plans {at_one * 1e3:.4g} ms of compute per step with GEMMs at the spec's full peak, "
            f"{at_one / target:.3g}x the measured {target * 1e3:.4g} ms: its memory-bound operations at the spec's "
            f"HBM bandwidth ({spec.hardware.gpu.hbm_bandwidth_bytes_per_s / 1e9:.4g} GB/s) alone outlast the run's "
            f"compute, so the spec's hardware understates this machine; the flat model (one efficiency for every "
            f"FLOP) is fitted instead"
        )
        values.append(FittedValue(name="gemm_efficiency", value=None, low=None, high=None, base=default, unit="",
                                  basis="-", refused=why))  # fmt: skip
        _fit_flat_compute(spec, base=base, measured=measured, stage=stage, values=values, changes=changes,
                          overrides=overrides)  # fmt: skip
        return
    values.append(FittedValue(
        name="gemm_efficiency", value=g, low=solve(high_t), high=solve(low_t), base=default, unit="",
        basis=f"the GEMM ceiling at which the roofline's compute equals the measured mean "
        f"({target * 1e3:.4g} ms per step over {measured.size:,} rank-steps)",
    ))  # fmt: skip
    changes["gemm_efficiency"] = g
    overrides["gemm_efficiency"] = g
    values.extend((_per_class_refusal(base), _host_refusal(base)))


def _fit_flat_compute(
    spec: JobSpec,
    *,
    base: PlanAssumptions,
    measured: NDArray[np.float64],
    stage: NDArray[np.int64],
    values: list[FittedValue],
    changes: dict[str, Any],
    overrides: dict[str, Any],
) -> None:
    """One efficiency for every FLOP: the median of planned compute at the dense peak over measured compute."""
    at_peak = _planned_compute(spec, replace(base, compute_efficiency=1.0))[np.clip(stage, 0, spec.layout.pp - 1)]
    ok = measured > 0
    ratio = at_peak[ok] / measured[ok]
    median, low, high = _bootstrap_median(ratio)
    note = ""
    if median > 1.0:
        note = f"; measured compute is faster than the peak allows ({median:.3g} x), kept at 1"
    value = min(median, 1.0)
    values.append(FittedValue(
        name="compute_efficiency", value=value, low=min(low, 1.0), high=min(high, 1.0),
        base=base.compute_efficiency, unit="",
        basis=f"median over {int(ok.sum()):,} rank-steps of planned compute at the dense peak ÷ measured "
        f"compute{note}",
    ))  # fmt: skip
    changes["compute_efficiency"] = value
    overrides["compute_efficiency"] = value
    values.extend((_per_class_refusal(base), _host_refusal(base)))


def _fit_host_compute(
    spec: JobSpec,
    *,
    base: PlanAssumptions,
    rs: RankSteps,
    stage: NDArray[np.int64],
    values: list[FittedValue],
    changes: dict[str, Any],
    overrides: dict[str, Any],
) -> None:
    """The emulated accelerator: measured compute minus its exact sleep, per layer and micro-batch of the stage."""
    plan = _planned_with(spec, base)
    planned = np.array([s.step_time.compute_seconds for s in plan.stages])
    passes = np.array([plan.micro_batches * max(s.layers, 1) for s in plan.stages], dtype=np.float64)
    rows = np.clip(stage, 0, spec.layout.pp - 1)
    extra = (rs.us(COMPUTE) / 1e6 - planned[rows]) / passes[rows]
    median, low, high = _bootstrap_median(extra)
    note = "; measured compute is below the emulated sleep, so 0" if median < 0 else ""
    value = max(median, 0.0)
    values.append(FittedValue(
        name="compute_efficiency", value=None, low=None, high=None, base=base.compute_efficiency, unit="",
        basis="-", refused="the emulated accelerator's kernels take exactly FLOPs ÷ its peak (a sleep): its efficiency "
        "is known, and what the host adds is fitted as host_seconds_per_layer_pass",
    ))  # fmt: skip
    values.append(FittedValue(
        name="host_seconds_per_layer_pass", value=value, low=max(low, 0.0), high=max(high, 0.0),
        base=base.host_seconds_per_layer_pass, unit="s",
        basis=f"median over {extra.size:,} rank-steps of (measured compute - the emulated sleep) ÷ (micro-batches x "
        f"layers of the stage){note}",
    ))  # fmt: skip
    changes["host_seconds_per_layer_pass"] = value
    overrides["host_seconds_per_layer_pass"] = value
    tokens = micro_batch_tokens_per_rank(spec.model, spec.training, spec.layout)
    values.append(FittedValue(
        name="host_reference_tokens", value=tokens, low=None, high=None, base=base.host_reference_tokens, unit="",
        basis=f"the run's tokens per rank per micro-batch (b·s ÷ cp = {spec.training.micro_batch_size} x "
        f"{spec.model.seq_length} ÷ {spec.layout.cp}), at which the host time per layer pass was measured; another "
        f"micro-batch scales it by (tokens ÷ {tokens:g}) ** host_tokens_exponent ({base.host_tokens_exponent:.3g})",
    ))  # fmt: skip
    changes["host_reference_tokens"] = tokens
    overrides["host_reference_tokens"] = tokens
    tp = spec.layout.tp
    values.append(FittedValue(
        name="host_reference_tp", value=float(tp), low=None, high=None, base=base.host_reference_tp, unit="",
        basis=f"the run's tensor-parallel degree, at which the host time per layer pass was measured; a layout "
        f"{'without' if tp > 1 else 'with'} tensor parallelism {'divides' if tp > 1 else 'multiplies'} it by "
        f"host_tp_factor ({base.host_tp_factor:.3g})",
    ))  # fmt: skip
    changes["host_reference_tp"] = float(tp)
    overrides["host_reference_tp"] = tp
    values.append(_per_class_refusal(base))


def _host_refusal(base: PlanAssumptions) -> FittedValue:
    return FittedValue(
        name="host_seconds_per_layer_pass",
        value=None,
        low=None,
        high=None,
        base=base.host_seconds_per_layer_pass,
        unit="s",
        basis="-",
        refused=(
            "one layout cannot tell the host's time per layer pass from a lower compute efficiency (both scale "
            "with the layers and micro-batches): the fitted efficiency absorbs it"
        ),
    )


def _per_class_refusal(base: PlanAssumptions) -> FittedValue:
    return FittedValue(
        name="attention_efficiency",
        value=None,
        low=None,
        high=None,
        base=base.attention_efficiency,
        unit="",
        basis="-",
        refused=(
            "step records carry one compute interval per pass, not per operation class: attention core and "
            "element-wise efficiencies keep their base values and the fitted compute term absorbs them"
        ),
    )


def _fit_links(
    spec: JobSpec,
    *,
    base: PlanAssumptions,
    rs: RankSteps,
    values: list[FittedValue],
    changes: dict[str, Any],
    overrides: dict[str, Any],
) -> tuple[LinkFit, ...]:
    inst = collective_instances(rs)
    transfer_s = inst.transfer_s
    stage_at_fit = base.cpu_stage_contention_at_fit
    if base.cpu_cores is not None and stage_at_fit is not None and stage_at_fit != base.cpu_contention_at_fit:
        # dp's collectives ran at the stage's contention, the others at the busy ranks': one line for both is
        # referenced to the busy ranks' (the planner prices dp on it x stage contention ÷ cpu_contention_at_fit).
        dp = inst.axis == AXES.index(MeshAxis.DP)
        transfer_s = np.where(dp, transfer_s * base.cpu_contention_at_fit / stage_at_fit, transfer_s)
    network = inst.nodes > 1
    hw = spec.hardware
    fits: list[LinkFit] = []
    simple = base.ring_simple
    hops = {"nvlink": simple.nvlink_hop_latency_s, "network": simple.network_hop_latency_s}
    for link in (Link.NVLINK.value, Link.NETWORK.value):
        mask = network if link == Link.NETWORK.value else ~network
        eff_name = f"{link}_efficiency"
        hop_name = f"ring_simple.{link}_hop_latency_s"
        nominal = hw.link_bandwidth_bytes_per_s(link)
        count = int(mask.sum())
        if count < MIN_INSTANCES:
            why = (
                "the run never crossed an NVLink domain (no collective spans two)"
                if link == Link.NETWORK.value and count == 0
                else f"only {count} complete collective instances over {link} (at least {MIN_INSTANCES} needed)"
            )
            for name, b, unit in ((eff_name, base.link_efficiency(link), ""), (hop_name, hops[link], "s")):
                values.append(FittedValue(name=name, value=None, low=None, high=None, base=b, unit=unit, basis="-",
                                          refused=f"{why}: the base value is kept"))  # fmt: skip
            continue
        x = inst.hops[mask]
        y = transfer_s[mask]
        if link == Link.NETWORK.value:
            # The hops inside a domain are priced at the NVLink hop latency (fitted above, else the base).
            y = y - (x - inst.inter_hops[mask]) * hops["nvlink"]
            x = inst.inter_hops[mask]
        fit = fit_link(link, x, inst.bus_bytes[mask], y, base_hop_latency_s=hops[link])
        fits.append(fit)
        efficiency = fit.bandwidth_bytes_per_s / nominal
        note = ""
        if efficiency > 1.0:
            note = f"; faster than the spec's nominal {link} bandwidth ({efficiency:.3g} x), kept at 1"
        lo_bw, hi_bw = fit.bandwidth_interval_bytes_per_s
        values.append(FittedValue(
            name=eff_name, value=min(efficiency, 1.0), low=min(lo_bw / nominal, 1.0),
            high=min(hi_bw / nominal, 1.0), base=base.link_efficiency(link), unit="",
            basis=f"bus bandwidth {fit.bandwidth_bytes_per_s / 1e6:.4g} MB/s (90 % {lo_bw / 1e6:.4g}-"
            f"{hi_bw / 1e6:.4g}) "
            f"of the nominal {nominal / 1e9:.4g} GB/s, Huber fit of {fit.instances:,} collective instances, median "
            f"residual {fit.residual_median_s * 1e6:.3g} µs{note}",
        ))  # fmt: skip
        changes[eff_name] = min(efficiency, 1.0)
        overrides[eff_name] = min(efficiency, 1.0)
        interval = fit.hop_latency_interval_s
        values.append(FittedValue(
            name=hop_name, value=None if fit.latency_refused else fit.hop_latency_s,
            low=None if interval is None else interval[0], high=None if interval is None else interval[1],
            base=hops[link], unit="s",
            basis=f"seconds per ring hop, the same fit ({fit.instances:,} instances)",
            refused=fit.latency_refused,
        ))  # fmt: skip
        hops[link] = fit.hop_latency_s
    if fits:
        costs = NcclProtocolCosts(
            base_latency_s=0.0,
            nvlink_hop_latency_s=hops["nvlink"],
            network_hop_latency_s=hops["network"],
            bandwidth_fraction=1.0,
        )
        changes.update(ring_simple=costs, nccl_latency=True, nccl_algorithms=("ring",), nccl_protocols=("simple",))
        overrides["nccl_latency"] = True
        overrides["nccl_algorithms"] = ["ring"]
        overrides["nccl_protocols"] = ["simple"]
        overrides["ring_simple"] = {
            "base_latency_s": 0.0,
            "nvlink_hop_latency_s": hops["nvlink"],
            "network_hop_latency_s": hops["network"],
            "bandwidth_fraction": 1.0,
        }
    return tuple(fits)


def _fit_optimizer(
    spec: JobSpec,
    *,
    base: PlanAssumptions,
    rs: RankSteps,
    stage: NDArray[np.int64],
    values: list[FittedValue],
    changes: dict[str, Any],
    overrides: dict[str, Any],
) -> None:
    measured = rs.us(OPTIMIZER) / 1e6
    ok = measured > 0
    default = base.optimizer_hbm_efficiency if base.optimizer_hbm_efficiency is not None else base.hbm_efficiency
    if not ok.any():
        values.append(FittedValue(name="optimizer_hbm_efficiency", value=None, low=None, high=None, base=default,
                                  unit="", basis="-", refused="the records mark no optimizer step: the base value "
                                  "is kept"))  # fmt: skip
        return
    at_peak_plan = _planned_with(spec, replace(base, optimizer_hbm_efficiency=1.0))
    at_peak = np.array([s.step_time.optimizer_seconds for s in at_peak_plan.stages])
    ratio = at_peak[np.clip(stage, 0, spec.layout.pp - 1)][ok] / measured[ok]
    median, low, high = _bootstrap_median(ratio)
    note = f"; faster than the HBM bandwidth allows ({median:.3g} x), kept at 1" if median > 1 else ""
    value = min(median, 1.0)
    values.append(FittedValue(
        name="optimizer_hbm_efficiency", value=value, low=min(low, 1.0), high=min(high, 1.0), base=default, unit="",
        basis=f"median over {int(ok.sum()):,} rank-steps of planned optimizer time at full HBM bandwidth ÷ measured"
        f"{note}",
    ))  # fmt: skip
    changes["optimizer_hbm_efficiency"] = value
    overrides["optimizer_hbm_efficiency"] = value


# ====================================================================== the file and the text


def _yaml_number(value: float) -> str:
    """A float as YAML 1.1 reads it back exactly (PyYAML needs a dot in the mantissa: ``1.0e-05``, not ``1e-05``)."""
    text = repr(float(value))
    if "e" in text and "." not in text.split("e")[0]:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}.0e{exponent}"
    return text


def _value_comment(v: FittedValue) -> str:
    interval = "" if v.low is None else f" (90 % interval {_plain(v.low, v.unit)} to {_plain(v.high, v.unit)})"
    return f"fitted{interval}: {v.basis}; base {_plain(v.base, v.unit)}"


def _plain(value: float | None, unit: str) -> str:
    if value is None:
        return "none"
    if unit == "s" and abs(value) < 1e-9:
        return "0 s"
    if unit == "s":
        return f"{value * 1e6:.4g} µs" if abs(value) < 1e-3 else f"{value * 1e3:.4g} ms"
    return f"{value:.4g}"


_FLAG_COMMENTS: Final = {
    "nccl_latency": "price collectives with the fitted latency",
    "cpu_compute": "the kernels ran on the CPU cores: compute stretches with their contention",
}


def render_file(c: Calibration) -> str:  # noqa: C901 - one branch per kind of line
    """The assumptions file: what ``--assumptions`` loads (over the base), each value's provenance in a comment.

    Values the run could not tell are not in the mapping (the base value stays); they are listed as comments with
    the reason.
    """
    by_name = {v.name: v for v in c.values}
    lines = [
        "# meshscope calibrate: planner assumptions fitted to a measured run (docs/predict.md).",
        (
            f"# job {c.spec.name!r}, layout {c.spec.layout.describe()}, {c.rank_steps:,} rank-steps over {c.steps} "
            f"steps; measured step {c.measured_step_seconds * 1e3:.4g} ms, calibrated plan "
            f"{c.plan.expected_step_time.total_seconds * 1e3:.4g} ms."
        ),
        "# Load with: meshscope plan --assumptions FILE, meshscope predict --assumptions FILE. Keys left out keep the",
        "# base assumptions" + (" of the emulated accelerator." if c.base.compute_efficiency == 1.0 else "."),
    ]
    for key, value in c.overrides.items():
        if key == "ring_simple":
            lines.append(f"{key}:  # the ring / Simple costs: latency = hops x hop latency, no base latency")
            for sub, number in value.items():
                v = by_name.get(f"ring_simple.{sub}")
                note = ""
                if v is not None:
                    note = f"  # {_value_comment(v)}" if v.refused is None else f"  # base kept: {v.refused}"
                elif sub == "base_latency_s":
                    note = "  # the fit has no per-collective term beyond its hops"
                else:
                    note = "  # the fit prices payload at the link's fitted bandwidth"
                lines.append(f"  {sub}: {_yaml_number(number)}{note}")
            continue
        if isinstance(value, bool):
            why = _FLAG_COMMENTS.get(key, "")
            lines.append(f"{key}: {'true' if value else 'false'}" + (f"  # {why}" if why else ""))
        elif isinstance(value, list):
            lines.append(f"{key}: [{', '.join(value)}]  # the run measured one algorithm and protocol, priced as one")
        else:
            v = by_name.get(key)
            shared = next((names[0] for names in OVERLAP_OF_AXIS.values() if key in names[1:]), None)
            note = f"  # {_value_comment(v)}" if v is not None else f"  # the same fit as {shared}" if shared else ""
            lines.append(f"{key}: {_yaml_number(value)}{note}")
    refused = [v for v in c.values if v.refused is not None and v.name not in c.overrides]
    if refused:
        lines.append("# Not told by this run (the base value stays):")
        lines.extend(f"#   {v.name} = {_plain(v.base, v.unit)}: {v.refused}" for v in refused)
    lines.append("# Residual per category (calibrated plan minus measured mean, the slowest stage):")
    for category, (measured, expected) in c.residuals().items():
        if measured or expected:
            lines.append(
                f"#   {category}: measured {_plain(measured, 's')}, calibrated {_plain(expected, 's')}, "
                f"residual {_plain(expected - measured, 's')}"
            )
    return "\n".join(lines) + "\n"


def render_calibration(c: Calibration) -> str:
    """For people: every value with its interval and basis, what was refused and why, the residual per category."""

    def shown(value: float | None, unit: str) -> str:
        if value is None:
            return "-"
        return human_seconds(value) if unit == "s" else f"{value:.4g}"

    rows = []
    for v in c.values:
        interval = "-" if v.low is None else f"{shown(v.low, v.unit)} to {shown(v.high, v.unit)}"
        rows.append(
            [v.name, shown(v.value, v.unit), interval, shown(v.base, v.unit), "refused" if v.refused else "fit"]
        )
    out = [
        (
            f"meshscope calibrate: {c.spec.name} ({c.spec.layout.describe()}), {c.rank_steps:,} rank-steps over "
            f"{c.steps} steps"
        ),
        render_table(["assumption", "fitted", "90 % interval", "base", ""], rows, title="\nFitted assumptions"),
        "\nWhere each value comes from",
    ]
    out.extend(f"  {v.name}: {v.refused or v.basis}" for v in c.values)
    res = [
        [category, human_seconds(m), human_seconds(e), human_seconds(e - m)]
        for category, (m, e) in c.residuals().items()
        if m or e
    ]
    total_m, total_e = c.critical.total_seconds, c.plan.expected_step_time.total_seconds
    res.append(["step", human_seconds(total_m), human_seconds(total_e), human_seconds(total_e - total_m)])
    out.append(
        render_table(
            ["category", "measured", "calibrated plan", "residual"],
            res,
            title=f"\nResidual per category (stage {c.critical.pp_rank}, mean per step; exposed comm = transfer + "
            "sync wait)",
        )
    )
    return "\n".join(out)


OVERLAP_OF_AXIS: Final = {
    "dp": ("dp_grad_reduce_overlap", "dp_param_gather_overlap"),
    "tp": ("tp_comm_overlap", "sp_backward_allgather_overlap"),
    "cp": ("cp_comm_overlap",),
    "ep": ("ep_comm_overlap",),
    "pp": ("pp_comm_overlap",),
}
"""The overlap fractions that hide each axis' collectives (all of an axis' fractions are fitted as one value)."""


def _fit_overlaps(  # noqa: C901 - the bisection and its edges, per axis
    spec: JobSpec,
    *,
    calibrated: PlanAssumptions,
    rs: RankSteps,
    stage: NDArray[np.int64],
    values: list[FittedValue],
    changes: dict[str, Any],
    overrides: dict[str, Any],
) -> None:
    """Per axis, the overlap fraction at which the calibrated plan's exposed transfer equals the measured one.

    The target is the breakdown's exposed *transfer* (sync wait is not a property of the link or the overlap: the
    planner does not price it, and the residual shows it). Only axes whose exposed time the fraction moves in this
    job's settings (``training.tpCommOverlap`` and the like) are fitted.
    """
    counts = np.bincount(np.clip(stage, 0, spec.layout.pp - 1), minlength=spec.layout.pp).astype(np.float64)
    for axis, names in OVERLAP_OF_AXIS.items():
        measured_rows = rs.us(comm_category(axis, TRANSFER)) / 1e6
        default = getattr(calibrated, names[0])

        def exposed(f: float, axis: str = axis, names: tuple[str, ...] = names) -> float:
            fractions: dict[str, Any] = dict.fromkeys(names, f)
            plan = _planned_with(spec, replace(calibrated, **fractions))
            per_stage = np.array([s.step_time.exposed_comm_seconds.get(axis, 0.0) for s in plan.stages])
            return float((per_stage * counts).sum() / counts.sum())

        none, full = exposed(0.0), exposed(1.0)
        if none - full <= 1e-12 * max(none, 1e-30):
            continue  # the fraction does not act on this axis here (no such collectives, or overlap off)
        mean, low_t, high_t = _bootstrap_mean(measured_rows)

        def solve(
            goal: float, none: float = none, full: float = full, exposed: Callable[[float], float] = exposed
        ) -> float:
            if goal >= none:
                return 0.0
            if goal <= full:
                return 1.0
            lo, hi = 0.0, 1.0
            for _ in range(24):
                mid = (lo + hi) / 2
                if exposed(mid) > goal:
                    lo = mid
                else:
                    hi = mid
            return (lo + hi) / 2

        f = solve(mean)
        note = ""
        if mean >= none:
            note = f"; more exposed than the plan's whole {axis} transfer ({none * 1e3:.4g} ms), so 0"
        values.append(FittedValue(
            name=names[0], value=f, low=solve(high_t), high=solve(low_t), base=default, unit="",
            basis=f"the fraction at which the calibrated plan's exposed {axis} transfer equals the measured mean "
            f"({mean * 1e3:.4g} ms per step over {measured_rows.size:,} rank-steps; plan {none * 1e3:.4g} ms with "
            f"nothing hidden){note}" + (f"; also sets {', '.join(names[1:])}" if len(names) > 1 else ""),
        ))  # fmt: skip
        for name in names:
            changes[name] = f
            overrides[name] = f


def _fit_sync_wait(
    spec: JobSpec,
    *,
    base: PlanAssumptions,
    rs: RankSteps,
    stage: NDArray[np.int64],
    values: list[FittedValue],
    changes: dict[str, Any],
    overrides: dict[str, Any],
) -> None:
    """Mean sync wait per collective of every axis but pp that the run measured, each from its own collectives.

    Per rank-step, the axis' sync wait over the plan's collectives per step of that axis on the rank's stage: the
    plan's count, so that records that merge instances (the simulator's) fit alike. An axis the layout does not
    run (degree 1, or no collectives planned) is refused: its sync wait is the base's, never another axis' fit.
    """
    plan = _planned_with(spec, base)
    rows = np.clip(stage, 0, spec.layout.pp - 1)
    for axis, name in SYNC_WAIT_AXIS_FIELDS.items():
        counts = np.array(
            [sum(c.count_per_step for c in s.collectives if c.axis == axis and c.group != "pp") for s in plan.stages],
            dtype=np.float64,
        )
        per_row = counts[rows]
        ok = per_row > 0
        base_value = base.sync_wait_per_collective(axis)
        if not ok.any():
            values.append(FittedValue(
                name=name, value=None, low=None, high=None, base=base_value, unit="s", basis="-",
                refused=f"the run has no {axis} collectives ({axis}={getattr(spec.layout, axis)}): not calibrated, a "
                f"layout with {axis} gets the plan's model (the base value), not another axis' fit",
            ))  # fmt: skip
            continue
        waits = rs.us(comm_category(MeshAxis(axis), SYNC_WAIT)) / 1e6
        mean, low, high = _bootstrap_mean(np.asarray(waits)[ok] / per_row[ok])
        values.append(FittedValue(
            name=name, value=mean, low=low, high=high, base=base_value, unit="s",
            basis=f"mean {axis} sync wait per step over {int(ok.sum()):,} rank-steps ÷ the plan's "
            f"{int(per_row.max()):,} {axis} collectives per step: arrival skew (stragglers, jitter, time slicing)",
        ))  # fmt: skip
        changes[name] = mean
        overrides[name] = mean


def _fit_contention(
    spec: JobSpec, *, base: PlanAssumptions, values: list[FittedValue], overrides: dict[str, Any]
) -> PlanAssumptions:
    """On a CPU testbed (``base.cpu_cores`` set), the contention the run's values are measured at.

    Returns ``base`` with ``cpu_contention_at_fit`` and ``cpu_stage_contention_at_fit`` set, so that the calibrated
    plan of the measured layout is not stretched, and another layout's is by the ratios of its contentions to these
    (:func:`meshscope.plan.contended`).
    """
    if base.cpu_cores is None:
        values.append(FittedValue(
            name="cpu_cores", value=None, low=None, high=None, base=None, unit="", basis="-",
            refused="no CPU figures (a GPU run, or records without a meshscope run directory): every rank has its own "
            "host, so host, sync-wait and collective times are not scaled with ranks ÷ cores",
        ))  # fmt: skip
        return base
    layout = spec.layout
    plan = _planned_with(spec, replace(base, cpu_cores=None))
    kappa = cpu_contention(layout.world_size, plan.bubble_fraction, base.cpu_cores)
    busy = layout.world_size / (1.0 + plan.bubble_fraction)
    values.append(FittedValue(
        name="cpu_cores", value=base.cpu_cores, low=None, high=None, base=None, unit="",
        basis="the cores the ranks could run on less the share other processes took over the run "
        "(collector.json: cpu.cores x (1 - foreign_fraction))"
        + ("; the job's kernels ran on these CPUs (its records name no GPU), so its compute is stretched with the "
           "contention too" if base.cpu_compute else ""),
    ))  # fmt: skip
    values.append(FittedValue(
        name="cpu_contention_at_fit", value=kappa, low=None, high=None, base=1.0, unit="",
        basis=f"max(1, busy ranks ÷ cores) = max(1, {busy:.3g} ÷ {base.cpu_cores:.3g}): {layout.world_size} ranks, "
        f"of which a share 1 ÷ (1 + bubble {plan.bubble_fraction:.3g}) compute at once; the host time and the "
        "collectives inside compute below are measured at this contention",
    ))  # fmt: skip
    stage = cpu_stage_contention(layout.world_size, layout.pp, base.cpu_cores)
    values.append(FittedValue(
        name="cpu_stage_contention_at_fit", value=stage, low=None, high=None, base=1.0, unit="",
        basis=f"max(1, ranks of a stage ÷ cores) = max(1, {layout.world_size // layout.pp} ÷ {base.cpu_cores:.3g}): "
        "what competes while a stage reduces its gradients and steps its optimizer; dp's sync wait and collectives "
        "and the optimizer below are measured at this contention",
    ))  # fmt: skip
    overrides["cpu_cores"] = base.cpu_cores
    if base.cpu_compute:
        overrides["cpu_compute"] = True
    overrides["cpu_contention_at_fit"] = kappa
    overrides["cpu_stage_contention_at_fit"] = stage
    return replace(base, cpu_contention_at_fit=kappa, cpu_stage_contention_at_fit=stage)

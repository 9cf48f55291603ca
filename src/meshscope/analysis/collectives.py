"""Collective traffic per pipeline stage: the bytes each GPU moves per step, as planned and as recorded.

Why it exists: the plan says, per pipeline stage, every kind of collective a GPU runs in a step with its NCCL message
size ``S`` and count (:class:`~meshscope.plan.CollectivePlan`). Records say what each rank ran, but not always one
interval per plan instance: the simulator records one interval per collective *phase* with the bytes of all the
instances it stands for, a profiler may merge launches, a real run records every call. Counts and message sizes
therefore only compare like with like when the recorder does; **bytes per step** always do. This module holds:

* :func:`stage_traffic`, the shared measurement: the collective and point-to-point intervals of a
  :class:`~meshscope.records.RecordTable` grouped by (pipeline stage, axis, op[, message size]), with per rank-step
  instance counts and summed bytes. Vectorised (``bincount`` over a dense key, no Python loop over intervals; one
  sort only when message sizes split the keys). :mod:`meshscope.analysis.costs` (``meshscope analyze``) and
  :mod:`meshscope.local.comparisons` (the exact per-size check of ``meshscope run``) both build on it.
* :func:`compare_collectives`, the analysis' "collectives: expected vs measured" table: per stage and (axis, op) the
  plan's bytes per GPU per step (``message_bytes × count_per_step`` summed: NCCL's ``S``, **not** bus bytes) beside
  the median over the stage's rank-steps of the summed recorded ``bytes``, with counts and mean messages of both
  sides, ratio, delta and a status. Definitions: ``docs/cost-table.md``, "Expected vs measured".

It must not read files, print, or loop over ranks or intervals in Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from meshscope.records import COMM_CODE, OP_CODE, OPS
from meshscope.topology import AXES, MeshAxis

if TYPE_CHECKING:
    from collections.abc import Collection

    from numpy.typing import NDArray

    from meshscope.plan import Plan
    from meshscope.records import RecordTable

__all__ = [
    "MATCH_TOLERANCE",
    "SEND_RECV",
    "STATUSES",
    "CollectiveComparison",
    "CollectiveStatus",
    "StageTraffic",
    "compare_collectives",
    "plan_op_name",
    "stage_of_rows",
    "stage_traffic",
]

SEND_RECV = "send_recv"
"""Op name of point-to-point traffic in the comparison (plan ``send-recv``, records ``send``/``recv``)."""
MATCH_TOLERANCE = 0.01
"""Measured bytes per step within this fraction of the plan's count as a ``match``."""

CollectiveStatus = Literal["match", "differs", "partial_sizes", "no_sizes", "plan_only", "records_only"]
STATUSES: tuple[CollectiveStatus, ...] = ("match", "differs", "partial_sizes", "no_sizes", "plan_only", "records_only")
"""Every :attr:`CollectiveComparison.status`, in the order of the docs' table."""

_SEND, _RECV = OP_CODE["send"], OP_CODE["recv"]
_N_AXES, _N_OPS = len(AXES), len(OPS)
_DENSE_BINCOUNT_MAX = 1 << 24
"""Keys below this are made dense with one ``bincount`` (O(n)); larger ones with ``np.unique`` (a sort)."""

_PLAN_OP = {
    "all-reduce": "all_reduce",
    "reduce-scatter": "reduce_scatter",
    "all-gather": "all_gather",
    "all-to-all": "all_to_all",
    "send-recv": SEND_RECV,
}


def plan_op_name(op: str) -> str:
    """A plan op (``all-reduce``, ``send-recv``) in the records' spelling (``all_reduce``, ``send_recv``)."""
    return _PLAN_OP.get(op, op.replace("-", "_"))


# ====================================================================== the shared measurement


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTraffic:
    """Collective and point-to-point intervals grouped by key (stage, axis, op[, size]), counted per rank-step.

    Key ``j`` owns the segment ``offsets[j]:offsets[j + 1]`` of :attr:`rows`, :attr:`count`, :attr:`sized` and
    :attr:`total_bytes`: one entry per rank-step of its stage (all of them, in table order, also those that ran none
    of it), so a median over a segment is a median over the stage's rank-steps.
    """

    pp_rank: NDArray[np.int64]
    """``(keys,)``: pipeline stage."""
    axis: NDArray[np.int64]
    """``(keys,)``: axis code (index into :data:`meshscope.topology.layout.AXES`)."""
    op: NDArray[np.int64]
    """``(keys,)``: op code (index into :data:`meshscope.records.OPS`); p2p keeps ``send`` and ``recv`` apart."""
    size_bytes: NDArray[np.int64]
    """``(keys,)``: the message size of a key split by size; -1 when not split (or the intervals carry none)."""
    offsets: NDArray[np.int64]
    """``(keys + 1,)``: segment bounds."""
    rows: NDArray[np.intp]
    """Rank-step row (into ``RecordTable.steps``) of each segment entry."""
    count: NDArray[np.int64]
    """Intervals of the key in that rank-step."""
    sized: NDArray[np.int64]
    """Of which carry ``bytes``."""
    total_bytes: NDArray[np.float64]
    """Summed ``bytes`` of those, bytes."""

    def __len__(self) -> int:
        """Number of keys."""
        return int(self.pp_rank.shape[0])

    def segment(self, key: int) -> slice:
        """Entries of key ``key``: one per rank-step of its stage."""
        return slice(int(self.offsets[key]), int(self.offsets[key + 1]))


def stage_of_rows(table: RecordTable) -> NDArray[np.int64]:
    """The pipeline stage of every rank-step (its recorded ``pp`` coord)."""
    return table.steps.coord[:, AXES.index(MeshAxis.PP)].astype(np.int64)


def _dense(codes: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.intp]]:
    """Distinct codes (sorted) and each code's index into them; O(n) for small non-negative codes."""
    if codes.size and int(codes.min()) >= 0 and int(codes.max()) < _DENSE_BINCOUNT_MAX:
        present = np.bincount(codes) > 0
        uniq = np.flatnonzero(present).astype(np.int64)
        lookup = np.cumsum(present) - 1
        return uniq, lookup[codes]
    uniq, inverse = np.unique(codes, return_inverse=True)
    return uniq.astype(np.int64), inverse.reshape(-1)


def stage_traffic(
    table: RecordTable, stage_of_row: NDArray[np.int64], *, split_sizes_except: Collection[str] | None = None
) -> StageTraffic:
    """Group ``table``'s comm and p2p intervals by (stage, axis, op) and count them per rank-step (vectorised).

    Args:
        table: the records.
        stage_of_row: the pipeline stage of every rank-step (:func:`stage_of_rows`); the intervals of rank-steps
            given -1 are left out.
        split_sizes_except: ``None``: one key per (stage, axis, op). Else also split by message size, except for
            the ops named here (records' spelling, e.g. ``{"all_to_all"}``: sizes that depend on the data).

    Returns:
        The grouped counts; keys sorted by stage, axis code, op code, size.
    """
    iv = table.intervals
    sel = np.flatnonzero((iv.kind >= COMM_CODE) & (iv.axis >= 0) & (iv.op >= 0))
    rows = iv.row[sel].astype(np.intp)
    stage = stage_of_row[rows]
    keep = stage >= 0
    if not keep.all():
        sel, rows, stage = sel[keep], rows[keep], stage[keep]
    op = iv.op[sel].astype(np.int64)
    size = iv.size_bytes[sel]
    code = (stage * _N_AXES + iv.axis[sel].astype(np.int64)) * _N_OPS + op
    if split_sizes_except is None:
        uniq, key = _dense(code)
        size_of_key = np.full(uniq.shape, -1, dtype=np.int64)
        base = uniq
    else:
        unsplit = np.isin(op, [OP_CODE[o] for o in split_sizes_except if o in OP_CODE])
        size_key = np.where(unsplit | (size < 0), -1, size)
        sizes, size_index = np.unique(size_key, return_inverse=True)
        n_sizes = max(sizes.size, 1)
        uniq, key = _dense(code * n_sizes + size_index.reshape(-1))
        base, size_of_key = np.divmod(uniq, n_sizes)
        size_of_key = sizes[size_of_key].astype(np.int64)
    pp_rank, rest = np.divmod(base, _N_AXES * _N_OPS)
    axis, op_of_key = np.divmod(rest, _N_OPS)
    # Rank-steps grouped by stage: each key's segment holds every rank-step of its stage.
    n_rows = table.n_rows
    n_stages = int(max(int(stage_of_row.max(initial=-1)), int(pp_rank.max(initial=-1)))) + 1
    valid = np.flatnonzero(stage_of_row >= 0)
    order = valid[np.argsort(stage_of_row[valid], kind="stable")]
    per_stage = np.bincount(stage_of_row[valid], minlength=n_stages)
    stage_start = np.concatenate(([0], np.cumsum(per_stage)))
    local = np.zeros(n_rows, dtype=np.int64)
    local[order] = np.arange(order.size) - stage_start[stage_of_row[order]]
    lengths = per_stage[pp_rank]
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    flat = offsets[key] + local[rows]
    total = int(offsets[-1])
    count = np.bincount(flat, minlength=total).astype(np.int64)
    sized = size >= 0
    if sized.all():  # the usual case: no second pass over the intervals
        n_sized, weights = count, size.astype(np.float64)
    else:
        flat, weights = flat[sized], size[sized].astype(np.float64)
        n_sized = np.bincount(flat, minlength=total).astype(np.int64)
    rows_of_key = [order[stage_start[s] : stage_start[s + 1]] for s in pp_rank.tolist()]
    return StageTraffic(
        pp_rank=pp_rank,
        axis=axis,
        op=op_of_key,
        size_bytes=size_of_key,
        offsets=offsets,
        rows=np.concatenate(rows_of_key) if rows_of_key else np.zeros(0, dtype=np.intp),
        count=count,
        sized=n_sized,
        total_bytes=np.asarray(np.bincount(flat, weights=weights, minlength=total), dtype=np.float64),
    )


# ====================================================================== the comparison


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveComparison:
    """One pipeline stage and (axis, op): bytes, count and mean message per GPU per step, plan vs records.

    Bytes are NCCL's message size ``S`` (the array a call passes) summed over the instances of a step, not the bus
    bytes a ring moves (``S`` x the bus factor): what a recorder sees as a call's ``bytes``.
    """

    pp_rank: int
    """Pipeline stage."""
    axis: str
    """Mesh axis."""
    op: str
    """Operation in the records' spelling (``all_reduce``, ...; ``send_recv`` for point-to-point)."""
    expected_bytes_per_step: float | None
    """Plan: ``Σ message_bytes × count_per_step`` over the stage's entries of this (axis, op); ``None``: none."""
    measured_bytes_per_step: float | None
    """Records: median over the stage's rank-steps of the summed ``bytes`` of its intervals of this (axis, op)
    (point-to-point: the sends, or the receives where the stage's records have no send on the axis); ``None`` when
    none of them carries ``bytes`` or there is no interval."""
    measured_min_bytes_per_step: float | None
    """Records: the smallest summed ``bytes`` of any rank-step of the stage (0 where one ran none of it)."""
    measured_max_bytes_per_step: float | None
    """Records: the largest. Min and max apart from the median say the stage's ranks or steps differ, which the
    median alone hides."""
    expected_count_per_step: int | None
    """Plan: instances per step on one GPU of the stage."""
    measured_count_per_step: float | None
    """Records: median over the stage's rank-steps of its intervals per rank-step (a recorder that aggregates
    instances shows fewer)."""
    expected_message_bytes: float | None
    """Plan: bytes per step ÷ count per step (the mean message)."""
    measured_message_bytes: float | None
    """Records: mean ``bytes`` of its intervals that carry one."""
    share_of_rank_steps: float | None
    """Records: share of the stage's rank-steps that ran it at least once."""
    sized_share: float | None
    """Records: share of its intervals that carry ``bytes``."""
    status: CollectiveStatus
    """``match`` (bytes within :data:`MATCH_TOLERANCE`), ``differs``, ``partial_sizes`` (some intervals carry no
    ``bytes``: the measured bytes undercount), ``no_sizes`` (none does), ``plan_only``, ``records_only``."""

    @property
    def ratio(self) -> float | None:
        """Measured ÷ expected bytes per step."""
        e, m = self.expected_bytes_per_step, self.measured_bytes_per_step
        return None if e is None or m is None or e <= 0 else m / e

    @property
    def delta_bytes_per_step(self) -> float | None:
        """Measured − expected bytes per step."""
        e, m = self.expected_bytes_per_step, self.measured_bytes_per_step
        return None if e is None or m is None else m - e

    def to_dict(self) -> dict[str, Any]:
        """JSON form (docs/cost-table.md: bytes, counts per step, ratios 0-1 and up)."""
        return {
            "pp_rank": self.pp_rank,
            "axis": self.axis,
            "op": self.op,
            "expected_bytes_per_step": self.expected_bytes_per_step,
            "measured_bytes_per_step": self.measured_bytes_per_step,
            "ratio": self.ratio,
            "delta_bytes_per_step": self.delta_bytes_per_step,
            "measured_min_bytes_per_step": self.measured_min_bytes_per_step,
            "measured_max_bytes_per_step": self.measured_max_bytes_per_step,
            "expected_count_per_step": self.expected_count_per_step,
            "measured_count_per_step": self.measured_count_per_step,
            "expected_message_bytes": self.expected_message_bytes,
            "measured_message_bytes": self.measured_message_bytes,
            "share_of_rank_steps": self.share_of_rank_steps,
            "sized_share": self.sized_share,
            "status": self.status,
        }


@dataclass(frozen=True, slots=True)
class _Measured:
    bytes_per_step: float | None
    min_bytes_per_step: float | None
    max_bytes_per_step: float | None
    count_per_step: float
    message_bytes: float | None
    share_of_rank_steps: float
    sized_share: float


def _measured(traffic: StageTraffic) -> dict[tuple[int, str, str], _Measured]:
    """(stage, axis, op) -> the records' side; point-to-point from the sends, else the receives, of (stage, axis)."""
    sends = {(int(s), int(a)) for s, a, o in zip(traffic.pp_rank, traffic.axis, traffic.op, strict=True) if o == _SEND}
    out: dict[tuple[int, str, str], _Measured] = {}
    for j in range(len(traffic)):
        stage, axis, op = int(traffic.pp_rank[j]), int(traffic.axis[j]), int(traffic.op[j])
        if op == _RECV and (stage, axis) in sends:
            continue  # a receive is the neighbour's send: counted once, on the sender's side
        seg = traffic.segment(j)
        count, sized, total = traffic.count[seg], traffic.sized[seg], traffic.total_bytes[seg]
        n_intervals, n_sized = int(count.sum()), int(sized.sum())
        name = SEND_RECV if op in {_SEND, _RECV} else OPS[op].value
        out[(stage, AXES[axis].value, name)] = _Measured(
            bytes_per_step=float(np.median(total)) if n_sized else None,
            min_bytes_per_step=float(total.min()) if n_sized else None,
            max_bytes_per_step=float(total.max()) if n_sized else None,
            count_per_step=float(np.median(count)),
            message_bytes=float(total.sum()) / n_sized if n_sized else None,
            share_of_rank_steps=float(np.count_nonzero(count)) / count.size,
            sized_share=n_sized / n_intervals,
        )
    return out


def _status(expected: float | None, measured: _Measured | None) -> CollectiveStatus:
    if measured is None:
        return "plan_only"
    if expected is None:
        return "records_only"
    if measured.bytes_per_step is None:
        return "no_sizes"
    if measured.sized_share < 1.0:
        return "partial_sizes"
    if expected <= 0:
        return "match" if measured.bytes_per_step == 0 else "differs"
    return "match" if abs(measured.bytes_per_step / expected - 1.0) <= MATCH_TOLERANCE else "differs"


def _axis_order(axis: str) -> int:
    names = [a.value for a in AXES]
    return names.index(axis) if axis in names else len(names)


def compare_collectives(table: RecordTable, plan: Plan) -> tuple[CollectiveComparison, ...]:
    """Per pipeline stage and (axis, op): the plan's bytes per GPU per step beside the records' (docs/cost-table.md).

    Args:
        table: the records (``Breakdown.table``).
        plan: the plan of the same job.

    Returns:
        One entry per (stage, axis, op) in the plan or the records, ordered by stage, axis (dp, tp, pp, cp, ep), op.
    """
    expected: dict[tuple[int, str, str], tuple[float, int]] = {}
    for stage in plan.stages:
        for c in stage.collectives:
            key = (stage.pp_rank, c.axis, plan_op_name(c.op.value))
            total, count = expected.get(key, (0.0, 0))
            expected[key] = (total + float(c.message_bytes) * c.count_per_step, count + c.count_per_step)
    measured = _measured(stage_traffic(table, stage_of_rows(table)))
    keys = sorted(set(expected) | set(measured), key=lambda k: (k[0], _axis_order(k[1]), k[2]))
    out = []
    for key in keys:
        e_bytes, e_count = expected.get(key, (None, None))
        m = measured.get(key)
        out.append(
            CollectiveComparison(
                pp_rank=key[0],
                axis=key[1],
                op=key[2],
                expected_bytes_per_step=e_bytes,
                measured_bytes_per_step=None if m is None else m.bytes_per_step,
                measured_min_bytes_per_step=None if m is None else m.min_bytes_per_step,
                measured_max_bytes_per_step=None if m is None else m.max_bytes_per_step,
                expected_count_per_step=e_count,
                measured_count_per_step=None if m is None else m.count_per_step,
                expected_message_bytes=e_bytes / e_count if e_bytes is not None and e_count else None,
                measured_message_bytes=None if m is None else m.message_bytes,
                share_of_rank_steps=None if m is None else m.share_of_rank_steps,
                sized_share=None if m is None else m.sized_share,
                status=_status(e_bytes, m),
            )
        )
    return tuple(out)

"""Chrome trace-event JSON of step records, for Perfetto UI and ``chrome://tracing``; shared timeline helpers.

The HTML report (:mod:`meshscope.reports.pages`) shows a bounded picture of a job; the trace is where a performance
engineer goes next, to zoom into one rank's step. Both draw the same things, so both use the helpers here: the
aligned clock, the **sync-wait part** of every collective (from a member's arrival to its last member's arrival,
read from the breakdown's :class:`~meshscope.analysis.breakdown.CollectiveJoin`), and the choice of representative
steps.

Trace layout (Chrome's "Trace Event Format"): one process per node, one thread per rank (``rank N (dp=.. tp=..
pp=..)``), a complete event (``"ph": "X"``, ``ts``/``dur`` in µs) per step and per interval, with the sync-wait part
of each collective as a child event and a flow arrow from the late rank to every member that waited for it (at most
:data:`MAX_FLOWS_PER_COLLECTIVE` per collective). Times are on the aligned clock, in µs since the earliest step start
in the trace (``otherData.origin_us`` holds that origin on the reference clock). Chrome's format needs the complete
events of one thread to nest; intervals that overlap without nesting (a gradient all-reduce under the backward pass)
go onto extra threads of the same rank, named ``rank N (...) lane 2`` and sorted right under it. Process and thread
ids start at 1: Perfetto treats pid/tid 0 as the kernel's swapper.

This module draws; it must not analyse (every number comes from the records and the breakdown) and must not read
record files.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from meshscope.analysis import CATEGORIES, TICKS_PER_US
from meshscope.records import KINDS, OPS, PHASES, IntervalKind
from meshscope.topology import AXES

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable

    from numpy.typing import NDArray

    from meshscope.analysis import Breakdown
    from meshscope.records import RecordTable

TRACE_ALL_STEPS_MAX_INTERVALS = 500_000
"""A trace holds every step up to this many intervals, else only the steps the report shows (:func:`trace_steps`)."""
MAX_FLOWS_PER_COLLECTIVE = 16
"""Flow arrows drawn per collective instance (to the members that waited longest): bounds the trace of big groups."""
_LANE_TID_STRIDE = 1 << 24
"""Thread id of a rank's extra lane k: ``rank + 1 + k * stride`` (above any rank)."""
_P2P_CODE = KINDS.index(IntervalKind.P2P)
_COMM_CODE = KINDS.index(IntervalKind.COMM)


# ====================================================================== shared timeline helpers


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncWaits:
    """The sync-wait part of every collective member that waited: arrival until the last member's arrival.

    One entry per comm interval with a wait (complete instances only; the last member itself has none). Times are
    on the aligned (reference) clock, like :attr:`meshscope.analysis.breakdown.CollectiveJoin.last_arrival_us`.
    """

    interval: NDArray[np.intp]
    """Index of the waiting member's comm interval in ``table.intervals``."""
    start_us: NDArray[np.int64]
    """The member's arrival, aligned clock, µs."""
    end_us: NDArray[np.int64]
    """The last member's arrival, or the member's own end if it finished first (misaligned clocks), aligned, µs."""
    instance: NDArray[np.int64]
    """Row in ``breakdown.collectives``."""
    late_rank: NDArray[np.int64]
    """The rank that arrived last."""
    late_interval: NDArray[np.int64]
    """Index of the late rank's comm interval in ``table.intervals``."""

    def __len__(self) -> int:
        """Number of waiting members."""
        return int(self.interval.shape[0])

    def take(self, mask: NDArray[np.bool_]) -> SyncWaits:
        """The entries where ``mask`` is true."""
        return SyncWaits(
            interval=self.interval[mask],
            start_us=self.start_us[mask],
            end_us=self.end_us[mask],
            instance=self.instance[mask],
            late_rank=self.late_rank[mask],
            late_interval=self.late_interval[mask],
        )


def check_breakdown(table: RecordTable, bd: Breakdown) -> None:
    """Refuse a breakdown computed from another table (its rows would not line up).

    Raises:
        ValueError: naming both sizes.
    """
    if bd.table is not table and (bd.table.n_rows != table.n_rows or bd.table.n_intervals != table.n_intervals):
        raise ValueError(
            f"the breakdown covers {bd.table.n_rows} rank-steps and {bd.table.n_intervals} intervals but the table "
            f"has {table.n_rows} and {table.n_intervals}; pass the breakdown of this table"
        )


def row_offsets_us(table: RecordTable, bd: Breakdown) -> NDArray[np.int64]:
    """Clock offset of every rank-step row: ``aligned time = host time - offset``, µs."""
    offsets: NDArray[np.int64] = bd.clock.offset_us[table.steps.node]
    return offsets


def sync_waits(table: RecordTable, bd: Breakdown) -> SyncWaits:
    """The sync-wait part of every collective member (see :class:`SyncWaits`).

    The split matches the breakdown's: a member waits from its arrival until the last member's arrival (aligned
    clocks), clipped to its own end; incomplete instances have no wait (nobody knows who was last).
    """
    check_breakdown(table, bd)
    iv, join = table.intervals, bd.collectives
    idx = table.collective_order
    if idx.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return SyncWaits(
            interval=np.zeros(0, dtype=np.intp),
            start_us=empty,
            end_us=empty,
            instance=empty,
            late_rank=empty,
            late_interval=empty,
        )
    g, q = iv.group[idx], iv.seq[idx]
    new = np.ones(idx.size, dtype=bool)
    new[1:] = (g[1:] != g[:-1]) | (q[1:] != q[:-1])
    inst = np.cumsum(new) - 1
    if int(inst[-1]) + 1 != len(join):
        raise ValueError(f"the table has {int(inst[-1]) + 1} collective instances but the breakdown {len(join)}")
    rows = iv.row[idx].astype(np.int64)
    offset = bd.clock.offset_us[table.steps.node[rows]]
    arrival = iv.start_us[idx] - offset
    end = iv.end_us[idx] - offset
    wait_end = np.minimum(join.last_arrival_us[inst], end)
    late_interval = np.full(len(join), -1, dtype=np.int64)
    is_late = rows == join.last_row[inst]
    late_interval[inst[is_late]] = idx[is_late]
    waits = join.complete[inst] & (wait_end > arrival)
    return SyncWaits(
        interval=idx[waits],
        start_us=arrival[waits],
        end_us=wait_end[waits],
        instance=inst[waits].astype(np.int64),
        late_rank=join.last_rank[inst[waits]],
        late_interval=late_interval[inst[waits]],
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTimes:
    """Every step's duration: the longest rank-step of that step (a synchronous step lasts as long as its slowest)."""

    step: NDArray[np.int64]
    """Step numbers, ascending."""
    longest_us: NDArray[np.int64]
    """Longest rank-step of each step, µs."""

    def representative(self) -> tuple[int, ...]:
        """The slowest step, then a median step (the lower median among the others); one step if there is one."""
        if self.step.size == 0:
            return ()
        slowest = int(np.argmax(self.longest_us))
        others = np.delete(np.arange(self.step.size), slowest)
        if others.size == 0:
            return (int(self.step[slowest]),)
        by_time = others[np.argsort(self.longest_us[others], kind="stable")]
        median = int(by_time[(by_time.size - 1) // 2])
        return int(self.step[slowest]), int(self.step[median])

    def us(self, step: int) -> int:
        """Duration of ``step``, µs.

        Raises:
            KeyError: for a step with no records.
        """
        hit = np.flatnonzero(self.step == step)
        if hit.size == 0:
            raise KeyError(f"step {step} has no records")
        return int(self.longest_us[hit[0]])


def step_times(table: RecordTable) -> StepTimes:
    """Duration of every step in ``table`` (see :class:`StepTimes`)."""
    s = table.steps
    if table.n_rows == 0:
        empty = np.zeros(0, dtype=np.int64)
        return StepTimes(step=empty, longest_us=empty)
    steps, inverse = np.unique(s.step, return_inverse=True)
    longest = np.zeros(steps.size, dtype=np.int64)
    np.maximum.at(longest, inverse, s.end_us - s.start_us)
    return StepTimes(step=steps.astype(np.int64), longest_us=longest)


def trace_steps(table: RecordTable) -> tuple[int, ...] | None:
    """The steps a trace of ``table`` holds: ``None`` (every step), or the slowest and a median step.

    Every step up to :data:`TRACE_ALL_STEPS_MAX_INTERVALS` intervals, else the two steps the report draws.
    """
    if table.n_intervals <= TRACE_ALL_STEPS_MAX_INTERVALS:
        return None
    return step_times(table).representative()


def degrees(table: RecordTable) -> dict[str, int]:
    """Each axis' degree as seen in the records (largest index + 1)."""
    c = table.steps.coord
    if table.n_rows == 0:
        return {a.value: 1 for a in AXES}
    return {a.value: int(c[:, k].max()) + 1 for k, a in enumerate(AXES)}


def coord_text(coord: Iterable[int], degree: dict[str, int], *, sep: str = " ") -> str:
    """``dp=1 tp=0 pp=1`` (dp, tp and pp always, cp and ep when used)."""
    parts = [
        f"{a.value}={int(i)}" for a, i in zip(AXES, coord, strict=True) if a.value in "dp tp pp" or degree[a.value] > 1
    ]
    return sep.join(parts)


def interval_name(kind: int, phase: int, axis: int, op: int, peer: int) -> str:
    """A short label for an interval: ``backward``, ``dp all_reduce``, ``pp recv from 11``, ``data wait``."""
    k = KINDS[kind]
    if k is IntervalKind.COMPUTE:
        return PHASES[phase].value if phase >= 0 else "compute"
    if k is IntervalKind.DATA:
        return "data wait"
    if k in (IntervalKind.COMM, IntervalKind.P2P):
        name = f"{AXES[axis].value} {OPS[op].value}"
        if k is IntervalKind.P2P and peer >= 0:
            name += f" {'to' if OPS[op].value == 'send' else 'from'} {peer}"
        return name
    return k.value


# ====================================================================== the trace


def build_trace(
    table: RecordTable,
    bd: Breakdown,
    *,
    steps: Collection[int] | None = None,
    ranks: Collection[int] | None = None,
) -> dict[str, Any]:
    """The Chrome trace-event object for the selected steps and ranks (see the module docstring).

    Args:
        table: the records.
        bd: their breakdown (its clock offsets and collective join).
        steps: step numbers to include; ``None`` for all. Bounds the trace of a long run.
        ranks: ranks to include; ``None`` for all. Bounds the trace of a big job.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``, ready for :func:`json.dump`.

    Raises:
        ValueError: if ``bd`` is not the breakdown of ``table``.
    """
    check_breakdown(table, bd)
    s, iv = table.steps, table.intervals
    selected = np.ones(table.n_rows, dtype=bool)
    if steps is not None:
        selected &= np.isin(s.step, np.fromiter(steps, dtype=np.int64))
    if ranks is not None:
        selected &= np.isin(s.rank, np.fromiter(ranks, dtype=np.int64))
    rows = np.flatnonzero(selected)
    offset = row_offsets_us(table, bd)
    aligned_start = s.start_us - offset
    origin = int(aligned_start[rows].min()) if rows.size else 0
    degree = degrees(table)

    slices: dict[int, list[_Slice]] = defaultdict(list)
    rank_of_row = s.rank.tolist()
    for r in rows.tolist():
        slices[rank_of_row[r]].append(_step_slice(table, bd, r, int(offset[r]) + origin))
    by_interval = _interval_slices(table, selected, offset, origin, slices)
    waits = sync_waits(table, bd)
    waits = waits.take(selected[iv.row[waits.interval]])
    flows = _wait_slices(table, waits, origin, by_interval, slices)

    events: list[dict[str, Any]] = []
    meta: list[dict[str, Any]] = []
    where: dict[int, tuple[int, int]] = {}  # id(slice) -> (pid, tid), for flows
    rank_rows = {rank_of_row[r]: r for r in rows.tolist()}
    for rank in sorted(slices):
        r = rank_rows[rank]
        pid = int(s.node[r]) + 1
        label = f"rank {rank} ({coord_text(s.coord[r].tolist(), degree)})"
        lanes = _assign_lanes(slices[rank])
        for lane in range(max(lanes.values(), default=0) + 1):
            tid = rank + 1 + lane * _LANE_TID_STRIDE
            name = label if lane == 0 else f"{label} lane {lane + 1}"
            meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            meta.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": pid,
                    "tid": tid,
                    "args": {"sort_index": rank * 64 + lane},
                }
            )
        for sl in sorted(slices[rank], key=_Slice.order):
            tid = rank + 1 + lanes[id(sl)] * _LANE_TID_STRIDE
            where[id(sl)] = (pid, tid)
            events.append(
                {
                    "name": sl.name,
                    "cat": sl.cat,
                    "ph": "X",
                    "ts": sl.start,
                    "dur": sl.end - sl.start,
                    "pid": pid,
                    "tid": tid,
                    "args": sl.args,
                }
            )
    first_tid: dict[int, int] = {}  # process metadata goes on a rank's thread: Perfetto makes a thread of any tid
    for rank in sorted(slices, reverse=True):
        first_tid[int(s.node[rank_rows[rank]])] = rank + 1
    for code, tid in sorted(first_tid.items()):
        name = table.node_name(code)
        meta.append({"ph": "M", "name": "process_name", "pid": code + 1, "tid": tid, "args": {"name": name}})
        meta.append(
            {"ph": "M", "name": "process_sort_index", "pid": code + 1, "tid": tid, "args": {"sort_index": code}}
        )
    events.extend(_flow_events(flows, where))
    trace_steps = sorted(set(s.step[rows].tolist()))
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "meshscope",
            "job": table.job,
            "clock": ("host clocks aligned on collective completions; ts = µs since origin_us on the reference clock"),
            "origin_us": origin,
            "steps": trace_steps,
            "ranks_in_trace": len(slices),
            "ranks_in_records": int(np.unique(s.rank).size),
        },
    }


def write_trace(
    path: str | Path,
    table: RecordTable,
    bd: Breakdown,
    *,
    steps: Collection[int] | None = None,
    ranks: Collection[int] | None = None,
) -> Path:
    """Write :func:`build_trace`'s object as compact JSON to ``path``; return the path.

    Raises:
        ValueError: if ``bd`` is not the breakdown of ``table``.
        OSError: if the file cannot be written.
    """
    out = Path(path)
    trace = build_trace(table, bd, steps=steps, ranks=ranks)
    with out.open("w", encoding="utf-8") as f:
        json.dump(trace, f, separators=(",", ":"), ensure_ascii=False)
    return out


# ====================================================================== building blocks


@dataclass(slots=True, eq=False)
class _Slice:
    """One complete event before it is placed on a lane."""

    start: int
    end: int
    name: str
    cat: str
    args: dict[str, Any]
    parent: _Slice | None = None
    """A slice that must hold this one on its own lane (the collective of a sync-wait part)."""
    depth: int = 0
    """Tie-break at equal bounds: lower depth is the outer slice."""

    def order(self) -> tuple[int, int, int]:
        """Sort key: by start, longer first, outer first."""
        return self.start, -self.end, self.depth


def _step_slice(table: RecordTable, bd: Breakdown, row: int, shift: int) -> _Slice:
    s = table.steps
    args: dict[str, Any] = {"step": int(s.step[row]), "step_us": int(s.end_us[row] - s.start_us[row])}
    # the loop's own number (per-epoch counts) where the SDK renumbered; the training thread's time waiting for a
    # CPU, and on one
    for name in (
        "user_step",
        "runqueue_wait_us",
        "on_cpu_us",
        "compute_runqueue_wait_us",
        "data_runqueue_wait_us",
        "optimizer_runqueue_wait_us",
    ):
        value = int(getattr(s, name)[row])
        if value >= 0:
            args[name] = value
    for k, category in enumerate(CATEGORIES):
        ticks = int(bd.ticks[row, k])
        if ticks:
            args[f"{category}_us"] = round(ticks / TICKS_PER_US, 1)
    for k, axis in enumerate(AXES):
        caused = float(bd.wait_caused_us[row, k])
        if caused > 0:
            args[f"wait_caused.{axis.value}_us"] = round(caused, 1)
        paid = float(bd.wait_paid_us[row, k])
        if paid != caused:
            args[f"wait_paid.{axis.value}_us"] = round(paid, 1)
        host = float(bd.wait_host_us[row, k])
        if host > 0:
            args[f"wait_host.{axis.value}_us"] = round(host, 1)
        before = float(bd.wait_before_us[row, k])
        if before > 0:
            args[f"wait_before.{axis.value}_us"] = round(before, 1)
    return _Slice(
        start=int(s.start_us[row]) - shift,
        end=int(s.end_us[row]) - shift,
        name=f"step {int(s.step[row])}" + (f" (loop step {args['user_step']})" if "user_step" in args else ""),
        cat="step",
        args=args,
    )


def _interval_slices(
    table: RecordTable,
    selected: NDArray[np.bool_],
    offset: NDArray[np.int64],
    origin: int,
    slices: dict[int, list[_Slice]],
) -> dict[int, _Slice]:
    """Append one slice per interval of the selected rows (clipped to its step); return them by interval index."""
    s, iv = table.steps, table.intervals
    idx = np.flatnonzero(selected[iv.row])
    row = iv.row[idx]
    shift = offset[row] + origin
    lo, hi = s.start_us[row] - shift, s.end_us[row] - shift
    start = np.clip(iv.start_us[idx] - shift, lo, hi)
    end = np.clip(iv.end_us[idx] - shift, lo, hi)
    clipped = (start != iv.start_us[idx] - shift) | (end != iv.end_us[idx] - shift)
    out: dict[int, _Slice] = {}
    cols = zip(
        idx.tolist(),
        s.rank[row].tolist(),
        start.tolist(),
        end.tolist(),
        clipped.tolist(),
        iv.kind[idx].tolist(),
        iv.phase[idx].tolist(),
        iv.axis[idx].tolist(),
        iv.op[idx].tolist(),
        iv.group[idx].tolist(),
        iv.seq[idx].tolist(),
        iv.size_bytes[idx].tolist(),
        iv.group_size[idx].tolist(),
        iv.peer[idx].tolist(),
        strict=True,
    )
    for i, rank, a, b, clip, kind, phase, axis, op, group, seq, size, gsize, peer in cols:
        args: dict[str, Any] = {}
        if kind >= _COMM_CODE:
            args["axis"] = AXES[axis].value
            args["op"] = OPS[op].value
            if size >= 0:
                args["bytes"] = size
            if group >= 0:
                args["group"] = table.group_name(group)
            if seq >= 0:
                args["seq"] = seq
            if gsize >= 0:
                args["group_size"] = gsize
            if peer >= 0:
                args["peer"] = peer
            cat = f"{KINDS[kind].value}.{AXES[axis].value}"
        else:
            cat = KINDS[kind].value
            if phase >= 0:
                args["phase"] = PHASES[phase].value
        if clip:
            args["clipped_to_step"] = True
        sl = _Slice(start=a, end=b, name=interval_name(kind, phase, axis, op, peer), cat=cat, args=args, depth=1)
        slices[rank].append(sl)
        out[i] = sl
    return out


@dataclass(frozen=True, slots=True)
class _Flow:
    wait: _Slice
    late: _Slice
    late_rank: int


def _wait_slices(
    table: RecordTable,
    waits: SyncWaits,
    origin: int,
    by_interval: dict[int, _Slice],
    slices: dict[int, list[_Slice]],
) -> list[_Flow]:
    """Append a child slice for every sync-wait part; return the flows to draw (late rank in the trace)."""
    iv = table.intervals
    flows: list[_Flow] = []
    per_instance: dict[int, int] = defaultdict(int)
    # Longest waits first within each instance, so the flow cap keeps the ones that matter.
    order = np.lexsort((-(waits.end_us - waits.start_us), waits.instance))
    cols = zip(
        waits.interval[order].tolist(),
        waits.start_us[order].tolist(),
        waits.end_us[order].tolist(),
        waits.instance[order].tolist(),
        waits.late_rank[order].tolist(),
        waits.late_interval[order].tolist(),
        strict=True,
    )
    for i, a, b, inst, late_rank, late_i in cols:
        parent = by_interval[i]
        start = max(a - origin, parent.start)
        end = min(b - origin, parent.end)
        if end <= start:  # the wait lies outside the step the interval was clipped to
            continue
        rank = int(table.steps.rank[iv.row[i]])
        axis = AXES[int(iv.axis[i])].value
        sl = _Slice(
            start=start,
            end=end,
            name=f"sync wait for rank {late_rank}",
            cat=f"sync_wait.{axis}",
            args={
                "axis": axis,
                "op": OPS[int(iv.op[i])].value,
                "group": table.group_name(int(iv.group[i])),
                "seq": int(iv.seq[i]),
                "late_rank": late_rank,
                "wait_us": end - start,
            },
            parent=parent,
            depth=2,
        )
        slices[rank].append(sl)
        late = by_interval.get(late_i)
        if late is not None and late.end > late.start and per_instance[inst] < MAX_FLOWS_PER_COLLECTIVE:
            per_instance[inst] += 1
            flows.append(_Flow(wait=sl, late=late, late_rank=late_rank))
    return flows


def _assign_lanes(slices: list[_Slice]) -> dict[int, int]:
    """Place slices on lanes so that the slices of each lane nest (Chrome's rule for complete events of a thread).

    Greedy in start order: a slice goes onto the first lane whose open slices all contain it; a sync-wait part goes
    onto its collective's lane. Returns ``id(slice) -> lane``.
    """
    lane: dict[int, int] = {}
    stacks: list[list[int]] = []  # per lane: end times of the open slices, innermost last
    for sl in sorted(slices, key=_Slice.order):
        candidates = range(len(stacks))
        if sl.parent is not None and id(sl.parent) in lane:
            home = lane[id(sl.parent)]
            candidates = range(home, home + 1)
        placed = False
        for k in candidates:
            stack = stacks[k]
            while stack and stack[-1] <= sl.start and not (stack[-1] == sl.start == sl.end):
                stack.pop()
            if not stack or sl.end <= stack[-1]:
                stack.append(sl.end)
                lane[id(sl)] = k
                placed = True
                break
        if not placed:
            stacks.append([sl.end])
            lane[id(sl)] = len(stacks) - 1
    return lane


def _flow_events(flows: list[_Flow], where: dict[int, tuple[int, int]]) -> list[dict[str, Any]]:
    """A flow arrow per (late rank -> waiting member): from the late arrival into the end of the member's wait."""
    events: list[dict[str, Any]] = []
    for n, flow in enumerate(flows, start=1):
        (src_pid, src_tid), (dst_pid, dst_tid) = where[id(flow.late)], where[id(flow.wait)]
        name = f"rank {flow.late_rank} arrives"
        events.append(
            {
                "ph": "s",
                "id": n,
                "name": name,
                "cat": "sync_wait",
                "ts": flow.late.start,
                "pid": src_pid,
                "tid": src_tid,
            }
        )
        events.append(
            {
                "ph": "f",
                "bp": "e",
                "id": n,
                "name": name,
                "cat": "sync_wait",
                "ts": max(flow.wait.start, flow.wait.end - 1),
                "pid": dst_pid,
                "tid": dst_tid,
            }
        )
    return events

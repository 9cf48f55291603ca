"""The step breakdown: every rank's every step split into categories that add up exactly to the step time.

This is the heart of meshscope (DESIGN.md, "The step breakdown"). For each rank-step of a
:class:`~meshscope.records.RecordTable` it computes compute, exposed communication per axis (transfer and sync wait
apart), pipeline bubble, data wait, optimizer, checkpoint and other; it joins every collective across its members by
(group, seq) to find who arrived last and how much waiting that caused; and it aligns the host clocks first, on the
completions of collectives.

How the time is split (per elementary segment of a rank's step, where the set of running intervals is constant):

1. **compute** if any compute interval runs (the union of compute intervals);
2. else, if communication runs, the segment is shared **equally between the channels that run**: one channel per
   axis for collectives (plus p2p of axes other than pp), and one channel for pipeline p2p. A collective channel's
   share is **transfer** if any of its collectives is past its last member's arrival, else **sync wait**; the p2p
   channel's share is transfer during the last ``bytes / bandwidth`` of a p2p interval (without a bandwidth: from
   when both its ends were posted, measured against the other end's record), else **bubble**;
3. else **optimizer**, then **checkpoint**, then **data** (this precedence settles overlaps between them);
4. else **other**.

So communication beats the optimizer, checkpoint and data brackets: DESIGN.md defines exposed comm as "a collective
runs while no compute runs", and a collective a rank is blocked in is an axis cost whatever phase it sits in.
Amounts are kept as integers in ticks of 1/60 µs (:data:`TICKS_PER_US`): 60 is divisible by every channel count
(1–6), so equal shares are exact and the categories sum to the step time exactly.

The engine is vectorised, a sweep line in the manner of HTA's ``merge_kernel_intervals`` over all rank-steps at
once: every rank-step gets its own stretch of one global time axis; one sort of all piece boundaries (grouped by
piece kind) and a running count find where each kind's union starts and stops; one sort of those transitions and an
XOR-accumulate give the state of every elementary segment; segment lengths are summed per (rank-step, state) and
weighted per category. Loops run over kinds, axes and row chunks, never over intervals.

It must not read files (that is :mod:`meshscope.records`), must not build the cost table or findings (later
modules), and must never return a number it could not compute: partial data (missing members, clipped intervals,
unknown bandwidth) is counted in :attr:`Breakdown.notes`.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cache
from typing import Any, TypeAlias

import numpy as np
from numpy.typing import ArrayLike, NDArray

from meshscope.analysis.chains import host_delay_us, own_shares, paying_rows, received_from_rows, waited_for_rows
from meshscope.errors import ParseCode, ParseError
from meshscope.progress import NO_PROGRESS, Progress
from meshscope.records import (
    COMM_CODE,
    KIND_CODE,
    OP_CODE,
    P2P_CODE,
    SYMMETRIC_OPS,
    Note,
    RecordTable,
    lexsort_keys,
)
from meshscope.topology import AXES, Link, MeshAxis

# ====================================================================== categories (shared with the cost table)

TICKS_PER_US = 60
"""Internal unit: 1/60 µs, so that idle time shared by 1–6 channels splits into whole ticks."""

COMPUTE = "compute"
BUBBLE = "bubble"
DATA = "data"
OPTIMIZER = "optimizer"
CHECKPOINT = "checkpoint"
OTHER = "other"
TRANSFER = "transfer"
SYNC_WAIT = "sync_wait"


def comm_category(axis: MeshAxis | str, part: str) -> str:
    """Name of an exposed-communication category, e.g. ``comm.tp.sync_wait``.

    Args:
        axis: mesh axis.
        part: :data:`TRANSFER` or :data:`SYNC_WAIT`.
    """
    if part not in {TRANSFER, SYNC_WAIT}:
        raise ValueError(f"part = {part!r}; expected {TRANSFER!r} or {SYNC_WAIT!r}")
    return f"comm.{MeshAxis(axis).value}.{part}"


CATEGORIES: tuple[str, ...] = (
    COMPUTE,
    *(comm_category(a, p) for a in AXES for p in (TRANSFER, SYNC_WAIT)),
    BUBBLE,
    DATA,
    OPTIMIZER,
    CHECKPOINT,
    OTHER,
)
"""Every category, in print order; column order of :attr:`Breakdown.ticks`."""
CATEGORY_INDEX: dict[str, int] = {c: i for i, c in enumerate(CATEGORIES)}

# Sweep "subkinds": what an interval piece contributes to the state of a segment (one bit each).
_SK_COMPUTE, _SK_OPTIMIZER, _SK_CHECKPOINT, _SK_DATA = 0, 1, 2, 3
_SK_WAIT = 4  # + axis code: collective piece before the last member arrived
_SK_XFER = 9  # + axis code: collective piece after it (and p2p of axes other than pp)
_SK_BUBBLE = 14  # pp p2p piece before its transfer
_SK_P2P_XFER = 15  # pp p2p piece during its transfer
_N_SK = 16
_PP = AXES.index(MeshAxis.PP)
_CHUNK_BINS = 1 << 22
"""Largest (rank-steps x distinct states) block aggregated at once: bounds the memory of the aggregation."""

P2PBandwidth: TypeAlias = (
    float
    | Mapping[str, float]
    | Callable[[NDArray[np.int64], NDArray[np.int64]], ArrayLike]
    | NDArray[np.floating[Any]]
    | None
)
"""How fast pipeline activations move, bytes/s: one number; a per-interval array aligned with the interval table;
a mapping ``{"nvlink": .., "network": ..}`` chosen per interval by whether the rank and its peer share an NVLink
domain; or a callable ``(ranks, peers) -> bytes/s``. ``None`` counts all exposed p2p time as bubble (with a note)."""


@cache
def _weights() -> NDArray[np.int64]:
    """Ticks per µs each category gets from a segment in each of the 2**16 possible states (rows sum to 60)."""
    state = np.arange(1 << _N_SK, dtype=np.int64)

    def bit(k: int) -> NDArray[np.int64]:
        return (state >> k) & 1

    w = np.zeros((state.size, len(CATEGORIES)), dtype=np.int64)
    computing = bit(_SK_COMPUTE)
    idle = 1 - computing
    channels = [bit(_SK_WAIT + a) | bit(_SK_XFER + a) for a in range(len(AXES))]
    p2p = bit(_SK_BUBBLE) | bit(_SK_P2P_XFER)
    n_channels = sum(channels, p2p)
    share = idle * np.where(n_channels > 0, TICKS_PER_US // np.maximum(n_channels, 1), 0)
    w[:, CATEGORY_INDEX[COMPUTE]] = TICKS_PER_US * computing
    for a, axis in enumerate(AXES):
        moving = bit(_SK_XFER + a)
        w[:, CATEGORY_INDEX[comm_category(axis, TRANSFER)]] += share * channels[a] * moving
        w[:, CATEGORY_INDEX[comm_category(axis, SYNC_WAIT)]] += share * channels[a] * (1 - moving)
    moving = bit(_SK_P2P_XFER)
    w[:, CATEGORY_INDEX[comm_category(MeshAxis.PP, TRANSFER)]] += share * p2p * moving
    w[:, CATEGORY_INDEX[BUBBLE]] += share * p2p * (1 - moving)
    rest = TICKS_PER_US * idle * (n_channels == 0)
    opt, ckpt, data = bit(_SK_OPTIMIZER), bit(_SK_CHECKPOINT), bit(_SK_DATA)
    w[:, CATEGORY_INDEX[OPTIMIZER]] = rest * opt
    w[:, CATEGORY_INDEX[CHECKPOINT]] = rest * (1 - opt) * ckpt
    w[:, CATEGORY_INDEX[DATA]] = rest * (1 - opt) * (1 - ckpt) * data
    w[:, CATEGORY_INDEX[OTHER]] = rest * (1 - opt) * (1 - ckpt) * (1 - data)
    w.setflags(write=False)
    return w


# ====================================================================== results


@dataclass(frozen=True, slots=True, kw_only=True)
class ClockOffsets:
    """Per-node clock offsets estimated from collective completions: ``reference time = local time - offset_us``."""

    offset_us: NDArray[np.int64]
    """Offset of each node's clock (indexed by node code) from its reference node's clock, µs."""
    reference: NDArray[np.int64]
    """The node each offset is relative to: the lowest-coded node of its connected component (nodes that share no
    collective with each other cannot be aligned, and need not be: no collective joins them)."""
    samples: NDArray[np.int64]
    """Collective completions behind the edge that placed each node (0 for reference nodes)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveJoin:
    """One row per collective instance (group, seq): who arrived when, who was last, what waiting it caused."""

    group: NDArray[np.int32]
    """Group code (``RecordTable.group_name``)."""
    seq: NDArray[np.int64]
    axis: NDArray[np.int8]
    """Axis code (index into :data:`meshscope.topology.layout.AXES`)."""
    op: NDArray[np.int8]
    """Op code (index into :data:`meshscope.records.OPS`)."""
    members: NDArray[np.int64]
    """Members seen."""
    expected_members: NDArray[np.int64]
    """The group's size: ``group_size`` when records give it, else the most members seen in any of its instances."""
    complete: NDArray[np.bool_]
    """All expected members seen; only complete instances are split into sync wait and transfer."""
    first_arrival_us: NDArray[np.int64]
    """Earliest arrival, on the reference clock (after alignment)."""
    last_arrival_us: NDArray[np.int64]
    """Latest arrival, on the reference clock: when the transfer could start."""
    last_rank: NDArray[np.int64]
    """The rank that arrived last (lowest such rank on a tie); -1 for incomplete instances."""
    last_row: NDArray[np.int64]
    """Its rank-step row in the table; -1 for incomplete instances."""
    n_last: NDArray[np.int64]
    """How many members share the last arrival time (the wait caused is split between them)."""
    wait_caused_us: NDArray[np.float64]
    """Exposed sync wait of all members in this instance: what the late member(s) cost the group, µs."""
    paying_rank: NDArray[np.int64]
    """The rank charged with the wait: the last arrival, or the rank at the end of the chain of waits that made it
    late (:mod:`meshscope.analysis.chains`); -1 for incomplete instances and where the lateness came from before the
    records (``Breakdown.wait_before_us``)."""
    paying_row: NDArray[np.int64]
    """Its rank-step row; -1 for incomplete instances."""

    def __len__(self) -> int:
        """Number of collective instances."""
        return int(self.group.shape[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class Breakdown:
    """The breakdown of every rank-step of a table, aligned with ``table.steps``."""

    table: RecordTable
    """The input."""
    ticks: NDArray[np.int64]
    """Shape ``(rows, len(CATEGORIES))``, in ticks of 1/60 µs; every row sums to exactly 60 × the step time."""
    wait_caused_us: NDArray[np.float64]
    """Shape ``(rows, 5)``, axes in :data:`meshscope.topology.layout.AXES` order: sync wait this rank-step caused other
    members of its collectives by arriving last, µs."""
    wait_paid_us: NDArray[np.float64]
    """Shape ``(rows, 5)``: the sync wait this rank-step is charged with, µs: what it caused by arriving last, unless
    it arrived last because it waited (then the rank-step it waited for pays, :mod:`meshscope.analysis.chains`),
    plus what was passed on to it, less the host's share (:attr:`wait_host_us`). The cost table, the findings and the
    report charge this."""
    wait_host_us: NDArray[np.float64]
    """Shape ``(rows, 5)``: of the sync wait this rank-step would pay, the host's share, µs: on a run timed on the host
    (no GPU, every record with ``runqueue_wait_us``), the part of its lateness that the scheduler made by keeping its
    thread off a CPU longer than its peers' rate (:func:`meshscope.analysis.chains.own_shares`); 0 elsewhere.
    ``wait_paid_us + wait_host_us + wait_before_us`` sums to ``wait_caused_us`` over the table."""
    wait_before_us: NDArray[np.float64]
    """Shape ``(rows, 5)``: sync wait this rank-step caused by arriving last because it started its step late, where
    what made it start late is not in the records (its step before is not in them: the warm-up step ``meshscope
    run`` leaves out, the start of a window of a longer run), µs. No rank-step pays it
    (:func:`meshscope.analysis.chains.paying_rows`)."""
    collectives: CollectiveJoin
    """Per collective instance."""
    clock: ClockOffsets
    """Clock offsets applied before the join."""
    notes: tuple[Note, ...] = ()
    """Partial data and adjustments (clipped intervals, incomplete collectives, ...), counted."""

    @property
    def step_us(self) -> NDArray[np.int64]:
        """Step time of each rank-step, µs."""
        return self.table.steps.end_us - self.table.steps.start_us

    def us(self, category: str) -> NDArray[np.float64]:
        """One category for every rank-step, µs.

        Raises:
            KeyError: for a name not in :data:`CATEGORIES`.
        """
        return self.ticks[:, CATEGORY_INDEX[category]] / TICKS_PER_US

    def seconds(self, category: str) -> NDArray[np.float64]:
        """One category for every rank-step, seconds."""
        return self.us(category) / 1e6

    @property
    def gpu_util(self) -> NDArray[np.float64]:
        """Reported GPU utilisation (0–1, NaN if not measured): a spinning NCCL kernel reads as busy."""
        return self.table.steps.gpu_util

    @property
    def compute_share(self) -> NDArray[np.float64]:
        """Useful compute / step time (NaN for zero-length steps): the number to read beside :attr:`gpu_util`."""
        total = self.step_us.astype(np.float64) * TICKS_PER_US
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(total > 0, self.ticks[:, CATEGORY_INDEX[COMPUTE]] / total, np.nan)

    def to_rows(self) -> list[dict[str, Any]]:
        """One dict per rank-step, for small inputs, tests and debugging.

        Keys: rank, step, node, step_us, every category in µs, ``wait_caused.<axis>``, ``wait_paid.<axis>``,
        ``wait_host.<axis>`` and ``wait_before.<axis>`` in µs, gpu_util and compute_share.
        """
        t, s = self.table, self.table.steps
        share, util, step_us = self.compute_share, self.gpu_util, self.step_us
        rows: list[dict[str, Any]] = []
        for i in range(t.n_rows):
            row: dict[str, Any] = {
                "rank": int(s.rank[i]),
                "step": int(s.step[i]),
                "node": t.node_name(int(s.node[i])),
                "step_us": int(step_us[i]),
            }
            row.update({c: float(self.ticks[i, k]) / TICKS_PER_US for k, c in enumerate(CATEGORIES)})
            row.update({f"wait_caused.{a.value}": float(self.wait_caused_us[i, k]) for k, a in enumerate(AXES)})
            row.update({f"wait_paid.{a.value}": float(self.wait_paid_us[i, k]) for k, a in enumerate(AXES)})
            row.update({f"wait_host.{a.value}": float(self.wait_host_us[i, k]) for k, a in enumerate(AXES)})
            row.update({f"wait_before.{a.value}": float(self.wait_before_us[i, k]) for k, a in enumerate(AXES)})
            row["gpu_util"] = None if math.isnan(util[i]) else float(util[i])
            row["compute_share"] = None if math.isnan(share[i]) else float(share[i])
            rows.append(row)
        return rows


# ====================================================================== collective instances


@dataclass(frozen=True, slots=True)
class _Instances:
    """Comm intervals sorted by (group, seq, rank) and cut into instances."""

    idx: NDArray[np.intp]
    """Comm interval indices, sorted."""
    inst: NDArray[np.intp]
    """Instance number of each sorted element."""
    starts: NDArray[np.intp]
    """First sorted element of each instance."""
    members: NDArray[np.int64]
    """Members of each instance."""


def _instances(table: RecordTable) -> _Instances:
    iv = table.intervals
    idx = table.collective_order  # comm intervals sorted by (group, seq, rank), from validation
    g, q = iv.group[idx], iv.seq[idx]
    new = np.ones(idx.size, dtype=bool)
    new[1:] = (g[1:] != g[:-1]) | (q[1:] != q[:-1])
    starts = np.flatnonzero(new)
    inst = np.cumsum(new) - 1
    members = np.diff(np.append(starts, idx.size)).astype(np.int64)
    return _Instances(idx=idx, inst=inst, starts=starts, members=members)


def estimate_clock_offsets(table: RecordTable) -> ClockOffsets:
    """Estimate each node's clock offset from the completions of symmetric collectives.

    Members of an all-reduce, all-gather, reduce-scatter, all-to-all or barrier finish within microseconds of each
    other, so the difference of two members' end times is the difference of their hosts' clocks. For every pair of
    nodes the **median** over all such samples is taken (robust to the odd late kernel); then, per connected group of
    nodes, offsets are chained from the lowest-coded node along a maximum spanning tree that prefers the edges with
    the most samples (Prim's algorithm over the node graph).

    Returns:
        One offset per node code; nodes never in a collective with another node get offset 0.
    """
    n_nodes = len(table.node_names) if table.node_names else int(table.steps.node.max(initial=-1)) + 1
    return _estimate_offsets(table, _instances(table), n_nodes)


def _estimate_offsets(table: RecordTable, ins: _Instances, n_nodes: int) -> ClockOffsets:
    iv = table.intervals
    offset = np.zeros(n_nodes, dtype=np.int64)
    reference = np.arange(n_nodes, dtype=np.int64)
    samples = np.zeros(n_nodes, dtype=np.int64)
    if ins.idx.size == 0 or n_nodes < 2:
        return ClockOffsets(offset_us=offset, reference=reference, samples=samples)
    node = table.steps.node[iv.row[ins.idx]].astype(np.int64)
    end = iv.end_us[ins.idx]
    symmetric = np.isin(iv.op[ins.idx], [OP_CODE[o] for o in SYMMETRIC_OPS])
    ref = ins.starts[ins.inst]  # the lowest rank of each instance is the reference member
    use = symmetric & (node != node[ref])
    a = np.minimum(node[ref], node)[use]
    b = np.maximum(node[ref], node)[use]
    d = (end - end[ref])[use]
    diff = np.where(node[use] == b, d, -d)  # off_b - off_a
    key = a * n_nodes + b
    order = lexsort_keys(key, diff)
    key, diff = key[order], diff[order]
    if key.size == 0:
        return ClockOffsets(offset_us=offset, reference=reference, samples=samples)
    first = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    count = np.diff(np.append(first, key.size))
    median = diff[first + (count - 1) // 2]
    adjacency: dict[int, list[tuple[int, int, int]]] = {}
    for k, m, c in zip((key[first]).tolist(), median.tolist(), count.tolist(), strict=True):
        u, v = divmod(k, n_nodes)
        adjacency.setdefault(u, []).append((c, v, m))
        adjacency.setdefault(v, []).append((c, u, -m))
    placed = np.zeros(n_nodes, dtype=bool)
    for root in sorted(adjacency):
        if placed[root]:
            continue
        placed[root] = True
        heap = [(-c, v, root, m) for c, v, m in adjacency[root]]
        heapq.heapify(heap)
        while heap:
            neg_count, v, u, m = heapq.heappop(heap)
            if placed[v]:
                continue
            placed[v] = True
            offset[v] = offset[u] + m
            reference[v] = root
            samples[v] = -neg_count
            for c, w, m2 in adjacency[v]:
                if not placed[w]:
                    heapq.heappush(heap, (-c, w, v, m2))
    return ClockOffsets(offset_us=offset, reference=reference, samples=samples)


def _clock(table: RecordTable, ins: _Instances, n_nodes: int, *, align: bool, notes: list[Note]) -> ClockOffsets:
    if not align:
        zeros = np.zeros(n_nodes, dtype=np.int64)
        return ClockOffsets(offset_us=zeros, reference=np.arange(n_nodes, dtype=np.int64), samples=zeros)
    clock = _estimate_offsets(table, ins, n_nodes)
    moved = clock.offset_us != 0
    if moved.any():
        notes.append(
            Note(
                code="clock_offsets",
                count=int(np.count_nonzero(moved)),
                message=(
                    f"{int(np.count_nonzero(moved))} nodes' clocks were offset (up to "
                    f"{int(np.abs(clock.offset_us).max())} µs) and aligned on collective completions"
                ),
            )
        )
    return clock


@dataclass(frozen=True, slots=True)
class _Joined:
    join: CollectiveJoin
    last_local_us: NDArray[np.int64]
    """Per sorted comm element: the last arrival on this member's own clock (its arrival if incomplete)."""
    is_charged: NDArray[np.bool_]
    """Per sorted comm element: a last member of a complete instance."""


def _join(table: RecordTable, ins: _Instances, clock: ClockOffsets, notes: list[Note]) -> _Joined:
    iv = table.intervals
    rows = iv.row[ins.idx].astype(np.int64)
    node_offset = clock.offset_us[table.steps.node[rows]]
    arrival_local = iv.start_us[ins.idx]
    arrival = arrival_local - node_offset
    n_inst = ins.starts.size
    if n_inst == 0:
        empty_i = np.zeros(0, dtype=np.int64)
        join = CollectiveJoin(
            group=np.zeros(0, dtype=np.int32),
            seq=empty_i,
            axis=np.zeros(0, dtype=np.int8),
            op=np.zeros(0, dtype=np.int8),
            members=empty_i,
            expected_members=empty_i,
            complete=np.zeros(0, dtype=bool),
            first_arrival_us=empty_i,
            last_arrival_us=empty_i,
            last_rank=empty_i,
            last_row=empty_i,
            paying_rank=empty_i,
            paying_row=empty_i,
            n_last=empty_i,
            wait_caused_us=np.zeros(0, dtype=np.float64),
        )
        return _Joined(join=join, last_local_us=empty_i, is_charged=np.zeros(0, dtype=bool))
    last = np.maximum.reduceat(arrival, ins.starts)
    first = np.minimum.reduceat(arrival, ins.starts)
    is_last = arrival == last[ins.inst]
    n_last = np.bincount(ins.inst, weights=is_last, minlength=n_inst).astype(np.int64)
    # Elements are sorted by rank inside an instance, so the first "last" element is the lowest such rank.
    last_pos = np.full(n_inst, -1, dtype=np.int64)
    hits = np.flatnonzero(is_last)
    first_hit = np.ones(hits.size, dtype=bool)
    first_hit[1:] = ins.inst[hits[1:]] != ins.inst[hits[:-1]]
    last_pos[ins.inst[hits[first_hit]]] = hits[first_hit]
    group = iv.group[ins.idx[ins.starts]]
    # A group's size is its group_size where any member gives one, else the most members any of its instances had.
    group_first = np.flatnonzero(np.concatenate(([True], group[1:] != group[:-1])))
    per_group = np.diff(np.append(group_first, n_inst))
    elem_first = ins.starts[group_first]
    given = np.repeat(np.maximum.reduceat(iv.group_size[ins.idx].astype(np.int64), elem_first), per_group)
    inferred = np.repeat(np.maximum.reduceat(ins.members, group_first), per_group)
    expected = np.where(given > 0, given, inferred)
    complete = ins.members >= expected
    last_local = np.where(complete[ins.inst], last[ins.inst] + node_offset, arrival_local)
    is_charged = is_last & complete[ins.inst]
    last_row = np.where(complete, rows[last_pos], -1)
    join = CollectiveJoin(
        group=group,
        seq=iv.seq[ins.idx[ins.starts]],
        axis=iv.axis[ins.idx[ins.starts]],
        op=iv.op[ins.idx[ins.starts]],
        members=ins.members,
        expected_members=expected,
        complete=complete,
        first_arrival_us=first,
        last_arrival_us=last,
        last_rank=np.where(complete, table.steps.rank[rows[last_pos]], -1),
        last_row=last_row,
        paying_rank=np.where(complete, table.steps.rank[rows[last_pos]], -1),
        paying_row=last_row,
        n_last=n_last,
        wait_caused_us=np.zeros(n_inst, dtype=np.float64),  # filled once the sweep knows what was exposed
    )
    _join_notes(table, join=join, given=given, group_first=group_first, last_local=last_local, ins=ins, notes=notes)
    return _Joined(join=join, last_local_us=last_local, is_charged=is_charged)


def _join_notes(
    table: RecordTable,
    *,
    join: CollectiveJoin,
    given: NDArray[np.int64],
    group_first: NDArray[np.intp],
    last_local: NDArray[np.int64],
    ins: _Instances,
    notes: list[Note],
) -> None:
    incomplete = int(np.count_nonzero(~join.complete))
    if incomplete:
        k = int(np.flatnonzero(~join.complete)[0])
        notes.append(
            Note(
                code="incomplete_collectives",
                count=incomplete,
                message=(
                    f"{incomplete} of {len(join)} collective instances miss members (e.g. group "
                    f"{table.group_name(int(join.group[k]))!r} seq {int(join.seq[k])}: {int(join.members[k])} of "
                    f"{int(join.expected_members[k])}); their exposed time is counted as transfer, with no sync wait "
                    f"split and no one charged"
                ),
            )
        )
    inferred_groups = int(np.count_nonzero(given[group_first] <= 0))
    if inferred_groups:
        single = int(np.count_nonzero((given[group_first] <= 0) & (join.expected_members[group_first] == 1)))
        notes.append(
            Note(
                code="inferred_group_size",
                count=inferred_groups,
                message=(
                    f"{inferred_groups} groups carry no group_size; their size is the most members seen in one "
                    f"instance ({single} of them were only ever seen with one member, so no wait could be measured)"
                ),
            )
        )
    end = table.intervals.end_us[ins.idx]
    early = last_local > end
    if early.any():
        worst = int((last_local - end)[early].max())
        notes.append(
            Note(
                code="finished_before_last_arrival",
                count=int(np.count_nonzero(early)),
                message=(
                    f"{int(np.count_nonzero(early))} members finished a collective before its last member arrived "
                    f"(by up to {worst} µs after clock alignment): clocks misaligned or arrivals mis-recorded; "
                    f"their whole exposed time is counted as sync wait"
                ),
            )
        )


# ====================================================================== pipeline p2p


def _p2p_transfer_us(
    table: RecordTable,
    idx: NDArray[np.intp],
    bandwidth: P2PBandwidth,
    notes: list[Note],
    *,
    clock: ClockOffsets | None = None,
) -> NDArray[np.int64]:
    """Transfer time of each pp p2p interval in ``idx``: bytes / bandwidth, rounded to whole µs.

    Without a bandwidth, measured where both ends are recorded (:func:`_p2p_measured_us`); the rest counts as bubble,
    noted.
    """
    iv = table.intervals
    size = iv.size_bytes[idx]
    if idx.size == 0:
        return np.zeros(0, dtype=np.int64)
    if bandwidth is None:
        return _p2p_unrated(table, idx, clock, notes)
    rank = table.steps.rank[iv.row[idx]]
    peer = iv.peer[idx]
    bw: NDArray[np.float64]
    if isinstance(bandwidth, int | float):
        bw = np.full(idx.size, float(bandwidth))
    elif isinstance(bandwidth, Mapping):
        bw = _bandwidth_by_link(table, idx, bandwidth, notes)
    elif callable(bandwidth):
        bw = np.asarray(bandwidth(rank, peer), dtype=np.float64)
        if bw.shape != (idx.size,):
            raise ParseError(
                f"p2p bandwidth callable returned shape {bw.shape}; expected ({idx.size},), one per p2p",
                code=ParseCode.BAD_SHAPE,
            )
    else:
        full = np.asarray(bandwidth, dtype=np.float64)
        if full.shape != (table.n_intervals,):
            raise ParseError(
                f"p2p bandwidth array has shape {full.shape}; expected ({table.n_intervals},), one value per interval",
                code=ParseCode.BAD_SHAPE,
            )
        bw = full[idx]
    bad = np.flatnonzero(~np.isfinite(bw) | (bw <= 0))
    if bad.size:
        raise ParseError(
            f"p2p bandwidth = {float(bw[bad[0]])} bytes/s for {table.where_interval(int(idx[bad[0]]))}; it must be a "
            f"positive number",
            code=ParseCode.VALUE_OUT_OF_RANGE,
        )
    missing = size < 0
    if missing.any():
        notes.append(
            Note(
                code="p2p_without_bytes",
                count=int(np.count_nonzero(missing)),
                message=(
                    f"{int(np.count_nonzero(missing))} pipeline p2p intervals carry no bytes: their exposed time is "
                    f"all counted as bubble"
                ),
            )
        )
    return np.where(missing, 0, np.rint(np.maximum(size, 0) / bw * 1e6)).astype(np.int64)


def _p2p_unrated(
    table: RecordTable, idx: NDArray[np.intp], clock: ClockOffsets | None, notes: list[Note]
) -> NDArray[np.int64]:
    """Transfers without a link rate: measured where both ends are recorded, else none (noted)."""
    if clock is None:
        measured, paired = np.zeros(idx.size, dtype=np.int64), np.zeros(idx.size, dtype=np.bool_)
    else:
        measured, paired = _p2p_measured_us(table, idx, clock)
    alone = int(np.count_nonzero(~paired))
    if alone:
        notes.append(
            Note(
                code="p2p_without_bandwidth",
                count=alone,
                message=(
                    f"{alone} pipeline p2p intervals whose other end is not in the records, and no p2p bandwidth "
                    "given: their exposed time is all counted as bubble (a spec gives the link rate that splits "
                    "off the transfer: --spec FILE, or a script that describes its job; in the API, "
                    "p2p_bandwidth_bytes_per_s)"
                ),
            )
        )
    return measured


def _p2p_measured_us(
    table: RecordTable, idx: NDArray[np.intp], clock: ClockOffsets
) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
    """Each pp p2p interval's transfer as measured against its other end, and whether that end is in the records.

    The k-th send from rank A to rank B in a step is received by B's k-th receive from A in that step. Bytes can move
    only once both are posted: an end's transfer is from the later of the two posts to its own completion (on clocks
    aligned across nodes), at most its own length; before that it waits for the other stage (bubble). A send's
    transfer ends no later than its receive's completion: the bytes have arrived, and a send waited on later (the
    interleaved 1F1B schedule waits its sends' handles at the end of the step) was no transfer after that; its idle
    time there was the receives' it was waiting in (bubble: 45 ms of a clean interleaved run's step read as pp
    transfer, the bubble 0). An end that completed before the other was posted (a send handed off eagerly) is
    transfer whole. Where no spec gives the link rate, this splits what a rate would; before, the whole exposed time
    was bubble and the pp rows were partial data.
    """
    iv, st = table.intervals, table.steps
    rows = iv.row[idx]
    offset = clock.offset_us[st.node[rows]]
    start = iv.start_us[idx] - offset
    end = iv.end_us[idx] - offset
    rank, peer = st.rank[rows].astype(np.int64), iv.peer[idx].astype(np.int64)
    sends = iv.op[idx] == OP_CODE["send"]
    src, dst = np.where(sends, rank, peer), np.where(sends, peer, rank)
    step = st.step[rows].astype(np.int64)
    # each end's place among the ends of its kind (send or receive) of one (src, dst, step), in time order
    order = np.lexsort((start, sends, step, dst, src))
    key = np.stack((src[order], dst[order], step[order], sends[order].astype(np.int64)))
    first = np.concatenate(([True], (key[:, 1:] != key[:, :-1]).any(axis=0)))
    run_start = np.maximum.accumulate(np.where(first, np.arange(order.size), 0))
    place = np.empty(idx.size, dtype=np.int64)
    place[order] = np.arange(order.size) - run_start
    # pair a receive with the send of the same (src, dst, step, place)
    order = np.lexsort((sends, place, step, dst, src))
    k = np.stack((src[order], dst[order], step[order], place[order]))
    same = (k[:, 1:] == k[:, :-1]).all(axis=0) & (sends[order][1:] != sends[order][:-1]) & (peer[order][1:] >= 0)
    a, b = order[:-1][same], order[1:][same]
    paired = np.zeros(idx.size, dtype=np.bool_)
    paired[a] = paired[b] = True
    measured = np.zeros(idx.size, dtype=np.int64)
    for mine, other in ((a, b), (b, a)):
        # a send moves bytes until its receive has them at the latest
        done = np.where(sends[mine], np.minimum(end[mine], np.maximum(end[other], start[mine])), end[mine])
        # an end that completed before the other was posted (a send handed off eagerly) waited for no one
        began = np.where(start[other] < done, np.maximum(start[mine], start[other]), start[mine])
        measured[mine] = np.clip(done - began, 0, end[mine] - start[mine])
    return measured, paired


def _bandwidth_by_link(
    table: RecordTable, idx: NDArray[np.intp], bandwidth: Mapping[str, float], notes: list[Note]
) -> NDArray[np.float64]:
    wanted = {Link.NVLINK.value, Link.NETWORK.value}
    if not wanted <= set(bandwidth):
        raise ParseError(
            f"p2p bandwidth mapping has keys {sorted(bandwidth)}; it needs {sorted(wanted)} (bytes/s per link)",
            code=ParseCode.MISSING_FIELD,
        )
    s = table.steps
    peer = table.intervals.peer[idx]
    size = int(max(int(s.rank.max(initial=0)), int(peer.max(initial=0)))) + 1
    domain_of_rank = np.full(size, -1, dtype=np.int64)
    domain_of_rank[s.rank] = s.nvlink_domain
    mine = s.nvlink_domain[table.intervals.row[idx]].astype(np.int64)
    theirs = domain_of_rank[peer]
    unknown = (mine < 0) | (theirs < 0)
    if unknown.any():
        notes.append(
            Note(
                code="p2p_link_unknown",
                count=int(np.count_nonzero(unknown)),
                message=(
                    f"{int(np.count_nonzero(unknown))} pipeline p2p intervals have no NVLink domain for the rank or "
                    f"its peer: network bandwidth assumed"
                ),
            )
        )
    nvlink = ~unknown & (mine == theirs)
    return np.where(nvlink, float(bandwidth[Link.NVLINK.value]), float(bandwidth[Link.NETWORK.value]))


# ====================================================================== the sweep


def break_down(
    table: RecordTable,
    *,
    p2p_bandwidth_bytes_per_s: P2PBandwidth = None,
    align_clocks: bool = True,
    progress: Progress = NO_PROGRESS,
) -> Breakdown:
    """Split every rank-step of ``table`` into :data:`CATEGORIES` (see the module docstring for the rules).

    Args:
        table: the records.
        p2p_bandwidth_bytes_per_s: how fast pipeline activations move (see :data:`P2PBandwidth`); the last
            ``bytes / bandwidth`` of an exposed pp p2p interval is transfer, the rest is bubble. ``None``: each
            interval's transfer is measured from when both its ends were posted (:func:`_p2p_measured_us`); an
            interval whose other end is not in the records is bubble whole (noted).
        align_clocks: estimate per-node clock offsets from collective completions and apply them before the join
            (:func:`estimate_clock_offsets`). Turn off only for data from one host clock.
        progress: told of the phases "aligning clocks", "joining collectives" and "breaking down" (each runs
            vectorised: there is nothing to count while it runs).

    Returns:
        The breakdown, aligned with ``table.steps``.

    Raises:
        ParseError: if the bandwidth argument does not fit the table.
    """
    notes: list[Note] = []
    s = table.steps
    n = table.n_rows
    # Rank-step r occupies [base[r], base[r] + its step time] in sweep coordinates, one µs apart from the next, so
    # that pieces of different rank-steps never touch.
    base = np.concatenate(([0], np.cumsum(s.end_us - s.start_us + 1))).astype(np.int64)
    if int(base[-1]) >= _MAX_POSITION:
        raise ParseError(
            f"the steps add up to {int(base[-1])} µs, beyond what the sweep can index (2**57)",
            code=ParseCode.VALUE_OUT_OF_RANGE,
        )
    n_nodes = len(table.node_names) if table.node_names else int(s.node.max(initial=-1)) + 1
    ins = _instances(table)
    with progress.phase(f"aligning clocks of {n_nodes:,} nodes" if align_clocks else "reading clocks as they are"):
        clock = _clock(table, ins, n_nodes, align=align_clocks, notes=notes)
    with progress.phase(f"joining collectives ({ins.idx.size:,} entries)"):
        joined = _join(table, ins, clock, notes)
    with progress.phase(f"breaking down {n:,} rank-steps ({table.n_intervals:,} intervals)"):
        events, waits = _events(
            table, base=base, ins=ins, joined=joined, bandwidth=p2p_bandwidth_bytes_per_s, clock=clock, notes=notes
        )
        ticks, wait_attr = _sweep(events, base=base, n=n, waits=waits, n_comm=ins.idx.size)
    with progress.phase("following chains of waits"):
        pay, share = _paying(table, ins, joined, clock, ticks, wait_attr)
        last = joined.join.last_row
        paying_row = np.where(last >= 0, pay[np.maximum(last, 0)], -1) if n else last
        join = replace(
            joined.join,
            wait_caused_us=np.bincount(ins.inst, weights=wait_attr, minlength=len(joined.join)) / TICKS_PER_US,
            paying_row=paying_row,
            paying_rank=np.where(paying_row >= 0, s.rank[np.maximum(paying_row, 0)], -1) if n else last,
        )
        rows, axis, amount = _last_arrivals(table, ins, joined, wait_attr)
        payer = pay[rows]
        paid = payer >= 0  # -1: the lateness came from before the records, no rank-step there pays
        payer, paid_axis, paid_amount = payer[paid], axis[paid], amount[paid]
        wait_caused_us = _per_row_axis(n, rows, axis, amount)
        wait_paid_us = _per_row_axis(n, payer, paid_axis, paid_amount * share[payer])
        wait_host_us = _per_row_axis(n, payer, paid_axis, paid_amount * (1.0 - share[payer]))
        wait_before_us = _per_row_axis(n, rows[~paid], axis[~paid], amount[~paid])
    return Breakdown(
        table=table,
        ticks=ticks,
        wait_caused_us=wait_caused_us,
        wait_paid_us=wait_paid_us,
        wait_host_us=wait_host_us,
        wait_before_us=wait_before_us,
        collectives=join,
        clock=clock,
        notes=(*table.notes, *notes),
    )


_MAX_POSITION = 1 << 57
_POSITION_MASK = (1 << 58) - 1
_SK_SHIFT = 59


@dataclass(frozen=True, slots=True)
class _Waits:
    """The sync-wait pieces of one axis: which sorted comm elements, and where they lie in sweep coordinates."""

    axis: int
    element: NDArray[np.intp]
    lo: NDArray[np.int64]
    hi: NDArray[np.int64]


def _events(
    table: RecordTable,
    *,
    base: NDArray[np.int64],
    ins: _Instances,
    joined: _Joined,
    bandwidth: P2PBandwidth,
    clock: ClockOffsets,
    notes: list[Note],
) -> tuple[NDArray[np.int64], list[_Waits]]:
    """Cut every interval into pieces of one sweep subkind and pack their boundaries into one event array.

    Positions are global: rank-step ``r`` occupies ``[base[r], base[r + 1] - 1]``, so one sort sweeps all
    rank-steps at once. An event is ``subkind << 59 | position << 1 | is_end``: grouped by subkind, then by
    position, starts before ends at one position so that touching pieces of one subkind merge.
    """
    s, iv = table.steps, table.intervals
    gs, ge = _sweep_positions(table, base, notes)
    groups: list[tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64] | int]] = []
    # Compute, optimizer, checkpoint, data: one piece each.
    plain = (iv.kind < COMM_CODE) & (ge > gs)
    lut = np.zeros(COMM_CODE, dtype=np.int64)
    for name, sk in (("compute", _SK_COMPUTE), ("optimizer", _SK_OPTIMIZER), ("checkpoint", _SK_CHECKPOINT)):
        lut[KIND_CODE[name]] = sk
    lut[KIND_CODE["data"]] = _SK_DATA
    groups.append((gs[plain], ge[plain], lut[iv.kind[plain]]))
    del plain
    # Collectives: [arrival, last arrival) is sync wait, the rest transfer (both on the member's own clock).
    c = ins.idx
    c_axis = iv.axis[c].astype(np.int64)
    c_lo, c_hi = gs[c], ge[c]
    split = np.clip(joined.last_local_us + (base[:-1] - s.start_us)[iv.row[c]], c_lo, c_hi)
    groups.extend(_nonempty(c_lo, split, _SK_WAIT + c_axis))
    groups.extend(_nonempty(split, c_hi, _SK_XFER + c_axis))
    waits = []
    for a in np.unique(c_axis).tolist():
        element = np.flatnonzero((c_axis == a) & (split > c_lo))
        if element.size:
            waits.append(_Waits(axis=a, element=element, lo=c_lo[element], hi=split[element]))
    # P2p: pp -> bubble, then transfer during the last bytes/bandwidth before the real end; other axes -> transfer.
    p2p = iv.kind == P2P_CODE
    pp = np.flatnonzero(p2p & (iv.axis == _PP))
    transfer = _p2p_transfer_us(table, pp, bandwidth, notes, clock=clock)
    row_offset = (base[:-1] - s.start_us)[iv.row[pp]]
    p2p_split = np.clip(iv.end_us[pp] + row_offset - transfer, gs[pp], ge[pp])
    groups.extend(_nonempty(gs[pp], p2p_split, _SK_BUBBLE))
    groups.extend(_nonempty(p2p_split, ge[pp], _SK_P2P_XFER))
    other = np.flatnonzero(p2p & (iv.axis != _PP))
    groups.extend(_nonempty(gs[other], ge[other], _SK_XFER + iv.axis[other].astype(np.int64)))
    del gs, ge

    total = sum(lo.size for lo, _, _ in groups)
    events = np.empty(2 * total, dtype=np.int64)
    at = 0
    for lo, hi, subkind in groups:
        m = lo.size
        tag = np.left_shift(np.asarray(subkind, dtype=np.int64), _SK_SHIFT)
        for edge, is_end in ((lo, 0), (hi, 1)):
            out = events[at : at + m]
            np.left_shift(edge, 1, out=out)
            out |= tag
            if is_end:
                out |= 1
            at += m
    return events, waits


def _sweep_positions(
    table: RecordTable, base: NDArray[np.int64], notes: list[Note]
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Every interval's start and end in sweep coordinates, clipped to its step (on the rank's own clock)."""
    iv = table.intervals
    offset = (base[:-1] - table.steps.start_us)[iv.row]
    gs = iv.start_us + offset
    ge = iv.end_us + offset
    del offset
    row_lo, row_hi = base[:-1][iv.row], (base[1:] - 1)[iv.row]
    over = np.maximum(row_lo - gs, 0)
    over += np.maximum(ge - row_hi, 0)
    if over.any():
        worst = int(np.argmax(over))
        count = int(np.count_nonzero(over))
        notes.append(
            Note(
                code="clipped_intervals",
                count=count,
                message=(
                    f"{count} intervals stuck out of their step and were clipped to it (up to {int(over[worst])} µs, "
                    f"e.g. {table.where_interval(worst)})"
                ),
            )
        )
    del over
    np.clip(gs, row_lo, row_hi, out=gs)
    np.clip(ge, row_lo, row_hi, out=ge)
    return gs, ge


def _nonempty(
    lo: NDArray[np.int64], hi: NDArray[np.int64], subkind: NDArray[np.int64] | int
) -> list[tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64] | int]]:
    keep = hi > lo
    sk = subkind if isinstance(subkind, int) else subkind[keep]
    return [(lo[keep], hi[keep], sk)]


def _low_bits(keys: NDArray[np.int64], mask: int) -> NDArray[np.uint8]:
    """``keys & mask`` for a mask within the lowest byte, without an int64 temporary."""
    if sys.byteorder == "little":
        return keys.view(np.uint8)[::8] & np.uint8(mask)
    return (keys & mask).astype(np.uint8)  # pragma: no cover - big-endian hosts


def _high_byte(keys: NDArray[np.int64]) -> NDArray[np.uint8]:
    """The most significant byte of every key (a copy, without an int64 temporary)."""
    if sys.byteorder == "little":
        return keys.view(np.uint8)[7::8].copy()
    return (keys >> 56).astype(np.uint8)  # pragma: no cover - big-endian hosts


def _or_low_byte(keys: NDArray[np.int64], code: NDArray[np.uint8]) -> None:
    """``keys |= code`` for codes below 256, in place, without an int64 temporary."""
    if sys.byteorder == "little":
        low = keys.view(np.uint8)[::8]
        low |= code
    else:  # pragma: no cover - big-endian hosts
        keys |= code.astype(np.int64)


def _sweep(
    events: NDArray[np.int64], *, base: NDArray[np.int64], n: int, waits: list[_Waits], n_comm: int
) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Sweep all events at once; return per-row category ticks and each comm element's exposed sync wait (ticks).

    Per subkind, a running count over its events finds where its union starts and stops (the "transitions");
    sorted by position, the transitions toggle one state bit each, so an XOR-accumulate gives the state of every
    elementary segment. Each segment's length goes to the categories its state selects (:func:`_weights`).
    """
    w = _weights()
    ticks = np.zeros((n, len(CATEGORIES)), dtype=np.int64)
    wait_attr = np.zeros(n_comm, dtype=np.float64)
    if events.size:
        events.sort(kind="stable")  # runs of presorted pieces: numpy's timsort merges them ~1.3x faster
        delta = 1 - 2 * _low_bits(events, 1).astype(np.int8)
        running = np.cumsum(delta, dtype=np.int32)
        transition = np.where(delta > 0, running == 1, running == 0)
        del delta
        # Re-key the transitions position-first: position << 5 | subkind << 1 | is_end.
        keys = events[transition]
        del transition
        code = _high_byte(keys)  # subkind << 3
        code >>= 2
        code &= 0b11110  # subkind << 1
        code |= _low_bits(keys, 1)
        keys >>= 1
        keys &= _POSITION_MASK
        keys <<= 5
        _or_low_byte(keys, code)
        del code
        keys.sort(kind="stable")  # one presorted run per subkind: merged ~2.4x faster than a quicksort
        toggle = np.left_shift(np.uint16(1), (_low_bits(keys, 31) >> 1).astype(np.uint16))
        state = np.bitwise_xor.accumulate(toggle, out=toggle)
        keys >>= 5
        seg_pos, seg_len, seg_state = keys[:-1], np.diff(keys), state[:-1]
        ticks[:] = _aggregate(seg_pos, seg_len=seg_len, seg_state=seg_state, base=base, n=n, w=w)
        sk_bounds = np.searchsorted(events, np.arange(_N_SK + 1, dtype=np.int64) << _SK_SHIFT)
        for wait in waits:
            _attribute_waits(
                wait,
                events=events[sk_bounds[_SK_WAIT + wait.axis] : sk_bounds[_SK_WAIT + wait.axis + 1]],
                running=running[sk_bounds[_SK_WAIT + wait.axis] : sk_bounds[_SK_WAIT + wait.axis + 1]],
                segments=(seg_pos, seg_len, seg_state),
                w=w,
                out=wait_attr,
            )
    step_ticks = (np.diff(base) - 1) * TICKS_PER_US
    other = CATEGORY_INDEX[OTHER]
    ticks[:, other] = step_ticks - ticks.sum(axis=1) + ticks[:, other]
    return ticks, wait_attr


def _attribute_waits(
    wait: _Waits,
    *,
    events: NDArray[np.int64],
    running: NDArray[np.int32],
    segments: tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.uint16]],
    w: NDArray[np.int64],
    out: NDArray[np.float64],
) -> None:
    """Split the exposed sync wait of one axis between the collectives waiting in it, equally at every instant.

    ``events``/``running`` are the axis' wait-piece events (sorted) and the number of its pieces open after each.
    The exposed sync wait charged up to position x, F(x), is piecewise linear over the state segments; between two
    consecutive events the open pieces share F's increase equally; prefix sums over events give each piece's share.
    """
    seg_pos, seg_len, seg_state = segments
    on = np.flatnonzero(seg_state & np.uint16(1 << (_SK_WAIT + wait.axis)))
    if on.size == 0:  # every wait of this axis was hidden under compute
        out[wait.element] = 0.0
        return
    rate = w[seg_state[on], CATEGORY_INDEX[comm_category(AXES[wait.axis], SYNC_WAIT)]]
    start, length = seg_pos[on], seg_len[on]
    before = np.concatenate(([0], np.cumsum(length * rate)))[:-1]

    def charged_until(x: NDArray[np.int64]) -> NDArray[np.int64]:
        i = np.maximum(np.searchsorted(start, x, side="right") - 1, 0)
        charged: NDArray[np.int64] = before[i] + np.clip(x - start[i], 0, length[i]) * rate[i]
        return charged

    pos = (events >> 1) & _POSITION_MASK
    at_event = charged_until(pos)
    share = np.diff(at_event) / np.maximum(running[:-1], 1)
    prefix = np.concatenate(([0.0], np.cumsum(share)))
    # The pieces come in collective order, scattered over the sweep: looked up in position order (sorted needles
    # keep the binary searches in cache, ~4x faster on the 16,384-rank benchmark).
    order = np.argsort(wait.lo)
    hi, lo = np.searchsorted(pos, wait.hi[order]), np.searchsorted(pos, wait.lo[order])
    out[wait.element[order]] = prefix[hi] - prefix[lo]


def _aggregate(
    seg_pos: NDArray[np.int64],
    *,
    seg_len: NDArray[np.int64],
    seg_state: NDArray[np.uint16],
    base: NDArray[np.int64],
    n: int,
    w: NDArray[np.int64],
) -> NDArray[np.int64]:
    """Sum segment lengths per (rank-step, state), then weight by state: ticks per rank-step and category."""
    out = np.zeros((n, len(CATEGORIES)), dtype=np.int64)
    if seg_pos.size == 0:
        return out
    bounds = np.searchsorted(seg_pos, base, side="left")
    counts = np.diff(bounds)
    present = np.flatnonzero(np.bincount(seg_state, minlength=1 << _N_SK))
    lut = np.zeros(1 << _N_SK, dtype=np.int32)
    lut[present] = np.arange(present.size, dtype=np.int32)
    sid = lut[seg_state]
    n_sid = int(present.size)
    weights = w[present].astype(np.float64)
    # Chunks of ~2**20 segments keep the temporaries small enough to be recycled by the allocator.
    rows_per_chunk = max(1, min(_CHUNK_BINS // n_sid, (n << 20) // max(seg_pos.size, 1)))
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(n, r0 + rows_per_chunk)
        lo, hi = int(bounds[r0]), int(bounds[r1])
        if lo == hi:
            continue
        key = np.repeat(np.arange(0, (r1 - r0) * n_sid, n_sid, dtype=np.int64), counts[r0:r1])
        key += sid[lo:hi]
        agg = np.bincount(key, weights=seg_len[lo:hi], minlength=(r1 - r0) * n_sid)
        # Integer-valued float64 sums below 2**53 are exact, so rounding recovers the exact integers.
        out[r0:r1] = np.rint(agg.reshape(r1 - r0, n_sid) @ weights).astype(np.int64)
    return out


def _paying(  # noqa: PLR0917 - private, one caller
    table: RecordTable,
    ins: _Instances,
    joined: _Joined,
    clock: ClockOffsets,
    ticks: NDArray[np.int64],
    wait_attr: NDArray[np.float64],
) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Per rank-step, who pays for a wait it caused, and the share of its lateness its own work made (module chains).

    The payer is itself or the end of its chain of waits; the share is 1 unless the host's scheduler made some of it.
    """
    s = table.steps
    if table.n_rows == 0:
        return np.zeros(0, dtype=np.int64), np.ones(0, dtype=np.float64)
    _, step_index = np.unique(s.step, return_inverse=True)
    step_index = step_index.reshape(-1)
    stage = np.maximum(s.coord[:, AXES.index("pp")].astype(np.int64), 0)
    _, peer_key = np.unique(step_index.astype(np.int64) * (int(stage.max()) + 1) + stage, return_inverse=True)
    us = ticks / float(TICKS_PER_US)
    member_rows = table.intervals.row[ins.idx].astype(np.int64)
    waited_for = waited_for_rows(
        member_rows,
        table.intervals.axis[ins.idx].astype(np.int64),
        wait_attr,
        joined.join.last_row[ins.inst] if ins.idx.size else np.zeros(0, dtype=np.int64),
        table.n_rows,
    )
    step_us = (s.end_us - s.start_us).astype(np.float64)
    bubble_us = us[:, CATEGORY_INDEX[BUBBLE]]
    sync_wait_us = np.column_stack([us[:, CATEGORY_INDEX[comm_category(a, SYNC_WAIT)]] for a in AXES])
    key = peer_key.reshape(-1).astype(np.int64)
    # The same rank's step before, where the records hold it (the step index one lower).
    order = np.lexsort((step_index, s.rank))
    previous = np.full(table.n_rows, -1, dtype=np.int64)
    follows = (s.rank[order][1:] == s.rank[order][:-1]) & (step_index[order][1:] == step_index[order][:-1] + 1)
    previous[order[1:][follows]] = order[:-1][follows]
    # The rank's own time between the steps: its time blocked in collectives there (waiting for a peer) is not.
    gap = s.gap_before_us.astype(np.float64)
    gap = np.where(gap >= 0, gap - np.minimum(np.clip(s.between_comm_us, 0, None), np.clip(gap, 0, None)), -1.0)
    pay = paying_rows(
        peer_key=key,
        step_us=step_us,
        bubble_us=bubble_us,
        sync_wait_us=sync_wait_us,
        waited_for=waited_for,
        received_from=received_from_rows(table, step_index),
        start_us=(s.start_us - clock.offset_us[s.node]).astype(np.float64),
        previous=previous,
        gap_before_us=gap,
    )
    if not table.host_timed_with_runqueue:
        return pay, np.ones(table.n_rows, dtype=np.float64)
    own_us = step_us - bubble_us - sync_wait_us.sum(axis=1)
    host_us = host_delay_us(peer_key=key, own_us=own_us, runqueue_us=s.runqueue_wait_us.astype(np.float64))
    return pay, own_shares(peer_key=key, own_us=own_us, host_us=host_us, gap_before_us=gap)


def _last_arrivals(
    table: RecordTable, ins: _Instances, joined: _Joined, wait_attr: NDArray[np.float64]
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64]]:
    """Each instance's total exposed sync wait, split over its last member(s): (row, axis, µs) per last member."""
    if ins.idx.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0, dtype=np.float64)
    per_inst = np.bincount(ins.inst, weights=wait_attr, minlength=ins.starts.size)
    charged = np.flatnonzero(joined.is_charged)
    inst = ins.inst[charged]
    amount = per_inst[inst] / joined.join.n_last[inst] / TICKS_PER_US
    rows = table.intervals.row[ins.idx[charged]].astype(np.int64)
    axis = table.intervals.axis[ins.idx[charged]].astype(np.int64)
    return rows, axis, amount.astype(np.float64, copy=False)


def _per_row_axis(
    n: int, rows: NDArray[np.int64], axis: NDArray[np.int64], amount: NDArray[np.float64]
) -> NDArray[np.float64]:
    """``amount`` summed per (row, axis): shape ``(n, len(AXES))``."""
    n_axes = len(AXES)
    summed = np.bincount(rows * n_axes + axis, weights=amount, minlength=n * n_axes).astype(np.float64, copy=False)
    return summed.reshape(n, n_axes)

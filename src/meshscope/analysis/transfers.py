"""Transfers measured against each other and against the link model: every collective and send, per byte.

Exists so that a slow link or NIC can be found from the records alone (:mod:`meshscope.analysis.diagnosis` reads it):
each complete collective instance and each pipeline or ring send of at least :data:`MIN_TRANSFER_BYTES` becomes one
transfer with its time, its bytes per member (the op's bus factor), the nodes and NVLink domains it runs through, its
class (axis, op, members, whether it crosses a domain) and how its time per byte compares with its class' median and,
with a spec, with the plan's link model. Definitions are in ``docs/cost-table.md``.

It works on numpy columns, vectorised over collective instances and sends. It must not read files, must not judge
(no findings: that is :mod:`meshscope.analysis.diagnosis`) and must not build the cost table
(:mod:`meshscope.analysis.costs`, which re-exports these names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from meshscope.analysis.breakdown import TRANSFER, comm_category
from meshscope.analysis.grouping import distinct, grouped_median
from meshscope.plan import PlanAssumptions
from meshscope.records import OPS, P2P_CODE, CommOp
from meshscope.topology import AXES, Link

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from meshscope.analysis.breakdown import Breakdown
    from meshscope.jobs import JobSpec
    from meshscope.plan import Plan
    from meshscope.records import RecordTable


class IndexedBreakdown(Protocol):
    """What the measurement reads of :class:`meshscope.analysis.costs.RankSteps` (which satisfies it)."""

    @property
    def breakdown(self) -> Breakdown:
        """The breakdown, with its table and collective join."""
        ...

    def us(self, category: str) -> NDArray[np.float64]:
        """One category for every rank-step, µs."""
        ...


MIN_TRANSFER_BYTES = 1 << 20
"""Transfers below this size are latency-bound and left out of per-byte comparisons."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfers:
    """Every measurable transfer of at least :data:`MIN_TRANSFER_BYTES`, with the nodes and domains it runs through.

    Complete collective instances count from the last member's arrival to the end (so never sync wait); pipeline and
    ring sends count whole (a send blocks its rank for the transfer). "Place" means the NVLink domain, or the node
    where the records carry no domain.
    """

    axis: NDArray[np.int64]
    op: NDArray[np.int64]
    """Op code (:data:`meshscope.records.OPS`)."""
    group: NDArray[np.int64]
    """Group or stream code, -1 if unknown."""
    members: NDArray[np.int64]
    """Ranks that wait for it (a send: its two ends)."""
    transfer_us: NDArray[np.float64]
    size_bytes: NDArray[np.float64]
    bus_bytes: NDArray[np.float64]
    """Bytes each member moves: ``size_bytes`` x the op's bus factor."""
    crosses: NDArray[np.bool_]
    """Whether it crosses an NVLink domain (its traffic goes over the network)."""
    exposed: NDArray[np.float64]
    """Fraction of it that is exposed: 1 for sends; for collectives the axis' exposed transfer (breakdown) ÷ the
    members' transfer time."""
    planned_us: NDArray[np.float64] | None
    """The plan's link model: bytes x bus factor ÷ (link bandwidth x link efficiency); ``None`` without a spec."""
    cls: NDArray[np.intp]
    """Its class: (axis, op, members, whether it crosses an NVLink domain)."""
    log_ratio: NDArray[np.float64]
    """log(time per bus byte ÷ its class' median)."""
    pair_transfer: NDArray[np.intp]
    """(transfer, node) pairs: the nodes each transfer runs through ..."""
    pair_node: NDArray[np.int64]
    """... and the node."""
    place_transfer: NDArray[np.intp]
    """(transfer, place) pairs: the places each transfer runs through ..."""
    place: NDArray[np.int64]
    """... and the place."""
    row_transfer: NDArray[np.intp]
    """(transfer, rank-step) pairs: the rank-steps each transfer delays (every member; both ends of a send) ..."""
    row: NDArray[np.int64]
    """... and the rank-step."""

    @property
    def n_nodes(self) -> int:
        """Node codes span ``0 .. n_nodes - 1``."""
        return int(self.pair_node.max()) + 1

    def count_by_node(self, mask: NDArray[np.bool_]) -> NDArray[np.int64]:
        """How many of the transfers in ``mask`` run through each node."""
        return np.bincount(self.pair_node[mask[self.pair_transfer]], minlength=self.n_nodes)


def place_of_rows(table: RecordTable) -> NDArray[np.int64]:
    """Per rank-step: its NVLink domain code, or (domain unknown) ``domains + node``, a place of its own per node."""
    s = table.steps
    domain = s.nvlink_domain.astype(np.int64)
    return np.where(domain >= 0, domain, int(domain.max(initial=-1)) + 1 + s.node.astype(np.int64))


_Part = dict[str, Any]


def _collective_part(rs: IndexedBreakdown, place_of_row: NDArray[np.int64]) -> _Part | None:
    bd = rs.breakdown
    table, join = bd.table, bd.collectives
    iv = table.intervals
    idx = table.collective_order
    if idx.size == 0:
        return None
    g, q = iv.group[idx], iv.seq[idx]
    new = np.ones(idx.size, dtype=bool)
    new[1:] = (g[1:] != g[:-1]) | (q[1:] != q[:-1])
    starts = np.flatnonzero(new)
    inst_of = np.cumsum(new) - 1
    rows = iv.row[idx].astype(np.int64)
    node = table.steps.node[rows].astype(np.int64)
    place = place_of_row[rows]
    inst_end = np.maximum.reduceat(iv.end_us[idx] - bd.clock.offset_us[node], starts)
    crosses = np.maximum.reduceat(place, starts) != np.minimum.reduceat(place, starts)
    size = iv.size_bytes[idx[starts]]
    transfer = (inst_end - join.last_arrival_us).astype(np.float64)
    keep = np.flatnonzero(join.complete & (size >= MIN_TRANSFER_BYTES) & (transfer > 0) & (join.members > 1))
    axis = join.axis[keep].astype(np.int64)
    members = join.members[keep].astype(np.int64)
    exposed = np.zeros(len(AXES))
    busy = np.bincount(axis, weights=transfer[keep] * members, minlength=len(AXES))
    for a, name in enumerate(AXES):
        if busy[a] > 0:
            exposed[a] = min(1.0, float(rs.us(comm_category(name, TRANSFER)).sum()) / busy[a])
    position = np.full(len(join), -1, dtype=np.int64)
    position[keep] = np.arange(keep.size)
    elem = position[inst_of]
    use = elem >= 0
    return {
        "axis": axis,
        "op": join.op[keep].astype(np.int64),
        "group": join.group[keep].astype(np.int64),
        "members": members,
        "transfer": transfer[keep],
        "size": size[keep].astype(np.int64),
        "crosses": crosses[keep],
        "exposed": exposed[axis],
        "at": elem[use],
        "node": node[use],
        "place": place[use],
        "row": rows[use],
    }


def _send_part(rs: IndexedBreakdown, place_of_row: NDArray[np.int64]) -> _Part | None:
    table = rs.breakdown.table
    iv, s = table.intervals, table.steps
    sends = np.flatnonzero(
        (iv.kind == P2P_CODE) & (iv.op == OPS.index(CommOp.SEND)) & (iv.size_bytes >= MIN_TRANSFER_BYTES)
    )
    if sends.size == 0:
        return None
    # The peer's rank-step: the row of the same step with the peer's rank.
    width = int(s.step.max()) + 1
    key = s.rank * width + s.step
    order = np.argsort(key)
    want = iv.peer[sends] * width + s.step[iv.row[sends]]
    peer_row = order[np.clip(np.searchsorted(key[order], want), 0, order.size - 1)]
    ok = (key[peer_row] == want) & (iv.end_us[sends] > iv.start_us[sends])
    sends, peer_row = sends[ok], peer_row[ok].astype(np.int64)
    rows = iv.row[sends].astype(np.int64)
    node = s.node.astype(np.int64)
    both = np.concatenate([rows, peer_row])
    return {
        "axis": iv.axis[sends].astype(np.int64),
        "op": np.full(sends.size, OPS.index(CommOp.SEND), dtype=np.int64),
        "group": iv.group[sends].astype(np.int64),
        "members": np.full(sends.size, 2, dtype=np.int64),
        "transfer": (iv.end_us[sends] - iv.start_us[sends]).astype(np.float64),
        "size": iv.size_bytes[sends].astype(np.int64),
        "crosses": place_of_row[rows] != place_of_row[peer_row],
        "exposed": np.ones(sends.size),
        "at": np.tile(np.arange(sends.size, dtype=np.int64), 2),
        "node": node[both],
        "place": place_of_row[both],
        "row": both,
    }


def bus_factor(op: NDArray[np.int64], members: NDArray[np.int64]) -> NDArray[np.float64]:
    """Bytes each member moves per message byte (nccl-tests): 2(n-1)/n all-reduce, 1 send, (n-1)/n otherwise."""
    n = members.astype(np.float64)
    factor = np.where(op == OPS.index(CommOp.ALL_REDUCE), 2 * (n - 1) / n, (n - 1) / n)
    return np.where(op == OPS.index(CommOp.SEND), 1.0, factor)


def _pairs(at: NDArray[np.int64], code: NDArray[np.int64]) -> tuple[NDArray[np.intp], NDArray[np.int64]]:
    """Distinct (transfer, code) pairs."""
    width = int(code.max()) + 1
    unique = distinct(at * width + code)
    return unique // width, unique % width


def measure_transfers(
    rs: IndexedBreakdown, *, spec: JobSpec | None = None, plan: Plan | None = None
) -> Transfers | None:
    """Every transfer of the records, its time per byte against its class and (with a spec) against the plan.

    Returns:
        The transfers; ``None`` when the records have none of at least :data:`MIN_TRANSFER_BYTES`.
    """
    place_of_row = place_of_rows(rs.breakdown.table)
    parts = [p for p in (_collective_part(rs, place_of_row), _send_part(rs, place_of_row)) if p is not None]
    parts = [p for p in parts if p["axis"].size]
    if not parts:
        return None
    offsets = np.cumsum([0] + [p["axis"].size for p in parts])
    col = {k: np.concatenate([p[k] for p in parts]) for k in parts[0] if k != "at"}
    at = np.concatenate([p["at"] + o for p, o in zip(parts, offsets, strict=False)])
    bus_bytes = col["size"] * bus_factor(col["op"], col["members"])
    per_byte = col["transfer"] / bus_bytes
    key = (col["axis"] * len(OPS) + col["op"]) * (int(col["members"].max()) + 1) + col["members"]
    _, cls = np.unique(key * 2 + col["crosses"], return_inverse=True)
    cls = cls.reshape(-1)
    median = grouped_median(cls, per_byte, int(cls.max()) + 1)[cls]
    planned = None
    if spec is not None:
        efficiency = (plan.assumptions if plan is not None else PlanAssumptions()).link_efficiency
        hw = spec.hardware
        rate = np.where(
            col["crosses"],
            hw.nic_bandwidth_bytes_per_s * efficiency(Link.NETWORK.value),
            hw.scaleup_bandwidth_bytes_per_s * efficiency(Link.NVLINK.value),
        )
        planned = bus_bytes / rate * 1e6
    pair_transfer, pair_node = _pairs(at, col["node"])
    place_transfer, place = _pairs(at, col["place"])
    return Transfers(
        axis=col["axis"],
        op=col["op"],
        group=col["group"],
        members=col["members"],
        transfer_us=col["transfer"],
        size_bytes=col["size"].astype(np.float64),
        bus_bytes=bus_bytes,
        crosses=col["crosses"].astype(bool),
        exposed=col["exposed"],
        planned_us=planned,
        cls=cls,
        log_ratio=np.log(per_byte / median),
        pair_transfer=pair_transfer,
        pair_node=pair_node,
        place_transfer=place_transfer,
        place=place,
        row_transfer=at,
        row=col["row"],
    )

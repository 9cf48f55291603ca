"""NCCL communicators as the log shows them, and the mesh axis each one maps to.

Exists because a COLL line names its communicator only by an address, and an address means something only inside
one process: this module keys communicators by ``(host, pid, comm)``, groups the members of one communicator across
processes by ``commId`` (split communicators, which print no commId, by their parent's group, the child's index and
its color), counts every call per communicator (the sequence; NCCL's ``opCount`` stays 0 on single-node
communicators since 2.27, NVIDIA/nccl PR #2021, so it cannot be one), and maps a communicator to an axis of a
:class:`~meshscope.topology.ParallelLayout` from its members' global ranks (:class:`AxisMapper`). It must not read
files or text (that is :mod:`~meshscope_sidecar.sources.nccl_lines`) and must not guess: an axis that the evidence
does not single out is ``unknown``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import numpy as np

from meshscope.topology import MeshAxis
from meshscope_sidecar.sources.nccl_lines import (
    DATATYPE_BYTES,
    Collective,
    CommShape,
    InitLine,
    InitTimings,
    MnnvlClique,
    MnnvlFabric,
    NcclEvent,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from numpy.typing import NDArray

    from meshscope.topology import ParallelLayout, Placement

ProcessKey = tuple[str, int]
"""``(host, pid)``: a process (a pid is unique only on its host)."""
CommKey = tuple[str, int, int]
"""``(host, pid, comm address)``: a communicator as one process sees it."""
GroupKey = tuple[object, ...]
"""What the members of one communicator share across processes: ``("id", commId)`` or ``("split", parent group,
child index, color)``."""

UNKNOWN: Final = "unknown"
"""The ``axis`` label of a communicator no single axis fits."""
DP_CP: Final = "dp-cp"
"""Megatron-core's ``DATA_PARALLEL_GROUP_WITH_CP`` (dense gradients), named as the planner names it."""
EDP: Final = "edp"
"""The expert-data-parallel group (routed-expert gradients), named as the planner names it."""
WORLD: Final = "world"
"""The default process group: every rank."""


@dataclass(slots=True)
class OpTotals:
    """Calls and message bytes of one op on one communicator (running totals)."""

    calls: int = 0
    """COLL lines counted."""
    message_bytes: int = 0
    """``count × sizeof(datatype)`` summed over calls of a known datatype."""
    unknown_datatype_calls: int = 0
    """Calls whose datatype the size table does not know (counted, bytes not added)."""


@dataclass(slots=True)
class Communicator:
    """One communicator in one process: what its Init lines said and what was called on it."""

    key: CommKey
    """``(host, pid, comm)``."""
    nranks: int
    """Ranks in the communicator."""
    rank: int | None = None
    """This process' rank in it; ``None`` when only COLL lines were seen (no Init line)."""
    comm_id: int | None = None
    """``commId`` of the Init lines (shared by every member); ``None`` before 2.17 and for most splits."""
    parent: CommKey | None = None
    """The parent communicator of a split one (same process)."""
    split_count: int | None = None
    """Which child of its parent it is (``childCount``/``splitCount``, or counted here when the line has none)."""
    color: int | None = None
    """Split color."""
    split_key: int | None = None
    """Split key."""
    cuda_dev: int | None = None
    """CUDA device from the Init line."""
    bus_id: int | None = None
    """PCI bus id of its GPU."""
    func: str | None = None
    """The init function (2.21.5+)."""
    complete: bool = False
    """Whether ``Init COMPLETE`` was seen."""
    n_nodes: int | None = None
    """Nodes it spans (comm shape line, 2.20.3+)."""
    local_ranks: int | None = None
    """Its members on this node (comm shape line)."""
    clique_id: int | None = None
    """MNNVL clique id of the communicator (clique line)."""
    init_s: float | None = None
    """Total init time, seconds (Init timings line)."""
    live: bool = True
    """``False`` once a new Init for the same address in the same process replaced it (destroyed and reused)."""
    sequence: int = 0
    """Calls counted on it so far: the sequence number of the latest call (1-based)."""
    last_op_count: int | None = None
    """NCCL's ``opCount`` of the latest call (kept for debugging, never used as the sequence)."""
    ops: dict[str, OpTotals] = field(default_factory=dict)
    """Totals by ``op`` label."""

    @property
    def process(self) -> ProcessKey:
        """``(host, pid)`` of the process."""
        return (self.key[0], self.key[1])


@dataclass(slots=True)
class RegistryStats:
    """What the registry could not place, counted."""

    communicators_dropped: int = 0
    """Communicators not kept because the cap was reached."""
    calls_dropped: int = 0
    """Calls on communicators that were not kept."""
    calls_without_init: int = 0
    """Calls on a communicator whose Init lines were not seen (log started late, or INIT not logged)."""
    timings_unmatched: int = 0
    """Init timings / clique lines with no communicator being initialised on their thread."""


class CommRegistry:
    """Every communicator the log showed, keyed by ``(host, pid, comm)``, grouped across processes; bounded."""

    def __init__(self, *, max_communicators: int = 4096) -> None:
        """Make an empty registry.

        Args:
            max_communicators: most communicators kept, live and replaced together (default 4096); Init lines and
                calls of communicators beyond it are counted in :attr:`stats` and dropped.
        """
        self.max_communicators = max_communicators
        self.stats = RegistryStats()
        self.version = 0
        """Bumped whenever membership, ranks or groups may have changed (not on calls): a cache key."""
        self._live: dict[CommKey, Communicator] = {}
        self._all: list[Communicator] = []
        self._dropped: set[CommKey] = set()
        self._children: dict[CommKey, int] = {}
        self._initialising: dict[tuple[str, int, int], Communicator] = {}  # (host, pid, tid) -> comm being set up
        self._domains: dict[ProcessKey, dict[int, tuple[str, int]]] = {}
        self._rank_hints: dict[ProcessKey, int] = {}

    # ------------------------------------------------------------------ reading events

    def apply(self, event: NcclEvent) -> int | None:  # noqa: C901, PLR0912 - one branch per event type
        """Take one event of :func:`~meshscope_sidecar.sources.nccl_lines.parse_line`.

        Returns:
            For a :class:`Collective`, its sequence number on its communicator (1-based; ``None`` when dropped);
            ``None`` for every other event.
        """
        if isinstance(event, Collective):
            return self.call(event)
        if isinstance(event, InitLine):
            self._init(event)
        elif isinstance(event, CommShape):
            comm = self._live.get((event.host, event.pid, event.comm))
            if comm is not None:
                comm.n_nodes, comm.local_ranks = event.n_nodes, event.local_ranks
                self.version += 1
        elif isinstance(event, InitTimings):
            comm = self._initialising.get((event.host, event.pid, event.tid))
            if comm is None or comm.rank != event.rank or comm.nranks != event.nranks:
                self.stats.timings_unmatched += 1
            else:
                comm.init_s = event.total_s
        elif isinstance(event, MnnvlClique):
            comm = self._initialising.get((event.host, event.pid, event.tid))
            if comm is None:
                self.stats.timings_unmatched += 1
            else:
                comm.clique_id = event.clique_id
        elif isinstance(event, MnnvlFabric):
            domain = event.nvlink_domain
            if domain is not None:
                per_gpu = self._domains.setdefault((event.host, event.pid), {})
                if len(per_gpu) < 64:  # a process drives at most a node's GPUs
                    per_gpu[event.bus_id] = domain
        return None

    def call(self, event: Collective) -> int | None:
        """Count one call (what :meth:`apply` does for a :class:`Collective`, without the dispatch).

        Returns:
            Its sequence number on its communicator (1-based); ``None`` when the communicator was not kept.
        """
        key = (event.host, event.pid, event.comm)
        comm = self._live.get(key)
        if comm is None:
            if key in self._dropped or not self._room(key):
                self.stats.calls_dropped += 1
                return None
            comm = self._add(Communicator(key=key, nranks=event.nranks))
            self.version += 1
        if comm.rank is None:
            self.stats.calls_without_init += 1
        if event.global_rank is not None and (event.host, event.pid) not in self._rank_hints:
            self._rank_hints[event.host, event.pid] = event.global_rank  # RCCL's globalrank suffix
            self.version += 1
        totals = comm.ops.get(event.op)
        if totals is None:
            totals = comm.ops[event.op] = OpTotals()
        totals.calls += 1
        size = DATATYPE_BYTES.get(event.datatype)
        if size is None:
            totals.unknown_datatype_calls += 1
        else:
            totals.message_bytes += event.element_count * size
        comm.sequence += 1
        comm.last_op_count = event.op_count
        return comm.sequence

    def _init(self, event: InitLine) -> None:
        key = (event.host, event.pid, event.comm)
        comm = self._live.get(key)
        # An Init for an address already in use in this process is a new communicator (the old one was destroyed
        # and its memory reused): a START after any Init or call, a COMPLETE after a COMPLETE or a call.
        reused = comm is not None and (
            comm.sequence > 0 or (comm.complete if event.complete else comm.rank is not None)
        )
        if comm is None or reused:
            if comm is not None:
                comm.live = False
                del self._live[key]
            if key in self._dropped or not self._room(key):
                return
            comm = self._add(Communicator(key=key, nranks=event.nranks))
        comm.rank, comm.nranks, comm.cuda_dev, comm.func = event.rank, event.nranks, event.cuda_dev, event.func
        comm.bus_id = event.bus_id if event.bus_id is not None else comm.bus_id
        comm.comm_id = event.comm_id or comm.comm_id  # a split prints commId 0 where it has none
        comm.color, comm.split_key = event.color, event.key
        if event.parent is not None:
            parent = (event.host, event.pid, event.parent)
            if comm.parent != parent:
                comm.parent = parent
                if event.split_count is None:
                    self._children[parent] = self._children.get(parent, 0) + 1
                    comm.split_count = self._children[parent]
            if event.split_count is not None:
                comm.split_count = event.split_count
        comm.complete = comm.complete or event.complete
        self._initialising[event.host, event.pid, event.tid] = comm
        if len(self._initialising) > self.max_communicators:
            self._initialising.pop(next(iter(self._initialising)))
        self.version += 1

    def _room(self, key: CommKey) -> bool:
        if len(self._all) < self.max_communicators:
            return True
        self._dropped.add(key)
        if len(self._dropped) > self.max_communicators:  # keep the set bounded too; re-dropping recounts nothing
            self._dropped.clear()
        self.stats.communicators_dropped += 1
        return False

    def _add(self, comm: Communicator) -> Communicator:
        self._live[comm.key] = comm
        self._all.append(comm)
        return comm

    # ------------------------------------------------------------------ reading the state

    @property
    def communicators(self) -> list[Communicator]:
        """Every communicator kept, in the order first seen, replaced ones included (their calls still count)."""
        return list(self._all)

    def live(self, key: CommKey) -> Communicator | None:
        """The current communicator at ``key``, if any."""
        return self._live.get(key)

    def group_of(self, comm: Communicator) -> GroupKey | None:
        """What ``comm`` shares with the other members of its communicator, ``None`` when nothing is known.

        ``("id", commId)`` when the Init lines carry a commId; for a split communicator without one, ``("split",
        the parent's group, the child index, the color)``: every member splits the same parent in the same order
        with the same color. ``None`` for a communicator whose lines predate commId.
        """
        seen: set[CommKey] = set()
        return self._group(comm, seen)

    def _group(self, comm: Communicator, seen: set[CommKey]) -> GroupKey | None:
        if comm.comm_id:
            return ("id", comm.comm_id)
        if comm.parent is None or comm.key in seen:
            return None
        seen.add(comm.key)
        parent = self._parent_of(comm)
        if parent is None:
            return None
        parent_group = self._group(parent, seen)
        if parent_group is None:
            return None
        return ("split", parent_group, comm.split_count, comm.color)

    def _parent_of(self, comm: Communicator) -> Communicator | None:
        """The parent as it was when ``comm`` was split (the live one, or the latest replaced one at that key)."""
        if comm.parent is None:
            return None
        live = self._live.get(comm.parent)
        if live is not None:
            return live
        for other in reversed(self._all):
            if other.key == comm.parent:
                return other
        return None

    def parent_of(self, comm: Communicator) -> Communicator | None:
        """The communicator ``comm`` was split from, if its Init lines were seen."""
        return self._parent_of(comm)

    def nvlink_domain(self, comm: Communicator) -> tuple[str, int] | None:
        """``(fabric UUID, cliqueId)`` of the communicator's GPU, from the MNNVL fabric line; ``None`` without."""
        if comm.bus_id is None:
            return None
        return self._domains.get(comm.process, {}).get(comm.bus_id)

    def rank_hints(self) -> dict[ProcessKey, int]:
        """Global ranks the log itself states (RCCL's ``globalrank`` suffix)."""
        return dict(self._rank_hints)


def fallback_ranks(comms: Iterable[Communicator], world_size: int) -> dict[ProcessKey, int]:
    """Global rank of each process from the first communicator of ``world_size`` ranks it initialised.

    That communicator is the default process group, whose rank is the global rank. Used only for processes the
    caller gave no rank for (the SDK's hello carries ``pid`` and ``rank``).
    """
    ranks: dict[ProcessKey, int] = {}
    for comm in comms:
        if comm.nranks == world_size and comm.rank is not None and comm.process not in ranks:
            ranks[comm.process] = comm.rank
    return ranks


# ------------------------------------------------------------------------------------------------------- axes


@dataclass(frozen=True, slots=True, kw_only=True)
class _Candidate:
    label: str
    primary: bool
    groups: NDArray[np.int64]
    row_of: NDArray[np.int64]
    pos_of: NDArray[np.int64]


def _candidate(label: str, groups: NDArray[np.int64], *, primary: bool) -> _Candidate:
    world = groups.size
    row_of = np.empty(world, dtype=np.int64)
    pos_of = np.empty(world, dtype=np.int64)
    rows, size = groups.shape
    row_of[groups.ravel()] = np.repeat(np.arange(rows, dtype=np.int64), size)
    pos_of[groups.ravel()] = np.tile(np.arange(size, dtype=np.int64), rows)
    return _Candidate(label=label, primary=primary, groups=groups, row_of=row_of, pos_of=pos_of)


class AxisMapper:
    """Which process group of a layout a communicator is, from the ranks of its members that the log shows.

    A candidate group fits when its size equals ``nranks``, every seen member (same commId) lies in the same group
    at the position equal to its rank in the communicator, and, with a placement and the comm shape line, the group
    spans ``nNodes`` nodes with ``localRanks`` members on this node. Candidates: each axis of degree above 1, the
    data-with-context-parallel group ``dp-cp`` (cp > 1, dp > 1), the expert-data-parallel group ``edp`` (ep > 1)
    and ``world``. One fit gives its label; several fits give :data:`UNKNOWN` (tp=2 and dp=2 with one member seen
    fit alike) unless they are one and the same set of ranks with only one single axis among them (a dp group that
    is the whole world is ``dp``).
    """

    def __init__(self, layout: ParallelLayout, placement: Placement | None = None) -> None:
        """Precompute, for each candidate, every rank's group and position in it.

        Args:
            layout: the job's layout.
            placement: where ranks run (optional): lets the comm shape line's ``nNodes``/``localRanks`` tell groups
                of the same size apart.
        """
        self.layout = layout
        self.world_size = layout.world_size
        self._node_of_rank = (
            placement.node_of_rank if placement is not None and placement.world_size == self.world_size else None
        )
        cands: list[_Candidate] = [
            _candidate(axis.value, layout.groups(axis), primary=True)
            for axis in (MeshAxis.DP, MeshAxis.TP, MeshAxis.PP, MeshAxis.CP, MeshAxis.EP)
            if layout.degree(axis) > 1
        ]
        if layout.dp > 1 and layout.cp > 1:
            cands.append(_candidate(DP_CP, layout.groups(MeshAxis.DP, MeshAxis.CP), primary=False))
        if layout.ep > 1 and layout.expert_dp > 1:
            cands.append(_candidate(EDP, layout.groups(MeshAxis.DP, expert=True), primary=False))
        if self.world_size > 1:
            cands.append(_candidate(WORLD, np.arange(self.world_size, dtype=np.int64)[None, :], primary=False))
        self._candidates = tuple(cands)

    def axis_of(
        self,
        *,
        nranks: int,
        members: Mapping[int, int],
        rank: int,
        n_nodes: int | None = None,
        local_ranks: int | None = None,
    ) -> str:
        """The label of the one group that fits, or :data:`UNKNOWN`.

        Args:
            nranks: ranks in the communicator.
            members: global rank -> rank in the communicator, of every member seen (this process included).
            rank: this process' global rank (a key of ``members``).
            n_nodes: ``nNodes`` of the comm shape line, if seen.
            local_ranks: ``localRanks`` of the comm shape line, if seen.
        """
        world = self.world_size
        if not 0 <= rank < world or rank not in members or any(not 0 <= g < world for g in members):
            return UNKNOWN
        fits: list[tuple[_Candidate, int]] = []
        for cand in self._candidates:
            if cand.groups.shape[1] != nranks:
                continue
            row = int(cand.row_of[rank])
            same_group = all(int(cand.row_of[g]) == row and int(cand.pos_of[g]) == r for g, r in members.items())
            if same_group and self._spans(cand.groups[row], rank, n_nodes, local_ranks):
                fits.append((cand, row))
        if not fits:
            return UNKNOWN
        if len(fits) == 1:
            return fits[0][0].label
        sets = {frozenset(int(x) for x in c.groups[row]) for c, row in fits}
        primaries = [c for c, _ in fits if c.primary]
        if len(sets) == 1 and len(primaries) <= 1:
            return primaries[0].label if primaries else fits[0][0].label
        return UNKNOWN

    def _spans(self, group: NDArray[np.int64], rank: int, n_nodes: int | None, local_ranks: int | None) -> bool:
        if self._node_of_rank is None:
            return True
        nodes = self._node_of_rank[group]
        if n_nodes is not None and len(np.unique(nodes)) != n_nodes:
            return False
        return local_ranks is None or int(np.count_nonzero(nodes == self._node_of_rank[rank])) == local_ranks

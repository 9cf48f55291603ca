"""The timeline: every rank's every step, built vectorised over ranks, written straight into a record table.

Why it exists: it is the simulator's one source of timestamps. Time is integer microseconds per rank, held as
``(pp, n)`` arrays on the :class:`~meshscope.simulation.model.Grid` (row = pipeline stage); every event of the
step (a compute chunk, a collective, a pipeline message) is one numpy operation over a whole row, so the cost is
O(ranks x intervals per rank-step) with Python overhead O(stages x passes x collectives per pass) per step. Loops
run over steps, stages, micro-batch passes and collective kinds, never over ranks.

A step on one rank, in order (see ``docs/simulator.md`` for the model and its simplifications):

1. **data**: the loader's time (``phases.data_ms``, slow-loader faults); with prefetch only the part beyond the
   rank's compute + optimizer time of the step is exposed;
2. the stage's **forward and backward passes** in the pipeline schedule's order (1F1B, interleaved, GPipe). Before
   a pass that needs a neighbour's activations (or gradients), a ``recv`` posted when the previous pass's compute
   ended completes at ``max(posted, the neighbour's send start + transfer)``; after a pass whose output a
   neighbour needs, a ``send`` blocks the stage for the transfer time (its next ``recv`` is already posted). Inside
   a pass, compute is cut into chunks with one aggregated collective (of the right total bytes) after each chunk
   but the last, per tensor-, context- and expert-parallel collective kind. Data-parallel parameter all-gathers run
   before the passes that need them, gradient reductions after the backward passes that produce them;
3. the tied-embedding all-reduce between the first and last stage, the **optimizer**, and any **checkpoint**.

Collectives: every member arrives at its own time (``start_us`` = its arrival), nobody leaves before the last
member arrived, and all leave at ``last arrival + transfer`` (bytes / the group's link bandwidth, from the
placement). A collective the plan partly hides behind compute is issued that much before the end of the compute
chunk it follows (or, before a pass, lets the compute start that much before it ends); the hidden part is at most
the chunk. Group ids and sequence numbers are the SDK's: ``"<name>:<first rank>"``, ``seq`` counted per group over
the whole job; pipeline and ring messages use per-direction streams ``"pp:<src>-<dst>"``.

It must not decide what a fault means beyond its documented parameters, and must not analyse the records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from meshscope.jobs import PipelineSchedule
from meshscope.progress import NO_PROGRESS
from meshscope.records import AXIS_CODE, KIND_CODE, OP_CODE, PHASE_CODE, IntervalColumns, RecordTable, StepColumns
from meshscope.simulation.faults import (
    CheckpointStall,
    DataImbalance,
    Noise,
    SlowLink,
    SlowLoader,
    Straggler,
    active,
)
from meshscope.simulation.model import Slot
from meshscope.topology import AXES, MeshAxis

if TYPE_CHECKING:
    from collections.abc import Sequence

    from numpy.typing import NDArray

    from meshscope.progress import Progress
    from meshscope.simulation.faults import Fault
    from meshscope.simulation.model import GroupKind, Item, JobModel

US = 1e6
"""Microseconds per second."""

_COMPUTE, _DATA, _OPT, _CKPT = KIND_CODE["compute"], KIND_CODE["data"], KIND_CODE["optimizer"], KIND_CODE["checkpoint"]
_COMM, _P2P = KIND_CODE["comm"], KIND_CODE["p2p"]
_FORWARD, _BACKWARD = PHASE_CODE["forward"], PHASE_CODE["backward"]
_SEND, _RECV = OP_CODE["send"], OP_CODE["recv"]
_PP_AXIS, _CP_AXIS = AXIS_CODE["pp"], AXIS_CODE["cp"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TimelineSettings:
    """How to run the timeline."""

    steps: int
    """Steps to simulate."""
    seed: int
    """Seed of the noise."""
    prefetch: bool
    """The loader overlaps the step's compute."""
    start_us: int
    """Timestamp of the first step's start (before clock skew), µs."""
    gpu_util: bool
    """Write reported GPU utilisation."""
    job: str
    """Job name in the records."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TimelineResult:
    """The records and what the timeline learnt about the faults."""

    table: RecordTable
    """The step records."""
    slowed_groups: dict[int, tuple[str, ...]]
    """Per slow-link fault (index in the fault list): ids of the groups and streams it slowed."""


# ==================================================================================================== schedules

Op = tuple[bool, int, int]
"""(forward?, micro-batch, model chunk)."""


def schedule_ops(schedule: PipelineSchedule, pp: int, micro_batches: int, chunks: int) -> list[list[Op]]:
    """The order of forward and backward passes on every pipeline stage.

    * 1F1B (Megatron-core ``forward_backward_pipelining_without_interleaving``): ``min(pp - r - 1, m)`` warm-up
      forwards on stage r, then alternating forward/backward, then the remaining backwards;
    * interleaved (``..._with_interleaving``): virtual micro-batch k runs model chunk ``(k mod pp·v) // pp``
      (backward: the mirror), ``(pp - r - 1)·2 + (v - 1)·pp`` warm-up passes (all of them when ``m == pp``);
    * GPipe: every forward, then every backward, in micro-batch order.

    Returns:
        One list of passes per stage.
    """
    m, v, p = micro_batches, chunks, pp
    out: list[list[Op]] = []
    for r in range(p):
        if schedule is PipelineSchedule.GPIPE:
            out.append([(True, i, 0) for i in range(m)] + [(False, i, 0) for i in range(m)])
            continue
        if schedule is PipelineSchedule.INTERLEAVED and v > 1:
            total = m * v
            warmup = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)

            def virtual(k: int, *, forward: bool) -> Op:
                in_group = k % (p * v)
                chunk = in_group // p
                return (forward, (k // (p * v)) * p + k % p, chunk if forward else v - 1 - chunk)

        else:
            total = m
            warmup = min(p - r - 1, m)

            def virtual(k: int, *, forward: bool) -> Op:
                return (forward, k, 0)

        ops = [virtual(k, forward=True) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [virtual(warmup + k, forward=True), virtual(k, forward=False)]
        ops += [virtual(total - warmup + k, forward=False) for k in range(warmup)]
        out.append(ops)
    return out


def _producer(op: Op, r: int, p: int, v: int) -> tuple[int, Op] | None:
    """The (stage, pass) whose output pass ``op`` of stage ``r`` receives, or ``None``."""
    forward, i, c = op
    if forward:
        if r > 0:
            return r - 1, (True, i, c)
        return (p - 1, (True, i, c - 1)) if c > 0 else None
    if r < p - 1:
        return r + 1, (False, i, c)
    return (0, (False, i, c + 1)) if c < v - 1 else None


def _consumer(op: Op, r: int, p: int, v: int) -> tuple[int, Op] | None:
    """The (stage, pass) that receives the output of pass ``op`` of stage ``r``, or ``None``."""
    forward, i, c = op
    if forward:
        if r < p - 1:
            return r + 1, (True, i, c)
        return (0, (True, i, c + 1)) if c < v - 1 else None
    if r > 0:
        return r - 1, (False, i, c)
    return (p - 1, (False, i, c - 1)) if c > 0 else None


# ==================================================================================================== recording


@dataclass(slots=True)
class _Blocks:
    """Intervals as blocks (one per event per stage); filled into columns once, at the end."""

    grid_ranks: NDArray[np.int64]
    world: int
    blocks: list[tuple[Any, ...]] = field(default_factory=list)
    count: int = 0

    def add(
        self,
        step: int,
        row: int,
        kind: int,
        start: NDArray[np.int64],
        end: NDArray[np.int64],
        *,
        mask: NDArray[np.bool_] | None = None,
        phase: int = -1,
        axis: int = -1,
        op: int = -1,
        group: NDArray[np.int32] | None = None,
        seq: int = -1,
        size: NDArray[np.int64] | int = -1,
        group_size: int = -1,
        peer: NDArray[np.int64] | None = None,
    ) -> None:
        n = int(start.shape[0]) if mask is None else int(np.count_nonzero(mask))
        if n == 0:
            return
        self.blocks.append((step, row, mask, kind, start, end, phase, axis, op, group, seq, size, group_size, peer))
        self.count += n

    def columns(self, offset_of_rank: NDArray[np.int64]) -> IntervalColumns:
        total = self.count
        cols: dict[str, NDArray[Any]] = {
            "row": np.empty(total, dtype=np.int32),
            "kind": np.empty(total, dtype=np.int8),
            "start_us": np.empty(total, dtype=np.int64),
            "end_us": np.empty(total, dtype=np.int64),
            "phase": np.empty(total, dtype=np.int8),
            "axis": np.empty(total, dtype=np.int8),
            "op": np.empty(total, dtype=np.int8),
            "group": np.empty(total, dtype=np.int32),
            "seq": np.empty(total, dtype=np.int64),
            "size_bytes": np.empty(total, dtype=np.int64),
            "group_size": np.empty(total, dtype=np.int32),
            "peer": np.empty(total, dtype=np.int64),
        }
        at = 0
        for index, block in enumerate(self.blocks):
            self.blocks[index] = ()  # let its arrays go as soon as they are copied
            step, row, mask, kind, start, end, phase, axis, op, group, seq, size, gsize, peer = block
            ranks = self.grid_ranks[row]

            def pick(values: Any, mask: Any = mask) -> Any:  # noqa: ANN401 - scalars or arrays
                return values[mask] if mask is not None and isinstance(values, np.ndarray) else values

            ranks = pick(ranks)
            sl = slice(at, at + ranks.shape[0])
            at = sl.stop
            offset = offset_of_rank[ranks]
            cols["row"][sl] = step * self.world + ranks
            cols["kind"][sl] = kind
            cols["start_us"][sl] = pick(start) + offset
            cols["end_us"][sl] = pick(end) + offset
            cols["phase"][sl] = phase
            cols["axis"][sl] = axis
            cols["op"][sl] = op
            cols["group"][sl] = -1 if group is None else pick(group)
            cols["seq"][sl] = seq
            cols["size_bytes"][sl] = pick(size)
            cols["group_size"][sl] = gsize
            cols["peer"][sl] = -1 if peer is None else pick(peer)
        self.blocks.clear()
        return IntervalColumns.build(
            row=cols["row"],
            kind=cols["kind"],
            start_us=cols["start_us"],
            end_us=cols["end_us"],
            phase=cols["phase"],
            axis=cols["axis"],
            op=cols["op"],
            group=cols["group"],
            seq=cols["seq"],
            size_bytes=cols["size_bytes"],
            group_size=cols["group_size"],
            peer=cols["peer"],
        )


# ==================================================================================================== the engine

Rows = list["NDArray[np.int64]"]
"""Per-stage state: one ``(n,)`` array per pipeline stage. Arrays are never changed in place once created (the
record blocks keep references to them), only replaced."""


@dataclass(slots=True)
class _StepState:
    """Per-step fault effects on the grid, all ``(pp, n)``, and the transfer times they lead to."""

    compute: NDArray[np.float64]
    """Multiplier of forward/backward compute."""
    tokens: NDArray[np.float64]
    """Tokens per sequence relative to nominal (data imbalance)."""
    data_us: NDArray[np.float64]
    """Loader time."""
    checkpoint_us: NDArray[np.float64]
    """Checkpoint length after the optimizer."""
    sigma: float
    """Noise."""
    link: dict[int, NDArray[np.float64]]
    """Per item index: ``(pp, groups)`` transfer-time multiplier (slow links)."""
    stream: dict[tuple[int, int], NDArray[np.float64]]
    """Per pipeline stream (src, dst): ``(n,)`` transfer-time multiplier (slow links)."""
    sized: dict[tuple[int, int], tuple[NDArray[np.int64], NDArray[np.int64]]] = field(default_factory=dict)
    """(item index, stage) -> per group transfer µs and bytes, computed on first use."""


@dataclass(slots=True)
class _Clock:
    """Per-step pipeline state."""

    free: Rows
    """When each rank can start its next pass."""
    posted: Rows
    """When its next receive is posted (the end of its last compute)."""
    avail: dict[tuple[int, Op], NDArray[np.int64]]
    """(stage, pass) -> when the message that pass needs has arrived, per column."""
    last_backward_start: Rows
    """When the backward of the stage's last micro-batch began (its first model chunk)."""


@dataclass(frozen=True, slots=True)
class _Context:
    """What every event of one step needs."""

    step: int
    state: _StepState
    clock: _Clock
    blocks: _Blocks


class _Engine:
    """Runs the steps; see the module docstring."""

    def __init__(self, model: JobModel, faults: Sequence[Fault], settings: TimelineSettings) -> None:
        self.model = model
        self.faults = faults
        self.settings = settings
        self.grid = grid = model.grid
        self.p, self.n = grid.stages, grid.columns
        self.world = self.p * self.n
        self.rng = np.random.default_rng([settings.seed, 0x51_4D])
        self.blocks = _Blocks(grid_ranks=grid.ranks, world=self.world)
        self.ops = schedule_ops(model.plan.schedule, self.p, model.micro_batches, model.chunks)
        self.firsts = [next((j for j, o in enumerate(ops) if o[0]), -1) for ops in self.ops]
        self.lasts = [max((j for j, o in enumerate(ops) if not o[0]), default=-1) for ops in self.ops]
        self.seq: dict[tuple[str, int], int] = {}
        self.pos_row = np.empty(self.world, dtype=np.intp)
        self.pos_col = np.empty(self.world, dtype=np.intp)
        self.pos_row[grid.ranks] = np.arange(self.p)[:, None]
        self.pos_col[grid.ranks] = np.arange(self.n)[None, :]
        self.items = [it for stage in model.stages for it in stage.items]
        self.item_index = {id(it): k for k, it in enumerate(self.items)}
        self.items_of_group = {
            name: [k for k, it in enumerate(self.items) if it.group is kind]
            for name, kind in grid.by_plan_group.items()
        }
        self.node_grid = grid.node[grid.ranks]
        self.domain_grid = model.placement.domain_of_node[self.node_grid]
        self.dp_grid = model.spec.layout.coords_array(grid.ranks.ravel())[MeshAxis.DP].reshape(self.p, self.n)
        self.alpha = np.array([s.attention_fraction for s in model.stages])[:, None]
        self.peers = {key: grid.ranks[key[1]] for key in grid.pp_forward}
        """The receiving side of each (source stage, destination stage) message: a send's peer."""
        self.cp_peers = {r: grid.ranks[r][s.peer_cols] for r, s in grid.cp_ring.items()}
        self.slow_masks, self.slowed_groups = self._slow_link_masks()

    # ------------------------------------------------------------------ fault effects

    def _slow_link_masks(self) -> tuple[dict[int, dict[Any, NDArray[np.bool_]]], dict[int, tuple[str, ...]]]:
        """Which groups (per plan group) and pipeline streams every slow-link fault slows.

        Returns:
            Masks by ``id`` of the fault, and the ids of what it slows by the fault's position in the list.
        """
        out: dict[int, dict[Any, NDArray[np.bool_]]] = {}
        names: dict[int, tuple[str, ...]] = {}
        grid = self.grid
        for index, fault in enumerate(self.faults):
            if not isinstance(fault, SlowLink):
                continue
            masks: dict[Any, NDArray[np.bool_]] = {}
            slowed: list[str] = []
            for plan_group, kind in grid.by_plan_group.items():
                mask = self._kind_mask(kind, fault)
                masks[plan_group] = mask
                for r in kind.rows:
                    if plan_group == "cp":  # recorded as ring messages: name the streams
                        codes = grid.cp_ring[r].codes[mask[r][kind.group_of_col]]
                    else:
                        codes = kind.codes[r][mask[r]]
                    slowed.extend(grid.group_names[c] for c in codes.tolist())
                    if kind.name == "pp_embedding":
                        break
            for key, stream in grid.pp_forward.items():
                if fault.node is not None:
                    mask = stream.network & ((stream.src_nodes == fault.node) | (stream.dst_nodes == fault.node))
                else:
                    domain = self.model.placement.domain_of_node[stream.dst_nodes]
                    mask = ~stream.network & (domain == fault.nvlink_domain)
                masks[key] = mask
                slowed.extend(grid.group_names[c] for c in stream.codes[mask].tolist())
            out[id(fault)] = masks
            names[index] = tuple(dict.fromkeys(slowed))
        return out, names

    def _kind_mask(self, kind: GroupKind, fault: SlowLink) -> NDArray[np.bool_]:
        """``(pp, groups)``: groups of ``kind`` whose traffic the slow link carries."""
        if kind.name == "pp_embedding":
            first, last = kind.rows
            nodes = np.stack([self.node_grid[first], self.node_grid[last]], axis=1)[None]
            domains = np.stack([self.domain_grid[first], self.domain_grid[last]], axis=1)[None]
        else:
            nodes = self.node_grid[:, kind.cols]  # (pp, groups, size)
            domains = self.domain_grid[:, kind.cols]
        if fault.node is not None:
            hit = (nodes == fault.node).any(axis=2)
            return np.broadcast_to(kind.network & hit, kind.network.shape)
        return np.broadcast_to(~kind.network & (domains[:, :, 0] == fault.nvlink_domain), kind.network.shape)

    def _state(self, step: int) -> _StepState:
        """The effects of every fault in step ``step``."""
        shape = (self.p, self.n)
        st = _StepState(
            compute=np.ones(shape),
            tokens=np.ones(shape),
            data_us=np.full(shape, self.model.data_s * US),
            checkpoint_us=np.zeros(shape),
            sigma=0.0,
            link={},
            stream={},
        )
        if self.model.checkpoint_every and (step + 1) % self.model.checkpoint_every == 0:
            st.checkpoint_us += self.model.checkpoint_s * US
        for fault in self.faults:
            if isinstance(fault, Noise):
                st.sigma = math.hypot(st.sigma, fault.sigma)
            elif isinstance(fault, CheckpointStall):
                if (step + 1) % fault.every == 0:
                    ranks = np.arange(self.world) if fault.ranks is None else np.array(fault.ranks)
                    st.checkpoint_us[self.pos_row[ranks], self.pos_col[ranks]] += fault.seconds * US
            elif active(fault, step):
                self._apply(fault, st)
        return st

    def _apply(self, fault: Fault, st: _StepState) -> None:
        """Effects of a fault that acts in the step (straggler, data imbalance, slow loader, slow link)."""
        if isinstance(fault, Straggler):
            st.compute[self.pos_row[fault.rank], self.pos_col[fault.rank]] *= fault.factor
        elif isinstance(fault, DataImbalance):
            replica = self.dp_grid == self.dp_grid[self.pos_row[fault.rank], self.pos_col[fault.rank]]
            k = fault.factor
            st.compute = np.where(replica, st.compute * ((1 - self.alpha) * k + self.alpha * k * k), st.compute)
            st.tokens = np.where(replica, st.tokens * k, st.tokens)
        elif isinstance(fault, SlowLoader):
            if fault.rank is None:
                st.data_us[:] = fault.data_ms * 1e3
            else:
                st.data_us[self.pos_row[fault.rank], self.pos_col[fault.rank]] = fault.data_ms * 1e3
        elif isinstance(fault, SlowLink):
            slow = 1.0 / fault.factor
            for key, mask in self.slow_masks[id(fault)].items():
                factor = np.where(mask, slow, 1.0)
                if isinstance(key, str):
                    for k in self.items_of_group[key]:
                        st.link[k] = st.link[k] * factor if k in st.link else factor
                else:
                    st.stream[key] = st.stream[key] * factor if key in st.stream else factor

    # ------------------------------------------------------------------ primitives

    def _jitter(self, st: _StepState) -> NDArray[np.float64] | float:
        if st.sigma <= 0:
            return 1.0
        return np.exp(st.sigma * self.rng.standard_normal(self.n) - st.sigma**2 / 2)

    def _next_seq(self, key: tuple[str, int]) -> int:
        value = self.seq.get(key, 0)
        self.seq[key] = value + 1
        return value

    def _sized(self, st: _StepState, item: Item, r: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Per group of row ``r``: transfer µs and bytes of one occurrence of ``item`` in this step."""
        k = self.item_index[id(item)]
        cached = st.sized.get((k, r))
        if cached is not None:
            return cached
        kind = item.group
        seconds = np.where(kind.network[r], item.seconds_network, item.seconds_nvlink) * item.instances
        mult = st.link.get(k)
        if mult is not None:
            seconds = seconds * mult[r]
        size = np.full(seconds.shape, item.message_bytes * item.instances)
        if item.token_scaled:
            scale = st.tokens[r][kind.cols[:, 0]]
            seconds, size = seconds * scale, size * scale
        out = np.rint(seconds * US).astype(np.int64), np.rint(size).astype(np.int64)
        st.sized[k, r] = out
        return out

    def _hidden(self, st: _StepState, item: Item, r: int) -> NDArray[np.int64]:
        """Per column: how much of one occurrence of ``item`` the plan expects to hide behind compute, µs."""
        transfer, _ = self._sized(st, item, r)
        hidden: NDArray[np.int64] = np.rint(transfer * item.hidden_fraction).astype(np.int64)[item.group.group_of_col]
        return hidden

    def _collective(self, r: int, item: Item, arrival: NDArray[np.int64], ctx: _Context) -> NDArray[np.int64]:
        """Run one occurrence of ``item`` on row ``r``: everyone leaves at the last arrival + transfer."""
        kind = item.group
        transfer, size = self._sized(ctx.state, item, r)
        last = arrival[kind.cols].max(axis=1)
        end: NDArray[np.int64] = (last + transfer)[kind.group_of_col]
        seq = self._next_seq((kind.name, r))
        if item.p2p:  # the context-parallel ring, recorded as receives from the previous member
            ctx.blocks.add(
                ctx.step, r, _P2P, arrival, end, axis=_CP_AXIS, op=_RECV, group=self.grid.cp_ring[r].codes, seq=seq,
                size=size[kind.group_of_col], peer=self.cp_peers[r],
            )  # fmt: skip
        else:
            ctx.blocks.add(
                ctx.step, r, _COMM, arrival, end, axis=AXIS_CODE[kind.axis.value], op=item.op,
                group=kind.codes[r][kind.group_of_col], seq=seq, size=size[kind.group_of_col], group_size=kind.size,
            )  # fmt: skip
        return end

    def _pp_bytes(self, st: _StepState, r: int) -> NDArray[np.int64]:
        size: NDArray[np.int64] = np.rint(self.model.pp_message_bytes * st.tokens[r]).astype(np.int64)
        return size

    def _pp_transfer(self, st: _StepState, src: int, dst: int) -> NDArray[np.int64]:
        stream = self.grid.pp_forward[src, dst]
        seconds = np.where(stream.network, self.model.pp_seconds_network, self.model.pp_seconds_nvlink)
        mult = st.stream.get((src, dst))
        if mult is not None:
            seconds = seconds * mult
        transfer: NDArray[np.int64] = np.rint(seconds * st.tokens[src] * US).astype(np.int64)
        return transfer

    # ------------------------------------------------------------------ a pass

    def _pass(self, r: int, op: Op, *, ctx: _Context, position: int) -> None:
        """One forward or backward pass of one model chunk of one micro-batch on stage ``r``."""
        forward, micro_batch, chunk_index = op
        clock, v = ctx.clock, self.model.chunks
        stage = self.model.stages[r]
        t = self._receive(r, op, ctx)
        micro_us = (stage.forward_s if forward else stage.backward_s) * US * ctx.state.compute[r]
        leading = Slot.BEFORE_FORWARD if forward else Slot.BEFORE_BACKWARD
        for item in stage.items:
            if item.slot is leading and (not item.once or position == self.firsts[r]):
                # A gather the plan partly hides: the compute starts once the exposed part is done and runs under
                # the rest (within one micro-batch's pass, or this chunk's when it runs every pass).
                window = np.rint(micro_us if item.once else micro_us / v).astype(np.int64)
                end = self._collective(r, item, t, ctx)
                t = np.maximum(t, end - np.minimum(self._hidden(ctx.state, item, r), window))
        if not forward and micro_batch == self.model.micro_batches - 1 and chunk_index == v - 1:
            clock.last_backward_start[r] = t  # the last micro-batch's gradients start to appear here
        pass_start = t
        t = self._compute(r, t, micro_us / v, forward=forward, ctx=ctx)
        # Gradient reductions are launched while the backward computes and waited for before the stage goes on; the
        # pipeline send of this pass does not queue behind them.
        reduced = t
        trailing = [
            it
            for it in stage.items
            if not forward and it.slot is Slot.AFTER_BACKWARD and (not it.once or position == self.lasts[r])
        ]
        if trailing:
            # Issued back to back, the first early enough that the plan's hidden parts of all of them run under the
            # backward, but not before the gradients exist.
            hidden = sum((self._hidden(ctx.state, it, r) for it in trailing), np.zeros(self.n, dtype=np.int64))
            earliest = clock.last_backward_start[r] if trailing[0].once else pass_start
            arrival = np.maximum(t - hidden, earliest)
            for item in trailing:
                arrival = self._collective(r, item, arrival, ctx)
            reduced = np.maximum(t, arrival)
        clock.posted[r] = t
        clock.free[r] = np.maximum(self._send(r, op, t, ctx), reduced)

    def _receive(self, r: int, op: Op, ctx: _Context) -> NDArray[np.int64]:
        """The pipeline receive before a pass, if it needs one; returns when the pass can start."""
        clock = ctx.clock
        source = _producer(op, r, self.p, self.model.chunks)
        if source is None:
            return clock.free[r]
        src = source[0]
        posted = clock.posted[r]
        end: NDArray[np.int64] = np.maximum(posted, clock.avail.pop((r, op)))
        ctx.blocks.add(
            ctx.step, r, _P2P, posted, end, axis=_PP_AXIS, op=_RECV, group=self.grid.pp_forward[src, r].codes,
            seq=self._next_seq((f"pp:{src}-{r}", 0)), size=self._pp_bytes(ctx.state, r), peer=self.grid.ranks[src],
        )  # fmt: skip
        start: NDArray[np.int64] = np.maximum(clock.free[r], end)
        return start

    def _compute(
        self, r: int, t: NDArray[np.int64], pass_us: NDArray[np.float64], *, forward: bool, ctx: _Context
    ) -> NDArray[np.int64]:
        """The compute of a pass in chunks, one aggregated in-layer collective after each chunk but the last."""
        inner_slot = Slot.IN_FORWARD if forward else Slot.IN_BACKWARD
        inner = [it for it in self.model.stages[r].items if it.slot is inner_slot]
        nominal = pass_us / (len(inner) + 1)
        phase = _FORWARD if forward else _BACKWARD
        for j in range(len(inner) + 1):
            chunk = np.rint(nominal * self._jitter(ctx.state)).astype(np.int64)
            done = t + chunk
            ctx.blocks.add(ctx.step, r, _COMPUTE, t, done, phase=phase)
            if j == len(inner):
                return done
            # Issued that much before the chunk ends (its hidden part runs under the chunk).
            hidden = np.minimum(self._hidden(ctx.state, inner[j], r), chunk)
            t = np.maximum(done, self._collective(r, inner[j], done - hidden, ctx))
        return t  # pragma: no cover - the loop returns

    def _send(self, r: int, op: Op, t: NDArray[np.int64], ctx: _Context) -> NDArray[np.int64]:
        """The pipeline send after a pass, if a neighbour needs its output; returns when it is done."""
        target = _consumer(op, r, self.p, self.model.chunks)
        if target is None:
            return t
        dst, dst_op = target
        arrive: NDArray[np.int64] = t + self._pp_transfer(ctx.state, r, dst)
        ctx.blocks.add(
            ctx.step, r, _P2P, t, arrive, axis=_PP_AXIS, op=_SEND, group=self.grid.pp_forward[r, dst].codes,
            seq=self._next_seq((f"pp:{r}-{dst}", 1)), size=self._pp_bytes(ctx.state, r), peer=self.peers[r, dst],
        )  # fmt: skip
        ctx.clock.avail[dst, dst_op] = arrive
        return arrive

    # ------------------------------------------------------------------ a step

    def step(self, k: int, now: Rows) -> tuple[Rows, Rows, _StepState]:
        """Simulate step ``k`` from ``now``; returns each rank's step end and its exposed data + checkpoint time."""
        st = self._state(k)
        data = self._data(st)
        ready = [now[r] + data[r] for r in range(self.p)]
        for r in range(self.p):
            self.blocks.add(k, r, _DATA, now[r], ready[r], mask=data[r] > 0)
        clock = _Clock(free=list(ready), posted=list(ready), avail={}, last_backward_start=list(ready))
        ctx = _Context(step=k, state=st, clock=clock, blocks=self.blocks)
        self._run_schedule(ctx)
        t = list(clock.free)
        stages = self.model.stages
        for item in stages[-1].items:
            if item.slot is Slot.STEP_END:
                t = self._embedding(item, t, ctx)
        ends: Rows = []
        idle: Rows = []
        ckpt = np.rint(st.checkpoint_us).astype(np.int64)
        for r, stage in enumerate(stages):
            opt_end = t[r] + np.rint(stage.optimizer_s * US * self._jitter(st)).astype(np.int64)
            self.blocks.add(k, r, _OPT, t[r], opt_end)
            end = opt_end + ckpt[r]
            self.blocks.add(k, r, _CKPT, opt_end, end, mask=ckpt[r] > 0)
            ends.append(end)
            idle.append(data[r] + ckpt[r])
        return ends, idle, st

    def _data(self, st: _StepState) -> Rows:
        """Exposed loader time of every rank."""
        data: Rows = []
        model = self.model
        for r, stage in enumerate(model.stages):
            if self.settings.prefetch:
                # The loader runs while the GPU computes: only what exceeds the step's compute shows.
                busy = model.micro_batches * (stage.forward_s + stage.backward_s) * st.compute[r] + stage.optimizer_s
                data.append(np.rint(np.maximum(st.data_us[r] - busy * US, 0.0)).astype(np.int64))
            else:
                data.append(np.rint(st.data_us[r]).astype(np.int64))
        return data

    def _run_schedule(self, ctx: _Context) -> None:
        """Every stage's passes in schedule order; a pass waits (in simulated time) for the message it needs."""
        ptr = [0] * self.p
        remaining = sum(len(o) for o in self.ops)
        while remaining:
            progressed = False
            for r in range(self.p):
                ops = self.ops[r]
                while ptr[r] < len(ops):
                    op = ops[ptr[r]]
                    if _producer(op, r, self.p, self.model.chunks) is not None and (r, op) not in ctx.clock.avail:
                        break
                    self._pass(r, op, ctx=ctx, position=ptr[r])
                    ptr[r] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:  # pragma: no cover - every schedule above is deadlock-free
                raise AssertionError(f"pipeline schedule stalled at passes {ptr}")

    def _embedding(self, item: Item, t: Rows, ctx: _Context) -> Rows:
        """The tied-embedding all-reduce between the first and the last stage (one group per column)."""
        first, last_row = item.group.rows
        seconds = np.where(item.group.network[first], item.seconds_network, item.seconds_nvlink) * item.instances
        mult = ctx.state.link.get(self.item_index[id(item)])
        if mult is not None:
            seconds = seconds * mult[first]
        end = np.maximum(t[first], t[last_row]) + np.rint(seconds * US).astype(np.int64)
        seq = self._next_seq(("pp_embedding", 0))
        size = round(item.message_bytes * item.instances)
        for r in (first, last_row):
            ctx.blocks.add(
                ctx.step, r, _COMM, t[r], end, axis=_PP_AXIS, op=item.op, group=item.group.codes[r], seq=seq,
                size=size, group_size=2,
            )  # fmt: skip
        out = list(t)
        out[first] = out[last_row] = end
        return out


# ==================================================================================================== entry point


def run_timeline(
    model: JobModel,
    faults: Sequence[Fault],
    settings: TimelineSettings,
    clock_offset_us: NDArray[np.int64],
    *,
    progress: Progress = NO_PROGRESS,
) -> TimelineResult:
    """Simulate ``settings.steps`` steps of ``model`` with ``faults`` and write the record table.

    Args:
        model: the job.
        faults: the faults (already checked against the job).
        settings: steps, seed, prefetch, start time, job name.
        clock_offset_us: per node, added to every timestamp of its ranks.
        progress: told of the phases "simulating" (steps done of ``settings.steps``, one at a time: each step is
            vectorised over every rank) and "building the records table".

    Returns:
        The records and the groups slow links slowed.
    """
    engine = _Engine(model, faults, settings)
    grid, p, n = model.grid, engine.p, engine.n
    steps = settings.steps
    start = np.zeros((steps, p, n), dtype=np.int64)
    end = np.zeros((steps, p, n), dtype=np.int64)
    idle = np.zeros((steps, p, n), dtype=np.int64)
    tokens = np.ones((steps, p, n))
    compute = np.ones((steps, p, n))
    now: Rows = [np.zeros(n, dtype=np.int64) for _ in range(p)]
    with progress.phase(f"simulating {model.spec.world_size:,} ranks", total=steps, unit="steps") as phase:
        for k in range(steps):
            start[k] = np.stack(now)
            now, spent, st = engine.step(k, now)
            end[k], idle[k] = np.stack(now), np.stack(spent)
            tokens[k], compute[k] = st.tokens, st.compute
            phase.advance()
    with progress.phase("building the records table"):
        offset_of_rank = clock_offset_us[grid.node] + settings.start_us
        intervals = engine.blocks.columns(offset_of_rank)
        steps_table = _step_columns(
            model=model,
            engine=engine,
            start=start,
            end=end,
            idle=idle,
            tokens=tokens,
            compute=compute,
            offset_of_rank=offset_of_rank,
            settings=settings,
        )
        placement = model.placement
        table = RecordTable(
            job=settings.job,
            steps=steps_table,
            intervals=intervals,
            node_names=tuple(placement.node_name(i) for i in range(placement.nodes)),
            nvlink_domain_names=tuple(f"nvl-{i}" for i in range(int(placement.domain_of_node.max()) + 1)),
            network_tier_names=tuple(f"block-{i}" for i in range(int(placement.block_of_node.max()) + 1)),
            group_names=tuple(grid.group_names),
        )
    return TimelineResult(table=table, slowed_groups=engine.slowed_groups)


def _step_columns(
    *,
    model: JobModel,
    engine: _Engine,
    start: NDArray[np.int64],
    end: NDArray[np.int64],
    idle: NDArray[np.int64],
    tokens: NDArray[np.float64],
    compute: NDArray[np.float64],
    offset_of_rank: NDArray[np.int64],
    settings: TimelineSettings,
) -> StepColumns:
    """One row per (step, rank), step-major, ranks in rank order."""
    steps, world = settings.steps, engine.world
    ranks = model.grid.ranks.ravel()

    def by_rank(values: NDArray[Any]) -> NDArray[Any]:
        """``(steps, pp, n)`` -> ``(steps * world,)`` in rank order."""
        out = np.empty((steps, world), dtype=values.dtype)
        out[:, ranks] = values.reshape(steps, -1)
        return out.ravel()

    rank = np.tile(np.arange(world, dtype=np.int64), steps)
    offset = np.tile(offset_of_rank, steps)
    s_us, e_us = by_rank(start) + offset, by_rank(end) + offset
    k = by_rank(tokens)
    stages = model.stages
    attention = np.array([s.attention_s for s in stages])[:, None]
    memory = np.array([s.memory_bytes for s in stages], dtype=np.float64)[:, None]
    activations = np.array([s.activation_bytes for s in stages], dtype=np.float64)[:, None]
    straggle = compute / np.where(tokens != 1, (1 - _alpha(model)) * tokens + _alpha(model) * tokens**2, 1.0)
    coords = model.spec.layout.coords_array()
    coord = np.stack([coords[a] for a in AXES], axis=1)
    placement = model.placement
    node = placement.node_of_rank
    local = np.zeros(world, dtype=np.int64)
    order = np.argsort(node, kind="stable")
    counts = np.bincount(node, minlength=placement.nodes)
    local[order] = np.arange(world) - np.repeat(np.cumsum(counts) - counts, counts)
    util = None
    if settings.gpu_util:
        length = (e_us - s_us).astype(np.float64)
        busy = length - by_rank(idle)
        util = np.clip(np.where(length > 0, busy / np.maximum(length, 1), 1.0), 0.0, 1.0)
    seq_len = model.sequence_length
    return StepColumns.build(
        rank=rank,
        step=np.repeat(np.arange(steps, dtype=np.int64), world),
        start_us=s_us,
        end_us=e_us,
        coord=np.tile(coord, (steps, 1)),
        node=np.tile(node, steps),
        nvlink_domain=np.tile(placement.domain_of_rank(), steps),
        network_tier=np.tile(placement.block_of_rank(), steps),
        gpu=np.tile(local, steps),
        gpu_util=util,
        tokens=np.rint(model.tokens * k).astype(np.int64),
        sequences=np.full(steps * world, model.sequences, dtype=np.int64),
        longest_sequence=np.rint(seq_len * k).astype(np.int64),
        attention_work=model.sequences * (seq_len * k) ** 2,
        attention_us=np.rint(by_rank(np.broadcast_to(attention * US, start.shape) * tokens**2 * straggle)).astype(
            np.int64
        ),
        peak_memory_bytes=np.rint(by_rank(np.broadcast_to(memory, start.shape) + activations * (tokens - 1))).astype(
            np.int64
        ),
    )


def _alpha(model: JobModel) -> NDArray[np.float64]:
    return np.array([s.attention_fraction for s in model.stages])[:, None]

"""What the timeline runs on: per-stage phase times and every process group, laid out on a stage-major grid.

Why it exists: the timeline must not think about the plan's vocabulary (purposes, windows, spans) or about rank
arithmetic. This module turns a :class:`~meshscope.plan.Plan` (or explicit :class:`Phases`) and a placement into:

* the **grid**: ranks as a ``(pp, n)`` array, row = pipeline stage, column = the rank's position among its stage's
  ranks in rank order. A rank's pipeline neighbours sit in the same column of the neighbouring rows, and every
  process group of a non-pipeline axis lies inside one row, with the same column pattern in every row;
* :class:`GroupKind`: the groups of one kind (``tp``, ``dp``, ``dp_cp``, ``edp``, ``etp``, ``ep``, ``cp``,
  ``pp_embedding``) with their SDK ids (``"<name>:<first rank>"``), sizes, and links (NVLink or network);
* :class:`Item`: one plan collective, sized per group (bytes / (link bandwidth x link efficiency), as the planner
  does, but per group rather than for the worst group) and placed: inside every forward/backward pass (tp, cp, ep),
  before or after a pass (dp), once per step (tied embeddings);
* per stage: forward/backward/optimizer seconds, attention share, tokens and memory for the records' stats.

It never loops over ranks (only over stages, group kinds and collectives); building the model of a 131,072-rank job
takes well under a second. It must not simulate (that is :mod:`meshscope.simulation.timeline`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from meshscope.errors import SpecError
from meshscope.plan import CollectiveOp, stage_compute
from meshscope.records import OP_CODE
from meshscope.topology import Link, MeshAxis

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from meshscope.jobs import JobSpec
    from meshscope.plan import CollectivePlan, Plan, PlanAssumptions, StagePlan
    from meshscope.simulation.scenarios import Phases
    from meshscope.topology import Placement

MS = 1e-3
"""Seconds per millisecond."""
_INSTANT = 1e30
"""Bandwidth, bytes/s, standing for "no transfer time"."""


class Slot(Enum):
    """Where in the step a collective runs."""

    IN_FORWARD = "in every forward pass"
    IN_BACKWARD = "in every backward pass"
    BEFORE_FORWARD = "before forward passes (parameter all-gather)"
    BEFORE_BACKWARD = "before backward passes (ZeRO-3 parameter all-gather)"
    AFTER_BACKWARD = "after backward passes (gradient reduction)"
    STEP_END = "once, after the gradient reduction (tied embeddings)"


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupKind:
    """The process groups of one kind on the grid."""

    name: str
    """SDK name: the id of a group is ``"<name>:<first member rank>"``."""
    axis: MeshAxis
    """Axis its collectives are recorded under."""
    size: int
    """Members per group."""
    cols: NDArray[np.intp]
    """``(groups per stage, size)``: member columns of each group, the same in every row."""
    group_of_col: NDArray[np.intp]
    """``(n,)``: the group (row of ``cols``) each column belongs to."""
    codes: NDArray[np.int32]
    """``(pp, groups per stage)``: code of each group in :attr:`Grid.group_names`."""
    network: NDArray[np.bool_]
    """``(pp, groups per stage)``: whether the group spans more than one NVLink domain (its traffic crosses the
    network)."""
    rows: tuple[int, ...]
    """Stages that have these groups (``pp_embedding``: the first and the last; the others: all)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Stream:
    """Point-to-point messages from one stage to another (pipeline) or around a ring (context parallel)."""

    codes: NDArray[np.int32]
    """``(n,)``: code of each column's stream id ``"<axis>:<src>-<dst>"`` in :attr:`Grid.group_names`."""
    peer_cols: NDArray[np.intp]
    """``(n,)``: the column of the other side (pipeline: the same column)."""
    network: NDArray[np.bool_]
    """``(n,)``: whether the message crosses the network."""
    src_nodes: NDArray[np.int64]
    """``(n,)``: node of the sender."""
    dst_nodes: NDArray[np.int64]
    """``(n,)``: node of the receiver."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Item:
    """One kind of collective of one stage, sized and placed."""

    group: GroupKind
    """Where it runs."""
    op: int
    """Record op code (:data:`meshscope.records.OP_CODE`)."""
    p2p: bool
    """Recorded as point-to-point (the context-parallel ring) rather than as a collective."""
    slot: Slot
    """Where in the step."""
    instances: float
    """Plan instances per slot occurrence (may be fractional: they are aggregated into one interval)."""
    once: bool
    """Once per step (the first forward pass or the last backward pass of the stage) rather than in every pass."""
    message_bytes: int
    """Bytes of one plan instance (``message_bytes``)."""
    seconds_nvlink: float
    """Seconds of one plan instance for a group inside one NVLink domain."""
    seconds_network: float
    """Seconds of one plan instance for a group that crosses the network."""
    hidden_fraction: float
    """Fraction of it the plan expects to hide behind compute (1 - exposed / expected)."""
    token_scaled: bool
    """Whether its bytes grow with the tokens of the replica (activations), under a data imbalance."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTimes:
    """One pipeline stage's phase times (seconds, on one GPU, before faults) and its record stats."""

    forward_s: float
    """Forward of one micro-batch (all model chunks)."""
    backward_s: float
    """Backward of one micro-batch, recompute included."""
    optimizer_s: float
    """Optimizer step."""
    attention_fraction: float
    """Share of forward + backward spent in the attention core (grows k² under a data imbalance)."""
    attention_s: float
    """Attention-core time of a step (for ``stats.attention_us``)."""
    memory_bytes: int
    """Peak memory (``stats.peak_memory_bytes``)."""
    activation_bytes: int
    """Its activation part (grows k x under a data imbalance)."""
    items: tuple[Item, ...]
    """Collectives, in the order they run inside a slot."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Grid:
    """The job on the stage-major grid."""

    ranks: NDArray[np.int64]
    """``(pp, n)``: global rank at each (stage, column)."""
    node: NDArray[np.int64]
    """``(world,)``: node of each rank."""
    group_names: list[str]
    """Every group and stream id; codes index it."""
    by_plan_group: dict[str, GroupKind]
    """Group kinds by the plan's group name (``tp``, ``dp-cp``, ``edp``, ``pp-embedding``, ...)."""
    pp_forward: dict[tuple[int, int], Stream]
    """Pipeline streams by (source stage, destination stage)."""
    cp_ring: dict[int, Stream]
    """Context-parallel ring streams by stage (receive from the previous member of the ring)."""

    @property
    def stages(self) -> int:
        """Pipeline stages (rows)."""
        return int(self.ranks.shape[0])

    @property
    def columns(self) -> int:
        """Ranks per stage."""
        return int(self.ranks.shape[1])


@dataclass(frozen=True, slots=True, kw_only=True)
class JobModel:
    """Everything the timeline needs about a job."""

    spec: JobSpec
    plan: Plan
    placement: Placement
    grid: Grid
    stages: tuple[StageTimes, ...]
    micro_batches: int
    """``m``."""
    chunks: int
    """Model chunks per stage (``vpp`` under the interleaved schedule, else 1)."""
    pp_message_bytes: int
    """Bytes of one pipeline message (0 without a pipeline)."""
    pp_seconds_nvlink: float
    """Seconds of one pipeline message over NVLink."""
    pp_seconds_network: float
    """Seconds of one pipeline message over the network."""
    data_s: float
    """Loader time per step."""
    checkpoint_s: float
    """Baseline checkpoint length (``phases.checkpoint_ms``), 0 for none."""
    checkpoint_every: int
    """Its period in steps (0: none)."""
    tokens: int
    """Tokens one rank's loader reads per step (``b·s·m / cp``)."""
    sequences: int
    """Sequences per rank per step (``b·m``)."""
    sequence_length: int
    """Tokens per sequence."""

    @property
    def p2p_bandwidth_bytes_per_s(self) -> dict[str, float]:
        """Effective pipeline bandwidth per link, for :func:`meshscope.analysis.breakdown.break_down`."""

        def rate(seconds: float) -> float:
            # A transfer given as 0 ms (phases.pp_ms) is instantaneous: any bandwidth that rounds it to 0 µs.
            return self.pp_message_bytes / seconds if seconds > 0 and self.pp_message_bytes > 0 else _INSTANT

        return {Link.NVLINK.value: rate(self.pp_seconds_nvlink), Link.NETWORK.value: rate(self.pp_seconds_network)}


# ==================================================================================================== the grid


def _grid_of(spec: JobSpec, placement: Placement, plan: Plan) -> Grid:
    layout = spec.layout
    coords = layout.coords_array()
    pp_of_rank = coords[MeshAxis.PP]
    order = np.argsort(pp_of_rank, kind="stable")
    ranks = order.reshape(layout.pp, -1).astype(np.int64)
    col_of_rank = np.empty(layout.world_size, dtype=np.intp)
    col_of_rank[ranks] = np.arange(ranks.shape[1])[None, :]
    domain = placement.domain_of_rank()
    names: list[str] = []
    kinds: dict[str, GroupKind] = {}
    wanted = {c.group for s in plan.stages for c in s.collectives}
    for plan_group, (name, axis, groups) in _group_sources(spec).items():
        if plan_group in wanted:
            kinds[plan_group] = _kind(
                name,
                axis=axis,
                groups=groups,
                pp_of_rank=pp_of_rank,
                col_of_rank=col_of_rank,
                domain=domain,
                names=names,
                pp=layout.pp,
            )
    pp_forward: dict[tuple[int, int], Stream] = {}
    if layout.pp > 1:
        pairs = [(r, r + 1) for r in range(layout.pp - 1)]
        if plan.schedule.value == "interleaved":
            pairs.append((layout.pp - 1, 0))
        for src, dst in pairs:
            for a, b in ((src, dst), (dst, src)):
                if (a, b) not in pp_forward:
                    pp_forward[a, b] = _stream(
                        "pp",
                        src=ranks[a],
                        dst=ranks[b],
                        peer_cols=np.arange(ranks.shape[1]),
                        placement=placement,
                        names=names,
                    )
    cp_ring: dict[int, Stream] = {}
    if "cp" in kinds:
        cp = kinds["cp"]
        prev = np.empty(ranks.shape[1], dtype=np.intp)
        prev[cp.cols] = np.roll(cp.cols, 1, axis=1)
        for r in range(layout.pp):
            cp_ring[r] = _stream(
                "cp", src=ranks[r][prev], dst=ranks[r], peer_cols=prev, placement=placement, names=names
            )
    return Grid(
        ranks=ranks,
        node=placement.node_of_rank,
        group_names=names,
        by_plan_group=kinds,
        pp_forward=pp_forward,
        cp_ring=cp_ring,
    )


def _group_sources(spec: JobSpec) -> dict[str, tuple[str, MeshAxis, NDArray[np.int64]]]:
    """Plan group -> (SDK name, record axis, groups as ``(n_groups, size)`` ranks)."""
    layout = spec.layout
    out: dict[str, tuple[str, MeshAxis, NDArray[np.int64]]] = {}
    if layout.tp > 1:
        out["tp"] = ("tp", MeshAxis.TP, layout.groups(MeshAxis.TP))
    if layout.cp > 1:
        out["cp"] = ("cp", MeshAxis.CP, layout.groups(MeshAxis.CP))
    if layout.ep > 1:
        out["ep"] = ("ep", MeshAxis.EP, layout.groups(MeshAxis.EP))
    if layout.expert_tp > 1:
        out["etp"] = ("etp", MeshAxis.TP, layout.groups(MeshAxis.TP, expert=True))
    if spec.model.is_moe and layout.expert_tp * layout.ep > 1:  # the token dispatcher's count exchange
        out["tp-ep"] = ("tp_ep", MeshAxis.EP, layout.groups(MeshAxis.TP, MeshAxis.EP, expert=True))
    if layout.dp > 1 or layout.cp > 1:
        dense = layout.groups(MeshAxis.DP, MeshAxis.CP) if layout.cp > 1 else layout.groups(MeshAxis.DP)
        out["dp-cp"] = ("dp_cp" if layout.cp > 1 else "dp", MeshAxis.DP, dense)
    if layout.expert_dp > 1:
        out["edp"] = ("edp", MeshAxis.DP, layout.groups(MeshAxis.DP, expert=True))
    if layout.pp > 1:
        out["pp-embedding"] = ("pp_embedding", MeshAxis.PP, layout.groups(MeshAxis.PP)[:, [0, layout.pp - 1]])
    return out


def _kind(
    name: str,
    *,
    axis: MeshAxis,
    groups: NDArray[np.int64],
    pp_of_rank: NDArray[np.int64],
    col_of_rank: NDArray[np.intp],
    domain: NDArray[np.int64],
    names: list[str],
    pp: int,
) -> GroupKind:
    first = groups.min(axis=1)
    base = len(names)
    names.extend(f"{name}:{r}" for r in first.tolist())
    codes = np.arange(base, base + groups.shape[0], dtype=np.int32)
    network = (domain[groups] != domain[groups[:, :1]]).any(axis=1)
    if name == "pp_embedding":
        # One group per column, spanning the first and the last stage.
        order = np.argsort(col_of_rank[groups[:, 0]], kind="stable")
        cols = np.arange(groups.shape[0], dtype=np.intp)[:, None]
        return GroupKind(
            name=name,
            axis=axis,
            size=2,
            cols=cols,
            group_of_col=np.arange(groups.shape[0], dtype=np.intp),
            codes=np.broadcast_to(codes[order], (pp, groups.shape[0])).copy(),
            network=np.broadcast_to(network[order], (pp, groups.shape[0])).copy(),
            rows=(0, pp - 1),
        )
    stage = pp_of_rank[groups[:, 0]]
    order = np.argsort(stage, kind="stable")
    per_stage = groups.shape[0] // pp
    cols = col_of_rank[groups[order]].reshape(pp, per_stage, groups.shape[1])
    if not (cols == cols[:1]).all():  # pragma: no cover - the layout guarantees it
        raise AssertionError(f"{name} groups do not repeat across pipeline stages")
    group_of_col = np.empty(cols.shape[2] * per_stage, dtype=np.intp)
    group_of_col[cols[0]] = np.arange(per_stage)[:, None]
    return GroupKind(
        name=name,
        axis=axis,
        size=int(groups.shape[1]),
        cols=cols[0],
        group_of_col=group_of_col,
        codes=codes[order].reshape(pp, per_stage),
        network=network[order].reshape(pp, per_stage),
        rows=tuple(range(pp)),
    )


def _stream(
    axis: str,
    *,
    src: NDArray[np.int64],
    dst: NDArray[np.int64],
    peer_cols: NDArray[np.intp],
    placement: Placement,
    names: list[str],
) -> Stream:
    base = len(names)
    names.extend(f"{axis}:{a}-{b}" for a, b in zip(src.tolist(), dst.tolist(), strict=True))
    domain = placement.domain_of_rank()
    return Stream(
        codes=np.arange(base, base + src.size, dtype=np.int32),
        peer_cols=peer_cols,
        network=domain[src] != domain[dst],
        src_nodes=placement.node_of_rank[src],
        dst_nodes=placement.node_of_rank[dst],
    )


# ==================================================================================================== collectives


def _op_code(op: CollectiveOp) -> int:
    return OP_CODE["recv"] if op is CollectiveOp.SEND_RECV else OP_CODE[op.value.replace("-", "_")]


_IN_LAYER = ("tp", "etp", "cp", "ep", "tp-ep")


def _forward_share(c: CollectivePlan, cp: int) -> float:
    """Share of an in-layer collective's instances that run in forward passes (the rest run in backward).

    Backward only: what the plan names ``(backward)`` (sequence parallelism's re-gather for weight gradients,
    context parallelism's reduce-scatter of dK/dV under ``all_gather``) and the ``p2p`` ring's middle backward steps.
    The ``p2p`` ring's single-size messages: ``cp - 1`` forward steps of ``cp + 1`` (plan.comms._cp_drafts). The rest
    (tp, etp, ep; cp ``all_gather``'s K/V gathers, ``a2a``): as many in backward as in forward.
    """
    if c.purpose.endswith("(backward)") or (c.group == "cp" and "middle backward" in c.purpose):
        return 0.0
    if c.group == "cp" and c.op is CollectiveOp.SEND_RECV:
        return (cp - 1) / (cp + 1)
    return 0.5


def _slots(c: CollectivePlan, m: int, v: int, cp: int) -> list[tuple[Slot, float, bool]]:
    """Where a plan collective runs and how many of its instances each occurrence of the slot carries."""
    passes = m * v
    backward_only = c.purpose.endswith("(backward)")
    if c.group in _IN_LAYER:
        forward_share = _forward_share(c, cp)
        if forward_share == 0.0:
            return [(Slot.IN_BACKWARD, c.count_per_step / passes, False)]
        return [
            (Slot.IN_FORWARD, c.count_per_step * forward_share / passes, False),
            (Slot.IN_BACKWARD, c.count_per_step * (1 - forward_share) / passes, False),
        ]
    if c.group == "pp-embedding":
        return [(Slot.STEP_END, float(c.count_per_step), True)]
    # Data parallel: gradients are reduced after backward; weights are gathered before the pass that needs them.
    if c.op is CollectiveOp.ALL_GATHER:
        slot = Slot.BEFORE_BACKWARD if backward_only else Slot.BEFORE_FORWARD
    else:
        slot = Slot.AFTER_BACKWARD
    if c.count_per_step == 1:
        return [(slot, 1.0, True)]
    return [(slot, c.count_per_step / passes, False)]


# ==================================================================================================== the model


def build_model(spec: JobSpec, plan: Plan, placement: Placement, phases: Phases) -> JobModel:
    """The model of ``spec`` as ``plan`` expects it to run on ``placement``, with ``phases`` overriding the plan.

    Raises:
        SpecError: for a phase override of an axis that has no collectives in this job (``phases.tp_ms``), naming
            the field.
    """
    layout, training = spec.layout, spec.training
    m = plan.micro_batches
    grid = _grid_of(spec, placement, plan)
    overrides = _overrides(plan, phases)
    stages = tuple(
        _stage_times(spec, plan, stage, grid=grid, phases=phases, overrides=overrides) for stage in plan.stages
    )
    pp_plan = next((c for stage in plan.stages for c in stage.collectives if c.group == "pp"), None)
    pp_bytes, pp_nvl, pp_net = 0, 0.0, 0.0
    if pp_plan is not None:
        pp_bytes = pp_plan.message_bytes
        pp_nvl = pp_bytes / _rate(spec, plan.assumptions, Link.NVLINK)
        pp_net = pp_bytes / _rate(spec, plan.assumptions, Link.NETWORK)
        if phases.pp_ms is not None:
            pp_nvl = pp_net = phases.pp_ms * MS
    b, s = training.micro_batch_size, spec.model.seq_length
    return JobModel(
        spec=spec,
        plan=plan,
        placement=placement,
        grid=grid,
        stages=stages,
        micro_batches=m,
        chunks=layout.vpp if plan.schedule.value == "interleaved" else 1,
        pp_message_bytes=pp_bytes,
        pp_seconds_nvlink=pp_nvl,
        pp_seconds_network=pp_net,
        # The loader: the phase override, else the plan's (a calibrated ``data_wait_seconds``; 0 by default).
        data_s=phases.data_ms * MS if phases.data_ms is not None else plan.assumptions.data_wait_seconds,
        checkpoint_s=(phases.checkpoint_ms or 0.0) * MS,
        checkpoint_every=phases.checkpoint_every or 0,
        tokens=b * s * m // layout.cp,
        sequences=b * m,
        sequence_length=s,
    )


def _overrides(plan: Plan, phases: Phases) -> dict[str, float | None]:
    """Axis -> the transfer time ``phases`` gives it, ms; checks each named axis has collectives."""
    layout = plan.layout
    overrides = {"dp": phases.dp_ms, "tp": phases.tp_ms, "cp": phases.cp_ms, "ep": phases.ep_ms}
    for axis, value in overrides.items():
        if value is not None and not any(c.axis == axis for s in plan.stages for c in s.collectives):
            label = "dp_ms (allreduce_ms)" if axis == "dp" else f"{axis}_ms"
            raise SpecError(
                f"phases.{label}", f"this job has no {axis} collectives ({layout.describe()}); drop the override"
            )
    if phases.pp_ms is not None and layout.pp == 1:
        raise SpecError("phases.pp_ms", f"this job has no pipeline ({layout.describe()}); drop the override")
    return overrides


def _stage_times(
    spec: JobSpec,
    plan: Plan,
    stage: StagePlan,
    *,
    grid: Grid,
    phases: Phases,
    overrides: dict[str, float | None],
) -> StageTimes:
    """One stage's phase times and collectives (per-group sizes, slots, hidden fractions)."""
    m = plan.micro_batches
    v = spec.layout.vpp if plan.schedule.value == "interleaved" else 1
    assumptions = plan.assumptions
    indices = [i for start, stop in stage.layer_ranges for i in range(start, stop)]
    compute = stage_compute(
        spec.model,
        spec.layout,
        spec.training,
        spec.hardware,
        assumptions,
        pp_rank=stage.pp_rank,
        layer_indices=indices,
        micro_batches=m,
        sequence_parallel=spec.parallelism.sequence_parallel,
    )
    plan_pass = stage.forward_seconds_per_microbatch + stage.backward_seconds_per_microbatch
    attention_fraction = compute.attention_core_seconds_per_microbatch / plan_pass if plan_pass > 0 else 0.0
    collectives = [c for c in stage.collectives if c.group != "pp"]
    # Plan seconds per axis: per micro-batch (tp, cp, ep) or per step (dp), the unit of the phase overrides.
    totals: dict[str, float] = {}
    for c in collectives:
        totals[c.axis] = totals.get(c.axis, 0.0) + c.seconds_per_instance * c.count_per_step / (
            1 if c.axis == "dp" else m
        )
    nvl, net = (_rate(spec, assumptions, link) for link in (Link.NVLINK, Link.NETWORK))
    items: list[Item] = []
    for c in collectives:
        target = overrides.get(c.axis)
        ratio = target * MS / totals[c.axis] if target is not None and totals[c.axis] > 0 else 1.0
        # Per-group seconds: the plan's bytes over each group's own link (the plan sizes every group by the worst
        # one): seconds_per_instance x (the plan's effective bandwidth / this link's).
        plan_rate = c.bandwidth_bytes_per_s * assumptions.link_efficiency(c.link.value)
        expected = c.expected_seconds_per_step
        hidden = 1.0 - c.exposed_seconds_per_step / expected if expected > 0 else 0.0
        items.extend(
            Item(
                group=grid.by_plan_group[c.group],
                op=_op_code(c.op),
                p2p=c.op is CollectiveOp.SEND_RECV,
                slot=slot,
                instances=per,
                once=once,
                message_bytes=c.message_bytes,
                seconds_nvlink=c.seconds_per_instance * plan_rate / nvl * ratio,
                seconds_network=c.seconds_per_instance * plan_rate / net * ratio,
                hidden_fraction=min(max(hidden, 0.0), 1.0),
                token_scaled=c.group in {"tp", "etp", "cp"},
            )
            for slot, per, once in _slots(c, m, v, spec.parallelism.layout.cp)
            if per > 0
        )
    return StageTimes(
        forward_s=stage.forward_seconds_per_microbatch if phases.forward_ms is None else phases.forward_ms * MS,
        backward_s=stage.backward_seconds_per_microbatch if phases.backward_ms is None else phases.backward_ms * MS,
        optimizer_s=stage.step_time.optimizer_seconds if phases.optimizer_ms is None else phases.optimizer_ms * MS,
        attention_fraction=min(max(attention_fraction, 0.0), 1.0),
        attention_s=m * compute.attention_core_seconds_per_microbatch,
        memory_bytes=stage.memory.total_bytes,
        activation_bytes=stage.memory.activations_bytes,
        items=_merged(items),
    )


def _merged(items: list[Item]) -> tuple[Item, ...]:
    """One item per (group, op, slot).

    What runs together in one place is recorded as one interval of the total bytes and time (e.g. sequence
    parallelism's backward re-gather joins the backward all-gather).
    """
    merged: dict[tuple[str, int, Slot, bool], list[Item]] = {}
    for item in items:
        merged.setdefault((item.group.name, item.op, item.slot, item.once), []).append(item)
    out = []
    for group in merged.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        nvlink = sum(it.seconds_nvlink * it.instances for it in group)
        network = sum(it.seconds_network * it.instances for it in group)
        hidden = sum(it.hidden_fraction * it.seconds_nvlink * it.instances for it in group)
        out.append(
            Item(
                group=group[0].group,
                op=group[0].op,
                p2p=group[0].p2p,
                slot=group[0].slot,
                instances=1.0,
                once=group[0].once,
                message_bytes=round(sum(it.message_bytes * it.instances for it in group)),
                seconds_nvlink=nvlink,
                seconds_network=network,
                hidden_fraction=hidden / nvlink if nvlink > 0 else 0.0,
                token_scaled=group[0].token_scaled,
            )
        )
    return tuple(out)


def _rate(spec: JobSpec, assumptions: PlanAssumptions, link: Link) -> float:
    """Effective bytes/s of one GPU over ``link`` (nominal x the plan's link efficiency)."""
    return spec.hardware.link_bandwidth_bytes_per_s(link.value) * assumptions.link_efficiency(link.value)

"""``plan_job``: a job spec in, a plan out (memory per stage, collectives per axis, FLOPs, bubble, expected time).

Exists as the one entry point the CLI, the operator's admission webhook and the cost table call. It validates what
only the planner can check (batch arithmetic, the layer split, that the placement fits the layout), puts the
per-stage pieces of :mod:`~meshscope.plan.memory`, :mod:`~meshscope.plan.flops`, :mod:`~meshscope.plan.timing` and
:mod:`~meshscope.plan.comms` together, and collects the findings. It works per pipeline stage (one representative
GPU each) and on vectorised group spans, never per rank: a 16,384-GPU plan takes milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from meshscope.errors import PlanError
from meshscope.jobs import CpCommType, active_params, total_params
from meshscope.plan.assumptions import PlanAssumptions
from meshscope.plan.comms import CollectivePlan, collective_spans, hybrid_spans, stage_collectives
from meshscope.plan.findings import Finding, StageSummary, collect_findings
from meshscope.plan.flops import StepFlops, step_flops
from meshscope.plan.kernels import compute_classes
from meshscope.plan.memory import (
    ActivationBreakdown,
    MemoryBreakdown,
    ModelStateBytes,
    StageParams,
    memory_breakdown,
    model_state_bytes,
    resolve_schedule,
    resting_state_bytes,
    stage_activations,
    stage_layer_ranges,
    stage_params,
    state_bytes_per_param,
)
from meshscope.plan.timing import (
    ExpectedStepTime,
    bubble_fraction,
    contended,
    grad_accumulation_bytes,
    grad_accumulation_seconds,
    optimizer_seconds,
    peak_flops_per_s,
    stage_compute,
)
from meshscope.topology import AXES, Placement

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from meshscope.jobs import JobSpec, PipelineSchedule, TrainingConfig
    from meshscope.plan.kernels import ComputeClass, StageKernels
    from meshscope.plan.memory import StateBytesPerParam
    from meshscope.plan.timing import StageCompute
    from meshscope.topology import GroupSpan, HardwareConfig, ParallelLayout


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePlan:
    """One GPU of one pipeline stage: what it holds, what it computes, what it sends."""

    pp_rank: int
    """Pipeline rank."""
    layer_ranges: tuple[tuple[int, int], ...]
    """Transformer layers ``[start, stop)`` of each of its model chunks (``vpp`` of them)."""
    params: StageParams
    """Parameters on this GPU, by bucket."""
    memory: MemoryBreakdown
    """Peak memory of this GPU."""
    resting_state: ModelStateBytes
    """Weights, gradients and optimizer state this GPU keeps between steps (sharding only, no gathered buffers)."""
    activations: ActivationBreakdown
    """Activation memory in detail."""
    hbm_bytes: int
    """HBM usable by the model (``hardware.usable_hbm_bytes``)."""
    forward_seconds_per_microbatch: float
    """Expected forward time of one micro-batch on this GPU (for the simulator)."""
    backward_seconds_per_microbatch: float
    """Expected backward time of one micro-batch, recompute included (for the simulator)."""
    model_flops_per_microbatch: float
    """Model FLOPs (forward + backward) of one micro-batch on this GPU."""
    hardware_flops_per_microbatch: float
    """Model FLOPs plus recomputation of one micro-batch on this GPU."""
    collectives: tuple[CollectivePlan, ...]
    """Every collective this GPU runs in a step."""
    step_time: ExpectedStepTime
    """Expected step time of this stage (bubble from the slowest stage)."""
    kernels: StageKernels | None = None
    """The roofline per operation class behind the compute seconds; ``None`` under the flat model."""
    compute_basis: tuple[int, float, float | None, float] = (1, 1.0, None, 0.0)
    """``(micro-batches, peak FLOP/s, flat efficiency, hardware FLOPs per micro-batch)``: what
    :attr:`compute_classes` needs besides ``kernels``."""
    grad_accumulation: tuple[float, float] = (0.0, 0.0)
    """``(HBM bytes, seconds)`` of one micro-batch's unfused gradient accumulation on this GPU, part of
    ``backward_seconds_per_microbatch`` (0 when the weight-gradient GEMMs accumulate, the default)."""

    @property
    def compute_classes(self) -> tuple[ComputeClass, ...]:
        """Per operation class: FLOPs, seconds and implied efficiency per step (one flat row under the flat model)."""
        m, peak, flat, hardware_flops = self.compute_basis
        return compute_classes(
            self.kernels,
            micro_batches=m,
            peak_flops_per_s=peak,
            flat_efficiency=flat,
            hardware_flops_per_microbatch=hardware_flops,
            grad_accumulation=self.grad_accumulation,
        )

    @property
    def layers(self) -> int:
        """Transformer layers on this stage (all chunks)."""
        return sum(stop - start for start, stop in self.layer_ranges)

    @property
    def headroom_bytes(self) -> int:
        """``hbm_bytes - memory.total_bytes``; negative when the stage does not fit."""
        return self.hbm_bytes - self.memory.total_bytes

    def to_dict(self) -> dict[str, object]:
        """JSON form: ``{pp_rank, layers, params, memory_bytes, hbm_bytes, headroom_bytes, ...}``."""
        return {
            "pp_rank": self.pp_rank,
            "layers": self.layers,
            "layer_ranges": [list(r) for r in self.layer_ranges],
            "params": self.params.total,
            "params_by_bucket": {
                "tp_sharded": self.params.tp_sharded,
                "replicated": self.params.replicated,
                "routed_experts": self.params.experts,
                "embedding": self.params.embedding,
                "output": self.params.output,
            },
            "memory_bytes": self.memory.to_dict(),
            "resting_state_bytes": {
                "weights": self.resting_state.weights_bytes,
                "gradients": self.resting_state.gradients_bytes,
                "optimizer": self.resting_state.optimizer_bytes,
            },
            "hbm_bytes": self.hbm_bytes,
            "headroom_bytes": self.headroom_bytes,
            "in_flight_microbatches": self.activations.in_flight_microbatches,
            "forward_seconds_per_microbatch": self.forward_seconds_per_microbatch,
            "backward_seconds_per_microbatch": self.backward_seconds_per_microbatch,
            "model_flops_per_microbatch": self.model_flops_per_microbatch,
            "hardware_flops_per_microbatch": self.hardware_flops_per_microbatch,
            "expected_step_seconds": self.step_time.to_dict(),
            "compute_classes": [c.to_dict() for c in self.compute_classes],
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """What a job will hold, send, compute and cost per step, before it runs."""

    world_size: int
    """GPUs."""
    layout: ParallelLayout
    """The parallel layout."""
    micro_batches: int
    """Micro-batches per pipeline per step ``m``."""
    schedule: PipelineSchedule
    """The pipeline schedule that runs."""
    stages: tuple[StagePlan, ...]
    """Every pipeline stage, in order."""
    collectives: tuple[CollectivePlan, ...]
    """One entry per kind of collective (axis, group, op, purpose), on the stage where it moves the most bytes."""
    flops: StepFlops
    """FLOPs per step under the three conventions."""
    bubble_fraction: float
    """Pipeline bubble as a fraction of ideal compute."""
    expected_step_time: ExpectedStepTime
    """Expected step time of the slowest stage, by category."""
    findings: tuple[Finding, ...]
    """Findings, errors first."""
    assumptions: PlanAssumptions
    """The assumptions behind every expected second."""
    peak_flops_per_s: float
    """Dense peak FLOP/s per GPU at the training precision."""
    total_params: int
    """Parameters of the whole model (every expert)."""
    active_params: int
    """Parameters one token passes through (``top_k`` of the routed experts)."""
    sequence_parallel: bool = False
    """Whether the plan is for Megatron sequence parallelism."""
    cp_comm_type: CpCommType = CpCommType.P2P
    """How the plan's context parallelism exchanges keys and values (``spec.parallelism.cpCommType``)."""

    @property
    def compute_classes(self) -> tuple[ComputeClass, ...]:
        """Operation classes of the slowest stage (the one ``expected_step_time`` is for), largest first."""
        return self.stages[self.expected_step_time.pp_rank].compute_classes

    @property
    def compute_efficiency_by_class(self) -> dict[str, float | None]:
        """Implied fraction of peak per operation class of the slowest stage (``None``: element-wise, no FLOPs)."""
        return {c.op: c.efficiency for c in self.compute_classes}

    @property
    def flops_per_step(self) -> float:
        """Headline model FLOPs per step (causal attention halved unless the assumptions say otherwise)."""
        return self.flops.model_flops

    @property
    def expected_mfu(self) -> float:
        """Model FLOPs utilisation at the expected step time: ``flops_per_step / (world · peak · step)``."""
        return self.flops.model_flops / (
            self.world_size * self.peak_flops_per_s * self.expected_step_time.total_seconds
        )

    def to_dict(self) -> dict[str, object]:
        """The plan as JSON-ready data: base units (bytes, seconds, FLOPs), keys documented in docs/planner.md."""
        layout = {a.value: self.layout.degree(a) for a in AXES}
        return {
            "world_size": self.world_size,
            "total_params": self.total_params,
            "active_params": self.active_params,
            "layout": {**layout, "vpp": self.layout.vpp, "etp": self.layout.expert_tp},
            "sequence_parallel": self.sequence_parallel,
            "cp_comm_type": self.cp_comm_type.value,
            "micro_batches": self.micro_batches,
            "schedule": self.schedule.value,
            "stages": [s.to_dict() for s in self.stages],
            "collectives": [c.to_dict() for c in self.collectives],
            "flops_per_step": self.flops.model_flops,
            "flops": self.flops.to_dict(),
            "bubble_fraction": self.bubble_fraction,
            "expected_step_seconds": self.expected_step_time.to_dict(),
            "expected_mfu": self.expected_mfu,
            "compute_model": "flat" if self.assumptions.flat_compute else "roofline per operation class",
            "compute_classes": [c.to_dict() for c in self.compute_classes],
            "findings": [f.to_dict() for f in self.findings],
            "assumptions": self.assumptions.to_dict(),
        }


def _check_batch(training: TrainingConfig, layout: ParallelLayout) -> int:
    b, gbs, dp = training.micro_batch_size, training.global_batch_size, layout.dp
    if b < 1 or gbs < 1:
        raise PlanError(f"micro_batch_size ({b}) and global_batch_size ({gbs}) must be >= 1")
    if gbs % (b * dp):
        raise PlanError(
            f"global_batch_size {gbs} is not a multiple of micro_batch_size·dp = {b}·{dp} = {b * dp}; "
            f"micro-batches per step would be {gbs / (b * dp):g}"
        )
    shard = training.dp_shard
    if shard is not None and (shard < 1 or (shard < dp and dp % shard)):
        raise PlanError(
            f"dp_shard {shard} does not divide dp {dp}: hybrid sharding splits the sharded state over dp_shard "
            f"consecutive data-parallel ranks; use a divisor of {dp}, or leave dp_shard out (all of dp)"
        )
    return training.micro_batches(dp)


IN_PATH_AXES = ("tp", "cp", "ep")
"""Axes whose collectives run inside every micro-batch's forward and backward (a pipeline stage waits for them)."""


def _in_path_seconds(collectives: Sequence[CollectivePlan], assumptions: PlanAssumptions) -> float:
    """Exposed seconds per step of a stage's in-path collectives (tp, cp, ep), with their expected sync wait."""
    return sum(
        c.exposed_seconds_per_step + c.count_per_step * assumptions.sync_wait_per_collective(c.axis)
        for c in collectives
        if c.axis in IN_PATH_AXES
    )


def _bubble_seconds(paths: Sequence[float], fraction: float) -> float:
    """The slowest stage's pipeline bubble per step, from every stage's path (compute and in-path comm per step).

    Narayanan et al. 2021 §2.2 charge ``(p - 1)/m`` (÷ ``vpp`` interleaved) of a stage's ideal time, for equal
    stages. With unequal ones the slowest stage waits while the micro-batches fill and drain through the *other*
    stages, once each: the makespan of ``m`` equal jobs through a ``p``-stage flow shop is ``Σ_k t_k + (m - 1)
    max_k t_k`` (t_k a micro-batch's time on stage k), so the slowest stage idles ``Σ_{k≠slowest} t_k``. With
    ``t_k = path_k / m`` that is ``fraction ÷ (p - 1) x Σ_{k≠slowest} path_k``: equal stages give ``fraction x path``
    as before, and a last stage slowed by the logits does not charge its own extra work to the bubble.
    """
    if len(paths) < 2 or fraction == 0.0:
        return 0.0
    return fraction / (len(paths) - 1) * (sum(paths) - max(paths))


def _with_grad_accumulation(
    compute: StageCompute,
    state: ModelStateBytes,
    per_param: StateBytesPerParam,
    hardware: HardwareConfig,
    assumptions: PlanAssumptions,
) -> tuple[StageCompute, tuple[float, float]]:
    """``compute`` with the unfused gradient accumulation in its backward, and that pass's ``(bytes, seconds)``."""
    seconds = grad_accumulation_seconds(state, per_param, hardware, assumptions) * assumptions.cpu_compute_time_scale
    if seconds <= 0:
        return compute, (0.0, 0.0)
    backward = compute.backward_seconds_per_microbatch + seconds
    return replace(compute, backward_seconds_per_microbatch=backward), (
        grad_accumulation_bytes(state, per_param, assumptions),
        seconds,
    )


def plan_job(
    spec: JobSpec,
    *,
    placement: Placement | None = None,
    assumptions: PlanAssumptions | None = None,
    spans: Mapping[str, GroupSpan] | None = None,
) -> Plan:
    """Plan a training job: memory per stage, every collective, FLOPs, bubble, expected step time and findings.

    Args:
        spec: the job (model, layout, training settings, hardware).
        placement: where each rank runs; default ``Placement.for_hardware(world_size, spec.hardware)`` (consecutive
            ranks fill nodes, nodes fill NVLink domains).
        assumptions: efficiencies and overlap fractions; default :class:`PlanAssumptions()`.
        spans: precomputed :func:`~meshscope.plan.comms.collective_spans` of this layout (without vpp) on
            ``placement``; the layout search shares them between candidates that differ only in vpp or micro-batch.

    Returns:
        The plan.

    Raises:
        PlanError: if the hardware or placement does not match the layout's world size, the batch does not split
            into whole micro-batches, the layers do not fill every pipeline chunk, or a training setting is out of
            range (all with the numbers).
    """
    assumptions = PlanAssumptions() if assumptions is None else assumptions
    model, parallelism, training, hardware = spec.model, spec.parallelism, spec.training, spec.hardware
    layout = parallelism.layout
    world = layout.world_size
    if placement is None:
        if hardware.world_size != world:
            raise PlanError(
                f"layout {layout.describe()} needs dp·tp·pp·cp = {world} GPUs but the hardware has "
                f"nodes·gpus_per_node = {hardware.nodes}·{hardware.gpus_per_node} = {hardware.world_size}"
            )
        placement = Placement.for_hardware(world, hardware)
    elif placement.world_size != world:
        raise PlanError(f"placement has {placement.world_size} ranks but layout {layout.describe()} has {world}")
    m = _check_batch(training, layout)
    schedule = resolve_schedule(training, layout)
    given = assumptions
    bubble = bubble_fraction(layout.pp, m, vpp=layout.vpp, schedule=schedule)
    assumptions = contended(assumptions, world, bubble, layout.pp)
    ranges = stage_layer_ranges(
        model.layers,
        layout,
        embedding_counts_as_layer=parallelism.account_for_embedding_in_pipeline_split,
        loss_counts_as_layer=parallelism.account_for_loss_in_pipeline_split,
    )
    dp_shard = training.hybrid_shard(layout.dp)
    spans = dict(spans) if spans is not None else collective_spans(layout, placement, model, dp_shard=dp_shard)
    if dp_shard is not None and "dp-shard" not in spans:
        spans.update(hybrid_spans(layout, placement, dp_shard))
    per_param = state_bytes_per_param(training)
    usable = hardware.usable_hbm_bytes

    drafts = []
    for r in range(layout.pp):
        indices = [i for start, stop in ranges[r] for i in range(start, stop)]
        params = stage_params(model, layout, r, indices)
        shards = {"dense_shards": (dp_shard or layout.dp) * layout.cp, "expert_shards": layout.expert_dp}
        state = model_state_bytes(params, training, pipelined=layout.pp > 1, **shards)
        resting = resting_state_bytes(params, training, **shards)
        activations = stage_activations(
            model, parallelism, training, pp_rank=r, layer_indices=indices, micro_batches=m, schedule=schedule
        )
        compute, accumulation = _with_grad_accumulation(
            stage_compute(
                model,
                layout,
                training,
                hardware,
                assumptions,
                pp_rank=r,
                layer_indices=indices,
                micro_batches=m,
                sequence_parallel=parallelism.sequence_parallel,
            ),
            state,
            per_param,
            hardware,
            assumptions,
        )
        collectives = stage_collectives(
            model,
            parallelism,
            training,
            hardware=hardware,
            assumptions=assumptions,
            spans=spans,
            pp_rank=r,
            layer_indices=indices,
            params=params,
            compute=compute,
        )
        memory = memory_breakdown(state, activations)
        drafts.append((r, params, memory, activations, compute, collectives, state, resting, accumulation))

    fraction = bubble
    peak = peak_flops_per_s(hardware, training.precision)
    paths = [d[4].compute_seconds_per_step + _in_path_seconds(d[5], assumptions) for d in drafts]
    bubble_seconds = _bubble_seconds(paths, fraction)
    stages = []
    for r, params, memory, activations, compute, collectives, state, resting, accumulation in drafts:
        exposed = {a.value: 0.0 for a in layout.enabled_axes}
        sync: dict[str, float] = {}
        for c in collectives:
            exposed[c.axis] = exposed.get(c.axis, 0.0) + c.exposed_seconds_per_step
            wait = assumptions.sync_wait_per_collective(c.axis)
            if wait > 0 and c.group != "pp":
                sync[c.axis] = sync.get(c.axis, 0.0) + c.count_per_step * wait
        step_time = ExpectedStepTime(
            pp_rank=r,
            compute_seconds=compute.compute_seconds_per_step,
            exposed_comm_seconds=exposed,
            sync_wait_seconds=sync or None,
            bubble_seconds=bubble_seconds,
            optimizer_seconds=optimizer_seconds(state, per_param, hardware, assumptions)
            * assumptions.cpu_stage_time_scale,
            data_seconds=assumptions.data_wait_seconds,
            other_seconds=assumptions.host_overhead_seconds,
        )
        stages.append(
            StagePlan(
                pp_rank=r,
                layer_ranges=ranges[r],
                params=params,
                memory=memory,
                resting_state=resting,
                activations=activations,
                hbm_bytes=usable,
                forward_seconds_per_microbatch=compute.forward_seconds_per_microbatch,
                backward_seconds_per_microbatch=compute.backward_seconds_per_microbatch,
                model_flops_per_microbatch=compute.model_flops_per_microbatch,
                hardware_flops_per_microbatch=compute.hardware_flops_per_microbatch,
                collectives=collectives,
                step_time=step_time,
                kernels=compute.kernels,
                compute_basis=(m, peak, assumptions.compute_efficiency, compute.hardware_flops_per_microbatch),
                grad_accumulation=accumulation,
            )
        )
    critical = max(stages, key=lambda s: (s.step_time.total_seconds, -s.pp_rank))
    plan_collectives = _busiest(stages)
    findings = collect_findings(
        layout=layout,
        hardware=hardware,
        assumptions=assumptions,
        spans=spans,
        stages=[StageSummary(pp_rank=s.pp_rank, memory=s.memory, collectives=s.collectives) for s in stages],
        bubble_fraction=fraction,
        bubble_seconds=bubble_seconds,
        micro_batches=m,
        schedule=schedule,
        cp_comm_type=spec.parallelism.cp_comm_type,
        moe_without_sequence_parallel=spec.model.is_moe and layout.tp > 1 and not spec.parallelism.sequence_parallel,
    )
    return Plan(
        world_size=world,
        layout=layout,
        micro_batches=m,
        schedule=schedule,
        stages=tuple(stages),
        collectives=plan_collectives,
        flops=step_flops(model, training, causal=assumptions.causal_attention),
        bubble_fraction=fraction,
        expected_step_time=critical.step_time,
        findings=findings,
        assumptions=given,
        peak_flops_per_s=peak_flops_per_s(hardware, training.precision),
        total_params=total_params(model),
        active_params=active_params(model),
        sequence_parallel=parallelism.sequence_parallel,
        cp_comm_type=parallelism.cp_comm_type,
    )


def _busiest(stages: list[StagePlan]) -> tuple[CollectivePlan, ...]:
    """For each kind of collective, the stage where it moves the most bytes (then: the most expected seconds)."""
    best: dict[tuple[str, str, str, str], CollectivePlan] = {}
    for stage in stages:
        for c in stage.collectives:
            key = (c.axis, c.group, c.op.value, c.purpose)
            held = best.get(key)
            if held is None or (c.bytes_per_gpu_per_step, c.expected_seconds_per_step) > (
                held.bytes_per_gpu_per_step,
                held.expected_seconds_per_step,
            ):
                best[key] = c
    return tuple(best.values())

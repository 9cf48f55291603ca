"""Expected seconds per step, split into the categories of the step breakdown.

Exists to turn the planner's FLOPs and bytes into the "expected" column of the cost table: compute, exposed
communication per axis, pipeline bubble and optimizer, each from a formula and a named assumption
(:class:`~meshscope.plan.assumptions.PlanAssumptions`). It does not decide which collectives exist (that is
:mod:`meshscope.plan.comms`) and it does not simulate a schedule: the bubble is the closed form of Narayanan et al.
2021 §2.2.

Conventions (docs/planner.md, "Expected step time"):

* compute: the roofline per operation class of :mod:`meshscope.plan.kernels` (GEMMs by shape, attention core,
  element-wise work, logits), forward, backward (data and weight gradients) and recompute; with
  ``compute_efficiency`` set (the flat model), a GPU's hardware FLOPs ÷ (dense peak x ``compute_efficiency``),
  forward = 1 pass, backward = 2 passes + recompute;
* host: ``host_seconds_per_layer_pass`` x the stage's layers per micro-batch (a third forward, two thirds backward;
  0 unless calibrated), scaled by the micro-batch's tokens where calibrated at another size (:func:`host_tokens_scale`)
  and by tensor parallelism's dispatch where calibrated with or without it (:func:`host_tp_scale`);
* CPU contention (only with ``cpu_cores``, a CPU testbed): host time, sync waits and in-compute collectives stretched
  by :func:`cpu_contention` of the layout over the calibrated run's, dp's collectives and sync wait and the
  optimizer by :func:`cpu_stage_contention`'s (:func:`contended`);
* bubble: ``(pp - 1)/m`` (1F1B, GPipe) or ``(pp - 1)/(m·vpp)`` (interleaved) of a stage's compute and exposed
  in-path (tp, cp, ep) communication (what a micro-batch's forward and backward take), for unequal stages that of
  the stages the slowest one waits on (``planning._bubble_seconds``);
* gradient accumulation: none when the weight-gradient GEMMs accumulate (the default); otherwise a pass per
  micro-batch over the gradient buffer, in backward (:func:`grad_accumulation_seconds`);
* optimizer: bytes the Adam step streams through HBM ÷ (HBM bandwidth x ``hbm_efficiency``);
* data wait and host overhead: the assumptions' ``data_wait_seconds`` and ``host_overhead_seconds`` (0 unless a run
  was calibrated: no formula gives them);
* the step is the slowest stage's ``compute + exposed communication + bubble + optimizer + data + other``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from meshscope.jobs import PipelineSchedule, Precision, Recompute
from meshscope.plan.flops import ForwardFlops, layer_forward_flops, logits_forward_flops, recompute_forward_flops
from meshscope.plan.kernels import OpClass, StageKernels, stage_kernels

if TYPE_CHECKING:
    from collections.abc import Mapping

    from meshscope.jobs import ModelConfig, TrainingConfig
    from meshscope.plan.assumptions import PlanAssumptions
    from meshscope.plan.memory import ModelStateBytes, StateBytesPerParam
    from meshscope.topology import HardwareConfig, ParallelLayout


def bubble_fraction(pp: int, micro_batches: int, *, vpp: int = 1, schedule: PipelineSchedule) -> float:
    """Pipeline bubble as a fraction of ideal compute time.

    ``(p - 1)/m`` for 1F1B and GPipe (Narayanan et al. 2021 §2.2.1), ``(p - 1)/(m·v)`` for the interleaved schedule
    (§2.2.2); 0 without a pipeline.
    """
    if pp == 1:
        return 0.0
    chunks = vpp if schedule is PipelineSchedule.INTERLEAVED else 1
    return (pp - 1) / (micro_batches * chunks)


def cpu_contention(world_size: int, bubble: float, cpu_cores: float) -> float:
    """How much sharing ``cpu_cores`` stretches a rank's host time: ``max(1, busy ranks ÷ cores)``.

    On a CPU testbed every rank's host work (the tiny tensors' math, autograd, gloo's threads) runs on the same
    cores; the kernel's fair scheduler (CFS) gives each of ``n`` runnable ranks ``cores ÷ n`` of a core once
    ``n > cores`` (sched(7)), so a fixed amount of CPU work takes ``n ÷ cores`` times as long. Ranks idle in a
    pipeline bubble do not compete: of the pipelined step a stage computes ``1 ÷ (1 + bubble fraction)``
    (``m ÷ (m + p - 1)`` for 1F1B, Narayanan et al. 2021 §2.2), so ``busy ranks = world ÷ (1 + bubble)``.
    On a GPU cluster each rank has its own host, and the planner does not apply this (``cpu_cores`` unset).
    """
    busy = world_size / (1.0 + bubble)
    return max(1.0, busy / cpu_cores)


def cpu_stage_contention(world_size: int, pp: int, cpu_cores: float) -> float:
    """The contention while a stage reduces its gradients and steps its optimizer: ``max(1, world ÷ pp ÷ cores)``.

    dp's collectives run in a stage's pipeline fill (parameter all-gathers before the first micro-batch) and drain
    (gradient all-reduces or reduce-scatters after the last one), and its optimizer step after that. In 1F1B the
    stages drain one after another, the last stage first (Narayanan et al. 2021 §2.2, Fig. 4), so what competes
    for the cores then is mostly the stage's own ``world ÷ pp`` ranks, not every busy rank of
    :func:`cpu_contention`; without a pipeline the two are the same. The other stages' host work in their own drain
    still competes a little, so this is the lower bound and :func:`cpu_contention` the upper one (docs/predict.md,
    "CPU contention": measured, the optimizer step of pipelined layouts sits near this bound).
    """
    return max(1.0, world_size / pp / cpu_cores)


def contended(assumptions: PlanAssumptions, world_size: int, bubble: float, pp: int = 1) -> PlanAssumptions:
    """``assumptions`` with host, sync-wait, collective and optimizer times stretched to ``world_size`` ranks' use.

    The ratio is :func:`cpu_contention` of the planned layout over ``cpu_contention_at_fit`` (the run the values
    were measured on) for the host time, the in-compute collectives and their sync waits, and
    :func:`cpu_stage_contention` over ``cpu_stage_contention_at_fit`` for dp's sync wait and the optimizer step, and
    over ``cpu_contention_at_fit`` for dp's collectives (the link fit is referenced to the busy ranks' contention:
    ``meshscope calibrate`` expresses a pipelined run's dp transfers at it), so planning the measured layout again
    changes nothing. Unchanged without ``cpu_cores``.
    """
    if assumptions.cpu_cores is None:
        return assumptions
    ratio = cpu_contention(world_size, bubble, assumptions.cpu_cores) / assumptions.cpu_contention_at_fit
    stage_at_fit = assumptions.cpu_stage_contention_at_fit
    kappa_stage = cpu_stage_contention(world_size, pp, assumptions.cpu_cores)
    stage = kappa_stage / (assumptions.cpu_contention_at_fit if stage_at_fit is None else stage_at_fit)
    dp_comm = kappa_stage / assumptions.cpu_contention_at_fit  # the link fit's reference is the busy ranks'
    if ratio == 1.0 and stage == 1.0 and dp_comm == 1.0:
        return assumptions

    def stretched(value: float | None, by: float) -> float | None:
        return None if value is None else value * by

    return replace(
        assumptions,
        host_seconds_per_layer_pass=assumptions.host_seconds_per_layer_pass * ratio,
        sync_wait_per_collective_seconds=assumptions.sync_wait_per_collective_seconds * ratio,
        dp_sync_wait_per_collective_seconds=stretched(assumptions.dp_sync_wait_per_collective_seconds, stage),
        tp_sync_wait_per_collective_seconds=stretched(assumptions.tp_sync_wait_per_collective_seconds, ratio),
        cp_sync_wait_per_collective_seconds=stretched(assumptions.cp_sync_wait_per_collective_seconds, ratio),
        ep_sync_wait_per_collective_seconds=stretched(assumptions.ep_sync_wait_per_collective_seconds, ratio),
        cpu_time_scale=assumptions.cpu_time_scale * ratio,
        cpu_stage_time_scale=assumptions.cpu_stage_time_scale * stage,
        cpu_dp_comm_time_scale=assumptions.cpu_dp_comm_time_scale * dp_comm,
        cpu_compute_time_scale=assumptions.cpu_compute_time_scale * (ratio if assumptions.cpu_compute else 1.0),
    )


def micro_batch_tokens_per_rank(model: ModelConfig, training: TrainingConfig, layout: ParallelLayout) -> float:
    """Tokens one rank holds of a micro-batch: ``b·s ÷ cp`` (what the host time per layer pass scales with)."""
    return training.micro_batch_size * model.seq_length / layout.cp


def host_tokens_scale(assumptions: PlanAssumptions, tokens_per_rank: float) -> float:
    """How much the host time per layer pass changes at a micro-batch of ``tokens_per_rank`` tokens (``b·s ÷ cp``).

    ``(tokens ÷ host_reference_tokens) ** host_tokens_exponent`` relative to the micro-batch it was measured at; 1
    without a reference or with exponent 0.
    """
    ref = assumptions.host_reference_tokens
    if ref is None or assumptions.host_tokens_exponent == 0.0:
        return 1.0
    return float((tokens_per_rank / ref) ** assumptions.host_tokens_exponent)


def host_tp_scale(assumptions: PlanAssumptions, tp: int) -> float:
    """How much the host time per layer pass changes at tensor-parallel degree ``tp``.

    ``host_tp_factor`` where ``tp > 1`` and the time was measured without tensor parallelism, its inverse the other
    way round, 1 where both have it or neither does, and without a reference (``host_reference_tp``).
    """
    ref = assumptions.host_reference_tp
    if ref is None or assumptions.host_tp_factor == 1.0:
        return 1.0
    return float(assumptions.host_tp_factor ** (int(tp > 1) - int(ref > 1)))


def peak_flops_per_s(hardware: HardwareConfig, precision: Precision) -> float:
    """Dense peak FLOP/s of one GPU at ``precision``."""
    return hardware.gpu.peak_flops_per_s(precision.value)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageCompute:
    """Compute of one GPU of a pipeline stage: FLOPs and expected seconds."""

    forward_flops_per_microbatch: ForwardFlops
    """Forward FLOPs of one micro-batch through the stage on this GPU (÷ tp·cp), by category."""
    recompute_flops_per_microbatch: float
    """Forward FLOPs recomputation adds to one micro-batch's backward on this GPU."""
    forward_seconds_per_microbatch: float
    """Expected forward time of one micro-batch, seconds (for the simulator)."""
    backward_seconds_per_microbatch: float
    """Expected backward time of one micro-batch, recompute included, seconds (for the simulator)."""
    attention_core_seconds_per_microbatch: float
    """Expected time of the attention core (forward, backward, recompute) of one micro-batch, seconds: the window
    the context-parallel ring exchange overlaps."""
    micro_batches: int
    """Micro-batches per step ``m``."""
    kernels: StageKernels | None = None
    """The roofline per operation class behind the seconds; ``None`` under the flat model (``compute_efficiency``)."""

    @property
    def model_flops_per_microbatch(self) -> float:
        """Model FLOPs (forward + backward) of one micro-batch on this GPU."""
        return 3.0 * self.forward_flops_per_microbatch.total

    @property
    def hardware_flops_per_microbatch(self) -> float:
        """Model FLOPs plus recomputation of one micro-batch on this GPU."""
        return self.model_flops_per_microbatch + self.recompute_flops_per_microbatch

    @property
    def compute_seconds_per_step(self) -> float:
        """``m·(forward + backward)`` seconds."""
        return self.micro_batches * (self.forward_seconds_per_microbatch + self.backward_seconds_per_microbatch)


def stage_compute(
    model: ModelConfig,
    layout: ParallelLayout,
    training: TrainingConfig,
    hardware: HardwareConfig,
    assumptions: PlanAssumptions,
    *,
    pp_rank: int,
    layer_indices: list[int],
    micro_batches: int,
    sequence_parallel: bool = False,
) -> StageCompute:
    """Expected compute of one GPU of pipeline rank ``pp_rank``.

    Per GPU, FLOPs are the stage's whole-model FLOPs ÷ ``tp·cp``: TP splits every GEMM, CP splits the tokens (and,
    with Megatron's load-balanced causal chunks, the attention core evenly); routed experts divide the same way
    because EP trades tokens among ranks that hold ``1/ep`` of the experts each. Seconds come from the roofline per
    operation class (:func:`~meshscope.plan.kernels.stage_kernels`), or, when ``assumptions.compute_efficiency`` is
    set, from the flat model: hardware FLOPs ÷ (peak x ``compute_efficiency``).

    Args:
        model: the model.
        layout: the parallel layout.
        training: batch, precision and recompute.
        hardware: the GPU.
        assumptions: the compute ceilings (or ``compute_efficiency``) and ``causal_attention``.
        pp_rank: the pipeline rank.
        layer_indices: its transformer layers.
        micro_batches: micro-batches per step.
        sequence_parallel: whether activations between GEMMs are sharded over tp (element-wise bytes ÷ tp).

    Returns:
        The stage's compute.
    """
    tokens = float(training.micro_batch_size * model.seq_length)
    forward = ForwardFlops()
    for layer in layer_indices:
        forward += layer_forward_flops(model, layer, tokens=tokens, causal=assumptions.causal_attention)
    last = pp_rank == layout.pp - 1
    if last:
        forward += logits_forward_flops(model, tokens=tokens)
    per_gpu = forward.scaled(1.0 / (layout.tp * layout.cp))
    recompute = recompute_forward_flops(per_gpu, training.recompute)
    # launches and dispatch (and, on a CPU testbed, the tiny tensors' math), per micro-batch
    host = (
        assumptions.host_seconds_per_layer_pass
        * len(layer_indices)
        * host_tokens_scale(assumptions, micro_batch_tokens_per_rank(model, training, layout))
        * host_tp_scale(assumptions, layout.tp)
    )
    stretch = assumptions.cpu_compute_time_scale  # 1 unless the kernels are CPU work on a contended testbed
    if assumptions.compute_efficiency is not None:
        rate = peak_flops_per_s(hardware, training.precision) * assumptions.compute_efficiency / stretch
        core_passes = 3.0 + (1.0 if training.recompute in (Recompute.SELECTIVE, Recompute.FULL) else 0.0)
        return StageCompute(
            forward_flops_per_microbatch=per_gpu,
            recompute_flops_per_microbatch=recompute,
            forward_seconds_per_microbatch=per_gpu.total / rate + host / 3.0,
            backward_seconds_per_microbatch=(2.0 * per_gpu.total + recompute) / rate + 2.0 * host / 3.0,
            attention_core_seconds_per_microbatch=core_passes * per_gpu.attention_core / rate,
            micro_batches=micro_batches,
        )
    kernels = stage_kernels(
        model,
        layout,
        training,
        hardware,
        assumptions,
        sequence_parallel=sequence_parallel,
        layer_indices=layer_indices,
        last_stage=last,
    )
    return StageCompute(
        forward_flops_per_microbatch=per_gpu,
        recompute_flops_per_microbatch=recompute,
        forward_seconds_per_microbatch=kernels.forward_seconds * stretch + host / 3.0,
        backward_seconds_per_microbatch=kernels.backward_seconds * stretch + 2.0 * host / 3.0,
        attention_core_seconds_per_microbatch=kernels.seconds(OpClass.ATTENTION_CORE) * stretch,
        micro_batches=micro_batches,
        kernels=kernels,
    )


def optimizer_seconds(
    state: ModelStateBytes, per_param: StateBytesPerParam, hardware: HardwareConfig, assumptions: PlanAssumptions
) -> float:
    """Expected optimizer-step time of one GPU.

    The Adam step is memory-bound; per parameter it updates it reads and writes the optimizer state
    (``2·optimizer``), reads the gradient twice (gradient-norm clipping, then Adam: ``2·gradients``) and writes the
    model weight (read and written when the weight is itself the fp32 main weight): 34 bytes for Megatron's bf16
    default, 32 for fp32. It streams at ``optimizer_hbm_efficiency`` (else ``hbm_efficiency``) of HBM bandwidth.
    """
    weight_passes = 2.0 if per_param.weights_are_main else 1.0
    per_updated_param = 2.0 * per_param.optimizer + 2.0 * per_param.gradients + weight_passes * per_param.weights
    traffic = state.updated_params * per_updated_param
    efficiency = assumptions.optimizer_hbm_efficiency
    efficiency = assumptions.hbm_efficiency if efficiency is None else efficiency
    return traffic / (hardware.gpu.hbm_bandwidth_bytes_per_s * efficiency)


def grad_accumulation_bytes(
    state: ModelStateBytes, per_param: StateBytesPerParam, assumptions: PlanAssumptions
) -> float:
    """HBM bytes of one micro-batch's unfused gradient accumulation on one GPU (0 when fused, the default).

    Without ``grad_accumulation_fusion`` every micro-batch's backward ends with a separate pass that adds the fresh
    gradients into the main-gradient buffer (Megatron's ``param.main_grad.add_(param.grad)`` under
    ``--no-gradient-accumulation-fusion``; autograd's ``AccumulateGrad`` under DDP and FSDP): per element of the
    buffer it reads the fresh gradient (the weight's bytes) and reads and writes the buffer (``grad_reduce_bytes``
    each): 10 bytes for bf16 weights and fp32 gradients. The buffer is what the GPU holds of gradients at its peak
    (whole, or its shard where ZeRO-2/3 reduce every micro-batch).
    """
    if assumptions.grad_accumulation_fusion or per_param.gradients <= 0:
        return 0.0
    elements = state.gradients_bytes / per_param.gradients
    return elements * (per_param.weights + 2.0 * per_param.gradients)


def grad_accumulation_seconds(
    state: ModelStateBytes, per_param: StateBytesPerParam, hardware: HardwareConfig, assumptions: PlanAssumptions
) -> float:
    """Seconds of :func:`grad_accumulation_bytes`: memory-bound, at ``hbm_efficiency`` of HBM bandwidth."""
    traffic = grad_accumulation_bytes(state, per_param, assumptions)
    return traffic / (hardware.gpu.hbm_bandwidth_bytes_per_s * assumptions.hbm_efficiency)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpectedStepTime:
    """Expected seconds of one step on one GPU, by breakdown category; the categories add up to ``total_seconds``."""

    pp_rank: int
    """Pipeline rank these numbers are for (the plan reports the slowest stage)."""
    compute_seconds: float
    """Forward, backward and recompute of all micro-batches."""
    exposed_comm_seconds: Mapping[str, float]
    """Communication not hidden behind compute, per axis (``tp``, ``cp``, ``ep``, ``pp``, ``dp``)."""
    bubble_seconds: float
    """Pipeline bubble of the slowest stage: ``bubble_fraction`` ÷ (pp - 1) x the other stages' compute and exposed
    tp, cp and ep communication (the fill and drain it waits through)."""
    optimizer_seconds: float
    """Optimizer step."""
    sync_wait_seconds: Mapping[str, float] | None = None
    """Expected sync wait per axis (``sync_wait_per_collective_seconds`` x collectives per step; ``None``: none)."""
    data_seconds: float = 0.0
    """Data-loader wait (``PlanAssumptions.data_wait_seconds``; 0 unless calibrated)."""
    other_seconds: float = 0.0
    """Host overhead (``PlanAssumptions.host_overhead_seconds``; 0 unless calibrated)."""

    @property
    def exposed_comm_total_seconds(self) -> float:
        """Exposed communication of all axes."""
        return sum(self.exposed_comm_seconds.values())

    @property
    def sync_wait_total_seconds(self) -> float:
        """Expected sync wait of all axes."""
        return sum(self.sync_wait_seconds.values()) if self.sync_wait_seconds else 0.0

    @property
    def total_seconds(self) -> float:
        """Expected step time."""
        return (
            self.compute_seconds
            + self.exposed_comm_total_seconds
            + self.sync_wait_total_seconds
            + self.bubble_seconds
            + self.optimizer_seconds
            + self.data_seconds
            + self.other_seconds
        )

    def to_dict(self) -> dict[str, object]:
        """Seconds by category, plus ``pp_rank``.

        ``{compute, exposed_comm: {axis: seconds}, sync_wait: {axis: seconds}, bubble, optimizer, data, other, total,
        pp_rank}``.
        """
        return {
            "compute": self.compute_seconds,
            "exposed_comm": dict(self.exposed_comm_seconds),
            "sync_wait": dict(self.sync_wait_seconds or {}),
            "bubble": self.bubble_seconds,
            "optimizer": self.optimizer_seconds,
            "data": self.data_seconds,
            "other": self.other_seconds,
            "total": self.total_seconds,
            "pp_rank": self.pp_rank,
        }

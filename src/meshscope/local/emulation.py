"""The emulated accelerator and the TrainingJob of ``examples/train_tiny.py``: what the planner expects of a CPU run.

Why it exists: ``meshscope run`` and ``meshscope demo`` lay the planner's expectations beside what a real job on CPU
ranks measured. For that the planner needs a :class:`~meshscope.jobs.spec.JobSpec` of the job that really ran (the
``tiny`` model as ``train_tiny`` builds it, the run's layout, its batch, fp32 AdamW, FSDP2 = ZeRO stage 3) and a
hardware entry whose numbers make the planner's expected compute time *equal* the time the trainer emulates:

* ``train_tiny --emulate MS`` sleeps, in every transformer block, the block's forward FLOPs on this GPU (the
  planner's :func:`~meshscope.plan.flops.layer_forward_flops` ÷ tp·cp) divided by an **emulated peak**, and twice
  that in backward; the output layer sleeps its FLOPs the same way. The emulated peak is chosen so that one block's
  forward of one nominal micro-batch takes ``MS`` milliseconds (:func:`emulated_peak_flops_per_s`).
* The emulated GPU has that peak at the training precision (fp32: the catalogue convention is half the BF16 peak,
  so its BF16 figure is twice the emulated peak) and the plan runs with ``compute_efficiency = 1``: the expected
  compute of a stage is then exactly the sleep the trainer adds. What the host really computes (the tiny matmuls on
  shared CPU cores) comes on top, and is what "measured minus expected" compute shows.
* Collectives, the optimizer step and data loading are **not** emulated: they run for real (gloo over loopback,
  AdamW on the CPU). Their link and memory bandwidths below are nominal figures, so expected exposed communication
  and optimizer time are indicative; bytes and counts of collectives are not (they must match exactly).

The training script describes itself to meshscope with :meth:`meshscope.sdk.Tracker.describe_job` (a small mapping,
:class:`TinyJob`); :func:`tiny_job_spec` turns that description and the run's layout into the spec. Pure: no torch,
no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from meshscope.errors import SpecError
from meshscope.jobs import (
    CpCommType,
    JobSpec,
    MoEConfig,
    ParallelismConfig,
    PipelineSchedule,
    PositionEmbedding,
    Precision,
    Recompute,
    TrainingConfig,
    lookup_model,
)
from meshscope.plan import PlanAssumptions, layer_forward_flops, logits_forward_flops
from meshscope.topology import EMULATED_GPU, GpuSpec, HardwareConfig

if TYPE_CHECKING:
    from collections.abc import Mapping

    from meshscope.jobs import ModelConfig
    from meshscope.topology import ParallelLayout

EMULATED_LINK_BYTES_PER_S: Final = 1.0e9
"""Nominal per-direction bandwidth of the emulated links, bytes/s: gloo over loopback moves small messages at
roughly this rate on a shared 2-core machine; collectives are not emulated, so it only scales the expected exposed
communication."""
EMULATED_HBM_BYTES_PER_S: Final = 4.0e9
"""Nominal memory bandwidth of the emulated accelerator, bytes/s: the rate at which AdamW's CPU kernels stream the
optimizer state on this kind of machine; the optimizer step is not emulated, so it only scales its expected time."""
EMULATED_MEMORY_BYTES: Final = 16 * 2**30
"""Memory of the emulated accelerator, bytes (a CPU rank's share of host memory is far larger than the tiny model)."""
DEMO_BLOCK_MS: Final = 40.0
"""Emulated forward time of one transformer block for one nominal micro-batch in ``meshscope demo``, ms."""
TINY_EXPERTS: Final = 4
"""Routed experts per MoE layer of ``train_tiny --moe`` (top-1, FFN half the dense FFN)."""


HOST_TOKENS_EXPONENT: Final = 1.0 / 3.0
"""How the host's time per layer pass grows with a micro-batch's tokens on the CPU ranks of ``train_tiny``
(``PlanAssumptions.host_tokens_exponent``): part of it is dispatch and autograd, the same at any size, part the tiny
tensors' real math. Measured on this project's 2-core machine, idle, 2026-12-05 (docs/predict.md, "Where (e)'s
errors are"): compute beyond the emulated sleep less the training thread's run-queue wait, per layer pass, was
10.3 ms at one micro-batch of 8 sequences (dp=2) against 5.9-6.9 ms at micro-batches of 2 (dp=2,pp=2), and 8.4
against 5.1-5.5 ms for dp=4 against dp=4,pp=2: 4x the tokens, 1.5-1.7x the time, i.e. tokens ** 0.3-0.4."""


HOST_TP_FACTOR: Final = 1.44
"""How much tensor parallelism multiplies the host's time per layer pass on the CPU ranks of ``train_tiny``
(``PlanAssumptions.host_tp_factor``): with ``tp > 1`` every op on a sharded weight goes through DTensor's sharding
propagation and the ranks wake up after each tensor-parallel all-reduce. Measured on this project's 2-core machine,
idle, 2026-12-05 (docs/predict.md, "Tensor parallelism's host time"): the fitted host time per layer pass of
``meshscope run ... --steps 6 --emulate 10``, three runs of each layout, against the layout with the same ranks,
micro-batch and contention without tp: tp=2 / dp=2 1.22 (1.20-1.23), dp=2,tp=2 / dp=4 1.49 (1.43-1.58),
tp=2,pp=2 / dp=2,pp=2 1.66 (1.64-1.68); the geometric mean of the three. It grows with contention and with smaller
micro-batches (the dispatch does not shrink with the tensors); one factor is the simple model. tp=2 only: the tiny
model's 2 KV heads allow no more."""


def emulated_assumptions() -> PlanAssumptions:
    """Plan assumptions for an emulated run: every efficiency 1, so expected seconds are FLOPs (bytes) ÷ peak.

    The host's time per layer pass grows with the micro-batch and with tensor parallelism as measured on CPU ranks
    (:data:`HOST_TOKENS_EXPONENT`, :data:`HOST_TP_FACTOR`).
    """
    return PlanAssumptions(
        compute_efficiency=1.0,
        nvlink_efficiency=1.0,
        network_efficiency=1.0,
        hbm_efficiency=1.0,
        host_tokens_exponent=HOST_TOKENS_EXPONENT,
        host_tp_factor=HOST_TP_FACTOR,
    )


def tiny_model(*, moe: bool = False, experts: int = TINY_EXPERTS) -> ModelConfig:
    """The ``tiny`` preset as ``train_tiny`` builds it: learned position embeddings, optionally every MLP an MoE.

    Args:
        moe: make every layer's MLP a top-1 mixture of ``experts`` experts of half the dense FFN size.
        experts: routed experts per MoE layer.
    """
    base = replace(lookup_model("tiny"), position_embedding=PositionEmbedding.LEARNED)
    if not moe:
        return base
    return replace(
        base,
        moe=MoEConfig(experts=experts, top_k=1, expert_ffn_hidden_size=base.ffn_hidden_size // 2, dense_layers=0),
    )


def block_forward_flops_per_gpu(model: ModelConfig, layout: ParallelLayout, layer: int, *, tokens: float) -> float:
    """Forward FLOPs one GPU runs for transformer ``layer`` on ``tokens`` tokens of the whole micro-batch (÷ tp·cp)."""
    flops = layer_forward_flops(model, layer, tokens=tokens, causal=True).total
    return flops / (layout.tp * layout.cp)


def logits_forward_flops_per_gpu(model: ModelConfig, layout: ParallelLayout, *, tokens: float) -> float:
    """Forward FLOPs one GPU runs for the output layer on ``tokens`` tokens (÷ tp·cp)."""
    return logits_forward_flops(model, tokens=tokens).total / (layout.tp * layout.cp)


def emulated_peak_flops_per_s(
    model: ModelConfig, layout: ParallelLayout, *, micro_batch_size: int, block_ms: float
) -> float:
    """The emulated accelerator's peak: one block's forward of a nominal micro-batch on one GPU takes ``block_ms``.

    Raises:
        SpecError: if ``block_ms`` or ``micro_batch_size`` is not positive.
    """
    if block_ms <= 0 or micro_batch_size < 1:
        raise SpecError(
            "emulation", f"block_ms ({block_ms}) must be > 0 and micro_batch_size ({micro_batch_size}) >= 1"
        )
    tokens = float(micro_batch_size * model.seq_length)
    return block_forward_flops_per_gpu(model, layout, 0, tokens=tokens) / (block_ms / 1000.0)


def emulated_hardware(peak_flops_per_s: float, *, world_size: int, gpus_per_node: int) -> HardwareConfig:
    """Hardware of emulated accelerators: ``peak_flops_per_s`` at fp32, nominal link and memory bandwidths.

    Args:
        peak_flops_per_s: emulated fp32 peak, FLOP/s.
        world_size: ranks in the run.
        gpus_per_node: ranks per emulated node (its NVLink domain is the node).
    """
    gpu = GpuSpec(
        name=EMULATED_GPU,
        bf16_flops_per_s=2.0 * peak_flops_per_s,  # the fp32 peak is half the BF16 one (hardware.py convention)
        fp8_flops_per_s=None,
        hbm_bytes=EMULATED_MEMORY_BYTES,
        hbm_bandwidth_bytes_per_s=EMULATED_HBM_BYTES_PER_S,
        scaleup_bandwidth_bytes_per_s=EMULATED_LINK_BYTES_PER_S,
        nvlink_domain_gpus=gpus_per_node,
        gpus_per_node=gpus_per_node,
        nic_bandwidth_bytes_per_s=EMULATED_LINK_BYTES_PER_S,
        source="meshscope.local.emulation: train_tiny's emulated accelerator (sleeps FLOPs / peak); nominal bandwidths",
    )
    return HardwareConfig(
        gpu=gpu,
        nodes=world_size // gpus_per_node,
        gpus_per_node=gpus_per_node,
        nvlink_domain_gpus=gpus_per_node,
        nic_bandwidth_bytes_per_s=EMULATED_LINK_BYTES_PER_S,
        scaleup_bandwidth_bytes_per_s=EMULATED_LINK_BYTES_PER_S,
        nodes_per_network_block=max(1, world_size // gpus_per_node),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyJob:
    """What ``train_tiny`` tells meshscope about itself (``tracker.describe_job``), in a form that survives JSON."""

    model: str = "tiny"
    """Model preset; only ``tiny`` is understood."""
    micro_batch_size: int
    """Sequences per micro-batch of a nominal replica."""
    micro_batches: int
    """Micro-batches per step per pipeline (1 without pipelining: the whole step is one micro-batch)."""
    block_ms: float | None = None
    """``--emulate`` value: emulated forward ms of one block for a nominal micro-batch; ``None``: not emulated."""
    moe: bool = False
    """Every MLP a top-1 mixture of experts."""
    experts: int = TINY_EXPERTS
    """Routed experts per MoE layer."""
    data_parallel: str = "fsdp"
    """``fsdp`` (FSDP2 fully_shard per block + root: ZeRO stage 3) or ``ddp`` (one gradient all-reduce)."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``1f1b`` or ``gpipe``."""
    cp_comm_type: str = CpCommType.P2P.value
    """How the script's context parallelism exchanges keys and values (a :class:`~meshscope.jobs.spec.CpCommType` value;
    ``train_tiny`` runs ``all_gather``)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (``train_tiny`` turns it on for MoE with tp > 1, as Megatron-core requires)."""
    dp_shard: int | None = None
    """Hybrid sharding (``train_tiny --dp-shard``): FSDP2 over a (replicate, shard) mesh, the state sharded over
    ``dp_shard`` consecutive data-parallel ranks (times cp); ``None``: over all of dp."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form (what the SDK sends)."""
        return {
            "model": self.model,
            "micro_batch_size": self.micro_batch_size,
            "micro_batches": self.micro_batches,
            "block_ms": self.block_ms,
            "moe": self.moe,
            "experts": self.experts,
            "data_parallel": self.data_parallel,
            "schedule": self.schedule,
            "cp_comm_type": self.cp_comm_type,
            "sequence_parallel": self.sequence_parallel,
            "dp_shard": self.dp_shard,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TinyJob:
        """Read a description sent by a training script.

        Raises:
            SpecError: for a description meshscope cannot plan (another model, missing or bad numbers).
        """
        try:
            job = cls(
                model=str(data.get("model", "tiny")),
                micro_batch_size=int(data["micro_batch_size"]),
                micro_batches=int(data["micro_batches"]),
                block_ms=None if data.get("block_ms") in (None, 0, 0.0) else float(data["block_ms"]),
                moe=bool(data.get("moe", False)),
                experts=int(data.get("experts", TINY_EXPERTS)),
                data_parallel=str(data.get("data_parallel", "fsdp")),
                schedule=str(data.get("schedule", "1f1b")),
                cp_comm_type=str(data.get("cp_comm_type", CpCommType.P2P.value)),
                sequence_parallel=bool(data.get("sequence_parallel", False)),
                dp_shard=None if data.get("dp_shard") is None else int(data["dp_shard"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError(
                "job description", f"cannot read the training script's description {data!r}: {exc}"
            ) from None
        if job.model != "tiny":
            raise SpecError("job description", f"only train_tiny's 'tiny' model can be planned here, got {job.model!r}")
        if job.micro_batch_size < 1 or job.micro_batches < 1:
            raise SpecError("job description", f"micro-batch size and count must be >= 1 in {data!r}")
        if job.dp_shard is not None and (job.dp_shard < 1 or job.data_parallel != "fsdp"):
            raise SpecError("job description", f"dp_shard must be >= 1 and needs fsdp data parallelism in {data!r}")
        if job.data_parallel not in {"fsdp", "ddp"} or job.schedule not in {"1f1b", "gpipe"}:
            raise SpecError("job description", f"unknown data parallelism or schedule in {data!r}")
        kinds = [c.value for c in CpCommType]
        if job.cp_comm_type not in kinds:
            raise SpecError(
                "job description", f"cp_comm_type {job.cp_comm_type!r} is not one of {', '.join(kinds)} in {data!r}"
            )
        return job


def tiny_job_spec(
    job: TinyJob, layout: ParallelLayout, *, gpus_per_node: int | None = None, name: str = "tiny"
) -> JobSpec:
    """The TrainingJob ``train_tiny`` ran: ``tiny`` model, ``layout``, its batch, fp32 AdamW, on emulated hardware.

    Args:
        job: the script's description of itself.
        layout: the run's layout.
        gpus_per_node: ranks per emulated node; default all ranks on one node.
        name: job name.

    Raises:
        SpecError: for a layout train_tiny cannot run (ep without MoE, sequence parallelism without tp).
    """
    model = tiny_model(moe=job.moe, experts=job.experts)
    if layout.ep > 1 and not job.moe:
        raise SpecError("job description", f"ep={layout.ep} needs the MoE model (train_tiny --moe)")
    if job.sequence_parallel and layout.tp == 1:
        raise SpecError("job description", "sequence parallelism needs tp > 1, but the run's layout has tp=1")
    per_node = gpus_per_node or layout.world_size
    block_ms = job.block_ms if job.block_ms is not None else DEMO_BLOCK_MS
    peak = emulated_peak_flops_per_s(model, layout, micro_batch_size=job.micro_batch_size, block_ms=block_ms)
    training = TrainingConfig(
        micro_batch_size=job.micro_batch_size,
        global_batch_size=job.micro_batch_size * job.micro_batches * layout.dp,
        precision=Precision.FP32,
        recompute=Recompute.NONE,
        zero_stage=3 if job.data_parallel == "fsdp" and layout.dp * layout.cp > 1 else 0,
        dp_shard=job.dp_shard if job.data_parallel == "fsdp" and layout.dp * layout.cp > 1 else None,
        pipeline_schedule=PipelineSchedule.GPIPE if job.schedule == "gpipe" else PipelineSchedule.ONE_F_ONE_B,
        overlap_grad_reduce=job.data_parallel == "fsdp",
        overlap_param_gather=job.data_parallel == "fsdp",
    )
    return JobSpec(
        name=name,
        model=model,
        parallelism=ParallelismConfig(
            layout=layout,
            sequence_parallel=job.sequence_parallel,
            cp_comm_type=CpCommType(job.cp_comm_type),
        ),
        training=training,
        hardware=emulated_hardware(peak, world_size=layout.world_size, gpus_per_node=per_node),
    )

"""The typed, frozen form of a TrainingJob spec.

``crds/trainingjobs.meshscope.io.yaml`` is the single source of truth for the wire format (camelCase, as a user
``kubectl apply``s it); :mod:`meshscope.jobs.loading` turns a manifest into these objects, applying every default in one
place. Everything downstream (planner, simulator, operator) takes a :class:`JobSpec` and never sees raw dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshscope.jobs.models import ModelConfig
    from meshscope.topology import HardwareConfig, ParallelLayout


class Precision(StrEnum):
    """Compute precision of the matmuls."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    FP32 = "fp32"


class Recompute(StrEnum):
    """Activation recomputation policy (Megatron-core's ``recompute_granularity``)."""

    NONE = "none"
    SELECTIVE = "selective"
    """Recompute the attention core (softmax, dropout, QK^T, AV): drops the ``5as/h`` term (Korthikanti et al. 2022)."""
    FULL = "full"
    """Keep only each layer's input; recompute the whole layer in backward."""


class AttentionImpl(StrEnum):
    """How attention is computed; decides whether the ``s^2`` attention scores are stored."""

    FLASH = "flash"
    """Fused / FlashAttention: no ``s^2`` tensors kept for backward."""
    EAGER = "eager"
    """Unfused: scores, softmax and dropout mask (``5as^2b`` bytes per layer) are kept unless recomputed."""


class CpCommType(StrEnum):
    """How context parallelism exchanges keys and values: Megatron-core's ``cp_comm_type``, run by Transformer Engine.

    Megatron-core ``TransformerConfig.cp_comm_type`` (``--cp-comm-type``, default ``p2p``); Transformer Engine
    ``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py`` implements each. Megatron's
    hierarchical ``a2a+p2p`` is not modelled.
    """

    P2P = "p2p"
    """Ring attention (``AttnFuncWithCPAndKVP2P``): K/V chunks travel around the cp ring by send/recv, overlapped
    with the attention of the chunk in hand; backward sends K/V again with the accumulated dK/dV."""
    ALL_GATHER = "all_gather"
    """``AttnFuncWithCPAndKVAllGather`` (Llama 3 §3.3.2): all-gather K and V before attention; backward gathers them
    again and reduce-scatters dK and dV. Only the local K and V are kept for backward. Not overlapped."""
    A2A = "a2a"
    """DeepSpeed-Ulysses (``AttnFuncWithCPAndQKVOA2A``): all-to-all Q, K, V from sequence- to head-sharded, attention
    over the whole sequence on ``heads/cp`` heads, all-to-all of the output back; backward mirrors them. Needs the
    heads on each tensor-parallel rank (query and key/value) divisible by cp."""


class PipelineSchedule(StrEnum):
    """Pipeline schedule."""

    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    GPIPE = "gpipe"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelismConfig:
    """The layout plus the switches that change what each axis stores and sends."""

    layout: ParallelLayout
    """Degrees, virtual stages and rank order."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: norms and dropout sharded over tp, all-reduce -> reduce-scatter + all-gather."""
    cp_comm_type: CpCommType = CpCommType.P2P
    """How context parallelism exchanges keys and values (Megatron-core's ``cp_comm_type``); unused when cp is 1."""
    account_for_embedding_in_pipeline_split: bool = False
    """Megatron's ``--account-for-embedding-in-pipeline-split``: the input embedding counts as one layer when layers
    are split over the ``pp*vpp`` model chunks, so the first chunk holds one transformer layer less. With both this
    and ``account_for_loss_in_pipeline_split``, ``layers + 2`` must divide evenly (Llama 3 405B: 126 + 2 over pp 16)."""
    account_for_loss_in_pipeline_split: bool = False
    """Megatron's ``--account-for-loss-in-pipeline-split``: the output layer and loss count as one layer, so the last
    chunk holds one transformer layer less."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingConfig:
    """Batch, precision and memory-saving settings."""

    micro_batch_size: int
    """Sequences per micro-batch per data-parallel replica (``b``)."""
    global_batch_size: int
    """Sequences per optimizer step over the whole job (``B``)."""
    precision: Precision = Precision.BF16
    """Matmul precision."""
    recompute: Recompute = Recompute.NONE
    """Activation recomputation."""
    attention: AttentionImpl = AttentionImpl.FLASH
    """Attention implementation."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer: main params and Adam state sharded over dp (6 + 12/dp bytes/param)."""
    zero_stage: int = 0
    """ZeRO stage 0-3 (DeepSpeed / FSDP terms): 1 shards optimizer state, 2 also gradients, 3 also parameters."""
    dp_shard: int | None = None
    """Hybrid sharding (HSDP): the data-parallel ranks the sharded state is split over, ``dp`` by default. With
    ``dp_shard < dp`` each run of ``dp_shard`` consecutive data-parallel ranks (times cp) holds one copy of the
    sharded state, replicated over the ``dp / dp_shard`` such groups: FSDP's ``HYBRID_SHARD``, torchtitan's
    ``data_parallel_shard_degree``, FSDP2 over a 2-D (replicate, shard) mesh. Routed experts stay sharded over
    their expert-data-parallel group."""
    pipeline_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    """Pipeline schedule; ``interleaved`` needs ``vpp > 1``."""
    grad_reduce_bytes: int = 4
    """Bytes per gradient element in the data-parallel reduction (4: fp32, Megatron's default; 2: bf16)."""
    overlap_grad_reduce: bool = True
    """Whether the data-parallel gradient reduction overlaps the backward pass."""
    overlap_param_gather: bool = True
    """Whether the distributed optimizer's parameter all-gather overlaps the next forward pass."""
    tp_comm_overlap: bool = False
    """Whether tensor-parallel collectives overlap GEMMs (Transformer Engine userbuffers)."""
    fp8_param_gather: bool = False
    """FP8 training keeps the transformer layers' GEMM weights in FP8 and all-gathers them so (Megatron-core's
    ``--fp8-param-gather``, NeMo's ``fp8_params``): the data-parallel weight all-gather moves 1 byte per such weight
    instead of 2. Needs ``precision: fp8``."""

    def micro_batches(self, dp: int) -> int:
        """Micro-batches per pipeline per step: ``m = B / (b * dp)``."""
        return self.global_batch_size // (self.micro_batch_size * dp)

    def hybrid_shard(self, dp: int) -> int | None:
        """The shard degree where sharding is hybrid (``1 <= dp_shard < dp``), else ``None``."""
        return self.dp_shard if self.dp_shard is not None and self.dp_shard < dp else None


@dataclass(frozen=True, slots=True, kw_only=True)
class TopologyConfig:
    """Node label keys that tell where pods landed (used by the operator to build a placement)."""

    nvlink_domain_label: str = "nvidia.com/gpu.clique"
    """Node label naming the NVLink domain (GPU feature discovery's clique; ``<ClusterUUID>.<CliqueID>``)."""
    network_tier_labels: tuple[str, ...] = (
        "network.topology.nvidia.com/leaf",
        "network.topology.nvidia.com/spine",
    )
    """Node labels naming the network switch at each tier, closest to the node first (topograph)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MonitoringConfig:
    """What the sidecar collects and how often."""

    enabled: bool = True
    """Whether the operator injects the sidecar."""
    scrape_interval_seconds: float = 15.0
    """Prometheus scrape interval of the sidecar's metrics, seconds."""
    sources: tuple[str, ...] = ("train", "dcgm", "nccl", "infiniband")
    """Telemetry sources the sidecar turns on."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """A whole TrainingJob spec, defaults applied."""

    name: str
    """``metadata.name``."""
    model: ModelConfig
    """The model."""
    parallelism: ParallelismConfig
    """Layout and sequence parallelism."""
    training: TrainingConfig
    """Batch and precision settings."""
    hardware: HardwareConfig
    """GPU type, node count and wiring."""
    namespace: str = "default"
    """``metadata.namespace``."""
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    """Node label keys."""
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)
    """Sidecar settings."""

    @property
    def layout(self) -> ParallelLayout:
        """Shortcut for ``parallelism.layout``."""
        return self.parallelism.layout

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        return self.layout.world_size

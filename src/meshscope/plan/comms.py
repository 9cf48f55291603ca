"""Every collective a training step runs, per axis: message, count, bytes per GPU, link, FLOPs/byte and seconds.

Exists so that a plan can say which axis' traffic crosses which link, how many bytes each GPU moves, whether enough
compute exists to hide it, and how much of it is expected to stay exposed. It works on one representative GPU per
pipeline stage and on the group spans of :func:`meshscope.topology.placement.axis_spans` (vectorised); it never loops
over ranks.

Conventions (docs/planner.md, "Collectives"; reference/planner.md §1.4, §1.7):

* ``message_bytes`` is NCCL's array size ``S``: the whole buffer of an all-reduce, the gathered (unsharded) buffer
  of an all-gather / reduce-scatter, the send buffer of an all-to-all, the tensor of a send/recv.
* Bytes each GPU moves per instance = ``S`` x bus factor: ``2(n-1)/n`` all-reduce, ``(n-1)/n`` reduce-scatter,
  all-gather and all-to-all, 1 send/recv (nccl-tests ``doc/PERFORMANCE.md``).
* Activations travel at 2 bytes per element (4 in fp32 training), also under fp8; gradients at
  ``grad_reduce_bytes``; parameter all-gathers at the weight's bytes (the layers' GEMM weights at 1 byte under
  ``fp8_param_gather``).
* ``flops_per_byte`` is per axis, as in reference §1.7: the model FLOPs per step on that GPU that the axis' traffic
  could hide behind (TP and CP: the stage's transformer layers; EP: its routed experts; PP and DP: everything the
  stage computes) ÷ all bytes that axis moves per GPU per step. It is compared with the link budget, peak FLOP/s ÷
  link bytes/s: below it, the traffic cannot be hidden even with perfect overlap.
* Expected seconds of one instance: NCCL's latency + bandwidth model for the group's size, its NVLink domains and its
  link, the cheapest algorithm and protocol (:func:`meshscope.plan.nccl.collective_time`); bandwidth only with
  ``nccl_latency`` off. The exposed part is what the overlap assumptions and the compute in the collective's overlap
  window leave over.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np

from meshscope.errors import LayoutError
from meshscope.jobs import CpCommType, PositionEmbedding, layer_params, output_params
from meshscope.plan.memory import (
    activation_element_bytes,
    attention_widths_per_gpu,
    gathered_weight_bytes,
    sharding_stage,
    state_bytes_per_param,
)
from meshscope.plan.nccl import collective_time
from meshscope.topology import Link, MeshAxis, axis_spans, span_of_groups

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from meshscope.jobs import ModelConfig, ParallelismConfig, TrainingConfig
    from meshscope.plan.assumptions import PlanAssumptions
    from meshscope.plan.memory import StageParams
    from meshscope.plan.timing import StageCompute
    from meshscope.topology import GroupSpan, HardwareConfig, ParallelLayout, Placement


class CollectiveOp(StrEnum):
    """NCCL operation."""

    ALL_REDUCE = "all-reduce"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_GATHER = "all-gather"
    ALL_TO_ALL = "all-to-all"
    SEND_RECV = "send-recv"

    def bus_factor(self, group_size: int) -> float:
        """Bytes each GPU moves per byte of the array ``S`` (nccl-tests ``doc/PERFORMANCE.md``)."""
        n = group_size
        if self is CollectiveOp.ALL_REDUCE:
            return 2.0 * (n - 1) / n
        if self is CollectiveOp.SEND_RECV:
            return 1.0
        return (n - 1) / n


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectivePlan:
    """One kind of collective of one axis, on one GPU of one pipeline stage, over a whole step."""

    axis: str
    """Mesh axis whose traffic this is (``tp``, ``cp``, ``ep``, ``pp``, ``dp``)."""
    group: str
    """Process group it runs on: the axis, or ``dp-cp`` (dense gradients), ``edp`` (routed-expert gradients),
    ``etp`` (expert tensor parallel), ``tp-ep`` (expert tensor x expert parallel: token counts), ``pp-embedding``
    (first and last stage, tied embeddings)."""
    op: CollectiveOp
    """NCCL operation."""
    purpose: str
    """What it moves, e.g. ``dense gradients``."""
    pp_rank: int
    """Pipeline rank of the GPU these numbers are for."""
    group_size: int
    """Ranks per group."""
    groups: int
    """Groups of this kind in the job."""
    groups_crossing_domains: int
    """Groups whose members sit in more than one NVLink domain."""
    link: Link
    """Slowest hop: ``network`` if any group crosses an NVLink domain."""
    message_bytes: int
    """NCCL array size ``S`` of one instance, bytes."""
    count_per_step: int
    """Instances per step on this GPU."""
    bus_factor: float
    """Bytes moved per GPU per byte of ``S``."""
    bytes_per_gpu_per_step: float
    """``message_bytes · bus_factor · count_per_step``."""
    bandwidth_bytes_per_s: float
    """Per-direction bandwidth of ``link`` per GPU (before the efficiency assumption)."""
    seconds_per_instance: float
    """Expected seconds of one instance: latency + ``message_bytes · bus_factor`` at the chosen protocol's bandwidth
    (``message_bytes · bus_factor / (bandwidth · link efficiency)`` with ``nccl_latency`` off)."""
    hiding_flops_per_step: float
    """Model FLOPs per step on this GPU that this collective's share of its axis' traffic could hide behind."""
    flops_per_byte: float
    """The axis' hiding FLOPs ÷ the axis' bytes per GPU per step (reference/planner.md §1.7)."""
    link_budget_flops_per_byte: float
    """Peak FLOP/s ÷ link bytes/s: FLOPs needed to hide each byte on ``link``."""
    overlap_fraction: float
    """Fraction of it allowed to run under compute (from the assumptions and the training switches)."""
    overlap_window_seconds: float
    """Compute seconds per step it can overlap (shared with collectives of the same window)."""
    exposed_seconds_per_step: float
    """Expected seconds per step not hidden behind compute."""
    in_axis_ratio: bool = True
    """Whether its bytes count in the axis' FLOPs per byte; ``False`` for traffic outside the layers (the vocabulary
    collectives), which no compute hides and which reference/planner.md §1.7 leaves out."""
    algorithm: str = "bandwidth-only"
    """NCCL algorithm the cost model picks: ``ring``, ``tree``, ``p2p`` or ``bandwidth-only``."""
    protocol: str = "simple"
    """NCCL protocol it picks: ``ll``, ``ll128`` or ``simple``."""
    latency_seconds: float = 0.0
    """Latency part of ``seconds_per_instance``, seconds."""

    @property
    def expected_seconds_per_step(self) -> float:
        """``seconds_per_instance · count_per_step``."""
        return self.seconds_per_instance * self.count_per_step

    @property
    def hideable(self) -> bool:
        """Whether its FLOPs/byte reaches the link budget."""
        return self.flops_per_byte >= self.link_budget_flops_per_byte

    def to_dict(self) -> dict[str, object]:
        """JSON form (bytes, seconds, FLOPs in base units)."""
        return {
            "axis": self.axis,
            "group": self.group,
            "op": self.op.value,
            "purpose": self.purpose,
            "pp_rank": self.pp_rank,
            "group_size": self.group_size,
            "groups": self.groups,
            "groups_crossing_domains": self.groups_crossing_domains,
            "link": self.link.value,
            "message_bytes": self.message_bytes,
            "count_per_step": self.count_per_step,
            "bus_factor": self.bus_factor,
            "bytes_per_gpu_per_step": self.bytes_per_gpu_per_step,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "seconds_per_instance": self.seconds_per_instance,
            "expected_seconds_per_step": self.expected_seconds_per_step,
            "exposed_seconds_per_step": self.exposed_seconds_per_step,
            "overlap_fraction": self.overlap_fraction,
            "hiding_flops_per_step": self.hiding_flops_per_step,
            "flops_per_byte": self.flops_per_byte,
            "link_budget_flops_per_byte": self.link_budget_flops_per_byte,
            "algorithm": self.algorithm,
            "protocol": self.protocol,
            "latency_seconds": self.latency_seconds,
        }


def collective_spans(
    layout: ParallelLayout, placement: Placement, model: ModelConfig, *, dp_shard: int | None = None
) -> dict[str, GroupSpan]:
    """Spans of every process group a collective of ``model`` on ``layout`` runs on.

    Keys: the enabled axes from :func:`~meshscope.topology.placement.axis_spans`; ``dp-cp`` always names the dense
    gradient group (``dp``, ``cp`` or both); ``etp``, ``edp`` and ``tp-ep`` (expert tensor x expert parallel, where
    the token dispatcher exchanges its counts) for MoE models when those groups have more than one rank;
    ``pp-embedding`` for tied embeddings with pp > 1; ``dp-shard`` and ``dp-replicate`` with hybrid sharding
    (``dp_shard``: :func:`hybrid_groups`). All vectorised over groups.
    """
    spans = axis_spans(layout, placement)
    if "dp-cp" not in spans:
        if layout.dp > 1:
            spans["dp-cp"] = spans["dp"]
        elif layout.cp > 1:
            spans["dp-cp"] = spans["cp"]
    if model.is_moe:
        if layout.expert_tp > 1:
            spans["etp"] = span_of_groups("etp", layout.groups(MeshAxis.TP, expert=True), placement)
        if layout.expert_tp * layout.ep > 1:
            spans["tp-ep"] = span_of_groups("tp-ep", layout.groups(MeshAxis.TP, MeshAxis.EP, expert=True), placement)
        if layout.expert_dp > 1 and "edp" not in spans:
            spans["edp"] = span_of_groups("edp", layout.groups(MeshAxis.DP, expert=True), placement)
    if model.tied_embeddings and layout.pp > 1:
        ends = layout.groups(MeshAxis.PP)[:, [0, layout.pp - 1]]
        spans["pp-embedding"] = span_of_groups("pp-embedding", ends, placement)
    if dp_shard is not None:
        spans.update(hybrid_spans(layout, placement, dp_shard))
    return spans


def hybrid_groups(layout: ParallelLayout, dp_shard: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Hybrid sharding's groups: ``(shard, replicate)``, each of shape ``(number of groups, group size)``.

    A shard group is ``dp_shard`` consecutive data-parallel ranks times every cp rank (the part of the dense gradient
    group ``dp-cp`` that holds one copy of the sharded state); a replicate group joins the ranks at the same place of
    every shard group (``dp / dp_shard`` of them): torchtitan's ``(dp_replicate, dp_shard_cp)`` mesh, FSDP's
    ``HYBRID_SHARD`` with a shard group per node.
    """
    if dp_shard < 1 or layout.dp % dp_shard:
        raise LayoutError(f"dp_shard ({dp_shard}) must divide dp ({layout.dp})")
    c = layout.coords_array()
    ranks = np.arange(layout.world_size, dtype=np.int64)
    block, within = c[MeshAxis.DP] // dp_shard, c[MeshAxis.DP] % dp_shard
    shard = ranks[np.lexsort((ranks, block, c[MeshAxis.TP], c[MeshAxis.PP]))]
    replicate = ranks[np.lexsort((ranks, within, c[MeshAxis.CP], c[MeshAxis.TP], c[MeshAxis.PP]))]
    return shard.reshape(-1, dp_shard * layout.cp), replicate.reshape(-1, layout.dp // dp_shard)


def hybrid_spans(layout: ParallelLayout, placement: Placement, dp_shard: int) -> dict[str, GroupSpan]:
    """Spans of :func:`hybrid_groups`: ``dp-shard`` and ``dp-replicate``."""
    shard, replicate = hybrid_groups(layout, dp_shard)
    return {
        "dp-shard": span_of_groups("dp-shard", shard, placement),
        "dp-replicate": span_of_groups("dp-replicate", replicate, placement),
    }


# Overlap windows: collectives that share a window share its compute seconds.
_STAGE = "stage compute"
_BACKWARD = "backward"
_CORE = "attention core"
_LAST_BACKWARD = "backward of the last micro-batch"
_FIRST_FORWARD = "forward of the first micro-batch"
_ALL_FORWARD = "forward of every micro-batch"
_NONE = "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class _Draft:
    axis: MeshAxis
    group: str
    op: CollectiveOp
    purpose: str
    message_bytes: int
    count_per_step: int
    overlap_fraction: float
    window: str
    in_axis_ratio: bool = True
    """Whether its bytes count in the axis' FLOPs per byte (reference §1.7 counts the layers' traffic only)."""


def _windows(compute: StageCompute) -> dict[str, float]:
    m = compute.micro_batches
    forward, backward = compute.forward_seconds_per_microbatch, compute.backward_seconds_per_microbatch
    return {
        _STAGE: compute.compute_seconds_per_step,
        _BACKWARD: m * backward,
        _CORE: m * compute.attention_core_seconds_per_microbatch,
        _LAST_BACKWARD: backward,
        _FIRST_FORWARD: forward,
        _ALL_FORWARD: m * forward,
        _NONE: 0.0,
    }


def stage_collectives(
    model: ModelConfig,
    parallelism: ParallelismConfig,
    training: TrainingConfig,
    *,
    hardware: HardwareConfig,
    assumptions: PlanAssumptions,
    spans: dict[str, GroupSpan],
    pp_rank: int,
    layer_indices: list[int],
    params: StageParams,
    compute: StageCompute,
) -> tuple[CollectivePlan, ...]:
    """Every collective one GPU of pipeline rank ``pp_rank`` runs in a step.

    Args:
        model: the model.
        parallelism: layout and sequence parallelism.
        training: batch, precision, sharding and overlap switches.
        hardware: link bandwidths and peak FLOP/s.
        assumptions: link efficiencies and overlap fractions.
        spans: :func:`collective_spans` of the layout on its placement.
        pp_rank: the pipeline rank.
        layer_indices: its transformer layers.
        params: its parameters per GPU.
        compute: its expected compute (FLOPs and seconds).

    Returns:
        The collectives, grouped by axis in the order tp, cp, ep, pp, dp.
    """
    drafts = [
        *_tp_drafts(model, parallelism, training, assumptions, layer_indices),
        *_vocab_drafts(model, parallelism, training, pp_rank),
        *_sequence_parallel_grad_drafts(model, parallelism, training, params=params, pp_rank=pp_rank),
        *_pp_scatter_gather_drafts(model, parallelism, training, assumptions, pp_rank),
        *_cp_drafts(model, parallelism, training, assumptions, layer_indices),
        *_ep_drafts(model, parallelism, training, assumptions, layer_indices),
        *_pp_drafts(model, parallelism, training, assumptions, pp_rank),
        *_dp_drafts(
            model,
            parallelism.layout,
            training,
            assumptions,
            params=params,
            micro_batches=compute.micro_batches,
            layer_indices=layer_indices,
        ),
    ]
    drafts = [d for d in drafts if d.count_per_step > 0 and d.message_bytes > 0 and d.group in spans]
    hiding = _hiding_flops(compute)
    precision = training.precision.value
    # dp's collectives run in the pipeline's fill and drain: on a CPU testbed, at the stage's contention
    at_drain = (
        assumptions
        if assumptions.cpu_dp_comm_time_scale == assumptions.cpu_time_scale
        else replace(assumptions, cpu_time_scale=assumptions.cpu_dp_comm_time_scale)
    )
    sized = []
    for d in drafts:
        span = spans[d.group]
        bus = d.op.bus_factor(span.group_size)
        link = span.link
        bandwidth = hardware.link_bandwidth_bytes_per_s(link.value)
        timed = collective_time(
            d.op.value,
            d.message_bytes,
            group_size=span.group_size,
            nodes=span.max_domains_per_group,
            link=link.value,
            link_bandwidth_bytes_per_s=bandwidth,
            assumptions=at_drain if d.axis is MeshAxis.DP else assumptions,
        )
        sized.append((d, span, bus, link, bandwidth, timed, d.message_bytes * bus * d.count_per_step))
    axis_bytes: dict[MeshAxis, float] = defaultdict(float)
    for d, *_, moved in sized:
        if d.in_axis_ratio:
            axis_bytes[d.axis] += moved
    windows = _windows(compute)
    full_windows = dict(windows)
    out = []
    for d, span, bus, link, bandwidth, timed, moved in sized:
        per_instance = timed.seconds
        expected = per_instance * d.count_per_step
        hidden = min(d.overlap_fraction * expected, windows[d.window])
        windows[d.window] -= hidden
        axis_flops = hiding[d.axis]
        out.append(
            CollectivePlan(
                axis=d.axis.value,
                group=d.group,
                op=d.op,
                purpose=d.purpose,
                pp_rank=pp_rank,
                group_size=span.group_size,
                groups=span.groups,
                groups_crossing_domains=span.groups_crossing_domains,
                link=link,
                message_bytes=d.message_bytes,
                count_per_step=d.count_per_step,
                bus_factor=bus,
                bytes_per_gpu_per_step=moved,
                bandwidth_bytes_per_s=bandwidth,
                seconds_per_instance=per_instance,
                hiding_flops_per_step=axis_flops * moved / axis_bytes[d.axis] if d.in_axis_ratio else 0.0,
                flops_per_byte=axis_flops / axis_bytes[d.axis] if axis_bytes[d.axis] else 0.0,
                link_budget_flops_per_byte=hardware.link_budget_flops_per_byte(link.value, precision),
                overlap_fraction=d.overlap_fraction,
                overlap_window_seconds=full_windows[d.window],
                exposed_seconds_per_step=expected - hidden,
                in_axis_ratio=d.in_axis_ratio,
                algorithm=timed.algorithm,
                protocol=timed.protocol,
                latency_seconds=timed.latency_seconds,
            )
        )
    return tuple(out)


def _hiding_flops(compute: StageCompute) -> dict[MeshAxis, float]:
    """Model FLOPs per step on this GPU that each axis' traffic can hide behind (reference/planner.md §1.7)."""
    m, forward = compute.micro_batches, compute.forward_flops_per_microbatch
    layers = 3.0 * m * forward.layers
    everything = 3.0 * m * forward.total
    return {
        MeshAxis.TP: layers,
        MeshAxis.CP: layers,
        MeshAxis.EP: 3.0 * m * forward.experts,
        MeshAxis.PP: everything,
        MeshAxis.DP: everything,
    }


def _tokens_per_gpu(model: ModelConfig, parallelism: ParallelismConfig, training: TrainingConfig) -> float:
    """Tokens of one micro-batch one GPU holds between layers: ``s/cp·b``, ÷ tp with sequence parallelism."""
    layout = parallelism.layout
    tokens = model.seq_length / layout.cp * training.micro_batch_size
    return tokens / layout.tp if parallelism.sequence_parallel else tokens


def _moe_layer_count(model: ModelConfig, layer_indices: list[int]) -> int:
    return sum(1 for i in layer_indices if model.is_moe_layer(i))


def _tp_drafts(
    model: ModelConfig,
    parallelism: ParallelismConfig,
    training: TrainingConfig,
    assumptions: PlanAssumptions,
    layer_indices: list[int],
) -> list[_Draft]:
    """TP: activations of every TP-sharded block (attention, dense MLP, shared experts).

    One all-reduce forward and one backward per block (Narayanan et al. 2021 §3.2: ``8bsh(t-1)/t`` per layer per
    micro-batch), or with SP an all-gather and a reduce-scatter each way (Korthikanti et al. 2022 §4.2.2) plus the
    backward re-gather of each column-parallel input; MoE layers gather routed tokens over the expert-TP group.
    """
    layout = parallelism.layout
    m, e = training.micro_batches(layout.dp), activation_element_bytes(training)
    drafts: list[_Draft] = []
    n_moe = _moe_layer_count(model, layer_indices)
    if layout.tp > 1:
        shared = n_moe if (model.moe is not None and model.moe.shared_experts) else 0
        blocks = len(layer_indices) + (len(layer_indices) - n_moe) + shared  # attention + dense MLP + shared experts
        message = math.ceil(_hidden_states_bytes(model, layout, training))
        overlap = assumptions.tp_comm_overlap if training.tp_comm_overlap else 0.0
        if parallelism.sequence_parallel:
            drafts.extend(
                _Draft(
                    axis=MeshAxis.TP,
                    group="tp",
                    op=op,
                    purpose="layer activations, sequence parallel (forward and backward)",
                    message_bytes=message,
                    count_per_step=2 * blocks * m,
                    overlap_fraction=overlap,
                    window=_STAGE,
                )
                for op in (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER)
            )
            drafts.append(
                _Draft(
                    axis=MeshAxis.TP,
                    group="tp",
                    op=CollectiveOp.ALL_GATHER,
                    purpose="sequence-parallel re-gather of GEMM inputs for weight gradients (backward)",
                    message_bytes=message,
                    count_per_step=blocks * m,
                    overlap_fraction=assumptions.sp_backward_allgather_overlap,
                    window=_BACKWARD,
                )
            )
        else:
            drafts.append(
                _Draft(
                    axis=MeshAxis.TP,
                    group="tp",
                    op=CollectiveOp.ALL_REDUCE,
                    purpose="layer activations (forward and backward)",
                    message_bytes=message,
                    count_per_step=2 * blocks * m,
                    overlap_fraction=overlap,
                    window=_STAGE,
                )
            )
    if model.moe is not None and n_moe and layout.expert_tp > 1:
        # Megatron-core's alltoall dispatcher (dispatch_postprocess / combine_preprocess): after the EP all-to-all the
        # routed tokens and their probabilities are all-gathered over etp, the expert output reduce-scattered; in
        # backward each becomes the other. Probabilities travel in the router's dtype (the activations' by default).
        copies = layout.expert_tp * model.moe.top_k * _tokens_per_gpu(model, parallelism, training)
        overlap = assumptions.tp_comm_overlap if training.tp_comm_overlap else 0.0
        tokens, probabilities = math.ceil(copies * model.hidden_size * e), math.ceil(copies * e)
        rows = (
            (CollectiveOp.ALL_GATHER, "routed tokens (forward; the expert output's gradient, backward)", tokens, 2),
            (CollectiveOp.REDUCE_SCATTER, "expert output (forward; the routed tokens' gradient, backward)", tokens, 2),
            (CollectiveOp.ALL_GATHER, "routing probabilities (forward)", probabilities, 1),
            (CollectiveOp.REDUCE_SCATTER, "routing-probability gradients (backward)", probabilities, 1),
        )
        drafts.extend(
            _Draft(
                axis=MeshAxis.TP,
                group="etp",
                op=op,
                purpose=f"expert tensor parallel: {what}",
                message_bytes=size,
                count_per_step=count * n_moe * m,
                overlap_fraction=overlap,
                window=_STAGE,
            )
            for op, what, size, count in rows
        )
    return drafts


def _vocab_drafts(
    model: ModelConfig, parallelism: ParallelismConfig, training: TrainingConfig, pp_rank: int
) -> list[_Draft]:
    """TP around the vocabulary: the embedding's output, the output layer's input, the cross entropy.

    Megatron-core with tp > 1 (``VocabParallelEmbedding``, ``ColumnParallelLinear`` output layer,
    ``vocab_parallel_cross_entropy``), per micro-batch:

    * first stage: the vocabulary-parallel embedding all-reduces its output forward (``b·s·h``). With sequence
      parallelism ``LanguageModelEmbedding`` reduce-scatters it instead, unless a learned position embedding is added
      after the word embedding: then it all-reduces and splits (``scatter_to_sequence_parallel_region``); either way
      backward all-gathers the gradient;
    * last stage: the output layer's input gradient is all-reduced backward. With sequence parallelism the output
      layer is a sequence-parallel ``ColumnParallelLinear``: its input is all-gathered forward, all-gathered again in
      backward for the weight gradient (``LinearWithGradAccumulationAndAsyncCommunication``) and its gradient
      reduce-scattered, ``b·s·h`` each;
    * last stage: the cross entropy all-reduces three fp32 values per token forward (the maximum logit, the target's
      logit, the sum of exponentials), ``4·b·s`` bytes each.

    None of them overlaps compute, and none counts in the axis' FLOPs per byte, which is about the layers' traffic
    (reference/planner.md §1.7).
    """
    layout = parallelism.layout
    if layout.tp == 1:
        return []
    m, e = training.micro_batches(layout.dp), activation_element_bytes(training)
    tokens = model.seq_length / layout.cp * training.micro_batch_size
    message = math.ceil(tokens * model.hidden_size * e)
    sp = parallelism.sequence_parallel
    drafts: list[_Draft] = []

    def add(op: CollectiveOp, purpose: str, size: int, count: int) -> None:
        drafts.append(
            _Draft(
                axis=MeshAxis.TP,
                group="tp",
                op=op,
                purpose=purpose,
                message_bytes=size,
                count_per_step=count,
                overlap_fraction=0.0,
                window=_NONE,
                in_axis_ratio=False,
            )
        )

    if pp_rank == 0:
        if not sp or model.position_embedding is PositionEmbedding.LEARNED:
            add(CollectiveOp.ALL_REDUCE, "vocabulary-parallel embedding output (forward)", message, m)
        else:
            add(CollectiveOp.REDUCE_SCATTER, "vocabulary-parallel embedding output, sequence parallel (forward)",
                message, m)  # fmt: skip
        if sp:
            add(CollectiveOp.ALL_GATHER, "embedding output gradient, sequence parallel (backward)", message, m)
    if pp_rank == layout.pp - 1:
        if sp:
            add(CollectiveOp.ALL_GATHER, "output-layer input, sequence parallel (forward)", message, m)
            add(CollectiveOp.ALL_GATHER, "output-layer input again, for its weight gradient (backward)", message, m)
            add(CollectiveOp.REDUCE_SCATTER, "output-layer input gradient, sequence parallel (backward)", message, m)
        else:
            add(CollectiveOp.ALL_REDUCE, "output-layer input gradient (backward)", message, m)
        add(
            CollectiveOp.ALL_REDUCE,
            "vocabulary-parallel cross entropy: max logit, target logit, sum of exponentials (forward)",
            math.ceil(4 * tokens),
            3 * m,
        )
    return drafts


def _sequence_parallel_grad_drafts(
    model: ModelConfig, parallelism: ParallelismConfig, training: TrainingConfig, *, params: StageParams, pp_rank: int
) -> list[_Draft]:
    """TP with sequence parallelism: one all-reduce of the gradients of the parameters every tp rank holds whole.

    Norms, the router and row-parallel biases see only the rank's sequence shard, so their gradients are partial
    sums; Megatron-core's ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``) flattens all of
    them (every model chunk of the stage, the final norm on the last stage) into one buffer and all-reduces it over
    tp once per step, after the data-parallel reduction. It reduces the whole gradients; with ZeRO-2/3 (gradients
    sharded over ``dp·cp``, as Megatron-FSDP) only this GPU's shard. Not overlapped.
    """
    layout = parallelism.layout
    if layout.tp == 1 or not parallelism.sequence_parallel:
        return []
    whole = params.replicated
    if pp_rank == layout.pp - 1:
        whole += output_params(model) - (0 if model.tied_embeddings else model.vocab_size * model.hidden_size)
    shards = layout.dp * layout.cp if sharding_stage(training) >= 2 else 1
    return [
        _Draft(
            axis=MeshAxis.TP,
            group="tp",
            op=CollectiveOp.ALL_REDUCE,
            purpose="sequence-parallel parameter gradients: norms, router, row-parallel biases (after backward)",
            message_bytes=math.ceil(whole * state_bytes_per_param(training).gradients / shards),
            count_per_step=1,
            overlap_fraction=0.0,
            window=_NONE,
            in_axis_ratio=False,
        )
    ]


def _hidden_states_bytes(model: ModelConfig, layout: ParallelLayout, training: TrainingConfig) -> float:
    """Bytes of one micro-batch's hidden states on a rank (``s/cp·b·h`` elements).

    What a TP all-reduce and a pipeline send move, before any sharding.
    """
    return (
        model.seq_length
        / layout.cp
        * training.micro_batch_size
        * model.hidden_size
        * activation_element_bytes(training)
    )


def _pp_scatter_gather_drafts(
    model: ModelConfig,
    parallelism: ParallelismConfig,
    training: TrainingConfig,
    assumptions: PlanAssumptions,
    pp_rank: int,
) -> list[_Draft]:
    """TP: the all-gather that puts back together each pipeline tensor sent in ``1/tp`` slices.

    With the scatter/gather optimisation (``PlanAssumptions.pp_scatter_gather``, no sequence parallelism; Narayanan et
    al. 2021 §4.1) each TP rank sends and receives ``1/tp`` of a pipeline tensor, and the receiver all-gathers the
    slices over its TP group before using it: Megatron-LM's ``p2p_communication._communicate`` calls
    ``mpu.gather_split_1d_tensor`` on every tensor it received (the code Korthikanti et al. 2022 ran; Megatron-core
    has no scatter/gather). One all-gather of the whole ``b·s·h`` tensor per activation received forward and per
    gradient received backward, after a synchronous receive: nothing hides it, and it is not the layers' traffic.
    """
    layout = parallelism.layout
    p, vpp = layout.pp, layout.vpp
    if p == 1 or layout.tp == 1 or parallelism.sequence_parallel or not assumptions.pp_scatter_gather:
        return []
    m = training.micro_batches(layout.dp)
    message = math.ceil(_hidden_states_bytes(model, layout, training))
    # The first virtual stage receives no activation, the last no gradient.
    received = m * (vpp - (1 if pp_rank == 0 else 0)) + m * (vpp - (1 if pp_rank == p - 1 else 0))
    return [
        _Draft(
            axis=MeshAxis.TP,
            group="tp",
            op=CollectiveOp.ALL_GATHER,
            purpose="pipeline scatter/gather: received activation or gradient slices (forward and backward)",
            message_bytes=message,
            count_per_step=received,
            overlap_fraction=0.0,
            window=_NONE,
            in_axis_ratio=False,
        )
    ]


def _cp_drafts(
    model: ModelConfig,
    parallelism: ParallelismConfig,
    training: TrainingConfig,
    assumptions: PlanAssumptions,
    layer_indices: list[int],
) -> list[_Draft]:
    """CP: what every attention layer exchanges over the cp group, per ``parallelism.cp_comm_type``.

    Transformer Engine ``attention/dot_product_attention/context_parallel.py`` (Megatron-core passes its
    ``cp_comm_type`` through), per attention layer and micro-batch, with ``n`` = cp, local tokens ``s/cp·b``:

    * ``p2p`` (``AttnFuncWithCPAndKVP2P``): K and V travel as one buffer. Forward: ``n - 1`` ring steps send the K/V
      chunk in hand. Backward: ``n`` steps; the first sends K/V, the last the accumulated dK/dV, the ``n - 2`` in
      between both together (one message of twice the size). Overlapped with the attention of the chunk in hand.
    * ``all_gather`` (``AttnFuncWithCPAndKVAllGather``): forward all-gathers K and V (``gather_along_first_dim``, one
      each); backward all-gathers them again (only the local K and V are kept) and reduce-scatters dK and dV. Messages
      are the gathered (whole-sequence) tensors. Megatron: "The all-gather is not async, and cannot be overlapped".
    * ``a2a`` (``AttnFuncWithCPAndQKVOA2A``, DeepSpeed-Ulysses): ``all_to_all_single`` of Q, K, V before attention and
      of the output after it; backward of the output gradient, then of dQ, dK, dV. Messages are the local tensors.
      On the critical path (the attention needs all of them); modelled as not overlapped.
    """
    layout = parallelism.layout
    n = layout.cp
    if n == 1 or not layer_indices:
        return []
    e = activation_element_bytes(training)
    q, k, v, o = attention_widths_per_gpu(model, layout.tp)
    local = model.seq_length / n * training.micro_batch_size
    units = len(layer_indices) * training.micro_batches(layout.dp)
    kind = parallelism.cp_comm_type
    if kind is CpCommType.P2P:
        kv = math.ceil(local * (k + v) * e)
        overlap, window = assumptions.cp_comm_overlap, _CORE
        rows = [
            (CollectiveOp.SEND_RECV, "ring exchange (p2p): K/V chunk forward, K/V and dK/dV at the ends of backward",
             kv, (n + 1) * units),
            (CollectiveOp.SEND_RECV, "ring exchange (p2p): K/V with dK/dV in one message, middle backward steps",
             2 * kv, (n - 2) * units),
        ]  # fmt: skip
    elif kind is CpCommType.ALL_GATHER:
        overlap, window = 0.0, _NONE
        tensors = [("K and V", k)] if k == v else [("K", k), ("V", v)]
        rows = []
        for name, width in tensors:
            gathered = math.ceil(model.seq_length * training.micro_batch_size * width * e)
            per = units * (2 if k == v else 1)
            rows.append(
                (CollectiveOp.ALL_GATHER, f"all_gather: {name} before attention, again in backward", gathered, 2 * per)
            )
            rows.append((CollectiveOp.REDUCE_SCATTER, f"all_gather: d{name.replace(' and ', ' and d')} (backward)",
                         gathered, per))  # fmt: skip
    else:
        overlap, window = 0.0, _NONE
        sizes: dict[int, list[str]] = {}
        for name, width in (("Q", q), ("K", k), ("V", v), ("output", o)):
            sizes.setdefault(math.ceil(local * width * e), []).append(name)
        rows = [
            (CollectiveOp.ALL_TO_ALL, f"a2a (Ulysses): {', '.join(names)} and their gradients", size,
             2 * len(names) * units)
            for size, names in sizes.items()
        ]  # fmt: skip
    return [
        _Draft(
            axis=MeshAxis.CP,
            group="cp",
            op=op,
            purpose=purpose,
            message_bytes=size,
            count_per_step=count,
            overlap_fraction=overlap,
            window=window,
        )
        for op, purpose, size, count in rows
    ]


def _ep_drafts(
    model: ModelConfig,
    parallelism: ParallelismConfig,
    training: TrainingConfig,
    assumptions: PlanAssumptions,
    layer_indices: list[int],
) -> list[_Draft]:
    """EP: Megatron-core's alltoall token dispatcher, per MoE layer and micro-batch.

    ``MoEAlltoAllTokenDispatcher`` (core >= 0.13): ``preprocess`` all-gathers every rank's token count per expert
    (``E`` int64) over the expert-tensor x expert-parallel group, from which each rank knows what it sends and
    receives (no gradient, so no backward collective); ``token_dispatch`` all-to-alls the permuted tokens
    (``T_loc·k·h``) and their routing probabilities (``T_loc·k``, the router's dtype, the activations' by default),
    which the experts apply to their activation; ``token_combine`` all-to-alls the expert output back. Backward runs
    the three all-to-alls again: 4 of tokens (reference/planner.md §1.4) and 2 of probabilities. Messages are the send
    buffers: what a rank sends is exactly its ``T_loc·k`` routed copies in dispatch; the rest depend on routing and
    equal it on average (every token sent is received once). The count exchange is a synchronisation point that no
    compute hides; like the vocabulary collectives it stays out of the axis' FLOPs per byte.
    """
    layout = parallelism.layout
    n_moe = _moe_layer_count(model, layer_indices)
    if model.moe is None or not n_moe or layout.ep * layout.expert_tp == 1:
        return []
    m = training.micro_batches(layout.dp)
    e = activation_element_bytes(training)
    copies = _tokens_per_gpu(model, parallelism, training) * model.moe.top_k
    drafts = [
        _Draft(
            axis=MeshAxis.EP,
            group="tp-ep",
            op=CollectiveOp.ALL_GATHER,
            purpose="token counts per expert (int64), before dispatch (forward)",
            message_bytes=layout.expert_tp * layout.ep * model.moe.experts * 8,
            count_per_step=n_moe * m,
            overlap_fraction=0.0,
            window=_NONE,
            in_axis_ratio=False,  # metadata on the critical path: no compute hides it, it moves no routed data
        )
    ]
    if layout.ep == 1:
        return drafts
    drafts.extend(
        _Draft(
            axis=MeshAxis.EP,
            group="ep",
            op=CollectiveOp.ALL_TO_ALL,
            purpose=purpose,
            message_bytes=math.ceil(copies * width * e),
            count_per_step=count * n_moe * m,
            overlap_fraction=assumptions.ep_comm_overlap,
            window=_STAGE,
        )
        for purpose, width, count in (
            ("token dispatch and combine (forward and backward)", model.hidden_size, 4),
            ("routing probabilities with the dispatch (forward and backward)", 1, 2),
        )
    )
    return drafts


def _pp_drafts(
    model: ModelConfig,
    parallelism: ParallelismConfig,
    training: TrainingConfig,
    assumptions: PlanAssumptions,
    pp_rank: int,
) -> list[_Draft]:
    """PP: stage-to-stage transfers and the tied-embedding gradient all-reduce.

    One activation tensor forward and one gradient backward per micro-batch per chunk boundary, ``b·s·h`` (÷ tp with
    SP or scatter/gather; Narayanan et al. 2021 §4.1), x vpp interleaved; plus the tied-embedding gradient
    all-reduce between the first and last stage.
    """
    layout = parallelism.layout
    p, vpp = layout.pp, layout.vpp
    if p == 1:
        return []
    m = training.micro_batches(layout.dp)
    shard = layout.tp if (parallelism.sequence_parallel or assumptions.pp_scatter_gather) else 1
    message = math.ceil(_hidden_states_bytes(model, layout, training) / shard)
    # The last virtual stage sends nothing forward, the first nothing backward.
    forward_sends = m * (vpp - (1 if pp_rank == p - 1 else 0))
    backward_sends = m * (vpp - (1 if pp_rank == 0 else 0))
    drafts = [
        _Draft(
            axis=MeshAxis.PP,
            group="pp",
            op=CollectiveOp.SEND_RECV,
            purpose=purpose,
            message_bytes=message,
            count_per_step=count,
            overlap_fraction=assumptions.pp_comm_overlap,
            window=_STAGE,
        )
        for purpose, count in (
            ("activations (forward)", forward_sends),
            ("activation gradients (backward)", backward_sends),
        )
    ]
    if model.tied_embeddings and pp_rank in (0, p - 1):
        grad_bytes = state_bytes_per_param(training).gradients
        word = -(-model.vocab_size * model.hidden_size // layout.tp)
        drafts.append(
            _Draft(
                axis=MeshAxis.PP,
                group="pp-embedding",
                op=CollectiveOp.ALL_REDUCE,
                purpose="tied word-embedding gradients (first and last stage)",
                message_bytes=math.ceil(word * grad_bytes),
                count_per_step=1,
                overlap_fraction=0.0,
                window=_NONE,
            )
        )
    return drafts


def _dp_drafts(
    model: ModelConfig,
    layout: ParallelLayout,
    training: TrainingConfig,
    assumptions: PlanAssumptions,
    *,
    params: StageParams,
    micro_batches: int,
    layer_indices: list[int],
) -> list[_Draft]:
    """DP: gradient reduction over ``dp·cp`` (dense) and ``expert_dp`` (routed experts).

    * no sharding: one all-reduce per step;
    * distributed optimizer / ZeRO-1: reduce-scatter of gradients + all-gather of updated weights, once per step
      (Megatron dist_optimizer.md);
    * ZeRO-2: the reduce-scatter runs every micro-batch (gradients are sharded, so they cannot accumulate whole);
    * ZeRO-3: :func:`_zero3_drafts`, per sharded unit as FSDP2 runs them.
    """
    if sharding_stage(training) == 3:
        return _zero3_drafts(
            model,
            layout,
            training,
            assumptions,
            params=params,
            micro_batches=micro_batches,
            layer_indices=layer_indices,
        )
    per = state_bytes_per_param(training)
    stage = sharding_stage(training)
    m = micro_batches
    grad = assumptions.dp_grad_reduce_overlap if training.overlap_grad_reduce else 0.0
    gather = assumptions.dp_param_gather_overlap if training.overlap_param_gather else 0.0
    # (op, what, bytes per param, count, overlap, window) for each sharding stage.
    plans: dict[int, list[tuple[CollectiveOp, str, float, int, float, str]]] = {
        0: [(CollectiveOp.ALL_REDUCE, "gradients", per.gradients, 1, grad, _LAST_BACKWARD)],
        1: [
            (CollectiveOp.REDUCE_SCATTER, "gradients", per.gradients, 1, grad, _LAST_BACKWARD),
            (CollectiveOp.ALL_GATHER, "weights", per.weights, 1, gather, _FIRST_FORWARD),
        ],
        2: [
            (CollectiveOp.REDUCE_SCATTER, "gradients", per.gradients, m, grad, _BACKWARD),
            (CollectiveOp.ALL_GATHER, "weights", per.weights, 1, gather, _FIRST_FORWARD),
        ],
    }
    # the GEMM weights of each group's parameters: what fp8_param_gather gathers in FP8
    gemm = {"dp-cp": params.tp_sharded, "edp": params.experts}

    def message(group: str, n_params: int, op: CollectiveOp, bytes_per_param: float) -> int:
        if op is CollectiveOp.ALL_GATHER:
            return math.ceil(gathered_weight_bytes(training, gemm_weights=gemm[group], other=n_params - gemm[group]))
        return math.ceil(n_params * bytes_per_param)

    drafts = [
        _Draft(
            axis=MeshAxis.DP,
            group=group,
            op=op,
            purpose=f"{kind} {what}",
            message_bytes=message(group, n_params, op, bytes_per_param),
            count_per_step=count,
            overlap_fraction=overlap,
            window=window,
        )
        for group, kind, n_params in (("dp-cp", "dense", params.dense), ("edp", "routed-expert", params.experts))
        for op, what, bytes_per_param, count, overlap, window in plans[stage]
    ]
    return _hybrid(drafts, layout, training)


def _hybrid(drafts: list[_Draft], layout: ParallelLayout, training: TrainingConfig) -> list[_Draft]:
    """Dense dp drafts under hybrid sharding: sharded collectives over the shard group, plus replication.

    Every reduce-scatter of dense gradients then runs over ``dp-shard`` and is followed by an all-reduce of the shard
    it leaves (``1/(dp_shard·cp)`` of its bytes) over ``dp-replicate``, in the same window (FSDP's ``HYBRID_SHARD``
    and FSDP2's HSDP: reduce-scatter, then all-reduce across replicas); all-gathers of weights stay within the shard
    group. Without hybrid sharding, or in a job that shards nothing, the drafts as they are.
    """
    shard = training.hybrid_shard(layout.dp)
    if shard is None or sharding_stage(training) == 0:
        return drafts
    out = []
    for d in drafts:
        if d.group != "dp-cp":
            out.append(d)
            continue
        out.append(replace(d, group="dp-shard"))
        if d.op is CollectiveOp.REDUCE_SCATTER:
            out.append(
                replace(
                    d,
                    group="dp-replicate",
                    op=CollectiveOp.ALL_REDUCE,
                    purpose=f"{d.purpose}: the shard across replicas",
                    message_bytes=math.ceil(d.message_bytes / (shard * layout.cp)),
                )
            )
    return out


def _zero3_drafts(
    model: ModelConfig,
    layout: ParallelLayout,
    training: TrainingConfig,
    assumptions: PlanAssumptions,
    *,
    params: StageParams,
    micro_batches: int,
    layer_indices: list[int],
) -> list[_Draft]:
    """ZeRO-3 as FSDP2 runs it: one sharded unit per transformer layer plus a root unit for the rest of the stage.

    Units follow torchtitan's wrapping (``fully_shard`` on every block, then on the stage): each layer's weights are
    one all-gather message, the stage's embedding, output layer and final norm another (the root). Layers reshard
    after forward; the root does not (FSDP2 keeps the root's weights for backward). Per step, with ``m``
    micro-batches:

    * no pipeline: each layer is gathered in every forward and again in every backward (``2m``), the root in every
      forward (``m``); every unit's gradients are reduce-scattered after every backward (``m``); the 3Ψ of Rajbhandari
      et al. 2019 §7 less the root's backward gather;
    * under a pipeline schedule (``torch.distributed.pipelining``, torchtitan with pp > 1), which keeps units
      unsharded after backward and defers gradient reduction to the last micro-batch: each layer is gathered before
      every forward and once more before the first backward that follows a forward (``m + 1``, whatever the
      schedule), the root once, and every unit's gradients are reduce-scattered once.

    Routed experts form the same per-layer units over the expert-data-parallel group. Messages are the units'
    parameters on this GPU (after tp/ep sharding) at the weight's and the gradient's bytes; FSDP2 pads each
    parameter's first dimension to a multiple of the shard count, which the planner does not (it does not know the
    tensor shapes). Under ``fp8_param_gather`` a unit's GEMM weights are gathered at 1 byte each (Megatron-FSDP's
    FP8 parameter gather).
    """
    per = state_bytes_per_param(training)
    m = micro_batches
    pipelined = layout.pp > 1
    grad = assumptions.dp_grad_reduce_overlap if training.overlap_grad_reduce else 0.0
    gather = assumptions.dp_param_gather_overlap if training.overlap_param_gather else 0.0
    expert_shards = layout.expert_tp * layout.ep
    # (group, kind, layer kind) -> (unit parameters on this GPU, of them GEMM weights, units on the stage); dense and
    # MoE layers differ
    units: dict[tuple[str, str, str], list[int]] = {}
    in_layers = 0
    for layer in layer_indices:
        lp = layer_params(model, layer)
        gemm = math.ceil(lp.tp_sharded / layout.tp)
        dense = gemm + lp.replicated
        in_layers += dense
        layer_kind = "MoE layer" if model.is_moe_layer(layer) else "layer"
        units.setdefault(("dp-cp", "dense", layer_kind), [dense, gemm, 0])[2] += 1
        if lp.routed_experts:
            experts = math.ceil(lp.routed_experts / expert_shards)
            units.setdefault(("edp", "routed-expert", layer_kind), [experts, experts, 0])[2] += 1
    root = params.dense - in_layers
    drafts: list[_Draft] = []

    def add(group: str, op: CollectiveOp, purpose: str, *, size: float, count: int, window: str) -> None:
        drafts.append(
            _Draft(
                axis=MeshAxis.DP,
                group=group,
                op=op,
                purpose=purpose,
                message_bytes=math.ceil(size),
                count_per_step=count,
                overlap_fraction=grad if op is CollectiveOp.REDUCE_SCATTER else gather,
                window=window,
            )
        )

    gather_op, reduce_op = CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER
    for (group, kind, layer_kind), (n_params, gemm, n) in units.items():
        weights = gathered_weight_bytes(training, gemm_weights=gemm, other=n_params - gemm)
        grads = n_params * per.gradients
        if pipelined:
            what = f"{kind} weights per {layer_kind} (before every forward, and before the first backward after one)"
            add(group, gather_op, what, size=weights, count=(m + 1) * n, window=_STAGE)
            what = f"{kind} gradients per {layer_kind} (last micro-batch)"
            add(group, reduce_op, what, size=grads, count=n, window=_LAST_BACKWARD)
        else:
            what = f"{kind} weights per {layer_kind}"
            add(group, gather_op, f"{what} (forward)", size=weights, count=m * n, window=_ALL_FORWARD)
            add(group, gather_op, f"{what} (backward)", size=weights, count=m * n, window=_BACKWARD)
            what = f"{kind} gradients per {layer_kind}"
            add(group, reduce_op, what, size=grads, count=m * n, window=_BACKWARD)
    if root > 0:
        what = "of embedding, output layer and final norm (root unit)"
        count = 1 if pipelined else m
        size = root * per.weights
        add("dp-cp", gather_op, f"dense weights {what}", size=size, count=count, window=_FIRST_FORWARD)
        window = _LAST_BACKWARD if pipelined else _BACKWARD
        add("dp-cp", reduce_op, f"dense gradients {what}", size=root * per.gradients, count=count, window=window)
    return _hybrid(drafts, layout, training)

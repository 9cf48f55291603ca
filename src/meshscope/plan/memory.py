"""Memory of one GPU of each pipeline stage: weights, gradients, optimizer state and activations.

Exists so that a plan can say, before the job starts, which stage runs out of HBM and by how much. It works on one
representative GPU per pipeline stage (every GPU of a stage holds the same shapes); it never loops over ranks.

Conventions (docs/planner.md, "Memory"; reference/planner.md §1.2-§1.3):

* **Model state** follows Megatron-core. Mixed precision (bf16/fp16/fp8) keeps a 2-byte model weight, a main-gradient
  buffer of ``grad_reduce_bytes`` (4: fp32, Megatron's default for bf16), and optimizer state of 4 (fp32 main weight)
  + 8 (Adam moments) bytes, + 4 for an fp32 main-gradient copy when the gradient buffer is 16-bit. That is 18
  bytes/param (6 + 12/d with the distributed optimizer) for bf16 + fp32 grads and 20 (4 + 16/d) for 16-bit grads,
  the numbers of Megatron's ``docs/user-guide/features/dist_optimizer.md``. fp32 training keeps 4 + 4 + 8 = 16
  (8 + 8/d).
* **Sharding**: the distributed optimizer and ZeRO-1 divide the optimizer field by ``d``, ZeRO-2 also the gradient
  field, ZeRO-3 also the weights; ``d`` is ``dp·cp`` for dense parameters (Megatron's data-parallel-with-context
  group) and ``expert_dp`` for routed experts (Megatron PR #4687). ZeRO-3 adds the largest layer's unsharded weights
  and gradients on the stage (DeepSpeed ``estimate_zero3_model_states_mem_needs``: ``4·largest_layer_params``); under
  a pipeline schedule its peak holds the stage's whole weights and gradients (:func:`model_state_bytes`). What stays
  between steps (:func:`resting_state_bytes`) is sharded either way.
* **Parameters per GPU** by bucket (:func:`meshscope.jobs.models.layer_params`): tp-sharded ÷ tp, replicated ÷ 1, routed
  experts ÷ (etp·ep); the word embedding is vocabulary-parallel (÷ tp) on stage 0, a learned position embedding is
  replicated; the output layer (÷ tp) and final norm sit on the last stage; tied embeddings with pp > 1 keep a
  second copy of the word embedding on the last stage, as Megatron does. Divisions round up (the most-loaded rank).
* **Activations** generalise Korthikanti et al. 2022 (eq. 1-6) per layer; see :func:`layer_activation_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshscope.errors import PlanError
from meshscope.jobs import (
    AttentionImpl,
    CpCommType,
    PipelineSchedule,
    Precision,
    Recompute,
    embedding_params,
    layer_params,
    output_params,
)

if TYPE_CHECKING:
    from meshscope.jobs import ModelConfig, ParallelismConfig, TrainingConfig
    from meshscope.topology import ParallelLayout


# ---------------------------------------------------------------------------------------------------- layer split


def stage_layer_ranges(
    layers: int,
    layout: ParallelLayout,
    *,
    embedding_counts_as_layer: bool = False,
    loss_counts_as_layer: bool = False,
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Which transformer layers each pipeline rank holds, one ``[start, stop)`` range per model chunk.

    The ``pp·vpp`` model chunks are numbered in model order; chunk ``v·pp + r`` lives on pipeline rank ``r`` (Megatron
    interleaving). Layers are split evenly; when they do not divide, the earlier chunks get one more. With
    Megatron's ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split`` the embedding /
    the loss count as one layer of the first / last chunk.

    Args:
        layers: transformer layers of the model.
        layout: the parallel layout (``pp``, ``vpp``).
        embedding_counts_as_layer: the first chunk holds one transformer layer less.
        loss_counts_as_layer: the last chunk holds one transformer layer less.

    Returns:
        For every pipeline rank, its chunks' layer ranges in chunk order.

    Raises:
        PlanError: if some chunk would hold no layer (or a negative number of them).
    """
    chunks = layout.pp * layout.vpp
    counted = layers + int(embedding_counts_as_layer) + int(loss_counts_as_layer)
    base, extra = divmod(counted, chunks)
    sizes = [base + (1 if c < extra else 0) for c in range(chunks)]
    if embedding_counts_as_layer:
        sizes[0] -= 1
    if loss_counts_as_layer:
        sizes[-1] -= 1
    allowed_empty = {0} if embedding_counts_as_layer else set()
    if loss_counts_as_layer:
        allowed_empty.add(chunks - 1)
    bad = [c for c, n in enumerate(sizes) if n < 0 or (n == 0 and c not in allowed_empty)]
    if bad:
        raise PlanError(
            f"{layers} layers cannot fill pp*vpp = {layout.pp}*{layout.vpp} = {chunks} model chunks "
            f"(chunk {bad[0]} would hold {sizes[bad[0]]} layers); use fewer pipeline stages or virtual stages"
        )
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    return tuple(
        tuple((starts[v * layout.pp + r], starts[v * layout.pp + r + 1]) for v in range(layout.vpp))
        for r in range(layout.pp)
    )


# ---------------------------------------------------------------------------------------------------- parameters


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageParams:
    """Parameters held by one GPU of a pipeline stage, by how data parallelism reduces them."""

    tp_sharded: int
    """Attention, dense-MLP and shared-expert parameters of the stage's layers, ÷ tp."""
    replicated: int
    """Norms, router, row-parallel biases of the stage's layers (every TP rank holds them whole)."""
    experts: int
    """Routed-expert parameters of the stage's layers, ÷ (etp·ep); reduced over the expert-data-parallel group."""
    embedding: int
    """Input embedding on this stage (word embedding ÷ tp, learned positions whole), or its tied copy on the last
    stage when pp > 1."""
    output: int
    """Output layer (÷ tp) and final norm on the last stage."""
    largest_layer: int
    """Parameters of the biggest single layer on this GPU (what ZeRO-3 gathers at once)."""
    tied_embedding_copy: int = 0
    """Of ``embedding``: the word-embedding copy a last stage keeps for tied embeddings when pp > 1 (its gradient is
    all-reduced with stage 0's)."""

    @property
    def dense(self) -> int:
        """Parameters reduced over the data-parallel (with context-parallel) group."""
        return self.tp_sharded + self.replicated + self.embedding + self.output

    @property
    def total(self) -> int:
        """All parameters on this GPU."""
        return self.dense + self.experts


def stage_params(model: ModelConfig, layout: ParallelLayout, pp_rank: int, layer_indices: list[int]) -> StageParams:
    """Parameters one GPU of pipeline rank ``pp_rank`` holds.

    Args:
        model: the model.
        layout: the parallel layout.
        pp_rank: the pipeline rank.
        layer_indices: the transformer layers of that rank (all its chunks).

    Returns:
        The GPU's parameters by bucket.
    """
    t, expert_shards = layout.tp, layout.expert_tp * layout.ep
    sharded = replicated = experts = largest = 0
    for layer in layer_indices:
        lp = layer_params(model, layer)
        s, rep, e = _ceil_div(lp.tp_sharded, t), lp.replicated, _ceil_div(lp.routed_experts, expert_shards)
        sharded, replicated, experts = sharded + s, replicated + rep, experts + e
        largest = max(largest, s + rep + e)
    word = model.vocab_size * model.hidden_size
    word_per_gpu = _ceil_div(word, t)
    positions = embedding_params(model) - word
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    embedding = word_per_gpu + positions if first else 0
    tied_copy = word_per_gpu if (last and layout.pp > 1 and model.tied_embeddings) else 0
    embedding += tied_copy
    output = 0
    if last:
        head = output_params(model) - (0 if model.tied_embeddings else word)  # final norm
        output = head + (0 if model.tied_embeddings else word_per_gpu)
    return StageParams(
        tp_sharded=sharded,
        replicated=replicated,
        experts=experts,
        embedding=embedding,
        output=output,
        largest_layer=largest,
        tied_embedding_copy=tied_copy,
    )


# ---------------------------------------------------------------------------------------------------- model state


def sharding_stage(training: TrainingConfig) -> int:
    """Effective ZeRO stage: ``zero_stage``, or 1 for Megatron's distributed optimizer (the same sharding).

    Raises:
        PlanError: if ``zero_stage`` is not 0-3.
    """
    if training.zero_stage not in (0, 1, 2, 3):
        raise PlanError(f"training.zero_stage must be 0, 1, 2 or 3, got {training.zero_stage!r}")
    return max(training.zero_stage, 1 if training.distributed_optimizer else 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class StateBytesPerParam:
    """Bytes per parameter of each model-state field before any sharding."""

    weights: float
    """Model weight: 2 (16-bit / fp8 training keeps bf16 weights) or 4 (fp32)."""
    gradients: float
    """Main-gradient buffer: ``grad_reduce_bytes`` (fp32 training: 4)."""
    optimizer: float
    """fp32 main weight (4, mixed precision only) + Adam moments (8) + fp32 main-gradient copy (4, when the gradient
    buffer is 16-bit)."""
    weights_are_main: bool = False
    """fp32 training: the model weight is itself the optimizer's main weight (no separate copy)."""

    @property
    def total(self) -> float:
        """Unsharded bytes per parameter (18 for Megatron's bf16 default)."""
        return self.weights + self.gradients + self.optimizer


def state_bytes_per_param(training: TrainingConfig) -> StateBytesPerParam:
    """Bytes per parameter of weights, gradients and optimizer state (Megatron dist_optimizer.md table).

    Raises:
        PlanError: if ``grad_reduce_bytes`` is not 2 or 4.
    """
    if training.grad_reduce_bytes not in (2, 4):
        raise PlanError(f"training.grad_reduce_bytes must be 2 (bf16) or 4 (fp32), got {training.grad_reduce_bytes!r}")
    if training.precision is Precision.FP32:
        return StateBytesPerParam(weights=4.0, gradients=4.0, optimizer=8.0, weights_are_main=True)
    grads = float(training.grad_reduce_bytes)
    main_grad_copy = 4.0 if grads < 4 else 0.0
    return StateBytesPerParam(weights=2.0, gradients=grads, optimizer=12.0 + main_grad_copy)


def gathered_weight_bytes(training: TrainingConfig, *, gemm_weights: float, other: float) -> float:
    """Bytes a data-parallel all-gather of weights moves for ``gemm_weights`` GEMM weights and ``other`` parameters.

    Every weight at the model weight's bytes (:func:`state_bytes_per_param`), except under ``fp8_param_gather``:
    the transformer layers' GEMM weights (attention and MLP projections, routed experts) are then kept and gathered
    in FP8, 1 byte each, while embeddings, the output layer and norms stay 16-bit (Megatron-core's
    ``--fp8-param-gather``: Transformer Engine's FP8 modules hold their weights as FP8 tensors; the output layer and
    the embedding are not Transformer Engine GEMMs).
    """
    weight = state_bytes_per_param(training).weights
    return (1.0 if training.fp8_param_gather else weight) * gemm_weights + weight * other


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStateBytes:
    """Weights, gradients and optimizer state of one GPU, bytes."""

    weights_bytes: float
    """Model weights (sharded under ZeRO-3, plus the gathered largest layer)."""
    gradients_bytes: float
    """Gradient buffers (sharded under ZeRO-2/3)."""
    optimizer_bytes: float
    """Main weights, main-gradient copies and Adam moments (sharded under dist-opt / ZeRO >= 1)."""
    updated_params: float
    """Parameters whose optimizer step this GPU runs (its shard under dist-opt / ZeRO >= 1)."""


def resting_state_bytes(
    params: StageParams, training: TrainingConfig, *, dense_shards: int, expert_shards: int
) -> ModelStateBytes:
    """Model-state bytes one GPU keeps between steps (after the optimizer step): sharding only, no gathered buffers.

    ZeRO-1 (and the distributed optimizer) shard the optimizer field over the data-parallel shards, ZeRO-2 also the
    gradients, ZeRO-3 also the weights. This is what a training process holds when it counts its parameters, their
    ``.grad`` and its optimizer state right after ``optimizer.step()`` (``meshscope.sdk``'s ``count_model_state``).

    Args:
        params: the GPU's parameters.
        training: precision and sharding settings.
        dense_shards: data-parallel shards of dense parameters, ``dp·cp``.
        expert_shards: data-parallel shards of routed experts, ``expert_dp``.

    Returns:
        Bytes of each field.
    """
    per = state_bytes_per_param(training)
    stage = sharding_stage(training)
    shard = params.dense / dense_shards + params.experts / expert_shards

    def sharded(bytes_per_param: float, *, from_stage: int) -> float:
        return bytes_per_param * (params.total if stage < from_stage else shard)

    return ModelStateBytes(
        weights_bytes=sharded(per.weights, from_stage=3),
        gradients_bytes=sharded(per.gradients, from_stage=2),
        optimizer_bytes=sharded(per.optimizer, from_stage=1),
        updated_params=params.total if stage == 0 else shard,
    )


def model_state_bytes(
    params: StageParams,
    training: TrainingConfig,
    *,
    dense_shards: int,
    expert_shards: int,
    pipelined: bool = False,
) -> ModelStateBytes:
    """Peak model-state bytes of one GPU: :func:`resting_state_bytes` plus what ZeRO-3 gathers during a step.

    ZeRO-3 without a pipeline adds the largest layer's unsharded weights and gradients (DeepSpeed
    ``estimate_zero3_model_states_mem_needs``: ``4·largest_layer_params``). Under a pipeline schedule
    (``torch.distributed.pipelining``, as torchtitan runs FSDP2 with pp > 1) the schedule turns off gradient
    reduction and resharding after backward until the last micro-batch: every unit of the stage is unsharded by the
    end of a backward pass and gradients accumulate unsharded, so the peak holds the stage's whole weights and
    gradients; only the optimizer state stays sharded.

    Args:
        params: the GPU's parameters.
        training: precision and sharding settings.
        dense_shards: data-parallel shards of dense parameters, ``dp·cp``.
        expert_shards: data-parallel shards of routed experts, ``expert_dp``.
        pipelined: the stage runs under a pipeline schedule (pp > 1).

    Returns:
        Bytes of each field.
    """
    per = state_bytes_per_param(training)
    rest = resting_state_bytes(params, training, dense_shards=dense_shards, expert_shards=expert_shards)
    if sharding_stage(training) != 3:
        return rest
    if pipelined:
        weights, grads = per.weights * params.total, per.gradients * params.total
    else:
        weights = rest.weights_bytes + per.weights * params.largest_layer
        grads = rest.gradients_bytes + per.gradients * params.largest_layer
    return ModelStateBytes(
        weights_bytes=weights,
        gradients_bytes=grads,
        optimizer_bytes=rest.optimizer_bytes,
        updated_params=rest.updated_params,
    )


# ---------------------------------------------------------------------------------------------------- activations


def activation_element_bytes(training: TrainingConfig) -> int:
    """Bytes per stored activation element: 4 for fp32 training, else 2.

    fp8 training keeps 2: Transformer Engine saves some GEMM inputs in fp8, but norms, residuals and attention stay
    in bf16, and the planner does not model the mix.
    """
    return 4 if training.precision is Precision.FP32 else 2


def resolve_schedule(training: TrainingConfig, layout: ParallelLayout) -> PipelineSchedule:
    """The pipeline schedule that actually runs.

    ``vpp > 1`` means Megatron's interleaved schedule even when ``1f1b`` is named (Megatron picks the schedule from
    the virtual pipeline size).

    Raises:
        PlanError: for ``interleaved`` with ``vpp == 1``, or ``gpipe`` with ``vpp > 1``.
    """
    schedule = training.pipeline_schedule
    if schedule is PipelineSchedule.INTERLEAVED and layout.vpp == 1:
        raise PlanError("pipeline schedule 'interleaved' needs vpp > 1 (model chunks per pipeline rank), got vpp=1")
    if schedule is PipelineSchedule.GPIPE and layout.vpp > 1:
        raise PlanError(f"pipeline schedule 'gpipe' has no virtual stages, but vpp={layout.vpp}")
    if layout.vpp > 1:
        return PipelineSchedule.INTERLEAVED
    return schedule


def in_flight_microbatches(
    pp_rank: int, layout: ParallelLayout, micro_batches: int, schedule: PipelineSchedule
) -> float:
    """Micro-batches whose activations pipeline rank ``pp_rank`` holds at its peak, in whole-stage units.

    * no pipeline: 1 (gradient accumulation frees each micro-batch before the next);
    * GPipe: all ``m``;
    * 1F1B: ``min(pp - pp_rank, m)`` (Megatron warm-up ``pp - rank - 1``, plus the one in steady state);
    * interleaved: Megatron's warm-up ``2·(pp - rank - 1) + (vpp - 1)·pp`` chunk-micro-batches plus one, capped at
      ``m·vpp``, divided by ``vpp`` (a chunk holds ``1/vpp`` of the stage). For rank 0 this is
      ``pp·(1 + (pp - 1)/(pp·vpp))``, Megatron's interleaved penalty (reference/planner.md §1.3).
    """
    p, vpp, m = layout.pp, layout.vpp, micro_batches
    if p == 1:
        return 1.0
    if schedule is PipelineSchedule.GPIPE:
        return float(m)
    if schedule is PipelineSchedule.INTERLEAVED:
        # megatron/core/pipeline_parallel/schedules.py, microbatch_group_size_per_vp_stage defaults to pp.
        warmup = 2 * (p - pp_rank - 1) + (vpp - 1) * p
        return min(warmup + 1, m * vpp) / vpp
    return float(min(p - pp_rank, m))


def attention_widths_per_gpu(model: ModelConfig, tp: int) -> tuple[float, float, float, float]:
    """Elements per token of Q, K, V and the attention output on one tensor-parallel rank.

    GQA keeps ``max(g/tp, 1)`` key/value heads per rank (Megatron replicates them when tp > g); MLA has ``a/tp`` heads
    of ``qk_head_dim + qk_rope_head_dim`` for Q and K and ``v_head_dim`` for V and the output.
    """
    heads = model.attention_heads / tp
    if model.mla is not None:
        qk = heads * (model.mla.qk_head_dim + model.mla.qk_rope_head_dim)
        v = heads * model.mla.v_head_dim
        return qk, qk, v, v
    d = model.kv_channels
    kv = max(model.groups / tp, 1.0) * d
    return heads * d, kv, kv, heads * d


def _sp_divisor(parallelism: ParallelismConfig) -> int:
    return parallelism.layout.tp if parallelism.sequence_parallel else 1


def layer_activation_bytes(
    model: ModelConfig,
    layer: int,
    parallelism: ParallelismConfig,
    training: TrainingConfig,
    *,
    recompute: Recompute | None = None,
) -> float:
    """Activation bytes one GPU keeps for one micro-batch through transformer layer ``layer``.

    Generalises Korthikanti et al. 2022 eq. 1-4 (``sbh·(34 + 5as/h)`` without parallelism) term by term, with
    ``s -> s/cp`` (context parallelism splits every activation along the sequence, Megatron CP docs), ``e`` bytes
    per element (2, or 4 in fp32) and 1-byte dropout masks only when ``dropout > 0``:

    * replicated over TP unless sequence parallel (then ÷ tp): 2 norm inputs, the QKV input, the MLP input
      (``4·e·sbh``) and two dropout masks (``2·sbh``);
    * ÷ tp: Q, K, V and the output-projection input ``e·sb·d_h·(2a + 2g)/tp`` (GQA keeps ``g`` K/V heads; at least
      one per TP rank). Every context-parallel type keeps only the local (``s/cp``) Q, K, V (Transformer Engine:
      ``all_gather`` gathers K and V again in backward); ``a2a`` (Ulysses) also keeps its head-sharded output before
      the all-to-all back, ``e·sb·a·d_h/tp`` more; the MLP: ``e·sb·f·2/tp`` (fc1 output and activation output),
      ``e·sb·f·3/tp`` for gated MLPs (gate and up output plus activation output);
    * eager attention without recompute: softmax output ``e·a·s_local·s·b/tp``, plus dropout mask and output
      ``(1 + e)·a·s_local·s·b/tp`` when dropout is on (``5as²b`` for bf16, Korthikanti eq. 1); flash attention and
      selective / full recompute keep none of it;
    * MoE layers replace the MLP, as Megatron-core >= 0.13 runs them (the alltoall dispatcher sends each copy's
      routing probability along and the experts apply it to their activation, ``WeightedSwiGLUFunction`` keeping its
      input and the probabilities; permute and unpermute keep only indices): the router's softmax probabilities
      ``e·sb·E`` and two int64 index sets ``2·8·sb·k`` (top-k experts, the sort by expert), ÷ tp when SP; shared
      experts like a dense MLP of ``shared·f_e``; per routed token copy ``e·(h + c·f_e/etp + 1)`` (expert input, fc1
      output and activation output, c = 3 gated or 2, and the probability) for ``k·sb·etp/tp`` copies per GPU: EP
      trades tokens rather than removing them (Megatron PR #6782 discussion), expert-TP ranks share theirs;
    * full recompute keeps only the layer input, ``e·sbh`` (÷ tp when SP).

    For a GPT shape (MHA, 4h GELU MLP, dropout, bf16) this is eq. 2 ``sbh(10 + 24/t + 5as/(ht))``, eq. 4
    ``sbh(34/t + 5as/(ht))`` with SP, and ``sbh·34/t`` with SP and selective recompute.

    Args:
        model: the model.
        layer: layer index (dense or MoE).
        parallelism: layout and sequence parallelism.
        training: micro-batch, precision, recompute and attention implementation.
        recompute: override ``training.recompute`` (the planner asks for ``NONE`` to size the layer that full
            recompute re-materialises).

    Returns:
        Bytes.
    """
    layout = parallelism.layout
    policy = training.recompute if recompute is None else recompute
    t, etp = layout.tp, layout.expert_tp
    e = activation_element_bytes(training)
    h, a, s = model.hidden_size, model.attention_heads, model.seq_length
    s_local = s / layout.cp
    sb = s_local * training.micro_batch_size
    sp = _sp_divisor(parallelism)
    if policy is Recompute.FULL:
        return e * sb * h / sp
    dropout = 1 if model.dropout > 0 else 0
    replicated = (4 * e + 2 * dropout) * sb * h / sp
    if model.mla is not None:
        m = model.mla
        qk = m.qk_head_dim + m.qk_rope_head_dim
        # Up-projected Q, K (a·qk each), V and output-projection input (a·v each), ÷ tp; the compressed latents
        # (input of the up-projections) are replicated like the QKV input.
        attention = e * sb * a * (2 * qk + 2 * m.v_head_dim) / t
        replicated += e * sb * (m.kv_lora_rank + m.qk_rope_head_dim + (m.q_lora_rank or 0)) / sp
    else:
        kv_heads_per_gpu = max(model.groups / t, 1.0)
        attention = e * sb * model.kv_channels * (2 * a / t + 2 * kv_heads_per_gpu)
    if layout.cp > 1 and parallelism.cp_comm_type is CpCommType.A2A:
        # Ulysses keeps the head-sharded output it computed, besides the output projection's (sequence-sharded) input:
        # Transformer Engine's AttnFuncWithCPAndQKVOA2A saves out_part before the all-to-all back.
        attention += e * sb * attention_widths_per_gpu(model, t)[3]
    core = 0.0
    if training.attention is AttentionImpl.EAGER and policy is Recompute.NONE:
        # Local queries attend to all s keys under CP; Korthikanti eq. 1: 2as²b softmax + as²b mask + 2as²b dropout.
        core = (e + dropout * (1 + e)) * a * s_local * s * training.micro_batch_size / t
    gated = 3 if model.activation.gated else 2
    if not model.is_moe_layer(layer):
        mlp = e * sb * model.ffn_hidden_size * gated / t
        return replicated + attention + core + mlp
    moe = model.moe
    assert moe is not None  # is_moe_layer guarantees it
    # Softmax probabilities, and two int64 index sets: the top-k experts and the permutation that sorts the routed
    # copies by expert (which the unpermute reuses).
    router = (e * moe.experts + 2 * 8 * moe.top_k) * sb / sp
    shared = e * sb * moe.shared_experts * moe.expert_ffn_hidden_size * gated / t
    token_copies = moe.top_k * sb * etp / t
    # Per copy: the expert input, fc1 output and activation output, and its routing probability.
    routed = token_copies * e * (h + gated * moe.expert_ffn_hidden_size / etp + 1)
    return replicated + attention + core + router + shared + routed


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationBreakdown:
    """Activation memory of one GPU of a pipeline stage at its peak, bytes."""

    per_microbatch_layers_bytes: float
    """One micro-batch through all the stage's transformer layers."""
    in_flight_microbatches: float
    """Micro-batches held at the peak (whole-stage units; fractional under the interleaved schedule)."""
    layers_bytes: float
    """``per_microbatch_layers_bytes · in_flight_microbatches``."""
    embedding_bytes: float
    """First stage: token ids (8 bytes each) and the embedding dropout mask, per in-flight micro-batch."""
    output_bytes: float
    """Last stage: final-norm input, output-layer input, fp32 logits ``4·sbV/tp`` and labels (Korthikanti §4.3)."""
    recompute_working_bytes: float
    """Full recompute: one layer re-materialised during its backward (one micro-batch, no recompute)."""

    @property
    def total_bytes(self) -> float:
        """All activation bytes."""
        return self.layers_bytes + self.embedding_bytes + self.output_bytes + self.recompute_working_bytes


def stage_activations(
    model: ModelConfig,
    parallelism: ParallelismConfig,
    training: TrainingConfig,
    *,
    pp_rank: int,
    layer_indices: list[int],
    micro_batches: int,
    schedule: PipelineSchedule,
) -> ActivationBreakdown:
    """Peak activation memory of one GPU of pipeline rank ``pp_rank``.

    Args:
        model: the model.
        parallelism: layout and sequence parallelism.
        training: batch, precision, recompute, attention.
        pp_rank: pipeline rank.
        layer_indices: its transformer layers.
        micro_batches: micro-batches per step ``m``.
        schedule: the schedule that runs (:func:`resolve_schedule`).

    Returns:
        The stage's activation bytes by part.
    """
    layout = parallelism.layout
    per_layer = {
        i: layer_activation_bytes(model, i, parallelism, training) for i in _representatives(model, layer_indices)
    }
    per_mb = sum(per_layer[_representative(model, i)] for i in layer_indices)
    in_flight = in_flight_microbatches(pp_rank, layout, micro_batches, schedule)
    e = activation_element_bytes(training)
    sp = _sp_divisor(parallelism)
    h, t = model.hidden_size, layout.tp
    sb = model.seq_length / layout.cp * training.micro_batch_size
    dropout = 1 if model.dropout > 0 else 0
    embedding = 0.0
    if pp_rank == 0:
        # Megatron theoretical_memory_usage: input ids 8·sb and embedding dropout mask sbh/t (SP) per micro-batch.
        embedding = in_flight * (8 * sb + dropout * sb * h / sp)
    output = 0.0
    if pp_rank == layout.pp - 1:
        # The loss runs right after the last stage's forward; only GPipe keeps every micro-batch's logits.
        held = float(micro_batches) if (schedule is PipelineSchedule.GPIPE and layout.pp > 1) else 1.0
        output = held * (2 * e * sb * h / sp + 4 * sb * model.vocab_size / t + 8 * sb)
    working = 0.0
    if training.recompute is Recompute.FULL and layer_indices:
        working = max(
            layer_activation_bytes(model, i, parallelism, training, recompute=Recompute.NONE)
            for i in _representatives(model, layer_indices)
        )
    return ActivationBreakdown(
        per_microbatch_layers_bytes=per_mb,
        in_flight_microbatches=in_flight,
        layers_bytes=per_mb * in_flight,
        embedding_bytes=embedding,
        output_bytes=output,
        recompute_working_bytes=working,
    )


def _representative(model: ModelConfig, layer: int) -> int:
    """Dense and MoE layers each have one shape; use the first of each kind as the representative."""
    if model.moe is None:
        return 0
    return model.moe.dense_layers if model.is_moe_layer(layer) else 0


def _representatives(model: ModelConfig, layer_indices: list[int]) -> set[int]:
    return {_representative(model, i) for i in layer_indices}


# ---------------------------------------------------------------------------------------------------- breakdown


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """HBM one GPU of a pipeline stage needs at its peak, bytes.

    The split: ``weights`` is the model's own weights (bf16, or fp32 in fp32 training); ``gradients`` the main
    gradient buffer; ``optimizer`` everything the optimizer adds (fp32 main weights, fp32 main-gradient copies,
    Adam moments).
    """

    weights_bytes: int
    """Model weights."""
    gradients_bytes: int
    """Gradient buffers."""
    optimizer_bytes: int
    """Optimizer state."""
    activations_bytes: int
    """Activations at the schedule's peak."""

    @property
    def total_bytes(self) -> int:
        """Sum of the four fields."""
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes

    def to_dict(self) -> dict[str, int]:
        """``{weights, gradients, optimizer, activations, total}`` in bytes."""
        return {
            "weights": self.weights_bytes,
            "gradients": self.gradients_bytes,
            "optimizer": self.optimizer_bytes,
            "activations": self.activations_bytes,
            "total": self.total_bytes,
        }


def memory_breakdown(state: ModelStateBytes, activations: ActivationBreakdown) -> MemoryBreakdown:
    """Round the model-state and activation bytes up to whole bytes."""
    return MemoryBreakdown(
        weights_bytes=math.ceil(state.weights_bytes),
        gradients_bytes=math.ceil(state.gradients_bytes),
        optimizer_bytes=math.ceil(state.optimizer_bytes),
        activations_bytes=math.ceil(activations.total_bytes),
    )

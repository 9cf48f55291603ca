"""Seconds of a micro-batch's compute, per operation class, from a roofline with the shape effects of GEMMs.

Exists because one flat efficiency for every FLOP is wrong in the same direction at both ends: large GEMMs run well
above half of peak, small ones and the memory-bound work between them (norms, residual adds, activation functions,
the cross entropy) far below. Each class of operation of a transformer block is timed on one GPU as a roofline over
the GPU's dense peak and HBM bandwidth (the hardware catalogue):

* **GEMMs by shape** (QKV, attention output, MLP up / down, router, routed experts as one grouped GEMM, the logits):
  ``max(FLOPs / (peak x ceiling x quantization), bytes / (HBM x hbm_efficiency))``, where ``ceiling`` is what a
  well-shaped GEMM sustains on that GPU at the precision (the catalogue's) and ``quantization`` is the useful
  fraction of the work the GPU does: output tiles of ``tile_m x tile_n`` (tile quantization) run one per SM per
  wave, ``ceil(tiles / SMs)`` waves (wave quantization), so a GEMM of ``M x N`` does ``waves x SMs x tile_m x
  tile_n`` of work for ``M x N`` of output (NVIDIA *Matrix Multiplication Background User's Guide*). The library's
  best tile is taken. Backward is the two GEMMs of the gradient: the data gradient (``M x K`` out, reduction over
  ``N``) and the weight gradient (``K x N`` out, reduction over ``M``).
* **Attention core** (``QK^T``, softmax, ``AV``, fused): model FLOPs ÷ (peak x ``attention_efficiency``), or the
  bytes of Q, K, V and the output if slower; backward twice the forward. Unfused (``attention: eager``) it runs at the
  GEMM ceiling and streams the ``s^2`` scores through HBM. Under FP8 training it runs at the BF16 peak and ceiling
  unless ``fp8_attention`` (Transformer Engine's FP8 recipes cast the linear layers only).
* **Element-wise and norms** (bytes-bound, no FLOPs counted): two norms, two residual adds, rotary embedding of Q
  and K, the MLP activation, dropout, the MoE permutation and, on the last stage, the final norm and the fp32 cross
  entropy over the vocabulary; each a read and a write of its tensor, backward twice the forward (own derivation,
  docs/planner.md).

FLOPs are the planner's (:mod:`meshscope.plan.flops`, per GPU ÷ tp·cp); shapes only decide how fast they run. The
implied efficiency of a class is its FLOPs ÷ (seconds x peak). Nothing here knows about communication or schedules.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from meshscope.jobs import AttentionImpl, PositionEmbedding, Recompute, attention_params

if TYPE_CHECKING:
    from collections.abc import Mapping

    from meshscope.jobs import ModelConfig, TrainingConfig
    from meshscope.plan.assumptions import PlanAssumptions
    from meshscope.topology import GpuSpec, HardwareConfig, ParallelLayout


class OpClass(StrEnum):
    """Class of operation of a training step, each timed by its own roofline."""

    QKV = "qkv"
    """Q, K, V projection (column-parallel); MLA: every projection."""
    ATTENTION_OUT = "attention_out"
    """Attention output projection (row-parallel)."""
    ATTENTION_CORE = "attention_core"
    """``QK^T``, softmax and ``AV`` (FlashAttention when fused)."""
    MLP_UP = "mlp_up"
    """Dense MLP (and shared experts) up / gate projection."""
    MLP_DOWN = "mlp_down"
    """Dense MLP (and shared experts) down projection."""
    ROUTER = "router"
    """MoE router GEMM."""
    EXPERTS = "experts"
    """Routed experts (up and down, one grouped GEMM over the local experts)."""
    ELEMENTWISE = "elementwise"
    """Norms, residual adds, activation functions, dropout, rotary, permutation, cross entropy: bytes-bound."""
    LOGITS = "logits"
    """Output-layer GEMM over the vocabulary."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassTime:
    """One operation class of one micro-batch on one GPU."""

    forward_flops: float = 0.0
    """Forward model FLOPs (0 for element-wise work)."""
    forward_seconds: float = 0.0
    """Expected forward seconds."""
    backward_seconds: float = 0.0
    """Expected backward seconds (data and weight gradients; no recompute)."""
    forward_bytes: float = 0.0
    """HBM bytes the forward reads and writes (the memory side of the roofline)."""

    def __add__(self, other: ClassTime) -> ClassTime:
        """Sum of two."""
        return ClassTime(
            forward_flops=self.forward_flops + other.forward_flops,
            forward_seconds=self.forward_seconds + other.forward_seconds,
            backward_seconds=self.backward_seconds + other.backward_seconds,
            forward_bytes=self.forward_bytes + other.forward_bytes,
        )

    def scaled(self, factor: float) -> ClassTime:
        """Every term times ``factor`` (a number of layers)."""
        return ClassTime(
            forward_flops=self.forward_flops * factor,
            forward_seconds=self.forward_seconds * factor,
            backward_seconds=self.backward_seconds * factor,
            forward_bytes=self.forward_bytes * factor,
        )


def _precision_bytes(precision: str) -> float:
    return 4.0 if precision == "fp32" else (1.0 if precision == "fp8" else 2.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Machine:
    """What a kernel's time depends on besides its shape: the GPU, the precision and the assumptions."""

    gpu: GpuSpec
    """Peak, HBM bandwidth, SM count and GEMM ceiling."""
    precision: str
    """Training precision (``bf16``, ``fp16``, ``fp8``, ``fp32``)."""
    assumptions: PlanAssumptions
    """GEMM ceiling and tiles, attention and HBM efficiencies, ``causal_attention``."""

    @property
    def peak_flops_per_s(self) -> float:
        """Dense peak at the precision."""
        return self.gpu.peak_flops_per_s(self.precision)

    @property
    def attention_precision(self) -> str:
        """Precision the attention core runs at.

        BF16 under FP8 training unless ``fp8_attention`` (Transformer Engine's ``DelayedScaling(fp8_dpa=False)``
        default: FP8 recipes cast the linear layers' inputs, not attention's).
        """
        if self.precision == "fp8" and not self.assumptions.fp8_attention:
            return "bf16"
        return self.precision

    @property
    def output_layer(self) -> Machine:
        """The machine the output layer's GEMM (the logits) runs on: BF16 under FP8 training.

        Megatron-core's output layer is ``tensor_parallel.ColumnParallelLinear``, not a Transformer Engine module,
        so the FP8 autocast of the transformer layers does not reach it (``megatron/core/models/gpt/gpt_model.py``).
        """
        return replace(self, precision="bf16") if self.precision == "fp8" else self

    @property
    def attention_peak_flops_per_s(self) -> float:
        """Dense peak at :attr:`attention_precision`."""
        return self.gpu.peak_flops_per_s(self.attention_precision)

    @property
    def attention_gemm_ceiling(self) -> float:
        """GEMM ceiling at :attr:`attention_precision` (what unfused attention's two GEMMs reach)."""
        ceiling = self.assumptions.gemm_efficiency
        return ceiling if ceiling is not None else self.gpu.matmul_ceiling(self.attention_precision)

    @property
    def hbm_bytes_per_s(self) -> float:
        """Achievable HBM bandwidth."""
        return self.gpu.hbm_bandwidth_bytes_per_s * self.assumptions.hbm_efficiency

    @property
    def gemm_ceiling(self) -> float:
        """Best fraction of peak a GEMM reaches."""
        ceiling = self.assumptions.gemm_efficiency
        return ceiling if ceiling is not None else self.gpu.matmul_ceiling(self.precision)

    @property
    def activation_bytes(self) -> float:
        """Bytes per activation element: 2 (also under fp8, docs/planner.md), 4 in fp32."""
        return 4.0 if self.precision == "fp32" else 2.0


@functools.lru_cache(maxsize=1 << 15)
def gemm_seconds(m: int, n: int, k: int, *, groups: int = 1, machine: Machine) -> float:
    """Expected seconds of ``groups`` GEMMs of ``(m x k) · (k x n)`` run as one (grouped) kernel.

    Compute: ``2·m·n·k·groups`` FLOPs at ``peak x ceiling x quantization``, quantization being the best over
    ``assumptions.gemm_tiles`` of ``m·n·groups / (waves · SMs · tile_m · tile_n)`` with ``waves = ceil(tiles / SMs)``.
    Memory: both inputs and the output, once, at ``hbm_efficiency``. The slower of the two.
    """
    m, n, k = max(1, m), max(1, n), max(1, k)
    sms = max(1, machine.gpu.sm_count)
    best = 0.0
    for tile_m, tile_n in machine.assumptions.gemm_tiles:
        tiles = groups * math.ceil(m / tile_m) * math.ceil(n / tile_n)
        waves = math.ceil(tiles / sms)
        best = max(best, m * n * groups / (waves * sms * tile_m * tile_n))
    compute = 2.0 * m * n * k * groups / (machine.peak_flops_per_s * machine.gemm_ceiling * best)
    memory = (m * k + k * n + m * n) * groups * _precision_bytes(machine.precision)
    return max(compute, memory / machine.hbm_bytes_per_s)


def _gemm(m: float, n: float, k: float, machine: Machine, *, groups: int = 1) -> ClassTime:
    """Forward and backward (data and weight gradient) of a GEMM ``Y[m,n] = X[m,k] W[k,n]``."""
    mi, ni, ki = (max(1, math.ceil(x)) for x in (m, n, k))
    forward = gemm_seconds(mi, ni, ki, groups=groups, machine=machine)
    backward = gemm_seconds(mi, ki, ni, groups=groups, machine=machine) + gemm_seconds(
        ki, ni, mi, groups=groups, machine=machine
    )
    return ClassTime(
        forward_flops=2.0 * m * n * k * groups,
        forward_seconds=forward,
        backward_seconds=backward,
        forward_bytes=(m * k + k * n + m * n) * groups * _precision_bytes(machine.precision),
    )


def _memory_bound(nbytes: float, machine: Machine) -> ClassTime:
    seconds = nbytes / machine.hbm_bytes_per_s
    return ClassTime(forward_seconds=seconds, backward_seconds=2.0 * seconds, forward_bytes=nbytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Shape:
    """What decides one GPU's shapes: tokens of the micro-batch on this GPU and the sharding."""

    tokens: float
    """``b·s/cp``: tokens of one micro-batch one GPU's GEMMs see (sequence-parallel inputs are gathered)."""
    tp: int
    sp: bool
    ep: int
    etp: int


def _attention(
    model: ModelConfig, shape: _Shape, machine: Machine, attention: AttentionImpl
) -> dict[OpClass, ClassTime]:
    """Projections and core of one attention block, one micro-batch, one GPU."""
    h, s, t, tokens = model.hidden_size, model.seq_length, shape.tp, shape.tokens
    out: dict[OpClass, ClassTime] = {}
    if model.mla is not None:
        # MLA's projections, as one GEMM class of the same FLOPs: width = parameters / h on this GPU.
        out[OpClass.QKV] = _gemm(tokens, attention_params(model)[0] / h / t, h, machine)
        mla = model.mla
        q_width = model.attention_heads * (mla.qk_head_dim + mla.qk_rope_head_dim) / t
        v_width = model.attention_heads * mla.v_head_dim / t
        core_width, core_tensors = q_width + v_width, 2 * q_width + 2 * v_width
    else:
        d, a, g = model.kv_channels, model.attention_heads, model.groups
        out[OpClass.QKV] = _gemm(tokens, (a + 2 * g) * d / t, h, machine)
        out[OpClass.ATTENTION_OUT] = _gemm(tokens, h, a * d / t, machine)
        core_width, core_tensors = 2 * a * d / t, (2 * a + 2 * g) * d / t
    # Attention core: 2·T·s·width FLOPs forward (QK^T and AV), halved for a causal mask.
    core_flops = 2.0 * tokens * s * core_width * (0.5 if machine.assumptions.causal_attention else 1.0)
    peak, element = machine.attention_peak_flops_per_s, machine.activation_bytes
    if attention is AttentionImpl.FLASH:
        core_bytes = tokens * core_tensors * element
        core = max(core_flops / (peak * machine.assumptions.attention_efficiency), core_bytes / machine.hbm_bytes_per_s)
    else:
        # Scores and probabilities (s_l x s per head) written, read by softmax, written, read by AV (and dropout's
        # mask and output with dropout).
        core_bytes = 4.0 * model.attention_heads / t * tokens * s * element * (1.75 if model.dropout else 1.0)
        core = core_flops / (peak * machine.attention_gemm_ceiling) + core_bytes / machine.hbm_bytes_per_s
    out[OpClass.ATTENTION_CORE] = ClassTime(
        forward_flops=core_flops, forward_seconds=core, backward_seconds=2.0 * core, forward_bytes=core_bytes
    )
    return out


def _add(out: dict[OpClass, ClassTime], op: OpClass, time: ClassTime) -> None:
    out[op] = out.get(op, ClassTime()) + time


@functools.lru_cache(maxsize=4096)
def _layer_classes(
    model: ModelConfig, *, moe_layer: bool, shape: _Shape, machine: Machine, attention: AttentionImpl
) -> dict[OpClass, ClassTime]:
    """Every class of one transformer layer, one micro-batch, one GPU."""
    h, t, tokens = model.hidden_size, shape.tp, shape.tokens
    sp = t if shape.sp else 1
    out = _attention(model, shape, machine, attention)
    up = 2 if model.activation.gated else 1
    act_passes = 3.0 if model.activation.gated else 2.0  # gated: read gate and up, write; otherwise read, write
    h_elems = tokens * h / sp
    elements = 10.0 * h_elems  # two norms (read + write) and two residual adds (two reads, one write)
    mask_bytes = 0.0
    if model.dropout:
        elements += 4.0 * h_elems  # two dropouts (read + write) ...
        mask_bytes = 2.0 * h_elems  # ... and their 1-byte masks
    if model.position_embedding is PositionEmbedding.ROTARY and model.mla is None:
        elements += 2.0 * tokens * (model.attention_heads + model.groups) * model.kv_channels / t
    ffn_sizes: list[int] = []
    if model.moe is None or not moe_layer:
        ffn_sizes.append(model.ffn_hidden_size)
    else:
        moe = model.moe
        _add(out, OpClass.ROUTER, _gemm(tokens / t, moe.experts, h, machine))
        if moe.shared_experts:
            ffn_sizes.append(moe.shared_experts * moe.expert_ffn_hidden_size)
        local = max(1, moe.experts // shape.ep)
        per_expert = tokens * moe.top_k * shape.ep * shape.etp / (moe.experts * t)
        f_e = moe.expert_ffn_hidden_size / shape.etp
        _add(out, OpClass.EXPERTS, _gemm(per_expert, up * f_e, h, machine, groups=local))
        _add(out, OpClass.EXPERTS, _gemm(per_expert, h, f_e, machine, groups=local))
        # Routed copies this GPU's experts hold, T·k·etp/t, each f_e/etp wide: T·k·f_e/t activation elements; the
        # permutation before and after the experts reads and writes every copy.
        elements += act_passes * tokens * moe.top_k * moe.expert_ffn_hidden_size / t
        elements += 4.0 * tokens * moe.top_k * h / sp
    for f in ffn_sizes:
        _add(out, OpClass.MLP_UP, _gemm(tokens, up * f / t, h, machine))
        _add(out, OpClass.MLP_DOWN, _gemm(tokens, h, f / t, machine))
        elements += act_passes * tokens * f / t
    out[OpClass.ELEMENTWISE] = _memory_bound(elements * machine.activation_bytes + mask_bytes, machine)
    return out


@functools.lru_cache(maxsize=1024)
def _logits_classes(model: ModelConfig, shape: _Shape, machine: Machine) -> dict[OpClass, ClassTime]:
    """Output layer of one micro-batch on one GPU: the GEMM, the final norm and the fp32 cross entropy."""
    t, tokens, h = shape.tp, shape.tokens, model.hidden_size
    sp = t if shape.sp else 1
    logits = _gemm(tokens, model.vocab_size / t, h, machine.output_layer)
    # Final norm (read + write) and the vocabulary-parallel cross entropy on fp32 logits: upcast, max, exp-sum and
    # the saved softmax (three passes of 4 bytes).
    nbytes = 2.0 * tokens * h / sp * machine.activation_bytes + 3.0 * tokens * model.vocab_size / t * 4.0
    return {OpClass.LOGITS: logits, OpClass.ELEMENTWISE: _memory_bound(nbytes, machine)}


@dataclass(frozen=True, slots=True, kw_only=True)
class StageKernels:
    """Every operation class of one micro-batch through one stage on one GPU, and what recomputation adds."""

    classes: Mapping[OpClass, ClassTime]
    """Per class: forward FLOPs and seconds, backward seconds."""
    recompute_seconds: Mapping[OpClass, float]
    """Forward seconds recomputation adds to the backward pass, per class."""
    recompute_flops: Mapping[OpClass, float]
    """Forward FLOPs recomputation adds, per class."""

    @property
    def forward_seconds(self) -> float:
        """Forward of one micro-batch."""
        return sum(c.forward_seconds for c in self.classes.values())

    @property
    def backward_seconds(self) -> float:
        """Backward of one micro-batch, recompute included."""
        return sum(c.backward_seconds for c in self.classes.values()) + sum(self.recompute_seconds.values())

    def seconds(self, op: OpClass) -> float:
        """Forward + backward + recompute seconds of ``op`` for one micro-batch."""
        c = self.classes.get(op, ClassTime())
        return c.forward_seconds + c.backward_seconds + self.recompute_seconds.get(op, 0.0)

    def flops(self, op: OpClass) -> float:
        """Model FLOPs (3 x forward) plus recompute FLOPs of ``op`` for one micro-batch."""
        return 3.0 * self.classes.get(op, ClassTime()).forward_flops + self.recompute_flops.get(op, 0.0)


def stage_kernels(
    model: ModelConfig,
    layout: ParallelLayout,
    training: TrainingConfig,
    hardware: HardwareConfig,
    assumptions: PlanAssumptions,
    *,
    sequence_parallel: bool,
    layer_indices: list[int],
    last_stage: bool,
) -> StageKernels:
    """Operation classes of one micro-batch through a stage's layers (and the output layer on the last stage).

    Args:
        model: the model.
        layout: tp, cp, ep and expert-tp decide the shapes.
        training: micro-batch, precision, recompute and attention implementation.
        hardware: the GPU (peak, HBM bandwidth, SMs, GEMM ceiling).
        assumptions: ceilings, tiles and ``causal_attention``.
        sequence_parallel: whether activations between GEMMs are sharded over tp (element-wise bytes ÷ tp).
        layer_indices: the stage's transformer layers.
        last_stage: whether the stage runs the output layer.

    Returns:
        The stage's classes and recomputation.
    """
    shape = _Shape(
        tokens=training.micro_batch_size * model.seq_length / layout.cp,
        tp=layout.tp,
        sp=sequence_parallel and layout.tp > 1,
        ep=layout.ep,
        etp=layout.expert_tp,
    )
    machine = Machine(gpu=hardware.gpu, precision=training.precision.value, assumptions=assumptions)
    moe_layers = sum(1 for i in layer_indices if model.is_moe_layer(i))
    return _stage_kernels(
        model,
        shape=shape,
        machine=machine,
        attention=training.attention,
        recompute=training.recompute,
        dense_layers=len(layer_indices) - moe_layers,
        moe_layers=moe_layers,
        last_stage=last_stage,
    )


@functools.lru_cache(maxsize=4096)  # stages of one layout, and layouts of one search, share their shapes
def _stage_kernels(
    model: ModelConfig,
    *,
    shape: _Shape,
    machine: Machine,
    attention: AttentionImpl,
    recompute: Recompute,
    dense_layers: int,
    moe_layers: int,
    last_stage: bool,
) -> StageKernels:
    totals: dict[OpClass, ClassTime] = {}
    for moe_layer, count in ((False, dense_layers), (True, moe_layers)):
        if not count:
            continue
        classes = _layer_classes(model, moe_layer=moe_layer, shape=shape, machine=machine, attention=attention)
        for op, time in classes.items():
            _add(totals, op, time.scaled(count))
    layer_classes = dict(totals)
    if last_stage:
        for op, time in _logits_classes(model, shape, machine).items():
            _add(totals, op, time)
    recompute_seconds: dict[OpClass, float] = {}
    recompute_flops: dict[OpClass, float] = {}
    if recompute is Recompute.FULL:
        recompute_seconds = {op: c.forward_seconds for op, c in layer_classes.items()}
        recompute_flops = {op: c.forward_flops for op, c in layer_classes.items()}
    elif recompute is Recompute.SELECTIVE and OpClass.ATTENTION_CORE in layer_classes:
        core = layer_classes[OpClass.ATTENTION_CORE]
        recompute_seconds = {OpClass.ATTENTION_CORE: core.forward_seconds}
        recompute_flops = {OpClass.ATTENTION_CORE: core.forward_flops}
    return StageKernels(classes=totals, recompute_seconds=recompute_seconds, recompute_flops=recompute_flops)


FLAT: str = "all (flat compute_efficiency)"
"""The one class a plan under the flat model reports."""
GRAD_ACCUMULATION: str = "grad_accumulation (unfused)"
"""The pass that adds each micro-batch's gradients into the main-gradient buffer, without gradient-accumulation
fusion (``PlanAssumptions.grad_accumulation_fusion``): bytes-bound."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeClass:
    """What one operation class costs per step on one GPU, and the efficiency that implies."""

    op: str
    """The :class:`OpClass` value (or :data:`FLAT` under the flat model)."""
    flops_per_step: float
    """Model FLOPs plus recomputation, per step."""
    seconds_per_step: float
    """Expected seconds per step (forward, backward, recompute)."""
    bytes_per_step: float
    """HBM bytes its roofline reads and writes per step (forward, and twice that backward)."""
    efficiency: float | None
    """Implied fraction of the dense peak: ``flops_per_step / (seconds_per_step x peak)``; ``None`` for element-wise
    work, which has no FLOPs in the planner's convention."""

    def to_dict(self) -> dict[str, object]:
        """JSON form (base units)."""
        return {
            "op": self.op,
            "flops_per_step": self.flops_per_step,
            "seconds_per_step": self.seconds_per_step,
            "bytes_per_step": self.bytes_per_step,
            "efficiency": self.efficiency,
        }


def compute_classes(
    kernels: StageKernels | None,
    *,
    micro_batches: int,
    peak_flops_per_s: float,
    flat_efficiency: float | None,
    hardware_flops_per_microbatch: float,
    grad_accumulation: tuple[float, float] = (0.0, 0.0),
) -> tuple[ComputeClass, ...]:
    """Per-step cost of every operation class of one stage, largest first (one :data:`FLAT` row under the flat model).

    Args:
        kernels: the stage's roofline (``None`` under the flat model).
        micro_batches: micro-batches per step.
        peak_flops_per_s: the GPU's dense peak at the training precision.
        flat_efficiency: ``compute_efficiency`` of the flat model.
        hardware_flops_per_microbatch: the stage's hardware FLOPs of one micro-batch (the flat row's FLOPs).
        grad_accumulation: ``(HBM bytes, seconds)`` of one micro-batch's unfused gradient accumulation: a
            :data:`GRAD_ACCUMULATION` row where its seconds are above 0.

    Returns:
        The classes.
    """
    m = micro_batches
    out = []
    accumulation_bytes, accumulation_seconds = grad_accumulation
    if accumulation_seconds > 0:
        out.append(
            ComputeClass(
                op=GRAD_ACCUMULATION,
                flops_per_step=0.0,
                seconds_per_step=m * accumulation_seconds,
                bytes_per_step=m * accumulation_bytes,
                efficiency=None,
            )
        )
    if kernels is None:
        efficiency = flat_efficiency or 1.0
        flops = m * hardware_flops_per_microbatch
        out.append(
            ComputeClass(
                op=FLAT,
                flops_per_step=flops,
                seconds_per_step=flops / (peak_flops_per_s * efficiency),
                bytes_per_step=0.0,
                efficiency=efficiency,
            )
        )
        return tuple(sorted(out, key=lambda c: -c.seconds_per_step))
    for op in OpClass:
        if op not in kernels.classes:
            continue
        seconds = m * kernels.seconds(op)
        flops = m * kernels.flops(op)
        c = kernels.classes[op]
        passes = 3.0 + (1.0 if op in kernels.recompute_seconds else 0.0)
        out.append(
            ComputeClass(
                op=op.value,
                flops_per_step=flops,
                seconds_per_step=seconds,
                bytes_per_step=m * passes * c.forward_bytes,
                efficiency=flops / (seconds * peak_flops_per_s) if flops > 0 and seconds > 0 else None,
            )
        )
    return tuple(sorted(out, key=lambda c: -c.seconds_per_step))

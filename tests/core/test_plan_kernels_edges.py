"""Edges of the compute roofline, the FLOP count and NCCL's cost model that test_plan_kernels.py leaves open.

MLA's attention, the bytes side of every roofline (flash and eager attention core, grouped GEMMs, the precision's
bytes per element), the shapes ``stage_kernels`` derives (cp, sequence parallelism, dense vs MoE layers), the per-step
rows of ``compute_classes``, and the NCCL paths the main tests do not price (point-to-point across nodes, a ring
all-reduce across nodes, ``cpu_time_scale``). Every expected number is worked out by hand from docs/planner.md
("Compute per operation class") and the formulas' sources, in the comment next to it.

``MEMORY_BOUND`` is an H100 with a peak of 1e30 FLOP/s: every compute term is ~1e-20 s, so a time on it is its bytes
÷ (HBM x hbm_efficiency) alone; the other tests run on the catalogue's H100.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshscope.jobs import (
    Activation,
    AttentionImpl,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    PositionEmbedding,
    Precision,
    Recompute,
    TrainingConfig,
)
from meshscope.plan import PlanAssumptions
from meshscope.plan.flops import ForwardFlops, layer_forward_flops, recompute_forward_flops
from meshscope.plan.kernels import (
    ClassTime,
    Machine,
    OpClass,
    StageKernels,
    compute_classes,
    gemm_seconds,
    stage_kernels,
)
from meshscope.plan.nccl import collective_time
from meshscope.topology.hardware import CATALOGUE, GpuSpec, default_hardware
from meshscope.topology.layout import ParallelLayout

H100 = CATALOGUE["H100"]
PEAK, CEILING, HBM = 989e12, 0.620, 3350e9
FP8_PEAK = 1979e12
BW = HBM * 0.8  # achievable HBM bandwidth at the default hbm_efficiency 0.8
MEMORY_BOUND = replace(H100, name="memory-bound", bf16_flops_per_s=1e30, fp8_flops_per_s=1e30)
DEFAULT = PlanAssumptions()


def gqa(**changes: object) -> ModelConfig:
    """h 1024, 16 query heads of d 64 in 2 groups (kv_heads 2), SwiGLU f 4096, rotary, no dropout, s 512."""
    base = ModelConfig(
        name="gqa",
        layers=1,
        hidden_size=1024,
        attention_heads=16,
        kv_heads=2,
        ffn_hidden_size=4096,
        vocab_size=1000,
        seq_length=512,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def kernels_of(
    model: ModelConfig,
    *,
    layout: ParallelLayout | None = None,
    gpu: GpuSpec = H100,
    assumptions: PlanAssumptions = DEFAULT,
    sequence_parallel: bool = False,
    layers: list[int] | None = None,
    last_stage: bool = False,
    **training: object,
) -> StageKernels:
    """The roofline of one micro-batch of size 1 through ``layers`` (layer 0 by default)."""
    config = TrainingConfig(micro_batch_size=1, global_batch_size=1, **training)  # type: ignore[arg-type]
    hardware = replace(default_hardware("H100", 1), gpu=gpu)
    return stage_kernels(
        model, layout or ParallelLayout(), config, hardware, assumptions, sequence_parallel=sequence_parallel,
        layer_indices=layers if layers is not None else [0], last_stage=last_stage,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------- MLA

# DeepSeek-style MLA, small: h 1024, a 8, queries projected directly (no q LoRA), kv LoRA rank 256, per head 64 + 32
# rotary for Q/K and 64 for V. Its projection parameters (attention_params, worked out by hand):
#   W_Q  h·a·(64 + 32)            = 1024·8·96       =   786,432
#   W_DKV h·(256 + 32)            = 1024·288        =   294,912
#   W_UKV 256·a·(64 + 64)         = 256·8·128       =   262,144
#   W_O  a·64·h                   = 8·64·1024       =   524,288
#                                                    P = 1,867,776
MLA = MLAConfig(q_lora_rank=None, kv_lora_rank=256, qk_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)
MLA_PARAMS = 786_432 + 294_912 + 262_144 + 524_288


def mla_model() -> ModelConfig:
    return ModelConfig(
        name="mla",
        layers=1,
        hidden_size=1024,
        attention_heads=8,
        ffn_hidden_size=4096,
        vocab_size=1000,
        seq_length=512,
        mla=MLA,
    )


def test_mla_projections_are_one_gemm_of_two_flops_per_parameter_per_token_on_a_tp_shard():
    # T = 512 tokens, tp 2: one GEMM (T, P/(h·t), h) = (512, 912, 1024): 2·T·P/t FLOPs; bytes (T·h + h·W + T·W)·2 =
    # (524,288 + 933,888 + 466,944)·2 = 3,850,240; no separate output projection.
    kernels = kernels_of(mla_model(), layout=ParallelLayout(tp=2))
    qkv = kernels.classes[OpClass.QKV]
    assert MLA_PARAMS == 1_867_776
    assert qkv.forward_flops == pytest.approx(2 * 512 * MLA_PARAMS / 2)
    assert qkv.forward_bytes == pytest.approx(3_850_240)
    assert OpClass.ATTENTION_OUT not in kernels.classes


def test_mla_attention_core_is_as_wide_as_its_query_and_value_heads():
    # Per GPU (tp 2): Q/K width a·(64 + 32)/t = 384, V/output width a·64/t = 256. Causal QK^T + AV:
    # 2·T·s·(384 + 256)/2 = 512·512·640 FLOPs; flash bytes: Q, K (384 each), V, output (256 each) = 1,280 elements
    # per token, 2 bytes: 512·1280·2 = 1,310,720. On the memory-bound GPU the core takes its bytes' time.
    kernels = kernels_of(mla_model(), layout=ParallelLayout(tp=2), gpu=MEMORY_BOUND)
    core = kernels.classes[OpClass.ATTENTION_CORE]
    assert core.forward_flops == pytest.approx(512 * 512 * 640)
    assert core.forward_bytes == pytest.approx(1_310_720)
    assert core.forward_seconds == pytest.approx(1_310_720 / BW)
    assert core.backward_seconds == pytest.approx(2 * 1_310_720 / BW)


def test_mla_layer_flops_count_every_projection_parameter_and_both_head_widths():
    # Whole layer, T = 512: projections 2·T·P = 1,912,602,624; SwiGLU MLP 2·T·3·h·f = 2·512·3·1024·4096 =
    # 12,884,901,888. Core width a·(64 + 32) + a·64 = 768 + 512 = 1,280: causal 2·T·s·1280/2 = 335,544,320.
    flops = layer_forward_flops(mla_model(), 0, tokens=512.0, causal=True)
    assert flops.linear == pytest.approx(1_912_602_624 + 12_884_901_888)
    assert flops.attention_core == pytest.approx(335_544_320)
    assert flops.experts == 0.0


# ---------------------------------------------------------------------------------------------------- attention core


def test_flash_core_bytes_are_q_k_v_and_output_of_the_tp_shard():
    # GQA, tp 2, T 512: Q a·d/t = 16·64/2 = 512, K and V g·d/t = 2·64/2 = 64 each, output 512: 1,152 elements per
    # token (= (2a + 2g)·d/t), 2 bytes: 512·1152·2 = 1,179,648 bytes. Memory-bound GPU: that many bytes' time.
    core = kernels_of(gqa(), layout=ParallelLayout(tp=2), gpu=MEMORY_BOUND).classes[OpClass.ATTENTION_CORE]
    assert core.forward_bytes == pytest.approx(1_179_648)
    assert core.forward_seconds == pytest.approx(1_179_648 / BW)
    assert core.backward_seconds == pytest.approx(2 * 1_179_648 / BW)


@pytest.mark.parametrize(("causal", "flops"), [(True, 268_435_456), (False, 536_870_912)], ids=["causal", "full"])
def test_causal_attention_halves_the_core_flops_and_full_attention_does_not(causal, flops):
    # GQA, tp 2, T = s = 512: width 2·a·d/t = 1024; QK^T + AV = 2·T·s·1024 = 536,870,912 FLOPs, half when causal.
    assumptions = PlanAssumptions(causal_attention=causal)
    core = kernels_of(gqa(), layout=ParallelLayout(tp=2), assumptions=assumptions).classes[OpClass.ATTENTION_CORE]
    assert core.forward_flops == pytest.approx(flops)


@pytest.mark.parametrize(("dropout", "score_bytes"), [(0.0, 16_777_216), (0.1, 29_360_128)], ids=["plain", "dropout"])
def test_eager_core_runs_at_the_gemm_ceiling_and_streams_the_scores(dropout, score_bytes):
    # Unfused, tp 2: a/t = 8 heads of T x s = 512 x 512 scores, written, read by softmax, written, read by AV:
    # 4·8·512·512·2 bytes = 16,777,216; x1.75 with dropout (its mask and output) = 29,360,128 (docs/planner.md).
    # FLOPs (causal) 268,435,456 at peak x the GEMM ceiling, plus the bytes at HBM x 0.8: both terms add up.
    model = gqa(dropout=dropout)
    core = kernels_of(model, layout=ParallelLayout(tp=2), attention=AttentionImpl.EAGER).classes[OpClass.ATTENTION_CORE]
    assert core.forward_bytes == pytest.approx(score_bytes)
    assert core.forward_seconds == pytest.approx(268_435_456 / (PEAK * CEILING) + score_bytes / BW)


# ---------------------------------------------------------------------------------------------------- GEMMs


@pytest.mark.parametrize(
    ("precision", "element_bytes"),
    [("bf16", 2), ("fp16", 2), ("fp8", 1), ("fp32", 4)],
    ids=["bf16", "fp16", "fp8", "fp32"],
)
def test_a_memory_bound_gemm_moves_its_operands_at_the_precisions_width(precision, element_bytes):
    # 8192 x 64 x 8192 on the memory-bound GPU: (m·k + k·n + m·n) = 67,108,864 + 524,288 + 524,288 elements, each as
    # wide as the precision's operands (fp8 1 byte, bf16/fp16 2, fp32 4).
    machine = Machine(gpu=MEMORY_BOUND, precision=precision, assumptions=DEFAULT)
    elements = 8192 * 8192 + 8192 * 64 + 64 * 8192
    assert gemm_seconds(8192, 64, 8192, machine=machine) == pytest.approx(elements * element_bytes / BW)


def test_fp32_training_doubles_gemm_and_activation_bytes_and_fp8_halves_only_the_gemms():
    """Activations are 2 bytes, 4 in fp32, "also 2 under fp8" (docs/planner.md); GEMM operands take the precision's width."""
    bf16 = kernels_of(gqa(), precision=Precision.BF16).classes
    fp32 = kernels_of(gqa(), precision=Precision.FP32).classes
    fp8 = kernels_of(gqa(), precision=Precision.FP8).classes
    for op in (OpClass.QKV, OpClass.MLP_UP, OpClass.ELEMENTWISE, OpClass.ATTENTION_CORE):
        assert fp32[op].forward_bytes == pytest.approx(2 * bf16[op].forward_bytes), op
    for op in (OpClass.QKV, OpClass.MLP_UP):
        assert fp8[op].forward_bytes == pytest.approx(bf16[op].forward_bytes / 2), op
    for op in (OpClass.ELEMENTWISE, OpClass.ATTENTION_CORE):
        assert fp8[op].forward_bytes == pytest.approx(bf16[op].forward_bytes), op


@pytest.mark.parametrize("attention", [AttentionImpl.FLASH, AttentionImpl.EAGER], ids=["flash", "eager"])
def test_fp8_training_runs_the_attention_core_at_the_bf16_peak_unless_fp8_attention(attention):
    # Transformer Engine's FP8 recipe casts the linear layers' GEMMs, not the attention core (fp8_dpa off by
    # default): its compute stays at the BF16 peak. With fp8_attention it runs at the FP8 peak (1,979 TF/s).
    # Eager attention streams its scores at the same bytes in both precisions, so only its compute term halves.
    model = gqa(seq_length=8192)  # long enough for the fused core to be compute-bound
    bf16 = kernels_of(model, precision=Precision.BF16, attention=attention).classes[OpClass.ATTENTION_CORE]
    fp8 = kernels_of(model, precision=Precision.FP8, attention=attention).classes[OpClass.ATTENTION_CORE]
    both = replace(DEFAULT, fp8_attention=True)
    fp8_core = kernels_of(model, precision=Precision.FP8, attention=attention, assumptions=both)
    core = fp8_core.classes[OpClass.ATTENTION_CORE]
    assert fp8.forward_seconds == pytest.approx(bf16.forward_seconds)
    flops = bf16.forward_flops
    if attention is AttentionImpl.FLASH:
        assert bf16.forward_seconds == pytest.approx(flops / (PEAK * 0.55), rel=1e-3)
        assert core.forward_seconds == pytest.approx(flops / (FP8_PEAK * 0.55), rel=1e-3)
    else:
        # its two GEMMs at the GEMM ceiling of the precision they run at: BF16's 0.620, FP8's 0.467
        streamed = bf16.forward_seconds - flops / (PEAK * CEILING)
        assert core.forward_seconds == pytest.approx(flops / (FP8_PEAK * 0.467) + streamed, rel=1e-3)


def test_fp8_training_runs_the_output_layer_in_bf16():
    # Megatron-core's output layer is tensor_parallel.ColumnParallelLinear, not a Transformer Engine module: FP8
    # autocast does not reach it, so the logits GEMM takes the BF16 time (peak 989 TF/s, ceiling 0.620, 2-byte
    # operands) while the layers' GEMMs take the FP8 one.
    model = gqa(seq_length=8192)
    bf16 = kernels_of(model, precision=Precision.BF16, last_stage=True).classes
    fp8 = kernels_of(model, precision=Precision.FP8, last_stage=True).classes
    assert fp8[OpClass.LOGITS].forward_seconds == pytest.approx(bf16[OpClass.LOGITS].forward_seconds)
    assert fp8[OpClass.LOGITS].backward_seconds == pytest.approx(bf16[OpClass.LOGITS].backward_seconds)
    assert fp8[OpClass.LOGITS].forward_bytes == pytest.approx(bf16[OpClass.LOGITS].forward_bytes)
    assert fp8[OpClass.MLP_UP].forward_seconds < 0.7 * bf16[OpClass.MLP_UP].forward_seconds


def test_a_one_token_micro_batch_is_a_one_row_gemm():
    # s = 1, b = 1: QKV is (1, 3072, 1024) for MHA h 1024, a 8, d 128, tp 1. Memory-bound:
    # (1·1024 + 1024·3072 + 1·3072)·2 = (1,024 + 3,145,728 + 3,072)·2 = 6,299,648 bytes.
    model = gqa(attention_heads=8, kv_heads=None, seq_length=1)
    qkv = kernels_of(model, gpu=MEMORY_BOUND).classes[OpClass.QKV]
    assert qkv.forward_flops == pytest.approx(2 * 1 * 3072 * 1024)
    assert qkv.forward_seconds == pytest.approx(6_299_648 / BW)


# MoE: h 1024, MHA a 8 of d 128, SwiGLU, 8 routed experts of f_e 512, top-2, the first layer dense, T = 512.
def moe_model(layers: int = 1, dense_layers: int = 0) -> ModelConfig:
    return ModelConfig(
        name="moe",
        layers=layers,
        hidden_size=1024,
        attention_heads=8,
        ffn_hidden_size=4096,
        vocab_size=1000,
        seq_length=512,
        moe=MoEConfig(experts=8, top_k=2, expert_ffn_hidden_size=512, dense_layers=dense_layers),
    )


def test_routed_experts_are_one_grouped_gemm_over_the_local_experts():
    # ep 1: 8 local experts of T·k/E = 128 tokens each. Up (128, 2·512, 1024) x 8: (128·1024 + 1024·1024 + 128·1024)
    # = 1,310,720 elements x 8 x 2 B = 20,971,520; down (128, 1024, 512) x 8: (65,536 + 524,288 + 131,072) = 720,896
    # x 16 = 11,534,336. Bytes 32,505,856. FLOPs 2·128·1024·1024·8 + 2·128·1024·512·8 = 3,221,225,472.
    # Memory-bound: forward = bytes / BW; the data and weight gradients read and write the same three matrices:
    # backward = 2 x forward.
    experts = kernels_of(moe_model(), gpu=MEMORY_BOUND).classes[OpClass.EXPERTS]
    assert experts.forward_flops == pytest.approx(3_221_225_472)
    assert experts.forward_bytes == pytest.approx(32_505_856)
    assert experts.forward_seconds == pytest.approx(32_505_856 / BW)
    assert experts.backward_seconds == pytest.approx(2 * 32_505_856 / BW)


def test_a_stage_counts_its_dense_and_moe_layers_apart():
    # Layers 0 (dense), 1, 2 (MoE). QKV every layer: 2·512·(8 + 16)·128·1024 = 3,221,225,472 each, x3.
    # Dense SwiGLU up (512, 8192, 1024): 2·512·8192·1024 = 8,589,934,592, once. Experts (above) 3,221,225,472 and
    # router (512, 8, 1024) 2·512·8·1024 = 8,388,608, twice.
    kernels = kernels_of(moe_model(layers=3, dense_layers=1), layers=[0, 1, 2])
    classes = kernels.classes
    assert classes[OpClass.QKV].forward_flops == pytest.approx(3 * 3_221_225_472)
    assert classes[OpClass.MLP_UP].forward_flops == pytest.approx(8_589_934_592)
    assert classes[OpClass.EXPERTS].forward_flops == pytest.approx(2 * 3_221_225_472)
    assert classes[OpClass.ROUTER].forward_flops == pytest.approx(2 * 8_388_608)


# ---------------------------------------------------------------------------------------------------- shapes


def test_context_parallel_splits_the_tokens_of_a_micro_batch():
    # cp 2: T = 1·512/2 = 256. QKV (256, (16 + 4)·64, 1024): 2·256·1280·1024 = 671,088,640 FLOPs; every class's
    # FLOPs are half of cp 1's (the core's T·s halves with T).
    cp1 = kernels_of(gqa()).classes
    cp2 = kernels_of(gqa(), layout=ParallelLayout(cp=2)).classes
    assert cp2[OpClass.QKV].forward_flops == pytest.approx(671_088_640)
    for op, time in cp2.items():
        assert time.forward_flops == pytest.approx(cp1[op].forward_flops / 2), op


@pytest.mark.parametrize(
    ("sequence_parallel", "nbytes"), [(True, 37_748_736), (False, 58_720_256)], ids=["sp", "no-sp"]
)
def test_sequence_parallel_shards_the_elementwise_work_over_tp(sequence_parallel, nbytes):
    # GELU, learned positions, no dropout, h 1024, f 4096, T = 2048, tp 2: norms and residuals 10·T·h/SP, the
    # activation 2·T·f/t = 8,388,608 elements. SP: 10·2048·512 = 10,485,760; without: 20,971,520. x2 bytes.
    model = gqa(
        kv_heads=None, seq_length=2048, activation=Activation.GELU, position_embedding=PositionEmbedding.LEARNED
    )
    kernels = kernels_of(model, layout=ParallelLayout(tp=2), sequence_parallel=sequence_parallel)
    assert kernels.classes[OpClass.ELEMENTWISE].forward_bytes == pytest.approx(nbytes)


# ---------------------------------------------------------------------------------------------------- per step


def hand_kernels() -> StageKernels:
    """QKV 1 TFLOP in 2 + 4 ms; the core 0.5 TFLOP in 1 + 2 ms, selectively recomputed (1 ms); element-wise 3 + 6 ms."""
    return StageKernels(
        classes={
            OpClass.QKV: ClassTime(forward_flops=1e12, forward_seconds=2e-3, backward_seconds=4e-3, forward_bytes=1e8),
            OpClass.ATTENTION_CORE: ClassTime(
                forward_flops=5e11, forward_seconds=1e-3, backward_seconds=2e-3, forward_bytes=1e7
            ),
            OpClass.ELEMENTWISE: ClassTime(forward_seconds=3e-3, backward_seconds=6e-3, forward_bytes=1e9),
        },
        recompute_seconds={OpClass.ATTENTION_CORE: 1e-3},
        recompute_flops={OpClass.ATTENTION_CORE: 5e11},
    )


def test_stage_kernels_add_recompute_to_a_class_and_nothing_for_an_absent_class():
    kernels = hand_kernels()
    assert kernels.seconds(OpClass.ATTENTION_CORE) == pytest.approx(1e-3 + 2e-3 + 1e-3)
    assert kernels.flops(OpClass.ATTENTION_CORE) == pytest.approx(3 * 5e11 + 5e11)
    assert kernels.seconds(OpClass.QKV) == pytest.approx(6e-3)
    assert kernels.flops(OpClass.QKV) == pytest.approx(3e12)
    assert kernels.seconds(OpClass.ROUTER) == 0.0
    assert kernels.flops(OpClass.ROUTER) == 0.0


def test_compute_classes_per_step_rows_largest_first():
    # m = 2, peak 1 PFLOP/s. Element-wise 2·9 ms = 18 ms, 2·3·1 GB = 6 GB, no efficiency. QKV 2·6 ms = 12 ms, 6 TFLOP,
    # 2·3·100 MB = 600 MB, 6e12 / (12e-3·1e15) = 0.5. Core 2·4 ms = 8 ms, 2·(1.5 + 0.5) = 4 TFLOP, recomputed so
    # four passes of its bytes: 2·4·10 MB = 80 MB, 4e12 / (8e-3·1e15) = 0.5.
    rows = compute_classes(
        hand_kernels(), micro_batches=2, peak_flops_per_s=1e15, flat_efficiency=None, hardware_flops_per_microbatch=0
    )
    assert [r.op for r in rows] == ["elementwise", "qkv", "attention_core"]
    expected = [(0.0, 18e-3, 6e9, None), (6e12, 12e-3, 6e8, 0.5), (4e12, 8e-3, 8e7, 0.5)]
    for row, (flops, seconds, nbytes, efficiency) in zip(rows, expected, strict=True):
        assert row.flops_per_step == pytest.approx(flops), row.op
        assert row.seconds_per_step == pytest.approx(seconds), row.op
        assert row.bytes_per_step == pytest.approx(nbytes), row.op
        assert row.efficiency == (None if efficiency is None else pytest.approx(efficiency)), row.op


def test_any_positive_flops_get_an_efficiency_and_zero_seconds_none():
    # 0.25 forward FLOPs -> 0.75 per step in 1 ms at peak 1: efficiency 750; a class of FLOPs but no seconds has
    # no efficiency (and no division by zero).
    kernels = StageKernels(
        classes={
            OpClass.ROUTER: ClassTime(forward_flops=0.25, forward_seconds=1e-3),
            OpClass.LOGITS: ClassTime(forward_flops=1e9),
        },
        recompute_seconds={},
        recompute_flops={},
    )
    rows = {
        r.op: r
        for r in compute_classes(
            kernels, micro_batches=1, peak_flops_per_s=1.0, flat_efficiency=None, hardware_flops_per_microbatch=0
        )
    }
    assert rows["router"].efficiency == pytest.approx(0.75 / 1e-3)
    assert rows["logits"].efficiency is None


def test_the_flat_row_without_an_efficiency_never_runs_faster_than_peak():
    (row,) = compute_classes(
        None, micro_batches=2, peak_flops_per_s=1e15, flat_efficiency=None, hardware_flops_per_microbatch=1e12
    )
    assert row.flops_per_step == pytest.approx(2e12)
    assert row.efficiency is not None
    assert row.efficiency <= 1.0
    assert row.seconds_per_step >= 2e12 / 1e15


def test_scaling_a_class_time_is_repeated_addition():
    time = ClassTime(forward_flops=1.0, forward_seconds=2.0, backward_seconds=3.0, forward_bytes=5.0)
    assert time.scaled(3) == time + time + time


def test_scaling_forward_flops_is_repeated_addition():
    flops = ForwardFlops(linear=1.0, attention_core=2.0, experts=3.0, logits=5.0)
    assert flops.scaled(3) == flops + flops + flops


@pytest.mark.parametrize(
    ("recompute", "extra"), [(Recompute.NONE, 0.0), (Recompute.SELECTIVE, 2.0), (Recompute.FULL, 6.0)]
)
def test_recompute_adds_nothing_the_core_or_the_layers(recompute, extra):
    # layers = linear + core + experts = 1 + 2 + 3 (not the logits, 5).
    flops = ForwardFlops(linear=1.0, attention_core=2.0, experts=3.0, logits=5.0)
    assert recompute_forward_flops(flops, recompute) == extra


# ---------------------------------------------------------------------------------------------------- NCCL


def _time(op: str, nbytes: int, n: int, nodes: int, link: str, **changes: object):
    bandwidth = 450e9 if link == "nvlink" else 50e9
    return collective_time(
        op, nbytes, group_size=n, nodes=nodes, link=link, link_bandwidth_bytes_per_s=bandwidth,
        assumptions=PlanAssumptions(**changes),  # type: ignore[arg-type]
    )  # fmt: skip


def test_cpu_time_scale_stretches_latency_and_transfer_and_slows_the_bandwidth():
    # 1 MiB send/recv on NVLink: Simple 8.4 + 3.4 = 11.8 µs + 2^20 B at 450 GB/s x 0.8 = 360 GB/s (cheapest, see
    # test_plan_kernels); x2 every time, bandwidth / 2.
    t = _time("send-recv", 2**20, 2, 1, "nvlink", cpu_time_scale=2.0)
    assert (t.algorithm, t.protocol) == ("p2p", "simple")
    assert t.latency_seconds == pytest.approx(2 * 11.8e-6)
    assert t.seconds == pytest.approx(2 * (11.8e-6 + 2**20 / 360e9))
    assert t.bandwidth_bytes_per_s == pytest.approx(360e9 / 2)


def test_all_to_all_across_two_nodes_pays_the_network_hop():
    # 16 ranks on 2 nodes, Simple only: 8.4 base + 14.0 network hop = 22.4 µs; 2^20·15/16 B at 50 GB/s x 0.7.
    t = _time("all-to-all", 2**20, 16, 2, "network", nccl_protocols=("simple",))
    assert (t.algorithm, t.protocol) == ("p2p", "simple")
    assert t.latency_seconds == pytest.approx(22.4e-6)
    assert t.bandwidth_bytes_per_s == pytest.approx(35e9)
    assert t.seconds == pytest.approx(22.4e-6 + 2**20 * 15 / 16 / 35e9)


def test_ring_all_reduce_across_nodes_crosses_the_network_twice_per_node():
    # 16 ranks on 2 nodes, ring LL only: 2·15 = 30 steps, 2·2 = 4 across the network (tuning.cc nInterSteps):
    # 6.6 + 26 x 0.6 + 4 x 2.7 = 33.0 µs; 4 KiB x 2·15/16 at 35 GB/s / 4.
    t = _time("all-reduce", 4096, 16, 2, "network", nccl_algorithms=("ring",), nccl_protocols=("ll",))
    assert (t.algorithm, t.protocol) == ("ring", "ll")
    assert t.latency_seconds == pytest.approx(33.0e-6)
    assert t.bandwidth_bytes_per_s == pytest.approx(35e9 / 4)
    assert t.seconds == pytest.approx(33.0e-6 + 4096 * 2 * 15 / 16 / (35e9 / 4))


def test_tree_all_reduce_reports_the_tree_protocols_bandwidth():
    # 64 ranks on 8 nodes, 1 KiB: tree LL (test_plan_kernels), bandwidth 50 GB/s x 0.7 x 0.92/3.8.
    t = _time("all-reduce", 1024, 64, 8, "network")
    assert (t.algorithm, t.protocol) == ("tree", "ll")
    assert t.bandwidth_bytes_per_s == pytest.approx(35e9 * 0.92 / 3.8)

"""Planner memory: parameters per stage, model-state bytes, activations (Korthikanti et al. 2022), errors.

Every expected number is written out from the formula in reference/planner.md (§1.2, §1.3) or docs/planner.md, never
taken from the code under test.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from builders import gpt_model
from meshscope.errors import PlanError
from meshscope.jobs.models import PRESETS, Activation, ModelConfig, MoEConfig, Norm
from meshscope.jobs.spec import (
    AttentionImpl,
    JobSpec,
    ParallelismConfig,
    PipelineSchedule,
    Precision,
    Recompute,
    TrainingConfig,
)
from meshscope.plan import plan_job
from meshscope.plan.memory import attention_widths_per_gpu, layer_activation_bytes, stage_layer_ranges
from meshscope.topology.hardware import GiB, default_hardware
from meshscope.topology.layout import ParallelLayout

# ---------------------------------------------------------------------------------------------------- builders


def gpt(*, layers: int, h: int, a: int, s: int, v: int = 51200) -> ModelConfig:
    """GPT-3 style: MHA, 4h GELU MLP, LayerNorm, learned positions, dropout (Korthikanti's setting)."""
    return gpt_model(layers=layers, h=h, a=a, s=s, v=v)


# A small Llama-style model whose parameters are easy to count by hand.
H, A, G, D, F, V, S = 256, 8, 2, 32, 512, 1000, 128
ATTENTION = 2 * H * A * D + 2 * H * G * D  # Q, O: h x a·d; K, V: h x g·d = 163,840
MLP = 3 * H * F  # SwiGLU: gate, up, down = 393,216
NORMS = 2 * H  # two RMSNorms per layer


def small_llama(*, layers: int = 4, tied: bool = False, moe: MoEConfig | None = None) -> ModelConfig:
    return ModelConfig(
        name="small",
        layers=layers,
        hidden_size=H,
        attention_heads=A,
        kv_heads=G,
        ffn_hidden_size=F,
        vocab_size=V,
        seq_length=S,
        tied_embeddings=tied,
        moe=moe,
    )


def job(
    model: ModelConfig,
    layout: ParallelLayout,
    *,
    gpu: str = "H100",
    sp: bool = False,
    reserved_bytes: int = 0,
    **training: object,
) -> JobSpec:
    hardware = default_hardware(gpu, max(layout.world_size // 8, 1))
    if layout.world_size < 8:
        hardware = replace(hardware, nodes=1, gpus_per_node=layout.world_size, nvlink_domain_gpus=layout.world_size)
    hardware = replace(hardware, reserved_bytes=reserved_bytes)
    settings: dict[str, object] = {"micro_batch_size": 1, "global_batch_size": layout.dp, **training}
    return JobSpec(
        name="test",
        model=model,
        parallelism=ParallelismConfig(layout=layout, sequence_parallel=sp),
        training=TrainingConfig(**settings),  # type: ignore[arg-type]
        hardware=hardware,
    )


# ---------------------------------------------------------------------------------------------------- layer split


def test_layers_split_evenly_with_extra_layers_on_earlier_stages():
    assert stage_layer_ranges(8, ParallelLayout(pp=4)) == (((0, 2),), ((2, 4),), ((4, 6),), ((6, 8),))
    # 5 layers over 2 stages: the first gets the extra one.
    assert stage_layer_ranges(5, ParallelLayout(pp=2)) == (((0, 3),), ((3, 5),))


def test_interleaved_chunks_alternate_over_pipeline_ranks():
    # Chunk v·pp + r lives on rank r (Megatron interleaving): 8 layers, pp=2, vpp=2 -> chunks of 2.
    assert stage_layer_ranges(8, ParallelLayout(pp=2, vpp=2)) == (((0, 2), (4, 6)), ((2, 4), (6, 8)))


def test_embedding_and_loss_count_as_layers_when_asked():
    # 6 + 2 = 8 over 4 chunks: 2 each, minus one on the first (embedding) and the last (loss) chunk.
    ranges = stage_layer_ranges(6, ParallelLayout(pp=4), embedding_counts_as_layer=True, loss_counts_as_layer=True)
    assert ranges == (((0, 1),), ((1, 3),), ((3, 5),), ((5, 6),))


def test_too_few_layers_for_the_chunks_is_a_plan_error():
    with pytest.raises(PlanError, match=r"3 layers cannot fill pp\*vpp = 2\*2 = 4 model chunks"):
        stage_layer_ranges(3, ParallelLayout(pp=2, vpp=2))


def test_every_stage_is_planned_with_its_own_layers():
    plan = plan_job(job(small_llama(layers=5), ParallelLayout(pp=2)))
    assert [s.layers for s in plan.stages] == [3, 2]
    assert [s.pp_rank for s in plan.stages] == [0, 1]


# ---------------------------------------------------------------------------------------------------- parameters


def test_params_per_stage_embedding_first_output_last():
    plan = plan_job(job(small_llama(), ParallelLayout(tp=2, pp=2)))
    first, last = plan.stages
    # Stage 0: layers 0-1, tp-sharded ÷ 2, norms whole, word embedding ÷ 2 (vocabulary parallel).
    assert first.params.total == 2 * (ATTENTION + MLP) // 2 + 2 * NORMS + V * H // 2
    # Last stage: layers 2-3, final norm (H) and output layer ÷ 2.
    assert last.params.total == 2 * (ATTENTION + MLP) // 2 + 2 * NORMS + H + V * H // 2
    assert first.to_dict()["params"] == first.params.total


def test_tied_embeddings_keep_a_copy_on_the_last_stage_when_pipelined():
    plan = plan_job(job(small_llama(tied=True), ParallelLayout(pp=2)))
    first, last = plan.stages
    assert first.params.total == 2 * (ATTENTION + MLP + NORMS) + V * H
    # Megatron keeps the shared word embedding on the last stage too; no separate output layer.
    assert last.params.total == 2 * (ATTENTION + MLP + NORMS) + V * H + H


def test_single_stage_holds_embedding_and_output_once():
    untied = plan_job(job(small_llama(), ParallelLayout()))
    assert untied.stages[0].params.total == 4 * (ATTENTION + MLP + NORMS) + V * H + H + V * H
    tied = plan_job(job(small_llama(tied=True), ParallelLayout()))
    assert tied.stages[0].params.total == 4 * (ATTENTION + MLP + NORMS) + V * H + H


def test_learned_positions_are_replicated_over_tp():
    model = gpt(layers=2, h=256, a=8, s=128, v=1000)
    stage = plan_job(job(model, ParallelLayout(tp=2))).stages[0]
    assert stage.params.embedding == 1000 * 256 // 2 + 128 * 256


def test_routed_experts_are_divided_by_etp_times_ep():
    moe = MoEConfig(experts=8, top_k=2, expert_ffn_hidden_size=128)
    plan = plan_job(job(small_llama(layers=2, moe=moe), ParallelLayout(dp=8, ep=4)))
    experts_per_gpu = 2 * 8 * 3 * H * 128 // 4  # 2 layers x 8 experts x SwiGLU(h, f_e) ÷ ep
    assert plan.stages[0].params.experts == experts_per_gpu


# ---------------------------------------------------------------------------------------------------- model state

P_SMALL = 4 * (ATTENTION + MLP + NORMS) + V * H + H + V * H  # small_llama on one stage, tp=1


@pytest.mark.parametrize(
    ("training", "bytes_per_param"),
    [
        ({}, 18),  # Megatron: 2 bf16 param + 4 fp32 main grad + 4 fp32 main param + 8 Adam
        ({"distributed_optimizer": True}, 6 + 12 / 8),  # d = dp·cp = 8
        ({"zero_stage": 1}, 6 + 12 / 8),
        ({"zero_stage": 2}, 2 + 16 / 8),
        ({"grad_reduce_bytes": 2}, 20),  # Megatron dist_optimizer.md: fp16 params + fp16 grads
        ({"grad_reduce_bytes": 2, "distributed_optimizer": True}, 4 + 16 / 8),
        ({"precision": Precision.FP32}, 16),
        ({"precision": Precision.FP32, "distributed_optimizer": True}, 8 + 8 / 8),
    ],
    ids=["megatron-18", "dist-opt", "zero1", "zero2", "fp16-grads", "fp16-grads-dist-opt", "fp32", "fp32-dist-opt"],
)
def test_model_state_bytes_per_param(training, bytes_per_param):
    # dp=4 x cp=2: Megatron shards the distributed optimizer over the data-parallel-with-context group (d = 8).
    stage = plan_job(job(small_llama(), ParallelLayout(dp=4, cp=2), global_batch_size=4, **training)).stages[0]
    mem = stage.memory
    state = mem.weights_bytes + mem.gradients_bytes + mem.optimizer_bytes
    assert state == pytest.approx(P_SMALL * bytes_per_param, abs=3)


def test_megatron_split_into_weights_gradients_optimizer():
    stage = plan_job(job(small_llama(), ParallelLayout(dp=8), global_batch_size=8, distributed_optimizer=True)).stages[
        0
    ]
    # Weights and gradients are not partitioned by the distributed optimizer (Narayanan in Megatron-LM#654).
    assert stage.memory.weights_bytes == 2 * P_SMALL
    assert stage.memory.gradients_bytes == 4 * P_SMALL
    assert stage.memory.optimizer_bytes == pytest.approx(12 * P_SMALL / 8, abs=1)


def test_zero3_shards_everything_but_gathers_the_largest_layer():
    stage = plan_job(job(small_llama(), ParallelLayout(dp=8), global_batch_size=8, zero_stage=3)).stages[0]
    largest = ATTENTION + MLP + NORMS  # one whole layer (tp=1)
    # DeepSpeed: 18Ψ/N + 4·largest_layer (2 bytes weights + 2 bytes grads there; ours: weight + grad bytes = 2 + 4).
    state = stage.memory.weights_bytes + stage.memory.gradients_bytes + stage.memory.optimizer_bytes
    assert state == pytest.approx(18 * P_SMALL / 8 + (2 + 4) * largest, abs=3)


def test_zero3_at_rest_is_sharding_only():
    d = 8
    stage = plan_job(job(small_llama(), ParallelLayout(dp=d), global_batch_size=d, zero_stage=3)).stages[0]
    rest = stage.resting_state
    # What a GPU keeps between steps: 2 + 4 + 12 bytes per parameter, all divided by d (no gathered layer).
    assert rest.weights_bytes == pytest.approx(2 * P_SMALL / d)
    assert rest.gradients_bytes == pytest.approx(4 * P_SMALL / d)
    assert rest.optimizer_bytes == pytest.approx(12 * P_SMALL / d)
    largest = ATTENTION + MLP + NORMS
    assert stage.memory.weights_bytes == pytest.approx(rest.weights_bytes + 2 * largest, abs=1)


def test_resting_state_equals_the_peak_without_zero3():
    stage = plan_job(job(small_llama(), ParallelLayout(dp=8), global_batch_size=8, distributed_optimizer=True)).stages[
        0
    ]
    rest, peak = stage.resting_state, stage.memory
    assert (round(rest.weights_bytes), round(rest.gradients_bytes), round(rest.optimizer_bytes)) == (
        peak.weights_bytes,
        peak.gradients_bytes,
        peak.optimizer_bytes,
    )


def test_zero3_under_a_pipeline_peaks_with_the_stages_whole_weights_and_gradients():
    # torch.distributed.pipelining keeps every FSDP2 unit gathered after backward and accumulates unsharded
    # gradients until the last micro-batch: only the optimizer state stays sharded at the peak.
    d, p = 4, 2
    plan = plan_job(job(small_llama(), ParallelLayout(dp=d, pp=p), global_batch_size=d * 2, zero_stage=3))
    for stage in plan.stages:
        n = stage.params.total
        assert stage.memory.weights_bytes == 2 * n
        assert stage.memory.gradients_bytes == 4 * n
        assert stage.memory.optimizer_bytes == pytest.approx(12 * n / d, abs=1)
        assert stage.resting_state.weights_bytes == pytest.approx(2 * n / d)


def test_moe_dist_opt_uses_expert_data_parallel_for_experts():
    moe = MoEConfig(experts=8, top_k=2, expert_ffn_hidden_size=128)
    plan = plan_job(
        job(small_llama(layers=2, moe=moe), ParallelLayout(dp=8, ep=4), global_batch_size=8, distributed_optimizer=True)
    )
    mem = plan.stages[0].memory
    router = H * 8
    dense = 2 * (ATTENTION + NORMS + router) + V * H + H + V * H
    experts = 2 * 8 * 3 * H * 128 // 4
    edp = 8 // 4  # tp·cp·dp / (etp·ep)
    # Megatron PR #4687: W = dense·(6 + 12/d) + experts·(6 + 12/EDP).
    expected = dense * (6 + 12 / 8) + experts * (6 + 12 / edp)
    assert mem.weights_bytes + mem.gradients_bytes + mem.optimizer_bytes == pytest.approx(expected, abs=3)


# ---------------------------------------------------------------------------------------------------- activations
# Korthikanti et al. 2022: per layer, bytes, 16-bit activations, 1-byte dropout masks, MHA, 4h MLP.


def _layer_bytes(model: ModelConfig, layout: ParallelLayout, *, sp: bool, **training: object) -> float:
    settings: dict[str, object] = {"micro_batch_size": 1, "global_batch_size": layout.dp, **training}
    return layer_activation_bytes(
        model,
        0,
        ParallelismConfig(layout=layout, sequence_parallel=sp),
        TrainingConfig(**settings),  # type: ignore[arg-type]
    )


KORTHIKANTI = [  # (a, h, s, t): 22B, 175B, 530B, 1T of Korthikanti Table 3
    (64, 6144, 2048, 8),
    (96, 12288, 2048, 8),
    (128, 20480, 2048, 8),
    (160, 25600, 2048, 8),
    (96, 12288, 2048, 1),
]
KIDS = ["22B", "175B", "530B", "1T", "175B-t1"]


@pytest.mark.parametrize(("a", "h", "s", "t"), KORTHIKANTI, ids=KIDS)
def test_korthikanti_eq2_tensor_parallel(a, h, s, t):
    model = gpt(layers=1, h=h, a=a, s=s)
    got = _layer_bytes(model, ParallelLayout(tp=t), sp=False, attention=AttentionImpl.EAGER)
    assert got == pytest.approx(s * 1 * h * (10 + 24 / t + 5 * a * s / (h * t)))


def test_korthikanti_eq1_without_parallelism():
    a, h, s, b = 96, 12288, 2048, 4
    model = gpt(layers=1, h=h, a=a, s=s)
    got = _layer_bytes(model, ParallelLayout(), sp=False, attention=AttentionImpl.EAGER, micro_batch_size=b)
    assert got == pytest.approx(s * b * h * (34 + 5 * a * s / h))


@pytest.mark.parametrize(("a", "h", "s", "t"), KORTHIKANTI, ids=KIDS)
def test_korthikanti_eq4_tensor_and_sequence_parallel(a, h, s, t):
    model = gpt(layers=1, h=h, a=a, s=s)
    got = _layer_bytes(model, ParallelLayout(tp=t), sp=True, attention=AttentionImpl.EAGER)
    assert got == pytest.approx(s * h * (34 / t + 5 * a * s / (h * t)))


@pytest.mark.parametrize(("a", "h", "s", "t"), KORTHIKANTI, ids=KIDS)
def test_korthikanti_selective_recompute(a, h, s, t):
    model = gpt(layers=1, h=h, a=a, s=s)
    tp_only = _layer_bytes(
        model, ParallelLayout(tp=t), sp=False, attention=AttentionImpl.EAGER, recompute=Recompute.SELECTIVE
    )
    assert tp_only == pytest.approx(s * h * (10 + 24 / t))
    with_sp = _layer_bytes(
        model, ParallelLayout(tp=t), sp=True, attention=AttentionImpl.EAGER, recompute=Recompute.SELECTIVE
    )
    assert with_sp == pytest.approx(s * h * 34 / t)


def test_flash_attention_drops_the_attention_scores():
    a, h, s, t = 96, 12288, 2048, 8
    model = gpt(layers=1, h=h, a=a, s=s)
    flash = _layer_bytes(model, ParallelLayout(tp=t), sp=True, attention=AttentionImpl.FLASH)
    assert flash == pytest.approx(s * h * 34 / t)


def test_full_recompute_keeps_only_the_layer_input():
    a, h, s, t = 96, 12288, 2048, 8
    model = gpt(layers=1, h=h, a=a, s=s)
    assert _layer_bytes(model, ParallelLayout(tp=t), sp=False, recompute=Recompute.FULL) == pytest.approx(2 * s * h)
    assert _layer_bytes(model, ParallelLayout(tp=t), sp=True, recompute=Recompute.FULL) == pytest.approx(2 * s * h / t)


def test_megatron_general_ffn_term_on_the_sp_selective_path():
    # Megatron theoretical_memory_usage (SP + selective): s·b·h·(18 + 4f/h)/t, with f = 3h here.
    h, s, t = 4096, 4096, 4
    model = ModelConfig(
        name="gpt-3h",
        layers=1,
        hidden_size=h,
        attention_heads=32,
        ffn_hidden_size=3 * h,
        vocab_size=1000,
        seq_length=s,
        activation=Activation.GELU,
        norm=Norm.LAYERNORM,
        dropout=0.1,
    )
    got = _layer_bytes(model, ParallelLayout(tp=t), sp=True, recompute=Recompute.SELECTIVE)
    assert got == pytest.approx(s * h * (18 + 4 * 3) / t)


def test_gqa_swiglu_layer_without_dropout():
    # Llama 3 8B shape, t=8, SP, flash, bf16, no dropout (own derivation, docs/planner.md):
    #   2 norm inputs + QKV input + MLP input: 4 elements of h per token, ÷ t (SP)     -> 2·4·sbh/t
    #   Q and O-proj input (a/t heads each), K and V (max(g/t, 1) heads each)         -> 2·sb·d·(2a/t + 2·1)
    #   SwiGLU: gate+up output (2f) and activation output (f), ÷ t                     -> 2·sb·3f/t
    h, a, g, d, f, s, t = 4096, 32, 8, 128, 14336, 8192, 8
    model = ModelConfig(
        name="l8",
        layers=1,
        hidden_size=h,
        attention_heads=a,
        kv_heads=g,
        ffn_hidden_size=f,
        vocab_size=1000,
        seq_length=s,
    )
    got = _layer_bytes(model, ParallelLayout(tp=t), sp=True)
    sb = s * 1
    assert got == pytest.approx(2 * 4 * sb * h / t + 2 * sb * d * (2 * a / t + 2 * 1) + 2 * sb * 3 * f / t)


def test_gqa_with_more_tensor_parallel_ranks_than_kv_heads_replicates_one_kv_head_per_rank():
    # g = 2 KV heads over t = 8 ranks: Megatron replicates them, so every rank keeps max(g/t, 1) = 1 K and 1 V head
    # (not g/t = 1/4). SP, flash, bf16, no dropout, SwiGLU (own derivation, as the test above):
    #   2·4·sbh/t + 2·sb·d·(2a/t + 2·1) + 2·sb·3f/t
    h, a, g, d, f, s, t = 2048, 16, 2, 128, 5632, 4096, 8
    model = ModelConfig(
        name="gqa",
        layers=1,
        hidden_size=h,
        attention_heads=a,
        kv_heads=g,
        ffn_hidden_size=f,
        vocab_size=1000,
        seq_length=s,
    )
    got = _layer_bytes(model, ParallelLayout(tp=t), sp=True)
    assert got == pytest.approx(2 * 4 * s * h / t + 2 * s * d * (2 * a / t + 2 * 1) + 2 * s * 3 * f / t)
    # = 8,388,608 + 6,291,456 + 17,301,504 bytes (written out, so that a changed formula cannot agree by accident)
    assert got == pytest.approx(8_388_608 + 6_291_456 + 17_301_504)
    # The per-rank widths: Q and output a/t·d = 256, K and V one head of d = 128 each.
    assert attention_widths_per_gpu(model, t) == (256.0, 128.0, 128.0, 256.0)
    assert attention_widths_per_gpu(model, 1) == (16 * 128.0, 2 * 128.0, 2 * 128.0, 16 * 128.0)


def test_context_parallel_divides_the_sequence():
    h, a, g, f, s = 4096, 32, 8, 14336, 8192
    model = ModelConfig(
        name="l8",
        layers=1,
        hidden_size=h,
        attention_heads=a,
        kv_heads=g,
        ffn_hidden_size=f,
        vocab_size=1000,
        seq_length=s,
    )
    no_cp = _layer_bytes(model, ParallelLayout(tp=2), sp=True)
    cp4 = _layer_bytes(model, ParallelLayout(tp=2, cp=4), sp=True)
    # Every term is linear in s once the s² scores are gone (flash): s -> s/cp.
    assert cp4 == pytest.approx(no_cp / 4)


def test_moe_layer_activations():
    # Mixtral-like MoE layer, t=1, ep=4 (carved out of dp), no SP, flash, bf16, no dropout:
    #   norms, QKV input, MLP input: 2·4·sbh; attention: 2·sb·d·(2a + 2g)
    #   router (Megatron-core >= 0.13): softmax probabilities 2·sb·E, top-k experts and the sort by expert 2·8·sb·k
    #   (int64); routed: k·sb token copies x 2·(h + 3·f_e + 1) (expert input; fc1 output, activation output; the
    #   routing probability the weighted SwiGLU keeps)
    h, a, g, d, s, e_count, k, fe = 1024, 16, 4, 64, 2048, 8, 2, 3584
    moe = MoEConfig(experts=e_count, top_k=k, expert_ffn_hidden_size=fe)
    model = ModelConfig(
        name="moe",
        layers=1,
        hidden_size=h,
        attention_heads=a,
        kv_heads=g,
        ffn_hidden_size=4096,
        vocab_size=1000,
        seq_length=s,
        moe=moe,
    )
    got = _layer_bytes(model, ParallelLayout(dp=4, ep=4), sp=False)
    sb = s
    router = 2 * sb * e_count + 2 * 8 * sb * k
    expected = 2 * 4 * sb * h + 2 * sb * d * (2 * a + 2 * g) + router + k * sb * 2 * (h + 3 * fe + 1)
    assert got == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------------- stages


def _gpt3_job(p: int, *, vpp: int = 1, m: int, schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B) -> JobSpec:
    model = gpt(layers=96, h=12288, a=96, s=2048)
    return job(
        model,
        ParallelLayout(tp=8, pp=p, vpp=vpp),
        sp=True,
        global_batch_size=m,
        recompute=Recompute.SELECTIVE,
        pipeline_schedule=schedule,
    )


def test_korthikanti_eq6_first_stage_holds_all_layers_worth():
    s, h, big_l, t, p, b = 2048, 12288, 96, 8, 8, 1
    plan = plan_job(_gpt3_job(p, m=16))
    first = plan.stages[0].activations
    # Eq. 6: 34·sbhL/t (p micro-batches in flight x L/p layers).
    assert first.in_flight_microbatches == p
    assert first.layers_bytes == pytest.approx(34 * s * b * h * big_l / t)
    # Embedding dropout mask sbhp/t (Korthikanti §4.3) plus the 8-byte token ids of each in-flight micro-batch.
    assert first.embedding_bytes == pytest.approx(p * (s * b * h / t + 8 * s * b))


def test_1f1b_stage_i_holds_p_minus_i_micro_batches():
    s, h, t, p = 2048, 12288, 8, 8
    plan = plan_job(_gpt3_job(p, m=16))
    per_layer = 34 * s * h / t
    for stage in plan.stages:
        assert stage.activations.in_flight_microbatches == p - stage.pp_rank
        assert stage.activations.layers_bytes == pytest.approx((p - stage.pp_rank) * 12 * per_layer)


def test_last_stage_keeps_fp32_logits():
    s, h, t, v = 2048, 12288, 8, 51200
    last = plan_job(_gpt3_job(8, m=16)).stages[-1].activations
    # Final-norm input 2sbh/t, output-layer input 2sbh/t, fp32 logits 4sbV/t (Korthikanti §4.3), labels 8sb.
    assert last.output_bytes == pytest.approx(2 * s * h / t + 2 * s * h / t + 4 * s * v / t + 8 * s)


def test_fewer_micro_batches_than_stages_caps_in_flight():
    plan = plan_job(_gpt3_job(8, m=3))
    assert [s.activations.in_flight_microbatches for s in plan.stages] == [3, 3, 3, 3, 3, 3, 2, 1]


def test_gpipe_holds_every_micro_batch():
    plan = plan_job(_gpt3_job(8, m=12, schedule=PipelineSchedule.GPIPE))
    assert {s.activations.in_flight_microbatches for s in plan.stages} == {12}


def test_gpipe_last_stage_keeps_every_micro_batchs_logits():
    # GPipe runs all m forwards before the first backward, so the last stage holds m micro-batches of its outputs:
    # m x (final-norm input 2sbh/t + output-layer input 2sbh/t + fp32 logits 4sbV/t + labels 8sb). 1F1B holds one.
    s, h, t, v, m = 2048, 12288, 8, 51200, 12
    one = 2 * s * h / t + 2 * s * h / t + 4 * s * v / t + 8 * s  # 12,582,912 + 52,428,800 + 16,384 = 65,028,096
    assert one == 65_028_096
    gpipe = plan_job(_gpt3_job(8, m=m, schedule=PipelineSchedule.GPIPE))
    assert gpipe.stages[-1].activations.output_bytes == pytest.approx(m * one)
    assert [st.activations.output_bytes for st in gpipe.stages[:-1]] == [0.0] * 7
    one_f_one_b = plan_job(_gpt3_job(8, m=m))
    assert one_f_one_b.stages[-1].activations.output_bytes == pytest.approx(one)


def test_interleaved_first_stage_pays_megatron_penalty():
    s, h, big_l, t, p, v = 2048, 12288, 96, 8, 8, 2
    plan = plan_job(_gpt3_job(p, vpp=v, m=16, schedule=PipelineSchedule.INTERLEAVED))
    first = plan.stages[0].activations
    # Korthikanti eq. 6 x interleaving factor 1 + (p-1)/(p·v) (Megatron interleaved_schedule_memory_penalty).
    assert first.layers_bytes == pytest.approx(34 * s * h * big_l / t * (1 + (p - 1) / (p * v)))
    # Last rank: warm-up (vpp-1)·p chunk-micro-batches + 1, each 1/vpp of the stage.
    assert plan.stages[-1].activations.in_flight_microbatches == ((v - 1) * p + 1) / v


def test_full_recompute_adds_one_rematerialised_layer():
    h, a, s, t = 12288, 96, 2048, 8
    model = gpt(layers=4, h=h, a=a, s=s)
    stage = plan_job(job(model, ParallelLayout(tp=t), sp=True, recompute=Recompute.FULL)).stages[0]
    assert stage.activations.layers_bytes == pytest.approx(4 * 2 * s * h / t)
    assert stage.activations.recompute_working_bytes == pytest.approx(34 * s * h / t)


# ---------------------------------------------------------------------------------------------------- totals


def test_total_and_headroom_against_usable_hbm():
    reserved = 2 * GiB
    plan = plan_job(job(small_llama(), ParallelLayout(tp=8), reserved_bytes=reserved))
    stage = plan.stages[0]
    mem = stage.memory
    # By hand, tp = 8: a layer keeps (Q, O 2·h·a·d + K, V 2·h·g·d + MLP 3·h·f) / 8 + norms 2h = 69,632 + 512
    # parameters, four of them 280,576; embedding and output layer V·h/8 = 32,000 each; final norm 256: 344,832.
    params = 4 * ((2 * H * A * D + 2 * H * G * D + 3 * H * F) // 8 + 2 * H) + 2 * (V * H // 8) + H
    assert params == 344_832
    # Megatron, bf16: 2 bytes of weight, 4 of fp32 main gradient, 12 of optimizer (main weight + two moments).
    assert (mem.weights_bytes, mem.gradients_bytes, mem.optimizer_bytes) == (2 * params, 4 * params, 12 * params)
    # Activations (one micro-batch in flight, no SP, flash, no dropout, b = 1, s = 128, e = 2):
    #   per layer: norms, QKV and MLP inputs 4·e·sbh = 262,144; Q and O-input a/t = 1 head, K and V max(g/t, 1) = 1
    #   head each, e·sb·d·(2 + 2) = 32,768; SwiGLU e·sb·3f/t = 49,152: 344,064, x 4 layers = 1,376,256;
    #   first stage: token ids 8·sb = 1,024; last stage: final-norm and output-layer inputs 2·e·sbh = 131,072,
    #   fp32 logits 4·sb·V/t = 64,000, labels 8·sb = 1,024.
    activations = (
        4 * (4 * 2 * S * H + 2 * S * D * (2 + 2) + 2 * S * 3 * F // 8) + 8 * S + 2 * 2 * S * H + 4 * S * V // 8
    )
    activations += 8 * S
    assert activations == 1_376_256 + 1_024 + 131_072 + 64_000 + 1_024
    assert mem.activations_bytes == activations
    assert mem.total_bytes == 18 * params + activations == 7_780_352
    assert stage.hbm_bytes == 80 * GiB - reserved
    assert stage.headroom_bytes == 80 * GiB - reserved - mem.total_bytes
    data = stage.to_dict()
    assert data["memory_bytes"] == {
        "weights": mem.weights_bytes,
        "gradients": mem.gradients_bytes,
        "optimizer": mem.optimizer_bytes,
        "activations": mem.activations_bytes,
        "total": mem.total_bytes,
    }
    assert data["headroom_bytes"] == stage.headroom_bytes


def test_llama3_8b_on_8_h100_tp8_fits_with_known_weights():
    plan = plan_job(job(PRESETS["llama3-8b"], ParallelLayout(tp=8), sp=True, global_batch_size=8))
    stage = plan.stages[0]
    # 8,030,261,248 parameters; each TP rank holds 1/8 of the matrices, the norms whole.
    h, f, v, layers = 4096, 14336, 128256, 32
    per_layer_sharded = 2 * h * 32 * 128 + 2 * h * 8 * 128 + 3 * h * f
    params = layers * (per_layer_sharded // 8 + 2 * h) + v * h // 8 + h + v * h // 8
    assert stage.params.total == params
    assert stage.memory.weights_bytes == 2 * params
    assert stage.headroom_bytes > 0


# ---------------------------------------------------------------------------------------------------- errors


def test_batch_that_does_not_split_into_micro_batches():
    with pytest.raises(PlanError, match=r"global_batch_size 10 is not a multiple of micro_batch_size·dp = 1·4 = 4"):
        plan_job(job(small_llama(), ParallelLayout(dp=4), global_batch_size=10))


def test_interleaved_needs_virtual_stages():
    with pytest.raises(PlanError, match=r"'interleaved' needs vpp > 1"):
        plan_job(job(small_llama(), ParallelLayout(pp=2), pipeline_schedule=PipelineSchedule.INTERLEAVED))


def test_zero_stage_out_of_range():
    with pytest.raises(PlanError, match=r"zero_stage must be 0, 1, 2 or 3, got 4"):
        plan_job(job(small_llama(), ParallelLayout(), zero_stage=4))


def test_hardware_that_does_not_match_the_layout():
    spec = job(small_llama(), ParallelLayout(tp=8))
    spec = replace(spec, hardware=default_hardware("H100", 2))
    with pytest.raises(
        PlanError, match=r"needs dp·tp·pp·cp = 8 GPUs but the hardware has nodes·gpus_per_node = 2·8 = 16"
    ):
        plan_job(spec)

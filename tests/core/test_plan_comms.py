"""Planner collectives: messages, counts, bus factors, links, FLOPs per byte (reference/planner.md §1.4, §1.7).

Expected numbers are written from the formulas: Narayanan et al. 2021 §3.2 (TP, PP), Korthikanti et al. 2022 (SP),
nccl-tests PERFORMANCE.md (bus factors), ZeRO §7 (1.5x), and the worked values of reference §1.7.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from builders import gpt_model
from meshscope.jobs.models import ModelConfig, MoEConfig, PositionEmbedding
from meshscope.jobs.spec import CpCommType, JobSpec, ParallelismConfig, PipelineSchedule, Precision, TrainingConfig
from meshscope.plan import CollectiveOp, CollectivePlan, Plan, PlanAssumptions, plan_job
from meshscope.topology.hardware import default_hardware
from meshscope.topology.layout import ParallelLayout
from meshscope.topology.placement import Link

NONCAUSAL = PlanAssumptions(causal_attention=False)


def gpt(*, layers: int, h: int, a: int, s: int, v: int = 1000, tied: bool = True) -> ModelConfig:
    return gpt_model(layers=layers, h=h, a=a, s=s, v=v, tied=tied)


def llama(*, layers: int = 2, h: int = 1024, a: int = 16, g: int = 4, f: int = 2816, s: int = 4096) -> ModelConfig:
    return ModelConfig(
        name="llama",
        layers=layers,
        hidden_size=h,
        attention_heads=a,
        kv_heads=g,
        ffn_hidden_size=f,
        vocab_size=1000,
        seq_length=s,
    )


def moe_model(*, experts: int, top_k: int, fe: int, h: int = 1024, s: int = 256, layers: int = 2) -> ModelConfig:
    return ModelConfig(
        name="moe",
        layers=layers,
        hidden_size=h,
        attention_heads=8,
        ffn_hidden_size=4096,
        vocab_size=1000,
        seq_length=s,
        moe=MoEConfig(experts=experts, top_k=top_k, expert_ffn_hidden_size=fe),
    )


def job(
    model: ModelConfig, layout: ParallelLayout, *, gpu: str = "H100", sp: bool = False, **training: object
) -> JobSpec:
    world = layout.world_size
    hardware = default_hardware(gpu, max(world // 8, 1))
    if world < 8:
        hardware = replace(hardware, nodes=1, gpus_per_node=world, nvlink_domain_gpus=world)
    settings: dict[str, object] = {"micro_batch_size": 1, "global_batch_size": layout.dp, **training}
    return JobSpec(
        name="test",
        model=model,
        parallelism=ParallelismConfig(layout=layout, sequence_parallel=sp),
        training=TrainingConfig(**settings),  # type: ignore[arg-type]
        hardware=hardware,
    )


def only(plan: Plan | tuple[CollectivePlan, ...], *, axis: str, op: CollectiveOp, purpose: str = "") -> CollectivePlan:
    pool = plan.collectives if isinstance(plan, Plan) else plan
    found = [c for c in pool if c.axis == axis and c.op is op and purpose in c.purpose]
    assert len(found) == 1, [(c.axis, c.op, c.purpose) for c in pool]
    return found[0]


# ---------------------------------------------------------------------------------------------------- bus factors


@pytest.mark.parametrize(
    ("op", "n", "factor"),
    [
        (CollectiveOp.ALL_REDUCE, 8, 2 * 7 / 8),
        (CollectiveOp.REDUCE_SCATTER, 8, 7 / 8),
        (CollectiveOp.ALL_GATHER, 4, 3 / 4),
        (CollectiveOp.ALL_TO_ALL, 64, 63 / 64),
        (CollectiveOp.SEND_RECV, 2, 1.0),
    ],
    ids=["all-reduce", "reduce-scatter", "all-gather", "all-to-all", "send-recv"],
)
def test_nccl_bus_factors(op, n, factor):
    assert op.bus_factor(n) == pytest.approx(factor)


# ---------------------------------------------------------------------------------------------------- TP


def test_tp_all_reduces_without_sequence_parallel():
    big_l, h, s, b, t, m = 2, 1024, 512, 2, 4, 3
    plan = plan_job(
        job(gpt(layers=big_l, h=h, a=16, s=s), ParallelLayout(tp=t), micro_batch_size=b, global_batch_size=b * m)
    )
    ar = only(plan, axis="tp", op=CollectiveOp.ALL_REDUCE, purpose="layer activations")
    assert ar.message_bytes == b * s * h * 2  # b·s·h bf16 elements
    assert ar.count_per_step == 4 * big_l * m  # 2 forward + 2 backward per layer per micro-batch
    assert ar.bytes_per_gpu_per_step == pytest.approx(4 * big_l * m * 2 * (t - 1) / t * b * s * h * 2)
    # Narayanan §3.2: 8bsh(t-1)/t elements per layer per device per micro-batch.
    assert ar.bytes_per_gpu_per_step == pytest.approx(big_l * m * 8 * b * s * h * (t - 1) / t * 2)
    assert ar.link is Link.NVLINK
    assert ar.group_size == t
    # NCCL's cost model (tuning.cc) on 4 GPUs of one NVLink domain, S = 2 MiB, 1.5·S moved: ring LL 10.2 µs + 35.0 µs,
    # ring LL128 (14 + 6 x 1.9) µs + 1.5·S/(360 GB/s x 0.92) = 34.90 µs, ring Simple 28.8 + 8.7 µs, tree LL128
    # (14 + 2 x 3 x 1.25) µs + 2·S/(360 GB/s x 0.8625) = 35.01 µs: ring LL128 is the cheapest.
    assert (ar.algorithm, ar.protocol) == ("ring", "ll128")
    assert ar.latency_seconds == pytest.approx((14.0 + 6 * 1.9) * 1e-6)
    assert ar.seconds_per_instance == pytest.approx(25.4e-6 + b * s * h * 2 * 2 * (t - 1) / t / (450e9 * 0.8 * 0.92))
    # Bandwidth only (the flat link model): S x bus factor at the link's achievable bandwidth.
    flat = plan_job(
        job(gpt(layers=big_l, h=h, a=16, s=s), ParallelLayout(tp=t), micro_batch_size=b, global_batch_size=b * m),
        assumptions=PlanAssumptions(nccl_latency=False),
    )
    flat_ar = only(flat, axis="tp", op=CollectiveOp.ALL_REDUCE, purpose="layer activations")
    assert flat_ar.seconds_per_instance == pytest.approx(b * s * h * 2 * 2 * (t - 1) / t / (450e9 * 0.8))
    # Without tp_comm_overlap nothing hides TP traffic.
    assert ar.exposed_seconds_per_step == pytest.approx(ar.expected_seconds_per_step)


def test_sequence_parallel_moves_the_same_bytes_as_all_reduce_plus_a_backward_regather():
    big_l, h, s, t = 2, 1024, 512, 4
    model = gpt(layers=big_l, h=h, a=16, s=s)
    plain = plan_job(job(model, ParallelLayout(tp=t)))
    sp = plan_job(job(model, ParallelLayout(tp=t), sp=True))
    ag = only(sp, axis="tp", op=CollectiveOp.ALL_GATHER, purpose="layer activations, sequence parallel")
    rs = only(sp, axis="tp", op=CollectiveOp.REDUCE_SCATTER, purpose="layer activations")
    regather = only(sp, axis="tp", op=CollectiveOp.ALL_GATHER, purpose="re-gather")
    assert ag.count_per_step == rs.count_per_step == 4 * big_l  # 2 forward + 2 backward per layer
    assert regather.count_per_step == 2 * big_l  # QKV and fc1 inputs, backward
    ar = only(plain, axis="tp", op=CollectiveOp.ALL_REDUCE, purpose="layer activations")
    assert ag.bytes_per_gpu_per_step + rs.bytes_per_gpu_per_step == pytest.approx(ar.bytes_per_gpu_per_step)


@pytest.mark.parametrize(
    ("h", "a", "s", "t", "worked"),
    [(12288, 96, 2048, 8, 8119), (4096, 32, 8192, 8, 3511)],
    ids=["h12288-s2048", "h4096-s8192"],
)
def test_tp_flops_per_byte_reproduces_reference_1_7(h, a, s, t, worked):
    plan = plan_job(job(gpt(layers=2, h=h, a=a, s=s), ParallelLayout(tp=t)), assumptions=NONCAUSAL)
    ar = only(plan, axis="tp", op=CollectiveOp.ALL_REDUCE, purpose="layer activations")
    # (72bsh² + 12bs²h)/t ÷ 2·8bsh(t-1)/t = (4.5h + 0.75s)/(t-1).
    assert ar.flops_per_byte == pytest.approx((4.5 * h + 0.75 * s) / (t - 1))
    assert ar.flops_per_byte == pytest.approx(worked, abs=0.5)
    assert ar.link_budget_flops_per_byte == pytest.approx(989e12 / 450e9)
    assert ar.hideable


def test_tp_comm_overlap_hides_up_to_the_assumed_fraction():
    model = gpt(layers=2, h=4096, a=32, s=2048)
    plan = plan_job(job(model, ParallelLayout(tp=8), tp_comm_overlap=True))
    ar = only(plan, axis="tp", op=CollectiveOp.ALL_REDUCE, purpose="layer activations")
    window = plan.stages[0].step_time.compute_seconds
    expected = ar.expected_seconds_per_step
    assert ar.exposed_seconds_per_step == pytest.approx(expected - min(0.8 * expected, window))


def test_expert_tensor_parallel_gathers_routed_tokens():
    k, s, h, t = 2, 256, 1024, 2
    model = moe_model(experts=4, top_k=k, fe=512, h=h, s=s)
    plan = plan_job(job(model, ParallelLayout(tp=t, dp=2, ep=2), sp=True, global_batch_size=2))
    etp = {(c.op, c.message_bytes): c.count_per_step for c in plan.collectives if c.group == "etp"}
    # Each GPU holds s·b/t tokens (SP), k copies after dispatch; the etp all-gather assembles etp of them.
    copies = t * k * (s // t)
    # Megatron's alltoall dispatcher: tokens gathered, the expert output reduce-scattered (and the reverse in
    # backward), 2 MoE layers, 1 micro-batch; the routing probabilities gathered forward, their gradients scattered.
    assert etp == {
        (CollectiveOp.ALL_GATHER, copies * h * 2): 2 * 2,
        (CollectiveOp.REDUCE_SCATTER, copies * h * 2): 2 * 2,
        (CollectiveOp.ALL_GATHER, copies * 2): 2,
        (CollectiveOp.REDUCE_SCATTER, copies * 2): 2,
    }
    assert {c.axis for c in plan.collectives if c.group == "etp"} == {"tp"}


def test_vocabulary_parallel_embedding_output_layer_and_cross_entropy_over_tp():
    b, s, h, t, m = 2, 512, 1024, 4, 3
    model = gpt(layers=4, h=h, a=16, s=s, tied=False)
    plan = plan_job(job(model, ParallelLayout(tp=t, pp=2), micro_batch_size=b, global_batch_size=b * m))
    first, last = (tuple(c for c in st.collectives if c.axis == "tp") for st in plan.stages)
    embedding = only(first, axis="tp", op=CollectiveOp.ALL_REDUCE, purpose="embedding output")
    assert (embedding.message_bytes, embedding.count_per_step) == (b * s * h * 2, m)
    assert not [c for c in first if "output-layer" in c.purpose or "cross entropy" in c.purpose]
    output = only(last, axis="tp", op=CollectiveOp.ALL_REDUCE, purpose="output-layer input gradient")
    assert (output.message_bytes, output.count_per_step) == (b * s * h * 2, m)
    entropy = only(last, axis="tp", op=CollectiveOp.ALL_REDUCE, purpose="cross entropy")
    assert (entropy.message_bytes, entropy.count_per_step) == (4 * b * s, 3 * m)  # max, target logit, sum of exp
    # Outside every layer: no compute hides them and they stay out of the axis' FLOPs per byte (reference §1.7).
    for c in (embedding, output, entropy):
        assert c.exposed_seconds_per_step == pytest.approx(c.expected_seconds_per_step)
        assert not c.in_axis_ratio
        assert c.hiding_flops_per_step == 0


@pytest.mark.parametrize(
    ("positions", "embedding_op"),
    [(PositionEmbedding.LEARNED, CollectiveOp.ALL_REDUCE), (PositionEmbedding.ROTARY, CollectiveOp.REDUCE_SCATTER)],
    ids=["learned-positions", "rotary"],
)
def test_vocabulary_collectives_with_sequence_parallelism(positions, embedding_op):
    b, s, h, t = 1, 512, 1024, 4
    model = replace(gpt(layers=2, h=h, a=16, s=s, tied=False), position_embedding=positions)
    plan = plan_job(job(model, ParallelLayout(tp=t), sp=True))
    tp = tuple(c for c in plan.stages[0].collectives if c.axis == "tp" and c.in_axis_ratio is False)
    found = {(c.op, c.purpose.split(",")[0].split(" (")[0]): (c.message_bytes, c.count_per_step) for c in tp}
    whole = b * s * h * 2
    # Megatron LanguageModelEmbedding: learned positions are added after the word embedding, so it all-reduces and
    # splits the sequence; rotary models reduce-scatter. Backward all-gathers the gradient either way.
    assert found[(embedding_op, "vocabulary-parallel embedding output")] == (whole, 1)
    assert found[(CollectiveOp.ALL_GATHER, "embedding output gradient")] == (whole, 1)
    # The output layer is a sequence-parallel ColumnParallelLinear: gather forward, again for its weight gradient,
    # reduce-scatter its input gradient.
    assert found[(CollectiveOp.ALL_GATHER, "output-layer input")] == (whole, 1)
    assert found[(CollectiveOp.ALL_GATHER, "output-layer input again")] == (whole, 1)
    assert found[(CollectiveOp.REDUCE_SCATTER, "output-layer input gradient")] == (whole, 1)


def test_sequence_parallel_all_reduces_the_gradients_of_the_parameters_every_tp_rank_holds():
    big_l, h, t, f = 2, 1024, 4, 2816
    model = llama(layers=big_l, h=h, f=f)  # RMSNorm: h weights per norm, two per layer, no biases
    plan = plan_job(job(model, ParallelLayout(tp=t, pp=2), sp=True, global_batch_size=2))
    first, last = (
        only(st.collectives, axis="tp", op=CollectiveOp.ALL_REDUCE, purpose="sequence-parallel parameter")
        for st in plan.stages
    )
    # One layer per stage: its 2 norms, fp32 main gradients (Megatron finalize_model_grads, once per step).
    assert (first.message_bytes, first.count_per_step) == (2 * h * 4, 1)
    assert last.message_bytes == (2 * h + h) * 4  # and the final norm
    # ZeRO-3: only this GPU's shard of them.
    sharded = plan_job(job(model, ParallelLayout(tp=t, dp=2), sp=True, global_batch_size=2, zero_stage=3))
    ar = only(sharded, axis="tp", op=CollectiveOp.ALL_REDUCE, purpose="sequence-parallel parameter")
    assert ar.message_bytes == (2 * big_l * h + h) * 4 // 2
    assert not [c for c in plan_job(job(model, ParallelLayout(tp=t))).collectives if "sequence-parallel" in c.purpose]


def test_no_vocabulary_collectives_without_tensor_parallelism():
    plan = plan_job(job(gpt(layers=2, h=1024, a=16, s=512), ParallelLayout(dp=2), global_batch_size=2))
    assert not [c for c in plan.collectives if c.axis == "tp"]


# ---------------------------------------------------------------------------------------------------- PP


def test_pp_flops_per_byte_matches_reference_1_7():
    h, s, t, p, big_l = 25600, 2048, 8, 3, 6
    plan = plan_job(
        job(gpt(layers=big_l, h=h, a=160, s=s, tied=False), ParallelLayout(tp=t, pp=p), sp=True, global_batch_size=8),
        assumptions=NONCAUSAL,
    )
    middle = plan.stages[1]  # sends activations forward and gradients backward
    send = only(middle.collectives, axis="pp", op=CollectiveOp.SEND_RECV, purpose="(forward)")
    assert send.message_bytes == s * h // t * 2  # b·s·h/t (SP shards it)
    # 3·(L/p)(24bsh² + 4bs²h)/t ÷ 2·2bsh/t = (18h + 3s)·L/p; reference §1.7 drops the s term: 18hL/p = 921,600.
    assert send.flops_per_byte == pytest.approx((18 * h + 3 * s) * big_l / p)
    assert send.flops_per_byte == pytest.approx(921_600, rel=0.02)


def test_pp_sends_per_stage_1f1b():
    m, p = 4, 3
    plan = plan_job(job(gpt(layers=6, h=512, a=8, s=256, tied=False), ParallelLayout(pp=p), global_batch_size=m))
    counts = [{c.purpose: c.count_per_step for c in s.collectives if c.axis == "pp"} for s in plan.stages]
    assert counts == [
        {"activations (forward)": m},
        {"activations (forward)": m, "activation gradients (backward)": m},
        {"activation gradients (backward)": m},
    ]


def test_pp_sends_per_stage_interleaved_multiply_by_vpp():
    m, p, v = 4, 2, 2
    spec = job(
        gpt(layers=8, h=512, a=8, s=256, tied=False),
        ParallelLayout(pp=p, vpp=v),
        global_batch_size=m,
        pipeline_schedule=PipelineSchedule.INTERLEAVED,
    )
    plan = plan_job(spec)
    counts = [{c.purpose: c.count_per_step for c in s.collectives if c.axis == "pp"} for s in plan.stages]
    # Every chunk boundary but the model's ends: rank 0 receives nothing backward for its first chunk, rank p-1
    # sends nothing forward from its last chunk.
    assert counts == [
        {"activations (forward)": v * m, "activation gradients (backward)": (v - 1) * m},
        {"activations (forward)": (v - 1) * m, "activation gradients (backward)": v * m},
    ]


def test_tied_embedding_gradients_are_all_reduced_between_first_and_last_stage():
    v, h, t = 1000, 512, 2
    plan = plan_job(job(gpt(layers=4, h=h, a=8, s=256, v=v), ParallelLayout(tp=t, pp=2)))
    ar = next(c for c in plan.collectives if c.group == "pp-embedding")
    assert ar.op is CollectiveOp.ALL_REDUCE
    assert ar.group_size == 2
    assert ar.message_bytes == v * h // t * 4  # fp32 main gradients of the vocabulary shard
    assert ar.count_per_step == 1


# ---------------------------------------------------------------------------------------------------- DP

H, A, G, D, F, V = 1024, 16, 4, 64, 2816, 1000
P_LLAMA = 2 * (2 * H * A * D + 2 * H * G * D + 3 * H * F + 2 * H) + V * H + H + V * H  # llama(), tp=1, pp=1


def test_dp_all_reduce_of_fp32_gradients():
    d = 16
    plan = plan_job(job(llama(), ParallelLayout(dp=d), global_batch_size=d))
    ar = only(plan, axis="dp", op=CollectiveOp.ALL_REDUCE)
    assert ar.message_bytes == P_LLAMA * 4
    assert ar.count_per_step == 1
    assert ar.bytes_per_gpu_per_step == pytest.approx(2 * (d - 1) / d * P_LLAMA * 4)
    assert ar.link is Link.NETWORK  # 16 ranks over two 8-GPU nodes
    assert ar.groups_crossing_domains == 1


def test_distributed_optimizer_reduce_scatters_grads_and_gathers_bf16_weights():
    d = 16
    plan = plan_job(job(llama(), ParallelLayout(dp=d), global_batch_size=d, distributed_optimizer=True))
    rs = only(plan, axis="dp", op=CollectiveOp.REDUCE_SCATTER)
    ag = only(plan, axis="dp", op=CollectiveOp.ALL_GATHER)
    assert rs.bytes_per_gpu_per_step == pytest.approx((d - 1) / d * P_LLAMA * 4)
    assert ag.bytes_per_gpu_per_step == pytest.approx((d - 1) / d * P_LLAMA * 2)


def test_fp8_param_gather_gathers_the_layers_gemm_weights_at_one_byte():
    # Megatron-core's --fp8-param-gather: Transformer Engine's GEMM weights are FP8 tensors and the distributed
    # optimizer all-gathers them so; the embedding, output layer and norms stay bf16. Gradients are unchanged.
    d = 16
    gemm = 2 * (2 * H * A * D + 2 * H * G * D + 3 * H * F)  # llama()'s two layers' projections
    rest = P_LLAMA - gemm  # 4 norms, the final norm, embedding, output layer
    plan = plan_job(
        job(
            llama(),
            ParallelLayout(dp=d),
            global_batch_size=d,
            distributed_optimizer=True,
            precision=Precision.FP8,
            fp8_param_gather=True,
        )
    )
    ag = only(plan, axis="dp", op=CollectiveOp.ALL_GATHER)
    rs = only(plan, axis="dp", op=CollectiveOp.REDUCE_SCATTER)
    assert ag.message_bytes == gemm * 1 + rest * 2
    assert rs.message_bytes == P_LLAMA * 4
    # ZeRO-3: each layer unit's projections at 1 byte, its two norms at 2; the root unit (embedding, final norm,
    # output layer) at 2.
    t, m = 2, 1
    zero3 = plan_job(
        job(
            llama(),
            ParallelLayout(tp=t, dp=d // t),
            global_batch_size=d // t,
            zero_stage=3,
            precision=Precision.FP8,
            fp8_param_gather=True,
        )
    )
    layer = only(zero3, axis="dp", op=CollectiveOp.ALL_GATHER, purpose="per layer (forward)")
    assert layer.message_bytes == (2 * H * A * D + 2 * H * G * D + 3 * H * F) // t * 1 + 2 * H * 2
    root = only(zero3, axis="dp", op=CollectiveOp.ALL_GATHER, purpose="root unit")
    assert root.message_bytes == (V * H // t + H + V * H // t) * 2
    assert root.count_per_step == m


def test_zero2_reduce_scatters_gradients_every_micro_batch_and_gathers_weights_once():
    # ZeRO-2 shards the gradients, so they cannot accumulate whole across micro-batches: each micro-batch's
    # backward reduce-scatters them (DeepSpeed stage 2; Rajbhandari et al. 2019 §5.2); the updated bf16 weights are
    # all-gathered once per step. d = 4 ranks, m = 3 micro-batches, fp32 gradients.
    d, m = 4, 3
    plan = plan_job(job(llama(), ParallelLayout(dp=d), global_batch_size=d * m, zero_stage=2))
    rs = only(plan, axis="dp", op=CollectiveOp.REDUCE_SCATTER)
    ag = only(plan, axis="dp", op=CollectiveOp.ALL_GATHER)
    assert rs.message_bytes == P_LLAMA * 4
    assert rs.count_per_step == m
    assert rs.bytes_per_gpu_per_step == pytest.approx(m * (d - 1) / d * P_LLAMA * 4)
    assert ag.count_per_step == 1
    assert ag.bytes_per_gpu_per_step == pytest.approx((d - 1) / d * P_LLAMA * 2)
    # P_LLAMA = 2·(2,097,152 + 524,288 + 8,650,752 + 2,048) + 1,024,000 + 1,024 + 1,024,000 = 24,597,504 parameters:
    # 3 x 3/4 x 98,390,016 bytes reduce-scattered per step.
    assert P_LLAMA == 24_597_504
    assert rs.bytes_per_gpu_per_step == pytest.approx(221_377_536)
    # ZeRO-1 reduces once per step, whatever m.
    zero1 = plan_job(job(llama(), ParallelLayout(dp=d), global_batch_size=d * m, zero_stage=1))
    assert only(zero1, axis="dp", op=CollectiveOp.REDUCE_SCATTER).count_per_step == 1


LAYER_LLAMA = 2 * H * A * D + 2 * H * G * D + 3 * H * F + 2 * H  # one llama() layer, tp=1
ROOT_LLAMA = V * H + H + V * H  # embedding, final norm, output layer


def test_zero3_moves_one_and_a_half_times_the_all_reduce_less_the_roots_backward_gather():
    d = 16
    base = plan_job(job(llama(), ParallelLayout(dp=d), global_batch_size=d, grad_reduce_bytes=2))
    zero3 = plan_job(job(llama(), ParallelLayout(dp=d), global_batch_size=d, grad_reduce_bytes=2, zero_stage=3))
    ar = sum(c.bytes_per_gpu_per_step for c in base.collectives if c.axis == "dp")
    z3 = sum(c.bytes_per_gpu_per_step for c in zero3.collectives if c.axis == "dp")
    # Rajbhandari et al. 2019 §7: 3Ψ vs 2Ψ, except that FSDP2 keeps the root unit (embedding, output layer, final
    # norm) gathered from forward to backward: its weights are gathered once, not twice.
    assert z3 == pytest.approx(1.5 * ar - (d - 1) / d * ROOT_LLAMA * 2)


def test_zero3_without_a_pipeline_gathers_every_layer_in_forward_and_backward_of_every_micro_batch():
    d, m = 4, 3
    plan = plan_job(job(llama(), ParallelLayout(dp=d), global_batch_size=d * m, zero_stage=3))
    dp = {(c.op, c.purpose): c for c in plan.stages[0].collectives if c.axis == "dp"}
    forward = dp[CollectiveOp.ALL_GATHER, "dense weights per layer (forward)"]
    backward = dp[CollectiveOp.ALL_GATHER, "dense weights per layer (backward)"]
    grads = dp[CollectiveOp.REDUCE_SCATTER, "dense gradients per layer"]
    root = [c for c in dp.values() if "root unit" in c.purpose]
    assert forward.message_bytes == backward.message_bytes == LAYER_LLAMA * 2  # bf16 weights, one layer per unit
    assert forward.count_per_step == backward.count_per_step == grads.count_per_step == 2 * m  # 2 layers
    assert grads.message_bytes == LAYER_LLAMA * 4  # fp32 main gradients
    assert {(c.op, c.message_bytes, c.count_per_step) for c in root} == {
        (CollectiveOp.ALL_GATHER, ROOT_LLAMA * 2, m),
        (CollectiveOp.REDUCE_SCATTER, ROOT_LLAMA * 4, m),
    }


def test_zero3_under_a_pipeline_gathers_each_layer_once_more_than_its_micro_batches_and_reduces_once():
    # torch.distributed.pipelining keeps FSDP2 units gathered after backward and defers the reduce-scatter to the
    # last micro-batch: each layer is gathered before every forward (resharded after it) and before the first
    # backward that follows a forward, whatever the schedule: m + 1.
    d, m, p = 2, 4, 2
    model = llama(layers=4)
    for schedule in (PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.GPIPE):
        plan = plan_job(
            job(model, ParallelLayout(dp=d, pp=p), global_batch_size=d * m, zero_stage=3, pipeline_schedule=schedule)
        )
        for stage in plan.stages:
            dp = [c for c in stage.collectives if c.axis == "dp"]
            layer_gather = only(tuple(dp), axis="dp", op=CollectiveOp.ALL_GATHER, purpose="per layer")
            layer_reduce = only(tuple(dp), axis="dp", op=CollectiveOp.REDUCE_SCATTER, purpose="per layer")
            assert layer_gather.message_bytes == LAYER_LLAMA * 2
            assert layer_gather.count_per_step == (m + 1) * 2  # 2 layers per stage
            assert layer_reduce.count_per_step == 2
            root = [c for c in dp if "root unit" in c.purpose]
            assert [c.count_per_step for c in root] == [1, 1]
            expected_root = V * H if stage.pp_rank == 0 else H + V * H
            assert root[0].message_bytes == expected_root * 2


def test_zero3_units_follow_tensor_parallel_shards():
    t, d = 2, 2
    plan = plan_job(job(llama(), ParallelLayout(tp=t, dp=d), global_batch_size=d, zero_stage=3))
    layer = only(plan, axis="dp", op=CollectiveOp.ALL_GATHER, purpose="per layer (forward)")
    # attention and MLP split over tp, the two norms replicated
    assert layer.message_bytes == ((2 * H * A * D + 2 * H * G * D + 3 * H * F) // t + 2 * H) * 2


def test_dp_reduction_includes_context_parallel_ranks():
    plan = plan_job(job(llama(), ParallelLayout(dp=2, cp=4), global_batch_size=2))
    ar = only(plan, axis="dp", op=CollectiveOp.ALL_REDUCE)
    assert ar.group == "dp-cp"
    assert ar.group_size == 8


def test_dp_flops_per_byte_close_to_reference_1_7():
    h, a, s, big_l, v, d, g = 4096, 32, 256, 4, 1000, 64, 4
    big_b = 16_777_216 // s  # B·s = 16,777,216 tokens
    model = gpt(layers=big_l, h=h, a=a, s=s, v=v, tied=False)
    plan = plan_job(job(model, ParallelLayout(dp=d), global_batch_size=big_b), assumptions=NONCAUSAL)
    ar = only(plan, axis="dp", op=CollectiveOp.ALL_REDUCE)
    # Exact, our definition: model FLOPs of the GPU's step ÷ all-reduce bytes of its fp32 gradients.
    tokens = big_b * s / d
    flops = 72 * tokens * big_l * h**2 * (1 + s / (6 * h)) + 6 * tokens * h * v
    params = big_l * (12 * h * h + 13 * h) + v * h + s * h + 2 * h + v * h  # GPT layers with biases, untied
    assert ar.flops_per_byte == pytest.approx(flops / (2 * (d - 1) / d * params * g))
    # Reference §1.7: 3·B·s/(g·(d-1)) ≈ 199,729 with 6Ψ FLOPs per token.
    assert ar.flops_per_byte == pytest.approx(199_729, rel=0.02)


def test_dp_grad_reduce_overlap_is_capped_by_the_last_backward():
    d = 16
    on = plan_job(job(llama(), ParallelLayout(dp=d), global_batch_size=4 * d))
    ar = only(on, axis="dp", op=CollectiveOp.ALL_REDUCE)
    window = on.stages[0].backward_seconds_per_microbatch
    assert ar.exposed_seconds_per_step == pytest.approx(
        ar.expected_seconds_per_step - min(0.9 * ar.expected_seconds_per_step, window)
    )
    off = plan_job(job(llama(), ParallelLayout(dp=d), global_batch_size=4 * d, overlap_grad_reduce=False))
    ar_off = only(off, axis="dp", op=CollectiveOp.ALL_REDUCE)
    assert ar_off.exposed_seconds_per_step == pytest.approx(ar_off.expected_seconds_per_step)


# ---------------------------------------------------------------------------------------------------- EP


def test_ep_all_to_all_reproduces_reference_1_7():
    fe, ep, k, s, h = 2048, 64, 2, 256, 1024
    model = moe_model(experts=64, top_k=k, fe=fe, h=h, s=s)
    plan = plan_job(job(model, ParallelLayout(dp=64, ep=ep), global_batch_size=64))
    a2a = only(plan, axis="ep", op=CollectiveOp.ALL_TO_ALL, purpose="token dispatch")
    assert a2a.message_bytes == s * k * h * 2  # T_loc·k·h bf16
    assert a2a.count_per_step == 4 * 2  # dispatch + combine, forward + backward, 2 MoE layers
    assert a2a.bytes_per_gpu_per_step == pytest.approx(8 * s * k * h * 2 * (ep - 1) / ep)
    # Megatron-core >= 0.13 also sends each routed copy's probability with the dispatch (forward and backward) and
    # all-gathers the token counts per expert (int64) first.
    probs = only(plan, axis="ep", op=CollectiveOp.ALL_TO_ALL, purpose="routing probabilities")
    assert (probs.message_bytes, probs.count_per_step) == (s * k * 2, 2 * 2)
    counts = only(plan, axis="ep", op=CollectiveOp.ALL_GATHER, purpose="token counts")
    assert (counts.message_bytes, counts.count_per_step, counts.group) == (ep * 64 * 8, 2, "tp-ep")
    # 18·T·k·h·f_e ÷ 8·T·k·h·(ep-1)/ep = 2.25·f_e·ep/(ep-1) ≈ 4,681 for the tokens alone (reference §1.7); the
    # probabilities (1/h of a token) lower it a little.
    assert not counts.in_axis_ratio  # a synchronisation point, not routed data (like the vocabulary collectives)
    tokens, probabilities = 8 * s * k * h, 2 * s * k * 2  # (both times the same bus factor (ep-1)/ep)
    assert a2a.flops_per_byte == pytest.approx(2.25 * fe * ep / (ep - 1) * tokens / (tokens + probabilities))
    assert 2.25 * fe * ep / (ep - 1) == pytest.approx(4681, abs=0.5)
    assert a2a.flops_per_byte == pytest.approx(4681, rel=0.01)
    assert a2a.link is Link.NETWORK
    assert a2a.link_budget_flops_per_byte == pytest.approx(19_780)
    assert not a2a.hideable
    assert a2a.exposed_seconds_per_step == pytest.approx(a2a.expected_seconds_per_step)  # EP overlap 0 by default


def test_expert_gradients_reduce_over_expert_data_parallel():
    model = moe_model(experts=8, top_k=2, fe=512)
    plan = plan_job(job(model, ParallelLayout(dp=8, ep=4), global_batch_size=8))
    experts = next(c for c in plan.collectives if c.group == "edp")
    per_gpu_experts = 2 * 8 * 3 * 1024 * 512 // 4
    assert experts.group_size == 8 // 4
    assert experts.message_bytes == per_gpu_experts * 4


# ---------------------------------------------------------------------------------------------------- CP


def cp_job(model: ModelConfig, layout: ParallelLayout, kind: CpCommType, **training: object) -> JobSpec:
    spec = job(model, layout, **training)
    return replace(spec, parallelism=replace(spec.parallelism, cp_comm_type=kind))


def test_cp_ring_exchange_of_kv_chunks():
    big_l, h, a, g, d, f, s, t, cp = 2, 1024, 16, 4, 64, 2816, 4096, 2, 2
    plan = plan_job(job(llama(layers=big_l, s=s), ParallelLayout(tp=t, cp=cp), sp=True))
    ring = only(plan, axis="cp", op=CollectiveOp.SEND_RECV)
    # K and V of s/cp tokens, g/t heads of d each, bf16.
    assert ring.message_bytes == 2 * (s // cp) * (g // t) * d * 2
    # cp = 2: one step forward; backward sends K/V, then dK/dV.
    assert ring.count_per_step == 3 * big_l
    assert ring.overlap_fraction == pytest.approx(0.8)  # overlapped with the attention core (PlanAssumptions)
    # Hiding FLOPs: the GPU's layer FLOPs (projections, SwiGLU, causal attention core) ÷ the ring's bytes.
    tokens = s
    layer = 2 * tokens * (2 * h * a * d + 2 * h * g * d) + 2 * tokens * 3 * h * f + 2 * tokens * s * a * d
    flops = 3 * big_l * layer / (t * cp)
    assert ring.flops_per_byte == pytest.approx(flops / (3 * big_l * ring.message_bytes))


def test_cp_ring_sends_kv_and_dkv_together_in_the_middle_of_backward():
    # Transformer Engine's AttnFuncWithCPAndKVP2P with cp = 4: forward 3 K/V steps; backward 4 steps, the first K/V,
    # the last dK/dV, the two between both in one message.
    big_l, g, d, s, cp = 2, 4, 64, 4096, 4
    plan = plan_job(job(llama(layers=big_l, s=s), ParallelLayout(cp=cp)))
    kv = 2 * (s // cp) * g * d * 2
    sends = {c.message_bytes: c.count_per_step for c in plan.collectives if c.axis == "cp"}
    assert sends == {kv: (3 + 2) * big_l, 2 * kv: 2 * big_l}
    # Same bytes as a ring that sends K/V cp-1 times forward and twice that backward.
    moved = sum(c.bytes_per_gpu_per_step for c in plan.collectives if c.axis == "cp")
    assert moved == pytest.approx(3 * (cp - 1) * big_l * kv)


def test_cp_all_gather_gathers_kv_forward_and_backward_and_reduce_scatters_their_gradients():
    big_l, b, m, g, d, s, t, cp = 2, 2, 3, 4, 64, 4096, 2, 4
    layout = ParallelLayout(tp=t, cp=cp)
    plan = plan_job(cp_job(llama(layers=big_l, s=s), layout, CpCommType.ALL_GATHER, micro_batch_size=b,
                           global_batch_size=b * m))  # fmt: skip
    gathered = b * s * (g // t) * d * 2  # one whole-sequence K (or V) of this GPU's KV heads, bf16
    ag = only(plan, axis="cp", op=CollectiveOp.ALL_GATHER)
    rs = only(plan, axis="cp", op=CollectiveOp.REDUCE_SCATTER)
    assert (ag.message_bytes, ag.count_per_step) == (gathered, 4 * big_l * m)  # K, V; forward and backward
    assert (rs.message_bytes, rs.count_per_step) == (gathered, 2 * big_l * m)  # dK, dV
    assert ag.bus_factor == pytest.approx((cp - 1) / cp)
    # Not async in Megatron-core: nothing hides it.
    assert ag.exposed_seconds_per_step == pytest.approx(ag.expected_seconds_per_step)
    assert not [c for c in plan.collectives if c.axis == "cp" and c.op is CollectiveOp.SEND_RECV]
    # Only the local K and V are kept: the same activations as the ring.
    ring = plan_job(job(llama(layers=big_l, s=s), layout, micro_batch_size=b, global_batch_size=b * m))
    assert plan.stages[0].activations.total_bytes == ring.stages[0].activations.total_bytes


def test_cp_a2a_all_to_alls_qkv_and_the_output_and_keeps_the_output_twice():
    big_l, b, a, g, d, s, cp = 2, 1, 16, 4, 64, 4096, 4
    layout = ParallelLayout(cp=cp)
    plan = plan_job(cp_job(llama(layers=big_l, s=s), layout, CpCommType.A2A, micro_batch_size=b,
                           global_batch_size=b))  # fmt: skip
    local = s // cp * b
    sizes = {c.message_bytes: c.count_per_step for c in plan.collectives if c.axis == "cp"}
    # Q and the output (a heads), K and V (g heads): one all-to-all each forward, one each backward.
    assert sizes == {local * a * d * 2: 4 * big_l, local * g * d * 2: 4 * big_l}
    assert {c.op for c in plan.collectives if c.axis == "cp"} == {CollectiveOp.ALL_TO_ALL}
    ring = plan_job(job(llama(layers=big_l, s=s), layout, micro_batch_size=b, global_batch_size=b))
    extra = (
        plan.stages[0].activations.per_microbatch_layers_bytes - ring.stages[0].activations.per_microbatch_layers_bytes
    )
    assert extra == pytest.approx(big_l * local * a * d * 2)  # the head-sharded output before the all-to-all back


# ---------------------------------------------------------------------------------------------------- budgets


def test_b200_link_budgets():
    plan = plan_job(job(llama(), ParallelLayout(tp=8, dp=2), gpu="B200", global_batch_size=2))
    tp = only(plan, axis="tp", op=CollectiveOp.ALL_REDUCE, purpose="layer activations")
    dp = only(plan, axis="dp", op=CollectiveOp.ALL_REDUCE)
    assert tp.link is Link.NVLINK
    assert tp.link_budget_flops_per_byte == pytest.approx(2500)  # 2,250 TF ÷ 900 GB/s
    assert dp.link is Link.NETWORK
    assert dp.link_budget_flops_per_byte == pytest.approx(45_000)  # 2,250 TF ÷ 50 GB/s
    assert dp.bandwidth_bytes_per_s == pytest.approx(50e9)
    # Two ranks on two nodes: the ring's 2 steps both cross the network; for ~13 MB of gradients the Simple protocol
    # wins (LL128 would move it at 0.92 of that bandwidth): (8.4 + 2 x 14.0) µs + S·(2·1/2)/(50 GB/s x 0.7).
    assert (dp.algorithm, dp.protocol) == ("ring", "simple")
    assert dp.seconds_per_instance == pytest.approx(36.4e-6 + dp.message_bytes * 2 * 1 / 2 / (50e9 * 0.7))

"""Planner FLOPs, bubble and expected step time.

FLOPs are checked against the published closed forms (Korthikanti et al. 2022 App. A, Narayanan et al. 2021 eq. 3,
PaLM App. B), the bubble against PTD-P §2.2, times against hand arithmetic from the named assumptions.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from builders import gpt_model
from meshscope.errors import PlanError
from meshscope.jobs.models import PRESETS, ModelConfig, MoEConfig
from meshscope.jobs.spec import JobSpec, ParallelismConfig, PipelineSchedule, Recompute, TrainingConfig
from meshscope.plan import PlanAssumptions, bubble_fraction, plan_job, step_flops
from meshscope.topology.hardware import default_hardware
from meshscope.topology.layout import ParallelLayout

gpt = gpt_model


def job(model: ModelConfig, layout: ParallelLayout, *, sp: bool = False, **training: object) -> JobSpec:
    world = layout.world_size
    hardware = default_hardware("H100", max(world // 8, 1))
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


SHAPES = [  # (L, h, a, s, V): GPT-3 175B, MT-NLG 530B, 1T (Korthikanti Table 3 / PTD-P Table 1)
    (96, 12288, 96, 2048, 51200),
    (105, 20480, 128, 2048, 51200),
    (128, 25600, 160, 2048, 51200),
]
SIDS = ["175B", "530B", "1T"]


# ---------------------------------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize(("big_l", "h", "a", "s", "v"), SHAPES, ids=SIDS)
def test_korthikanti_app_a_model_flops(big_l, h, a, s, v):
    b_global = 1536
    flops = step_flops(
        gpt(layers=big_l, h=h, a=a, s=s, v=v), TrainingConfig(micro_batch_size=1, global_batch_size=b_global)
    )
    expected = 72 * b_global * big_l * s * h**2 * (1 + s / (6 * h) + v / (12 * h * big_l))
    assert flops.model_flops_noncausal == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("big_l", "h", "a", "s", "v"), SHAPES, ids=SIDS)
def test_narayanan_eq3_counts_full_recompute(big_l, h, a, s, v):
    b_global = 1536
    training = TrainingConfig(micro_batch_size=1, global_batch_size=b_global, recompute=Recompute.FULL)
    flops = step_flops(gpt(layers=big_l, h=h, a=a, s=s, v=v), training, causal=False)
    expected = 96 * b_global * s * big_l * h**2 * (1 + s / (6 * h) + v / (16 * big_l * h))
    assert flops.hardware_flops == pytest.approx(expected, rel=1e-12)


def test_causal_headline_halves_the_attention_term():
    big_l, h, a, s, v, b_global = 96, 12288, 96, 2048, 51200, 512
    flops = step_flops(
        gpt(layers=big_l, h=h, a=a, s=s, v=v), TrainingConfig(micro_batch_size=1, global_batch_size=b_global)
    )
    # Megatron-LM >= 2025-03: QK^T and AV counted causally, s/(6h) -> s/(12h).
    assert flops.model_flops == pytest.approx(
        72 * b_global * big_l * s * h**2 * (1 + s / (12 * h) + v / (12 * h * big_l))
    )
    assert flops.causal


def test_selective_recompute_adds_the_forward_attention_core():
    big_l, h, a, s, v, b_global = 96, 12288, 96, 2048, 51200, 512
    training = TrainingConfig(micro_batch_size=1, global_batch_size=b_global, recompute=Recompute.SELECTIVE)
    flops = step_flops(gpt(layers=big_l, h=h, a=a, s=s, v=v), training, causal=False)
    # Forward QK^T + AV = 4·B·s²·h per layer (Korthikanti App. A), recomputed once.
    assert flops.hardware_flops - flops.model_flops == pytest.approx(4 * b_global * s**2 * h * big_l)


def test_palm_6n_plus_attention_for_llama3_8b():
    model = PRESETS["llama3-8b"]
    b_global = 64
    tokens = b_global * model.seq_length
    big_l, h, a, g, d, f, v, s = 32, 4096, 32, 8, 128, 14336, 128256, 8192
    matrices = big_l * (2 * h * a * d + 2 * h * g * d + 3 * h * f) + v * h  # every GEMM weight, output layer included
    # PaLM App. B: 6N + 12·L·H·Q·T per token, the attention term halved for a causal mask.
    expected = 6 * matrices * tokens + 12 * big_l * a * d * s * tokens / 2
    assert step_flops(
        model, TrainingConfig(micro_batch_size=1, global_batch_size=b_global)
    ).model_flops == pytest.approx(expected)


def test_moe_counts_top_k_experts_and_router():
    h, a, s, v, e_count, k, fe, big_l = 1024, 16, 1024, 1000, 8, 2, 2048, 2
    moe = MoEConfig(experts=e_count, top_k=k, expert_ffn_hidden_size=fe, shared_experts=1)
    model = ModelConfig(
        name="moe",
        layers=big_l,
        hidden_size=h,
        attention_heads=a,
        ffn_hidden_size=4096,
        vocab_size=v,
        seq_length=s,
        moe=moe,
    )
    b_global = 4
    t = b_global * s
    per_layer = 2 * t * 4 * h * h + 2 * t * s * 2 * h / 2  # MHA projections; causal QK^T + AV
    per_layer += 2 * t * h * e_count + 2 * t * 3 * h * fe + 2 * t * k * 3 * h * fe  # router, shared, top-k routed
    expected = 3 * (big_l * per_layer + 2 * t * h * v)
    assert step_flops(
        model, TrainingConfig(micro_batch_size=1, global_batch_size=b_global)
    ).model_flops == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------------- bubble


@pytest.mark.parametrize(
    ("p", "m", "v", "schedule", "expected"),
    [
        (1, 8, 1, PipelineSchedule.ONE_F_ONE_B, 0.0),
        (4, 8, 1, PipelineSchedule.ONE_F_ONE_B, 3 / 8),
        (4, 8, 1, PipelineSchedule.GPIPE, 3 / 8),
        (8, 64, 1, PipelineSchedule.ONE_F_ONE_B, 7 / 64),
        (8, 64, 4, PipelineSchedule.INTERLEAVED, 7 / (64 * 4)),
    ],
    ids=["no-pp", "1f1b", "gpipe", "1f1b-64", "interleaved"],
)
def test_ptdp_bubble_fraction(p, m, v, schedule, expected):
    assert bubble_fraction(p, m, vpp=v, schedule=schedule) == pytest.approx(expected)


def test_ptdp_bubble_in_terms_of_gpus_and_batch():
    # Narayanan §3.3.1 with t = 1: (p-1)/m = (n-d)/b', b' = B/b.
    model = gpt(layers=8, h=512, a=8, s=256, v=1000)
    p, d, b, big_b = 4, 2, 2, 32
    plan = plan_job(job(model, ParallelLayout(pp=p, dp=d), micro_batch_size=b, global_batch_size=big_b))
    n = p * d
    assert plan.bubble_fraction == pytest.approx((n - d) / (big_b / b))
    # The stages are unequal (the last adds the logits): m = B/b micro-batches flow through p stages taking
    # t_k = compute_k / m each, a flow shop's makespan T = Σ t_k + (m - 1) max t_k; the slowest stage is busy
    # m · max t_k of it and idles the rest, the fill and drain through the other stages.
    m = big_b // (b * d)
    t = [s.step_time.compute_seconds / m for s in plan.stages]
    makespan = sum(t) + (m - 1) * max(t)
    assert plan.expected_step_time.bubble_seconds == pytest.approx(makespan - m * max(t))
    assert plan.expected_step_time.bubble_seconds < plan.bubble_fraction * max(t) * m  # below the equal-stage bound


# ---------------------------------------------------------------------------------------------------- time


FLAT = PlanAssumptions(compute_efficiency=0.5)
"""The flat model: every hardware FLOP at half the dense peak (the explicit ``compute_efficiency`` override)."""


def test_single_gpu_compute_time_is_flops_over_efficient_peak():
    model = gpt(layers=4, h=1024, a=16, s=1024, v=1000)
    plan = plan_job(job(model, ParallelLayout(), micro_batch_size=2, global_batch_size=8), assumptions=FLAT)
    assert plan.world_size == 1
    assert plan.micro_batches == 4
    h, s, big_l, v, big_b = 1024, 1024, 4, 1000, 8
    hardware_flops = 72 * big_b * big_l * s * h**2 * (1 + s / (12 * h) + v / (12 * h * big_l))
    peak, efficiency = 989e12, 0.5
    assert plan.expected_step_time.compute_seconds == pytest.approx(hardware_flops / (peak * efficiency))
    stage = plan.stages[0]
    assert stage.backward_seconds_per_microbatch == pytest.approx(2 * stage.forward_seconds_per_microbatch)
    assert stage.forward_seconds_per_microbatch * 4 * 3 == pytest.approx(plan.expected_step_time.compute_seconds)


def test_full_recompute_adds_a_forward_of_the_layers_to_backward():
    h, s, big_l, v = 1024, 1024, 4, 1000
    model = gpt(layers=big_l, h=h, a=16, s=s, v=v)
    stage = plan_job(job(model, ParallelLayout(), recompute=Recompute.FULL), assumptions=FLAT).stages[0]
    layers = 24 * s * big_l * h**2 * (1 + s / (12 * h))  # forward FLOPs of the layers, one sequence
    logits = 2 * s * h * v
    rate = 989e12 * 0.5
    assert stage.forward_seconds_per_microbatch == pytest.approx((layers + logits) / rate)
    assert stage.backward_seconds_per_microbatch == pytest.approx((2 * (layers + logits) + layers) / rate)


def test_tensor_and_context_parallel_divide_the_flops_per_gpu():
    h, s, big_l, v, t, cp = 1024, 2048, 4, 1000, 2, 2
    model = gpt(layers=big_l, h=h, a=16, s=s, v=v)
    stage = plan_job(job(model, ParallelLayout(tp=t, cp=cp))).stages[0]
    per_sequence = 72 * big_l * s * h**2 * (1 + s / (12 * h) + v / (12 * h * big_l))
    assert stage.model_flops_per_microbatch == pytest.approx(per_sequence / (t * cp))


def test_optimizer_time_streams_the_adam_state_through_hbm():
    model = gpt(layers=2, h=512, a=8, s=256, v=1000)
    plan = plan_job(job(model, ParallelLayout()))
    params = plan.stages[0].params.total
    # Per parameter: read+write main weight and moments (2·12), read the gradient twice (2·4), write the bf16 weight.
    assert plan.expected_step_time.optimizer_seconds == pytest.approx(params * (2 * 12 + 2 * 4 + 2) / (3350e9 * 0.8))


def test_expected_time_categories_add_up_and_mfu_stays_below_efficiency():
    plan = plan_job(
        job(
            PRESETS["llama3-8b"],
            ParallelLayout(tp=8, pp=2, dp=4),
            sp=True,
            global_batch_size=64,
            distributed_optimizer=True,
        ),
        assumptions=PlanAssumptions(compute_efficiency=0.5),  # the flat model: one efficiency for every FLOP
    )
    step = plan.expected_step_time
    parts = (
        step.compute_seconds + sum(step.exposed_comm_seconds.values()) + step.bubble_seconds + step.optimizer_seconds
    )
    assert step.total_seconds == pytest.approx(parts)
    # The sum holds by construction; its parts are pinned by hand. The bubble: 1F1B with p = 2 stages and
    # m = 64 / 4 = 16 micro-batches; the slowest (last) stage idles while the first micro-batch's forward and the
    # last one's backward pass the other stage: one micro-batch of stage 0's path, its compute and exposed tp
    # communication (Narayanan et al. 2021 §2.2's (p - 1)(t_f + t_b) with the other stage's t; no sync wait here).
    first = plan.stages[0].step_time
    assert step.pp_rank == 1
    assert step.bubble_seconds == pytest.approx((first.compute_seconds + first.exposed_comm_seconds["tp"]) / 16)
    # The compute: m x (forward + backward) of the slowest stage, the last one (it adds the logits), whose model
    # FLOPs per micro-batch (no recompute) run at the efficient bf16 peak of an H100 SXM (989 TFLOP/s dense).
    last = plan.stages[-1]
    rate = 989e12 * 0.5
    assert step.compute_seconds == pytest.approx(16 * last.model_flops_per_microbatch / rate)
    assert set(step.exposed_comm_seconds) >= {"tp", "pp", "dp"}
    assert 0 < plan.expected_mfu < 0.5  # the step also communicates and idles


def test_assumptions_change_the_expected_time():
    spec = job(PRESETS["llama3-8b"], ParallelLayout(tp=8), sp=True, global_batch_size=8)
    slow = plan_job(spec, assumptions=PlanAssumptions(compute_efficiency=0.25))
    fast = plan_job(spec, assumptions=PlanAssumptions(compute_efficiency=0.5))
    assert slow.expected_step_time.compute_seconds == pytest.approx(2 * fast.expected_step_time.compute_seconds)


def test_assumptions_are_validated():
    with pytest.raises(PlanError, match=r"compute_efficiency must be a number in \(0, 1\], got 1.5"):
        PlanAssumptions(compute_efficiency=1.5)
    with pytest.raises(PlanError, match=r"ep_comm_overlap must be a number in \[0, 1\], got -0.1"):
        PlanAssumptions(ep_comm_overlap=-0.1)


# ---------------------------------------------------------------------------------------------------- scale, shape


def _llama3_405b_16k() -> JobSpec:
    layout = ParallelLayout(tp=8, pp=16, dp=128, vpp=1)
    return JobSpec(
        name="405b",
        model=PRESETS["llama3-405b"],
        parallelism=ParallelismConfig(layout=layout, sequence_parallel=True),
        training=TrainingConfig(
            micro_batch_size=1, global_batch_size=2048, distributed_optimizer=True, recompute=Recompute.SELECTIVE
        ),
        hardware=default_hardware("H100", 2048),
    )


def test_plan_of_16k_gpus_is_fast():
    spec = _llama3_405b_16k()
    plan_job(spec)  # warm imports and caches
    start = time.perf_counter()
    plan = plan_job(spec)
    elapsed = time.perf_counter() - start
    assert plan.world_size == 16384
    assert len(plan.stages) == 16
    assert elapsed < 1.0, f"plan_job took {elapsed:.3f} s for 16,384 GPUs"


def test_to_dict_has_the_documented_shape():
    data = plan_job(_llama3_405b_16k()).to_dict()
    json.dumps(data)  # JSON-ready
    assert {
        "world_size",
        "layout",
        "stages",
        "collectives",
        "flops_per_step",
        "bubble_fraction",
        "expected_step_seconds",
        "findings",
        "assumptions",
    } <= set(data)
    assert data["world_size"] == 16384
    # Llama 3 paper, Table 3: 405B parameters (126 layers, h = 16384, f = 53248, 8 KV heads, V = 128,256).
    h, f, v = 16384, 53248, 128256
    assert data["total_params"] == 126 * (2 * h * h + 2 * h * 8 * 128 + 3 * h * f + 2 * h) + 2 * v * h + h
    assert {k: data["layout"][k] for k in ("dp", "tp", "pp", "cp", "ep", "vpp")} == {
        "dp": 128,
        "tp": 8,
        "pp": 16,
        "cp": 1,
        "ep": 1,
        "vpp": 1,
    }
    stage = data["stages"][0]
    assert {"pp_rank", "layers", "params", "memory_bytes", "hbm_bytes", "headroom_bytes"} <= set(stage)
    assert set(stage["memory_bytes"]) == {"weights", "gradients", "optimizer", "activations", "total"}
    collective = data["collectives"][0]
    assert {
        "axis",
        "op",
        "message_bytes",
        "count_per_step",
        "bytes_per_gpu_per_step",
        "link",
        "flops_per_byte",
        "link_budget_flops_per_byte",
        "expected_seconds_per_step",
        "exposed_seconds_per_step",
        "group_size",
        "groups_crossing_domains",
    } <= set(collective)
    step = data["expected_step_seconds"]
    assert {"compute", "exposed_comm", "bubble", "optimizer", "total"} <= set(step)
    assert isinstance(step["exposed_comm"], dict)
    for finding in data["findings"]:
        assert set(finding) == {"code", "severity", "message"}
    # compute_efficiency unset: the roofline per operation class, whose classes the plan lists.
    assert data["assumptions"]["compute_efficiency"] is None
    assert data["compute_model"] == "roofline per operation class"
    assert {c["op"] for c in data["compute_classes"]} >= {"qkv", "attention_core", "mlp_up", "mlp_down", "elementwise"}
    assert all(set(c) == {"op", "flops_per_step", "seconds_per_step", "bytes_per_step", "efficiency"}
               for c in data["compute_classes"])  # fmt: skip

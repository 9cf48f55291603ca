"""Edges of the planner's timing and memory formulas, called directly (timing.py, memory.py).

Each expected number is worked out by hand from the formula in the module's docstring (docs/planner.md), with the
arithmetic in a comment, or is a property the formula must have (a branch on both sides of its boundary, a default
that must equal the value it stands for, a brute-force sum the code's shortcut must agree with). None is taken from
running the code under test.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshscope.errors import PlanError
from meshscope.jobs.models import MLAConfig, ModelConfig, MoEConfig
from meshscope.jobs.spec import (
    AttentionImpl,
    CpCommType,
    JobSpec,
    ParallelismConfig,
    PipelineSchedule,
    Precision,
    Recompute,
    TrainingConfig,
)
from meshscope.plan import PlanAssumptions, plan_job, planning
from meshscope.plan.kernels import OpClass, stage_kernels
from meshscope.plan.memory import (
    ModelStateBytes,
    StageParams,
    StateBytesPerParam,
    activation_element_bytes,
    attention_widths_per_gpu,
    in_flight_microbatches,
    layer_activation_bytes,
    model_state_bytes,
    resolve_schedule,
    resting_state_bytes,
    stage_activations,
    stage_layer_ranges,
    stage_params,
    state_bytes_per_param,
)
from meshscope.plan.timing import (
    bubble_fraction,
    contended,
    cpu_contention,
    grad_accumulation_seconds,
    optimizer_seconds,
    peak_flops_per_s,
    stage_compute,
)
from meshscope.topology.hardware import default_hardware
from meshscope.topology.layout import ParallelLayout

H100 = default_hardware("H100", 1)
H100_BF16, H100_FP8, H100_HBM = 989e12, 1979e12, 3350e9  # catalogue: dense FLOP/s and HBM bytes/s

# A tiny GQA SwiGLU model whose activation terms are easy to add up by hand: h=64, a=4 heads of d=16, g=2 KV heads,
# f=128, V=100, s=32, no dropout.
H, A, G, D, F, V, S = 64, 4, 2, 16, 128, 100, 32


def tiny(*, layers: int = 2, moe: MoEConfig | None = None, mla: MLAConfig | None = None) -> ModelConfig:
    return ModelConfig(
        name="tiny",
        layers=layers,
        hidden_size=H,
        attention_heads=A,
        kv_heads=G,
        ffn_hidden_size=F,
        vocab_size=V,
        seq_length=S,
        moe=moe,
        mla=mla,
    )


def training(**changes: object) -> TrainingConfig:
    settings: dict[str, object] = {"micro_batch_size": 1, "global_batch_size": 1, **changes}
    return TrainingConfig(**settings)  # type: ignore[arg-type]


# 8 routed experts of f_e=48, top-2, one shared expert; layer 0 dense, layers 1.. MoE.
MOE = MoEConfig(experts=8, top_k=2, expert_ffn_hidden_size=48, shared_experts=1, dense_layers=1)


# ---------------------------------------------------------------------------------------------------- bubble


def test_bubble_fraction_vpp_defaults_to_one_chunk():
    # (p - 1)/(m·v) with v left at its default 1: (4 - 1)/(8·1) = 3/8.
    assert bubble_fraction(4, 8, schedule=PipelineSchedule.INTERLEAVED) == 3 / 8
    assert bubble_fraction(4, 8, vpp=2, schedule=PipelineSchedule.INTERLEAVED) == 3 / 16


@pytest.mark.parametrize("schedule", [PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.GPIPE], ids=["1f1b", "gpipe"])
def test_bubble_fraction_ignores_vpp_outside_the_interleaved_schedule(schedule):
    """Only the interleaved schedule divides the bubble by ``vpp``; 1F1B and GPipe are ``(p - 1)/m``."""
    assert bubble_fraction(4, 8, vpp=2, schedule=schedule) == 3 / 8


# ---------------------------------------------------------------------------------------------------- contention


@pytest.mark.parametrize(
    ("world", "bubble", "cores", "expected"),
    [
        (12, 0.5, 2.0, 4.0),  # busy = 12 / 1.5 = 8 ranks on 2 cores
        (6, 0.5, 4.0, 1.0),  # busy = 4 ranks on 4 cores: exactly one core each
        (2, 0.0, 4.0, 1.0),  # 2 ranks on 4 cores: never below 1
        (3, 0.0, 0.5, 6.0),  # 3 ranks on half a core
    ],
    ids=["bubble-idles-ranks", "exactly-a-core-each", "floor-of-one", "half-a-core"],
)
def test_cpu_contention_is_busy_ranks_per_core_floored_at_one(world, bubble, cores, expected):
    assert cpu_contention(world, bubble, cores) == pytest.approx(expected, rel=1e-12)


CALIBRATED = PlanAssumptions(
    cpu_cores=2.0,
    cpu_contention_at_fit=1.6,
    host_seconds_per_layer_pass=0.01,
    sync_wait_per_collective_seconds=0.001,
    dp_sync_wait_per_collective_seconds=0.002,
    tp_sync_wait_per_collective_seconds=0.003,
    cp_sync_wait_per_collective_seconds=0.004,
    ep_sync_wait_per_collective_seconds=0.005,
    cpu_time_scale=1.5,
)


def test_contended_stretches_every_cpu_time_by_the_contention_ratio():
    # 12 ranks, bubble 0.5: 8 busy on 2 cores, kappa 4; fitted at 1.6: ratio 4 / 1.6 = 2.5. In 3 stages a stage has
    # 4 ranks: 2 per core while it reduces its gradients and steps, against 1.6 at the fit (unset: the same as
    # kappa's): ratio 2 / 1.6 = 1.25 for dp's sync wait and collectives and the optimizer.
    got = contended(CALIBRATED, 12, 0.5, pp=3)
    assert got.host_seconds_per_layer_pass == pytest.approx(0.025)
    assert got.sync_wait_per_collective_seconds == pytest.approx(0.0025)
    assert got.dp_sync_wait_per_collective_seconds == pytest.approx(0.0025)
    assert got.tp_sync_wait_per_collective_seconds == pytest.approx(0.0075)
    assert got.cp_sync_wait_per_collective_seconds == pytest.approx(0.01)
    assert got.ep_sync_wait_per_collective_seconds == pytest.approx(0.0125)
    assert got.cpu_time_scale == pytest.approx(1.5 * 2.5)
    assert got.cpu_stage_time_scale == pytest.approx(1.25)
    # A stage contention measured at the fit replaces kappa's there: 2 / 4 = 0.5.
    measured = contended(dataclasses.replace(CALIBRATED, cpu_stage_contention_at_fit=4.0), 12, 0.5, pp=3)
    assert measured.dp_sync_wait_per_collective_seconds == pytest.approx(0.001)
    assert measured.cpu_stage_time_scale == pytest.approx(0.5)
    assert measured.cpu_time_scale == pytest.approx(1.5 * 2.5)
    # dp's collectives are priced on the link fit, which is referenced to the busy ranks' contention at the fit:
    # 2 / 1.6, whatever the stage's was.
    assert got.cpu_dp_comm_time_scale == pytest.approx(1.25)
    assert measured.cpu_dp_comm_time_scale == pytest.approx(1.25)
    # A stage's contention as at the fit does not stop the busy ranks': 8 ranks in 2 stages, fitted at 2 (both).
    same_stage = contended(dataclasses.replace(CALIBRATED, cpu_contention_at_fit=2.0), 8, 0.25, pp=2)
    assert (same_stage.cpu_stage_time_scale, same_stage.cpu_dp_comm_time_scale) == (1.0, 1.0)
    assert same_stage.host_seconds_per_layer_pass == pytest.approx(0.01 * 3.2 / 2)
    # The busy-rank ratio at 1 does not stop the stage's: fitted at kappa 4 (both contentions), 3 stages of 4 ranks.
    same_busy = contended(dataclasses.replace(CALIBRATED, cpu_contention_at_fit=4.0), 12, 0.5, pp=3)
    assert same_busy.host_seconds_per_layer_pass == pytest.approx(0.01)
    # Compute stretches only where the kernels are CPU work (a user's script on CPU ranks), by kappa's ratio.
    assert got.cpu_compute_time_scale == 1.0
    on_cpu = contended(dataclasses.replace(CALIBRATED, cpu_compute=True), 12, 0.5, pp=3)
    assert on_cpu.cpu_compute_time_scale == pytest.approx(2.5)
    assert same_busy.dp_sync_wait_per_collective_seconds == pytest.approx(0.002 * 2 / 4)
    assert same_busy.cpu_stage_time_scale == pytest.approx(0.5)
    # What contention does not touch stays as it was.
    assert got.cpu_cores == 2.0
    assert got.cpu_contention_at_fit == 1.6
    assert got.hbm_efficiency == CALIBRATED.hbm_efficiency


def test_contended_keeps_unset_per_axis_sync_waits_unset():
    a = dataclasses.replace(
        CALIBRATED,
        dp_sync_wait_per_collective_seconds=None,
        tp_sync_wait_per_collective_seconds=None,
        cp_sync_wait_per_collective_seconds=None,
        ep_sync_wait_per_collective_seconds=None,
    )
    got = contended(a, 12, 0.5)  # ratio 2.5, as above
    assert got.dp_sync_wait_per_collective_seconds is None
    assert got.tp_sync_wait_per_collective_seconds is None
    assert got.cp_sync_wait_per_collective_seconds is None
    assert got.ep_sync_wait_per_collective_seconds is None
    assert got.sync_wait_per_collective("tp") == pytest.approx(0.0025)  # falls back to the all-axes value


def test_contended_at_a_ratio_of_exactly_two():
    # 8 ranks, no bubble, 2 cores: kappa 4; fitted at 2: ratio 2.
    a = dataclasses.replace(CALIBRATED, cpu_contention_at_fit=2.0)
    got = contended(a, 8, 0.0)
    assert got.host_seconds_per_layer_pass == pytest.approx(0.02)
    assert got.cpu_time_scale == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("world", "at_fit"),
    [(8, 4.0), (2, 1.0)],
    ids=["the-measured-layout", "fewer-ranks-than-cores"],
)
def test_contended_returns_the_assumptions_themselves_at_a_ratio_of_one(world, at_fit):
    """Planning the layout the values were measured on (kappa 8/2 = 4 = at_fit), or kappa 1 = at_fit 1."""
    a = dataclasses.replace(CALIBRATED, cpu_contention_at_fit=at_fit)
    assert contended(a, world, 0.0) is a


def test_contended_uses_the_bubble_to_count_busy_ranks():
    # 12 ranks with bubble 0.5 are 8 busy (kappa 4) but 12 busy without it (kappa 6): ratios 4/1.6 and 6/1.6.
    with_bubble = contended(CALIBRATED, 12, 0.5)
    without = contended(CALIBRATED, 12, 0.0)
    assert with_bubble.host_seconds_per_layer_pass == pytest.approx(0.01 * 4 / 1.6)
    assert without.host_seconds_per_layer_pass == pytest.approx(0.01 * 6 / 1.6)


# ---------------------------------------------------------------------------------------------------- peak, optimizer


@pytest.mark.parametrize(
    ("precision", "peak"),
    [
        (Precision.BF16, H100_BF16),
        (Precision.FP8, H100_FP8),
        (Precision.FP32, H100_BF16 / 2),  # TF32 tensor cores: half the BF16 rate
    ],
    ids=["bf16", "fp8", "fp32"],
)
def test_peak_flops_follow_the_training_precision(precision, peak):
    assert peak_flops_per_s(H100, precision) == pytest.approx(peak)


def _state(updated: float) -> ModelStateBytes:
    return ModelStateBytes(weights_bytes=0.0, gradients_bytes=0.0, optimizer_bytes=0.0, updated_params=updated)


def test_optimizer_reads_and_writes_an_fp32_main_weight_twice():
    # fp32 training: 2·8 optimizer + 2·4 gradients + 2·4 weight (the weight is the main weight) = 32 bytes/param;
    # 1e9 params at 0.8 x 3.35 TB/s.
    per = StateBytesPerParam(weights=4.0, gradients=4.0, optimizer=8.0, weights_are_main=True)
    got = optimizer_seconds(_state(1e9), per, H100, PlanAssumptions())
    assert got == pytest.approx(32e9 / (H100_HBM * 0.8))


def test_optimizer_writes_a_16_bit_weight_once():
    # bf16 + fp32 grads: 2·12 + 2·4 + 1·2 = 34 bytes/param.
    per = StateBytesPerParam(weights=2.0, gradients=4.0, optimizer=12.0)
    got = optimizer_seconds(_state(1e9), per, H100, PlanAssumptions())
    assert got == pytest.approx(34e9 / (H100_HBM * 0.8))


def test_optimizer_hbm_efficiency_overrides_hbm_efficiency():
    per = StateBytesPerParam(weights=2.0, gradients=4.0, optimizer=12.0)
    got = optimizer_seconds(_state(1e9), per, H100, PlanAssumptions(optimizer_hbm_efficiency=0.5, hbm_efficiency=0.8))
    assert got == pytest.approx(34e9 / (H100_HBM * 0.5))


UNFUSED = PlanAssumptions(grad_accumulation_fusion=False)


@pytest.mark.parametrize(
    ("per", "grad_bytes", "per_element"),
    [
        # bf16 weights, fp32 buffer: read the fresh 2-byte gradient, read and write the 4-byte buffer = 10 bytes
        (StateBytesPerParam(weights=2.0, gradients=4.0, optimizer=12.0), 4.0, 10.0),
        # bf16 buffer (grad_reduce_bytes 2): 2 + 2 + 2
        (StateBytesPerParam(weights=2.0, gradients=2.0, optimizer=16.0), 2.0, 6.0),
        # fp32 training: 4 + 4 + 4
        (StateBytesPerParam(weights=4.0, gradients=4.0, optimizer=8.0, weights_are_main=True), 4.0, 12.0),
    ],
    ids=["bf16-fp32-buffer", "bf16-buffer", "fp32"],
)
def test_unfused_gradient_accumulation_streams_the_fresh_gradient_and_the_buffer(per, grad_bytes, per_element):
    # 1e9 gradient elements held (the buffer's bytes ÷ its element size), at 0.8 x 3.35 TB/s
    state = ModelStateBytes(weights_bytes=0.0, gradients_bytes=1e9 * grad_bytes, optimizer_bytes=0.0, updated_params=0)
    got = grad_accumulation_seconds(state, per, H100, UNFUSED)
    assert got == pytest.approx(1e9 * per_element / (H100_HBM * 0.8))
    assert grad_accumulation_seconds(state, per, H100, PlanAssumptions()) == 0.0


@pytest.mark.parametrize(("m", "zero_stage", "dp"), [(1, 0, 1), (4, 0, 1), (4, 1, 2), (4, 2, 2)])
def test_unfused_gradient_accumulation_adds_a_pass_per_micro_batch_to_backward(m, zero_stage, dp):
    # Per micro-batch, one pass over the gradient buffer this GPU holds: all of the stage's parameters, or their
    # 1/dp shard where ZeRO-2 reduce-scatters every micro-batch; nothing in forward.
    hardware = dataclasses.replace(H100, gpus_per_node=dp, nvlink_domain_gpus=dp)
    spec = JobSpec(
        name="accumulate",
        model=tiny(layers=4),
        parallelism=ParallelismConfig(layout=ParallelLayout(dp=dp)),
        training=training(global_batch_size=dp * m, zero_stage=zero_stage),
        hardware=hardware,
    )
    fused, unfused = plan_job(spec), plan_job(spec, assumptions=UNFUSED)
    (a,), (b,) = fused.stages, unfused.stages
    held = b.params.total / (dp if zero_stage >= 2 else 1)
    per_pass = held * 10.0 / (H100_HBM * 0.8)
    assert b.forward_seconds_per_microbatch == a.forward_seconds_per_microbatch
    assert b.backward_seconds_per_microbatch - a.backward_seconds_per_microbatch == pytest.approx(per_pass, rel=1e-9)
    assert unfused.expected_step_time.compute_seconds - fused.expected_step_time.compute_seconds == pytest.approx(
        m * per_pass, rel=1e-9
    )
    # the plan's compute classes show it as a bytes-bound row of its own, and still add up to the compute
    (row,) = [c for c in unfused.compute_classes if c.op == "grad_accumulation (unfused)"]
    assert (row.seconds_per_step, row.bytes_per_step, row.efficiency) == pytest.approx(
        (m * per_pass, m * held * 10.0, None)
    )
    assert all(c.op != row.op for c in fused.compute_classes)
    assert sum(c.seconds_per_step for c in unfused.compute_classes) - sum(
        c.seconds_per_step for c in fused.compute_classes
    ) == pytest.approx(m * per_pass, rel=1e-9)


# ---------------------------------------------------------------------------------------------------- stage compute

FLAT = PlanAssumptions(compute_efficiency=0.5)


def _compute(
    assumptions: PlanAssumptions,
    *,
    layout: ParallelLayout | None = None,
    layers: int = 2,
    recompute: Recompute = Recompute.NONE,
    **kw: bool,
):
    return stage_compute(
        tiny(layers=layers),
        layout or ParallelLayout(tp=2),
        training(recompute=recompute),
        H100,
        assumptions,
        pp_rank=0,
        layer_indices=list(range(layers)),
        micro_batches=1,
        **kw,
    )


@pytest.mark.parametrize(
    ("recompute", "passes"),
    [(Recompute.NONE, 3), (Recompute.SELECTIVE, 4), (Recompute.FULL, 4)],
    ids=["none", "selective", "full"],
)
def test_flat_attention_core_time_counts_forward_backward_and_recompute_passes(recompute, passes):
    # Causal core FLOPs per layer 2·tokens·s·(2·a·d)·0.5 = 2·32·32·128·0.5 = 131,072; 2 layers ÷ tp=2 = 131,072 per
    # GPU; forward + backward is 3 passes, recompute (selective or full) reruns the core once more.
    rate = H100_BF16 * 0.5
    got = _compute(FLAT, recompute=recompute).attention_core_seconds_per_microbatch
    assert got == pytest.approx(passes * 131_072 / rate)


@pytest.mark.parametrize("assumptions", [FLAT, PlanAssumptions()], ids=["flat", "roofline"])
def test_host_time_per_layer_pass_splits_a_third_forward_two_thirds_backward(assumptions):
    # 4 layers x 3 ms = 12 ms per micro-batch: 4 ms forward, 8 ms backward, on top of the kernels' time.
    base = _compute(assumptions, layers=4)
    hosted = _compute(dataclasses.replace(assumptions, host_seconds_per_layer_pass=0.003), layers=4)
    forward = hosted.forward_seconds_per_microbatch - base.forward_seconds_per_microbatch
    backward = hosted.backward_seconds_per_microbatch - base.backward_seconds_per_microbatch
    assert forward == pytest.approx(0.004, rel=1e-9)
    assert backward == pytest.approx(0.008, rel=1e-9)


def _assert_host_scaled(layout: ParallelLayout, scale: float, **host: float | None) -> None:
    """4 layers x 3 ms of host time per layer pass x ``scale`` on ``layout``: 4 ms x scale forward, 8 ms backward."""
    base = _compute(FLAT, layout=layout, layers=4)
    hosted = _compute(dataclasses.replace(FLAT, host_seconds_per_layer_pass=0.003, **host), layout=layout, layers=4)
    forward = hosted.forward_seconds_per_microbatch - base.forward_seconds_per_microbatch
    backward = hosted.backward_seconds_per_microbatch - base.backward_seconds_per_microbatch
    assert forward == pytest.approx(0.004 * scale, rel=1e-9)
    assert backward == pytest.approx(0.008 * scale, rel=1e-9)


@pytest.mark.parametrize(
    ("reference", "exponent", "layout", "scale"),
    [
        (8.0, 1.0 / 3.0, ParallelLayout(tp=2), 4.0 ** (1.0 / 3.0)),  # S tokens per rank, measured at S/4
        (8.0, 1.0 / 3.0, ParallelLayout(cp=2), 2.0 ** (1.0 / 3.0)),  # cp halves a rank's tokens: S/2 against S/4
        (64.0, 0.5, ParallelLayout(tp=2), 0.5**0.5),  # a smaller micro-batch than the measured one: less host time
        (8.0, 1.0, ParallelLayout(tp=2), 4.0),  # exponent 1: all of it the tensors' math, in proportion
        (8.0, 0.0, ParallelLayout(tp=2), 1.0),  # exponent 0: launches and dispatch only, any size
        (None, 1.0 / 3.0, ParallelLayout(tp=2), 1.0),  # no reference: not calibrated at any size
    ],
    ids=["larger", "cp", "smaller", "proportional", "exponent-0", "no-reference"],
)
def test_host_time_per_layer_pass_scales_with_a_ranks_tokens_per_micro_batch(reference, exponent, layout, scale):
    # S = 32 tokens per micro-batch (b = 1); 4 layers x 3 ms x (tokens ÷ reference) ** exponent, a third of it in
    # forward and two thirds in backward.
    assert S == 32
    _assert_host_scaled(layout, scale, host_reference_tokens=reference, host_tokens_exponent=exponent)


@pytest.mark.parametrize(
    ("reference", "factor", "layout", "scale"),
    [
        (1.0, 1.5, ParallelLayout(tp=2), 1.5),  # measured without tp, planned with it: tp's dispatch added
        (2.0, 1.5, ParallelLayout(dp=2), 1.0 / 1.5),  # measured with tp, planned without: taken away
        (2.0, 1.5, ParallelLayout(tp=4), 1.0),  # both have tp: the measured time holds
        (1.0, 1.5, ParallelLayout(dp=2), 1.0),  # neither has it
        (None, 1.5, ParallelLayout(tp=2), 1.0),  # no reference: not calibrated with or without tp
        (1.0, 1.0, ParallelLayout(tp=2), 1.0),  # factor 1: tp adds no host time
    ],
    ids=["add-tp", "drop-tp", "both-tp", "neither", "no-reference", "factor-1"],
)
def test_host_time_per_layer_pass_scales_with_tensor_parallelisms_dispatch(reference, factor, layout, scale):
    # 4 layers x 3 ms x the tp scale per micro-batch, a third of it in forward, two thirds in backward.
    _assert_host_scaled(layout, scale, host_reference_tp=reference, host_tp_factor=factor)


def test_a_reference_tensor_parallel_degree_must_be_whole():
    with pytest.raises(PlanError, match=r"host_reference_tp must be a whole number >= 1 .*got 1\.5"):
        dataclasses.replace(FLAT, host_reference_tp=1.5)


def test_roofline_attention_core_time_is_the_kernels_attention_core_class():
    got = _compute(PlanAssumptions())
    assert got.kernels is not None
    assert got.attention_core_seconds_per_microbatch == got.kernels.seconds(OpClass.ATTENTION_CORE)
    assert got.attention_core_seconds_per_microbatch > 0.0


def _kernels(*, sequence_parallel: bool):
    return stage_kernels(
        tiny(),
        ParallelLayout(tp=2),
        training(),
        H100,
        PlanAssumptions(),
        sequence_parallel=sequence_parallel,
        layer_indices=[0, 1],
        last_stage=True,
    )


def test_stage_compute_passes_sequence_parallel_to_the_roofline_and_defaults_to_off():
    with_sp, without_sp = _kernels(sequence_parallel=True), _kernels(sequence_parallel=False)
    # SP divides the element-wise bytes by tp = 2, so the two differ.
    assert with_sp.forward_seconds < without_sp.forward_seconds
    assert _compute(PlanAssumptions(), sequence_parallel=True).forward_seconds_per_microbatch == pytest.approx(
        with_sp.forward_seconds, rel=1e-12
    )
    assert _compute(PlanAssumptions()).forward_seconds_per_microbatch == pytest.approx(
        without_sp.forward_seconds, rel=1e-12
    )


# ---------------------------------------------------------------------------------------------------- layer split


def test_embedding_as_a_layer_takes_one_from_the_first_chunk():
    # 8 + 1 counted over 2 chunks: 5 and 4; the first gives one to the embedding: 4 and 4.
    ranges = stage_layer_ranges(8, ParallelLayout(pp=2), embedding_counts_as_layer=True)
    assert ranges == (((0, 4),), ((4, 8),))


def test_loss_as_a_layer_takes_one_from_the_last_chunk():
    # 9 + 1 counted over 2 chunks: 5 and 5; the last gives one to the loss: 5 and 4.
    ranges = stage_layer_ranges(9, ParallelLayout(pp=2), loss_counts_as_layer=True)
    assert ranges == (((0, 5),), ((5, 9),))


def test_an_empty_first_chunk_is_an_error_without_the_embedding_as_a_layer():
    with pytest.raises(PlanError, match=r"\(chunk 0 would hold 0 layers\)"):
        stage_layer_ranges(0, ParallelLayout(pp=1))


# ---------------------------------------------------------------------------------------------------- parameters


def test_parameters_per_gpu_round_up_when_tp_does_not_divide():
    # Word embedding 1001·64 = 64,064 over tp=3: 21,354.67 -> 21,355 whole parameters on the most-loaded rank;
    # the untied output layer the same, plus the final RMSNorm's 64.
    model = dataclasses.replace(tiny(), vocab_size=1001)
    params = stage_params(model, ParallelLayout(tp=3), 0, [0, 1])
    assert params.embedding == 21_355
    assert params.output == 21_355 + 64
    assert isinstance(params.embedding, int)
    assert isinstance(params.output, int)


def test_largest_layer_of_a_moe_stage_counts_its_experts():
    # MoE layer 1, tp=1: attention 64·64 (Q) + 64·32 (K) + 64·32 (V) + 64·64 (O) = 12,288; two RMSNorms 128; router
    # 64·8 = 512; one shared expert 3·64·48 = 9,216; 8 routed experts 8·3·64·48 = 73,728. Total 95,872.
    params = stage_params(tiny(moe=MOE), ParallelLayout(), 0, [0, 1])
    assert params.largest_layer == 12_288 + 128 + 512 + 9_216 + 73_728


@pytest.mark.parametrize(("pp_rank", "copy"), [(0, 0), (1, 100 * 64 // 2)], ids=["first", "last"])
def test_tied_embedding_copy_is_on_the_last_stage_only(pp_rank, copy):
    # Tied embeddings with pp=2: the last stage keeps a copy of the word embedding, 100·64 ÷ tp=2 = 3,200.
    model = dataclasses.replace(tiny(), tied_embeddings=True)
    params = stage_params(model, ParallelLayout(tp=2, pp=2), pp_rank, [pp_rank])
    assert params.tied_embedding_copy == copy


# ---------------------------------------------------------------------------------------------------- model state

# 1,000 dense parameters, the largest layer 100 of them.
PARAMS = StageParams(tp_sharded=1000, replicated=0, experts=0, embedding=0, output=0, largest_layer=100)


def test_zero3_without_a_pipeline_by_default_gathers_only_the_largest_layer():
    # bf16: 2 bytes weights, 4 gradient bytes; 4 shards: 2·1000/4 + 2·100 = 700, 4·1000/4 + 4·100 = 1,400.
    got = model_state_bytes(PARAMS, training(zero_stage=3), dense_shards=4, expert_shards=1)
    assert got.weights_bytes == pytest.approx(700)
    assert got.gradients_bytes == pytest.approx(1400)


@pytest.mark.parametrize(
    ("zero_stage", "updated"),
    [(0, 1000), (1, 250), (2, 250), (3, 250)],
    ids=["zero0", "zero1", "zero2", "zero3"],
)
def test_optimizer_updates_its_shard_from_zero_1_on(zero_stage, updated):
    # Unsharded, every GPU steps all 1,000 parameters; sharded over 4: 250 each.
    got = resting_state_bytes(PARAMS, training(zero_stage=zero_stage), dense_shards=4, expert_shards=1)
    assert got.updated_params == pytest.approx(updated)


def test_fp32_weights_are_the_optimizers_main_weights():
    per = state_bytes_per_param(training(precision=Precision.FP32))
    assert per.weights_are_main is True
    assert (per.weights, per.gradients, per.optimizer) == (4.0, 4.0, 8.0)
    assert state_bytes_per_param(training()).weights_are_main is False


def test_grad_reduce_bytes_other_than_2_or_4_is_a_plan_error_naming_the_value():
    with pytest.raises(PlanError, match=r"^training\.grad_reduce_bytes must be 2 \(bf16\) or 4 \(fp32\), got 3$"):
        state_bytes_per_param(training(grad_reduce_bytes=3))


# ---------------------------------------------------------------------------------------------------- schedule


def test_gpipe_with_two_virtual_stages_is_a_plan_error():
    with pytest.raises(PlanError, match=r"^pipeline schedule 'gpipe' has no virtual stages, but vpp=2$"):
        resolve_schedule(training(pipeline_schedule=PipelineSchedule.GPIPE), ParallelLayout(pp=2, vpp=2))


def test_interleaved_without_virtual_stages_message_in_full():
    with pytest.raises(
        PlanError,
        match=r"^pipeline schedule 'interleaved' needs vpp > 1 \(model chunks per pipeline rank\), got vpp=1$",
    ):
        resolve_schedule(training(pipeline_schedule=PipelineSchedule.INTERLEAVED), ParallelLayout(pp=2))


def test_two_virtual_stages_run_the_interleaved_schedule_even_when_1f1b_is_named():
    got = resolve_schedule(training(pipeline_schedule=PipelineSchedule.ONE_F_ONE_B), ParallelLayout(pp=2, vpp=2))
    assert got is PipelineSchedule.INTERLEAVED


@pytest.mark.parametrize(
    ("pp", "pp_rank", "schedule", "expected"),
    [
        (1, 0, PipelineSchedule.GPIPE, 1.0),  # no pipeline: one micro-batch at a time, whatever is named
        (1, 0, PipelineSchedule.ONE_F_ONE_B, 1.0),
        (2, 0, PipelineSchedule.ONE_F_ONE_B, 2.0),  # min(pp - rank, m) = min(2, 4)
        (2, 1, PipelineSchedule.ONE_F_ONE_B, 1.0),  # min(2 - 1, 4)
        (2, 1, PipelineSchedule.GPIPE, 4.0),  # all m
    ],
    ids=["pp1-gpipe", "pp1-1f1b", "pp2-rank0", "pp2-rank1", "pp2-gpipe"],
)
def test_in_flight_micro_batches_at_the_edge_of_a_pipeline(pp, pp_rank, schedule, expected):
    assert in_flight_microbatches(pp_rank, ParallelLayout(pp=pp), 4, schedule) == expected


# ---------------------------------------------------------------------------------------------------- activations


@pytest.mark.parametrize(
    ("precision", "e"),
    [(Precision.FP32, 4), (Precision.BF16, 2), (Precision.FP16, 2), (Precision.FP8, 2)],
    ids=["fp32", "bf16", "fp16", "fp8"],
)
def test_activation_element_bytes_by_precision(precision, e):
    assert activation_element_bytes(training(precision=precision)) == e


def test_full_recompute_keeps_the_fp32_layer_input():
    # e·sbh = 4·32·1·64 = 8,192 bytes.
    got = layer_activation_bytes(
        tiny(),
        0,
        ParallelismConfig(layout=ParallelLayout()),
        training(precision=Precision.FP32, recompute=Recompute.FULL),
    )
    assert got == pytest.approx(8_192)


# A MoE setting where every term of layer_activation_bytes is on: tp = etp = 2 with SP, eager attention, b = 2.
MOE_PAR = ParallelismConfig(layout=ParallelLayout(tp=2), sequence_parallel=True)
MOE_TRAINING = training(micro_batch_size=2, global_batch_size=2, attention=AttentionImpl.EAGER)
# sb = 32·2 = 64, e = 2, sp = t = etp = 2, no dropout:
#   replicated 4·e·sbh/sp = 8·64·64/2 = 16,384
#   attention e·sb·d·(2a/t + 2·max(g/t, 1)) = 2·64·16·(4 + 2) = 12,288
#   core (eager, no recompute) e·a·s_local·s·b/t = 2·4·32·32·2/2 = 8,192
#   dense MLP e·sb·f·3/t = 2·64·128·3/2 = 24,576
DENSE_LAYER = 16_384 + 12_288 + 8_192 + 24_576  # 61,440
#   router (e·E + 2·8·k)·sb/sp = (16 + 32)·64/2 = 1,536
#   shared e·sb·1·f_e·3/t = 2·64·48·3/2 = 9,216
#   routed k·sb·etp/t = 128 copies x e·(h + 3·f_e/etp + 1) = 2·(64 + 72 + 1) = 274 -> 35,072
MOE_LAYER = 16_384 + 12_288 + 8_192 + 1_536 + 9_216 + 35_072  # 82,688


def test_moe_layer_activations_with_tensor_sequence_and_expert_tensor_parallelism():
    model = tiny(moe=MOE)
    assert layer_activation_bytes(model, 0, MOE_PAR, MOE_TRAINING) == pytest.approx(DENSE_LAYER, rel=1e-12)
    assert layer_activation_bytes(model, 1, MOE_PAR, MOE_TRAINING) == pytest.approx(MOE_LAYER, rel=1e-12)


def test_moe_layer_routed_copies_follow_the_expert_tp_not_the_dense_tp():
    # tp=2, etp=1, ep=2 (carved out of dp=1·tp=2): routed copies k·sb·etp/t = 2·64·1/2 = 64, each
    # e·(h + 3·f_e/1 + 1) = 2·(64 + 144 + 1) = 418 -> 26,752; the rest as above.
    par = ParallelismConfig(layout=ParallelLayout(tp=2, ep=2, etp=1), sequence_parallel=True)
    got = layer_activation_bytes(tiny(moe=MOE), 1, par, MOE_TRAINING)
    assert got == pytest.approx(16_384 + 12_288 + 8_192 + 1_536 + 9_216 + 26_752, rel=1e-12)


def test_stage_activations_of_mixed_dense_and_moe_layers():
    """Layers 0 (dense) and 1-2 (MoE) share two shapes; the stage's sum must match the layer-by-layer sum."""
    model = tiny(layers=3, moe=MOE)
    got = stage_activations(
        model,
        MOE_PAR,
        MOE_TRAINING,
        pp_rank=0,
        layer_indices=[0, 1, 2],
        micro_batches=1,
        schedule=PipelineSchedule.ONE_F_ONE_B,
    )
    assert got.per_microbatch_layers_bytes == pytest.approx(DENSE_LAYER + 2 * MOE_LAYER, rel=1e-12)
    brute = sum(layer_activation_bytes(model, i, MOE_PAR, MOE_TRAINING) for i in range(3))
    assert got.per_microbatch_layers_bytes == pytest.approx(brute, rel=1e-12)


def test_full_recompute_working_layer_is_the_largest_of_a_mixed_stage():
    model = tiny(layers=3, moe=MOE)
    recompute = dataclasses.replace(MOE_TRAINING, recompute=Recompute.FULL)
    got = stage_activations(
        model,
        MOE_PAR,
        recompute,
        pp_rank=0,
        layer_indices=[0, 1, 2],
        micro_batches=1,
        schedule=PipelineSchedule.ONE_F_ONE_B,
    )
    # The MoE layer without recompute (82,688) is bigger than the dense one (61,440).
    assert got.recompute_working_bytes == pytest.approx(MOE_LAYER, rel=1e-12)


# MLA: a=4 heads, Q/K 16 + 8 rope = 24 wide, V 12 wide; latents kv 32, q 24.
MLA = MLAConfig(q_lora_rank=24, kv_lora_rank=32, qk_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def test_mla_attention_widths_per_tensor_parallel_rank():
    # a/tp = 2 heads per rank: Q and K 2·24 = 48, V and output 2·12 = 24.
    assert attention_widths_per_gpu(tiny(mla=MLA), 2) == (48.0, 48.0, 24.0, 24.0)


@pytest.mark.parametrize(
    ("q_lora_rank", "latents"),
    [(24, 32 + 8 + 24), (None, 32 + 8)],
    ids=["compressed-queries", "direct-queries"],
)
def test_mla_layer_activations(q_lora_rank, latents):
    # tp=2, SP, flash, b=1: sb = 32, e = 2, no dropout.
    #   replicated 4·e·sbh/sp = 8·32·64/2 = 8,192, plus the latents e·sb·(kv + rope + q)/sp = 32·latents
    #   attention e·sb·a·(2·24 + 2·12)/t = 2·32·4·72/2 = 9,216
    #   MLP e·sb·f·3/t = 2·32·128·3/2 = 12,288
    mla = dataclasses.replace(MLA, q_lora_rank=q_lora_rank)
    par = ParallelismConfig(layout=ParallelLayout(tp=2), sequence_parallel=True)
    got = layer_activation_bytes(tiny(mla=mla), 0, par, training())
    assert got == pytest.approx(8_192 + 32 * latents + 9_216 + 12_288, rel=1e-12)


def _cp_bytes(cp: int, comm: CpCommType) -> float:
    par = ParallelismConfig(layout=ParallelLayout(cp=cp), cp_comm_type=comm)
    return layer_activation_bytes(tiny(), 0, par, training(micro_batch_size=2, global_batch_size=2))


def test_ulysses_keeps_the_head_sharded_attention_output_from_cp_two_on():
    # cp=2, b=2: sb = 16·2 = 32; the extra output is e·sb·a·d/t = 2·32·4·16 = 4,096 bytes.
    assert _cp_bytes(2, CpCommType.A2A) - _cp_bytes(2, CpCommType.P2P) == pytest.approx(4_096, rel=1e-12)


def test_ulysses_named_without_context_parallelism_keeps_nothing_extra():
    assert _cp_bytes(1, CpCommType.A2A) == _cp_bytes(1, CpCommType.P2P)


# ---------------------------------------------------------------------------------------------------- stage parts

# Output of one micro-batch on the last stage, tp=1, no SP, bf16, b=1, sb=32: final-norm and output-layer inputs
# 2·e·sbh = 2·2·32·64 = 8,192; fp32 logits 4·sbV = 4·32·100 = 12,800; labels 8·sb = 256. 21,248 in all.
OUTPUT_ONE_MB = 8_192 + 12_800 + 256


def _stage(pp: int, pp_rank: int, schedule: PipelineSchedule, *, micro_batches: int = 4):
    return stage_activations(
        tiny(),
        ParallelismConfig(layout=ParallelLayout(pp=pp)),
        training(global_batch_size=micro_batches),
        pp_rank=pp_rank,
        layer_indices=[pp_rank],
        micro_batches=micro_batches,
        schedule=schedule,
    )


def test_gpipe_without_a_pipeline_holds_one_micro_batch_and_its_logits():
    got = _stage(1, 0, PipelineSchedule.GPIPE)
    assert got.in_flight_microbatches == 1.0
    assert got.output_bytes == pytest.approx(OUTPUT_ONE_MB)


def test_gpipe_over_two_stages_keeps_every_micro_batchs_logits():
    got = _stage(2, 1, PipelineSchedule.GPIPE)
    assert got.output_bytes == pytest.approx(4 * OUTPUT_ONE_MB)


def test_only_the_first_stage_holds_embedding_activations():
    # Stage 0, 1F1B over pp=2: 2 in flight x token ids 8·sb = 256 (no dropout mask) = 512.
    assert _stage(2, 0, PipelineSchedule.ONE_F_ONE_B).embedding_bytes == pytest.approx(512)
    assert _stage(2, 1, PipelineSchedule.ONE_F_ONE_B).embedding_bytes == 0.0


def test_the_bubble_of_a_single_stage_is_zero_and_one_micro_batch_waits_the_whole_fill() -> None:
    # One stage has no neighbour to wait for, whatever fraction the caller passes (no division by p - 1 = 0).
    assert planning._bubble_seconds([4.0], 0.5) == 0.0
    # pp=2, m=1: (p - 1)/m = 1.0. The slowest stage (3 s a step) idles while the one micro-batch passes the other
    # stage: t_0 = 2 s / 1 = 2 s (flow shop: makespan 2 + 3 = 5 s, of which the slowest stage works 3 s).
    assert planning._bubble_seconds([2.0, 3.0], 1.0) == 2.0

"""Edges of the planner's time model (plan/timing.py) that the other plan tests leave open.

Each expectation follows from the model's definition (docs/planner.md, "Expected step time"): host time per layer
pass splits a third into forward and two thirds into backward; the flat model's attention core runs 3 passes (4 with
recompute); the optimizer streams its bytes per parameter through HBM (fp32: the weight is the main weight, read
and written); an unset ``optimizer_hbm_efficiency`` falls back to ``hbm_efficiency``; 1F1B and GPipe bubbles do not
divide by vpp.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from builders import gpt_model
from meshscope.jobs.spec import JobSpec, ParallelismConfig, PipelineSchedule, Precision, Recompute, TrainingConfig
from meshscope.plan import PlanAssumptions, bubble_fraction, plan_job
from meshscope.topology.hardware import default_hardware
from meshscope.topology.layout import ParallelLayout


def job(layout: ParallelLayout, *, sp: bool = False, **training: object) -> JobSpec:
    hardware = default_hardware("H100", 1)
    hardware = replace(hardware, gpus_per_node=max(layout.world_size, 1), nvlink_domain_gpus=max(layout.world_size, 1))
    settings: dict[str, object] = {"micro_batch_size": 1, "global_batch_size": layout.dp * 2, **training}
    return JobSpec(
        name="edges",
        model=gpt_model(layers=4, h=1024, a=16, s=1024, v=1000),
        parallelism=ParallelismConfig(layout=layout, sequence_parallel=sp),
        training=TrainingConfig(**settings),  # type: ignore[arg-type]
        hardware=hardware,
    )


@pytest.mark.parametrize("flat", [None, 0.5], ids=["roofline", "flat"])
def test_host_time_per_layer_pass_is_a_third_forward_and_two_thirds_backward(flat: float | None) -> None:
    base = PlanAssumptions(compute_efficiency=flat)
    host = replace(base, host_seconds_per_layer_pass=0.003)
    spec = job(ParallelLayout())
    without, with_host = plan_job(spec, assumptions=base).stages[0], plan_job(spec, assumptions=host).stages[0]
    layers = 4
    # 3 ms per layer pass x 4 layers = 12 ms per micro-batch: 4 ms in forward, 8 ms in backward
    fwd = with_host.forward_seconds_per_microbatch - without.forward_seconds_per_microbatch
    bwd = with_host.backward_seconds_per_microbatch - without.backward_seconds_per_microbatch
    assert fwd == pytest.approx(layers * 0.003 / 3)
    assert bwd == pytest.approx(layers * 0.003 * 2 / 3)


@pytest.mark.parametrize(
    ("recompute", "passes"), [(Recompute.NONE, 3.0), (Recompute.SELECTIVE, 4.0), (Recompute.FULL, 4.0)]
)
def test_flat_model_attention_core_runs_three_passes_and_four_with_recompute(
    recompute: Recompute, passes: float
) -> None:
    # forward, the two backward passes (dgrad, wgrad), and the forward again when recomputed; the core's window is
    # what a context-parallel ring overlaps, so its length is the core's FLOPs at the flat rate times the passes
    from meshscope.plan.timing import stage_compute  # noqa: PLC0415 - the function under test, not re-exported

    spec = job(ParallelLayout(), recompute=recompute)
    a = PlanAssumptions(compute_efficiency=0.5)
    c = stage_compute(
        spec.model, spec.layout, spec.training, spec.hardware, a, pp_rank=0, layer_indices=range(4), micro_batches=2
    )
    rate = 989e12 * 0.5  # H100 SXM dense bf16 peak x the flat efficiency
    core = c.forward_flops_per_microbatch.attention_core
    assert core > 0
    assert c.attention_core_seconds_per_microbatch == pytest.approx(passes * core / rate)


def test_roofline_attention_core_window_is_the_cores_own_time() -> None:
    from meshscope.plan.timing import stage_compute  # noqa: PLC0415

    spec = job(ParallelLayout())
    c = stage_compute(
        spec.model,
        spec.layout,
        spec.training,
        spec.hardware,
        PlanAssumptions(),
        pp_rank=0,
        layer_indices=range(4),
        micro_batches=2,
    )
    whole = c.forward_seconds_per_microbatch + c.backward_seconds_per_microbatch
    assert 0 < c.attention_core_seconds_per_microbatch < whole


def test_fp32_training_reads_and_writes_the_main_weight_and_falls_back_to_hbm_efficiency() -> None:
    # fp32: weights 4, gradients 4, Adam moments 8 bytes per parameter, the weight itself is the main weight:
    # read+write moments (2·8) + read the gradient twice (2·4) + read+write the weight (2·4) = 32 bytes
    spec = job(ParallelLayout(), precision=Precision.FP32)
    plan = plan_job(spec, assumptions=PlanAssumptions(hbm_efficiency=0.8, optimizer_hbm_efficiency=None))
    params = plan.stages[0].params.total
    assert plan.expected_step_time.optimizer_seconds == pytest.approx(params * 32 / (3350e9 * 0.8))
    own = plan_job(spec, assumptions=PlanAssumptions(hbm_efficiency=0.8, optimizer_hbm_efficiency=0.4))
    assert own.expected_step_time.optimizer_seconds == pytest.approx(params * 32 / (3350e9 * 0.4))


@pytest.mark.parametrize("schedule", [PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.GPIPE])
def test_a_vpp_without_the_interleaved_schedule_does_not_shrink_the_bubble(schedule: PipelineSchedule) -> None:
    assert bubble_fraction(4, 8, vpp=2, schedule=schedule) == pytest.approx(3 / 8)
    assert bubble_fraction(4, 8, vpp=2, schedule=PipelineSchedule.INTERLEAVED) == pytest.approx(3 / 16)

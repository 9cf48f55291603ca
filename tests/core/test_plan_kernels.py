"""The compute roofline per operation class and NCCL's latency model, with hand-derived numbers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from builders import gpt_model
from meshscope.jobs.spec import JobSpec, ParallelismConfig, Recompute, TrainingConfig
from meshscope.plan import PlanAssumptions, plan_job
from meshscope.plan.kernels import Machine, OpClass, gemm_seconds, stage_kernels
from meshscope.plan.nccl import collective_time
from meshscope.topology.hardware import CATALOGUE, default_hardware
from meshscope.topology.layout import ParallelLayout

H100 = CATALOGUE["H100"]
PEAK, CEILING, SMS, HBM = 989e12, 0.620, 132, 3350e9
"""H100 SXM: dense BF16 peak, GEMM ceiling (the catalogue's, what NVIDIA's published DGX H100 run sustained), SMs, HBM."""
DEFAULT = PlanAssumptions()


def gpt(**kw: int):
    """GPT shape without dropout (the builder's has Korthikanti's 0.1)."""
    return replace(gpt_model(**kw), dropout=0.0)


def machine(**changes: object) -> Machine:
    return Machine(gpu=H100, precision="bf16", assumptions=PlanAssumptions(**changes))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- GEMMs


def test_tile_quantization_of_a_gemm_smaller_than_one_wave():
    # 1024 x 1024 output: 64 tiles of 128x128 on 132 SMs, one wave, so 1024² of 132·128² useful (48.5 %); the
    # 128x256 and 256x128 tiles leave 32 tiles (24.2 %). Compute-bound: 8.6 GFLOP vs 18.9 MB through HBM.
    seconds = gemm_seconds(1024, 1024, 4096, machine=machine())
    useful = 1024 * 1024 / (SMS * 128 * 128)
    assert seconds == pytest.approx(2 * 1024 * 1024 * 4096 / (PEAK * CEILING * useful))


def test_wave_quantization_one_tile_past_a_full_wave_costs_a_wave():
    # With 128x128 tiles only: 33 x 8 = 264 tiles are two full waves; 34 x 8 = 272 tiles need three.
    m = machine(gemm_tiles=((128, 128),))
    two_waves = gemm_seconds(128 * 33, 1024, 4096, machine=m)
    three_waves = gemm_seconds(128 * 34, 1024, 4096, machine=m)
    assert two_waves == pytest.approx(2 * 128 * 33 * 1024 * 4096 / (PEAK * CEILING))
    assert three_waves == pytest.approx(2 * 128 * 34 * 1024 * 4096 / (PEAK * CEILING * 272 / 396))
    assert three_waves == pytest.approx(1.5 * two_waves)


def test_a_thin_gemm_is_memory_bound():
    # 8192 x 8192 x 64: 8.6 GFLOP against (0.5 M + 0.5 M + 64 M) x 2 bytes = 130 MB, 48.5 µs at 0.8 x 3.35 TB/s,
    # while its compute (4,096 tiles of 128x128 in 32 waves, 97 % useful) would take 14.2 µs.
    seconds = gemm_seconds(8192, 8192, 64, machine=machine())
    assert seconds == pytest.approx((8192 * 64 + 64 * 8192 + 8192 * 8192) * 2 / (HBM * 0.8))


def test_gemm_efficiency_overrides_the_catalogue_ceiling():
    assert gemm_seconds(1024, 1024, 4096, machine=machine(gemm_efficiency=0.4)) == pytest.approx(
        2 * 1024 * 1024 * 4096 / (PEAK * 0.4 * 1024 * 1024 / (SMS * 128 * 128))
    )


# ---------------------------------------------------------------------------------------------------- classes


def _spec(model, layout, **training):
    return JobSpec(
        name="k",
        model=model,
        parallelism=ParallelismConfig(layout=layout),
        training=TrainingConfig(micro_batch_size=1, global_batch_size=1, **training),
        hardware=replace(default_hardware("H100", nodes=1), gpus_per_node=layout.world_size,
                         nvlink_domain_gpus=layout.world_size),
    )  # fmt: skip


def test_elementwise_bytes_of_a_gelu_layer():
    # GPT layer without dropout, learned positions, GELU, tp 1: two norms (read + write) and two residual adds (two
    # reads, one write) = 10 T·h elements, the activation function reads and writes T·f: 2 T·f; 2 bytes each.
    h, f, s = 1024, 4096, 2048
    model = gpt(layers=1, h=h, a=16, s=s, v=1000)
    spec = _spec(model, ParallelLayout())
    kernels = stage_kernels(
        model, spec.layout, spec.training, spec.hardware, DEFAULT, sequence_parallel=False, layer_indices=[0],
        last_stage=False,
    )  # fmt: skip
    elementwise = kernels.classes[OpClass.ELEMENTWISE]
    nbytes = (10 * s * h + 2 * s * f) * 2
    assert elementwise.forward_bytes == pytest.approx(nbytes)
    assert elementwise.forward_seconds == pytest.approx(nbytes / (HBM * 0.8))
    assert elementwise.backward_seconds == pytest.approx(2 * nbytes / (HBM * 0.8))


def test_flash_attention_core_runs_at_the_attention_efficiency():
    # Causal: 2·T·s·(2·a·d)/2 forward FLOPs at 0.55 of peak; backward twice the forward.
    h, a, s = 1024, 16, 4096
    model = gpt(layers=1, h=h, a=a, s=s, v=1000)
    spec = _spec(model, ParallelLayout())
    kernels = stage_kernels(
        model, spec.layout, spec.training, spec.hardware, DEFAULT, sequence_parallel=False, layer_indices=[0],
        last_stage=False,
    )  # fmt: skip
    core = kernels.classes[OpClass.ATTENTION_CORE]
    flops = 2 * s * s * 2 * h / 2
    assert core.forward_flops == pytest.approx(flops)
    assert core.forward_seconds == pytest.approx(flops / (PEAK * 0.55))
    assert core.backward_seconds == pytest.approx(2 * core.forward_seconds)


def test_full_recompute_adds_the_forward_of_every_layer_class_but_not_the_logits():
    model = gpt(layers=2, h=1024, a=16, s=2048, v=32000)
    spec = _spec(model, ParallelLayout(), recompute=Recompute.FULL)
    kernels = stage_kernels(
        model, spec.layout, spec.training, spec.hardware, DEFAULT, sequence_parallel=False, layer_indices=[0, 1],
        last_stage=True,
    )  # fmt: skip
    assert OpClass.LOGITS not in kernels.recompute_seconds
    assert kernels.recompute_seconds[OpClass.MLP_UP] == pytest.approx(kernels.classes[OpClass.MLP_UP].forward_seconds)
    plain = sum(c.backward_seconds for c in kernels.classes.values())
    assert kernels.backward_seconds == pytest.approx(plain + sum(kernels.recompute_seconds.values()))


def test_class_flops_add_up_to_the_planners_flops_and_the_plan_lists_their_efficiency():
    model = gpt(layers=2, h=2048, a=16, s=2048, v=32000)
    plan = plan_job(_spec(model, ParallelLayout()))
    stage = plan.stages[0]
    classes = plan.compute_classes
    assert sum(c.flops_per_step for c in classes) == pytest.approx(stage.hardware_flops_per_microbatch)
    assert sum(c.seconds_per_step for c in classes) == pytest.approx(plan.expected_step_time.compute_seconds)
    by_class = plan.compute_efficiency_by_class
    assert by_class["elementwise"] is None
    assert by_class["attention_core"] == pytest.approx(0.55)
    assert 0.5 < by_class["mlp_up"] <= CEILING


def test_the_flat_model_is_one_efficiency_for_every_flop():
    model = gpt(layers=2, h=2048, a=16, s=2048, v=32000)
    plan = plan_job(_spec(model, ParallelLayout()), assumptions=PlanAssumptions(compute_efficiency=0.4))
    (flat,) = plan.compute_classes
    assert flat.efficiency == 0.4
    assert plan.expected_step_time.compute_seconds == pytest.approx(flat.flops_per_step / (PEAK * 0.4))


# ---------------------------------------------------------------------------------------------------- NCCL


def _time(op, nbytes, n, nodes, link, **changes):
    bandwidth = 450e9 if link == "nvlink" else 50e9
    return collective_time(
        op, nbytes, group_size=n, nodes=nodes, link=link, link_bandwidth_bytes_per_s=bandwidth,
        assumptions=PlanAssumptions(**changes),  # type: ignore[arg-type]
    )  # fmt: skip


def test_small_all_gather_over_two_nodes_takes_the_ll_ring():
    # 16 ranks on 2 nodes, 4 KiB: 15 ring steps, 1 across the network. LL: 6.6 + 14 x 0.6 + 2.7 = 17.7 µs plus
    # 3840 B at 35 GB/s / 4; LL128 14 + 14 x 1.9 + 4.0 = 44.6 µs; Simple 8.4 + 14 x 3.4 + 14 = 70 µs.
    t = _time("all-gather", 4096, 16, 2, "network")
    assert (t.algorithm, t.protocol) == ("ring", "ll")
    assert t.latency_seconds == pytest.approx(17.7e-6)
    assert t.seconds == pytest.approx(17.7e-6 + 4096 * 15 / 16 / (50e9 * 0.7 / 4))


def test_small_all_reduce_over_many_nodes_takes_the_tree():
    # 64 ranks on 8 nodes, 1 KiB. Ring LL: 126 steps, 16 across nodes: 6.6 + 110 x 0.6 + 16 x 2.7 = 115.8 µs.
    # Tree LL: 6.8 + 2 x (7 x 0.6 + log2(8) x 5.0) = 45.2 µs, moving 2 KiB at 35 GB/s x 0.92/3.8.
    t = _time("all-reduce", 1024, 64, 8, "network")
    assert (t.algorithm, t.protocol) == ("tree", "ll")
    assert t.latency_seconds == pytest.approx(45.2e-6)
    assert t.seconds == pytest.approx(45.2e-6 + 2 * 1024 / (50e9 * 0.7 * 0.92 / 3.8))


def test_large_send_recv_runs_at_the_links_bandwidth_with_simple():
    # 1 MiB point to point on NVLink: Simple 8.4 + 3.4 µs + S/360 GB/s = 14.71 µs beats LL (7.2 + S/90 GB/s) and
    # LL128 (15.9 µs + S/331 GB/s).
    t = _time("send-recv", 2**20, 2, 1, "nvlink")
    assert (t.algorithm, t.protocol) == ("p2p", "simple")
    assert t.seconds == pytest.approx(11.8e-6 + 2**20 / 360e9)


def test_without_the_latency_model_a_collective_is_bandwidth_only():
    t = _time("all-reduce", 2**20, 8, 1, "nvlink", nccl_latency=False)
    assert t.algorithm == "bandwidth-only"
    assert t.seconds == pytest.approx(2**20 * 2 * 7 / 8 / 360e9)


def test_a_protocols_costs_can_be_overridden():
    base = PlanAssumptions()
    slow_net = PlanAssumptions(ring_ll=type(base.ring_ll)(
        base_latency_s=6.6e-6, nvlink_hop_latency_s=0.6e-6, network_hop_latency_s=50e-6, bandwidth_fraction=0.25
    ))  # fmt: skip
    fast = _time("all-gather", 4096, 16, 2, "network")
    slow = collective_time(
        "all-gather", 4096, group_size=16, nodes=2, link="network", link_bandwidth_bytes_per_s=50e9,
        assumptions=slow_net,
    )  # fmt: skip
    assert slow.latency_seconds > fast.latency_seconds

"""The planner's JSON (``meshscope plan --json``, ``plan --search --json``): every key, its unit and its value.

Each ``to_dict`` is checked on objects built by hand with values picked so that every sum and ratio the JSON
computes is exact in binary floating point (``ExpectedStepTime.total``, ``headroom_bytes``, ``expected_mfu``, ...),
then on real plans of the example manifests, key by key against the plan's own attributes. The key sets are checked
exactly: a renamed or dropped key fails. docs/planner.md, "``Plan.to_dict()``", lists the documented keys; the
dicts here also carry the extra keys it allows (``compute_model``, ``compute_classes``, ``sync_wait``, ``data``,
``other``, a collective's ``algorithm``, ``protocol`` and ``latency_seconds``).
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

import pytest

from meshscope.cli import main
from meshscope.jobs import load_spec
from meshscope.jobs.spec import CpCommType, PipelineSchedule
from meshscope.plan import (
    ActivationBreakdown,
    Candidate,
    CollectiveOp,
    CollectivePlan,
    Finding,
    MemoryBreakdown,
    Plan,
    PlanAssumptions,
    SearchResult,
    Severity,
    StageParams,
    StagePlan,
    StepFlops,
    plan_job,
)
from meshscope.plan.assumptions import NcclProtocolCosts, assumptions_from_mapping
from meshscope.plan.memory import ModelStateBytes
from meshscope.plan.timing import ExpectedStepTime
from meshscope.topology.layout import ParallelLayout
from meshscope.topology.placement import Link

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

STEP_KEYS = {"compute", "exposed_comm", "sync_wait", "bubble", "optimizer", "data", "other", "total", "pp_rank"}
COLLECTIVE_KEYS = {
    "axis",
    "group",
    "op",
    "purpose",
    "pp_rank",
    "group_size",
    "groups",
    "groups_crossing_domains",
    "link",
    "message_bytes",
    "count_per_step",
    "bus_factor",
    "bytes_per_gpu_per_step",
    "bandwidth_bytes_per_s",
    "seconds_per_instance",
    "expected_seconds_per_step",
    "exposed_seconds_per_step",
    "overlap_fraction",
    "hiding_flops_per_step",
    "flops_per_byte",
    "link_budget_flops_per_byte",
    "algorithm",
    "protocol",
    "latency_seconds",
}
STAGE_KEYS = {
    "pp_rank",
    "layers",
    "layer_ranges",
    "params",
    "params_by_bucket",
    "memory_bytes",
    "resting_state_bytes",
    "hbm_bytes",
    "headroom_bytes",
    "in_flight_microbatches",
    "forward_seconds_per_microbatch",
    "backward_seconds_per_microbatch",
    "model_flops_per_microbatch",
    "hardware_flops_per_microbatch",
    "expected_step_seconds",
    "compute_classes",
}
PLAN_KEYS = {
    "world_size",
    "total_params",
    "active_params",
    "layout",
    "sequence_parallel",
    "cp_comm_type",
    "micro_batches",
    "schedule",
    "stages",
    "collectives",
    "flops_per_step",
    "flops",
    "bubble_fraction",
    "expected_step_seconds",
    "expected_mfu",
    "compute_model",
    "compute_classes",
    "findings",
    "assumptions",
}
CANDIDATE_KEYS = {
    "layout",
    "micro_batch_size",
    "expected_step_seconds",
    "peak_memory_bytes",
    "headroom_bytes",
    "bubble_fraction",
    "exposed_comm_seconds",
    "expected_mfu",
    "findings",
}
NCCL_COST_KEYS = {"base_latency_s", "nvlink_hop_latency_s", "network_hop_latency_s", "bandwidth_fraction"}
ASSUMPTION_KEYS = {f.name for f in fields(PlanAssumptions) if f.init}  # every settable assumption, nothing else
PLAIN = (str, int, float, bool, type(None))


def assert_plain_json(data: object) -> None:
    """Only dicts with str keys, lists and plain scalars (no tuples, numpy types or NaN), and it round-trips."""

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                assert type(key) is str, key
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        else:
            assert type(node) in PLAIN, (type(node), node)
            if type(node) is float:
                assert math.isfinite(node), node

    walk(data)
    assert json.loads(json.dumps(data, allow_nan=False)) == data


# ---------------------------------------------------------------------------------------------------- ExpectedStepTime


def step_time(*, pp_rank: int = 1, sync: dict[str, float] | None = None, **extra: float) -> ExpectedStepTime:
    return ExpectedStepTime(
        pp_rank=pp_rank,
        compute_seconds=1.5,
        exposed_comm_seconds={"tp": 0.25, "dp": 0.5, "pp": 0.0},
        sync_wait_seconds=sync,
        bubble_seconds=0.75,
        optimizer_seconds=0.0625,
        **extra,
    )


def test_step_time_json_lists_every_category_with_its_axes_and_their_sum():
    t = step_time(sync={"tp": 0.125, "dp": 0.0625}, data_seconds=0.03125, other_seconds=0.015625)
    data = t.to_dict()
    assert set(data) == STEP_KEYS
    # 1.5 + (0.25 + 0.5 + 0) + (0.125 + 0.0625) + 0.75 + 0.0625 + 0.03125 + 0.015625, all exact in binary
    assert data == {
        "compute": 1.5,
        "exposed_comm": {"tp": 0.25, "dp": 0.5, "pp": 0.0},
        "sync_wait": {"tp": 0.125, "dp": 0.0625},
        "bubble": 0.75,
        "optimizer": 0.0625,
        "data": 0.03125,
        "other": 0.015625,
        "total": 3.296875,
        "pp_rank": 1,
    }
    assert_plain_json(data)


def test_step_time_json_without_sync_waits_has_an_empty_mapping_and_zero_loader_and_host():
    data = step_time(pp_rank=0).to_dict()
    assert set(data) == STEP_KEYS
    assert data["sync_wait"] == {}
    assert data["data"] == 0.0
    assert data["other"] == 0.0
    assert data["total"] == 1.5 + 0.75 + 0.75 + 0.0625  # compute + exposed + bubble + optimizer
    assert data["pp_rank"] == 0
    assert_plain_json(data)


# ---------------------------------------------------------------------------------------------------- StepFlops


@pytest.mark.parametrize(
    ("causal", "convention"),
    [(True, "causal attention halved"), (False, "full s^2 attention")],
    ids=["causal", "noncausal"],
)
def test_step_flops_json_names_the_three_counts_and_the_convention(causal, convention):
    flops = StepFlops(model_flops=3.0e18, model_flops_noncausal=3.5e18, hardware_flops=4.0e18, causal=causal)
    data = flops.to_dict()
    assert data == {"model": 3.0e18, "model_noncausal": 3.5e18, "hardware": 4.0e18, "convention": convention}
    assert_plain_json(data)


# ---------------------------------------------------------------------------------------------------- CollectivePlan


def collective(**changes: object) -> CollectivePlan:
    values: dict[str, object] = {
        "axis": "dp",
        "group": "dp-cp",
        "op": CollectiveOp.REDUCE_SCATTER,
        "purpose": "dense gradients",
        "pp_rank": 1,
        "group_size": 4,
        "groups": 6,
        "groups_crossing_domains": 2,
        "link": Link.NETWORK,
        "message_bytes": 8_000_000,
        "count_per_step": 3,
        "bus_factor": 0.75,
        "bytes_per_gpu_per_step": 18_000_000.0,
        "bandwidth_bytes_per_s": 50e9,
        "seconds_per_instance": 0.125,
        "hiding_flops_per_step": 6.0e12,
        "flops_per_byte": 333_000.0,
        "link_budget_flops_per_byte": 19_780.0,
        "overlap_fraction": 0.9,
        "overlap_window_seconds": 0.5,
        "exposed_seconds_per_step": 0.046875,
        "algorithm": "ring",
        "protocol": "ll128",
        "latency_seconds": 2.0e-5,
        **changes,
    }
    return CollectivePlan(**values)  # type: ignore[arg-type]


COLLECTIVE_JSON = {
    "axis": "dp",
    "group": "dp-cp",
    "op": "reduce-scatter",
    "purpose": "dense gradients",
    "pp_rank": 1,
    "group_size": 4,
    "groups": 6,
    "groups_crossing_domains": 2,
    "link": "network",
    "message_bytes": 8_000_000,
    "count_per_step": 3,
    "bus_factor": 0.75,
    "bytes_per_gpu_per_step": 18_000_000.0,
    "bandwidth_bytes_per_s": 50e9,
    "seconds_per_instance": 0.125,
    "expected_seconds_per_step": 0.375,  # 0.125 s x 3 per step
    "exposed_seconds_per_step": 0.046875,
    "overlap_fraction": 0.9,
    "hiding_flops_per_step": 6.0e12,
    "flops_per_byte": 333_000.0,
    "link_budget_flops_per_byte": 19_780.0,
    "algorithm": "ring",
    "protocol": "ll128",
    "latency_seconds": 2.0e-5,
}


def test_collective_json_has_every_field_in_base_units():
    data = collective().to_dict()
    assert set(data) == COLLECTIVE_KEYS
    assert data == COLLECTIVE_JSON
    assert_plain_json(data)


def test_collective_json_defaults_say_bandwidth_only():
    c = CollectivePlan(
        **{**_without(collective(), "algorithm", "protocol", "latency_seconds"), "op": CollectiveOp.SEND_RECV}
    )
    data = c.to_dict()
    assert (data["op"], data["algorithm"], data["protocol"], data["latency_seconds"]) == (
        "send-recv",
        "bandwidth-only",
        "simple",
        0.0,
    )


def _without(c: CollectivePlan, *names: str) -> dict[str, object]:
    return {f.name: getattr(c, f.name) for f in fields(c) if f.name not in names}


# ---------------------------------------------------------------------------------------------------- StagePlan

PEAK = 1.0e15
HBM = 200_000


def stage(pp_rank: int, *, hbm_bytes: int = HBM) -> StagePlan:
    """A flat-model stage of two chunks; its numbers are those of ``stage_json``."""
    return StagePlan(
        pp_rank=pp_rank,
        layer_ranges=((3 * pp_rank, 3 * pp_rank + 3), (6 + 2 * pp_rank, 8 + 2 * pp_rank)),
        params=StageParams(tp_sharded=1000, replicated=20, experts=300, embedding=400, output=500, largest_layer=250),
        memory=MemoryBreakdown(
            weights_bytes=4440, gradients_bytes=8880, optimizer_bytes=26640, activations_bytes=100000
        ),
        resting_state=ModelStateBytes(
            weights_bytes=4440.0, gradients_bytes=8880.0, optimizer_bytes=13320.0, updated_params=1110.0
        ),
        activations=ActivationBreakdown(
            per_microbatch_layers_bytes=40000.0,
            in_flight_microbatches=2.5,
            layers_bytes=100000.0,
            embedding_bytes=0.0,
            output_bytes=0.0,
            recompute_working_bytes=0.0,
        ),
        hbm_bytes=hbm_bytes,
        forward_seconds_per_microbatch=0.125,
        backward_seconds_per_microbatch=0.25,
        model_flops_per_microbatch=3.0e12,
        hardware_flops_per_microbatch=2.0e12 + pp_rank * 1.0e12,
        collectives=(collective(pp_rank=pp_rank),),
        step_time=step_time(pp_rank=pp_rank),
        kernels=None,
        compute_basis=(4, PEAK, 0.5, 2.0e12 + pp_rank * 1.0e12),
    )


def stage_json(pp_rank: int, *, hbm_bytes: int = HBM) -> dict[str, object]:
    hardware_flops = 2.0e12 + pp_rank * 1.0e12
    return {
        "pp_rank": pp_rank,
        "layers": 5,  # 3 + 2 layers in the two chunks
        "layer_ranges": [[3 * pp_rank, 3 * pp_rank + 3], [6 + 2 * pp_rank, 8 + 2 * pp_rank]],
        "params": 2220,  # 1000 + 20 + 300 + 400 + 500
        "params_by_bucket": {
            "tp_sharded": 1000,
            "replicated": 20,
            "routed_experts": 300,
            "embedding": 400,
            "output": 500,
        },
        "memory_bytes": {
            "weights": 4440,
            "gradients": 8880,
            "optimizer": 26640,
            "activations": 100000,
            "total": 139960,
        },
        "resting_state_bytes": {"weights": 4440.0, "gradients": 8880.0, "optimizer": 13320.0},
        "hbm_bytes": hbm_bytes,
        "headroom_bytes": hbm_bytes - 139960,
        "in_flight_microbatches": 2.5,
        "forward_seconds_per_microbatch": 0.125,
        "backward_seconds_per_microbatch": 0.25,
        "model_flops_per_microbatch": 3.0e12,
        "hardware_flops_per_microbatch": hardware_flops,
        "expected_step_seconds": step_time(pp_rank=pp_rank).to_dict(),  # checked on its own above
        "compute_classes": [
            {
                "op": "all (flat compute_efficiency)",
                "flops_per_step": 4 * hardware_flops,  # 4 micro-batches
                "seconds_per_step": 4 * hardware_flops / (PEAK * 0.5),
                "bytes_per_step": 0.0,
                "efficiency": 0.5,
            }
        ],
    }


@pytest.mark.parametrize(("hbm_bytes", "headroom"), [(HBM, 60040), (100_000, -39960)], ids=["fits", "too-big"])
def test_stage_json_has_every_field_with_its_unit(hbm_bytes, headroom):
    data = stage(1, hbm_bytes=hbm_bytes).to_dict()
    assert set(data) == STAGE_KEYS
    assert data == stage_json(1, hbm_bytes=hbm_bytes)
    assert data["headroom_bytes"] == headroom
    assert data["compute_classes"][0]["seconds_per_step"] == 0.024  # 4 x 3e12 FLOPs at half of 1e15 FLOP/s
    assert_plain_json(data)


# ---------------------------------------------------------------------------------------------------- PlanAssumptions


def assumptions_json(a: PlanAssumptions) -> dict[str, object]:
    """What ``to_dict`` documents: every assumption by name, NCCL costs as mappings, tuples as lists."""
    out: dict[str, object] = {}
    for name in ASSUMPTION_KEYS:
        value = getattr(a, name)
        if isinstance(value, NcclProtocolCosts):
            value = {key: getattr(value, key) for key in NCCL_COST_KEYS}
        elif name == "gemm_tiles":
            value = [[rows, cols] for rows, cols in value]
        elif isinstance(value, tuple):
            value = list(value)
        out[name] = value
    return out


ASSUMPTION_CASES = {
    "defaults": PlanAssumptions(),
    "calibrated": PlanAssumptions(
        compute_efficiency=0.5,
        gemm_tiles=((256, 128),),
        nccl_algorithms=("ring",),
        nccl_protocols=("simple", "ll"),
        ring_simple=NcclProtocolCosts(
            base_latency_s=1.0e-5, nvlink_hop_latency_s=2.0e-6, network_hop_latency_s=3.0e-5, bandwidth_fraction=0.9
        ),
        data_wait_seconds=0.03125,
        host_overhead_seconds=0.015625,
        tp_sync_wait_per_collective_seconds=1.0e-4,
        cpu_cores=6.0,
    ),
}


@pytest.mark.parametrize("a", ASSUMPTION_CASES.values(), ids=ASSUMPTION_CASES.keys())
def test_assumptions_json_names_every_assumption_and_nothing_else(a):
    data = a.to_dict()
    assert set(data) == ASSUMPTION_KEYS
    assert "_hash" not in data
    assert data == assumptions_json(a)
    assert_plain_json(data)


def test_assumptions_json_tiles_and_nccl_choices_are_lists_of_what_was_set():
    data = ASSUMPTION_CASES["calibrated"].to_dict()
    assert data["gemm_tiles"] == [[256, 128]]
    assert data["nccl_algorithms"] == ["ring"]
    assert data["nccl_protocols"] == ["simple", "ll"]
    assert data["ring_simple"] == {
        "base_latency_s": 1.0e-5,
        "nvlink_hop_latency_s": 2.0e-6,
        "network_hop_latency_s": 3.0e-5,
        "bandwidth_fraction": 0.9,
    }
    assert data["compute_efficiency"] == 0.5
    assert data["gemm_efficiency"] is None


def test_assumptions_json_reads_back_as_the_same_assumptions():
    a = ASSUMPTION_CASES["calibrated"]
    assert assumptions_from_mapping(json.loads(json.dumps(a.to_dict()))) == a


# ---------------------------------------------------------------------------------------------------- Plan

LAYOUT = ParallelLayout(dp=2, tp=2, pp=2, cp=1, ep=2, etp=1, vpp=2)  # 8 GPUs


def hand_plan(assumptions: PlanAssumptions) -> Plan:
    stages = (stage(0), stage(1))
    return Plan(
        world_size=8,
        layout=LAYOUT,
        micro_batches=4,
        schedule=PipelineSchedule.INTERLEAVED,
        stages=stages,
        collectives=(collective(),),
        flops=StepFlops(model_flops=2.6375e15, model_flops_noncausal=3.0e15, hardware_flops=3.5e15, causal=True),
        bubble_fraction=0.125,
        expected_step_time=stages[1].step_time,
        findings=(Finding(code="bubble-large", severity=Severity.WARNING, message="pipeline bubble is 12.5%"),),
        assumptions=assumptions,
        peak_flops_per_s=PEAK,
        total_params=47_000,
        active_params=13_000,
        sequence_parallel=True,
        cp_comm_type=CpCommType.ALL_GATHER,
    )


@pytest.mark.parametrize(
    ("a", "compute_model"),
    [
        (PlanAssumptions(), "roofline per operation class"),
        (PlanAssumptions(compute_efficiency=0.5, data_wait_seconds=0.03125), "flat"),
    ],
    ids=["roofline", "flat"],
)
def test_plan_json_has_every_key_with_the_plans_numbers(a, compute_model):
    data = hand_plan(a).to_dict()
    assert set(data) == PLAN_KEYS
    assert data == {
        "world_size": 8,
        "total_params": 47_000,
        "active_params": 13_000,
        "layout": {"dp": 2, "tp": 2, "pp": 2, "cp": 1, "ep": 2, "vpp": 2, "etp": 1},
        "sequence_parallel": True,
        "cp_comm_type": "all_gather",
        "micro_batches": 4,
        "schedule": "interleaved",
        "stages": [stage_json(0), stage_json(1)],
        "collectives": [COLLECTIVE_JSON],
        "flops_per_step": 2.6375e15,
        "flops": {
            "model": 2.6375e15,
            "model_noncausal": 3.0e15,
            "hardware": 3.5e15,
            "convention": "causal attention halved",
        },
        "bubble_fraction": 0.125,
        "expected_step_seconds": step_time(pp_rank=1).to_dict(),
        # model FLOPs / (8 GPUs x 1e15 FLOP/s x stage 1's 3.0625 s)
        "expected_mfu": 2.6375e15 / (8 * PEAK * 3.0625),
        "compute_model": compute_model,
        "compute_classes": stage_json(1)["compute_classes"],  # the slowest stage's (pp_rank 1)
        "findings": [{"code": "bubble-large", "severity": "warning", "message": "pipeline bubble is 12.5%"}],
        "assumptions": assumptions_json(a),
    }
    assert_plain_json(data)


def test_plan_json_mfu_and_classes_come_from_the_slowest_stage():
    data = hand_plan(PlanAssumptions()).to_dict()
    # stage 1's step: 1.5 compute + 0.75 exposed + 0.75 bubble + 0.0625 optimizer = 3.0625 s
    assert data["expected_step_seconds"]["total"] == 3.0625
    assert data["expected_mfu"] == pytest.approx(2.6375e15 / 2.45e16, rel=1e-15)  # 8 x 1e15 x 3.0625 = 2.45e16
    # stage 1 holds 3e12 hardware FLOPs per micro-batch (stage 0: 2e12): 4 x 3e12 per step
    assert data["compute_classes"][0]["flops_per_step"] == 1.2e13


# ---------------------------------------------------------------------------------------------------- real plans


def expected_collective(c: CollectivePlan) -> dict[str, object]:
    return {
        "axis": c.axis,
        "group": c.group,
        "op": c.op.value,
        "purpose": c.purpose,
        "pp_rank": c.pp_rank,
        "group_size": c.group_size,
        "groups": c.groups,
        "groups_crossing_domains": c.groups_crossing_domains,
        "link": c.link.value,
        "message_bytes": c.message_bytes,
        "count_per_step": c.count_per_step,
        "bus_factor": c.bus_factor,
        "bytes_per_gpu_per_step": c.bytes_per_gpu_per_step,
        "bandwidth_bytes_per_s": c.bandwidth_bytes_per_s,
        "seconds_per_instance": c.seconds_per_instance,
        "expected_seconds_per_step": c.seconds_per_instance * c.count_per_step,
        "exposed_seconds_per_step": c.exposed_seconds_per_step,
        "overlap_fraction": c.overlap_fraction,
        "hiding_flops_per_step": c.hiding_flops_per_step,
        "flops_per_byte": c.flops_per_byte,
        "link_budget_flops_per_byte": c.link_budget_flops_per_byte,
        "algorithm": c.algorithm,
        "protocol": c.protocol,
        "latency_seconds": c.latency_seconds,
    }


def expected_step(t: ExpectedStepTime) -> dict[str, object]:
    exposed = dict(t.exposed_comm_seconds)
    sync = dict(t.sync_wait_seconds or {})
    total = (
        t.compute_seconds
        + sum(exposed.values())
        + sum(sync.values())
        + t.bubble_seconds
        + t.optimizer_seconds
        + t.data_seconds
        + t.other_seconds
    )
    return {
        "compute": t.compute_seconds,
        "exposed_comm": exposed,
        "sync_wait": sync,
        "bubble": t.bubble_seconds,
        "optimizer": t.optimizer_seconds,
        "data": t.data_seconds,
        "other": t.other_seconds,
        "total": total,
        "pp_rank": t.pp_rank,
    }


def expected_stage(s: StagePlan) -> dict[str, object]:
    p, m, r = s.params, s.memory, s.resting_state
    total = m.weights_bytes + m.gradients_bytes + m.optimizer_bytes + m.activations_bytes
    return {
        "pp_rank": s.pp_rank,
        "layers": sum(stop - start for start, stop in s.layer_ranges),
        "layer_ranges": [[start, stop] for start, stop in s.layer_ranges],
        "params": p.tp_sharded + p.replicated + p.experts + p.embedding + p.output,
        "params_by_bucket": {
            "tp_sharded": p.tp_sharded,
            "replicated": p.replicated,
            "routed_experts": p.experts,
            "embedding": p.embedding,
            "output": p.output,
        },
        "memory_bytes": {
            "weights": m.weights_bytes,
            "gradients": m.gradients_bytes,
            "optimizer": m.optimizer_bytes,
            "activations": m.activations_bytes,
            "total": total,
        },
        "resting_state_bytes": {
            "weights": r.weights_bytes,
            "gradients": r.gradients_bytes,
            "optimizer": r.optimizer_bytes,
        },
        "hbm_bytes": s.hbm_bytes,
        "headroom_bytes": s.hbm_bytes - total,
        "in_flight_microbatches": s.activations.in_flight_microbatches,
        "forward_seconds_per_microbatch": s.forward_seconds_per_microbatch,
        "backward_seconds_per_microbatch": s.backward_seconds_per_microbatch,
        "model_flops_per_microbatch": s.model_flops_per_microbatch,
        "hardware_flops_per_microbatch": s.hardware_flops_per_microbatch,
        "expected_step_seconds": expected_step(s.step_time),
        "compute_classes": [
            {
                "op": c.op,
                "flops_per_step": c.flops_per_step,
                "seconds_per_step": c.seconds_per_step,
                "bytes_per_step": c.bytes_per_step,
                "efficiency": c.efficiency,
            }
            for c in s.compute_classes
        ],
    }


def expected_plan(plan: Plan, layout: dict[str, int]) -> dict[str, object]:
    slowest = plan.stages[plan.expected_step_time.pp_rank]
    step = expected_step(plan.expected_step_time)
    return {
        "world_size": plan.world_size,
        "total_params": plan.total_params,
        "active_params": plan.active_params,
        "layout": layout,
        "sequence_parallel": plan.sequence_parallel,
        "cp_comm_type": plan.cp_comm_type.value,
        "micro_batches": plan.micro_batches,
        "schedule": plan.schedule.value,
        "stages": [expected_stage(s) for s in plan.stages],
        "collectives": [expected_collective(c) for c in plan.collectives],
        "flops_per_step": plan.flops.model_flops,
        "flops": {
            "model": plan.flops.model_flops,
            "model_noncausal": plan.flops.model_flops_noncausal,
            "hardware": plan.flops.hardware_flops,
            "convention": "causal attention halved" if plan.flops.causal else "full s^2 attention",
        },
        "bubble_fraction": plan.bubble_fraction,
        "expected_step_seconds": step,
        "expected_mfu": plan.flops.model_flops / (plan.world_size * plan.peak_flops_per_s * step["total"]),
        "compute_model": "flat" if plan.assumptions.compute_efficiency is not None else "roofline per operation class",
        "compute_classes": expected_stage(slowest)["compute_classes"],
        "findings": [{"code": f.code, "severity": f.severity.value, "message": f.message} for f in plan.findings],
        "assumptions": assumptions_json(plan.assumptions),
    }


CALIBRATED_YAML = """\
sync_wait_per_collective_seconds: 1.0e-4
data_wait_seconds: 0.002
host_overhead_seconds: 0.001
"""

EXAMPLE_CASES = [  # manifest, its layout as the JSON names it
    ("mixtral-8x7b-h100.yaml", {"dp": 32, "tp": 1, "pp": 4, "cp": 1, "ep": 8, "vpp": 1, "etp": 1}),
    ("llama3-8b-h100.yaml", {"dp": 32, "tp": 2, "pp": 1, "cp": 1, "ep": 1, "vpp": 1, "etp": 2}),
]


@pytest.mark.parametrize(("manifest", "layout"), EXAMPLE_CASES, ids=["mixtral", "llama3-8b"])
@pytest.mark.parametrize("calibrated", [False, True], ids=["defaults", "calibrated"])
def test_cli_plan_json_prints_every_key_of_the_plan(manifest, layout, calibrated, tmp_path, capsys):
    argv = ["plan", str(EXAMPLES / manifest), "--json"]
    if calibrated:
        (tmp_path / "a.yaml").write_text(CALIBRATED_YAML)
        argv += ["--assumptions", str(tmp_path / "a.yaml")]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    plan = plan_job(load_spec(EXAMPLES / manifest), assumptions=_calibrated() if calibrated else None)
    assert set(printed) == PLAN_KEYS
    assert all(set(s) == STAGE_KEYS for s in printed["stages"])
    assert all(set(c) == COLLECTIVE_KEYS for c in printed["collectives"])
    assert printed == expected_plan(plan, layout)
    if calibrated:  # the calibrated terms reach the JSON
        step = printed["expected_step_seconds"]
        assert (step["data"], step["other"]) == (0.002, 0.001)
        assert step["sync_wait"]
        assert printed["assumptions"]["sync_wait_per_collective_seconds"] == 1.0e-4
    assert_plain_json(plan.to_dict())


def _calibrated() -> PlanAssumptions:
    return PlanAssumptions(
        sync_wait_per_collective_seconds=1.0e-4, data_wait_seconds=0.002, host_overhead_seconds=0.001
    )


# ---------------------------------------------------------------------------------------------------- search


def candidate(*, headroom: int, seconds: float = 1.25, vpp: int = 3) -> Candidate:
    return Candidate(
        layout=ParallelLayout(dp=2, tp=4, pp=2, cp=1, ep=1, vpp=vpp),
        micro_batch_size=2,
        expected_step_seconds=seconds,
        peak_memory_bytes=70_000_000_000,
        headroom_bytes=headroom,
        bubble_fraction=0.125,
        exposed_comm_seconds=0.0625,
        expected_mfu=0.4,
        findings=3,
    )


def candidate_json(*, headroom: int, seconds: float = 1.25, vpp: int = 3) -> dict[str, object]:
    return {
        "layout": {"dp": 2, "tp": 4, "pp": 2, "cp": 1, "ep": 1, "vpp": vpp},
        "micro_batch_size": 2,
        "expected_step_seconds": seconds,
        "peak_memory_bytes": 70_000_000_000,
        "headroom_bytes": headroom,
        "bubble_fraction": 0.125,
        "exposed_comm_seconds": 0.0625,
        "expected_mfu": 0.4,
        "findings": 3,
    }


def test_candidate_json_has_every_field_in_base_units():
    data = candidate(headroom=10_000_000_000).to_dict()
    assert set(data) == CANDIDATE_KEYS
    assert data == candidate_json(headroom=10_000_000_000)
    assert_plain_json(data)


RANKED = tuple(candidate(headroom=h, seconds=s, vpp=v) for h, s, v in [(1, 1.0, 1), (2, 1.5, 2), (3, 2.0, 4)])
RANKED_JSON = [candidate_json(headroom=h, seconds=s, vpp=v) for h, s, v in [(1, 1.0, 1), (2, 1.5, 2), (3, 2.0, 4)]]


@pytest.mark.parametrize(
    ("top", "shown"),
    [(None, RANKED_JSON), (1, RANKED_JSON[:1]), (2, RANKED_JSON[:2]), (0, []), (5, RANKED_JSON)],
    ids=["all", "top-1", "top-2", "top-0", "top-more-than-there-are"],
)
@pytest.mark.parametrize("misfit", [None, candidate(headroom=-5_000_000_000)], ids=["no-misfit", "misfit"])
def test_search_json_counts_every_fitting_layout_and_lists_the_top_ones(top, shown, misfit):
    result = SearchResult(
        evaluated=12,
        candidates=RANKED,
        rejected={"exceeds HBM": 2, "spec.model.attentionHeads": 5},
        closest_misfit=misfit,
    )
    data = result.to_dict(top=top)
    assert data == {
        "evaluated": 12,
        "fitting": 3,  # all three fit, whatever top shows
        "rejected": {"exceeds HBM": 2, "spec.model.attentionHeads": 5},
        "candidates": shown,
        "closest_misfit": None if misfit is None else candidate_json(headroom=-5_000_000_000),
    }
    assert_plain_json(data)

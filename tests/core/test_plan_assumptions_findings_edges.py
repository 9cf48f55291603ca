"""Edges of the planner's assumptions, findings and ``plan_job``: range boundaries on both sides, whole error messages,
the etp-versus-tp crossing rule, ties between stages, and the sync-wait and CPU-contention terms of a plan.

Every expected value is worked out by hand from the formula or the documented rule (the arithmetic is in the
comments), or is a property the plan must keep (a sum, a maximum, a monotonic change).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from builders import SMALL_MOE
from meshscope.errors import PlanError
from meshscope.jobs.models import ModelConfig, MoEConfig
from meshscope.jobs.spec import CpCommType, JobSpec, ParallelismConfig, PipelineSchedule, TrainingConfig
from meshscope.plan import (
    CollectiveOp,
    CollectivePlan,
    MemoryBreakdown,
    NcclProtocolCosts,
    Plan,
    PlanAssumptions,
    Severity,
    assumptions_from_mapping,
    plan_job,
)
from meshscope.plan.assumptions import RING_LL, RING_SIMPLE, TREE_SIMPLE, _nccl
from meshscope.plan.findings import StageSummary, _gb_per_s, _seconds, collect_findings
from meshscope.topology import GiB, Link
from meshscope.topology.hardware import HardwareConfig, default_hardware
from meshscope.topology.layout import ParallelLayout, parse_order
from meshscope.topology.placement import GroupSpan, Placement

# ---------------------------------------------------------------------------------------------------- shared

DENSE = ModelConfig(
    name="dense",
    layers=6,
    hidden_size=1024,
    attention_heads=8,
    ffn_hidden_size=4096,
    vocab_size=1000,
    seq_length=512,
)
MOE = SMALL_MOE


def job(
    model: ModelConfig,
    layout: ParallelLayout,
    *,
    sp: bool = True,
    cp_comm_type: CpCommType = CpCommType.P2P,
    split_ends: bool = False,
    **training: object,
) -> JobSpec:
    """A job on H100 nodes of 8 GPUs (one node of ``world`` GPUs below 8)."""
    world = layout.world_size
    hardware = default_hardware("H100", max(world // 8, 1))
    if world < 8:
        hardware = replace(hardware, nodes=1, gpus_per_node=world, nvlink_domain_gpus=world)
    settings: dict[str, object] = {"micro_batch_size": 1, "global_batch_size": 8 * layout.dp, **training}
    return JobSpec(
        name="edges",
        model=model,
        parallelism=ParallelismConfig(
            layout=layout,
            sequence_parallel=sp,
            cp_comm_type=cp_comm_type,
            account_for_embedding_in_pipeline_split=split_ends,
            account_for_loss_in_pipeline_split=split_ends,
        ),
        training=TrainingConfig(**settings),  # type: ignore[arg-type]
        hardware=hardware,
    )


def messages(plan: Plan, code: str) -> list[str]:
    return [f.message for f in plan.findings if f.code == code]


# ---------------------------------------------------------------------------------------------------- NCCL costs


def test_nccl_costs_helper_turns_microseconds_into_seconds_field_by_field():
    """Distinct numbers per field: a swapped or unconverted field shows."""
    costs = _nccl(1.0, 2.0, 3.0, 0.5)
    assert costs.base_latency_s == pytest.approx(1.0e-6, rel=1e-12)
    assert costs.nvlink_hop_latency_s == pytest.approx(2.0e-6, rel=1e-12)
    assert costs.network_hop_latency_s == pytest.approx(3.0e-6, rel=1e-12)
    assert costs.bandwidth_fraction == 0.5


def test_nccl_defaults_are_the_tuning_cc_numbers():
    # NCCL tuning.cc @ b6475625: Ring LL base 6.6 µs, hops .6 / 2.7 µs, 1/4 of the bus bandwidth; Ring Simple 8.4,
    # 3.4 / 14.0, full; Tree Simple base 0, hops 28 / 28, 0.92.
    assert (RING_LL.base_latency_s, RING_LL.nvlink_hop_latency_s, RING_LL.network_hop_latency_s) == pytest.approx(
        (6.6e-6, 0.6e-6, 2.7e-6), rel=1e-12
    )
    assert RING_LL.bandwidth_fraction == 0.25
    assert (RING_SIMPLE.base_latency_s, RING_SIMPLE.network_hop_latency_s) == pytest.approx((8.4e-6, 14.0e-6))
    assert RING_SIMPLE.bandwidth_fraction == 1.0
    assert (TREE_SIMPLE.base_latency_s, TREE_SIMPLE.nvlink_hop_latency_s) == (0.0, pytest.approx(28e-6))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("base_latency_s", -1.0),
        ("nvlink_hop_latency_s", math.inf),
        ("network_hop_latency_s", math.nan),
    ],
    ids=["negative", "infinite", "nan"],
)
def test_nccl_latency_must_be_finite_and_not_negative(field, value):
    good = {"base_latency_s": 0.0, "nvlink_hop_latency_s": 0.0, "network_hop_latency_s": 0.0}
    with pytest.raises(PlanError) as raised:
        NcclProtocolCosts(**{**good, field: value}, bandwidth_fraction=1.0)
    assert str(raised.value) == f"{field} must be a finite number of seconds >= 0, got {value!r}"


def test_nccl_latency_of_zero_and_fraction_of_one_are_accepted():
    costs = NcclProtocolCosts(
        base_latency_s=0.0, nvlink_hop_latency_s=0.0, network_hop_latency_s=0.0, bandwidth_fraction=1.0
    )
    assert costs.bandwidth_fraction == 1.0


@pytest.mark.parametrize("fraction", [0.0, 1.5, -0.5], ids=["zero", "above-one", "negative"])
def test_nccl_bandwidth_fraction_lies_in_zero_open_one_closed(fraction):
    with pytest.raises(PlanError) as raised:
        NcclProtocolCosts(
            base_latency_s=0.0, nvlink_hop_latency_s=0.0, network_hop_latency_s=0.0, bandwidth_fraction=fraction
        )
    assert str(raised.value) == f"bandwidth_fraction must lie in (0, 1], got {fraction!r}"


# ---------------------------------------------------------------------------------------------------- PlanAssumptions


@pytest.mark.parametrize(
    ("field", "value", "fits"),
    [
        ("hbm_efficiency", 0.0, "a number in (0, 1]"),
        ("cpu_time_scale", 0.0, "a number >= 0"),
        ("cpu_cores", 0.0, "a number >= 0"),
    ],
    ids=["efficiency", "cpu-time-scale", "cpu-cores"],
)
def test_fields_open_at_their_low_end_reject_the_low_end(field, value, fits):
    """(0, 1] and (0, inf) exclude 0 itself; the message prints ``>= 0`` for the unbounded ones (``_fits``)."""
    with pytest.raises(PlanError) as raised:
        PlanAssumptions(**{field: value})
    assert str(raised.value) == f"assumption {field} must be {fits}, got 0.0"


def test_closed_low_end_accepts_the_low_end():
    a = PlanAssumptions(tp_comm_overlap=0.0, cpu_contention_at_fit=1.0, hbm_efficiency=1.0)
    assert (a.tp_comm_overlap, a.cpu_contention_at_fit, a.hbm_efficiency) == (0.0, 1.0, 1.0)


def test_a_boolean_assumption_must_be_a_bool():
    with pytest.raises(PlanError) as raised:
        PlanAssumptions(causal_attention=1)  # type: ignore[arg-type]
    assert str(raised.value) == "assumption causal_attention must be true or false, got 1"


def test_nccl_fields_must_be_protocol_costs():
    with pytest.raises(PlanError) as raised:
        PlanAssumptions(tree_ll={"base_latency_s": 0.0})  # type: ignore[arg-type]
    assert str(raised.value) == "assumption tree_ll must be NCCL protocol costs, got {'base_latency_s': 0.0}"


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("nccl_algorithms", (), "ring, tree"),
        ("nccl_algorithms", ("ring", "nvls"), "ring, tree"),
        ("nccl_algorithms", ("ring", "ring"), "ring, tree"),
        ("nccl_protocols", ("ll", 128), "ll, ll128, simple"),
        ("nccl_protocols", ("simple", "simple"), "ll, ll128, simple"),
        ("nccl_protocols", ("LL",), "ll, ll128, simple"),
    ],
    ids=["empty", "unknown-name", "repeated", "not-a-string", "repeated-protocol", "wrong-case"],
)
def test_nccl_choices_are_non_empty_distinct_known_names(field, value, allowed):
    with pytest.raises(PlanError) as raised:
        PlanAssumptions(**{field: value})
    expected = f"assumption {field} must be a non-empty list of distinct names from {allowed}, got {value!r}"
    assert str(raised.value) == expected


def test_nccl_choices_accept_a_subset_and_price_only_that_subset():
    a = PlanAssumptions(nccl_algorithms=("ring",), nccl_protocols=("simple",))
    # ring x simple only: neither (ring, ll) nor (tree, simple) is allowed.
    assert a.nccl_options() == {("ring", "simple"): a.ring_simple}
    both = PlanAssumptions(nccl_algorithms=("tree",), nccl_protocols=("ll", "ll128"))
    assert set(both.nccl_options()) == {("tree", "ll"), ("tree", "ll128")}


@pytest.mark.parametrize(
    "tiles",
    [(), ((0, 128),), ((128, 4097),), ((128.0, 128),), ((True, 128),), ((128, 128, 1),), [(128, 128)]],
    ids=["empty", "zero", "above-4096", "float", "bool", "three-numbers", "a-list"],
)
def test_gemm_tiles_must_be_whole_pairs_in_1_to_4096(tiles):
    with pytest.raises(PlanError, match=r"^assumption gemm_tiles"):
        PlanAssumptions(gemm_tiles=tiles)


def test_gemm_tiles_errors_name_what_fits():
    with pytest.raises(PlanError) as raised:
        PlanAssumptions(gemm_tiles=())
    assert str(raised.value) == "assumption gemm_tiles must be a non-empty list of [rows, columns] pairs, got ()"
    with pytest.raises(PlanError) as raised:
        PlanAssumptions(gemm_tiles=((0, 128),))
    assert str(raised.value) == (
        "assumption gemm_tiles: each tile must be [rows, columns] of whole numbers in 1..4096, got (0, 128)"
    )


def test_gemm_tiles_accept_both_ends_of_1_to_4096():
    assert PlanAssumptions(gemm_tiles=((1, 4096), (4096, 1))).gemm_tiles == ((1, 4096), (4096, 1))


def test_different_assumptions_hash_differently_and_equal_ones_alike():
    """The planner's caches key on the assumptions: a constant hash would put every one in the same bucket."""
    variants = [PlanAssumptions(hbm_efficiency=x / 10) for x in range(1, 11)]
    assert len({hash(a) for a in variants}) == len(variants)
    assert hash(PlanAssumptions(hbm_efficiency=0.5)) == hash(PlanAssumptions(hbm_efficiency=0.5))


def test_sync_wait_of_an_axis_is_its_own_value_else_the_all_axes_one():
    a = PlanAssumptions(sync_wait_per_collective_seconds=1e-3, tp_sync_wait_per_collective_seconds=2e-3)
    assert a.sync_wait_per_collective("tp") == 2e-3
    assert a.sync_wait_per_collective("dp") == 1e-3
    assert a.sync_wait_per_collective("pp") == 1e-3  # pp has no field of its own
    zero = PlanAssumptions(sync_wait_per_collective_seconds=1e-3, ep_sync_wait_per_collective_seconds=0)
    assert zero.sync_wait_per_collective("ep") == 0.0  # an own 0 is a value, not "unset"
    assert isinstance(zero.sync_wait_per_collective("ep"), float)


# ---------------------------------------------------------------------------------------------------- from a mapping


def test_mapping_default_origin_is_assumptions():
    with pytest.raises(PlanError) as raised:
        assumptions_from_mapping({"hbm_efficiency": 2})
    assert str(raised.value) == "assumptions.hbm_efficiency: expected a number in (0, 1], got 2"


def test_mapping_overrides_the_given_base():
    base = PlanAssumptions(hbm_efficiency=0.5, tp_comm_overlap=0.3)
    a = assumptions_from_mapping({"tp_comm_overlap": 0.1}, base=base)
    assert (a.hbm_efficiency, a.tp_comm_overlap) == (0.5, 0.1)
    assert assumptions_from_mapping({}, base=base) == base


def test_unknown_key_with_no_close_match_lists_the_known_names():
    with pytest.raises(PlanError) as raised:
        assumptions_from_mapping({"zzzz": 1}, origin="f")
    message = str(raised.value)
    # The fields of PlanAssumptions in declaration order: compute_efficiency, gemm_efficiency, gemm_tiles, ...
    assert message.startswith("f: unknown assumption 'zzzz'; known: compute_efficiency, gemm_efficiency, gemm_tiles, ")
    assert message.endswith(
        ", cpu_cores, cpu_compute, cpu_contention_at_fit, cpu_stage_contention_at_fit, cpu_time_scale, "
        "cpu_stage_time_scale, cpu_dp_comm_time_scale, cpu_compute_time_scale"
    )


def test_unknown_key_with_a_close_match_names_the_origin_and_the_match():
    with pytest.raises(PlanError) as raised:
        assumptions_from_mapping({"hbmEfficency": 0.5}, origin="f.yaml")
    assert str(raised.value) == "f.yaml: unknown assumption 'hbmEfficency'; did you mean hbm_efficiency?"


def test_a_key_that_is_not_a_string_is_an_unknown_assumption():
    with pytest.raises(PlanError, match=r"^f: unknown assumption 5; known: compute_efficiency, "):
        assumptions_from_mapping({5: 1}, origin="f")  # type: ignore[dict-item]


def test_unknown_nccl_key_lists_the_four_cost_fields():
    with pytest.raises(PlanError) as raised:
        assumptions_from_mapping({"ring_ll": {"zzzz": 1}}, origin="f")
    assert str(raised.value) == (
        "f.ring_ll: unknown assumption 'zzzz'; "
        "known: base_latency_s, nvlink_hop_latency_s, network_hop_latency_s, bandwidth_fraction"
    )


def test_nccl_costs_not_a_mapping_shows_the_value():
    with pytest.raises(PlanError) as raised:
        assumptions_from_mapping({"ring_ll": 3}, origin="f")
    assert str(raised.value) == (
        "f.ring_ll: expected a mapping of base_latency_s, nvlink_hop_latency_s, network_hop_latency_s, "
        "bandwidth_fraction, got 3"
    )


@pytest.mark.parametrize(("value", "accepted"), [(1.0, True), (0.0, True), (1.5, False), (-1e-9, False)])
def test_nccl_latency_from_a_mapping_lies_in_zero_to_one_second(value, accepted):
    data = {"ringSimple": {"nvlinkHopLatencyS": value}}
    if accepted:
        assert assumptions_from_mapping(data).ring_simple.nvlink_hop_latency_s == value
        return
    with pytest.raises(PlanError) as raised:
        assumptions_from_mapping(data, origin="f")
    assert str(raised.value) == f"f.ring_simple.nvlink_hop_latency_s: expected a number in [0, 1], got {value!r}"


def test_gemm_tiles_from_a_mapping_errors():
    with pytest.raises(PlanError) as raised:
        assumptions_from_mapping({"gemm_tiles": 128}, origin="f")
    assert str(raised.value) == "f.gemm_tiles: expected a list of [rows, columns] pairs, got 128"
    with pytest.raises(PlanError) as raised:
        assumptions_from_mapping({"gemm_tiles": [128]}, origin="f")
    assert str(raised.value) == (
        "f: assumption gemm_tiles: each tile must be [rows, columns] of whole numbers in 1..4096, got 128"
    )


def test_nccl_choices_from_a_mapping_errors():
    with pytest.raises(PlanError) as raised:
        assumptions_from_mapping({"nccl_protocols": "simple"}, origin="f")
    assert str(raised.value) == "f.nccl_protocols: expected a list of names from ll, ll128, simple, got 'simple'"
    with pytest.raises(PlanError) as raised:
        assumptions_from_mapping({"ncclAlgorithms": ["ring", "ring"]}, origin="f")
    assert str(raised.value) == (
        "f: assumption nccl_algorithms must be a non-empty list of distinct names from ring, tree, got ('ring', 'ring')"
    )
    assert assumptions_from_mapping({"nccl_algorithms": ["tree"]}).nccl_algorithms == ("tree",)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        # repr of 58 x's is 60 characters: shown whole.
        ("x" * 58, "'" + "x" * 58 + "'"),
        # repr of 59 x's is 61 characters: its first 57 (the quote and 56 x's) and "...".
        ("x" * 59, "'" + "x" * 56 + "..."),
    ],
    ids=["60-chars-whole", "61-chars-cut"],
)
def test_long_values_are_cut_to_60_characters_in_messages(text, shown):
    with pytest.raises(PlanError) as raised:
        assumptions_from_mapping({"hbm_efficiency": text}, origin="f")
    assert str(raised.value) == f"f.hbm_efficiency: expected a number in (0, 1], got {shown}"
    assert len(shown) == 60


# ---------------------------------------------------------------------------------------------------- formatting


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (1.0, "1.00 s"),
        (1.5, "1.50 s"),
        (0.999, "999.0 ms"),
        (0.5, "500.0 ms"),
        (1e-3, "1.0 ms"),
        (9.99e-4, "999 µs"),
        # 999.4997 µs rounds down; 0.05 µs more (or a scale slightly off) would round it up to 1,000.
        (0.0009994997, "999 µs"),
        (5e-4, "500 µs"),
    ],
)
def test_seconds_pick_s_ms_or_us_at_1_and_1e_minus_3(seconds, text):
    assert _seconds(seconds) == text


@pytest.mark.parametrize(
    ("bytes_per_s", "text"),
    [(450e9, "450 GB/s"), (50e9, "50 GB/s"), (2_500_000_001, "3 GB/s"), (2_499_999_999, "2 GB/s")],
)
def test_gb_per_s_is_bytes_per_s_over_1e9(bytes_per_s, text):
    # 2,500,000,001 B/s = 2.500000001 GB/s: just above the half, so it rounds up.
    assert _gb_per_s(bytes_per_s) == text


# ---------------------------------------------------------------------------------------------------- findings, synthetic

H100 = default_hardware("H100", 2)  # 2 nodes of 8, NVLink 450 GB/s, NIC 50 GB/s, 80 GiB HBM, nothing reserved


def memory(total_gib: float) -> MemoryBreakdown:
    return MemoryBreakdown(
        weights_bytes=int(total_gib * GiB), gradients_bytes=0, optimizer_bytes=0, activations_bytes=0
    )


def collective(
    *,
    axis: str,
    group: str | None = None,
    link: Link = Link.NETWORK,
    seconds: float = 0.01,
    exposed: float = 0.005,
    gib: float = 1.0,
    pp_rank: int = 0,
    hideable: bool = False,
    in_axis_ratio: bool = True,
    op: CollectiveOp = CollectiveOp.ALL_REDUCE,
    purpose: str = "gradients",
    budget: float = 19_780.0,
    bandwidth: float = 50e9,
) -> CollectivePlan:
    """One collective per step (count 1): ``seconds`` per instance, ``gib`` GiB moved per GPU."""
    return CollectivePlan(
        axis=axis,
        group=group or axis,
        op=op,
        purpose=purpose,
        pp_rank=pp_rank,
        group_size=2,
        groups=4,
        groups_crossing_domains=1 if link is Link.NETWORK else 0,
        link=link,
        message_bytes=int(gib * GiB),
        count_per_step=1,
        bus_factor=1.0,
        bytes_per_gpu_per_step=gib * GiB,
        bandwidth_bytes_per_s=bandwidth,
        seconds_per_instance=seconds,
        hiding_flops_per_step=1e12,
        flops_per_byte=2 * budget if hideable else 1_000.0,
        link_budget_flops_per_byte=budget,
        overlap_fraction=0.0,
        overlap_window_seconds=0.0,
        exposed_seconds_per_step=exposed,
        in_axis_ratio=in_axis_ratio,
    )


def span(axis: str, *, crossing: int, groups: int = 4, size: int = 2, domains: int = 2) -> GroupSpan:
    return GroupSpan(
        axis=axis,
        group_size=size,
        groups=groups,
        groups_crossing_nodes=crossing,
        groups_crossing_domains=crossing,
        groups_crossing_blocks=0,
        max_nodes_per_group=domains if crossing else 1,
        max_domains_per_group=domains if crossing else 1,
        example_crossing_group=(),
    )


def stage(pp_rank: int, *collectives: CollectivePlan, gib: float = 10.0) -> StageSummary:
    return StageSummary(pp_rank=pp_rank, memory=memory(gib), collectives=collectives)


def findings(
    layout: ParallelLayout,
    *,
    stages: list[StageSummary],
    spans: dict[str, GroupSpan] | None = None,
    hardware: HardwareConfig = H100,
    fraction: float = 0.0,
    seconds: float = 0.0,
    micro_batches: int = 8,
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B,
) -> list[tuple[str, Severity, str]]:
    found = collect_findings(
        layout=layout,
        hardware=hardware,
        assumptions=PlanAssumptions(),
        spans=spans or {},
        stages=stages,
        bubble_fraction=fraction,
        bubble_seconds=seconds,
        micro_batches=micro_batches,
        schedule=schedule,
    )
    return [(f.code, f.severity, f.message) for f in found]


def test_memory_exactly_at_the_usable_hbm_fits_and_one_byte_more_does_not():
    usable = H100.usable_hbm_bytes  # 80 GiB, nothing reserved
    at = StageSummary(pp_rank=0, memory=replace(memory(0), weights_bytes=usable), collectives=())
    assert findings(ParallelLayout(dp=16), stages=[at]) == []
    over = StageSummary(pp_rank=0, memory=replace(memory(0), weights_bytes=usable + 1), collectives=())
    assert [code for code, _, _ in findings(ParallelLayout(dp=16), stages=[over])] == ["memory-exceeds-hbm"]


def test_memory_finding_names_the_worst_stage_then_counts_every_stage_over():
    stages = [stage(0, gib=90.0), stage(1, gib=85.0), stage(2, gib=40.0)]
    ((code, severity, message),) = findings(ParallelLayout(pp=3, dp=5), stages=stages, hardware=H100)
    assert (code, severity) == ("memory-exceeds-hbm", Severity.ERROR)
    # 90 GiB of weights against 80 usable: over by 10.0 GiB; stages 0 and 1 of 3 are over.
    assert message == (
        "pipeline stage 0 needs 90.0 GiB per GPU (weights 90.0 GiB, gradients 0.0 GiB, optimizer 0.0 GiB, activations "
        "0.0 GiB) but 80.0 GiB of HBM is usable: over by 10.0 GiB; 2 of 3 stages exceed HBM (0, 1)"
    )


def test_tp_crossing_without_any_tp_traffic_has_no_numbers():
    """A crossing span is reported even when no stage carries its collectives: no traffic part, nothing made up."""
    ((code, severity, message),) = findings(
        ParallelLayout(tp=16), stages=[stage(0)], spans={"tp": span("tp", crossing=1, groups=1, size=16)}
    )
    assert (code, severity) == ("tp-crosses-nvlink-domain", Severity.WARNING)
    assert message == (
        "tp=16 groups span 2 NVLink domains (8 GPUs each): 1 of 1 TP groups cross the network at 50 GB/s instead of "
        "450 GB/s; keep tp <= 8"
    )


def test_tp_crossing_numbers_come_from_the_stage_with_the_most_tp_seconds():
    stages = [
        stage(0, collective(axis="tp", seconds=0.010, exposed=0.004, gib=1.0, hideable=True)),
        stage(1, collective(axis="tp", seconds=0.020, exposed=0.002, gib=0.5, pp_rank=1, hideable=True)),
        stage(2),  # no tp traffic at all: never the worst
    ]
    ((_, _, message),) = findings(
        ParallelLayout(tp=16, pp=3), stages=stages, spans={"tp": span("tp", crossing=3, groups=3, size=16)}
    )
    # Stage 1 takes 20 ms against stage 0's 10 ms: its 0.5 GiB and 2 ms exposed are reported.
    assert message.endswith("; 0.5 GiB per GPU per step, 2.0 ms exposed (pipeline stage 1); keep tp <= 8")


def test_axis_traffic_on_equal_stages_is_reported_for_the_first():
    ep = collective(axis="ep", op=CollectiveOp.ALL_TO_ALL, seconds=0.020, exposed=0.005, gib=1.0)
    stages = [stage(0, ep), stage(1, replace(ep, pp_rank=1))]
    found = findings(ParallelLayout(dp=8, ep=2, pp=2), stages=stages, spans={"ep": span("ep", crossing=1)})
    ((_, severity, message),) = [f for f in found if f[0] == "ep-all-to-all-over-network"]
    assert severity is Severity.WARNING
    assert message == (
        "ep=2 all-to-all crosses the network in 1 of 4 EP groups (up to 2 NVLink domains of 8 GPUs per group): "
        "1.0 GiB per GPU per step at 50 GB/s instead of 450 GB/s; expected 20.0 ms per step, 5.0 ms exposed "
        "(pipeline stage 0)"
    )


def test_axis_traffic_is_reported_for_the_stage_that_has_it_even_when_a_later_one_has_none():
    stages = [stage(0, collective(axis="cp", seconds=0.002, exposed=0.001, gib=0.25)), stage(1)]
    found = findings(ParallelLayout(cp=16, pp=2), stages=stages, spans={"cp": span("cp", crossing=1, groups=2)})
    ((_, severity, message),) = [f for f in found if f[0] == "cp-over-network"]
    assert severity is Severity.WARNING
    assert message.endswith(
        ": 0.2 GiB per GPU per step at 50 GB/s instead of 450 GB/s; expected 2.0 ms per step, 1.0 ms exposed "
        "(pipeline stage 0)"
    )


def test_pp_over_network_is_info_and_ep_is_a_warning():
    pp = collective(axis="pp", op=CollectiveOp.SEND_RECV, seconds=0.001, exposed=0.001, hideable=True)
    found = findings(
        ParallelLayout(dp=4, ep=2, pp=4),
        stages=[stage(0, pp, collective(axis="ep", op=CollectiveOp.ALL_TO_ALL, hideable=True))],
        spans={"pp": span("pp", crossing=4), "ep": span("ep", crossing=1)},
    )
    severities = {code: severity for code, severity, _ in found}
    assert severities == {"ep-all-to-all-over-network": Severity.WARNING, "pp-over-network": Severity.INFO}


def test_collect_findings_reports_no_moe_rule_unless_asked():
    found = collect_findings(
        layout=ParallelLayout(tp=2, dp=4),
        hardware=H100,
        assumptions=PlanAssumptions(),
        spans={},
        stages=[stage(0)],
        bubble_fraction=0.0,
        bubble_seconds=0.0,
        micro_batches=8,
        schedule=PipelineSchedule.ONE_F_ONE_B,
    )
    assert found == ()


def test_interleaved_bubble_message_has_the_vpp_formula_and_no_schedule_advice():
    ((code, _, message),) = findings(
        ParallelLayout(pp=4, vpp=2, dp=4),
        stages=[stage(0)],
        fraction=0.375,  # (4-1)/(4·2)
        seconds=0.25,
        micro_batches=4,
        schedule=PipelineSchedule.INTERLEAVED,
    )
    assert code == "bubble-large"
    assert message == (
        "pipeline bubble is 37.5% of compute, above 10%: (pp-1)/(m·vpp) = 3/(4·2) with pp=4 and 4 micro-batches "
        "(interleaved); expected 250.0 ms idle per step; raise the number of micro-batches (global batch ÷ "
        "(micro-batch · dp))"
    )


def test_one_f_one_b_bubble_message_also_advises_the_interleaved_schedule():
    ((_, _, message),) = findings(
        ParallelLayout(pp=4, dp=4), stages=[stage(0)], fraction=0.75, seconds=1.5, micro_batches=4
    )
    assert message == (
        "pipeline bubble is 75.0% of compute, above 10%: (pp-1)/m = 3/4 with pp=4 and 4 micro-batches (1f1b); "
        "expected 1.50 s idle per step; raise the number of micro-batches (global batch ÷ (micro-batch · dp)) or use "
        "the interleaved schedule (vpp > 1)"
    )


def test_below_budget_full_message_for_a_group_that_is_not_the_axis():
    c = collective(
        axis="dp", group="edp", link=Link.NVLINK, seconds=0.004, exposed=0.001, budget=2_000.0, bandwidth=450e9
    )
    ((code, severity, message),) = findings(ParallelLayout(dp=8), stages=[stage(0, c)])
    assert (code, severity) == ("flops-per-byte-below-budget", Severity.WARNING)
    # peak = 2,000 FLOPs/byte x 450e9 B/s = 900e12 FLOP/s = 900 TFLOP/s.
    assert message == (
        "dp (edp group) all-reduce over nvlink (gradients): 1,000 FLOPs per byte < link budget 2,000 (900 TFLOP/s ÷ "
        "450 GB/s), so it cannot be hidden behind compute; expected 4.0 ms per step on pipeline stage 0, 1.0 ms exposed"
    )


def test_below_budget_keeps_each_link_of_one_axis_and_group_apart():
    near = collective(axis="tp", link=Link.NVLINK, seconds=0.001, exposed=0.001, purpose="near", bandwidth=450e9)
    far = collective(axis="tp", link=Link.NETWORK, seconds=0.010, exposed=0.010, purpose="far")
    found = findings(ParallelLayout(tp=16), stages=[stage(0, near, far)])
    below = [m for code, _, m in found if code == "flops-per-byte-below-budget"]
    assert len(below) == 2
    assert below[0].startswith("tp all-reduce over nvlink (near): ")
    assert below[0].endswith("expected 1.0 ms per step on pipeline stage 0, 1.0 ms exposed")
    assert below[1].startswith("tp all-reduce over network (far): ")
    assert below[1].endswith("expected 10.0 ms per step on pipeline stage 0, 10.0 ms exposed")


def test_below_budget_findings_follow_the_first_collective_below_budget():
    """A hideable collective of the same axis, group and link does not move its finding ahead of others."""
    hidden = collective(axis="tp", hideable=True, purpose="hidden")
    dp = collective(axis="dp", purpose="dp")
    tp = collective(axis="tp", purpose="tp")
    found = findings(ParallelLayout(tp=2, dp=8), stages=[stage(0, hidden, dp, tp)])
    assert [m.split(" (")[0] for _, _, m in found] == ["dp all-reduce over network", "tp all-reduce over network"]


def test_below_budget_tflops_round_from_peak_over_1e12():
    # peak = (2.5e12 + 1) FLOPs/byte x 1 B/s = 2.500000000001 TFLOP/s: just above the half, so "3".
    c = collective(axis="tp", budget=2.5e12 + 1, bandwidth=1.0)
    ((_, _, message),) = findings(ParallelLayout(tp=16), stages=[stage(0, c)])
    assert "(3 TFLOP/s ÷ 0 GB/s)" in message


# ---------------------------------------------------------------------------------------------------- findings, planned


def test_etp_groups_that_cross_are_reported_though_tp_groups_of_the_same_degree_do_not():
    # Order cp-tp: tp groups are {0, 2} and {1, 3} (stride cp = 2), each on one node; expert layers have no cp, so
    # their etp groups are {0, 1} and {2, 3}, and ranks alternate between two nodes: both etp groups cross.
    layout = ParallelLayout(tp=2, cp=2, etp=2, order=parse_order("cp-tp-ep-dp-pp"))
    plan = plan_job(job(MOE, layout, global_batch_size=1), placement=Placement.from_node_names(["a", "b"] * 2))
    (message,) = messages(plan, "tp-crosses-nvlink-domain")
    assert message.startswith(
        "etp=2 groups span 2 NVLink domains (4 GPUs each): 2 of 2 ETP groups cross the network at 50 GB/s instead "
        "of 450 GB/s; "
    )
    assert re.search(
        r"; [\d.]+ GiB per GPU per step, [\d.]+ (µs|ms|s) exposed \(pipeline stage 0\); keep etp <= 4$", message
    )


def test_etp_above_a_domain_is_reported_when_tp_fits_in_it():
    plan = plan_job(job(MOE, ParallelLayout(tp=2, dp=8, etp=16), global_batch_size=8))
    (message,) = messages(plan, "tp-crosses-nvlink-domain")
    assert message.startswith("etp=16 groups span 2 NVLink domains (8 GPUs each): 1 of 1 ETP groups cross the network")
    assert message.endswith("keep etp <= 8")


def test_tp_and_a_different_etp_both_crossing_are_both_reported():
    # Ranks alternate between nodes a and b: every tp pair and every etp quadruple spans both.
    plan = plan_job(
        job(MOE, ParallelLayout(tp=2, dp=4, etp=4), global_batch_size=4),
        placement=Placement.from_node_names(["a", "b"] * 4),
    )
    found = messages(plan, "tp-crosses-nvlink-domain")
    assert [m.split(" groups")[0] for m in found] == ["tp=2", "etp=4"]
    assert "4 of 4 TP groups" in found[0]
    assert "2 of 2 ETP groups" in found[1]


def test_etp_equal_to_tp_crossing_once_is_reported_once():
    # TP group 0 (ranks 0-7) straddles node-a and node-b, group 1 sits on node-c; etp = tp: the same groups.
    nodes = ["node-a"] * 4 + ["node-b"] * 4 + ["node-c"] * 8
    plan = plan_job(
        job(MOE, ParallelLayout(tp=8, dp=2, ep=2), global_batch_size=2),
        placement=Placement.from_node_names(nodes),
    )
    (message,) = messages(plan, "tp-crosses-nvlink-domain")
    assert message.startswith("tp=8 groups span 2 NVLink domains (8 GPUs each): 1 of 2 TP groups cross the network")


def test_moe_rule_needs_tp_above_one():
    plan = plan_job(job(MOE, ParallelLayout(dp=8, ep=8), sp=False, global_batch_size=8))
    assert messages(plan, "moe-tp-without-sp") == []


def test_moe_rule_message_in_full():
    plan = plan_job(job(MOE, ParallelLayout(tp=2, dp=4, ep=4, etp=1), sp=False, global_batch_size=4))
    (message,) = messages(plan, "moe-tp-without-sp")
    assert message == (
        "an MoE model with tp=2 needs parallelism.sequenceParallel: Megatron-core refuses to train MoE with tensor "
        "parallelism without it (MoELayer.forward raises), because every tp rank would route and compute the same "
        "tokens; the plan assumes each tp rank routes its own sequence shard"
    )


# ---------------------------------------------------------------------------------------------------- plan_job


def test_batch_errors_name_the_numbers():
    with pytest.raises(PlanError) as raised:
        plan_job(job(DENSE, ParallelLayout(tp=2), micro_batch_size=0, global_batch_size=8))
    assert str(raised.value) == "micro_batch_size (0) and global_batch_size (8) must be >= 1"
    with pytest.raises(PlanError) as raised:
        plan_job(job(DENSE, ParallelLayout(dp=8), micro_batch_size=1, global_batch_size=12))
    # 12 / (1·8) = 1.5 micro-batches.
    assert str(raised.value) == (
        "global_batch_size 12 is not a multiple of micro_batch_size·dp = 1·8 = 8; micro-batches per step would be 1.5"
    )


def test_placement_of_another_size_names_both_sizes():
    with pytest.raises(PlanError) as raised:
        plan_job(job(DENSE, ParallelLayout(tp=8)), placement=Placement.from_node_names(["a"] * 16))
    assert str(raised.value) == "placement has 16 ranks but layout dp=1 tp=8 pp=1 cp=1 ep=1 vpp=1 has 8"


def test_plan_carries_the_spec_switches():
    dense = plan_job(job(DENSE, ParallelLayout(tp=2, cp=2), cp_comm_type=CpCommType.ALL_GATHER, global_batch_size=1))
    assert dense.sequence_parallel is True
    assert dense.cp_comm_type is CpCommType.ALL_GATHER
    assert dense.active_params == dense.total_params  # a dense model: every parameter is active
    moe = plan_job(job(MOE, ParallelLayout(dp=8, ep=8), sp=False, global_batch_size=8))
    assert moe.sequence_parallel is False
    assert 0 < moe.active_params < moe.total_params  # top 4 of 64 experts


def test_sequence_parallel_shards_element_wise_compute():
    """Under SP each tp rank runs the norms and dropouts on 1/tp of the tokens: strictly less compute per GPU."""
    with_sp = plan_job(job(DENSE, ParallelLayout(tp=8), sp=True, global_batch_size=8))
    without = plan_job(job(DENSE, ParallelLayout(tp=8), sp=False, global_batch_size=8))
    assert with_sp.stages[0].forward_seconds_per_microbatch < without.stages[0].forward_seconds_per_microbatch
    assert with_sp.expected_step_time.compute_seconds < without.expected_step_time.compute_seconds


def test_plan_flops_follow_the_causal_attention_assumption():
    spec = job(DENSE, ParallelLayout(tp=2))
    full = plan_job(spec, assumptions=PlanAssumptions(causal_attention=False))
    causal = plan_job(spec)
    assert full.flops.model_flops == full.flops.model_flops_noncausal
    assert causal.flops.model_flops < causal.flops.model_flops_noncausal


def test_exposed_comm_per_axis_is_the_sum_of_its_collectives_even_on_an_axis_of_degree_one():
    # MoE with tp = 1 and etp = 2: the expert-tp collectives are on axis tp, which the layout does not enable;
    # a dense model with cp = 2 and dp = 1 reduces its gradients on axis dp over the cp group.
    small = replace(MOE, layers=2, seq_length=512, moe=MoEConfig(experts=8, top_k=2, expert_ffn_hidden_size=1024))
    for plan in (
        plan_job(job(small, ParallelLayout(dp=4, etp=2), sp=False, global_batch_size=4)),
        plan_job(job(DENSE, ParallelLayout(cp=2), sp=False, global_batch_size=1)),
    ):
        for s in plan.stages:
            sums: dict[str, float] = {}
            for c in s.collectives:
                sums[c.axis] = sums.get(c.axis, 0.0) + c.exposed_seconds_per_step
            shown = dict(s.step_time.exposed_comm_seconds)
            assert set(shown) == set(sums) | {a.value for a in plan.layout.enabled_axes}
            for axis, value in shown.items():
                assert value == pytest.approx(sums.get(axis, 0.0), rel=1e-12, abs=0.0)


def pipelined(**assumptions: object) -> Plan:
    """pp = 4, tp = 2, 6 layers with the embedding and the loss each counted as a layer: 2 slots per stage."""
    spec = job(DENSE, ParallelLayout(tp=2, pp=4), split_ends=True, global_batch_size=8)
    return plan_job(spec, assumptions=PlanAssumptions(**assumptions))  # type: ignore[arg-type]


def test_sync_wait_counts_every_collective_of_its_axis_but_no_pipeline_send():
    w = 1e-4
    plan = pipelined(sync_wait_per_collective_seconds=w)
    for s in plan.stages:
        counts: dict[str, int] = {}
        for c in s.collectives:
            if c.group != "pp":
                counts[c.axis] = counts.get(c.axis, 0) + c.count_per_step
        assert "pp" in {c.axis for c in s.collectives}  # sends exist, and carry no sync wait
        # The documented term: per axis, sync_wait_per_collective_seconds x its collectives per step.
        assert dict(s.step_time.sync_wait_seconds or {}) == pytest.approx({a: n * w for a, n in counts.items()})


def test_an_axis_own_sync_wait_is_used_for_that_axis():
    plan = pipelined(tp_sync_wait_per_collective_seconds=2e-4)
    s = plan.stages[0]
    tp_count = sum(c.count_per_step for c in s.collectives if c.axis == "tp")
    assert s.step_time.sync_wait_seconds == pytest.approx({"tp": tp_count * 2e-4})


def test_no_sync_wait_leaves_the_category_empty():
    plan = pipelined()
    assert all(s.step_time.sync_wait_seconds is None for s in plan.stages)
    assert plan.expected_step_time.to_dict()["sync_wait"] == {}


def test_in_path_sync_wait_lengthens_the_bubble():
    """The bubble is the fill and drain through the other stages' compute and in-path communication, sync wait
    included: m micro-batches through p stages of t_k each take Σ t_k + (m - 1) max t_k, the slowest stage idles the
    rest (for equal stages the fraction x a stage's path)."""
    fraction = (4 - 1) / 8  # 1F1B, pp = 4, m = 8
    base = pipelined()
    waited = pipelined(tp_sync_wait_per_collective_seconds=1e-4)
    assert base.bubble_fraction == fraction

    def idle(plan: Plan, wait: float) -> float:
        m = 8
        t = [
            (
                s.step_time.compute_seconds
                + sum(c.exposed_seconds_per_step + c.count_per_step * wait for c in s.collectives if c.axis == "tp")
            )
            / m
            for s in plan.stages
        ]
        return sum(t) + (m - 1) * max(t) - m * max(t)

    assert base.expected_step_time.bubble_seconds == pytest.approx(idle(base, 0.0))
    assert waited.expected_step_time.bubble_seconds == pytest.approx(idle(waited, 1e-4))
    assert waited.expected_step_time.bubble_seconds > base.expected_step_time.bubble_seconds


def test_equally_slow_stages_report_the_first():
    # Stages 1 and 2 hold 2 layers each and neither end: the same compute, collectives and total.
    plan = pipelined()
    totals = [s.step_time.total_seconds for s in plan.stages]
    assert totals[1] == totals[2] == max(totals)
    assert plan.expected_step_time.pp_rank == 1


def test_plan_collectives_come_from_the_stage_moving_the_most_bytes_first_on_ties():
    plan = pipelined()
    kinds: dict[tuple[str, str, str, str], list[CollectivePlan]] = {}
    for s in plan.stages:
        for c in s.collectives:
            kinds.setdefault((c.axis, c.group, c.op.value, c.purpose), []).append(c)
    assert len(plan.collectives) == len(kinds)
    for c in plan.collectives:
        same = kinds[(c.axis, c.group, c.op.value, c.purpose)]
        best = max((x.bytes_per_gpu_per_step, x.expected_seconds_per_step) for x in same)
        assert (c.bytes_per_gpu_per_step, c.expected_seconds_per_step) == best
        first = min(x.pp_rank for x in same if (x.bytes_per_gpu_per_step, x.expected_seconds_per_step) == best)
        assert c.pp_rank == first
    # The per-layer tp all-gather: stages 1 and 2 tie with 2 layers each; stage 1 is named.
    layer_gathers = [
        c for c in plan.collectives if c.purpose.startswith("layer activations") and c.op.value == "all-gather"
    ]
    assert [c.pp_rank for c in layer_gathers] == [1]


def test_cpu_contention_scales_the_optimizer_step_by_a_stages_ranks_over_cores():
    # pp = 2, vpp = 2, tp = 2: 4 ranks, interleaved, m = 4: bubble (2-1)/(4·2) = 1/8; busy ranks 4 / (1 + 1/8) = 32/9;
    # on one core the tp collectives inside compute stretch by 32/9, while the optimizer, stepped as the stages
    # drain one after another, competes with its own stage's 2 ranks only: x 2.
    model = replace(DENSE, layers=4)
    spec = job(model, ParallelLayout(tp=2, pp=2, vpp=2), global_batch_size=4)
    free = plan_job(spec)
    shared = plan_job(spec, assumptions=PlanAssumptions(cpu_cores=1.0))
    assert free.bubble_fraction == 1 / 8
    for a, b in zip(free.stages, shared.stages, strict=True):
        assert b.step_time.optimizer_seconds == pytest.approx(a.step_time.optimizer_seconds * 2, rel=1e-12)
        tp = [(x, y) for x, y in zip(a.collectives, b.collectives, strict=True) if x.axis == "tp"]
        assert tp
        for x, y in tp:
            assert y.seconds_per_instance == pytest.approx(x.seconds_per_instance * 32 / 9, rel=1e-12)

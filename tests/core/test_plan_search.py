"""The layout search (``meshscope plan --search``): what it enumerates, what it rejects and why, how it ranks.

Expectations come from the conventions the module documents (tp within an NVLink domain, cp and the candidate
degrees, pp at most the layers, ep carved out of dp*cp, vpp only with a pipeline, the embedding and the loss counted
as layers where that evens the split), listed by hand for small cases and by brute force over every degree for larger
ones; and from its promise that each candidate is planned exactly as ``meshscope plan`` plans a manifest, checked by
building each job by hand and planning it directly.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from meshscope.errors import PlanError, SpecError
from meshscope.jobs import (
    JobSpec,
    ParallelismConfig,
    PipelineSchedule,
    Precision,
    Recompute,
    TrainingConfig,
    check_job,
)
from meshscope.jobs.models import ModelConfig, MoEConfig
from meshscope.plan import PlanAssumptions, plan_job
from meshscope.plan.search import (
    Candidate,
    SearchRequest,
    SearchResult,
    _divisors,
    _powers_of_two,
    enumerate_layouts,
    search_layouts,
)
from meshscope.topology import HardwareConfig, ParallelLayout, default_hardware


def hardware(nodes: int, gpus_per_node: int, *, domain: int | None = None, reserved: int = 0) -> HardwareConfig:
    return replace(
        default_hardware("H100", nodes),
        gpus_per_node=gpus_per_node,
        nvlink_domain_gpus=gpus_per_node if domain is None else domain,
        reserved_bytes=reserved,
    )


def model(
    *, layers: int = 4, heads: int = 4, hidden: int = 256, seq: int = 256, experts: int | None = None
) -> ModelConfig:
    moe = None if experts is None else MoEConfig(experts=experts, top_k=1, expert_ffn_hidden_size=256)
    return ModelConfig(
        name="tiny",
        layers=layers,
        hidden_size=hidden,
        attention_heads=heads,
        ffn_hidden_size=512,
        vocab_size=1000,
        seq_length=seq,
        moe=moe,
    )


# ---------------------------------------------------------------------------------------------- small helpers


@pytest.mark.parametrize("n", [*range(1, 50), 64, 96, 97, 100, 121, 128, 360, 1024], ids=str)
def test_divisors_are_every_divisor_ascending(n: int) -> None:
    assert _divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize(
    ("limit", "expected"),
    [
        (1, [1]),
        (2, [1, 2]),
        (3, [1, 2]),
        (4, [1, 2, 4]),
        (7, [1, 2, 4]),
        (8, [1, 2, 4, 8]),
        (15, [1, 2, 4, 8]),
        (16, [1, 2, 4, 8, 16]),
        (17, [1, 2, 4, 8, 16]),
    ],
    ids=lambda v: str(v) if isinstance(v, int) else None,
)
def test_powers_of_two_up_to_and_including_the_limit(limit: int, expected: list[int]) -> None:
    assert _powers_of_two(limit) == expected


# ---------------------------------------------------------------------------------------------- enumeration


def test_enumeration_of_a_small_moe_job_listed_by_hand() -> None:
    # 4 GPUs, NVLink domains of 2: tp in {1, 2}; cp in {1, 2} (max_cp 2); pp at most the 2 layers; ep divides the 2
    # experts and dp*cp; vpp 1..2 only with pp 2. With 2 layers, pp*vpp = 4 splits unevenly but 2 + 2 = 4 evenly:
    # the embedding and the loss are counted as layers there.
    request = SearchRequest(
        model=model(layers=2, experts=2),
        hardware=hardware(1, 4, domain=2),
        global_batch_size=8,
        micro_batch_sizes=(1,),
        max_vpp=2,
        max_cp=2,
    )
    # (tp, cp, pp, dp, ep, vpp, split_extra)
    expected = [
        (1, 1, 1, 4, 1, 1, False),
        (1, 1, 1, 4, 2, 1, False),
        (1, 1, 2, 2, 1, 1, False),
        (1, 1, 2, 2, 1, 2, True),
        (1, 1, 2, 2, 2, 1, False),
        (1, 1, 2, 2, 2, 2, True),
        (1, 2, 1, 2, 1, 1, False),
        (1, 2, 1, 2, 2, 1, False),
        (1, 2, 2, 1, 1, 1, False),
        (1, 2, 2, 1, 1, 2, True),
        (1, 2, 2, 1, 2, 1, False),
        (1, 2, 2, 1, 2, 2, True),
        (2, 1, 1, 2, 1, 1, False),
        (2, 1, 1, 2, 2, 1, False),
        (2, 1, 2, 1, 1, 1, False),  # ep 2 does not divide dp*cp = 1
        (2, 1, 2, 1, 1, 2, True),
        (2, 2, 1, 1, 1, 1, False),
        (2, 2, 1, 1, 2, 1, False),
    ]
    got = [(lay.tp, lay.cp, lay.pp, lay.dp, lay.ep, lay.vpp, extra) for lay, _, extra in enumerate_layouts(request)]
    assert got == expected


def test_enumeration_of_a_dense_job_keeps_ep_at_one_and_tries_every_micro_batch_in_order() -> None:
    # 2 GPUs in one domain, 3 layers: pp 2 splits 3 unevenly and 3 + 2 = 5 unevenly too; vpp up to 1.
    request = SearchRequest(
        model=model(layers=3), hardware=hardware(1, 2), global_batch_size=8, micro_batch_sizes=(4, 1), max_vpp=1
    )
    got = [(lay.tp, lay.cp, lay.pp, lay.dp, lay.ep, lay.vpp, b, extra) for lay, b, extra in enumerate_layouts(request)]
    assert got == [
        (1, 1, 1, 2, 1, 1, 4, False),
        (1, 1, 1, 2, 1, 1, 1, False),
        (1, 1, 2, 1, 1, 1, 4, False),
        (1, 1, 2, 1, 1, 1, 1, False),
        (1, 2, 1, 1, 1, 1, 4, False),
        (1, 2, 1, 1, 1, 1, 1, False),
        (2, 1, 1, 1, 1, 1, 4, False),
        (2, 1, 1, 1, 1, 1, 1, False),
    ]


def brute_force(request: SearchRequest) -> list[tuple[tuple[int, ...], int, bool]]:
    """Every degree from 1 to the world size, kept by the documented rules, in (tp, cp, pp, ep, vpp, b) order."""
    gpus = request.hardware.world_size
    layers = request.model.layers
    experts = request.model.moe.experts if request.model.moe is not None else 1
    powers = {2**i for i in range(12)}
    rows = []
    for tp, cp, pp, ep in itertools.product(range(1, gpus + 1), range(1, gpus + 1), range(1, gpus + 1), range(1, 65)):
        if gpus % (tp * cp * pp) or tp > request.hardware.nvlink_domain_gpus:
            continue
        if cp not in powers or cp > request.max_cp or pp > layers or experts % ep:
            continue
        dp = gpus // (tp * cp * pp)
        if (dp * cp) % ep:  # experts are carved out of dp*cp
            continue
        for vpp in range(1, (request.max_vpp if pp > 1 else 1) + 1):
            chunks = pp * vpp
            extra = pp > 1 and layers % chunks != 0 and (layers + 2) % chunks == 0
            rows.extend(((dp, tp, pp, cp, ep, vpp), b, extra) for b in request.micro_batch_sizes)
    return rows


@pytest.mark.parametrize(
    ("layers", "experts", "max_vpp", "max_cp"),
    [
        (7, None, 3, 16),
        (7, 6, 3, 16),
        (4, 6, 2, 2),
        (2, 12, 4, 4),
        (12, 4, 2, 16),
        (3, None, 8, 8),
    ],
    ids=["dense-7", "moe6-7", "moe6-4-cp2", "moe12-2", "moe4-12", "dense-3-vpp8"],
)
def test_enumeration_on_twelve_gpus_matches_brute_force(
    layers: int, experts: int | None, max_vpp: int, max_cp: int
) -> None:
    # 12 GPUs (3 nodes of 4): not a power of two, so some cp leave no whole number of data-parallel replicas; pp 3
    # and 6 exist; with 6 experts, ep 2 and 3 divide dp*cp where 6 may not.
    request = SearchRequest(
        model=model(layers=layers, experts=experts),
        hardware=hardware(3, 4),
        global_batch_size=12,
        micro_batch_sizes=(2, 1),
        max_vpp=max_vpp,
        max_cp=max_cp,
    )
    got = [
        ((lay.dp, lay.tp, lay.pp, lay.cp, lay.ep, lay.vpp), b, extra) for lay, b, extra in enumerate_layouts(request)
    ]
    assert got == brute_force(request)
    assert all(lay.world_size == 12 for lay, _, _ in enumerate_layouts(request))


def test_split_extra_counts_embedding_and_loss_only_where_that_evens_the_split() -> None:
    # 7 layers on 12 GPUs: pp*vpp = 3 (7 = 2*3 + 1) and 9 (pp 3, vpp 3) split 7 + 2 = 9 evenly; 6 and 12 do not;
    # pp 2 (7 + 2 = 9 is odd) never does; pp 1 never needs it.
    request = SearchRequest(
        model=model(layers=7), hardware=hardware(3, 4), global_batch_size=12, micro_batch_sizes=(1,), max_vpp=4
    )
    extra = {(lay.pp, lay.vpp) for lay, _, split in enumerate_layouts(request) if split}
    assert extra == {(3, 1), (3, 3)}


# ---------------------------------------------------------------------------------------------- search


def tiny_request(**changes: object) -> SearchRequest:
    base = SearchRequest(
        model=model(layers=4), hardware=hardware(1, 4), global_batch_size=12, micro_batch_sizes=(1, 2), max_vpp=2
    )
    return replace(base, **changes)


def test_search_counts_what_it_planned_and_why_it_dropped_the_rest() -> None:
    # 4 GPUs, 4 layers, batch 12, micro-batches 1 and 2, vpp up to 2. Layouts (tp, cp, pp, dp): tp 1: (1,1,4),
    # (1,2,2), (1,4,1), cp 2: (2,1,2), (2,2,1), cp 4: (4,1,1); tp 2: (1,1,2), (1,2,1), cp 2: (2,1,1); tp 4: (1,1,1).
    # The four with pp > 1 also run vpp 2: 14 layouts x 2 micro-batches = 28 jobs. Rejected:
    # * pp 4, vpp 2: 8 chunks for 4 layers (4 + 2 = 6 is no better), both micro-batches: 2 (spec.model.layers);
    # * dp 4, micro-batch 2: 12 is not a multiple of 2*4; pp 2, vpp 2, dp 2, micro-batch 2: m = 3 is not a multiple
    #   of pp, which the interleaved schedule needs (1F1B would take m = 3 >= 2): 2 (globalBatchSize).
    # The 24 others are planned, and a tiny model fits an H100 every time.
    result = search_layouts(tiny_request())
    assert result.evaluated == 24
    assert len(result.candidates) == 24
    assert result.rejected == {"spec.model.layers": 2, "spec.training.globalBatchSize": 2}
    assert result.closest_misfit is None
    keys = [(c.expected_step_seconds, c.peak_memory_bytes) for c in result.candidates]
    assert keys == sorted(keys)


def test_search_counts_planner_rejections_apart_from_the_spec_checks() -> None:
    # A micro-batch of -1 passes the spec's batch check (12 % -dp == 0, m = -12/dp) where no pipeline rule applies,
    # but the planner refuses it. Of the 14 layouts of tiny_request: the 6 with pp 1 reach the planner; with pp > 1
    # and vpp 1, 1F1B needs m >= pp: 4 globalBatchSize; with vpp 2, interleaving needs m to be a multiple of pp,
    # which -6 and -12 are: 3 more reach the planner, and pp 4 with vpp 2 fails on its layers first. Micro-batch 1
    # is planned on 13 layouts (pp 4 vpp 2 fails on its layers again).
    result = search_layouts(tiny_request(micro_batch_sizes=(1, -1)))
    assert result.rejected == {"planner": 9, "spec.training.globalBatchSize": 4, "spec.model.layers": 2}
    assert result.evaluated == 13
    assert {c.micro_batch_size for c in result.candidates} == {1}
    with pytest.raises(PlanError) as exc:
        search_layouts(tiny_request(micro_batch_sizes=(-1,)))
    assert str(exc.value) == (
        "no valid layout of tiny on 4 GPUs; rejected by planner (9), spec.training.globalBatchSize (4), "
        "spec.model.layers (1)"
    )


def test_search_with_nothing_valid_names_the_three_most_common_reasons() -> None:
    # 2 GPUs: (tp, cp, pp, dp) = (1,1,1,2) batch 1 is not a multiple of dp 2; (1,1,2,1) 3 layers do not split in 2
    # (nor 3 + 2 = 5); (1,2,1,1) sequence 3 is not a multiple of 2*cp; (2,1,1,1) 3 heads do not split over tp 2.
    # One each: most_common keeps the first three in the order met.
    request = SearchRequest(
        model=model(layers=3, heads=3, hidden=255, seq=3),
        hardware=hardware(1, 2),
        global_batch_size=1,
        micro_batch_sizes=(1,),
        max_vpp=1,
    )
    with pytest.raises(PlanError) as exc:
        search_layouts(request)
    assert str(exc.value) == (
        "no valid layout of tiny on 2 GPUs; rejected by spec.training.globalBatchSize (1), spec.model.layers (1), "
        "spec.parallelism.cp (1)"
    )


def test_search_uses_the_requested_sequence_length() -> None:
    # With sequences of 6 tokens, cp 2 and 4 (6 is not a multiple of 4 or 8) fail on every layout that has them:
    # (tp, cp, pp) = (1,2,1), (1,2,2) x 2 vpp, (1,4,1), (2,2,1): 5 layouts x 2 micro-batches. The model's own 256
    # would let them through.
    result = search_layouts(tiny_request(seq_length=6))
    assert result.rejected["spec.parallelism.cp"] == 10
    assert all(c.layout.cp == 1 for c in result.candidates)
    assert result.rejected == {"spec.parallelism.cp": 10, "spec.model.layers": 2, "spec.training.globalBatchSize": 2}
    assert result.evaluated == 24 - 10


def planned_by_hand(
    request: SearchRequest, assumptions: PlanAssumptions | None
) -> tuple[list[Candidate], list[Candidate], dict[str, int]]:
    """Each job of the brute-force enumeration built as a manifest would be and planned directly."""
    job_model = request.model if request.seq_length is None else replace(request.model, seq_length=request.seq_length)
    fitting, misfits, rejected = [], [], {}
    for (dp, tp, pp, cp, ep, vpp), b, extra in brute_force(request):
        layout = ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp)
        shard = request.dp_shard if request.dp_shard is not None and request.dp_shard < dp else None
        if shard is not None and dp % shard:  # hybrid sharding needs whole shard groups
            rejected["dp_shard"] = rejected.get("dp_shard", 0) + 1
            continue
        spec = JobSpec(
            name="by-hand",
            model=job_model,
            parallelism=ParallelismConfig(
                layout=layout,
                sequence_parallel=tp > 1,
                account_for_embedding_in_pipeline_split=extra,
                account_for_loss_in_pipeline_split=extra,
            ),
            training=TrainingConfig(
                micro_batch_size=b,
                global_batch_size=request.global_batch_size,
                precision=request.precision,
                recompute=request.recompute,
                distributed_optimizer=request.distributed_optimizer and not request.zero_stage,
                zero_stage=request.zero_stage,
                dp_shard=shard,
                pipeline_schedule=PipelineSchedule.INTERLEAVED if vpp > 1 else PipelineSchedule.ONE_F_ONE_B,
            ),
            hardware=request.hardware,
        )
        try:
            check_job(spec)
        except SpecError as exc:
            rejected[exc.field] = rejected.get(exc.field, 0) + 1
            continue
        plan = plan_job(spec, assumptions=assumptions)
        fullest = max(plan.stages, key=lambda s: s.memory.total_bytes)
        candidate = Candidate(
            layout=layout,
            micro_batch_size=b,
            expected_step_seconds=plan.expected_step_time.total_seconds,
            peak_memory_bytes=fullest.memory.total_bytes,
            headroom_bytes=request.hardware.usable_hbm_bytes - fullest.memory.total_bytes,
            bubble_fraction=plan.bubble_fraction,
            exposed_comm_seconds=sum(plan.expected_step_time.exposed_comm_seconds.values()),
            expected_mfu=plan.expected_mfu,
            findings=len(plan.findings),
        )
        (fitting if candidate.headroom_bytes >= 0 else misfits).append(candidate)
    return fitting, misfits, rejected


REQUESTS = {
    "defaults": (tiny_request(), None),
    "fp8-full-recompute-no-causal": (
        tiny_request(precision=Precision.FP8, recompute=Recompute.FULL, seq_length=128),
        PlanAssumptions(causal_attention=False),
    ),
    "six-layers-split-extra": (replace(tiny_request(), model=model(layers=6), max_vpp=3), None),
    "no-recompute-replicated-optimizer": (
        tiny_request(recompute=Recompute.NONE, distributed_optimizer=False, micro_batch_sizes=(2,)),
        None,
    ),
    "moe-ep": (replace(tiny_request(), model=model(layers=2, experts=4), micro_batch_sizes=(1,)), None),
    "zero3-hybrid": (tiny_request(zero_stage=3, dp_shard=2), None),  # dp 4 in shard groups of 2; dp 2, 1 whole
    "zero1-hybrid-6-gpus": (replace(tiny_request(zero_stage=1, dp_shard=4), hardware=hardware(1, 6)), None),
}


@pytest.mark.parametrize(("request_", "assumptions"), REQUESTS.values(), ids=REQUESTS.keys())
def test_every_candidate_is_planned_as_the_manifest_would_be(
    request_: SearchRequest, assumptions: PlanAssumptions | None
) -> None:
    fitting, misfits, rejected = planned_by_hand(request_, assumptions)
    result = search_layouts(request_, assumptions=assumptions)
    assert result.evaluated == len(fitting) + len(misfits)
    # fastest first, the smaller peak first between equally fast ones (the sort is stable)
    assert result.candidates == tuple(sorted(fitting, key=lambda c: (c.expected_step_seconds, c.peak_memory_bytes)))
    assert result.rejected == rejected
    assert result.closest_misfit is None
    assert {c.layout.tp > 1 for c in fitting} == {True, False}
    if request_.dp_shard == 4:  # on 6 GPUs dp 6 holds no whole shard group of 4
        assert rejected["dp_shard"] > 0


def test_hybrid_sharding_in_the_search_keeps_fsdp_off_the_network() -> None:
    # Llama 3 8B on 16 H100 nodes, ZeRO-3: sharded over all 128 GPUs, the gathers cross the network; over the 8 GPUs
    # of a node (HSDP), they stay on NVLink and only the shards' all-reduce crosses it. Pure data parallelism wins.
    from meshscope.jobs import lookup_model  # noqa: PLC0415

    request = SearchRequest(
        model=lookup_model("llama3-8b"), hardware=default_hardware("H100", 16), global_batch_size=512, zero_stage=3
    )
    full = {(c.layout, c.micro_batch_size): c for c in search_layouts(request).candidates}
    hybrid = search_layouts(replace(request, dp_shard=8))
    best = hybrid.candidates[0]
    assert (best.layout.dp, best.layout.tp, best.layout.pp) == (128, 1, 1)
    same = full[(best.layout, best.micro_batch_size)]
    assert best.exposed_comm_seconds < same.exposed_comm_seconds / 10
    assert best.peak_memory_bytes > same.peak_memory_bytes  # the price: a copy of the state per node
    with pytest.raises(PlanError, match="shards nothing"):
        search_layouts(replace(request, zero_stage=0, distributed_optimizer=False, dp_shard=8))


def test_candidates_of_equal_step_time_rank_by_peak_memory() -> None:
    fitting, _, _ = planned_by_hand(tiny_request(), None)
    result = search_layouts(tiny_request())
    best = min(c.expected_step_seconds for c in fitting)
    assert result.candidates[0].expected_step_seconds == best
    assert result.candidates[0] == min(fitting, key=lambda c: (c.expected_step_seconds, c.peak_memory_bytes))


def dp4_peak() -> int:
    """Peak memory of (dp 4, micro-batch 1) of tiny_request, planned directly."""
    spec = JobSpec(
        name="dp4",
        model=model(layers=4),
        parallelism=ParallelismConfig(layout=ParallelLayout(dp=4)),
        training=TrainingConfig(
            micro_batch_size=1, global_batch_size=12, recompute=Recompute.SELECTIVE, distributed_optimizer=True
        ),
        hardware=hardware(1, 4),
    )
    plan = plan_job(spec)
    return max(s.memory.total_bytes for s in plan.stages)


def test_a_candidate_with_no_headroom_left_still_fits() -> None:
    # HBM cut to exactly the peak of (dp 4, micro-batch 1), the largest of tiny_request (as large: dp 2, cp 2,
    # micro-batch 2, with as many tokens per GPU and optimizer shards): headroom 0 fits, nothing is dropped.
    peak = dp4_peak()
    hw = hardware(1, 4)
    hw = replace(hw, reserved_bytes=hw.gpu.hbm_bytes - peak)
    result = search_layouts(replace(tiny_request(), hardware=hw))
    zero = [(c.layout, c.micro_batch_size) for c in result.candidates if c.headroom_bytes == 0]
    assert sorted(zero, key=lambda lb: lb[0].cp) == [(ParallelLayout(dp=4), 1), (ParallelLayout(dp=2, cp=2), 2)]
    assert result.evaluated == len(result.candidates) == 24
    assert "exceeds HBM" not in result.rejected
    assert result.closest_misfit is None


def test_closest_misfit_is_the_first_met_of_the_smallest_peaks() -> None:
    # One byte less than (dp 4, micro-batch 1) needs: it misfits by one byte, as does (dp 2, cp 2, micro-batch 2),
    # which holds as many tokens per GPU and as many optimizer shards (dp*cp = 4); every other job needs less.
    # dp 4 is met first (cp 1 before 2) and stays the closest.
    peak = dp4_peak()
    hw = hardware(1, 4)
    hw = replace(hw, reserved_bytes=hw.gpu.hbm_bytes - peak + 1)
    result = search_layouts(replace(tiny_request(), hardware=hw))
    _, misfits, _ = planned_by_hand(replace(tiny_request(), hardware=hw), None)
    tied = [c for c in misfits if c.peak_memory_bytes == peak]
    assert [(c.layout, c.micro_batch_size) for c in tied] == [
        (ParallelLayout(dp=4), 1),
        (ParallelLayout(dp=2, cp=2), 2),
    ]
    assert min(c.peak_memory_bytes for c in misfits) == peak
    assert result.closest_misfit == tied[0]
    assert result.closest_misfit.headroom_bytes == -1
    assert misfits == tied
    assert result.rejected == {"exceeds HBM": 2, "spec.model.layers": 2, "spec.training.globalBatchSize": 2}
    assert result.evaluated == 24
    assert len(result.candidates) == 22


# ---------------------------------------------------------------------------------------------- JSON forms


CANDIDATE = Candidate(
    layout=ParallelLayout(dp=2, tp=4, pp=3, cp=1, ep=2, vpp=5),
    micro_batch_size=7,
    expected_step_seconds=1.25,
    peak_memory_bytes=1000,
    headroom_bytes=-24,
    bubble_fraction=0.125,
    exposed_comm_seconds=0.5,
    expected_mfu=0.375,
    findings=3,
)
CANDIDATE_JSON = {
    "layout": {"dp": 2, "tp": 4, "pp": 3, "cp": 1, "ep": 2, "vpp": 5},
    "micro_batch_size": 7,
    "expected_step_seconds": 1.25,
    "peak_memory_bytes": 1000,
    "headroom_bytes": -24,
    "bubble_fraction": 0.125,
    "exposed_comm_seconds": 0.5,
    "expected_mfu": 0.375,
    "findings": 3,
}


def test_candidate_json_names_every_field() -> None:
    assert CANDIDATE.to_dict() == CANDIDATE_JSON


def test_search_result_json_lists_all_or_the_top_candidates() -> None:
    other = replace(CANDIDATE, micro_batch_size=1, headroom_bytes=8)
    result = SearchResult(evaluated=9, candidates=(other, other, other), rejected={"exceeds HBM": 4})
    other_json = {**CANDIDATE_JSON, "micro_batch_size": 1, "headroom_bytes": 8}
    assert result.to_dict() == {
        "evaluated": 9,
        "fitting": 3,
        "rejected": {"exceeds HBM": 4},
        "candidates": [other_json, other_json, other_json],
        "closest_misfit": None,
    }
    assert result.to_dict(top=2)["candidates"] == [other_json, other_json]
    assert result.to_dict(top=2)["fitting"] == 3
    with_misfit = replace(result, closest_misfit=CANDIDATE)
    assert with_misfit.to_dict(top=1) == {
        "evaluated": 9,
        "fitting": 3,
        "rejected": {"exceeds HBM": 4},
        "candidates": [other_json],
        "closest_misfit": CANDIDATE_JSON,
    }

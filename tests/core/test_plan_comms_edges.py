"""Planner collectives at their edges: group spans, overlap windows, hiding FLOPs, each axis' drafts in full.

The tests call :func:`~meshscope.plan.comms.stage_collectives` directly with a synthetic stage (round compute seconds
and FLOPs, round parameter counts) on one NVLink domain with NCCL's latency off, so that every window, share and
message is a few lines of hand arithmetic from the formulas in ``comms.py``'s docstrings (Megatron-core, Transformer
Engine, nccl-tests PERFORMANCE.md). The group spans are checked on placements of one GPU per node, where every group
of more than one rank crosses a domain and ``example_crossing_group`` names the ranks of the first group.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshscope.jobs.models import MLAConfig, ModelConfig, MoEConfig
from meshscope.jobs.spec import CpCommType, ParallelismConfig, Precision, TrainingConfig
from meshscope.plan import CollectiveOp, CollectivePlan, PlanAssumptions
from meshscope.plan.comms import collective_spans, stage_collectives
from meshscope.plan.flops import ForwardFlops
from meshscope.plan.memory import StageParams
from meshscope.plan.timing import StageCompute
from meshscope.topology.hardware import default_hardware
from meshscope.topology.layout import ParallelLayout
from meshscope.topology.placement import Placement

AG, RS, AR, A2A, P2P = (
    CollectiveOp.ALL_GATHER,
    CollectiveOp.REDUCE_SCATTER,
    CollectiveOp.ALL_REDUCE,
    CollectiveOp.ALL_TO_ALL,
    CollectiveOp.SEND_RECV,
)

# Bandwidth only: seconds = S x bus factor / (450 GB/s x 0.8) on the H100's NVLink, no latency term.
FLAT = PlanAssumptions(nccl_latency=False)
NVLINK_BYTES_PER_S = 450e9 * 0.8

# One micro-batch through the synthetic stage: forward 0.5 s, backward 2 s, attention core 0.25 s.
FORWARD_S, BACKWARD_S, CORE_S = 0.5, 2.0, 0.25
# Forward FLOPs per micro-batch on the GPU: layers = 6 + 1 + 2 = 9 TFLOP, total = 10 TFLOP, routed experts 2 TFLOP.
FLOPS = ForwardFlops(linear=6e12, attention_core=1e12, experts=2e12, logits=1e12)
# dense = tp_sharded + replicated + embedding + output = 1000 + 10 + 200 + 300 = 1510 parameters; 500 routed-expert.
PARAMS = StageParams(tp_sharded=1000, replicated=10, experts=500, embedding=200, output=300, largest_layer=500)

H, A, G, D, F, V, S = 1024, 16, 4, 64, 2816, 1000, 512  # llama(): d = h/a = 64, 4 KV heads


def llama(*, layers: int = 2, tied: bool = False, h: int = H, a: int = A, v: int = V) -> ModelConfig:
    return ModelConfig(
        name="llama",
        layers=layers,
        hidden_size=h,
        attention_heads=a,
        kv_heads=G if a == A else None,
        ffn_hidden_size=F,
        vocab_size=v,
        seq_length=S,
        tied_embeddings=tied,
    )


def moe(*, layers: int = 2, dense_layers: int = 0, shared: int = 0) -> ModelConfig:
    """h = 1024, 8 heads, s = 256; 8 experts, top-2, expert FFN 512."""
    return ModelConfig(
        name="moe",
        layers=layers,
        hidden_size=1024,
        attention_heads=8,
        ffn_hidden_size=4096,
        vocab_size=V,
        seq_length=256,
        moe=MoEConfig(experts=8, top_k=2, expert_ffn_hidden_size=512, shared_experts=shared, dense_layers=dense_layers),
    )


def synthetic_compute(m: int, *, forward: float = FORWARD_S, backward: float = BACKWARD_S) -> StageCompute:
    return StageCompute(
        forward_flops_per_microbatch=FLOPS,
        recompute_flops_per_microbatch=0.0,
        forward_seconds_per_microbatch=forward,
        backward_seconds_per_microbatch=backward,
        attention_core_seconds_per_microbatch=CORE_S,
        micro_batches=m,
    )


def plan_stage(
    model: ModelConfig,
    layout: ParallelLayout,
    *,
    pp_rank: int = 0,
    layers: list[int] | None = None,
    sp: bool = False,
    cp_comm_type: CpCommType = CpCommType.P2P,
    params: StageParams = PARAMS,
    compute: StageCompute | None = None,
    micro_batch_size: int = 1,
    micro_batches: int = 1,
    assumptions: PlanAssumptions = FLAT,
    **training: object,
) -> tuple[CollectivePlan, ...]:
    """The collectives of one GPU of ``pp_rank``, every rank in one NVLink domain, the synthetic compute."""
    world = layout.world_size
    hardware = replace(default_hardware("H100", 1), gpus_per_node=world, nvlink_domain_gpus=world)
    placement = Placement.for_hardware(world, hardware)
    settings: dict[str, object] = {
        "micro_batch_size": micro_batch_size,
        "global_batch_size": micro_batch_size * layout.dp * micro_batches,
        **training,
    }
    return stage_collectives(
        model,
        ParallelismConfig(layout=layout, sequence_parallel=sp, cp_comm_type=cp_comm_type),
        TrainingConfig(**settings),  # type: ignore[arg-type]
        hardware=hardware,
        assumptions=assumptions,
        spans=collective_spans(layout, placement, model),
        pp_rank=pp_rank,
        layer_indices=list(range(model.layers)) if layers is None else layers,
        params=params,
        compute=compute or synthetic_compute(micro_batches),
    )


def rows(plans: tuple[CollectivePlan, ...], *, axis: str) -> list[tuple[str, CollectiveOp, str, int, int]]:
    """(group, op, purpose, message bytes, count per step) of every collective of ``axis``, in plan order."""
    return [(c.group, c.op, c.purpose, c.message_bytes, c.count_per_step) for c in plans if c.axis == axis]


def by_purpose(plans: tuple[CollectivePlan, ...]) -> dict[tuple[CollectiveOp, str], CollectivePlan]:
    found = {(c.op, c.purpose): c for c in plans}
    assert len(found) == len(plans), [(c.op, c.purpose) for c in plans]
    return found


def one_gpu_per_node(world: int) -> Placement:
    """Every rank its own node and NVLink domain: every group of two or more ranks crosses a domain."""
    return Placement.default(world, gpus_per_node=1, nvlink_domain_gpus=1, nodes_per_network_block=1)


# ---------------------------------------------------------------------------------------------------- group spans


def test_dense_gradient_group_is_the_cp_group_when_dp_is_one():
    spans = collective_spans(ParallelLayout(cp=2), one_gpu_per_node(2), llama())
    assert spans["dp-cp"] is spans["cp"]
    assert spans["dp-cp"].group_size == 2
    # Neither dp nor cp: no gradient group at all.
    assert "dp-cp" not in collective_spans(ParallelLayout(tp=2), one_gpu_per_node(2), llama())


EXPERT = ("etp", "tp-ep", "edp")


def test_expert_groups_come_from_the_expert_generator():
    # tp=1, etp=2, ep=2, dp=8: expert degrees etp=2, ep=2, edp = 8/(2·2) = 2 in the order tp-cp-ep-dp-pp, so an expert
    # rank is etp_i + 2·ep_i + 4·edp_i: etp group 0 = {0, 1}, tp-ep group 0 = {0, 1, 2, 3}, edp group 0 = {0, 4}.
    spans = collective_spans(ParallelLayout(dp=8, ep=2, etp=2), one_gpu_per_node(8), moe())
    found = {k: (s.axis, s.group_size, s.groups, s.example_crossing_group) for k, s in spans.items() if k in EXPERT}
    assert found == {
        "etp": ("etp", 2, 4, (0, 1)),
        "tp-ep": ("tp-ep", 4, 2, (0, 1, 2, 3)),
        "edp": ("edp", 2, 4, (0, 4)),
    }


def test_expert_data_parallel_group_without_expert_parallelism():
    # ep=1 (axis_spans adds no edp then): tp=1, etp=2, dp=4 gives edp = 4/2 = 2; an expert rank is etp_i + 2·edp_i,
    # so edp group 0 = {0, 2}, and the decoder's dp group (all 4 ranks) must not stand in for it.
    spans = collective_spans(ParallelLayout(dp=4, etp=2), one_gpu_per_node(4), moe())
    found = {k: (s.axis, s.group_size, s.groups, s.example_crossing_group) for k, s in spans.items() if k in EXPERT}
    assert found == {
        "etp": ("etp", 2, 2, (0, 1)),
        "tp-ep": ("tp-ep", 2, 2, (0, 1)),
        "edp": ("edp", 2, 2, (0, 2)),
    }


def test_no_expert_tensor_groups_when_every_expert_group_has_one_rank():
    # etp = tp = 1 and ep = 1: the etp and tp-ep groups would have one rank each, so they are left out.
    spans = collective_spans(ParallelLayout(dp=2), one_gpu_per_node(2), moe())
    assert set(spans) == {"dp", "dp-cp", "edp"}
    assert set(collective_spans(ParallelLayout(dp=2), one_gpu_per_node(2), llama())) == {"dp", "dp-cp"}


def test_tied_embedding_group_joins_the_first_and_last_stage():
    # pp=4, dp=2: a rank is dp_i + 2·pp_i, pipeline group 0 = {0, 2, 4, 6}; its ends are ranks 0 and 6.
    spans = collective_spans(ParallelLayout(dp=2, pp=4), one_gpu_per_node(8), llama(layers=4, tied=True))
    ends = spans["pp-embedding"]
    assert (ends.axis, ends.group_size, ends.groups, ends.example_crossing_group) == ("pp-embedding", 2, 2, (0, 6))
    # Untied embeddings, or no pipeline: nothing to all-reduce between stages.
    untied = collective_spans(ParallelLayout(dp=2, pp=4), one_gpu_per_node(8), llama(layers=4))
    assert "pp-embedding" not in untied
    assert "pp-embedding" not in collective_spans(ParallelLayout(dp=2), one_gpu_per_node(2), llama(tied=True))


# ---------------------------------------------------------------------------------------------------- windows


def test_every_overlap_window_has_its_documented_length():
    m = 3
    # m·(forward + backward) = 3 x 2.5 = 7.5 s; m·backward = 6 s; the first forward 0.5 s; nothing for the
    # vocabulary and sequence-parallel gradient all-reduces.
    sp = by_purpose(plan_stage(llama(), ParallelLayout(tp=2, dp=2), sp=True, micro_batches=m, zero_stage=2))
    windows = {key: c.overlap_window_seconds for key, c in sp.items()}
    assert windows == pytest.approx(
        {
            (AG, "layer activations, sequence parallel (forward and backward)"): 7.5,
            (RS, "layer activations, sequence parallel (forward and backward)"): 7.5,
            (AG, "sequence-parallel re-gather of GEMM inputs for weight gradients (backward)"): 6.0,
            (RS, "vocabulary-parallel embedding output, sequence parallel (forward)"): 0.0,
            (AG, "embedding output gradient, sequence parallel (backward)"): 0.0,
            (AG, "output-layer input, sequence parallel (forward)"): 0.0,
            (AG, "output-layer input again, for its weight gradient (backward)"): 0.0,
            (RS, "output-layer input gradient, sequence parallel (backward)"): 0.0,
            (AR, "vocabulary-parallel cross entropy: max logit, target logit, sum of exponentials (forward)"): 0.0,
            (AR, "sequence-parallel parameter gradients: norms, router, row-parallel biases (after backward)"): 0.0,
            (RS, "dense gradients"): 6.0,
            (AG, "dense weights"): 0.5,
        }
    )
    # No sharding: the last backward, 2 s.
    (ar,) = plan_stage(llama(), ParallelLayout(dp=2), micro_batches=m)
    assert ar.overlap_window_seconds == pytest.approx(2.0)
    # The cp ring: m x the attention core = 0.75 s.
    (ring,) = (c for c in plan_stage(llama(), ParallelLayout(cp=2), micro_batches=m) if c.axis == "cp")
    assert ring.overlap_window_seconds == pytest.approx(0.75)
    # ZeRO-3 without a pipeline: every forward (1.5 s) and every backward (6 s).
    z3 = by_purpose(plan_stage(llama(), ParallelLayout(dp=2), micro_batches=m, zero_stage=3))
    assert z3[AG, "dense weights per layer (forward)"].overlap_window_seconds == pytest.approx(1.5)
    assert z3[AG, "dense weights per layer (backward)"].overlap_window_seconds == pytest.approx(6.0)


def test_collectives_sharing_a_window_share_its_seconds():
    """The first collective of a window hides what it can; the next one gets only what is left."""
    # A 0.3 µs stage (forward 0.1 µs + backward 0.2 µs, m = 1) against ~1.5 µs per all-gather of S = 1 MiB:
    # 0.8 of the traffic is far more than the window holds.
    compute = synthetic_compute(1, forward=1e-7, backward=2e-7)
    plans = by_purpose(plan_stage(llama(), ParallelLayout(tp=2), sp=True, compute=compute, tp_comm_overlap=True))
    gather = plans[AG, "layer activations, sequence parallel (forward and backward)"]
    scatter = plans[RS, "layer activations, sequence parallel (forward and backward)"]
    regather = plans[AG, "sequence-parallel re-gather of GEMM inputs for weight gradients (backward)"]
    assert gather.overlap_fraction == scatter.overlap_fraction == pytest.approx(0.8)
    assert 0.8 * gather.expected_seconds_per_step > 3e-7
    # The all-gather takes the whole 0.3 µs stage window, the reduce-scatter (same window) nothing.
    assert gather.expected_seconds_per_step - gather.exposed_seconds_per_step == pytest.approx(3e-7)
    assert scatter.exposed_seconds_per_step == pytest.approx(scatter.expected_seconds_per_step)
    # The re-gather has a window of its own, m x backward = 0.2 µs, and hides all of it (overlap 1.0).
    assert regather.expected_seconds_per_step - regather.exposed_seconds_per_step == pytest.approx(2e-7)


# ---------------------------------------------------------------------------------------------------- FLOPs per byte


def test_axis_hiding_flops_are_shared_in_proportion_to_bytes():
    m, t = 2, 2
    plans = plan_stage(llama(), ParallelLayout(tp=t, dp=2), sp=True, micro_batches=m)
    tp = [c for c in plans if c.axis == "tp" and c.in_axis_ratio]
    # blocks = 2 attention + 2 MLP = 4; all-gather and reduce-scatter 2·4·m = 16 each, re-gather 4·m = 8, all of
    # S = s·b·h·2 = 1 MiB at (t-1)/t = 1/2: bytes in the ratio 16 : 16 : 8 of 40·S/2 = 20·S.
    message = S * H * 2
    assert message == 1_048_576
    layers_flops = 3 * m * 9e12  # 3 x m x the layers' forward FLOPs
    assert [c.op for c in tp] == [AG, RS, AG]
    assert [c.hiding_flops_per_step for c in tp] == pytest.approx(
        [0.4 * layers_flops, 0.4 * layers_flops, 0.2 * layers_flops]
    )
    for c in tp:
        assert c.flops_per_byte == pytest.approx(layers_flops / (20 * message))
        assert c.pp_rank == 0
        assert c.groups == 2  # world 4 / tp 2
    # DP hides behind everything the stage computes, 3·m·10 TFLOP, over 1510 fp32 gradients all-reduced once
    # (bus factor 2·1/2 = 1).
    (dp,) = (c for c in plans if c.axis == "dp")
    assert dp.hiding_flops_per_step == pytest.approx(3 * m * 10e12)
    assert dp.flops_per_byte == pytest.approx(3 * m * 10e12 / (1510 * 4))
    # The vocabulary collectives stay out: no share of FLOPs, the axis' ratio all the same.
    for c in plans:
        if c.axis == "tp" and not c.in_axis_ratio:
            assert c.hiding_flops_per_step == 0
            assert c.flops_per_byte == pytest.approx(layers_flops / (20 * message))


def test_an_axis_without_bytes_in_its_ratio_reports_zero_flops_per_byte():
    # MoE with etp = tp = 2, ep = 1: the only EP collective is the token-count all-gather, which stays out of the
    # ratio, so the EP axis has no bytes to divide by.
    (counts,) = (c for c in plan_stage(moe(), ParallelLayout(tp=2), sp=True) if c.axis == "ep")
    assert counts.purpose.startswith("token counts")
    assert counts.flops_per_byte == 0.0
    assert counts.hiding_flops_per_step == 0.0


def test_link_budget_uses_the_training_precision():
    # fp32 runs at half the BF16 tensor-core peak (989 TFLOP/s on the H100) over the 450 GB/s NVLink.
    plans = plan_stage(llama(), ParallelLayout(tp=2), precision=Precision.FP32)
    ar = next(c for c in plans if c.purpose == "layer activations (forward and backward)")
    assert ar.link_budget_flops_per_byte == pytest.approx(989e12 / 2 / 450e9)
    assert ar.message_bytes == S * H * 4  # fp32 activations


def test_empty_collectives_are_dropped_and_a_one_byte_one_is_kept():
    # First stage of an MoE model whose layer 0 is dense: no routed-expert parameters there, so no edp reduction.
    # ep=2 over dp=4: edp = 4/2 = 2.
    layout = ParallelLayout(dp=4, ep=2, pp=2)
    first = plan_stage(moe(dense_layers=1), layout, layers=[0], params=replace(PARAMS, experts=0))
    assert [c.group for c in first if c.axis == "dp"] == ["dp-cp"]
    # One replicated parameter, bf16 gradients, ZeRO-2 over dp = 2: ceil(1 x 2 / 2) = 1 byte on the first stage.
    layout = ParallelLayout(tp=2, dp=2, pp=2)
    params = replace(PARAMS, replicated=1)
    tiny = plan_stage(llama(), layout, layers=[0], sp=True, params=params, zero_stage=2, grad_reduce_bytes=2)
    grads = [c for c in tiny if c.purpose.startswith("sequence-parallel parameter gradients")]
    assert [(c.message_bytes, c.count_per_step) for c in grads] == [(1, 1)]


# ---------------------------------------------------------------------------------------------------- TP


def test_tp_blocks_are_attention_dense_mlps_and_shared_experts():
    # 4 layers, the first dense: blocks = 4 attention + 1 dense MLP (+ 3 shared-expert MLPs when there are shared
    # experts); one all-reduce forward and one backward per block and micro-batch, m = 2; S = s·b·h·2 = 256·1024·2.
    m, layout = 2, ParallelLayout(tp=2)
    message = 256 * 1024 * 2
    for shared, blocks in ((0, 5), (1, 8)):
        plans = plan_stage(moe(layers=4, dense_layers=1, shared=shared), layout, micro_batches=m)
        layer = [c for c in plans if c.purpose == "layer activations (forward and backward)"]
        assert [(c.op, c.message_bytes, c.count_per_step) for c in layer] == [(AR, message, 2 * blocks * m)], shared


def test_tp_messages_hold_the_local_sequence_of_context_parallelism():
    # cp = 2: b·(s/cp)·h·2 = 256 x 1024 x 2 bytes per all-reduce.
    plans = plan_stage(llama(), ParallelLayout(tp=2, cp=2))
    assert rows(plans, axis="tp")[0] == ("tp", AR, "layer activations (forward and backward)", 256 * H * 2, 2 * 4)


def test_tp_with_sequence_parallelism_in_full():
    m = 3
    plans = plan_stage(llama(), ParallelLayout(tp=2), sp=True, micro_batches=m, tp_comm_overlap=True)
    layers = [
        (c.op, c.purpose, c.message_bytes, c.count_per_step, c.overlap_fraction) for c in plans if c.in_axis_ratio
    ]
    message, blocks = S * H * 2, 4  # 2 attention + 2 MLP
    assert layers == [
        (AG, "layer activations, sequence parallel (forward and backward)", message, 2 * blocks * m, 0.8),
        (RS, "layer activations, sequence parallel (forward and backward)", message, 2 * blocks * m, 0.8),
        (AG, "sequence-parallel re-gather of GEMM inputs for weight gradients (backward)", message, blocks * m, 1.0),
    ]


@pytest.mark.parametrize(("overlap", "fraction"), [(True, 0.8), (False, 0.0)], ids=["tp-comm-overlap", "no-overlap"])
def test_expert_tensor_parallel_rows_in_full(overlap, fraction):
    # etp = tp = 2, SP: s·b/t = 128 tokens per GPU, k = 2 copies each, the etp all-gather assembles etp of them:
    # 2 x 2 x 128 = 512 copies of h·2 bytes (tokens) or 2 bytes (probabilities); 2 MoE layers, m = 2.
    m, n_moe = 2, 2
    tokens, probabilities = 512 * 1024 * 2, 512 * 2
    plans = plan_stage(moe(), ParallelLayout(tp=2), sp=True, micro_batches=m, tp_comm_overlap=overlap)
    etp = [(c.op, c.purpose, c.message_bytes, c.count_per_step, c.overlap_fraction) for c in plans if c.group == "etp"]
    prefix = "expert tensor parallel: "
    assert etp == [
        (
            AG,
            prefix + "routed tokens (forward; the expert output's gradient, backward)",
            tokens,
            2 * n_moe * m,
            fraction,
        ),
        (
            RS,
            prefix + "expert output (forward; the routed tokens' gradient, backward)",
            tokens,
            2 * n_moe * m,
            fraction,
        ),
        (AG, prefix + "routing probabilities (forward)", probabilities, n_moe * m, fraction),
        (RS, prefix + "routing-probability gradients (backward)", probabilities, n_moe * m, fraction),
    ]


# ---------------------------------------------------------------------------------------------------- vocabulary


def test_vocabulary_collectives_without_sequence_parallelism_in_full():
    # tp = 2, cp = 2, m = 2: s/cp·b = 256 tokens per GPU, b·s·h·2 = 256 x 1024 x 2 bytes; the cross entropy moves
    # 4 bytes per token, three times per micro-batch.
    m = 2
    plans = plan_stage(llama(), ParallelLayout(tp=2, cp=2), micro_batches=m)
    vocab = [c for c in plans if c.axis == "tp" and not c.in_axis_ratio]
    assert [(c.op, c.purpose, c.message_bytes, c.count_per_step) for c in vocab] == [
        (AR, "vocabulary-parallel embedding output (forward)", 256 * H * 2, m),
        (AR, "output-layer input gradient (backward)", 256 * H * 2, m),
        (
            AR,
            "vocabulary-parallel cross entropy: max logit, target logit, sum of exponentials (forward)",
            4 * 256,
            3 * m,
        ),
    ]
    for c in vocab:
        assert (c.overlap_fraction, c.overlap_window_seconds, c.in_axis_ratio) == (0.0, 0.0, False)
        assert c.exposed_seconds_per_step == pytest.approx(c.expected_seconds_per_step)


# ---------------------------------------------------------------------------------------------------- SP gradients


def sp_gradients(plans: tuple[CollectivePlan, ...]) -> list[CollectivePlan]:
    return [c for c in plans if c.purpose.startswith("sequence-parallel parameter gradients")]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_sequence_parallel_gradients_of_the_last_stage_add_the_final_norm(tied):
    # pp = 1, so stage 0 is the last: the 10 replicated parameters plus the final RMSNorm's h = 1024 weights (the
    # output layer is tp-sharded, tied or not), fp32 gradients.
    (ar,) = sp_gradients(plan_stage(llama(tied=tied), ParallelLayout(tp=2), sp=True))
    assert (ar.group, ar.op, ar.message_bytes, ar.count_per_step) == ("tp", AR, (10 + H) * 4, 1)
    assert ar.purpose == ("sequence-parallel parameter gradients: norms, router, row-parallel biases (after backward)")
    assert (ar.overlap_fraction, ar.overlap_window_seconds, ar.hiding_flops_per_step) == (0.0, 0.0, 0.0)
    assert ar.in_axis_ratio is False


@pytest.mark.parametrize(
    ("training", "shards"),
    [({}, 1), ({"distributed_optimizer": True}, 1), ({"zero_stage": 2}, 4), ({"zero_stage": 3}, 4)],
    ids=["no-sharding", "zero1", "zero2", "zero3"],
)
def test_sequence_parallel_gradients_are_sharded_over_dp_cp_from_zero2(training, shards):
    # tp = 2, cp = 2, dp = 2: ZeRO-2/3 leave each GPU 1/(dp·cp) = 1/4 of the gradients; below that, all of them.
    (ar,) = sp_gradients(plan_stage(llama(), ParallelLayout(tp=2, cp=2, dp=2), sp=True, **training))
    assert ar.message_bytes == (10 + H) * 4 // shards


def test_no_sequence_parallel_gradient_all_reduce_without_sequence_parallelism():
    assert len(sp_gradients(plan_stage(llama(), ParallelLayout(tp=2), sp=True))) == 1
    assert not sp_gradients(plan_stage(llama(), ParallelLayout(tp=2)))


# ---------------------------------------------------------------------------------------------------- CP


def test_cp_ring_rows_in_full():
    # cp = 4, b = 2: s/cp·b = 256 local tokens; K and V of 4 heads x 64 each, bf16: 256 x 512 x 2 bytes. 2 layers x
    # 1 micro-batch = 2 units: (cp + 1) single and (cp - 2) double messages per unit.
    kv = 256 * (G * D + G * D) * 2
    plans = plan_stage(llama(), ParallelLayout(cp=4), micro_batch_size=2)
    assert rows(plans, axis="cp") == [
        ("cp", P2P, "ring exchange (p2p): K/V chunk forward, K/V and dK/dV at the ends of backward", kv, 5 * 2),
        ("cp", P2P, "ring exchange (p2p): K/V with dK/dV in one message, middle backward steps", 2 * kv, 2 * 2),
    ]
    assert {c.overlap_fraction for c in plans if c.axis == "cp"} == {0.8}


def test_cp_all_gather_rows_in_full_when_k_and_v_have_one_width():
    # cp = 2: the whole sequence of K (or V) of 4 heads x 64: 512 x 256 x 2 bytes; K and V, 2 layers, 1 micro-batch:
    # 2 x 2 = 4 gathers forward and again backward, 4 reduce-scatters of dK and dV.
    gathered = S * G * D * 2
    plans = plan_stage(llama(), ParallelLayout(cp=2), cp_comm_type=CpCommType.ALL_GATHER)
    assert rows(plans, axis="cp") == [
        ("cp", AG, "all_gather: K and V before attention, again in backward", gathered, 8),
        ("cp", RS, "all_gather: dK and dV (backward)", gathered, 4),
    ]
    assert {(c.overlap_fraction, c.overlap_window_seconds) for c in plans if c.axis == "cp"} == {(0.0, 0.0)}


def test_cp_all_gather_rows_in_full_when_k_and_v_differ():
    # MLA, 16 heads: K is 16 x (128 + 64) = 3072 wide, V 16 x 128 = 2048; one of each per layer (2 layers), gathered
    # forward and backward, reduce-scattered once.
    mla = MLAConfig(q_lora_rank=None, kv_lora_rank=512, qk_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    plans = plan_stage(replace(llama(), mla=mla), ParallelLayout(cp=2), cp_comm_type=CpCommType.ALL_GATHER)
    k, v = S * 3072 * 2, S * 2048 * 2
    assert rows(plans, axis="cp") == [
        ("cp", AG, "all_gather: K before attention, again in backward", k, 4),
        ("cp", RS, "all_gather: dK (backward)", k, 2),
        ("cp", AG, "all_gather: V before attention, again in backward", v, 4),
        ("cp", RS, "all_gather: dV (backward)", v, 2),
    ]


def test_cp_a2a_rows_in_full():
    # cp = 2, b = 2: 256 x 2 = 512 local tokens; Q and the output are 16 x 64 = 1024 wide, K and V 4 x 64 = 256.
    # Each is all-to-alled forward and its gradient backward: 2 per tensor of a size, x 2 tensors, x 2 layers.
    plans = plan_stage(llama(), ParallelLayout(cp=2), cp_comm_type=CpCommType.A2A, micro_batch_size=2)
    assert rows(plans, axis="cp") == [
        ("cp", A2A, "a2a (Ulysses): Q, output and their gradients", 512 * 1024 * 2, 8),
        ("cp", A2A, "a2a (Ulysses): K, V and their gradients", 512 * 256 * 2, 8),
    ]
    assert {(c.overlap_fraction, c.overlap_window_seconds) for c in plans if c.axis == "cp"} == {(0.0, 0.0)}


# ---------------------------------------------------------------------------------------------------- EP


COUNTS = "token counts per expert (int64), before dispatch (forward)"
DISPATCH = "token dispatch and combine (forward and backward)"
PROBABILITIES = "routing probabilities with the dispatch (forward and backward)"


def test_ep_rows_in_full_without_expert_tensor_parallelism():
    # ep = 2, etp = 1, m = 2, 2 MoE layers: 256 tokens per GPU, k = 2 copies: 512 x 1024 x 2 bytes dispatched, 512 x 2
    # bytes of probabilities; the counts: etp·ep x 8 experts x 8 bytes.
    m = 2
    plans = plan_stage(moe(), ParallelLayout(dp=2, ep=2), micro_batches=m)
    assert rows(plans, axis="ep") == [
        ("tp-ep", AG, COUNTS, 2 * 8 * 8, 2 * m),
        ("ep", A2A, DISPATCH, 512 * 1024 * 2, 4 * 2 * m),
        ("ep", A2A, PROBABILITIES, 512 * 2, 2 * 2 * m),
    ]
    counts, dispatch, probabilities = (c for c in plans if c.axis == "ep")
    assert counts.in_axis_ratio is False
    assert (counts.overlap_fraction, counts.overlap_window_seconds) == (0.0, 0.0)
    # EP hides behind the routed experts: 3·m·2 TFLOP, over the dispatched bytes at (ep-1)/ep = 1/2.
    moved = (4 * 2 * m * 512 * 1024 * 2 + 2 * 2 * m * 512 * 2) / 2
    assert dispatch.flops_per_byte == pytest.approx(3 * m * 2e12 / moved)
    assert dispatch.hiding_flops_per_step + probabilities.hiding_flops_per_step == pytest.approx(3 * m * 2e12)


def test_ep_rows_with_expert_tensor_parallelism():
    # tp = etp = 2, ep = 2, dp = 2, SP: 256/2 = 128 tokens per GPU, 256 copies; the counts over etp·ep = 4 ranks.
    plans = plan_stage(moe(), ParallelLayout(tp=2, dp=2, ep=2), sp=True)
    assert rows(plans, axis="ep") == [
        ("tp-ep", AG, COUNTS, 4 * 8 * 8, 2),
        ("ep", A2A, DISPATCH, 256 * 1024 * 2, 8),
        ("ep", A2A, PROBABILITIES, 256 * 2, 4),
    ]


@pytest.mark.parametrize(("sp", "tokens"), [(False, 256), (True, 128)], ids=["no-sp", "sp"])
def test_tokens_per_gpu_are_the_local_sequence_of_the_micro_batch(sp, tokens):
    # s = 256, cp = 2, b = 2: s/cp·b = 256 tokens, ÷ tp = 2 only with sequence parallelism; k = 2 copies each.
    plans = plan_stage(moe(), ParallelLayout(tp=2, cp=2, dp=2, ep=2), sp=sp, micro_batch_size=2)
    (dispatch,) = (c for c in plans if c.purpose == DISPATCH)
    assert dispatch.message_bytes == tokens * 2 * 1024 * 2


# ---------------------------------------------------------------------------------------------------- PP


def test_pp_message_is_the_local_sequence_of_a_micro_batch():
    # cp = 2, b = 2: (s/cp)·b·h·2 = 256 x 2 x 1024 x 2 bytes; the first stage only sends forward.
    plans = plan_stage(llama(), ParallelLayout(pp=2, cp=2), layers=[0], micro_batch_size=2)
    assert rows(plans, axis="pp") == [("pp", P2P, "activations (forward)", 256 * 2 * H * 2, 1)]


SCATTER_GATHER = replace(FLAT, pp_scatter_gather=True)
GATHER_PURPOSE = "pipeline scatter/gather: received activation or gradient slices (forward and backward)"


def test_pp_scatter_gather_sends_slices_and_gathers_each_received_tensor_over_tp():
    # tp = 2, pp = 3, m = 4, one layer per stage. Slice s·b·h·2/tp = 512 x 1024 x 2 / 2 = 524,288 bytes; the
    # all-gather puts back 512 x 1024 x 2 = 1,048,576 bytes for every tensor received: rank 0 receives 4 gradients,
    # rank 1 4 activations + 4 gradients, rank 2 4 activations.
    layout = ParallelLayout(tp=2, pp=3)
    stages = [
        plan_stage(llama(layers=3), layout, pp_rank=r, layers=[r], micro_batches=4, assumptions=SCATTER_GATHER)
        for r in range(3)
    ]
    pp = [[(c.purpose, c.message_bytes, c.count_per_step) for c in s if c.axis == "pp"] for s in stages]
    assert pp == [
        [("activations (forward)", 524_288, 4)],
        [("activations (forward)", 524_288, 4), ("activation gradients (backward)", 524_288, 4)],
        [("activation gradients (backward)", 524_288, 4)],
    ]
    gathers = [[c for c in s if c.purpose == GATHER_PURPOSE] for s in stages]
    assert [[(g.axis, g.group, g.op, g.message_bytes, g.count_per_step) for g in s] for s in gathers] == [
        [("tp", "tp", AG, 1_048_576, count)] for count in (4, 8, 4)
    ]
    (middle,) = gathers[1]
    # 8 x 1,048,576 x (2-1)/2 bytes at 360 GB/s, all exposed (it follows a synchronous receive), outside the ratio.
    assert middle.expected_seconds_per_step == pytest.approx(8 * 1_048_576 * 0.5 / NVLINK_BYTES_PER_S)
    assert middle.exposed_seconds_per_step == pytest.approx(middle.expected_seconds_per_step)
    assert middle.hiding_flops_per_step == 0.0


@pytest.mark.parametrize(
    ("sp", "assumptions"), [(True, SCATTER_GATHER), (False, FLAT)], ids=["sequence-parallel", "megatron-core"]
)
def test_no_pipeline_gather_with_sequence_parallelism_or_without_scatter_gather(sp, assumptions):
    plans = plan_stage(llama(layers=2), ParallelLayout(tp=2, pp=2), layers=[0], sp=sp, assumptions=assumptions)
    assert not [c for c in plans if c.purpose == GATHER_PURPOSE]
    # Sequence parallelism shards the pipeline tensor anyway; Megatron-core without it sends it whole.
    (send,) = (c for c in plans if c.axis == "pp")
    assert send.message_bytes == 512 * 1024 * 2 // (2 if sp else 1)


def test_tied_embedding_gradients_on_the_first_and_last_of_three_stages_only():
    tied = llama(layers=3, tied=True)
    stages = [plan_stage(tied, ParallelLayout(pp=3), pp_rank=r, layers=[r]) for r in range(3)]
    found = [
        [(c.op, c.purpose, c.message_bytes, c.count_per_step) for c in s if c.group == "pp-embedding"] for s in stages
    ]
    # V·h fp32 gradients, once per step.
    expected = [(AR, "tied word-embedding gradients (first and last stage)", V * H * 4, 1)]
    assert found == [expected, [], expected]
    assert [{c.pp_rank for c in s} for s in stages] == [{0}, {1}, {2}]
    (ar,) = (c for c in plan_stage(tied, ParallelLayout(pp=3), layers=[0]) if c.group == "pp-embedding")
    assert (ar.overlap_fraction, ar.overlap_window_seconds) == (0.0, 0.0)


def test_tied_embedding_shard_holds_whole_parameters():
    # V·h = 1001 x 1001 = 1,002,001 parameters over tp = 2: the larger shard holds 501,001, at 4 bytes.
    model = llama(h=1001, a=2, v=1001, tied=True)
    plans = plan_stage(model, ParallelLayout(tp=2, pp=2), layers=[0])
    (ar,) = (c for c in plans if c.group == "pp-embedding")
    assert ar.message_bytes == 501_001 * 4


# ---------------------------------------------------------------------------------------------------- DP


@pytest.mark.parametrize(
    ("training", "expected"),
    [
        ({}, [(AR, "dense gradients", 1510 * 4, 1)]),
        ({"distributed_optimizer": True}, [(RS, "dense gradients", 1510 * 4, 1), (AG, "dense weights", 1510 * 2, 1)]),
        ({"zero_stage": 2}, [(RS, "dense gradients", 1510 * 4, 3), (AG, "dense weights", 1510 * 2, 1)]),
    ],
    ids=["no-sharding", "zero1", "zero2"],
)
def test_dp_rows_in_full(training, expected):
    # The synthetic stage's 1510 dense parameters: fp32 gradients, bf16 weights; m = 3.
    plans = plan_stage(llama(), ParallelLayout(dp=2), micro_batches=3, **training)
    assert [(c.op, c.purpose, c.message_bytes, c.count_per_step) for c in plans if c.axis == "dp"] == expected


def test_routed_expert_gradients_are_named_apart_from_dense_ones():
    plans = plan_stage(moe(), ParallelLayout(dp=4, ep=2))
    # 500 routed-expert parameters of the synthetic stage, fp32, over edp = 4/2 = 2.
    assert rows(plans, axis="dp") == [
        ("dp-cp", AR, "dense gradients", 1510 * 4, 1),
        ("edp", AR, "routed-expert gradients", 500 * 4, 1),
    ]


@pytest.mark.parametrize(("gather", "fraction"), [(True, 0.9), (False, 0.0)], ids=["overlapped", "not-overlapped"])
def test_weight_gather_overlap_follows_overlap_param_gather(gather, fraction):
    plans = plan_stage(llama(), ParallelLayout(dp=2), distributed_optimizer=True, overlap_param_gather=gather)
    (ag,) = (c for c in plans if c.axis == "dp" and c.op is AG)
    assert ag.overlap_fraction == fraction


def test_pp_scatter_gather_of_two_stages_gathers_the_local_sequence_of_a_micro_batch():
    # tp = 2, pp = 2, cp = 2, b = 2, m = 2: the all-gather puts back s/cp·b·h·2 = 256 x 2 x 1024 x 2 = 1,048,576
    # bytes per tensor received: stage 0 receives 2 gradients, stage 1 2 activations. Without a pipeline (pp = 1)
    # there is nothing to gather, whatever tp.
    layout = ParallelLayout(tp=2, pp=2, cp=2)
    gathers = [
        [
            (c.message_bytes, c.count_per_step, c.overlap_fraction, c.in_axis_ratio)
            for c in plan_stage(
                llama(layers=2),
                layout,
                pp_rank=r,
                layers=[r],
                micro_batch_size=2,
                micro_batches=2,
                assumptions=SCATTER_GATHER,
            )
            if c.purpose == GATHER_PURPOSE
        ]
        for r in range(2)
    ]
    # Nothing hides it (it follows a synchronous receive) and it is not the layers' traffic: overlap 0, no ratio.
    assert gathers == [[(1_048_576, 2, 0.0, False)], [(1_048_576, 2, 0.0, False)]]
    assert all(type(g[3]) is bool for stage in gathers for g in stage)
    flat = plan_stage(llama(layers=2), ParallelLayout(tp=2), layers=[0, 1], assumptions=SCATTER_GATHER)
    assert not [c for c in flat if c.purpose == GATHER_PURPOSE]

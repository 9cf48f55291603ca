"""ZeRO-3 / FSDP2 collectives of the planner: units, messages, counts, groups, overlap and windows.

Expected numbers are written from the unit rules of docs/planner.md's collectives table (torchtitan's wrapping:
one unit per transformer layer, routed experts per layer over the expert-data-parallel group, a root unit for the
embedding, output layer and final norm; Rajbhandari et al. 2019 §7 for the gathers and reduce-scatters).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshscope.jobs.models import ModelConfig, MoEConfig
from meshscope.jobs.spec import JobSpec, ParallelismConfig, TrainingConfig
from meshscope.plan import CollectiveOp, CollectivePlan, Plan, PlanAssumptions, plan_job
from meshscope.topology.hardware import default_hardware
from meshscope.topology.layout import ParallelLayout

H, A, G, D, F, V, E, FE = 1024, 16, 4, 64, 2816, 1000, 4, 512
ATTENTION = 2 * H * A * D + 2 * H * G * D  # q, o; k, v (GQA)
NORMS = 2 * H  # two RMSNorms per layer
DENSE_LAYER = ATTENTION + 3 * H * F + NORMS  # SwiGLU MLP: gate, up, down
MOE_LAYER = ATTENTION + NORMS + H * E  # attention, norms and the router; the experts are a unit of their own
EXPERTS = E * 3 * H * FE  # every routed expert of one MoE layer
ROOT = V * H + H + V * H  # embedding, final norm, output layer (untied)
ROOT_PURPOSE = "of embedding, output layer and final norm (root unit)"


def moe_model(*, layers: int = 2, dense_layers: int = 1) -> ModelConfig:
    return ModelConfig(
        name="moe",
        layers=layers,
        hidden_size=H,
        attention_heads=A,
        kv_heads=G,
        ffn_hidden_size=F,
        vocab_size=V,
        seq_length=1024,
        moe=MoEConfig(experts=E, top_k=1, expert_ffn_hidden_size=FE, dense_layers=dense_layers),
    )


def plan(
    model: ModelConfig,
    layout: ParallelLayout,
    *,
    m: int,
    assumptions: PlanAssumptions | None = None,
    **training: object,
) -> Plan:
    world = layout.world_size
    hardware = replace(default_hardware("H100", 1), gpus_per_node=world, nvlink_domain_gpus=world)
    settings: dict[str, object] = {"micro_batch_size": 1, "global_batch_size": layout.dp * m, "zero_stage": 3}
    spec = JobSpec(
        name="zero3",
        model=model,
        parallelism=ParallelismConfig(layout=layout),
        training=TrainingConfig(**{**settings, **training}),  # type: ignore[arg-type]
        hardware=hardware,
    )
    return plan_job(spec, assumptions=assumptions)


def dp_rows(collectives: tuple[CollectivePlan, ...]) -> list[tuple[str, CollectiveOp, str, int, int, int]]:
    return sorted(
        (c.group, c.op, c.purpose, c.message_bytes, c.count_per_step, c.group_size)
        for c in collectives
        if c.axis == "dp"
    )


def test_moe_units_without_a_pipeline() -> None:
    # dp 4, ep 2 (etp = tp = 1): each GPU holds E/2 experts, the expert-data-parallel group is 4/2 = 2 GPUs. One
    # dense layer, one MoE layer, 3 micro-batches: each layer unit gathered in every forward and backward (2 x 3),
    # reduce-scattered after every backward (3); the root gathered once per forward (3) and reduced after each backward.
    m = 3
    p = plan(moe_model(), ParallelLayout(dp=4, ep=2), m=m)
    gather, reduce = CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER
    experts = EXPERTS // 2
    assert dp_rows(p.stages[0].collectives) == sorted(
        [
            ("dp-cp", gather, "dense weights per layer (forward)", DENSE_LAYER * 2, m, 4),
            ("dp-cp", gather, "dense weights per layer (backward)", DENSE_LAYER * 2, m, 4),
            ("dp-cp", reduce, "dense gradients per layer", DENSE_LAYER * 4, m, 4),
            ("dp-cp", gather, "dense weights per MoE layer (forward)", MOE_LAYER * 2, m, 4),
            ("dp-cp", gather, "dense weights per MoE layer (backward)", MOE_LAYER * 2, m, 4),
            ("dp-cp", reduce, "dense gradients per MoE layer", MOE_LAYER * 4, m, 4),
            ("edp", gather, "routed-expert weights per MoE layer (forward)", experts * 2, m, 2),
            ("edp", gather, "routed-expert weights per MoE layer (backward)", experts * 2, m, 2),
            ("edp", reduce, "routed-expert gradients per MoE layer", experts * 4, m, 2),
            ("dp-cp", gather, f"dense weights {ROOT_PURPOSE}", ROOT * 2, m, 4),
            ("dp-cp", reduce, f"dense gradients {ROOT_PURPOSE}", ROOT * 4, m, 4),
        ]
    )


def test_moe_units_count_every_moe_layer_of_the_stage() -> None:
    # Three MoE layers and no dense one: one unit kind per group, three units each: 3m per step, over the
    # expert-data-parallel group of 4 / ep 2 = 2 GPUs.
    m = 2
    p = plan(moe_model(layers=3, dense_layers=0), ParallelLayout(dp=4, ep=2), m=m)
    rows = dp_rows(p.stages[0].collectives)
    experts = [r for r in rows if r[0] == "edp"]
    assert experts == sorted(
        [
            (
                "edp",
                CollectiveOp.ALL_GATHER,
                "routed-expert weights per MoE layer (forward)",
                EXPERTS // 2 * 2,
                3 * m,
                2,
            ),
            (
                "edp",
                CollectiveOp.ALL_GATHER,
                "routed-expert weights per MoE layer (backward)",
                EXPERTS // 2 * 2,
                3 * m,
                2,
            ),
            ("edp", CollectiveOp.REDUCE_SCATTER, "routed-expert gradients per MoE layer", EXPERTS // 2 * 4, 3 * m, 2),
        ]
    )
    assert not [r for r in rows if r[2].endswith("per layer") or "per layer " in r[2]]


def test_moe_units_under_a_pipeline() -> None:
    # pp 2, 2 MoE layers, one per stage: gathered m + 1 times, reduced once on the last micro-batch.
    m = 4
    p = plan(moe_model(layers=2, dense_layers=0), ParallelLayout(dp=4, ep=2, pp=2), m=m)
    for stage in p.stages:
        experts = [r for r in dp_rows(stage.collectives) if r[0] == "edp"]
        assert experts == [
            (
                "edp",
                CollectiveOp.ALL_GATHER,
                "routed-expert weights per MoE layer (before every forward, and before the first backward after one)",
                EXPERTS // 2 * 2,
                m + 1,
                2,
            ),
            (
                "edp",
                CollectiveOp.REDUCE_SCATTER,
                "routed-expert gradients per MoE layer (last micro-batch)",
                EXPERTS // 2 * 4,
                1,
                2,
            ),
        ]


@pytest.mark.parametrize(
    ("overlap_grad_reduce", "overlap_param_gather", "reduce_overlap", "gather_overlap"),
    [(True, True, 0.5, 0.25), (False, True, 0.0, 0.25), (True, False, 0.5, 0.0), (False, False, 0.0, 0.0)],
    ids=["both", "no-grad-overlap", "no-gather-overlap", "neither"],
)
def test_overlap_fractions_follow_the_training_switches(
    *, overlap_grad_reduce: bool, overlap_param_gather: bool, reduce_overlap: float, gather_overlap: float
) -> None:
    assumptions = PlanAssumptions(dp_grad_reduce_overlap=0.5, dp_param_gather_overlap=0.25)
    p = plan(
        moe_model(),
        ParallelLayout(dp=4, ep=2),
        m=2,
        assumptions=assumptions,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
    )
    dp = [c for c in p.stages[0].collectives if c.axis == "dp"]
    assert {c.overlap_fraction for c in dp if c.op is CollectiveOp.REDUCE_SCATTER} == {reduce_overlap}
    assert {c.overlap_fraction for c in dp if c.op is CollectiveOp.ALL_GATHER} == {gather_overlap}


@pytest.mark.parametrize(("pp", "m"), [(1, 3), (3, 3)], ids=["no-pipeline", "pipeline"])
def test_root_gradients_share_the_window_of_the_layers_gradients(pp: int, m: int) -> None:
    # Without a pipeline every backward reduces (window: all backward); under one, the last micro-batch's backward.
    # With m = 3 the two windows differ, so the root's reduce-scatter must sit in the layers'.
    p = plan(moe_model(layers=3, dense_layers=3), ParallelLayout(dp=2, pp=pp), m=m)
    for stage in (p.stages[0], p.stages[-1]):
        reduces = [c for c in stage.collectives if c.axis == "dp" and c.op is CollectiveOp.REDUCE_SCATTER]
        root = [c for c in reduces if ROOT_PURPOSE in c.purpose]
        layers = [c for c in reduces if ROOT_PURPOSE not in c.purpose]
        assert len(root) == 1
        assert layers
        assert {c.overlap_window_seconds for c in layers} == {root[0].overlap_window_seconds}


def test_a_middle_stage_has_no_root_unit() -> None:
    # pp 3 over 3 layers: stage 1 holds one layer and neither the embedding nor the output layer.
    p = plan(moe_model(layers=3, dense_layers=3), ParallelLayout(dp=2, pp=3), m=3)
    middle = [c for c in p.stages[1].collectives if c.axis == "dp"]
    assert sorted((c.op, c.purpose, c.message_bytes, c.count_per_step) for c in middle) == sorted(
        [
            (
                CollectiveOp.ALL_GATHER,
                "dense weights per layer (before every forward, and before the first backward after one)",
                DENSE_LAYER * 2,
                4,
            ),
            (CollectiveOp.REDUCE_SCATTER, "dense gradients per layer (last micro-batch)", DENSE_LAYER * 4, 1),
        ]
    )


def test_a_root_unit_of_one_parameter_is_still_gathered() -> None:
    # hidden 1, vocab 1: the first stage's root is the 1x1 embedding (one parameter), the last stage's the final
    # norm and the 1x1 output layer (two). Each layer: q, k, v, o (4), gate, up, down (3), two norms (2) = 9.
    tiny = ModelConfig(
        name="unit", layers=2, hidden_size=1, attention_heads=1, ffn_hidden_size=1, vocab_size=1, seq_length=8
    )
    p = plan(tiny, ParallelLayout(dp=2, pp=2), m=2)
    for stage, root in zip(p.stages, (1, 2), strict=True):
        rows = [(c.op, c.purpose, c.message_bytes, c.count_per_step) for c in stage.collectives if c.axis == "dp"]
        assert sorted(rows) == sorted(
            [
                (
                    CollectiveOp.ALL_GATHER,
                    "dense weights per layer (before every forward, and before the first backward after one)",
                    9 * 2,
                    3,
                ),
                (CollectiveOp.REDUCE_SCATTER, "dense gradients per layer (last micro-batch)", 9 * 4, 1),
                (CollectiveOp.ALL_GATHER, f"dense weights {ROOT_PURPOSE}", root * 2, 1),
                (CollectiveOp.REDUCE_SCATTER, f"dense gradients {ROOT_PURPOSE}", root * 4, 1),
            ]
        )

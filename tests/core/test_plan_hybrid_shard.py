"""Hybrid sharding (HSDP, ``spec.training.dpShard``) in the planner: groups, links, messages, memory, and the spec.

Expected numbers are written from the rules of docs/planner.md ("Hybrid sharding"): the sharded state is split over
``dp_shard`` consecutive data-parallel ranks (times cp), and every reduce-scatter of dense gradients is followed by an
all-reduce of the shard it leaves across the ``dp / dp_shard`` replicas (FSDP's ``HYBRID_SHARD``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from meshscope.errors import PlanError, SpecError
from meshscope.jobs import spec_from_manifest
from meshscope.jobs.models import ModelConfig
from meshscope.jobs.spec import JobSpec, ParallelismConfig, TrainingConfig
from meshscope.plan import CollectiveOp, Plan, plan_job
from meshscope.plan.comms import hybrid_groups
from meshscope.topology.hardware import default_hardware
from meshscope.topology.layout import ParallelLayout

H, A, F, V, L = 1024, 16, 4096, 32000, 4
MODEL = ModelConfig(
    name="dense", layers=L, hidden_size=H, attention_heads=A, ffn_hidden_size=F, vocab_size=V, seq_length=2048
)


def plan(layout: ParallelLayout, *, nodes: int, **training: object) -> Plan:
    hardware = default_hardware("H100", nodes)  # 8 GPUs and one NVLink domain per node
    settings: dict[str, object] = {"micro_batch_size": 1, "global_batch_size": layout.dp * 4, "zero_stage": 3}
    spec = JobSpec(
        name="hsdp",
        model=MODEL,
        parallelism=ParallelismConfig(layout=layout),
        training=TrainingConfig(**{**settings, **training}),  # type: ignore[arg-type]
        hardware=hardware,
    )
    return plan_job(spec)


def test_shard_groups_are_consecutive_dp_ranks_and_replicate_groups_join_their_places() -> None:
    layout = ParallelLayout(dp=4, tp=2)  # rank = tp + 2*dp
    shard, replicate = hybrid_groups(layout, 2)
    assert sorted(map(tuple, shard.tolist())) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert sorted(map(tuple, replicate.tolist())) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    with_cp = ParallelLayout(dp=4, cp=2)  # rank = cp + 2*dp: a shard group holds every cp rank of its dp ranks
    shard, replicate = hybrid_groups(with_cp, 2)
    assert sorted(map(tuple, shard.tolist())) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert sorted(map(tuple, replicate.tolist())) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # every rank in exactly one group of each kind
    for groups in hybrid_groups(ParallelLayout(dp=8, tp=2, pp=2, cp=2), 4):
        assert np.array_equal(np.sort(groups.ravel()), np.arange(64))


def test_hsdp_keeps_the_sharded_traffic_inside_the_node_and_replicates_the_shards_over_the_network() -> None:
    layout = ParallelLayout(dp=16)  # 2 nodes of 8
    full = plan(layout, nodes=2)
    hybrid = plan(layout, nodes=2, dp_shard=8)
    full_dp = [c for c in full.stages[0].collectives if c.axis == "dp"]
    hybrid_dp = [c for c in hybrid.stages[0].collectives if c.axis == "dp"]
    assert {(c.group, c.link.value, c.group_size) for c in full_dp} == {("dp-cp", "network", 16)}
    sharded = [c for c in hybrid_dp if c.group == "dp-shard"]
    replicated = [c for c in hybrid_dp if c.group == "dp-replicate"]
    assert {(c.link.value, c.group_size) for c in sharded} == {("nvlink", 8)}
    assert {(c.link.value, c.group_size, c.op) for c in replicated} == {("network", 2, CollectiveOp.ALL_REDUCE)}
    # the same gathers and reduce-scatters, now in the shard group ...
    assert sorted((c.op, c.message_bytes, c.count_per_step) for c in sharded) == sorted(
        (c.op, c.message_bytes, c.count_per_step) for c in full_dp
    )
    # ... each reduce-scatter followed by an all-reduce of its shard across the replicas
    scatters = sorted((c.message_bytes, c.count_per_step) for c in sharded if c.op is CollectiveOp.REDUCE_SCATTER)
    shards = sorted((c.message_bytes, c.count_per_step) for c in replicated)
    assert [count for _, count in shards] == [count for _, count in scatters]
    assert [size for size, _ in shards] == [-(-size // 8) for size, _ in scatters]  # ceil(bytes / dp_shard)
    # over NVLink instead of the network: the exposed dp time falls
    assert hybrid.expected_step_time.exposed_comm_seconds["dp"] < full.expected_step_time.exposed_comm_seconds["dp"]


def test_hsdp_holds_a_shard_of_the_state_per_shard_group() -> None:
    layout = ParallelLayout(dp=16)
    full, hybrid = plan(layout, nodes=2), plan(layout, nodes=2, dp_shard=4)
    f, h = full.stages[0].resting_state, hybrid.stages[0].resting_state
    for field in ("weights_bytes", "gradients_bytes", "optimizer_bytes"):  # ZeRO-3: all three sharded, 16 -> 4
        assert getattr(h, field) == pytest.approx(4 * getattr(f, field), rel=1e-6)
    one = plan(layout, nodes=2, zero_stage=1, dp_shard=4).stages[0].resting_state
    whole = plan(layout, nodes=2, zero_stage=1).stages[0].resting_state
    assert one.weights_bytes == whole.weights_bytes  # ZeRO-1: only the optimizer state is sharded
    assert one.optimizer_bytes == pytest.approx(4 * whole.optimizer_bytes, rel=1e-6)


def test_dp_shard_equal_to_dp_is_plain_sharding() -> None:
    layout = ParallelLayout(dp=16)
    a, b = plan(layout, nodes=2), plan(layout, nodes=2, dp_shard=16)
    assert a.expected_step_time == b.expected_step_time
    assert [c.group for c in b.stages[0].collectives] == [c.group for c in a.stages[0].collectives]


def _manifest(**training: object) -> dict[str, object]:
    return {
        "apiVersion": "meshscope.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "hsdp"},
        "spec": {
            "model": {"preset": "llama3-8b"},
            "parallelism": {"tp": 1},
            "training": {"globalBatchSize": 64, **training},
            "hardware": {"gpu": "H100", "nodes": 2},
        },
    }


def test_the_spec_takes_dp_shard_and_refuses_what_cannot_run() -> None:
    spec = spec_from_manifest(_manifest(zeroStage=3, dpShard=8))
    assert spec.training.dp_shard == 8
    assert spec.training.hybrid_shard(spec.layout.dp) == 8
    with pytest.raises(SpecError, match=r"dpShard \(3\) .* must divide dp \(16\); use one of 1, 2, 4, 8, 16"):
        spec_from_manifest(_manifest(zeroStage=3, dpShard=3))
    with pytest.raises(SpecError, match=r"dpShard \(32\) .* must divide dp \(16\)"):
        spec_from_manifest(_manifest(zeroStage=3, dpShard=32))
    with pytest.raises(SpecError, match=r"nothing is sharded; set zeroStage \(1-3\) or distributedOptimizer"):
        spec_from_manifest(_manifest(dpShard=8))
    assert spec_from_manifest(_manifest(dpShard=16)).training.hybrid_shard(16) is None  # all of dp: not hybrid
    plain = replace(spec.training, dp_shard=None)
    assert plain.hybrid_shard(16) is None


def test_a_layout_whose_dp_the_shard_degree_does_not_divide_is_refused_by_name() -> None:
    # meshscope predict --layout ... plans the spec's training on another layout: dp 12 cannot hold shard groups of 8
    with pytest.raises(PlanError, match=r"dp_shard 8 does not divide dp 12: .* use a divisor of 12"):
        plan(ParallelLayout(dp=12, tp=2), nodes=3, dp_shard=8, global_batch_size=48)
    # a shard degree of dp or more is all of dp: plain sharding, as the spec's default
    wide = plan(ParallelLayout(dp=8), nodes=1, dp_shard=16)
    assert wide.expected_step_time == plan(ParallelLayout(dp=8), nodes=1).expected_step_time

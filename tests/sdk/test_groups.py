"""Axis attribution of process groups and their ids (pure: no torch, no processes)."""

from __future__ import annotations

import pytest

from meshscope.sdk.groups import (
    axis_of_name,
    implied_layout,
    infer_from_layout,
    infer_sub_axis,
    make_group,
    p2p_axis,
    p2p_group_id,
    sub_group_name,
)
from meshscope.topology.layout import MeshAxis, ParallelLayout


@pytest.mark.parametrize(
    ("name", "axis"),
    [
        ("tp", MeshAxis.TP),
        ("mesh_tp", MeshAxis.TP),
        ("dp_cp", MeshAxis.DP),
        ("mesh_dp_shard_cp", MeshAxis.DP),
        ("dp_replicate", MeshAxis.DP),
        ("mesh_shard", MeshAxis.DP),  # HSDP's (replicate, shard) mesh
        ("replicate", MeshAxis.DP),
        ("edp", MeshAxis.DP),
        ("expert_data_parallel", MeshAxis.DP),
        ("tensor_model_parallel", MeshAxis.TP),
        ("pipeline_model_parallel_group", MeshAxis.PP),
        ("context_parallel", MeshAxis.CP),
        ("expert_model_parallel", MeshAxis.EP),
        ("ep", MeshAxis.EP),
        ("default_pg", None),
        ("undefined", None),
        ("my_group", None),
    ],
    ids=str,
)
def test_group_names_map_to_axes(name: str, axis: MeshAxis | None) -> None:
    assert axis_of_name(name) is axis


LAYOUT = ParallelLayout(pp=2, dp=2, cp=1, tp=2, ep=2)  # 8 ranks, tp fastest: rank = tp + 2*dp + 4*pp


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        ((0, 1), ("tp", MeshAxis.TP)),
        ((4, 5), ("tp", MeshAxis.TP)),
        ((1, 3), ("dp", MeshAxis.DP)),  # dp and ep groups coincide here: dp wins, register ep explicitly
        ((2, 6), ("pp", MeshAxis.PP)),
        ((0, 1, 2, 3), None),  # tp x dp: no single axis
        ((0,), None),
    ],
    ids=["tp", "tp-stage1", "dp", "pp", "tp-dp", "single"],
)
def test_groups_without_names_are_recognised_from_the_layout(ranks, expected) -> None:
    assert infer_from_layout(LAYOUT, ranks) == expected


def test_combined_gradient_groups_are_attributed_to_dp() -> None:
    layout = ParallelLayout(dp=2, cp=2, tp=2)  # rank = tp + 2*cp + 4*dp
    assert infer_from_layout(layout, (0, 2, 4, 6)) == ("dp_cp", MeshAxis.DP)
    moe = ParallelLayout(dp=4, ep=2)  # expert dp over {0, 2} and {1, 3}; ep over {0, 1} and {2, 3}
    assert infer_from_layout(moe, (0, 2)) == ("edp", MeshAxis.DP)
    assert infer_from_layout(moe, (2, 3)) == ("ep", MeshAxis.EP)


def test_group_ids_come_from_the_first_member_and_p2p_ids_from_the_direction() -> None:
    assert make_group("tp", MeshAxis.TP, [5, 4]).group_id == "tp:4"
    assert make_group("dp_cp", MeshAxis.DP, [2, 6, 10]).group_id == "dp_cp:2"
    assert p2p_group_id(MeshAxis.PP, 3, 7) == "pp:3-7" != p2p_group_id(MeshAxis.PP, 7, 3)
    assert p2p_axis(LAYOUT, 1, 5) is MeshAxis.PP
    assert p2p_axis(LAYOUT, 0, 3) is None  # differs along tp and dp
    assert p2p_axis(None, 0, 4) is None


def test_a_job_that_says_nothing_implies_dp_over_the_world() -> None:
    # No MESHSCOPE_LAYOUT and nothing registered (a plain DDP/FSDP script): the world group is the dp group, as the
    # coords (dp = rank) already say; a smaller group is no layout group (infer_sub_axis would call it a part of
    # one, but the tracker asks only under a layout it was given: dp over the world is an assumption here), one
    # process has no groups to explain.
    layout = implied_layout(4)
    assert layout is not None
    assert infer_from_layout(layout, [0, 1, 2, 3]) == ("dp", MeshAxis.DP)
    assert infer_from_layout(layout, [0, 1]) is None
    assert infer_sub_axis(layout, [0, 1]) is MeshAxis.DP
    assert implied_layout(1) is None


@pytest.mark.parametrize(
    ("layout", "ranks", "axis"),
    [
        (ParallelLayout(dp=4), (0, 1), MeshAxis.DP),  # hybrid sharding: a shard group inside the dp group
        (ParallelLayout(dp=4), (1, 3), MeshAxis.DP),  # ... and a replicate group
        (ParallelLayout(dp=8, tp=2), (0, 4, 8), MeshAxis.DP),  # any part of one dp group
        (ParallelLayout(pp=4, tp=2), (0, 6), MeshAxis.PP),  # Megatron's embedding group: first and last stage
        (ParallelLayout(dp=2, cp=2, tp=2), (0, 2, 4), MeshAxis.DP),  # part of a dp_cp group
        (ParallelLayout(tp=8), (0, 1, 2, 3), MeshAxis.TP),
        (ParallelLayout(dp=4, tp=2), (0, 1, 2), None),  # tp and dp vary: no axis pays alone
        (ParallelLayout(dp=4), (2,), None),
        (ParallelLayout(dp=4), (0, 9), None),  # outside the world
    ],
    ids=["shard", "replicate", "strided-dp", "embedding", "dp-cp", "tp-half", "tp-dp", "single", "outside"],
)
def test_a_group_inside_one_axis_group_is_that_axis(layout, ranks, axis) -> None:
    assert infer_sub_axis(layout, ranks) is axis


def test_sub_groups_of_one_shape_share_a_name_and_differ_by_their_first_member() -> None:
    # FSDP's hybrid sharding over dp=4: shard groups {0,1}, {2,3} and replicate groups {0,2}, {1,3}. Rank 0 is in a
    # shard and a replicate group: their ids must differ, and every member must compute the same id for its group.
    shard = [sub_group_name(MeshAxis.DP, g) for g in ((0, 1), (2, 3))]
    replicate = [sub_group_name(MeshAxis.DP, g) for g in ((2, 0), (1, 3))]
    assert shard == ["dp_sub2s1"] * 2
    assert replicate == ["dp_sub2s2"] * 2
    ids = {
        make_group(n, MeshAxis.DP, g).group_id
        for n, g in zip(shard + replicate, ((0, 1), (2, 3), (0, 2), (1, 3)), strict=True)
    }
    assert ids == {"dp_sub2s1:0", "dp_sub2s1:2", "dp_sub2s2:0", "dp_sub2s2:1"}
    # not an arithmetic progression: a digest of the offsets, the same for a translated group
    assert (
        sub_group_name(MeshAxis.DP, (0, 1, 3))
        == sub_group_name(MeshAxis.DP, (4, 5, 7))
        != sub_group_name(MeshAxis.DP, (0, 2, 3))
    )
    # a group that describes itself keeps its name (a DeviceMesh dim "shard"); torch's "undefined" is no name
    assert sub_group_name(MeshAxis.DP, (0, 1), "mesh_shard") == "shard"
    assert sub_group_name(MeshAxis.DP, (0, 1), "undefined") == "dp_sub2s1"

"""Placement: which groups cross nodes, NVLink domains and network blocks."""

from __future__ import annotations

import numpy as np
import pytest

from meshscope.errors import LayoutError
from meshscope.topology.hardware import default_hardware
from meshscope.topology.layout import ParallelLayout
from meshscope.topology.placement import Link, Placement, axis_spans


def h100_placement(world: int) -> Placement:
    return Placement.default(world, gpus_per_node=8, nvlink_domain_gpus=8, nodes_per_network_block=4)


def test_tp8_on_8_gpu_nodes_stays_on_nvlink() -> None:
    layout = ParallelLayout(dp=4, tp=8, pp=2)  # 64 ranks, 8 nodes
    spans = axis_spans(layout, h100_placement(64))
    assert spans["tp"].groups == 8
    assert spans["tp"].groups_crossing_domains == 0
    assert spans["tp"].link is Link.NVLINK
    # dp groups stride over tp=8: each of the 4 members sits on its own node.
    assert spans["dp"].groups_crossing_nodes == spans["dp"].groups == 16
    assert spans["dp"].max_nodes_per_group == 4
    assert spans["dp"].link is Link.NETWORK
    # pp groups stride over tp*dp = 32 ranks = 4 nodes = one network block of 4 nodes: every pp group crosses blocks.
    assert spans["pp"].groups_crossing_blocks == 32


def test_tp16_on_8_gpu_nodes_crosses_every_group() -> None:
    layout = ParallelLayout(dp=2, tp=16)
    spans = axis_spans(layout, h100_placement(32))
    tp = spans["tp"]
    assert (tp.groups, tp.groups_crossing_domains, tp.max_domains_per_group) == (2, 2, 2)
    assert tp.example_crossing_group == tuple(range(16))
    assert tp.link is Link.NETWORK


def test_nvl72_domain_holds_tp_and_more() -> None:
    # GB200 NVL72: 4-GPU trays, 72-GPU domains -> 18 nodes per domain.
    layout = ParallelLayout(dp=18, tp=4, pp=2)  # 144 ranks, 2 domains
    placement = Placement.default(144, gpus_per_node=4, nvlink_domain_gpus=72, nodes_per_network_block=32)
    spans = axis_spans(layout, placement)
    assert spans["tp"].link is Link.NVLINK
    # dp groups stride 4 over 72 ranks: they cross nodes but stay in the NVLink domain.
    assert spans["dp"].groups_crossing_nodes == spans["dp"].groups
    assert spans["dp"].groups_crossing_domains == 0
    assert spans["pp"].groups_crossing_domains == spans["pp"].groups


def test_combined_gradient_groups() -> None:
    layout = ParallelLayout(dp=2, tp=2, cp=2, ep=2, pp=1)
    spans = axis_spans(layout, h100_placement(8))
    assert spans["dp-cp"].group_size == 4
    assert spans["edp"].group_size == layout.expert_dp == 2


def test_from_node_names_uses_labels() -> None:
    # Pods landed out of order: rank 1 on node b, ranks 0,2,3 on node a; a and b share one NVLink clique.
    placement = Placement.from_node_names(
        ["a", "b", "a", "a"], node_domains={"a": "uuid.1", "b": "uuid.1"}, node_blocks={"a": "leaf-1", "b": "leaf-2"}
    )
    assert placement.nodes == 2
    assert placement.node_name(1) == "b"
    layout = ParallelLayout(tp=2, dp=2)
    spans = axis_spans(layout, placement)
    assert spans["tp"].groups_crossing_nodes == 1  # [0, 1] crosses a->b; [2, 3] stays on a
    assert spans["tp"].groups_crossing_domains == 0  # same clique
    assert spans["tp"].groups_crossing_blocks == 1


def test_hardware_default_placement_matches_catalogue() -> None:
    hw = default_hardware("GB200", nodes=36)
    placement = Placement.for_hardware(hw.world_size, hw)
    assert np.unique(placement.domain_of_rank()).size == 2  # 144 GPUs / 72


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 12, "gpus_per_node": 8, "nvlink_domain_gpus": 8}, r"world size 12 does not fill whole 8-GPU"),
        ({"world_size": 16, "gpus_per_node": 8, "nvlink_domain_gpus": 12}, r"domain of 12 GPUs is not a whole number"),
        ({"world_size": 16, "gpus_per_node": 0, "nvlink_domain_gpus": 8}, r"gpus_per_node \(0\)"),
    ],
    ids=["partial-node", "domain-not-nodes", "zero"],
)
def test_bad_placement(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        Placement.default(nodes_per_network_block=4, **kwargs)


def test_placement_must_cover_layout() -> None:
    with pytest.raises(LayoutError, match="placement has 8 ranks but the layout"):
        axis_spans(ParallelLayout(dp=16), h100_placement(8))


def _nodes_of_2(world: int) -> Placement:
    return Placement.default(world, gpus_per_node=2, nvlink_domain_gpus=2, nodes_per_network_block=2)


def test_the_combined_gradient_groups_appear_only_when_both_degrees_exceed_one() -> None:
    # dp-cp needs cp > 1 and dp > 1; edp needs ep > 1 and expert dp > 1 (edp = tp·cp·dp / (etp·ep)).
    assert "dp-cp" not in axis_spans(ParallelLayout(dp=2, tp=2, cp=1), _nodes_of_2(4))
    assert "dp-cp" not in axis_spans(ParallelLayout(dp=1, tp=2, cp=2), _nodes_of_2(4))
    spans = axis_spans(ParallelLayout(dp=2, tp=2, cp=2), _nodes_of_2(8))
    # cp=2 then dp=2 in the default order (tp fastest): the dp-cp groups are {0, 2, 4, 6} and {1, 3, 5, 7}.
    assert (spans["dp-cp"].axis, spans["dp-cp"].groups, spans["dp-cp"].group_size) == ("dp-cp", 2, 4)
    # ep=2 of dp=2: expert dp = 2·2·1 / (2·2) = 1, no edp group; ep=2 of dp=4: expert dp 2.
    assert "edp" not in axis_spans(ParallelLayout(dp=2, tp=2, ep=2), _nodes_of_2(4))
    assert "edp" not in axis_spans(ParallelLayout(dp=2, tp=2, ep=1), _nodes_of_2(4))
    moe = axis_spans(ParallelLayout(dp=4, tp=2, ep=2), _nodes_of_2(8))
    assert (moe["edp"].axis, moe["edp"].group_size, moe["ep"].axis) == ("edp", 2, "ep")
    assert all(span.axis == key for key, span in moe.items())


def test_a_placement_that_does_not_add_up_is_refused_with_the_numbers() -> None:
    one = np.zeros(1, dtype=np.int64)
    two = np.zeros(2, dtype=np.int64)
    with pytest.raises(LayoutError, match=r"^placement: 1 network blocks given for 2 nodes; need one per node$"):
        Placement(node_of_rank=one, domain_of_node=two, block_of_node=one)
    with pytest.raises(LayoutError, match=r"^placement: a rank is placed on a node outside \[0, 2\)$"):
        Placement(node_of_rank=np.array([0, 2]), domain_of_node=two, block_of_node=two)
    with pytest.raises(LayoutError, match=r"outside \[0, 2\)"):
        Placement(node_of_rank=np.array([-1, 0]), domain_of_node=two, block_of_node=two)
    with pytest.raises(LayoutError, match=r"^placement: 1 node names for 2 nodes$"):
        Placement(node_of_rank=one, domain_of_node=two, block_of_node=two, node_names=("a",))
    assert Placement(node_of_rank=np.array([0, 1]), domain_of_node=two, block_of_node=two).nodes == 2


@pytest.mark.parametrize(
    ("gpus", "domain", "block"), [(0, 8, 4), (8, 0, 4), (8, 8, 0)], ids=["gpus", "domain", "block"]
)
def test_the_default_placement_refuses_a_zero_size_and_accepts_one(gpus: int, domain: int, block: int) -> None:
    with pytest.raises(LayoutError, match=r">= 1$"):
        Placement.default(8, gpus_per_node=gpus, nvlink_domain_gpus=domain, nodes_per_network_block=block)
    # Size 1 everywhere is valid: one GPU per node, one node per domain and per block.
    p = Placement.default(3, gpus_per_node=1, nvlink_domain_gpus=1, nodes_per_network_block=1)
    assert (p.node_of_rank.tolist(), p.domain_of_node.tolist(), p.block_of_node.tolist()) == (
        [0, 1, 2],
        [0, 1, 2],
        [0, 1, 2],
    )


def test_the_default_placement_counts_nodes_domains_and_blocks_in_whole_numbers() -> None:
    # 24 ranks on 4-GPU nodes: 6 nodes; 8-GPU domains: 2 nodes each; 4 nodes per block.
    p = Placement.default(24, gpus_per_node=4, nvlink_domain_gpus=8, nodes_per_network_block=4)
    assert p.node_of_rank.tolist() == [r // 4 for r in range(24)]
    assert p.domain_of_node.tolist() == [0, 0, 1, 1, 2, 2]
    assert p.block_of_node.tolist() == [0, 0, 0, 0, 1, 1]
    assert all(a.dtype.kind == "i" for a in (p.node_of_rank, p.domain_of_node, p.block_of_node))


def test_nodes_without_labels_are_their_own_domain_and_share_one_block() -> None:
    p = Placement.from_node_names(["x", "y", "x", "z"], node_domains={"x": "c1"}, node_blocks={"y": "leaf-9"})
    assert p.node_names == ("x", "y", "z")
    assert p.node_of_rank.tolist() == [0, 1, 0, 2]
    # y and z have no clique label: each is a domain of its own, apart from x's clique.
    assert p.domain_of_node.tolist() == [0, 1, 2]
    # Only y has a block label: x and z share the unlabelled block, y is alone under its leaf.
    assert p.block_of_node.tolist() == [0, 1, 0]
    bare = Placement.from_node_names(["x", "y"])
    assert (bare.domain_of_node.tolist(), bare.block_of_node.tolist()) == ([0, 1], [0, 0])

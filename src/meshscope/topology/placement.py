"""Placement: rank -> node -> NVLink domain -> network block, and which groups cross which boundary.

A layout says which ranks talk to each other; a placement says over what. The slowest hop a group's traffic crosses
is its **link**: ``nvlink`` when every member sits in one NVLink domain, ``network`` otherwise. Layouts live or die by
that: on a B200 NVLink gives ~900 GB/s per direction per GPU, the network ~50 GB/s.

The default placement fills nodes with consecutive ranks and domains with consecutive nodes, which is what a launcher
does with a node-rank-ordered host list. On Kubernetes the real placement comes from where pods landed (node labels);
that path builds a :class:`Placement` from explicit arrays.

Everything is vectorised over ranks: a 131,072-GPU layout is checked in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np

from meshscope.errors import LayoutError
from meshscope.topology.layout import AXES, MeshAxis, ParallelLayout

if TYPE_CHECKING:
    from collections.abc import Sequence

    from numpy.typing import NDArray

    from meshscope.topology.hardware import HardwareConfig


class Link(StrEnum):
    """The slowest hop a group's traffic crosses."""

    NVLINK = "nvlink"
    NETWORK = "network"


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Where every rank runs.

    Arrays are indexed by global rank (``node_of_rank``) or by node index (the rest).
    """

    node_of_rank: NDArray[np.int64]
    """Node index of each rank."""
    domain_of_node: NDArray[np.int64]
    """NVLink domain index of each node."""
    block_of_node: NDArray[np.int64]
    """Network block (leaf switch group) index of each node."""
    node_names: tuple[str, ...] = ()
    """Optional node names (Kubernetes node names); empty means ``node-<index>``."""

    def __post_init__(self) -> None:
        """Check the arrays agree with each other."""
        n_nodes = self.domain_of_node.shape[0]
        if self.block_of_node.shape[0] != n_nodes:
            raise LayoutError(
                f"placement: {self.block_of_node.shape[0]} network blocks given for {n_nodes} nodes; need one per node"
            )
        if self.node_of_rank.size and (self.node_of_rank.min() < 0 or self.node_of_rank.max() >= n_nodes):
            raise LayoutError(f"placement: a rank is placed on a node outside [0, {n_nodes})")
        if self.node_names and len(self.node_names) != n_nodes:
            raise LayoutError(f"placement: {len(self.node_names)} node names for {n_nodes} nodes")

    @property
    def world_size(self) -> int:
        """Ranks placed."""
        return int(self.node_of_rank.shape[0])

    @property
    def nodes(self) -> int:
        """Nodes in the placement."""
        return int(self.domain_of_node.shape[0])

    def node_name(self, node: int) -> str:
        """Name of node index ``node``."""
        return self.node_names[node] if self.node_names else f"node-{node}"

    def domain_of_rank(self) -> NDArray[np.int64]:
        """NVLink domain of each rank."""
        return self.domain_of_node[self.node_of_rank]

    def block_of_rank(self) -> NDArray[np.int64]:
        """Network block of each rank."""
        return self.block_of_node[self.node_of_rank]

    @classmethod
    def default(
        cls,
        world_size: int,
        *,
        gpus_per_node: int,
        nvlink_domain_gpus: int,
        nodes_per_network_block: int,
    ) -> Placement:
        """Consecutive ranks fill a node, consecutive nodes fill an NVLink domain and then a network block.

        Raises:
            LayoutError: if the domain is not a whole number of nodes or the world does not fill whole nodes.
        """
        if gpus_per_node < 1 or nvlink_domain_gpus < 1 or nodes_per_network_block < 1:
            raise LayoutError(
                f"placement needs gpus_per_node ({gpus_per_node}), nvlink_domain_gpus ({nvlink_domain_gpus}) and "
                f"nodes_per_network_block ({nodes_per_network_block}) >= 1"
            )
        if nvlink_domain_gpus % gpus_per_node:
            raise LayoutError(
                f"an NVLink domain of {nvlink_domain_gpus} GPUs is not a whole number of {gpus_per_node}-GPU nodes"
            )
        if world_size % gpus_per_node:
            raise LayoutError(f"world size {world_size} does not fill whole {gpus_per_node}-GPU nodes")
        nodes = world_size // gpus_per_node
        node_index = np.arange(nodes, dtype=np.int64)
        return cls(
            node_of_rank=np.arange(world_size, dtype=np.int64) // gpus_per_node,
            domain_of_node=node_index // (nvlink_domain_gpus // gpus_per_node),
            block_of_node=node_index // nodes_per_network_block,
        )

    @classmethod
    def for_hardware(cls, world_size: int, hardware: HardwareConfig) -> Placement:
        """The default placement on ``hardware``."""
        return cls.default(
            world_size,
            gpus_per_node=hardware.gpus_per_node,
            nvlink_domain_gpus=hardware.nvlink_domain_gpus,
            nodes_per_network_block=hardware.nodes_per_network_block,
        )

    @classmethod
    def from_node_names(
        cls,
        rank_nodes: Sequence[str],
        *,
        node_domains: dict[str, str] | None = None,
        node_blocks: dict[str, str] | None = None,
    ) -> Placement:
        """Build a placement from where each rank actually landed (node names), e.g. from pod scheduling.

        Args:
            rank_nodes: node name of every rank, indexed by rank.
            node_domains: NVLink domain label of each node (e.g. ``nvidia.com/gpu.clique``); missing means the node is
                its own domain.
            node_blocks: network block label of each node; missing means one block for all.
        """
        names: list[str] = list(dict.fromkeys(rank_nodes))
        index = {n: i for i, n in enumerate(names)}
        domain_labels = [(node_domains or {}).get(n, f"node:{n}") for n in names]
        block_labels = [(node_blocks or {}).get(n, "") for n in names]
        return cls(
            node_of_rank=np.array([index[n] for n in rank_nodes], dtype=np.int64),
            domain_of_node=_codes(domain_labels),
            block_of_node=_codes(block_labels),
            node_names=tuple(names),
        )


def _codes(labels: list[str]) -> NDArray[np.int64]:
    order = {lab: i for i, lab in enumerate(dict.fromkeys(labels))}
    return np.array([order[lab] for lab in labels], dtype=np.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupSpan:
    """How the process groups of one axis sit on the placement."""

    axis: str
    """Axis name, or a combined name such as ``dp-cp`` or ``edp``."""
    group_size: int
    """Ranks per group."""
    groups: int
    """Number of groups."""
    groups_crossing_nodes: int
    """Groups whose members sit on more than one node."""
    groups_crossing_domains: int
    """Groups whose members sit in more than one NVLink domain."""
    groups_crossing_blocks: int
    """Groups whose members sit under more than one network block (traffic crosses the spine)."""
    max_nodes_per_group: int
    """Most nodes any one group spans."""
    max_domains_per_group: int
    """Most NVLink domains any one group spans."""
    example_crossing_group: tuple[int, ...]
    """Ranks of one group that crosses an NVLink domain (empty if none does)."""

    @property
    def link(self) -> Link:
        """Slowest hop any group of this axis crosses."""
        return Link.NETWORK if self.groups_crossing_domains else Link.NVLINK


def span_of_groups(axis: str, groups: NDArray[np.int64], placement: Placement) -> GroupSpan:
    """Count how many of ``groups`` (shape ``(n_groups, size)``) cross nodes, NVLink domains and network blocks."""
    if groups.size and groups.max() >= placement.world_size:
        raise LayoutError(
            f"placement covers {placement.world_size} ranks but the {axis} groups reach rank {int(groups.max())}"
        )
    nodes = placement.node_of_rank[groups]
    domains = placement.domain_of_node[nodes]
    blocks = placement.block_of_node[nodes]
    cross_node = (nodes != nodes[:, :1]).any(axis=1)
    cross_domain = (domains != domains[:, :1]).any(axis=1)
    cross_block = (blocks != blocks[:, :1]).any(axis=1)
    crossing = np.nonzero(cross_domain)[0]
    return GroupSpan(
        axis=axis,
        group_size=int(groups.shape[1]),
        groups=int(groups.shape[0]),
        groups_crossing_nodes=int(cross_node.sum()),
        groups_crossing_domains=int(cross_domain.sum()),
        groups_crossing_blocks=int(cross_block.sum()),
        max_nodes_per_group=_max_distinct(nodes),
        max_domains_per_group=_max_distinct(domains),
        example_crossing_group=tuple(int(r) for r in groups[crossing[0]]) if crossing.size else (),
    )


def _max_distinct(values: NDArray[np.int64]) -> int:
    """Largest number of distinct values in any row."""
    if values.shape[1] <= 1:
        return 1
    s = np.sort(values, axis=1)
    return int(((s[:, 1:] != s[:, :-1]).sum(axis=1) + 1).max())


def axis_spans(layout: ParallelLayout, placement: Placement) -> dict[str, GroupSpan]:
    """Span of every enabled axis' groups, plus the gradient-reduction groups.

    Keys: the enabled axes (``dp``, ``tp``, ``pp``, ``cp``, ``ep``), ``dp-cp`` when cp > 1 (dense gradients are
    reduced over data and context parallel ranks together, as in Megatron-core) and ``edp`` when ep > 1 (routed-expert
    gradients are reduced over the expert-data-parallel group).
    """
    if placement.world_size != layout.world_size:
        raise LayoutError(
            f"placement has {placement.world_size} ranks but the layout {layout.describe()} has {layout.world_size}"
        )
    spans: dict[str, GroupSpan] = {}
    for axis in AXES:
        if layout.enabled(axis):
            spans[axis.value] = span_of_groups(axis.value, layout.groups(axis), placement)
    if layout.cp > 1 and layout.dp > 1:
        spans["dp-cp"] = span_of_groups("dp-cp", layout.groups(MeshAxis.DP, MeshAxis.CP), placement)
    if layout.ep > 1 and layout.expert_dp > 1:
        spans["edp"] = span_of_groups("edp", layout.groups(MeshAxis.DP, expert=True), placement)
    return spans

"""Which mesh axis a process group belongs to, and the job-unique id every member gives it.

A captured collective is only useful if it is attributed to an axis (dp, tp, pp, cp, ep) and joined with the same
collective on the other members. This module owns both decisions:

* **axis**: from an explicit registration (``tracker.register_groups({"tp": g})``), from a DeviceMesh group's
  description (``mesh_tp``, ``mesh_dp_cp``), from a Megatron-core group name (``tensor_model_parallel``), or, for
  groups nobody named, by comparing the group's ranks with the groups of the job's :class:`ParallelLayout`.
  Combined gradient-reduction groups (``dp_cp``, ``edp``) are attributed to ``dp``. Under a layout that was given, a
  group inside one layout group, its members differing along a single axis (dp and cp count as one, like ``dp_cp``),
  is a *sub-group* of that axis: hybrid sharding's shard and replicate groups (FSDP's ``HYBRID_SHARD``, HSDP over a
  2-D mesh), Megatron's embedding group across the first and last stage (pp). Groups no rule explains (the world
  group of a multi-axis job) are *unattributed*: their collectives are counted, not recorded.
* **id**: ``"<name>:<first member rank>"`` (e.g. ``tp:4``, ``dp_cp:0``), computed by every member from the same
  member list without talking. Groups of one name partition the ranks, so the first member is unique within a name.
  Point-to-point messages get a per-direction id ``"<axis>:<src>-<dst>"``.

Pure: no torch here (the tracker passes member ranks and descriptions in), and nothing raises on odd names.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshscope.errors import LayoutError
from meshscope.topology import MeshAxis, ParallelLayout

if TYPE_CHECKING:
    from collections.abc import Sequence

_EXACT: dict[str, MeshAxis | None] = {
    # Megatron-core parallel_state group names and torchtitan mesh names
    "tensor_model_parallel": MeshAxis.TP,
    "tensor_parallel": MeshAxis.TP,
    "expert_tensor_parallel": MeshAxis.TP,
    "etp": MeshAxis.TP,
    "pipeline_model_parallel": MeshAxis.PP,
    "pipeline_parallel": MeshAxis.PP,
    "data_parallel": MeshAxis.DP,
    "data_parallel_with_context_parallel": MeshAxis.DP,
    "data_parallel_with_cp": MeshAxis.DP,
    "expert_data_parallel": MeshAxis.DP,
    "expert_dp": MeshAxis.DP,
    "edp": MeshAxis.DP,
    "context_parallel": MeshAxis.CP,
    "expert_model_parallel": MeshAxis.EP,
    "expert_parallel": MeshAxis.EP,
    "world": None,
    "default_pg": None,
    "undefined": None,
}
_TOKENS: dict[str, MeshAxis] = {
    "dp": MeshAxis.DP,
    "data": MeshAxis.DP,
    "fsdp": MeshAxis.DP,
    "ddp": MeshAxis.DP,
    "hsdp": MeshAxis.DP,
    "shard": MeshAxis.DP,  # HSDP's (replicate, shard) mesh, as PyTorch's FSDP2 documents it
    "replicate": MeshAxis.DP,
    "tp": MeshAxis.TP,
    "tensor": MeshAxis.TP,
    "pp": MeshAxis.PP,
    "pipeline": MeshAxis.PP,
    "cp": MeshAxis.CP,
    "context": MeshAxis.CP,
    "ep": MeshAxis.EP,
    "expert": MeshAxis.EP,
    "moe": MeshAxis.EP,
}
_SPLIT = re.compile(r"[_\-\s.:/]+")


def axis_of_name(name: str) -> MeshAxis | None:
    """The axis a group name stands for, or ``None`` when the name says nothing about one.

    Exact names first (Megatron-core's ``tensor_model_parallel``, ``expert_data_parallel`` -> dp, ``edp``), then the
    first word that names an axis (``dp_cp`` -> dp, ``dp_shard`` -> dp, ``mesh_tp`` -> tp).
    """
    key = name.strip().lower().removeprefix("mesh_").removesuffix("_group")
    if key in _EXACT:
        return _EXACT[key]
    for token in _SPLIT.split(key):
        if token in _TOKENS:
            return _TOKENS[token]
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupInfo:
    """What the tracker knows about one process group."""

    name: str
    """Name the id is built from: the registered name, the mesh dim, or the axes the ranks vary along."""
    axis: MeshAxis | None
    """Axis its collectives are attributed to; ``None``: unattributed (counted, not recorded)."""
    ranks: tuple[int, ...]
    """Global ranks of the members, in group-rank order."""
    group_id: str
    """Job-unique id, ``"<name>:<first rank>"``."""
    dispatch_axis: MeshAxis | None = None
    """The axis of its all-to-alls where that is not :attr:`axis`: a group the layout makes both the dp and the ep
    group (ep carved out of all of dp) carries the dense gradients' all-reduce (dp) and the experts' token dispatch
    (ep). ``None``: every collective on it is :attr:`axis`'s."""

    @property
    def size(self) -> int:
        """Members."""
        return len(self.ranks)

    def global_rank(self, group_rank: int) -> int:
        """Global rank of member ``group_rank``."""
        return self.ranks[group_rank]


def make_group(
    name: str, axis: MeshAxis | None, ranks: Sequence[int], *, dispatch_axis: MeshAxis | None = None
) -> GroupInfo:
    """Build a :class:`GroupInfo` with its id ``"<name>:<min rank>"``."""
    members = tuple(int(r) for r in ranks)
    first = min(members) if members else 0
    return GroupInfo(name=name, axis=axis, ranks=members, group_id=f"{name}:{first}", dispatch_axis=dispatch_axis)


def dispatch_group_id(info: GroupInfo) -> str:
    """The group id its all-to-alls are recorded under where they are another axis' (a group is one axis')."""
    axis = info.dispatch_axis.value if info.dispatch_axis is not None else info.name
    first = min(info.ranks) if info.ranks else 0
    _, tilde, creation = info.group_id.partition("~")  # a later-created namesake's suffix stays
    return f"{axis}:{first}{tilde}{creation}"


def dispatch_axis_of(layout: ParallelLayout, axis: MeshAxis, ranks: Sequence[int]) -> MeshAxis | None:
    """:attr:`GroupInfo.dispatch_axis` of a group of ``axis`` (inferred or registered, dp or ep).

    ep where the layout makes the group dp's and ep's alike (ep carved out of all of dp); ``None`` otherwise.
    """
    if axis not in {MeshAxis.DP, MeshAxis.EP} or layout.ep < 2 or not ranks:
        return None
    members = sorted(int(r) for r in ranks)
    try:
        ep_group = layout.group_of(members[0], MeshAxis.EP)
        dp_group = layout.group_of(members[0], MeshAxis.DP)
    except LayoutError:
        return None
    return MeshAxis.EP if sorted(ep_group) == members == sorted(dp_group) else None


def infer_from_layout(layout: ParallelLayout, ranks: Sequence[int]) -> tuple[str, MeshAxis] | None:
    """Name and axis of the layout group whose members are exactly ``ranks``, or ``None``.

    Tries the single axes (dp, tp, pp, cp, ep), then the combined gradient-reduction groups ``dp_cp`` (dense) and
    ``edp`` (expert data parallel), both attributed to dp.
    """
    members = sorted(int(r) for r in ranks)
    if len(members) < 2 or members[-1] >= layout.world_size or members[0] < 0:
        return None
    candidates: list[tuple[str, MeshAxis, tuple[MeshAxis, ...], bool]] = [
        (a.value, a, (a,), False) for a in (MeshAxis.TP, MeshAxis.CP, MeshAxis.DP, MeshAxis.PP, MeshAxis.EP)
    ]
    candidates += [
        ("dp_cp", MeshAxis.DP, (MeshAxis.DP, MeshAxis.CP), False),
        ("edp", MeshAxis.DP, (MeshAxis.DP,), True),
    ]
    for name, axis, axes, expert in candidates:
        try:
            group = layout.group_of(members[0], *axes, expert=expert)
        except LayoutError:
            continue
        if len(group) == len(members) and sorted(group) == members:
            return name, axis
    return None


_SUB_AXES = (MeshAxis.PP, MeshAxis.DP, MeshAxis.TP, MeshAxis.CP)


def infer_sub_axis(layout: ParallelLayout, ranks: Sequence[int]) -> MeshAxis | None:
    """The axis of a group that lies inside one layout group, or ``None``.

    Its members differ along one axis only (dp and cp together count as dp, like the ``dp_cp`` group): it is a part
    of that axis's group, and its traffic that axis's. ``None`` for one member, members outside the world, or members
    that differ along several axes (tp and dp: no axis pays for it alone).
    """
    members = sorted({int(r) for r in ranks})
    if len(members) < 2 or members[0] < 0 or members[-1] >= layout.world_size:
        return None
    try:
        coords = [layout.coord(r) for r in members]
    except LayoutError:
        return None
    first = coords[0]
    varying = {a for a in _SUB_AXES if any(c[a] != first[a] for c in coords[1:])}
    if len(varying) == 1:
        return varying.pop()
    if varying == {MeshAxis.DP, MeshAxis.CP}:
        return MeshAxis.DP
    return None


def sub_group_name(axis: MeshAxis, ranks: Sequence[int], desc: str = "") -> str:
    """The name of a sub-group of ``axis``: its own description, else one shared by every group of its shape.

    A description is kept (``shard`` for a mesh dim ``mesh_shard``). Without one (none, or torch's ``undefined``):
    members ``first, first + s, ...`` (``n`` of them) give ``<axis>_sub<n>s<s>`` (``dp_sub2s1``); any other shape a
    short digest of the members' offsets from the first (``dp_sub3x5f2a1c``). Groups of one shape partition their
    ranks like the layout's own groups, so ``"<name>:<first member>"`` stays unique, and every member computes it from
    the same list.
    """
    key = desc.strip().removeprefix("mesh_")
    if key and key.lower() not in _EXACT:
        return key
    members = sorted({int(r) for r in ranks})
    offsets = [r - members[0] for r in members]
    stride = offsets[1] if len(offsets) > 1 else 0
    if all(o == i * stride for i, o in enumerate(offsets)):
        return f"{axis.value}_sub{len(members)}s{stride}"
    digest = zlib.crc32(",".join(map(str, offsets)).encode()) & 0xFFFFFF
    return f"{axis.value}_sub{len(members)}x{digest:06x}"


def implied_layout(world_size: int) -> ParallelLayout | None:
    """The layout a job implies when it gives none and registers nothing: data parallelism over the world.

    It matches the coords such a rank reports (``dp = rank``), so the world group (a plain DDP or FSDP script's
    default group) is the dp group; any smaller group stays unexplained. ``None`` for a single process.
    """
    return ParallelLayout(dp=world_size) if world_size > 1 else None


def p2p_axis(layout: ParallelLayout | None, rank: int, peer: int) -> MeshAxis | None:
    """The one axis along which ``rank`` and ``peer`` differ, or ``None`` (no layout, or several axes differ)."""
    if layout is None:
        return None
    try:
        a, b = layout.coord(rank), layout.coord(peer)
    except LayoutError:
        return None
    differ = [ax for ax in (MeshAxis.PP, MeshAxis.DP, MeshAxis.TP, MeshAxis.CP) if a[ax] != b[ax]]
    return differ[0] if len(differ) == 1 else None


def p2p_group_id(axis: MeshAxis, src: int, dst: int) -> str:
    """Id of the message stream from ``src`` to ``dst``: ``"pp:0-4"``; both sides compute the same one."""
    return f"{axis.value}:{src}-{dst}"

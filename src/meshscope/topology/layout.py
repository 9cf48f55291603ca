"""Parallel layouts: degrees of the five mesh axes and the rank <-> coord mapping.

This module is the one place where the rank order is defined. Everything else (planner, breakdown, sidecar tagging,
operator) asks a :class:`ParallelLayout` which coord a rank has and which ranks form a group; nobody recomputes strides.

Rank order
----------
The default order is Megatron-core's ``tp-cp-ep-dp-pp`` (``megatron/core/parallel_state.py``, ``RankGenerator``): the
first axis of the order varies fastest, so a tensor-parallel group is ``tp`` consecutive ranks and a pipeline group
strides over the whole of ``tp*cp*dp``. Any permutation of the five axes is accepted as ``order``.

Two generators share the order, as in Megatron-core:

* the **decoder** generator has degrees ``tp, cp, ep=1, dp, pp``; world size = ``tp*cp*dp*pp``. It defines the
  ``dp``, ``tp``, ``pp`` and ``cp`` coords and groups.
* the **expert** generator has degrees ``etp, cp=1, ep, edp, pp`` with ``edp = tp*cp*dp / (etp*ep)``: expert
  parallelism is carved out of ``dp*cp``. It defines the ``ep`` coord and groups and the expert-data-parallel groups
  (over which routed-expert gradients are reduced). ``etp`` (expert tensor parallel) defaults to ``tp``.

Megatron-core requires ``ep`` and ``dp`` to be adjacent in the order when both are used; so do we. With experts
sharded (``ep > 1`` or ``etp != tp``) the pipeline coord must agree between the two generators, which holds whenever
``pp`` comes after the axes whose degrees differ.

Nothing here knows about nodes or hardware (that is :mod:`meshscope.topology.placement`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np

from meshscope.errors import LayoutError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from numpy.typing import NDArray


class MeshAxis(StrEnum):
    """A device-mesh axis. Its size is a *degree*."""

    DP = "dp"
    TP = "tp"
    PP = "pp"
    CP = "cp"
    EP = "ep"


DEFAULT_ORDER: tuple[MeshAxis, ...] = (MeshAxis.TP, MeshAxis.CP, MeshAxis.EP, MeshAxis.DP, MeshAxis.PP)
"""Megatron-core's default rank order, fastest-varying axis first."""

AXES: tuple[MeshAxis, ...] = (MeshAxis.DP, MeshAxis.TP, MeshAxis.PP, MeshAxis.CP, MeshAxis.EP)
"""The axes in the order meshscope prints them."""


def parse_order(order: str | Sequence[str]) -> tuple[MeshAxis, ...]:
    """Parse a rank order such as ``"tp-cp-ep-dp-pp"``.

    Args:
        order: dash-separated axis names, fastest first, or a sequence of them.

    Returns:
        The order as a tuple of :class:`MeshAxis`.

    Raises:
        LayoutError: if the order is not a permutation of dp, tp, pp, cp, ep.
    """
    names = order.split("-") if isinstance(order, str) else list(order)
    valid = {a.value for a in MeshAxis}
    bad = [n for n in names if n not in valid]
    if bad:
        raise LayoutError(
            f"rank order {_fmt_order(names)!r} names unknown axes {bad}; use each of dp, tp, pp, cp, ep once, "
            f"e.g. 'tp-cp-ep-dp-pp'"
        )
    if sorted(names) != sorted(valid):
        missing = sorted(valid - set(names))
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise LayoutError(
            f"rank order {_fmt_order(names)!r} must name each of dp, tp, pp, cp, ep exactly once "
            f"(missing {missing}, repeated {dupes}), e.g. 'tp-cp-ep-dp-pp'"
        )
    return tuple(MeshAxis(n) for n in names)


def _fmt_order(names: Sequence[str]) -> str:
    return "-".join(str(n) for n in names)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCoord:
    """Where one rank sits on the mesh: its index along every axis."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int

    def __getitem__(self, axis: MeshAxis | str) -> int:
        """Index along ``axis``."""
        return int(getattr(self, MeshAxis(axis).value))

    def as_dict(self) -> dict[str, int]:
        """The coord as ``{"dp": .., "tp": .., "pp": .., "cp": .., "ep": ..}``."""
        return {a.value: self[a] for a in AXES}


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelLayout:
    """Degrees of the five mesh axes plus the virtual pipeline size and the rank order.

    Validation happens on construction; an instance always describes a layout that can exist.
    """

    dp: int = 1
    """Data-parallel degree (replicas, or ZeRO/FSDP shards). 1 disables it."""
    tp: int = 1
    """Tensor-parallel degree. 1 disables it."""
    pp: int = 1
    """Pipeline-parallel degree (stages). 1 disables it."""
    cp: int = 1
    """Context-parallel degree (sequence split inside attention). 1 disables it."""
    ep: int = 1
    """Expert-parallel degree; carved out of ``dp*cp``, so it does not change the world size. 1 disables it."""
    etp: int | None = None
    """Expert tensor-parallel degree; ``None`` means the same as ``tp`` (Megatron-core's default)."""
    vpp: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank, for the interleaved schedule. 1 means none."""
    order: tuple[MeshAxis, ...] = DEFAULT_ORDER
    """Rank order, fastest-varying axis first."""

    _decoder_strides: dict[MeshAxis, int] = field(init=False, repr=False, compare=False)
    _expert_strides: dict[MeshAxis, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Validate degrees and order; precompute strides."""
        for name in ("dp", "tp", "pp", "cp", "ep", "vpp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.etp is not None and (isinstance(self.etp, bool) or not isinstance(self.etp, int) or self.etp < 1):
            raise LayoutError(f"etp must be a whole number >= 1 (or unset to follow tp), got {self.etp!r}")
        order = parse_order(self.order)
        object.__setattr__(self, "order", order)
        if self.vpp > 1 and self.pp < 2:
            raise LayoutError(f"vpp ({self.vpp}) > 1 needs pipeline parallelism, but pp is {self.pp}")
        dense = self.tp * self.cp * self.dp
        if dense % (self.expert_tp * self.ep) != 0:
            raise LayoutError(
                f"expert parallelism is carved out of tp*cp*dp: etp*ep = {self.expert_tp}*{self.ep} = "
                f"{self.expert_tp * self.ep} must divide tp*cp*dp = {self.tp}*{self.cp}*{self.dp} = {dense}"
            )
        if self.ep > 1:
            i, j = order.index(MeshAxis.EP), order.index(MeshAxis.DP)
            if abs(i - j) != 1:
                raise LayoutError(
                    f"rank order {_fmt_order(order)!r}: ep and dp must be adjacent when ep > 1 "
                    f"(as Megatron-core requires), e.g. 'tp-cp-ep-dp-pp'"
                )
        dec = self._strides(self._decoder_degrees())
        exp = self._strides(self._expert_degrees())
        sharded_experts = self.ep > 1 or self.expert_tp != self.tp
        if self.pp > 1 and sharded_experts and dec[MeshAxis.PP] != exp[MeshAxis.PP]:
            raise LayoutError(
                f"rank order {_fmt_order(order)!r} with ep={self.ep}, etp={self.expert_tp}: the pipeline coord "
                f"would differ between dense and expert layers; put pp after tp, cp, ep and dp"
            )
        object.__setattr__(self, "_decoder_strides", dec)
        object.__setattr__(self, "_expert_strides", exp)

    # ---------------------------------------------------------------- sizes

    @property
    def world_size(self) -> int:
        """Number of ranks: ``dp*tp*pp*cp`` (ep is carved out of dp*cp)."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel degree (``etp``, defaulting to ``tp``)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel degree: ``tp*cp*dp / (etp*ep)``."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    def degree(self, axis: MeshAxis | str) -> int:
        """Degree of ``axis``."""
        return int(getattr(self, MeshAxis(axis).value))

    def enabled(self, axis: MeshAxis | str) -> bool:
        """Whether ``axis`` has a degree above 1."""
        return self.degree(axis) > 1

    @property
    def enabled_axes(self) -> tuple[MeshAxis, ...]:
        """Axes with degree above 1, in print order."""
        return tuple(a for a in AXES if self.enabled(a))

    def describe(self) -> str:
        """Short form, e.g. ``dp=8 tp=8 pp=4 cp=1 ep=1 vpp=1``."""
        parts = [f"{a.value}={self.degree(a)}" for a in AXES]
        if self.etp is not None and self.etp != self.tp:
            parts.append(f"etp={self.etp}")
        parts.append(f"vpp={self.vpp}")
        return " ".join(parts)

    # ---------------------------------------------------------------- generators

    def _decoder_degrees(self) -> dict[MeshAxis, int]:
        return {
            MeshAxis.TP: self.tp,
            MeshAxis.CP: self.cp,
            MeshAxis.EP: 1,
            MeshAxis.DP: self.dp,
            MeshAxis.PP: self.pp,
        }

    def _expert_degrees(self) -> dict[MeshAxis, int]:
        return {
            MeshAxis.TP: self.expert_tp,
            MeshAxis.CP: 1,
            MeshAxis.EP: self.ep,
            MeshAxis.DP: self.expert_dp,
            MeshAxis.PP: self.pp,
        }

    def _strides(self, degrees: Mapping[MeshAxis, int]) -> dict[MeshAxis, int]:
        strides: dict[MeshAxis, int] = {}
        stride = 1
        for axis in self.order:
            strides[axis] = stride
            stride *= degrees[axis]
        return strides

    # ---------------------------------------------------------------- rank <-> coord

    def coord(self, rank: int) -> RankCoord:
        """Coord of one global rank.

        Raises:
            LayoutError: if the rank is outside ``[0, world_size)``.
        """
        self._check_rank(rank)
        dec, dd = self._decoder_strides, self._decoder_degrees()
        idx = {a: (rank // dec[a]) % dd[a] for a in (MeshAxis.DP, MeshAxis.TP, MeshAxis.PP, MeshAxis.CP)}
        exp, ed = self._expert_strides, self._expert_degrees()
        ep = (rank // exp[MeshAxis.EP]) % ed[MeshAxis.EP]
        return RankCoord(dp=idx[MeshAxis.DP], tp=idx[MeshAxis.TP], pp=idx[MeshAxis.PP], cp=idx[MeshAxis.CP], ep=ep)

    def rank(self, coord: RankCoord | Mapping[str, int]) -> int:
        """Global rank of a coord (dp, tp, pp, cp define it; an ep index, if given, must agree).

        Raises:
            LayoutError: if an index is out of range or the ep index contradicts the others.
        """
        get = coord.__getitem__
        rank = 0
        for axis in (MeshAxis.DP, MeshAxis.TP, MeshAxis.PP, MeshAxis.CP):
            index = int(get(axis.value))
            if not 0 <= index < self.degree(axis):
                raise LayoutError(f"coord {axis.value}={index} is outside [0, {self.degree(axis)})")
            rank += index * self._decoder_strides[axis]
        ep_given = coord.ep if isinstance(coord, RankCoord) else coord.get("ep")
        if ep_given is not None and int(ep_given) != self.coord(rank).ep:
            raise LayoutError(
                f"coord ep={ep_given} contradicts dp/tp/pp/cp, which put the rank at ep={self.coord(rank).ep} "
                f"(ep is carved out of dp*cp)"
            )
        return rank

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside [0, {self.world_size}) for layout {self.describe()}")

    def coords_array(self, ranks: NDArray[np.int64] | None = None) -> dict[MeshAxis, NDArray[np.int64]]:
        """Vectorised :meth:`coord`: one integer array per axis, aligned with ``ranks`` (default: every rank)."""
        r = np.arange(self.world_size, dtype=np.int64) if ranks is None else np.asarray(ranks, dtype=np.int64)
        if r.size and (r.min() < 0 or r.max() >= self.world_size):
            raise LayoutError(f"ranks must lie in [0, {self.world_size}), got {int(r.min())}..{int(r.max())}")
        dec, dd = self._decoder_strides, self._decoder_degrees()
        out = {a: (r // dec[a]) % dd[a] for a in (MeshAxis.DP, MeshAxis.TP, MeshAxis.PP, MeshAxis.CP)}
        out[MeshAxis.EP] = (r // self._expert_strides[MeshAxis.EP]) % self.ep
        return out

    def ranks_array(self, coords: Mapping[MeshAxis, NDArray[np.int64]]) -> NDArray[np.int64]:
        """Vectorised :meth:`rank` (from dp, tp, pp, cp arrays; ep is ignored)."""
        rank: NDArray[np.int64] = np.zeros(np.shape(coords[MeshAxis.DP]), dtype=np.int64)
        for axis in (MeshAxis.DP, MeshAxis.TP, MeshAxis.PP, MeshAxis.CP):
            rank = rank + np.asarray(coords[axis], dtype=np.int64) * self._decoder_strides[axis]
        return rank

    # ---------------------------------------------------------------- groups

    def groups(self, *axes: MeshAxis | str, expert: bool = False) -> NDArray[np.int64]:
        """Process groups varying along ``axes`` (all other coords fixed), as Megatron-core's ``RankGenerator``.

        Args:
            axes: one or more axes; several give the combined group (``groups("dp", "cp")`` is Megatron's
                data-parallel-with-context-parallel group, over which dense gradients are reduced).
            expert: use the expert generator (``tp`` means etp, ``dp`` means expert-dp). ``ep`` always does.

        Returns:
            An array of shape ``(number of groups, group size)``; row ``i`` lists group ``i``'s ranks in rank order
            within the group, groups enumerated as Megatron-core enumerates them.
        """
        wanted = {MeshAxis(a) for a in axes}
        if not wanted:
            raise LayoutError("groups() needs at least one axis")
        use_expert = expert or MeshAxis.EP in wanted
        if use_expert and MeshAxis.CP in wanted:
            raise LayoutError("cp is not an axis of the expert generator (ep is carved out of dp*cp)")
        if not use_expert and MeshAxis.EP in wanted:  # pragma: no cover - guarded above
            raise LayoutError("ep groups come from the expert generator")
        degrees = self._expert_degrees() if use_expert else self._decoder_degrees()
        # C-order reshape puts the last dimension fastest, so reverse the (fastest-first) order.
        rev = list(reversed(self.order))
        grid = np.arange(self.world_size, dtype=np.int64).reshape([degrees[a] for a in rev])
        kept = [i for i, a in enumerate(rev) if a not in wanted]
        varied = [i for i, a in enumerate(rev) if a in wanted]
        size = math.prod(degrees[rev[i]] for i in varied)
        return grid.transpose(kept + varied).reshape(-1, size)

    def group_of(self, rank: int, *axes: MeshAxis | str, expert: bool = False) -> tuple[int, ...]:
        """The group along ``axes`` that ``rank`` belongs to."""
        self._check_rank(rank)
        g = self.groups(*axes, expert=expert)
        row = int(np.nonzero((g == rank).any(axis=1))[0][0])
        return tuple(int(x) for x in g[row])


_LAYOUT_TERM = re.compile(r"^\s*([a-z]+)\s*=\s*(\S+)\s*$")


def parse_layout(text: str, *, world_size: int | None = None) -> ParallelLayout:
    """Parse ``"dp=2,tp=2,pp=2"`` (the ``--layout`` flag).

    Axes left out have degree 1, except ``dp`` which, when ``world_size`` is given, takes the leftover ranks.

    Raises:
        LayoutError: on unknown keys, non-integers, or degrees that do not multiply to ``world_size``.
    """
    values: dict[str, int | str] = {}
    allowed = {"dp", "tp", "pp", "cp", "ep", "etp", "vpp", "order"}
    for term in filter(None, (t.strip() for t in text.split(","))):
        m = _LAYOUT_TERM.match(term)
        if not m or m.group(1) not in allowed:
            raise LayoutError(f"layout term {term!r} is not one of {sorted(allowed)} as key=value")
        key, raw = m.group(1), m.group(2)
        if key in values:
            raise LayoutError(f"layout names {key} twice")
        if key == "order":
            values[key] = raw
            continue
        try:
            values[key] = int(raw)
        except ValueError:
            raise LayoutError(f"layout {key}={raw!r} is not a whole number") from None
    degrees = {k: v for k, v in values.items() if isinstance(v, int)}
    if "dp" not in degrees and world_size is not None:
        rest = math.prod(degrees.get(a, 1) for a in ("tp", "pp", "cp"))
        if world_size % rest:
            raise LayoutError(f"tp*pp*cp = {rest} does not divide the world size {world_size}")
        degrees["dp"] = world_size // rest
    order = values.get("order")
    layout = ParallelLayout(
        dp=degrees.get("dp", 1),
        tp=degrees.get("tp", 1),
        pp=degrees.get("pp", 1),
        cp=degrees.get("cp", 1),
        ep=degrees.get("ep", 1),
        etp=degrees.get("etp"),
        vpp=degrees.get("vpp", 1),
        order=parse_order(str(order)) if order is not None else DEFAULT_ORDER,
    )
    if world_size is not None and layout.world_size != world_size:
        dense = layout.tp * layout.pp * layout.cp
        carved = (
            f" (ep is carved out of dp: it adds no ranks, dp counts the expert-parallel ranks too; for {world_size} "
            f"ranks dp={world_size // dense},ep={layout.ep})"
            if layout.ep > 1 and world_size % dense == 0 and (world_size // dense) % layout.ep == 0
            else ""
        )
        raise LayoutError(
            f"dp({layout.dp})*tp({layout.tp})*pp({layout.pp})*cp({layout.cp}) = {layout.world_size} "
            f"!= world size {world_size}{carved}"
        )
    return layout


def layout_text(layout: ParallelLayout) -> str:
    """``layout`` as ``--layout`` and ``MESHSCOPE_LAYOUT`` take it: :func:`parse_layout` of it gives ``layout`` back.

    ``dp=2,tp=2,pp=2,cp=1,ep=1``, plus etp, vpp and the order where they are not the default.
    """
    parts = [f"{a}={layout.degree(a)}" for a in ("dp", "tp", "pp", "cp", "ep")]
    if layout.etp is not None:
        parts.append(f"etp={layout.etp}")
    if layout.vpp != 1:
        parts.append(f"vpp={layout.vpp}")
    if layout.order != DEFAULT_ORDER:
        parts.append("order=" + "-".join(a.value for a in layout.order))
    return ",".join(parts)

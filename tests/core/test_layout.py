"""Layouts: rank <-> coord, groups with Megatron-core semantics, validation messages."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshscope.errors import LayoutError
from meshscope.topology.layout import DEFAULT_ORDER, MeshAxis, ParallelLayout, parse_layout, parse_order

LAYOUTS = {
    "dp8": ParallelLayout(dp=8),
    "tp2-pp4-dp2": ParallelLayout(dp=2, tp=2, pp=4),
    "tp2-cp2-dp2-pp2": ParallelLayout(dp=2, tp=2, pp=2, cp=2),
    "tp2-dp4-ep2-pp2": ParallelLayout(dp=4, tp=2, pp=2, ep=2),
    "tp2-cp2-dp4-ep4": ParallelLayout(dp=4, tp=2, cp=2, ep=4),
    "etp1-tp4-dp4-ep4": ParallelLayout(dp=4, tp=4, ep=4, etp=1, pp=2),
    "order-tp-dp-pp-cp-ep": ParallelLayout(dp=2, tp=2, pp=3, cp=2, order=parse_order("tp-dp-pp-cp-ep")),
    "order-pp-fastest": ParallelLayout(dp=3, tp=2, pp=2, order=parse_order("pp-tp-cp-ep-dp")),
}


def megatron_groups(world: int, sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Oracle: Megatron-core's masked orthogonal rank groups, written out with loops.

    ``sizes`` follow the order (fastest first); masked axes vary inside a group. Group index and in-group index are
    both decomposed fastest-first, as in ``megatron/core/parallel_state.py``.
    """
    masked = [s for s, m in zip(sizes, mask, strict=True) if m]
    unmasked = [s for s, m in zip(sizes, mask, strict=True) if not m]
    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]
    masked_strides = [d for d, m in zip(strides, mask, strict=True) if m]
    unmasked_strides = [d for d, m in zip(strides, mask, strict=True) if not m]

    def decompose(index: int, shape: list[int]) -> list[int]:
        out = []
        for s in shape:
            out.append(index % s)
            index //= s
        return out

    size = math.prod(masked)
    groups = []
    for g in range(world // size):
        base = sum(i * d for i, d in zip(decompose(g, unmasked), unmasked_strides, strict=True))
        groups.append(
            [base + sum(i * d for i, d in zip(decompose(r, masked), masked_strides, strict=True)) for r in range(size)]
        )
    return groups


def test_megatron_docstring_example() -> None:
    # Megatron-core initialize_model_parallel docstring: 16 GPUs, tp=2, pp=4 (so dp=2).
    layout = ParallelLayout(dp=2, tp=2, pp=4)
    assert layout.groups("tp").tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert layout.groups("dp").tolist() == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout.groups("pp").tolist() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_round_trip_every_rank(layout: ParallelLayout) -> None:
    for rank in range(layout.world_size):
        assert layout.rank(layout.coord(rank)) == rank
        assert layout.rank(layout.coord(rank).as_dict()) == rank
    coords = layout.coords_array()
    assert np.array_equal(layout.ranks_array(coords), np.arange(layout.world_size))


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_groups_match_megatron_rank_generator(layout: ParallelLayout) -> None:
    order = list(layout.order)
    dense = {
        MeshAxis.TP: layout.tp,
        MeshAxis.CP: layout.cp,
        MeshAxis.EP: 1,
        MeshAxis.DP: layout.dp,
        MeshAxis.PP: layout.pp,
    }
    expert = {
        MeshAxis.TP: layout.expert_tp,
        MeshAxis.CP: 1,
        MeshAxis.EP: layout.ep,
        MeshAxis.DP: layout.expert_dp,
        MeshAxis.PP: layout.pp,
    }
    for axes in ([MeshAxis.TP], [MeshAxis.DP], [MeshAxis.PP], [MeshAxis.CP], [MeshAxis.DP, MeshAxis.CP]):
        want = megatron_groups(layout.world_size, [dense[a] for a in order], [a in axes for a in order])
        assert layout.groups(*axes).tolist() == want, axes
    for axes in ([MeshAxis.EP], [MeshAxis.DP], [MeshAxis.TP]):
        want = megatron_groups(layout.world_size, [expert[a] for a in order], [a in axes for a in order])
        assert layout.groups(*axes, expert=True).tolist() == want, axes


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_group_members_share_every_other_coord(layout: ParallelLayout) -> None:
    coords = layout.coords_array()
    for axis in (MeshAxis.DP, MeshAxis.TP, MeshAxis.PP, MeshAxis.CP):
        groups = layout.groups(axis)
        assert groups.shape == (layout.world_size // layout.degree(axis), layout.degree(axis))
        assert sorted(groups.ravel().tolist()) == list(range(layout.world_size))
        for other in (MeshAxis.DP, MeshAxis.TP, MeshAxis.PP, MeshAxis.CP):
            values = coords[other][groups]
            if other == axis:
                assert (np.sort(values, axis=1) == np.arange(layout.degree(axis))).all()
            else:
                assert (values == values[:, :1]).all()
    ep_groups = layout.groups(MeshAxis.EP)
    assert (np.sort(coords[MeshAxis.EP][ep_groups], axis=1) == np.arange(layout.ep)).all()
    assert (coords[MeshAxis.PP][ep_groups] == coords[MeshAxis.PP][ep_groups][:, :1]).all()


def test_default_order_tp_consecutive_and_ep_carved_out_of_dp() -> None:
    layout = ParallelLayout(dp=4, tp=2, pp=2, ep=2)
    assert layout.order == DEFAULT_ORDER
    # EP groups stride over tp (ep comes right after tp and cp in the order) inside one pipeline stage.
    assert layout.groups("ep").tolist()[:2] == [[0, 2], [1, 3]]
    # Expert data parallel = tp*cp*dp/(etp*ep) = 2*1*4/(2*2) = 2 and strides over tp*ep = 4 ranks.
    assert layout.expert_dp == 2
    assert layout.groups("dp", expert=True).tolist()[:2] == [[0, 4], [1, 5]]
    assert layout.coord(5) == layout.coord(5)  # value object
    assert layout.coord(5).as_dict() == {"dp": 2, "tp": 1, "pp": 0, "cp": 0, "ep": 0}
    assert layout.coord(3).ep == 1


@settings(max_examples=150, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4, 8]),
    cp=st.sampled_from([1, 2]),
    dp=st.sampled_from([1, 2, 3, 4, 8]),
    pp=st.sampled_from([1, 2, 3, 4]),
    ep_choice=st.integers(0, 3),
    order=st.permutations(["tp", "cp", "ep", "dp", "pp"]),
    data=st.data(),
)
def test_round_trip_property(
    tp: int, cp: int, dp: int, pp: int, ep_choice: int, order: list[str], data: st.DataObject
) -> None:
    ep_options = [e for e in (1, 2, 4, 8) if (tp * cp * dp) % (tp * e) == 0]
    ep = ep_options[min(ep_choice, len(ep_options) - 1)]
    i, j = order.index("ep"), order.index("dp")
    if ep > 1 and abs(i - j) != 1:
        with pytest.raises(LayoutError, match="adjacent"):
            ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, order=parse_order("-".join(order)))
        return
    before_pp = order[: order.index("pp")]
    dense_before = math.prod({"tp": tp, "cp": cp, "ep": 1, "dp": dp}[a] for a in before_pp)
    expert_before = math.prod({"tp": tp, "cp": 1, "ep": ep, "dp": tp * cp * dp // (tp * ep)}[a] for a in before_pp)
    if pp > 1 and ep > 1 and dense_before != expert_before:
        with pytest.raises(LayoutError, match="pipeline coord would differ"):
            ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, order=parse_order("-".join(order)))
        return
    layout = ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, order=parse_order("-".join(order)))
    rank = data.draw(st.integers(0, layout.world_size - 1))
    coord = layout.coord(rank)
    assert layout.rank(coord) == rank
    vec = layout.coords_array(np.array([rank]))
    assert {a: int(v[0]) for a, v in vec.items()} == {MeshAxis(k): v for k, v in coord.as_dict().items()}


def test_vectorised_large_layout() -> None:
    layout = ParallelLayout(dp=256, tp=8, pp=16, cp=2, ep=8)  # 65,536 ranks
    coords = layout.coords_array()
    assert np.array_equal(layout.ranks_array(coords), np.arange(layout.world_size))
    sample = [0, 1, 4097, 65535, 31337]
    for r in sample:
        assert {a: int(coords[a][r]) for a in MeshAxis} == {
            MeshAxis(k): v for k, v in layout.coord(r).as_dict().items()
        }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, r"tp must be a whole number >= 1, got 0"),
        ({"dp": -2}, r"dp must be a whole number >= 1, got -2"),
        ({"pp": True}, r"pp must be a whole number >= 1, got True"),
        ({"vpp": 2}, r"vpp \(2\) > 1 needs pipeline parallelism, but pp is 1"),
        ({"dp": 3, "ep": 2}, r"etp\*ep = 1\*2 = 2 must divide tp\*cp\*dp = 1\*1\*3 = 3"),
        ({"dp": 2, "ep": 2, "order": ("tp", "ep", "cp", "dp", "pp")}, r"ep and dp must be adjacent"),
        ({"order": ("tp", "dp", "pp")}, r"must name each of dp, tp, pp, cp, ep exactly once \(missing \['cp', 'ep'\]"),
        ({"order": ("tp", "xp", "cp", "dp", "pp")}, r"unknown axes \['xp'\]"),
        (
            {"dp": 2, "tp": 2, "pp": 2, "etp": 1, "order": ("tp", "pp", "cp", "ep", "dp")},
            r"pipeline coord would differ",
        ),
    ],
    ids=[
        "tp0",
        "dp-negative",
        "bool",
        "vpp-no-pp",
        "ep-not-dividing",
        "ep-dp-apart",
        "order-missing",
        "order-unknown",
        "etp-pp-order",
    ],
)
def test_invalid_layouts_name_the_numbers(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        ParallelLayout(**kwargs)  # type: ignore[arg-type]


def test_coord_out_of_range() -> None:
    layout = ParallelLayout(dp=2, tp=2)
    with pytest.raises(LayoutError, match=r"rank 4 is outside \[0, 4\)"):
        layout.coord(4)
    with pytest.raises(LayoutError, match=r"coord tp=2 is outside \[0, 2\)"):
        layout.rank({"dp": 0, "tp": 2, "pp": 0, "cp": 0})
    ep_layout = ParallelLayout(dp=2, tp=1, ep=2)
    with pytest.raises(LayoutError, match="contradicts"):
        ep_layout.rank({"dp": 0, "tp": 0, "pp": 0, "cp": 0, "ep": 1})


def test_parse_layout() -> None:
    layout = parse_layout("tp=2, pp=2", world_size=8)
    assert (layout.dp, layout.tp, layout.pp, layout.cp, layout.ep) == (2, 2, 2, 1, 1)
    assert parse_layout("dp=2,tp=2,pp=2,vpp=2").vpp == 2
    with pytest.raises(LayoutError, match=r"dp\(2\)\*tp\(2\)\*pp\(2\)\*cp\(1\) = 8 != world size 16"):
        parse_layout("dp=2,tp=2,pp=2", world_size=16)
    with pytest.raises(LayoutError, match=r"= 2 != world size 4 \(ep is carved out of dp: .* for 4 ranks dp=4,ep=2\)"):
        parse_layout("dp=2,ep=2", world_size=4)  # an MoE user's first try: ep beside dp, not inside it
    with pytest.raises(LayoutError, match=r"layout tp='x' is not a whole number"):
        parse_layout("tp=x")
    with pytest.raises(LayoutError, match=r"'zz=2' is not one of"):
        parse_layout("zz=2")
    with pytest.raises(LayoutError, match="names tp twice"):
        parse_layout("tp=2,tp=4")
    with pytest.raises(LayoutError, match=r"tp\*pp\*cp = 3 does not divide the world size 8"):
        parse_layout("tp=3", world_size=8)


def test_describe_and_enabled_axes() -> None:
    layout = ParallelLayout(dp=8, tp=8, pp=4)
    assert layout.describe() == "dp=8 tp=8 pp=4 cp=1 ep=1 vpp=1"
    assert layout.enabled_axes == (MeshAxis.DP, MeshAxis.TP, MeshAxis.PP)
    assert layout.world_size == 256
    assert [layout.degree(a) for a in itertools.islice(MeshAxis, 5)] == [8, 8, 4, 1, 1]


def test_parse_layout_infers_dp_from_the_ranks_left_after_tp_pp_and_cp() -> None:
    # 16 ranks, tp=2 and cp=2 take 4 of every group: dp = 16 / (2·2) = 4 (cp counts, as in world = tp·cp·dp·pp).
    layout = parse_layout("tp=2,cp=2", world_size=16)
    assert (layout.dp, layout.tp, layout.pp, layout.cp) == (4, 2, 1, 2)
    # 32 ranks, tp=2, pp=2, cp=4: dp = 32 / 16 = 2.
    layout = parse_layout("tp=2,pp=2,cp=4", world_size=32)
    assert (layout.dp, layout.world_size) == (2, 32)
    # cp=3 leaves no whole dp on 8 ranks.
    with pytest.raises(LayoutError, match=r"tp\*pp\*cp = 6 does not divide the world size 8"):
        parse_layout("tp=2,cp=3", world_size=8)


def test_parse_layout_reads_every_key_it_accepts() -> None:
    # Each key the flag accepts lands in its own field; an order is parsed, the others left at their defaults.
    layout = parse_layout("dp=4,tp=2,ep=4,etp=1,order=tp-cp-ep-dp-pp")
    assert (layout.dp, layout.tp, layout.pp, layout.cp, layout.ep, layout.etp, layout.vpp) == (4, 2, 1, 1, 4, 1, 1)
    assert layout.order == DEFAULT_ORDER
    swapped = parse_layout("dp=2,tp=2,order=dp-tp-cp-ep-pp")
    assert swapped.order == (MeshAxis.DP, MeshAxis.TP, MeshAxis.CP, MeshAxis.EP, MeshAxis.PP)
    # dp varies fastest in that order: ranks 0 and 1 differ in dp, so the tp groups are {0, 2} and {1, 3}.
    assert swapped.groups("tp").tolist() == [[0, 2], [1, 3]]
    # Left out: every degree 1, etp following tp (None), the default order; with no world size dp stays 1.
    bare = parse_layout("")
    assert (bare.dp, bare.tp, bare.pp, bare.cp, bare.ep, bare.etp, bare.order) == (1, 1, 1, 1, 1, None, DEFAULT_ORDER)
    assert parse_layout("pp=2").dp == 1
    assert parse_layout("pp=2").tp == 1
    # A term after the order is still read (the order does not end the parse).
    assert parse_layout("order=tp-cp-ep-dp-pp,tp=2").tp == 2
    with pytest.raises(LayoutError, match="unknown axes"):
        parse_layout("order=tp-cp-ep-dp-zz")


def test_the_group_of_a_rank_is_the_row_of_its_groups_that_holds_it() -> None:
    # dp=2, tp=2, pp=2 in the default order (tp fastest, then dp, then pp): rank = tp + 2·dp + 4·pp.
    layout = ParallelLayout(dp=2, tp=2, pp=2)
    assert layout.group_of(5, "tp") == (4, 5)  # pp=1, dp=0: tp 0 and 1
    assert layout.group_of(5, "dp") == (5, 7)  # pp=1, tp=1: dp 0 and 1
    assert layout.group_of(5, "pp") == (1, 5)  # dp=0, tp=1: pp 0 and 1
    assert layout.group_of(5, "dp", "tp") == (4, 5, 6, 7)
    assert layout.group_of(0, "pp") == (0, 4)
    with pytest.raises(LayoutError):
        layout.group_of(8, "tp")
    # Expert groups: ep=2 carved out of dp=2 (etp = tp = 2): the ep group of rank 5 is its dp group.
    moe = ParallelLayout(dp=2, tp=2, pp=2, ep=2)
    assert moe.group_of(5, "ep") == (5, 7)
    assert moe.group_of(5, "tp", expert=True) == (4, 5)


def test_coords_and_ranks_arrays_invert_each_other_by_hand() -> None:
    # cp=2, tp=2, dp=2 in the default order tp-cp-ep-dp-pp: rank = tp + 2·cp + 4·dp.
    layout = ParallelLayout(dp=2, tp=2, cp=2)
    coords = layout.coords_array()
    assert coords[MeshAxis.TP].tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert coords[MeshAxis.CP].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert coords[MeshAxis.DP].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert coords[MeshAxis.PP].tolist() == [0] * 8
    assert coords[MeshAxis.EP].tolist() == [0] * 8
    some = layout.coords_array(np.array([6, 3], dtype=np.int64))
    assert (some[MeshAxis.TP].tolist(), some[MeshAxis.CP].tolist(), some[MeshAxis.DP].tolist()) == (
        [0, 1],
        [1, 1],
        [1, 0],
    )
    assert layout.ranks_array(coords).tolist() == list(range(8))
    one = np.array([1], dtype=np.int64)
    zero = np.array([0], dtype=np.int64)
    # dp=1, tp=1, cp=1 (pp=0): 4 + 1 + 2.
    assert layout.ranks_array({MeshAxis.DP: one, MeshAxis.TP: one, MeshAxis.PP: zero, MeshAxis.CP: one}).tolist() == [7]
    with pytest.raises(LayoutError, match=r"ranks must lie in \[0, 8\), got -1\.\.2"):
        layout.coords_array(np.array([-1, 2], dtype=np.int64))
    with pytest.raises(LayoutError, match=r"got 0\.\.8"):
        layout.coords_array(np.array([0, 8], dtype=np.int64))
    # The expert coord: ep=2 carved out of dp=2 (etp = tp = 2; expert order etp-cp-ep-edp-pp): rank = etp + 2·ep.
    moe = ParallelLayout(dp=2, tp=2, ep=2)
    assert moe.coords_array()[MeshAxis.EP].tolist() == [0, 0, 1, 1]


def test_groups_refuses_what_no_generator_has_in_so_many_words() -> None:
    layout = ParallelLayout(dp=2, tp=2, cp=2, ep=2)
    with pytest.raises(LayoutError, match=r"^groups\(\) needs at least one axis$"):
        layout.groups()
    with pytest.raises(
        LayoutError, match=r"^cp is not an axis of the expert generator \(ep is carved out of dp\*cp\)$"
    ):
        layout.groups("ep", "cp")
    assert layout.groups("tp").dtype == np.int64

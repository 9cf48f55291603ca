"""The step breakdown: hand-computed cases, a brute-force cross-check over random timelines, clock skew, notes."""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshscope.analysis.breakdown as engine
from meshscope.analysis.breakdown import (
    BUBBLE,
    CATEGORIES,
    CHECKPOINT,
    COMPUTE,
    DATA,
    OPTIMIZER,
    OTHER,
    SYNC_WAIT,
    TICKS_PER_US,
    TRANSFER,
    Breakdown,
    break_down,
    comm_category,
    estimate_clock_offsets,
)
from meshscope.errors import ParseError
from meshscope.records import Interval, Note, RecordTable, StepRecord, read_table
from meshscope.topology.layout import AXES, RankCoord

if TYPE_CHECKING:
    from collections.abc import Iterator

DATA_DIR = Path(__file__).parent.parent / "data"
MS = 1000  # µs per ms

DP_WAIT = comm_category("dp", SYNC_WAIT)
DP_XFER = comm_category("dp", TRANSFER)
TP_XFER = comm_category("tp", TRANSFER)
PP_XFER = comm_category("pp", TRANSFER)


# ---------------------------------------------------------------------------- builders


def rec(rank: int, intervals: list[Interval], *, end: int, start: int = 0, step: int = 0, node: str = "node-0", **kw):
    return StepRecord(
        job="t",
        step=step,
        rank=rank,
        coord=RankCoord(dp=rank, tp=0, pp=0, cp=0, ep=0),
        node=node,
        start_us=start,
        end_us=end,
        intervals=tuple(intervals),
        **kw,
    )


def compute(s: int, e: int) -> Interval:
    return Interval(kind="compute", start_us=s, end_us=e, phase="forward")


def span(kind: str, s: int, e: int) -> Interval:
    return Interval(kind=kind, start_us=s, end_us=e)


def coll(s: int, e: int, *, axis: str = "dp", group: str = "dp:0", seq: int = 0, op: str = "all_reduce", **kw):
    return Interval(kind="comm", start_us=s, end_us=e, axis=axis, op=op, group=group, seq=seq, **kw)


def recv(s: int, e: int, *, size: int | None = None, peer: int = 1, axis: str = "pp") -> Interval:
    return Interval(kind="p2p", start_us=s, end_us=e, axis=axis, op="recv", peer=peer, size_bytes=size)


def rows(b: Breakdown) -> dict[tuple[int, int], dict]:
    return {(r["rank"], r["step"]): r for r in b.to_rows()}


def assert_sums_exact(b: Breakdown) -> None:
    assert (b.ticks >= 0).all()
    np.testing.assert_array_equal(b.ticks.sum(axis=1), b.step_us * TICKS_PER_US)


# ---------------------------------------------------------------------------- hand-made cases


def test_dp8_straggler_scenario_file():
    """tests/data/dp8_straggler: 8 DP ranks on 2 nodes, 2 steps; rank 2 is 5 ms late into the step-0 all-reduce.

    Every rank: data 0-6 ms, forward 6-16, backward 16-32 (rank 2 in step 0: 16-37), all-reduce from its backward
    end to 47 (10 ms of transfer once rank 2 arrives at 37), optimizer 47-49. Step 1: nobody late, all-reduce 32-42,
    optimizer 42-44.
    """
    b = break_down(read_table(DATA_DIR / "dp8_straggler" / "records.jsonl"))
    assert_sums_exact(b)
    r = rows(b)
    for rank in range(8):
        step0 = r[(rank, 0)]
        assert step0["step_us"] == 49 * MS
        assert step0[DATA] == 6 * MS
        assert step0[OPTIMIZER] == 2 * MS
        assert step0[DP_XFER] == 10 * MS  # 37 -> 47
        assert step0[OTHER] == 0
        if rank == 2:
            assert step0[COMPUTE] == (10 + 21) * MS
            assert step0[DP_WAIT] == 0
            assert step0["wait_caused.dp"] == pytest.approx(7 * 5 * MS)  # seven others wait 5 ms each
        else:
            assert step0[COMPUTE] == (10 + 16) * MS
            assert step0[DP_WAIT] == 5 * MS  # arrived at 32, last arrival at 37
            assert step0["wait_caused.dp"] == 0
        step1 = r[(rank, 1)]
        assert (step1[COMPUTE], step1[DP_XFER], step1[DP_WAIT], step1["wait_caused.dp"]) == (26 * MS, 10 * MS, 0, 0)
    join = b.collectives
    assert len(join) == 2
    first = int(np.flatnonzero(join.seq == 0)[0])
    assert join.last_rank[first] == 2
    assert join.last_arrival_us[first] - join.first_arrival_us[first] == 5 * MS
    assert join.wait_caused_us[first] == pytest.approx(35 * MS)
    assert join.complete.all()
    assert b.table.node_name(int(b.table.steps.node[join.last_row[first]])) == "node-0"


def test_collective_fully_under_compute_costs_nothing():
    b = break_down(RecordTable.from_records([rec(0, [compute(0, 20), coll(5, 15, axis="tp", group="tp:0")], end=30)]))
    (r,) = b.to_rows()
    assert r[COMPUTE] == 20
    assert all(r[comm_category(a, p)] == 0 for a in AXES for p in (TRANSFER, SYNC_WAIT))
    assert r[OTHER] == 10


def test_two_axes_overlapping_in_idle_time_share_it_equally():
    # tp 0-10 alone 0-4, shared 4-10 (6 µs, 3 each); dp alone 10-14: tp = 4 + 3, dp = 3 + 4.
    ivs = [coll(0, 10, axis="tp", group="tp:0"), coll(4, 14, axis="dp", group="dp:0")]
    (r,) = break_down(RecordTable.from_records([rec(0, ivs, end=14)])).to_rows()
    assert r[TP_XFER] == 7
    assert r[DP_XFER] == 7
    assert r[OTHER] == 0


def test_three_channels_share_exactly_in_ticks():
    # dp, tp and pipeline p2p all run 0-1 µs: one third of a µs each, which is 20 ticks, no rounding anywhere.
    ivs = [coll(0, 1, axis="tp", group="tp:0"), coll(0, 1, axis="dp", group="dp:0"), recv(0, 1, size=0)]
    b = break_down(RecordTable.from_records([rec(0, ivs, end=1)]), p2p_bandwidth_bytes_per_s=1e9)
    i = {c: k for k, c in enumerate(CATEGORIES)}
    assert b.ticks[0, i[TP_XFER]] == b.ticks[0, i[DP_XFER]] == b.ticks[0, i[BUBBLE]] == 20
    assert_sums_exact(b)


def test_p2p_transfer_is_bytes_over_bandwidth_and_the_rest_is_bubble():
    # recv waits 10-30 ms; 5 MB at 1 GB/s = 5 ms of transfer at the end; 15 ms of bubble before it.
    ivs = [compute(0, 10 * MS), recv(10 * MS, 30 * MS, size=5_000_000), compute(30 * MS, 40 * MS)]
    table = RecordTable.from_records([rec(0, ivs, end=40 * MS)])
    (r,) = break_down(table, p2p_bandwidth_bytes_per_s=1e9).to_rows()
    assert (r[COMPUTE], r[PP_XFER], r[BUBBLE], r[OTHER]) == (20 * MS, 5 * MS, 15 * MS, 0)
    # Without a bandwidth the whole wait is bubble, and a note says why.
    b = break_down(table)
    assert b.to_rows()[0][BUBBLE] == 20 * MS
    (note,) = [n for n in b.notes if n.code == "p2p_without_bandwidth"]
    assert note.count == 1
    assert "--spec FILE" in note.message  # what a user of meshscope run or analyze can do about it


def send(s: int, e: int, *, size: int | None = None, peer: int = 0) -> Interval:
    return Interval(kind="p2p", start_us=s, end_us=e, axis="pp", op="send", peer=peer, size_bytes=size)


def test_without_a_bandwidth_a_p2p_transfer_is_measured_against_its_other_end():
    # Stage 1 (rank 1) computes 0-10 ms and sends 10-12 ms; stage 0 (rank 0) posted its receive at 2 ms, which
    # completes at 12 ms: 8 ms waiting for the other stage (bubble), 2 ms moving bytes (transfer), on both ends.
    # Step 1: the receive is posted at 15 ms, after the send (10-11 ms, handed off eagerly) ended: the send waited
    # for no one (1 ms of transfer), the receive copies 15-16 ms (transfer). Before: all of it bubble, and noted.
    r0 = [
        rec(0, [recv(2 * MS, 12 * MS, size=10**6)], end=12 * MS),
        rec(0, [recv(15 * MS, 16 * MS)], end=16 * MS, step=1),
    ]
    r1 = [
        rec(1, [compute(0, 10 * MS), send(10 * MS, 12 * MS, size=10**6)], end=12 * MS),
        rec(1, [compute(0, 10 * MS), send(10 * MS, 11 * MS)], end=16 * MS, step=1),
    ]
    b = break_down(RecordTable.from_records([*r0, *r1]), align_clocks=False)
    got = rows(b)
    assert (got[0, 0][BUBBLE], got[0, 0][PP_XFER]) == (8 * MS, 2 * MS)
    assert (got[1, 0][BUBBLE], got[1, 0][PP_XFER], got[1, 0][COMPUTE]) == (0, 2 * MS, 10 * MS)
    assert (got[0, 1][BUBBLE], got[0, 1][PP_XFER]) == (0, 1 * MS)
    assert (got[1, 1][BUBBLE], got[1, 1][PP_XFER]) == (0, 1 * MS)
    assert not [n for n in b.notes if n.code == "p2p_without_bandwidth"]
    assert_sums_exact(b)


def test_a_send_waited_on_at_the_end_of_the_step_moved_bytes_only_until_its_receive_had_them():
    # The interleaved 1F1B schedule waits its sends' handles at the end of the step. Rank 1 sends at 10 ms (waited
    # at 40 ms); rank 0's receive, posted at 5 ms, has the bytes at 12 ms. Rank 1 then idles in a receive from
    # 20 ms until rank 0 sends at 38 ms (done at 40 ms). Rank 1's 30 ms without compute: its send moved bytes
    # 10-12 ms and its receive 38-40 ms, the rest it waited for the other stage. Before, the send's 30 ms was
    # transfer and the bubble 0 (a clean interleaved run: pp transfer 45 ms a step, bubble 0).
    r0 = [
        rec(0, [recv(5 * MS, 12 * MS, peer=1), compute(12 * MS, 38 * MS), send(38 * MS, 40 * MS, peer=1)], end=40 * MS)
    ]
    r1 = [rec(1, [compute(0, 10 * MS), send(10 * MS, 40 * MS), recv(20 * MS, 40 * MS)], end=40 * MS)]
    b = break_down(RecordTable.from_records([*r0, *r1]), align_clocks=False)
    got = rows(b)
    assert got[1, 0][PP_XFER] + got[1, 0][BUBBLE] == 30 * MS
    assert got[1, 0][PP_XFER] <= 4 * MS, got[1, 0]
    assert_sums_exact(b)


def test_p2p_bandwidth_by_link_and_per_interval_array():
    # Rank 0 receives from rank 1 (same NVLink domain: 100 B/µs) and from rank 2 (other domain: 10 B/µs).
    r0 = rec(0, [recv(0, 100, size=1000, peer=1), recv(100, 300, size=1000, peer=2)], end=300, nvlink_domain="a")
    r1 = rec(1, [], end=300, nvlink_domain="a")
    r2 = rec(2, [], end=300, nvlink_domain="b")
    table = RecordTable.from_records([r0, r1, r2])
    by_link = break_down(table, p2p_bandwidth_bytes_per_s={"nvlink": 100e6, "network": 10e6}).to_rows()[0]
    assert (by_link[PP_XFER], by_link[BUBBLE]) == (10 + 100, 90 + 100)
    per_interval = break_down(table, p2p_bandwidth_bytes_per_s=np.array([100e6, 10e6])).to_rows()[0]
    assert per_interval[PP_XFER] == by_link[PP_XFER]
    by_callable = break_down(table, p2p_bandwidth_bytes_per_s=lambda ranks, peers: np.where(peers == 1, 100e6, 10e6))
    assert by_callable.to_rows()[0][PP_XFER] == by_link[PP_XFER]


@pytest.mark.parametrize(
    ("bandwidth", "message"),
    [
        (np.array([1.0, 2.0, 3.0]), "expected (2,), one value per interval"),
        ({"nvlink": 1e9}, "it needs ['network', 'nvlink']"),
        (-5.0, "it must be a positive number"),
    ],
    ids=["array-shape", "mapping-keys", "negative"],
)
def test_bad_bandwidth_arguments_are_errors(bandwidth, message):
    table = RecordTable.from_records([rec(0, [recv(0, 10, size=10), recv(10, 20, size=10)], end=20)])
    with pytest.raises(ParseError, match=re.escape(message)):
        break_down(table, p2p_bandwidth_bytes_per_s=bandwidth)


def test_non_pp_p2p_is_exposed_transfer_of_its_axis():
    (r,) = break_down(RecordTable.from_records([rec(0, [recv(0, 8, size=1, axis="cp")], end=8)])).to_rows()
    assert r[comm_category("cp", TRANSFER)] == 8
    assert r[BUBBLE] == 0


def test_precedence_compute_comm_optimizer_checkpoint_data():
    # data 0-10, checkpoint 2-10, optimizer 4-10, collective 6-10, compute 8-10:
    # data 0-2, checkpoint 2-4, optimizer 4-6, dp transfer 6-8, compute 8-10.
    ivs = [span("data", 0, 10), span("checkpoint", 2, 10), span("optimizer", 4, 10), coll(6, 10), compute(8, 10)]
    (r,) = break_down(RecordTable.from_records([rec(0, ivs, end=12)])).to_rows()
    assert (r[DATA], r[CHECKPOINT], r[OPTIMIZER], r[DP_XFER], r[COMPUTE], r[OTHER]) == (2, 2, 2, 2, 2, 2)


def test_sync_wait_counts_only_its_exposed_part_and_is_charged_as_such():
    # Rank 0 enters at 10 but computes until 12; rank 1 enters at 15; both finish at 20.
    # Rank 0: sync wait 12-15 = 3 (not 5), transfer 15-20 = 5. Rank 1 caused 3 µs of waiting.
    r0 = rec(0, [compute(0, 12), coll(10, 20)], end=20)
    r1 = rec(1, [compute(0, 15), coll(15, 20)], end=20)
    b = break_down(RecordTable.from_records([r0, r1]))
    r = rows(b)
    assert (r[(0, 0)][DP_WAIT], r[(0, 0)][DP_XFER]) == (3, 5)
    assert (r[(1, 0)][DP_WAIT], r[(1, 0)][DP_XFER]) == (0, 5)
    assert r[(1, 0)]["wait_caused.dp"] == pytest.approx(3)
    assert b.collectives.wait_caused_us[0] == pytest.approx(3)


def test_tied_last_members_share_the_charge():
    # Ranks 1 and 2 both arrive at 10; rank 0 waits 6 (4-10): each of them is charged 3.
    table = RecordTable.from_records(
        [rec(0, [coll(4, 15)], end=15), rec(1, [coll(10, 15)], end=15), rec(2, [coll(10, 15)], end=15)]
    )
    b = break_down(table)
    r = rows(b)
    assert r[(0, 0)][DP_WAIT] == 6
    assert r[(1, 0)]["wait_caused.dp"] == pytest.approx(3)
    assert r[(2, 0)]["wait_caused.dp"] == pytest.approx(3)
    assert (b.collectives.n_last[0], b.collectives.last_rank[0]) == (2, 1)


def test_concurrent_collectives_of_one_axis_split_the_wait_between_them():
    # Rank 0 waits in an all-gather (group A, rank 1 arrives at 4) and a reduce-scatter (group B, rank 2 arrives
    # at 6) at once. 0-4: both wait -> dp sync wait, 2 µs charged to each; 4-10: A moves bytes -> the dp channel is
    # transfer, so B's remaining wait 4-6 is hidden behind A's transfer and charged to nobody.
    r0 = rec(0, [coll(0, 10, group="A", op="all_gather"), coll(0, 10, group="B", op="reduce_scatter")], end=10)
    r1 = rec(1, [coll(4, 10, group="A", op="all_gather")], end=10)
    r2 = rec(2, [coll(6, 10, group="B", op="reduce_scatter")], end=10)
    b = break_down(RecordTable.from_records([r0, r1, r2]))
    r = rows(b)
    assert (r[(0, 0)][DP_WAIT], r[(0, 0)][DP_XFER]) == (4, 6)
    assert r[(1, 0)]["wait_caused.dp"] == pytest.approx(2)
    assert r[(2, 0)]["wait_caused.dp"] == pytest.approx(2)


def test_missing_members_mean_no_sync_wait_split_and_a_note():
    # group_size says 3, only ranks 0 and 1 reported: rank 0's wait 0-5 cannot be attributed -> all transfer.
    table = RecordTable.from_records(
        [rec(0, [coll(0, 10, group_size=3)], end=10), rec(1, [coll(5, 10, group_size=3)], end=10)]
    )
    b = break_down(table)
    r = rows(b)
    assert (r[(0, 0)][DP_XFER], r[(0, 0)][DP_WAIT]) == (10, 0)
    assert r[(1, 0)]["wait_caused.dp"] == 0
    assert not b.collectives.complete[0]
    assert b.collectives.last_rank[0] == -1
    (note,) = [n for n in b.notes if n.code == "incomplete_collectives"]
    assert note.count == 1
    assert "2 of 3" in note.message


def test_inferred_group_size_marks_instances_with_fewer_members_incomplete():
    # seq 0 has two members, seq 1 only one (rank 1's record for step 1 is missing from the input).
    table = RecordTable.from_records(
        [
            rec(0, [coll(0, 10, seq=0)], end=10),
            rec(1, [coll(4, 10, seq=0)], end=10),
            rec(0, [coll(10, 20, seq=1)], start=10, end=20, step=1),
        ]
    )
    b = break_down(table)
    assert b.collectives.complete.tolist() == [True, False]
    assert rows(b)[(0, 1)][DP_XFER] == 10


def test_rank_step_without_intervals_is_all_other():
    b = break_down(RecordTable.from_records([rec(0, [], end=17), rec(1, [compute(0, 3)], end=5)]))
    r = rows(b)
    assert r[(0, 0)][OTHER] == 17
    assert sum(r[(0, 0)][c] for c in CATEGORIES) == 17
    assert (r[(1, 0)][COMPUTE], r[(1, 0)][OTHER]) == (3, 2)


def test_intervals_sticking_out_are_clipped_and_noted():
    (b,) = [break_down(RecordTable.from_records([rec(0, [compute(-5, 4), span("data", 8, 13)], end=10)]))]
    (r,) = b.to_rows()
    assert (r[COMPUTE], r[DATA], r[OTHER]) == (4, 2, 4)
    (note,) = [n for n in b.notes if n.code == "clipped_intervals"]
    assert note.count == 2
    assert "up to 5 µs" in note.message


def test_gpu_util_is_shown_beside_the_compute_share():
    r0 = rec(0, [compute(0, 25), coll(25, 100, axis="tp", group="tp:0")], end=100, gpu_util=0.97)
    b = break_down(RecordTable.from_records([r0]))
    assert b.gpu_util[0] == pytest.approx(0.97)
    assert b.compute_share[0] == pytest.approx(0.25)
    (row,) = b.to_rows()
    assert (row["gpu_util"], row["compute_share"]) == (pytest.approx(0.97), pytest.approx(0.25))


# ---------------------------------------------------------------------------- clock skew


def _skew_scenario(skew_us: dict[int, int]) -> RecordTable:
    """16 ranks on 4 nodes, 2 DP groups of 8 and 8 TP groups of 2, 3 steps; arrivals vary, completions agree ±2 µs.

    ``skew_us`` shifts every time a node records (its clock runs that far ahead).
    """
    rng = np.random.default_rng(7)
    records = []
    for step in range(3):
        t0 = step * 100 * MS
        compute_end = {r: t0 + 20 * MS + int(rng.integers(0, 6 * MS)) for r in range(16)}
        tp_end = {}
        for g in range(8):
            a, b = 2 * g, 2 * g + 1
            end = max(compute_end[a], compute_end[b]) + 2 * MS
            tp_end[a], tp_end[b] = end + int(rng.integers(-2, 3)), end + int(rng.integers(-2, 3))
        dp_groups = [list(range(0, 16, 2)), list(range(1, 16, 2))]
        dp_end = {}
        for members in dp_groups:
            end = max(tp_end[r] for r in members) + 9 * MS
            dp_end.update({r: end + int(rng.integers(-2, 3)) for r in members})
        for r in range(16):
            node = r // 4
            k = skew_us.get(node, 0)
            ivs = [
                compute(t0 + k, compute_end[r] + k),
                coll(compute_end[r] + k, tp_end[r] + k, axis="tp", group=f"tp:{r // 2}", seq=step),
                coll(tp_end[r] + k, dp_end[r] + k, axis="dp", group=f"dp:{r % 2}", seq=step),
            ]
            records.append(rec(r, ivs, start=t0 + k, end=t0 + 60 * MS + k, step=step, node=f"node-{node}"))
    return RecordTable.from_records(records)


def test_clock_skew_is_estimated_and_removed_before_the_join():
    skew = {1: 7300, 2: -4100, 3: 12_000}
    plain = break_down(_skew_scenario({}))
    skewed = break_down(_skew_scenario(skew))
    offsets = estimate_clock_offsets(skewed.table)
    for node in range(4):
        assert abs(int(offsets.offset_us[node]) - skew.get(node, 0)) <= 3
    # Without alignment the skew would be read as several ms of sync wait; with it, results agree within µs.
    np.testing.assert_allclose(skewed.ticks / TICKS_PER_US, plain.ticks / TICKS_PER_US, atol=5)
    np.testing.assert_allclose(skewed.wait_caused_us, plain.wait_caused_us, atol=5 * 8)
    np.testing.assert_array_equal(skewed.collectives.last_rank, plain.collectives.last_rank)
    assert plain.ticks[:, [CATEGORIES.index(comm_category(a, SYNC_WAIT)) for a in ("dp", "tp")]].sum() > 0
    unaligned = break_down(_skew_scenario(skew), align_clocks=False)
    assert np.abs(unaligned.ticks - plain.ticks).max() / TICKS_PER_US > 1000
    assert any(n.code == "clock_offsets" and n.count == 3 for n in skewed.notes)


# ---------------------------------------------------------------------------- brute force over random timelines


def reference(records: list[StepRecord], bandwidth: float | None) -> tuple[dict, dict]:  # noqa: C901 - one plain loop
    """Per-µs simulation of the documented rules, written independently of the engine (one clock, no skew)."""
    instances: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    given: dict[str, int] = {}
    for r in records:
        for iv in r.intervals:
            if iv.kind == "comm":
                instances[(iv.group, iv.seq)].append((r.rank, iv.start_us))
                if iv.group_size:
                    given[iv.group] = iv.group_size
    most: dict[str, int] = defaultdict(int)
    for (g, _), members in instances.items():
        most[g] = max(most[g], len(members))
    last = {}
    for key, members in instances.items():
        if len(members) >= given.get(key[0], most[key[0]]):
            last[key] = max(a for _, a in members)
    cats = {c: i for i, c in enumerate(CATEGORIES)}
    out, attributed = {}, defaultdict(float)
    for r in records:
        ticks = [0] * len(CATEGORIES)
        for t in range(r.start_us, r.end_us):
            on = [iv for iv in r.intervals if iv.start_us <= t < iv.end_us]
            kinds = {iv.kind for iv in on}
            if "compute" in kinds:
                ticks[cats[COMPUTE]] += 60
                continue
            channels: dict[str, list] = defaultdict(list)  # channel -> [(interval, moving)]
            for iv in on:
                if iv.kind == "comm":
                    split = last.get((iv.group, iv.seq), iv.start_us)
                    channels[iv.axis].append((iv, t >= split))
                elif iv.kind == "p2p" and iv.axis == "pp":
                    xfer = round(iv.size_bytes / bandwidth * 1e6) if bandwidth and iv.size_bytes is not None else 0
                    channels["p2p"].append((iv, t >= iv.end_us - xfer))
                elif iv.kind == "p2p":
                    channels[iv.axis].append((iv, True))
            if channels:
                share = 60 // len(channels)
                for ch, members in channels.items():
                    moving = any(m for _, m in members)
                    if ch == "p2p":
                        ticks[cats[PP_XFER if moving else BUBBLE]] += share
                    else:
                        ticks[cats[comm_category(ch, TRANSFER if moving else SYNC_WAIT)]] += share
                        if not moving:
                            for iv, _ in members:
                                attributed[(r.rank, iv.group, iv.seq)] += share / len(members)
                continue
            for kind, cat in (("optimizer", OPTIMIZER), ("checkpoint", CHECKPOINT), ("data", DATA)):
                if kind in kinds:
                    ticks[cats[cat]] += 60
                    break
            else:
                ticks[cats[OTHER]] += 60
        out[(r.rank, r.step)] = ticks
    caused: dict[tuple[int, int, str], float] = defaultdict(float)
    step_of = {(r.rank, iv.group, iv.seq): r.step for r in records for iv in r.intervals if iv.kind == "comm"}
    axis_of = {iv.group: iv.axis for r in records for iv in r.intervals if iv.kind == "comm"}
    for key, members in instances.items():
        if key not in last:
            continue
        late = [rank for rank, a in members if a == last[key]]
        total = sum(attributed[(rank, *key)] for rank, _ in members)
        for rank in late:
            caused[(rank, step_of[(rank, *key)], axis_of[key[0]])] += total / len(late) / 60
    return out, caused


KINDS_STRAT = st.sampled_from(["compute", "compute", "data", "optimizer", "checkpoint", "p2p", "p2p-cp"])
GROUPS = [
    ("dp:0", "dp", "all_reduce"),
    ("dp:1", "dp", "reduce_scatter"),
    ("tp:0", "tp", "all_gather"),
    ("pp:x", "pp", "broadcast"),
]


@st.composite
def timelines(draw):
    n_ranks = draw(st.integers(1, 3))
    n_steps = draw(st.integers(1, 2))
    bounds = {}
    for step in range(n_steps):
        for rank in range(n_ranks):
            start = step * 40 + draw(st.integers(0, 4))
            bounds[(rank, step)] = (start, start + draw(st.integers(0, 30)))
    ivs = defaultdict(list)
    for (rank, step), (s, e) in bounds.items():
        for _ in range(draw(st.integers(0, 5))):
            a = draw(st.integers(s - 3, e))
            b = draw(st.integers(max(a, s), e + 3))
            kind = draw(KINDS_STRAT)
            if kind == "p2p":
                size = draw(st.none() | st.integers(0, 12))
                ivs[(rank, step)].append(recv(a, b, size=size))
            elif kind == "p2p-cp":
                ivs[(rank, step)].append(recv(a, b, size=1, axis="cp"))
            else:
                ivs[(rank, step)].append(span(kind, a, b))
    for seq in range(draw(st.integers(0, 5))):
        group, axis, op = draw(st.sampled_from(GROUPS))
        step = draw(st.integers(0, n_steps - 1))
        members = draw(st.lists(st.integers(0, n_ranks - 1), min_size=1, max_size=n_ranks, unique=True))
        size = draw(st.none() | st.just(n_ranks))
        for rank in members:
            s, e = bounds[(rank, step)]
            a = draw(st.integers(s - 2, e))
            b = draw(st.integers(max(a, s), e + 2))
            ivs[(rank, step)].append(coll(a, b, axis=axis, group=group, seq=seq, op=op, group_size=size))
    bandwidth = draw(st.sampled_from([None, 1e6, 2e6]))
    records = [rec(r, ivs[(r, k)], start=s, end=e, step=k) for (r, k), (s, e) in bounds.items()]
    return records, bandwidth


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(timelines())
def test_random_timelines_sum_exactly_and_match_a_brute_force_reference(case):
    records, bandwidth = case
    b = break_down(RecordTable.from_records(records), p2p_bandwidth_bytes_per_s=bandwidth)
    assert_sums_exact(b)
    expected, caused = reference(records, bandwidth)
    # Passing a charge along a chain of waits moves it, never creates or loses any: what no rank-step pays (the
    # host's share, a late start from before the records) is kept apart.
    kept = b.wait_paid_us + b.wait_host_us + b.wait_before_us
    assert kept.sum(axis=0) == pytest.approx(b.wait_caused_us.sum(axis=0), abs=1e-6)
    assert (b.wait_paid_us >= 0).all()
    assert (b.wait_host_us >= 0).all()
    assert (b.wait_before_us >= 0).all()
    for i, r in enumerate(records):
        assert b.ticks[i].tolist() == expected[(r.rank, r.step)], (r.rank, r.step)
        for k, axis in enumerate(AXES):
            assert b.wait_caused_us[i, k] == pytest.approx(caused.get((r.rank, r.step, axis), 0.0), abs=1e-9)


def test_seconds_and_microseconds_agree():
    b = break_down(RecordTable.from_records([rec(0, [compute(0, 1500)], end=2000)]))
    assert b.us(COMPUTE)[0] == 1500
    assert b.seconds(COMPUTE)[0] == pytest.approx(0.0015)
    assert b.seconds(OTHER)[0] == pytest.approx(0.0005)


def test_table_notes_are_carried_into_the_breakdown():
    table = RecordTable.from_records([rec(0, [], end=1)])
    noted = replace(table, notes=(Note(code="truncated_line", count=1, message="x"),))
    assert [n.code for n in break_down(noted).notes] == ["truncated_line"]


def test_aggregation_in_small_chunks_gives_the_same_numbers(monkeypatch):
    table = read_table(DATA_DIR / "dp8_straggler" / "records.jsonl")
    whole = break_down(table)
    monkeypatch.setattr(engine, "_CHUNK_BINS", 1)  # one rank-step per chunk
    np.testing.assert_array_equal(break_down(table).ticks, whole.ticks)


# ---------------------------------------------------------------------------- notes and edges the mutation run found


def test_groups_without_a_size_are_noted_with_their_count() -> None:
    # dp:0 and dp:1 (ranks 0 and 1 each) and tp:0 (rank 0 alone) carry no group_size: their sizes are inferred (2,
    # 2 and 1), and tp:0 was only ever seen with one member. tp:1 says it is a group of one (group_size 1): not
    # inferred.
    table = RecordTable.from_records(
        [
            rec(0, [coll(0, 10), coll(10, 12, axis="tp", group="tp:0"), coll(12, 14, group="dp:1")], end=14),
            rec(
                1,
                [coll(4, 10), coll(10, 12, axis="tp", group="tp:1", group_size=1), coll(12, 14, group="dp:1")],
                end=14,
            ),
        ]
    )
    (note,) = [n for n in break_down(table).notes if n.code == "inferred_group_size"]
    assert note.count == 3
    assert note.message == (
        "3 groups carry no group_size; their size is the most members seen in one instance (1 of them were only "
        "ever seen with one member, so no wait could be measured)"
    )


def test_members_that_finish_before_the_last_arrives_are_noted() -> None:
    # One node (no clock to align): rank 1 arrives at 12; rank 0 ended at 10, 2 µs before; rank 2 ended at 12,
    # just as rank 1 arrived: only rank 0 is early.
    table = RecordTable.from_records(
        [
            rec(0, [coll(0, 10, group_size=3)], end=20),
            rec(1, [coll(12, 20, group_size=3)], end=20),
            rec(2, [coll(5, 12, group_size=3)], end=20),
        ]
    )
    (note,) = [n for n in break_down(table).notes if n.code == "finished_before_last_arrival"]
    assert note.count == 1
    assert note.message == (
        "1 members finished a collective before its last member arrived (by up to 2 µs after clock alignment): "
        "clocks misaligned or arrivals mis-recorded; their whole exposed time is counted as sync wait"
    )


def test_clock_offsets_of_nodes_known_only_by_their_codes() -> None:
    # A table without node names (nodes by code only) is aligned the same way as one with them.
    skew = {1: 7300, 2: -4100, 3: 12_000}
    table = _skew_scenario(skew)
    named = estimate_clock_offsets(table)
    coded = estimate_clock_offsets(replace(table, node_names=()))
    np.testing.assert_array_equal(coded.offset_us, named.offset_us)
    assert coded.offset_us.size == 4
    for node in range(4):
        assert abs(int(coded.offset_us[node]) - skew.get(node, 0)) <= 3


def test_clock_offsets_follow_the_best_sampled_edges_by_hand() -> None:
    # Ranks 0-4, one per node (node-i). All-reduces end together on the true clock, so the difference of two
    # members' end times is their clocks' difference:
    #   node-0/node-1, 3 instances: node-1 ends 90, 100 and 500 µs later: median 100 (the lower middle of 3);
    #   node-1/node-2, 2 instances: node-2 ends 50 and 60 µs later: median 50 (the lower of the middle two);
    #   node-0/node-2, 1 instance: 400 µs (an outlier edge: the spanning tree prefers the better-sampled path);
    #   node-3/node-4, 1 instance: 30 µs (a group of nodes of its own, aligned on node-3);
    #   a broadcast node-0/node-1 ending 9 ms apart (not symmetric: its members need not finish together).
    # Prim from node-0: node-1 by its 3-sample edge (+100), then node-2 through node-1 (2 samples: +150), not its
    # 1-sample edge to node-0 (+400).
    ends = {
        0: [("A", 0, 1000), ("A", 1, 2000), ("A", 2, 3000), ("C", 0, 4000), ("X", 0, 500)],
        1: [("A", 0, 1090), ("A", 1, 2100), ("A", 2, 3500), ("B", 0, 5000), ("B", 1, 6000), ("X", 0, 9500)],
        2: [("B", 0, 5050), ("B", 1, 6060), ("C", 0, 4400)],
        3: [("D", 0, 1000)],
        4: [("D", 0, 1030)],
    }
    records = []
    for rank, mine in ends.items():
        ivs = [
            coll(end - 5, end, group=group, seq=seq, group_size=2, op="broadcast" if group == "X" else "all_reduce")
            for group, seq, end in mine
        ]
        records.append(rec(rank, sorted(ivs, key=lambda i: i.start_us), end=10_000, node=f"node-{rank}"))
    clock = estimate_clock_offsets(RecordTable.from_records(records))
    assert clock.offset_us.tolist() == [0, 100, 150, 0, 30]
    assert clock.reference.tolist() == [0, 0, 0, 3, 3]
    assert clock.samples.tolist() == [0, 3, 2, 0, 1]


def test_one_node_or_no_collective_needs_no_alignment() -> None:
    one = estimate_clock_offsets(
        RecordTable.from_records([rec(0, [coll(0, 10)], end=10), rec(1, [coll(5, 10)], end=10)])
    )
    assert (one.offset_us.tolist(), one.reference.tolist(), one.samples.tolist()) == ([0], [0], [0])
    two = RecordTable.from_records([rec(0, [compute(0, 10)], end=10), rec(1, [compute(0, 10)], end=10, node="node-1")])
    clock = estimate_clock_offsets(two)
    assert (clock.offset_us.tolist(), clock.reference.tolist(), clock.samples.tolist()) == ([0, 0], [0, 1], [0, 0])


def test_a_job_without_collectives_has_an_empty_join_of_the_same_columns() -> None:
    # The join of a table without any collective is empty, column for column with the dtypes of a real join (what
    # reads it, e.g. the cost table's charge lookups, indexes and concatenates it), nobody waits or is charged, and
    # an unaligned breakdown keeps every node on its own clock.
    with_comm = break_down(RecordTable.from_records([rec(0, [coll(0, 10)], end=10), rec(1, [coll(5, 10)], end=10)]))
    table = RecordTable.from_records([rec(0, [compute(0, 10)], end=10), rec(1, [compute(0, 8)], end=10, node="node-1")])
    for align in (True, False):
        b = break_down(table, align_clocks=align)
        assert len(b.collectives) == 0
        for f in dataclasses.fields(b.collectives):
            got, want = getattr(b.collectives, f.name), getattr(with_comm.collectives, f.name)
            assert (got.shape, got.dtype) == ((0,), want.dtype), f.name
        assert b.wait_caused_us.sum() == 0
        assert b.wait_paid_us.sum() == 0
        assert (b.clock.offset_us.tolist(), b.clock.reference.tolist(), b.clock.samples.tolist()) == (
            [0, 0],
            [0, 1],
            [0, 0],
        )
        assert b.clock.reference.dtype == np.int64
        assert_sums_exact(b)


def test_rows_name_the_node_and_say_none_where_nothing_was_measured() -> None:
    # A rank-step without a GPU utilisation and with no time (0 µs): both shares are unknown, written None.
    b = break_down(RecordTable.from_records([rec(0, [], end=0, node="gpu-7"), rec(1, [compute(0, 4)], end=4)]))
    r = rows(b)
    assert r[(0, 0)]["node"] == "gpu-7"
    assert (r[(0, 0)]["gpu_util"], r[(0, 0)]["compute_share"]) == (None, None)
    assert r[(1, 0)]["compute_share"] == 1.0
    assert b.ticks.dtype == np.int64  # ticks are exact integers (docs: TICKS_PER_US per µs), never floats


class _Phases:
    """A Progress that records the names of the phases it is given."""

    def __init__(self) -> None:
        self.names: list[str] = []

    @contextmanager
    def phase(self, name: str, *, total: int | None = None, unit: str = "") -> Iterator[object]:
        self.names.append(name)
        yield self

    def advance(self, amount: int = 1) -> None:
        """Counted nowhere."""


def test_the_phases_a_user_sees() -> None:
    # The progress display shows what the breakdown is doing, in these words.
    table = RecordTable.from_records(
        [rec(0, [compute(0, 5), coll(5, 10)], end=10), rec(1, [coll(7, 10)], end=10, node="node-1")]
    )
    for align, clocks in ((True, "aligning clocks of 2 nodes"), (False, "reading clocks as they are")):
        seen = _Phases()
        break_down(table, align_clocks=align, progress=seen)
        assert seen.names == [
            clocks,
            "joining collectives (2 entries)",
            "breaking down 2 rank-steps (3 intervals)",
            "following chains of waits",
        ]


def test_the_first_rank_step_can_be_the_one_that_pays_and_a_missing_member_leaves_nobody() -> None:
    # Instance 0: row 0 (rank 0) arrives last and pays for rank 1's wait. Instance 1 (group size 3, two members
    # seen): incomplete, nobody is last or pays.
    table = RecordTable.from_records(
        [
            rec(0, [coll(5, 10, seq=0), coll(10, 20, group="dp:1", seq=0, group_size=3)], end=20),
            rec(1, [coll(0, 10, seq=0), coll(12, 20, group="dp:1", seq=0, group_size=3)], end=20),
        ]
    )
    join = break_down(table).collectives
    by_group = {table.group_name(int(g)): i for i, g in enumerate(join.group)}
    first, partial = by_group["dp:0"], by_group["dp:1"]
    assert (join.last_row[first], join.paying_row[first], join.paying_rank[first]) == (0, 0, 0)
    assert (join.last_row[partial], join.paying_row[partial], join.paying_rank[partial]) == (-1, -1, -1)


@pytest.mark.parametrize(
    ("bandwidth", "message"),
    [
        (0.0, "p2p bandwidth = 0.0 bytes/s for row 0 (rank 0, step 0): intervals[0]; it must be a positive number"),
        (
            np.array([0.0, -1.0]),
            "p2p bandwidth = 0.0 bytes/s for row 0 (rank 0, step 0): intervals[0]; it must be a positive number",
        ),
        (
            np.array([1e9, -1.0]),
            "p2p bandwidth = -1.0 bytes/s for row 0 (rank 0, step 0): intervals[1]; it must be a positive number",
        ),
    ],
    ids=["zero", "first-of-two-bad", "second"],
)
def test_a_bad_bandwidth_is_named_with_its_interval(bandwidth, message):
    table = RecordTable.from_records([rec(0, [recv(0, 10, size=10), recv(10, 20, size=10)], end=20)])
    with pytest.raises(ParseError, match=re.escape(message) + "$"):
        break_down(table, p2p_bandwidth_bytes_per_s=bandwidth)


def test_a_slow_link_of_one_byte_per_second_is_a_bandwidth() -> None:
    # 2 bytes at 1 B/s: 2 s of transfer, more than the 20 µs the receive took: all of it is transfer.
    table = RecordTable.from_records([rec(0, [recv(0, 20, size=2)], end=20)])
    (r,) = break_down(table, p2p_bandwidth_bytes_per_s=1.0).to_rows()
    assert (r[PP_XFER], r[BUBBLE]) == (20, 0)


def test_a_long_transfer_is_exact_to_the_microsecond() -> None:
    # 1 GB at 1 GB/s is 1,000,000 µs of a 1.5 s receive: the remaining 500,000 µs are bubble.
    table = RecordTable.from_records([rec(0, [recv(0, 1_500_000, size=1_000_000_000)], end=1_500_000)])
    (r,) = break_down(table, p2p_bandwidth_bytes_per_s=1e9).to_rows()
    assert (r[PP_XFER], r[BUBBLE]) == (1_000_000, 500_000)


def test_p2p_without_bytes_is_noted_in_full() -> None:
    # One receive carries no size (all bubble, and noted); one says 0 bytes (a size: 0 µs of transfer, all bubble
    # too, not noted); one 10 bytes at 1 MB/s: 10 µs of transfer.
    table = RecordTable.from_records([rec(0, [recv(0, 10, size=0), recv(10, 20), recv(20, 30, size=10)], end=30)])
    b = break_down(table, p2p_bandwidth_bytes_per_s=1e6)
    (note,) = [n for n in b.notes if n.code == "p2p_without_bytes"]
    assert note.count == 1
    assert note.message == "1 pipeline p2p intervals carry no bytes: their exposed time is all counted as bubble"
    (r,) = b.to_rows()
    assert (r[PP_XFER], r[BUBBLE]) == (10, 20)


def test_a_peer_without_a_record_is_reached_over_the_network_and_noted() -> None:
    # Rank 0 (domain a) receives 1,000 bytes from rank 3, of which no record says where it is: network (10 B/µs),
    # 100 µs; its receive from rank 1 (domain a too) goes over NVLink (100 B/µs), 10 µs.
    r0 = rec(0, [recv(0, 200, size=1000, peer=3), recv(200, 300, size=1000, peer=1)], end=300, nvlink_domain="a")
    r1 = rec(1, [], end=300, nvlink_domain="a")
    b = break_down(RecordTable.from_records([r0, r1]), p2p_bandwidth_bytes_per_s={"nvlink": 100e6, "network": 10e6})
    assert (b.to_rows()[0][PP_XFER], b.to_rows()[0][BUBBLE]) == (100 + 10, 100 + 90)
    (note,) = [n for n in b.notes if n.code == "p2p_link_unknown"]
    assert note.count == 1
    assert note.message == (
        "1 pipeline p2p intervals have no NVLink domain for the rank or its peer: network bandwidth assumed"
    )


def test_a_tie_for_last_in_a_later_instance_names_its_lowest_rank() -> None:
    # Instance seq 0: rank 0 is last alone. Instance seq 1: ranks 1 and 2 tie for last: the lowest, rank 1, is named,
    # two members were last; columns keep their integer dtypes.
    table = RecordTable.from_records(
        [
            rec(0, [coll(6, 10, seq=0), coll(10, 20, seq=1)], end=20),
            rec(1, [coll(0, 10, seq=0), coll(14, 20, seq=1)], end=20),
            rec(2, [coll(2, 10, seq=0), coll(14, 20, seq=1)], end=20),
        ]
    )
    join = break_down(table).collectives
    assert join.seq.tolist() == [0, 1]
    assert join.last_rank.tolist() == [0, 1]
    assert join.n_last.tolist() == [1, 2]
    assert (join.n_last.dtype, join.expected_members.dtype) == (np.int64, np.int64)


def test_seconds_are_microseconds_over_a_million_exactly() -> None:
    b = break_down(RecordTable.from_records([rec(0, [compute(0, 3_000_000)], end=3_000_000)]))
    assert b.seconds(COMPUTE)[0] == 3.0


def test_a_category_part_that_does_not_exist_is_named() -> None:
    with pytest.raises(ValueError, match=re.escape("part = 'latency'; expected 'transfer' or 'sync_wait'")):
        comm_category("dp", "latency")

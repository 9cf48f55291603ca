"""Who pays for a sync wait: the late rank, or the rank it waited for, followed along the chain of waits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshscope.analysis import Breakdown, analyze, break_down
from meshscope.analysis.chains import host_delay_us, own_shares, paying_rows, received_from_rows, waited_for_rows
from meshscope.jobs.loading import load_spec_text
from meshscope.records import BetweenSteps, Interval, RecordTable, StepRecord, read_records
from meshscope.simulation import Noise, Straggler, simulate
from meshscope.topology import AXES
from meshscope.topology.layout import RankCoord

SPEC = """
apiVersion: meshscope.io/v1alpha1
kind: TrainingJob
metadata: {name: chain}
spec:
  model: {preset: llama3-8b}
  parallelism: {pp: 4, dp: 8, tp: 2}
  training: {microBatchSize: 1, globalBatchSize: 64}
  hardware: {gpu: H100, nodes: 8, gpusPerNode: 8}
"""


def _rank(spec, **coord: int) -> int:
    layout = spec.layout
    return next(r for r in range(layout.world_size) if all(getattr(layout.coord(r), a) == v for a, v in coord.items()))


def test_a_stage_1_straggler_pays_for_the_dp_wait_that_stage_0_ranks_arrive_late_to() -> None:
    # The case, scaled down from Llama 3 405B on 16,384 ranks: the slow rank sits in stage 1; the ranks of
    # its data-parallel replica in the other stages arrive last at their dp all-reduces only because they waited
    # for it through the pipeline (and its tp peer through the tp all-reduce).
    spec = load_spec_text(SPEC)
    slow = _rank(spec, pp=1, dp=3, tp=0)
    result = simulate(spec, steps=6, seed=1, faults=[Straggler(rank=slow, factor=1.4), Noise(sigma=0.01)])
    analysis = analyze(result.table, spec=spec)
    join = analysis.breakdown.collectives
    dp = (join.axis == 0) & (join.wait_caused_us > 0)
    late = set(np.unique(join.last_rank[dp]).tolist())
    assert slow in late
    assert len(late) > 2  # the replica's ranks of the other stages arrive last too
    assert set(np.unique(join.paying_rank[dp]).tolist()) == {slow}
    row = next(r for r in analysis.rows if r.category == "comm.dp.sync_wait")
    assert row.suspect is not None
    assert row.suspect.rank == slow
    assert "; some of it through rank " in row.suspect.message
    assert f", last to arrive only because it had waited for rank {slow}" in row.suspect.message
    straggler = next(f for f in analysis.findings if f.code == "straggler")
    assert [s.rank for s in straggler.suspects] == [slow]
    # The finding quotes the table's own sentence for the axis it was costliest on (all members' wait summed).
    sync_rows = [r for r in analysis.rows if r.category.endswith(".sync_wait") and r.suspect is not None]
    quoted = [r for r in sync_rows if r.suspect is not None and r.suspect.message in straggler.message]
    assert len(quoted) == 1, [r.category for r in sync_rows]
    assert quoted[0].suspect is not None
    assert quoted[0].suspect.rank == slow


def test_a_late_rank_that_did_not_wait_pays_itself() -> None:
    spec = load_spec_text(SPEC)
    slow = _rank(spec, pp=0, dp=5, tp=1)
    result = simulate(spec, steps=4, seed=2, faults=[Straggler(rank=slow, factor=1.4)])
    bd = break_down(result.table)
    s = bd.table.steps
    mine = s.rank == slow
    assert bd.wait_paid_us[mine].sum() >= bd.wait_caused_us[mine].sum() > 0
    join = bd.collectives
    charged = join.wait_caused_us > 0
    assert (join.paying_rank[charged & (join.last_rank == slow)] == slow).all()


def test_conservation_and_no_passing_without_excess_waiting() -> None:
    # A clean pipelined job: charges stay where they were (nobody waited beyond their stage peers).
    spec = load_spec_text(SPEC)
    bd = break_down(simulate(spec, steps=4, seed=3).table)
    assert bd.wait_paid_us.sum() == pytest.approx(bd.wait_caused_us.sum())


def _pay(
    n: int,
    *,
    bubble: dict[int, float],
    sync: dict[tuple[int, int], float],
    waited: dict[tuple[int, int], int],
    received: dict[int, int],
) -> list[int]:
    """paying_rows over ``n`` rank-steps of one (step, stage) group, 100 µs steps; rows not named wait nothing."""
    b = np.zeros(n)
    for row, us in bubble.items():
        b[row] = us
    w = np.zeros((n, 5))
    for (row, axis), us in sync.items():
        w[row, axis] = us
    target = np.full((n, 5), -1, dtype=np.int64)
    for (row, axis), to in waited.items():
        target[row, axis] = to
    r = np.full(n, -1, dtype=np.int64)
    for row, to in received.items():
        r[row] = to
    pay = paying_rows(
        peer_key=np.zeros(n, dtype=np.int64),
        step_us=np.full(n, 100.0),
        bubble_us=b,
        sync_wait_us=w,
        waited_for=target,
        received_from=r,
    )
    return pay.tolist()


def test_a_chain_is_followed_to_its_end() -> None:
    # Row 3 waited (dp sync) for row 2, which waited in the bubble for row 1, which waited (tp sync) for row 0;
    # rows 4-9 are on-time peers: row 0 pays for all of them.
    pay = _pay(10, bubble={2: 30.0}, sync={(3, 0): 30.0, (1, 1): 30.0}, waited={(3, 0): 2, (1, 1): 0},
               received={2: 1})  # fmt: skip
    assert pay == [0, 0, 0, 0, 4, 5, 6, 7, 8, 9]


def test_a_cycle_of_waits_keeps_its_own_charges() -> None:
    # Rows 0, 1 and 2 each waited for the next one round a cycle; row 3 waited for row 0.
    pay = _pay(10, bubble={0: 30.0, 1: 30.0, 2: 30.0, 3: 30.0}, sync={}, waited={},
               received={0: 1, 1: 2, 2: 0, 3: 0})  # fmt: skip
    assert pay == list(range(10))


def test_a_rank_whose_own_time_is_longer_than_its_waiting_keeps_the_charge() -> None:
    # Row 0 waited 20 µs beyond its peers but also computed 30 µs longer: its own time made it late. Modelled as a
    # longer step (150 µs) with 20 µs of bubble: own time 130 against the peers' 100.
    b = np.zeros(6)
    b[0] = 20.0
    step = np.full(6, 100.0)
    step[0] = 150.0
    pay = paying_rows(
        peer_key=np.zeros(6, dtype=np.int64),
        step_us=step,
        bubble_us=b,
        sync_wait_us=np.zeros((6, 5)),
        waited_for=np.full((6, 5), -1, dtype=np.int64),
        received_from=np.array([1, -1, -1, -1, -1, -1]),
    )
    assert pay.tolist() == list(range(6))


# ---------------------------------------------------------------------------- the pieces, by hand


def test_waited_for_is_the_last_arrival_of_the_longest_wait() -> None:
    # Five rank-steps; member elements (row, axis, wait, last arrival's row):
    # row 1 waited 5 (dp) for row 0 (row 0 is a valid last arrival), and 9 (dp) for row 3: the longer one wins;
    # row 2 waited 0.5 on tp for row 4 (any wait above 0 counts); row 3 is the last arrival itself (no wait);
    # row 4 waited 0 on dp (arrived together: no wait, no target) and 7 on tp for an incomplete instance (-1).
    dp, tp = AXES.index("dp"), AXES.index("tp")
    members = [(1, dp, 5.0, 0), (1, dp, 9.0, 3), (2, tp, 0.5, 4), (3, dp, 0.0, 3), (4, dp, 0.0, 1), (4, tp, 7.0, -1)]
    rows, axis, wait, last = (np.array(c) for c in zip(*members, strict=True))
    out = waited_for_rows(rows, axis, wait, last, 5)
    expected = np.full((5, 5), -1)
    expected[1, dp] = 3
    expected[2, tp] = 4
    np.testing.assert_array_equal(out, expected)
    # One waiting member alone is enough.
    one = waited_for_rows(np.array([2]), np.array([dp]), np.array([4.0]), np.array([0]), 3)
    assert one[:, dp].tolist() == [-1, -1, 0]
    assert (waited_for_rows(np.array([2]), np.array([dp]), np.array([0.0]), np.array([0]), 3) == -1).all()


def _p2p_table(recvs: dict[tuple[int, int], list[tuple[int, int]]], *, sends: dict[int, int] | None = None):
    """Ranks 0-3, 2 steps, 1 ms each; ``recvs[(rank, step)]``: (peer, µs) receives; ``sends``: rank -> peer (step 0)."""
    records = []
    for step in range(2):
        for rank in range(4):
            t = 1000 * step
            ivs = []
            for peer, us in recvs.get((rank, step), []):
                ivs.append(Interval(kind="p2p", start_us=t, end_us=t + us, axis="pp", op="recv", peer=peer))
                t += us
            if step == 0 and rank in (sends or {}):
                ivs.append(Interval(kind="p2p", start_us=t, end_us=t + 5, axis="pp", op="send", peer=sends[rank]))
            coord = RankCoord(dp=0, tp=0, pp=rank, cp=0, ep=0)
            start = 1000 * step
            records.append(
                StepRecord(job="p2p", step=step, rank=rank, coord=coord, node="node-0", start_us=start,
                           end_us=start + 900, intervals=tuple(ivs))
            )  # fmt: skip
    return RecordTable.from_records(records)


def test_received_from_is_the_peer_received_from_longest_in_the_same_step() -> None:
    # Rows are (step, rank) in table order: row = 4 step + rank. Step 0: rank 1 receives from rank 0 (the first
    # row: peer 0 counts); rank 2 receives twice for 10 µs from rank 1 and once for 30 µs from rank 3: 30 > 20, rank
    # 3. Step 1: rank 0 receives from rank 3 (the last row of the table); rank 2 from rank 1. Rank 3 sends to rank 0
    # in step 0 (a send is not a receive); rank 3 in step 1 receives nothing: -1.
    table = _p2p_table(
        {(1, 0): [(0, 10)], (2, 0): [(1, 10), (1, 10), (3, 30)], (0, 1): [(3, 10)], (2, 1): [(1, 50)]},
        sends={3: 0},
    )
    step_index = table.steps.step.astype(np.intp)
    got = received_from_rows(table, step_index)
    row = {(int(s), int(r)): i for i, (s, r) in enumerate(zip(table.steps.step, table.steps.rank, strict=True))}
    expected = np.full(table.n_rows, -1)
    expected[row[(0, 1)]] = row[(0, 0)]
    expected[row[(0, 2)]] = row[(0, 3)]
    expected[row[(1, 0)]] = row[(1, 3)]
    expected[row[(1, 2)]] = row[(1, 1)]
    np.testing.assert_array_equal(got, expected)


def test_received_from_a_peer_without_a_record_that_step_is_no_one() -> None:
    # Rank 1 receives from rank 7, which has no rank-step: -1.
    table = _p2p_table({(1, 0): [(7, 10)]})
    assert (received_from_rows(table, table.steps.step.astype(np.intp)) == -1).all()


def test_a_wait_exactly_at_the_floor_passes_on_and_one_no_longer_than_own_time_does_not() -> None:
    # Steps of 100 µs: the floor is 1 % of the median step, 1 µs. Row 0 waited 1 µs beyond its peers in the bubble
    # for row 1: at the floor, passed on. Row 2's excess waiting (20 µs) equals its excess own time (a 140 µs step,
    # 20 µs of it bubble: own time 120 against 100): not larger, it keeps its charge.
    b = np.zeros(8)
    b[0], b[2] = 1.0, 20.0
    step = np.full(8, 100.0)
    step[0], step[2] = 101.0, 140.0
    pay = paying_rows(
        peer_key=np.zeros(8, dtype=np.int64),
        step_us=step,
        bubble_us=b,
        sync_wait_us=np.zeros((8, 5)),
        waited_for=np.full((8, 5), -1, dtype=np.int64),
        received_from=np.array([1, -1, 3, -1, -1, -1, -1, -1]),
    )
    assert pay.tolist() == [1, 1, 2, 3, 4, 5, 6, 7]


def test_waiting_that_every_peer_shares_is_nobodys_excess() -> None:
    # All six rank-steps sit 30 µs in the bubble (their median): row 0's 30 µs is not beyond its peers', so it keeps
    # its charge although it received from row 1.
    assert _pay(6, bubble=dict.fromkeys(range(6), 30.0), sync={}, waited={}, received={0: 1}) == list(range(6))


def test_no_rank_steps_pay_for_nothing() -> None:
    empty = np.zeros(0)
    pay = paying_rows(
        peer_key=np.zeros(0, dtype=np.int64),
        step_us=empty,
        bubble_us=empty,
        sync_wait_us=np.zeros((0, 5)),
        waited_for=np.zeros((0, 5), dtype=np.int64),
        received_from=np.zeros(0, dtype=np.int64),
    )
    assert pay.tolist() == []


# ---------------------------------------------------------------------------------------------- the host's share

DATA = Path(__file__).parent.parent / "data"


def test_host_delay_is_the_run_delay_beyond_the_peers_rate_for_the_same_work() -> None:
    # Four rank-steps of one group: every thread waits a third of its CPU time for a core (rate 1/3 of own - run delay).
    # Row 1 does three times the work and waits three times as long: none of it is the host's. Row 2 does the same work
    # as rows 0 and 3 and waited 6 ms more: 6 ms is the host's. Row 3 waited less than its rate: 0, never negative.
    own = np.array([20.0, 60.0, 26.0, 19.0])
    runqueue = np.array([5.0, 15.0, 11.0, 4.0])
    host = host_delay_us(peer_key=np.zeros(4, dtype=np.int64), own_us=own, runqueue_us=runqueue)
    # peers' rates: 5/15, 15/45, 11/15, 4/15 -> median 1/3
    assert host.tolist() == pytest.approx([0.0, 0.0, 11.0 - 15.0 / 3, 0.0])
    # Groups are separate: the same rows in another group do not change the first group's figures.
    both = host_delay_us(
        peer_key=np.repeat(np.array([0, 1], dtype=np.int64), 4),
        own_us=np.concatenate([own, own * 2]),
        runqueue_us=np.concatenate([runqueue, np.zeros(4)]),
    )
    assert both[:4].tolist() == pytest.approx(host.tolist())
    assert both[4:].tolist() == [0.0] * 4


def test_own_share_takes_the_host_delay_out_of_the_excess_own_time() -> None:
    key = np.zeros(4, dtype=np.int64)
    own = np.array([20.0, 20.0, 30.0, 40.0])  # median 25: excess -5, -5, 5, 15
    share = own_shares(peer_key=key, own_us=own, host_us=np.array([0.0, 1.0, 5.0, 5.0]))
    # no host delay: all of it; host delay without excess own time: none; covering it: none; a third of it: 2/3
    assert share.tolist() == pytest.approx([1.0, 0.0, 0.0, 2.0 / 3])


def _late_rank_0(*, runqueue_us: int, gpu: int | None = None) -> RecordTable:
    """Two ranks, 5 steps: rank 0 computes 6 ms longer and arrives last at the dp all-reduce; rank 1 waits 6 ms.

    Both threads wait ``1 ms`` for a CPU per step, rank 0 ``runqueue_us`` more."""
    records = []
    for step in range(5):
        t0 = step * 100_000
        for rank, busy in ((0, 46_000), (1, 40_000)):
            records.append(
                StepRecord(
                    job="t", step=step, rank=rank, coord=RankCoord(dp=rank, tp=0, pp=0, cp=0, ep=0), node="node-0",
                    start_us=t0, end_us=t0 + 50_000, gpu=gpu,
                    runqueue_wait_us=1_000 + (runqueue_us if rank == 0 else 0),
                    intervals=(
                        Interval(kind="compute", start_us=t0, end_us=t0 + busy, phase="backward"),
                        Interval(kind="comm", start_us=t0 + busy, end_us=t0 + 48_000, axis="dp", op="all_reduce",
                                 group="dp:0", seq=step, group_size=2, size_bytes=1 << 20),
                    ),
                )
            )  # fmt: skip
    return RecordTable.from_records(records)


def test_a_rank_the_scheduler_kept_off_a_cpu_does_not_pay_for_the_wait_it_made() -> None:
    # Rank 0's 6 ms of extra compute is all extra run delay (6 ms more than rank 1, same work): the host's.
    bd = break_down(_late_rank_0(runqueue_us=6_000), align_clocks=False)
    dp = AXES.index("dp")
    caused = bd.wait_caused_us[:, dp].sum()
    assert caused == pytest.approx(5 * 6_000)
    assert bd.wait_paid_us[:, dp].sum() == pytest.approx(0.0)
    assert bd.wait_host_us[:, dp].sum() == pytest.approx(caused)
    # 2 ms more run delay than rank 1 for 6 ms more work: part of its lateness is its own, part the host's; the
    # charge is split between them, nothing lost.
    bd = break_down(_late_rank_0(runqueue_us=2_000), align_clocks=False)
    paid, host = bd.wait_paid_us[:, dp].sum(), bd.wait_host_us[:, dp].sum()
    assert 0 < paid < caused
    assert paid + host == pytest.approx(caused)
    # No extra run delay: rank 0 pays all of it.
    bd = break_down(_late_rank_0(runqueue_us=0), align_clocks=False)
    assert bd.wait_paid_us[:, dp].sum() == pytest.approx(caused)
    assert bd.wait_host_us.sum() == 0


def _log_flush_between_steps(*, comm_between_us: int = 0) -> RecordTable:
    """Two ranks, 8 steps of 20 ms (compute, then a dp all-reduce). Rank 0 flushes a log for 50 ms after its
    ``end_step()`` before steps 3 and 6 and starts them late; rank 1 waits 50 ms for it in their all-reduce. Run
    delay 1 ms a step on both threads, rank 0 0.5 ms more in the late steps and the steps before (a busy host).

    ``comm_between_us``: of rank 1's gap before steps 3 and 6, time blocked in a collective (a barrier it waited in)."""
    records = []
    t = 0
    for step in range(8):
        late = 50_000 if step in (3, 6) else 0
        for rank in (0, 1):
            start = t + (late if rank == 0 else 0)
            gap = None if step == 0 else (1_000 + (late if rank == 0 else comm_between_us if late else 0))
            between = None if step == 0 or rank == 0 or not late else BetweenSteps(comm_us=comm_between_us)
            records.append(
                StepRecord(
                    job="t", step=step, rank=rank, coord=RankCoord(dp=rank, tp=0, pp=0, cp=0, ep=0), node="node-0",
                    start_us=start, end_us=t + late + 20_000, gap_before_us=gap, between_steps=between,
                    runqueue_wait_us=1_000 + (500 if rank == 0 and step in (2, 3, 5, 6) else 0),
                    intervals=(
                        Interval(kind="compute", start_us=start, end_us=start + 15_000, phase="backward"),
                        Interval(kind="comm", start_us=start + 15_000, end_us=t + late + 20_000, axis="dp",
                                 op="all_reduce", group="dp:0", seq=step, group_size=2, size_bytes=1 << 20),
                    ),
                )
            )  # fmt: skip
        t += late + 21_000
    return RecordTable.from_records(records)


def test_a_late_start_its_own_time_between_steps_made_is_the_ranks_not_the_hosts() -> None:
    # Rank 0's log flush between steps made it start steps 3 and 6 late. Passed to its step before (as a long end of
    # that step would be), whose own time matched its peer's while its thread waited a little longer for a CPU, the
    # whole charge was the host's and the dp row named nobody (a 2-rank DDP loop logging after end_step(), a
    # new-user trial beside a busy host: 3.64 of 6.4 ms a step kept as the host's).
    bd = break_down(_log_flush_between_steps(), align_clocks=False)
    dp = AXES.index("dp")
    caused = bd.wait_caused_us[:, dp].sum()
    assert caused == pytest.approx(2 * 50_000, rel=0.05)
    rank0 = bd.table.steps.rank == 0
    # Its extra 0.5 ms of run delay in the late steps is the host's part of a 50 ms lateness: 1 % of it.
    assert bd.wait_paid_us[rank0, dp].sum() == pytest.approx(caused, rel=0.02)
    assert bd.wait_host_us.sum() == pytest.approx(caused - bd.wait_paid_us[rank0, dp].sum())
    # A rank whose gap was time blocked in a collective there (it waited) is not made late by it.
    bd = break_down(_log_flush_between_steps(comm_between_us=50_000), align_clocks=False)
    assert bd.wait_paid_us[rank0, dp].sum() == pytest.approx(bd.wait_caused_us[:, dp].sum(), rel=0.02)


def test_on_a_gpu_the_late_rank_pays_whatever_its_thread_waited_for() -> None:
    # A kernel runs whether or not the thread that launched it has a core: nothing is the host's.
    bd = break_down(_late_rank_0(runqueue_us=6_000, gpu=0), align_clocks=False)
    dp = AXES.index("dp")
    assert bd.wait_paid_us[:, dp].sum() == pytest.approx(5 * 6_000)
    assert bd.wait_host_us.sum() == 0


def test_a_rank_descheduled_by_foreign_load_is_not_charged_for_an_imbalance_elsewhere() -> None:
    # A real 2-rank FSDP2 run (tests/data/imbalance_fsdp2_burners) with three times the batch on rank 1, beside two
    # CPU burners: rank 0 was descheduled for up to 13 ms a step more than rank 1 and arrived last at some
    # collectives. Charged to the last arrival, the dp sync-wait row named rank 0 (12.28 ms per step) while the
    # data-imbalance finding named rank 1: the table and the finding disagreed on who pays.
    records = read_records(DATA / "imbalance_fsdp2_burners" / "records.jsonl")
    warmup = min(r.step for r in records)  # what meshscope run leaves out
    bd = _table_and_finding_name_rank_1(RecordTable.from_records([r for r in records if r.step != warmup]))
    assert bd.wait_host_us.sum() > 0


def _table_and_finding_name_rank_1(table: RecordTable) -> Breakdown:
    """Analyse ``table``: the dp sync-wait row and the data-imbalance finding both name rank 1, in the same words;
    every µs of sync wait caused is paid or kept apart."""
    result = analyze(table, one_clock=True)
    row = next(r for r in result.rows if r.category == "comm.dp.sync_wait")
    assert row.suspect is not None
    assert row.suspect.rank == 1
    (finding,) = [f for f in result.findings if f.code == "data-imbalance"]
    assert finding.suspects[0].rank == 1
    assert row.suspect.message in finding.message
    bd = result.breakdown
    kept = bd.wait_paid_us.sum() + bd.wait_host_us.sum() + bd.wait_before_us.sum()
    assert kept == pytest.approx(bd.wait_caused_us.sum())
    return bd


def test_a_wait_carried_in_from_the_left_out_warm_up_is_no_ranks() -> None:
    # A real 2-rank FSDP2 run (tests/data/imbalance_fsdp2_warmup_skew: steps 1-9, the warm-up left out as meshscope
    # run does), three times the batch on rank 1, beside two CPU burners: rank 0 had ended the warm-up step 31 ms
    # late, and rank 1 waited 27 ms for it in step 1's first all-gather. Charged to rank 0 as the last arrival, that
    # one wait made rank 0 the dp sync-wait row's suspect while the finding named rank 1.
    table = RecordTable.from_records(read_records(DATA / "imbalance_fsdp2_warmup_skew" / "records.jsonl"))
    bd = _table_and_finding_name_rank_1(table)
    s = bd.table.steps
    first = s.step == s.step.min()
    dp = AXES.index("dp")
    assert bd.wait_before_us[first, dp].sum() > 25_000  # the wait carried in, kept apart
    assert bd.wait_before_us[~first].sum() == 0  # later late starts have their step before in the records


def _late_start(*, previous: int, gap: float = -1.0) -> list[int]:
    """Rows 0 and 1: rank 1 and rank 0 of one step; rank 0 started 10 µs late (its own time as long as rank 1's)
    and rank 1 waited 10 µs for it. Row 2: rank 0's step before (a group of its own), given as row 1's ``previous``
    or not (-1); ``gap``: row 1's time since its step before ended (row 0's: 1 µs)."""
    pay = paying_rows(
        peer_key=np.array([0, 0, 1], dtype=np.int64),
        step_us=np.array([100.0, 90.0, 100.0]),
        bubble_us=np.zeros(3),
        sync_wait_us=np.array([[10.0, 0, 0, 0, 0], [0.0] * 5, [0.0] * 5]),
        waited_for=np.array([[1, -1, -1, -1, -1], [-1] * 5, [-1] * 5], dtype=np.int64),
        received_from=np.full(3, -1, dtype=np.int64),
        start_us=np.array([0.0, 10.0, -200.0]),
        previous=np.array([-1, previous, -1], dtype=np.int64),
        gap_before_us=np.array([1.0, gap, -1.0]),
    )
    return pay.tolist()


def test_a_rank_that_started_late_passes_the_charge_to_its_step_before() -> None:
    # Rank 1 waited (it passes to rank 0); rank 0 was late only because it started late: its step before pays.
    assert _late_start(previous=2) == [2, 2, 2]
    # Not in the records: no rank-step pays.
    assert _late_start(previous=-1) == [-1, -1, 2]
    # ... unless its own time between the two steps, above its peer's, explains the late start (the peers' median of
    # two is their mean: 5 µs late against it, a gap 10 µs above rank 1's is 5 above the median): then it is its own,
    # whether or not the records hold its step before (a log flush after end_step() delays no step before it)
    assert _late_start(previous=-1, gap=1.0 + 10.0) == [1, 1, 2]
    assert _late_start(previous=2, gap=1.0 + 10.0) == [1, 1, 2]
    assert _late_start(previous=-1, gap=1.0 + 4.0) == [-1, -1, 2]
    assert _late_start(previous=2, gap=1.0 + 4.0) == [2, 2, 2]

"""Who pays for a sync wait: the late rank, or the rank it waited for, followed along the chain of waits."""

from __future__ import annotations

import numpy as np
import pytest

from meshscope.analysis import analyze, break_down
from meshscope.analysis.chains import paying_rows
from meshscope.jobs.loading import load_spec_text
from meshscope.simulation import Noise, Straggler, simulate

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
    assert "through ranks that arrived last because they waited for it" in row.suspect.message
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

"""Who pays for a sync wait: the member that arrived last, or the rank it was itself waiting for.

Exists because "the last member to arrive" is not always the cause. In a pipelined job a stage-0 rank whose
stage-1 neighbour waits in a tensor-parallel all-reduce for a slow stage-1 GPU arrives late at its data-parallel
all-reduce: it is last, yet its own work was on time, it sat in the pipeline bubble waiting for its neighbour, which
sat in sync wait for the slow GPU. Charging the stage-0 rank names a healthy GPU. Here every rank-step that arrived
late *because it waited* passes the charge on to the rank-step it waited for, and so on along the chain of waits,
until a rank-step whose own time (compute, data, optimizer, ...) made it late.

The rule, per rank-step (its peers: the rank-steps of the same step and pipeline stage):

* its **excess waiting** (pipeline bubble + sync wait of every axis, minus the peers' median) is larger than its
  **excess own time** (step time minus that waiting, minus the peers' median), and at least
  :data:`CHAIN_MIN_SHARE` of the median step: it was late because it waited;
* it passes the charge to where most of that excess went: for the pipeline bubble, the pipeline peer it received
  from longest in that step; for the sync wait of an axis, the member that arrived last at the collective that kept
  it waiting longest;
* chains are followed to their end (pointer jumping, a handful of rounds even at 16,384 ranks); a rank-step in a
  cycle of waits keeps its own charge.

A rank-step can also be late because it **started** its step late: its excess start (against the same peers, on one
clock) above both excesses, and at least the floor. Where the rank's own time between the two steps
(``gap_before_us``, less its time blocked in collectives there, above its peers') explains the late start (a log
flush, an evaluation or a save after ``end_step()``), the lateness is the rank-step's own. Otherwise its step before
ran long at its end, after that step's last collective, and the charge passes to the same rank's step before; where
the records do not hold that step (the first recorded step: ``meshscope run`` leaves out the warm-up, a window of a
longer run starts mid-run) it is no rank-step's (``-1``): the lateness came from before the records.

On a run timed on the host (no GPU: its phases are wall times of the training thread), a rank-step can also be late
because the scheduler kept its thread off a CPU longer than its peers' (foreign load, more ranks than cores): that
lateness is the host's, not the rank's work. :func:`own_shares` measures it from the records' run delay
(``runqueue_wait_us``) and the breakdown charges the rank only with its own share; the rest is kept apart as the
host's (``Breakdown.wait_host_us``), never passed to another rank.

Vectorised over rank-steps and intervals; it must not read the category table itself (the breakdown hands it the
arrays) and must not decide anything but who pays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from meshscope.analysis.grouping import grouped_median
from meshscope.records import KIND_CODE, OP_CODE
from meshscope.topology import AXES

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from meshscope.records import RecordTable

CHAIN_MIN_SHARE = 0.01
"""A rank-step passes its charge on only when its excess waiting is at least this share of the median step."""
_MAX_ROUNDS = 64
"""Pointer-jumping rounds: chains up to 2**64 long, i.e. any; a cycle never settles and keeps its own charge."""


def waited_for_rows(
    member_rows: NDArray[np.int64],
    member_axis: NDArray[np.int64],
    wait: NDArray[np.float64],
    last_rows: NDArray[np.int64],
    n_rows: int,
) -> NDArray[np.int64]:
    """Per rank-step and axis, the last arrival of the collective that kept it waiting longest; -1 where none.

    Args:
        member_rows: the rank-step of every collective member (one element per member and instance).
        member_axis: its axis code.
        wait: its exposed sync wait (any unit).
        last_rows: the rank-step that arrived last at its instance (-1 for incomplete instances).
        n_rows: rank-steps in the table.
    """
    out = np.full((n_rows, len(AXES)), -1, dtype=np.int64)
    sel = np.flatnonzero((wait > 0) & (last_rows >= 0) & (last_rows != member_rows))
    if sel.size == 0:
        return out
    key = member_rows[sel] * len(AXES) + member_axis[sel]
    order = np.lexsort((-wait[sel], key))
    key = key[order]
    first = np.ones(key.size, dtype=bool)
    first[1:] = key[1:] != key[:-1]
    chosen = sel[order[first]]
    out.reshape(-1)[key[first]] = last_rows[chosen]
    return out


def received_from_rows(table: RecordTable, step_index: NDArray[np.intp]) -> NDArray[np.int64]:
    """Per rank-step, the rank-step of the pipeline peer it spent longest receiving from in that step; -1 if none."""
    s, iv = table.steps, table.intervals
    out = np.full(table.n_rows, -1, dtype=np.int64)
    recv = np.flatnonzero((iv.kind == KIND_CODE["p2p"]) & (iv.op == OP_CODE["recv"]) & (iv.peer >= 0))
    if recv.size == 0:
        return out
    rows = iv.row[recv].astype(np.int64)
    peers = iv.peer[recv].astype(np.int64)
    n_steps = int(step_index.max()) + 1
    # (rank, step) -> row, for the peers' rank-steps in the same step.
    code = s.rank.astype(np.int64) * n_steps + step_index
    order = np.argsort(code, kind="stable")
    want = peers * n_steps + step_index[rows]
    pos = np.clip(np.searchsorted(code[order], want), 0, order.size - 1)
    found = code[order][pos] == want
    peer_row = np.where(found, order[pos], -1)
    pair = rows * (int(peers.max()) + 1) + peers
    pairs, inverse = np.unique(pair, return_inverse=True)
    duration = np.bincount(inverse.reshape(-1), weights=(iv.end_us[recv] - iv.start_us[recv]).astype(np.float64))
    pair_row = pairs // (int(peers.max()) + 1)
    pair_peer_row = np.full(pairs.size, -1, dtype=np.int64)
    pair_peer_row[inverse.reshape(-1)] = peer_row
    best = np.lexsort((-duration, pair_row))
    first = np.ones(best.size, dtype=bool)
    first[1:] = pair_row[best][1:] != pair_row[best][:-1]
    out[pair_row[best[first]]] = pair_peer_row[best[first]]
    return out


def paying_rows(
    *,
    peer_key: NDArray[np.int64],
    step_us: NDArray[np.float64],
    bubble_us: NDArray[np.float64],
    sync_wait_us: NDArray[np.float64],
    waited_for: NDArray[np.int64],
    received_from: NDArray[np.int64],
    start_us: NDArray[np.float64] | None = None,
    previous: NDArray[np.int64] | None = None,
    gap_before_us: NDArray[np.float64] | None = None,
) -> NDArray[np.int64]:
    """Per rank-step, the rank-step that pays for a wait it caused (itself, or the end of its chain of waits).

    Args:
        peer_key: each rank-step's (step, pipeline stage) group, dense codes.
        step_us: step time of each rank-step.
        bubble_us: its pipeline bubble.
        sync_wait_us: shape ``(rows, 5)``: its sync wait per axis.
        waited_for: shape ``(rows, 5)``: :func:`waited_for_rows`.
        received_from: :func:`received_from_rows`.
        start_us: its start on one clock for all nodes; with ``previous``, a rank-step late because it *started*
            late passes the charge to what made it start late (module docstring).
        previous: the same rank's rank-step of the step before, -1 where the records do not hold it.
        gap_before_us: the rank's own time since its step before ended (-1 unknown; its time blocked in collectives
            there taken out): a late start that this gap explains stays the rank-step's own.

    Returns:
        The paying rank-step of each rank-step; -1 where no rank-step in the records pays (the lateness came from
        before the first step the records hold).
    """
    n = step_us.size
    own = np.arange(n, dtype=np.int64)
    if n == 0:
        return own
    n_groups = int(peer_key.max()) + 1
    waits = np.column_stack([bubble_us, sync_wait_us])
    waiting = waits.sum(axis=1)
    excess_waits = waits - np.column_stack(
        [grouped_median(peer_key, waits[:, k], n_groups)[peer_key] for k in range(waits.shape[1])]
    )
    excess_waiting = waiting - grouped_median(peer_key, waiting, n_groups)[peer_key]
    own_time = step_us - waiting
    excess_own = own_time - grouped_median(peer_key, own_time, n_groups)[peer_key]
    floor = CHAIN_MIN_SHARE * float(np.median(step_us))
    passes = (excess_waiting > excess_own) & (excess_waiting >= floor)
    where = np.argmax(excess_waits, axis=1)
    targets = np.column_stack([received_from, waited_for])
    target = targets[own, where]
    pay = np.where(passes & (target >= 0) & (target != own), target, own)
    nobody = n  # one slot past the rows: "before the records", a chain's end that no rank-step pays
    if start_us is not None and previous is not None:
        excess_start = start_us - grouped_median(peer_key, start_us, n_groups)[peer_key]
        late = (excess_start > excess_own) & (excess_start >= excess_waiting) & (excess_start >= floor)
        before = previous
        if gap_before_us is not None:
            known = gap_before_us >= 0
            gap = np.where(known, gap_before_us, 0.0)
            typical = grouped_median(peer_key[known], gap[known], n_groups)[peer_key] if known.any() else gap
            # its own time between steps, just before this step, made it start late: its own
            explained = known & (gap - typical >= excess_start)
            before = np.where(explained, own, previous)
        pay = np.where(late, np.where(before >= 0, before, nobody), pay)
    pay = np.append(pay, nobody)
    for _ in range(_MAX_ROUNDS):
        nxt = pay[pay]
        if np.array_equal(nxt, pay):
            break
        pay = nxt
    cycling = pay[pay] != pay
    pay = np.where(cycling, np.append(own, nobody), pay)[:n]
    return np.where(pay == nobody, -1, pay)


def host_delay_us(
    *,
    peer_key: NDArray[np.int64],
    own_us: NDArray[np.float64],
    runqueue_us: NDArray[np.float64],
) -> NDArray[np.float64]:
    """Per rank-step, the run delay the host's scheduler added beyond what its peers had for the same work, µs.

    A thread with more to do also waits longer for a CPU on a busy host, in proportion: a rank with three times its
    peers' batch waits about three times their run delay, and that is its work's cost, not the host's. So the host's
    part is the run delay beyond what the peers' *rate* predicts for this rank-step's time on a CPU or off it for
    its own reasons (own time less run delay): ``runqueue - (own - runqueue) x median(peer runqueue / (own -
    runqueue))``, at least 0. A rank whose own time and run delay both match its peers' gets 0; one the scheduler
    kept off a CPU 6 ms longer than its peers for the same work gets 6 ms.

    Args:
        peer_key: each rank-step's (step, pipeline stage) group, dense codes.
        own_us: its own time (step time minus sync wait and pipeline bubble).
        runqueue_us: its training threads' run delay (time runnable but not running) in the step.
    """
    if own_us.size == 0:
        return np.zeros(0, dtype=np.float64)
    n_groups = int(peer_key.max()) + 1
    base = np.maximum(own_us - runqueue_us, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where(base > 0, runqueue_us / base, 0.0)
    return np.maximum(runqueue_us - base * grouped_median(peer_key, rate, n_groups)[peer_key], 0.0)


def own_shares(
    *,
    peer_key: NDArray[np.int64],
    own_us: NDArray[np.float64],
    host_us: NDArray[np.float64],
    gap_before_us: NDArray[np.float64] | None = None,
) -> NDArray[np.float64]:
    """Per rank-step, the share (0-1) of its lateness that its own work made; the rest is the host's scheduler.

    Its lateness is its excess own time over its peers' median, plus its own time between the steps just before it
    beyond theirs (a late start the rank's own log flush or evaluation made); the host's part (:func:`host_delay_us`,
    the run delay inside the step) comes out of it first: ``1 - host / lateness``; 0 when the host's part covers it
    (or it was not late and still waited for a CPU longer than its peers: its lateness was the scheduler's); 1 when
    the host's part is 0.

    Args:
        peer_key: each rank-step's (step, pipeline stage) group, dense codes.
        own_us: its own time (step time minus sync wait and pipeline bubble).
        host_us: :func:`host_delay_us`.
        gap_before_us: its own time since its step before ended (-1 unknown), as :func:`paying_rows` takes it.
    """
    if own_us.size == 0:
        return np.ones(0, dtype=np.float64)
    n_groups = int(peer_key.max()) + 1
    excess_own = own_us - grouped_median(peer_key, own_us, n_groups)[peer_key]
    if gap_before_us is not None:
        known = gap_before_us >= 0
        if known.any():
            gap = np.where(known, gap_before_us, 0.0)
            typical = grouped_median(peer_key[known], gap[known], n_groups)[peer_key]
            excess_own = excess_own + np.where(known, np.clip(gap - typical, 0.0, None), 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(excess_own > host_us, 1.0 - host_us / excess_own, 0.0)
    return np.where(host_us > 0, share, 1.0)

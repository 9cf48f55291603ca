"""Chrome trace export: schema, events against the records (counts, µs), aligned clocks, sync waits, nesting, bounds."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from meshscope.analysis.breakdown import SYNC_WAIT, break_down, comm_category
from meshscope.records import Interval, RecordTable, StepRecord, read_table
from meshscope.reports.traces import (
    build_trace,
    coord_text,
    degrees,
    row_offsets_us,
    step_times,
    sync_waits,
    write_trace,
)
from meshscope.topology.layout import AXES, RankCoord

DATA_DIR = Path(__file__).parent.parent / "data"
DP8 = DATA_DIR / "dp8_straggler" / "records.jsonl"
PP2 = DATA_DIR / "pp2_tp2_dp2_straggler" / "records.jsonl"
MS = 1000


def load(path: Path) -> tuple[RecordTable, object]:
    table = read_table(path)
    return table, break_down(table, p2p_bandwidth_bytes_per_s=100e9)


def x_events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def meta(trace: dict, name: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == name]


def thread_names(trace: dict) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in meta(trace, "thread_name")}


# ---------------------------------------------------------------------------- schema


def test_written_file_is_chrome_trace_event_json(tmp_path: Path):
    table, bd = load(DP8)
    path = write_trace(tmp_path / "trace.json", table, bd)
    trace = json.loads(path.read_text(encoding="utf-8"))
    assert set(trace) >= {"traceEvents", "displayTimeUnit", "otherData"}
    assert trace["displayTimeUnit"] == "ms"
    for e in trace["traceEvents"]:
        assert e["ph"] in {"X", "M", "s", "f"}
        assert isinstance(e["pid"], int)
        assert isinstance(e["tid"], int)
        assert isinstance(e["name"], str)
        if e["ph"] == "X":
            assert isinstance(e["ts"], int)
            assert isinstance(e["dur"], int)
            assert e["dur"] >= 0
            assert isinstance(e["cat"], str)
            assert isinstance(e["args"], dict)
        if e["ph"] == "M":
            assert e["name"] in {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}
            assert "args" in e
    # Perfetto treats pid/tid 0 as the swapper: every process and thread id starts at 1.
    assert min(e["pid"] for e in trace["traceEvents"]) >= 1
    assert min(e["tid"] for e in trace["traceEvents"]) >= 1


def test_one_process_per_node_one_thread_per_rank():
    table, bd = load(DP8)
    trace = build_trace(table, bd)
    processes = {e["pid"]: e["args"]["name"] for e in meta(trace, "process_name")}
    assert sorted(processes.values()) == ["node-0", "node-1"]
    names = thread_names(trace)
    assert sorted(names.values()) == sorted(f"rank {r} (dp={r} tp=0 pp=0)" for r in range(8))
    # Each rank's thread lives in its node's process.
    node_of = {int(r): table.node_name(int(n)) for r, n in zip(table.steps.rank, table.steps.node, strict=True)}
    for (pid, _), name in names.items():
        rank = int(name.split()[1])
        assert processes[pid] == node_of[rank]


# ---------------------------------------------------------------------------- events against the records


def test_every_interval_and_step_becomes_one_event_with_its_microseconds():
    table, bd = load(DP8)
    trace = build_trace(table, bd)
    events = x_events(trace)
    by_cat = Counter(e["cat"] for e in events)
    assert by_cat == {"step": 16, "data": 16, "compute": 32, "comm.dp": 16, "optimizer": 16, "sync_wait.dp": 7}

    # Independently from the record objects: (rank, cat, ts, dur) relative to the earliest step start.
    offset = dict(zip(table.steps.node.tolist(), row_offsets_us(table, bd).tolist(), strict=True))
    assert set(offset.values()) == {0}  # this scenario shares one clock
    origin = min(r.start_us for r in table.to_records())
    expected = Counter()
    for rec in table.to_records():
        expected[(rec.rank, "step", rec.start_us - origin, rec.end_us - rec.start_us)] += 1
        for iv in rec.intervals:
            cat = iv.kind.value if iv.axis is None else f"{iv.kind.value}.{iv.axis.value}"
            expected[(rec.rank, cat, iv.start_us - origin, iv.end_us - iv.start_us)] += 1
    rank_of_tid = {tid: int(name.split()[1]) for (_, tid), name in thread_names(trace).items()}
    got = Counter((rank_of_tid[e["tid"]], e["cat"], e["ts"], e["dur"]) for e in events if e["cat"] != "sync_wait.dp")
    assert got == expected
    assert trace["otherData"]["origin_us"] == origin


def test_comm_events_carry_axis_op_bytes_group_seq():
    table, bd = load(DP8)
    comm = [e for e in x_events(build_trace(table, bd)) if e["cat"] == "comm.dp"]
    assert {e["name"] for e in comm} == {"dp all_reduce"}
    for e in comm:
        assert e["args"]["axis"] == "dp"
        assert e["args"]["op"] == "all_reduce"
        assert e["args"]["bytes"] == 8 * 1024 * 1024
        assert e["args"]["group"] == "dp:0"
        assert e["args"]["seq"] in {0, 1}
        assert e["args"]["group_size"] == 8


def test_step_events_carry_the_breakdown():
    table, bd = load(DP8)
    steps = [e for e in x_events(build_trace(table, bd)) if e["cat"] == "step"]
    step0 = {int(e["args"]["step"]): e for e in steps if e["name"] == "step 0" and e["tid"] == 3}  # rank 2
    args = step0[0]["args"]
    assert args["step_us"] == 49 * MS
    assert args["compute_us"] == 31 * MS
    assert args["wait_caused.dp_us"] == pytest.approx(35 * MS)
    assert f"{comm_category('dp', SYNC_WAIT)}_us" not in args  # the late rank did not wait


# ---------------------------------------------------------------------------- sync waits and flows


def test_sync_waits_are_child_events_with_a_flow_from_the_late_rank():
    """dp8: in step 0 rank 2 arrives 5 ms late (37 ms) at the all-reduce the 7 others entered at 32 ms."""
    table, bd = load(DP8)
    trace = build_trace(table, bd)
    names = thread_names(trace)
    rank_of_tid = {tid: int(name.split()[1]) for (_, tid), name in names.items()}
    waits = [e for e in x_events(trace) if e["cat"] == "sync_wait.dp"]
    assert sorted(rank_of_tid[e["tid"]] for e in waits) == [0, 1, 3, 4, 5, 6, 7]
    for e in waits:
        assert (e["ts"], e["dur"]) == (32 * MS, 5 * MS)
        assert e["args"]["late_rank"] == 2
        assert e["args"]["wait_us"] == 5 * MS
        assert e["args"]["group"] == "dp:0"
        assert e["args"]["seq"] == 0
    starts = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "s"}
    finishes = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "f"}
    assert set(starts) == set(finishes)
    assert len(starts) == 7
    for flow_id, s in starts.items():
        f = finishes[flow_id]
        assert rank_of_tid[s["tid"]] == 2
        assert s["ts"] == 37 * MS  # the late arrival
        assert f["bp"] == "e"
        assert 32 * MS <= f["ts"] < 37 * MS  # inside the waiter's sync-wait event
        assert rank_of_tid[f["tid"]] != 2


def test_sync_waits_match_the_breakdown_when_nothing_hides_them():
    """In the simulated pp2·tp2·dp2 job nothing overlaps a collective, so every wait is exposed sync wait."""
    table, bd = load(PP2)
    waits = sync_waits(table, bd)
    assert len(waits) > 0
    per_row = np.bincount(
        table.intervals.row[waits.interval], weights=waits.end_us - waits.start_us, minlength=table.n_rows
    )
    exposed = sum(bd.us(comm_category(a, SYNC_WAIT)) for a in AXES)
    np.testing.assert_allclose(per_row, exposed)
    # The late rank never waits in the instance it is late for.
    late_rows = bd.collectives.last_row[waits.instance]
    assert not np.any(table.intervals.row[waits.interval] == late_rows)


def test_clocks_are_aligned_in_the_trace():
    """Node-1's clock runs 2.5 ms ahead in the pp2 scenario; its events must line up with node-0's."""
    table, bd = load(PP2)
    assert sorted(set(bd.clock.offset_us.tolist())) == [0, 2500]
    trace = build_trace(table, bd, steps=[0])
    names = thread_names(trace)
    rank_of_tid = {tid: int(name.split()[1]) for (_, tid), name in names.items()}
    # The dp all-reduce of group dp:0.0 (ranks 0 and 2, on different nodes) ends at the same aligned instant.
    ends = {
        rank_of_tid[e["tid"]]: e["ts"] + e["dur"]
        for e in x_events(trace)
        if e["cat"] == "comm.dp" and e["args"]["group"] == "dp:0.0"
    }
    assert set(ends) == {0, 2}
    assert ends[0] == ends[2]
    # Steps start together on the aligned clock (they started together in the simulation).
    starts = {e["ts"] for e in x_events(trace) if e["cat"] == "step"}
    assert starts == {0}


# ---------------------------------------------------------------------------- nesting (Chrome's rule per thread)


def overlapping_job() -> RecordTable:
    """Two ranks whose dp all-reduce overlaps the backward pass without nesting in it (bucketed gradient sync)."""
    recs = []
    for rank in range(2):
        late = 2 * MS if rank == 1 else 0
        ivs = (
            Interval(kind="compute", start_us=0, end_us=10 * MS, phase="forward"),
            Interval(kind="compute", start_us=10 * MS, end_us=30 * MS + late, phase="backward"),
            Interval(
                kind="comm", start_us=20 * MS + late, end_us=35 * MS, axis="dp", op="all_reduce", group="dp:0", seq=0
            ),
            Interval(kind="optimizer", start_us=35 * MS, end_us=36 * MS),
        )
        recs.append(
            StepRecord(
                job="overlap",
                step=0,
                rank=rank,
                coord=RankCoord(dp=rank, tp=0, pp=0, cp=0, ep=0),
                node="n0",
                start_us=0,
                end_us=36 * MS,
                intervals=ivs,
            )
        )
    return RecordTable.from_records(recs)


def assert_nested_per_thread(trace: dict) -> None:
    per_thread = defaultdict(list)
    for e in x_events(trace):
        per_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in per_thread.values():
        stack: list[int] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], f"{(start, end)} overlaps its enclosing event ending {stack[-1]}"
            stack.append(end)


def test_overlapping_intervals_go_to_an_extra_lane_and_every_thread_nests():
    table = overlapping_job()
    bd = break_down(table)
    trace = build_trace(table, bd)
    assert_nested_per_thread(trace)
    names = set(thread_names(trace).values())
    assert "rank 0 (dp=0 tp=0 pp=0) lane 2" in names
    # The sync-wait part (rank 0 waits 20 -> 22 ms for rank 1) sits on its collective's lane.
    wait = next(e for e in x_events(trace) if e["cat"] == "sync_wait.dp")
    comm = next(e for e in x_events(trace) if e["cat"] == "comm.dp" and e["tid"] == wait["tid"])
    assert (wait["ts"], wait["dur"]) == (20 * MS, 2 * MS)
    assert comm["ts"] == wait["ts"]


@pytest.mark.parametrize("path", [DP8, PP2], ids=["dp8", "pp2_tp2_dp2"])
def test_scenarios_nest_per_thread(path: Path):
    table, bd = load(path)
    assert_nested_per_thread(build_trace(table, bd))


# ---------------------------------------------------------------------------- bounds and helpers


def test_step_and_rank_selection_bounds_the_trace():
    table, bd = load(PP2)
    full = build_trace(table, bd)
    part = build_trace(table, bd, steps=[2], ranks=[1, 5])
    assert part["otherData"]["steps"] == [2]
    assert part["otherData"]["ranks_in_trace"] == 2
    assert part["otherData"]["ranks_in_records"] == 8
    assert {n.split(" (")[0] for n in thread_names(part).values()} == {"rank 1", "rank 5"}
    steps = [e for e in x_events(part) if e["cat"] == "step"]
    assert sorted(e["name"] for e in steps) == ["step 2", "step 2"]
    rows = np.flatnonzero((table.steps.step == 2) & np.isin(table.steps.rank, [1, 5]))
    n_intervals = int(np.isin(table.intervals.row, rows).sum())
    assert len([e for e in x_events(part) if e["cat"] != "step" and not e["cat"].startswith("sync")]) == n_intervals
    assert len(x_events(part)) < len(x_events(full)) / 10
    # Flows only where the late rank is in the trace.
    for e in part["traceEvents"]:
        if e["ph"] == "s":
            assert thread_names(part)[(e["pid"], e["tid"])].startswith(("rank 1 ", "rank 5 "))


def test_breakdown_of_another_table_is_refused():
    _, bd = load(DP8)
    other = read_table(PP2)
    with pytest.raises(ValueError, match="breakdown covers 16 rank-steps"):
        build_trace(other, bd)


@pytest.mark.parametrize(
    ("durations", "expected"),
    [
        ([10, 30, 20, 25], (1, 2)),  # slowest step 1; the others sorted 10, 20, 25 -> lower median 20 (step 2)
        ([10, 30], (1, 0)),
        ([7], (0,)),
    ],
    ids=["four", "two", "one"],
)
def test_representative_steps(durations: list[int], expected: tuple[int, ...]):
    recs = [
        StepRecord(
            job="t",
            step=s,
            rank=0,
            coord=RankCoord(dp=0, tp=0, pp=0, cp=0, ep=0),
            node="n",
            start_us=1000 * s,
            end_us=1000 * s + d,
        )
        for s, d in enumerate(durations)
    ]
    times = step_times(RecordTable.from_records(recs))
    assert times.representative() == expected
    assert times.us(1 if len(durations) > 1 else 0) == durations[1 if len(durations) > 1 else 0]


def test_coord_text_names_used_axes_only():
    table, _ = load(PP2)
    assert degrees(table) == {"dp": 2, "tp": 2, "pp": 2, "cp": 1, "ep": 1}
    assert coord_text([1, 0, 1, 0, 0], degrees(table)) == "dp=1 tp=0 pp=1"
    assert coord_text([1, 0, 1, 3, 0], {"dp": 2, "tp": 1, "pp": 2, "cp": 4, "ep": 1}) == "dp=1 tp=0 pp=1 cp=3"


def test_a_renumbered_step_shows_the_loops_own_number_and_its_wait_for_a_cpu():
    table, _ = load(DP8)
    s = table.steps
    user_step = np.where(s.step == 1, 0, -1)  # step 1 was the loop's step 0 again (a new epoch)
    runqueue = np.where(s.rank == 2, 4_000, -1)
    table = replace(table, steps=replace(s, user_step=user_step, runqueue_wait_us=runqueue))
    steps = [e for e in x_events(build_trace(table, break_down(table))) if e["cat"] == "step"]
    names = {(e["tid"], e["name"]) for e in steps}
    assert (3, "step 1 (loop step 0)") in names
    assert (3, "step 0") in names
    by_name = {(e["tid"], e["name"]): e["args"] for e in steps}
    assert by_name[(3, "step 1 (loop step 0)")]["user_step"] == 0
    assert "user_step" not in by_name[(3, "step 0")]
    assert by_name[(3, "step 0")]["runqueue_wait_us"] == 4_000  # rank 2 (tid 3)
    assert "runqueue_wait_us" not in by_name[(2, "step 0")]

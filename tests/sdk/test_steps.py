"""Turning a step's marks into its record: blocked windows cut out of compute, incomplete operations left out."""

from __future__ import annotations

import json
import mmap
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from meshscope import records
from meshscope.records import BetweenSteps, _parse_record
from meshscope.sdk.clocks import HostClock
from meshscope.sdk.steps import (
    BETWEEN_COMM,
    BETWEEN_KINDS,
    MAX_RAISED_CHARS,
    WAIT,
    OpMeta,
    RecordHeader,
    RssPeak,
    SchedStat,
    StepIntervals,
    StepState,
    build_record,
    encode_record,
    merge_windows,
    new_op,
    subtract_windows,
)

US = 1000  # ns


def test_windows_merge_across_small_gaps_and_cut_compute() -> None:
    assert merge_windows([(10, 20), (25, 30), (60, 70), (65, 68)]) == [(10, 30), (60, 70)]
    assert subtract_windows(0, 100, [(10, 30), (60, 70)]) == [(0, 10), (30, 60), (70, 100)]
    assert subtract_windows(0, 100, [(0, 100)]) == []
    assert subtract_windows(20, 50, [(0, 10), (40, 200)]) == [(20, 40)]


@pytest.fixture
def clock() -> HostClock:
    c = HostClock()
    c.offset_ns = 0  # host microseconds == perf_counter microseconds, for hand-computed numbers
    return c


TP0 = OpMeta(kind="comm", axis="tp", op="all_reduce", group="tp:0", group_size=2, peer=None)


def _op(start_us: int, end_us: int | None, seq: int) -> list[object]:
    return new_op(TP0, seq, 512, start_us * US, None if end_us is None else end_us * US)


def test_a_step_becomes_a_record(clock: HostClock) -> None:
    st = StepState(3, 1000 * US, 1000 * US)
    st.end_ns = 2000 * US
    st.segments = [("data", None, 1000 * US, 1100 * US), ("compute", "forward", 1100 * US, 1900 * US)]
    st.windows = [[1200 * US, 1300 * US], [1310 * US, 1400 * US], [1950 * US, 1990 * US]]  # 10 µs apart: one window
    st.ops = [_op(1200, 1400, 0), _op(1500, None, 1)]  # the second never completed
    st.tokens, st.sequences, st.longest, st.work = 8, 2, 5, 34.0
    st.attention = [(1150 * US, 1160 * US), (1800 * US, 1830 * US)]
    header = {"schema": "meshscope.step/1", "job": "j", "step": 0, "rank": 1, "coord": {}, "node": "n"}
    header["coord"] = {"dp": 0, "tp": 1, "pp": 0, "cp": 0, "ep": 0}
    record, incomplete = build_record(st, clock=clock, header=header, device=False)
    assert incomplete == 1
    assert list(record)[:4] == ["schema", "job", "step", "rank"]  # the order the collector's fast path relies on
    assert (record["step"], record["start_us"], record["end_us"]) == (3, 1000, 2000)
    assert [(iv["kind"], iv.get("phase"), iv["start_us"], iv["end_us"]) for iv in record["intervals"]] == [
        ("data", None, 1000, 1100),
        ("compute", "forward", 1100, 1200),
        ("comm", None, 1200, 1400),
        ("compute", "forward", 1400, 1900),  # the blocked 1200..1400 is not compute; 1950.. lies after the phase
    ]
    assert record["stats"] == {
        "tokens": 8,
        "sequences": 2,
        "longest_sequence": 5,
        "attention_work": 34.0,
        "attention_us": 40,
    }
    parsed = _parse_record(record, "built")
    assert parsed.intervals[2].seq == 0
    assert parsed.intervals[2].size_bytes == 512


def _covered_runs(a: int, b: int, windows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Oracle: maximal runs of the unit cells [t, t+1) of [a, b) that no window [w0, w1) covers."""
    runs: list[tuple[int, int]] = []
    for t in range(a, b):
        if any(w0 <= t < w1 for w0, w1 in windows):
            continue
        if runs and runs[-1][1] == t:
            runs[-1] = (runs[-1][0], t + 1)
        else:
            runs.append((t, t + 1))
    return runs


@pytest.mark.parametrize("offset_ns", [0, 1_700_000_000_123_456_789], ids=["offset-0", "wall-clock-offset"])
def test_intervals_match_a_brute_force_oracle(offset_ns: int) -> None:
    """Compute minus blocked windows, and operation spans, against unit-cell arithmetic on ``HostClock.to_us``."""
    clock = HostClock()
    clock.offset_ns = offset_ns
    rng = random.Random(7)
    t0 = 5_000_000_000 + rng.randint(0, 999)  # perf_counter_ns of the step start, sub-µs part included

    def mark(lo_us: int, hi_us: int) -> int:
        return t0 + rng.randint(lo_us * US, hi_us * US)

    for _ in range(300):
        st = StepState(0, t0, t0)
        st.end_ns = t0 + 3000 * US
        segments = []
        for _ in range(rng.randint(1, 6)):
            a = mark(0, 2500)
            segments.append((a, a + rng.randint(0, 400 * US)))
        windows = []
        for _ in range(rng.randint(0, 25)):
            w0 = mark(-50, 2900)  # may start before the step: clipped to its start
            windows.append((w0, w0 + rng.randint(0, 120 * US)))
        ops = [(s, s + rng.randint(-3 * US, 90 * US)) for s in (mark(0, 2900) for _ in range(rng.randint(0, 8)))]
        st.segments = [("compute", "forward", a, b) for a, b in segments]
        st.windows = list(windows)
        st.ops = [new_op(TP0, i, 8, s, e) for i, (s, e) in enumerate(ops)]
        record, _ = build_record(st, clock=clock, header={"step": 0}, device=False)
        us = clock.to_us
        start = us(t0)
        in_us = sorted((max(us(w0), start), us(w1)) for w0, w1 in windows)
        merged = [(a, b) for a, b in merge_windows(in_us) if b > a]  # a 0 µs window splits a piece, removes nothing
        expected = sorted(run for a, b in segments for run in _covered_runs(us(a), max(us(a), us(b)), merged))
        got = [(iv["start_us"], iv["end_us"]) for iv in record["intervals"] if iv["kind"] == "compute"]
        assert _joined(sorted(got)) == _joined(expected)
        got_ops = sorted((iv["start_us"], iv["end_us"]) for iv in record["intervals"] if iv["kind"] == "comm")
        assert got_ops == sorted((us(s), max(us(s), us(e))) for s, e in ops)


def _joined(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent pieces joined (a zero-length window may split a piece in two that touch)."""
    out: list[tuple[int, int]] = []
    for a, b in pieces:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _random_step(rng: random.Random) -> StepState:
    metas = [
        TP0,
        OpMeta(kind="comm", axis="dp", op="reduce_scatter", group='dp_cp:0~"odd" név', group_size=4, peer=None),
        OpMeta(kind="p2p", axis="pp", op="send", group="pp:0-4", group_size=None, peer=4),
    ]
    st = StepState(rng.randint(0, 10**6), 10**9, 10**9)
    st.end_ns = 10**9 + 5000 * US
    kinds = [("data", None), ("compute", "forward"), ("compute", "backward"), ("compute", None), ("optimizer", None)]
    for _ in range(rng.randint(0, 12)):
        a = 10**9 + rng.randint(0, 4800) * US + rng.randint(0, 999)  # sub-µs marks: the µs conversion floors
        st.segments.append((*rng.choice(kinds), a, a + rng.randint(0, 300) * US))
    for seq in range(rng.randint(0, 15)):
        s = 10**9 + rng.randint(0, 4900) * US + rng.randint(0, 999)
        end = None if rng.random() < 0.1 else s + rng.randint(-5, 80) * US  # incomplete, or ending "before" start
        op = new_op(rng.choice(metas), seq, rng.choice([None, 0, 4096]), s, end)
        st.ops.append(op)
        if end is not None and rng.random() < 0.7:
            wait = s + rng.randint(0, 100) * US  # waited from its issue (a synchronous call) or later, maybe after it
            op[WAIT] = wait
            st.windows.append((wait, end))
    st.windows.append([10**9 + 4000 * US, None])  # DDP's tail, never completed: not a window
    if rng.random() < 0.5:
        st.tokens, st.sequences, st.longest, st.work = 96, 3, 64, 4096.5
        st.attention = [(10**9 + 100 * US, 10**9 + 130 * US)]
        st.peak_memory_bytes = 123_456_789
    if rng.random() < 0.5:
        st.user_step = rng.randint(0, 50)
    if rng.random() < 0.2:
        st.raised = rng.choice(["RuntimeError", "torch.OutOfMemoryError", 'odd "name" ✓'])
    if rng.random() < 0.7:
        st.gap_ns = rng.randint(0, 10**9)
        kinds = ["data", "compute", "optimizer", "checkpoint", "eval", "comm"]
        st.between_ns = {k: rng.randint(0, 3000) for k in rng.sample(kinds, rng.randint(0, 6))}
    return st


def test_the_encoded_record_is_the_json_of_the_reference_record(clock: HostClock) -> None:
    """The fast encoder against an independent oracle: ``json.dumps`` of :func:`build_record`'s dict."""
    header = {"schema": "meshscope.step/1", "job": 'a "job" ✓', "step": 0, "rank": 3}
    header |= {"coord": {"dp": 1, "tp": 1, "pp": 0, "cp": 0, "ep": 0}, "node": "node-0", "nvlink_domain": "nvl-0"}
    sdk = {"records_sent": 4, "records_dropped": 1, "hook_errors": 0}
    rng = random.Random(11)
    for _ in range(200):
        st = _random_step(rng)
        reference, incomplete = build_record(st, clock=clock, header=header, device=False)
        intervals = StepIntervals(st, clock, device=False)
        data = encode_record(st, intervals, header=RecordHeader(header), sdk=sdk)
        assert data == json.dumps({**reference, "sdk": sdk}, separators=(",", ":"), ensure_ascii=False).encode()
        assert intervals.incomplete == incomplete == sum(op[1] is None for op in st.ops)
        record = _parse_record(json.loads(data), "encoded")  # and it is a valid record
        assert record.user_step == st.user_step
        assert record.raised == st.raised
        assert record.gap_before_us == (None if st.gap_ns is None else st.gap_ns // 1000)
        if st.gap_ns is not None:
            between = {f"{k}_us": ns // 1000 for k, ns in st.between_ns.items()}
            assert record.between_steps == BetweenSteps(**between)


def test_the_sdk_writes_the_between_steps_kinds_of_the_schema() -> None:
    assert BETWEEN_KINDS == records.BETWEEN_KINDS
    assert BETWEEN_COMM == records.BETWEEN_COMM
    assert MAX_RAISED_CHARS == records.MAX_RAISED_CHARS


def test_waiting_is_cut_out_of_compute_and_an_optimizer_phase_is_never_lost(clock: HostClock) -> None:
    st = StepState(0, 100 * US, 100 * US)
    st.end_ns = 400 * US
    st.segments = [("compute", "backward", 100 * US, 250 * US), ("optimizer", None, 250 * US, 260 * US)]
    sync = new_op(TP0, 0, 8, 120 * US, 150 * US, wait=120 * US)  # a synchronous call: blocked throughout
    late = new_op(TP0, 1, 8, 160 * US, 262 * US, wait=200 * US)  # issued, then waited from 200 µs (into the optimizer)
    background = new_op(TP0, 2, 8, 210 * US, 240 * US)  # never waited on: runs under compute
    st.ops = [sync, late, background]
    st.windows = [(120 * US, 150 * US), (200 * US, 262 * US)]
    record, _ = build_record(st, clock=clock, header={"step": 0}, device=False)
    us = clock.to_us
    busy = [(iv["kind"], iv["start_us"], iv["end_us"]) for iv in record["intervals"] if iv["kind"] != "comm"]
    # the optimizer sat in the wait throughout: its interval stays, of length 0, where the phase ended
    assert busy == [
        ("compute", us(100 * US), us(120 * US)),
        ("compute", us(150 * US), us(200 * US)),
        ("optimizer", us(260 * US), us(260 * US)),
    ]
    waits = [iv.get("wait_us") for iv in record["intervals"] if iv["kind"] == "comm"]
    assert waits == [us(150 * US) - us(120 * US), us(262 * US) - us(200 * US), None]


def test_peak_rss_follows_the_process_and_resets() -> None:
    peak = RssPeak()
    peak.reset()
    before = peak.read()
    if before is None:
        pytest.skip("this kernel does not let the process reset its peak RSS (/proc/self/clear_refs)")
    # Fresh pages from the kernel, not from malloc (which may keep freed memory: tune_memory_for_columns).
    block = mmap.mmap(-1, 64 << 20)
    for offset in range(0, len(block), 1 << 12):  # touch every page: 64 MiB resident
        block[offset] = 1
    during = peak.read()
    block.close()
    peak.reset()  # the peak falls back to what is resident now
    after = peak.read()
    peak.close()
    assert during is not None
    assert after is not None
    assert during - before >= 60 << 20
    assert during - after >= 60 << 20


SPIN_ON_ONE_CPU = """
import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
print("spinning", flush=True)
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(100_000): pass
"""


def test_run_delay_is_the_time_the_thread_waited_for_a_cpu() -> None:
    # A spinning process pinned to this thread's CPU: the two share it, so the thread waits for it while it spins;
    # the run delay grows by a good part of the wall time, never by more, and with the time on a CPU makes up the
    # wall time of a thread that never blocked.
    cpu = min(os.sched_getaffinity(0))
    old = os.sched_getaffinity(0)
    burner = subprocess.Popen([sys.executable, "-c", SPIN_ON_ONE_CPU, str(cpu)], stdout=subprocess.PIPE, text=True)
    try:
        assert burner.stdout is not None
        assert burner.stdout.readline() == "spinning\n"
        os.sched_setaffinity(0, {cpu})
        sched = SchedStat()
        before = sched.read()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.4:
            pass
        wall_ns = (time.perf_counter() - t0) * 1e9
        after = sched.read()
        sched.close()
    finally:
        os.sched_setaffinity(0, old)
        burner.kill()
        burner.wait()
        if burner.stdout is not None:
            burner.stdout.close()
    assert before is not None
    assert after is not None
    on_cpu, delay = after[0] - before[0], after[1] - before[1]
    assert 0.1 * wall_ns < delay <= wall_ns + 20e6  # schedstat is updated at switches: a tick of slack
    assert 0.1 * wall_ns < on_cpu <= wall_ns + 20e6
    assert 0.8 * wall_ns < on_cpu + delay <= wall_ns + 40e6


def test_time_asleep_is_neither_on_a_cpu_nor_run_delay() -> None:
    # The injected straggler of tests/scripts/faults.py, and a rank waiting for a device, are off a CPU and not
    # runnable: neither number grows by the sleep.
    sched = SchedStat()
    before = sched.read()
    t0 = time.perf_counter()
    time.sleep(0.3)
    wall_ns = (time.perf_counter() - t0) * 1e9
    after = sched.read()
    sched.close()
    assert before is not None
    assert after is not None
    assert after[0] - before[0] < 0.5 * wall_ns
    assert after[1] - before[1] < 0.5 * wall_ns


def test_run_delay_read_from_another_thread_is_unknown() -> None:
    delay = SchedStat()
    first = delay.read()  # opened here: this thread's
    assert first is not None
    seen: list[object] = []
    reader = threading.Thread(target=lambda: seen.extend((delay.read(), delay.run_delay())))
    reader.start()
    reader.join()
    assert seen == [None, -1]  # never another thread's numbers, by either read
    assert first[1] <= delay.run_delay() <= delay.read()[1]  # type: ignore[index] # the same counter, read on
    delay.close()


def test_the_last_ddp_bucket_ends_where_the_reducers_wait_ended() -> None:
    # DDP's reducer waits for its buckets at the end of backward; the backend reports a bucket's completion on its
    # own thread. Where the step thread wakes later than the last completion (a host that holds it off its core),
    # that time was in no interval: "outside phases and collectives", once a transient straggler. The last bucket
    # now ends where the wait did; an earlier bucket keeps its completion; none ends after the wait.
    from meshscope.sdk.operations import _DdpWait  # noqa: PLC0415 - the rule itself, without a backward pass
    from meshscope.sdk.steps import END  # noqa: PLC0415

    class Sink:
        def __init__(self) -> None:
            self.now = 0

        def mark_end(self) -> int:
            return self.now

        def device_mark(self, host_ns: int) -> int:
            return host_ns

        def fault(self, where: str, exc: BaseException) -> None:
            raise AssertionError(where) from exc

    sink = Sink()
    first = [3_000, 3_500, None, 7, 2_000, None, 3_000, None]  # issued at 3.0, completed at 3.5
    last = [3_600, 4_818, None, 8, 2_000, None, 3_600, None]  # completed at 4.818
    late = [3_700, None, None, 9, 2_000, None, 3_700, None]  # not completed by the wait's end: it ends there
    wait = _DdpWait(sink, [first, last], lambda fn: None)
    wait.start(3_900)
    sink.now = 9_175
    wait.finished()
    assert (first[END], last[END], wait.window) == (3_500, 9_175, [3_900, 9_175])
    wait = _DdpWait(sink, [first, late], lambda fn: None)
    wait.finished()
    assert (first[END], late[END]) == (3_500, 9_175)

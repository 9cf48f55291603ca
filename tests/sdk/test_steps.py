"""Turning a step's marks into its record: blocked windows cut out of compute, incomplete operations left out."""

from __future__ import annotations

import pytest

from meshscope.records import _parse_record
from meshscope.sdk.clocks import HostClock
from meshscope.sdk.steps import Op, StepState, build_record, merge_windows, subtract_windows

US = 1000  # ns


def test_windows_merge_across_small_gaps_and_cut_compute() -> None:
    assert merge_windows([(10, 20), (25, 30), (60, 70), (65, 68)]) == [(10, 30), (60, 70)]
    assert subtract_windows(0, 100, [(10, 30), (60, 70)]) == [(0, 10), (30, 60), (70, 100)]
    assert subtract_windows(0, 100, [(0, 100)]) == []
    assert subtract_windows(20, 50, [(0, 10), (40, 200)]) == [(20, 40)]


@pytest.fixture
def clock() -> HostClock:
    c = HostClock()
    c._offset_ns = 0  # host microseconds == perf_counter microseconds, for hand-computed numbers
    return c


def _op(start_us: int, end_us: int | None, seq: int) -> Op:
    op = Op(
        kind="comm",
        axis="tp",
        op="all_reduce",
        group="tp:0",
        seq=seq,
        nbytes=512,
        group_size=2,
        peer=None,
        start=start_us * US,
    )
    op.end = None if end_us is None else end_us * US
    return op


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

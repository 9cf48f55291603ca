"""The training-loop source: real datagrams in, the core's breakdown per complete step, bounded buffers, bad input."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from meshscope.sdk import RecordReader, RecordSender, encode
from meshscope_sidecar.sources.train_events import TrainEventsSource

if TYPE_CHECKING:
    from pathlib import Path

# Rank 0 of a tp=2 pod, one 100 ms step (times in ms from the step's start), categories derived by hand:
#   data 0-10 | forward 10-40 | tp all_reduce 35-50 (5 ms hidden under compute, 40-50 exposed) | backward 50-80
#   dp all_reduce 75-90 (80-85 exposed alone) | tp all_reduce 85-90 (85-90: dp and tp share it, 2.5 ms each)
#   optimizer 90-97 | nothing 97-100
# compute 60, data 10, exposed tp 10 + 2.5 = 12.5, exposed dp 5 + 2.5 = 7.5, optimizer 7, other 3 (sum 100 ms);
# own time = 100 - 12.5 - 7.5 = 80 ms.
RANK0 = [
    {"kind": "data", "start_us": 0, "end_us": 10},
    {"kind": "compute", "start_us": 10, "end_us": 40, "phase": "forward"},
    {
        "kind": "comm",
        "start_us": 35,
        "end_us": 50,
        "axis": "tp",
        "op": "all_reduce",
        "group": "tp:0",
        "seq": 1,
        "bytes": 1 << 20,
        "group_size": 2,
    },
    {"kind": "compute", "start_us": 50, "end_us": 80, "phase": "backward"},
    {
        "kind": "comm",
        "start_us": 75,
        "end_us": 90,
        "axis": "dp",
        "op": "all_reduce",
        "group": "dp:0",
        "seq": 1,
        "bytes": 4 << 20,
        "group_size": 2,
    },
    {
        "kind": "comm",
        "start_us": 85,
        "end_us": 90,
        "axis": "tp",
        "op": "all_reduce",
        "group": "tp:0",
        "seq": 2,
        "bytes": 2 << 20,
        "group_size": 2,
    },
    {"kind": "optimizer", "start_us": 90, "end_us": 97},
]
# Rank 1: computes the whole step; its two tp all_reduces (the same instances as rank 0's) hide under compute.
RANK1 = [
    {"kind": "compute", "start_us": 0, "end_us": 100},
    {
        "kind": "comm",
        "start_us": 30,
        "end_us": 50,
        "axis": "tp",
        "op": "all_reduce",
        "group": "tp:0",
        "seq": 1,
        "bytes": 1 << 20,
        "group_size": 2,
    },
    {
        "kind": "comm",
        "start_us": 80,
        "end_us": 90,
        "axis": "tp",
        "op": "all_reduce",
        "group": "tp:0",
        "seq": 2,
        "bytes": 2 << 20,
        "group_size": 2,
    },
]
STATS = {
    "tokens": 1000,
    "sequences": 2,
    "longest_sequence": 600,
    "attention_work": 520000.0,
    "attention_us": 1500,
    "peak_memory_bytes": 123456,
}


def _source(sock_dir: Path, **kw: Any) -> TrainEventsSource:
    kw.setdefault("ranks", frozenset({0, 1}))
    return TrainEventsSource(addresses=[f"unix:{sock_dir}/r.sock"], job="j", **kw)


def _values(src: TrainEventsSource) -> dict[tuple[str, int | None, tuple[tuple[str, str], ...]], float]:
    return {(s.metric, s.rank, s.labels): s.value for s in src.samples()}


def _send(sock_dir: Path, *records: dict[str, Any], dropped: int = 0) -> None:
    sender = RecordSender(f"unix:{sock_dir}/r.sock")
    for r in records:
        message = {**r, "sdk": {"records_sent": 1, "records_dropped": dropped}}
        deadline = time.monotonic() + 10
        # the socket queues only a few datagrams (net.unix.max_dgram_qlen): wait until there is room
        while not sender.send(message):
            assert time.monotonic() < deadline, sender.last_error
            time.sleep(0.005)
    sender.close()


def _poll_until(src: TrainEventsSource, done, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        src.poll()
        if done() or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _bd(values, rank: int, category: str, axis: str = "") -> float:
    return values["meshscope_breakdown_seconds_total", rank, (("axis", axis), ("category", category))]


def test_a_hand_built_step_breaks_down_into_the_categories_derived_by_hand(sock_dir: Path, step_record) -> None:
    src = _source(sock_dir)
    try:
        _send(sock_dir, step_record(0, 0, RANK0, stats=STATS), step_record(1, 0, RANK1), dropped=3)
        _poll_until(src, lambda: _values(src).get(("meshscope_steps_total", 1, ()), 0) >= 1)
        v = _values(src)
    finally:
        src.close()
    assert abs(_bd(v, 0, "compute") - 0.060) < 1e-9
    assert abs(_bd(v, 0, "data") - 0.010) < 1e-9
    assert abs(_bd(v, 0, "exposed_comm", "tp") - 0.0125) < 1e-9
    assert abs(_bd(v, 0, "exposed_comm", "dp") - 0.0075) < 1e-9
    assert abs(_bd(v, 0, "optimizer") - 0.007) < 1e-9
    assert abs(_bd(v, 0, "other") - 0.003) < 1e-9
    assert _bd(v, 0, "bubble") == 0
    assert _bd(v, 0, "checkpoint") == 0
    assert (
        "meshscope_breakdown_seconds_total",
        0,
        (("axis", "pp"), ("category", "exposed_comm")),
    ) not in v  # no pp traffic
    assert abs(v["meshscope_own_seconds_total", 0, ()] - 0.080) < 1e-9
    assert (v["meshscope_steps_total", 0, ()], v["meshscope_step_seconds_total", 0, ()]) == (1, 0.1)
    assert v["meshscope_last_step_seconds", 0, ()] == 0.1
    assert v["meshscope_collectives_total", 0, (("axis", "tp"), ("op", "all_reduce"))] == 2
    assert v["meshscope_collective_bytes_total", 0, (("axis", "tp"), ("op", "all_reduce"))] == 3 << 20
    assert v["meshscope_collective_bytes_total", 0, (("axis", "dp"), ("op", "all_reduce"))] == 4 << 20
    assert v["meshscope_data_tokens_total", 0, ()] == 1000
    assert v["meshscope_data_longest_sequence_tokens", 0, ()] == 600
    assert v["meshscope_data_attention_work_total", 0, ()] == 520000.0
    assert abs(v["meshscope_data_attention_seconds_total", 0, ()] - 0.0015) < 1e-12
    assert v["meshscope_peak_memory_bytes", 0, ()] == 123456
    assert v["meshscope_records_dropped_total", 0, ()] == 3
    # rank 1: all compute, its tp collectives hidden (exported at 0: it has tp traffic)
    assert _bd(v, 1, "compute") == 0.1
    assert _bd(v, 1, "exposed_comm", "tp") == 0
    assert ("meshscope_data_tokens_total", 1, ()) not in v  # not measured is not zero


def test_a_step_waits_for_every_rank_of_the_pod_or_for_the_lag(sock_dir: Path, step_record) -> None:
    src = _source(sock_dir)
    try:
        _send(sock_dir, step_record(0, 0, RANK0))
        _poll_until(src, lambda: False, timeout_s=0.2)
        assert _values(src)["meshscope_steps_total", 0, ()] == 0  # rank 1 has not sent step 0 (counters start at 0)
        _send(sock_dir, step_record(0, 1, RANK0), step_record(0, 2, RANK0))
        _poll_until(src, lambda: _values(src).get(("meshscope_steps_total", 0, ()), 0) >= 1)
        assert _values(src)["meshscope_steps_total", 0, ()] == 1  # step 0 only: rank 0 is 2 steps past it
        src.flush()
        assert _values(src)["meshscope_steps_total", 0, ()] == 3
    finally:
        src.close()


def test_foreign_duplicate_and_bad_records_are_counted_and_skipped(sock_dir: Path, step_record) -> None:
    src = _source(sock_dir)
    try:
        good = step_record(0, 0, RANK0)
        _send(
            sock_dir,
            good,
            good,  # duplicate
            step_record(5, 0, RANK0),  # rank 5 runs elsewhere
            step_record(1, 0, RANK1, job="other"),
            {**step_record(1, 1, RANK1), "end_us": 0},  # ends before it starts
        )
        sender = RecordSender(f"unix:{sock_dir}/r.sock")
        sender.send_bytes(b"\xff\xfe garbage")
        sender.send_bytes(b'{"schema": "meshscope.step/1", "rank": 1, "step": ')  # truncated
        sender.close()
        _poll_until(src, lambda: src.health.parse_errors_total >= 3)
        v = _values(src)
    finally:
        src.close()
    rejected = {labels[0][1]: n for (m, _, labels), n in v.items() if m == "meshscope_records_rejected_total"}
    assert rejected == {"duplicate": 1, "foreign_rank": 1, "foreign_job": 1}
    assert src.health.parse_errors_total == 3
    assert src.health.up


def test_recent_steps_are_bounded_by_steps_and_bytes(sock_dir: Path, step_record) -> None:
    src = _source(sock_dir, ranks=frozenset({0}), max_steps_kept=3)
    try:
        _send(sock_dir, *(step_record(0, s, [{"kind": "compute", "start_us": 0, "end_us": 50}]) for s in range(5)))
        deadline = time.monotonic() + 5
        while src._reader is not None and src._reader.lines < 5 and time.monotonic() < deadline:
            time.sleep(0.01)  # all five read before the first poll: it breaks them down together
        _poll_until(src, lambda: len(src.recent_lines(max_bytes=1 << 20)) == 3)
        steps = [json.loads(line)["step"] for line in src.recent_lines(max_bytes=1 << 20)]
        assert steps == [2, 3, 4]
        assert [json.loads(x)["step"] for x in src.recent_lines(since_step=2, max_bytes=1 << 20)] == [3, 4]
        assert [json.loads(x)["step"] for x in src.recent_lines(limit_steps=1, max_bytes=1 << 20)] == [2]
        one = len(src.recent_lines(max_bytes=1 << 20)[0])
        assert len(src.recent_lines(max_bytes=one + 1)) == 1  # whole lines only
        assert len(src.recent_lines(max_bytes=1)) == 1  # but always progress
        assert "sdk" not in json.loads(src.recent_lines(max_bytes=1 << 20)[0])
    finally:
        src.close()


def test_a_flood_is_dropped_and_counted_and_memory_stays_bounded(sock_dir: Path, step_record) -> None:
    src = _source(sock_dir, ranks=frozenset({0}), max_queued_records=20)
    sender = RecordSender(f"unix:{sock_dir}/r.sock")
    try:
        data = encode({**step_record(0, 0, RANK0), "sdk": {}})
        for _ in range(3000):
            sender.send_bytes(data)
        time.sleep(0.3)
        assert len(src._queue) <= 20
        src.poll()
        assert src.health.dropped_total + sender.dropped > 0  # queued beyond 20 or refused by the kernel
        assert src.health.dropped_total + sender.dropped + 20 >= 3000 - src._rejected["duplicate"] - 1
    finally:
        sender.close()
        src.close()


def test_a_peer_that_connects_and_never_sends_blocks_nothing(sock_dir: Path, step_record) -> None:
    src = _source(sock_dir, ranks=frozenset({0}))
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        idle.connect(f"{sock_dir}/r.sock")
        t0 = time.monotonic()
        src.poll()
        assert time.monotonic() - t0 < 1.0
        _send(sock_dir, step_record(0, 0, RANK0))
        _poll_until(src, lambda: _values(src).get(("meshscope_steps_total", 0, ()), 0) >= 1)
        assert _values(src)["meshscope_steps_total", 0, ()] == 1
    finally:
        idle.close()
        src.close()


def test_the_nccl_sources_pid_lookup_and_the_readers_hand_over_never_deadlock(sock_dir: Path) -> None:
    # The reader's thread holds the reader's lock while it hands a record to write_record (which takes the source's
    # lock); the NCCL source's thread asks process_ranks for the hello pids. Taken in the other order there, the two
    # locks deadlocked a sidecar under a flood of records (tests/sidecar/test_hostile.py hung in a CI run).
    src = _source(sock_dir, ranks=frozenset({0}))
    try:
        src.poll()
        reader = src._reader  # the reader's lock is the one under test
        assert reader is not None
        handed_over = threading.Event()
        with reader.lock:  # as the reader's thread, handing a record over
            looker = threading.Thread(target=src.process_ranks, daemon=True)
            looker.start()
            looker.join(0.2)  # it waits for the reader's lock (and, taken in the other order, held the source's)
            writer = threading.Thread(target=lambda: (src.write_record(0, b"{}\n"), handed_over.set()), daemon=True)
            writer.start()
            assert handed_over.wait(10), "write_record blocked: process_ranks held the source's lock"
        looker.join(10)
        assert not looker.is_alive()
    finally:
        src.close()


def test_a_restarted_rank_may_repeat_its_step_numbers(sock_dir: Path, step_record) -> None:
    src = _source(sock_dir, ranks=frozenset({0}))
    sender = RecordSender(f"unix:{sock_dir}/r.sock")
    try:
        hello = {"schema": "meshscope.sdk/1", "event": "hello", "job": "j", "rank": 0, "world_size": 1, "counters": {}}
        assert sender.send({**hello, "pid": 100})
        assert sender.send({**step_record(0, 0, RANK0), "sdk": {}})
        _poll_until(src, lambda: _values(src).get(("meshscope_steps_total", 0, ()), 0) >= 1)
        assert sender.send({**hello, "pid": 200})  # restarted from a checkpoint: step 0 again
        time.sleep(0.1)
        assert sender.send({**step_record(0, 0, RANK0), "sdk": {}})
        _poll_until(src, lambda: _values(src)["meshscope_steps_total", 0, ()] == 2)
        assert _values(src)["meshscope_steps_total", 0, ()] == 2
        assert src._reader is not None
        assert src._reader.ranks[0].pid == 200
    finally:
        sender.close()
        src.close()


def test_a_rank_restarted_with_the_same_pid_is_told_by_its_records_attempt(sock_dir: Path, step_record) -> None:
    # A training container restarted in its pod starts a fresh PID namespace: the new process may say hello with
    # the pid of the last one. Its records' attempt_start_us is new, and its step numbers start afresh (before:
    # step 0 of the new process rejected as a duplicate, its steps lost until it passed the old one's last step).
    src = _source(sock_dir, ranks=frozenset({0}))
    sender = RecordSender(f"unix:{sock_dir}/r.sock")
    try:
        hello = {"schema": "meshscope.sdk/1", "event": "hello", "job": "j", "rank": 0, "world_size": 1, "counters": {}}
        assert sender.send({**hello, "pid": 7})
        for step in (0, 1):
            assert sender.send({**step_record(0, step, RANK0), "attempt_start_us": 1_000, "sdk": {}})
        _poll_until(src, lambda: _values(src).get(("meshscope_steps_total", 0, ()), 0) >= 2)
        assert sender.send({**hello, "pid": 7})  # the container restarted: the same pid, resumed at step 1
        time.sleep(0.1)
        assert sender.send({**step_record(0, 1, RANK0), "attempt_start_us": 9_000, "sdk": {}})
        _poll_until(src, lambda: _values(src)["meshscope_steps_total", 0, ()] == 3)
        assert src._rejected["duplicate"] == 0
        assert sender.send({**step_record(0, 1, RANK0), "attempt_start_us": 9_000, "sdk": {}})  # a real duplicate
        _poll_until(src, lambda: src._rejected["duplicate"] == 1)
        assert _values(src)["meshscope_steps_total", 0, ()] == 3
    finally:
        sender.close()
        src.close()


def test_a_socket_that_cannot_be_bound_leaves_the_source_down_not_the_sidecar(tmp_path: Path) -> None:
    src = TrainEventsSource(addresses=[f"unix:{tmp_path}/absent-dir/r.sock"], job="j", ranks=None)
    src.poll()
    assert not src.health.up
    assert "cannot listen on" in (src.health.last_error or "")
    assert list(src.samples()) == [s for s in src.samples() if s.metric == "meshscope_records_rejected_total"]
    src.close()


def test_the_reader_is_the_one_meshscope_run_uses_with_another_sink(sock_dir: Path) -> None:
    got: list[tuple[int, bytes]] = []

    class Sink:
        def write_record(self, rank: int, line: bytes) -> None:
            got.append((rank, line))

    reader = RecordReader([f"{sock_dir}/x.sock"], Sink(), keep_step_times=False, max_ranks=1)
    try:
        reader.handle(encode({"schema": "meshscope.sdk/1", "event": "hello", "rank": 2, "pid": 4242}))
        reader.handle(
            b'{"schema":"meshscope.step/1","job":"j","step":0,"rank":2,"start_us":1,"end_us":2,"intervals":[],"sdk":{"records_dropped":7}}'
        )
        reader.handle(encode({"schema": "meshscope.step/1", "rank": 3, "step": 0}))  # a second rank: over max_ranks
    finally:
        reader.close()
    assert got == [
        (2, b'{"schema":"meshscope.step/1","job":"j","step":0,"rank":2,"start_us":1,"end_us":2,"intervals":[]}\n')
    ]
    assert (reader.ranks[2].pid, reader.ranks[2].counters, reader.ranks[2].step_times_us) == (
        4242,
        {"records_dropped": 7},
        [],
    )
    assert (reader.untallied, reader.garbage) == (1, 0)


# ---------------------------------------------------------------------------------------------- fuzzing
_KINDS = ["compute", "data", "optimizer", "checkpoint", "comm", "p2p"]
_ms = st.integers(min_value=-20, max_value=140)


@st.composite
def _interval(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(_KINDS))
    a, b = sorted((draw(_ms), draw(_ms)))
    iv: dict[str, Any] = {"kind": kind, "start_us": a, "end_us": b}
    if kind == "comm":
        iv.update(axis=draw(st.sampled_from(["tp", "dp", "pp", "xx"])), op=draw(st.sampled_from(["all_reduce", "all_gather", "send"])),
                  group=draw(st.sampled_from(["tp:0", "dp:0"])), seq=draw(st.integers(0, 3)), bytes=draw(st.integers(0, 1 << 30)))  # fmt: skip
    elif kind == "p2p":
        iv.update(axis="pp", op=draw(st.sampled_from(["send", "recv"])), peer=draw(st.integers(0, 3)))
    if draw(st.booleans()) and draw(st.booleans()):
        iv.pop(draw(st.sampled_from(sorted(iv))))  # a required field missing
    return iv


@st.composite
def _record(draw: st.DrawFn) -> dict[str, Any] | bytes:
    rec: dict[str, Any] = {
        "schema": draw(st.sampled_from(["meshscope.step/1", "meshscope.step/1", "meshscope.step/2"])),
        "job": draw(st.sampled_from(["j", "j", "j", "other"])),
        "step": draw(st.integers(0, 6)),
        "rank": draw(st.integers(0, 2)),
        "coord": {"dp": 0, "tp": 0, "pp": 0, "cp": 0, "ep": 0},
        "node": "node-a",
        "start_us": 0,
        "end_us": draw(st.sampled_from([100_000, 50_000, -1])),
        "intervals": [],
    }
    for iv in draw(st.lists(_interval(), max_size=8)):
        rec["intervals"].append(
            {**iv, **{k: iv[k] * 1000 for k in ("start_us", "end_us") if isinstance(iv.get(k), int)}}
        )
    if draw(st.booleans()):
        rec["stats"] = {"tokens": draw(st.one_of(st.integers(-5, 10**6), st.text(max_size=3)))}
    mutation = draw(st.sampled_from(["none", "none", "drop", "type", "bytes"]))
    if mutation == "drop":
        rec.pop(draw(st.sampled_from(sorted(rec))))
    elif mutation == "type":
        rec[draw(st.sampled_from(sorted(rec)))] = draw(
            st.one_of(st.none(), st.text(max_size=4), st.floats(allow_nan=True))
        )
    elif mutation == "bytes":
        raw = json.dumps(rec).encode()
        return raw[: draw(st.integers(0, len(raw)))]
    return rec


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(records=st.lists(_record(), min_size=1, max_size=12))
def test_fuzzed_records_never_raise_and_every_one_is_accounted_for(sock_dir: Path, records: list[Any]) -> None:
    src = TrainEventsSource(addresses=[f"unix:{sock_dir}/fuzz.sock"], job="j", ranks=frozenset({0, 1}))
    try:
        for r in records:
            line = r if isinstance(r, bytes) else json.dumps(r).encode()
            src.write_record(0, line + b"\n")
        src.poll()
        src.flush()
        samples = list(src.samples())  # never raises either
        steps = sum(s.value for s in samples if s.metric == "meshscope_steps_total")
        rejected = sum(s.value for s in samples if s.metric == "meshscope_records_rejected_total")
        assert steps + rejected + src._parse_errors == len(records)
        by_rank: dict[int | None, dict[str, float]] = {}
        for s in samples:
            if s.metric in {"meshscope_breakdown_seconds_total", "meshscope_step_seconds_total"}:
                d = by_rank.setdefault(s.rank, {})
                d[s.metric] = d.get(s.metric, 0.0) + s.value
        for d in by_rank.values():  # the categories add up to the step time
            assert abs(d["meshscope_breakdown_seconds_total"] - d["meshscope_step_seconds_total"]) < 1e-6
    finally:
        src.close()


def test_a_step_cut_short_by_an_exception_is_kept_for_the_operator_and_not_counted(sock_dir: Path, step_record) -> None:
    """A rank's record that says its step raised (``raised``): no parse error, its peers' step still breaks down,
    its time is in no total, and ``/v1/steps`` still serves its line (the operator's table notes it)."""
    src = _source(sock_dir)
    try:
        cut = {**step_record(1, 0, RANK1), "raised": "RuntimeError"}
        _send(sock_dir, step_record(0, 0, RANK0), cut, step_record(0, 1, RANK0), step_record(0, 2, RANK0))
        _poll_until(src, lambda: _values(src).get(("meshscope_steps_total", 0, ()), 0) >= 1)
        src.flush()
        v = _values(src)
        assert v["meshscope_steps_total", 0, ()] == 3
        assert v.get(("meshscope_steps_total", 1, ()), 0) == 0  # rank 1's only step was cut short
        assert src.health.parse_errors_total == 0
        served = [json.loads(line) for line in src.recent_lines(max_bytes=1 << 20)]
        assert [(o["rank"], o["step"], o.get("raised")) for o in served if o["rank"] == 1] == [(1, 0, "RuntimeError")]
    finally:
        src.close()

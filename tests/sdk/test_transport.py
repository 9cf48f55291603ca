"""The datagram transport on its own: encoding, sending without blocking, collecting."""

from __future__ import annotations

import json
import os
import stat
import zlib
from pathlib import Path

import pytest

from meshscope.sdk.transport import (
    COMPRESS_ABOVE_BYTES,
    AddressError,
    RecordCollector,
    RecordFile,
    RecordSender,
    decode,
    encode,
    open_sender,
    parse_address,
)
from runs import socket_path


def test_small_messages_are_plain_json_and_large_ones_compressed() -> None:
    small = {"schema": "meshscope.step/1", "rank": 1}
    assert encode(small) == json.dumps(small, separators=(",", ":")).encode()
    large = {"schema": "meshscope.step/1", "rank": 1, "intervals": [{"kind": "compute", "i": i} for i in range(5000)]}
    data = encode(large)
    assert len(json.dumps(large, separators=(",", ":"))) > COMPRESS_ABOVE_BYTES
    assert data[:1] == b"\x78"
    assert json.loads(zlib.decompress(data)) == large
    assert decode(data) == large
    assert decode(encode(small)) == small


@pytest.mark.parametrize("bad", [b"[1,2]", b"not json", b"\x78garbage"], ids=["list", "text", "bad-zlib"])
def test_decode_rejects_anything_but_one_object(bad: bytes) -> None:
    with pytest.raises(ValueError):  # json and zlib errors are both ValueErrors here
        decode(bad)


def test_addresses() -> None:
    assert parse_address("unix:/tmp/x.sock") == "/tmp/x.sock"
    assert parse_address("/tmp/x.sock") == "/tmp/x.sock"
    assert parse_address("unix:@meshscope-3") == b"\0meshscope-3"
    with pytest.raises(AddressError, match="not 'unix:/absolute/path'"):
        parse_address("tcp://127.0.0.1:9000")


def test_sender_without_listener_counts_drops(tmp_path: Path) -> None:
    for address in (None, f"unix:{tmp_path}/nobody.sock", "tcp://nowhere"):
        sender = RecordSender(address)
        assert sender.send({"schema": "meshscope.step/1", "rank": 0}) is False
        assert (sender.sent, sender.dropped) == (0, 1)
        assert sender.last_error
        sender.close()


def test_collector_writes_records_without_sdk_counters_and_skips_garbage(tmp_path: Path) -> None:
    sock = socket_path("c", tmp_path)
    out = tmp_path / "records.jsonl"
    collector = RecordCollector([sock], out)
    try:
        sender = RecordSender(f"unix:{sock}")
        record = {"schema": "meshscope.step/1", "rank": 3, "step": 0, "start_us": 10, "end_us": 25}
        assert sender.send({**record, "sdk": {"records_dropped": 2}})
        assert sender.send(
            {"schema": "meshscope.sdk/1", "event": "close", "rank": 3, "counters": {"records_dropped": 4}}
        )
        assert sender.send_bytes(b"garbage")
        assert sender.send({"schema": "other/1", "rank": 3})
        assert sender.send({"schema": "meshscope.step/1"})  # no rank
        assert collector.drain_now() == 5
        sender.close()
    finally:
        collector.stop()
    assert [json.loads(line) for line in out.read_text().splitlines()] == [record]
    tally = collector.ranks[3]
    assert (tally.records, tally.closed, tally.counters, tally.step_times_us) == (1, True, {"records_dropped": 4}, [15])
    assert collector.garbage == 3
    assert not sock.exists()


def test_records_as_the_sdk_writes_them_take_the_fast_path_to_the_same_line(tmp_path: Path) -> None:
    sock = socket_path("f", tmp_path)
    out = tmp_path / "records.jsonl"
    collector = RecordCollector([sock], out)
    record = {
        "schema": "meshscope.step/1",
        "job": 'a "quoted" job',
        "step": 4,
        "rank": 5,
        "coord": {"dp": 1, "tp": 0, "pp": 0, "cp": 0, "ep": 0},
        "node": "node-0",
        "start_us": 100,
        "end_us": 160,
        "intervals": [{"kind": "compute", "start_us": 100, "end_us": 150}],
        "gpu_util": None,
    }
    reordered = {"rank": 6, **{k: v for k, v in record.items() if k != "rank"}}  # not the SDK's order: slow path
    try:
        collector.handle(encode({**record, "sdk": {"records_dropped": 1}}))
        collector.handle(encode({**reordered, "sdk": {"records_dropped": 2}}))
    finally:
        collector.stop()
    assert [json.loads(line) for line in out.read_text().splitlines()] == [record, reordered]
    assert (collector.ranks[5].counters, collector.ranks[5].step_times_us) == ({"records_dropped": 1}, [60])
    assert (collector.ranks[6].counters, collector.ranks[6].step_times_us) == ({"records_dropped": 2}, [60])


def _sdk_bytes(record: dict[str, object], counters: dict[str, int]) -> bytes:
    """A record as the SDK writes it: compact JSON, the ``sdk`` counters last."""
    return json.dumps({**record, "sdk": counters}, separators=(",", ":")).encode()


def test_a_file_destination_appends_each_ranks_records_as_a_collector_writes_them(tmp_path: Path) -> None:
    rank = [0]
    sender = open_sender(f"file:{tmp_path}/run", lambda: rank[0])
    assert isinstance(sender, RecordFile)
    assert sender.send({"schema": "meshscope.sdk/1", "event": "hello", "rank": 0})  # nothing to write, no file yet
    assert not (tmp_path / "run").exists()
    rank[0] = 3  # the rank the process group told before the first record (mp.spawn, SLURM)
    records = [
        {"schema": "meshscope.step/1", "job": "j", "step": n, "rank": 3, "start_us": 1, "end_us": 2} for n in (0, 1)
    ]
    for record in records:
        assert sender.send_record(_sdk_bytes(record, {"records_dropped": 0}))
    sender.close()
    assert sender.path is None  # closed: no file held
    path = tmp_path / "run" / "rank-00003.jsonl"
    assert [json.loads(line) for line in path.read_text().splitlines()] == records  # no sdk counters, one per line
    assert (sender.sent, sender.dropped) == (2, 0)
    assert not sender.send_record(_sdk_bytes(records[0], {}))  # after close: dropped, counted
    assert (sender.sent, sender.dropped) == (2, 1)
    # a second run into the same directory appends (a resumed job keeps one file per rank)
    again = RecordFile(str(tmp_path / "run"), lambda: 3)
    assert again.send_record(_sdk_bytes({**records[1], "step": 2}, {}))
    again.close()
    assert len(path.read_text().splitlines()) == 3


def test_a_relative_file_destination_is_the_working_directorys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `MESHSCOPE_COLLECTOR=file:recs torchrun ...` as typed: every record was dropped ("must be an absolute path").
    monkeypatch.chdir(tmp_path)
    sender = open_sender("file:recs", lambda: 0)
    monkeypatch.chdir("/")  # a script that changes directory later still writes where the user looks
    assert sender.send_record(_sdk_bytes({"schema": "meshscope.step/1", "rank": 0}, {}))
    sender.close()
    assert (tmp_path / "recs" / "rank-00000.jsonl").is_file()


@pytest.mark.parametrize("where", ["/proc/meshscope-cannot-write-here"])
def test_a_file_destination_that_cannot_be_written_drops_and_counts_never_raises(where: str) -> None:
    sender = open_sender(f"file:{where}", lambda: 0)
    assert not sender.send_record(_sdk_bytes({"schema": "meshscope.step/1", "rank": 0}, {}))
    assert not sender.send_record(_sdk_bytes({"schema": "meshscope.step/1", "rank": 0}, {}))
    assert (sender.sent, sender.dropped) == (0, 2)
    assert sender.last_error is not None
    assert where in sender.last_error
    sender.close()


def test_an_address_that_is_not_a_file_destination_is_a_socket() -> None:
    for address in ("unix:/tmp/x.sock", None):
        sender = open_sender(address, lambda: 0)
        assert isinstance(sender, RecordSender)
        sender.close()


def test_a_close_message_tells_the_size_of_the_process_group_the_rank_joined(tmp_path: Path) -> None:
    sock = socket_path("g", tmp_path)
    collector = RecordCollector([sock], tmp_path / "records.jsonl")
    close = {"schema": "meshscope.sdk/1", "event": "close", "counters": {}}
    try:
        collector.handle(encode({**close, "rank": 0, "process_group_size": 4}))
        collector.handle(encode({**close, "rank": 1, "process_group_size": None}))  # never joined one
        collector.handle(encode({**close, "rank": 2, "process_group_size": True}))  # not a size
        collector.handle(encode({**close, "rank": 3}))  # an older SDK says nothing
    finally:
        collector.stop()
    assert [collector.ranks[r].process_group_size for r in range(4)] == [4, None, None, None]


def test_the_rank_each_process_claims_is_its_latest_hello_and_the_memory_of_them_is_bounded(tmp_path: Path) -> None:
    from meshscope.sdk import transport  # noqa: PLC0415

    sock = socket_path("p", tmp_path)
    collector = RecordCollector([sock], tmp_path / "records.jsonl")
    hello = {"schema": "meshscope.sdk/1", "event": "hello", "counters": {}}
    try:
        # mp.spawn under one launched rank: both children first say the environment's rank 0, then their own
        for pid, rank in ((10, 0), (11, 0), (11, 1)):
            collector.handle(encode({**hello, "rank": rank, "pid": pid}))
        assert collector.claimed_twice() == {}
        collector.handle(encode({**hello, "rank": 1, "pid": 12}))  # a second process says it is rank 1 too
        assert collector.claimed_twice() == {1: [11, 12]}
        for pid in range(100, 100 + transport.MAX_PIDS):
            collector.handle(encode({**hello, "rank": 5, "pid": pid}))
    finally:
        collector.stop()
    assert len(collector.rank_of_pid) == transport.MAX_PIDS
    assert 10 not in collector.rank_of_pid  # the oldest went first


def test_a_rank_running_as_another_user_than_the_collector_can_send(tmp_path: Path) -> None:
    # The sidecar runs as uid 65532 and binds its sockets with the mode bind() leaves (0755): a training container
    # running as any other user was refused every datagram (EACCES), which the SDK only counted as drops.
    sock = socket_path("u", tmp_path)
    out = tmp_path / "records.jsonl"
    tmp_path.chmod(0o755)
    collector = RecordCollector([sock], out)
    try:
        assert stat.S_IMODE(Path(sock).stat().st_mode) == 0o666
        if os.geteuid() == 0:  # where the test may change user: a real send from another one
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    sender = RecordSender(f"unix:{sock}")
                    sent = sender.send({"schema": "meshscope.step/1", "rank": 7, "step": 0, "start_us": 1, "end_us": 2})
                    code = 0 if sent else 2
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            collector.start()
    finally:
        collector.stop()
    if os.geteuid() == 0:
        assert [json.loads(line)["rank"] for line in out.read_text().splitlines()] == [7]


def test_a_close_message_tells_what_ran_after_the_last_step(tmp_path: Path) -> None:
    sock = socket_path("a", tmp_path)
    collector = RecordCollector([sock], tmp_path / "records.jsonl")
    close = {"schema": "meshscope.sdk/1", "event": "close", "counters": {}}
    try:
        collector.handle(
            encode({**close, "rank": 0, "after_last_step_us": 600_000, "after_last_step": {"checkpoint": 590_000}})
        )
        collector.handle(
            encode(
                {
                    **close,
                    "rank": 1,
                    "after_last_step_us": 601_000,
                    "after_last_step": {"comm": 598_000, "eval": -4, "x": "y"},
                }
            )
        )
        collector.handle(
            encode({**close, "rank": 2, "after_last_step_us": -1, "after_last_step": {"checkpoint": 5}})
        )  # garbage
        collector.handle(encode({**close, "rank": 3}))  # an older SDK, or no step ended
    finally:
        collector.stop()
    got = [(collector.ranks[r].after_last_step_us, collector.ranks[r].after_last_step) for r in range(4)]
    assert got == [(600_000, {"checkpoint": 590_000}), (601_000, {"comm": 598_000}), (None, {}), (None, {})]

"""The datagram transport on its own: encoding, sending without blocking, collecting."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from meshscope.sdk.transport import (
    COMPRESS_ABOVE_BYTES,
    AddressError,
    RecordCollector,
    RecordSender,
    decode,
    encode,
    parse_address,
)


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
    sock = Path(f"/tmp/ms-c-{tmp_path.name[-20:]}.sock")
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
    sock = Path(f"/tmp/ms-f-{tmp_path.name[-20:]}.sock")
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

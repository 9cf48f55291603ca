"""Hostile input, as a whole: a running sidecar under a flood, garbage, idle peers, a hung exporter, a rotated log.

One real ``meshscope-sidecar`` process with the training-loop, DCGM and NCCL sources on. While it runs it gets a
flood of records, garbage datagrams and records that parse but break the schema, two TCP peers that connect to
its HTTP port and never finish a request, a dcgm-exporter that accepts and never answers, and an NCCL log that is
truncated, overlong and deleted under it. It must keep serving ``/metrics``, its memory must stay within what its
buffers allow, and every loss must show in the ``meshscope_source_*`` metrics, counted exactly where the count is
determined (every datagram sent with a blocking send reaches its reader).
"""

from __future__ import annotations

import json
import re
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from meshscope_sidecar.sources.nccl_log import nccl_host
from sidecar.test_end_to_end import Sidecar, _get, _wait

if TYPE_CHECKING:
    from collections.abc import Iterator

MiB = 1 << 20
T0_US = 1_700_000_000_000_000
QUEUE_CAP_BYTES = 64 * MiB
"""TrainEventsSource's default cap on the bytes of records waiting for a poll."""
STEPS_BYTES = 1 * MiB
"""What this test lets the sidecar keep for /v1/steps (MESHSCOPE_SIDECAR_STEPS_BYTES)."""
NCCL_BUDGET_BYTES = 8 * MiB
"""NcclLogSource's default bytes read per poll."""
RSS_SLACK_BYTES = 48 * MiB
"""Allocator and interpreter slack on top of the buffers' caps."""


def _record(step: int, **extra: object) -> bytes:
    rec = {
        "schema": "meshscope.step/1",
        "job": "hostile",
        "step": step,
        "rank": 0,
        "coord": {"dp": 0, "tp": 0, "pp": 0, "cp": 0, "ep": 0},
        "node": "n",
        "start_us": T0_US + step * 1000,
        "end_us": T0_US + step * 1000 + 900,
        "intervals": [{"kind": "compute", "start_us": T0_US + step * 1000, "end_us": T0_US + step * 1000 + 800}],
        **extra,
    }
    return json.dumps(rec, separators=(",", ":")).encode()


def _rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"VmRSS:\s+(\d+) kB", status)
    assert m is not None
    return int(m.group(1)) * 1024


def _metric(text: str, name: str, **labels: str) -> float | None:
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    return None


@pytest.fixture
def hung_exporter() -> Iterator[str]:
    """A TCP server that accepts connections and never answers (nor closes them)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}/metrics"
    stop.set()
    thread.join(timeout=5)
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.slow
def test_the_sidecar_survives_hostile_input_with_bounded_memory_and_counted_loss(
    tmp_path: Path, sock_dir: Path, hung_exporter: str
) -> None:
    logs = tmp_path / "nccl"
    logs.mkdir()
    sock = f"{sock_dir}/r.sock"
    sidecar = Sidecar(
        {
            "MESHSCOPE_JOB": "hostile",
            "MESHSCOPE_NODE_NAME": "n",
            "MESHSCOPE_LAYOUT": "dp=2",
            "MESHSCOPE_GPUS_PER_NODE": "1",
            "MESHSCOPE_NODE_RANK": "0",
            "MESHSCOPE_SIDECAR_SOCKETS": f"unix:{sock}",
            "MESHSCOPE_SIDECAR_TRAIN_POLL_SECONDS": "0.2",
            "MESHSCOPE_SIDECAR_STEPS_BYTES": str(STEPS_BYTES),
            "MESHSCOPE_SIDECAR_DCGM_URL": hung_exporter,
            "MESHSCOPE_SIDECAR_DCGM_TIMEOUT_SECONDS": "0.5",
            "MESHSCOPE_SIDECAR_DCGM_POLL_SECONDS": "0.2",
            "MESHSCOPE_SIDECAR_NCCL_LOGS": str(logs),
            "MESHSCOPE_SIDECAR_NCCL_POLL_SECONDS": "0.2",
            "MESHSCOPE_SIDECAR_NVML": "off",
            "MESHSCOPE_SIDECAR_INFINIBAND": "off",
        }
    )
    port = sidecar.port
    assert port is not None
    idle_peers: list[socket.socket] = []
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # blocking: every datagram reaches the reader
    sender.settimeout(60)  # a reader that stops reading fails the test (OSError: timed out) instead of hanging it
    try:
        text = _get(port, "/metrics").decode()
        rss_before = _rss_bytes(sidecar.proc.pid)

        # Two peers that connect to the HTTP port and never finish: one silent, one mid-request.
        for partial in (b"", b"GET /metrics HTTP/1.1\r\nHost: x\r\n"):
            peer = socket.create_connection(("127.0.0.1", port))
            peer.sendall(partial)
            idle_peers.append(peer)

        # An NCCL log (a 2-rank world communicator of rank 0, then 2 calls), truncated in place and written again
        # (1 + 2 calls), an overlong line and 1 call, then deleted.
        host, pid = nccl_host("hostile-host"), 777
        prefix = f"{host}:{pid}:{pid} [0] NCCL INFO "
        init = (
            f"{prefix}ncclCommInitRank comm 0x1000 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 18000 "
            "commId 0xabc - Init COMPLETE\n"
        )
        coll = (
            f"{prefix}AllReduce: opCount 0 sendbuff 0x7f00 recvbuff 0x7f00 count 256 datatype 7 op 0 root 0 "
            "comm 0x1000 [nranks=2] stream 0x5000\n"
        )
        log = logs / f"nccl.{host}.{pid}"
        log.write_text(init + coll * 2)

        def nccl_calls() -> float:
            return _metric(_get(port, "/metrics").decode(), "meshscope_nccl_collectives_total", rank="0") or 0.0

        _wait("the log's first two calls", lambda: nccl_calls() == 2, 30)

        # The flood: distinct valid records, garbage, and records that parse but break the schema.
        n_good, n_garbage, n_bad = 6000, 3000, 200
        for step in range(n_good):
            sender.sendto(_record(step), sock)
        for i in range(n_garbage):
            sender.sendto(bytes([0xFF, 0xFE, i % 256]) * 50, sock)
        for step in range(n_good, n_good + n_bad):
            sender.sendto(_record(step, end_us=T0_US), sock)  # ends before it starts

        # Truncated in place (copytruncate) to less than was read: seen as such whenever the next poll comes; then
        # the writer goes on.
        log.write_text(init + coll)
        _wait("the truncated log's call", lambda: nccl_calls() == 3, 30)
        with log.open("a") as f:
            f.write(coll * 2)
        _wait("the calls after it", lambda: nccl_calls() == 5, 30)
        with log.open("a") as f:
            f.write("x" * (200 * 1024) + "\n")  # longer than the 64 KiB a line may take
            f.write(coll)
        _wait("the call after the overlong line", lambda: nccl_calls() == 6, 30)
        log.unlink()

        def settled() -> bool:
            t = _get(port, "/metrics").decode()
            steps = _metric(t, "meshscope_steps_total", rank="0") or 0
            dropped = _metric(t, "meshscope_source_dropped_total", source="train_events") or 0
            errors = _metric(t, "meshscope_source_parse_errors_total", source="train_events") or 0
            return steps + dropped + errors == n_good + n_garbage + n_bad and not (
                _metric(t, "meshscope_source_up", source="dcgm")
            )

        _wait("every datagram accounted for and the exporter seen as down", settled, 60)
        text = _get(port, "/metrics").decode()
        health = json.loads(_get(port, "/healthz"))
        rss_after = _rss_bytes(sidecar.proc.pid)
    finally:
        sender.close()
        for peer in idle_peers:
            peer.close()
        code = sidecar.stop()
    assert code == 0, "".join(sidecar.lines)

    # Loss, counted where it happened: every garbage datagram is a parse error at the reader; a record (valid, or
    # schema-breaking) is queued, then broken down, refused as a parse error, or dropped by the full queue (which
    # happens to the schema-breaking ones too when the machine is slow to poll): each is counted exactly once.
    steps = _metric(text, "meshscope_steps_total", rank="0")
    dropped = _metric(text, "meshscope_source_dropped_total", source="train_events")
    errors = _metric(text, "meshscope_source_parse_errors_total", source="train_events")
    assert steps is not None
    assert dropped is not None
    assert errors is not None
    assert n_garbage <= errors <= n_garbage + n_bad
    assert steps + dropped + errors == n_good + n_garbage + n_bad
    assert 0 < steps <= n_good
    # The hung exporter: down, said why, and it cost no scrape.
    assert _metric(text, "meshscope_source_up", source="dcgm") == 0.0
    assert health["sources"]["dcgm"]["last_error"] == "no complete answer within 0.5 s"
    # The log: truncated, overlong and deleted; what was cut is counted, what was written is counted once.
    assert _metric(text, "meshscope_nccl_collectives_total", rank="0") == 6
    assert _metric(text, "meshscope_source_dropped_total", source="nccl_log") == 1  # the overlong line
    assert _metric(text, "meshscope_source_up", source="train_events") == 1.0
    # Memory: within the queue's and the kept steps' caps and one NCCL read budget, with slack.
    bound = QUEUE_CAP_BYTES + STEPS_BYTES + NCCL_BUDGET_BYTES + RSS_SLACK_BYTES
    assert rss_after - rss_before < bound, (rss_before / MiB, rss_after / MiB)

"""The HTTP server over real sockets: /metrics, /v1/steps (bounded, paged), /healthz; a hung source blocks nothing."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

import pytest

from meshscope.sdk import RecordSender
from meshscope_sidecar.collector import PollState, SidecarCollector, make_registry
from meshscope_sidecar.server import Poller, SidecarServer, serve_until
from meshscope_sidecar.sources.base import Sample, SourceHealth
from meshscope_sidecar.sources.train_events import TrainEventsSource

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


class HungSource:
    """A test-only source whose poll never returns (until released) and whose samples are fixed."""

    name = "dcgm"

    def __init__(self) -> None:
        self.health = SourceHealth(up=True)
        self.release = threading.Event()

    def poll(self) -> None:
        self.release.wait(30)

    def samples(self) -> list[Sample]:
        return [Sample(metric="meshscope_gpu_power_watts", value=300.0, gpu=0)]

    def close(self) -> None:
        self.release.set()


class Served:
    def __init__(self, base: str, train: TrainEventsSource, hung: HungSource, polls: dict[str, PollState]) -> None:
        self.base, self.train, self.hung, self.polls = base, train, hung, polls

    def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=10) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()


@pytest.fixture
def served(sock_dir: Path, make_identity) -> Iterator[Served]:
    ident = make_identity("tp=2", "2", "0")
    train = TrainEventsSource(addresses=[f"unix:{sock_dir}/r.sock"], job="j", ranks=ident.ranks, max_steps_kept=4)
    hung = HungSource()
    polls = {"train_events": PollState(period_s=0.05), "dcgm": PollState(period_s=0.05, stall_after_s=0.3)}
    collector = SidecarCollector([train, hung], ident, version="0.1.0", polls=polls)
    server = SidecarServer(
        collector=collector, registry=make_registry(collector), train=train, steps_limit=4, response_bytes=64 * 1024
    )
    pollers = [Poller(train, polls["train_events"]), Poller(hung, polls["dcgm"])]
    for p in pollers:
        p.start()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    ready: list[list[tuple[str, int]]] = []
    thread = threading.Thread(
        target=lambda: loop.run_until_complete(serve_until(server, "127.0.0.1", 0, stop, ready.append)), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 10
    while not ready and time.monotonic() < deadline:
        time.sleep(0.01)
    host, port = ready[0][0]
    try:
        yield Served(f"http://{host}:{port}", train, hung, polls)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()
        hung.close()
        for p in pollers:
            p.stop()
        train.close()


def _send_steps(sock_dir: Path, step_record, steps: range) -> None:
    sender = RecordSender(f"unix:{sock_dir}/r.sock")
    for s in steps:
        for rank in (0, 1):
            message = {**step_record(rank, s, [{"kind": "compute", "start_us": 0, "end_us": 80}]), "sdk": {}}
            deadline = time.monotonic() + 10
            # the socket queues only a few datagrams (net.unix.max_dgram_qlen): wait until there is room
            while not sender.send(message) and time.monotonic() < deadline:
                time.sleep(0.005)
    sender.close()


def _wait(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_metrics_while_a_source_hangs(served: Served, sock_dir: Path, step_record) -> None:
    _send_steps(sock_dir, step_record, range(2))
    _wait(
        lambda: re.search(rb'meshscope_steps_total\{[^}]*rank="1"[^}]*\} 2\.0', served.get("/metrics")[2]) is not None
    )
    t0 = time.monotonic()
    status, headers, body = served.get("/metrics")
    assert time.monotonic() - t0 < 5
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    text = body.decode()
    assert (
        'meshscope_steps_total{cp="0",dp="0",ep="0",gpu="1",job="j",network_tier="",node="node-a",nvlink_domain="",pp="0",rank="1",tp="1"} 2.0'
        in text
    )
    assert 'meshscope_gpu_power_watts{cp="0",dp="0",ep="0",gpu="0"' in text  # the hung source's samples still read
    n = served.polls["train_events"].polls_total
    _wait(lambda: served.polls["train_events"].polls_total > n + 2)
    assert served.polls["train_events"].polls_total > n + 2  # the other source keeps being polled
    assert served.polls["dcgm"].polls_total == 0

    def up_lines() -> list[str]:
        return [x for x in served.get("/metrics")[2].decode().splitlines() if x.startswith("meshscope_source_up{")]

    _wait(lambda: any('source="dcgm"} 0.0' in line for line in up_lines()))
    up = up_lines()
    assert any('source="dcgm"} 0.0' in line for line in up)
    assert any('source="train_events"} 1.0' in line for line in up)
    health = json.loads(served.get("/healthz")[2])
    assert health["sources"]["dcgm"]["stalled"] is True
    assert health["mode"] == "full"


def test_steps_endpoint_pages_bounded_json_lines(served: Served, sock_dir: Path, step_record) -> None:
    _send_steps(sock_dir, step_record, range(6))
    _wait(lambda: served.get("/v1/steps?since_step=4")[2].count(b"\n") == 2)
    status, headers, body = served.get("/v1/steps")
    assert status == 200
    assert headers["Content-Type"].startswith("application/x-ndjson")
    got = [(r["step"], r["rank"]) for r in map(json.loads, body.splitlines())]
    assert got == [(s, r) for s in range(2, 6) for r in (0, 1)]  # 4 steps kept
    page = [json.loads(x)["step"] for x in served.get("/v1/steps?since_step=2&limit=2")[2].splitlines()]
    assert page == [3, 3, 4, 4]
    assert served.get("/v1/steps?limit=1000")[2].count(b"\n") == 8  # clamped to the server's limit


@pytest.mark.parametrize("query", ["since_step=x", "limit=0", "since_step=-2", "limit=99999999999999999999999"])
def test_bad_query_parameters_are_a_400_with_a_reason(served: Served, query: str) -> None:
    status, _, body = served.get(f"/v1/steps?{query}")
    assert status == 400
    assert b"is not a whole number" in body


def test_healthz_describes_identity_and_sources(served: Served) -> None:
    status, _, body = served.get("/healthz")
    doc: dict[str, Any] = json.loads(body)
    assert status == 200
    assert doc["identity"].startswith("job 'j' on node 'node-a', layout ")
    assert set(doc["sources"]) == {"train_events", "dcgm"}
    assert doc["cannot_tag"] == []

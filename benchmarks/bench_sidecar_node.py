"""The sidecar with every source on a training node: 8 GPUs, 8 ranks, DCGM, NCCL logs and InfiniBand at once.

Starts a real ``meshscope-sidecar`` process (identity tp=2,pp=2,dp=2 on one 8-GPU node named as the DCGM fixture's
host, one socket per rank) and feeds it, for the whole run:

- the training loop: one step record per rank per second, ~200 intervals each, as real datagrams in the SDK's byte
  layout (the records of ``bench_sidecar.py``);
- DCGM: a local HTTP server answering with ``tests/data/sidecar/dcgm/h100_8gpu_default.prom`` (8 H100s, the default
  counters), scraped every second;
- NCCL: 8 debug-log files (one per rank: Init lines of the world, TP and DP communicators, then COLL lines) appended
  to at 2,000 COLL lines per second in all, read on the default 5 s period;
- InfiniBand: the fixture tree of ``tests/data/sidecar/infiniband/`` copied to a temporary directory, its data
  counters advanced before every poll, read every second.

It measures, over the steady part: the sidecar's CPU (user + system, all threads, ``/proc/PID/stat``) as a share of
one core (target under 5 %), its RSS and peak (target under 200 MiB), the wall time of a ``/metrics`` scrape
(target under 50 ms), and each source's polling CPU (``meshscope_source_poll_seconds_total``). The feeders run in
this process, not the sidecar's.

Usage: ``.venv/bin/python benchmarks/bench_sidecar_node.py [--seconds 30] [--nccl-lines-per-second 2000]``.
"""

from __future__ import annotations

import argparse
import http.server
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench_sidecar import T0_US, cpu_seconds, memory_mib, record
from timing import machine_reference

REPO = Path(__file__).resolve().parents[1]
DCGM_FIXTURE = REPO / "tests" / "data" / "sidecar" / "dcgm" / "h100_8gpu_default.prom"
IB_FIXTURE = REPO / "tests" / "data" / "sidecar" / "infiniband" / "class_infiniband"
NODE = "gpu-node-07"  # the DCGM fixture's Hostname label
RANKS = 8


def serve_dcgm(body: bytes) -> http.server.ThreadingHTTPServer:
    """A dcgm-exporter stand-in on a free loopback port, answering every GET with ``body``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def nccl_prelude(host: str, pid: int, rank: int) -> list[str]:
    """Init lines (NCCL 2.23+ wording, ``src/init.cc``) of rank ``rank``'s world, TP and DP communicators."""
    p = f"{host}:{pid}:{pid} [{rank}] NCCL INFO "
    tp, dp = rank // 2, (rank % 2) + 4 * (rank // 4)
    return [
        (
            f"{p}ncclCommInitRankConfig comm 0x1000 rank {rank} nranks 8 cudaDev {rank} nvmlDev {rank} busId 18000 "
            "commId 0x7c1f3a9e2b4d6081 - Init COMPLETE"
        ),
        (
            f"{p}ncclCommInitRankConfig comm 0x2000 rank {rank % 2} nranks 2 cudaDev {rank} nvmlDev {rank} busId 18000 "
            f"commId 0x{0x100 + tp:x} - Init COMPLETE"
        ),
        (
            f"{p}ncclCommInitRankConfig comm 0x3000 rank {(rank // 2) % 2} nranks 2 cudaDev {rank} nvmlDev {rank} "
            f"busId 18000 commId 0x{0x200 + dp:x} - Init COMPLETE"
        ),
    ]


def nccl_coll(host: str, pid: int, rank: int, i: int) -> str:
    """One COLL line (``src/enqueue.cc``), TP AllReduce bf16 or DP ReduceScatter fp32 in turn."""
    op, comm, datatype, count = (
        ("AllReduce", "0x2000", 9, 4194304) if i % 2 else ("ReduceScatter", "0x3000", 7, 2097152)
    )
    return (
        f"{host}:{pid}:{pid} [{rank}] NCCL INFO {op}: opCount {i:x} sendbuff 0x7f0000000000 recvbuff 0x7f0000800000 "
        f"count {count} datatype {datatype} op 0 root 0 comm {comm} [nranks=2] stream 0x5600000b0000"
    )


def feed_nccl(files: list[Path], host: str, lines_per_second: float, stop: threading.Event, sent: list[int]) -> None:
    """Append COLL lines to ``files`` in turn, ``lines_per_second`` in all, in 20 ms batches."""
    outs = [f.open("a", buffering=1) for f in files]
    start = time.monotonic()
    i = 0
    while not stop.is_set():
        due = int((time.monotonic() - start) * lines_per_second)
        while i < due:
            r = i % len(outs)
            outs[r].write(nccl_coll(host, 5000 + r, r, i // len(outs)) + "\n")
            i += 1
        sent[0] = i
        stop.wait(0.02)
    for out in outs:
        out.close()


def bump_infiniband(root: Path, stop: threading.Event) -> None:
    """Advance every port's 64-bit data counters once a second, as traffic would."""
    counters = [p for p in root.glob("*/ports/*/counters*/port_*_data*") if p.is_file()]
    while not stop.wait(1.0):
        for path in counters:
            try:
                value = int(path.read_text().strip())
            except ValueError:
                continue
            if value < 4294967295:  # a saturated legacy counter stays where it is
                path.write_text(f"{value + 25_000_000}\n")


def main() -> None:  # noqa: C901 - one measured run, step by step
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0, help="measured seconds (after 6 s of warm-up)")
    ap.add_argument("--intervals", type=int, default=200)
    ap.add_argument("--nccl-lines-per-second", type=float, default=2000.0)
    ap.add_argument("--scrape-every", type=float, default=1.0, help="seconds between /metrics scrapes")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ms-node-", dir="/tmp"))
    dcgm = serve_dcgm(DCGM_FIXTURE.read_bytes())
    ib_root = tmp / "infiniband"
    shutil.copytree(IB_FIXTURE, ib_root, symlinks=True)
    logs = tmp / "nccl"
    logs.mkdir()
    host = socket.gethostname().split(".", 1)[0]
    files = [logs / f"nccl.{host}.{5000 + r}" for r in range(RANKS)]
    for r, f in enumerate(files):
        f.write_text("".join(line + "\n" for line in nccl_prelude(host, 5000 + r, r)))
    socks = [f"unix:{tmp}/rank-{r}.sock" for r in range(RANKS)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSCOPE_")}
    env.update(
        MESHSCOPE_JOB="bench",
        MESHSCOPE_NODE_NAME=NODE,
        MESHSCOPE_LAYOUT="tp=2,pp=2,dp=2",
        MESHSCOPE_GPUS_PER_NODE=str(RANKS),
        MESHSCOPE_NODE_RANK="0",
        MESHSCOPE_SIDECAR_SOCKETS=",".join(socks),
        MESHSCOPE_SIDECAR_DCGM_URL=f"http://127.0.0.1:{dcgm.server_address[1]}/metrics",
        MESHSCOPE_SIDECAR_DCGM_POLL_SECONDS="1",
        MESHSCOPE_SIDECAR_NCCL_LOGS=f"{logs}/nccl.%h.%p",
        MESHSCOPE_SIDECAR_INFINIBAND_ROOT=str(ib_root),
        MESHSCOPE_SIDECAR_INFINIBAND_POLL_SECONDS="1",
        MESHSCOPE_SIDECAR_NVML="off",  # no GPU here; on a GPU node NVML would be read every 10 s
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshscope_sidecar", "--host", "127.0.0.1", "--port", "0"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    port_box: list[int] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            m = re.search(r"on 127\.0\.0\.1:(\d+)", line)
            if m:
                port_box.append(int(m.group(1)))
            elif "WARNING" in line or "error" in line:
                sys.stderr.write(line)

    threading.Thread(target=read_stderr, daemon=True).start()
    deadline = time.monotonic() + 30
    while not port_box and time.monotonic() < deadline:
        time.sleep(0.05)
    port = port_box[0]
    stop = threading.Event()
    nccl_sent = [0]
    feeders = [
        threading.Thread(target=feed_nccl, args=(files, host, args.nccl_lines_per_second, stop, nccl_sent)),
        threading.Thread(target=bump_infiniband, args=(ib_root, stop)),
    ]
    for t in feeders:
        t.start()
    senders = [socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(RANKS)]
    for s in senders:
        s.setblocking(False)  # noqa: FBT003 - the socket API
    sent = dropped = 0
    start = time.monotonic()
    measure_from = start + 6.0
    end = measure_from + args.seconds
    cpu0 = wall0 = None
    scrape_ms: list[float] = []
    body = b""
    step = 0
    nccl0 = 0
    next_scrape = measure_from + 0.5
    while time.monotonic() < end:
        tick = start + step
        for r, s in enumerate(senders):
            try:
                s.sendto(record(r, step, args.intervals, T0_US + step * 1_000_000), socks[r][5:])
                sent += 1
            except OSError:
                dropped += 1
        step += 1
        while time.monotonic() < tick + 1.0:
            now = time.monotonic()
            if cpu0 is None and now >= measure_from:
                cpu0, wall0, nccl0 = cpu_seconds(proc.pid), now, nccl_sent[0]
            if now >= next_scrape and cpu0 is not None:
                t = time.perf_counter()
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                    body = resp.read()
                scrape_ms.append(1000 * (time.perf_counter() - t))
                next_scrape = now + args.scrape_every
            time.sleep(0.01)
    assert cpu0 is not None
    assert wall0 is not None
    cpu1, wall1 = cpu_seconds(proc.pid), time.monotonic()
    nccl1 = nccl_sent[0]
    rss, hwm = memory_mib(proc.pid)
    stop.set()
    for t in feeders:
        t.join()
    proc.terminate()
    proc.wait(20)
    dcgm.shutdown()
    dcgm.server_close()
    for s in senders:
        s.close()
    shutil.rmtree(tmp, ignore_errors=True)
    text = body.decode()

    def total(metric: str, label: str = "") -> float:
        pattern = rf"^{metric}\{{[^}}]*{label}[^}}]*\}} (\S+)$"
        return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.MULTILINE))

    cpu_share = (cpu1 - cpu0) / (wall1 - wall0)
    print(f"ranks {RANKS}, {args.intervals} intervals per record, 1 record per rank per second; DCGM scrape every 1 s;")
    print(f"NCCL {(nccl1 - nccl0) / (wall1 - wall0):.0f} COLL lines/s over {len(files)} files; InfiniBand every 1 s")
    broken_down = total("meshscope_steps_total")
    print(f"records sent {sent}, dropped by the sender {dropped}; rank-steps broken down: {broken_down:.0f}")
    print(f"NCCL collectives counted: {total('meshscope_nccl_collectives_total'):.0f} of {nccl1} written")
    up = {m.group(1): m.group(2) for m in re.finditer(r'meshscope_source_up\{[^}]*source="(\w+)"\} (\S+)', text)}
    print(f"sources up: {up}")
    polls = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'meshscope_source_poll_seconds_total\{[^}]*source="(\w+)"\} (\S+)', text)
    }
    print("polling CPU by source over the whole run, s: " + ", ".join(f"{k} {v:.2f}" for k, v in polls.items()))
    print(f"sidecar CPU: {100 * cpu_share:.2f} % of one core over {wall1 - wall0:.1f} s, a scrape every ", end="")
    print(f"{args.scrape_every:g} s (target < 5 %)")
    print(f"sidecar memory: RSS {rss:.1f} MiB, peak {hwm:.1f} MiB (target < 200 MiB)")
    med, worst = statistics.median(scrape_ms), max(scrape_ms)
    print(f"/metrics scrape ({len(body) / 1024:.1f} KiB): median {med:.2f} ms, max {worst:.2f} ms ", end="")
    print(f"over {len(scrape_ms)} scrapes (target < 50 ms)")
    print(f"machine load average while measuring: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"machine reference: {machine_reference()}")


if __name__ == "__main__":
    main()

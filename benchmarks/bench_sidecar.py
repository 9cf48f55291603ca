"""The sidecar's overhead on a training node: 8 ranks, one record per rank per second, ~200 intervals each.

Starts a real ``meshscope-sidecar`` process (identity tp=2,pp=2,dp=2 on one 8-GPU node, one socket per rank), sends
it hand-built step records as real datagrams in the SDK's own byte layout (the reader's fast path), and measures
over the steady part of the run:

- the sidecar's CPU (user + system, all its threads, from /proc/PID/stat) per second of wall time, as a share of
  one core (target: under 5 %);
- its resident memory at the end and its peak (VmRSS, VmHWM; target: under 200 MiB);
- the wall time of a ``/metrics`` scrape, as the client sees it (target: under 50 ms).

Usage: ``.venv/bin/python benchmarks/bench_sidecar.py [--seconds 30] [--ranks 8] [--intervals 200]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

T0_US = 1_700_000_000_000_000


def record(rank: int, step: int, n_intervals: int, t0_us: int) -> bytes:
    """One rank's step as the SDK writes it: compact JSON, schema/job/step/rank first, sdk last; 1 s long."""
    tp, dp, pp = rank % 2, (rank // 2) % 2, rank // 4
    ivs = []
    t = t0_us
    slot = 1_000_000 // n_intervals
    for i in range(n_intervals):
        kind = i % 4
        if kind in (0, 2):
            ivs.append(
                {
                    "kind": "compute",
                    "start_us": t,
                    "end_us": t + slot,
                    "phase": "forward" if i < n_intervals // 2 else "backward",
                }
            )
        elif kind == 1:
            ivs.append(
                {
                    "kind": "comm",
                    "start_us": t,
                    "end_us": t + slot,
                    "axis": "tp",
                    "op": "all_reduce",
                    "group": f"tp:{rank // 2}",
                    "seq": step * n_intervals + i,
                    "bytes": 8 << 20,
                    "group_size": 2,
                }
            )
        elif i % 8 == 3:
            ivs.append(
                {
                    "kind": "comm",
                    "start_us": t,
                    "end_us": t + slot,
                    "axis": "dp",
                    "op": "reduce_scatter",
                    "group": f"dp:{tp}-{pp}",
                    "seq": step * n_intervals + i,
                    "bytes": 64 << 20,
                    "group_size": 2,
                }
            )
        else:
            op = "send" if (i // 8 + pp) % 2 == 0 else "recv"
            ivs.append(
                {
                    "kind": "p2p",
                    "start_us": t,
                    "end_us": t + slot,
                    "axis": "pp",
                    "op": op,
                    "peer": rank ^ 4,
                    "bytes": 4 << 20,
                }
            )
        t += slot
    rec = {"schema": "meshscope.step/1", "job": "bench", "step": step, "rank": rank,
           "coord": {"dp": dp, "tp": tp, "pp": pp, "cp": 0, "ep": 0}, "node": "node-0", "gpu": rank,
           "start_us": t0_us, "end_us": t0_us + 1_000_000, "intervals": ivs,
           "stats": {"tokens": 16384, "sequences": 4, "longest_sequence": 8192, "attention_work": 2.1e8,
                     "attention_us": 5100, "peak_memory_bytes": 123456789},
           "sdk": {"records_sent": step, "records_dropped": 0}}  # fmt: skip
    return json.dumps(rec, separators=(",", ":")).encode()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int) -> tuple[float, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
    hwm = int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024
    return rss, hwm


def main() -> None:  # noqa: C901 - one measured run, step by step
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0, help="measured seconds (after 5 s of warm-up)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--intervals", type=int, default=200)
    ap.add_argument("--scrape-every", type=float, default=1.0, help="seconds between /metrics scrapes")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ms-bench-", dir="/tmp"))
    socks = [f"unix:{tmp}/rank-{r}.sock" for r in range(args.ranks)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSCOPE_")}
    env.update(MESHSCOPE_JOB="bench", MESHSCOPE_NODE_NAME="node-0", MESHSCOPE_LAYOUT=f"tp=2,pp=2,dp={args.ranks // 4}",
               MESHSCOPE_GPUS_PER_NODE=str(args.ranks), MESHSCOPE_NODE_RANK="0",
               MESHSCOPE_SIDECAR_SOCKETS=",".join(socks))  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshscope_sidecar", "--host", "127.0.0.1", "--port", "0"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    port_box: list[int] = []

    def read_stderr() -> None:
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
    senders = [socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(args.ranks)]
    for s in senders:
        s.setblocking(False)  # noqa: FBT003 - the socket API
    sent = dropped = 0
    start = time.monotonic()
    measure_from = start + 5.0
    end = measure_from + args.seconds
    cpu0 = wall0 = None
    scrape_ms: list[float] = []
    step = 0
    size = len(record(0, 0, args.intervals, T0_US))
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
                cpu0, wall0 = cpu_seconds(proc.pid), now
            if now >= next_scrape and cpu0 is not None:
                t = time.perf_counter()
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                    body = resp.read()
                scrape_ms.append(1000 * (time.perf_counter() - t))
                next_scrape = now + args.scrape_every
            time.sleep(0.01)
    cpu1, wall1 = cpu_seconds(proc.pid), time.monotonic()
    rss, hwm = memory_mib(proc.pid)
    steps_seen = sum(float(m.group(1)) for m in re.finditer(rb"meshscope_steps_total\{[^}]*\} (\S+)", body))
    proc.terminate()
    proc.wait(20)
    for s in senders:
        s.close()
    cpu_share = (cpu1 - cpu0) / (wall1 - wall0)
    kib = size / 1024
    print(f"ranks {args.ranks}, {args.intervals} intervals per record ({kib:.1f} KiB), 1 record per rank per second")
    print(f"records sent {sent}, dropped by the sender {dropped}; rank-steps broken down: {steps_seen:.0f}")
    print(f"sidecar CPU: {100 * cpu_share:.2f} % of one core over {wall1 - wall0:.1f} s, a scrape every ", end="")
    print(f"{args.scrape_every:g} s (target < 5 %)")
    print(f"sidecar memory: RSS {rss:.1f} MiB, peak {hwm:.1f} MiB (target < 200 MiB)")
    med, worst = statistics.median(scrape_ms), max(scrape_ms)
    print(f"/metrics scrape ({len(body) / 1024:.1f} KiB): median {med:.2f} ms, max {worst:.2f} ms ", end="")
    print(f"over {len(scrape_ms)} scrapes (target < 50 ms)")
    print(f"machine load average while measuring: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()

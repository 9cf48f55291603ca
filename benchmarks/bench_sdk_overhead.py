"""What the meshscope SDK costs a training job.

Two measurements, printed as tables:

1. **Step time, SDK on vs off**, on the same CPU job (``examples/train_tiny.py`` under ``meshscope run``, real
   compute, no emulation), alternating runs with ``MESHSCOPE_DISABLE=1`` and without, and the median ratio of median
   step times. On a 2-core machine this is dominated by run-to-run noise (±20-30 %, cpu-testbed.md §3), so the
   per-collective figure below is the one to extrapolate from.
2. **Hot-path cost per captured operation**: a tight loop of tiny operations on a 1-process gloo group, in blocks of
   100 alternating without and with the tracker; the difference of the medians per operation, in microseconds. Plus
   the cost of ending a step (building, encoding and sending its record) for a step of 100 captured collectives.

    .venv/bin/python benchmarks/bench_sdk_overhead.py [--rounds 4] [--steps 15] [--ops 5000] [--skip-job]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from meshscope import sdk
from meshscope.sdk.transport import RecordCollector

REPO = Path(__file__).resolve().parents[1]


# ====================================================================== 1. step time of a real job


def run_job(*, enabled: bool, steps: int, layout: str, nproc: int, out: Path, emulate: float) -> tuple[float, float]:
    """Median step time (s) and median CPU time per step (s, all threads) of the loss rank, after 2 warm-up steps."""
    report = out / "report.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if not enabled:
        env["MESHSCOPE_DISABLE"] = "1"
    cmd = [sys.executable, "-m", "meshscope", "run", "--nproc", str(nproc), "--layout", layout, "--out", str(out)]
    cmd += ["--", sys.executable, str(REPO / "examples" / "train_tiny.py"), "--steps", str(steps)]
    cmd += ["--report", str(report)]
    if emulate:
        cmd += ["--emulate", str(emulate)]
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=600)
    data = json.loads(report.read_text())
    # The first steps warm up (allocations, first gathers, and the SDK's activation and model-state counts).
    times = data["step_times_s"][2:]
    return statistics.median(times), statistics.median(data["step_cpu_s"][2:])


def bench_job(rounds: int, steps: int, layout: str, nproc: int, emulate: float) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            pair = {}
            for enabled in (i % 2 == 0, i % 2 == 1):  # alternate which goes first
                out = Path(tmp) / f"r{i}{enabled}"
                pair[enabled] = run_job(
                    enabled=enabled, steps=steps, layout=layout, nproc=nproc, out=out, emulate=emulate
                )
            (off, off_cpu), (on, on_cpu) = pair[False], pair[True]
            rows.append((off, on, on / off, off_cpu, on_cpu))
            print(
                f"  round {i}: off {off * 1e3:6.1f} ms/step ({off_cpu * 1e3:5.1f} ms CPU)   "
                f"on {on * 1e3:6.1f} ms/step ({on_cpu * 1e3:5.1f} ms CPU)   ratio {on / off:.3f}"
            )
    med = [statistics.median(r[k] for r in rows) for k in range(5)]
    print(
        f"step time, train_tiny {layout} on {nproc} ranks, {steps} steps x {rounds} rounds: off {med[0] * 1e3:.1f} ms, "
        f"on {med[1] * 1e3:.1f} ms, median ratio on/off {med[2]:.3f}; CPU per step of the loss rank: "
        f"off {med[3] * 1e3:.1f} ms, on {med[4] * 1e3:.1f} ms"
    )


# ====================================================================== 2. hot path per operation

PER_STEP = 100
"""Captured operations per step in the hot-path loop."""


def _cases(group: dist.ProcessGroup) -> dict[str, object]:
    x = torch.ones(1)

    def sync_all_reduce() -> None:
        dist.all_reduce(x, group=group)

    def async_all_reduce() -> None:
        dist.all_reduce(x, group=group, async_op=True).wait()

    def functional_all_reduce() -> None:
        funcol.all_reduce(x, "sum", group).wait()

    def broadcast() -> None:
        dist.broadcast(x, src=0, group=group)

    return {
        "all_reduce (sync)": sync_all_reduce,
        "all_reduce (async + wait)": async_all_reduce,
        "functional all_reduce + wait": functional_all_reduce,
        "broadcast (sync)": broadcast,
    }


def _block(fn, tracker, step: int) -> tuple[float, float]:
    """Seconds per operation over one block of PER_STEP operations, and seconds to end the step (0 without SDK)."""
    if tracker is None:
        t0 = time.perf_counter()
        for _ in range(PER_STEP):
            fn()
        return (time.perf_counter() - t0) / PER_STEP, 0.0
    ctx = tracker.step(step)
    ctx.__enter__()
    t0 = time.perf_counter()
    for _ in range(PER_STEP):
        fn()
    t1 = time.perf_counter()
    ctx.__exit__(None, None, None)
    return (t1 - t0) / PER_STEP, time.perf_counter() - t1


def bench_hot_path(ops: int) -> None:
    """Blocks of PER_STEP operations, alternating without and with the SDK (so load drift hits both alike)."""
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.new_group([0])
    sock_dir = Path(tempfile.mkdtemp(prefix="ms-b-"))
    collector = RecordCollector([sock_dir / "r0.sock"], sock_dir / "records.jsonl")
    collector.start()
    settings = sdk.TrackerSettings(collector=f"unix:{sock_dir / 'r0.sock'}", job="bench")
    tracker = sdk.Tracker(settings)
    tracker.register_group(group, "dp")
    tracker.close()  # patches off; the tracker object is reopened per block below
    blocks = max(1, ops // PER_STEP)
    print(f"hot path, 1-process gloo group, {blocks} alternating blocks of {PER_STEP} ops (median per op):")
    print(f"  {'operation':32s} {'without':>10s} {'with SDK':>10s} {'overhead':>10s}")
    end_costs = []
    step = 0
    for name, fn in _cases(group).items():
        for _ in range(5):
            _block(fn, None, 0)  # warm up
        base, capt = [], []
        for _ in range(blocks):
            base.append(_block(fn, None, 0)[0])
            tracker = sdk.Tracker(settings)
            tracker.register_group(group, "dp")
            per_op, end = _block(fn, tracker, step)
            step += 1
            errors = tracker.counters().hook_errors
            tracker.close()
            assert errors == 0
            capt.append(per_op)
            end_costs.append(end)
        b, c = statistics.median(base) * 1e6, statistics.median(capt) * 1e6
        print(f"  {name:32s} {b:8.1f} us {c:8.1f} us {c - b:8.1f} us")
    end_us = statistics.median(end_costs) * 1e6
    print(f"  ending a step of {PER_STEP} captured ops (record built, encoded, sent): {end_us:.0f} us")
    collector.stop()
    shutil.rmtree(sock_dir, ignore_errors=True)
    print(f"  records received by the collector: {collector.lines} of {step}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--ops", type=int, default=5000, help="operations per case in the hot-path loop")
    p.add_argument("--layout", default="dp=2,tp=2")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--skip-job", action="store_true", help="only the hot-path measurement")
    p.add_argument("--emulate", type=float, default=0.0, metavar="MS", help="train_tiny --emulate MS (0: real compute)")
    args = p.parse_args()
    bench_hot_path(args.ops)
    if not args.skip_job:
        bench_job(args.rounds, args.steps, args.layout, args.nproc, args.emulate)


if __name__ == "__main__":
    main()

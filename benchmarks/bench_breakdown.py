"""Scale check of the step breakdown: a 16,384-rank x 20-step synthetic job built straight from arrays.

Layout tp=8, pp=4, dp=512 (Megatron order tp-cp-ep-dp-pp), 8 GPUs per node, 72-GPU NVLink domains, every node's
clock skewed by up to ±5 ms. Per rank-step ~29 intervals: data, 4 micro-batches of (pp recv, forward, tp all-reduce,
forward), 4 of (backward, tp all-reduce), pp send, dp reduce-scatter, optimizer, dp all-gather, and every tenth step a
checkpoint. Collectives end together (last arrival + transfer), so the join and the clock alignment have real work.
No Python object is created per interval.

    .venv/bin/python benchmarks/bench_breakdown.py                 # 16,384 ranks x 20 steps
    .venv/bin/python benchmarks/bench_breakdown.py --ranks 1024 --jsonl /tmp/records.jsonl   # + JSONL write/read
    .venv/bin/python benchmarks/bench_breakdown.py --jsonl /tmp/records.jsonl --read-only      # read + break down
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from meshscope.analysis import CATEGORIES, TICKS_PER_US, break_down
from meshscope.records import (
    AXIS_CODE,
    KIND_CODE,
    OP_CODE,
    PHASE_CODE,
    IntervalColumns,
    RecordTable,
    StepColumns,
    read_table,
    write_records,
)
from meshscope.topology import AXES, ParallelLayout
from timing import Clock, machine_reference, peak_rss_mib

TP, PP = 8, 4
GPUS_PER_NODE, DOMAIN_GPUS = 8, 72
MICRO_BATCHES = 4
STEP_SPACING_US = 10_000_000


POSITIONS = 1 + MICRO_BATCHES * 4 + MICRO_BATCHES * 2 + 4  # interval positions per rank-step (+ checkpoints)
COLUMNS = {
    "start_us": np.int64,
    "end_us": np.int64,
    "kind": np.int8,
    "phase": np.int8,
    "axis": np.int8,
    "op": np.int8,
    "group": np.int32,
    "seq": np.int64,
    "size_bytes": np.int64,
    "group_size": np.int32,
    "peer": np.int64,
}


def build_table(ranks: int, steps: int, seed: int = 0) -> RecordTable:
    """The synthetic job; interval columns are preallocated and filled one template position at a time."""
    dp = ranks // (TP * PP)
    layout = ParallelLayout(tp=TP, pp=PP, dp=dp)
    rng = np.random.default_rng(seed)
    n = steps * ranks  # rows: step-major, then rank
    rank = np.tile(np.arange(ranks, dtype=np.int64), steps)
    step = np.repeat(np.arange(steps, dtype=np.int64), ranks)
    grid = (steps, PP, dp, TP)  # view of a per-row array: tp groups along the last axis, dp groups along axis 2
    node = rank // GPUS_PER_NODE
    n_nodes = ranks // GPUS_PER_NODE
    shift = rng.integers(-5000, 5001, n_nodes)[node]  # every node's clock is off by up to ±5 ms
    slow = 1.0 + (rng.random(n) < 0.001) * 0.5  # a few stragglers
    ckpt_rows = np.flatnonzero(step % 10 == 9)
    total = n * POSITIONS + ckpt_rows.size
    cols = {name: np.full(total, -1, dtype=dtype) for name, dtype in COLUMNS.items()}
    main = {name: col[: n * POSITIONS].reshape(n, POSITIONS) for name, col in cols.items()}
    pp_idx = (rank // (TP * dp)) % PP
    groups = {"tp": rank // TP, "dp": (rank % TP) + TP * pp_idx + ranks // TP}  # dp group ids after the tp ones
    sizes = {"tp": TP, "dp": dp}
    position = 0
    seq_in_step = {"tp": 0, "dp": 0}
    t = step * STEP_SPACING_US

    def add(kind, start, end, **fields):
        nonlocal position
        m = main
        m["start_us"][:, position] = start + shift
        m["end_us"][:, position] = end + shift
        m["kind"][:, position] = KIND_CODE[kind]
        for name, value in fields.items():
            m[name][:, position] = value
        position += 1

    def work(kind, mean_us, phase=-1):
        nonlocal t
        dur = (mean_us * slow * (1 + 0.05 * rng.standard_normal(n))).astype(np.int64).clip(1)
        add(kind, t, t + dur, phase=phase)
        t = t + dur

    def collective(axis, op, size, xfer_us):
        nonlocal t
        g = t.reshape(grid)
        last = g.max(axis=3, keepdims=True) if axis == "tp" else g.max(axis=2, keepdims=True)
        end = np.broadcast_to(last, grid).reshape(n) + xfer_us + rng.integers(-2, 3, n)  # finish within µs
        end = np.maximum(end, t)
        fields = {"axis": AXIS_CODE[axis], "op": OP_CODE[op], "group": groups[axis], "size_bytes": size}
        add("comm", t, end, seq=step * 64 + seq_in_step[axis], group_size=sizes[axis], **fields)
        seq_in_step[axis] += 1
        t = end

    def p2p(op, size, wait_us):
        nonlocal t
        dur = (wait_us * rng.random(n)).astype(np.int64) + 200
        peer = (rank - TP * dp if op == "recv" else rank + TP * dp) % ranks
        add("p2p", t, t + dur, axis=AXIS_CODE["pp"], op=OP_CODE[op], size_bytes=size, peer=peer)
        t = t + dur

    work("data", 3_000)
    for _ in range(MICRO_BATCHES):
        p2p("recv", 16 << 20, 4_000)
        work("compute", 12_000, PHASE_CODE["forward"])
        collective("tp", "all_reduce", 32 << 20, 1_500)
        work("compute", 12_000, PHASE_CODE["forward"])
    for _ in range(MICRO_BATCHES):
        work("compute", 40_000, PHASE_CODE["backward"])
        collective("tp", "all_reduce", 32 << 20, 1_500)
    p2p("send", 16 << 20, 2_000)
    collective("dp", "reduce_scatter", 256 << 20, 20_000)
    work("optimizer", 8_000)
    collective("dp", "all_gather", 256 << 20, 20_000)
    assert position == POSITIONS
    # Every tenth step ends with a 150 ms checkpoint.
    tail = slice(n * POSITIONS, total)
    cols["start_us"][tail] = t[ckpt_rows] + shift[ckpt_rows]
    cols["end_us"][tail] = t[ckpt_rows] + 150_000 + shift[ckpt_rows]
    cols["kind"][tail] = KIND_CODE["checkpoint"]
    t[ckpt_rows] += 150_000
    row = np.concatenate([np.repeat(np.arange(n, dtype=np.int32), POSITIONS), ckpt_rows.astype(np.int32)])

    coords = layout.coords_array(np.arange(ranks))
    return RecordTable(
        job="bench",
        steps=StepColumns.build(
            rank=rank,
            step=step,
            start_us=step * STEP_SPACING_US + shift,
            end_us=t + 500 + shift,
            coord=np.stack([coords[a] for a in AXES], axis=1)[rank],
            node=node,
            nvlink_domain=rank // DOMAIN_GPUS,
            network_tier=rank // (DOMAIN_GPUS * 8),
            gpu=rank % GPUS_PER_NODE,
            gpu_util=np.full(n, 0.97),
        ),
        intervals=IntervalColumns.build(row=row, **cols),
        node_names=tuple(f"node-{i}" for i in range(n_nodes)),
        group_names=tuple(f"tp:{i}" for i in range(ranks // TP)) + tuple(f"dp:{i}" for i in range(TP * PP)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=16_384)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--jsonl", type=Path, help="also write the table as JSON lines here and time read_table")
    parser.add_argument("--workers", type=int, default=2, help="processes for read_table (default 2)")
    parser.add_argument("--read-only", action="store_true", help="time read_table on an existing --jsonl file")
    args = parser.parse_args()
    print(machine_reference(), flush=True)

    clock = Clock()
    if args.read_only:
        table = read_table(args.jsonl, workers=args.workers)
        print(
            f"read   {clock.lap()}  workers={args.workers}, {table.n_intervals:,} intervals; peak RSS "
            f"{peak_rss_mib():,.0f} MiB (this process)"
        )
    else:
        table = build_table(args.ranks, args.steps)
        print(
            f"build  {clock.lap()}  {table.n_rows:,} rank-steps, {table.n_intervals:,} intervals "
            f"({table.n_intervals / table.n_rows:.1f} per rank-step); peak RSS {peak_rss_mib():,.0f} MiB"
        )
    b = break_down(table, p2p_bandwidth_bytes_per_s={"nvlink": 450e9, "network": 50e9})
    print(
        f"break  {clock.lap()}  {len(b.collectives):,} collective instances joined; peak RSS {peak_rss_mib():,.0f} MiB"
    )
    exact = bool((b.ticks.sum(axis=1) == b.step_us * TICKS_PER_US).all())
    print(f"categories sum exactly to step time: {exact}")
    mean = b.ticks.mean(axis=0) / TICKS_PER_US / 1000
    print("mean per rank-step (ms): " + ", ".join(f"{c} {v:.2f}" for c, v in zip(CATEGORIES, mean, strict=True) if v))
    worst = int(np.argmax(b.wait_caused_us.sum(axis=1)))
    print(
        f"worst straggler: rank {int(table.steps.rank[worst])} step {int(table.steps.step[worst])} caused "
        f"{b.wait_caused_us[worst].sum() / 1000:.1f} ms of waiting; notes: {[n.code for n in b.notes]}"
    )
    if args.jsonl and not args.read_only:
        clock.lap()
        lines = write_records(args.jsonl, table)
        size = args.jsonl.stat().st_size
        print(f"write  {clock.lap()}  {lines:,} lines, {size / 2**20:,.0f} MiB")
        for workers in sorted({1, args.workers}):
            wall = time.perf_counter()
            again = read_table(args.jsonl, workers=workers)
            wall = time.perf_counter() - wall
            print(
                f"read   {clock.lap()}  workers={workers}: {size / 2**20 / wall:.0f} MiB/s, "
                f"{again.n_intervals / wall / 1e6:.2f} M intervals/s; peak RSS {peak_rss_mib():,.0f} MiB"
            )


if __name__ == "__main__":
    main()

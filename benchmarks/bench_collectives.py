"""Scale check of the collectives comparison: per stage and (axis, op), plan vs records, on 16,384 ranks x 20 steps.

The records are ``bench_breakdown.build_table``'s synthetic job (tp=8, pp=4, dp=ranks/32) with 6 micro-batches per
step instead of 4, so a rank-step holds 41 intervals (data, 6 pp receives, 18 compute intervals, 12 tp all-reduces, a
pp send, a dp reduce-scatter, the optimizer, a dp all-gather; a checkpoint every tenth step): 13.5 M intervals, 6.9 M
of them collectives or p2p. The plan is llama3-70b on the same layout. Timed: ``compare_collectives`` (what ``meshscope
analyze --spec`` adds) and ``stage_traffic`` split by message size (what the exact comparison of ``meshscope run``
uses), best and median of ``--repeat`` runs, wall and CPU time (CPU time is steadier on a shared machine).

    .venv/bin/python benchmarks/bench_collectives.py
    .venv/bin/python benchmarks/bench_collectives.py --ranks 4096 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import bench_breakdown
from meshscope.analysis import compare_collectives, stage_of_rows, stage_traffic
from meshscope.jobs import spec_from_manifest
from meshscope.plan import plan_job
from timing import Clock, machine_reference, peak_rss_mib

MICRO_BATCHES = 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=16_384)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(machine_reference(), flush=True)

    # build_table reads its template size from these module constants at call time.
    bench_breakdown.MICRO_BATCHES = MICRO_BATCHES
    bench_breakdown.POSITIONS = 1 + MICRO_BATCHES * 4 + MICRO_BATCHES * 2 + 4
    clock = Clock()
    table = bench_breakdown.build_table(args.ranks, args.steps)
    net = int((table.intervals.kind >= 4).sum())
    print(
        f"build    {clock.lap()}  {table.n_rows:,} rank-steps, {table.n_intervals:,} intervals "
        f"({table.n_intervals / table.n_rows:.1f} per rank-step, {net:,} comm/p2p); peak RSS {peak_rss_mib():,.0f} MiB"
    )
    dp = args.ranks // (bench_breakdown.TP * bench_breakdown.PP)
    spec = spec_from_manifest(
        {
            "apiVersion": "meshscope.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "bench"},
            "spec": {
                "model": {"preset": "llama3-70b"},
                "parallelism": {"tp": bench_breakdown.TP, "pp": bench_breakdown.PP, "dp": dp},
                "training": {"microBatchSize": 1, "globalBatchSize": dp * MICRO_BATCHES},
                "hardware": {"gpu": "H100", "nodes": args.ranks // 8, "gpusPerNode": 8},
            },
        }
    )
    plan = plan_job(spec)
    print(f"plan     {clock.lap()}")
    for label, run in (
        ("compare_collectives", lambda: compare_collectives(table, plan)),
        (
            "stage_traffic by size",
            lambda: stage_traffic(table, stage_of_rows(table), split_sizes_except={"all_to_all"}),
        ),
    ):
        wall, cpu = [], []
        for _ in range(args.repeat):
            w, c = time.perf_counter(), time.process_time()
            result = run()
            wall.append(time.perf_counter() - w)
            cpu.append(time.process_time() - c)
        print(
            f"{label:22} wall best {min(wall):.3f} s median {statistics.median(wall):.3f} s; CPU best {min(cpu):.3f} s "
            f"median {statistics.median(cpu):.3f} s; {len(result):,} rows/keys; peak RSS {peak_rss_mib():,.0f} MiB"
        )


if __name__ == "__main__":
    main()

"""Scale check of the simulator: a 16,384-rank Llama 3 70B job on 2,048 H100 nodes, 20 steps, three faults.

Layout tp=8 (inside a node), pp=4, dp=512; 4 micro-batches per step (globalBatchSize 2048), the distributed
optimizer, 1F1B. Per rank-step ~40 intervals: per micro-batch a pipeline receive, forward compute, the tensor-parallel
all-reduce, compute, a send (and the same for the backward), plus the data-parallel reduce-scatter and all-gather and
the optimizer. Faults: a straggler, a slow NIC, noise. Prints the build time, the intervals, the peak RSS
(``resource.getrusage``) and the time of ``meshscope.analysis.breakdown.break_down`` on the result.

    .venv/bin/python benchmarks/bench_simulate.py                     # 16,384 ranks x 20 steps
    .venv/bin/python benchmarks/bench_simulate.py --nodes 256 --steps 5 --jsonl /tmp/sim.jsonl.gz
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from meshscope.analysis import CATEGORIES, TICKS_PER_US
from meshscope.jobs import spec_from_manifest
from meshscope.records import write_records
from meshscope.simulation import Noise, SlowLink, Straggler, simulate
from timing import Clock, machine_reference, peak_rss_mib


def manifest(nodes: int) -> dict[str, object]:
    gpus = nodes * 8
    dp = gpus // (8 * 4)
    return {
        "apiVersion": "meshscope.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": f"bench-llama3-70b-{gpus}"},
        "spec": {
            "model": {"preset": "llama3-70b"},
            "parallelism": {"tp": 8, "pp": 4, "dp": dp},
            "training": {"microBatchSize": 1, "globalBatchSize": 4 * dp, "distributedOptimizer": True},
            "hardware": {"gpu": "H100", "nodes": nodes},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2048, help="8-GPU nodes (2048 = 16,384 ranks)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--jsonl", type=Path, help="also write the records here and time it")
    args = parser.parse_args()
    print(machine_reference(), flush=True)

    spec = spec_from_manifest(manifest(args.nodes))
    faults = [Straggler(rank=3, factor=1.3), SlowLink(node=5, factor=0.25), Noise(sigma=0.02)]
    clock = Clock()
    result = simulate(spec, steps=args.steps, faults=faults, seed=1)
    table = result.table
    print(
        f"simulate {clock.lap()}  {spec.world_size:,} ranks x {args.steps} steps: {table.n_rows:,} rank-steps, "
        f"{table.n_intervals:,} intervals ({table.n_intervals / table.n_rows:.1f} per rank-step); "
        f"peak RSS {peak_rss_mib():,.0f} MiB"
    )
    b = result.break_down()
    print(f"break    {clock.lap()}  {len(b.collectives):,} collective instances; peak RSS {peak_rss_mib():,.0f} MiB")
    mean = b.ticks.mean(axis=0) / TICKS_PER_US / 1000
    print("mean per rank-step (ms): " + ", ".join(f"{c} {v:.1f}" for c, v in zip(CATEGORIES, mean, strict=True) if v))
    worst = int(np.argmax(b.wait_caused_us.sum(axis=1)))
    print(
        f"most waiting caused: rank {int(table.steps.rank[worst])} step {int(table.steps.step[worst])} "
        f"({b.wait_caused_us[worst].sum() / 1000:.1f} ms); truth: {result.truth.describe()}"
    )
    if args.jsonl:
        clock.lap()
        lines = write_records(args.jsonl, table)
        print(f"write    {clock.lap()}  {lines:,} lines, {args.jsonl.stat().st_size / 2**20:,.0f} MiB")


if __name__ == "__main__":
    main()

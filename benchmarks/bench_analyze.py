"""Scale check of ``analyze``: breakdown + cost table + diagnosis on 16,384 ranks x 20 steps of synthetic records.

The records are ``bench_breakdown.build_table``'s job (tp=8, pp=4, dp=ranks/32, ~29 intervals per rank-step with every
tp and dp collective as its own interval, clock skew, a few stragglers, a checkpoint every tenth step), built from
arrays. Each size runs in a fresh process so that peak RSS is that size's own.

    .venv/bin/python benchmarks/bench_analyze.py                      # 16,384 ranks x 20 steps
    .venv/bin/python benchmarks/bench_analyze.py --ranks 4096 8192 16384   # how the cost grows with ranks
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from timing import machine_reference

HERE = Path(__file__).resolve().parent


def one(ranks: int, steps: int) -> dict[str, object]:
    sys.path.insert(0, str(HERE))
    from bench_breakdown import build_table  # noqa: PLC0415 - sibling script, imported on demand
    from meshscope.analysis import (  # noqa: PLC0415
        analyze,
        break_down,
        diagnose,
        index_rank_steps,
        render_analysis,
    )

    t = time.perf_counter()
    table = build_table(ranks, steps)
    build_s = time.perf_counter() - t
    rss_table = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = time.perf_counter()
    analysis = analyze(table)
    analyze_s = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # Where the time goes: the breakdown alone, then indexing + diagnosis on its result.
    t = time.perf_counter()
    bd = break_down(table)
    breakdown_s = time.perf_counter() - t
    t = time.perf_counter()
    diagnose(index_rank_steps(bd))
    diagnose_s = time.perf_counter() - t
    text = render_analysis(analysis)
    return {
        "ranks": ranks,
        "steps": steps,
        "intervals": table.n_intervals,
        "build_s": build_s,
        "analyze_s": analyze_s,
        "breakdown_s": breakdown_s,
        "index_and_diagnose_s": diagnose_s,
        "peak_rss_after_build_mib": rss_table,
        "peak_rss_mib": rss,
        "findings": [f.code for f in analysis.findings],
        "render_chars": len(text),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16_384])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.ranks[0], args.steps)))
        return
    print(machine_reference(), flush=True)
    print(f"{'ranks':>7} {'intervals':>11} {'analyze':>9} {'breakdown':>10} {'index+diag':>11} {'peak RSS':>10}")
    for ranks in args.ranks:
        proc = subprocess.run(
            [sys.executable, __file__, "--one", "--ranks", str(ranks), "--steps", str(args.steps)],
            capture_output=True,
            text=True,
            check=True,
        )
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(
            f"{r['ranks']:>7,} {r['intervals']:>11,} {r['analyze_s']:>8.2f}s {r['breakdown_s']:>9.2f}s "
            f"{r['index_and_diagnose_s']:>10.2f}s {r['peak_rss_mib']:>7,.0f} MiB   (findings {r['findings']}; "
            f"table built in {r['build_s']:.1f} s, {r['peak_rss_after_build_mib']:,.0f} MiB)"
        )


if __name__ == "__main__":
    main()

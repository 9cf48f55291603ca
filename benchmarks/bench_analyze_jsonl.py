"""End-to-end scale check of ``meshscope analyze`` on JSON lines: write, read (1 and 2 workers), analyze, total, RSS.

Issue 3 asks ``meshscope analyze`` of 16,384 ranks x 20 steps of simulated records (every collective its own
interval) in under 30 s and 4 GiB on the 2-core development machine. Two jobs of that size:

- ``--job synthetic`` (default): ``bench_breakdown.build_table``, the job ``bench_analyze.py`` times in memory
  (tp=8, pp=4, dp=512, ~29 intervals per rank-step, ~9.5 M intervals, ~1 GiB of JSON lines);
- ``--job simulate``: what ``meshscope simulate`` writes for ``bench_simulate.py``'s Llama 3 70B job on 2,048
  nodes (~39 intervals per rank-step, ~12.8 M intervals, ~1.7 GiB).

Every phase runs in a fresh process, so that each peak RSS is that phase's own:

1. write: build the job and ``write_records`` it (skipped with ``--reuse`` when the file exists);
2. read: ``read_table`` with 1 worker, then with 2;
3. analyze: ``read_table`` as the command line calls it (``default_workers()``), ``analyze``, the JSON of the result;
4. total: the command itself, ``python -m meshscope analyze FILE --json > /dev/null``, timed from outside.

Peak RSS is the process's own (``ru_maxrss``) and, where worker processes run, the peak of the whole process tree
(the sum of every process' RSS, sampled every 50 ms from ``/proc``; shared pages count once per process, so it is an
upper bound). Linux only.

    .venv/bin/python benchmarks/bench_analyze_jsonl.py
    .venv/bin/python benchmarks/bench_analyze_jsonl.py --job simulate --jsonl /tmp/sim.jsonl --reuse
    .venv/bin/python benchmarks/bench_analyze_jsonl.py --ranks 1024     # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GIB = 2**30
MIB = 2**20


# ---------------------------------------------------------------------------------------------- the phases (children)


def build(job: str, ranks: int, steps: int) -> Any:
    """The job's RecordTable."""
    sys.path.insert(0, str(HERE))
    if job == "synthetic":
        from bench_breakdown import build_table  # noqa: PLC0415 - sibling script, imported on demand

        return build_table(ranks, steps)
    from bench_simulate import manifest  # noqa: PLC0415
    from meshscope.loading import spec_from_manifest  # noqa: PLC0415
    from meshscope.simulate import simulate  # noqa: PLC0415

    return simulate(spec_from_manifest(manifest(ranks // 8)), steps=steps, seed=1).table


def phase_write(args: argparse.Namespace) -> dict[str, Any]:
    from meshscope.records import write_records  # noqa: PLC0415

    t = time.perf_counter()
    table = build(args.job, args.ranks, args.steps)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    lines = write_records(args.jsonl, table)
    return {
        "build_s": build_s,
        "write_s": time.perf_counter() - t,
        "lines": lines,
        "intervals": table.n_intervals,
        "bytes": args.jsonl.stat().st_size,
    }


def phase_read(args: argparse.Namespace) -> dict[str, Any]:
    from meshscope.records import read_table  # noqa: PLC0415

    t = time.perf_counter()
    table = read_table(args.jsonl, workers=args.workers)
    return {"read_s": time.perf_counter() - t, "intervals": table.n_intervals, **own_rss()}


def phase_analyze(args: argparse.Namespace) -> dict[str, Any]:
    from meshscope.analysis import analyze  # noqa: PLC0415
    from meshscope.records import read_table  # noqa: PLC0415
    from meshscope.records.reading import default_workers  # noqa: PLC0415

    t0 = time.perf_counter()
    table = read_table(args.jsonl, workers=default_workers())
    t1 = time.perf_counter()
    result = analyze(table)
    t2 = time.perf_counter()
    text = json.dumps(result.to_dict(), indent=2)
    t3 = time.perf_counter()
    return {
        "workers": default_workers(),
        "read_s": t1 - t0,
        "analyze_s": t2 - t1,
        "json_s": t3 - t2,
        "total_s": t3 - t0,
        "findings": [f.code for f in result.findings],
        "json_chars": len(text),
        **own_rss(),
    }


def own_rss() -> dict[str, float]:
    return {
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_children_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


# ---------------------------------------------------------------------------------------------- the driver


def tree_usage(root: int) -> tuple[int, dict[int, float]]:
    """Resident bytes of ``root`` and all its descendants, and each one's CPU seconds so far, from ``/proc``."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            pages = int((entry / "statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue
        pid = int(entry.name)
        children.setdefault(int(stat[1]), []).append(pid)
        rss[pid] = pages
        cpu[pid] = (int(stat[11]) + int(stat[12])) / tick  # utime + stime
    total, todo, seen = 0, [root], {}
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        seen[pid] = cpu.get(pid, 0.0)
        todo.extend(children.get(pid, []))
    return total * os.sysconf("SC_PAGE_SIZE"), seen


def run(cmd: list[str], *, capture: bool = True) -> tuple[str, float, float, float]:
    """Run ``cmd``; return its stdout, wall seconds, CPU seconds of its process tree and the tree's peak RSS (MiB)."""
    peak = 0
    cpu: dict[int, float] = {}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if capture else subprocess.DEVNULL, text=True)
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.05):
            rss, seen = tree_usage(proc.pid)
            peak = max(peak, rss)
            cpu.update(seen)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    wall = time.perf_counter() - t
    done.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # The command itself exactly (it was waited for); its descendants as last sampled.
    cpu[proc.pid] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return out or "", wall, sum(cpu.values()), peak / MIB


def child(args: argparse.Namespace, phase: str, *extra: str) -> tuple[dict[str, Any], float, float]:
    """Run one phase in a fresh process: its JSON, the CPU seconds of its process tree and the tree's peak RSS."""
    cmd = [sys.executable, __file__, "--phase", phase, "--job", args.job, "--ranks", str(args.ranks)]
    cmd += ["--steps", str(args.steps), "--jsonl", str(args.jsonl), *extra]
    out, _, cpu, tree = run(cmd)
    return json.loads(out.strip().splitlines()[-1]), cpu, tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=["synthetic", "simulate"], default="synthetic")
    parser.add_argument("--ranks", type=int, default=16_384, help="a multiple of 32 (default 16,384)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--jsonl", type=Path, help="records file (default: a temporary file, removed at the end)")
    parser.add_argument("--reuse", action="store_true", help="keep an existing --jsonl file instead of writing it")
    parser.add_argument("--phase", choices=["write", "read", "analyze"], help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        phases = {"write": phase_write, "read": phase_read, "analyze": phase_analyze}
        print(json.dumps(phases[args.phase](args)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        if args.jsonl is None:
            args.jsonl = Path(tmp) / "records.jsonl"
        print(f"{args.job} job, {args.ranks:,} ranks x {args.steps} steps -> {args.jsonl}")
        if args.reuse and args.jsonl.exists():
            print(f"write     reused {args.jsonl.stat().st_size / GIB:.2f} GiB")
        else:
            w, cpu, tree = child(args, "write")
            print(
                f"write     {w['write_s']:6.1f} s  ({w['lines']:,} lines, {w['intervals']:,} intervals, "
                f"{w['bytes'] / GIB:.2f} GiB; job built in {w['build_s']:.1f} s; peak RSS {tree:,.0f} MiB)"
            )
        for workers in (1, 2):
            r, cpu, tree = child(args, "read", "--workers", str(workers))
            print(
                f"read      {r['read_s']:6.1f} s  ({workers} worker{'s' if workers > 1 else ''}; {cpu:.1f} CPU-s "
                f"in all; peak RSS {r['rss_mib']:,.0f} MiB, process tree {tree:,.0f} MiB)"
            )
        a, cpu, tree = child(args, "analyze")
        print(
            f"analyze   {a['analyze_s']:6.1f} s  (after read_table {a['read_s']:.1f} s with {a['workers']} workers, "
            f"then JSON {a['json_s']:.1f} s: {a['total_s']:.1f} s, {cpu:.1f} CPU-s in all; peak RSS "
            f"{a['rss_mib']:,.0f} MiB, process tree {tree:,.0f} MiB; findings {sorted(set(a['findings']))})"
        )
        _, wall, cpu, tree = run(
            [sys.executable, "-m", "meshscope", "analyze", str(args.jsonl), "--json"], capture=False
        )
        print(
            f"total     {wall:6.1f} s  (meshscope analyze FILE --json > /dev/null; {cpu:.1f} CPU-s; peak RSS, tree "
            f"{tree:,.0f} MiB)"
        )


if __name__ == "__main__":
    main()

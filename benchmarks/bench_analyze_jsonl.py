"""Issue 3's scale bar, end to end: ``meshscope simulate`` writes the records, ``meshscope analyze --json`` reads them.

The bar: ``analyze`` of 16,384 ranks x 20 steps of simulated records (every collective its own interval) in under
30 s and under 4 GiB of memory on the 2-core development machine, and ``simulate`` producing them in under 30 s.
The job is ``bench_simulate.py``'s: Llama 3 70B, tp 8 (inside a node), pp 4, dp = ranks / 32, 4 micro-batches per
step, with a straggler, a slow NIC and noise (~39 intervals per rank-step: 12.8 M intervals, 1.7 GiB at 16,384
ranks). For every size it runs, as separate processes timed from outside:

1. ``meshscope simulate --spec SPEC --steps 20 --seed 1 --fault ... --out FILE.jsonl``;
2. ``meshscope analyze --json FILE.jsonl --spec SPEC > /dev/null``.

Each gets its wall time, the CPU seconds of its process tree (worker processes included) and the peak RSS of the
tree (the sum of every process' RSS, sampled every 50 ms from ``/proc``; shared pages count once per process, so it
is an upper bound). Then, for the largest size, the phase split of ``analyze``: the same steps as the command in one
process under ``cProfile`` (the parent only; the decoding runs in worker processes), wall seconds per phase. Last,
how time and memory grow with the ranks. Linux only. The machine is shared: compare figures of one run, side by side.

    .venv/bin/python benchmarks/bench_analyze_jsonl.py                          # 4,096 / 8,192 / 16,384 ranks
    .venv/bin/python benchmarks/bench_analyze_jsonl.py --ranks 16384            # the bar only
    .venv/bin/python benchmarks/bench_analyze_jsonl.py --ranks 1024 --steps 5   # a quick run
    .venv/bin/python benchmarks/bench_analyze_jsonl.py --keep /tmp/scale        # keep (and reuse) the files
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from timing import machine_reference

HERE = Path(__file__).resolve().parent
GIB = 2**30
MIB = 2**20
BAR_SECONDS = 30.0
BAR_RSS_BYTES = 4 * GIB
FAULTS = ("straggler:rank=3,factor=1.3", "slow-link:node=5,factor=0.25", "noise:sigma=0.02")
"""The faults ``bench_simulate.py`` injects."""
PHASES = (
    # (label, functions whose cumulative time it is, functions called inside those, subtracted)
    ("read: decode (workers, or in process)", ("_read_parallel", "read_file"), ("_merge", "_validate_table")),
    ("read: merge the workers' columns", ("_merge",), ()),
    ("read: validate the table", ("_validate_table",), ()),
    ("breakdown (sweep, join, clocks)", ("break_down",), ()),
    ("index rank-steps", ("index_rank_steps",), ()),
    ("transfers + diagnosis", ("diagnose",), ()),
    ("cost rows + summary", ("cost_rows", "summarise"), ()),
    ("collectives + memory comparison", ("compare_collectives", "compare_memory"), ()),
    ("JSON out", ("to_dict", "dump"), ()),
)

# ---------------------------------------------------------------------------------------------- measuring processes


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


def run(cmd: list[str], *, stdout: Any = subprocess.DEVNULL) -> tuple[str, float, float, int]:
    """Run ``cmd``; return its stdout, wall seconds, CPU seconds of its process tree and the tree's peak RSS (bytes)."""
    peak = 0
    cpu: dict[int, float] = {}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=stdout, text=True)
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
    return out or "", wall, sum(cpu.values()), peak


# ---------------------------------------------------------------------------------------------- the phase split


def phase_split(records: Path, spec: Path) -> dict[str, Any]:
    """Child: ``meshscope analyze --json RECORDS --spec SPEC`` in this process under cProfile; seconds per phase."""
    from meshscope.cli import main  # noqa: PLC0415 - imported in the child only

    profile = cProfile.Profile()
    out, sys.stdout = sys.stdout, io.StringIO()
    t = time.perf_counter()
    profile.enable()
    try:
        code = main(["analyze", "--json", str(records), "--spec", str(spec)])
    finally:
        profile.disable()
        sys.stdout = out
    total = time.perf_counter() - t
    if code:
        raise SystemExit(f"meshscope analyze exited with {code}")
    cumulative: dict[str, float] = {}
    for (_, _, name), (_, _, _, cum, _) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        cumulative[name] = max(cumulative.get(name, 0.0), cum)
    phases = {
        label: sum(cumulative.get(name, 0.0) for name in names) - sum(cumulative.get(name, 0.0) for name in inner)
        for label, names, inner in PHASES
    }
    return {"total_s": total, "phases": phases}


# ---------------------------------------------------------------------------------------------- the driver


def manifest_file(folder: Path, ranks: int) -> Path:
    sys.path.insert(0, str(HERE))
    from bench_simulate import manifest  # noqa: PLC0415 - sibling script

    path = folder / f"spec-{ranks}.yaml"
    path.write_text(yaml.safe_dump(manifest(ranks // 8)))
    return path


def one_size(folder: Path, ranks: int, steps: int) -> dict[str, Any]:
    spec = manifest_file(folder, ranks)
    records = folder / f"records-{ranks}x{steps}.jsonl"
    meshscope = [sys.executable, "-m", "meshscope"]
    said = records.with_suffix(".said.txt")  # what simulate printed, for a reused file
    sim: dict[str, Any] = {}
    if not records.exists():
        cmd = [*meshscope, "simulate", "--spec", str(spec), "--steps", str(steps), "--seed", "1", "--out", str(records)]
        for fault in FAULTS:
            cmd += ["--fault", fault]
        out, wall, cpu, peak = run(cmd, stdout=subprocess.PIPE)
        said.write_text(out)
        sim = {"wall_s": wall, "cpu_s": cpu, "peak_rss": peak}
    sim_said = said.read_text().strip().splitlines() if said.exists() else []
    _, wall, cpu, peak = run([*meshscope, "analyze", "--json", str(records), "--spec", str(spec)])
    return {
        "ranks": ranks,
        "bytes": records.stat().st_size,
        "simulate": sim,
        "said": sim_said,
        "analyze": {"wall_s": wall, "cpu_s": cpu, "peak_rss": peak},
        "spec": spec,
        "records": records,
    }


def intervals_of(said: list[str]) -> str:
    """The interval count ``meshscope simulate`` printed."""
    for line in said:
        if "intervals (" in line:
            return line.split(" rank-steps, ")[1].split(" intervals")[0]
    return "?"


def verdict(ok: bool) -> str:  # noqa: FBT001
    return "meets the bar" if ok else "MISSES THE BAR"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4096, 8192, 16_384], help="multiples of 32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--keep", type=Path, help="folder to write (and reuse) the files in; default a temporary one")
    parser.add_argument("--no-split", action="store_true", help="skip the phase split (one more analyze run)")
    parser.add_argument("--phase-split", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase_split:
        print(json.dumps(phase_split(*args.phase_split)))
        return
    print(machine_reference(), flush=True)
    with tempfile.TemporaryDirectory(prefix="meshscope-bench-") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        print(
            f"meshscope simulate + analyze --json, Llama 3 70B (tp 8, pp 4, dp ranks/32) x {args.steps} steps, "
            f"faults {', '.join(f.split(':')[0] for f in FAULTS)}; machine: {os.cpu_count()} CPUs"
        )
        print(
            f"{'ranks':>7} {'intervals':>11} {'file':>9} | {'simulate':>8} {'CPU':>7} {'RSS':>9} | "
            f"{'analyze':>8} {'CPU':>7} {'RSS (tree)':>10}"
        )
        results = []
        for ranks in sorted(args.ranks):
            r = one_size(folder, ranks, args.steps)
            results.append(r)
            sim, an = r["simulate"], r["analyze"]
            sim_text = (
                f"{sim['wall_s']:7.1f}s {sim['cpu_s']:6.1f}s {sim['peak_rss'] / MIB:6,.0f} MiB"
                if sim
                else f"{'(reused)':>8} {'':>7} {'':>9}"
            )
            print(
                f"{ranks:>7,} {intervals_of(r['said']):>11} {r['bytes'] / GIB:5.2f} GiB | {sim_text} | "
                f"{an['wall_s']:7.1f}s {an['cpu_s']:6.1f}s {an['peak_rss'] / MIB:6,.0f} MiB"
            )
        big = results[-1]
        an, sim = big["analyze"], big["simulate"]
        ok = an["wall_s"] < BAR_SECONDS and an["peak_rss"] < BAR_RSS_BYTES
        print(
            f"bar at {big['ranks']:,} ranks: analyze {an['wall_s']:.1f} s (< {BAR_SECONDS:.0f} s), peak RSS "
            f"{an['peak_rss'] / GIB:.2f} GiB (< 4 GiB): {verdict(ok)}"
        )
        if sim:
            print(
                f"                     simulate {sim['wall_s']:.1f} s (< {BAR_SECONDS:.0f} s): "
                f"{verdict(sim['wall_s'] < BAR_SECONDS)}"
            )
        if not args.no_split:
            cmd = [sys.executable, __file__, "--phase-split", str(big["records"]), str(big["spec"])]
            out, _, _, _ = run(cmd, stdout=subprocess.PIPE)
            split = json.loads(out.strip().splitlines()[-1])
            phases = split["phases"]
            print(f"phase split at {big['ranks']:,} ranks (one more run, under cProfile: {split['total_s']:.1f} s):")
            for label, seconds in phases.items():
                print(f"  {label:<34} {seconds:6.2f} s")
            print(f"  {'other (start-up, spec, plan, ...)':<34} {split['total_s'] - sum(phases.values()):6.2f} s")
        if len(results) > 1:
            print("growth with ranks (ratio to the previous size; linear = the ranks' ratio):")
            for a, b in itertools.pairwise(results):
                print(
                    f"  {a['ranks']:>6,} -> {b['ranks']:>6,} ranks (x{b['ranks'] / a['ranks']:.1f}): analyze time "
                    f"x{b['analyze']['wall_s'] / a['analyze']['wall_s']:.2f}, CPU "
                    f"x{b['analyze']['cpu_s'] / a['analyze']['cpu_s']:.2f}, peak RSS "
                    f"x{b['analyze']['peak_rss'] / a['analyze']['peak_rss']:.2f}"
                )


if __name__ == "__main__":
    main()

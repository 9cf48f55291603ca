"""Planner speed targets (issue 2), measured and printed; nothing is asserted.

Targets: placement check of a 131,072-GPU layout under 0.5 s; ``meshscope plan`` of a 16,384-GPU llama3-405b spec
under 1 s end to end (YAML load + plan + JSON); layout search over 16,384 GPUs under 10 s.
Run: ``.venv/bin/python benchmarks/bench_planner.py``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from meshscope.jobs import load_spec, lookup_model
from meshscope.plan import PlanAssumptions, SearchRequest, plan_job, search_layouts
from meshscope.topology import ParallelLayout, Placement, axis_spans, default_hardware
from timing import machine_reference

ROOT = Path(__file__).resolve().parents[1]


def best_of(fn, repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main() -> None:
    print(machine_reference(), flush=True)
    # 1. Placement check: 131,072 GPUs (16,384 nodes of 8), tp8 cp2 ep8 pp16 dp512, every axis' groups spanned.
    layout = ParallelLayout(dp=512, tp=8, pp=16, cp=2, ep=8)
    hw = default_hardware("H100", nodes=16_384)

    def placement_check() -> None:
        axis_spans(layout, Placement.for_hardware(layout.world_size, hw))

    best, median = best_of(placement_check, 5)
    print(
        f"placement check, {layout.world_size:,} GPUs ({layout.describe()}): best {best:.3f} s, median {median:.3f} s"
        f" (target < 0.5 s)"
    )

    # 2. plan of the 16,384-GPU llama3-405b example: in process (load + plan + to_dict), and as a fresh CLI process.
    example = ROOT / "examples" / "llama3-405b-h100.yaml"

    def plan_in_process() -> None:
        json.dumps(plan_job(load_spec(example)).to_dict())

    best, median = best_of(plan_in_process, 5)
    print(f"plan {example.name} (16,384 GPUs), in process: best {best:.3f} s, median {median:.3f} s (target < 1 s)")

    def plan_cli() -> None:
        subprocess.run([sys.executable, "-m", "meshscope", "plan", "--json", str(example)], check=True,
                       capture_output=True)  # fmt: skip

    best, median = best_of(plan_cli, 3)
    print(
        f"meshscope plan --json {example.name}, whole process incl. interpreter start: best {best:.3f} s, "
        f"median {median:.3f} s (target < 1 s)"
    )

    # 2b. Start-up of the command line as whole processes: a command loads only its own modules (docs/architecture.md).
    # Beside them, the same interpreter importing every command's modules: what each of these cost before the CLI
    # loaded commands lazily (meshscope --version took 0.5 s on this kind of machine).
    small = ROOT / "examples" / "llama3-8b-h100.yaml"
    everything = "import meshscope.cli, meshscope.local, meshscope.simulation, meshscope.reports, meshscope.analysis"
    for label, argv, target in (
        ("meshscope --version", ["-m", "meshscope", "--version"], "< 0.15 s"),
        ("meshscope --help", ["-m", "meshscope", "--help"], "< 0.15 s"),
        (f"meshscope plan {small.name} --json", ["-m", "meshscope", "plan", str(small), "--json"], "well < 0.5 s"),
        (f"meshscope plan {example.name} --json", ["-m", "meshscope", "plan", str(example), "--json"], "well < 0.5 s"),
        ("python -c 'import every command's modules'", ["-c", everything], "the eager CLI's floor"),
    ):
        best, median = best_of(
            lambda argv=argv: subprocess.run([sys.executable, *argv], check=True, capture_output=True), 5
        )
        print(f"{label}, whole process: best {best:.3f} s, median {median:.3f} s ({target})")

    # 3. Layout search over 16,384 H100s for llama3-405b.
    request = SearchRequest(
        model=lookup_model("llama3-405b"), hardware=default_hardware("H100", nodes=2048), global_batch_size=2048
    )
    # The roofline per operation class with NCCL's latency model (the default), and the flat model the planner used
    # before issue 12 (one compute_efficiency, bandwidth-only collectives) for comparison; best of 2, CPU time beside.
    for label, assumptions in (
        ("roofline + NCCL latency (default)", None),
        (
            "flat model (compute_efficiency 0.5, bandwidth only)",
            PlanAssumptions(compute_efficiency=0.5, nccl_latency=False),
        ),
    ):
        runs = []
        for _ in range(2):
            t0, c0 = time.perf_counter(), time.process_time()
            result = search_layouts(request, assumptions=assumptions)
            runs.append((time.perf_counter() - t0, time.process_time() - c0))
        wall, cpu = min(runs)
        print(
            f"layout search, llama3-405b on 16,384 H100, {label}: {wall:.2f} s ({cpu:.2f} s CPU) for "
            f"{result.evaluated:,} planned layouts, {len(result.candidates):,} fit (target < 10 s)"
        )


if __name__ == "__main__":
    main()

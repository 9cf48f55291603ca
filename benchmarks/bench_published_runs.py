"""The planner against published measured training runs: ours vs published TFLOP/s per GPU, new model and flat model.

Each run of ``tests/data/published_runs/runs.yaml`` is planned exactly as it was configured (the manifest beside it);
TFLOP/s per GPU are in the source's own FLOPs convention (Korthikanti et al. 2022: App. A model FLOPs, full ``s^2``
attention; Llama 3: causal attention, the count under which Table 4's three rows agree). Prints the table of
docs/planner.md ("Checks against published runs"). Run: ``.venv/bin/python benchmarks/bench_published_runs.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from meshscope.plan import PlanAssumptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from published_runs import (  # tests/ is put on the path above
    RUNS,
    ceiling_groups,
    least_largest_error_ceiling,
    leave_one_out_errors,
    tflops_per_gpu,
)

FLAT = PlanAssumptions(compute_efficiency=0.5, nccl_latency=False)


def main() -> None:
    print("| run | published TFLOP/s/GPU | ours | error | flat model | flat error |")
    print("|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {"new": [], "flat": [], "new, held out": []}
    for run in RUNS:
        ours, published = tflops_per_gpu(run)
        flat, _ = tflops_per_gpu(run, FLAT)
        errors["new"].append(ours / published - 1)
        errors["flat"].append(flat / published - 1)
        if "sets_ceiling" not in run:  # the rows a GPU's ceiling was fitted to are no check of it
            errors["new, held out"].append(ours / published - 1)
        print(
            f"| {run['name']} | {published:.1f} | {ours:.1f} | {100 * (ours / published - 1):+.1f} % | {flat:.1f} | "
            f"{100 * (flat / published - 1):+.1f} % |"
        )
    for name, errs in errors.items():
        mean = sum(abs(e) for e in errs) / len(errs)
        print(
            f"{name}: mean |error| {100 * mean:.1f} %, max |error| {100 * max(abs(e) for e in errs):.1f} % "
            f"({len(errs)} rows)"
        )
    print("\nceilings fitted to published runs (least largest |error| over them); each run's error at the ceiling")
    print("fitted without it (leave-one-out):")
    for tag, runs in ceiling_groups().items():
        fitted = least_largest_error_ceiling(runs, tag)
        out = leave_one_out_errors(runs, tag)
        shown = ", ".join(f"{100 * e:+.1f} %" for e in out) if out else "none: the only run"
        print(f"  {tag}: {fitted:.3f} over {len(runs)} run(s); leave-one-out {shown}")


if __name__ == "__main__":
    main()

"""The planner against published measured training runs: ours vs published TFLOP/s per GPU, new model and flat model.

Each run of ``tests/data/published_runs/runs.yaml`` is planned exactly as it was configured (the manifest beside it);
TFLOP/s per GPU are in the source's own FLOPs convention (Korthikanti et al. 2022: App. A model FLOPs, full ``s^2``
attention; Llama 3: causal attention, the count under which Table 4's three rows agree). Prints the table of
docs/planner.md ("Checks against published runs"). Run: ``.venv/bin/python benchmarks/bench_published_runs.py``.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from meshscope.jobs import spec_from_manifest
from meshscope.plan import PlanAssumptions, assumptions_from_mapping, flops_in_convention, plan_job

RUNS = Path(__file__).resolve().parents[1] / "tests" / "data" / "published_runs" / "runs.yaml"
FLAT = PlanAssumptions(compute_efficiency=0.5, nccl_latency=False)


def tflops(run: dict, assumptions: PlanAssumptions | None) -> tuple[float, float]:
    """``(ours, published)`` TFLOP/s per GPU of ``run``, with the run's own ``assumptions`` (the software it ran)."""
    assumptions = assumptions_from_mapping(run.get("assumptions", {}), base=assumptions, origin=run["name"])
    spec = spec_from_manifest(run["manifest"])
    plan = plan_job(spec, assumptions=assumptions)
    tokens = spec.training.global_batch_size * spec.model.seq_length
    flops = flops_in_convention(plan.flops, run["flops_convention"], params=plan.total_params, tokens=tokens)
    ours = flops / (plan.expected_step_time.total_seconds * plan.world_size) / 1e12
    if "published_iteration_seconds" in run:
        return ours, flops / (run["published_iteration_seconds"] * plan.world_size) / 1e12
    return ours, float(run["published_tflops_per_gpu"])


def main() -> None:
    runs = yaml.safe_load(RUNS.read_text(encoding="utf-8"))["runs"]
    print("| run | published TFLOP/s/GPU | ours | error | flat model | flat error |")
    print("|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {"new": [], "flat": [], "new, held out": []}
    for run in runs:
        ours, published = tflops(run, None)
        flat, _ = tflops(run, FLAT)
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


if __name__ == "__main__":
    main()

"""Published measured training runs (tests/data/published_runs), planned as configured: one definition of each figure.

Shared by ``tests/core/test_plan_published.py`` and ``benchmarks/bench_published_runs.py``.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from meshscope.jobs.loading import spec_from_manifest
from meshscope.plan import PlanAssumptions, assumptions_from_mapping, flops_in_convention, plan_job

RUNS: list[dict] = yaml.safe_load(
    (Path(__file__).resolve().parent / "data" / "published_runs" / "runs.yaml").read_text(encoding="utf-8")
)["runs"]


def tflops_per_gpu(run: dict, assumptions: PlanAssumptions | None = None) -> tuple[float, float]:
    """``(ours, published)`` TFLOP/s per GPU of ``run`` in its source's FLOPs convention.

    The run's own ``assumptions`` (the software it ran: runs.yaml) apply over ``assumptions``.
    """
    assumptions = assumptions_from_mapping(run.get("assumptions", {}), base=assumptions, origin=run["name"])
    spec = spec_from_manifest(run["manifest"])
    plan = plan_job(spec, assumptions=assumptions)
    tokens = spec.training.global_batch_size * spec.model.seq_length
    flops = flops_in_convention(plan.flops, run["flops_convention"], params=plan.total_params, tokens=tokens)
    ours = flops / (plan.expected_step_time.total_seconds * plan.world_size)
    if "published_tokens_per_second_per_gpu" in run:  # a step's tokens at that rate on every GPU
        published = flops / (tokens / run["published_tokens_per_second_per_gpu"])
    elif "published_iteration_seconds" in run:
        published = flops / (run["published_iteration_seconds"] * plan.world_size)
    else:
        published = run["published_tflops_per_gpu"] * 1e12
    return ours / 1e12, published / 1e12


def error(run: dict, assumptions: PlanAssumptions | None = None) -> float:
    """``ours / published - 1`` in TFLOP/s per GPU (the same as published step time / ours - 1)."""
    ours, published = tflops_per_gpu(run, assumptions)
    return ours / published - 1


def least_largest_error_ceiling(runs: list[dict]) -> float:
    """The GEMM ceiling under which the largest |error| over ``runs`` is least (the exact fit of one run).

    Every run's error grows with the ceiling (a faster GEMM, a shorter step), so the least largest |error| is where
    the most positive and the most negative error are equal and opposite: bisected on their sum.
    """
    low, high = 0.3, 0.95
    for _ in range(20):
        middle = (low + high) / 2
        errors = [error(r, PlanAssumptions(gemm_efficiency=middle)) for r in runs]
        low, high = (middle, high) if max(errors) + min(errors) < 0 else (low, middle)
    return low


def ceiling_groups() -> dict[str, list[dict]]:
    """The runs each catalogue ceiling is fitted to, by ``sets_ceiling`` tag (``"<GPU> <precision>"``)."""
    groups: dict[str, list[dict]] = {}
    for run in RUNS:
        if "sets_ceiling" in run:
            groups.setdefault(run["sets_ceiling"], []).append(run)
    return groups


def leave_one_out_errors(runs: list[dict]) -> list[float]:
    """Each run's error at the ceiling fitted to the others (none where it is the only one)."""
    return [
        error(r, PlanAssumptions(gemm_efficiency=least_largest_error_ceiling(runs[:i] + runs[i + 1 :])))
        for i, r in enumerate(runs)
        if len(runs) > 1
    ]

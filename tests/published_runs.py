"""Published measured training runs (tests/data/published_runs), planned as configured: one definition of each figure.

Shared by ``tests/core/test_plan_published.py`` and ``benchmarks/bench_published_runs.py``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from meshscope.jobs.loading import spec_from_manifest
from meshscope.plan import PlanAssumptions, assumptions_from_mapping, flops_in_convention, plan_job
from meshscope.topology.hardware import CATALOGUE

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


_ORIGINAL = dict(CATALOGUE)
"""The catalogue as the code has it: what every fit starts from and puts back."""


def _catalogue_with(tag: str, value: float) -> None:
    """Put ``value`` in the catalogue as the ceiling ``tag`` (``"<GPU> <precision>"``), nothing else changed."""
    gpu, precision = tag.split()
    field = "fp8_matmul_achievable_fraction" if precision == "fp8" else "matmul_achievable_fraction"
    CATALOGUE[gpu] = replace(_ORIGINAL[gpu], **{field: value})


def least_largest_error_ceiling(runs: list[dict], tag: str) -> float:
    """The catalogue ceiling ``tag`` under which the largest |error| over ``runs`` is least (one run: its exact fit).

    Every run's error grows with the ceiling (a faster GEMM, a shorter step), so the least largest |error| is where
    the most positive and the most negative error are equal and opposite: bisected on their sum. Only that ceiling
    moves while it runs (an FP8 run's output layer keeps the BF16 one), and the catalogue is restored after.
    """
    low, high = 0.3, 0.95
    try:
        for _ in range(20):
            middle = (low + high) / 2
            _catalogue_with(tag, middle)
            errors = [error(r) for r in runs]
            low, high = (middle, high) if max(errors) + min(errors) < 0 else (low, middle)
    finally:
        CATALOGUE.update(_ORIGINAL)
    return low


def ceiling_groups() -> dict[str, list[dict]]:
    """The runs each catalogue ceiling is fitted to, by ``sets_ceiling`` tag (``"<GPU> <precision>"``)."""
    groups: dict[str, list[dict]] = {}
    for run in RUNS:
        if "sets_ceiling" in run:
            groups.setdefault(run["sets_ceiling"], []).append(run)
    return groups


def leave_one_out_errors(runs: list[dict], tag: str) -> list[float]:
    """Each run's error at the ceiling ``tag`` fitted to the others (none where it is the only one)."""
    out = []
    try:
        for i, run in enumerate(runs if len(runs) > 1 else []):
            _catalogue_with(tag, least_largest_error_ceiling(runs[:i] + runs[i + 1 :], tag))
            out.append(error(run))
    finally:
        CATALOGUE.update(_ORIGINAL)
    return out

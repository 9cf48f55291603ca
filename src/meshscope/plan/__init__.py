"""The planner: what a training job will hold, send, compute and cost per step, before it runs.

``plan_job(spec)`` returns a :class:`Plan`: per pipeline stage the parameters and peak memory of one GPU (weights,
gradients, optimizer state, activations) against HBM; per axis every collective with its message, count, bytes per
GPU, link, FLOPs per byte against the link's budget and expected seconds; FLOPs per step; the pipeline bubble; an
expected step time split into compute, exposed communication per axis, bubble and optimizer; and findings with
numbers. Every formula, its source and every convention are in ``docs/planner.md``; every efficiency it assumes is a
named field of :class:`PlanAssumptions`.

The planner is pure: no I/O, no GPU, no Kubernetes. It works per stage and on vectorised group spans, so planning a
16,384-GPU job takes milliseconds.
"""

from __future__ import annotations

from meshscope.plan.assumptions import PlanAssumptions
from meshscope.plan.comms import CollectiveOp, CollectivePlan
from meshscope.plan.findings import Finding, Severity
from meshscope.plan.flops import ForwardFlops, StepFlops, step_flops
from meshscope.plan.memory import ActivationBreakdown, MemoryBreakdown, StageParams
from meshscope.plan.planning import Plan, StagePlan, plan_job
from meshscope.plan.timing import ExpectedStepTime, bubble_fraction

__all__ = [
    "ActivationBreakdown",
    "CollectiveOp",
    "CollectivePlan",
    "ExpectedStepTime",
    "Finding",
    "ForwardFlops",
    "MemoryBreakdown",
    "Plan",
    "PlanAssumptions",
    "Severity",
    "StageParams",
    "StagePlan",
    "StepFlops",
    "bubble_fraction",
    "plan_job",
    "step_flops",
]

"""The planner: what a training job will hold, send, compute and cost per step, before it runs.

``plan_job(spec)`` returns a :class:`Plan`: per pipeline stage the parameters and peak memory of one GPU (weights,
gradients, optimizer state, activations) against HBM; per axis every collective with its message, count, bytes per
GPU, link, FLOPs per byte against the link's budget and expected seconds; FLOPs per step; the pipeline bubble; an
expected step time split into compute, exposed communication per axis, bubble and optimizer; and findings with
numbers. Every formula, its source and every convention are in ``docs/planner.md``; every efficiency it assumes is a
named field of :class:`PlanAssumptions`.

The planner is pure: no I/O, no GPU, no Kubernetes, no records. It works per stage and on vectorised group spans,
so planning a 16,384-GPU job takes milliseconds. :func:`search_layouts` enumerates every valid layout of a model on
N GPUs and ranks them by the same planner (``meshscope plan --search``).

- :mod:`~meshscope.plan.assumptions`: :class:`PlanAssumptions`, every efficiency the planner assumes, and
  :func:`assumptions_from_mapping` (a parsed YAML file or ``spec.assumptions``);
- :mod:`~meshscope.plan.kernels`: compute per operation class (GEMM roofline with tile and wave quantization);
- :mod:`~meshscope.plan.nccl`: seconds of one collective, NCCL's latency + bandwidth model;
- :mod:`~meshscope.plan.flops`, :mod:`~meshscope.plan.memory`, :mod:`~meshscope.plan.comms`,
  :mod:`~meshscope.plan.timing`: FLOPs, memory per stage, collectives per axis, expected times;
- :mod:`~meshscope.plan.findings`: :class:`Finding` with :class:`Severity` (the operator's admission warnings);
- :mod:`~meshscope.plan.planning`: :func:`plan_job` -> :class:`Plan` of :class:`StagePlan`;
- :mod:`~meshscope.plan.search`: :class:`SearchRequest` -> :func:`search_layouts` -> :class:`SearchResult`.

It must not read files or records and must not analyse measurements. Import the names from here
(``from meshscope.plan import plan_job``).
"""

from __future__ import annotations

from meshscope.plan.assumptions import (
    SYNC_WAIT_AXIS_FIELDS,
    NcclProtocolCosts,
    PlanAssumptions,
    assumptions_from_mapping,
)
from meshscope.plan.comms import CollectiveOp, CollectivePlan
from meshscope.plan.findings import Finding, Severity
from meshscope.plan.flops import (
    FLOPS_CONVENTIONS,
    ForwardFlops,
    StepFlops,
    flops_in_convention,
    layer_forward_flops,
    logits_forward_flops,
    step_flops,
)
from meshscope.plan.memory import ActivationBreakdown, MemoryBreakdown, StageParams
from meshscope.plan.planning import Plan, StagePlan, plan_job
from meshscope.plan.rendering import render_plan, render_plan_report
from meshscope.plan.search import Candidate, SearchRequest, SearchResult, search_layouts
from meshscope.plan.timing import (
    ExpectedStepTime,
    StageCompute,
    bubble_fraction,
    contended,
    cpu_contention,
    cpu_stage_contention,
    host_tokens_scale,
    host_tp_scale,
    micro_batch_tokens_per_rank,
    stage_compute,
)

__all__ = [
    "FLOPS_CONVENTIONS",
    "SYNC_WAIT_AXIS_FIELDS",
    "ActivationBreakdown",
    "Candidate",
    "CollectiveOp",
    "CollectivePlan",
    "ExpectedStepTime",
    "Finding",
    "ForwardFlops",
    "MemoryBreakdown",
    "NcclProtocolCosts",
    "Plan",
    "PlanAssumptions",
    "SearchRequest",
    "SearchResult",
    "Severity",
    "StageCompute",
    "StageParams",
    "StagePlan",
    "StepFlops",
    "assumptions_from_mapping",
    "bubble_fraction",
    "contended",
    "cpu_contention",
    "cpu_stage_contention",
    "flops_in_convention",
    "host_tokens_scale",
    "host_tp_scale",
    "layer_forward_flops",
    "logits_forward_flops",
    "micro_batch_tokens_per_rank",
    "plan_job",
    "render_plan",
    "render_plan_report",
    "search_layouts",
    "stage_compute",
    "step_flops",
]

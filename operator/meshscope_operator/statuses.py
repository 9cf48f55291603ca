"""Pure: what reconcile writes into ``TrainingJob.status`` — the plan summary, the phase and the conditions.

Exists so that every status field the operator writes is built in one place, from the core's :class:`~meshscope.plan.
Plan`, and holds only what the CRD declares (the API server prunes anything else silently): ``phase``,
``observedGeneration``, ``conditions`` (``metav1.Condition``), ``worldSize``, ``layout``, ``plan.*``, ``findings``
and ``findingsList``, each bounded as the CRD bounds it (at most 16 conditions, 20 findings, messages of at most
1,024 characters), so a status is a few kilobytes at any job size.

Conditions follow ``metav1.Condition``: ``lastTransitionTime`` changes only when a condition's ``status`` changes,
so re-running reconcile on the same spec writes the same status (idempotent).

It must not import kopf and must do no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from meshscope.topology import AXES

if TYPE_CHECKING:
    from meshscope.jobs import JobSpec
    from meshscope.plan import Finding, Plan
    from meshscope.topology import ParallelLayout

MAX_FINDINGS_LISTED = 20
"""``status.findingsList`` holds at most this many (the CRD's ``maxItems``)."""
MAX_FINDING_MESSAGE_CHARS = 1024
"""Longest ``findingsList[].message`` (the CRD's ``maxLength``)."""
MAX_FINDING_CODE_CHARS = 64
MAX_CONDITIONS = 16
MAX_CONDITION_MESSAGE_CHARS = 32768
"""Longest ``conditions[].message`` (``metav1.Condition``: 32,768)."""
ELLIPSIS = "…"


class Phase(StrEnum):
    """``status.phase``: planned (no Job yet), then as its Job runs (:mod:`~meshscope_operator.runs`), or invalid."""

    PLANNED = "Planned"
    """The spec is planned and its Job is not made (yet): a name taken, an API error."""
    PENDING = "Pending"
    """The Job exists and not every one of its pods is ready (not started, scheduling, pulling, suspended)."""
    RUNNING = "Running"
    """Every pod of the Job is ready."""
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    INVALID = "Invalid"


class ConditionType(StrEnum):
    """The conditions reconcile owns."""

    PLANNED = "Planned"
    """True: the spec loads and is planned; False (reason ``InvalidSpec``): the loader's or planner's message."""
    READY = "Ready"
    """True: the Job and the headless Service exist and are this TrainingJob's."""
    RESTART_REQUIRED = "RestartRequired"
    """True: the Job runs an older spec (a Job's pod template cannot be changed); delete the Job to restart."""
    RUNNING = "Running"
    """True: every pod of the Job is ready; False: why not (the counts), or how the run ended."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Condition:
    """One ``metav1.Condition`` without its time (added by :func:`merge_conditions`)."""

    type: ConditionType
    status: bool
    reason: str
    """CamelCase, as ``metav1.Condition`` requires."""
    message: str


def cut(text: str, limit: int) -> str:
    """``text`` at most ``limit`` characters, with an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - len(ELLIPSIS)] + ELLIPSIS


def short_layout(layout: ParallelLayout) -> str:
    """``status.layout``: the axes of degree above 1, ``dp16-tp8-pp4`` (``dp1`` for a single GPU)."""
    parts = [f"{a.value}{layout.degree(a)}" for a in AXES if layout.degree(a) > 1]
    return "-".join(parts) or "dp1"


def findings_list(findings: Sequence[Finding]) -> list[dict[str, str]]:
    """``status.findingsList``: the first :data:`MAX_FINDINGS_LISTED` findings (most severe first), bounded."""
    return [
        {
            "code": cut(f.code, MAX_FINDING_CODE_CHARS),
            "severity": f.severity.value,
            "message": cut(f.message, MAX_FINDING_MESSAGE_CHARS),
        }
        for f in findings[:MAX_FINDINGS_LISTED]
    ]


def plan_summary(plan: Plan) -> dict[str, object]:
    """``status.plan``: the most loaded pipeline stage's peak memory and headroom, the step, the bubble, the FLOPs."""
    loaded = max(plan.stages, key=lambda s: (s.memory.total_bytes, -s.pp_rank))
    return {
        "peakMemoryBytesPerGpu": int(loaded.memory.total_bytes),
        "headroomBytes": int(loaded.headroom_bytes),
        "expectedStepSeconds": float(plan.expected_step_time.total_seconds),
        "bubbleFraction": min(max(float(plan.bubble_fraction), 0.0), 1.0),
        "flopsPerStep": float(plan.flops_per_step),
    }


def planned_fields(spec: JobSpec, plan: Plan) -> dict[str, object]:
    """The status fields of a planned spec, without phase and conditions."""
    return {
        "worldSize": spec.world_size,
        "layout": short_layout(spec.layout),
        "plan": plan_summary(plan),
        "findings": len(plan.findings),
        "findingsList": findings_list(plan.findings),
    }


def planned_message(spec: JobSpec, plan: Plan) -> str:
    """The ``Planned`` condition's message: layout, GPUs, step time and memory, with units."""
    summary = plan_summary(plan)
    peak_gib = float(summary["peakMemoryBytesPerGpu"]) / 2**30  # type: ignore[arg-type]
    hbm_gib = spec.hardware.usable_hbm_bytes / 2**30
    return (
        f"{short_layout(spec.layout)} on {spec.world_size:,} GPUs ({spec.hardware.nodes:,} nodes): expected "
        f"{plan.expected_step_time.total_seconds:.3f} s per step, peak {peak_gib:.1f} GiB of {hbm_gib:.1f} GiB "
        f"usable per GPU, {len(plan.findings)} findings"
    )


def merge_conditions(
    previous: object, updates: Sequence[Condition], *, generation: int | None, now: str
) -> list[dict[str, object]]:
    """``status.conditions`` after ``updates``: others kept, ``lastTransitionTime`` kept unless the status flips.

    Args:
        previous: the object's ``status.conditions`` as stored (anything: a bad value is dropped).
        updates: the conditions to set.
        generation: ``metadata.generation`` these conditions describe (``None``: not written).
        now: RFC 3339 time of this update.
    """
    kept: dict[str, dict[str, object]] = {}
    if isinstance(previous, Sequence) and not isinstance(previous, str):
        for c in previous:
            if isinstance(c, Mapping) and isinstance(c.get("type"), str):
                kept[str(c["type"])] = dict(c)
    for u in updates:
        status = "True" if u.status else "False"
        old = kept.get(u.type.value)
        since = old.get("lastTransitionTime") if old and old.get("status") == status else None
        entry: dict[str, object] = {
            "type": u.type.value,
            "status": status,
            "reason": u.reason,
            "message": cut(u.message, MAX_CONDITION_MESSAGE_CHARS),
            "lastTransitionTime": since if isinstance(since, str) else now,
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        kept[u.type.value] = entry
    return list(kept.values())[:MAX_CONDITIONS]


def status_patch(
    body: Mapping[str, object],
    *,
    phase: Phase,
    fields: Mapping[str, object],
    conditions: Sequence[Condition],
    now: str,
) -> dict[str, object]:
    """The whole ``status`` reconcile writes: ``phase``, ``observedGeneration``, ``conditions`` and ``fields``.

    Args:
        body: the TrainingJob as stored (its generation and present conditions are read).
        phase: the phase.
        fields: planned fields (:func:`planned_fields`), or ``{}`` for an invalid spec.
        conditions: the conditions to set.
        now: RFC 3339 time of this update.
    """
    generation = generation_of(body)
    status = body.get("status")
    previous = status.get("conditions") if isinstance(status, Mapping) else None
    patch: dict[str, object] = {
        "phase": phase.value,
        "conditions": merge_conditions(previous, conditions, generation=generation, now=now),
        **fields,
    }
    if generation is not None:
        patch["observedGeneration"] = generation
    return patch


def generation_of(body: Mapping[str, object]) -> int | None:
    """``metadata.generation``, or ``None`` when the server sent none."""
    meta = body.get("metadata")
    generation = meta.get("generation") if isinstance(meta, Mapping) else None
    return generation if isinstance(generation, int) and not isinstance(generation, bool) and generation >= 0 else None

"""Pure: a TrainingJob's run as its Job reports it — ``status.phase`` and the ``Running`` condition.

Exists so that the one mapping from a ``batch/v1`` Job's status to the TrainingJob's phase is written once, used by
reconcile (which reads the Job back on every spec change and operator start) and by the handler that follows the
Job's events, so both write the same phase for the same Job.

The Job's status (kubernetes.io/docs/concepts/workloads/controllers/job/, "Job termination and cleanup" and "Pod
backoff failure policy"; the API reference's ``JobStatus``): ``active``, ``ready`` (active pods with a Ready
condition; reported from Kubernetes 1.24, GA in 1.29), ``succeeded``, ``failed``, ``terminating`` (1.28+),
``startTime``, ``completionTime``, and ``conditions`` of the types ``Suspended``, ``FailureTarget``, ``Failed``,
``SuccessCriteriaMet`` and ``Complete``. Since 1.31 the controller sets ``FailureTarget`` / ``SuccessCriteriaMet``
first and ``Failed`` / ``Complete`` only once every pod has terminated; the outcome is known at the first of the two,
so either makes the phase terminal.

=================================================  ===========  =======================================
the Job                                            ``phase``    ``Running`` condition (status, reason)
=================================================  ===========  =======================================
``Complete`` or ``SuccessCriteriaMet`` True        Succeeded    False, ``Succeeded``
``Failed`` or ``FailureTarget`` True               Failed       False, ``Failed``
``Suspended`` True, or ``spec.suspend``            Pending      False, ``Suspended``
no ``startTime`` and no active pod                 Pending      False, ``NotStarted``
every one of the job's pods ready                  Running      True, ``AllPodsReady``
otherwise                                          Pending      False, ``PodsNotReady``
=================================================  ===========  =======================================

Every pod must be ready for ``Running``: the ranks of a training job rendezvous, so a job with one pod missing does
not train. The messages carry the counts ("12 of 16 pods ready, 14 active, 2 failed so far") and, once finished,
the time from ``startTime`` to ``completionTime`` in seconds.

It must not import kopf and must do no I/O; any value of a stored Job (a field missing, of a wrong type) gives a
phase, never an exception.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshscope_operator.statuses import Condition, ConditionType, Phase, cut

MAX_JOB_MESSAGE_CHARS = 512
"""The Job condition's own message is quoted cut to this many characters."""
FINISHED_REASONS = frozenset({"Succeeded", "Failed"})
"""``Running`` reasons of a run that is over."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    """Where a TrainingJob's run stands."""

    phase: Phase
    running: Condition
    """The ``Running`` condition."""

    @property
    def finished(self) -> bool:
        """Whether the run is over (succeeded or failed)."""
        return self.phase in (Phase.SUCCEEDED, Phase.FAILED)


def _count(status: Mapping[str, object], key: str) -> int:
    value = status.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _true_conditions(status: Mapping[str, object]) -> dict[str, Mapping[str, object]]:
    conditions = status.get("conditions")
    if not isinstance(conditions, Sequence) or isinstance(conditions, str):
        return {}
    return {
        str(c["type"]): c
        for c in conditions
        if isinstance(c, Mapping) and isinstance(c.get("type"), str) and c.get("status") == "True"
    }


def _time(value: object) -> dt.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=dt.UTC)


def _ran(status: Mapping[str, object]) -> str:
    start, end = _time(status.get("startTime")), _time(status.get("completionTime"))
    if start is None or end is None or end < start:
        return ""
    return f", {(end - start).total_seconds():,.0f} s from start to completion"


def _quoted(condition: Mapping[str, object]) -> str:
    reason = condition.get("reason")
    message = condition.get("message")
    parts = [str(p) for p in (reason, message) if isinstance(p, str) and p]
    return f" ({cut(': '.join(parts), MAX_JOB_MESSAGE_CHARS)})" if parts else ""


def job_progress(job: Mapping[str, object], nodes: int) -> Progress:
    """The phase and ``Running`` condition of a TrainingJob whose Job (one pod per node, ``nodes`` pods) is ``job``.

    Args:
        job: the Job as stored (a manifest without ``status`` is a Job the controller has not seen yet).
        nodes: the pods the Job runs (``spec.hardware.nodes``).
    """
    meta = job.get("metadata")
    name = str(meta.get("name", "")) if isinstance(meta, Mapping) else ""
    raw_status = job.get("status")
    status: Mapping[str, object] = raw_status if isinstance(raw_status, Mapping) else {}
    spec = job.get("spec")
    suspended_spec = isinstance(spec, Mapping) and spec.get("suspend") is True
    true = _true_conditions(status)
    active, succeeded, failed = _count(status, "active"), _count(status, "succeeded"), _count(status, "failed")
    terminating = _count(status, "terminating")

    def progress(phase: Phase, *, running: bool, reason: str, message: str) -> Progress:
        condition = Condition(type=ConditionType.RUNNING, status=running, reason=reason, message=message)
        return Progress(phase=phase, running=condition)

    done = true.get("Complete") or true.get("SuccessCriteriaMet")
    if done is not None:
        return progress(
            Phase.SUCCEEDED,
            running=False,
            reason="Succeeded",
            message=f"Job {name} succeeded: {succeeded} of {nodes} pods completed{_ran(status)}",
        )
    fell = true.get("Failed") or true.get("FailureTarget")
    if fell is not None:
        return progress(
            Phase.FAILED,
            running=False,
            reason="Failed",
            message=f"Job {name} failed{_quoted(fell)}: {failed} pods failed, {succeeded} of {nodes} completed",
        )
    if "Suspended" in true or suspended_spec:
        return progress(
            Phase.PENDING,
            running=False,
            reason="Suspended",
            message=f"Job {name} is suspended (spec.suspend): {active} of {nodes} pods active",
        )
    if status.get("startTime") is None and active == 0:
        return progress(
            Phase.PENDING,
            running=False,
            reason="NotStarted",
            message=f"Job {name} has no pods yet: the Job controller has not started its {nodes} pods",
        )
    ready_value = status.get("ready")
    reported = isinstance(ready_value, int) and not isinstance(ready_value, bool)
    # A cluster older than 1.24 reports no ready count: active pods are the nearest it says.
    ready = _count(status, "ready") if reported else active
    what = "ready" if reported else "active (this cluster reports no ready count)"
    extra = [f"{active} active"] if reported else []
    extra += [f"{failed} failed so far"] if failed else []
    extra += [f"{terminating} terminating"] if terminating else []
    counts = f"{ready} of {nodes} pods {what}" + (f", {', '.join(extra)}" if extra else "")
    if ready >= nodes:
        return progress(Phase.RUNNING, running=True, reason="AllPodsReady", message=counts)
    return progress(Phase.PENDING, running=False, reason="PodsNotReady", message=counts)


def stored_condition(body: Mapping[str, object], kind: ConditionType) -> Mapping[str, object] | None:
    """The TrainingJob's stored condition ``kind``, if it has one."""
    status = body.get("status")
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    if not isinstance(conditions, Sequence) or isinstance(conditions, str):
        return None
    for c in conditions:
        if isinstance(c, Mapping) and c.get("type") == kind.value:
            return c
    return None


def finished_run(body: Mapping[str, object], generation: int | None) -> Progress | None:
    """The finished run of this spec, when the TrainingJob's status records one; ``None`` otherwise.

    A run is finished for this spec when the ``Running`` condition's reason is ``Succeeded`` or ``Failed``, it was
    written at ``generation`` (the spec as it is now), and ``RestartRequired`` is not True (the finished Job was not of
    an earlier spec). Such a Job is not made again when it is deleted (a TTL, or by hand): that would run the training
    a second time.
    """
    running = stored_condition(body, ConditionType.RUNNING)
    if running is None or running.get("reason") not in FINISHED_REASONS or running.get("status") != "False":
        return None
    if generation is None or running.get("observedGeneration") != generation:
        return None
    restart = stored_condition(body, ConditionType.RESTART_REQUIRED)
    if restart is not None and restart.get("status") == "True":
        return None
    reason = str(running["reason"])
    condition = Condition(
        type=ConditionType.RUNNING, status=False, reason=reason, message=str(running.get("message", ""))
    )
    return Progress(phase=Phase.SUCCEEDED if reason == "Succeeded" else Phase.FAILED, running=condition)

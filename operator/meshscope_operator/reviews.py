"""The validating webhook's verdict on a TrainingJob: denied with the numbers, or admitted with the planner's findings.

Exists so that ``kubectl apply -f job.yaml`` and ``meshscope plan job.yaml`` say the same thing: a spec the loader or
the planner refuses is denied with exactly the message ``meshscope plan`` prints (the field, the value, what would
fit), and an admitted spec carries the planner's findings as admission warnings, which kubectl prints as
``Warning: ...``. The warnings are bounded so that the API server passes every one of them on whole (see
:func:`admission_warnings`).

It must not import kopf (the handler in :mod:`~meshscope_operator.admission` turns a :class:`Review` into kopf's
``warnings`` and ``AdmissionError``), must do no I/O, and must not swallow errors it does not understand: an
unexpected exception propagates, and kopf denies the request (the TrainingJob webhook fails closed).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshscope.errors import MeshscopeError
from meshscope.plan import Severity, plan_job
from meshscope_operator.spec import job_spec, spec_changed

if TYPE_CHECKING:
    from meshscope.plan import Finding

DENIAL_CODE = 422
"""HTTP status of a denial: 422 Unprocessable Entity, what the API server answers for an invalid object
(``metav1.StatusReasonInvalid``)."""
MAX_WARNING_CHARS = 256
"""Longest warning the API server is sure to pass on uncut (k8s.io/apiserver ``pkg/endpoints/filters/warning.go``,
``truncateItemRunes = 256``; admission/v1 ``AdmissionResponse.warnings``: "Warnings over 256 characters ... may be
truncated"). Python counts code points, as Go counts runes."""
MAX_DENIAL_CHARS = 4096
"""Longest denial message sent back; the loader's messages are far shorter, a hostile value is cut."""
ELLIPSIS = "…"


@dataclass(frozen=True, slots=True, kw_only=True)
class Review:
    """What the validating webhook answers."""

    allowed: bool
    """Whether the request is admitted."""
    message: str = ""
    """Why not (empty when admitted): the loader's or planner's message, as ``meshscope plan`` prints it."""
    code: int = 200
    """HTTP status of the verdict: 200, or :data:`DENIAL_CODE`."""
    warnings: tuple[str, ...] = ()
    """Admission warnings, at most ``max_warnings + 1``, each at most :data:`MAX_WARNING_CHARS` characters."""


def review_training_job(
    new: Mapping[str, object],
    old: Mapping[str, object] | None = None,
    *,
    max_warnings: int,
    max_planned_gpus: int,
) -> Review:
    """Check a TrainingJob that is being created or updated.

    An update that leaves ``spec`` as it was (labels, annotations, finalizers, kopf's own bookkeeping) and an object
    being deleted are admitted without a look: the spec was checked when it was written, and refusing such updates
    could keep an object that predates the webhook from ever being cleaned up.

    Args:
        new: the object as it will be stored (the admission request's ``object``).
        old: the stored object before an update (``oldObject``); ``None`` for a create.
        max_warnings: findings returned as warnings, at most (the rest are summed up in one more line).
        max_planned_gpus: a job of more GPUs is loaded (its layout arithmetic checked) but not planned, and admitted
            with a warning saying so: planning takes time and memory in proportion to the GPUs (about 0.1 s and
            15 MiB at 262,144 GPUs, 3.5 s and 400 MiB at 8 million), and the API server waits at most 10 s by
            default for a webhook (admissionregistration/v1 ``timeoutSeconds``).

    Returns:
        Denied with the message of the :class:`~meshscope.errors.MeshscopeError` that ``meshscope plan`` would print
        for the same manifest, or admitted with the planner's findings as warnings.
    """
    metadata = new.get("metadata")
    if isinstance(metadata, Mapping) and metadata.get("deletionTimestamp"):
        return Review(allowed=True)
    if not spec_changed(new, old):
        return Review(allowed=True)
    try:
        spec = job_spec(new)
        if spec.world_size > max_planned_gpus:
            return Review(allowed=True, warnings=(not_planned_warning(spec.world_size, max_planned_gpus),))
        plan = plan_job(spec)
    except MeshscopeError as exc:  # SpecError from the loader, PlanError / LayoutError from the planner
        return Review(allowed=False, message=_cut(str(exc), MAX_DENIAL_CHARS), code=DENIAL_CODE)
    return Review(allowed=True, warnings=admission_warnings(plan.findings, limit=max_warnings))


def not_planned_warning(world_size: int, max_planned_gpus: int) -> str:
    """The warning of a job too large for this operator to plan on admission."""
    return (
        f"meshscope: not planned on admission: {world_size:,} GPUs is above this operator's bound of "
        f"{max_planned_gpus:,} (MESHSCOPE_OPERATOR_MAX_PLANNED_GPUS); the spec loads and its layout arithmetic "
        "holds; `meshscope plan` on this manifest plans it"
    )


def admission_warnings(findings: Sequence[Finding], *, limit: int) -> tuple[str, ...]:
    """The planner's findings as admission warnings the API server passes on whole.

    Each warning is ``code: message`` (``code (error): message`` for an error), most severe first as the planner
    sorts them, with control characters replaced by spaces (the API server drops a warning that has any:
    k8s.io/apimachinery ``util/net/http.go`` ``NewWarningHeader``) and cut to :data:`MAX_WARNING_CHARS` characters.
    At most ``limit`` findings are shown; if any was left out or cut, one last line says so and points at
    ``meshscope plan``. With ``limit`` at most 15, the whole stays under the API server's 4,096-character budget.

    Args:
        findings: the plan's findings, most severe first.
        limit: findings shown, at most.

    Returns:
        The warnings, at most ``limit + 1``.
    """
    shown = findings[: max(limit, 0)]
    texts: list[str] = []
    cut = 0
    for f in shown:
        severity = " (error)" if f.severity is Severity.ERROR else ""
        full = warning_text(f"{f.code}{severity}: {f.message}")
        text = _cut(full, MAX_WARNING_CHARS)
        cut += text != full
        texts.append(text)
    left_out = len(findings) - len(shown)
    if left_out or cut:
        parts = [f"{left_out} more not shown"] if left_out else []
        parts += [f"{cut} cut short"] if cut else []
        texts.append(
            f"meshscope: {len(findings)} findings in all ({', '.join(parts)}); "
            "`meshscope plan` on this manifest prints every one in full"
        )
    return tuple(texts)


def bounded_warning(text: str) -> str:
    """``text`` as a warning the API server passes on whole: no control characters, at most 256 characters."""
    return _cut(warning_text(text), MAX_WARNING_CHARS)


def warning_text(text: str) -> str:
    """``text`` with every control character (Unicode category Cc: newlines, tabs, escapes) made a space."""
    return "".join(" " if unicodedata.category(c) == "Cc" else c for c in text)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - len(ELLIPSIS)] + ELLIPSIS

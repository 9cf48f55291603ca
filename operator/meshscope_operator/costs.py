"""The cost table's status summary and ConfigMap, built from an analysis or from the store's job-level series.

Exists so that both tiers of the cost table (docs/operator.md, "The cost table") write ``TrainingJob.status``
through one set of pure builders that hold the CRD's bounds (crds/trainingjobs.meshscope.io.yaml: at most 16
``costTable`` rows, 20 ``findingsList`` entries, each string within its ``maxLength``, every number within its
``minimum``/``maximum``), and the full table into a ConfigMap under its 1 MiB limit:

- :func:`status_from_analysis`: the deep tier's summary of ``Analysis.to_dict()`` (expected beside measured);
- :func:`status_from_reading`: the continuous tier's summary of a :class:`MetricsReading` (measured side only);
- :func:`configmap_for`: the ConfigMap that holds the whole ``Analysis.to_dict()`` JSON, owned by the TrainingJob;
- :func:`with_condition`: one ``metav1.Condition`` set in a list without losing the others.

It must not do I/O, import kopf, or copy per-rank data into status: a summary has the same size at 16 and at
131,072 ranks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from meshscope.formatting import human_seconds, percent

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

ANALYSIS_KEY = "analysis.json"
"""The ConfigMap's data key holding ``Analysis.to_dict()`` as JSON (docs/cost-table.md's shape); the kubectl plugin
reads it."""
CONFIGMAP_SUFFIX = "-meshscope-costs"
"""The ConfigMap of TrainingJob ``NAME`` is ``NAME-meshscope-costs`` (``status.costTableRef``)."""
CONFIGMAP_DATA_BUDGET_BYTES = 1_000_000
"""Most bytes of ``analysis.json``: the API server refuses a ConfigMap whose data exceeds 1 MiB (1,048,576 bytes,
k8s.io/kubernetes ``pkg/apis/core/validation`` ``MaxSecretSize``/ConfigMap ``totalSize``), and labels, annotations,
the owner reference and the JSON envelope need some of it."""
TRIMMED = "trimmed_for_configmap"
"""``partial_data`` code added when the JSON had to be cut to fit :data:`CONFIGMAP_DATA_BUDGET_BYTES`."""

MAX_ROWS = 16
"""``status.costTable`` maxItems."""
MAX_FINDINGS = 20
"""``status.findingsList`` maxItems."""
MAX_CATEGORY_CHARS = 64
MAX_SUSPECT_CHARS = 256
MAX_TOP_COST_CHARS = 128
MAX_CODE_CHARS = 64
MAX_FINDING_CHARS = 1024
MAX_CONDITION_MESSAGE_CHARS = 32768
MAX_REASON_CHARS = 1024
SEVERITIES = ("info", "warning", "error")

METRICS_AVAILABLE = "MetricsAvailable"
"""Condition of the continuous tier: ``True`` once the store answered every query of a job."""
COST_TABLE_AVAILABLE = "CostTableAvailable"
"""Condition of the deep tier: ``True`` once an analysis was written (``reason: PartialData`` when it lacked some
of the records)."""

CATEGORY_OF_SERIES: dict[tuple[str, str], str] = {
    ("compute", ""): "compute",
    ("bubble", ""): "bubble",
    ("data", ""): "data",
    ("optimizer", ""): "optimizer",
    ("checkpoint", ""): "checkpoint",
    ("other", ""): "other",
}
"""The recording rules' (``category``, ``axis``) -> the status row's category; ``exposed_comm`` of axis ``A`` is
``comm.A``: its transfer and sync wait together (the split needs every member's records: the deep tier's
``comm.A.transfer`` and ``comm.A.sync_wait``)."""
CATEGORY_ORDER: tuple[str, ...] = (
    "compute",
    *(f"comm.{a}" for a in ("dp", "tp", "pp", "cp", "ep")),
    "bubble",
    "data",
    "optimizer",
    "checkpoint",
    "other",
)
"""Order of the continuous tier's rows (the breakdown's, docs/cost-table.md)."""


def _cut(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters, with an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _seconds(value: object) -> float | None:
    """A non-negative finite number of seconds, or ``None`` (the CRD's ``minimum: 0``; NaN is not JSON)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return max(0.0, float(value))


def _ratio(value: object) -> float | None:
    """A finite ratio clamped to 0..1 (the CRD's bounds), or ``None``."""
    seconds = _seconds(value)
    return None if seconds is None else min(1.0, seconds)


def row_label(category: str) -> str:
    """For people: ``comm.dp.sync_wait`` -> ``dp sync wait``, ``comm.tp`` -> ``exposed comm tp``."""
    parts = category.split(".")
    if parts[0] == "comm" and len(parts) == 2:
        return f"exposed comm {parts[1]}"
    if parts[0] == "comm" and len(parts) == 3:
        return f"{parts[1]} {parts[2].replace('_', ' ')}"
    return category


def top_cost(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The row that costs the most time beyond compute, as ``"dp sync wait 12.3%"``; ``None`` when none costs any.

    Args:
        rows: status rows (``category``, ``measuredSeconds``, ``shareOfStep``).
    """
    costly = [r for r in rows if r["category"] != "compute" and (r.get("measuredSeconds") or 0.0) > 0.0]
    if not costly:
        return None
    top = max(costly, key=lambda r: r["measuredSeconds"])
    share = top.get("shareOfStep")
    text = row_label(top["category"]) + ("" if share is None else f" {share * 100:.1f}%")
    return _cut(text, MAX_TOP_COST_CHARS)


def _bounded_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At most :data:`MAX_ROWS`, keeping the costliest (and compute) in their original order."""
    if len(rows) <= MAX_ROWS:
        return rows
    keep = sorted(range(len(rows)), key=lambda i: -(rows[i].get("measuredSeconds") or 0.0))[:MAX_ROWS]
    return [rows[i] for i in sorted(keep)]


# ---------------------------------------------------------------------------------------------------- deep tier


def status_rows(analysis: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``status.costTable`` of an ``Analysis.to_dict()``: category, expected, measured median, share, suspect."""
    rows = []
    for r in analysis.get("rows", []):
        values = {
            "expectedSeconds": _seconds(r.get("expected_seconds")),
            "measuredSeconds": _seconds(r.get("measured_median_seconds")),
            "shareOfStep": _ratio(r.get("share_of_step")),
        }
        row: dict[str, Any] = {"category": _cut(str(r["category"]), MAX_CATEGORY_CHARS)}
        row |= {k: v for k, v in values.items() if v is not None}
        suspect = r.get("suspect")
        if isinstance(suspect, dict) and suspect.get("message"):
            row["suspect"] = _cut(str(suspect["message"]), MAX_SUSPECT_CHARS)
        rows.append(row)
    return _bounded_rows(rows)


def status_findings(findings: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """``status.findingsList``: the first :data:`MAX_FINDINGS` (the analysis orders them most costly first)."""
    out = []
    for f in findings[:MAX_FINDINGS]:
        severity = str(f.get("severity", "warning"))
        out.append(
            {
                "code": _cut(str(f.get("code", "")), MAX_CODE_CHARS),
                "severity": severity if severity in SEVERITIES else "warning",
                "message": _cut(str(f.get("message", "")), MAX_FINDING_CHARS),
            }
        )
    return out


def status_from_analysis(
    analysis: Mapping[str, Any], *, configmap: str, planner_findings: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """The deep tier's status fields of one ``Analysis.to_dict()`` (without conditions).

    Args:
        analysis: ``Analysis.to_dict()`` (docs/cost-table.md's JSON shape).
        configmap: the name of the ConfigMap holding the whole of it (``costTableRef``).
        planner_findings: the plan's findings (``{code, severity, message}``, what reconcile writes into
            ``findings``/``findingsList``): kept after the measured ones, those of a code the analysis also raised
            left out, so that the deep tier does not drop what the planner found.

    Returns:
        ``stepTimeSeconds``, ``topCost``, ``costTable``, ``findings``, ``findingsList``, ``costTableRef``: every
        string and list within the CRD's bounds, whatever the analysis holds.
    """
    rows = status_rows(analysis)
    findings = list(analysis.get("findings", []))
    measured = {str(f.get("code")) for f in findings}
    findings += [f for f in planner_findings if str(f.get("code")) not in measured]
    status: dict[str, Any] = {
        "costTable": rows,
        "findings": len(findings),
        "findingsList": status_findings(findings),
        "costTableRef": configmap,
    }
    step = _seconds(analysis.get("summary", {}).get("median_step_seconds"))
    if step is not None:
        status["stepTimeSeconds"] = step
    top = top_cost(rows)
    status["topCost"] = top
    return status


def analysis_message(analysis: Mapping[str, Any]) -> str:
    """The ``CostTableAvailable`` condition's message: what was analysed and, when partial, what was missing."""
    steps = analysis.get("steps", {})
    text = (
        f"{analysis.get('ranks_seen', 0):,} of {analysis.get('world_size', 0):,} ranks, steps "
        f"{steps.get('first')}-{steps.get('last')} ({steps.get('count', 0)} steps); "
        f"{len(analysis.get('findings', []))} findings"
    )
    notes = [f"{n.get('code')}: {n.get('message')}" for n in analysis.get("partial_data", [])]
    if notes:
        text += "; partial data: " + "; ".join(notes)
    return _cut(text, MAX_CONDITION_MESSAGE_CHARS)


# ---------------------------------------------------------------------------------------------------- continuous


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsReading:
    """One job's job-level series, as the store answered (``None``: the series has no sample yet)."""

    median_step_seconds: float | None = None
    """``job:meshscope_step_seconds:median_rate5m``: median over ranks of each rank's mean step time."""
    max_step_seconds: float | None = None
    """``job:meshscope_step_seconds:max_rate5m``: the slowest rank's mean step time."""
    straggler_gap_seconds: float | None = None
    """``job:meshscope_straggler_gap_seconds:max_rate5m``: the widest stage's own-time gap."""
    useful_compute_share: float | None = None
    """``job:meshscope_compute_share:ratio_rate5m``: compute's share of step time, mean over ranks."""
    reported_gpu_util: float | None = None
    """``job:meshscope_gpu_utilization_ratio:avg5m``: DCGM GPU_UTIL, mean over ranks."""
    shares: dict[tuple[str, str], float] = field(default_factory=dict)
    """``job_category_axis:meshscope_breakdown_share:ratio_rate5m``: (category, axis) -> share of step, mean over
    ranks."""


def status_rows_of_reading(reading: MetricsReading) -> list[dict[str, Any]]:
    """``status.costTable`` from the store: per category, its share and share x median step time (measured side).

    ``measuredSeconds`` is the category's mean share of step time times the median step time: the recording rules
    keep the share per category (``job_category_axis:...``), the step time per job.
    """
    step = reading.median_step_seconds
    by_category: dict[str, float] = {}
    for (category, axis), share in reading.shares.items():
        name = f"comm.{axis or 'unknown'}" if category == "exposed_comm" else CATEGORY_OF_SERIES.get((category, ""))
        if name is None or not math.isfinite(share):
            continue
        by_category[name] = by_category.get(name, 0.0) + share
    order = {c: i for i, c in enumerate(CATEGORY_ORDER)}
    rows = []
    for name in sorted(by_category, key=lambda c: (order.get(c, len(order)), c)):
        share = by_category[name]
        row: dict[str, Any] = {"category": _cut(name, MAX_CATEGORY_CHARS)}
        ratio = _ratio(share)
        if ratio is not None:
            row["shareOfStep"] = ratio
        measured = _seconds(share * step) if step is not None else None
        if measured is not None:
            row["measuredSeconds"] = measured
        rows.append(row)
    return _bounded_rows(rows)


def status_from_reading(reading: MetricsReading, *, rows: bool = True) -> dict[str, Any]:
    """The continuous tier's status fields (without conditions).

    Args:
        reading: what the store answered.
        rows: also write ``costTable`` and ``topCost`` (the caller leaves them to a recent deep analysis).
    """
    status: dict[str, Any] = {}
    step = _seconds(reading.median_step_seconds)
    if step is not None:
        status["stepTimeSeconds"] = step
    if rows:
        table = status_rows_of_reading(reading)
        status["costTable"] = table
        status["topCost"] = top_cost(table)
    return status


def reading_message(reading: MetricsReading) -> str:
    """The ``MetricsAvailable`` condition's message: step time, straggler gap, useful compute vs reported busy."""

    def s(value: float | None) -> str:
        return "no data" if value is None else human_seconds(value)

    def p(value: float | None) -> str:
        return "no data" if value is None else percent(value)

    return _cut(
        f"median step {s(reading.median_step_seconds)} (slowest rank {s(reading.max_step_seconds)}); straggler gap "
        f"{s(reading.straggler_gap_seconds)}; useful compute {p(reading.useful_compute_share)} vs reported GPU "
        f"utilisation {p(reading.reported_gpu_util)}",
        MAX_CONDITION_MESSAGE_CHARS,
    )


# ---------------------------------------------------------------------------------------------------- ConfigMap


def configmap_name(job: str) -> str:
    """``NAME-meshscope-costs``, cut to the 253 characters of a DNS subdomain."""
    return job[: 253 - len(CONFIGMAP_SUFFIX)] + CONFIGMAP_SUFFIX


def _finite(value: Any) -> Any:  # noqa: ANN401 - JSON
    """``value`` with every NaN or infinity made ``null`` (JSON has neither; the analysis keeps ``None`` for absent)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def encode_analysis(analysis: Mapping[str, Any], *, budget_bytes: int = CONFIGMAP_DATA_BUDGET_BYTES) -> str:
    """``analysis`` as compact JSON of at most ``budget_bytes`` UTF-8 bytes (NaN and infinities as ``null``).

    What is cut when it does not fit, in this order, until it fits: each finding's ``evidence``; the
    ``expected_vs_measured.collectives`` entries beyond the first 64; findings beyond the first 20 (status's own
    bound); the partial-data notes' messages beyond 1,024 characters. A note ``trimmed_for_configmap`` in
    ``partial_data`` says what went and how large the whole was. The cost table's rows, the summary and the memory
    comparison are never cut (one entry per category or pipeline stage).

    Raises:
        ValueError: if even the trimmed JSON exceeds the budget (it cannot at any job size: what is left is bounded
            by categories, stages and notes).
    """
    text = json.dumps(_finite(analysis), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    size = len(text.encode())
    if size <= budget_bytes:
        return text
    d: dict[str, Any] = json.loads(text)
    cut: list[str] = []
    steps: list[tuple[str, Any]] = [
        ("findings' evidence", lambda x: [f.pop("evidence", None) for f in x.get("findings", [])]),
        (
            "collectives beyond the first 64",
            lambda x: x.get("expected_vs_measured", {}).__setitem__(
                "collectives", x.get("expected_vs_measured", {}).get("collectives", [])[:64]
            ),
        ),
        (
            f"findings beyond the first {MAX_FINDINGS}",
            lambda x: x.__setitem__("findings", x["findings"][:MAX_FINDINGS]),
        ),
        (
            "long partial-data messages",
            lambda x: [n.__setitem__("message", _cut(str(n["message"]), 1024)) for n in x.get("partial_data", [])],
        ),
    ]
    for what, apply in steps:
        apply(d)
        cut.append(what)
        note = {
            "code": TRIMMED,
            "message": f"the analysis' JSON ({size:,} bytes) was cut to fit its ConfigMap: {', '.join(cut)} left out",
            "count": len(cut),
        }
        trial = {**d, "partial_data": [*d.get("partial_data", []), note]}
        out = json.dumps(trial, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        if len(out.encode()) <= budget_bytes:
            return out
    raise ValueError(f"the analysis' JSON is {size:,} bytes and does not fit {budget_bytes:,} bytes even trimmed")


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    """The controller owner reference to a TrainingJob (so the ConfigMap goes when the job does)."""
    meta = owner.get("metadata", {})
    return {
        "apiVersion": owner.get("apiVersion", "meshscope.io/v1alpha1"),
        "kind": owner.get("kind", "TrainingJob"),
        "name": meta.get("name", ""),
        "uid": meta.get("uid", ""),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def configmap_for(owner: Mapping[str, Any], analysis_json: str) -> dict[str, Any]:
    """The ConfigMap holding the full cost table of TrainingJob ``owner`` (``data[analysis.json]``)."""
    meta = owner.get("metadata", {})
    name = str(meta.get("name", ""))
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": configmap_name(name),
            "namespace": meta.get("namespace", ""),
            "labels": {"meshscope.io/trainingjob": name, "app.kubernetes.io/managed-by": "meshscope"},
            "ownerReferences": [owner_reference(owner)],
        },
        "data": {ANALYSIS_KEY: analysis_json},
    }


# ---------------------------------------------------------------------------------------------------- conditions


def with_condition(
    conditions: object,
    *,
    type_: str,
    status: str,
    reason: str,
    message: str,
    generation: int | None,
    now: str,
) -> list[dict[str, Any]]:
    """``conditions`` with the condition ``type_`` set (others kept as they are, at most 16 in all).

    ``lastTransitionTime`` changes only when ``status`` does (metav1.Condition's rule); ``now`` is RFC 3339.
    """
    old = [c for c in conditions if isinstance(c, dict)] if isinstance(conditions, list) else []
    previous = next((c for c in old if c.get("type") == type_), None)
    since = previous.get("lastTransitionTime") if previous and previous.get("status") == status else None
    condition: dict[str, Any] = {
        "type": type_,
        "status": status,
        "reason": _cut(reason, MAX_REASON_CHARS),
        "message": _cut(message, MAX_CONDITION_MESSAGE_CHARS),
        "lastTransitionTime": since or now,
    }
    if generation is not None and generation >= 0:
        condition["observedGeneration"] = generation
    out = [condition if c.get("type") == type_ else c for c in old]
    if previous is None:
        out.append(condition)
    return out[-16:]

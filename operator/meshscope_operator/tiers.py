"""The cost table's two tiers as kopf handlers: a timer that reads the store, a timer and an annotation that analyse.

Exists so that :func:`register_costs` (called once from :func:`meshscope_operator.handlers.register`) gives a
registry everything that writes the cost table into ``TrainingJob.status`` (docs/operator.md, "The cost table"):

- **continuous** (only with ``MESHSCOPE_OPERATOR_METRICS_URL``): every ``metrics_interval_seconds`` per
  TrainingJob, the bounded queries of :mod:`~meshscope_operator.promql` -> ``stepTimeSeconds``, and ``costTable`` /
  ``topCost`` (measured side) unless a deep analysis wrote them within two of its intervals; condition
  ``MetricsAvailable`` (``False`` with the reason when the store fails);
- **deep**: every ``deep_interval_seconds`` (first after one interval), and at once when the TrainingJob carries
  the annotation ``analyze.meshscope.io/now`` (removed after the run): :mod:`~meshscope_operator.deep` -> the
  ConfigMap ``NAME-meshscope-costs`` (owned by the TrainingJob) and the bounded summary in status; condition
  ``CostTableAvailable``.

Handlers never raise what they can name (the store down, a sidecar gone, bad records, an API error): each becomes a
condition, and the timer's next run is the retry, so there is no exception storm. They return nothing (a handler's
return value would be copied into ``status``); one deep analysis runs at a time in the whole operator (its working
set is the operator's largest), in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import aiohttp
import kopf

from meshscope.errors import MeshscopeError
from meshscope_operator.costs import (
    COST_TABLE_AVAILABLE,
    METRICS_AVAILABLE,
    analysis_message,
    configmap_for,
    configmap_name,
    reading_message,
    status_from_analysis,
    status_from_reading,
    with_condition,
)
from meshscope_operator.deep import (
    JOB_LABEL,
    Pulled,
    Target,
    analyse_window,
    expected_pods_note,
    pull_window,
    targets_of,
    window_steps,
)
from meshscope_operator.kubeapi import ApiError, ConflictError, KubeApi
from meshscope_operator.promql import MetricsError, StoreClient, read_job
from meshscope_operator.spec import GROUP, PLURAL, VERSION, job_spec

if TYPE_CHECKING:
    from meshscope.jobs import JobSpec
    from meshscope_operator.settings import OperatorSettings

ANALYZE_NOW = "analyze.meshscope.io/now"
"""Annotation that asks for a deep analysis now (any value: a new value is a new request); the operator removes it
once the analysis ran. Not under ``meshscope.io/``: kopf keeps its own state there and leaves every annotation with
that prefix out of what it compares to see a change (kopf ``_cogs/configs/diffbase.py``), so a request there would
never reach an update handler."""
METRICS_TIMER_ID = "costs-metrics"
DEEP_TIMER_ID = "costs-deep"
ANALYZE_NOW_ID = "costs-analyze-now"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _State:
    """What the handlers share: the sessions (opened at startup) and per job, the deep tier's cursor and time."""

    api: KubeApi | None = None
    http: aiohttp.ClientSession | None = None
    deep_gate: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    cursor: dict[tuple[str, str], int] = field(default_factory=dict)
    """(namespace, name) -> newest step analysed: the next window starts after it."""
    deep_done: dict[tuple[str, str], float] = field(default_factory=dict)
    """(namespace, name) -> ``time.monotonic()`` of the last deep analysis written."""
    asked: dict[tuple[str, str], str] = field(default_factory=dict)
    """(namespace, name) -> the value of the last ``analyze.meshscope.io/now`` answered: a request seen again
    (an event that predates the annotation's removal) is not run twice."""


def _condition(body: kopf.Body, patch: kopf.Patch, **fields: Any) -> None:  # noqa: ANN401 - condition fields
    """Set one condition in ``patch.status.conditions``, keeping the others (the patch replaces the whole list)."""
    current = patch.status.get("conditions", body.get("status", {}).get("conditions"))
    generation = body.get("metadata", {}).get("generation")
    patch.status["conditions"] = with_condition(
        current, generation=generation if isinstance(generation, int) else None, now=_now(), **fields
    )


def _spec_or_none(body: kopf.Body) -> tuple[JobSpec | None, str]:
    try:
        return job_spec(dict(body)), ""
    except MeshscopeError as exc:
        return None, str(exc).splitlines()[0]


async def _pods(api: KubeApi, namespace: str, name: str) -> list[dict[str, Any]]:
    """The pods labelled ``meshscope.io/trainingjob=NAME``; the label is checked here too (not every API filters)."""
    selector = quote(f"{JOB_LABEL}={name}")
    pods = await api.list(f"/api/v1/namespaces/{quote(namespace)}/pods?labelSelector={selector}")
    return [p for p in pods if (p.get("metadata", {}).get("labels") or {}).get(JOB_LABEL) == name]


async def _apply(api: KubeApi, configmap: dict[str, Any]) -> None:
    """Create the ConfigMap, or merge-patch it where it exists (its data replaced)."""
    base = f"/api/v1/namespaces/{quote(configmap['metadata']['namespace'])}/configmaps"
    try:
        await api.create(base, configmap)
    except ConflictError:
        await api.patch(f"{base}/{quote(configmap['metadata']['name'])}", configmap)


async def read_metrics(state: _State, settings: OperatorSettings, *, body: kopf.Body, patch: kopf.Patch) -> None:
    """The continuous tier for one TrainingJob: query the store, write the summary and ``MetricsAvailable``."""
    meta = body.get("metadata", {})
    key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
    if state.http is None:
        return
    client = StoreClient(settings.metrics_url, timeout_s=settings.metrics_timeout_seconds, session=state.http)
    try:
        reading = await read_job(client, key[1])
    except MetricsError as exc:
        _condition(body, patch, type_=METRICS_AVAILABLE, status="False", reason=exc.reason, message=str(exc))
        return
    done = state.deep_done.get(key)
    fresh = done is not None and time.monotonic() - done < 2 * settings.deep_interval_seconds
    patch.status.update(status_from_reading(reading, rows=not fresh))
    _condition(body, patch, type_=METRICS_AVAILABLE, status="True", reason="Read", message=reading_message(reading))


async def run_deep(state: _State, settings: OperatorSettings, *, body: kopf.Body, patch: kopf.Patch) -> None:
    """The deep tier for one TrainingJob: pull, analyse, write the ConfigMap and the summary, ``CostTableAvailable``."""
    meta = body.get("metadata", {})
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    key = (namespace, name)

    def fail(reason: str, message: str) -> None:
        _condition(body, patch, type_=COST_TABLE_AVAILABLE, status="False", reason=reason, message=message)

    if state.api is None or state.http is None:
        return  # the operator is stopping
    spec, spec_error = _spec_or_none(body)
    try:
        pods = await _pods(state.api, namespace, name)
    except ApiError as exc:
        fail("ApiError", str(exc))
        return
    targets, notes = targets_of(pods, port=settings.sidecar_port)
    missing = expected_pods_note(len(pods), spec)
    if missing is not None:
        notes.append(missing)
    if not targets:
        fail("NoSidecars", f"no running pod labelled {JOB_LABEL}={name} in {namespace} to pull records from")
        return
    async with state.deep_gate:
        steps = window_steps(
            settings.deep_window_steps,
            max_rank_steps=settings.deep_window_rank_steps,
            world_size=spec.world_size if spec is not None else None,
        )
        pulled = await _pull(state, settings, key, targets, window=steps)
        notes.extend(pulled.notes)
        if not pulled.records:
            found = f"the {len(targets)} sidecars asked hold no step records yet"
            fail("NoRecords", "; ".join([found, *(n.message for n in notes)]))
            return
        try:
            result = await asyncio.to_thread(
                analyse_window, pulled.records, window=pulled.window, spec=spec, notes=notes
            )
        except (MeshscopeError, ValueError) as exc:
            fail("AnalysisFailed", str(exc).splitlines()[0] + (f" (spec: {spec_error})" if spec_error else ""))
            return
        finally:
            pulled.records.clear()  # the records are not kept past the analysis (analyse_window empties it too)
    configmap = configmap_for(dict(body), result.json)
    try:
        await _apply(state.api, configmap)
    except ApiError as exc:
        fail("ApiError", f"writing ConfigMap {configmap_name(name)}: {exc}")
        return
    if pulled.last_step is not None:
        state.cursor[key] = pulled.last_step
    state.deep_done[key] = time.monotonic()
    summary = status_from_analysis(
        result.analysis, configmap=configmap_name(name), planner_findings=result.planner_findings
    )
    patch.status.update(summary)
    partial = bool(result.analysis.get("partial_data"))
    message = analysis_message(result.analysis) + (f"; analysed without the spec: {spec_error}" if spec_error else "")
    _condition(
        body,
        patch,
        type_=COST_TABLE_AVAILABLE,
        status="True",
        reason="PartialData" if partial else "Analysed",
        message=message,
    )


async def _pull(
    state: _State, settings: OperatorSettings, key: tuple[str, str], targets: list[Target], *, window: int
) -> Pulled:
    """The window after the job's cursor; from the oldest kept step when that is empty (a restarted job)."""
    pulled = Pulled()
    if state.http is None:
        return pulled
    for since in dict.fromkeys((state.cursor.get(key, -1), -1)):
        pulled = await pull_window(
            state.http,
            targets,
            since_step=since,
            window_steps=window,
            pod_max_bytes=settings.deep_pod_max_bytes,
            total_max_bytes=settings.deep_total_max_bytes,
            timeout_s=settings.deep_timeout_seconds,
            concurrency=settings.deep_concurrency,
        )
        if pulled.records:
            break
    return pulled


async def answer_request(state: _State, settings: OperatorSettings, *, body: kopf.Body, patch: kopf.Patch) -> None:
    """Run the deep tier for a new ``analyze.meshscope.io/now`` value (once per value), then remove the annotation."""
    meta = body.get("metadata", {})
    key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
    asked = str(meta.get("annotations", {}).get(ANALYZE_NOW, ""))
    if state.asked.get(key) != asked:
        state.asked[key] = asked
        await run_deep(state, settings, body=body, patch=patch)
    patch.metadata.annotations[ANALYZE_NOW] = None


async def _close(state: _State) -> None:
    closing = (state.api, state.http)
    state.api, state.http = None, None  # a handler still running sees the tiers as off, not a closed session
    for session in closing:
        if session is not None:
            with contextlib.suppress(Exception):
                await session.close()


def register_costs(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> None:
    """Add the cost table's handlers to ``registry``, bound to ``settings``.

    The API calls (the pods, the ConfigMap) go through reconcile's wrapper (:class:`~meshscope_operator.kubeapi.
    KubeApi`): ``MESHSCOPE_OPERATOR_API_SERVER`` when set, else the pod's service account.
    """
    state = _State()
    operator_settings = settings

    @kopf.on.startup(registry=registry)
    async def costs_sessions(**_: object) -> None:
        state.api = KubeApi(operator_settings.api_server)
        state.http = aiohttp.ClientSession()

    @kopf.on.cleanup(registry=registry)
    async def costs_close(**_: object) -> None:
        await _close(state)

    if settings.metrics_url:

        @kopf.timer(
            GROUP,
            VERSION,
            PLURAL,
            id=METRICS_TIMER_ID,
            interval=settings.metrics_interval_seconds,
            registry=registry,
        )
        async def costs_metrics(body: kopf.Body, patch: kopf.Patch, **_: object) -> None:
            await read_metrics(state, operator_settings, body=body, patch=patch)

    @kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        id=DEEP_TIMER_ID,
        interval=settings.deep_interval_seconds,
        initial_delay=settings.deep_interval_seconds,
        registry=registry,
    )
    async def costs_deep(body: kopf.Body, patch: kopf.Patch, **_: object) -> None:
        await run_deep(state, operator_settings, body=body, patch=patch)

    @kopf.on.create(
        GROUP, VERSION, PLURAL, id=ANALYZE_NOW_ID, annotations={ANALYZE_NOW: kopf.PRESENT}, registry=registry
    )
    @kopf.on.update(
        GROUP, VERSION, PLURAL, id=ANALYZE_NOW_ID, annotations={ANALYZE_NOW: kopf.PRESENT}, registry=registry
    )
    async def costs_analyze_now(body: kopf.Body, patch: kopf.Patch, **_: object) -> None:
        await answer_request(state, operator_settings, body=body, patch=patch)

"""Reconcile: a TrainingJob planned into status, materialised as an Indexed Job and a headless Service, placed.

Once its pods are bound to nodes, the real placement is checked and published to the sidecars.

Exists to hold the steps between kopf's handlers and the pure builders (:mod:`~meshscope_operator.statuses`,
:mod:`~meshscope_operator.children`, :mod:`~meshscope_operator.placements`) and the API calls
(:mod:`~meshscope_operator.kubeapi`), with the error policy in one place:

- a spec the loader or planner refuses, or a template that cannot make a Job: ``phase: Invalid`` with a condition
  naming the field, the value and what would fit, then ``kopf.PermanentError`` (no retry until the spec changes);
- a transient API failure (no answer, 429, 5xx): ``kopf.TemporaryError`` with a delay doubling from 5 s to 5 min;
  403 (missing RBAC, fixable by an administrator): retried every 5 min; any other refusal: permanent, with the
  server's message in the ``Ready`` condition;
- idempotent: each child is created, and a 409 means read and compare (a stored Service is patched back; a Job,
  whose pod template cannot change, is compared by the hash it was built from; a child of the same name not owned by
  this TrainingJob is left alone and named in the ``Ready`` condition).

:func:`register_reconcile` wires the handlers onto a registry; each handler is one call into this module.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import kopf

from meshscope.errors import MeshscopeError
from meshscope.plan import plan_job
from meshscope_operator.children import (
    FINDINGS_KEY,
    PLACEMENT_KEY,
    ChildError,
    job_manifest,
    owned_by,
    placement_manifest,
    placement_name,
    publishes_placement,
    service_drift,
    service_manifest,
    stored_hash,
)
from meshscope_operator.injection import LABEL
from meshscope_operator.kubeapi import ApiError, ConflictError, KubeApi, TransientApiError
from meshscope_operator.placements import (
    PodEntry,
    describe,
    label_keys,
    nodes_by_index,
    pod_entry,
    raised_codes,
    resolve_placement,
)
from meshscope_operator.runs import Progress, finished_run, job_progress
from meshscope_operator.spec import GROUP, PLURAL, VERSION, job_spec
from meshscope_operator.statuses import (
    Condition,
    ConditionType,
    Phase,
    cut,
    generation_of,
    planned_fields,
    planned_message,
    status_patch,
)

if TYPE_CHECKING:
    from meshscope.jobs import JobSpec
    from meshscope.plan import Plan
    from meshscope_operator.settings import OperatorSettings

RECONCILE_ID = "reconcile"
POD_INDEX_ID = "trainingjob_pods"
"""kopf index of the pods labelled ``meshscope.io/trainingjob``: ``(namespace, job) -> PodEntry`` per pod."""
JOB_INDEX_ID = "trainingjob_plans"
"""kopf index of TrainingJobs for placement: ``(namespace, name) -> PlacementSource``."""
PLACEMENT_RECHECK_S = 30.0
"""Seconds between re-checks of every TrainingJob's placement (a timer): a publication that failed on a pod event is
retried without a new pod event, and the nodes' labels are read again (a pod event that leaves every index on the
same node reads nothing)."""
PLANNED_SPECS = 1024
"""TrainingJob manifests whose plan the placement index keeps (least recently used first out): a status write is
a MODIFIED event of the TrainingJob, and its spec is planned again only when it changed."""
FIRST_RETRY_S = 5.0
LAST_RETRY_S = 300.0
FORBIDDEN_RETRY_S = 300.0
MAX_EVENT_CHARS = 1024
"""Longest Event message (``events.k8s.io/v1`` ``note``: at most 1 kB)."""
NODE_REQUESTS = 16
"""Node GETs in flight at once while resolving a placement."""
# Written as null when a spec turns invalid, so status never shows a plan of a spec that is no longer there.
_PLANNED_FIELDS = ("worldSize", "layout", "plan", "findings", "findingsList")

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementSource:
    """What the placement handler needs of a TrainingJob, kept in a kopf index (no API call per pod event)."""

    body: dict[str, Any]
    """apiVersion, kind, metadata (name, namespace, uid) and spec."""
    spec: JobSpec
    """The loaded spec."""
    planned_codes: frozenset[str]
    """Codes of the plan's findings on the default placement."""


def now_rfc3339() -> str:
    """The current UTC time, as ``metav1.Time`` writes it (seconds, ``Z``)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def retry_delay(retry: int) -> float:
    """Seconds before retry number ``retry`` (0-based): 5, 10, 20, ... capped at 300."""
    return float(min(FIRST_RETRY_S * 2.0 ** min(retry, 16), LAST_RETRY_S))


def _meta(body: Mapping[str, object]) -> Mapping[str, object]:
    meta = body.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _collection(api_version: str, plural: str, namespace: str) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{base}/namespaces/{namespace}/{plural}"


async def reconcile_training_job(
    api: KubeApi,
    body: Mapping[str, object],
    status: dict[str, object] | Any,  # noqa: ANN401 - kopf's patch.status
    settings: OperatorSettings,
    *,
    retry: int = 0,
) -> None:
    """Plan ``body`` into ``status``, and create (or check) its Job and Service.

    Args:
        api: the API connection.
        body: the TrainingJob as stored.
        status: where to write status fields (kopf's ``patch.status``).
        settings: the operator's settings.
        retry: kopf's retry count of this handler (for the backoff).

    Raises:
        kopf.PermanentError: for a spec or template that cannot be planned or materialised.
        kopf.TemporaryError: for API failures worth retrying.
    """
    now = now_rfc3339()
    try:
        spec = job_spec(body)
        plan: Plan = await asyncio.to_thread(plan_job, spec)
    except MeshscopeError as exc:
        _invalid(body, status, str(exc), now)
        raise kopf.PermanentError(f"invalid spec: {exc}") from None
    planned = Condition(type=ConditionType.PLANNED, status=True, reason="Planned", message=planned_message(spec, plan))
    fields = planned_fields(spec, plan)
    if _plan_only(body):
        ready = Condition(type=ConditionType.READY, status=False, reason="NoTemplate", message=NO_TEMPLATE)
        status.update(status_patch(body, phase=Phase.PLANNED, fields=fields, conditions=[planned, ready], now=now))
        return
    try:
        job = job_manifest(body, spec, settings)
        service = service_manifest(body, spec)
    except ChildError as exc:
        conditions = [
            planned,
            Condition(type=ConditionType.READY, status=False, reason="InvalidTemplate", message=str(exc)),
        ]
        status.update(status_patch(body, phase=Phase.INVALID, fields=fields, conditions=conditions, now=now))
        raise kopf.PermanentError(str(exc)) from None
    uid = str(_meta(body).get("uid"))
    finished = finished_run(body, generation_of(body))
    try:
        service_note = await _ensure_service(api, service, uid)
        outcome = await _ensure_job(api, job, uid, keep_finished=finished is not None)
    except ApiError as exc:
        ready = Condition(type=ConditionType.READY, status=False, reason="ApiError", message=str(exc))
        phase = _run_phase(body) or Phase.PLANNED  # a failed request says nothing about a running Job
        status.update(status_patch(body, phase=phase, fields=fields, conditions=[planned, ready], now=now))
        if isinstance(exc, TransientApiError):
            raise kopf.TemporaryError(str(exc), delay=retry_delay(retry)) from None
        if exc.status == 403:
            raise kopf.TemporaryError(str(exc), delay=FORBIDDEN_RETRY_S) from None
        raise kopf.PermanentError(str(exc)) from None
    problems = [n for n in (service_note, outcome.note) if n]
    progress = job_progress(outcome.job, spec.hardware.nodes) if outcome.job is not None else finished
    ready = _ready_condition(spec, problems, gone_finished=finished if outcome.job is None else None)
    restart_condition = _restart_condition(spec, restart=outcome.restart)
    conditions = [planned, ready, restart_condition]
    phase = Phase.PLANNED
    if progress is not None and not problems:
        conditions.append(progress.running)
        phase = progress.phase
    status.update(status_patch(body, phase=phase, fields=fields, conditions=conditions, now=now))
    if problems:
        # Someone else's object holds the name; check again later (it may be deleted), without a retry storm.
        raise kopf.TemporaryError("; ".join(problems), delay=LAST_RETRY_S)


def _run_phase(body: Mapping[str, object]) -> Phase | None:
    """The stored phase when it is one the Job's run gave (Pending, Running, Succeeded, Failed)."""
    status = body.get("status")
    phase = status.get("phase") if isinstance(status, Mapping) else None
    runs = (Phase.PENDING, Phase.RUNNING, Phase.SUCCEEDED, Phase.FAILED)
    return next((p for p in runs if p.value == phase), None)


def _ready_condition(spec: JobSpec, problems: list[str], *, gone_finished: Progress | None) -> Condition:
    if problems:
        return Condition(type=ConditionType.READY, status=False, reason="NameTaken", message="; ".join(problems))
    if gone_finished is not None:
        return Condition(
            type=ConditionType.READY,
            status=False,
            reason="RunFinished",
            message=(
                f"Job {spec.name} {gone_finished.phase.value.lower()} and is gone (deleted, or its "
                "ttlSecondsAfterFinished ran out); it is not made again for the same spec, which would run the "
                "training a second time: change the spec to run again"
            ),
        )
    return Condition(
        type=ConditionType.READY,
        status=True,
        reason="ChildrenCreated",
        message=f"Job {spec.name} ({spec.hardware.nodes} pods) and Service {spec.name} exist",
    )


def _restart_condition(spec: JobSpec, *, restart: bool) -> Condition:
    return Condition(
        type=ConditionType.RESTART_REQUIRED,
        status=restart,
        reason="SpecChanged" if restart else "UpToDate",
        message=(
            f"Job {spec.name} runs an earlier spec and a Job's pod template cannot change; delete Job {spec.name} "
            "(kubectl delete job) and the operator makes it again from this spec"
            if restart
            else f"Job {spec.name} runs this spec"
        ),
    )


def _invalid(body: Mapping[str, object], status: Any, message: str, now: str) -> None:  # noqa: ANN401 - kopf's patch.status
    condition = Condition(type=ConditionType.PLANNED, status=False, reason="InvalidSpec", message=message)
    cleared = dict.fromkeys(_PLANNED_FIELDS)
    status.update(status_patch(body, phase=Phase.INVALID, fields=cleared, conditions=[condition], now=now))


async def _ensure_service(api: KubeApi, service: Mapping[str, Any], uid: str) -> str:
    """Create the Service, or put a stored one right; a note when the name is someone else's."""
    meta = service["metadata"]
    collection = _collection("v1", "services", meta["namespace"])
    try:
        await api.create(collection, service)
    except ConflictError:
        stored = await api.get(f"{collection}/{meta['name']}")
        if stored is None:
            raise TransientApiError("GET", f"{collection}/{meta['name']}", 404, "deleted while read") from None
        if not owned_by(stored, uid):
            return f"a Service {meta['name']} exists that this TrainingJob does not own; delete or rename it"
        drift = service_drift(stored, meta["name"])
        if drift is not None:
            await api.patch(f"{collection}/{meta['name']}", drift)
    return ""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobOutcome:
    """What :func:`_ensure_job` found or made."""

    note: str = ""
    """Why the Job is not this TrainingJob's (its name is taken), else empty."""
    restart: bool = False
    """Whether the stored Job runs an earlier spec."""
    job: Mapping[str, Any] | None = None
    """The Job as stored, or as created; ``None`` when a finished run's Job is gone and is not made again."""


async def _ensure_job(api: KubeApi, job: Mapping[str, Any], uid: str, *, keep_finished: bool) -> JobOutcome:
    """Create the Job, or compare a stored one; with ``keep_finished``, only read it (a finished run is not re-run)."""
    meta = job["metadata"]
    collection = _collection("batch/v1", "jobs", meta["namespace"])
    if keep_finished:
        stored = await api.get(f"{collection}/{meta['name']}")
        return JobOutcome() if stored is None else _compared(stored, job, uid)
    try:
        await api.create(collection, job)
    except ConflictError:
        stored = await api.get(f"{collection}/{meta['name']}")
        if stored is None:
            raise TransientApiError("GET", f"{collection}/{meta['name']}", 404, "deleted while read") from None
        return _compared(stored, job, uid)
    return JobOutcome(job=job)


def _compared(stored: Mapping[str, Any], job: Mapping[str, Any], uid: str) -> JobOutcome:
    name = job["metadata"]["name"]
    if not owned_by(stored, uid):
        return JobOutcome(note=f"a Job {name} exists that this TrainingJob does not own; delete or rename it")
    return JobOutcome(restart=stored_hash(stored) != stored_hash(job), job=stored)


def placement_source(body: Mapping[str, object]) -> PlacementSource | None:
    """The index entry of a TrainingJob (``None`` when its spec does not load or plan: nothing to place)."""
    meta = _meta(body)
    read = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "spec": body.get("spec")}
    read["metadata"] = {k: meta[k] for k in ("name", "namespace") if k in meta}  # what job_spec reads
    planned = _planned(json.dumps(read, sort_keys=True, default=str))
    if planned is None:
        return None
    spec, codes = planned
    trimmed = {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid") if k in meta},
        "spec": body.get("spec"),
    }
    return PlacementSource(body=trimmed, spec=spec, planned_codes=codes)


NO_TEMPLATE = (
    "no spec.template: the job is planned only (its plan, findings and cost are in status); add a pod template to "
    "run it (docs/spec.md)"
)
"""The Ready condition's message of a TrainingJob without a pod template."""


def _plan_only(body: Mapping[str, object]) -> bool:
    """Whether the TrainingJob has no ``spec.template`` at all: a plan to read, not a job to run.

    The shipped examples are such plans (``kubectl apply -f examples/llama3-8b-h100.yaml``, as the chart's notes
    suggest): they were ``Invalid`` (``InvalidTemplate: spec.template.spec.containers: missing``). A template given but
    broken is still invalid.
    """
    spec = body.get("spec")
    return isinstance(spec, Mapping) and spec.get("template") is None


@functools.lru_cache(maxsize=PLANNED_SPECS)
def _planned(manifest: str) -> tuple[JobSpec, frozenset[str]] | None:
    """The spec and the codes of the plan's findings of a TrainingJob's JSON, or ``None`` where it does not plan."""
    try:
        spec = job_spec(json.loads(manifest))
        return spec, frozenset(f.code for f in plan_job(spec).findings)
    except MeshscopeError:
        return None


class PlacementPublisher:
    """Publishes each TrainingJob's placement; one at a time per job, so each new finding is raised once.

    A pod event that leaves every completion index on the node it was published with (a pod's status moving:
    containers starting, becoming ready) costs no API call: a large Job's start is several events per pod, and each
    full publication reads every node. Node labels changing under running pods are read by the re-check timer.
    """

    def __init__(self, api: KubeApi, settings: OperatorSettings) -> None:
        """Bind the API and settings."""
        self._api = api
        self._settings = settings
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._published: dict[tuple[str, str], tuple[object, dict[int, str]]] = {}
        """key -> (the TrainingJob's uid and spec, the nodes by index) of its last publication (or unchanged one)."""

    async def publish(self, key: tuple[str, str], jobs: object, pods: object, *, recheck: bool = False) -> str:
        """Publish the placement of TrainingJob ``key`` if every pod is bound; returns what happened (for the log).

        Args:
            key: ``(namespace, name)``.
            jobs: kopf's index of TrainingJobs (:data:`JOB_INDEX_ID`).
            pods: kopf's index of their pods (:data:`POD_INDEX_ID`).
            recheck: read the nodes and the ConfigMap even if the pods sit where they were published (the timer,
                a deleted ConfigMap).
        """
        source = _lookup(jobs, key, PlacementSource)
        if source is None:
            self._published.pop(key, None)  # deleted (its pods' last events come here), or its spec stopped planning
            return "no plannable TrainingJob"
        if not publishes_placement(source.spec):
            return "no placement published for this job (monitoring off, or too many nodes)"
        entries = [e for e in _values(pods, key) if isinstance(e, PodEntry)]
        where = nodes_by_index(source.spec, entries)
        if isinstance(where, str):
            return f"waiting: {where}"
        lock = self._locks.setdefault(key, asyncio.Lock())
        seen = (source.body["metadata"].get("uid"), source.body.get("spec"))
        async with lock:
            if not recheck and self._published.get(key) == (seen, where):
                return "unchanged: every pod on the node it was published with"
            done, outcome = await self._publish(source, where)
            if done:
                self._published[key] = (seen, where)
            return outcome

    async def _publish(self, source: PlacementSource, where: dict[int, str]) -> tuple[bool, str]:
        """Read the nodes, resolve, write the ConfigMap if it changed: ``(the ConfigMap holds it, what happened)``."""
        spec = source.spec
        names = sorted(set(where.values()))
        gate = asyncio.Semaphore(NODE_REQUESTS)

        async def node_labels(name: str) -> tuple[str, dict[str, str]]:
            async with gate:
                node = await self._api.get(f"/api/v1/nodes/{name}")
            labels = _meta(node or {}).get("labels")
            return name, {str(k): str(v) for k, v in labels.items()} if isinstance(labels, Mapping) else {}

        labels = dict(await asyncio.gather(*(node_labels(n) for n in names)))
        collection = _collection("v1", "configmaps", spec.namespace)
        path = f"{collection}/{placement_name(spec.name)}"
        stored = await self._api.get(path)
        uid = str(source.body["metadata"].get("uid", ""))
        if stored is not None and not owned_by(stored, uid):
            return False, f"ConfigMap {placement_name(spec.name)} exists and is not this TrainingJob's; not published"
        data = stored.get("data") if stored is not None else None
        data = data if isinstance(data, Mapping) else {}
        raised = raised_codes(data.get(FINDINGS_KEY))
        domain, tiers = label_keys(source.body, spec, self._settings)
        result = await asyncio.to_thread(
            resolve_placement,
            spec,
            where,
            labels,
            domain_label=domain,
            tier_labels=tiers,
            planned_codes=source.planned_codes,
            raised=raised,
        )
        document = json.dumps(result.document, sort_keys=True)
        findings = result.findings_text(raised)
        if data.get(PLACEMENT_KEY) == document and data.get(FINDINGS_KEY) == findings:
            return True, f"unchanged: {describe(result)}"
        manifest = placement_manifest(source.body, spec.name, spec.namespace, placement=document, findings=findings)
        if stored is None:
            try:
                await self._api.create(collection, manifest)
            except ConflictError:
                await self._api.patch(path, {"data": manifest["data"]})
        else:
            await self._api.patch(path, {"data": manifest["data"]})
        for finding in result.new_findings:
            message = cut(f"placement of the scheduled pods: {finding.code}: {finding.message}", MAX_EVENT_CHARS)
            kopf.warn(cast("kopf.Body", source.body), reason="PlacementFinding", message=message)
        return True, f"published {placement_name(spec.name)}: {describe(result)}"


def _values(index: object, key: tuple[str, str]) -> list[object]:
    if not isinstance(index, Mapping):
        return []
    store = index.get(key)
    return list(store or ())


def _lookup(index: object, key: tuple[str, str], kind: type) -> Any:  # noqa: ANN401 - a kopf index value
    for value in _values(index, key):
        if isinstance(value, kind):
            return value
    return None


def register_reconcile(
    registry: kopf.OperatorRegistry, settings: OperatorSettings
) -> tuple[KubeApi, PlacementPublisher]:
    """Add reconcile's handlers to ``registry``, bound to ``settings``; the API connection and publisher they use."""
    api = KubeApi(settings.api_server)
    publisher = PlacementPublisher(api, settings)

    @kopf.on.cleanup(registry=registry)
    async def close_api(**_: object) -> None:
        await api.close()

    @kopf.on.resume(GROUP, VERSION, PLURAL, id=RECONCILE_ID, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, id=RECONCILE_ID, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, id=RECONCILE_ID, field="spec", registry=registry)
    async def reconcile(body: kopf.Body, patch: kopf.Patch, retry: int, **_: object) -> None:
        await reconcile_training_job(api, body, patch.status, settings, retry=retry)

    @kopf.index(GROUP, VERSION, PLURAL, id=JOB_INDEX_ID, registry=registry)
    def trainingjob_plans(body: kopf.Body, name: str, namespace: str | None, **_: object) -> dict[Any, Any]:
        source = placement_source(body)
        return {(namespace or "", name): source} if source is not None else {}

    @kopf.index("v1", "pods", id=POD_INDEX_ID, labels={LABEL: kopf.PRESENT}, registry=registry)
    def trainingjob_pods(body: kopf.Body, namespace: str | None, **_: object) -> dict[Any, Any]:
        entry = pod_entry(body)
        return {(namespace or "", entry.job): entry} if entry is not None else {}

    @kopf.on.event("v1", "pods", id="placement", labels={LABEL: kopf.PRESENT}, registry=registry)
    async def placement(
        body: kopf.Body,
        namespace: str | None,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        **kwargs: Any,  # noqa: ANN401 - kopf's kwargs
    ) -> None:
        entry = pod_entry(body)
        if entry is None:
            return
        await publish_logged(publisher, (namespace or "", entry.job), kwargs, logger)

    @kopf.timer(GROUP, VERSION, PLURAL, id="placement-recheck", interval=PLACEMENT_RECHECK_S, registry=registry)
    async def placement_recheck(
        name: str,
        namespace: str | None,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        **kwargs: Any,  # noqa: ANN401 - kopf's kwargs
    ) -> None:
        await publish_logged(publisher, (namespace or "", name), kwargs, logger, recheck=True)

    return api, publisher


async def publish_logged(
    publisher: PlacementPublisher,
    key: tuple[str, str],
    indices: Mapping[str, object],
    logger: logging.Logger | logging.LoggerAdapter[Any],
    *,
    recheck: bool = False,
) -> None:
    """Publish the placement of TrainingJob ``key`` (``indices``: a handler's kopf kwargs); a failure is logged."""
    try:
        outcome = await publisher.publish(key, indices.get(JOB_INDEX_ID), indices.get(POD_INDEX_ID), recheck=recheck)
    except (ApiError, MeshscopeError) as exc:
        # Not raised: a pod event is not retried by kopf; the timer (PLACEMENT_RECHECK_S) tries again.
        logger.warning("placement of %s/%s not published: %s", *key, exc)
        return
    logger.debug("placement of %s/%s: %s", *key, outcome)

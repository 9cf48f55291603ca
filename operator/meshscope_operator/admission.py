"""The two admission webhooks as kopf handlers: thin, each one call into a pure function.

- ``trainingjobs.meshscope.io`` (validating, CREATE and UPDATE of TrainingJobs):
  :func:`~meshscope_operator.reviews.review_training_job` decides; a denial becomes ``kopf.AdmissionError`` (422,
  the message ``meshscope plan`` prints), findings become kopf's ``warnings``. It **fails closed**: an error the
  review does not understand propagates and kopf denies the request, and the webhook configuration's
  ``failurePolicy: Fail`` (set by the chart, or by kopf for managed configurations, its default) refuses
  TrainingJobs while the operator is down.
- ``sidecar.meshscope.io`` (mutating, CREATE of Pods labelled ``meshscope.io/trainingjob``):
  :func:`~meshscope_operator.injection.injection_for` builds the JSON patch from the operator's index of
  TrainingJobs. It **fails open**: whatever goes wrong, the pod is admitted as it is, with a warning, and its
  configuration has ``failurePolicy: Ignore`` (``ignore_failures``), so pods are created while the operator is down.
  Training is never blocked by meshscope.

It must not hold logic beyond that translation. The one API call: a pod whose TrainingJob the index does not hold
reads it from the API (:func:`live_target`, bounded by :data:`LIVE_LOOKUP_TIMEOUT_S`). A standby replica of a peered
operator serves the webhooks while kopf keeps its watches paused, so its index is empty: before, the pods it admitted
ran without the sidecar.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jsonpatch
import kopf

from meshscope_operator.injection import LABEL, InjectionTarget, injection_for, target_from_body
from meshscope_operator.kubeapi import ApiError, KubeApi
from meshscope_operator.reviews import review_training_job
from meshscope_operator.spec import GROUP, PLURAL, VERSION

if TYPE_CHECKING:
    from meshscope_operator.settings import OperatorSettings

VALIDATE_ID = "trainingjobs"
"""Handler id of the TrainingJob webhook: kopf serves it at ``POST /trainingjobs`` and names it
``trainingjobs.<managed name>`` in managed configurations."""
MUTATE_ID = "sidecar"
"""Handler id of the pod webhook (``POST /sidecar``)."""
INDEX_ID = "trainingjob_targets"
"""The kopf index of TrainingJobs the pod webhook reads (:func:`meshscope_operator.handlers.register`): keyed by
``(namespace, name)``, holding an :class:`~meshscope_operator.injection.InjectionTarget` or the loader's message."""
FAILED_OPEN = (
    "meshscope: the sidecar could not be added (an error in meshscope's pod webhook, logged by the operator); "
    "the pod runs without it"
)

LIVE_LOOKUP_TIMEOUT_S = 2.0
"""At most this long for reading a TrainingJob the index does not hold (the API server waits on the webhook)."""

_log = logging.getLogger(__name__)


def lookup_target(index: object, namespace: str, name: str) -> InjectionTarget | str | None:
    """The indexed TrainingJob ``namespace/name``: its target, the loader's message, or ``None`` if unknown."""
    if not isinstance(index, Mapping):
        return None
    store = index.get((namespace, name))
    for value in store or ():
        if isinstance(value, (InjectionTarget, str)):
            return value
    return None


async def live_target(api: KubeApi, namespace: str, name: str) -> InjectionTarget | str | None:
    """The TrainingJob ``namespace/name`` read from the API: its target, the loader's message, ``None`` if none.

    ``None`` too where the API does not answer within :data:`LIVE_LOOKUP_TIMEOUT_S` (logged): the pod then runs
    without the sidecar, as the webhook fails open.
    """
    if not (namespace and name):
        return None
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
    try:
        body = await asyncio.wait_for(api.get(path), LIVE_LOOKUP_TIMEOUT_S)
    except (ApiError, TimeoutError) as exc:
        _log.warning("pod webhook: TrainingJob %s/%s not read from the API: %s", namespace, name, exc)
        return None
    return None if body is None else target_from_body(body)


def register_admission(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> None:
    """Add both webhooks to ``registry``, bound to ``settings``."""
    api = KubeApi(settings.api_server)

    @kopf.on.cleanup(registry=registry)
    async def close_admission_api(**_: object) -> None:
        await api.close()

    @kopf.on.validate(GROUP, VERSION, PLURAL, id=VALIDATE_ID, operations={"CREATE", "UPDATE"}, registry=registry)
    def validate_training_job(body: kopf.Body, warnings: list[str], **kwargs: Any) -> None:  # noqa: ANN401 - kopf's kwargs
        old = kwargs.get("old")  # the stored object on UPDATE (oldObject), None on CREATE
        review = review_training_job(
            body,
            old if isinstance(old, Mapping) else None,
            max_warnings=settings.max_warnings,
            max_planned_gpus=settings.max_planned_gpus,
        )
        warnings.extend(review.warnings)
        if not review.allowed:
            raise kopf.AdmissionError(review.message, code=review.code)

    @kopf.on.mutate(
        "v1",
        "pods",
        id=MUTATE_ID,
        operations={"CREATE"},
        labels={LABEL: kopf.PRESENT},
        ignore_failures=True,
        registry=registry,
    )
    async def inject_sidecar(body: kopf.Body, patch: kopf.Patch, warnings: list[str], **kwargs: Any) -> None:  # noqa: ANN401 - kopf's kwargs
        try:
            meta = body.get("metadata") or {}
            labels = meta.get("labels") or {}
            namespace, name = str(meta.get("namespace", "")), str(labels.get(LABEL, ""))
            found = lookup_target(kwargs.get(INDEX_ID), namespace, name)
            if found is None:  # a standby replica's index is empty; or the job is new, or there is none
                found = await live_target(api, namespace, name)
            injection = injection_for(body, found, settings)
            ops = [dict(op) for op in injection.patch]
            if ops:
                # Applied to a copy first: a patch that does not apply is caught here, not after the handler.
                jsonpatch.apply_patch(copy.deepcopy(dict(body)), ops)
                patch.fns.append(lambda raw: jsonpatch.apply_patch(raw, ops, in_place=True))
        except Exception:  # noqa: BLE001 - the pod webhook fails open: any failure leaves the pod as it is
            _log.exception("pod webhook: no sidecar for pod %r", (body.get("metadata") or {}).get("name"))
            warnings.append(FAILED_OPEN)
            return
        warnings.extend(injection.warnings)
        _log.info("pod webhook: %s for pod %r", injection.outcome.value, meta.get("name") or meta.get("generateName"))

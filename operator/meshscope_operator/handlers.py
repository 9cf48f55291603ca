"""Every kopf handler of the operator, registered on an explicit registry with the settings bound in.

Exists so that one call, :func:`register`, gives a registry everything the operator does, for ``__main__`` and for
tests alike (each test run gets a fresh ``kopf.OperatorRegistry``, as kopf's own tests do). Now: the startup
handler that configures kopf (STYLE.md §4), the index of TrainingJobs that the pod webhook reads, the two
admission webhooks (:mod:`~meshscope_operator.admission`), reconcile (:mod:`~meshscope_operator.reconciling`:
status, the Job and Service, the placement) and the children followed (:mod:`~meshscope_operator.following`: the
Job's run into status, deleted children made again) and the cost table's two tiers
(:mod:`~meshscope_operator.tiers`).

It must hold no logic of its own: each handler calls one pure function.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import kopf

from meshscope_operator.admission import INDEX_ID, register_admission
from meshscope_operator.following import register_following
from meshscope_operator.injection import LABEL, InjectionTarget, target_from_body
from meshscope_operator.reconciling import register_reconcile
from meshscope_operator.spec import GROUP, PLURAL, VERSION
from meshscope_operator.tiers import register_costs

if TYPE_CHECKING:
    from meshscope_operator.settings import OperatorSettings

ANNOTATION_PREFIX = "meshscope.io"
"""kopf's progress and diff-base annotations are ``meshscope.io/...``: never written into ``status``, which the
API server prunes to the fields the CRD declares (docs/spec.md, status)."""
FINALIZER = "meshscope.io/finalizer"
"""kopf's finalizer on TrainingJobs (added only once a handler needs one: reconcile, later)."""


def configure_kopf(kopf_settings: kopf.OperatorSettings, settings: OperatorSettings) -> None:
    """Tune kopf from the operator's settings: the webhook server, storage, events, timeouts."""
    kopf_settings.admission.server = kopf.WebhookServer(
        addr=settings.webhook_addr,
        port=settings.webhook_port or None,
        host=settings.webhook_host or None,
        certfile=settings.webhook_cert_file,
        pkeyfile=settings.webhook_key_file,
        cafile=settings.webhook_ca_file or None,
    )
    kopf_settings.admission.managed = settings.webhook_managed or None
    kopf_settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    kopf_settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    kopf_settings.persistence.finalizer = FINALIZER
    kopf_settings.posting.level = logging.WARNING  # Events for warnings and errors only, not every handler run
    # A watch the server never closes can go stale silently behind a load balancer; ask the server to end each one
    # after 10 minutes (kopf docs, configuration: "Watching"), and bound every other request.
    # The operator's handlers on Pods, Jobs, Services and ConfigMaps all filter on this label; asking the server for
    # only those keeps kopf from watching (and dropping) every other object of the kind (kopf docs, "Watching").
    for kind in (("v1", "pods"), ("batch", "v1", "jobs"), ("v1", "services"), ("v1", "configmaps")):
        kopf_settings.watching.label_selectors[kind] = LABEL
    kopf_settings.watching.server_timeout = 600
    kopf_settings.watching.client_timeout = 660
    kopf_settings.watching.connect_timeout = 30
    kopf_settings.networking.request_timeout = 60
    kopf_settings.networking.connect_timeout = 30


def register(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> None:
    """Add every handler of the operator to ``registry``, bound to ``settings``."""
    operator_settings = settings  # kopf passes its own settings as ``settings`` to the startup handler

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: object) -> None:
        configure_kopf(settings, operator_settings)

    @kopf.index(GROUP, VERSION, PLURAL, id=INDEX_ID, registry=registry)
    def trainingjob_targets(
        body: kopf.Body, name: str, namespace: str | None, **_: object
    ) -> dict[tuple[str, str], InjectionTarget | str]:
        return {(namespace or "", name): target_from_body(body)}

    register_admission(registry, settings)
    api, publisher = register_reconcile(registry, settings)
    register_following(registry, settings, api, publisher)
    register_costs(registry, settings)

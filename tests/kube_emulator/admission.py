"""Admission: the stored Mutating/ValidatingWebhookConfigurations called as the API server calls them.

For each request the emulator asks :func:`matching_webhooks` which webhooks' ``rules`` (apiGroups, apiVersions,
resources with ``/subresource``, operations, ``*`` wildcards) and ``objectSelector`` match, then
:func:`call_webhook` POSTs an ``admission.k8s.io/v1`` AdmissionReview to ``clientConfig.url`` over TLS, trusting
only ``clientConfig.caBundle``, within ``timeoutSeconds`` (default 10 s). Mutating webhooks run first, in
configuration-name order, each one's base64 ``JSONPatch`` applied before the next; validating ones after schema
validation. A denial is ``admission webhook "<name>" denied the request: <message>`` with the webhook's code (at
least 400); warnings become ``Warning: 299 - "..."`` headers; a webhook that cannot be called fails the request
(``failurePolicy: Fail``, the default) or is skipped (``Ignore``). Every call is kept in the emulator's review log.

Not emulated: ``namespaceSelector``, ``matchConditions``, ``reinvocationPolicy``, ``service`` client configs (only
``url``), ``sideEffects`` and dry runs.
"""

from __future__ import annotations

import base64
import json
import ssl
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import jsonpatch

from kube_emulator.selectors import SelectorError, match_labels, selector_from_object

DEFAULT_TIMEOUT_S = 10
"""``timeoutSeconds`` when a webhook leaves it out (admissionregistration.k8s.io/v1's default)."""


class AdmissionDenied(Exception):  # noqa: N818 - the API server's word
    """A webhook denied the request, or could not be called under ``failurePolicy: Fail``."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class Attributes:
    """What admission sees of one request."""

    group: str
    version: str
    resource: str
    subresource: str
    kind: str
    namespace: str | None
    name: str
    operation: str
    """CREATE, UPDATE or DELETE."""
    obj: dict[str, Any] | None
    old: dict[str, Any] | None
    dry_run: bool = False


@dataclass
class Review:
    """One call to a webhook, for tests to read (``emulator.reviews``)."""

    webhook: str
    operation: str
    resource: str
    allowed: bool | None
    """``None`` when the webhook could not be called."""
    warnings: list[str] = field(default_factory=list)
    patched: bool = False
    error: str = ""


def _rule_matches(rule: dict[str, Any], attrs: Attributes) -> bool:
    def has(values: Any, value: str) -> bool:
        return "*" in (values or ()) or value in (values or ())

    resource = attrs.resource + (f"/{attrs.subresource}" if attrs.subresource else "")
    resources = rule.get("resources") or ()
    resource_ok = (
        resource in resources
        or "*/*" in resources
        or (not attrs.subresource and "*" in resources)
        or (attrs.subresource and f"{attrs.resource}/*" in resources)
        or (attrs.subresource and f"*/{attrs.subresource}" in resources)
    )
    scope = rule.get("scope", "*")
    scope_ok = scope == "*" or (scope == "Namespaced") == (attrs.namespace is not None)
    return bool(
        has(rule.get("apiGroups"), attrs.group)
        and has(rule.get("apiVersions"), attrs.version)
        and has(rule.get("operations"), attrs.operation)
        and resource_ok
        and scope_ok
    )


def _object_selected(webhook: dict[str, Any], attrs: Attributes) -> bool:
    try:
        requirements = selector_from_object(webhook.get("objectSelector"))
    except SelectorError:
        return False
    candidates = [o for o in (attrs.obj, attrs.old) if o is not None]
    return any(match_labels(requirements, (o.get("metadata") or {}).get("labels")) for o in candidates)


def matching_webhooks(configurations: list[dict[str, Any]], attrs: Attributes) -> list[dict[str, Any]]:
    """The webhooks of ``configurations`` (sorted by name) whose rules and objectSelector match ``attrs``."""
    ordered = sorted(configurations, key=lambda c: c.get("metadata", {}).get("name", ""))
    return [
        webhook
        for config in ordered
        for webhook in config.get("webhooks") or ()
        if any(_rule_matches(r, attrs) for r in webhook.get("rules") or ()) and _object_selected(webhook, attrs)
    ]


def _review(attrs: Attributes, obj: dict[str, Any] | None) -> dict[str, Any]:
    gvk = {"group": attrs.group, "version": attrs.version, "kind": attrs.kind}
    gvr = {"group": attrs.group, "version": attrs.version, "resource": attrs.resource}
    request: dict[str, Any] = {
        "uid": str(uuid.uuid4()),
        "kind": gvk,
        "resource": gvr,
        "requestKind": gvk,
        "requestResource": gvr,
        "name": attrs.name,
        "operation": attrs.operation,
        "userInfo": {"username": "kubernetes-admin", "groups": ["system:masters", "system:authenticated"]},
        "object": obj,
        "oldObject": attrs.old,
        "dryRun": attrs.dry_run,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": f"{attrs.operation.capitalize()}Options"},
    }
    if attrs.subresource:
        request["subResource"] = attrs.subresource
        request["requestSubResource"] = attrs.subresource
    if attrs.namespace is not None:
        request["namespace"] = attrs.namespace
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def _context(webhook: dict[str, Any]) -> ssl.SSLContext:
    bundle = (webhook.get("clientConfig") or {}).get("caBundle")
    if bundle:
        return ssl.create_default_context(cadata=base64.b64decode(bundle).decode())
    return ssl.create_default_context()


async def _exchange(webhook: dict[str, Any], review: dict[str, Any]) -> dict[str, Any]:
    """POST the review; the webhook's ``response``. Raises what the caller counts as "could not be called"."""
    url = (webhook.get("clientConfig") or {}).get("url")
    if not url:
        raise ValueError("only clientConfig.url is emulated, not clientConfig.service")
    timeout = aiohttp.ClientTimeout(total=float(webhook.get("timeoutSeconds") or DEFAULT_TIMEOUT_S))
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(url, json=review, ssl=_context(webhook)) as response,
    ):
        if response.status != 200:
            raise ValueError(f"expected response.status 200, got {response.status}")
        answer = json.loads(await response.read())
    result = answer["response"]
    if result.get("uid") != review["request"]["uid"]:
        raise ValueError(f"expected response.uid={review['request']['uid']!r}, got {result.get('uid')!r}")
    return dict(result)


async def call_webhook(
    webhook: dict[str, Any], attrs: Attributes, obj: dict[str, Any] | None, reviews: list[Review]
) -> tuple[dict[str, Any] | None, list[str]]:
    """Call one webhook about ``obj``; the object as patched (mutating) and the warnings it returned.

    Raises:
        AdmissionDenied: when it denies, or cannot be called and its ``failurePolicy`` is ``Fail``.
    """
    name = webhook.get("name", "")
    record = Review(webhook=name, operation=attrs.operation, resource=attrs.resource, allowed=None)
    reviews.append(record)
    review = _review(attrs, obj)
    try:
        result = await _exchange(webhook, review)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError, TypeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        if webhook.get("failurePolicy", "Fail") == "Ignore":
            return obj, []
        raise AdmissionDenied(
            500,
            "InternalError",
            f'Internal error occurred: failed calling webhook "{name}": failed to call webhook: {exc}',
        ) from exc
    warnings = [str(w) for w in result.get("warnings") or ()]
    record.warnings, record.allowed = warnings, bool(result.get("allowed"))
    if not result.get("allowed"):
        status = result.get("status") or {}
        code = max(int(status.get("code") or 0), 400)
        message = status.get("message") or status.get("reason") or ""
        denied = f'admission webhook "{name}" denied the request'
        raise AdmissionDenied(
            code, status.get("reason", ""), f"{denied}: {message}" if message else f"{denied} without explanation"
        )
    if result.get("patch") and obj is not None:
        if result.get("patchType") != "JSONPatch":
            raise AdmissionDenied(
                500, "InternalError", f'webhook "{name}" returned patchType {result.get("patchType")!r}'
            )
        ops = json.loads(base64.b64decode(result["patch"]))
        obj = jsonpatch.apply_patch(obj, ops)
        record.patched = True
    return obj, warnings

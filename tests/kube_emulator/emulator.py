"""A Kubernetes API server emulated on kmock, close enough for the real ``kubectl`` and kopf to show what users see.

:class:`KubeEmulator` subclasses ``kmock.KubernetesEmulator`` and keeps its object store (``emulator.objects[...]``,
each object's ``history``), its discovery and its request log (``for request in emulator``), but serves every
resource request itself, with what shared/reference/kubernetes-testing.md §4 lists as missing from kmock:

- paths parsed so that ``/api/v1/namespaces[/NAME]`` are namespace objects (kmock takes ``namespaces`` as a
  prefix); core discovery says ``groupVersion: v1``; subresources carry no short names; built-in resources are
  declared, with the ``default`` and ``kube-system`` namespaces;
- metadata: ``uid``, ``resourceVersion`` (one counter for the whole server), ``creationTimestamp``, ``generation``
  (1 on create, bumped only when something outside ``metadata`` and ``status`` changes, or when deletion starts),
  ``generateName``;
- 201 on create, 409 on duplicates, PUT with a ``resourceVersion`` precondition (409 on conflict, also for a patch
  that names a stale one), merge / JSON / strategic-merge (approximated as merge) patches, ``<Kind>List`` lists;
- ``labelSelector`` and ``fieldSelector`` on list and watch (custom resources: ``metadata.name`` and
  ``metadata.namespace`` only, as the API server has it); watch resumes from ``resourceVersion`` (410 when it is
  older than the kept history), honours ``timeoutSeconds``, and turns objects leaving or entering a selector into
  DELETED / ADDED, as the API server's watch cache does;
- the status subresource: a main-resource write keeps ``.status``, a ``/status`` write changes only ``.status``;
- CRDs: creating one registers its served versions in discovery and sets ``NamesAccepted`` / ``Established``;
  custom objects are defaulted, pruned (``fieldValidation``: ``Warn``, the default, returns ``unknown field``
  warnings; ``Strict`` refuses; ``Ignore`` is silent) and validated against ``openAPIV3Schema`` (422 with causes,
  :mod:`kube_emulator.schemas`); Tables from ``additionalPrinterColumns`` (:mod:`kube_emulator.tables`);
- admission through the stored webhook configurations (:mod:`kube_emulator.admission`), in the API server's
  order: mutating webhooks, schema validation, validating webhooks;
- size limits: request bodies over 3 MiB (413), stored objects over 1.5 MiB (etcd's ``--max-request-bytes``;
  500 ``etcdserver: request is too large``), annotations over 256 KiB together (422).

kmock's DSL reactions still answer discovery and other paths, but not resource requests (this class answers them).
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
import random
import traceback
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp.test_utils
import aiohttp.web
import aiohttp.web_request
import attrs
import jsonpatch
import kmock
import yaml
from kmock._internal import parsing, rendering

from kube_emulator.admission import AdmissionDenied, Attributes, Review, call_webhook, matching_webhooks
from kube_emulator.schemas import FieldError, default_and_prune, validate
from kube_emulator.selectors import (
    SelectorError,
    match_fields,
    match_labels,
    parse_field_selector,
    parse_label_selector,
)
from kube_emulator.tables import render_table, wants_table

MAX_REQUEST_BYTES = 3 * 1024 * 1024
"""The API server's request body limit (k8s.io/apiserver ``MaxRequestBodyBytes``, 3 MiB)."""
MAX_OBJECT_BYTES = 1_572_864
"""etcd's default ``--max-request-bytes`` (1.5 MiB): a larger object is refused by storage."""
MAX_ANNOTATIONS_BYTES = 262_144
"""All annotations of one object together, keys and values (k8s.io/apimachinery ``TotalAnnotationSizeLimitB``)."""
EVENT_HISTORY = 4096
"""Watch events kept for resuming watches; older resourceVersions get 410 Gone."""

_SUFFIX = "bcdfghjklmnpqrstvwxz2456789"  # what generateName appends (k8s.io/apiserver names.SimpleNameGenerator)
_NAMES = random.Random()  # its own generator: names never touch the global one (which Hypothesis watches)
_ALL_VERBS = {"create", "delete", "get", "list", "patch", "update", "watch"}


def _info(kind: str, *, namespaced: bool, status: bool = False, short: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "kind": kind,
        "singular": kind.lower(),
        "namespaced": namespaced,
        "verbs": _ALL_VERBS,
        "shortnames": set(short),
        "subresources": {"status"} if status else set(),
    }


BUILTINS: dict[str, dict[str, Any]] = {
    "v1/namespaces": _info("Namespace", namespaced=False, status=True, short=("ns",)),
    "v1/pods": _info("Pod", namespaced=True, status=True, short=("po",)),
    "v1/nodes": _info("Node", namespaced=False, status=True, short=("no",)),
    "v1/events": _info("Event", namespaced=True, short=("ev",)),
    "v1/configmaps": _info("ConfigMap", namespaced=True, short=("cm",)),
    "v1/secrets": _info("Secret", namespaced=True),
    "v1/services": _info("Service", namespaced=True, status=True, short=("svc",)),
    "v1/serviceaccounts": _info("ServiceAccount", namespaced=True, short=("sa",)),
    "apps/v1/deployments": _info("Deployment", namespaced=True, status=True, short=("deploy",)),
    "batch/v1/jobs": _info("Job", namespaced=True, status=True),
    "apiextensions.k8s.io/v1/customresourcedefinitions": _info(
        "CustomResourceDefinition", namespaced=False, status=True, short=("crd", "crds")
    ),
    "admissionregistration.k8s.io/v1/validatingwebhookconfigurations": _info(
        "ValidatingWebhookConfiguration", namespaced=False
    ),
    "admissionregistration.k8s.io/v1/mutatingwebhookconfigurations": _info(
        "MutatingWebhookConfiguration", namespaced=False
    ),
}
CRDS = kmock.resource(group="apiextensions.k8s.io", version="v1", plural="customresourcedefinitions")
NAMESPACES = kmock.resource(group="", version="v1", plural="namespaces")
VALIDATING = kmock.resource(
    group="admissionregistration.k8s.io", version="v1", plural="validatingwebhookconfigurations"
)
MUTATING = kmock.resource(group="admissionregistration.k8s.io", version="v1", plural="mutatingwebhookconfigurations")


class ApiError(Exception):
    """An error the API server answers with a ``Status``."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict[str, Any]:
        """The ``v1 Status`` body."""
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


@dataclass(frozen=True, slots=True)
class Target:
    """What a resource URL addresses."""

    group: str
    version: str
    plural: str
    namespace: str | None
    name: str | None
    subresource: str | None

    @property
    def resource(self) -> kmock.resource:
        """The kmock resource."""
        return kmock.resource(group=self.group, version=self.version, plural=self.plural)


def parse_target(path: str) -> Target | None:
    """The resource a URL path addresses, ``None`` for discovery and other paths.

    ``/api/v1/namespaces`` and ``/api/v1/namespaces/NAME[/status]`` are namespace objects; ``/api/v1/namespaces/
    NS/pods[/NAME[/SUB]]`` are namespaced ones.
    """
    parts = [p for p in path.strip("/").split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    if not rest:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    plural, name = rest[0], rest[1] if len(rest) > 1 else None
    sub = "/".join(rest[2:]) or None
    return Target(group, version, plural, namespace, name, sub)


@dataclass(frozen=True, slots=True)
class CustomVersion:
    """A served version of a registered CRD."""

    crd: str
    kind: str
    list_kind: str
    schema: dict[str, Any] | None
    columns: list[dict[str, Any]]
    status: bool


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change, kept for watches."""

    rv: int
    resource: kmock.resource
    type: str
    old: dict[str, Any] | None
    new: dict[str, Any]


SHUTDOWN_S = 5.0
"""How long a closing server lets open requests finish (watches are ended before it closes)."""


class _BigRequestServer(aiohttp.test_utils.RawTestServer):
    """aiohttp's test server with request bodies up to 64 MiB (its default is 1 MiB), so the emulator can answer
    bodies over its own limits the way the API server does, and a close bounded by :data:`SHUTDOWN_S` (aiohttp
    waits 60 s for open requests by default, longer than a test waits for a server to stop)."""

    async def _make_runner(self, debug: bool = True, **kwargs: Any) -> aiohttp.web.ServerRunner:
        def factory(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> aiohttp.web.BaseRequest:
            return aiohttp.web_request.BaseRequest(
                message, payload, protocol, writer, task, self._loop, client_max_size=64 * 1024 * 1024
            )

        server = aiohttp.web.Server(self._handler, loop=self._loop, debug=debug, request_factory=factory, **kwargs)
        return aiohttp.web.ServerRunner(server, debug=debug, shutdown_timeout=SHUTDOWN_S, **kwargs)


def make_server(emulator: KubeEmulator, *, host: str = "127.0.0.1", port: int | None = None) -> kmock.Server:
    """A kmock server for ``emulator`` on ``host:port`` (a free port by default), taking large bodies."""
    return kmock.Server(emulator, host=host, port=port, server_cls=_BigRequestServer)


def _now() -> str:
    return dt.datetime.now(tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _merge(base: Any, patch: Any) -> Any:
    """RFC 7386 merge patch (``$``-directives of strategic merge patches dropped)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base) if isinstance(base, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


def _essence(obj: dict[str, Any], *, keep_status: bool) -> dict[str, Any]:
    """What ``generation`` counts: everything but ``metadata`` (and ``status`` under a status subresource)."""
    return {k: v for k, v in obj.items() if k != "metadata" and (keep_status or k != "status")}


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """The emulated API server (see the module docstring). Serve it with :func:`make_server`."""

    reviews: list[Review] = attrs.field(factory=list, init=False)
    """Every admission webhook call, in order."""
    _versions: dict[kmock.resource, CustomVersion] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=0, init=False)
    _events: list[WatchEvent] = attrs.field(factory=list, init=False)
    _tick: asyncio.Event | None = attrs.field(default=None, init=False)
    _closing: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, info in BUILTINS.items():
            self.resources[key] = kmock.ResourceInfo(**info)
        for namespace in ("default", "kube-system"):
            self.put("v1/namespaces", {"metadata": {"name": namespace}})

    # ------------------------------------------------------------------------------------------------ storage

    def _kind(self, resource: kmock.resource) -> tuple[str, str]:
        """``(apiVersion, kind)`` of a resource's objects."""
        info = self.resources[resource]
        api_version = f"{resource.group}/{resource.version}" if resource.group else str(resource.version)
        return api_version, info.kind or str(resource.plural).capitalize()

    def _qualified(self, resource: kmock.resource) -> str:
        return f"{resource.plural}.{resource.group}" if resource.group else str(resource.plural)

    def _qualified_kind(self, resource: kmock.resource) -> str:
        _, kind = self._kind(resource)
        return f"{kind}.{resource.group}" if resource.group else kind

    def _current(self, resource: kmock.resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (resource, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def _stored(self, resource: kmock.resource, namespace: str | None = None) -> list[dict[str, Any]]:
        found = [
            obj.raw
            for (res, ns, _), obj in self.objects.items()
            if res == resource and not obj.deleted and (namespace is None or ns == namespace)
        ]
        return sorted(found, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"].get("name", "")))

    def _record(self, resource: kmock.resource, kind: str, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
        meta = new["metadata"]
        key = (resource, meta.get("namespace"), meta["name"])
        if kind == "DELETED":
            self.objects[key].delete()
        elif key in self.objects:
            self.objects[key].create(copy.deepcopy(new))
        else:
            self.objects[key] = copy.deepcopy(new)
        self._events.append(WatchEvent(self._rv, resource, kind, old, copy.deepcopy(new)))
        del self._events[:-EVENT_HISTORY]
        if self._tick is not None:
            tick, self._tick = self._tick, None
            tick.set()

    def end_watches(self) -> None:
        """End every open watch (before the server stops, which waits for its handlers)."""
        self._closing = True
        if self._tick is not None:
            tick, self._tick = self._tick, None
            tick.set()

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def put(self, resource: str | kmock.resource, obj: dict[str, Any]) -> dict[str, Any]:
        """Store ``obj`` as created (metadata filled, no admission, no validation): for fixtures.

        Call it before serving or from the emulator's loop.
        """
        res = resource if isinstance(resource, kmock.resource) else kmock.resource(resource)
        api_version, kind = self._kind(res)
        new = {"apiVersion": api_version, "kind": kind, **copy.deepcopy(obj)}
        self._fill_metadata(new)
        new["metadata"]["resourceVersion"] = self._next_rv()
        if res == NAMESPACES:
            new["status"] = {"phase": "Active"}
        self._record(res, "ADDED", None, new)
        if res == CRDS:
            self._register_crd(new)
        return new

    @staticmethod
    def _fill_metadata(obj: dict[str, Any]) -> None:
        meta = obj.setdefault("metadata", {})
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        for system in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
            meta.pop(system, None)

    # ------------------------------------------------------------------------------------------------ CRDs

    def _register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        for res in [r for r, v in self._versions.items() if v.crd == crd["metadata"]["name"]]:
            del self._versions[res]
            if res in self.resources:
                del self.resources[res]
        for version in spec.get("versions") or ():
            if not version.get("served", True):
                continue
            res = kmock.resource(group=spec["group"], version=version["name"], plural=names["plural"])
            status = "status" in (version.get("subresources") or {})
            self.resources[res] = kmock.ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                verbs=_ALL_VERBS,
                shortnames=set(names.get("shortNames") or ()),
                categories=set(names.get("categories") or ()),
                subresources={"status"} if status else set(),
            )
            self._versions[res] = CustomVersion(
                crd=crd["metadata"]["name"],
                kind=names["kind"],
                list_kind=names.get("listKind") or f"{names['kind']}List",
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                columns=list(version.get("additionalPrinterColumns") or ()),
                status=status,
            )

    def _unregister_crd(self, crd: dict[str, Any]) -> None:
        for res in [r for r, v in self._versions.items() if v.crd == crd["metadata"]["name"]]:
            for stored in self._stored(res):
                old, gone = copy.deepcopy(stored), copy.deepcopy(stored)
                gone["metadata"]["resourceVersion"] = self._next_rv()
                self._record(res, "DELETED", old, gone)
            del self._versions[res]
            del self.resources[res]

    @staticmethod
    def _crd_errors(crd: dict[str, Any]) -> list[FieldError]:
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        errors = [
            FieldError("FieldValueRequired", path, "Required value")
            for path, value in (
                ("spec.group", spec.get("group")),
                ("spec.names.plural", names.get("plural")),
                ("spec.names.kind", names.get("kind")),
                ("spec.versions", spec.get("versions")),
            )
            if not value
        ]
        name = crd.get("metadata", {}).get("name", "")
        if not errors and name != f"{names['plural']}.{spec['group']}":
            errors.append(
                FieldError(
                    "FieldValueInvalid",
                    "metadata.name",
                    f'Invalid value: "{name}": must be spec.names.plural+"."+spec.group',
                )
            )
        return errors

    @staticmethod
    def _crd_status(crd: dict[str, Any]) -> dict[str, Any]:
        now = _now()
        spec = crd["spec"]
        return {
            "conditions": [
                {
                    "type": "NamesAccepted",
                    "status": "True",
                    "lastTransitionTime": now,
                    "reason": "NoConflicts",
                    "message": "no conflicts found",
                },
                {
                    "type": "Established",
                    "status": "True",
                    "lastTransitionTime": now,
                    "reason": "InitialNamesAccepted",
                    "message": "the initial names have been accepted",
                },
            ],
            "acceptedNames": spec["names"],
            "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
        }

    # ------------------------------------------------------------------------------------------------ serving

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        target = parse_target(raw_request.path)
        if target is None:
            return await super().__call__(raw_request)  # discovery and everything else: kmock's own
        body = await raw_request.read()
        request = rendering.Request(
            id=len(self._requests),
            raw_request=raw_request,
            url=raw_request.url,
            method=raw_request.method,
            params=dict(raw_request.query),
            headers=dict(raw_request.headers),
            cookies=dict(raw_request.cookies),
            body=body,
            text=body.decode(errors="replace"),
            data=self._decode(body, raw_request.content_type, strict=False),
            action=parsing.guess_k8s(
                parsing.ParsedPath(
                    target.group, target.version, target.plural, target.namespace, target.name, target.subresource
                ),
                kmock.method(raw_request.method),
                dict(raw_request.query),
            ),
            resource=target.resource,
            namespace=target.namespace,
            name=target.name,
            subresource=target.subresource,
        )
        self._requests.append(request)
        warnings: list[str] = []
        try:
            return await self._serve(raw_request, request, target, warnings)
        except ApiError as exc:
            return self._respond(exc.code, exc.status(), warnings)
        except AdmissionDenied as exc:
            return self._respond(exc.code, ApiError(exc.code, exc.reason, exc.message).status(), warnings)
        except Exception as exc:  # noqa: BLE001 - a bug in the emulator: a 500 the test sees, and kmock's errors
            if self._errors:
                self._errors[-1].append(exc)
            message = f"emulator error: {type(exc).__name__}: {exc}"
            return self._respond(
                500, ApiError(500, "InternalError", message, {"traceback": traceback.format_exc()}).status(), warnings
            )

    @staticmethod
    def _decode(body: bytes, content_type: str, *, strict: bool = True) -> Any:
        if not body:
            return None
        if "protobuf" in content_type and strict:
            # kubectl's typed generators (create configmap / secret) send protobuf, which the API server decodes.
            raise ApiError(
                415, "UnsupportedMediaType", f"the emulator decodes JSON and YAML bodies only, not {content_type}"
            )
        try:
            if content_type == "application/apply-patch+yaml":
                return yaml.safe_load(body)
            return json.loads(body)
        except (ValueError, yaml.YAMLError) as exc:
            if strict:
                raise ApiError(400, "BadRequest", f"the body of the request was in an unknown format: {exc}") from exc
            return None

    @staticmethod
    def _respond(code: int, payload: Any, warnings: list[str]) -> aiohttp.web.Response:
        response = aiohttp.web.json_response(payload, status=code)
        for warning in dict.fromkeys(warnings):
            escaped = warning.replace("\\", "\\\\").replace('"', '\\"')
            response.headers.add("Warning", f'299 - "{escaped}"')
        return response

    async def _serve(
        self, raw: aiohttp.web.BaseRequest, request: rendering.Request, target: Target, warnings: list[str]
    ) -> aiohttp.web.StreamResponse:
        if len(request.body) > MAX_REQUEST_BYTES:
            raise ApiError(413, "RequestEntityTooLarge", f"Request entity too large: limit is {MAX_REQUEST_BYTES}")
        resource = target.resource
        if resource not in self.resources:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        namespaced = bool(self.resources[resource].namespaced)
        if namespaced != (target.namespace is not None) and target.name is not None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if target.subresource not in (None, "status") or (
            target.subresource == "status" and "status" not in self.resources[resource].subresources
        ):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        params = request.params
        method = raw.method
        if method == "GET" and params.get("watch") in ("true", "1"):
            return await self._watch(raw, target, params)
        if method == "GET":
            return self._get(raw, target, params)
        if method == "POST" and target.name is None:
            obj = self._decode(request.body, raw.content_type)
            created = await self._create(target, obj, params, warnings)
            return self._respond(201, created, warnings)
        if method in ("PUT", "PATCH") and target.name is not None:
            body = self._decode(request.body, raw.content_type)
            updated = await self._update(target, method, raw.content_type, body, params, warnings)
            return self._respond(200, updated, warnings)
        if method == "DELETE" and target.name is not None:
            return self._respond(200, await self._delete(target, warnings), warnings)
        raise ApiError(
            405, "MethodNotAllowed", f"the server does not allow this method on the requested resource: {method}"
        )

    def _selected(self, target: Target, params: Any) -> tuple[Any, Any]:
        custom = target.resource in self._versions

        def allowed(path: str) -> bool:
            return not custom or path in ("metadata.name", "metadata.namespace")

        try:
            return (
                parse_label_selector(params.get("labelSelector", "")),
                parse_field_selector(params.get("fieldSelector", ""), allowed),
            )
        except SelectorError as exc:
            raise ApiError(400, "BadRequest", str(exc)) from exc

    def _matches(self, selectors: tuple[Any, Any], target: Target, obj: dict[str, Any]) -> bool:
        labels, fields = selectors
        meta = obj.get("metadata", {})
        if target.namespace is not None and meta.get("namespace") != target.namespace:
            return False
        if target.name is not None and meta.get("name") != target.name:
            return False
        return match_labels(labels, meta.get("labels")) and match_fields(fields, obj)

    def _get(self, raw: aiohttp.web.BaseRequest, target: Target, params: Any) -> aiohttp.web.Response:
        resource = target.resource
        version = self._versions.get(resource)
        table = wants_table(raw.headers.get("Accept", ""))
        if target.name is not None:
            obj = self._current(resource, target.namespace, target.name)
            if obj is None:
                raise self._not_found(resource, target.name)
            objs = [obj]
        else:
            selectors = self._selected(target, params)
            objs = [o for o in self._stored(resource, target.namespace) if self._matches(selectors, target, o)]
        if table:
            rendered = render_table(
                objs,
                version.columns if version else None,
                resource_version=str(self._rv),
                include_object=params.get("includeObject", "Metadata"),
            )
            return self._respond(200, rendered, [])
        if target.name is not None:
            return self._respond(200, objs[0], [])
        api_version, kind = self._kind(resource)
        listing = {
            "kind": version.list_kind if version else f"{kind}List",
            "apiVersion": api_version,
            "metadata": {"resourceVersion": str(self._rv)},
            "items": objs,
        }
        return self._respond(200, listing, [])

    def _not_found(self, resource: kmock.resource, name: str) -> ApiError:
        qualified = self._qualified(resource)
        return ApiError(
            404,
            "NotFound",
            f'{qualified} "{name}" not found',
            {"name": name, "group": resource.group, "kind": resource.plural},
        )

    def _invalid(self, resource: kmock.resource, name: str, errors: list[FieldError]) -> ApiError:
        _, kind = self._kind(resource)
        joined = errors[0].message if len(errors) == 1 else "[" + ", ".join(e.message for e in errors) + "]"
        return ApiError(
            422,
            "Invalid",
            f'{self._qualified_kind(resource)} "{name}" is invalid: {joined}',
            {
                "name": name,
                "group": resource.group,
                "kind": kind,
                "causes": [{"reason": e.type, "message": e.body, "field": e.field} for e in errors],
            },
        )

    def _prune(self, target: Target, obj: dict[str, Any], params: Any, warnings: list[str]) -> dict[str, Any]:
        version = self._versions.get(target.resource)
        if version is None or version.schema is None:
            return obj
        pruned, unknown = default_and_prune(obj, version.schema)
        mode = params.get("fieldValidation", "Warn")
        if unknown and mode == "Strict":
            fields = ", ".join(f'unknown field "{u}"' for u in unknown)
            raise ApiError(
                400,
                "BadRequest",
                f'{version.kind} in version "{target.version}" cannot be handled as a {version.kind}: '
                f"strict decoding error: {fields}",
            )
        if mode != "Ignore":
            warnings.extend(f'unknown field "{u}"' for u in unknown)
        return pruned

    def _check(self, target: Target, obj: dict[str, Any]) -> None:
        """Schema validation, metadata limits and storage size: the checks after mutating admission."""
        resource, meta = target.resource, obj["metadata"]
        errors: list[FieldError] = []
        version = self._versions.get(resource)
        if version is not None and version.schema is not None:
            errors.extend(validate(obj, version.schema))
        if resource == CRDS:
            errors.extend(self._crd_errors(obj))
        annotations = meta.get("annotations") or {}
        if sum(len(k.encode()) + len(str(v).encode()) for k, v in annotations.items()) > MAX_ANNOTATIONS_BYTES:
            errors.append(
                FieldError(
                    "FieldValueTooLong",
                    "metadata.annotations",
                    f"Too long: must have at most {MAX_ANNOTATIONS_BYTES} bytes",
                )
            )
        if errors:
            raise self._invalid(resource, meta.get("name", ""), errors)
        if len(json.dumps(obj, ensure_ascii=False).encode()) > MAX_OBJECT_BYTES:
            raise ApiError(500, "InternalError", "etcdserver: request is too large")

    def _attributes(self, target: Target, operation: str, obj: Any, old: Any, name: str) -> Attributes:
        _, kind = self._kind(target.resource)
        return Attributes(
            group=target.group,
            version=target.version,
            resource=target.plural,
            subresource=target.subresource or "",
            kind=kind,
            namespace=target.namespace,
            name=name,
            operation=operation,
            obj=obj,
            old=old,
        )

    async def _admit(self, config: kmock.resource, attrs_: Attributes, obj: Any, warnings: list[str]) -> Any:
        """Call the matching webhooks of one kind of configuration in order; the object as they left it."""
        for webhook in matching_webhooks(self._stored(config), attrs_):
            obj, said = await call_webhook(webhook, attrs_, obj, self.reviews)
            warnings.extend(said)
        return obj

    async def _create(self, target: Target, obj: Any, params: Any, warnings: list[str]) -> dict[str, Any]:  # noqa: C901 - the create path, step by step
        resource = target.resource
        api_version, kind = self._kind(resource)
        if not isinstance(obj, dict):
            raise ApiError(400, "BadRequest", "the body of the request is not a JSON object")
        if obj.get("kind", kind) != kind or obj.get("apiVersion", api_version) != api_version:
            raise ApiError(
                400,
                "BadRequest",
                f"the API version in the data ({obj.get('apiVersion')}) does not match the expected API version "
                f"({api_version}) or the kind ({obj.get('kind')}) is not {kind}",
            )
        obj = {**obj, "apiVersion": api_version, "kind": kind}
        meta = obj["metadata"] = dict(obj.get("metadata") or {})
        namespaced = bool(self.resources[resource].namespaced)
        if namespaced:
            if target.namespace is None:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            if meta.get("namespace", target.namespace) != target.namespace:
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on the request",
                )
            meta["namespace"] = target.namespace
            if self._current(NAMESPACES, None, target.namespace) is None:
                raise ApiError(
                    404,
                    "NotFound",
                    f'namespaces "{target.namespace}" not found',
                    {"name": target.namespace, "kind": "namespaces"},
                )
        else:
            meta.pop("namespace", None)
        if "status" in self.resources[resource].subresources:
            obj.pop("status", None)  # written through /status only (the strategies' PrepareForCreate)
        obj = self._prune(target, obj, params, warnings)
        obj = await self._admit(
            MUTATING, self._attributes(target, "CREATE", obj, None, meta.get("name", "")), obj, warnings
        )
        obj = self._prune(target, obj, {"fieldValidation": "Ignore"}, warnings)
        meta = obj["metadata"]
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                raise self._invalid(
                    resource,
                    "",
                    [
                        FieldError(
                            "FieldValueRequired", "metadata.name", "Required value: name or generateName is required"
                        )
                    ],
                )
            for _ in range(8):
                meta["name"] = prefix + "".join(_NAMES.choices(_SUFFIX, k=5))
                if self._current(resource, target.namespace, meta["name"]) is None:
                    break
        name = meta["name"]
        if self._current(resource, target.namespace, name) is not None:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{self._qualified(resource)} "{name}" already exists',
                {"name": name, "group": resource.group, "kind": resource.plural},
            )
        self._fill_metadata(obj)
        if resource == NAMESPACES:
            obj["status"] = {"phase": "Active"}
        self._check(target, obj)
        await self._admit(VALIDATING, self._attributes(target, "CREATE", obj, None, name), obj, warnings)
        if resource == CRDS:
            obj["status"] = self._crd_status(obj)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._record(resource, "ADDED", None, obj)
        if resource == CRDS:
            self._register_crd(obj)
        return obj

    def _patched(self, old: dict[str, Any], method: str, content_type: str, body: Any) -> dict[str, Any]:
        if method == "PUT":
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "the body of the request is not a JSON object")
            return copy.deepcopy(body)
        if content_type == "application/json-patch+json":
            try:
                return jsonpatch.apply_patch(old, body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, TypeError) as exc:
                raise ApiError(
                    422, "Invalid", f"the server rejected our request due to an error in our request: {exc}"
                ) from exc
        if content_type in (
            "application/merge-patch+json",
            "application/strategic-merge-patch+json",
            "application/apply-patch+yaml",
        ):
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "the patch is not a JSON object")
            return _merge(old, body)
        raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {content_type}")

    async def _update(  # noqa: C901
        self,
        target: Target,
        method: str,
        content_type: str,
        body: Any,
        params: Any,
        warnings: list[str],
    ) -> dict[str, Any]:
        resource, name = target.resource, str(target.name)
        old = self._current(resource, target.namespace, name)
        if old is None:
            raise self._not_found(resource, name)
        new = self._patched(old, method, content_type, body)
        # A resourceVersion in a PUT's object or in a merge patch is a precondition (optimistic concurrency).
        wanted_rv = ((body.get("metadata") or {}) if isinstance(body, dict) else {}).get("resourceVersion")
        if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {self._qualified(resource)} "{name}": the object has been modified; '
                "please apply your changes to the latest version and try again",
                {"name": name, "group": resource.group, "kind": resource.plural},
            )
        if "status" in self.resources[resource].subresources:
            if target.subresource == "status":
                status = new.get("status")
                new = copy.deepcopy(old)
                new.pop("status", None)
                if status is not None:
                    new["status"] = status
            elif "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        meta = new["metadata"] = dict(new.get("metadata") or {})
        for fixed in ("name", "namespace", "uid", "creationTimestamp", "generation", "deletionTimestamp"):
            if fixed in old["metadata"]:
                meta[fixed] = old["metadata"][fixed]
            else:
                meta.pop(fixed, None)
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        new = self._prune(target, new, params, warnings)
        new = await self._admit(MUTATING, self._attributes(target, "UPDATE", new, old, name), new, warnings)
        new = self._prune(target, new, {"fieldValidation": "Ignore"}, warnings)
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        self._check(target, new)
        await self._admit(VALIDATING, self._attributes(target, "UPDATE", new, old, name), new, warnings)
        if new == old:
            return old  # a no-op write changes no resourceVersion and sends no event
        keep_status = "status" not in self.resources[resource].subresources
        if _essence(new, keep_status=keep_status) != _essence(old, keep_status=keep_status):
            new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
        new["metadata"]["resourceVersion"] = self._next_rv()
        finished = new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers")
        self._record(resource, "MODIFIED", old, new)
        if finished:
            gone = copy.deepcopy(new)
            gone["metadata"]["resourceVersion"] = self._next_rv()
            self._record(resource, "DELETED", new, gone)
            self._deleted(resource, gone)
        elif resource == CRDS:
            self._register_crd(new)
        return new

    def _deleted(self, resource: kmock.resource, obj: dict[str, Any]) -> None:
        if resource == CRDS:
            self._unregister_crd(obj)

    async def _delete(self, target: Target, warnings: list[str]) -> dict[str, Any]:
        resource, name = target.resource, str(target.name)
        old = self._current(resource, target.namespace, name)
        if old is None:
            raise self._not_found(resource, name)
        await self._admit(VALIDATING, self._attributes(target, "DELETE", None, old, name), None, warnings)
        new = copy.deepcopy(old)
        if old["metadata"].get("finalizers"):
            if old["metadata"].get("deletionTimestamp"):
                return old
            new["metadata"]["deletionTimestamp"] = _now()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
            new["metadata"]["resourceVersion"] = self._next_rv()
            self._record(resource, "MODIFIED", old, new)
            return new
        new["metadata"]["resourceVersion"] = self._next_rv()
        self._record(resource, "DELETED", old, new)
        self._deleted(resource, new)
        return new

    # ------------------------------------------------------------------------------------------------ watch

    async def _watch(self, raw: aiohttp.web.BaseRequest, target: Target, params: Any) -> aiohttp.web.StreamResponse:  # noqa: C901 - the watch cache rules
        selectors = self._selected(target, params)
        resource = target.resource
        since = params.get("resourceVersion", "")
        timeout_s = float(params.get("timeoutSeconds") or 0) or None
        pending: list[dict[str, Any]] = []
        if since in ("", "0"):
            # The snapshot and the position in the event history are taken together (no await in between), so no
            # event is lost or sent twice.
            pending = [
                {"type": "ADDED", "object": o} for o in self._stored(resource) if self._matches(selectors, target, o)
            ]
            position = self._rv
        else:
            try:
                position = int(since)
            except ValueError as exc:
                raise ApiError(400, "BadRequest", f"invalid resource version: {since!r}") from exc
        response = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        oldest = self._events[0].rv if self._events else self._rv + 1
        if since not in ("", "0") and position < oldest - 1 and len(self._events) == EVENT_HISTORY:
            gone = ApiError(410, "Expired", f"too old resource version: {position} ({oldest - 1})").status()
            await response.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            return response
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        try:
            while True:
                for event in pending:
                    await response.write(json.dumps(event).encode() + b"\n")
                pending = []
                for event in [e for e in self._events if e.rv > position and e.resource == resource]:
                    position = event.rv
                    was = event.old is not None and self._matches(selectors, target, event.old)
                    now = self._matches(selectors, target, event.new)
                    if event.type == "DELETED":
                        kind = "DELETED" if was or now else None
                    elif now and not was and event.type == "MODIFIED":
                        kind = "ADDED"
                    elif was and not now:
                        kind = "DELETED"
                    else:
                        kind = event.type if now else None
                    if kind is not None:
                        pending.append({"type": kind, "object": event.new})
                position = max(position, self._rv)
                if pending:
                    continue
                if self._closing:
                    break
                if self._tick is None:
                    self._tick = asyncio.Event()
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self._tick.wait(), remaining)
                except TimeoutError:
                    break
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            return response
        await response.write_eof()
        return response

    # ------------------------------------------------------------------------------------------------ discovery

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        """``/api/v1`` and ``/apis/G/V`` as the API server answers them (kmock says ``groupVersion: /v1`` and
        repeats short names on subresources, which makes kubectl warn about ambiguous names)."""
        assert request.resource is not None
        group, version = request.resource.group, request.resource.version
        resources = [r for r in self._get_resources() if r.group == group and r.version == version and r.plural]
        if not resources and group != "":
            raise kmock.KubernetesResourceNotFoundError
        entries = []
        for res in sorted(resources, key=lambda r: str(r.plural)):
            info = self.resources[res]
            _, kind = self._kind(res)
            entries.append(
                {
                    "name": res.plural,
                    "singularName": info.singular or str(res.plural),
                    "namespaced": bool(info.namespaced),
                    "kind": kind,
                    "verbs": sorted(info.verbs or _ALL_VERBS),
                    "shortNames": sorted(info.shortnames),
                    "categories": sorted(info.categories),
                }
            )
            entries.extend(
                {
                    "name": f"{res.plural}/{sub}",
                    "singularName": "",
                    "namespaced": bool(info.namespaced),
                    "kind": kind,
                    "verbs": ["get", "patch", "update"],
                }
                for sub in sorted(info.subresources)
            )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else str(version),
            "resources": entries,
        }

"""The few Kubernetes API calls the cost table's tiers make, over aiohttp with kopf's credentials.

Exists so that the deep tier can find a TrainingJob's pods and write its ConfigMap without the (blocking)
``kubernetes`` client on kopf's event loop: the credentials are a ``kopf.ConnectionInfo`` (what kopf's own login
handlers return: in-cluster service account, or kubeconfig), every request has a timeout, and every API error is
one :class:`KubeError` with the HTTP status and the server's message. Tests mock at this level (STYLE.md §6) or run
it against kmock.

Calls: :meth:`KubeApi.list_pods` (label selector; the labels are checked again here, since not every API emulation
filters), :meth:`KubeApi.apply_configmap` (create, or merge-patch when it exists).

It must not retry: the handler decides (a timer's next run), and must not hold the session past :meth:`close`.
"""

from __future__ import annotations

import json
import ssl
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import aiohttp

if TYPE_CHECKING:
    import kopf

HTTP_NOT_FOUND = 404
HTTP_CONFLICT = 409
MAX_POD_LIST_BYTES = 256 * 1024 * 1024
"""Most bytes of one pod list (16,384 pods of ~10 KiB each fit)."""


class KubeError(Exception):
    """An API call that failed: :attr:`status` (HTTP, 0 without an answer) and the server's message."""

    def __init__(self, status: int, message: str) -> None:
        """``status`` 0 when no answer came."""
        super().__init__(message)
        self.status = status


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    context = ssl.create_default_context(
        cafile=str(info.ca_path) if info.ca_path else None,
        cadata=info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data,
    )
    if info.certificate_path and info.private_key_path:
        context.load_cert_chain(str(info.certificate_path), str(info.private_key_path))
    return context


class KubeApi:
    """A session against one API server."""

    def __init__(self, info: kopf.ConnectionInfo, *, timeout_s: float = 30.0) -> None:
        """Talk to ``info.server`` with its token or client certificate; each request ends within ``timeout_s``."""
        headers = {"Accept": "application/json"}
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        self.base = info.server.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session = aiohttp.ClientSession(
            headers=headers, connector=aiohttp.TCPConnector(ssl=_ssl_context(info)), timeout=self.timeout
        )

    async def close(self) -> None:
        """Close the session."""
        await self.session.close()

    async def _request(self, method: str, path: str, *, body: object = None, content_type: str = "") -> Any:  # noqa: ANN401 - JSON
        headers = {"Content-Type": content_type} if content_type else {}
        try:
            async with self.session.request(method, self.base + path, json=body, headers=headers) as response:
                raw = await response.content.read(MAX_POD_LIST_BYTES + 1)
                if len(raw) > MAX_POD_LIST_BYTES:
                    raise KubeError(response.status, f"{method} {path}: answer over {MAX_POD_LIST_BYTES:,} bytes")
                if response.status >= 400:
                    raise KubeError(response.status, f"{method} {path}: HTTP {response.status}: {raw[:500]!r}")
                return _decoded(raw)
        except TimeoutError:
            raise KubeError(0, f"{method} {path}: no answer within {self.timeout.total:g} s") from None
        except aiohttp.ClientError as exc:
            raise KubeError(0, f"{method} {path}: {exc}"[:500]) from None

    async def list_pods(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """Pods of ``namespace`` carrying every one of ``labels``."""
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        answer = await self._request(
            "GET", f"/api/v1/namespaces/{quote(namespace)}/pods?labelSelector={quote(selector)}"
        )
        items = answer.get("items", []) if isinstance(answer, dict) else []
        return [
            p
            for p in items
            if isinstance(p, dict)
            and all((p.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    async def apply_configmap(self, body: dict[str, Any]) -> None:
        """Create the ConfigMap ``body``, or merge-patch it where it exists (its data replaced)."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        base = f"/api/v1/namespaces/{quote(namespace)}/configmaps"
        try:
            await self._request("POST", base, body=body)
        except KubeError as exc:
            if exc.status != HTTP_CONFLICT:
                raise
            await self._request(
                "PATCH", f"{base}/{quote(name)}", body=body, content_type="application/merge-patch+json"
            )


def _decoded(raw: bytes) -> Any:  # noqa: ANN401 - JSON
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None

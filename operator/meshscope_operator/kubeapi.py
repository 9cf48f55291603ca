"""The few Kubernetes API calls reconcile makes, over one aiohttp session: get, list, create, merge-patch.

Exists because kopf talks to the API only for the objects it watches (and their status); the children a TrainingJob
owns (its Job, Service and placement ConfigMap) and the nodes its pods landed on need requests of their own. It is
our own thin wrapper, so tests run it against kmock over real HTTP, and handler code never sees HTTP.

Errors are sorted once, here: :class:`TransientApiError` (connection failures, timeouts, 429, 5xx: retry with
backoff), :class:`ConflictError` (409 on create: the object exists; read it and compare), and :class:`ApiError` for
the rest (the request was refused as it is: 400, 403, 422, ...), each naming the method, the path, the status and the
server's message. A 404 on ``get`` is ``None``, not an error.

Credentials: :attr:`~meshscope_operator.settings.OperatorSettings.api_server` when set (tests, or an operator run
outside the cluster, with ``token``), else the pod's service account: ``https://$KUBERNETES_SERVICE_HOST:
$KUBERNETES_SERVICE_PORT``, the token file re-read on every request (bound service account tokens are rotated by
the kubelet) and the cluster CA.

It must not know what a TrainingJob is, and must not retry by itself: the handlers decide (kopf retries them).
"""

from __future__ import annotations

import json
import os
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from collections.abc import Mapping

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where the kubelet mounts a pod's service account token and the cluster CA."""
REQUEST_TIMEOUT_S = 30.0
"""Longest one request may take, connect to last byte."""
MAX_MESSAGE_CHARS = 512
"""The server's message is cut to this many characters in an error."""
_TRANSIENT = frozenset({429, 500, 502, 503, 504})


class ApiError(Exception):
    """A request the API server refused as it is (4xx other than 404 on get and 409 on create)."""

    def __init__(self, method: str, path: str, status: int, message: str) -> None:
        """Keep the status; the text names the request and the server's message."""
        super().__init__(f"{method} {path}: HTTP {status}: {message[:MAX_MESSAGE_CHARS]}")
        self.status = status


class ConflictError(ApiError):
    """409 on create: an object of that name exists."""


class TransientApiError(ApiError):
    """No answer, a timeout, 429 or 5xx: worth retrying later."""


class KubeApi:
    """A connection to the Kubernetes API (one aiohttp session, opened on first use)."""

    def __init__(self, server: str = "", *, token: str = "", service_account_dir: Path = SERVICE_ACCOUNT_DIR) -> None:
        """Open nothing yet: the session starts on the first request.

        Args:
            server: the API's URL; empty: the in-cluster address from ``KUBERNETES_SERVICE_HOST``/``_PORT``.
            token: a bearer token for ``server``; empty: the service account's token file, when there is one.
            service_account_dir: where the token and ``ca.crt`` are (in-cluster).
        """
        self._sa = service_account_dir
        self._token = token
        if server:
            self._server = server.rstrip("/")
            self._ssl: ssl.SSLContext | bool = True
        else:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            self._server = f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}"
            ca = service_account_dir / "ca.crt"
            self._ssl = ssl.create_default_context(cafile=str(ca)) if ca.exists() else True
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    @property
    def server(self) -> str:
        """The API's base URL."""
        return self._server

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        token = self._token
        if not token:
            try:
                token = (self._sa / "token").read_text().strip()
            except OSError:
                token = ""
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    async def _request(self, method: str, path: str, body: object = None, content_type: str | None = None) -> Any:  # noqa: ANN401 - JSON
        if self._closed:
            # A handler still running when the operator's cleanup closed the connection (kopf runs the cleanup
            # handlers all at once: the keeper's task may outlive this close by a moment) must not open a session
            # that nobody would close.
            raise TransientApiError(method, path, 0, "the API connection is closed (the operator is stopping)")
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))
        data = None if body is None else json.dumps(body).encode()
        try:
            async with self._session.request(
                method, self._server + path, data=data, headers=self._headers(content_type), ssl=self._ssl
            ) as response:
                text = await response.text()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TransientApiError(method, path, 0, f"no answer: {exc or type(exc).__name__}") from exc
        if status < 300:
            return json.loads(text) if text else {}
        message = _message(text)
        if status == 404 and method == "GET":
            return None
        if status == 409 and method == "POST":
            raise ConflictError(method, path, status, message)
        if status in _TRANSIENT:
            raise TransientApiError(method, path, status, message)
        raise ApiError(method, path, status, message)

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object at ``path``; ``None`` if there is none (404)."""
        found = await self._request("GET", path)
        return found if isinstance(found, dict) else None

    async def list(self, path: str) -> list[dict[str, Any]]:
        """The ``items`` of the list at ``path`` (a collection URL, with its query)."""
        found = await self._request("GET", path)
        items = found.get("items") if isinstance(found, dict) else None
        return [i for i in items or () if isinstance(i, dict)]

    async def create(self, path: str, body: Mapping[str, object]) -> dict[str, Any]:
        """POST ``body`` to the collection ``path``.

        Raises:
            ConflictError: if an object of that name exists.
        """
        created = await self._request("POST", path, dict(body), "application/json")
        return created if isinstance(created, dict) else {}

    async def patch(self, path: str, body: Mapping[str, object]) -> dict[str, Any]:
        """JSON merge patch (RFC 7386) of the object at ``path``."""
        patched = await self._request("PATCH", path, dict(body), "application/merge-patch+json")
        return patched if isinstance(patched, dict) else {}

    async def close(self) -> None:
        """Close the session (the operator's cleanup); later requests are refused, none reopens it."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None


def _message(text: str) -> str:
    """The ``message`` of a ``metav1.Status`` answer, else the text itself."""
    try:
        doc = json.loads(text)
    except ValueError:
        return text.strip() or "(no message)"
    if isinstance(doc, dict) and isinstance(doc.get("message"), str):
        return str(doc["message"])
    return text.strip() or "(no message)"

"""The operator served for real: kopf's own ``WebhookServer`` over HTTPS (certificates from trustme), the operator's
registry as ``meshscope-operator`` builds it, and kmock as the Kubernetes API kopf talks to.

Layout, after the traps in ``shared/reference/kubernetes-testing.md`` §2.3:

- kmock runs in a thread of its own with its own event loop, and kopf runs in another (recipe C, ``kopf.operator``
  as a task), so the sync tests, kopf and the mock never share a loop (traps T2, T3);
- kopf logs in through an ``@kopf.on.login`` handler, never ``$KUBECONFIG`` (T4); kmock declares the CRD and
  namespace resources kopf waits for (T5); namespace scanning is off (T6);
- a minimal shim over kmock (:class:`NamingEmulator`) gives creates with ``generateName`` a name, as the API server
  does, so kopf's Events are posted (T7), and the TrainingJobs stored here carry a ``uid`` and a ``generation``, which
  kmock never adds (reference §2.1): reconcile's ownerReferences need the uid, and kopf tests the
  ``resourceVersion`` it saw in its JSON patches (kmock never changes it, so the test holds). The tests that change a spec bump
  the generation themselves, as the API server would;
- reconcile's own client (``meshscope_operator.kubeapi``) talks to the same kmock (``api_server``);
- every wait has a deadline and every request a timeout; the operator is stopped with its stop flag and awaited
  with a timeout at the end of the session.

Tests POST ``admission.k8s.io/v1`` AdmissionReviews with :meth:`Served.review` and get the JSON answer back. The
``served`` fixture is in tests/operator/conftest.py; this module is importable by name (``tests/operator`` cannot be
a package called ``operator``: the standard library owns that name).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kmock
import kopf
import pytest
import trustme
import yaml

from meshscope_operator.admission import MUTATE_ID, VALIDATE_ID
from meshscope_operator.handlers import register
from meshscope_operator.settings import OperatorSettings

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "training"
TIMEOUT_S = 30.0
BESIDE_THE_OPERATOR = pytest.mark.filterwarnings(
    "ignore:Do not use the `random` module inside strategies:hypothesis.errors.HypothesisDeprecationWarning"
)
"""For a hypothesis test that runs beside the served operator: kopf's thread picks its API credentials with the global
``random`` (``random.choice`` in kopf's credentials vault) on every request it makes, and when that falls inside
hypothesis drawing an example, hypothesis takes the change of the global state for a strategy that uses ``random`` and
warns (an error here: a clean-clone run of the suite failed so, 2026-12-08). The strategies here use none."""
"""Every request and every wait in these tests ends by then (generous: the machine is shared)."""

# What kopf needs discovered before it starts any watch (trap T5), plus what the webhooks are for.
RESOURCES: dict[str, dict[str, Any]] = {
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition",
        "namespaced": False,
        "verbs": {"list", "watch", "get", "create", "patch"},
    },
    "v1/namespaces": {"kind": "Namespace", "namespaced": False, "verbs": {"list", "watch", "get"}},
    "v1/pods": {"kind": "Pod", "namespaced": True, "verbs": {"list", "watch", "get", "create", "patch", "delete"}},
    "v1/events": {"kind": "Event", "namespaced": True, "verbs": {"list", "watch", "get", "create", "patch"}},
    "v1/services": {
        "kind": "Service",
        "namespaced": True,
        "verbs": {"list", "watch", "get", "create", "patch", "delete"},
    },
    "v1/configmaps": {
        "kind": "ConfigMap",
        "namespaced": True,
        "verbs": {"list", "watch", "get", "create", "patch", "delete"},
    },
    "v1/nodes": {"kind": "Node", "namespaced": False, "verbs": {"list", "watch", "get", "create", "patch"}},
    "batch/v1/jobs": {
        "kind": "Job",
        "namespaced": True,
        "verbs": {"list", "watch", "get", "create", "patch", "delete"},
    },
    "meshscope.io/v1alpha1/trainingjobs": {
        "kind": "TrainingJob",
        "namespaced": True,
        "singular": "trainingjob",
        "shortnames": {"tj"},
        "verbs": {"list", "watch", "get", "create", "patch", "delete"},
        "subresources": {"status"},
    },
}


def load_example(name: str) -> dict[str, Any]:
    """``examples/<name>.yaml`` as a dict."""
    return yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())


def training_job(name: str, spec: dict[str, Any], *, generation: int = 1) -> dict[str, Any]:
    """A TrainingJob object in the test namespace, with the uid and generation an API server would give it."""
    return {
        "apiVersion": "meshscope.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": str(uuid.uuid4()),
            "generation": generation,
            "resourceVersion": "1",
        },
        "spec": spec,
    }


class NamingEmulator(kmock.KubernetesEmulator):
    """kmock with a few things of the API server's added.

    - a create with ``generateName`` and no name gets a name;
    - every write gives the object a new ``metadata.resourceVersion`` (one counter for all, as etcd's revision), and
      a write that names a ``resourceVersion`` (a merge patch's ``metadata.resourceVersion``, a JSON patch's ``test``
      of ``/metadata/resourceVersion``) is refused when the object has changed since: 409 Conflict for a merge
      patch (the API server's precondition), 422 for a failed ``test`` (RFC 6902), as the API server answers;
    - :attr:`faults`: ``(METHOD, path) -> HTTP status`` answered instead of serving the request (a test's outage).
    """

    _generated = 0
    _revision = 1000

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults: dict[tuple[str, str], int] = {}

    async def _handle(self, request: Any) -> Any:
        fault = self.faults.get((str(request.method.value).upper(), request.url.path))
        if fault is not None:
            return _status_response(fault, f"injected fault {fault}")
        data = request.data
        if request.resource is not None and request.action == kmock.action.CREATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if isinstance(meta, dict) and not meta.get("name") and meta.get("generateName"):
                NamingEmulator._generated += 1
                meta["name"] = f"{meta['generateName']}{NamingEmulator._generated:05d}"
            if isinstance(meta, dict) and not meta.get("resourceVersion"):
                meta["resourceVersion"] = self._next_revision()
        elif request.resource is not None and request.action == kmock.action.UPDATE and request.name is not None:
            refused = self._versioned(request)
            if refused is not None:
                return refused
        return await super()._handle(request)

    @classmethod
    def _next_revision(cls) -> str:
        cls._revision += 1
        return str(cls._revision)

    def _versioned(self, request: Any) -> Any:
        """Check a patch's resourceVersion against the stored object's, and make the patch set a new one."""
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        current = self._objects[key].last.raw.get("metadata", {}).get("resourceVersion")
        data = request.data
        if isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            wanted = meta.get("resourceVersion") if isinstance(meta, dict) else None
            if wanted is not None and wanted != current:
                return _status_response(
                    409, "the object has been modified; please apply your changes to the latest version"
                )
            if isinstance(meta, dict):
                meta["resourceVersion"] = self._next_revision()
        elif isinstance(data, list):
            for op in data:
                tested = (
                    isinstance(op, dict) and op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion"
                )
                if tested and op.get("value") != current:
                    return _status_response(422, "the test operation on /metadata/resourceVersion failed")
            data.append({"op": "replace", "path": "/metadata/resourceVersion", "value": self._next_revision()})
        return None


def _status_response(code: int, message: str) -> Any:
    import aiohttp.web  # noqa: PLC0415 - only the emulator answers by hand

    reasons = {409: "Conflict", 422: "Invalid"}
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}
    body["reason"] = reasons.get(code, "InternalError")
    return aiohttp.web.json_response(body, status=code)


# TrainingJobs the cluster holds before the operator starts: the pod webhook finds them through kopf's index.
_LLAMA = load_example("llama3-70b-h100")
_LLAMA["metadata"].update(namespace=NAMESPACE, uid=str(uuid.uuid4()), generation=1, resourceVersion="1")
STORED_JOBS: dict[str, dict[str, Any]] = {
    "llama3-70b-h100": _LLAMA,
    # tp 3 does not divide llama3-70b's 64 heads: the CRD schema takes it, the loader does not.
    "tp3": training_job("tp3", {**_LLAMA["spec"], "parallelism": {"tp": 3}}),
    "quiet": training_job("quiet", {**_LLAMA["spec"], "monitoring": {"enabled": False}}),
    "train-only": training_job("train-only", {**_LLAMA["spec"], "monitoring": {"sources": ["train"]}}),
}


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _LoopThread:
    """An event loop running forever in a daemon thread; coroutines are submitted to it and awaited with a timeout."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout_s: float = TIMEOUT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT_S)
        if not self.thread.is_alive():
            self.loop.close()


@contextlib.contextmanager
def kopf_running(registry: kopf.OperatorRegistry, *, namespace: str, name: str = "kopf") -> Iterator[None]:
    """``kopf.operator`` for ``registry`` as a task in a loop thread of its own (traps T2, T3): ready before the
    body runs, stopped with its stop flag and awaited (bounded) after it, the thread closed."""
    thread = _LoopThread(name)
    flags: dict[str, asyncio.Event] = {}

    async def start() -> asyncio.Task[None]:
        flags["stop"], flags["ready"] = asyncio.Event(), asyncio.Event()
        return asyncio.get_running_loop().create_task(
            kopf.operator(
                registry=registry,
                standalone=True,
                namespaces=[namespace],
                stop_flag=flags["stop"],
                ready_flag=flags["ready"],
            )
        )

    task = thread.run(start())
    try:
        thread.run(asyncio.wait_for(flags["ready"].wait(), TIMEOUT_S))
        yield
    finally:
        thread.loop.call_soon_threadsafe(flags["stop"].set)

        async def stopped() -> None:
            # kopf ends its root task by cancelling it once everything has shut down.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, TIMEOUT_S)

        thread.run(stopped(), TIMEOUT_S + 5)
        thread.close()


@dataclass
class Served:
    """The running operator's webhook server, and the API mock behind it."""

    base_url: str
    context: ssl.SSLContext
    settings: OperatorSettings
    mock: Any
    api_url: str = ""
    """kmock's URL (plain HTTP)."""
    mock_loop: Any = None
    """The event loop kmock runs in (read its recorded requests there)."""

    def post(self, path: str, payload: bytes) -> tuple[int, dict[str, Any] | None]:
        """POST raw bytes to the webhook server; the HTTP status and the JSON answer (``None`` if not JSON)."""
        request = urllib.request.Request(
            f"{self.base_url}/{path}", data=payload, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, context=self.context, timeout=TIMEOUT_S) as response:
                status, body = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read()
        try:
            return status, json.loads(body)
        except ValueError:
            return status, None

    def review(
        self,
        path: str,
        obj: dict[str, Any],
        *,
        operation: str = "CREATE",
        old: dict[str, Any] | None = None,
        resource: tuple[str, str, str, str] = ("meshscope.io", "v1alpha1", "trainingjobs", "TrainingJob"),
    ) -> dict[str, Any]:
        """Send ``obj`` as an admission.k8s.io/v1 AdmissionReview, as the API server does; the answer's ``response``.

        Fails the test unless the server answers 200 with a review of the same uid.
        """
        group, version, plural, kind = resource
        uid = str(uuid.uuid4())
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "kind": {"group": group, "version": version, "kind": kind},
                "resource": {"group": group, "version": version, "resource": plural},
                "requestKind": {"group": group, "version": version, "kind": kind},
                "requestResource": {"group": group, "version": version, "resource": plural},
                "name": meta.get("name", ""),
                "namespace": meta.get("namespace", NAMESPACE),
                "operation": operation,
                "userInfo": {"username": "kubernetes-admin", "groups": ["system:masters", "system:authenticated"]},
                "object": obj,
                "oldObject": old,
                "dryRun": False,
                "options": {"apiVersion": "meta.k8s.io/v1", "kind": f"{operation.capitalize()}Options"},
            },
        }
        status, answer = self.post(path, json.dumps(review).encode())
        assert status == 200, (status, answer)
        assert answer is not None
        assert answer["apiVersion"] == "admission.k8s.io/v1"
        assert answer["kind"] == "AdmissionReview"
        assert answer["response"]["uid"] == uid
        return answer["response"]

    def api(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        """One request to kmock, as a client of the API server would send it; the status and the JSON answer."""
        content = "application/merge-patch+json" if method == "PATCH" else "application/json"
        request = urllib.request.Request(
            self.api_url + path,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": content, "Accept": "application/json"},
            method=method,
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, None

    def requests(self) -> list[tuple[str, str]]:
        """Every request kmock has served so far, as (method, path), read in kmock's own loop."""

        async def snapshot() -> list[tuple[str, str]]:
            return [(str(r.method.value).upper(), r.url.path) for r in self.mock]

        return list(self.mock_loop.run(snapshot()))

    def review_job(self, obj: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """Review a TrainingJob through the validating webhook."""
        return self.review(VALIDATE_ID, obj, **kwargs)

    def review_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        """Review a Pod (CREATE) through the mutating webhook."""
        return self.review(MUTATE_ID, pod, resource=("", "v1", "pods", "Pod"))


def labelled_pod(job: str | None, *, name: str = "worker-0", containers: int = 1) -> dict[str, Any]:
    """A pod as a Job controller creates it: one or more training containers, labelled for ``job`` unless ``None``."""
    labels = {"batch.kubernetes.io/job-completion-index": "0", "app": "trainer"}
    if job is not None:
        labels["meshscope.io/trainingjob"] = job
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": f"trainer-{i}" if i else "trainer",
                    "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                    "command": ["torchrun", "train.py"],
                    "env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}],
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                }
                for i in range(containers)
            ],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}}],
        },
    }


def serve(certs: Path) -> Iterator[Served]:
    """Start kmock and the operator, yield the webhook server, stop both (the ``served`` fixture).

    Args:
        certs: an empty directory for the certificates trustme makes.
    """
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    issued.cert_chain_pems[0].write_to_path(str(certs / "tls.crt"))
    issued.private_key_pem.write_to_path(str(certs / "tls.key"))
    ca.cert_pem.write_to_path(str(certs / "ca.crt"))
    port = _free_port()
    mock_thread = _LoopThread("kmock")

    async def start_mock() -> tuple[Any, Any]:
        emulator = NamingEmulator()
        await emulator.__aenter__()
        server = kmock.Server(emulator)
        await server.__aenter__()
        for key, info in RESOURCES.items():
            emulator.resources[key] = kmock.ResourceInfo(**info)
        for name, job in STORED_JOBS.items():
            emulator.objects["meshscope.io/v1alpha1/trainingjobs", NAMESPACE, name] = job
        return emulator, server

    emulator, server = mock_thread.run(start_mock())
    api_url = str(server.url).rstrip("/")
    settings = OperatorSettings(
        api_server=api_url,
        webhook_addr="127.0.0.1",
        webhook_port=port,
        webhook_cert_file=str(certs / "tls.crt"),
        webhook_key_file=str(certs / "tls.key"),
        webhook_ca_file=str(certs / "ca.crt"),
        liveness_port=0,
        namespaces=(NAMESPACE,),
        sidecar_image="registry.example/meshscope-sidecar:test",
    )

    registry = kopf.OperatorRegistry()
    register(registry, settings)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=api_url, insecure=True, scheme="Bearer", token="dummy")

    @kopf.on.startup(registry=registry)
    def plain_kmock(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.scanning.disabled = True  # kmock's /api/v1/namespaces is broken (trap T6)

    with contextlib.ExitStack() as stack:
        stack.callback(_stop_mock, mock_thread, server, emulator)
        stack.enter_context(kopf_running(registry, namespace=NAMESPACE))
        context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        result = Served(
            base_url=f"https://127.0.0.1:{port}",
            context=context,
            settings=settings,
            mock=emulator,
            api_url=api_url,
            mock_loop=mock_thread,
        )
        _wait_until_serving(result)
        yield result
    # Whatever the operator or kmock left open (an aiohttp session, a socket) warns when collected: collect now, so
    # the warning fails this module's teardown rather than whichever later test the collector happens to run in.
    gc.collect()


def _stop_mock(mock_thread: _LoopThread, server: Any, emulator: Any) -> None:
    async def stop_mock() -> None:
        await server.__aexit__(None, None, None)
        await emulator.__aexit__(None, None, None)

    mock_thread.run(stop_mock())
    mock_thread.close()


def _wait_until_serving(served: Served) -> None:
    """Wait (bounded) until the webhook server listens and kopf's index holds the stored TrainingJobs."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            response = served.review_pod(labelled_pod("llama3-70b-h100"))
        except (OSError, AssertionError):
            response = {}
        if "patch" in response:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the operator did not serve an injection within {TIMEOUT_S} s: {response}")
        time.sleep(0.05)

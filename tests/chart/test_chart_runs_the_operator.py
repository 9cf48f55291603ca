"""The operator started as the chart's Deployment starts it, serving the chart's certificate to the chart's CA bundle.

The settings are what ``meshscope-operator`` builds from the rendered Deployment's environment (after the kubelet's
``$(VAR)`` expansion), with two changes only a test needs: the listen address (loopback, a free port) and the
directory of the mounted Secret (a temporary one holding the rendered Secret's files). kopf runs the operator's
registry against kmock (as tests/operator_serving.py does, in threads of its own, every wait bounded) with the
liveness endpoint on the chart's probe path. The API server's side is played by a TLS client that trusts only the
rendered ``caBundle`` and checks the Service's DNS name, as the API server does for a service reference.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
import urllib.request
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import kmock
import kopf
import pytest
import yaml

from charting import (
    NAMESPACE,
    OPERATOR_RESOURCES,
    ROOT,
    KmockApi,
    Rendered,
    chart_webhooks,
    container,
    kubelet_env,
    operator_process,
    render,
)
from meshscope_operator.handlers import register
from meshscope_operator.settings import settings_from

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

TIMEOUT_S = 30.0


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Loop:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout_s: float = TIMEOUT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT_S)
        assert not self.thread.is_alive()
        self.loop.close()


class Running:
    """The operator as the chart configures it, and how the API server and the kubelet reach it."""

    def __init__(self, rendered: Rendered, webhook_port: int, liveness_port: int) -> None:
        self.webhook_port = webhook_port
        self.liveness_port = liveness_port
        service = rendered.one("Service")["metadata"]["name"]
        self.service_host = f"{service}.{NAMESPACE}.svc"
        self.webhooks = chart_webhooks(rendered)

    def review(self, webhook: str, obj: dict[str, Any], resource: tuple[str, str, str, str]) -> dict[str, Any]:
        """POST an AdmissionReview the way the API server does for the chart's configuration of ``webhook``."""
        config = self.webhooks[webhook]["clientConfig"]
        context = ssl.create_default_context(cadata=base64.b64decode(config["caBundle"]).decode())
        group, version, plural, kind = resource
        uid = str(uuid.uuid4())
        body = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "kind": {"group": group, "version": version, "kind": kind},
                "resource": {"group": group, "version": version, "resource": plural},
                "requestKind": {"group": group, "version": version, "kind": kind},
                "requestResource": {"group": group, "version": version, "resource": plural},
                "name": obj["metadata"]["name"],
                "namespace": NAMESPACE,
                "operation": "CREATE",
                "userInfo": {"username": "kubernetes-admin"},
                "object": obj,
                "oldObject": None,
                "dryRun": False,
            },
        }
        raw = socket.create_connection(("127.0.0.1", self.webhook_port), timeout=TIMEOUT_S)
        # The hostname the API server checks for a service reference: <service>.<namespace>.svc
        with context.wrap_socket(raw, server_hostname=self.service_host) as tls:
            connection = http.client.HTTPConnection(self.service_host, timeout=TIMEOUT_S)
            connection.sock = tls
            connection.request(
                "POST", config["service"]["path"], json.dumps(body), {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            assert response.status == 200, response.read()
            answer = json.loads(response.read())
        assert answer["response"]["uid"] == uid
        return answer["response"]


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    rendered = render()
    env = kubelet_env(container(rendered)["env"])
    mount = next(m["mountPath"] for m in container(rendered)["volumeMounts"] if m["name"] == "webhook-certificates")
    certs: Path = tmp_path_factory.mktemp("mounted")
    for key, value in rendered.one("Secret")["data"].items():
        (certs / key).write_bytes(base64.b64decode(value))
    chart_settings = settings_from({k: v.replace(mount, str(certs)) for k, v in env.items()})
    settings = replace(chart_settings, webhook_addr="127.0.0.1", webhook_port=_free_port())
    liveness_port = _free_port()

    mock = _Loop("kmock-chart")

    async def start_mock() -> tuple[Any, Any]:
        emulator = kmock.KubernetesEmulator()
        await emulator.__aenter__()
        server = kmock.Server(emulator)
        await server.__aenter__()
        for key, info in OPERATOR_RESOURCES.items():
            emulator.resources[key] = kmock.ResourceInfo(**info)
        return emulator, server

    emulator, server = mock.run(start_mock())
    api_url = str(server.url).rstrip("/")
    registry = kopf.OperatorRegistry()
    register(registry, settings)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=api_url, insecure=True, scheme="Bearer", token="dummy")

    @kopf.on.startup(registry=registry)
    def plain_kmock(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.enabled = False  # kmock has no generateName (trap T7)
        settings.scanning.disabled = True  # kmock's namespace listing is broken (trap T6)

    operator = _Loop("kopf-chart")
    flags: dict[str, asyncio.Event] = {}

    async def start_operator() -> asyncio.Task[None]:
        flags["stop"], flags["ready"] = asyncio.Event(), asyncio.Event()
        return asyncio.get_running_loop().create_task(
            kopf.operator(
                registry=registry,
                standalone=True,  # the chart's default: no peering
                clusterwide=not settings.namespaces,
                namespaces=settings.namespaces,
                liveness_endpoint=f"http://127.0.0.1:{liveness_port}/healthz",
                stop_flag=flags["stop"],
                ready_flag=flags["ready"],
            )
        )

    task = operator.run(start_operator())
    try:
        operator.run(asyncio.wait_for(flags["ready"].wait(), TIMEOUT_S))
        yield Running(rendered, settings.webhook_port, liveness_port)
    finally:
        operator.loop.call_soon_threadsafe(flags["stop"].set)

        async def stopped() -> None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, TIMEOUT_S)

        operator.run(stopped(), TIMEOUT_S + 5)
        operator.close()

        async def stop_mock() -> None:
            await server.__aexit__(None, None, None)
            await emulator.__aexit__(None, None, None)

        mock.run(stop_mock())
        mock.close()


def _until(what: str, check: Any) -> Any:
    """Retry ``check`` until it returns without an OSError, within the deadline (the server starts asynchronously)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            return check()
        except OSError as exc:
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: nothing within {TIMEOUT_S} s: {exc}")
            time.sleep(0.05)


def test_the_trainingjob_webhook_answers_the_api_server_over_the_charts_tls(running: Running) -> None:
    job = yaml.safe_load((ROOT / "examples" / "bad-tp16-h100.yaml").read_text())
    job["metadata"]["namespace"] = NAMESPACE
    response = _until(
        "the TrainingJob webhook",
        lambda: running.review(
            "validating/trainingjobs.meshscope.io", job, ("meshscope.io", "v1alpha1", "trainingjobs", "TrainingJob")
        ),
    )
    assert response["allowed"] is True
    assert any(w.startswith("tp-crosses-nvlink-domain: tp=16") for w in response["warnings"]), response


def test_the_pod_webhook_answers_and_fails_open(running: Running) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "w-0", "namespace": NAMESPACE, "labels": {"meshscope.io/trainingjob": "absent"}},
        "spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]},
    }
    response = _until(
        "the pod webhook", lambda: running.review("mutating/sidecar.meshscope.io", pod, ("", "v1", "pods", "Pod"))
    )
    assert response["allowed"] is True
    assert "patch" not in response
    assert any("no TrainingJob 'absent'" in w for w in response["warnings"]), response


def test_the_liveness_probe_path_is_answered(running: Running) -> None:
    def probe() -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{running.liveness_port}/healthz", timeout=TIMEOUT_S) as r:
            return int(r.status)

    assert _until("kopf's /healthz", probe) == 200


def test_meshscope_operator_as_the_image_runs_it_logs_in_and_serves(tmp_path: Path) -> None:
    api = KmockApi(OPERATOR_RESOURCES)
    try:
        rendered = render()
        with operator_process(rendered, tmp_path, api.url) as process:
            problem = process.ready(TIMEOUT_S, api)
            if problem is not None and "LoginError" not in problem:
                pytest.fail(problem)  # anything but the known defect is a real failure, not the expected one
            assert problem is None, problem
            client = Running(rendered, process.webhook_port, process.liveness_port)
            job = yaml.safe_load((ROOT / "examples" / "bad-tp16-h100.yaml").read_text())
            job["metadata"]["namespace"] = NAMESPACE
            response = _until(
                "the TrainingJob webhook of the process",
                lambda: client.review(
                    "validating/trainingjobs.meshscope.io",
                    job,
                    ("meshscope.io", "v1alpha1", "trainingjobs", "TrainingJob"),
                ),
            )
            assert any(w.startswith("tp-crosses-nvlink-domain: tp=16") for w in response["warnings"])
            assert process.process.poll() is None  # still running
    finally:
        api.close()

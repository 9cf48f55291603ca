"""Self-signed webhook certificates survive ``helm upgrade``: the chart's ``lookup`` of its Secret, for real.

Helm renders cluster-aware here (helm-python-sdk's ``Config.render``, what ``helm upgrade`` does before it applies):
its ``lookup`` asks a real HTTP API, kmock's Kubernetes emulator, for the Secret. A Secret from an earlier release
is reused whole, and the webhook configurations carry its CA; none, or one missing a key, gives a fresh pair.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import helm_python as helm
import pytest
import yaml

from charting import CHART, RELEASE, KmockApi, render

if TYPE_CHECKING:
    from collections.abc import Iterator

SECRET = f"{RELEASE}-meshscope-webhook-tls"


class _Api(KmockApi):
    """kmock serving Secrets, and Helm rendering against it."""

    def __init__(self) -> None:
        super().__init__({"v1/secrets": {"kind": "Secret", "namespaced": True, "verbs": {"get", "list"}}})

    def store_secret(self, namespace: str, data: dict[str, str]) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": SECRET, "namespace": namespace},
            "type": "kubernetes.io/tls",
            "data": data,
        }
        self.emulator.objects["v1/secrets", namespace, SECRET] = body

    def render_upgrade(self, namespace: str) -> dict[str, dict[str, Any]]:
        """The chart as ``helm upgrade`` renders it against this API: objects by kind."""
        config = helm.Config(kube_apiserver=self.url, kube_token="dummy", namespace=namespace)
        try:
            with helm.Chart.load(str(CHART)) as chart:
                manifests = config.render(chart, {}, name=RELEASE, namespace=namespace, is_upgrade=True)
        finally:
            config.close()
        text = manifests["meshscope/templates/webhook/configurations.yaml"]
        return {doc["kind"]: doc for doc in yaml.safe_load_all(text) if doc}


@pytest.fixture(scope="module")
def api() -> Iterator[_Api]:
    served = _Api()
    try:
        yield served
    finally:
        served.close()


def _ca_bundles(objects: dict[str, dict[str, Any]]) -> set[str]:
    return {
        w["clientConfig"]["caBundle"]
        for kind in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration")
        for w in objects[kind]["webhooks"]
    }


def test_an_upgrade_keeps_the_certificates_of_the_release(api: _Api) -> None:
    first = render(namespace="kept").one("Secret")  # what `helm install` created
    api.store_secret("kept", first["data"])
    upgraded = api.render_upgrade("kept")
    assert upgraded["Secret"]["data"] == first["data"]
    assert _ca_bundles(upgraded) == {first["data"]["ca.crt"]}


def test_without_a_secret_an_upgrade_makes_a_fresh_pair(api: _Api) -> None:
    objects = api.render_upgrade("fresh")
    data = objects["Secret"]["data"]
    assert base64.b64decode(data["ca.crt"]).startswith(b"-----BEGIN CERTIFICATE-----")
    assert base64.b64decode(data["tls.key"]).startswith(b"-----BEGIN RSA PRIVATE KEY-----")
    assert _ca_bundles(objects) == {data["ca.crt"]}


def test_a_secret_missing_a_key_is_replaced_not_half_reused(api: _Api) -> None:
    first = render(namespace="partial").one("Secret")
    api.store_secret("partial", {k: v for k, v in first["data"].items() if k != "tls.key"})
    objects = api.render_upgrade("partial")
    data = objects["Secret"]["data"]
    assert set(data) == {"ca.crt", "tls.crt", "tls.key"}
    assert data["ca.crt"] != first["data"]["ca.crt"]
    assert data["tls.crt"] != first["data"]["tls.crt"]
    assert _ca_bundles(objects) == {data["ca.crt"]}

"""A cluster without a cluster (the fixtures of tests/kube, importable by name): the emulated API server, the real kubectl, and the operator served against them.

- ``cluster``: a :class:`~kube_emulator.RunningEmulator` with the test namespace, and a :class:`~kube_emulator.
  kubectl.Kubectl` for it; the CRD is applied with ``kubectl apply --validate=false`` (what a user does).
- ``operator``: the operator's registry as ``meshscope-operator`` builds it, run by ``kopf.operator`` in a thread
  of its own (tests/operator_serving.py's recipe), logged in to the emulator (kopf and reconcile's own client), serving its webhooks over HTTPS
  (trustme certificates) and **managing** its webhook configurations (``webhook_managed``), so the emulator calls
  the webhooks because kopf registered them, as in a cluster. Stopped with its stop flag, within a deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import kopf
import pytest
import trustme

from kube_emulator import RunningEmulator
from kube_emulator.emulator import MUTATING, VALIDATING
from kube_emulator.kubectl import Kubectl
from meshscope_operator.admission import MUTATE_ID, VALIDATE_ID
from meshscope_operator.handlers import register
from meshscope_operator.settings import OperatorSettings
from operator_serving import TIMEOUT_S, _free_port, kopf_running

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

NAMESPACE = "training"
MANAGED = "meshscope.io"
CRD_FILE = "crds/trainingjobs.meshscope.io.yaml"


@dataclass(frozen=True)
class Cluster:
    """The emulator, kubectl for it, and what applying the CRD printed."""

    api: RunningEmulator
    kubectl: Kubectl
    crd_applied: Any


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    home = tmp_path_factory.mktemp("kubectl-home")
    api = RunningEmulator()
    try:
        api.call(lambda e: e.put("v1/namespaces", {"metadata": {"name": NAMESPACE}}))
        kubectl = Kubectl(api.kubeconfig(home / "kubeconfig", namespace=NAMESPACE), home)
        applied = kubectl.run("apply", "--validate=false", "-f", CRD_FILE)
        yield Cluster(api=api, kubectl=kubectl, crd_applied=applied)
    finally:
        api.close()


def _webhooks(cluster: Cluster) -> dict[str, list[str]]:
    def read(e: Any) -> dict[str, list[str]]:
        out = {}
        for kind, res in (("validating", VALIDATING), ("mutating", MUTATING)):
            key = (res, None, MANAGED)
            live = key in e.objects and not e.objects[key].deleted
            out[kind] = [w["name"] for w in e.objects[key].raw.get("webhooks") or ()] if live else []
        return out

    return cluster.api.call(read)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorSettings]:
    with running_operator(cluster, tmp_path_factory.mktemp("certs")) as settings:
        yield settings


@contextlib.contextmanager
def running_operator(cluster: Cluster, certs: Path, **overrides: Any) -> Iterator[OperatorSettings]:
    """The operator on ``cluster`` until the block ends (its webhooks registered when the block starts).

    Args:
        cluster: the emulated cluster (the CRD applied).
        certs: an empty directory for trustme's certificates.
        overrides: other :class:`OperatorSettings` fields (the cost tiers' store and intervals, the ports).
    """
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    issued.cert_chain_pems[0].write_to_path(str(certs / "tls.crt"))
    issued.private_key_pem.write_to_path(str(certs / "tls.key"))
    ca.cert_pem.write_to_path(str(certs / "ca.crt"))
    settings = OperatorSettings(
        webhook_addr="127.0.0.1",
        webhook_port=_free_port(),
        webhook_cert_file=str(certs / "tls.crt"),
        webhook_key_file=str(certs / "tls.key"),
        webhook_ca_file=str(certs / "ca.crt"),
        webhook_managed=MANAGED,
        liveness_port=0,
        namespaces=(NAMESPACE,),
        sidecar_image="registry.example/meshscope-sidecar:test",
        api_server=cluster.api.url,  # reconcile's own client (meshscope_operator.kubeapi) talks to the emulator
    )
    settings = dataclasses.replace(settings, **overrides)
    registry = kopf.OperatorRegistry()
    register(registry, settings)
    api_url = cluster.api.url

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=api_url, insecure=True, scheme="Bearer", token="dummy")

    with kopf_running(registry, namespace=NAMESPACE, name="kopf-on-emulator"):
        deadline = time.monotonic() + TIMEOUT_S
        wanted = {"validating": [f"{VALIDATE_ID}.{MANAGED}"], "mutating": [f"{MUTATE_ID}.{MANAGED}"]}
        while (found := _webhooks(cluster)) != wanted:
            if time.monotonic() > deadline:
                raise TimeoutError(f"kopf did not register its webhooks within {TIMEOUT_S} s: {found}")
            time.sleep(0.05)
        yield settings


def wait_reconciled(cluster: Cluster, name: str) -> dict[str, Any]:
    """The TrainingJob once reconcile has written its status for the current spec (observedGeneration)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        done = cluster.kubectl.run("get", "tj", name, "-o", "json")
        obj = json.loads(done.stdout) if done.returncode == 0 else {}
        status = obj.get("status") or {}
        if obj and status.get("observedGeneration") == obj["metadata"]["generation"]:
            return obj
        if time.monotonic() > deadline:
            raise TimeoutError(f"reconcile did not write the status of {name} within {TIMEOUT_S} s: {status}")
        time.sleep(0.05)


def write(tmp_path: Path, name: str, text: str) -> Path:
    """A manifest file for kubectl."""
    path = tmp_path / name
    path.write_text(text)
    return path

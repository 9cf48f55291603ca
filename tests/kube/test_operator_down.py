"""While the operator is down, its webhook configurations as kopf wrote them keep TrainingJobs out (fail closed) and
let pods in without the sidecar (fail open): docs/operator.md, "Fails closed" and "Fails open", through kubectl."""

from __future__ import annotations

import copy
import json

import yaml

from kube_emulator.emulator import MUTATING, VALIDATING
from kube_serving import NAMESPACE, Cluster, running_operator, write
from operator_serving import labelled_pod

BAD = "examples/bad-tp16-h100.yaml"


def _configurations(cluster: Cluster) -> list[dict]:
    def read(e) -> list[dict]:
        return [copy.deepcopy(e.objects[r, None, "meshscope.io"].raw) for r in (VALIDATING, MUTATING)]

    return cluster.api.call(read)


def test_without_the_operator_trainingjobs_are_refused_and_pods_run_without_the_sidecar(
    cluster: Cluster, tmp_path
) -> None:
    certs = tmp_path / "certs"
    certs.mkdir()
    with running_operator(cluster, certs):
        configurations = _configurations(cluster)
    policies = {w["name"]: w["failurePolicy"] for c in configurations for w in c["webhooks"]}
    assert policies == {"trainingjobs.meshscope.io": "Fail", "sidecar.meshscope.io": "Ignore"}
    # kopf empties its managed configurations when it stops; put them back as they were, the operator still down.
    for config in configurations:
        kind = config["kind"]
        manifest = {"apiVersion": config["apiVersion"], "kind": kind, "metadata": {"name": "meshscope.io"}}
        manifest["webhooks"] = config["webhooks"]
        done = cluster.kubectl.run(
            "apply", "--validate=false", "-f", str(write(tmp_path, f"{kind}.yaml", yaml.safe_dump(manifest)))
        )
        assert done.returncode == 0, done.stderr

    refused = cluster.kubectl.run("apply", "--validate=false", "-f", BAD)
    assert refused.returncode == 1
    assert (
        'Internal error occurred: failed calling webhook "trainingjobs.meshscope.io": failed to call webhook: '
        in refused.stderr
    )
    assert cluster.kubectl.run("get", "tj", "bad-tp16-h100").returncode == 1  # not stored

    pod = labelled_pod("bad-tp16-h100", name="worker-0")
    pod["metadata"]["namespace"] = NAMESPACE
    created = cluster.kubectl.run(
        "create", "--validate=false", "-f", str(write(tmp_path, "pod.yaml", yaml.safe_dump(pod)))
    )
    assert created.returncode == 0, created.stderr
    assert created.stdout == "pod/worker-0 created\n"
    stored = json.loads(cluster.kubectl.run("get", "pod", "worker-0", "-o", "json", check=True).stdout)
    assert "initContainers" not in stored["spec"]
    assert [c["name"] for c in stored["spec"]["containers"]] == ["trainer"]
    errors = cluster.api.call(lambda e: [(r.webhook, r.allowed, bool(r.error)) for r in e.reviews][-2:])
    assert errors == [("trainingjobs.meshscope.io", None, True), ("sidecar.meshscope.io", None, True)]

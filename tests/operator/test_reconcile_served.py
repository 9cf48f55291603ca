"""Reconcile served for real: kopf runs the operator against kmock (tests/operator_serving.py), the test plays the API
server's clients, the Job controller (it creates the Job's pods) and the scheduler (it binds them to nodes).

Expected values are derived by hand from the specs below or come from an independent path (``meshscope plan`` in a
subprocess, the sidecar's own placement reader).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

import yaml

from meshscope_operator.reconciling import PLACEMENT_RECHECK_S
from meshscope_sidecar.identity import IdentityInputs, read_placement, resolve_identity
from operator_serving import NAMESPACE, TIMEOUT_S, load_example, training_job

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from operator_serving import Served

TJ = f"/apis/meshscope.io/v1alpha1/namespaces/{NAMESPACE}/trainingjobs"
JOBS = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"
SERVICES = f"/api/v1/namespaces/{NAMESPACE}/services"
CONFIGMAPS = f"/api/v1/namespaces/{NAMESPACE}/configmaps"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
EVENTS = f"/api/v1/namespaces/{NAMESPACE}/events"
TEMPLATE = {
    "metadata": {"labels": {"team": "llm"}},
    "spec": {
        "containers": [
            {
                "name": "trainer",
                "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                "command": ["torchrun", "train.py"],
                "env": [{"name": "MASTER_PORT", "value": "12345"}],
            }
        ]
    },
}


def wait_for(what: str, probe: Callable[[], Any]) -> Any:
    """Poll ``probe`` until it returns something truthy; fail after :data:`TIMEOUT_S`."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {TIMEOUT_S} s waiting for {what}")
        time.sleep(0.05)


def get(served: Served, path: str) -> dict[str, Any] | None:
    status, body = served.api("GET", path)
    return body if status == 200 else None


def create(served: Served, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    obj = training_job(name, spec)
    status, _ = served.api("POST", TJ, obj)
    assert status in (200, 201), status
    return obj


def planned(served: Served, name: str, generation: int = 1) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        obj = get(served, f"{TJ}/{name}")
        status = (obj or {}).get("status") or {}
        done = status.get("observedGeneration") == generation and status.get("phase")
        ready = any(c["type"] in ("Ready", "Planned") for c in status.get("conditions", []))
        return obj if done and ready else None

    return wait_for(f"status of {name} at generation {generation}", probe)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == kind)


def cli_plan(tmp_path: Path, manifest: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return subprocess.run(
        [sys.executable, "-m", "meshscope", "plan", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S * 2,
        check=False,
    )


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_a_trainingjob_gets_its_job_service_and_the_plan_in_status(served: Served, tmp_path: Path) -> None:
    spec = copy.deepcopy(load_example("llama3-8b-h100")["spec"]) | {"template": TEMPLATE}
    obj = create(served, "llama-a", spec)
    uid = obj["metadata"]["uid"]
    job = wait_for("the Job", lambda: get(served, f"{JOBS}/llama-a"))
    service = wait_for("the Service", lambda: get(served, f"{SERVICES}/llama-a"))
    owner = {
        "apiVersion": "meshscope.io/v1alpha1",
        "kind": "TrainingJob",
        "name": "llama-a",
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    assert job["metadata"]["ownerReferences"] == [owner]
    assert service["metadata"]["ownerReferences"] == [owner]
    # 8 nodes of 8 H100s (the example): one pod per node.
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 8
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {
        "meshscope.io/trainingjob": "llama-a",
        "batch.kubernetes.io/job-name": "llama-a",
    }
    pod = job["spec"]["template"]
    assert pod["metadata"]["labels"] == {"team": "llm", "meshscope.io/trainingjob": "llama-a"}
    assert pod["spec"]["subdomain"] == "llama-a"
    assert pod["spec"]["restartPolicy"] == "Never"
    [sidecar] = pod["spec"]["initContainers"]
    assert sidecar["name"] == "meshscope-sidecar"
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == served.settings.sidecar_image
    index = {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    side_env = env_of(sidecar)
    assert side_env["MESHSCOPE_JOB"] == "llama-a"
    assert side_env["MESHSCOPE_LAYOUT"] == "dp=32,tp=2,pp=1,cp=1,ep=1"  # 64 GPUs / tp 2
    assert side_env["MESHSCOPE_GPUS_PER_NODE"] == "8"
    assert side_env["MESHSCOPE_NODE_RANK"] == index
    assert side_env["MESHSCOPE_PLACEMENT_FILE"] == "/etc/meshscope/placement/placement.json"
    [trainer] = pod["spec"]["containers"]
    env = env_of(trainer)
    assert env["WORLD_SIZE"] == "64"
    assert env["NNODES"] == env["PET_NNODES"] == "8"
    assert env["NPROC_PER_NODE"] == env["PET_NPROC_PER_NODE"] == "8"
    assert env["NODE_RANK"] == env["PET_NODE_RANK"] == index
    assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == f"llama-a-0.llama-a.{NAMESPACE}.svc"
    assert env["MASTER_PORT"] == "12345"  # the template's own value is kept
    assert env["PET_MASTER_PORT"] == "29500"
    assert env["MESHSCOPE_COLLECTOR"] == "unix:/run/meshscope/records.sock"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["meshscope-placement"]["configMap"]["name"] == "llama-a-placement"
    assert "meshscope-run" in volumes

    # The status, against `meshscope plan --json` of the same manifest (another process, the CLI's path).
    stored = planned(served, "llama-a")
    manifest = {k: stored[k] for k in ("apiVersion", "kind", "spec")} | {"metadata": {"name": "llama-a"}}
    cli = cli_plan(tmp_path, manifest)
    assert cli.returncode == 0, cli.stderr
    expected = json.loads(cli.stdout)
    loaded = max(expected["stages"], key=lambda s: s["memory_bytes"]["total"])
    status = stored["status"]
    # The Job exists and its controller has reported nothing yet (nobody plays it in this test).
    assert status["phase"] == "Pending"
    assert status["observedGeneration"] == 1
    assert status["worldSize"] == 64
    assert status["layout"] == "dp32-tp2"
    assert status["plan"] == {
        "peakMemoryBytesPerGpu": loaded["memory_bytes"]["total"],
        "headroomBytes": loaded["headroom_bytes"],
        "expectedStepSeconds": expected["expected_step_seconds"]["total"],
        "bubbleFraction": expected["bubble_fraction"],
        "flopsPerStep": expected["flops_per_step"],
    }
    assert status["findings"] == len(expected["findings"])
    assert status["findingsList"] == expected["findings"][:20]
    assert condition(stored, "Planned")["status"] == "True"
    assert condition(stored, "Ready")["status"] == "True"
    assert condition(stored, "RestartRequired")["status"] == "False"
    running = condition(stored, "Running")
    assert (running["status"], running["reason"]) == ("False", "NotStarted")
    assert not {"reconcile", "kopf"} & set(status), "kopf's progress belongs in annotations"


def test_an_unplannable_spec_is_invalid_once_and_not_retried(served: Served, tmp_path: Path) -> None:
    spec = copy.deepcopy(load_example("llama3-8b-h100")["spec"])
    spec["parallelism"]["tp"] = 3  # 32 heads do not divide by 3: the loader refuses it
    create(served, "tp3-invalid", spec)
    stored = wait_for(
        "phase Invalid",
        lambda: (o := get(served, f"{TJ}/tp3-invalid")) and (o.get("status") or {}).get("phase") == "Invalid" and o,
    )
    cli = cli_plan(
        tmp_path,
        {
            "apiVersion": stored["apiVersion"],
            "kind": "TrainingJob",
            "metadata": {"name": "tp3-invalid"},
            "spec": stored["spec"],
        },
    )
    assert cli.returncode != 0
    message = cli.stderr.strip().removeprefix("meshscope: error: ")
    planned_condition = condition(stored, "Planned")
    assert planned_condition["status"] == "False"
    assert planned_condition["reason"] == "InvalidSpec"
    assert planned_condition["message"] == message
    assert "spec.parallelism" in message
    assert "worldSize" not in stored["status"]
    # kopf is done with this spec: the change is recorded as handled, and no progress (no retry) is left pending.
    annotations = wait_for(
        "kopf's diff-base annotation",
        lambda: (
            (a := (get(served, f"{TJ}/tp3-invalid") or {}).get("metadata", {}).get("annotations", {}))
            and "meshscope.io/last-handled-configuration" in a
            and a
        ),
    )
    assert "meshscope.io/reconcile" not in annotations
    assert wait_for("no Job", lambda: get(served, f"{JOBS}/tp3-invalid") is None)

    def touching() -> int:
        return sum(1 for _, path in served.requests() if path.startswith(f"{TJ}/tp3-invalid"))

    before = touching()
    # A barrier: another TrainingJob reconciled end to end after this one failed.
    create(served, "barrier", copy.deepcopy(load_example("llama3-8b-h100")["spec"]) | {"template": TEMPLATE})
    planned(served, "barrier")
    assert touching() == before


def test_a_trainingjob_without_a_template_is_a_plan_to_read(served: Served) -> None:
    # The shipped examples have no pod template; applied as the chart's notes suggest, each was Invalid
    # ("InvalidTemplate: spec.template.spec.containers: missing"). It is a plan to read: planned, nothing run.
    create(served, "plan-only", copy.deepcopy(load_example("llama3-8b-h100")["spec"]))
    stored = planned(served, "plan-only")
    assert stored["status"]["phase"] == "Planned"
    assert stored["status"]["worldSize"] == 64
    assert condition(stored, "Planned")["status"] == "True"
    ready = condition(stored, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NoTemplate")
    assert ready["message"].startswith("no spec.template: the job is planned only")
    # A barrier: another TrainingJob reconciled end to end after this one, which made no Job and no Service.
    create(served, "barrier-2", copy.deepcopy(load_example("llama3-8b-h100")["spec"]) | {"template": TEMPLATE})
    planned(served, "barrier-2")
    assert get(served, f"{JOBS}/plan-only") is None
    assert get(served, f"{SERVICES}/plan-only") is None
    # a template given but broken is still invalid
    broken = copy.deepcopy(load_example("llama3-8b-h100")["spec"]) | {"template": {"spec": {"containers": []}}}
    create(served, "broken-template", broken)
    invalid = wait_for(
        "phase Invalid",
        lambda: (o := get(served, f"{TJ}/broken-template")) and (o.get("status") or {}).get("phase") == "Invalid" and o,
    )
    assert condition(invalid, "Ready")["reason"] == "InvalidTemplate"


def test_reconcile_again_creates_nothing_twice_and_a_layout_change_needs_a_restart(served: Served) -> None:
    spec = copy.deepcopy(load_example("llama3-8b-h100")["spec"]) | {"template": TEMPLATE}
    create(served, "twice", spec)
    first = planned(served, "twice")
    job_before = get(served, f"{JOBS}/twice")

    # The same handler run again on the stored object (what kopf does on resume after a restart).
    import asyncio  # noqa: PLC0415

    from meshscope_operator.kubeapi import KubeApi  # noqa: PLC0415
    from meshscope_operator.reconciling import reconcile_training_job  # noqa: PLC0415

    status: dict[str, Any] = {}

    async def again() -> None:
        api = KubeApi(served.api_url)
        try:
            await reconcile_training_job(api, first, status, served.settings)
        finally:
            await api.close()

    asyncio.run(asyncio.wait_for(again(), TIMEOUT_S))
    assert status["conditions"] == first["status"]["conditions"]  # same times: nothing flipped
    assert get(served, f"{JOBS}/twice") == job_before
    creates = [
        path
        for method, path, data in _requests(served)
        if method == "POST" and path in (JOBS, SERVICES) and data.get("metadata", {}).get("name") == "twice"
    ]
    # Job and Service: each created once by kopf's run and once more by the re-run (answered 409, then read).
    assert sorted(creates) == sorted([JOBS, SERVICES, JOBS, SERVICES])
    assert sum(1 for m, p in served.requests() if m == "GET" and p == f"{JOBS}/twice") >= 1

    # A spec change that changes the layout: the Job stays as it is, the status says a restart is needed.
    patch = {"metadata": {"generation": 2}, "spec": {"parallelism": {"tp": 4}}}
    assert served.api("PATCH", f"{TJ}/twice", patch)[0] == 200
    second = planned(served, "twice", generation=2)
    assert second["status"]["layout"] == "dp16-tp4"
    restart = condition(second, "RestartRequired")
    assert restart["status"] == "True"
    assert restart["reason"] == "SpecChanged"
    assert get(served, f"{JOBS}/twice") == job_before


def _requests(served: Served) -> list[tuple[str, str, dict[str, Any]]]:
    async def snapshot() -> list[tuple[str, str, dict[str, Any]]]:
        return [
            (str(r.method.value).upper(), r.url.path, r.data if isinstance(r.data, dict) else {}) for r in served.mock
        ]

    return list(served.mock_loop.run(snapshot()))


GB200_SPEC: dict[str, Any] = {
    # 4 GB200 trays of 4 GPUs: 16 GPUs, tp 8 spans two trays; the default placement puts all 16 in one 72-GPU
    # NVLink domain, so the plan has no tp finding.
    "model": {"preset": "llama3-8b"},
    "parallelism": {"tp": 8, "sequenceParallel": True},
    "training": {"globalBatchSize": 16},
    "hardware": {"gpu": "GB200", "nodes": 4},
    "template": TEMPLATE,
}
CLIQUE = "nvidia.com/gpu.clique"
LEAF = "network.topology.nvidia.com/leaf"


def test_scheduled_pods_give_a_placement_the_sidecar_reads_and_one_event(served: Served, tmp_path: Path) -> None:
    tj = create(served, "gb-small", copy.deepcopy(GB200_SPEC))
    job = wait_for("the Job", lambda: get(served, f"{JOBS}/gb-small"))
    # Nodes: tray 0 in clique c1, trays 1-3 in clique c2, so TP group 0 (ranks 0-7: pods 0 and 1) crosses domains.
    cliques = {"tray-a": "uuid.1", "tray-b": "uuid.2", "tray-c": "uuid.2", "tray-d": "uuid.2"}
    for node, clique in cliques.items():
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": node, "labels": {CLIQUE: clique, LEAF: "leaf-1"}},
        }
        assert served.api("POST", "/api/v1/nodes", body)[0] in (200, 201)
    # The Job controller's pods, not yet scheduled.
    template = job["spec"]["template"]
    for i in range(4):
        pod = copy.deepcopy(template)
        pod["metadata"] = {
            "name": f"gb-small-{i}-x{uuid.uuid4().hex[:5]}",
            "namespace": NAMESPACE,
            "labels": {**template["metadata"]["labels"], "batch.kubernetes.io/job-name": "gb-small"},
            "annotations": {"batch.kubernetes.io/job-completion-index": str(i)},
        }
        assert served.api("POST", PODS, {"apiVersion": "v1", "kind": "Pod", **pod})[0] in (200, 201)
    _, pods = served.api("GET", PODS)
    names = sorted(p["metadata"]["name"] for p in pods["items"] if p["metadata"]["name"].startswith("gb-small-"))
    assert get(served, f"{CONFIGMAPS}/gb-small-placement") is None  # nothing is published before every pod is bound
    # The scheduler binds them: pod i to tray i.
    for name, node in zip(names, cliques, strict=True):
        assert served.api("PATCH", f"{PODS}/{name}", {"spec": {"nodeName": node}})[0] == 200
    cm = wait_for("the placement ConfigMap", lambda: get(served, f"{CONFIGMAPS}/gb-small-placement"))
    assert cm["metadata"]["ownerReferences"][0]["uid"] == tj["metadata"]["uid"]
    placement_file = tmp_path / "placement.json"
    placement_file.write_text(cm["data"]["placement.json"])

    # The sidecar's own reader, as the sidecar on tray-b would read the mounted file.
    nodes = read_placement(placement_file, world_size=16)
    assert {n: (e.ranks, e.nvlink_domain, e.network_tier) for n, e in nodes.items()} == {
        "tray-a": ((0, 1, 2, 3), "uuid.1", "leaf-1"),
        "tray-b": ((4, 5, 6, 7), "uuid.2", "leaf-1"),
        "tray-c": ((8, 9, 10, 11), "uuid.2", "leaf-1"),
        "tray-d": ((12, 13, 14, 15), "uuid.2", "leaf-1"),
    }
    identity = resolve_identity(
        IdentityInputs(
            job="gb-small",
            node_name="tray-b",
            layout="dp=2,tp=8,pp=1,cp=1,ep=1",
            gpus_per_node="4",
            placement_file=str(placement_file),
        )
    )
    assert identity.mode.value == "full"
    assert [g.rank for g in identity.gpus] == [4, 5, 6, 7]
    assert identity.nvlink_domain == "uuid.2"

    def placement_events() -> list[dict[str, Any]]:
        return [
            r[2]
            for r in _requests(served)
            if r[0] == "POST"
            and r[1] == EVENTS
            and r[2].get("reason") == "PlacementFinding"
            and r[2].get("involvedObject", {}).get("name") == "gb-small"
        ]

    [event] = wait_for("the placement Event", placement_events)
    assert event["type"] == "Warning"
    assert "tp-crosses-nvlink-domain" in event["message"]
    findings = json.loads(cm["data"]["findings.json"])
    assert findings["raised"] == ["tp-crosses-nvlink-domain"]

    # Pod events that leave every index on its node (containers starting, becoming ready) read no node: a large
    # Job's start is several events per pod, and a publication reads every node. Then pod 3 is replaced on another
    # node (tray-e, another leaf): published again, reading the four nodes once, and no second Event.
    def node_reads() -> int:
        return sum(1 for r in _requests(served) if r[0] == "GET" and r[1].startswith("/api/v1/nodes/"))

    reads, since = node_reads(), time.monotonic()
    for touch in range(4):
        patch = {"metadata": {"annotations": {"touched": str(touch)}}}
        assert served.api("PATCH", f"{PODS}/{names[0]}", patch)[0] == 200
    tray_e = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "tray-e", "labels": {CLIQUE: "uuid.2", LEAF: "leaf-2"}},
    }
    assert served.api("POST", "/api/v1/nodes", tray_e)[0] in (200, 201)
    _, old = served.api("GET", f"{PODS}/{names[3]}")
    new = copy.deepcopy(old)
    new["metadata"] = {k: v for k, v in old["metadata"].items() if k in ("namespace", "labels", "annotations")}
    new["metadata"]["name"] = f"gb-small-3-x{uuid.uuid4().hex[:5]}"
    new["spec"]["nodeName"] = "tray-e"
    assert served.api("POST", PODS, new)[0] in (200, 201)
    assert served.api("DELETE", f"{PODS}/{names[3]}")[0] == 200
    wait_for(
        "the republished placement",
        lambda: (
            "tray-e"
            in ((get(served, f"{CONFIGMAPS}/gb-small-placement") or {}).get("data") or {}).get("placement.json", "")
        ),
    )
    # The re-check timer reads the nodes too, every PLACEMENT_RECHECK_S: allow its ticks (none, on a test that runs
    # well under 30 s); a publication per touch would have read 16 more.
    ticks = 1 + int((time.monotonic() - since) // PLACEMENT_RECHECK_S)
    assert 4 <= node_reads() - reads <= 4 * (1 + ticks)
    assert len(placement_events()) == 1

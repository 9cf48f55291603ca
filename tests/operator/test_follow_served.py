"""Following the children, served for real: kopf runs the operator against kmock (tests/operator_serving.py); the test
plays the Job controller (it patches the Job's status), the scheduler (it binds pods), the garbage collector and a
user deleting children, and the cost tiers (it writes their status fields).

Expected phases and messages are written out by hand from the Job statuses the test sets.
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import TYPE_CHECKING, Any

from meshscope_operator.reconciling import FIRST_RETRY_S
from operator_serving import NAMESPACE, TIMEOUT_S, load_example, training_job

if TYPE_CHECKING:
    from collections.abc import Callable

    from operator_serving import Served

TJ = f"/apis/meshscope.io/v1alpha1/namespaces/{NAMESPACE}/trainingjobs"
JOBS = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"
SERVICES = f"/api/v1/namespaces/{NAMESPACE}/services"
CONFIGMAPS = f"/api/v1/namespaces/{NAMESPACE}/configmaps"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
TEMPLATE = {"spec": {"containers": [{"name": "trainer", "image": "trainer:1", "command": ["torchrun", "train.py"]}]}}
START = "2026-03-01T10:00:00Z"
# What the cost tiers write (another helper's fields): a follower's status patch must leave them as they are.
COST_FIELDS = {
    "stepTimeSeconds": 6.25,
    "topCost": "exposed comm dp (31 %)",
    "costTable": [
        {"category": "compute", "expectedSeconds": 4.1, "measuredSeconds": 4.3, "shareOfStep": 0.69},
        {"category": "exposed comm dp", "measuredSeconds": 1.95, "shareOfStep": 0.31, "suspect": "rank 5 on node-0"},
    ],
    "costTableRef": "follow-costs",
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


def create(served: Served, name: str, spec: dict[str, Any], **meta: Any) -> dict[str, Any]:
    obj = training_job(name, spec)
    obj["metadata"].update(meta)
    status, _ = served.api("POST", TJ, obj)
    assert status in (200, 201), status
    return obj


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or ():
        if c["type"] == kind:
            return dict(c)
    return {}


def running_is(served: Served, name: str, reason: str) -> dict[str, Any]:
    """Wait until TrainingJob ``name``'s Running condition has ``reason``; the TrainingJob."""
    return wait_for(
        f"Running {reason} on {name}",
        lambda: (o := get(served, f"{TJ}/{name}")) and condition(o, "Running").get("reason") == reason and o,
    )


def requests(served: Served) -> list[tuple[str, str, Any]]:
    async def snapshot() -> list[tuple[str, str, Any]]:
        return [(str(r.method.value).upper(), r.url.path, r.data) for r in served.mock]

    return list(served.mock_loop.run(snapshot()))


def creates_of(served: Served, collection: str, name: str) -> int:
    return sum(
        1
        for m, p, d in requests(served)
        if m == "POST" and p == collection and isinstance(d, dict) and d.get("metadata", {}).get("name") == name
    )


def small_spec() -> dict[str, Any]:
    return copy.deepcopy(load_example("llama3-8b-h100")["spec"]) | {"template": copy.deepcopy(TEMPLATE)}


def test_the_jobs_run_moves_the_phase_and_leaves_the_cost_tiers_fields_alone(served: Served) -> None:
    create(served, "follow", small_spec())  # 8 nodes of 8 H100s: 8 pods
    pending = running_is(served, "follow", "NotStarted")
    assert pending["status"]["phase"] == "Pending"
    # The cost tiers write their fields (as they would, merge-patching the status).
    assert served.api("PATCH", f"{TJ}/follow/status", {"status": copy.deepcopy(COST_FIELDS)})[0] == 200

    def controller_reports(status: dict[str, Any]) -> None:
        assert served.api("PATCH", f"{JOBS}/follow", {"status": status})[0] == 200

    steps = [
        ({"startTime": START, "active": 8, "ready": 3}, "Pending", "PodsNotReady", "3 of 8 pods ready, 8 active"),
        ({"ready": 8}, "Running", "AllPodsReady", "8 of 8 pods ready, 8 active"),
        ({"ready": 7, "failed": 1}, "Pending", "PodsNotReady", "7 of 8 pods ready, 8 active, 1 failed so far"),
        (
            {
                "active": 0,
                "ready": 0,
                "succeeded": 8,
                "completionTime": "2026-03-01T13:20:00Z",
                "conditions": [{"type": "Complete", "status": "True", "lastTransitionTime": "2026-03-01T13:20:00Z"}],
            },
            "Succeeded",
            "Succeeded",
            "Job follow succeeded: 8 of 8 pods completed, 12,000 s from start to completion",  # 3 h 20 min
        ),
    ]
    for job_status, phase, reason, message in steps:
        controller_reports(job_status)
        tj = wait_for(
            f"phase {phase} ({reason})",
            lambda r=reason, m=message: (
                (o := get(served, f"{TJ}/follow"))
                and (condition(o, "Running").get("reason"), condition(o, "Running").get("message")) == (r, m)
                and o
            ),
        )
        status = tj["status"]
        assert status["phase"] == phase
        assert condition(tj, "Running")["status"] == ("True" if phase == "Running" else "False")
        assert {k: status[k] for k in COST_FIELDS} == COST_FIELDS
        assert condition(tj, "Planned")["status"] == "True"  # reconcile's conditions are kept
        assert condition(tj, "Ready")["reason"] == "ChildrenCreated"

    # Every status write of the operator's that follows the Job names the resourceVersion and holds phase and
    # conditions only; none carries a cost tier's field.
    status_writes = [d for m, p, d in requests(served) if m == "PATCH" and p == f"{TJ}/follow/status"]
    followers = [d for d in status_writes if set(d["status"]) == {"phase", "conditions"}]
    assert len(followers) >= len(steps)
    assert all(d["metadata"]["resourceVersion"] for d in followers)
    assert not any(set(COST_FIELDS) & set(d["status"]) for d in status_writes if d["status"].get("phase"))

    # The finished Job is deleted (by hand or its TTL): it is not made again, which would re-run the training.
    assert served.api("DELETE", f"{JOBS}/follow")[0] == 200
    gone = wait_for(
        "Ready RunFinished",
        lambda: (o := get(served, f"{TJ}/follow")) and condition(o, "Ready").get("reason") == "RunFinished" and o,
    )
    assert gone["status"]["phase"] == "Succeeded"
    assert {k: gone["status"][k] for k in COST_FIELDS} == COST_FIELDS  # reconcile's own status patch kept them too
    assert "not made again for the same spec" in condition(gone, "Ready")["message"]
    assert get(served, f"{JOBS}/follow") is None
    assert creates_of(served, JOBS, "follow") == 1


def test_a_deleted_job_service_and_placement_configmap_come_back(served: Served) -> None:
    spec = {
        "model": {"preset": "llama3-8b"},
        "parallelism": {"tp": 4},
        "training": {"globalBatchSize": 16},
        "hardware": {"gpu": "GB200", "nodes": 2},  # 2 trays of 4 GPUs: 2 pods
        "template": copy.deepcopy(TEMPLATE),
    }
    tj = create(served, "keep", spec)
    uid = tj["metadata"]["uid"]
    job = wait_for("the Job", lambda: get(served, f"{JOBS}/keep"))
    wait_for("the Service", lambda: get(served, f"{SERVICES}/keep"))
    for i in range(2):
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"keep-tray-{i}", "labels": {}}}
        assert served.api("POST", "/api/v1/nodes", node)[0] in (200, 201)
        pod = copy.deepcopy(job["spec"]["template"])
        pod["metadata"] = {
            "name": f"keep-{i}-{uuid.uuid4().hex[:5]}",
            "namespace": NAMESPACE,
            "labels": pod["metadata"]["labels"],
            "annotations": {"batch.kubernetes.io/job-completion-index": str(i)},
        }
        pod["spec"]["nodeName"] = f"keep-tray-{i}"
        assert served.api("POST", PODS, {"apiVersion": "v1", "kind": "Pod", **pod})[0] in (200, 201)
    placement = wait_for("the placement", lambda: get(served, f"{CONFIGMAPS}/keep-placement"))

    for path, collection, name in (
        (f"{SERVICES}/keep", SERVICES, "keep"),
        (f"{JOBS}/keep", JOBS, "keep"),
        (f"{CONFIGMAPS}/keep-placement", CONFIGMAPS, "keep-placement"),
    ):
        before = creates_of(served, collection, name)
        assert served.api("DELETE", path)[0] == 200
        back = wait_for(f"{path} made again", lambda p=path: get(served, p))
        assert back["metadata"]["ownerReferences"][0]["uid"] == uid
        assert creates_of(served, collection, name) == before + 1  # made once again, not in a loop
    assert get(served, f"{CONFIGMAPS}/keep-placement")["data"] == placement["data"]
    assert get(served, f"{JOBS}/keep")["spec"] == job["spec"]


def test_the_children_of_a_trainingjob_being_deleted_are_not_made_again(served: Served) -> None:
    # Another controller's finalizer holds the TrainingJob in deletion, as the garbage collector removes its children.
    create(served, "going", small_spec(), finalizers=["example.com/hold"])
    wait_for("the Job", lambda: get(served, f"{JOBS}/going"))
    wait_for("the Service", lambda: get(served, f"{SERVICES}/going"))
    assert served.api("DELETE", f"{TJ}/going")[0] == 200
    assert (get(served, f"{TJ}/going") or {}).get("metadata", {}).get("deletionTimestamp")

    def reads() -> int:
        return sum(1 for m, p, _ in requests(served) if m == "GET" and p == f"{TJ}/going")

    before = reads()
    assert served.api("DELETE", f"{JOBS}/going")[0] == 200
    assert served.api("DELETE", f"{SERVICES}/going")[0] == 200
    # The operator looked (one read of the TrainingJob per deleted child) ...
    wait_for("the operator's reads of the TrainingJob", lambda: reads() >= before + 2)
    # ... and, after a barrier (another TrainingJob's deleted Service made again), has made nothing.
    create(served, "barrier", small_spec())
    wait_for("the barrier's Service", lambda: get(served, f"{SERVICES}/barrier"))
    assert served.api("DELETE", f"{SERVICES}/barrier")[0] == 200
    wait_for("the barrier's Service again", lambda: get(served, f"{SERVICES}/barrier"))
    assert get(served, f"{JOBS}/going") is None
    assert get(served, f"{SERVICES}/going") is None
    assert creates_of(served, JOBS, "going") == 1
    assert creates_of(served, SERVICES, "going") == 1


def test_a_recreation_that_keeps_failing_backs_off_and_says_why(served: Served) -> None:
    create(served, "flaky", small_spec())
    wait_for("the Job", lambda: get(served, f"{JOBS}/flaky"))
    served.mock.faults[("POST", JOBS)] = 503
    try:
        started = time.monotonic()
        assert served.api("DELETE", f"{JOBS}/flaky")[0] == 200
        failing = wait_for(
            "Ready ApiError",
            lambda: (o := get(served, f"{TJ}/flaky")) and condition(o, "Ready").get("reason") == "ApiError" and o,
        )
        ready = condition(failing, "Ready")
        assert ready["status"] == "False"
        assert ready["message"] == f"POST {JOBS}: HTTP 503: injected fault 503"
    finally:
        del served.mock.faults[("POST", JOBS)]
    back = wait_for("the Job made again", lambda: get(served, f"{JOBS}/flaky"))
    elapsed_s = time.monotonic() - started
    assert back["metadata"]["labels"]["meshscope.io/trainingjob"] == "flaky"
    wait_for(
        "Ready ChildrenCreated",
        lambda: condition(get(served, f"{TJ}/flaky"), "Ready").get("reason") == "ChildrenCreated",
    )
    # One create refused, then one per retry: the first after 5 s, the next 10 s later, ... However slow this
    # machine, no more than that in the time it took (a loop would make hundreds).
    attempts = creates_of(served, JOBS, "flaky") - 1  # the first, before the deletion
    assert attempts >= 2
    assert attempts <= 2 + elapsed_s / FIRST_RETRY_S


def test_the_children_are_watched_with_the_label_selector_only(served: Served) -> None:
    async def watches() -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        for r in served.mock:
            if r.url.query.get("watch") == "true":
                found.setdefault(r.url.path, set()).add(r.url.query.get("labelSelector", ""))
        return found

    found = served.mock_loop.run(watches())
    for collection in (JOBS, SERVICES, CONFIGMAPS, PODS):
        assert found.get(collection) == {"meshscope.io/trainingjob"}, (collection, found)

"""The Job's run as the TrainingJob's phase (meshscope_operator.runs), the status patch that follows it, and the
keeper's backoff; pure, with the expected values written out by hand from the Job statuses below."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshscope_operator.following import ChildKeeper, is_going, job_status_patch, trainingjob_key
from meshscope_operator.kubeapi import ApiError, KubeApi
from meshscope_operator.reconciling import PlacementPublisher
from meshscope_operator.runs import finished_run, job_progress
from meshscope_operator.settings import OperatorSettings
from meshscope_operator.statuses import Phase

START = "2026-01-01T00:00:00Z"


def _job(status: dict[str, Any] | None = None, *, suspend: bool = False, completions: int = 16) -> dict[str, Any]:
    job: dict[str, Any] = {
        "metadata": {"name": "big", "namespace": "ml", "labels": {"meshscope.io/trainingjob": "big"}},
        "spec": {"completions": completions, "parallelism": completions, "suspend": suspend},
    }
    if status is not None:
        job["status"] = status
    return job


CASES = [
    pytest.param(
        None,
        Phase.PENDING,
        False,
        "NotStarted",
        "Job big has no pods yet: the Job controller has not started its 16 pods",
        id="just-created",
    ),
    pytest.param(
        {"startTime": START, "active": 14, "ready": 12, "failed": 2},
        Phase.PENDING,
        False,
        "PodsNotReady",
        "12 of 16 pods ready, 14 active, 2 failed so far",
        id="some-ready",
    ),
    pytest.param(
        {"startTime": START, "active": 16, "ready": 16, "terminating": 1},
        Phase.RUNNING,
        True,
        "AllPodsReady",
        "16 of 16 pods ready, 16 active, 1 terminating",
        id="all-ready",
    ),
    pytest.param(
        {"startTime": START, "active": 16},
        Phase.RUNNING,
        True,
        "AllPodsReady",
        "16 of 16 pods active (this cluster reports no ready count)",
        id="no-ready-count",
    ),
    pytest.param(
        {
            "startTime": START,
            "completionTime": "2026-01-01T02:00:30Z",
            "succeeded": 16,
            "conditions": [{"type": "Complete", "status": "True"}],
        },
        Phase.SUCCEEDED,
        False,
        "Succeeded",
        "Job big succeeded: 16 of 16 pods completed, 7,230 s from start to completion",  # 2 h 30 s
        id="complete",
    ),
    pytest.param(
        {"startTime": START, "succeeded": 16, "conditions": [{"type": "SuccessCriteriaMet", "status": "True"}]},
        Phase.SUCCEEDED,
        False,
        "Succeeded",
        "Job big succeeded: 16 of 16 pods completed",
        id="success-criteria-met",
    ),
    pytest.param(
        {
            "startTime": START,
            "failed": 7,
            "succeeded": 0,
            "active": 9,
            "conditions": [
                {"type": "Complete", "status": "False"},
                {
                    "type": "FailureTarget",
                    "status": "True",
                    "reason": "BackoffLimitExceeded",
                    "message": "Job has reached the specified backoff limit",
                },
            ],
        },
        Phase.FAILED,
        False,
        "Failed",
        "Job big failed (BackoffLimitExceeded: Job has reached the specified backoff limit): 7 pods failed, 0 of 16 "
        "completed",
        id="failure-target",
    ),
    pytest.param(
        {"conditions": [{"type": "Suspended", "status": "True"}]},
        Phase.PENDING,
        False,
        "Suspended",
        "Job big is suspended (spec.suspend): 0 of 16 pods active",
        id="suspended",
    ),
]


@pytest.mark.parametrize(("status", "phase", "running", "reason", "message"), CASES)
def test_a_jobs_status_gives_the_phase_and_the_running_condition(
    status: dict[str, Any] | None, phase: Phase, running: bool, reason: str, message: str
) -> None:
    progress = job_progress(_job(status), 16)
    assert progress.phase is phase
    assert (progress.running.status, progress.running.reason, progress.running.message) == (running, reason, message)
    assert progress.finished is (phase in (Phase.SUCCEEDED, Phase.FAILED))


def test_a_suspended_spec_is_pending_even_before_the_controller_says_so() -> None:
    assert job_progress(_job(None, suspend=True), 16).running.reason == "Suspended"


_JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 10**12), st.text(max_size=8), st.lists(st.integers(), max_size=2)
)


@settings(max_examples=300, deadline=None)
@given(
    status=st.one_of(
        _JUNK,
        st.fixed_dictionaries(
            {},
            optional=dict.fromkeys(
                ("active", "ready", "succeeded", "failed", "terminating", "startTime", "completionTime"), _JUNK
            )
            | {
                "conditions": st.lists(
                    st.fixed_dictionaries(
                        {
                            "type": st.sampled_from(["Complete", "Failed", "Suspended", "FailureTarget", "X"]),
                            "status": st.sampled_from(["True", "False", "Unknown", 1]),
                        },
                        optional={"reason": _JUNK, "message": _JUNK},
                    ),
                    max_size=3,
                )
                | _JUNK
            },
        ),
    ),
    nodes=st.integers(1, 4096),
)
def test_any_stored_job_status_gives_a_phase_never_an_exception(status: Any, nodes: int) -> None:
    job = _job(None)
    job["status"] = status
    progress = job_progress(job, nodes)
    assert progress.phase in {Phase.PENDING, Phase.RUNNING, Phase.SUCCEEDED, Phase.FAILED}
    assert progress.running.status is (progress.phase is Phase.RUNNING)
    assert 0 < len(progress.running.message) <= 2048


def _tj(conditions: list[dict[str, Any]], *, generation: int = 3, phase: str = "Running") -> dict[str, Any]:
    return {
        "metadata": {"name": "big", "namespace": "ml", "uid": "u1", "generation": generation, "resourceVersion": "7"},
        "status": {"phase": phase, "conditions": conditions, "costTable": [{"category": "compute"}]},
    }


def _cond(kind: str, status: str, reason: str, generation: int = 3) -> dict[str, Any]:
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": "m",
        "lastTransitionTime": START,
        "observedGeneration": generation,
    }


def test_the_status_patch_holds_phase_and_conditions_only_and_keeps_the_others() -> None:
    planned = _cond("Planned", "True", "Planned")
    tj = _tj([planned, _cond("ContinuousCost", "True", "Measured")], phase="Pending")
    patch = job_status_patch(tj, _job({"startTime": START, "active": 16, "ready": 16}), "2026-01-02T00:00:00Z")
    assert patch is not None
    assert set(patch) == {"phase", "conditions"}
    assert patch["phase"] == "Running"
    conditions = {c["type"]: c for c in patch["conditions"]}  # type: ignore[attr-defined]
    assert conditions["Planned"] == planned
    assert conditions["ContinuousCost"]["reason"] == "Measured"  # another writer's condition, kept
    assert conditions["Running"] == {
        "type": "Running",
        "status": "True",
        "reason": "AllPodsReady",
        "message": "16 of 16 pods ready, 16 active",
        "lastTransitionTime": "2026-01-02T00:00:00Z",
        "observedGeneration": 3,
    }
    # Written as is, the same Job gives no patch at all.
    again = {**tj, "status": {**tj["status"], **patch}}
    assert (
        job_status_patch(again, _job({"startTime": START, "active": 16, "ready": 16}), "2026-01-03T00:00:00Z") is None
    )


def test_an_invalid_trainingjob_keeps_its_phase_while_its_old_job_runs() -> None:
    tj = _tj([_cond("Planned", "False", "InvalidSpec")], phase="Invalid")
    patch = job_status_patch(tj, _job({"startTime": START, "active": 16, "ready": 16}), START)
    assert patch is not None
    assert patch["phase"] == "Invalid"


@pytest.mark.parametrize(
    ("conditions", "generation", "finished"),
    [
        pytest.param([_cond("Running", "False", "Succeeded")], 3, Phase.SUCCEEDED, id="succeeded-this-spec"),
        pytest.param([_cond("Running", "False", "Failed")], 3, Phase.FAILED, id="failed-this-spec"),
        pytest.param([_cond("Running", "False", "Succeeded", generation=2)], 3, None, id="spec-changed-since"),
        pytest.param(
            [_cond("Running", "False", "Succeeded"), _cond("RestartRequired", "True", "SpecChanged")],
            3,
            None,
            id="finished-job-of-an-earlier-spec",
        ),
        pytest.param([_cond("Running", "False", "PodsNotReady")], 3, None, id="not-finished"),
        pytest.param([], 3, None, id="no-run-yet"),
    ],
)
def test_a_finished_run_of_this_spec_is_recognised(
    conditions: list[dict[str, Any]], generation: int, finished: Phase | None
) -> None:
    found = finished_run(_tj(conditions, generation=generation), generation)
    assert (found.phase if found else None) is finished


def test_children_name_their_trainingjob_and_a_deleting_one_is_going() -> None:
    assert trainingjob_key(_job()) == ("ml", "big")
    assert trainingjob_key({"metadata": {"name": "x"}}) is None
    assert is_going(None)
    assert is_going({"metadata": {"deletionTimestamp": START}})
    assert not is_going({"metadata": {"name": "big"}})


def test_the_keepers_backoff_doubles_from_5_to_300_seconds() -> None:
    now = [100.0]
    settings_ = OperatorSettings(api_server="http://127.0.0.1:9")
    api = KubeApi(settings_.api_server)
    keeper = ChildKeeper(api, settings_, PlacementPublisher(api, settings_), clock=lambda: now[0])
    key = ("ml", "big")
    assert not keeper.due(key)
    delays = [keeper.failed(key) for _ in range(8)]
    assert delays == [5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0]
    assert keeper.pending(key) == (8, 400.0)
    assert not keeper.due(key)
    now[0] = 400.0
    assert keeper.due(key)
    keeper.forget(key)
    assert not keeper.due(key)
    asyncio.run(api.close())


class _Api(KubeApi):
    """Our own API wrapper with the server replaced by a script: the TrainingJob changes once between read and write."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9")
        self.version = 1
        self.patches: list[dict[str, Any]] = []

    async def get(self, path: str) -> dict[str, Any] | None:
        assert path == "/apis/meshscope.io/v1alpha1/namespaces/ml/trainingjobs/big"
        return {**_tj([]), "metadata": {**_tj([])["metadata"], "resourceVersion": str(self.version)}}

    async def patch(self, path: str, body: Any) -> dict[str, Any]:
        assert path.endswith("/trainingjobs/big/status")
        self.patches.append(body)
        if body["metadata"]["resourceVersion"] != "2":
            self.version = 2  # another writer got there first
            raise ApiError("PATCH", path, 409, "the object has been modified")
        return {}


def test_a_status_write_refused_as_stale_is_read_again_and_written_at_the_new_version() -> None:
    api = _Api()
    settings_ = OperatorSettings(api_server="http://127.0.0.1:9")
    keeper = ChildKeeper(api, settings_, PlacementPublisher(api, settings_))
    job = _job({"startTime": START, "active": 16, "ready": 16})
    job["metadata"]["ownerReferences"] = [{"uid": "u1"}]
    outcome = asyncio.run(keeper.follow(job))
    assert outcome == "phase Running"
    assert [p["metadata"]["resourceVersion"] for p in api.patches] == ["1", "2"]
    assert all(set(p["status"]) == {"phase", "conditions"} for p in api.patches)

"""TrainingJob bodies drawn from the CRD's schema (tests/trainingjob_strategies.py: valid, broken, corrupted) through
reconcile against kmock: always a clear verdict, never a crash loop or an endless retry.

Two paths. The handler's body (:func:`~meshscope_operator.reconciling.reconcile_training_job`) called directly, twice
per body, over real HTTP to kmock: it ends planned (its Job and Service made) or invalid (``kopf.PermanentError``,
``phase: Invalid`` and a condition with the core's own message), the second run makes nothing new and writes the same
status, the requests per object are bounded, and the status holds only fields the CRD declares, valid against its
schema (the API server would prune or refuse anything else). And a few bodies stored for kopf to reconcile as the
operator runs: each gets a verdict, and after it no request for it is made again (no retry loop).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
import uuid
from typing import TYPE_CHECKING, Any

import jsonschema
import kopf
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshscope.errors import MeshscopeError
from meshscope.plan import plan_job
from meshscope_operator.children import ChildError, job_manifest
from meshscope_operator.kubeapi import KubeApi
from meshscope_operator.reconciling import reconcile_training_job
from meshscope_operator.spec import job_spec
from operator_serving import BESIDE_THE_OPERATOR, NAMESPACE, ROOT, TIMEOUT_S
from trainingjob_strategies import training_jobs

if TYPE_CHECKING:
    from operator_serving import Served

TJ = f"/apis/meshscope.io/v1alpha1/namespaces/{NAMESPACE}/trainingjobs"
CRD = yaml.safe_load((ROOT / "crds" / "trainingjobs.meshscope.io.yaml").read_text())
STATUS_SCHEMA: dict[str, Any] = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
TEMPLATE = {"spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]}}
_names = itertools.count()
MAX_WRITES_PER_RUN = 2
"""A run writes at most: POST Service, POST Job (a 409 then is read, not written again)."""
MAX_WRITES_SERVED = 8
"""A stored body: the test's POST, kopf's finalizer and annotation patches, its status patch, the two children, and
the status patch of the handler that follows the Job."""


def _undeclared(value: Any, schema: dict[str, Any], path: str = "status") -> list[str]:
    """Paths in ``value`` the schema does not declare (what the API server would prune)."""
    if isinstance(value, dict) and "properties" in schema:
        found = []
        for key, sub in value.items():
            if key not in schema["properties"]:
                found.append(f"{path}.{key}")
            else:
                found += _undeclared(sub, schema["properties"][key], f"{path}.{key}")
        return found
    if isinstance(value, list) and "items" in schema:
        return [p for i, v in enumerate(value) for p in _undeclared(v, schema["items"], f"{path}[{i}]")]
    return []


def _applied(patch: Any) -> Any:
    """A merge patch (RFC 7386) applied to an empty status: its ``null`` members remove fields."""
    if isinstance(patch, dict):
        return {k: _applied(v) for k, v in patch.items() if v is not None}
    return patch


def _expected_invalid(body: dict[str, Any], served: Served) -> str | None:
    """What the core or the child builders refuse in ``body`` (an independent path); ``None`` when it plans."""
    try:
        spec = job_spec(body)
        plan_job(spec)
        job_manifest(body, spec, served.settings)
    except (MeshscopeError, ChildError) as exc:
        return str(exc)
    return None


def _named(job: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(job)
    body["metadata"] = {
        "name": f"fz-{next(_names)}",
        "namespace": NAMESPACE,
        "uid": str(uuid.uuid4()),
        "generation": 1,
        "resourceVersion": "1",
    }
    spec = body.setdefault("spec", {})
    if isinstance(spec, dict) and "template" not in spec:
        spec["template"] = copy.deepcopy(TEMPLATE)
    return body


def _writes(served: Served, name: str) -> int:
    """Requests other than reads that name the object ``name`` (in the path or the body)."""

    async def count() -> int:
        return sum(
            1
            for r in served.mock
            if str(r.method.value).upper() != "GET"
            and (r.url.path.endswith(f"/{name}") or "/" + name + "/" in r.url.path or _names_object(r.data, name))
        )

    return int(served.mock_loop.run(count()))


def _names_object(data: Any, name: str) -> bool:
    return isinstance(data, dict) and isinstance(data.get("metadata"), dict) and data["metadata"].get("name") == name


async def _reconcile(served: Served, body: dict[str, Any]) -> tuple[dict[str, Any], BaseException | None]:
    api = KubeApi(served.api_url)
    status: dict[str, Any] = {}
    try:
        await reconcile_training_job(api, body, status, served.settings)
    except (kopf.PermanentError, kopf.TemporaryError) as exc:
        return status, exc
    finally:
        await api.close()
    return status, None


@BESIDE_THE_OPERATOR
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(job=training_jobs())
def test_reconcile_of_any_body_ends_planned_or_invalid_with_bounded_requests(
    served: Served, job: dict[str, Any]
) -> None:
    body = _named(job)
    name = body["metadata"]["name"]
    expected = _expected_invalid(body, served)
    status, raised = asyncio.run(asyncio.wait_for(_reconcile(served, body), TIMEOUT_S))
    assert not isinstance(raised, kopf.TemporaryError), raised  # nothing here is worth a retry
    assert _undeclared(status, STATUS_SCHEMA) == []
    jsonschema.validate(_applied(status), STATUS_SCHEMA)
    conditions = {c["type"]: c for c in status["conditions"]}
    if expected is not None:
        assert isinstance(raised, kopf.PermanentError)
        assert status["phase"] == "Invalid"
        refused = [c for c in conditions.values() if c["status"] == "False"]
        assert [c["message"] for c in refused] == [expected]
        assert "Traceback" not in expected
    else:
        assert raised is None
        assert status["phase"] == "Pending"
        assert conditions["Ready"]["reason"] == "ChildrenCreated"
    first = _writes(served, name)
    assert first <= MAX_WRITES_PER_RUN
    # Again, on the stored status (what kopf's resume does): nothing new is made, the status is the same.
    again = {**body, "status": status}
    second, raised_again = asyncio.run(asyncio.wait_for(_reconcile(served, again), TIMEOUT_S))
    assert type(raised_again) is type(raised)
    assert second == status
    assert _writes(served, name) <= first + MAX_WRITES_PER_RUN


@settings(
    max_examples=6,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(job=training_jobs(), valid=st.booleans())
def test_stored_bodies_get_one_verdict_from_the_running_operator_and_no_retry_loop(
    served: Served, job: dict[str, Any], *, valid: bool
) -> None:
    body = _named(job)
    if valid:  # half of them a spec that plans, so kopf's success path is fuzzed too
        body["spec"] = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "llama3-8b-h100.yaml").read_text())["spec"])
        body["spec"]["template"] = copy.deepcopy(TEMPLATE)
    name = body["metadata"]["name"]
    assert served.api("POST", TJ, body)[0] in (200, 201)
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        _, stored = served.api("GET", f"{TJ}/{name}")
        annotations = stored.get("metadata", {}).get("annotations") or {}
        phase = (stored.get("status") or {}).get("phase")
        if phase and "meshscope.io/last-handled-configuration" in annotations:
            break
        assert time.monotonic() < deadline, f"no verdict on {name} after {TIMEOUT_S} s: {stored}"
        time.sleep(0.05)
    assert phase in ("Invalid", "Pending", "Running"), stored["status"]
    assert _undeclared(stored["status"], STATUS_SCHEMA) == []
    jsonschema.validate(stored["status"], STATUS_SCHEMA)
    # kopf has recorded the change as handled and keeps no progress of a handler to retry (kopf stores a pending
    # retry there); the writes for it are bounded.
    assert "meshscope.io/reconcile" not in annotations, annotations
    assert _writes(served, name) <= MAX_WRITES_SERVED

"""Reconcile's pure parts: status bounds, conditions, child manifests, placement, the new settings."""

from __future__ import annotations

import asyncio
import copy
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshscope.plan import Finding, Severity, plan_job
from meshscope_operator import reconciling
from meshscope_operator.children import ChildError, check_names, job_manifest, pod_template
from meshscope_operator.kubeapi import KubeApi, TransientApiError
from meshscope_operator.placements import PodEntry, nodes_by_index, resolve_placement
from meshscope_operator.settings import OperatorSettings, SettingsError, settings_from
from meshscope_operator.spec import job_spec
from meshscope_operator.statuses import (
    Condition,
    ConditionType,
    findings_list,
    merge_conditions,
    short_layout,
)
from operator_serving import load_example, training_job

CONTAINER = {"name": "trainer", "image": "trainer:1"}


def _body(name: str = "job-a", **spec_changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(load_example("llama3-8b-h100")["spec"])
    spec["template"] = {"spec": {"containers": [dict(CONTAINER)]}}
    spec.update(spec_changes)
    return training_job(name, spec)


def test_findings_list_is_bounded_as_the_crd_bounds_it() -> None:
    findings = [Finding(code=f"c{i}", severity=Severity.WARNING, message="x" * 5000) for i in range(25)]
    listed = findings_list(findings)
    assert len(listed) == 20
    assert all(len(f["message"]) == 1024 for f in listed)
    assert listed[0]["message"].endswith("…")


def test_a_condition_keeps_its_transition_time_until_its_status_flips() -> None:
    up = Condition(type=ConditionType.READY, status=True, reason="ChildrenCreated", message="ok")
    first = merge_conditions(None, [up], generation=1, now="2026-01-01T00:00:00Z")
    same = merge_conditions(first, [up], generation=2, now="2026-01-02T00:00:00Z")
    assert same[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert same[0]["observedGeneration"] == 2
    down = Condition(type=ConditionType.READY, status=False, reason="ApiError", message="no")
    flipped = merge_conditions(same, [down], generation=2, now="2026-01-03T00:00:00Z")
    assert flipped[0]["lastTransitionTime"] == "2026-01-03T00:00:00Z"
    assert flipped[0]["status"] == "False"


def test_short_layout_names_only_the_axes_in_use() -> None:
    assert short_layout(job_spec(load_example("llama3-70b-h100")).layout) == "dp16-tp8-pp4"


def test_a_name_too_long_for_the_pods_host_names_is_refused_with_the_room_left() -> None:
    with pytest.raises(ChildError, match=r"metadata.name: .* at most 61 characters"):
        check_names("a" * 62, 8)  # "-7" leaves 61 of 63
    with pytest.raises(ChildError, match="starting with a letter"):
        check_names("8b-run", 8)
    check_names("a" * 61, 8)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ({}, "spec.template.spec.containers: missing"),
        ({"spec": {"containers": []}}, "spec.template.spec.containers: \\[\\]"),
        ({"spec": {"containers": [CONTAINER], "restartPolicy": "Always"}}, "restartPolicy: 'Always'"),
    ],
    ids=["no-containers", "empty", "always"],
)
def test_a_template_a_job_cannot_run_is_refused(template: dict[str, Any], message: str) -> None:
    body = _body(template=template)
    with pytest.raises(ChildError, match=message):
        pod_template(body, job_spec(body), OperatorSettings())


def test_monitoring_off_gives_a_job_without_sidecar_or_placement() -> None:
    body = _body(monitoring={"enabled": False})
    template = job_manifest(body, job_spec(body), OperatorSettings())["spec"]["template"]  # type: ignore[index]
    assert "initContainers" not in template["spec"]
    assert "volumes" not in template["spec"]


def test_the_placement_index_plans_a_spec_once_not_on_every_status_write(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every status write is a MODIFIED event of the TrainingJob, and kopf calls the index on it: the spec is planned
    # again only when it changed (9 ms at 16,384 GPUs, a large Job's start is one status write per Job update).
    plans: list[str] = []

    def counted(spec: Any) -> Any:
        plans.append(spec.name)
        return plan_job(spec)

    monkeypatch.setattr(reconciling, "plan_job", counted)
    name = f"job-{uuid.uuid4().hex[:8]}"  # a spec no other test (or an earlier run) left planned in the index
    body = _body(name)
    first = reconciling.placement_source(body)
    assert first is not None
    for version in range(3):  # status writes: the server's fields and status move, the spec does not
        written = copy.deepcopy(body)
        written["metadata"] |= {"resourceVersion": str(version), "uid": "u-1"}
        written["status"] = {"phase": "Running", "stepTimeSeconds": 1.5 + version}
        again = reconciling.placement_source(written)
        assert again is not None
        assert again.spec == first.spec
        assert again.body["metadata"]["uid"] == "u-1"  # the entry is of this event's object
    assert plans == [name]
    changed = reconciling.placement_source(_body(name, hardware={**body["spec"]["hardware"], "nodes": 16}))
    assert changed is not None
    assert changed.spec.hardware.nodes == 16
    assert plans == [name, name]
    assert reconciling.placement_source(_body(name, model={"preset": "no-such-model"})) is None


def test_pods_not_all_scheduled_publish_nothing_yet() -> None:
    spec = job_spec(_body())
    pods = [PodEntry(job="job-a", name=f"p{i}", index=i, node=f"n{i}" if i else "") for i in range(8)]
    assert nodes_by_index(spec, pods) == "7 of 8 pods scheduled (index 0 is not)"


def test_a_raised_finding_is_not_new_and_a_shared_node_is_left_out() -> None:
    body = training_job(
        "gb",
        {
            "model": {"preset": "llama3-8b"},
            "parallelism": {"tp": 8, "sequenceParallel": True},
            "training": {"globalBatchSize": 16},
            "hardware": {"gpu": "GB200", "nodes": 4},
        },
    )
    spec = job_spec(body)
    labels = {"a": {"c": "1"}, "b": {"c": "2"}, "d": {"c": "2"}}
    where = {0: "a", 1: "b", 2: "b", 3: "d"}
    fresh = resolve_placement(spec, where, labels, domain_label="c", tier_labels=(), planned_codes=(), raised=())
    assert "tp-crosses-nvlink-domain" in {f.code for f in fresh.new_findings}
    assert fresh.shared_nodes == ("b",)
    assert set(fresh.document["nodes"]) == {"a", "d"}  # type: ignore[arg-type]
    again = resolve_placement(
        spec,
        where,
        labels,
        domain_label="c",
        tier_labels=(),
        planned_codes=(),
        raised=[f.code for f in fresh.findings],
    )
    assert again.new_findings == ()


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("MESHSCOPE_OPERATOR_NETWORK_TIER_LABELS", "a,b,c,d,e,f,g,h,i", "is not 1 to 8 comma-separated"),
        ("MESHSCOPE_OPERATOR_NVLINK_DOMAIN_LABEL", "not a label", "is not a node label key"),
        ("MESHSCOPE_OPERATOR_API_SERVER", "ftp://x", "is not an http:// or https:// URL"),
        ("MESHSCOPE_OPERATOR_MASTER_PORT", "70000", "is not a whole number from 1 to 65535"),
    ],
    ids=["tiers", "domain", "url", "port"],
)
def test_a_bad_reconcile_setting_names_the_variable_and_the_value(variable: str, value: str, message: str) -> None:
    with pytest.raises(SettingsError, match=f"^{variable}={value!r} {message}"):
        settings_from({variable: value})


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
_templates = st.fixed_dictionaries(
    {},
    optional={
        "metadata": st.fixed_dictionaries({}, optional={"labels": _json, "annotations": _json}) | _json,
        "spec": st.fixed_dictionaries(
            {},
            optional={
                "containers": st.lists(
                    st.fixed_dictionaries(
                        {"name": st.text(max_size=5)}, optional={"env": _json, "volumeMounts": _json}
                    ),
                    max_size=2,
                )
                | _json,
                "initContainers": _json,
                "volumes": _json,
                "restartPolicy": st.sampled_from(["Never", "OnFailure", "Always"]) | _json,
            },
        )
        | _json,
    },
)


@settings(max_examples=150, deadline=None)
@given(template=_templates)
def test_any_template_gives_a_job_or_a_child_error(template: dict[str, Any]) -> None:
    body = _body(template=template)
    spec = job_spec(body)
    try:
        job = job_manifest(body, spec, OperatorSettings())
    except ChildError as exc:
        assert str(exc).startswith(("spec.template", "metadata.name"))  # noqa: PT017 - the message names the field
        return
    pod = job["spec"]["template"]  # type: ignore[index]
    assert pod["spec"]["containers"]
    assert pod["spec"]["restartPolicy"] in ("Never", "OnFailure")


def test_a_closed_api_connection_refuses_requests_and_connects_no_more() -> None:
    """kopf runs the cleanup handlers all at once: a task still running after the connection closed (the keeper's
    retries) must get a clear refusal, not a new session that nobody would close."""
    accepted: list[int] = []

    async def go() -> str:
        def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(1)
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        api = KubeApi(f"http://127.0.0.1:{port}", token="t")
        await api.close()
        try:
            with pytest.raises(TransientApiError) as refused:
                await api.get("/api/v1/namespaces/training/pods")
        finally:
            server.close()
            await server.wait_closed()
        return str(refused.value)

    message = asyncio.run(go())
    assert "closed (the operator is stopping)" in message
    assert accepted == []

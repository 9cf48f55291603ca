"""The emulation layer's own behaviour, against hand-derived expectations: selectors, Table cells and durations,
pruning and validation wording, then over HTTP: metadata and generation rules, the status subresource, conflicts,
lists, watches resumed from a resourceVersion, size limits, CRD registration, finalizers and webhook failure
policies."""

from __future__ import annotations

import datetime as dt
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_emulator import RunningEmulator
from kube_emulator.kubectl import Kubectl
from kube_emulator.schemas import default_and_prune, validate
from kube_emulator.selectors import (
    SelectorError,
    match_fields,
    match_labels,
    parse_field_selector,
    parse_label_selector,
)
from kube_emulator.tables import human_duration, render_table

# ----------------------------------------------------------------------------------------------------- selectors


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ("app=trainer", {"app": "trainer"}, True),
        ("app==trainer", {"app": "other"}, False),
        ("app!=trainer", {}, True),  # != matches objects without the key
        ("app!=trainer", {"app": "trainer"}, False),
        ("tier in (a, b)", {"tier": "b"}, True),
        ("tier in (a,b)", {}, False),
        ("tier notin (a,b)", {}, True),
        ("tier notin (a,b)", {"tier": "a"}, False),
        ("gpu", {"gpu": ""}, True),
        ("!gpu", {"gpu": "h100"}, False),
        ("app=trainer,!gpu", {"app": "trainer"}, True),
        ("app=trainer,tier in (a,b)", {"app": "trainer", "tier": "c"}, False),
        ("meshscope.io/trainingjob=big", {"meshscope.io/trainingjob": "big"}, True),
        ("", {"anything": "x"}, True),
    ],
)
def test_label_selectors_match_as_the_api_server_matches(selector, labels, matches) -> None:
    assert match_labels(parse_label_selector(selector), labels) is matches


@pytest.mark.parametrize("selector", ["app=tr ainer", "=x", "app in a", "app=trainer,", "a b c"])
def test_a_label_selector_that_does_not_parse_is_an_error(selector) -> None:
    with pytest.raises(SelectorError):
        parse_label_selector(selector)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab=!,() in/.-_x", max_size=30))
def test_any_label_selector_text_parses_or_is_refused_with_selector_error(text) -> None:
    try:
        requirements = parse_label_selector(text)
    except SelectorError:
        return
    assert match_labels(requirements, {"a": "b"}) in (True, False)


def test_field_selectors_read_missing_fields_as_empty() -> None:
    pod = {"metadata": {"name": "w-0"}, "spec": {"nodeName": "node-3"}}
    assert match_fields(parse_field_selector("metadata.name=w-0,spec.nodeName==node-3"), pod)
    assert match_fields(parse_field_selector("status.phase!=Running"), pod)  # "" != Running
    assert not match_fields(parse_field_selector("status.phase=Running"), pod)
    with pytest.raises(SelectorError, match=r"field label not supported: spec\.x"):
        parse_field_selector("spec.x=1", lambda path: path.startswith("metadata."))


# ----------------------------------------------------------------------------------------------------- tables


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-2, "<invalid>"),
        (-1, "0s"),
        (0, "0s"),
        (119, "119s"),
        (120, "2m"),
        (125, "2m5s"),
        (600, "10m"),
        (3 * 3600 - 1, "179m"),
        (3 * 3600, "3h"),
        (3 * 3600 + 30 * 60, "3h30m"),
        (8 * 3600, "8h"),
        (47 * 3600, "47h"),
        (48 * 3600, "2d"),
        (53 * 3600, "2d5h"),
        (8 * 86400, "8d"),
        (2 * 365 * 86400, "2y"),
        (2 * 365 * 86400 + 3 * 86400, "2y3d"),
        (8 * 365 * 86400, "8y"),
    ],
)
def test_ages_read_as_the_api_server_prints_them(seconds, text) -> None:
    assert human_duration(seconds) == text


def test_a_table_has_a_name_column_then_the_declared_ones_typed() -> None:
    now = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
    obj = {
        "metadata": {"name": "big", "namespace": "ml", "creationTimestamp": "2026-01-01T11:57:55Z"},
        "status": {"world": 3.0, "step": 2, "layout": "dp8-tp8", "ok": True, "share": 0.41},
    }
    columns = [
        {"name": "Layout", "type": "string", "jsonPath": ".status.layout"},
        {"name": "World", "type": "integer", "jsonPath": ".status.world"},
        {"name": "Step", "type": "number", "jsonPath": ".status.step"},
        {"name": "OK", "type": "boolean", "jsonPath": ".status.ok"},
        {"name": "Share", "type": "string", "jsonPath": ".status.share", "priority": 1},
        {"name": "Missing", "type": "string", "jsonPath": ".status.nothing"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    table = render_table([obj], columns, resource_version="7", now=now)
    assert table["kind"] == "Table"
    assert table["apiVersion"] == "meta.k8s.io/v1"
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", *(c["name"] for c in columns)]
    assert [c["priority"] for c in table["columnDefinitions"]] == [0, 0, 0, 0, 0, 1, 0, 0]
    # 3.0 -> 3 (integer), 2 -> 2.0 (number), 0.41 printed as text, a missing path -> null, 2m5s before `now`.
    assert table["rows"][0]["cells"] == ["big", "dp8-tp8", 3, 2.0, True, "0.41", None, "2m5s"]
    assert table["rows"][0]["object"] == {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": obj["metadata"],
    }
    bare = render_table([obj], None, resource_version="7", include_object="None", now=now)
    assert [c["name"] for c in bare["columnDefinitions"]] == ["Name", "Age"]  # no columns declared: Age
    assert bare["rows"] == [{"cells": ["big", "2m5s"]}]


# ----------------------------------------------------------------------------------------------------- schemas

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "required": ["tp"],
            "properties": {
                "tp": {"type": "integer", "minimum": 1, "maximum": 64},
                "preset": {"type": "string", "enum": ["a", "b"], "maxLength": 4},
                "name": {"type": "string", "pattern": "^[a-z]+$"},
                "retries": {"type": "integer", "default": 3},
                "nested": {
                    "type": "object",
                    "properties": {"b": {"type": "integer"}, "d": {"type": "integer", "default": 5}},
                },
                "items": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {"type": "object", "properties": {"k": {"type": "string"}}},
                },
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "map": {"type": "object", "additionalProperties": {"type": "integer"}},
            },
        },
    },
}


def test_pruning_removes_undeclared_fields_and_defaulting_fills_absent_ones() -> None:
    obj = {
        "apiVersion": "x/v1",
        "kind": "X",
        "metadata": {"name": "n", "labels": {"a": "b"}},
        "spec": {
            "tp": 2,
            "bogus": 1,
            "nested": {"b": 1, "c": 2},
            "items": [{"k": "v"}, {"k": "w", "x": 1}],
            "free": {"anything": {"goes": True}},
            "map": {"one": 1},
        },
        "extra": {},
    }
    pruned, unknown = default_and_prune(obj, SCHEMA)
    assert unknown == ["spec.bogus", "spec.nested.c", "spec.items[1].x", "extra"]
    assert pruned["spec"] == {
        "tp": 2,
        "retries": 3,
        "nested": {"b": 1, "d": 5},
        "items": [{"k": "v"}, {"k": "w"}],
        "free": {"anything": {"goes": True}},
        "map": {"one": 1},
    }
    assert pruned["metadata"] == obj["metadata"]  # the API server's own fields are never pruned
    assert "bogus" in obj["spec"]  # the input is left as it was


def test_validation_speaks_the_api_servers_words() -> None:
    obj = {"spec": {"tp": 0, "preset": "zzzzz", "name": "A1", "items": [{}, {}, {}], "map": {"x": "y"}}}
    messages = [e.message for e in validate(obj, SCHEMA)]
    assert messages == [
        "spec.tp: Invalid value: 0: spec.tp in body should be greater than or equal to 1",
        'spec.preset: Unsupported value: "zzzzz": supported values: "a", "b"',
        "spec.preset: Too long: may not be longer than 4",
        "spec.name: Invalid value: \"A1\": spec.name in body should match '^[a-z]+$'",
        "spec.items: Too many: 3: must have at most 2 items",
        'spec.map.x: Invalid value: "string": spec.map.x in body must be of type integer: "string"',
    ]
    assert [e.message for e in validate({"spec": {"tp": 65}}, SCHEMA)] == [
        "spec.tp: Invalid value: 65: spec.tp in body should be less than or equal to 64"
    ]
    assert [e.message for e in validate({"spec": {}}, SCHEMA)] == ["spec.tp: Required value"]


# ----------------------------------------------------------------------------------------------------- over HTTP

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.io"},
    "spec": {
        "group": "example.io",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"]},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [{"name": "Size", "type": "integer", "jsonPath": ".spec.tp"}],
                "schema": {
                    "openAPIV3Schema": {
                        **SCHEMA,
                        "properties": {
                            **SCHEMA["properties"],
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}
WIDGETS = "/apis/example.io/v1/namespaces/default/widgets"


class Api:
    def __init__(self, url: str) -> None:
        self.url = url

    def __call__(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        ct: str = "application/json",
        accept: str = "application/json",
        raw: bytes | None = None,
    ) -> tuple[int, Any, list[str]]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": ct, "Accept": accept}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                text = response.read()
                return (
                    response.status,
                    json.loads(text) if "watch=" not in path else text.decode(),
                    response.headers.get_all("Warning") or [],
                )
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read()), exc.headers.get_all("Warning") or []


@pytest.fixture(scope="module")
def api():
    running = RunningEmulator()
    try:
        call = Api(running.url)
        assert call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", CRD)[0] == 201
        yield call
    finally:
        running.close()


def widget(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "example.io/v1", "kind": "Widget", "metadata": {"name": name}, "spec": {"tp": 1, **spec}}


def merge(api, path: str, patch: dict[str, Any]) -> tuple[int, Any, list[str]]:
    return api("PATCH", path, patch, ct="application/merge-patch+json")


def test_a_crd_is_established_and_discovered_without_short_names_on_subresources(api) -> None:
    code, crd, _ = api("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.example.io")
    assert code == 200
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]} == {
        "NamesAccepted": "True",
        "Established": "True",
    }
    _, found, _ = api("GET", "/apis/example.io/v1")
    assert found["groupVersion"] == "example.io/v1"
    entries = {r["name"]: r for r in found["resources"]}
    assert entries["widgets"]["shortNames"] == ["wd"]
    assert "shortNames" not in entries["widgets/status"]
    _, core, _ = api("GET", "/api/v1")
    assert core["groupVersion"] == "v1"  # kmock says "/v1"


def test_metadata_generation_and_resource_versions_follow_the_api_server(api) -> None:
    code, made, _ = api("POST", WIDGETS, widget("gen"))
    assert code == 201
    meta = made["metadata"]
    assert meta["generation"] == 1
    assert meta["uid"]
    assert meta["creationTimestamp"].endswith("Z")
    path = f"{WIDGETS}/gen"
    _, labelled, _ = merge(api, path, {"metadata": {"labels": {"a": "b"}}})
    assert labelled["metadata"]["generation"] == 1  # metadata changes leave generation alone
    assert int(labelled["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    _, respec, _ = merge(api, path, {"spec": {"tp": 4}})
    assert respec["metadata"]["generation"] == 2
    _, status, _ = merge(api, f"{path}/status", {"status": {"phase": "Running"}, "spec": {"tp": 8}})
    assert status["status"] == {"phase": "Running"}
    assert status["spec"]["tp"] == 4  # /status changes only .status
    assert status["metadata"]["generation"] == 2
    _, main, _ = merge(api, path, {"status": {"phase": "Hacked"}})
    assert main["status"] == {"phase": "Running"}  # the main resource keeps .status
    assert main["metadata"]["resourceVersion"] == status["metadata"]["resourceVersion"]  # a no-op: no new version
    stale = {**main, "metadata": {**main["metadata"], "resourceVersion": meta["resourceVersion"]}}
    code, conflict, _ = api("PUT", path, stale)
    assert code == 409
    assert conflict["message"] == (
        'Operation cannot be fulfilled on widgets.example.io "gen": the object has been modified; please apply your '
        "changes to the latest version and try again"
    )
    code, replaced, _ = api("PUT", path, {**main, "spec": {"tp": 16}})
    assert code == 200
    assert replaced["metadata"]["generation"] == 3


def test_unknown_fields_are_pruned_with_a_warning_or_refused_when_strict(api) -> None:
    code, made, warnings = api("POST", WIDGETS, widget("pruned", bogus=1))
    assert code == 201
    assert "bogus" not in made["spec"]
    assert warnings == ['299 - "unknown field \\"spec.bogus\\""']
    code, refused, _ = api("POST", WIDGETS + "?fieldValidation=Strict", widget("strict", bogus=1))
    assert code == 400
    assert refused["message"] == (
        'Widget in version "v1" cannot be handled as a Widget: strict decoding error: unknown field "spec.bogus"'
    )
    assert api("POST", WIDGETS + "?fieldValidation=Ignore", widget("quiet", bogus=1))[2] == []


def test_an_invalid_object_is_refused_with_causes(api) -> None:
    code, status, _ = api("POST", WIDGETS, widget("bad", tp=0))
    assert code == 422
    assert status["reason"] == "Invalid"
    assert status["message"] == (
        'Widget.example.io "bad" is invalid: spec.tp: Invalid value: 0: spec.tp in body should be greater than or equal to 1'
    )
    assert status["details"]["causes"] == [
        {
            "reason": "FieldValueInvalid",
            "message": "Invalid value: 0: spec.tp in body should be greater than or equal to 1",
            "field": "spec.tp",
        }
    ]


def test_generate_name_and_namespaces(api) -> None:
    names = [
        api("POST", WIDGETS, {**widget(""), "metadata": {"generateName": "w-"}})[1]["metadata"]["name"]
        for _ in range(2)
    ]
    assert names[0] != names[1]
    assert all(n.startswith("w-") and len(n) == 7 and set(n[2:]) <= set("bcdfghjklmnpqrstvwxz2456789") for n in names)
    code, ns, _ = api("GET", "/api/v1/namespaces/default")
    assert (code, ns["kind"], ns["status"]["phase"]) == (200, "Namespace", "Active")
    code, missing, _ = api("POST", "/api/v1/namespaces/nope/configmaps", {"metadata": {"name": "x"}})
    assert (code, missing["message"]) == (404, 'namespaces "nope" not found')


def test_lists_have_a_kind_and_honour_selectors(api) -> None:
    for name, size in (("sel-a", "s"), ("sel-b", "m")):
        api("POST", WIDGETS, {**widget(name), "metadata": {"name": name, "labels": {"size": size}}})
    _, listing, _ = api("GET", WIDGETS + "?labelSelector=size%20in%20(s,m),size!=m")
    assert (listing["kind"], listing["apiVersion"]) == ("WidgetList", "example.io/v1")
    assert [o["metadata"]["name"] for o in listing["items"]] == ["sel-a"]
    _, by_name, _ = api("GET", WIDGETS + "?fieldSelector=metadata.name=sel-b")
    assert [o["metadata"]["name"] for o in by_name["items"]] == ["sel-b"]
    code, refused, _ = api("GET", WIDGETS + "?fieldSelector=spec.tp=1")
    assert (code, refused["message"]) == (400, "field label not supported: spec.tp")
    _, table, _ = api("GET", f"{WIDGETS}/sel-a", accept="application/json;as=Table;v=v1;g=meta.k8s.io,application/json")
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Size"]
    assert table["rows"][0]["cells"] == ["sel-a", 1]


def _events(stream: str) -> list[tuple[str, str]]:
    return [(e["type"], e["object"]["metadata"]["name"]) for e in map(json.loads, stream.splitlines())]


def test_a_watch_resumes_after_its_resource_version_and_follows_its_selector(api) -> None:
    first = api("POST", WIDGETS, {**widget("w-1"), "metadata": {"name": "w-1", "labels": {"team": "x"}}})[1]
    api("POST", WIDGETS, {**widget("w-2"), "metadata": {"name": "w-2", "labels": {"team": "x"}}})
    merge(api, f"{WIDGETS}/w-1", {"metadata": {"labels": {"team": "y"}}})
    rv = first["metadata"]["resourceVersion"]
    # timeoutSeconds ends each stream (the API server's deadline), so the test reads to the end.
    _, everything, _ = api("GET", f"{WIDGETS}?watch=true&resourceVersion={rv}&timeoutSeconds=1&labelSelector=team")
    assert _events(everything) == [("ADDED", "w-2"), ("MODIFIED", "w-1")]
    _, team_x, _ = api("GET", f"{WIDGETS}?watch=true&resourceVersion={rv}&timeoutSeconds=1&labelSelector=team%3Dx")
    assert _events(team_x) == [("ADDED", "w-2"), ("DELETED", "w-1")]  # w-1 left the selector
    _, fresh, _ = api("GET", f"{WIDGETS}?watch=true&timeoutSeconds=1&labelSelector=team%3Dx")
    assert _events(fresh) == [("ADDED", "w-2")]  # no resourceVersion: the current objects first


def test_finalizers_hold_a_deleted_object_until_they_are_removed(api) -> None:
    api("POST", WIDGETS, {**widget("fin"), "metadata": {"name": "fin", "finalizers": ["example.io/keep"]}})
    code, marked, _ = api("DELETE", f"{WIDGETS}/fin")
    assert code == 200
    assert marked["metadata"]["deletionTimestamp"]
    assert marked["metadata"]["generation"] == 2
    assert api("GET", f"{WIDGETS}/fin")[0] == 200
    merge(api, f"{WIDGETS}/fin", {"metadata": {"finalizers": None}})
    code, gone, _ = api("GET", f"{WIDGETS}/fin")
    assert (code, gone["message"]) == (404, 'widgets.example.io "fin" not found')


def test_size_limits(api) -> None:
    too_many = {"metadata": {"name": "notes", "annotations": {"a": "x" * 262_144}}}
    code, status, _ = api("POST", "/api/v1/namespaces/default/configmaps", too_many)
    assert (code, status["message"]) == (
        422,
        'ConfigMap "notes" is invalid: metadata.annotations: Too long: must have at most 262144 bytes',
    )
    big = {"metadata": {"name": "big"}, "data": {"x": "y" * 1_600_000}}  # over etcd's 1.5 MiB, under 3 MiB
    code, status, _ = api("POST", "/api/v1/namespaces/default/configmaps", big)
    assert (code, status["message"]) == (500, "etcdserver: request is too large")
    huge = json.dumps({"metadata": {"name": "huge"}, "data": {"x": "y" * (3 * 1024 * 1024)}}).encode()
    code, status, _ = api("POST", "/api/v1/namespaces/default/configmaps", raw=huge)
    assert (code, status["message"]) == (413, "Request entity too large: limit is 3145728")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_webhook_fails_the_request_or_is_ignored_by_its_failure_policy(api) -> None:
    hook = {
        "name": "cm.example.io",
        "clientConfig": {"url": f"https://127.0.0.1:{_closed_port()}/cm"},
        "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "resources": ["configmaps"], "operations": ["CREATE"]}],
        "objectSelector": {"matchLabels": {"checked": "yes"}},
        "failurePolicy": "Fail",
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
    }
    configs = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
    assert api("POST", configs, {"metadata": {"name": "cm"}, "webhooks": [hook]})[0] == 201
    checked = {"metadata": {"name": "checked", "labels": {"checked": "yes"}}}
    code, status, _ = api("POST", "/api/v1/namespaces/default/configmaps", checked)
    assert code == 500
    assert status["message"].startswith(
        'Internal error occurred: failed calling webhook "cm.example.io": failed to call webhook: '
    )
    unlabelled = {"metadata": {"name": "unchecked"}}
    assert api("POST", "/api/v1/namespaces/default/configmaps", unlabelled)[0] == 201  # objectSelector: not called
    merge(api, f"{configs}/cm", {"webhooks": [{**hook, "failurePolicy": "Ignore"}]})
    assert api("POST", "/api/v1/namespaces/default/configmaps", checked)[0] == 201


def test_deleting_a_crd_removes_its_resource(api) -> None:
    crd = {
        **CRD,
        "metadata": {"name": "gadgets.example.io"},
        "spec": {**CRD["spec"], "names": {"plural": "gadgets", "kind": "Gadget"}},
    }
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    assert api("POST", crds, crd)[0] == 201
    assert api("GET", "/apis/example.io/v1/namespaces/default/gadgets")[0] == 200
    assert api("DELETE", f"{crds}/gadgets.example.io")[0] == 200
    assert api("GET", "/apis/example.io/v1/namespaces/default/gadgets")[0] == 404
    code, wrong, _ = api("POST", crds, {**CRD, "metadata": {"name": "wrong"}})
    assert (code, wrong["details"]["causes"][0]["field"]) == (422, "metadata.name")


def test_a_watch_from_a_version_older_than_the_kept_history_gets_410(monkeypatch) -> None:
    monkeypatch.setattr("kube_emulator.emulator.EVENT_HISTORY", 4)
    running = RunningEmulator()
    try:
        call = Api(running.url)
        first = call("POST", "/api/v1/namespaces/default/configmaps", {"metadata": {"name": "cm-0"}})[1]
        for i in range(1, 6):
            call("POST", "/api/v1/namespaces/default/configmaps", {"metadata": {"name": f"cm-{i}"}})
        rv = first["metadata"]["resourceVersion"]
        _, stream, _ = call(
            "GET", f"/api/v1/namespaces/default/configmaps?watch=true&resourceVersion={rv}&timeoutSeconds=1"
        )
        (event,) = map(json.loads, stream.splitlines())
        assert event["type"] == "ERROR"
        assert (event["object"]["code"], event["object"]["reason"]) == (410, "Expired")
    finally:
        running.close()


def test_the_standalone_mode_serves_kubectl(tmp_path) -> None:
    port = _closed_port()
    kubeconfig = tmp_path / "kubeconfig"
    tests = Path(__file__).resolve().parents[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "kube_emulator", str(port), str(kubeconfig)],
        cwd=tests,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()  # the server says so once it listens (or exits, giving "")
        assert line == f"serving http://127.0.0.1:{port}; kubeconfig {kubeconfig}\n"
        done = Kubectl(kubeconfig, tmp_path).run("get", "namespaces", "-o", "name")
        assert done.stdout == "namespace/default\nnamespace/kube-system\n"
    finally:
        server.send_signal(2)  # SIGINT: the server closes and exits
        try:
            assert server.wait(timeout=30) == 0
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(timeout=30)
            server.stdout.close()

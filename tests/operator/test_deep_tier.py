"""The deep tier end to end: kopf against kmock, real sidecars as the pods, the core's analysis in status.

The cluster (kmock) holds a TrainingJob of 4 nodes (16 ranks, tp=2, dp=8) annotated ``analyze.meshscope.io/now``,
and its pods: two whose sidecars run for real on their pod IPs (127.0.0.2 and 127.0.0.3, one port, as in a
cluster), one whose sidecar is dead (127.0.0.4: nothing listens), one still Pending, and a pod of another job.
The operator (``register_costs`` on a fresh registry, kopf's real machinery, recipe C of
shared/reference/kubernetes-testing.md) must pull the window, analyse it, write the ConfigMap with its owner
reference, the bounded summary and the conditions, remove the annotation, and answer a second annotation with the
next window. The expected numbers are the core's ``analyze`` of the same records (the window's steps of the live
pods' ranks) run here. The store is down all along: ``MetricsAvailable=False``, never an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.server
import json
import socket
import threading
import time
import urllib.request
from typing import TYPE_CHECKING, Any

import aiohttp
import kmock
import kopf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cost_sidecars import JOB, NAMESPACE, feed_all, job_manifest, sidecars, simulated_job
from meshscope.analysis import analyze
from meshscope.errors import ParseError
from meshscope.records import pack_lines, table_from_lines, unpack_columns
from meshscope_operator.costs import ANALYSIS_KEY, COST_TABLE_AVAILABLE, METRICS_AVAILABLE, status_from_analysis
from meshscope_operator.deep import (
    PodRecords,
    Pulled,
    Target,
    analyse_window,
    pull_window,
    targets_of,
    window_steps,
)
from meshscope_operator.handlers import ANNOTATION_PREFIX
from meshscope_operator.kubeapi import KubeApi
from meshscope_operator.settings import OperatorSettings
from meshscope_operator.tiers import ANALYZE_NOW, _State, register_costs, run_deep
from operator_serving import RESOURCES, _LoopThread, kopf_running
from sidecar.promstack import free_port

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

TIMEOUT_S = 30.0
TJ = ("meshscope.io/v1alpha1/trainingjobs", NAMESPACE, JOB)
CM = ("v1/configmaps", NAMESPACE, f"{JOB}-meshscope-costs")
LIVE = ("127.0.0.2", "127.0.0.3")


def _pod(name: str, *, job: str = JOB, ip: str | None, phase: str = "Running") -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if ip is not None:
        status["podIP"] = ip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"meshscope.io/trainingjob": job}},
        "spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]},
        "status": status,
    }


def _shared_port() -> int:
    with socket.socket() as s:
        s.bind((LIVE[0], 0))
        port: int = s.getsockname()[1]
    with socket.socket() as s:
        s.bind((LIVE[1], port))  # free on the other address too (fails the test otherwise: run it again)
    return port


@contextlib.contextmanager
def _operator(settings: OperatorSettings, objects: dict[tuple[str, str, str], dict[str, Any]]) -> Iterator[Any]:
    """kmock with ``objects``, and the cost tiers' handlers running against it; both stopped on the way out."""
    mock_loop = _LoopThread("kmock")

    async def start_mock() -> tuple[Any, Any]:
        emulator = kmock.KubernetesEmulator()
        await emulator.__aenter__()
        server = kmock.Server(emulator)
        await server.__aenter__()
        resources = {
            **RESOURCES,
            "v1/configmaps": {"kind": "ConfigMap", "namespaced": True, "verbs": {"list", "get", "create", "patch"}},
        }
        for key, info in resources.items():
            emulator.resources[key] = kmock.ResourceInfo(**info)
        for key, obj in objects.items():
            emulator.objects[key] = obj
        return emulator, server

    emulator, server = mock_loop.run(start_mock())
    api_url = str(server.url).rstrip("/")
    info = kopf.ConnectionInfo(server=api_url, insecure=True, scheme="Bearer", token="dummy")
    registry = kopf.OperatorRegistry()
    register_costs(registry, dataclasses.replace(settings, api_server=api_url))

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return info

    @kopf.on.startup(registry=registry)
    def plain_kmock(settings: kopf.OperatorSettings, **_: Any) -> None:
        # what configure_kopf sets, less the webhook server (no admission handlers here)
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
        )
        settings.posting.enabled = False  # trap T7
        settings.scanning.disabled = True  # trap T6

    try:
        with kopf_running(registry, namespace=NAMESPACE):
            yield emulator, api_url
    finally:

        async def stop_mock() -> None:
            await server.__aexit__(None, None, None)
            await emulator.__aexit__(None, None, None)

        mock_loop.run(stop_mock())
        mock_loop.close()


def _condition(emulator: Any, kind: str) -> dict[str, Any] | None:
    status = emulator.objects[TJ].get("status") or {}
    return next((c for c in status.get("conditions", []) if c.get("type") == kind), None)


def _wait(what: str, check: Any) -> Any:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        with contextlib.suppress(KeyError):
            got = check()
            if got:
                return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {TIMEOUT_S:.0f} s waiting for {what}")
        time.sleep(0.1)


def _expected(job: Any, steps: set[int]) -> Any:
    """The core's analysis of the window's records of the live pods' ranks (0-7)."""
    lines = [x for x in job.lines_of(range(8)) if json.loads(x)["step"] in steps]
    return analyze(table_from_lines(lines), spec=job.spec)


def test_the_deep_tier_writes_the_cores_analysis(tmp_path: Path) -> None:
    job = simulated_job(4, tmp_path)
    port = _shared_port()
    tj = job_manifest(4)
    tj["metadata"]["annotations"] = {ANALYZE_NOW: "1"}
    objects = {
        TJ: tj,
        ("v1/pods", NAMESPACE, "tiny-0"): _pod("tiny-0", ip=LIVE[0]),
        ("v1/pods", NAMESPACE, "tiny-1"): _pod("tiny-1", ip=LIVE[1]),
        ("v1/pods", NAMESPACE, "tiny-2"): _pod("tiny-2", ip="127.0.0.4"),  # its sidecar is dead
        ("v1/pods", NAMESPACE, "tiny-3"): _pod("tiny-3", ip=None, phase="Pending"),
        ("v1/pods", NAMESPACE, "other-0"): _pod("other-0", job="other", ip="127.0.0.5"),
    }
    settings = OperatorSettings(
        namespaces=(NAMESPACE,),
        sidecar_port=port,
        metrics_url=f"http://127.0.0.1:{free_port()}",  # nothing listens: the store is down
        metrics_interval_seconds=1.0,
        metrics_timeout_seconds=0.5,
        deep_interval_seconds=3600.0,  # only on demand in this test
        deep_timeout_seconds=5.0,
    )
    with sidecars(job, [(LIVE[0], port), (LIVE[1], port)]) as running:
        feed_all(job, running)
        with _operator(settings, objects) as (emulator, api_url):
            done = _wait("the deep analysis", lambda: _condition(emulator, COST_TABLE_AVAILABLE))
            assert (done["status"], done["reason"]) == ("True", "PartialData"), done
            _wait("the annotation removed", lambda: ANALYZE_NOW not in emulator.objects[TJ]["metadata"]["annotations"])
            configmap = emulator.objects[CM]
            status = emulator.objects[TJ]["status"]

            # the ConfigMap: owned by the TrainingJob, the core's analysis of the window (steps 0-1, ranks 0-7)
            assert configmap["metadata"]["ownerReferences"] == [
                {
                    "apiVersion": "meshscope.io/v1alpha1",
                    "kind": "TrainingJob",
                    "name": JOB,
                    "uid": tj["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
            written = json.loads(configmap["data"][ANALYSIS_KEY])
            expected = _expected(job, {0, 1})
            want = expected.to_dict()
            assert written["steps"] == {"first": 0, "last": 1, "count": 2}
            assert written["ranks_seen"] == 8
            assert written["rows"] == want["rows"]
            assert written["summary"] == want["summary"]
            assert [f["code"] for f in written["findings"]] == [f["code"] for f in want["findings"]]
            ours = {n["code"]: n for n in written["partial_data"]}
            assert "tiny-2" in ours["sidecars_unreachable"]["message"]
            assert ours["sidecars_unreachable"]["count"] == 1
            assert "tiny-3" in ours["pods_not_running"]["message"]
            assert "other-0" not in json.dumps(written["partial_data"])  # another job's pod is not this job's
            assert written["partial_data"][-len(want["partial_data"]) :] == want["partial_data"]

            # the status: the bounded summary of that same analysis, and the condition of the store
            planner = [f.to_dict() for f in expected.plan.findings]
            summary = status_from_analysis(want, configmap=CM[2], planner_findings=planner)
            assert status["costTable"] == summary["costTable"]
            assert status["findings"] == len(want["findings"]) + len(
                {f.code for f in expected.plan.findings} - {f["code"] for f in want["findings"]}
            )
            assert status["stepTimeSeconds"] == want["summary"]["median_step_seconds"]
            assert status["findingsList"] == summary["findingsList"]
            assert status["costTableRef"] == CM[2]
            metrics = _wait("the store's condition", lambda: _condition(emulator, METRICS_AVAILABLE))
            assert (metrics["status"], metrics["reason"]) == ("False", "StoreUnreachable")
            assert "steps 0-1" in done["message"]

            # asked again: the next window
            request = urllib.request.Request(
                f"{api_url}/apis/meshscope.io/v1alpha1/namespaces/{NAMESPACE}/trainingjobs/{JOB}",
                data=json.dumps({"metadata": {"annotations": {ANALYZE_NOW: "2"}}}).encode(),
                headers={"Content-Type": "application/merge-patch+json"},
                method="PATCH",
            )
            with urllib.request.urlopen(request, timeout=10):
                pass

            def second_window() -> dict[str, Any] | None:
                c = _condition(emulator, COST_TABLE_AVAILABLE)
                return c if c is not None and "steps 2-3" in c["message"] else None

            again = _wait("the second window", second_window)
            assert again["status"] == "True"
            second = json.loads(emulator.objects[CM]["data"][ANALYSIS_KEY])
            assert second["rows"] == _expected(job, {2, 3}).to_dict()["rows"]


# ---------------------------------------------------------------------------------------------------- the pull


class _Stub(http.server.ThreadingHTTPServer):
    """A sidecar that hangs (``delay_s``), answers an error, or (``lines``) answers JSON lines whatever it is asked,
    as a sidecar that does not pack does: what a broken or an older pod looks like from the operator."""

    daemon_threads = True

    def __init__(
        self, status: int, delay_s: float = 0.0, lines: list[bytes] | None = None, pause_s: float = 0.0
    ) -> None:
        """``pause_s``: send the body in two parts that far apart, as a network that splits an answer does."""
        self.release = threading.Event()
        self.asked: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.asked.append(self.path)
                outer.release.wait(delay_s)
                body = b"".join(lines) if lines is not None else b"overloaded\n"
                self.send_response(status)
                self.send_header("Content-Type", "application/x-ndjson")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                half = len(body) // 2 if pause_s else len(body)
                with contextlib.suppress(OSError):
                    self.wfile.write(body[:half])
                    self.wfile.flush()
                    time.sleep(pause_s)
                    self.wfile.write(body[half:])

            def log_message(self, *_args: object) -> None:
                return

        super().__init__(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()
        self.thread.join(10)


def _pull(targets: list[Target], **bounds: Any) -> Pulled:
    async def go() -> Pulled:
        async with aiohttp.ClientSession() as session:
            args = {"since_step": -1, "window_steps": 2, "timeout_s": 5.0, "concurrency": 1} | bounds
            return await pull_window(session, targets, **args)

    return asyncio.run(go())


def _rank_steps(pulled: Pulled) -> dict[str, set[tuple[int, int]]]:
    """Per pod, the (rank, step) pairs of its records in the window, whichever way it answered."""
    out = {}
    for pod in pulled.records:
        if pod.packed is not None:
            rows = unpack_columns(pod.packed, where=pod.pod).only_steps(pulled.window).raw.rows
            out[pod.pod] = set(zip(rows["rank"].tolist(), rows["step"].tolist(), strict=True))
        else:
            out[pod.pod] = {(json.loads(x)["rank"], json.loads(x)["step"]) for x in pod.lines}
    return out


def _pairs(lines: list[bytes]) -> set[tuple[int, int]]:
    return {(json.loads(x)["rank"], json.loads(x)["step"]) for x in lines}


def test_the_pull_is_bounded_and_names_what_it_missed(tmp_path: Path) -> None:
    job = simulated_job(2, tmp_path)
    hung, failing = _Stub(200, delay_s=30.0), _Stub(503)
    try:
        with sidecars(job, [("127.0.0.1", 0), ("127.0.0.1", 0)]) as running:
            feed_all(job, running)
            a, b = (Target(pod=f"tiny-{i}", url=s.url) for i, s in enumerate(running))
            window = [x for x in job.lines if json.loads(x)["step"] in {0, 1}]
            of_a = [x for x in window if json.loads(x)["rank"] < 4]
            of_b = [x for x in window if json.loads(x)["rank"] >= 4]

            # the sidecars pack their records: exactly the window (steps 0-1 of every rank), in fewer bytes
            whole = _pull([a, b], pod_max_bytes=1 << 20, total_max_bytes=1 << 30)
            assert all(pod.packed is not None for pod in whole.records)
            assert _rank_steps(whole) == {"tiny-0": _pairs(of_a), "tiny-1": _pairs(of_b)}
            assert (whole.notes, whole.pods_answered, whole.last_step, whole.window) == ([], 2, 1, {0, 1})
            assert whole.bytes_read == sum(len(pod.packed or b"") for pod in whole.records)
            assert whole.bytes_read < sum(map(len, window))  # fewer bytes than the lines

            # a byte cap per pod: the sidecar packs the records that fit it (one byte short of all of them: all but
            # the last), and the operator names the answer cut
            cap = len(pack_lines(of_a, where="sidecar")[0]) - 1
            cut = _pull([a], pod_max_bytes=cap, total_max_bytes=1 << 30)
            assert [(n.code, n.count) for n in cut.notes] == [("sidecar_answer_cut", 1)]
            assert _rank_steps(cut) == {"tiny-0": _pairs(of_a[:-1])}  # steps 0-1 of ranks 0-3, less rank 3's step 1
            assert cut.bytes_read <= cap

            # a total cap: the first pod takes it, the second is not asked (one at a time here)
            total = len(pack_lines(of_a, where="sidecar")[0])
            spent = _pull([a, b], pod_max_bytes=1 << 20, total_max_bytes=total)
            assert _rank_steps(spent) == {"tiny-0": _pairs(of_a)}
            assert [(n.code, n.count) for n in spent.notes] == [("records_over_budget", 1)]
            assert "tiny-1" in spent.notes[0].message
            assert spent.bytes_read == total

            # a hung and a failing sidecar: noted with the pod and why, the others analysed
            broken = _pull(
                [a, b, Target(pod="tiny-hung", url=hung.url), Target(pod="tiny-503", url=failing.url)],
                pod_max_bytes=1 << 20,
                total_max_bytes=1 << 30,
                timeout_s=0.5,
                concurrency=4,
            )
            assert _rank_steps(broken) == {"tiny-0": _pairs(of_a), "tiny-1": _pairs(of_b)}
            [note] = broken.notes
            assert (note.code, note.count) == ("sidecars_unreachable", 2)
            assert "tiny-hung (no answer within 0.5 s)" in note.message
            assert "tiny-503 (HTTP 503" in note.message
    finally:
        hung.close()
        failing.close()


def test_a_sidecar_that_answers_json_lines_is_analysed_beside_packed_ones(tmp_path: Path) -> None:
    """A pod whose sidecar does not pack (an older image, or records that would not pack) answers JSON lines; the
    operator cuts its window out of the lines, and the analysis is that of the same records read from one file."""
    job = simulated_job(2, tmp_path)
    window = [x for x in job.lines if json.loads(x)["step"] in {0, 1}]
    of_b = [x for x in job.lines if json.loads(x)["rank"] >= 4]  # every step it kept: the window cuts all but 0-1
    older = _Stub(200, lines=of_b)
    try:
        with sidecars(job, [("127.0.0.1", 0)]) as running:
            feed_all(job, running)
            pulled = _pull(
                [Target(pod="tiny-0", url=running[0].url), Target(pod="tiny-1", url=older.url)],
                pod_max_bytes=1 << 20,
                total_max_bytes=1 << 30,
                window_steps=2,
            )
    finally:
        older.close()
    assert [pod.packed is not None for pod in sorted(pulled.records, key=lambda p: p.pod)] == [True, False]
    assert "max_bytes=1048576" in older.asked[0]  # every sidecar is told the byte cap
    assert pulled.window == {0, 1}
    outside = [x for x in of_b if x not in window]
    assert [(n.code, n.count) for n in pulled.notes] == [("steps_outside_window", len(outside))]
    result = analyse_window(pulled.records, window=pulled.window, spec=None, notes=[])
    assert pulled.records == []  # consumed
    expected = analyze(table_from_lines(window, where="window"))
    assert result.analysis["rows"] == expected.to_dict()["rows"]
    assert result.analysis["summary"] == expected.to_dict()["summary"]


def test_an_answer_that_arrives_in_parts_is_read_whole() -> None:
    """A sidecar's answer split by the network (half, a pause, the rest) is read to its end: every line kept, none
    cut. (Read once, the first part alone was taken as the whole answer: its last line unreadable, the rest lost,
    and no note about a cut.)"""
    lines = [json.dumps({"step": step, "rank": 0, "pad": "x" * 200}).encode() + b"\n" for step in range(40)]
    split = _Stub(200, lines=lines, pause_s=0.3)
    try:
        pulled = _pull([Target(pod="tiny-0", url=split.url)], pod_max_bytes=1 << 20, total_max_bytes=1 << 30)
    finally:
        split.close()
    assert pulled.notes == []
    assert pulled.bytes_read == sum(map(len, lines))
    [pod] = pulled.records
    assert pod.lines == lines


def test_pods_without_an_ip_are_noted_not_asked() -> None:
    targets, notes = targets_of(
        [_pod("b", ip="10.0.0.7"), _pod("a", ip="fd00::7"), _pod("c", ip=None, phase="Pending")], port=9402
    )
    assert targets == [Target(pod="a", url="http://[fd00::7]:9402"), Target(pod="b", url="http://10.0.0.7:9402")]
    assert [(n.code, n.count) for n in notes] == [("pods_not_running", 1)]
    assert "c" in notes[0].message


_garbage = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    st.builds(
        lambda d: json.dumps(d).encode(),
        st.dictionaries(
            st.sampled_from(["schema", "job", "step", "rank"]), st.integers() | st.text(max_size=5), max_size=4
        ),
    ),
)


@pytest.fixture(scope="module")
def tiny_lines(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    return simulated_job(2, tmp_path_factory.mktemp("fuzz")).lines[:16]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.lists(_garbage, max_size=4), at=st.integers(0, 16), packed=st.booleans())
def test_garbage_from_a_sidecar_is_left_out_or_refused_in_one_line(
    tiny_lines: list[bytes], garbage: list[bytes], at: int, packed: bool
) -> None:
    lines = [*tiny_lines[:at], *(g.replace(b"\n", b" ") + b"\n" for g in garbage), *tiny_lines[at:]]
    records = [PodRecords(pod="tiny-0", lines=lines)]
    if packed:  # the garbage as a second pod's packed answer, beside the good lines
        records = [PodRecords(pod="tiny-0", lines=tiny_lines), PodRecords(pod="tiny-1", packed=b"".join(lines))]
    try:
        result = analyse_window(records, window=frozenset({0, 1}), spec=None, notes=[])
    except ParseError as exc:
        message = str(exc)
    else:
        message = ""
    if message:
        assert message.strip()
        assert "\n" not in message.strip()
        return
    if garbage or packed:
        codes = [n["code"] for n in result.analysis["partial_data"]]
        assert "invalid_records" in codes or len(result.analysis["rows"]) > 0
    if packed:  # the packed garbage is left out whole, the good pod analysed
        assert "invalid_records" in [n["code"] for n in result.analysis["partial_data"]]
    assert json.loads(result.json)["rows"] == result.analysis["rows"]


@pytest.mark.parametrize(("api", "reason"), [("down", "ApiError"), ("no-pods", "NoSidecars")])
def test_what_stops_an_analysis_is_a_condition(api: str, reason: str) -> None:
    body = kopf.Body({**job_manifest(2), "status": {}})
    patch = kopf.Patch()
    settings = OperatorSettings(deep_timeout_seconds=2.0)

    async def go() -> None:
        state = _State(http=aiohttp.ClientSession())
        state.api = (KubeApi if api == "down" else _NoPods)(f"http://127.0.0.1:{free_port()}", token="t")
        try:
            await run_deep(state, settings, body=body, patch=patch)
        finally:
            closing = [s for s in (state.api, state.http) if s is not None]
            for s in closing:
                await s.close()

    asyncio.run(go())
    [condition] = patch.status["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == (COST_TABLE_AVAILABLE, "False", reason)
    assert "\n" not in condition["message"]
    assert "costTable" not in patch.status  # nothing analysed: the last table stays as it was


class _NoPods(KubeApi):
    """The API answering an empty pod list (our own wrapper mocked, STYLE.md section 6)."""

    async def list(self, path: str) -> list[dict[str, Any]]:
        assert path == f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=meshscope.io/trainingjob%3D{JOB}", path
        return []


@pytest.mark.parametrize(
    ("configured", "world_size", "steps"),
    [(2, 16_384, 1), (2, 8_192, 2), (2, 100_000, 1), (64, 4_096, 4), (2, None, 2), (3, 1, 3)],
    ids=["16k-ranks-one-step", "8k-ranks-two", "beyond-the-bound-still-one", "64-asked-4-fit", "size-unknown", "tiny"],
)
def test_a_window_holds_at_most_the_rank_steps_bound(configured: int, world_size: int | None, steps: int) -> None:
    assert window_steps(configured, max_rank_steps=16_384, world_size=world_size) == steps

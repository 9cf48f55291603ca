"""The continuous tier against a real Prometheus and a real VictoriaMetrics (+ vmalert) scraping real sidecars.

Two ``meshscope-sidecar`` processes (the two nodes of a simulated tp=2, dp=4 job with a straggler) are fed the
job's records after both stores scraped their counters at zero; both stores evaluate the shipped recording rules.
The operator's client (:mod:`meshscope_operator.promql`) then reads the job-level series, and the status rows must
equal what this test derives from the same records through the core's breakdown (per rank: a category's seconds
over its step seconds; the mean over ranks; the median over ranks of each rank's mean step time, interpolated as
PromQL's ``quantile`` does). Stores that are down, slow, wrong or too talkative give a named reason in bounded
attempts, never an exception out of the tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.server
import json
import shutil
import threading
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import kopf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_sidecars import JOB, feed_all, sidecars, simulated_job
from meshscope.analysis import CATEGORIES, break_down
from meshscope_operator.costs import status_from_reading
from meshscope_operator.promql import ATTEMPTS, REASONS, MetricsError, StoreClient, read_job
from meshscope_operator.promql import _vector as _vector_of
from meshscope_operator.settings import OperatorSettings
from meshscope_operator.tiers import _State, read_metrics
from sidecar.promstack import free_port, start_prometheus, start_victoria_metrics, start_vmalert

if TYPE_CHECKING:
    from collections.abc import Iterator

    from sidecar.promstack import Service

RULES = Path(__file__).resolve().parents[2] / "sidecar" / "monitoring" / "recording-rules.yaml"
REL = 1e-6  # VictoriaMetrics keeps 12 significant digits (tests/sidecar/test_recording_rules.py); Prometheus exact


def _read(url: str, *, timeout_s: float = 10.0) -> Any:
    async def go() -> Any:
        async with aiohttp.ClientSession() as session:
            return await read_job(StoreClient(url, timeout_s=timeout_s, session=session), JOB)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("continuous")
    rules = work / "recording-rules.yaml"
    shutil.copy(RULES, rules)
    job = simulated_job(2, work)
    with contextlib.ExitStack() as stack:
        running = stack.enter_context(sidecars(job, [("127.0.0.1", 0), ("127.0.0.1", 0)]))
        targets = [f"127.0.0.1:{s.port}" for s in running]
        prom = stack.enter_context(start_prometheus(work / "prometheus", targets=targets, rule_files=[rules]))
        vm = stack.enter_context(start_victoria_metrics(work / "victoria-metrics", targets=targets))
        stack.enter_context(start_vmalert(work / "vmalert", rule_files=[rules], store_url=vm.url))
        zeros = f'meshscope_steps_total{{job="{JOB}"}} == 0'
        for store in (prom, vm):
            store.wait_for("the ranks' counters scraped at 0", lambda s=store: len(s.query(zeros)) == 8)
        feed_all(job, running)
        total = f'sum(meshscope_steps_total{{job="{JOB}"}})'
        for store in (prom, vm):
            store.wait_for("every step scraped", lambda s=store: [r["value"][1] for r in s.query(total)] == ["48"])
        full_at = time.time()
        # Prometheus evaluates a group's rules in order at one timestamp; vmalert reads the per-rank level of an
        # earlier evaluation through remote write: a few intervals more (recording-rules.yaml's header). The groups
        # run concurrently and in no set order, so each group's job-level result the test reads is waited for.
        for store, lag_s in ((prom, 1.0), (vm, 4.0)):
            for rule in (
                "job_category_axis:meshscope_breakdown_share:ratio_rate5m",
                "job:meshscope_straggler_gap_seconds:max_rate5m",
            ):
                store.wait_for(
                    f"{rule} evaluated over the final counts",
                    lambda s=store, lag=lag_s, rule=rule: any(
                        float(r["value"][1]) > full_at + lag for r in s.query(f"timestamp({rule})")
                    ),
                )
        yield {"job": job, "prometheus": prom, "victoria-metrics": vm}


def _expected(job: Any) -> dict[str, Any]:
    """From the records, through the core: per-rank means, then the job-level aggregates the rules define."""
    bd = break_down(job.table, align_clocks=False)
    ranks = job.table.steps.rank
    step_us = job.table.steps.end_us - job.table.steps.start_us
    ticks = bd.ticks.astype(np.float64)
    per_rank_step: list[float] = []
    per_rank_share: dict[str, list[float]] = {}
    for r in np.unique(ranks):
        rows = ranks == r
        per_rank_step.append(step_us[rows].sum() / rows.sum() / 1e6)
        total = ticks[rows].sum()
        share: dict[str, float] = {}
        for i, c in enumerate(CATEGORIES):  # transfer and sync wait of an axis are its exposed comm together
            name = f"comm.{c.split('.')[1]}" if c.startswith("comm.") else c
            share[name] = share.get(name, 0.0) + ticks[rows, i].sum() / total
        for name, value in share.items():
            per_rank_share.setdefault(name, []).append(value)
    median = float(np.quantile(per_rank_step, 0.5))
    shares = {c: float(np.mean(v)) for c, v in per_rank_share.items()}
    return {"median": median, "max": max(per_rank_step), "shares": shares}


@pytest.mark.slow
@pytest.mark.parametrize("store", ["prometheus", "victoria-metrics"])
def test_the_status_rows_are_the_records_through_the_core(stores: dict[str, Any], store: str) -> None:
    service: Service = stores[store]
    reading = _read(service.url)
    want = _expected(stores["job"])
    status = status_from_reading(reading)
    assert status["stepTimeSeconds"] == pytest.approx(want["median"], rel=REL)
    assert reading.max_step_seconds == pytest.approx(want["max"], rel=REL)
    rows = {r["category"]: r for r in status["costTable"]}
    # Axes of degree 1 and categories the job never spends time in are exported as 0 by the sidecars.
    nonzero = {c: s for c, s in want["shares"].items() if s > 0}
    assert {c for c, r in rows.items() if r["shareOfStep"] > 0} == set(nonzero)
    for category, share in nonzero.items():
        assert rows[category]["shareOfStep"] == pytest.approx(share, rel=REL), category
        assert rows[category]["measuredSeconds"] == pytest.approx(share * want["median"], rel=REL), category
    assert reading.useful_compute_share == pytest.approx(want["shares"]["compute"], rel=REL)
    assert reading.straggler_gap_seconds is not None
    assert reading.straggler_gap_seconds > 0  # rank 5's own time stands out of its (only) stage
    top = max((c for c in nonzero if c != "compute"), key=lambda c: nonzero[c])
    assert status["topCost"].startswith(("exposed comm " + top.split(".")[1]) if top.startswith("comm.") else top)


@pytest.mark.slow
def test_another_jobs_name_reads_no_data(stores: dict[str, Any]) -> None:
    async def go() -> None:
        async with aiohttp.ClientSession() as session:
            await read_job(StoreClient(stores["prometheus"].url, timeout_s=5, session=session), 'no"such\\job')

    with pytest.raises(MetricsError) as err:
        asyncio.run(go())
    assert err.value.reason == "NoData"


# ---------------------------------------------------------------------------------------------------- bad stores


class _Store(http.server.ThreadingHTTPServer):
    """A loopback HTTP server answering every GET with ``answer(path)`` (status, body), counting requests."""

    daemon_threads = True

    def __init__(self, answer: Any, delay_s: float = 0.0, pause_s: float = 0.0) -> None:
        """``pause_s``: send each body in two parts that far apart, as a network that splits an answer does."""
        self.requests = 0
        self.release = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests += 1
                if delay_s:
                    outer.release.wait(delay_s)
                status, body = answer(self.path)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
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


@contextlib.contextmanager
def _store(answer: Any, delay_s: float = 0.0, pause_s: float = 0.0) -> Iterator[_Store]:
    s = _Store(answer, delay_s, pause_s)
    try:
        yield s
    finally:
        s.close()


def _vector(n: int) -> bytes:
    result = [{"metric": {"job": JOB, "category": f"c{i}"}, "value": [0, "0.5"]} for i in range(n)]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()


def _reason(url: str, *, timeout_s: float = 5.0) -> str:
    with pytest.raises(MetricsError) as err:
        _read(url, timeout_s=timeout_s)
    assert "\n" not in str(err.value)
    return err.value.reason


def test_a_store_that_is_down_is_a_reason() -> None:
    assert _reason(f"http://127.0.0.1:{free_port()}") == "StoreUnreachable"


def test_a_slow_store_times_out_in_bounded_attempts() -> None:
    with _store(lambda _p: (200, _vector(1)), delay_s=30.0) as slow:
        assert _reason(slow.url, timeout_s=0.3) == "StoreTimeout"
        # six queries at once, each tried ATTEMPTS times, then no more
        deadline = time.monotonic() + 10
        while slow.requests < 6 * ATTEMPTS and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # room for a (wrong) extra attempt to arrive before counting
        assert slow.requests == 6 * ATTEMPTS


def test_a_store_error_is_not_retried() -> None:
    body = json.dumps({"status": "error", "errorType": "bad_data", "error": "parse error at char 4"}).encode()
    with _store(lambda _p: (400, body)) as bad:
        assert _reason(bad.url) == "StoreError"
        assert bad.requests == 6


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (200, _vector(65)),  # not job-level: per-rank series would be copied into status
        (200, b"<html>proxy login</html>"),
        (200, json.dumps({"status": "success", "data": {"resultType": "matrix", "result": []}}).encode()),
        (200, json.dumps({"status": "success", "data": {"resultType": "vector", "result": [{"x": 1}]}}).encode()),
        (200, b"[" + b"1," * 200_000 + b"1]"),
    ],
    ids=["too-many-series", "html", "matrix", "bad-sample", "too-large"],
)
def test_a_wrong_answer_is_refused(status: int, body: bytes) -> None:
    with _store(lambda _p: (status, body)) as wrong:
        assert _reason(wrong.url) == "BadAnswer"


def test_an_answer_that_arrives_in_parts_is_read_whole() -> None:
    """A store's answer split by the network (half, a pause, the rest) reads as the same answer sent at once. (Read
    once, its first half was taken as the whole and refused as "BadAnswer".)"""
    with _store(_answers) as whole, _store(_answers, pause_s=0.3) as split:
        assert _read(split.url) == _read(whole.url)


_json = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_answer = st.fixed_dictionaries(
    {
        "status": st.sampled_from(["success", "error", "weird"]),
        "data": st.fixed_dictionaries(
            {
                "resultType": st.sampled_from(["vector", "matrix", "scalar"]),
                "result": st.lists(
                    st.fixed_dictionaries(
                        {"metric": st.dictionaries(st.text(max_size=5), _json, max_size=3), "value": _json}
                    ),
                    max_size=3,
                )
                | _json,
            }
        )
        | _json,
    }
)


@settings(max_examples=200, deadline=None)
@given(body=_answer | _json)
def test_any_answer_is_samples_or_a_named_reason(body: Any) -> None:
    try:
        samples = _vector_of(body, "q")
    except MetricsError as exc:
        failure: MetricsError | None = exc
    else:
        failure = None
    if failure is not None:
        assert failure.reason in REASONS
        assert "\n" not in str(failure)
        return
    assert all(isinstance(v, float) and all(isinstance(k, str) for k in labels) for labels, v in samples)


def _answers(path: str) -> tuple[int, bytes]:
    """A store holding one job's job-level series: median step 2 s, slowest 2.5 s, shares 60 % compute and 40 % dp
    exposed communication, every other series 0.5."""
    query = urllib.parse.parse_qs(urllib.parse.urlparse(path).query)["query"][0]
    if query.startswith("job_category_axis:"):
        result = [
            {"metric": {"job": JOB, "category": "compute", "axis": ""}, "value": [0, "0.6"]},
            {"metric": {"job": JOB, "category": "exposed_comm", "axis": "dp"}, "value": [0, "0.4"]},
        ]
    else:
        value = {"job:meshscope_step_seconds:median_rate5m": "2", "job:meshscope_step_seconds:max_rate5m": "2.5"}
        result = [{"metric": {"job": JOB}, "value": [0, value.get(query.split("{")[0], "0.5")]}]
    return 200, json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()


@pytest.mark.parametrize("deep_age_s", [None, 10.0, 1000.0], ids=["no-deep", "fresh-deep", "stale-deep"])
def test_the_timer_leaves_the_rows_to_a_recent_deep_analysis(deep_age_s: float | None) -> None:
    settings = OperatorSettings(metrics_timeout_seconds=5.0, deep_interval_seconds=300.0)
    body = {"metadata": {"name": JOB, "namespace": "training", "generation": 2}, "status": {"conditions": []}}
    patch = kopf.Patch()

    async def go(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            state = _State(http=session)
            if deep_age_s is not None:
                state.deep_done[("training", JOB)] = time.monotonic() - deep_age_s
            await read_metrics(state, dataclasses.replace(settings, metrics_url=url), body=kopf.Body(body), patch=patch)

    with _store(_answers) as store:
        asyncio.run(go(store.url))
    status = dict(patch.status)
    assert status["stepTimeSeconds"] == 2.0
    [condition] = status["conditions"]
    assert (condition["type"], condition["status"], condition["observedGeneration"]) == ("MetricsAvailable", "True", 2)
    assert "median step 2.00 s (slowest rank 2.50 s)" in condition["message"]
    assert "useful compute 50.0 % vs reported GPU utilisation 50.0 %" in condition["message"]
    if deep_age_s == 10.0:  # within two deep intervals: the deep table (expected beside measured) stays
        assert "costTable" not in status
    else:
        assert status["costTable"] == [
            {"category": "compute", "shareOfStep": 0.6, "measuredSeconds": 1.2},
            {"category": "comm.dp", "shareOfStep": 0.4, "measuredSeconds": 0.8},
        ]
        assert status["topCost"] == "exposed comm dp 40.0%"

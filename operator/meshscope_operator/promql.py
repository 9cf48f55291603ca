"""The continuous tier's store client: a fixed, bounded set of instant PromQL queries of one job's job-level series.

Exists so that the operator reads the recording rules' output (sidecar/monitoring/recording-rules.yaml) from any
store that serves Prometheus' HTTP API (``GET /api/v1/query``: Prometheus, VictoriaMetrics, Thanos Query, Mimir)
with every cost bounded:

- the queries are a fixed list (:data:`QUERIES`), each selecting one job's **job-level** series (``job:`` and
  ``job_category_axis:``), so an answer holds at most a handful of series whatever the job's size; an answer with
  more than :data:`MAX_SERIES` series (a store that ignores the matcher) is refused, never copied;
- each query has a timeout (the client's, and the ``timeout`` parameter the store applies itself), at most two
  attempts, and an answer of at most :data:`MAX_RESPONSE_BYTES`;
- every failure is one :class:`MetricsError` with a reason from a closed set and a one-line message, which the
  handler turns into the ``MetricsAvailable=False`` condition: never an exception out of the timer.

It must not query per-rank series, must not retry without bound, and must not import kopf.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import TYPE_CHECKING, Any

import aiohttp

from meshscope_operator.bodies import read_at_most
from meshscope_operator.costs import MetricsReading

if TYPE_CHECKING:
    from collections.abc import Mapping

MAX_SERIES = 64
"""Most series one answer may hold: the breakdown shares are 7 categories plus one per axis (at most 13 with the
axis values the sidecar exports); anything larger is not a job-level answer."""
MAX_RESPONSE_BYTES = 256 * 1024
"""Most bytes read of one answer (64 series are under 16 KiB)."""
ATTEMPTS = 2
"""Tries per query; the timer's next run is the next retry."""
RETRY_DELAY_S = 0.5

QUERIES: dict[str, str] = {
    "median_step_seconds": "job:meshscope_step_seconds:median_rate5m",
    "max_step_seconds": "job:meshscope_step_seconds:max_rate5m",
    "straggler_gap_seconds": "job:meshscope_straggler_gap_seconds:max_rate5m",
    "useful_compute_share": "job:meshscope_compute_share:ratio_rate5m",
    "reported_gpu_util": "job:meshscope_gpu_utilization_ratio:avg5m",
    "shares": "job_category_axis:meshscope_breakdown_share:ratio_rate5m",
}
"""Field of :class:`~meshscope_operator.costs.MetricsReading` -> the recorded series it reads (one job's)."""

REASONS = ("StoreUnreachable", "StoreTimeout", "StoreError", "BadAnswer", "NoData")
"""``MetricsAvailable=False`` reasons: no connection; no answer in time; the store answered an error; the answer
was not a bounded instant vector; the store has no series of the job yet."""

_LABEL_VALUE = re.compile(r'[\\"\n]')


class MetricsError(Exception):
    """A query that gave no usable answer: :attr:`reason` (one of :data:`REASONS`) and a one-line message."""

    def __init__(self, reason: str, message: str) -> None:
        """``reason`` from :data:`REASONS`; ``message`` one line."""
        super().__init__(message)
        self.reason = reason


def job_selector(series: str, job: str) -> str:
    """``series{job="JOB"}`` with the job name escaped as PromQL string literals require."""
    escaped = _LABEL_VALUE.sub(lambda m: {"\\": "\\\\", '"': '\\"', "\n": "\\n"}[m.group()], job)
    return f'{series}{{job="{escaped}"}}'


def _vector(body: object, expr: str) -> list[tuple[dict[str, str], float]]:
    """The samples of an instant-vector answer; :class:`MetricsError` when it is not one, or too large."""
    if not isinstance(body, dict):
        raise MetricsError("BadAnswer", f"the store answered {expr!r} with no JSON object")
    if body.get("status") != "success":
        error = str(body.get("error", body.get("status")))[:300]
        raise MetricsError("StoreError", f"the store refused {expr!r}: {error}")
    data = body.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise MetricsError("BadAnswer", f"the store's answer to {expr!r} is not an instant vector")
    result = data["result"]
    if len(result) > MAX_SERIES:
        raise MetricsError("BadAnswer", f"{expr!r} gave {len(result)} series, more than {MAX_SERIES} (not job-level)")
    out = []
    for sample in result:
        try:
            labels = {str(k): str(v) for k, v in sample["metric"].items()}
            value = float(sample["value"][1])
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            raise MetricsError("BadAnswer", f"a sample of {expr!r} is not {{metric, value: [t, v]}}") from None
        out.append((labels, value))
    return out


class StoreClient:
    """Instant queries against one store's ``/api/v1/query``, each bounded in time and size."""

    def __init__(self, base_url: str, *, timeout_s: float, session: aiohttp.ClientSession) -> None:
        """Query ``base_url`` (``http://prometheus:9090``, ``http://vmselect:8481/select/0/prometheus``, ...).

        Args:
            base_url: the store's API root (``/api/v1/query`` is appended).
            timeout_s: per attempt, connection included.
            session: the caller's aiohttp session (closed by the caller).
        """
        self.url = base_url.rstrip("/") + "/api/v1/query"
        self.timeout_s = timeout_s
        self.session = session

    async def _once(self, expr: str) -> list[tuple[dict[str, str], float]]:
        params = {"query": expr, "timeout": f"{self.timeout_s:g}s"}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self.session.get(self.url, params=params, timeout=timeout) as response:
                raw = await read_at_most(response.content, MAX_RESPONSE_BYTES + 1)
                status = response.status
        except TimeoutError:
            raise MetricsError("StoreTimeout", f"no answer to {expr!r} within {self.timeout_s:g} s") from None
        except (aiohttp.ClientError, RuntimeError) as exc:  # RuntimeError: the session closed (operator stopping)
            raise MetricsError("StoreUnreachable", f"cannot query {self.url}: {exc}"[:500]) from None
        if len(raw) > MAX_RESPONSE_BYTES:
            raise MetricsError("BadAnswer", f"the answer to {expr!r} exceeds {MAX_RESPONSE_BYTES:,} bytes")
        try:
            body = json.loads(raw)
        except ValueError:
            reason = "StoreError" if status >= 400 else "BadAnswer"
            raise MetricsError(reason, f"HTTP {status} for {expr!r}: {raw[:200]!r}") from None
        return _vector(body, expr)

    async def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """The instant vector of ``expr``: ``[(labels, value)]``; at most :data:`ATTEMPTS` tries.

        Raises:
            MetricsError: the last attempt's failure. An error the store itself reports (bad query) is not retried.
        """
        for attempt in range(ATTEMPTS):
            try:
                return await self._once(expr)
            except MetricsError as exc:
                if exc.reason in {"StoreError", "BadAnswer"} or attempt == ATTEMPTS - 1:
                    raise
            await asyncio.sleep(RETRY_DELAY_S)
        raise AssertionError("unreachable")  # pragma: no cover


def _single(samples: list[tuple[dict[str, str], float]]) -> float | None:
    finite = [v for _labels, v in samples if math.isfinite(v)]
    return finite[0] if len(finite) == 1 else None


async def read_job(client: StoreClient, job: str) -> MetricsReading:
    """Every series of :data:`QUERIES` for ``job``, asked at once.

    Raises:
        MetricsError: the first query that failed; ``NoData`` when the store holds none of the job's series.
    """
    names = list(QUERIES)
    answers: list[Any] = await asyncio.gather(
        *(client.query(job_selector(QUERIES[n], job)) for n in names), return_exceptions=True
    )
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
    got: Mapping[str, list[tuple[dict[str, str], float]]] = dict(zip(names, answers, strict=True))
    if not any(got.values()):
        raise MetricsError("NoData", f"the store has no series of job {job!r} yet (are its sidecars scraped?)")
    shares = {(labels.get("category", ""), labels.get("axis", "")): v for labels, v in got["shares"]}
    return MetricsReading(
        median_step_seconds=_single(got["median_step_seconds"]),
        max_step_seconds=_single(got["max_step_seconds"]),
        straggler_gap_seconds=_single(got["straggler_gap_seconds"]),
        useful_compute_share=_single(got["useful_compute_share"]),
        reported_gpu_util=_single(got["reported_gpu_util"]),
        shares=shares,
    )

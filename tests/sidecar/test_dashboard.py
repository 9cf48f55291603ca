"""The Grafana dashboard (sidecar/monitoring/dashboard.json): its variables, its panels, and every panel's query
executed against a real Prometheus that scrapes the synthetic job of :mod:`sidecar.promstack` and evaluates the
recording rules; every query must return data.

Grafana's variables are substituted as Grafana would: ``$job`` by the job's name, ``$__rate_interval`` by 5 s (at
least four scrapes at the test's 1 s interval, as Grafana's rule of four scrape intervals gives).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from sidecar.promstack import JOB, Service, http_get, start_prometheus, synthetic_job

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "sidecar" / "monitoring" / "dashboard.json"
RULES = ROOT / "sidecar" / "monitoring" / "recording-rules.yaml"
RATE_INTERVAL = "5s"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def panels() -> list[dict[str, Any]]:
    out = []
    for p in dashboard()["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row holds its panels
    return out


def targets() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{p['title']} / {t['refId']}", t) for p in panels() if p["type"] != "row" for t in p["targets"]]


def substitute(expr: str) -> str:
    out = expr.replace("${job}", JOB).replace("$job", JOB).replace("$__rate_interval", RATE_INTERVAL)
    assert "$" not in out, f"a variable the test does not know in {expr!r}"
    return out


def test_dashboard_has_the_datasource_and_job_variables() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    job = variables["job"]
    assert job["type"] == "query"
    assert job["datasource"] == DATASOURCE
    assert job["query"]["query"] == "label_values(meshscope_steps_total, job)"


def test_every_panel_and_query_uses_the_datasource_variable() -> None:
    for p in panels():
        if p["type"] == "row":
            continue
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"], f"{p['title']} has no query"
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE, p["title"]
            assert '{job="$job"' in t["expr"] or 'job="$job"' in t["expr"], f"{p['title']}: not filtered by job"


def test_panel_ids_are_unique_and_panels_do_not_overlap() -> None:
    ps = panels()
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in ps:
        g = p["gridPos"]
        assert g["x"] >= 0, p["title"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[x, y]}"
                cells[x, y] = p["title"]


@pytest.mark.parametrize(
    "needle",
    [
        "rank:meshscope_step_seconds:mean_rate5m",  # step time per rank (its recorded level)
        "job_pp:meshscope_straggler_gap_seconds:rate5m",
        "job_axis:meshscope_exposed_comm_seconds:mean_rate5m",
        "job_pp:meshscope_bubble_seconds:mean_rate5m",
        "job:meshscope_data_tokens_per_step:max_rate5m",
        "job:meshscope_gpu_utilization_ratio:avg5m",
        "job:meshscope_compute_share:ratio_rate5m",
        "job_source:meshscope_source_up:ratio",
    ],
)
def test_dashboard_shows(needle: str) -> None:
    assert any(needle in t["expr"] for _, t in targets()), f"no panel queries {needle}"


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    work = tmp_path_factory.mktemp("dashboard")
    rules = work / "recording-rules.yaml"
    shutil.copy(RULES, rules)
    with contextlib.ExitStack() as stack:
        expositions = stack.enter_context(synthetic_job())
        prom = stack.enter_context(
            start_prometheus(work / "prometheus", targets=[e.target for e in expositions], rule_files=[rules])
        )
        # the per-rank panels need a rate interval's worth of scrapes; the rule panels their first evaluation
        prom.wait_for(
            "5 s of scrapes and the rules' first values",
            lambda: (
                bool(prom.query("count_over_time(meshscope_steps_total[5s]) >= 5"))
                and bool(prom.query("job_source:meshscope_source_poll_seconds:max_rate5m"))
                and bool(prom.query("rank:meshscope_step_seconds:mean_rate5m"))  # the breakdown group's level
                and bool(prom.query("job:meshscope_compute_share:ratio_rate5m"))
            ),
        )
        yield prom


def test_the_job_variable_finds_the_job(prometheus: Service) -> None:
    # Grafana's label_values(meshscope_steps_total, job) is this API call
    url = f"{prometheus.url}/api/v1/label/job/values?{urllib.parse.urlencode({'match[]': 'meshscope_steps_total'})}"
    assert json.loads(http_get(url))["data"] == [JOB]


@pytest.mark.parametrize(("where", "target"), targets(), ids=[w for w, _ in targets()])
def test_every_panel_query_returns_data(prometheus: Service, where: str, target: dict[str, Any]) -> None:
    expr = substitute(target["expr"])
    result: list[dict[str, Any]] = []

    def has_data() -> bool:
        # polled: a scrape that times out under load leaves raw gauges stale until the next one, a second later
        nonlocal result
        result = prometheus.query(expr)
        return bool(result)

    with contextlib.suppress(pytest.fail.Exception):
        prometheus.wait_for(f"data for {expr}", has_data, timeout_s=10)
    assert result, f"{where}: no data for {expr}"
    values = [float(s["value"][1]) for s in result]
    assert not any(math.isnan(v) for v in values), f"{where}: NaN in {values}"
    # a legend that names a label must get it from the series
    for label in re.findall(r"\{\{(\w+)\}\}", target.get("legendFormat", "")):
        assert all(label in s["metric"] or label == "axis" for s in result), f"{where}: no {label} label"

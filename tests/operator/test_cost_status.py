"""The cost table's status summary and ConfigMap: the CRD's bounds hold whatever the analysis holds.

The summaries are built from the core's own analysis of simulated records (a straggler injected) and checked field
by field against the :class:`meshscope.analysis.Analysis` objects (not their JSON, which the builders read), then
validated against the CRD's ``status`` schema (crds/trainingjobs.meshscope.io.yaml), including one of 16,384 ranks,
whose bytes are measured. Hostile analysis dicts (hypothesis) must still give a valid, bounded status.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshscope.analysis import analyze
from meshscope.jobs import spec_from_manifest
from meshscope.simulation import Straggler, simulate
from meshscope_operator.costs import (
    ANALYSIS_KEY,
    CONFIGMAP_DATA_BUDGET_BYTES,
    TRIMMED,
    MetricsReading,
    configmap_for,
    encode_analysis,
    status_from_analysis,
    status_from_reading,
    with_condition,
)

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "trainingjobs.meshscope.io.yaml").read_text())
STATUS_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
VALIDATOR = jsonschema.Draft202012Validator(STATUS_SCHEMA)


def _manifest(name: str, *, tp: int, dp: int, nodes: int, gpus_per_node: int = 8) -> dict[str, Any]:
    return {
        "apiVersion": "meshscope.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": "training", "uid": "0b4a-uid"},
        "spec": {
            "model": {"preset": "llama3-8b"},
            "parallelism": {"tp": tp, "dp": dp},
            "training": {"microBatchSize": 1, "globalBatchSize": dp, "distributedOptimizer": True},
            "hardware": {"gpu": "H100", "nodes": nodes, "gpusPerNode": gpus_per_node},
        },
    }


def _valid(status: dict[str, Any]) -> None:
    """The status as the API server would store it: ``None`` deletes a field in a merge patch."""
    stored = {k: v for k, v in status.items() if v is not None}
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(stored)]
    assert errors == []


@pytest.fixture(scope="module")
def small() -> Any:
    spec = spec_from_manifest(_manifest("tiny", tp=2, dp=4, nodes=2, gpus_per_node=4))
    result = simulate(spec, steps=6, faults=[Straggler(rank=5, factor=1.5)])
    return analyze(result.table, spec=spec)


def test_the_summary_is_the_analysis_in_the_crds_shape(small: Any) -> None:
    status = status_from_analysis(small.to_dict(), configmap="tiny-meshscope-costs")
    _valid(status)
    assert status["costTableRef"] == "tiny-meshscope-costs"
    assert status["stepTimeSeconds"] == small.summary.median_step_seconds
    assert [r["category"] for r in status["costTable"]] == [r.category for r in small.rows]
    for got, row in zip(status["costTable"], small.rows, strict=True):
        assert got["measuredSeconds"] == row.measured_median_seconds
        assert got["shareOfStep"] == min(1.0, row.share_of_step)
        assert got.get("expectedSeconds") == row.expected_seconds
        assert got.get("suspect") == (row.suspect.message[:256] if row.suspect is not None else None)
    assert status["findings"] == len(small.findings) >= 1
    assert [f["code"] for f in status["findingsList"]] == [f.code for f in small.findings]
    assert "straggler" in status["findingsList"][0]["code"]
    # The top cost beyond compute, found here by hand from the rows.
    top = max((r for r in small.rows if r.category != "compute"), key=lambda r: r.measured_median_seconds)
    parts = top.category.split(".")
    label = f"{parts[1]} {parts[2].replace('_', ' ')}" if parts[0] == "comm" else top.category
    assert status["topCost"] == f"{label} {top.share_of_step * 100:.1f}%"


def test_a_16k_rank_summary_validates_and_is_small() -> None:
    spec = spec_from_manifest(_manifest("big", tp=8, dp=2048, nodes=2048))
    result = simulate(spec, steps=1, faults=[Straggler(rank=1234, factor=1.5)])
    analysis = analyze(result.table, spec=spec)
    assert analysis.ranks_seen == 16_384
    status = status_from_analysis(analysis.to_dict(), configmap="big-meshscope-costs")
    _valid(status)
    size = len(json.dumps(status).encode())
    assert size < 16 * 1024, size  # the summary does not grow with ranks: rows, findings and a few numbers
    assert any("1234" in f["message"] for f in status["findingsList"])


def test_the_continuous_summary_is_the_reading() -> None:
    reading = MetricsReading(
        median_step_seconds=2.0,
        max_step_seconds=2.05,
        straggler_gap_seconds=0.3,
        useful_compute_share=0.6,
        reported_gpu_util=0.98,
        shares={("compute", ""): 0.6, ("exposed_comm", "dp"): 0.125, ("exposed_comm", "tp"): 0.05, ("bubble", ""): 0.2},
    )
    status = status_from_reading(reading)
    _valid(status)
    assert status["stepTimeSeconds"] == 2.0
    assert status["costTable"] == [
        {"category": "compute", "shareOfStep": 0.6, "measuredSeconds": 1.2},
        {"category": "comm.dp", "shareOfStep": 0.125, "measuredSeconds": 0.25},
        {"category": "comm.tp", "shareOfStep": 0.05, "measuredSeconds": 0.1},
        {"category": "bubble", "shareOfStep": 0.2, "measuredSeconds": 0.4},
    ]
    assert status["topCost"] == "bubble 20.0%"
    assert status_from_reading(reading, rows=False) == {"stepTimeSeconds": 2.0}


def test_a_large_analysis_is_trimmed_to_the_configmap_budget(small: Any) -> None:
    d = small.to_dict()
    whole = json.dumps(d)
    big = {
        **d,
        "findings": [
            {**d["findings"][0], "code": f"f{i}", "evidence": {f"k{j}": j for j in range(300)}} for i in range(400)
        ],
    }
    text = encode_analysis(big)
    assert len(text.encode()) <= CONFIGMAP_DATA_BUDGET_BYTES
    out = json.loads(text)
    assert out["rows"] == d["rows"]
    assert out["summary"] == d["summary"]
    assert out["partial_data"][-1]["code"] == TRIMMED
    assert "evidence" in out["partial_data"][-1]["message"]
    assert len(out["findings"]) == 400  # evidence alone was enough
    assert encode_analysis(d) == json.dumps(d, separators=(",", ":"), ensure_ascii=False)  # fits: untouched
    assert len(whole) < CONFIGMAP_DATA_BUDGET_BYTES
    odd = {**d, "summary": {**d["summary"], "efficiency": float("nan"), "ideal_step_seconds": float("inf")}}
    got = json.loads(encode_analysis(odd))["summary"]
    assert (got.pop("efficiency"), got.pop("ideal_step_seconds")) == (None, None)  # JSON has no NaN or inf
    assert got == {k: v for k, v in d["summary"].items() if k not in {"efficiency", "ideal_step_seconds"}}


def test_the_configmap_is_owned_by_the_trainingjob() -> None:
    owner = _manifest("tiny", tp=2, dp=4, nodes=2)
    cm = configmap_for(owner, '{"job":"tiny"}')
    assert cm["metadata"]["name"] == "tiny-meshscope-costs"
    assert cm["metadata"]["namespace"] == "training"
    assert cm["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "meshscope.io/v1alpha1",
            "kind": "TrainingJob",
            "name": "tiny",
            "uid": "0b4a-uid",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert cm["data"] == {ANALYSIS_KEY: '{"job":"tiny"}'}


def test_a_condition_keeps_the_others_and_its_transition_time() -> None:
    others = [{"type": "Planned", "status": "True", "reason": "Planned", "message": "", "lastTransitionTime": "t0"}]
    first = with_condition(
        others, type_="MetricsAvailable", status="False", reason="StoreTimeout", message="m", generation=3, now="t1"
    )
    assert first[0] == others[0]
    assert first[1] == {
        "type": "MetricsAvailable",
        "status": "False",
        "reason": "StoreTimeout",
        "message": "m",
        "lastTransitionTime": "t1",
        "observedGeneration": 3,
    }
    again = with_condition(
        first, type_="MetricsAvailable", status="False", reason="x", message="y", generation=3, now="t2"
    )
    assert again[1]["lastTransitionTime"] == "t1"  # same status: the transition stays where it was
    flipped = with_condition(
        again, type_="MetricsAvailable", status="True", reason="Read", message="", generation=4, now="t3"
    )
    assert (flipped[1]["lastTransitionTime"], flipped[1]["observedGeneration"]) == ("t3", 4)
    assert len(flipped) == 2
    assert (
        with_condition("garbage", type_="A", status="True", reason="r", message="", generation=None, now="t")[0]["type"]
        == "A"
    )


_text = st.text(max_size=3000)
_number = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**20), 10**20))
_row = st.fixed_dictionaries(
    {
        "category": _text,
        "expected_seconds": _number,
        "measured_median_seconds": _number,
        "share_of_step": _number,
        "suspect": st.one_of(st.none(), st.fixed_dictionaries({"message": _text})),
    }
)
_finding = st.fixed_dictionaries({"code": _text, "severity": _text, "message": _text})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(_row, max_size=40),
    findings=st.lists(_finding, max_size=40),
    step=_number,
)
def test_hostile_analyses_still_give_a_valid_bounded_status(
    rows: list[dict[str, Any]], findings: list[dict[str, Any]], step: Any
) -> None:
    status = status_from_analysis(
        {"rows": rows, "findings": findings, "summary": {"median_step_seconds": step}}, configmap="x-meshscope-costs"
    )
    _valid(status)
    assert status["findings"] == len(findings)
    assert len(json.dumps(status).encode()) < 64 * 1024


def test_the_planners_findings_follow_the_measured_ones(small: Any) -> None:
    measured = small.to_dict()
    planner = [
        {"code": measured["findings"][0]["code"], "severity": "info", "message": "the planner said so too"},
        {"code": "bubble-large", "severity": "warning", "message": "bubble 12 % of the step"},
    ]
    status = status_from_analysis(measured, configmap="x", planner_findings=planner)
    codes = [f["code"] for f in status["findingsList"]]
    assert codes == [f["code"] for f in measured["findings"]] + ["bubble-large"]  # the duplicate code left out
    assert status["findings"] == len(measured["findings"]) + 1
    _valid(status)

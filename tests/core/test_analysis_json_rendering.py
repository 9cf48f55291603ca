"""``render_analysis_dict`` (what ``kubectl meshscope cost`` prints from a stored table) gives exactly the text of
``render_analysis`` (what ``meshscope analyze`` prints), for analyses with and without a plan, after a JSON round
trip (the ConfigMap holds JSON text)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshscope.analysis import analyze, render_analysis, render_analysis_dict
from meshscope.jobs.loading import spec_from_manifest
from meshscope.records import read_table
from meshscope.simulation import simulate

DATA = Path(__file__).resolve().parents[1] / "data"


def _round_trip(analysis) -> dict:
    return json.loads(json.dumps(analysis.to_dict()))


@pytest.mark.parametrize("records", ["pp2_tp2_dp2_straggler", "dp8_straggler"])
def test_records_without_a_plan_render_the_same_from_json(records) -> None:
    analysis = analyze(read_table([DATA / records / "records.jsonl"]))
    assert analysis.plan is None
    assert render_analysis_dict(_round_trip(analysis)) == render_analysis(analysis)


# A clean pp2 tp2 cp2 dp4 job (as tests/core/test_collectives.py simulates it): every collectives row and stage.
PLANNED = {
    "apiVersion": "meshscope.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "rendering"},
    "spec": {
        "model": {"preset": "llama3-8b"},
        "parallelism": {"tp": 2, "cp": 2, "pp": 2, "dp": 4},
        "training": {"microBatchSize": 1, "globalBatchSize": 8, "distributedOptimizer": True},
        "hardware": {"gpu": "H100", "nodes": 4, "gpusPerNode": 8},
    },
}


def test_a_planned_job_renders_the_same_from_json_collectives_and_memory_included() -> None:
    result = simulate(spec_from_manifest(PLANNED), steps=2)
    analysis = analyze(result.table, plan=result.plan)
    text = render_analysis(analysis)
    assert "Collectives per GPU per step, by pipeline stage" in text
    assert "Memory per GPU per stage" in text
    assert "as planned" in text
    assert render_analysis_dict(_round_trip(analysis)) == text


def test_a_table_that_is_not_an_analysis_raises_a_lookup_or_type_error() -> None:
    with pytest.raises(KeyError):
        render_analysis_dict({"job": "x"})
    with pytest.raises(TypeError):
        render_analysis_dict([])  # type: ignore[arg-type]

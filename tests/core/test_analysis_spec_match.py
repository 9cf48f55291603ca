"""``analyze`` refuses a spec whose layout did not make the records (every number would be silently wrong)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshscope.analysis import analyze
from meshscope.errors import ParseError
from meshscope.jobs.loading import load_spec
from meshscope.records import read_table, write_records
from meshscope.simulation import load_scenario, simulate

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "examples" / "scenarios"


def test_spec_of_another_layout_is_refused() -> None:
    result = simulate(load_scenario(SCENARIOS / "dp8-handmade.yaml"))
    other = load_spec(ROOT / "examples" / "llama3-8b-h100.yaml")  # dp=32 tp=2: rank 1 is tp=1 there, dp=1 here
    with pytest.raises(ParseError, match=r"rank 1 was recorded at dp=1 tp=0 .* puts it at dp=0 tp=1"):
        analyze(result.table, spec=other)


def test_spec_with_fewer_ranks_than_the_records_is_refused() -> None:
    result = simulate(load_scenario(SCENARIOS / "dp8-handmade.yaml"))  # 8 ranks
    smaller = load_scenario(SCENARIOS / "pipeline-1f1b.yaml").spec  # 4 ranks
    with pytest.raises(ParseError, match=r"the records hold rank 4 but spec 'pipeline-1f1b' has 4 ranks"):
        analyze(result.table, spec=smaller)


def test_own_spec_with_a_missing_rank_is_partial_data_not_an_error(tmp_path: Path) -> None:
    scenario = load_scenario(SCENARIOS / "dp8-handmade.yaml")
    full = tmp_path / "full.jsonl"
    write_records(full, simulate(scenario).table)
    kept = [line for line in full.read_text().splitlines() if json.loads(line)["rank"] != 5]
    partial = tmp_path / "partial.jsonl"
    partial.write_text("\n".join(kept) + "\n")
    analysis = analyze(read_table(partial), spec=scenario.spec).to_dict()
    assert (analysis["ranks_seen"], analysis["world_size"]) == (7, 8)
    assert analysis["partial_data"], "a missing rank must be reported as partial data"
    assert all(row["label"].endswith("(partial data)") for row in analysis["rows"])

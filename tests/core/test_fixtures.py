"""Generated fixtures are what their generators write today: a stale fixture fails here, not in a report test.

tests/data/pp2_tp2_dp2_straggler holds records written by its make_records.py and the ``analyze`` output of those
records (with hand-written findings), which the report tests read instead of running the analysis. Both are
regenerated in a temporary folder and compared.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from meshscope.records import read_records, write_records

if TYPE_CHECKING:
    from types import ModuleType

PP2 = Path(__file__).resolve().parents[1] / "data" / "pp2_tp2_dp2_straggler"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pp2_make_records", PP2 / "make_records.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_pp2_records_are_what_make_records_writes(tmp_path: Path) -> None:
    fresh = tmp_path / "records.jsonl"
    write_records(fresh, _generator().records())
    assert fresh.read_bytes() == (PP2 / "records.jsonl").read_bytes()
    assert len(read_records(fresh)) == 32  # 8 ranks x 4 steps


def test_the_pp2_analysis_json_is_what_analyze_writes_today() -> None:
    make = _generator()
    stored = json.loads((PP2 / "analysis.json").read_text(encoding="utf-8"))
    today = make.analysis(PP2 / "records.jsonl")
    # Field by field first, so that a failure names what drifted.
    assert sorted(stored) == sorted(today)
    for key in today:
        assert stored[key] == today[key], key
    assert (PP2 / "analysis.json").read_text(encoding="utf-8") == make.analysis_text(PP2 / "records.jsonl")


def test_the_hand_written_finding_names_the_straggler_the_analysis_finds() -> None:
    # The report tests show a hand-written finding; it must still be the one the analysis reaches (rank 5, node-0).
    from meshscope.analysis import analyze  # noqa: PLC0415
    from meshscope.records import read_table  # noqa: PLC0415

    found = analyze(read_table(PP2 / "records.jsonl")).to_dict()["findings"]
    # (rank 3's extra 6 ms of data wait in step 1 is a second, data-phase straggler the report tests leave out)
    suspects = {f["suspects"][0]["rank"]: f["suspects"][0] for f in found if f["code"] == "straggler"}
    assert sorted(suspects) == [3, 5]
    assert suspects[5]["node"] == "node-0"
    (hand,) = _generator().HAND_FINDINGS
    assert (hand["code"], hand["suspects"][0]["rank"], hand["suspects"][0]["node"]) == ("straggler", 5, "node-0")

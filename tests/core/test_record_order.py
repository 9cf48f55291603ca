"""The cost table of a set of records must not depend on the order the records arrive in.

The deep tier of the operator concatenates the sidecars' answers in the order they arrive (concurrent requests),
and ``meshscope analyze`` reads files in the order given, so the same records reach the core in any order.
``tests/data/record_order/gloo_window.jsonl`` is one window (steps 0-1) of the real 4-rank gloo job of
tests/kube/test_end_to_end.py (tp=2, dp=2 on node-c and node-d, two ranks each), as its two sidecars held it:
node-c's four records first, then node-d's. Swapping the two nodes' halves changes no record.
"""

from __future__ import annotations

from pathlib import Path

from meshscope.analysis import analyze
from meshscope.records import table_from_lines

WINDOW = Path(__file__).resolve().parents[1] / "data" / "record_order" / "gloo_window.jsonl"


def test_swapping_two_nodes_records_leaves_the_table_as_it_was() -> None:
    lines = WINDOW.read_bytes().splitlines(keepends=True)
    assert len(lines) == 8  # ranks 0-3, steps 0-1
    half = len(lines) // 2
    as_held = analyze(table_from_lines(lines)).to_dict()
    swapped = analyze(table_from_lines(lines[half:] + lines[:half])).to_dict()
    assert swapped["rows"] == as_held["rows"]
    assert swapped["summary"] == as_held["summary"]

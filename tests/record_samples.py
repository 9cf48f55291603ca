"""Sample step records shared by the record tests: one valid record of every field, and a grammar fuzzer that
changes one field of a few of them (importable because pytest puts ``tests/`` on the path)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from hypothesis import strategies as st

from meshscope.errors import ParseError
from meshscope.records import BetweenSteps, DataStats, Interval, StepRecord, record_to_json
from meshscope.topology.layout import RankCoord

if TYPE_CHECKING:
    from pathlib import Path


def make_record(rank: int = 0, step: int = 0, *, job: str = "demo", **overrides) -> StepRecord:
    t0 = 1_700_000_000_000_000 + step * 100_000
    fields = {
        "job": job,
        "step": step,
        "rank": rank,
        "coord": RankCoord(dp=rank // 2, tp=rank % 2, pp=0, cp=0, ep=0),
        "node": f"node-{rank // 4}",
        "nvlink_domain": "nvl-0",
        "network_tier": "block-0",
        "gpu": rank % 4,
        "attempt_start_us": 1_699_999_990_000_000 + rank,
        "start_us": t0,
        "end_us": t0 + 100_000,
        "intervals": (
            Interval(kind="data", start_us=t0, end_us=t0 + 5_000),
            Interval(kind="compute", start_us=t0 + 5_000, end_us=t0 + 40_000, phase="forward"),
            Interval(
                kind="comm",
                start_us=t0 + 40_000,
                end_us=t0 + 45_000,
                axis="tp",
                op="all_reduce",
                group=f"tp:{rank // 2}",
                seq=step,
                size_bytes=8_388_608,
                group_size=2,
            ),
            Interval(
                kind="p2p",
                start_us=t0 + 45_000,
                end_us=t0 + 47_000,
                axis="pp",
                op="recv",
                group="pp:0-1",
                seq=step,
                size_bytes=4_194_304,
                peer=rank + 8,
            ),
            Interval(kind="compute", start_us=t0 + 47_000, end_us=t0 + 90_000, phase="backward"),
            Interval(kind="optimizer", start_us=t0 + 90_000, end_us=t0 + 95_000),
            Interval(kind="checkpoint", start_us=t0 + 95_000, end_us=t0 + 100_000),
        ),
        "stats": DataStats(
            tokens=16384,
            sequences=4,
            longest_sequence=8192,
            attention_work=2.1e8,
            attention_us=5100,
            peak_memory_bytes=123_456_789,
        ),
        "gpu_util": 0.97,
        "user_step": step % 2,
        "gap_before_us": 2_500,
        "between_steps": BetweenSteps(checkpoint_us=1_500, eval_us=500, comm_us=300),
        "runqueue_wait_us": 700,
        "on_cpu_us": 90_000,
        "compute_runqueue_wait_us": 500,
        "data_runqueue_wait_us": 150,
        "optimizer_runqueue_wait_us": 50,
    }
    fields.update(overrides)
    return StepRecord(**fields)


def sample_records() -> list[StepRecord]:
    return [make_record(rank, step) for step in range(2) for rank in range(4)]


def write_lines(path: Path, objs: list[dict], *, tail: str = "") -> Path:
    text = "".join(json.dumps(o) + "\n" for o in objs) + tail
    path.write_text(text)
    return path


def good_json(rank: int = 0, step: int = 0, **changes) -> dict:
    obj = record_to_json(make_record(rank, step))
    obj.update(changes)
    return obj


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
_FIELDS = [*good_json(0), "stats.tokens", "stats.attention_work", "coord.tp", "between_steps.eval"]
_INTERVAL_FIELDS = ["kind", "start_us", "end_us", "phase", "axis", "op", "group", "seq", "bytes", "group_size", "peer"]


@st.composite
def _records_one_field_changed(draw: st.DrawFn) -> list[dict]:
    """A few valid records of the grammar, one field of one of them (top level, nested or an interval's) replaced
    by an arbitrary JSON value or removed, or a valid value moved within range."""
    objs = [good_json(rank, step) for step in range(2) for rank in range(draw(st.integers(1, 3)))]
    target = objs[draw(st.integers(0, len(objs) - 1))]
    where = draw(st.sampled_from(["record", "interval"]))
    if where == "interval":
        target = target["intervals"][draw(st.integers(0, len(target["intervals"]) - 1))]
        field = draw(st.sampled_from(_INTERVAL_FIELDS))
    else:
        field = draw(st.sampled_from(_FIELDS))
        if "." in field:
            head, field = field.split(".")
            target = target.setdefault(head, {}) if isinstance(target.get(head), dict) else target
    action = draw(st.sampled_from(["value", "remove", "shift"]))
    if action == "remove":
        target.pop(field, None)
    elif action == "shift" and isinstance(target.get(field), int) and not isinstance(target.get(field), bool):
        target[field] += draw(st.integers(-3, 3))
    else:
        target[field] = draw(_JSON_VALUES)
    return objs


def _outcome(read) -> tuple[str, object]:
    try:
        return "ok", read().to_records()
    except ParseError as exc:
        return "error", (exc.code, str(exc))

"""Packed columns (``meshscope.columns/7``): the same table as the JSON lines they were packed from, hand-counted
sizes, a byte cap, several sources put together, and hostile bytes refused with a ParseError naming the source."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshscope.errors import ParseCode, ParseError
from meshscope.records import (
    PACKED_SCHEMA,
    columns_from_lines,
    pack_columns,
    pack_lines,
    packed_steps,
    read_table,
    record_to_json,
    table_from_columns,
    table_from_lines,
    unpack_columns,
)
from meshscope.records.packing import LAYOUT
from record_samples import _outcome, _records_one_field_changed, good_json, write_lines

ROW_BYTES = 277
"""One rank-step's columns, counted by hand from the layout below: rank, step, start_us, end_us 4 x 8; coord 5 x 8;
node, nvlink_domain, network_tier, gpu 4 x 4; gpu_util 8; tokens, sequences, longest_sequence, attention_work,
attention_us, peak_memory_bytes 6 x 8; user_step, gap_before_us 2 x 8; between_us 5 x 8; between_comm_us 8; runqueue_wait_us,
on_cpu_us, compute_runqueue_wait_us, data_runqueue_wait_us, optimizer_runqueue_wait_us, attempt_start_us 6 x 8; source_file 4; source_line 8;
n_intervals 8; raised 1."""
INTERVAL_BYTES = 52
"""One interval's: kind 1, start_us and end_us 2 x 8, phase, axis, op 3 x 1, group 4, seq and size_bytes 2 x 8,
group_size 4, peer 8."""


def _lines(objs: list[dict]) -> list[bytes]:
    return [json.dumps(o).encode() + b"\n" for o in objs]


def _objs() -> list[dict]:
    """Two steps of four ranks on two nodes, every field of the schema used (tests/core/test_records.py)."""
    return [good_json(rank, step) for step in range(2) for rank in range(4)]


def test_the_layout_is_the_schema_version() -> None:
    # A change of the columns is a new schema version: change both, and the readers of the old version refuse it.
    assert PACKED_SCHEMA == "meshscope.columns/7"
    assert [(part, name, dtype, tail) for part, name, dtype, tail in LAYOUT] == [
        ("rows", "rank", "<i8", ()),
        ("rows", "step", "<i8", ()),
        ("rows", "start_us", "<i8", ()),
        ("rows", "end_us", "<i8", ()),
        ("rows", "coord", "<i8", (5,)),
        ("rows", "node", "<i4", ()),
        ("rows", "nvlink_domain", "<i4", ()),
        ("rows", "network_tier", "<i4", ()),
        ("rows", "gpu", "<i4", ()),
        ("rows", "gpu_util", "<f8", ()),
        ("rows", "tokens", "<i8", ()),
        ("rows", "sequences", "<i8", ()),
        ("rows", "longest_sequence", "<i8", ()),
        ("rows", "attention_work", "<f8", ()),
        ("rows", "attention_us", "<i8", ()),
        ("rows", "peak_memory_bytes", "<i8", ()),
        ("rows", "user_step", "<i8", ()),
        ("rows", "gap_before_us", "<i8", ()),
        ("rows", "between_us", "<i8", (5,)),
        ("rows", "between_comm_us", "<i8", ()),
        ("rows", "runqueue_wait_us", "<i8", ()),
        ("rows", "on_cpu_us", "<i8", ()),
        ("rows", "compute_runqueue_wait_us", "<i8", ()),
        ("rows", "data_runqueue_wait_us", "<i8", ()),
        ("rows", "optimizer_runqueue_wait_us", "<i8", ()),
        ("rows", "attempt_start_us", "<i8", ()),
        ("rows", "source_file", "<i4", ()),
        ("rows", "source_line", "<i8", ()),
        ("rows", "n_intervals", "<i8", ()),
        ("rows", "raised", "|i1", ()),
        ("intervals", "kind", "|i1", ()),
        ("intervals", "start_us", "<i8", ()),
        ("intervals", "end_us", "<i8", ()),
        ("intervals", "phase", "|i1", ()),
        ("intervals", "axis", "|i1", ()),
        ("intervals", "op", "|i1", ()),
        ("intervals", "group", "<i4", ()),
        ("intervals", "seq", "<i8", ()),
        ("intervals", "size_bytes", "<i8", ()),
        ("intervals", "group_size", "<i4", ()),
        ("intervals", "peer", "<i8", ()),
    ]


def test_packed_lines_read_back_as_the_table_of_the_lines() -> None:
    lines = _lines(_objs())
    data, held = pack_lines(lines, where="node-0")
    assert held == len(lines)
    header = json.loads(data[: data.index(b"\n")])
    assert (header["schema"], header["job"], header["steps"], header["lines"]) == (PACKED_SCHEMA, "demo", [0, 1], 8)
    assert len(data) == data.index(b"\n") + 1 + 8 * ROW_BYTES + 8 * 7 * INTERVAL_BYTES  # 7 intervals a record
    assert packed_steps(data, where="node-0") == {0, 1}
    table = table_from_columns([unpack_columns(data, where="node-0")])
    assert table.to_records() == table_from_lines(lines).to_records()
    assert table.source_files == ("node-0",)


ADDED_IN = (
    ("on_cpu_us",),
    ("compute_runqueue_wait_us",),
    ("attempt_start_us",),
    ("raised",),
    ("between_comm_us",),
    ("data_runqueue_wait_us", "optimizer_runqueue_wait_us"),
)
"""The row columns each version from ``meshscope.columns/2`` on added, in order (docs/records.md)."""


@pytest.mark.parametrize(
    ("schema", "lacks"),
    [
        (f"meshscope.columns/{version}", tuple(c for added in ADDED_IN[version - 1 :] for c in added))
        for version in range(1, len(ADDED_IN) + 1)
    ],
)
def test_the_versions_before_read_with_the_newer_columns_unknown(schema: str, lacks: tuple[str, ...]) -> None:
    # A sidecar of a pod started before the operator's upgrade packs an older version: the same columns without the
    # ones added since (on_cpu_us in /2, compute_runqueue_wait_us in /3, attempt_start_us in /4, raised in /5,
    # between_comm_us in /6: between_steps.comm, data_runqueue_wait_us and optimizer_runqueue_wait_us in /7). Made
    # here from a /7 message by cutting them.
    lines = _lines(_objs())
    data = pack_lines(lines, where="a")[0]
    end = data.index(b"\n")
    header = json.loads(data[:end])
    at, kept = end + 1, []
    for part, col, dtype, shape in header["columns"]:
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if not (part == "rows" and col in lacks):
            kept.append(data[at : at + size])
        at += size
    header["schema"] = schema
    header["columns"] = [c for c in header["columns"] if not (c[0] == "rows" and c[1] in lacks)]
    old = json.dumps(header).encode() + b"\n" + b"".join(kept)
    table = table_from_columns([unpack_columns(old, where="a")])
    for name in lacks:
        if name != "raised":  # no table column: a step that ended by an exception is left out of the table
            assert (getattr(table.steps, name) == -1).all(), name
    objs = [{k: v for k, v in o.items() if k not in lacks} for o in _objs()]
    for o in objs:  # between_comm_us is between_steps.comm on a line
        if "between_comm_us" in lacks:
            o["between_steps"].pop("comm")
    without = [json.dumps(o).encode() + b"\n" for o in objs]
    assert table.to_records() == table_from_lines(without).to_records()
    n = len(header["columns"])
    with pytest.raises(ParseError, match=rf"{n} columns; meshscope\.columns/7 has 41") as info:  # not /7's layout
        unpack_columns(_with_header(old, schema="meshscope.columns/7"), where="a")
    assert info.value.code == ParseCode.BAD_SHAPE


def test_several_sources_make_the_table_of_all_their_lines(tmp_path) -> None:
    objs = _objs()
    for obj in objs[4:]:  # the second source's nodes and groups are others, and named before the first's
        obj["node"] = "node-" + obj["node"]
        obj["intervals"][2]["group"] = "x" + obj["intervals"][2]["group"]
    lines = _lines(objs)
    parts = [
        unpack_columns(pack_lines(lines[4:], where="pod-b")[0], where="pod b"),
        columns_from_lines(lines[:4], where="pod a"),  # a source that answered JSON lines
    ]
    table = table_from_columns(parts)
    from_file = read_table(write_lines(tmp_path / "all.jsonl", objs[4:] + objs[:4]))
    assert table.to_records() == from_file.to_records()
    assert table.node_names == from_file.node_names
    assert table.group_names == from_file.group_names
    assert table.source_files == ("pod b", "pod a")
    assert table.where_row(5) == "pod a line 2"  # each source numbers its own lines


def test_sources_of_two_jobs_are_refused() -> None:
    other = _lines([good_json(0, 0, job="other")])
    parts = [columns_from_lines(_lines(_objs()), where="pod a"), columns_from_lines(other, where="pod b")]
    with pytest.raises(ParseError) as info:
        table_from_columns(parts)
    assert info.value.code == ParseCode.JOB_MISMATCH
    assert "pod b line 1: job 'other' does not match job 'demo' of pod a line 1" in str(info.value)


def test_only_steps_cuts_a_window_out_with_its_intervals() -> None:
    columns = columns_from_lines(_lines(_objs()), where="pod a")
    one = columns.only_steps({1})
    assert one.steps() == {1}
    assert one.raw.intervals["kind"].shape == (4 * 7,)
    assert table_from_columns([one]).to_records() == table_from_lines(_lines(_objs()[4:])).to_records()
    assert columns.only_steps({0, 1}) is columns


@pytest.mark.parametrize(("fit", "held"), [(0, 1), (1, 1), (3, 3), (8, 8)])
def test_a_byte_cap_packs_the_first_records_that_fit(fit: int, held: int) -> None:
    lines = _lines(_objs())
    whole, _ = pack_lines(lines, where="a")
    header = whole.index(b"\n") + 1
    cap = header + fit * (ROW_BYTES + 7 * INTERVAL_BYTES)  # room for `fit` records under the whole header
    data, n = pack_lines(lines, where="a", max_bytes=cap)
    assert n == held  # never none: a reader paging on always gets further
    assert len(data) <= cap or fit == 0
    assert (
        table_from_columns([unpack_columns(data, where="a")]).to_records()
        == table_from_lines(lines[:held]).to_records()
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(objs=_records_one_field_changed(), cut=st.integers(0, 6))
def test_packing_refuses_and_keeps_what_the_json_reader_does(objs: list[dict], cut: int) -> None:
    lines = [json.dumps(o).encode() for o in objs]
    expected = _outcome(lambda: table_from_lines(lines, where="src"))

    def via_packed_sources():  # split in two sources at `cut`, each packed and read back
        parts = [lines[:cut], lines[cut:]]
        return table_from_columns([unpack_columns(pack_lines(p, where="src")[0], where="src") for p in parts if p])

    got = _outcome(via_packed_sources)
    if expected[0] == "ok":
        assert got == expected
    else:
        assert got[0] == "error"
        assert got[1][0] == expected[1][0]  # the same code (a cross-source rule may name the other line)


# ---------------------------------------------------------------------------------------------------- hostile bytes


def _packed() -> bytes:
    return pack_lines(_lines(_objs()), where="a")[0]


def _with_header(data: bytes, **changes: object) -> bytes:
    end = data.index(b"\n")
    header = json.loads(data[:end])
    header.update(changes)
    return json.dumps(header).encode() + data[end:]


def _with_column(data: bytes, name: str, change) -> bytes:
    """``data`` with interval or row column ``name`` changed in place by ``change(array)``."""
    end = data.index(b"\n") + 1
    header = json.loads(data[: end - 1])
    payload = bytearray(data[end:])
    at = 0
    for part, col, dtype, shape in header["columns"]:
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if f"{part}.{col}" == name:
            arr = np.frombuffer(payload, dtype=dtype, count=int(np.prod(shape)), offset=at).copy()
            change(arr)
            payload[at : at + size] = arr.tobytes()
        at += size
    return data[:end] + bytes(payload)


@pytest.mark.parametrize(
    ("make", "code", "fragment"),
    [
        (lambda d: d[:-1], ParseCode.TRUNCATED, "the bytes end inside column intervals.peer"),
        (lambda d: d + b"\0", ParseCode.BAD_SHAPE, "1 bytes follow the last column"),
        (lambda d: d[: d.index(b"\n")], ParseCode.BAD_JSON, "no header line"),
        (lambda d: b"{" + d, ParseCode.BAD_JSON, "header is not JSON"),
        (lambda d: _with_header(d, schema="meshscope.columns/8"), ParseCode.UNSUPPORTED_SCHEMA, "columns/8"),
        (lambda d: _with_header(d, extra=1), ParseCode.WRONG_TYPE, "header"),
        (lambda d: _with_header(d, steps=[0]), ParseCode.INCONSISTENT, "the header lists steps [0]"),
        (lambda d: _with_header(d, job=None), ParseCode.MISSING_FIELD, "without a job name"),
        (
            lambda d: _with_header(d, columns=json.loads(d[: d.index(b"\n")])["columns"][:-1]),
            ParseCode.BAD_SHAPE,
            "40 columns; meshscope.columns/7 has 41",
        ),
        (
            lambda d: _with_header(
                d,
                columns=[
                    [p, c, "<i8" if c == "kind" else t, s] for p, c, t, s in json.loads(d[: d.index(b"\n")])["columns"]
                ],
            ),
            ParseCode.BAD_SHAPE,
            "column intervals.kind has dtype '<i8'; expected '|i1'",
        ),
        (
            lambda d: _with_header(d, names={**json.loads(d[: d.index(b"\n")])["names"], "node": ["n", "n"]}),
            ParseCode.VALUE_OUT_OF_RANGE,
            "the node names hold an empty or repeated name",
        ),
        (
            lambda d: _with_column(d, "rows.n_intervals", lambda a: a.__setitem__(0, 6)),
            ParseCode.INCONSISTENT,
            "the rank-steps count 55 intervals but 56 are packed",
        ),
        (
            lambda d: _with_column(d, "rows.n_intervals", lambda a: a.__setitem__(slice(0, 2), (-1, 15))),
            ParseCode.VALUE_OUT_OF_RANGE,
            "negative interval count",
        ),
        (
            lambda d: _with_column(d, "rows.node", lambda a: a.__setitem__(0, 7)),
            ParseCode.NOT_ONE_OF,
            "node codes run 0..7 but the node names are 1",
        ),
        (
            lambda d: _with_column(d, "intervals.group", lambda a: a.__setitem__(2, -2)),
            ParseCode.NOT_ONE_OF,
            "group codes run -2..",
        ),
        (
            lambda d: _with_column(d, "intervals.axis", lambda a: a.__setitem__(0, 1)),  # on a data interval
            ParseCode.INCONSISTENT,
            "axis is given on compute, data, optimizer and checkpoint intervals",
        ),
        (
            lambda d: _with_column(d, "intervals.peer", lambda a: a.__setitem__(2, 3)),  # on a comm interval
            ParseCode.INCONSISTENT,
            "peer is given on intervals that are not p2p",
        ),
        (
            lambda d: _with_column(d, "intervals.phase", lambda a: a.__setitem__(0, 0)),  # on a data interval
            ParseCode.INCONSISTENT,
            "phase is given on intervals that are not compute",
        ),
        (
            lambda d: _with_column(d, "rows.attention_work", lambda a: a.__setitem__(0, np.inf)),
            ParseCode.VALUE_OUT_OF_RANGE,
            "rows.attention_work holds an infinity",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_broken_packs_are_refused_naming_the_source(make, code: ParseCode, fragment: str) -> None:
    with pytest.raises(ParseError) as info:
        unpack_columns(make(_packed()), where="pod gpu-7")
    assert info.value.code == code
    assert str(info.value).startswith("pod gpu-7: packed columns: ")
    assert fragment in str(info.value)


def test_values_are_left_to_the_tables_checks() -> None:
    # structurally fine, but a kind code no reader makes: the table refuses it, naming the source and line
    data = _with_column(_packed(), "intervals.kind", lambda a: a.__setitem__(0, 9))  # a data interval's
    with pytest.raises(ParseError) as info:
        table_from_columns([unpack_columns(data, where="pod gpu-7")])
    assert info.value.code == ParseCode.NOT_ONE_OF
    assert "pod gpu-7 line 1: intervals[0]: kind = 9" in str(info.value)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_damage_is_a_parse_error_or_a_valid_table(data: st.DataObject) -> None:
    packed = bytearray(_packed())
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, len(packed) - 1))
        if kind == "flip":
            packed[at] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            del packed[at : at + data.draw(st.integers(1, 64))]
        else:
            packed[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        if not packed:
            packed = bytearray(b"\n")
    message, table = "", None
    try:
        table = table_from_columns([unpack_columns(bytes(packed), where="pod x")])
    except ParseError as exc:
        message = str(exc).strip()
    if table is None:
        assert message
        assert "\n" not in message
    else:  # what reads must be a table the JSON reader could have made: written as lines, it reads back the same
        lines = [json.dumps(record_to_json(r)).encode() for r in table.to_records()]
        assert table_from_lines(lines).to_records() == table.to_records()


def test_a_damaged_column_name_is_shown_with_its_escapes_on_one_line() -> None:
    # Found by the fuzz above: one byte of the header turned "longest_sequence" into "l\\ngest_sequence", which the
    # JSON header decodes to a name with a newline in it; the error printed it raw, on two lines.
    packed = _packed()
    assert packed.count(b"longest_sequence") >= 1
    damaged = packed.replace(b"longest_sequence", b"l\\ngest_sequence", 1)
    with pytest.raises(ParseError) as info:
        table_from_columns([unpack_columns(damaged, where="pod x")])
    message = str(info.value)
    assert "\n" not in message
    assert "column rows.'l\\ngest_sequence' where rows.longest_sequence belongs" in message


def test_pack_columns_of_lines_is_what_pack_lines_gives() -> None:
    lines = _lines(_objs())
    assert pack_columns(columns_from_lines(lines, where="a")) == pack_lines(lines, where="a")[0]

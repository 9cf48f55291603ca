"""Packed columns: one source's step records as the table's own columns in bytes, for records that travel in bulk.

Exists because decoding JSON lines into columns costs ~1 µs per interval (:mod:`meshscope.records.building`), and the
operator's deep tier pays it for every interval of every rank of a job in one process: 17 s for one step of a
16,384-GPU job. A sidecar decodes its own node's lines anyway; it hands them on packed (``pack_lines``), so that the
decoding is spread over every node and the operator only checks and copies (:func:`unpack_columns`, then
:func:`~meshscope.records.building.table_from_columns`). Packed columns take about 40 % of the bytes of the lines.

The format, ``meshscope.columns/7`` (media type :data:`PACKED_MEDIA_TYPE`): one line of JSON (the header: schema,
job, the step numbers held, the name tables, and every column's part, name, dtype and shape, in the order of
:data:`LAYOUT`), a newline, then every column's bytes back to back, little-endian, C order. A change of the columns
is a new schema version; a reader reads the versions before its own too (``meshscope.columns/1``: without
``on_cpu_us``, ``meshscope.columns/2``: without ``compute_runqueue_wait_us``, ``meshscope.columns/3``: without
``attempt_start_us``, ``meshscope.columns/4``: without ``raised``, ``meshscope.columns/5``: without
``between_comm_us``, ``meshscope.columns/6``: without ``data_runqueue_wait_us`` and ``optimizer_runqueue_wait_us``,
read as unknown), so that an operator
reads the sidecars of pods started before it was upgraded.

Packed bytes are input like any other: this module must not trust them. :func:`unpack_columns` checks the header,
every dtype, shape and length, the name tables and codes, and that every field a kind does not have is absent
(what a JSON reader would have made of the same records); the values' ranges and the rules across rows are the
table's checks, which run when the columns become a table. Every problem is a
:class:`~meshscope.errors.ParseError`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from meshscope.errors import ParseCode, ParseError
from meshscope.records.building import _NAMES, RecordColumns, _layout_of, _Raw, _table_of, _TableBuilder
from meshscope.records.schema import COMM_CODE, COMPUTE_CODE, P2P_CODE, UNKNOWN

if TYPE_CHECKING:
    from collections.abc import Iterable

    from numpy.typing import NDArray

PACKED_SCHEMA = "meshscope.columns/7"
"""The header's ``schema``: the version of the column layout."""
PACKED_MEDIA_TYPE = "application/vnd.meshscope.columns"
"""HTTP media type of packed columns (``Accept`` it to get them from a sidecar's ``/v1/steps``)."""
CUT_HEADER = "Meshscope-Cut"
"""HTTP response header of an answer of records that a byte cap cut short of the steps asked for (a sidecar's
``/v1/steps`` with ``max_bytes``)."""
MAX_HEADER_BYTES = 16 * 1024 * 1024
"""A header longer than this is refused (a node's name tables take a few KiB)."""


def _layout() -> tuple[tuple[str, str, str, tuple[int, ...]], ...]:
    """(part, column, dtype, trailing shape) of every packed column, in order: what the readers' columns are."""
    return tuple((part, name, dtype, shape[1:]) for part, name, dtype, shape in _layout_of(_TableBuilder().raw()))


LAYOUT = _layout()
"""The columns of :data:`PACKED_SCHEMA`: (``rows`` or ``intervals``, column, numpy dtype string, shape after the
first axis)."""
_LACKS: dict[str, tuple[tuple[str, str], ...]] = {
    "meshscope.columns/1": (
        ("rows", "on_cpu_us"),
        ("rows", "compute_runqueue_wait_us"),
        ("rows", "attempt_start_us"),
        ("rows", "raised"),
        ("rows", "between_comm_us"),
        ("rows", "data_runqueue_wait_us"),
        ("rows", "optimizer_runqueue_wait_us"),
    ),
    "meshscope.columns/2": (
        ("rows", "compute_runqueue_wait_us"),
        ("rows", "attempt_start_us"),
        ("rows", "raised"),
        ("rows", "between_comm_us"),
        ("rows", "data_runqueue_wait_us"),
        ("rows", "optimizer_runqueue_wait_us"),
    ),
    "meshscope.columns/3": (
        ("rows", "attempt_start_us"),
        ("rows", "raised"),
        ("rows", "between_comm_us"),
        ("rows", "data_runqueue_wait_us"),
        ("rows", "optimizer_runqueue_wait_us"),
    ),
    "meshscope.columns/4": (
        ("rows", "raised"),
        ("rows", "between_comm_us"),
        ("rows", "data_runqueue_wait_us"),
        ("rows", "optimizer_runqueue_wait_us"),
    ),
    "meshscope.columns/5": (
        ("rows", "between_comm_us"),
        ("rows", "data_runqueue_wait_us"),
        ("rows", "optimizer_runqueue_wait_us"),
    ),
    "meshscope.columns/6": (("rows", "data_runqueue_wait_us"), ("rows", "optimizer_runqueue_wait_us")),
}
"""The columns each older version lacks (read as unknown, -1; for ``raised``, a step that ended normally):
``on_cpu_us`` came with ``meshscope.columns/2``, ``compute_runqueue_wait_us`` with ``meshscope.columns/3``,
``attempt_start_us`` with ``meshscope.columns/4``, ``raised`` (1 where the step ended by an exception, else 0) with
``meshscope.columns/5``, ``between_comm_us`` with ``meshscope.columns/6``, ``data_runqueue_wait_us`` and
``optimizer_runqueue_wait_us`` with ``meshscope.columns/7``."""
_LAYOUTS = {
    PACKED_SCHEMA: LAYOUT,
    **{schema: tuple(c for c in LAYOUT if (c[0], c[1]) not in added) for schema, added in _LACKS.items()},
}
"""The layout of every version this reader reads."""
_ROW_BYTES, _INTERVAL_BYTES = (
    sum(np.dtype(dtype).itemsize * math.prod(tail) for p, _, dtype, tail in LAYOUT if p == part)
    for part in ("rows", "intervals")
)
"""Bytes one rank-step and one interval take in the columns."""

_NOT_APPLICABLE: tuple[tuple[str, str], ...] = (
    ("phase", "intervals that are not compute"),
    ("axis", "compute, data, optimizer and checkpoint intervals"),
    ("op", "compute, data, optimizer and checkpoint intervals"),
    ("group", "compute, data, optimizer and checkpoint intervals"),
    ("seq", "compute, data, optimizer and checkpoint intervals"),
    ("size_bytes", "compute, data, optimizer and checkpoint intervals"),
    ("group_size", "intervals that are not comm"),
    ("peer", "intervals that are not p2p"),
)
"""Interval fields that must be -1 (absent) where their kind has no such field, and where that is."""


class _Header(msgspec.Struct, forbid_unknown_fields=True):
    schema: str
    job: str | None
    steps: list[int]
    names: dict[str, list[str]]
    columns: list[tuple[str, str, str, list[int]]]
    lines: int = 0


_encode_header = msgspec.json.Encoder().encode
_decode_header = msgspec.json.Decoder(_Header).decode


def pack_lines(lines: Iterable[bytes], *, where: str, max_bytes: int | None = None) -> tuple[bytes, int]:
    """Packed columns of ``meshscope.step/1`` lines, checked as a table first (what no reader would take is refused).

    Args:
        lines: the records, one JSON object each.
        where: the lines' name in messages.
        max_bytes: pack the longest run of the first lines whose columns fit in this many bytes (at least one line,
            so that a reader paging on always gets further; that one may not fit).

    Returns:
        The packed bytes, and how many of the first lines they hold.

    Raises:
        ParseError: as :func:`~meshscope.records.building.table_from_lines` raises it.
    """
    listed = list(lines)
    builder = _TableBuilder()
    builder.read_lines(listed, where)
    raw = builder.raw(lines=len(listed))
    _table_of(raw, notes=(), source_files=(where,))
    columns = RecordColumns(where=where, raw=raw)
    data = pack_columns(columns)
    if max_bytes is None or len(data) <= max_bytes or len(listed) <= 1:
        return data, len(listed)
    header = data.index(b"\n") + 1  # a head of the rows lists no more names and steps than all of them
    sizes = _ROW_BYTES + raw.rows["n_intervals"] * _INTERVAL_BYTES
    fits = int(np.searchsorted(np.cumsum(sizes), max_bytes - header, side="right"))
    head = max(fits, 1)
    return pack_columns(_head(columns, head)), head


def _head(columns: RecordColumns, n: int) -> RecordColumns:
    """The first ``n`` rank-steps of ``columns`` (those of its first ``n`` lines) and their intervals."""
    raw = columns.raw
    spans = int(raw.rows["n_intervals"][:n].sum())
    head = replace(
        raw,
        rows={name: col[:n] for name, col in raw.rows.items()},
        intervals={name: col[:spans] for name, col in raw.intervals.items()},
        lines=n,
    )
    return RecordColumns(where=columns.where, raw=head)


def pack_columns(columns: RecordColumns) -> bytes:
    """The bytes of ``columns`` in the :data:`PACKED_SCHEMA` format."""
    raw = columns.raw
    arrays = [np.ascontiguousarray(getattr(raw, part)[name]) for part, name, _, _ in LAYOUT]
    header = _Header(
        schema=PACKED_SCHEMA,
        job=raw.job,
        steps=sorted(columns.steps()),
        names={kind: list(raw.names[kind]) for kind in _NAMES},
        columns=[
            (part, name, a.dtype.str, list(a.shape)) for (part, name, _, _), a in zip(LAYOUT, arrays, strict=True)
        ],
        lines=raw.lines,
    )
    return b"".join([_encode_header(header), b"\n", *(a.tobytes() for a in arrays)])


def packed_steps(data: bytes, *, where: str) -> frozenset[int]:
    """The step numbers a packed answer says it holds, from its header alone (:func:`unpack_columns` checks them).

    Raises:
        ParseError: the header cannot be read.
    """
    header, _ = _header_of(data, where)
    return frozenset(header.steps)


def unpack_columns(data: bytes, *, where: str) -> RecordColumns:
    """The columns of packed bytes, checked (see the module's docstring); the values get the table's checks later.

    Args:
        data: one packed message (:data:`PACKED_SCHEMA`, or an older version: see the module's docstring).
        where: the source's name for messages (``sidecar pod-3``).

    Raises:
        ParseError: naming ``where`` and what does not fit.
    """
    header, at = _header_of(data, where)
    arrays = _arrays_of(header, data, at, where)
    for part, name in _LACKS.get(header.schema, ()):  # an older version's: unknown
        dtype, tail = next((d, tl) for p, n, d, tl in LAYOUT if (p, n) == (part, name))
        length = next(iter(a.shape[0] for (p, _), a in arrays.items() if p == part))
        arrays[part, name] = np.full((length, *tail), UNKNOWN, dtype=dtype)
    names = _names_of(header, where)
    rows = {name: col for (part, name), col in arrays.items() if part == "rows"}
    intervals = {name: col for (part, name), col in arrays.items() if part == "intervals"}
    _check_spans(rows, intervals, where)
    _check_codes(rows, intervals, names, where)
    _check_absent_fields(intervals, where)
    if not np.isin(rows["raised"], (0, 1, UNKNOWN)).all():
        raise _error(where, "column rows.raised holds a value other than 0 or 1", ParseCode.VALUE_OUT_OF_RANGE)
    for part, name in (("rows", "gpu_util"), ("rows", "attention_work")):
        if np.isinf(arrays[part, name]).any():
            raise _error(where, f"column {part}.{name} holds an infinity", ParseCode.VALUE_OUT_OF_RANGE)
    held = set(np.unique(rows["step"]).tolist())
    if held != set(header.steps):
        raise _error(
            where, f"the header lists steps {sorted(header.steps)[:8]} but the rows hold others", ParseCode.INCONSISTENT
        )
    if rows["rank"].size and not header.job:
        raise _error(where, "records without a job name", ParseCode.MISSING_FIELD)
    raw = _Raw(
        job=header.job if rows["rank"].size else None,
        job_where=f"{where} line 1",
        rows=rows,
        intervals=intervals,
        names=names,
        lines=header.lines,
    )
    return RecordColumns(where=where, raw=raw)


def _arrays_of(header: _Header, data: bytes, at: int, where: str) -> dict[tuple[str, str], NDArray[Any]]:
    """Every column of ``data`` from byte ``at`` on, as the header describes it, once it fits its version's layout."""
    layout = _LAYOUTS[header.schema]
    if len(header.columns) != len(layout):
        raise _error(where, f"{len(header.columns)} columns; {header.schema} has {len(layout)}", ParseCode.BAD_SHAPE)
    arrays: dict[tuple[str, str], NDArray[Any]] = {}
    first: dict[str, int] = {}
    for (part, name, dtype, shape), (want_part, want_name, want_dtype, tail) in zip(
        header.columns, layout, strict=True
    ):
        column = f"column {_printable(part)}.{_printable(name)}"
        if (part, name) != (want_part, want_name):
            raise _error(where, f"{column} where {want_part}.{want_name} belongs", ParseCode.BAD_SHAPE)
        if dtype != want_dtype:
            raise _error(where, f"{column} has dtype {dtype!r}; expected {want_dtype!r}", ParseCode.BAD_SHAPE)
        length = first.setdefault(part, shape[0] if shape else -1)
        if tuple(shape) != (length, *tail) or length < 0:
            expected = [max(length, 0), *tail]
            raise _error(where, f"{column} has shape {shape}; expected {expected}", ParseCode.BAD_SHAPE)
        count = length * math.prod(tail)
        nbytes = count * np.dtype(dtype).itemsize
        if at + nbytes > len(data):
            raise _error(where, f"the bytes end inside {column}", ParseCode.TRUNCATED)
        arrays[part, name] = np.frombuffer(data, dtype=dtype, count=count, offset=at).reshape(shape).copy()
        at += nbytes
    if at != len(data):
        raise _error(where, f"{len(data) - at} bytes follow the last column", ParseCode.BAD_SHAPE)
    return arrays


def _printable(text: str) -> str:
    """``text`` as it is, or quoted with its escapes where a damaged header put control characters in it."""
    return text if text.isprintable() else repr(text)


def _error(where: str, problem: str, code: ParseCode) -> ParseError:
    return ParseError(f"{where}: packed columns: {problem}", code=code)


def _header_of(data: bytes, where: str) -> tuple[_Header, int]:
    end = data.find(b"\n", 0, MAX_HEADER_BYTES)
    if end < 0:
        raise _error(where, f"no header line within the first {MAX_HEADER_BYTES:,} bytes", ParseCode.BAD_JSON)
    try:
        header = _decode_header(data[:end])
    except msgspec.ValidationError as exc:
        raise _error(where, f"header: {exc}", ParseCode.WRONG_TYPE) from None
    except msgspec.DecodeError as exc:
        raise _error(where, f"header is not JSON: {exc}", ParseCode.BAD_JSON) from None
    if header.schema not in _LAYOUTS:
        raise _error(
            where,
            f"schema {header.schema[:60]!r}; this reader reads {', '.join(map(repr, sorted(_LAYOUTS)))}",
            ParseCode.UNSUPPORTED_SCHEMA,
        )
    return header, end + 1


def _names_of(header: _Header, where: str) -> dict[str, tuple[str, ...]]:
    if set(header.names) != set(_NAMES):
        raise _error(where, f"name tables {sorted(header.names)}; expected {sorted(_NAMES)}", ParseCode.BAD_SHAPE)
    names = {}
    for kind in _NAMES:
        table = header.names[kind]
        if not all(table) or len(set(table)) != len(table):
            raise _error(where, f"the {kind} names hold an empty or repeated name", ParseCode.VALUE_OUT_OF_RANGE)
        names[kind] = tuple(table)
    return names


def _check_spans(rows: dict[str, NDArray[Any]], intervals: dict[str, NDArray[Any]], where: str) -> None:
    counts = rows["n_intervals"]
    if (counts < 0).any():
        raise _error(where, "a rank-step with a negative interval count", ParseCode.VALUE_OUT_OF_RANGE)
    total = int(counts.sum(dtype=np.int64)) if counts.size else 0
    if total != intervals["kind"].shape[0]:
        raise _error(
            where,
            f"the rank-steps count {total} intervals but {intervals['kind'].shape[0]} are packed",
            ParseCode.INCONSISTENT,
        )


def _check_codes(
    rows: dict[str, NDArray[Any]], intervals: dict[str, NDArray[Any]], names: dict[str, tuple[str, ...]], where: str
) -> None:
    for part, kind, lo in (
        (rows, "node", 0),
        (rows, "nvlink_domain", UNKNOWN),
        (rows, "network_tier", UNKNOWN),
        (intervals, "group", UNKNOWN),
    ):
        col = part[kind]
        if col.size and (int(col.min()) < lo or int(col.max()) >= len(names[kind])):
            raise _error(
                where,
                f"{kind} codes run {int(col.min())}..{int(col.max())} but the {kind} names are {len(names[kind])}",
                ParseCode.NOT_ONE_OF,
            )


def _check_absent_fields(intervals: dict[str, NDArray[Any]], where: str) -> None:
    kind = intervals["kind"]
    plain = kind < COMM_CODE
    without = {
        "phase": kind != COMPUTE_CODE,
        "axis": plain,
        "op": plain,
        "group": plain,
        "seq": plain,
        "size_bytes": plain,
        "group_size": kind != COMM_CODE,
        "peer": kind != P2P_CODE,
    }
    for name, where_absent in _NOT_APPLICABLE:
        mask = without[name]
        if (intervals[name][mask] != UNKNOWN).any():
            raise _error(where, f"{name} is given on {where_absent} (it must be -1 there)", ParseCode.INCONSISTENT)

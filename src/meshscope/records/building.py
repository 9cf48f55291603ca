"""The columnar fast path: JSON lines decoded straight into typed objects, then into numpy columns a batch at a time.

:func:`~meshscope.records.reading.read_table` reads through a :class:`_TableBuilder`. Each line is decoded by
``msgspec`` into small typed objects (:class:`_Line`, and one type per interval kind, told apart by ``kind``): the
decoder checks every field's JSON type in C as it goes (whole numbers where the schema wants them, strings, objects),
ignores the fields the object parser ignores, and builds no dict per interval. A batch of such lines becomes columns
field by field: every value of one field is fetched by ``map`` over the batch (``operator.attrgetter``), coded
through a dict and packed by ``array``, so no Python bytecode runs per interval; names (node, NVLink domain, network
tier, group) are numbered in order of first appearance, once per distinct name. Values that would read wrongly as
"absent" (negative optional integers, required fields left out or null) are found over the batch's columns. On the
2-core development machine this is ~0.35 µs per interval for the decoding and ~0.8 µs for the columns, against
~1.4 and ~1.2 µs for ``json.loads`` into dicts and the same columns from them.

A batch that does not go through whole is decoded again with the standard ``json`` module (whose messages the
truncation rules quote) and taken line by line; a line the typed objects cannot take goes to the object parser
(:mod:`meshscope.records.parsing`), which raises the precise error, or, for a valid line in an unusual spelling,
hands back its canonical form. So both readers accept the same lines (booleans are not numbers in either) and raise
the same per-line errors. The rules that span rows (ranges, codes, duplicates, collectives) are left to
:class:`~meshscope.records.tables.RecordTable`.

The builder's columns (:class:`_Raw`) are also what a worker process hands back. This module must not open files
other than through :mod:`meshscope.records.decoding`.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, replace
from functools import partial
from itertools import chain, compress, repeat
from operator import attrgetter, is_
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from meshscope.errors import ParseCode, ParseError
from meshscope.records.decoding import _BATCH_LINES, _decode_batch, _raw_batches
from meshscope.records.memory import mapped_empty
from meshscope.records.parsing import _parse_record, record_to_json
from meshscope.records.schema import (
    AXIS_CODE,
    BETWEEN_COMM,
    BETWEEN_KINDS,
    COMM_CODE,
    COMPUTE_CODE,
    KIND_CODE,
    MAX_RAISED_CHARS,
    OP_CODE,
    PHASE_CODE,
    SCHEMA,
    UNKNOWN,
    Note,
    _job_mismatch,
)
from meshscope.records.tables import IntervalColumns, RecordTable, StepColumns, raised_steps_note, sorted_codes
from meshscope.topology import AXES

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterable, Sequence
    from pathlib import Path

    from numpy.typing import NDArray

    from meshscope.progress import Phase

_INT32_MAX = int(np.iinfo(np.int32).max)
_NAMES = ("node", "nvlink_domain", "network_tier", "group")
"""Name-valued fields, coded into ``RecordTable.<field>_names``; all but ``node`` are optional."""
_STATS = ("tokens", "sequences", "longest_sequence", "attention_us", "peak_memory_bytes")
"""Integer stats (``attention_work`` is the one float)."""
_PHASE_OR_NONE: dict[str | None, int] = dict([(None, UNKNOWN), *PHASE_CODE.items()])
_is_none = partial(is_, None)
_NEW = -2
"""Code of a name not seen before, while a batch is coded."""


# ====================================================================== the typed objects a line decodes into
# Field types are JSON types only (the decoder's checks); ranges and codes are checked over columns. An optional
# field may be left out or null (as the object parser reads it: ``None`` either way); a required one that is null
# is refused over the columns. ``gc=False``: decoded lines hold no reference cycles, so the cyclic collector need not
# track millions of them.


class CoordFields(msgspec.Struct, gc=False):
    """A record's ``coord`` (read and written)."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int


class StatsFields(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """A record's ``stats`` (read and written; absent fields left out when written)."""

    tokens: int | None = None
    sequences: int | None = None
    longest_sequence: int | None = None
    attention_work: float | None = None
    attention_us: int | None = None
    peak_memory_bytes: int | None = None


_NO_STATS = StatsFields()


class BetweenFields(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """A record's ``between_steps`` (read and written; kinds of :data:`BETWEEN_KINDS`, absent ones left out)."""

    data: int | None = None
    compute: int | None = None
    optimizer: int | None = None
    checkpoint: int | None = None
    eval: int | None = None
    comm: int | None = None
    """Time blocked in collectives between the steps (``BETWEEN_COMM``: inside the kinds, not one of them)."""


# One type per interval kind, told apart by ``kind`` (a tagged union, decoded in C): each declares only the fields
# the object parser reads for its kind, so the others are ignored as the object parser ignores them.


class _Compute(msgspec.Struct, tag_field="kind", tag="compute", gc=False):
    start_us: int
    end_us: int
    phase: str | None = None


class _Data(msgspec.Struct, tag_field="kind", tag="data", gc=False):
    start_us: int
    end_us: int


class _Optimizer(msgspec.Struct, tag_field="kind", tag="optimizer", gc=False):
    start_us: int
    end_us: int


class _Checkpoint(msgspec.Struct, tag_field="kind", tag="checkpoint", gc=False):
    start_us: int
    end_us: int


class _Comm(msgspec.Struct, tag_field="kind", tag="comm", gc=False):
    start_us: int
    end_us: int
    axis: str | None = None
    op: str | None = None
    group: str | None = None
    seq: int | None = None
    size_bytes: int | None = msgspec.field(default=None, name="bytes")
    group_size: int | None = None


class _P2P(msgspec.Struct, tag_field="kind", tag="p2p", gc=False):
    start_us: int
    end_us: int
    axis: str | None = None
    op: str | None = None
    group: str | None = None
    seq: int | None = None
    size_bytes: int | None = msgspec.field(default=None, name="bytes")
    peer: int | None = None


_Interval = _Compute | _Data | _Optimizer | _Checkpoint | _Comm | _P2P
_KIND_OF_TYPE: dict[type, int] = {
    t: KIND_CODE[str(t.__struct_config__.tag)] for t in (_Compute, _Data, _Optimizer, _Checkpoint, _Comm, _P2P)
}
"""Interval type -> kind code (:data:`~meshscope.records.schema.KIND_CODE`, which every kind must be in)."""


class _Line(msgspec.Struct, gc=False):
    schema: str
    job: str
    step: int
    rank: int
    coord: CoordFields
    node: str
    start_us: int
    end_us: int
    intervals: list[_Interval]
    nvlink_domain: str | None = None
    network_tier: str | None = None
    gpu: int | None = None
    stats: StatsFields | None = _NO_STATS
    gpu_util: float | None = None
    user_step: int | None = None
    gap_before_us: int | None = None
    between_steps: BetweenFields | None = None
    runqueue_wait_us: int | None = None
    on_cpu_us: int | None = None
    compute_runqueue_wait_us: int | None = None
    data_runqueue_wait_us: int | None = None
    optimizer_runqueue_wait_us: int | None = None
    attempt_start_us: int | None = None
    raised: str | None = None


_decode_line = msgspec.json.Decoder(_Line).decode

_schema_of, _job_of, _intervals_of, _coord_of = (attrgetter(k) for k in ("schema", "job", "intervals", "coord"))
_node_of, _domain_of, _tier_of = attrgetter("node"), attrgetter("nvlink_domain"), attrgetter("network_tier")
_gpu_of, _util_of, _stats_of = attrgetter("gpu"), attrgetter("gpu_util"), attrgetter("stats")
_user_step_of, _gap_of, _between_of = attrgetter("user_step"), attrgetter("gap_before_us"), attrgetter("between_steps")
_between_kinds_of = attrgetter(*BETWEEN_KINDS)
_between_comm_of = attrgetter(BETWEEN_COMM)
_runqueue_of, _on_cpu_of = attrgetter("runqueue_wait_us"), attrgetter("on_cpu_us")
_in_compute_of, _attempt_of = attrgetter("compute_runqueue_wait_us"), attrgetter("attempt_start_us")
_in_data_of, _in_optimizer_of = attrgetter("data_runqueue_wait_us"), attrgetter("optimizer_runqueue_wait_us")
_raised_of = attrgetter("raised")
_row_ints_of = attrgetter("rank", "step", "start_us", "end_us")
_axes_of = attrgetter(*(a.value for a in AXES))
_start_of, _end_of, _phase_of = attrgetter("start_us"), attrgetter("end_us"), attrgetter("phase")
_axis_of, _op_of, _group_of = attrgetter("axis"), attrgetter("op"), attrgetter("group")
_seq_of, _bytes_of = attrgetter("seq"), attrgetter("size_bytes")
_group_size_of, _peer_of = attrgetter("group_size"), attrgetter("peer")


class _SlowPathError(Exception):
    """Internal: the fast path cannot take this batch; its lines are retried one by one, then by the object parser."""


_NOT_FAST = (_SlowPathError, KeyError, TypeError, ValueError, OverflowError, AttributeError, IndexError)
"""What a value the fast path cannot take raises on the way into a column (bad JSON or JSON type, which
``msgspec`` reports as ``ValueError``; an unknown code; a number too big)."""


def _ints(values: Iterable[Any]) -> NDArray[np.int64]:
    """Whole numbers as int64; a number beyond int64 raises ``OverflowError``.

    ``array`` is strict where ``np.fromiter`` would cast, and it packs a list faster than an iterator.
    """
    packed = array("q", values if isinstance(values, list | tuple) else list(values))
    return np.frombuffer(packed, dtype=np.int64) if len(packed) else np.zeros(0, dtype=np.int64)


def _floats(values: Iterable[Any]) -> NDArray[np.float64]:
    """Numbers as float64."""
    packed = array("d", list(values))
    return np.frombuffer(packed, dtype=np.float64) if len(packed) else np.zeros(0, dtype=np.float64)


def _optional_floats(values: Iterable[float | None]) -> NDArray[np.float64]:
    """Optional finite numbers as float64, NaN where left out or null.

    Raises:
        _SlowPathError: for a NaN or infinity given (which JSON cannot spell, but Python's ``json`` reads).
    """
    listed = list(values)
    if None not in listed:
        col = _floats(listed)
        given = np.ones(col.size, dtype=bool)
    else:
        col = _floats([math.nan if v is None else v for v in listed])
        given = ~np.fromiter(map(_is_none, listed), dtype=bool, count=len(listed))
    if not np.isfinite(col[given]).all():
        raise _SlowPathError
    return col


def _raised_column(values: list[str | None]) -> NDArray[np.int8]:
    """1 where a line says its step ended by an exception (``raised``), else 0."""
    if values.count(None) == len(values):
        return np.zeros(len(values), dtype=np.int8)
    if any(v is not None and not 0 < len(v) <= MAX_RAISED_CHARS for v in values):
        raise _SlowPathError  # the object parser names the line and the field
    return np.fromiter((v is not None for v in values), dtype=np.int8, count=len(values))


def _codes_of(values: Iterable[int]) -> NDArray[np.int8]:
    """Codes 0 .. 127 this module looked up itself (``bytes`` packs them fastest)."""
    return np.frombuffer(bytes(values), dtype=np.int8).copy()


def _codes_or_unknown(values: Iterable[int]) -> NDArray[np.int8]:
    """Codes -1 .. 127 this module looked up itself."""
    packed = array("b", list(values))
    return np.frombuffer(packed, dtype=np.int8) if len(packed) else np.zeros(0, dtype=np.int8)


def _ints_or_absent(values: Iterable[int | None]) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
    """Optional whole numbers as int64 (0 where left out or null) and where they were left out."""
    listed = values if isinstance(values, list | tuple) else list(values)
    if None not in listed:
        col = _ints(listed)
        return col, np.zeros(col.size, dtype=bool)
    absent = np.fromiter(map(_is_none, listed), dtype=bool, count=len(listed))
    return _ints([0 if v is None else v for v in listed]), absent


def _optional_ints(values: Iterable[int | None]) -> NDArray[np.int64]:
    """An optional integer >= 0 as a column with -1 where left out.

    Raises:
        _SlowPathError: for a negative value (which would read as "unknown").
    """
    col, absent = _ints_or_absent(values)
    if (col < 0).any():
        raise _SlowPathError
    return np.where(absent, UNKNOWN, col)


def _between_columns(values: list[BetweenFields | None]) -> NDArray[np.int64]:
    """``between_steps`` as rows of :data:`BETWEEN_KINDS`: -1 throughout where left out, 0 for a kind left out.

    Raises:
        _SlowPathError: for a negative value (which would read as "unknown").
    """
    n = len(values)
    width = len(BETWEEN_KINDS)
    if values.count(None) == n:
        return np.full((n, width), UNKNOWN, dtype=np.int64)
    flat = chain.from_iterable(repeat(None, width) if v is None else _between_kinds_of(v) for v in values)
    col, _ = _ints_or_absent(list(flat))
    if (col < 0).any():
        raise _SlowPathError
    col = col.reshape(n, width)
    missing = np.fromiter(map(_is_none, values), dtype=bool, count=n)
    col[missing] = UNKNOWN
    return col


def _between_comm_column(values: list[BetweenFields | None]) -> NDArray[np.int64]:
    """``between_steps.comm`` per row: -1 where the record has no ``between_steps``, 0 where it leaves ``comm`` out.

    Raises:
        _SlowPathError: for a negative value (which would read as "unknown").
    """
    if values.count(None) == len(values):
        return np.full(len(values), UNKNOWN, dtype=np.int64)
    return _optional_ints([None if v is None else (_between_comm_of(v) or 0) for v in values])


@dataclass(frozen=True, slots=True, kw_only=True)
class _Raw:
    """A reader's columns before the table's checks (a worker writes them to a file for the parent to merge)."""

    job: str | None
    job_where: str
    rows: dict[str, NDArray[Any]]
    """Rank-step columns as :meth:`StepColumns.build` takes them (``coord`` has shape ``(rows, 5)``), plus
    ``n_intervals`` per row."""
    intervals: dict[str, NDArray[Any]]
    """Interval columns as :meth:`IntervalColumns.build` takes them, without ``row``."""
    names: dict[str, tuple[str, ...]]
    """Names of the codes in ``node``, ``nvlink_domain``, ``network_tier`` and ``group``."""
    lines: int = 0
    """Physical lines read (a worker's chunk), to number the next chunk's lines."""


class _TableBuilder:
    """Columns of decoded lines, a batch at a time; :meth:`raw` and :meth:`build` put them together."""

    def __init__(self) -> None:
        self.job: str | None = None
        self.job_where = ""
        self.names: dict[str, dict[str, int]] = {k: {} for k in _NAMES}
        # name -> code, plus None -> UNKNOWN where the field is optional: one dict lookup codes a value.
        self.lookup: dict[str, dict[str | None, int]] = {k: {} if k == "node" else {None: UNKNOWN} for k in _NAMES}
        self.rows: list[dict[str, NDArray[Any]]] = []
        self.intervals: list[dict[str, NDArray[Any]]] = []

    def read_file(
        self,
        path: Path,
        file_index: int,
        allow_partial: bool,  # noqa: FBT001
        notes: list[Note],
        *,
        span: tuple[int, int] | None = None,
        last: bool = True,
        phase: Phase | None = None,
    ) -> int:
        """Append every line of ``path`` (or of a byte span of it); tell ``phase`` the bytes read, a batch at a time.

        Returns:
            The number of physical lines read.

        Raises:
            ParseError: for the first line that breaks a rule checked per line (as the object parser words it).
        """
        counted: list[int] = []
        tally, told = [0], 0  # bytes read, and told to ``phase``
        batches = _raw_batches(
            path,
            allow_partial,
            notes,
            span=span,
            last=last,
            counted=counted,
            tally=tally if phase is not None else None,
        )
        for batch, final in batches:
            if phase is not None:
                phase.advance(tally[0] - told)
                told = tally[0]
            self._read_batch(batch, file_index, path, final=final, allow_partial=allow_partial, notes=notes)
        if phase is not None:
            phase.advance(tally[0] - told)
        return counted[0] if counted else 0

    def read_lines(self, lines: Iterable[bytes], where: str) -> None:
        """Append record lines already in memory, numbered from 1 in the order given; blank lines are skipped.

        No truncation rule applies (nothing was cut off mid-write): a bad line anywhere is an error naming it.

        Raises:
            ParseError: for the first line that breaks a rule checked per line (as the object parser words it).
        """
        batch: list[tuple[int, bytes]] = []
        for lineno, raw in enumerate(lines, 1):
            if not raw or raw.isspace():
                continue
            batch.append((lineno, raw))
            if len(batch) == _BATCH_LINES:
                self._read_batch(batch, 0, where, final=False, allow_partial=False, notes=[])
                batch = []
        if batch:
            self._read_batch(batch, 0, where, final=False, allow_partial=False, notes=[])

    def _read_batch(
        self,
        batch: list[tuple[int, bytes]],
        file_index: int,
        path: Path | str,
        *,
        final: bool,
        allow_partial: bool,
        notes: list[Note],
    ) -> None:
        """One batch: typed decoding straight into columns, else ``json`` and the line-by-line fallbacks."""
        linenos = [lineno for lineno, _ in batch]
        try:
            self._add_batch(list(map(_decode_line, [raw for _, raw in batch])), file_index, linenos, path)
        except _NOT_FAST:
            pass
        else:
            return
        linenos, objs = _decode_batch(path, batch, final=final, allow_partial=allow_partial, notes=notes)
        self._add_decoded(objs, file_index, linenos, path)

    def _add_decoded(self, objs: list[Any], file_index: int, linenos: list[int], path: Path | str) -> None:
        """A batch the typed decoder refused, decoded by ``json``: each line typed alone, else by the object parser."""
        lines = [_typed(obj, f"{path} line {lineno}") for lineno, obj in zip(linenos, objs, strict=True)]
        if not lines:
            return
        try:
            self._add_batch(lines, file_index, linenos, path)
        except _NOT_FAST:
            for line, obj, lineno in zip(lines, objs, linenos, strict=True):
                self._add_line(line, obj, file_index, lineno, path)

    def _add_line(self, line: _Line, obj: object, file_index: int, lineno: int, path: Path | str) -> None:
        """One line alone; if the fast path still cannot take it, the object parser decides."""
        try:
            self._add_batch([line], file_index, [lineno], path)
        except _NOT_FAST:
            where = f"{path} line {lineno}"
            rec = _parse_record(obj, where)  # raises the precise error in practice
            if self.job is not None and rec.job != self.job:
                raise ParseError(
                    _job_mismatch(rec.job, where, self.job, self.job_where), code=ParseCode.JOB_MISMATCH
                ) from None
            try:  # a valid record in its canonical form (nulls left out, ...)
                self._add_batch([msgspec.convert(record_to_json(rec), _Line)], file_index, [lineno], path)
            except _NOT_FAST:
                raise ParseError(_OUT_OF_RANGE.format(where=where), code=ParseCode.VALUE_OUT_OF_RANGE) from None

    def _add_batch(self, lines: list[_Line], file_index: int, linenos: list[int], path: Path | str) -> None:
        """Append a batch of typed lines, all or nothing.

        Raises:
            _SlowPathError: (or what :data:`_NOT_FAST` names) if any value of the batch cannot be taken as it is.
        """
        n = len(lines)
        if list(map(_schema_of, lines)).count(SCHEMA) != n:
            raise _SlowPathError
        jobs = set(map(_job_of, lines))
        job = jobs.pop()
        if jobs or (job != self.job and (self.job is not None or not job)):
            raise _SlowPathError
        pending: dict[str, dict[str, int]] = {k: {} for k in _NAMES}
        rows = self._rows(lines, pending)
        intervals, counts = self._intervals(list(map(_intervals_of, lines)), pending)
        rows["n_intervals"] = counts
        rows["source_file"] = np.full(n, file_index, dtype=np.int32)
        rows["source_line"] = np.asarray(linenos, dtype=np.int64)
        # Nothing above changed the builder: commit.
        if self.job is None:
            self.job, self.job_where = job, f"{path} line {linenos[0]}"
        for kind, new in pending.items():
            self.names[kind].update(new)
            self.lookup[kind].update(new)
        self.rows.append(rows)
        self.intervals.append(intervals)

    def _codes(self, kind: str, values: Sequence[Any], pending: dict[str, dict[str, int]]) -> NDArray[np.int32]:
        """Codes of names (UNKNOWN for a left-out optional one); names not seen before go to ``pending``.

        Raises:
            _SlowPathError: for an empty name.
        """
        codes = np.frombuffer(array("i", list(map(self.lookup[kind].get, values, repeat(_NEW)))), dtype=np.int32)
        if codes.size == 0:
            return np.zeros(0, dtype=np.int32)
        new_at = codes == _NEW
        if not new_at.any():
            return codes
        new_names = list(compress(values, new_at.tolist()))
        new = pending[kind]
        base = len(self.names[kind])
        for name in dict.fromkeys(new_names):  # in order of first appearance, as the names are numbered
            if not name:
                raise _SlowPathError
            new.setdefault(name, base + len(new))
        codes = codes.copy()
        codes[new_at] = np.frombuffer(array("i", list(map(new.__getitem__, new_names))), dtype=np.int32)
        return codes

    def _rows(self, lines: list[_Line], pending: dict[str, dict[str, int]]) -> dict[str, NDArray[Any]]:
        """The rank-step columns of a batch; fields fetched together where the schema requires them all."""
        n = len(lines)
        times = _ints(chain.from_iterable(map(_row_ints_of, lines))).reshape(n, 4)
        coord = _ints(chain.from_iterable(map(_axes_of, map(_coord_of, lines)))).reshape(n, len(AXES))
        gpu = _optional_ints(map(_gpu_of, lines))
        if (gpu > _INT32_MAX).any():
            raise _SlowPathError
        util = _optional_floats(map(_util_of, lines))
        rows: dict[str, NDArray[Any]] = {
            "rank": times[:, 0],
            "step": times[:, 1],
            "start_us": times[:, 2],
            "end_us": times[:, 3],
            "coord": coord,
            "node": self._codes("node", list(map(_node_of, lines)), pending),
            "nvlink_domain": self._codes("nvlink_domain", list(map(_domain_of, lines)), pending),
            "network_tier": self._codes("network_tier", list(map(_tier_of, lines)), pending),
            "gpu": gpu.astype(np.int32),
            "gpu_util": util,
            "user_step": _optional_ints(map(_user_step_of, lines)),
            "gap_before_us": _optional_ints(map(_gap_of, lines)),
            "between_us": _between_columns(between := list(map(_between_of, lines))),
            "between_comm_us": _between_comm_column(between),
            "runqueue_wait_us": _optional_ints(map(_runqueue_of, lines)),
            "on_cpu_us": _optional_ints(map(_on_cpu_of, lines)),
            "compute_runqueue_wait_us": _optional_ints(map(_in_compute_of, lines)),
            "data_runqueue_wait_us": _optional_ints(map(_in_data_of, lines)),
            "optimizer_runqueue_wait_us": _optional_ints(map(_in_optimizer_of, lines)),
            "attempt_start_us": _optional_ints(map(_attempt_of, lines)),
            "raised": _raised_column(list(map(_raised_of, lines))),
        }
        stats = list(map(_stats_of, lines))
        if None in stats:  # "stats": null
            stats = [_NO_STATS if st is None else st for st in stats]
        if stats.count(_NO_STATS) == n:  # no line of the batch has stats
            rows.update({key: np.full(n, UNKNOWN, dtype=np.int64) for key in _STATS})
            rows["attention_work"] = np.full(n, math.nan)
            return rows
        rows.update({key: _optional_ints(map(attrgetter(key), stats)) for key in _STATS})
        rows["attention_work"] = _optional_floats(map(attrgetter("attention_work"), stats))
        return rows

    def _intervals(
        self, lists: list[list[_Interval]], pending: dict[str, dict[str, int]]
    ) -> tuple[dict[str, NDArray[Any]], NDArray[np.int64]]:
        """The interval columns of a batch and the number of intervals of each line, field by field in C loops."""
        counts = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        flat: list[_Interval] = list(chain.from_iterable(lists))
        m = len(flat)
        kind = _codes_of(map(_KIND_OF_TYPE.__getitem__, map(type, flat)))
        out: dict[str, NDArray[Any]] = {
            "kind": kind,
            "start_us": _ints(map(_start_of, flat)),
            "end_us": _ints(map(_end_of, flat)),
            "phase": np.full(m, UNKNOWN, dtype=np.int8),
            "axis": np.full(m, UNKNOWN, dtype=np.int8),
            "op": np.full(m, UNKNOWN, dtype=np.int8),
            "group": np.full(m, UNKNOWN, dtype=np.int32),
            "seq": np.full(m, UNKNOWN, dtype=np.int64),
            "size_bytes": np.full(m, UNKNOWN, dtype=np.int64),
            "group_size": np.full(m, UNKNOWN, dtype=np.int32),
            "peer": np.full(m, UNKNOWN, dtype=np.int64),
        }
        compute = kind == COMPUTE_CODE
        if compute.any():
            phases = map(_phase_of, compress(flat, compute.tolist()))
            out["phase"][compute] = _codes_or_unknown(map(_PHASE_OR_NONE.__getitem__, phases))
        is_net = kind >= COMM_CODE
        if is_net.any():
            self._net_columns(out, list(compress(flat, is_net.tolist())), np.flatnonzero(is_net), pending)
        return out, counts

    def _net_columns(
        self,
        out: dict[str, NDArray[Any]],
        net: list[_Interval],
        at: NDArray[np.intp],
        pending: dict[str, dict[str, int]],
    ) -> None:
        """Fill the fields of the comm and p2p intervals ``net``, which sit at ``at``.

        Raises:
            _SlowPathError: for a value that would read as absent (negative), a comm interval without group or seq, a
                p2p interval without peer, or a group size beyond int32.
        """
        out["axis"][at] = _codes_of(map(AXIS_CODE.__getitem__, map(_axis_of, net)))
        out["op"][at] = _codes_of(map(OP_CODE.__getitem__, map(_op_of, net)))
        group = self._codes("group", list(map(_group_of, net)), pending)
        (seq, no_seq), (size, no_size) = _ints_or_absent(map(_seq_of, net)), _ints_or_absent(map(_bytes_of, net))
        comm = out["kind"][at] == COMM_CODE
        bad = (seq < 0) | (size < 0)
        # group_size is a field of comm intervals only, peer of p2p only: each is fetched from its own kind.
        in_comm, in_p2p = np.flatnonzero(comm), np.flatnonzero(~comm)
        group_size, no_size_given = _ints_or_absent(map(_group_size_of, compress(net, comm.tolist())))
        peer, no_peer = _ints_or_absent(map(_peer_of, compress(net, (~comm).tolist())))
        bad[in_comm] |= ((group_size < 1) & ~no_size_given) | (group_size > _INT32_MAX)
        bad |= comm & ((group < 0) | no_seq)
        bad[in_p2p] |= (peer < 0) | no_peer
        if bad.any():
            raise _SlowPathError
        out["group"][at] = group
        out["seq"][at] = np.where(no_seq, UNKNOWN, seq)
        out["size_bytes"][at] = np.where(no_size, UNKNOWN, size)
        out["group_size"][at[in_comm]] = np.where(no_size_given, UNKNOWN, group_size)
        out["peer"][at[in_p2p]] = peer

    def raw(self, *, lines: int = 0) -> _Raw:
        """The columns put together (one array per field), with the name tables."""
        return _Raw(
            job=self.job,
            job_where=self.job_where,
            rows=_concatenated(self.rows, _empty_rows()),
            intervals=_concatenated(self.intervals, _empty_intervals()),
            names={k: tuple(v) for k, v in self.names.items()},
            lines=lines,
        )

    def build(
        self,
        *,
        notes: tuple[Note, ...],
        source_files: tuple[str, ...],
        attempt: int | None = None,
        skip_steps: int = 0,
    ) -> RecordTable:
        """Turn the columns into a validated :class:`RecordTable` (``attempt``, ``skip_steps``: :func:`_table_of`'s)."""
        return _table_of(self.raw(), notes=notes, source_files=source_files, attempt=attempt, skip_steps=skip_steps)


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordColumns:
    """One source's step records as columns, each line checked but the rules across rows not yet applied.

    What a reader makes of one source (a sidecar's answer, lines in memory, packed columns) before
    :func:`table_from_columns` puts several sources together into one validated :class:`RecordTable`. Built by
    :func:`columns_from_lines` or :func:`~meshscope.records.packing.unpack_columns`.
    """

    where: str
    """The source's name in messages and in :attr:`RecordTable.source_files` (``where line N``)."""
    raw: _Raw

    @property
    def n_rows(self) -> int:
        """Rank-steps held."""
        return int(self.raw.rows["rank"].shape[0])

    def steps(self) -> frozenset[int]:
        """The step numbers held."""
        return frozenset(np.unique(self.raw.rows["step"]).tolist())

    def only_steps(self, steps: Collection[int]) -> RecordColumns:
        """The rank-steps of ``steps`` only (the same object when it holds no other step)."""
        step = self.raw.rows["step"]
        keep = np.isin(step, np.fromiter(steps, dtype=np.int64, count=len(steps)))
        if keep.all():
            return self
        spans = np.repeat(keep, self.raw.rows["n_intervals"])
        raw = replace(
            self.raw,
            rows={name: col[keep] for name, col in self.raw.rows.items()},
            intervals={name: col[spans] for name, col in self.raw.intervals.items()},
        )
        return RecordColumns(where=self.where, raw=raw)


def columns_from_lines(lines: Iterable[bytes], *, where: str) -> RecordColumns:
    """The columns of ``meshscope.step/1`` lines in memory (the checks of one line each; see :func:`table_from_lines`).

    Raises:
        ParseError: for the first bad line, naming ``<where> line <n>``.
    """
    builder = _TableBuilder()
    listed = lines if isinstance(lines, list | tuple) else list(lines)
    builder.read_lines(listed, where)
    return RecordColumns(where=where, raw=builder.raw(lines=len(listed)))


def table_from_columns(parts: Sequence[RecordColumns], *, notes: Sequence[Note] = ()) -> RecordTable:
    """One validated table of several sources' columns; each source keeps its name (``pod-3 line 12: ...``).

    Names (nodes, NVLink domains, network tiers, groups) are numbered across the sources; the table's own checks
    (ranges, codes, duplicate rank-steps, collectives that disagree) then run over all of them together.

    Raises:
        ParseError: records of several jobs, or what the table's checks refuse.
    """
    if not parts:
        raise ParseError("no step records to put together", code=ParseCode.INVALID)
    with_job = [p for p in parts if p.raw.job is not None]
    first = with_job[0] if with_job else parts[0]
    for p in with_job[1:]:
        if p.raw.job != first.raw.job:
            raise ParseError(
                _job_mismatch(str(p.raw.job), p.raw.job_where, str(first.raw.job), first.raw.job_where),
                code=ParseCode.JOB_MISMATCH,
            )
    sources = tuple(p.where for p in parts)
    if len(parts) == 1:
        return _table_of(parts[0].raw, notes=tuple(notes), source_files=sources)
    layouts = [_layout_of(p.raw) for p in parts]

    def fill(i: int, targets: list[NDArray[Any]]) -> None:
        for (part, name, _, _), target in zip(layouts[i], targets, strict=True):
            target[...] = getattr(parts[i].raw, part)[name]

    merged = _merge_parts(
        [
            _Described(columns=layouts[i], names=p.raw.names, job=p.raw.job, job_where=p.raw.job_where, lines=0)
            for i, p in enumerate(parts)
        ],
        list(range(len(parts))),
        fill,
    )
    merged.rows["source_file"][...] = np.repeat(
        np.arange(len(parts), dtype=merged.rows["source_file"].dtype), [p.n_rows for p in parts]
    )
    return _table_of(merged, notes=tuple(notes), source_files=sources)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Described:
    """A reader's columns as described for merging: a worker's file, or one source's arrays in memory."""

    columns: tuple[tuple[str, str, str, tuple[int, ...]], ...]
    """(table part ``rows`` or ``intervals``, column, dtype, shape) of each column, in order."""
    names: dict[str, tuple[str, ...]]
    job: str | None
    job_where: str
    lines: int
    """Physical lines read, to number the next part's lines of the same source."""


def _layout_of(raw: _Raw) -> tuple[tuple[str, str, str, tuple[int, ...]], ...]:
    """(part, column, dtype, shape) of every column of ``raw``, rank-step columns first."""
    return tuple(
        (part, name, col.dtype.str, tuple(col.shape))
        for part, cols in (("rows", raw.rows), ("intervals", raw.intervals))
        for name, col in cols.items()
    )


def _merge_parts(
    parts: Sequence[_Described], file_of: Sequence[int], fill: Callable[[int, list[NDArray[Any]]], None]
) -> _Raw:
    """The merged columns of ``parts``, name codes renumbered across them, line numbers going on within one file.

    ``fill(i, targets)`` writes part ``i``'s columns into their slices of the merged columns (in its ``columns``
    order); ``file_of[i]`` is the file part ``i`` was read from.
    """
    widest = next((p for p in parts if _rows_of(p)), parts[0])  # dtypes from a part with rows
    layout = {(part, name): (np.dtype(dtype), tuple(shape[1:])) for part, name, dtype, shape in widest.columns}
    totals = dict.fromkeys(layout, 0)
    for p in parts:
        for part, name, _, shape in p.columns:
            totals[part, name] += shape[0]
    merged = {key: mapped_empty((totals[key], *tail), dtype) for key, (dtype, tail) in layout.items()}
    names: dict[str, dict[str, int]] = {kind: {} for kind in widest.names}
    line_offset: dict[int, int] = {}
    at = dict.fromkeys(layout, 0)
    for i, (p, file_index) in enumerate(zip(parts, file_of, strict=True)):
        piece: dict[tuple[str, str], NDArray[Any]] = {}
        for part, name, _, shape in p.columns:
            key = (part, name)
            piece[key] = merged[key][at[key] : at[key] + shape[0]]
            at[key] += shape[0]
        fill(i, list(piece.values()))
        for kind in ("node", "nvlink_domain", "network_tier"):
            col = piece["rows", kind]
            col[...] = _recode(names[kind], p.names[kind], col)
        group = piece["intervals", "group"]
        group[...] = _recode(names["group"], p.names["group"], group)
        piece["rows", "source_line"] += line_offset.get(file_index, 0)
        line_offset[file_index] = line_offset.get(file_index, 0) + p.lines
    job = next((p for p in parts if p.job is not None), widest)
    return _Raw(
        job=job.job,
        job_where=job.job_where,
        rows={name: col for (part, name), col in merged.items() if part == "rows"},
        intervals={name: col for (part, name), col in merged.items() if part == "intervals"},
        names={kind: tuple(known) for kind, known in names.items()},
    )


def _rows_of(part: _Described) -> int:
    return next(shape[0] for p, name, _, shape in part.columns if (p, name) == ("rows", "rank"))


def _recode(known: dict[str, int], names: tuple[str, ...], codes: NDArray[Any]) -> NDArray[Any]:
    """Codes into one part's ``names`` as codes into ``known`` (which learns the names it lacks); -1 stays."""
    lut = np.array([known.setdefault(name, len(known)) for name in names] + [UNKNOWN], dtype=codes.dtype)
    out: NDArray[Any] = lut[codes]  # code -1 picks the trailing UNKNOWN
    return out


def table_from_lines(lines: Iterable[bytes], *, where: str = "memory") -> RecordTable:
    """A validated :class:`RecordTable` of ``meshscope.step/1`` lines already in memory, by the columnar fast path.

    For records that arrive one by one (the sidecar's datagrams) rather than in a file: the same typed decoding,
    the same per-line checks and fallbacks as :func:`~meshscope.records.reading.read_table`, and the same table
    checks, so it accepts exactly the lines both file readers accept and refuses the others with the same error
    (:class:`~meshscope.errors.ParseError` naming ``<where> line <n>``). Lines are numbered from 1 in the order
    given; blank lines are skipped; a trailing newline is allowed. The table's one source file is ``where``.

    Args:
        lines: one JSON object per item (``bytes``), in any rank and step order.
        where: what to call the lines in messages and :attr:`RecordTable.source_files`.

    Returns:
        The table of every line.

    Raises:
        ParseError: for the first bad line, or for lines that do not make a valid table (duplicate rank-steps,
            collectives that disagree, lines of several jobs).
    """
    builder = _TableBuilder()
    builder.read_lines(lines, where)
    return builder.build(notes=(), source_files=(where,))


_OUT_OF_RANGE = "{where}: a value is out of range (integers must fit in 64 bits, gpu and group_size in 32)"


def _typed(obj: object, where: str) -> _Line:
    """One line decoded by ``json`` as the typed objects; a line they cannot take goes through the object parser.

    Raises:
        ParseError: the object parser's message for an invalid line.
    """
    try:
        return msgspec.convert(obj, _Line)
    except msgspec.ValidationError:
        pass
    canonical = record_to_json(_parse_record(obj, where))  # raises the precise error for an invalid line
    try:
        return msgspec.convert(canonical, _Line)
    except msgspec.ValidationError:
        raise ParseError(_OUT_OF_RANGE.format(where=where), code=ParseCode.VALUE_OUT_OF_RANGE) from None


def _concatenated(chunks: list[dict[str, NDArray[Any]]], empty: dict[str, NDArray[Any]]) -> dict[str, NDArray[Any]]:
    """One array per column; the batches' arrays are released column by column to bound the peak memory."""
    if not chunks:
        return empty
    out = {}
    for key in list(chunks[0]):
        out[key] = np.concatenate([c.pop(key) for c in chunks])
    chunks.clear()
    return out


def _empty_rows() -> dict[str, NDArray[Any]]:
    steps = StepColumns.build(rank=np.zeros(0, dtype=np.int64), step=(), start_us=(), end_us=())
    rows: dict[str, NDArray[Any]] = {name: getattr(steps, name) for name in StepColumns.__dataclass_fields__}
    rows["n_intervals"] = np.zeros(0, dtype=np.int64)
    rows["raised"] = np.zeros(0, dtype=np.int8)
    return rows


def _empty_intervals() -> dict[str, NDArray[Any]]:
    ivs = IntervalColumns.build(row=np.zeros(0, dtype=np.int32), kind=(), start_us=(), end_us=())
    return {name: getattr(ivs, name) for name in IntervalColumns.__dataclass_fields__ if name != "row"}


def _table_of(
    raw: _Raw,
    *,
    notes: tuple[Note, ...],
    source_files: tuple[str, ...],
    attempt: int | None = None,
    skip_steps: int = 0,
) -> RecordTable:
    """The validated table of a reader's columns; of a restarted job's, its last attempt (:func:`_last_attempts`).

    ``attempt`` (1 the first, -1 the last) keeps another attempt of every rank instead. ``skip_steps`` leaves out the
    attempt's first step numbers (:func:`_without_first_steps`: the warm-up).

    Where several processes wrote a rank's records (``attempt_start_us``), the latest one's are kept, always. Where
    the writer does not say, a rank's steps going back mean a new attempt only where the table's checks find a
    duplicate (the readers' rule before the field existed: records whose steps go back without colliding are read
    as they are).
    """
    # The attempt first, then its rank-steps that raised: a step an earlier attempt died in is not this one's.
    kept, note = _last_attempts(raw, source_files, steps_back=False, attempt=attempt)
    clean, cut = _without_raised(kept)
    try:
        table = _validated_table(
            _without_first_steps(clean, skip_steps),
            notes=tuple(n for n in (*notes, cut, note) if n is not None),
            source_files=source_files,
        )
    except ParseError as exc:
        if exc.code is not ParseCode.DUPLICATE:
            raise
        again, note = _last_attempts(raw, source_files, steps_back=True, attempt=attempt)
        if note is None or again.rows["rank"].shape[0] == kept.rows["rank"].shape[0]:
            raise
        again, cut = _without_raised(again)
        return _validated_table(
            _without_first_steps(again, skip_steps),
            notes=tuple(n for n in (*notes, cut, note) if n is not None),
            source_files=source_files,
        )
    if note is None and attempt not in (None, 1, -1):  # the records hold one attempt
        ranks = raw.rows["rank"]
        held_by = int(ranks[0]) if ranks.shape[0] else 0
        raise ParseError(_no_such_attempt(attempt, rank=held_by, held=1), code=ParseCode.VALUE_OUT_OF_RANGE)
    return table


def _last_attempts(
    raw: _Raw, source_files: tuple[str, ...], *, steps_back: bool, attempt: int | None = None
) -> tuple[_Raw, Note | None]:
    """Each rank's rank-steps of its last attempt: its latest process's, after the last place its steps go back.

    A job restarted (torchrun's elastic restarts, a container restarted in its pod) or resumed from a checkpoint
    into the same records writes its steps again, numbered from 0 or from the checkpoint's step, or numbered on from
    where the last attempt stopped (resumed from a checkpoint of its last step); either way its collectives'
    sequence numbers start over: two attempts cannot be analysed as one. Every process of a rank writes its own
    ``attempt_start_us``, the time it began tracking: the rows of the latest one are kept, in whatever order the
    records came (a file per rank is in the order written; a sidecar serves its recent records step by step). Rows
    whose writer does not say (``-1``) count as the earliest process. With ``steps_back``, within that process's
    rows, in the order written, a step not above the one before also starts a new attempt (records from writers
    that do not say). A note says how many rank-steps were left out; ``None`` for the note where none was.
    ``attempt`` keeps another one of each rank's attempts instead: its ``attempt``-th (1 the first), or counted from
    the last (-1 the last).

    Raises:
        ParseError: where a process of a rank wrote a step that began after a later process of that rank began
            tracking: two processes wrote as one rank at once, which no restart does; where a rank holds fewer
            attempts than ``attempt`` asks for.
    """
    rank, step, began = raw.rows["rank"], raw.rows["step"], raw.rows["attempt_start_us"]
    n = rank.shape[0]
    order = np.lexsort((np.arange(n), began, rank))  # by rank, then process (earliest first), then as written
    r, a, s = rank[order], began[order], step[order]
    new_rank = np.r_[True, r[1:] != r[:-1]]
    new_process = new_rank | np.r_[False, a[1:] != a[:-1]]
    starts = new_process.copy()
    if steps_back:
        starts |= np.r_[False, s[1:] <= s[:-1]]  # a step that goes back within one process's rows
    if not (starts & ~new_rank).any():  # one attempt (whether another one was asked for, the caller says)
        return raw, None
    _check_one_process_at_a_time(raw, order, new_process, new_rank, source_files)
    number = np.cumsum(starts)  # every attempt of every rank numbered, in sorted order
    firsts = np.flatnonzero(new_rank)
    sizes = np.diff(np.r_[firsts, n])
    first_number = np.repeat(number[firsts], sizes)
    last_number = np.repeat(number[np.r_[firsts[1:] - 1, n - 1]], sizes)
    held = last_number - first_number + 1  # each row's rank's attempts
    if attempt is None:
        chosen = last_number
    else:
        short = np.flatnonzero(held < abs(attempt))
        if short.size:
            raise ParseError(
                _no_such_attempt(attempt, rank=int(r[short[0]]), held=int(held[short[0]])),
                code=ParseCode.VALUE_OUT_OF_RANGE,
            )
        chosen = first_number + (attempt - 1 if attempt > 0 else held + attempt)
    keep = np.zeros(n, dtype=bool)
    keep[order] = number == chosen
    restarted, per_rank = np.unique(r[starts & ~new_rank], return_counts=True)
    restarts, ranks = int(per_rank.max()), int(restarted.shape[0])
    dropped = int(n - keep.sum())
    spans = np.repeat(keep, raw.rows["n_intervals"])
    kept = replace(
        raw,
        rows={name: col[keep] for name, col in raw.rows.items()},
        intervals={name: col[spans] for name, col in raw.intervals.items()},
    )
    return kept, earlier_attempts_note(restarts=restarts, ranks=ranks, dropped=dropped, attempt=attempt)


def _without_raised(raw: _Raw) -> tuple[_Raw, Note | None]:
    """``raw`` without the rank-steps that ended by an exception (``raised``), and the note that says which."""
    raised = raw.rows["raised"] == 1
    if not raised.any():
        return raw, None
    keep = ~raised
    spans = np.repeat(keep, raw.rows["n_intervals"])
    note = raised_steps_note(raw.rows["rank"][raised].tolist(), raw.rows["step"][raised].tolist())
    return replace(
        raw,
        rows={name: col[keep] for name, col in raw.rows.items()},
        intervals={name: col[spans] for name, col in raw.intervals.items()},
    ), note


def _without_first_steps(raw: _Raw, skip: int) -> _Raw:
    """``raw`` without its ``skip`` lowest step numbers (every rank's rank-steps of them): a run's warm-up.

    Raises:
        ParseError: (``value_out_of_range``) where that would leave no step, naming the steps held.
    """
    if skip <= 0:
        return raw
    steps = np.unique(raw.rows["step"])
    if skip >= steps.shape[0]:
        held = f" ({steps[0]}..{steps[-1]})" if steps.shape[0] > 1 else ""
        raise ParseError(
            f"leaving out the first {skip} step number{'' if skip == 1 else 's'} leaves no step to analyse: the "
            f"records hold {steps.shape[0]} step "
            f"number{'' if steps.shape[0] == 1 else 's'}{held}; give at most {max(steps.shape[0] - 1, 0)}",
            code=ParseCode.VALUE_OUT_OF_RANGE,
        )
    keep = raw.rows["step"] > steps[skip - 1]
    spans = np.repeat(keep, raw.rows["n_intervals"])
    return replace(
        raw,
        rows={name: col[keep] for name, col in raw.rows.items()},
        intervals={name: col[spans] for name, col in raw.intervals.items()},
    )


def _no_such_attempt(attempt: int, *, rank: int, held: int) -> str:
    """The message for an ``attempt`` that a rank's records do not hold."""
    return (
        f"attempt {attempt} was asked for, but rank {rank}'s records hold {held} attempt{'' if held == 1 else 's'}: "
        f"give 1 to {held} (1 the first), or -1 to -{held} counted from the last"
    )


def _check_one_process_at_a_time(
    raw: _Raw,
    order: NDArray[np.intp],
    new_process: NDArray[np.bool_],
    new_rank: NDArray[np.bool_],
    source_files: tuple[str, ...],
) -> None:
    """Refuse a rank one of whose processes wrote a step that began after a later process of the rank began tracking.

    ``order`` sorts the rows by rank, then process, then as written; ``new_process`` and ``new_rank`` mark each
    (rank, process) group's and each rank's first row in it. A restart's new process begins after the last one
    stopped; a step of the earlier process that began after that (on one host clock; a rank moved to another node
    would need a clock skew above the restart's own seconds) means both ran at once.

    Raises:
        ParseError: naming the record, the rank and both processes.
    """
    a = raw.rows["attempt_start_us"][order]
    group = np.cumsum(new_process) - 1
    firsts = np.flatnonzero(new_process)
    began = a[firsts]
    latest = np.maximum.reduceat(raw.rows["start_us"][order], firsts)  # each process's last step start
    later = np.r_[~new_rank[firsts][1:], False]  # a group followed by a later process of its rank
    clash = later & (began >= 0) & (latest >= np.r_[began[1:], 0])
    if not clash.any():
        return
    g = int(np.flatnonzero(clash)[0])
    earlier = order[group == g]
    late = int(earlier[np.argmax(raw.rows["start_us"][earlier] >= began[g + 1])])
    row = int(order[firsts[g + 1]])  # the later process's first record
    file, line = int(raw.rows["source_file"][row]), int(raw.rows["source_line"][row])
    where = f"{source_files[file]} line {line}" if 0 <= file < len(source_files) and line >= 0 else f"row {row}"
    raise ParseError(
        _two_processes(
            where,
            rank=int(raw.rows["rank"][row]),
            later=int(began[g + 1]),
            earlier=int(began[g]),
            step=int(raw.rows["step"][late]),
            start_us=int(raw.rows["start_us"][late]),
        ),
        code=ParseCode.INCONSISTENT,
    )


def _two_processes(where: str, *, rank: int, later: int, earlier: int, step: int, start_us: int) -> str:
    """The message for two processes that wrote as one rank at once (every reader says it the same way)."""
    return (
        f"{where}: rank {rank}'s records come from two processes at once: the one that wrote this record began "
        f"tracking at attempt_start_us = {later}, and the one that began at {earlier} still wrote after that (its "
        f"step {step} began at {start_us} µs). A script started twice with the same RANK, or two trackers in one "
        "process, does this; no restart does: give every process its own rank or its own records"
    )


def earlier_attempts_note(*, restarts: int, ranks: int, dropped: int, attempt: int | None = None) -> Note:
    """The note of :func:`_last_attempts` (the object reader writes the same); ``attempt``: the one kept, if chosen."""
    held = (
        f"the records hold {restarts} restart{'' if restarts == 1 else 's'} ({ranks} ranks began again: their step "
        "numbers go back, or a new process wrote them; a job restarted or resumed into the same records)"
    )
    if attempt is None or attempt == -1:
        kept = (
            f"{dropped} rank-steps of earlier attempts are left out and each rank's last attempt is analysed (to "
            "analyse an earlier one, meshscope analyze --attempt N, 1 the first)"
        )
    else:
        kept = f"{dropped} rank-steps of its other attempts are left out and attempt {attempt} of each rank is analysed"
    return Note(code="earlier_attempts", count=dropped, message=f"{held}; {kept}")


def _validated_table(raw: _Raw, *, notes: tuple[Note, ...], source_files: tuple[str, ...]) -> RecordTable:
    """The validated table of a reader's columns, as they are."""
    rows = dict(raw.rows)
    counts = rows.pop("n_intervals")
    rows.pop("raised")  # left out before (_without_raised): the table holds the steps that ran to their end
    row = np.repeat(np.arange(counts.shape[0], dtype=np.int32), counts)
    intervals = dict(raw.intervals)
    names: dict[str, tuple[str, ...]] = {}
    for name in ("node", "nvlink_domain", "network_tier"):
        names[name], rows[name] = sorted_codes(raw.names[name], rows[name])
    names["group"], intervals["group"] = sorted_codes(raw.names["group"], intervals["group"])
    return RecordTable(
        job=raw.job or "",
        steps=StepColumns.build(**rows),
        intervals=IntervalColumns.build(row=row, **intervals),
        node_names=names["node"],
        nvlink_domain_names=names["nvlink_domain"],
        network_tier_names=names["network_tier"],
        group_names=names["group"],
        source_files=source_files,
        notes=notes,
    )

"""The columnar fast path: decoded JSON lines turned into numpy columns a batch at a time, without record objects.

:func:`~meshscope.records.reading.read_table` reads through a :class:`_TableBuilder`. A batch of decoded lines becomes
columns field by field: every value of one field is fetched by ``map`` over the batch (``operator.itemgetter``,
``dict.get``), coded through a dict and packed by ``array``, so no Python bytecode runs per interval; names (node,
NVLink domain, network tier, group) are interned once per distinct name. (On the 2-core development machine this
takes ~0.7 µs per interval, ``json.loads`` itself ~1.5 µs; :func:`~meshscope.records.reading.read_table` spreads
both over worker processes.) Values that would read wrongly as "absent"
(negative optional integers, required fields left out) are found over the batch's columns. A batch that does not go
through whole is redone line by line, and any line the fast path cannot take goes to the object parser
(:mod:`meshscope.records.parsing`), which raises the precise error, so both readers say the same thing. The rules
that span rows (ranges, codes, duplicates, collectives) are left to :class:`~meshscope.records.tables.RecordTable`.

The builder's columns (:class:`_Raw`) are also what a worker process hands back. This module must not open files
other than through :mod:`meshscope.records.decoding`.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from itertools import chain, repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from meshscope.errors import ParseError
from meshscope.layout import AXES
from meshscope.records.decoding import _decoded_batches
from meshscope.records.parsing import _parse_record, record_to_json
from meshscope.records.schema import (
    AXIS_CODE,
    COMM_CODE,
    COMPUTE_CODE,
    KIND_CODE,
    OP_CODE,
    PHASE_CODE,
    SCHEMA,
    UNKNOWN,
    Note,
    _job_mismatch,
)
from meshscope.records.tables import IntervalColumns, RecordTable, StepColumns

if TYPE_CHECKING:
    from collections.abc import Iterable
    from pathlib import Path

    from numpy.typing import NDArray

_ABSENT = -(2**62)
"""Stands for a left-out optional integer while a batch is checked. (A file that spells this very number reads it
as left out.)"""
_INT32_MAX = int(np.iinfo(np.int32).max)
_NAMES = ("node", "nvlink_domain", "network_tier", "group")
"""Name-valued fields, coded into ``RecordTable.<field>_names``; all but ``node`` are optional."""
_STATS = ("tokens", "sequences", "longest_sequence", "attention_us", "peak_memory_bytes")
"""Integer stats (``attention_work`` is the one float)."""
_PHASE_OR_NONE: dict[str | None, int] = dict([(None, UNKNOWN), *PHASE_CODE.items()])
_EMPTY: dict[str, Any] = {}

_schema_of, _job_of, _intervals_of, _coord_of = (itemgetter(k) for k in ("schema", "job", "intervals", "coord"))
_start_of, _end_of = itemgetter("start_us"), itemgetter("end_us")
_kind_of, _axis_of, _op_of, _node_of = (itemgetter(k) for k in ("kind", "axis", "op", "node"))
_row_ints_of = itemgetter("rank", "step", "start_us", "end_us")
_axes_of = itemgetter(*(a.value for a in AXES))


class _SlowPathError(Exception):
    """Internal: the fast path cannot take this batch; its lines are retried one by one, then by the object parser."""


_NOT_FAST = (_SlowPathError, KeyError, TypeError, ValueError, OverflowError, AttributeError, IndexError)
"""What a value the fast path cannot take raises on the way into a column (missing key, wrong type, too big)."""


def _ints(values: Iterable[Any]) -> NDArray[np.int64]:
    """Whole numbers from the file as int64; JSON booleans read as 1/0.

    Anything else (float, string, null) raises ``TypeError``, a number beyond int64 ``OverflowError``: ``array`` is
    strict where ``np.fromiter`` would cast, and it packs a list faster than an iterator.
    """
    packed = array("q", list(values))
    return np.frombuffer(packed, dtype=np.int64) if len(packed) else np.zeros(0, dtype=np.int64)


def _floats(values: Iterable[Any]) -> NDArray[np.float64]:
    """Numbers from the file as float64; strings and nulls raise ``TypeError``."""
    packed = array("d", list(values))
    return np.frombuffer(packed, dtype=np.float64) if len(packed) else np.zeros(0, dtype=np.float64)


def _codes_of(values: Iterable[int], count: int) -> NDArray[np.int8]:
    """Small codes this module looked up itself (so no checks are needed: ``np.fromiter`` is the fastest packer)."""
    return np.fromiter(values, dtype=np.int8, count=count)


def _optional_ints(objs: list[dict[str, Any]], key: str) -> NDArray[np.int64]:
    """An optional integer >= 0 of every object, -1 where left out.

    Raises:
        _SlowPathError: for a negative value (which would read as "unknown").
    """
    col = _ints(map(dict.get, objs, repeat(key), repeat(_ABSENT)))
    absent = col == _ABSENT
    if (col < 0).any() and not absent[col < 0].all():
        raise _SlowPathError
    return np.where(absent, UNKNOWN, col)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Raw:
    """A reader's columns before the table's checks: what a worker process hands back (picklable)."""

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
    ) -> int:
        """Append every line of ``path`` (or of a byte span of it).

        Returns:
            The number of physical lines read.

        Raises:
            ParseError: for the first line that breaks a rule checked per line (as the object parser words it).
        """
        counted: list[int] = []
        for linenos, objs in _decoded_batches(path, allow_partial, notes, span=span, last=last, counted=counted):
            try:
                self._add_batch(objs, file_index, linenos, path)
            except _NOT_FAST:
                for lineno, obj in zip(linenos, objs, strict=True):
                    self._add_line(obj, file_index, lineno, path)
        return counted[0] if counted else 0

    def _add_line(self, obj: object, file_index: int, lineno: int, path: Path) -> None:
        """One line alone; if the fast path still cannot take it, the object parser decides."""
        try:
            self._add_batch([obj], file_index, [lineno], path)
        except _NOT_FAST:
            where = f"{path} line {lineno}"
            rec = _parse_record(obj, where)  # raises the precise error in practice
            if self.job is not None and rec.job != self.job:
                raise ParseError(_job_mismatch(rec.job, where, self.job, self.job_where)) from None
            try:  # a valid record in its canonical form (nulls left out, ...)
                self._add_batch([record_to_json(rec)], file_index, [lineno], path)
            except _NOT_FAST:
                raise ParseError(
                    f"{where}: a value is out of range (integers must fit in 64 bits, gpu and group_size in 32)"
                ) from None

    def _add_batch(self, objs: list[Any], file_index: int, linenos: list[int], path: Path) -> None:
        """Append a batch of decoded lines, all or nothing.

        Raises:
            _SlowPathError: (or what :data:`_NOT_FAST` names) if any value of the batch cannot be taken as it is.
        """
        n = len(objs)
        if list(map(_schema_of, objs)).count(SCHEMA) != n:
            raise _SlowPathError
        jobs = set(map(_job_of, objs))
        job = jobs.pop()
        if jobs or (job != self.job and (self.job is not None or type(job) is not str or not job)):
            raise _SlowPathError
        pending: dict[str, dict[str, int]] = {k: {} for k in _NAMES}
        rows = self._rows(objs, pending)
        intervals, counts = self._intervals(list(map(_intervals_of, objs)), pending)
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

    def _codes(self, kind: str, values: list[Any], pending: dict[str, dict[str, int]]) -> NDArray[np.int32]:
        """Codes of names (UNKNOWN for a left-out optional one); names not seen before go to ``pending``."""
        lookup = self.lookup[kind]
        codes = list(map(lookup.get, values))
        if None in codes:
            new = pending[kind]
            base = len(self.names[kind])
            for i, code in enumerate(codes):
                if code is None:
                    name = values[i]
                    if type(name) is not str or not name:
                        raise _SlowPathError
                    codes[i] = new.setdefault(name, base + len(new))
        return np.asarray(codes, dtype=np.int32)

    def _rows(self, objs: list[dict[str, Any]], pending: dict[str, dict[str, int]]) -> dict[str, NDArray[Any]]:
        """The rank-step columns of a batch; fields fetched together where the schema requires them all."""
        n = len(objs)
        times = _ints(chain.from_iterable(map(_row_ints_of, objs))).reshape(n, 4)
        coord = _ints(chain.from_iterable(map(_axes_of, map(_coord_of, objs)))).reshape(n, len(AXES))
        gpu = _optional_ints(objs, "gpu")
        if (gpu > _INT32_MAX).any():
            raise _SlowPathError
        util = list(map(dict.get, objs, repeat("gpu_util")))
        if None in util:
            util = [math.nan if v is None else v for v in util]
        rows: dict[str, NDArray[Any]] = {
            "rank": times[:, 0],
            "step": times[:, 1],
            "start_us": times[:, 2],
            "end_us": times[:, 3],
            "coord": coord,
            "node": self._codes("node", list(map(_node_of, objs)), pending),
            "nvlink_domain": self._codes("nvlink_domain", list(map(dict.get, objs, repeat("nvlink_domain"))), pending),
            "network_tier": self._codes("network_tier", list(map(dict.get, objs, repeat("network_tier"))), pending),
            "gpu": gpu.astype(np.int32),
            "gpu_util": _floats(util),
        }
        stats = list(map(dict.get, objs, repeat("stats"), repeat(_EMPTY)))
        if stats.count(_EMPTY) == n:  # no line of the batch has stats
            rows.update({key: np.full(n, UNKNOWN, dtype=np.int64) for key in _STATS})
            rows["attention_work"] = np.full(n, math.nan)
            return rows
        if any(type(st) is not dict for st in stats):
            raise _SlowPathError
        work = [st.get("attention_work") for st in stats]
        if any(w is not None and not math.isfinite(w) for w in work):
            raise _SlowPathError
        rows.update({key: _optional_ints(stats, key) for key in _STATS})
        rows["attention_work"] = _floats(math.nan if w is None else w for w in work)
        return rows

    def _intervals(
        self, lists: list[Any], pending: dict[str, dict[str, int]]
    ) -> tuple[dict[str, NDArray[Any]], NDArray[np.int64]]:
        """The interval columns of a batch and the number of intervals of each line, field by field in C loops."""
        if any(type(ivs) is not list for ivs in lists):
            raise _SlowPathError
        counts = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        flat: list[dict[str, Any]] = list(chain.from_iterable(lists))
        m = len(flat)
        kind = _codes_of(map(KIND_CODE.__getitem__, map(_kind_of, flat)), m)
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
        compute = np.flatnonzero(kind == COMPUTE_CODE).tolist()
        if compute:
            phases = map(dict.get, map(flat.__getitem__, compute), repeat("phase"))
            out["phase"][compute] = _codes_of(map(_PHASE_OR_NONE.__getitem__, phases), len(compute))
        net_index = np.flatnonzero(kind >= COMM_CODE)
        if net_index.size:
            self._net_columns(out, net_index, list(map(flat.__getitem__, net_index.tolist())), pending)
        return out, counts

    def _net_columns(
        self,
        out: dict[str, NDArray[Any]],
        at: NDArray[np.intp],
        net: list[dict[str, Any]],
        pending: dict[str, dict[str, int]],
    ) -> None:
        """Fill the comm/p2p fields of the intervals at ``at``.

        Raises:
            _SlowPathError: for a value that would read as absent (negative), a comm interval without group or seq, a
                p2p interval without peer, or a group size beyond int32.
        """
        out["axis"][at] = _codes_of(map(AXIS_CODE.__getitem__, map(_axis_of, net)), len(net))
        out["op"][at] = _codes_of(map(OP_CODE.__getitem__, map(_op_of, net)), len(net))
        group = self._codes("group", list(map(dict.get, net, repeat("group"))), pending)
        seq, size = (_ints(map(dict.get, net, repeat(key), repeat(_ABSENT))) for key in ("seq", "bytes"))
        comm = out["kind"][at] == COMM_CODE
        bad = ((seq < 0) & (seq != _ABSENT)) | ((size < 0) & (size != _ABSENT))
        # group_size counts for comm intervals only, peer for p2p only: each is fetched from its own kind.
        in_comm, in_p2p = np.flatnonzero(comm), np.flatnonzero(~comm)
        group_size = _ints(map(dict.get, map(net.__getitem__, in_comm.tolist()), repeat("group_size"), repeat(_ABSENT)))
        peer = _ints(map(dict.get, map(net.__getitem__, in_p2p.tolist()), repeat("peer"), repeat(_ABSENT)))
        bad[in_comm] |= ((group_size < 1) & (group_size != _ABSENT)) | (group_size > _INT32_MAX)
        bad |= comm & ((group < 0) | (seq == _ABSENT))
        bad[in_p2p] |= peer < 0
        if bad.any():
            raise _SlowPathError
        out["group"][at] = group
        out["seq"][at] = np.where(seq == _ABSENT, UNKNOWN, seq)
        out["size_bytes"][at] = np.where(size == _ABSENT, UNKNOWN, size)
        out["group_size"][at[in_comm]] = np.where(group_size == _ABSENT, UNKNOWN, group_size)
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

    def build(self, *, notes: tuple[Note, ...], source_files: tuple[str, ...]) -> RecordTable:
        """Turn the columns into a validated :class:`RecordTable`."""
        return _table_of(self.raw(), notes=notes, source_files=source_files)


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
    return rows


def _empty_intervals() -> dict[str, NDArray[Any]]:
    ivs = IntervalColumns.build(row=np.zeros(0, dtype=np.int32), kind=(), start_us=(), end_us=())
    return {name: getattr(ivs, name) for name in IntervalColumns.__dataclass_fields__ if name != "row"}


def _table_of(raw: _Raw, *, notes: tuple[Note, ...], source_files: tuple[str, ...]) -> RecordTable:
    """The validated table of a reader's columns."""
    rows = dict(raw.rows)
    counts = rows.pop("n_intervals")
    row = np.repeat(np.arange(counts.shape[0], dtype=np.int32), counts)
    return RecordTable(
        job=raw.job or "",
        steps=StepColumns.build(**rows),
        intervals=IntervalColumns.build(row=row, **raw.intervals),
        node_names=raw.names["node"],
        nvlink_domain_names=raw.names["nvlink_domain"],
        network_tier_names=raw.names["network_tier"],
        group_names=raw.names["group"],
        source_files=source_files,
        notes=notes,
    )

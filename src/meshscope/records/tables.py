"""The columnar form of step records: :class:`RecordTable` (numpy columns) and its vectorised validation.

Analysis runs on columns, not on record objects: a 16,384-rank job with 20 steps and ~30 intervals per rank-step is
~10 million intervals, which per-interval Python objects could not hold. A :class:`RecordTable` is one table of
rank-steps (:class:`StepColumns`) and one of intervals (:class:`IntervalColumns`), with string fields stored as codes
into name tuples. Construction checks every rule of the schema over whole columns at once and raises a
:class:`~meshscope.errors.ParseError` naming the first offending row (file and line when it was read from disk).

This module must not read or write files and must not analyse (no breakdown, no joins across ranks: that is
:mod:`meshscope.analysis.breakdown`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from meshscope.errors import ParseCode, ParseError
from meshscope.records.schema import (
    AXIS_CODE,
    BETWEEN_KINDS,
    COMM_CODE,
    COMPUTE_CODE,
    KIND_CODE,
    KINDS,
    OP_CODE,
    OPS,
    P2P_CODE,
    P2P_OPS,
    PHASE_CODE,
    PHASES,
    RESTARTED,
    UNKNOWN,
    BetweenSteps,
    DataStats,
    Interval,
    IntervalKind,
    Note,
    StepRecord,
    _job_mismatch,
)
from meshscope.topology import AXES, RankCoord

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from numpy.typing import ArrayLike, NDArray

_COLLECTIVE_OP_CODES = np.array([i for i, o in enumerate(OPS) if o not in P2P_OPS], dtype=np.int8)
_P2P_OP_CODES = np.array([i for i, o in enumerate(OPS) if o in P2P_OPS], dtype=np.int8)

# ====================================================================== columnar form


def _column(values: ArrayLike | None, n: int, dtype: type[np.generic], fill: float, name: str) -> NDArray[Any]:
    if values is None:
        return np.full(n, fill, dtype=dtype)
    out = np.ascontiguousarray(values, dtype=dtype)
    if out.shape != (n,):
        raise ParseError(
            f"column {name} has shape {out.shape}; expected ({n},), one value per row", code=ParseCode.BAD_SHAPE
        )
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class StepColumns:
    """The rank-step table: one row per (rank, step). Build with :meth:`build`, which fills optional columns."""

    rank: NDArray[np.int64]
    step: NDArray[np.int64]
    start_us: NDArray[np.int64]
    end_us: NDArray[np.int64]
    coord: NDArray[np.int64]
    """Shape ``(rows, 5)``, columns in :data:`meshscope.topology.layout.AXES` order (dp, tp, pp, cp, ep)."""
    node: NDArray[np.int32]
    """Index into ``RecordTable.node_names``."""
    nvlink_domain: NDArray[np.int32]
    """Index into ``RecordTable.nvlink_domain_names``, or -1."""
    network_tier: NDArray[np.int32]
    """Index into ``RecordTable.network_tier_names``, or -1."""
    gpu: NDArray[np.int32]
    """GPU index on the node, or -1."""
    gpu_util: NDArray[np.float64]
    """Ratio 0–1, or NaN."""
    tokens: NDArray[np.int64]
    sequences: NDArray[np.int64]
    longest_sequence: NDArray[np.int64]
    attention_work: NDArray[np.float64]
    attention_us: NDArray[np.int64]
    peak_memory_bytes: NDArray[np.int64]
    user_step: NDArray[np.int64]
    """The training loop's own step number where it differs from ``step``, or -1 (the same as ``step``)."""
    gap_before_us: NDArray[np.int64]
    """Microseconds since the rank's previous step ended, or -1 (first step, not measured)."""
    between_us: NDArray[np.int64]
    """Shape ``(rows, 5)``, columns in :data:`~meshscope.records.schema.BETWEEN_KINDS` order (data, compute,
    optimizer, checkpoint, eval): microseconds of each kind measured in that gap; -1 where the record has no
    ``between_steps``, 0 for a kind it leaves out."""
    between_comm_us: NDArray[np.int64]
    """Microseconds of that gap the rank was blocked in collectives (``between_steps.comm``: inside the kinds, not
    added to them); -1 where the record has no ``between_steps`` (or came packed by an older writer), 0 where it
    leaves ``comm`` out."""
    runqueue_wait_us: NDArray[np.int64]
    """Microseconds the step's training thread waited for a CPU (run delay), or -1 (not measured)."""
    on_cpu_us: NDArray[np.int64]
    """Microseconds the step's training thread ran on a CPU, or -1 (not measured)."""
    compute_runqueue_wait_us: NDArray[np.int64]
    """The part of ``runqueue_wait_us`` in the step's compute, microseconds, or -1 (not measured)."""
    data_runqueue_wait_us: NDArray[np.int64]
    """The part of ``runqueue_wait_us`` in the step's data loading, microseconds, or -1 (not measured)."""
    optimizer_runqueue_wait_us: NDArray[np.int64]
    """The part of ``runqueue_wait_us`` in the step's optimizer step, microseconds, or -1 (not measured)."""
    attempt_start_us: NDArray[np.int64]
    """When the process that wrote the row began tracking (host-clock microseconds): one value per attempt of the
    rank, or -1 (the writer does not say)."""
    source_file: NDArray[np.int32]
    """Index into ``RecordTable.source_files`` the row was read from, or -1 (built from arrays)."""
    source_line: NDArray[np.int64]
    """1-based line number in that file, or -1."""

    @classmethod
    def build(
        cls,
        *,
        rank: ArrayLike,
        step: ArrayLike,
        start_us: ArrayLike,
        end_us: ArrayLike,
        coord: ArrayLike | None = None,
        node: ArrayLike | None = None,
        nvlink_domain: ArrayLike | None = None,
        network_tier: ArrayLike | None = None,
        gpu: ArrayLike | None = None,
        gpu_util: ArrayLike | None = None,
        tokens: ArrayLike | None = None,
        sequences: ArrayLike | None = None,
        longest_sequence: ArrayLike | None = None,
        attention_work: ArrayLike | None = None,
        attention_us: ArrayLike | None = None,
        peak_memory_bytes: ArrayLike | None = None,
        user_step: ArrayLike | None = None,
        gap_before_us: ArrayLike | None = None,
        between_us: ArrayLike | None = None,
        between_comm_us: ArrayLike | None = None,
        runqueue_wait_us: ArrayLike | None = None,
        on_cpu_us: ArrayLike | None = None,
        compute_runqueue_wait_us: ArrayLike | None = None,
        data_runqueue_wait_us: ArrayLike | None = None,
        optimizer_runqueue_wait_us: ArrayLike | None = None,
        attempt_start_us: ArrayLike | None = None,
        source_file: ArrayLike | None = None,
        source_line: ArrayLike | None = None,
    ) -> StepColumns:
        """Columns from arrays; left-out optional columns mean "unknown" (-1 or NaN), ``coord`` zeros, node 0.

        Raises:
            ParseError: if a column's length differs from ``rank``'s.
        """
        r = np.ascontiguousarray(rank, dtype=np.int64)
        n = r.shape[0]
        c = np.zeros((n, len(AXES)), dtype=np.int64) if coord is None else np.asarray(coord, dtype=np.int64)
        if c.shape != (n, len(AXES)):
            raise ParseError(
                f"column coord has shape {c.shape}; expected ({n}, {len(AXES)}), axes {AXES}", code=ParseCode.BAD_SHAPE
            )
        width = len(BETWEEN_KINDS)
        b = np.full((n, width), UNKNOWN, dtype=np.int64) if between_us is None else np.asarray(between_us, np.int64)
        if b.shape != (n, width):
            raise ParseError(
                f"column between_us has shape {b.shape}; expected ({n}, {width}), kinds {BETWEEN_KINDS}",
                code=ParseCode.BAD_SHAPE,
            )
        i64, i32, f64 = np.int64, np.int32, np.float64
        return cls(
            rank=r,
            step=_column(step, n, i64, 0, "step"),
            start_us=_column(start_us, n, i64, 0, "start_us"),
            end_us=_column(end_us, n, i64, 0, "end_us"),
            coord=np.ascontiguousarray(c),
            node=_column(node, n, i32, 0, "node"),
            nvlink_domain=_column(nvlink_domain, n, i32, UNKNOWN, "nvlink_domain"),
            network_tier=_column(network_tier, n, i32, UNKNOWN, "network_tier"),
            gpu=_column(gpu, n, i32, UNKNOWN, "gpu"),
            gpu_util=_column(gpu_util, n, f64, math.nan, "gpu_util"),
            tokens=_column(tokens, n, i64, UNKNOWN, "tokens"),
            sequences=_column(sequences, n, i64, UNKNOWN, "sequences"),
            longest_sequence=_column(longest_sequence, n, i64, UNKNOWN, "longest_sequence"),
            attention_work=_column(attention_work, n, f64, math.nan, "attention_work"),
            attention_us=_column(attention_us, n, i64, UNKNOWN, "attention_us"),
            peak_memory_bytes=_column(peak_memory_bytes, n, i64, UNKNOWN, "peak_memory_bytes"),
            user_step=_column(user_step, n, i64, UNKNOWN, "user_step"),
            gap_before_us=_column(gap_before_us, n, i64, UNKNOWN, "gap_before_us"),
            between_us=np.ascontiguousarray(b),
            between_comm_us=_column(between_comm_us, n, i64, UNKNOWN, "between_comm_us"),
            runqueue_wait_us=_column(runqueue_wait_us, n, i64, UNKNOWN, "runqueue_wait_us"),
            on_cpu_us=_column(on_cpu_us, n, i64, UNKNOWN, "on_cpu_us"),
            compute_runqueue_wait_us=_column(compute_runqueue_wait_us, n, i64, UNKNOWN, "compute_runqueue_wait_us"),
            data_runqueue_wait_us=_column(data_runqueue_wait_us, n, i64, UNKNOWN, "data_runqueue_wait_us"),
            optimizer_runqueue_wait_us=_column(
                optimizer_runqueue_wait_us, n, i64, UNKNOWN, "optimizer_runqueue_wait_us"
            ),
            attempt_start_us=_column(attempt_start_us, n, i64, UNKNOWN, "attempt_start_us"),
            source_file=_column(source_file, n, i32, UNKNOWN, "source_file"),
            source_line=_column(source_line, n, i64, UNKNOWN, "source_line"),
        )

    def __len__(self) -> int:
        """Number of rank-steps."""
        return int(self.rank.shape[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class IntervalColumns:
    """The interval table: one row per interval, ``row`` pointing into the rank-step table. -1 means absent."""

    row: NDArray[np.int32]
    """Index of the interval's rank-step in :class:`StepColumns`."""
    kind: NDArray[np.int8]
    """Index into :data:`KINDS`."""
    start_us: NDArray[np.int64]
    end_us: NDArray[np.int64]
    phase: NDArray[np.int8]
    """Index into :data:`PHASES`, or -1."""
    axis: NDArray[np.int8]
    """Index into :data:`meshscope.topology.layout.AXES`, or -1."""
    op: NDArray[np.int8]
    """Index into :data:`OPS`, or -1."""
    group: NDArray[np.int32]
    """Index into ``RecordTable.group_names``, or -1."""
    seq: NDArray[np.int64]
    size_bytes: NDArray[np.int64]
    group_size: NDArray[np.int32]
    peer: NDArray[np.int64]

    @classmethod
    def build(
        cls,
        *,
        row: ArrayLike,
        kind: ArrayLike,
        start_us: ArrayLike,
        end_us: ArrayLike,
        phase: ArrayLike | None = None,
        axis: ArrayLike | None = None,
        op: ArrayLike | None = None,
        group: ArrayLike | None = None,
        seq: ArrayLike | None = None,
        size_bytes: ArrayLike | None = None,
        group_size: ArrayLike | None = None,
        peer: ArrayLike | None = None,
    ) -> IntervalColumns:
        """Columns from arrays of codes; left-out optional columns are all -1.

        Raises:
            ParseError: if a column's length differs from ``row``'s.
        """
        r = np.ascontiguousarray(row, dtype=np.int32)
        n = r.shape[0]
        i8, i32, i64 = np.int8, np.int32, np.int64
        return cls(
            row=r,
            kind=_column(kind, n, i8, 0, "kind"),
            start_us=_column(start_us, n, i64, 0, "start_us"),
            end_us=_column(end_us, n, i64, 0, "end_us"),
            phase=_column(phase, n, i8, UNKNOWN, "phase"),
            axis=_column(axis, n, i8, UNKNOWN, "axis"),
            op=_column(op, n, i8, UNKNOWN, "op"),
            group=_column(group, n, i32, UNKNOWN, "group"),
            seq=_column(seq, n, i64, UNKNOWN, "seq"),
            size_bytes=_column(size_bytes, n, i64, UNKNOWN, "size_bytes"),
            group_size=_column(group_size, n, i32, UNKNOWN, "group_size"),
            peer=_column(peer, n, i64, UNKNOWN, "peer"),
        )

    def __len__(self) -> int:
        """Number of intervals."""
        return int(self.row.shape[0])


def _natural(name: str) -> tuple[tuple[int, str, int], ...]:
    """Sort key putting ``node-2`` before ``node-10``: text and numbers alternately, numbers by value."""
    return tuple((0, part, 0) if i % 2 == 0 else (1, "", int(part)) for i, part in enumerate(_DIGITS.split(name)))


_DIGITS = re.compile(r"(\d+)")


def sorted_codes(names: Sequence[str], codes: NDArray[Any]) -> tuple[tuple[str, ...], NDArray[Any]]:
    """``names`` in natural order (``node-2`` before ``node-10``), ``codes`` renumbered to match (unknown ones kept).

    Readers number nodes, domains, tiers and groups as they first meet them; the order records arrive in (files
    given in another order, sidecars answering the operator in another order) must not change any result, and ties
    broken by code (the clock alignment's spanning tree, for one) would. Every table numbers them by name.
    """
    keys = [(_natural(n), n) for n in names]  # the name itself breaks ties (node-07 and node-7)
    if keys == sorted(keys):
        return tuple(names), codes
    order = sorted(range(len(names)), key=keys.__getitem__)
    new_code = np.empty(len(names), dtype=np.int64)
    new_code[order] = np.arange(len(names), dtype=np.int64)
    arr = np.asarray(codes)
    known = arr >= 0
    out = arr.copy()
    out[known] = new_code[arr[known]].astype(arr.dtype, copy=False)
    return tuple(names[i] for i in order), out


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordTable:
    """All step records of one job as numpy columns. Validated on construction (vectorised).

    String-valued fields (node, NVLink domain, network tier, group) are stored as integer codes into the name tuples.
    """

    job: str
    """Job name."""
    steps: StepColumns
    """One row per (rank, step)."""
    intervals: IntervalColumns
    """One row per interval."""
    node_names: tuple[str, ...] = ()
    """Names for ``steps.node`` codes; empty means ``node-<code>``."""
    nvlink_domain_names: tuple[str, ...] = ()
    network_tier_names: tuple[str, ...] = ()
    group_names: tuple[str, ...] = ()
    """Names for ``intervals.group`` codes; empty means ``group-<code>``."""
    source_files: tuple[str, ...] = ()
    """Files the rows were read from (``steps.source_file`` indexes it)."""
    notes: tuple[Note, ...] = ()
    """Partial data met while reading."""
    collective_order: NDArray[np.intp] = field(init=False, repr=False, compare=False)
    """Indices of the comm intervals sorted by (group, seq, rank): every collective instance is a contiguous run.
    Computed during validation, reused by the join."""

    def __post_init__(self) -> None:
        """Validate every column against the schema's rules.

        Raises:
            ParseError: for the first offending row or interval, naming where it came from (file and line when read
                from disk), the field, the value and what would fit.
        """
        object.__setattr__(self, "collective_order", _validate_table(self))

    @property
    def n_rows(self) -> int:
        """Number of rank-steps."""
        return len(self.steps)

    @property
    def on_gpu(self) -> bool:
        """Whether the run had GPUs: a record names one or reports its utilisation (else its phases are host times)."""
        s = self.steps
        return bool((s.gpu >= 0).any() or np.isfinite(s.gpu_util).any())

    @property
    def host_timed_with_runqueue(self) -> bool:
        """Whether the run was timed on the host (no GPU) and every record has ``runqueue_wait_us``.

        Where the scheduler's delays can be told from the job's own time; on a GPU the kernels run whether or not the
        launching thread has a core.
        """
        runqueue = self.steps.runqueue_wait_us
        return runqueue.size > 0 and not self.on_gpu and bool((runqueue >= 0).all())

    @property
    def n_intervals(self) -> int:
        """Number of intervals."""
        return len(self.intervals)

    def node_name(self, code: int) -> str:
        """Name of node ``code``."""
        return self.node_names[code] if self.node_names else f"node-{code}"

    def group_name(self, code: int) -> str:
        """Name of group ``code``."""
        return self.group_names[code] if self.group_names else f"group-{code}"

    def where_row(self, row: int) -> str:
        """Where rank-step ``row`` came from, for messages: ``file line N`` or ``row i (rank r, step s)``."""
        f = int(self.steps.source_file[row])
        if 0 <= f < len(self.source_files):
            return f"{self.source_files[f]} line {int(self.steps.source_line[row])}"
        return f"row {row} (rank {int(self.steps.rank[row])}, step {int(self.steps.step[row])})"

    def where_interval(self, index: int) -> str:
        """Where interval ``index`` came from: its rank-step and its position among that rank-step's intervals."""
        row = int(self.intervals.row[index])
        if not 0 <= row < self.n_rows:
            return f"interval {index}"
        position = int(np.count_nonzero(self.intervals.row[:index] == row))
        return f"{self.where_row(row)}: intervals[{position}]"

    @classmethod
    def from_records(cls, records: Iterable[StepRecord], *, notes: Sequence[Note] = ()) -> RecordTable:
        """Columns from record objects (small inputs, tests, the SDK's buffers).

        Raises:
            ParseError: on mismatched jobs, duplicate (rank, step) or any rule of :class:`RecordTable`.
        """
        kept: list[StepRecord] = []
        raised: list[StepRecord] = []
        for r in records:
            (kept if r.raised is None else raised).append(r)
        if raised:
            notes = (*notes, raised_steps_note([r.rank for r in raised], [r.step for r in raised]))
        return _table_of_records(kept, notes=tuple(notes))

    def to_records(self) -> tuple[StepRecord, ...]:
        """Record objects for every row, in table order (for small tables: one object per interval)."""
        return tuple(_row_record(self, i, ivs) for i, ivs in enumerate(_intervals_by_row(self)))


RAISED_STEPS = "raised_steps"
"""The note code of rank-steps left out because they ended by an exception (the record's ``raised``)."""


def raised_steps_note(ranks: Sequence[int], steps: Sequence[int]) -> Note:
    """The note for rank-steps that ended by an exception, left out of the table: how many, and which (the first 5)."""
    n = len(ranks)
    pairs = sorted(zip(steps, ranks, strict=True))
    which = ", ".join(f"rank {r} step {st}" for st, r in pairs[:5]) + (f" and {n - 5} more" if n > 5 else "")
    return Note(
        code=RAISED_STEPS,
        count=n,
        message=(
            f"{n} rank-step{'' if n == 1 else 's'} ended by an exception ({which}) left out: cut short where the "
            "training loop raised (a crash, an out-of-memory error, a collective's timeout or a peer's lost "
            f"connection), {'it is no step' if n == 1 else 'they are no steps'} of the run; the records keep "
            f"{'it' if n == 1 else 'them'}, and the failing rank's log says why"
        ),
    )


_ROW_FIELDS = ("tokens", "sequences", "longest_sequence", "attention_us", "peak_memory_bytes")
_NO_BETWEEN = [UNKNOWN] * len(BETWEEN_KINDS)
_NET_FIELDS = ("seq", "size_bytes", "group_size", "peer")


def _by_name(
    codes: Mapping[str, Iterable[str]], rows: dict[str, Any], ivs: dict[str, Any]
) -> dict[str, tuple[str, ...]]:
    """The names of each coded field in sorted order, ``rows`` and ``ivs`` renumbered to match (in place)."""
    names: dict[str, tuple[str, ...]] = {}
    for name in ("node", "nvlink_domain", "network_tier"):
        names[name], rows[name] = sorted_codes(tuple(codes[name]), np.asarray(rows[name], dtype=np.int64))
    names["group"], ivs["group"] = sorted_codes(tuple(codes["group"]), np.asarray(ivs["group"], dtype=np.int64))
    return names


def _table_of_records(records: Iterable[StepRecord], *, notes: tuple[Note, ...]) -> RecordTable:  # noqa: PLR0915 - one field after another
    """Columns from record objects; names are coded in the order they first appear.

    Net fields are kept for comm and p2p intervals only (``peer`` for p2p, ``group_size`` for comm), as the JSON
    readers do.

    Raises:
        ParseError: for records of more than one job, and as :class:`RecordTable`.
    """
    codes: dict[str, dict[str, int]] = {"node": {}, "nvlink_domain": {}, "network_tier": {}, "group": {}}

    def code(kind: str, name: str | None) -> int:
        if name is None:
            return UNKNOWN
        names = codes[kind]
        return names.setdefault(name, len(names))

    job: tuple[str, str] | None = None
    rows: dict[str, list[Any]] = {k: [] for k in ("rank", "step", "start_us", "end_us", "coord", "gpu", "gpu_util")}
    rows.update({k: [] for k in ("node", "nvlink_domain", "network_tier", *_ROW_FIELDS, "attention_work")})
    rows.update(
        {
            k: []
            for k in (
                "user_step",
                "gap_before_us",
                "between_us",
                "between_comm_us",
                "runqueue_wait_us",
                "on_cpu_us",
                "compute_runqueue_wait_us",
                "data_runqueue_wait_us",
                "optimizer_runqueue_wait_us",
                "attempt_start_us",
            )
        }
    )
    ivs: dict[str, list[Any]] = {k: [] for k in ("row", "kind", "start_us", "end_us", "phase", "axis", "op", "group")}
    ivs.update({k: [] for k in _NET_FIELDS})
    for i, rec in enumerate(records):
        where = f"record {i}"
        if job is None:
            job = (rec.job, where)
        elif rec.job != job[0]:
            raise ParseError(_job_mismatch(rec.job, where, *job), code=ParseCode.JOB_MISMATCH)
        for name in ("rank", "step", "start_us", "end_us"):
            rows[name].append(getattr(rec, name))
        rows["coord"].append([rec.coord[a] for a in AXES])
        rows["node"].append(code("node", rec.node))
        rows["nvlink_domain"].append(code("nvlink_domain", rec.nvlink_domain))
        rows["network_tier"].append(code("network_tier", rec.network_tier))
        rows["gpu"].append(UNKNOWN if rec.gpu is None else rec.gpu)
        rows["gpu_util"].append(math.nan if rec.gpu_util is None else rec.gpu_util)
        for name in _ROW_FIELDS:
            value = getattr(rec.stats, name)
            rows[name].append(UNKNOWN if value is None else value)
        work = rec.stats.attention_work
        rows["attention_work"].append(math.nan if work is None else work)
        rows["user_step"].append(UNKNOWN if rec.user_step is None else rec.user_step)
        rows["gap_before_us"].append(UNKNOWN if rec.gap_before_us is None else rec.gap_before_us)
        rows["runqueue_wait_us"].append(UNKNOWN if rec.runqueue_wait_us is None else rec.runqueue_wait_us)
        rows["on_cpu_us"].append(UNKNOWN if rec.on_cpu_us is None else rec.on_cpu_us)
        in_compute = rec.compute_runqueue_wait_us
        rows["compute_runqueue_wait_us"].append(UNKNOWN if in_compute is None else in_compute)
        in_data = rec.data_runqueue_wait_us
        rows["data_runqueue_wait_us"].append(UNKNOWN if in_data is None else in_data)
        in_optimizer = rec.optimizer_runqueue_wait_us
        rows["optimizer_runqueue_wait_us"].append(UNKNOWN if in_optimizer is None else in_optimizer)
        rows["attempt_start_us"].append(UNKNOWN if rec.attempt_start_us is None else rec.attempt_start_us)
        between = rec.between_steps
        rows["between_us"].append(
            _NO_BETWEEN if between is None else [getattr(between, f"{k}_us") for k in BETWEEN_KINDS]
        )
        rows["between_comm_us"].append(UNKNOWN if between is None else between.comm_us)
        for iv in rec.intervals:
            net = iv.kind in {IntervalKind.COMM, IntervalKind.P2P}
            ivs["row"].append(i)
            ivs["kind"].append(KIND_CODE[iv.kind])
            ivs["start_us"].append(iv.start_us)
            ivs["end_us"].append(iv.end_us)
            ivs["phase"].append(UNKNOWN if iv.phase is None else PHASE_CODE[iv.phase])
            ivs["axis"].append(AXIS_CODE[iv.axis] if net and iv.axis is not None else UNKNOWN)
            ivs["op"].append(OP_CODE[iv.op] if net and iv.op is not None else UNKNOWN)
            ivs["group"].append(code("group", iv.group) if net else UNKNOWN)
            ivs["seq"].append(UNKNOWN if iv.seq is None or not net else iv.seq)
            ivs["size_bytes"].append(UNKNOWN if iv.size_bytes is None or not net else iv.size_bytes)
            is_comm = iv.kind is IntervalKind.COMM
            ivs["group_size"].append(UNKNOWN if iv.group_size is None or not is_comm else iv.group_size)
            ivs["peer"].append(UNKNOWN if iv.peer is None or is_comm or not net else iv.peer)
    n = len(rows["rank"])
    group_size = np.asarray(ivs.pop("group_size"), dtype=np.int64)
    big = _first(group_size > np.iinfo(np.int32).max)
    if big is not None:
        raise ParseError(
            f"group_size = {int(group_size[big])} is more than {np.iinfo(np.int32).max} ranks",
            code=ParseCode.VALUE_OUT_OF_RANGE,
        )
    coord = np.asarray(rows.pop("coord"), dtype=np.int64).reshape(n, len(AXES))
    between_us = np.asarray(rows.pop("between_us"), dtype=np.int64).reshape(n, len(BETWEEN_KINDS))
    names = _by_name(codes, rows, ivs)
    return RecordTable(
        job=job[0] if job else "",
        steps=StepColumns.build(coord=coord, between_us=between_us, **rows),
        intervals=IntervalColumns.build(group_size=group_size, **ivs),
        node_names=names["node"],
        nvlink_domain_names=names["nvlink_domain"],
        network_tier_names=names["network_tier"],
        group_names=names["group"],
        notes=notes,
    )


def _intervals_by_row(table: RecordTable) -> list[list[Interval]]:
    per_row: list[list[Interval]] = [[] for _ in range(table.n_rows)]
    iv = table.intervals
    cols = [
        iv.row.tolist(),
        iv.kind.tolist(),
        iv.start_us.tolist(),
        iv.end_us.tolist(),
        iv.phase.tolist(),
        iv.axis.tolist(),
        iv.op.tolist(),
        iv.group.tolist(),
        iv.seq.tolist(),
        iv.size_bytes.tolist(),
        iv.group_size.tolist(),
        iv.peer.tolist(),
    ]
    for r, k, s, e, ph, ax, op, g, sq, nb, gs, peer in zip(*cols, strict=True):
        per_row[r].append(
            Interval(
                kind=KINDS[k],
                start_us=s,
                end_us=e,
                phase=PHASES[ph] if ph >= 0 else None,
                axis=AXES[ax] if ax >= 0 else None,
                op=OPS[op] if op >= 0 else None,
                group=table.group_name(g) if g >= 0 else None,
                seq=sq if sq >= 0 else None,
                size_bytes=nb if nb >= 0 else None,
                group_size=gs if gs >= 0 else None,
                peer=peer if peer >= 0 else None,
            )
        )
    return per_row


def _opt_int(value: np.integer[Any]) -> int | None:
    v = int(value)
    return v if v >= 0 else None


def _opt_float(value: np.floating[Any]) -> float | None:
    v = float(value)
    return None if math.isnan(v) else v


def _row_record(table: RecordTable, i: int, intervals: list[Interval]) -> StepRecord:
    s = table.steps
    dom, tier = int(s.nvlink_domain[i]), int(s.network_tier[i])
    return StepRecord(
        job=table.job,
        step=int(s.step[i]),
        rank=int(s.rank[i]),
        coord=RankCoord(**{a.value: int(s.coord[i, k]) for k, a in enumerate(AXES)}),
        node=table.node_name(int(s.node[i])),
        start_us=int(s.start_us[i]),
        end_us=int(s.end_us[i]),
        intervals=tuple(intervals),
        nvlink_domain=(table.nvlink_domain_names[dom] if table.nvlink_domain_names else f"nvl-{dom}")
        if dom >= 0
        else None,
        network_tier=(table.network_tier_names[tier] if table.network_tier_names else f"block-{tier}")
        if tier >= 0
        else None,
        gpu=_opt_int(s.gpu[i]),
        stats=DataStats(
            tokens=_opt_int(s.tokens[i]),
            sequences=_opt_int(s.sequences[i]),
            longest_sequence=_opt_int(s.longest_sequence[i]),
            attention_work=_opt_float(s.attention_work[i]),
            attention_us=_opt_int(s.attention_us[i]),
            peak_memory_bytes=_opt_int(s.peak_memory_bytes[i]),
        ),
        gpu_util=_opt_float(s.gpu_util[i]),
        user_step=_opt_int(s.user_step[i]),
        gap_before_us=_opt_int(s.gap_before_us[i]),
        between_steps=None
        if s.between_us[i, 0] < 0
        else BetweenSteps(
            **{f"{k}_us": int(s.between_us[i, j]) for j, k in enumerate(BETWEEN_KINDS)},
            comm_us=max(0, int(s.between_comm_us[i])),
        ),
        runqueue_wait_us=_opt_int(s.runqueue_wait_us[i]),
        on_cpu_us=_opt_int(s.on_cpu_us[i]),
        compute_runqueue_wait_us=_opt_int(s.compute_runqueue_wait_us[i]),
        data_runqueue_wait_us=_opt_int(s.data_runqueue_wait_us[i]),
        optimizer_runqueue_wait_us=_opt_int(s.optimizer_runqueue_wait_us[i]),
        attempt_start_us=_opt_int(s.attempt_start_us[i]),
    )


# ====================================================================== vectorised validation


def lexsort_keys(*keys: NDArray[np.integer[Any]]) -> NDArray[np.intp]:
    """Indices that sort by ``keys[0]``, then ``keys[1]``, ... (the first key most significant).

    Like ``np.lexsort(keys[::-1])``, but when the keys' ranges fit in 62 bits together they are packed into one
    int64 and argsorted, several times faster on millions of rows. Order among fully equal keys is unspecified.
    """
    if not keys or keys[0].size == 0:
        return np.zeros(0, dtype=np.intp)
    lows = [int(k.min()) for k in keys]
    widths = [(int(k.max()) - lo).bit_length() for k, lo in zip(keys, lows, strict=True)]
    if sum(widths) > 62:
        return np.lexsort(keys[::-1])
    packed = np.zeros(keys[0].shape, dtype=np.int64)
    for k, lo, width in zip(keys, lows, widths, strict=True):
        packed <<= width
        packed |= k.astype(np.int64) - lo
    return np.argsort(packed)


def _first(mask: NDArray[np.bool_]) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _check_codes(
    table: RecordTable, values: NDArray[Any], *, allowed: str, lo: int, hi: int, name: str, rows: bool
) -> None:
    bad = _first((values < lo) | (values >= hi))
    if bad is not None:
        where = table.where_row(bad) if rows else table.where_interval(bad)
        raise ParseError(
            f"{where}: {name} = {int(values[bad])} is not {allowed} (codes {lo}..{hi - 1})", code=ParseCode.NOT_ONE_OF
        )


def _validate_table(t: RecordTable) -> NDArray[np.intp]:  # noqa: C901, PLR0912, PLR0915 - one rule after another
    s, iv = t.steps, t.intervals
    n = len(s)
    for name in (
        "step",
        "start_us",
        "end_us",
        "node",
        "nvlink_domain",
        "network_tier",
        "gpu",
        "gpu_util",
        "tokens",
        "sequences",
        "longest_sequence",
        "attention_work",
        "attention_us",
        "peak_memory_bytes",
        "user_step",
        "gap_before_us",
        "between_comm_us",
        "runqueue_wait_us",
        "on_cpu_us",
        "compute_runqueue_wait_us",
        "data_runqueue_wait_us",
        "optimizer_runqueue_wait_us",
        "attempt_start_us",
        "source_file",
        "source_line",
    ):
        if getattr(s, name).shape != (n,):
            raise ParseError(
                f"step column {name} has shape {getattr(s, name).shape}; expected ({n},)", code=ParseCode.BAD_SHAPE
            )
    if s.coord.shape != (n, len(AXES)):
        raise ParseError(
            f"step column coord has shape {s.coord.shape}; expected ({n}, {len(AXES)})", code=ParseCode.BAD_SHAPE
        )
    if s.between_us.shape != (n, len(BETWEEN_KINDS)):
        raise ParseError(
            f"step column between_us has shape {s.between_us.shape}; expected ({n}, {len(BETWEEN_KINDS)})",
            code=ParseCode.BAD_SHAPE,
        )
    m = len(iv)
    for name in ("kind", "start_us", "end_us", "phase", "axis", "op", "group", "seq", "size_bytes"):
        if getattr(iv, name).shape != (m,):
            raise ParseError(
                f"interval column {name} has shape {getattr(iv, name).shape}; expected ({m},)", code=ParseCode.BAD_SHAPE
            )
    # -- rank-steps
    for name in ("rank", "step"):
        bad = _first(getattr(s, name) < 0)
        if bad is not None:
            raise ParseError(
                f"{t.where_row(bad)}: {name} = {int(getattr(s, name)[bad])} is below 0",
                code=ParseCode.VALUE_OUT_OF_RANGE,
            )
    bad_c = np.flatnonzero((s.coord < 0).any(axis=1))
    if bad_c.size:
        raise ParseError(
            f"{t.where_row(int(bad_c[0]))}: coord has a negative index: {s.coord[bad_c[0]].tolist()}",
            code=ParseCode.VALUE_OUT_OF_RANGE,
        )
    bad = _first(s.end_us < s.start_us)
    if bad is not None:
        raise ParseError(
            f"{t.where_row(bad)}: end_us = {int(s.end_us[bad])} is before start_us = {int(s.start_us[bad])}; "
            f"a step must end at or after its start",
            code=ParseCode.ENDS_BEFORE_START,
        )
    n_nodes = len(t.node_names) if t.node_names else (int(s.node.max()) + 1 if n else 0)
    _check_codes(t, s.node, allowed="a known node", lo=0, hi=n_nodes, name="node", rows=True)
    for name, names in (("nvlink_domain", t.nvlink_domain_names), ("network_tier", t.network_tier_names)):
        col = getattr(s, name)
        hi = len(names) if names else (int(col.max()) + 1 if n else 0)
        _check_codes(t, col, allowed=f"a known {name} or -1", lo=UNKNOWN, hi=max(hi, 0), name=name, rows=True)
    util = s.gpu_util
    bad = _first(~np.isnan(util) & ((util < 0) | (util > 1)))
    if bad is not None:
        raise ParseError(
            f"{t.where_row(bad)}: gpu_util = {float(util[bad])} must be a ratio in [0, 1] (DCGM percent / 100)",
            code=ParseCode.VALUE_OUT_OF_RANGE,
        )
    for name in (
        "gpu",
        "tokens",
        "sequences",
        "longest_sequence",
        "attention_us",
        "peak_memory_bytes",
        "user_step",
        "gap_before_us",
        "between_comm_us",
        "runqueue_wait_us",
        "on_cpu_us",
        "compute_runqueue_wait_us",
        "data_runqueue_wait_us",
        "optimizer_runqueue_wait_us",
        "attempt_start_us",
    ):
        col = getattr(s, name)
        bad = _first(col < UNKNOWN)
        if bad is not None:
            raise ParseError(
                f"{t.where_row(bad)}: {name} = {int(col[bad])} is below 0 (-1 means unknown)",
                code=ParseCode.VALUE_OUT_OF_RANGE,
            )
    # the run delay in compute, data loading and the optimizer step: parts of runqueue_wait_us, only with it
    for name, where in (
        ("compute_runqueue_wait_us", "compute"),
        ("data_runqueue_wait_us", "data loading"),
        ("optimizer_runqueue_wait_us", "optimizer step"),
    ):
        part = getattr(s, name)
        bad = _first((part >= 0) & ((s.runqueue_wait_us < 0) | (part > s.runqueue_wait_us)))
        if bad is not None:
            raise ParseError(
                f"{t.where_row(bad)}: {name} = {int(part[bad])} must come with runqueue_wait_us and be at most it "
                f"(runqueue_wait_us = {int(s.runqueue_wait_us[bad])}; -1 means unknown): it is the part of the "
                f"step's run delay in its {where}",
                code=ParseCode.VALUE_OUT_OF_RANGE,
            )
    # between_us: a row is all -1 (not measured) or every kind >= 0
    given = s.between_us >= 0
    below = np.any(s.between_us < UNKNOWN, axis=1)
    mixed = np.any(given, axis=1) & ~np.all(given, axis=1)
    bad = _first(np.asarray(below | mixed))
    if bad is not None:
        raise ParseError(
            f"{t.where_row(bad)}: between_us = {s.between_us[bad].tolist()} must be all -1 (not measured) or all "
            f">= 0, kinds {BETWEEN_KINDS}",
            code=ParseCode.VALUE_OUT_OF_RANGE,
        )
    # between_comm_us: a part of between_steps, measured only with it (-1 beside it: an older writer's)
    bad = _first((s.between_comm_us >= 0) & ~given[:, 0])
    if bad is not None:
        raise ParseError(
            f"{t.where_row(bad)}: between_comm_us = {int(s.between_comm_us[bad])} where between_us is not measured "
            "(all -1): it is a part of between_steps, -1 without it",
            code=ParseCode.VALUE_OUT_OF_RANGE,
        )
    _check_unique_rank_steps(t)
    # -- intervals
    if m == 0:
        return np.zeros(0, dtype=np.intp)
    _check_codes(t, iv.row, allowed="a rank-step row", lo=0, hi=n, name="row", rows=False)
    _check_codes(
        t, iv.kind, allowed=f"a kind of {[k.value for k in KINDS]}", lo=0, hi=len(KINDS), name="kind", rows=False
    )
    bad = _first(iv.end_us < iv.start_us)
    if bad is not None:
        raise ParseError(
            f"{t.where_interval(bad)}.end_us = {int(iv.end_us[bad])} is before start_us = {int(iv.start_us[bad])}; "
            f"an interval must end at or after its start",
            code=ParseCode.ENDS_BEFORE_START,
        )
    row_start, row_end = s.start_us[iv.row], s.end_us[iv.row]
    bad = _first((iv.end_us < row_start) | (iv.start_us > row_end))
    if bad is not None:
        r = int(iv.row[bad])
        raise ParseError(
            f"{t.where_interval(bad)} = [{int(iv.start_us[bad])}, {int(iv.end_us[bad])}] lies wholly outside the "
            f"step [{int(s.start_us[r])}, {int(s.end_us[r])}]; an interval must overlap its step (wrong step or rank?)",
            code=ParseCode.OUTSIDE_STEP,
        )
    is_compute = iv.kind == COMPUTE_CODE
    _check_codes(
        t,
        np.where(is_compute, iv.phase, 0),
        allowed=f"a phase of {list(PHASE_CODE)} or -1",
        lo=UNKNOWN,
        hi=len(PHASES),
        name="phase",
        rows=False,
    )
    comm = iv.kind == COMM_CODE
    p2p = iv.kind == P2P_CODE
    net = comm | p2p
    bad = _first(net & ((iv.axis < 0) | (iv.axis >= len(AXES))))
    if bad is not None:
        raise ParseError(
            f"{t.where_interval(bad)}.axis = {int(iv.axis[bad])} is not an axis code 0..4 {AXES}",
            code=ParseCode.NOT_ONE_OF,
        )
    for mask, fits, problem in (
        (comm, _COLLECTIVE_OP_CODES, "is point-to-point; use kind 'p2p' for send/recv"),
        (p2p, _P2P_OP_CODES, "is a collective; a p2p interval has op 'send' or 'recv'"),
    ):
        bad = _first(mask & ~np.isin(iv.op, fits))
        if bad is not None:
            code = int(iv.op[bad])
            if not 0 <= code < len(OPS):
                raise ParseError(
                    f"{t.where_interval(bad)}.op = {code} is not an op code 0..{len(OPS) - 1} {OPS}",
                    code=ParseCode.NOT_ONE_OF,
                )
            raise ParseError(f"{t.where_interval(bad)}.op = {OPS[code].value!r} {problem}", code=ParseCode.INCONSISTENT)
    n_groups = len(t.group_names) if t.group_names else (int(iv.group.max()) + 1 if m else 0)
    bad = _first(comm & ((iv.group < 0) | (iv.group >= n_groups)))
    if bad is not None:
        raise ParseError(
            f"{t.where_interval(bad)}.group = {int(iv.group[bad])} is not a known group code", code=ParseCode.NOT_ONE_OF
        )
    bad = _first(comm & (iv.seq < 0))
    if bad is not None:
        raise ParseError(
            f"{t.where_interval(bad)}.seq = {int(iv.seq[bad])}: a comm interval needs seq >= 0",
            code=ParseCode.MISSING_FIELD,
        )
    bad = _first(p2p & (iv.peer < 0))
    if bad is not None:
        raise ParseError(
            f"{t.where_interval(bad)}.peer = {int(iv.peer[bad])}: a p2p interval needs its peer rank",
            code=ParseCode.MISSING_FIELD,
        )
    for name, label in (("size_bytes", "bytes"), ("seq", "seq"), ("peer", "peer")):
        col = getattr(iv, name)
        bad = _first(col < UNKNOWN)
        if bad is not None:
            raise ParseError(
                f"{t.where_interval(bad)}.{label} = {int(col[bad])} is below 0 (-1 means unknown)",
                code=ParseCode.VALUE_OUT_OF_RANGE,
            )
    bad = _first((iv.group_size == 0) | (iv.group_size < UNKNOWN))
    if bad is not None:
        raise ParseError(
            f"{t.where_interval(bad)}.group_size = {int(iv.group_size[bad])} must be >= 1",
            code=ParseCode.VALUE_OUT_OF_RANGE,
        )
    return _check_collectives(t, np.flatnonzero(comm))


def _check_unique_rank_steps(t: RecordTable) -> None:
    s = t.steps
    if len(s) < 2:
        return
    order = lexsort_keys(s.rank, s.step)
    r, st = s.rank[order], s.step[order]
    dup = _first((r[1:] == r[:-1]) & (st[1:] == st[:-1]))
    if dup is not None:
        a, b = sorted((int(order[dup]), int(order[dup + 1])))
        raise ParseError(
            f"rank {int(s.rank[a])} step {int(s.step[a])} appears twice: {t.where_row(a)} and {t.where_row(b)}; "
            f"each (rank, step) must have exactly one record{RESTARTED}",
            code=ParseCode.DUPLICATE,
        )


def _check_collectives(t: RecordTable, comm: NDArray[np.intp]) -> NDArray[np.intp]:
    """Every (group, seq, rank) once; one op, axis and group size per instance; one axis per group.

    Returns:
        ``comm`` sorted by (group, seq, rank).
    """
    if comm.size == 0:
        return comm
    iv = t.intervals
    grp, seq = iv.group[comm], iv.seq[comm]
    rank = t.steps.rank[iv.row[comm]]
    order = lexsort_keys(grp, seq, rank)
    g, q, r = grp[order], seq[order], rank[order]
    same_group = g[1:] == g[:-1]
    same_inst = same_group & (q[1:] == q[:-1])

    def pair(k: int) -> tuple[int, int]:
        return int(comm[order[k]]), int(comm[order[k + 1]])

    bad = _first(same_inst & (r[1:] == r[:-1]))
    if bad is not None:
        a, b = pair(bad)
        raise ParseError(
            f"collective group {t.group_name(int(g[bad]))!r} seq {int(q[bad])} appears twice on rank {int(r[bad])}: "
            f"{t.where_interval(a)} and {t.where_interval(b)}; (group, seq) must name one collective instance over "
            f"the whole job (seq counts the group's collectives, it does not restart every step){RESTARTED}",
            code=ParseCode.DUPLICATE,
        )
    op = iv.op[comm][order]
    bad = _first(same_inst & (op[1:] != op[:-1]))
    if bad is not None:
        a, b = pair(bad)
        raise ParseError(
            f"collective group {t.group_name(int(g[bad]))!r} seq {int(q[bad])}: {t.where_interval(a)} has op "
            f"{OPS[int(op[bad])].value!r} but {t.where_interval(b)} has {OPS[int(op[bad + 1])].value!r}; members of "
            f"one collective must agree",
            code=ParseCode.INCONSISTENT,
        )
    ax = iv.axis[comm][order]
    bad = _first(same_group & (ax[1:] != ax[:-1]))
    if bad is not None:
        a, b = pair(bad)
        raise ParseError(
            f"group {t.group_name(int(g[bad]))!r} is on axis {AXES[int(ax[bad])].value} at {t.where_interval(a)} but "
            f"on axis {AXES[int(ax[bad + 1])].value} at {t.where_interval(b)}; a group belongs to one axis",
            code=ParseCode.INCONSISTENT,
        )
    # group_size is a property of the group: where given, it must agree, and no instance may have more members.
    gs = iv.group_size[comm][order].astype(np.int64)
    group_first = np.flatnonzero(np.concatenate(([True], ~same_group)))
    group_given = np.maximum.reduceat(gs, group_first)
    group_of = np.cumsum(np.concatenate(([True], ~same_group))) - 1
    bad = _first((gs > 0) & (gs != group_given[group_of]))
    if bad is not None:
        a = int(comm[order[bad]])
        raise ParseError(
            f"group {t.group_name(int(g[bad]))!r} has group_size {int(gs[bad])} at {t.where_interval(a)} but "
            f"{int(group_given[group_of[bad]])} elsewhere; a group has one size",
            code=ParseCode.INCONSISTENT,
        )
    starts = np.flatnonzero(np.concatenate(([True], ~same_inst)))
    members = np.diff(np.append(starts, order.size))
    given = group_given[group_of[starts]]
    bad = _first((given > 0) & (members > given))
    if bad is not None:
        a = int(comm[order[starts[bad]]])
        raise ParseError(
            f"collective group {t.group_name(int(g[starts[bad]]))!r} seq {int(q[starts[bad]])} has "
            f"{int(members[bad])} members but group_size = {int(given[bad])} ({t.where_interval(a)})",
            code=ParseCode.INCONSISTENT,
        )
    return comm[order]

"""Step records: the one schema every source (SDK, simulator, sidecar) produces, and its columnar in-memory form.

A **step record** describes one rank's one training step: where the rank sits (coord, node, NVLink domain, network
tier, GPU), when the step started and ended, and the intervals it spent computing, communicating, loading data,
stepping the optimizer and checkpointing. On disk it is one JSON object per line (``meshscope.step/1``, see
``docs/records.md``); in memory it is either a :class:`StepRecord` (small inputs, tests, writers) or a
:class:`RecordTable` (numpy columns: one table of rank-steps, one of intervals) for analysis at scale: a 16,384-rank
job with 20 steps and ~30 intervals per rank-step is ~10 million intervals, which per-interval Python objects could
not hold.

This module exists so that every producer and every consumer agrees on one schema and one set of checks. It reads,
writes and validates; it must not analyse (no breakdown, no joins across ranks: that is :mod:`meshscope.breakdown`),
must not guess at bad input (every problem is a :class:`~meshscope.errors.ParseError` naming the file, line, field,
value and what would fit) and must not depend on anything beyond numpy and the standard library.
"""

from __future__ import annotations

import gzip
import json
import math
import multiprocessing
import zlib
from array import array
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

import numpy as np

from meshscope.errors import ParseError
from meshscope.layout import AXES, MeshAxis, RankCoord

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence

    from numpy.typing import ArrayLike, NDArray

    StrPath = str | PathLike[str]

SCHEMA = "meshscope.step/1"
"""Schema tag every record carries. A reader refuses any other version."""

UNKNOWN = -1
"""Code stored in integer columns where a record leaves an optional field out (floats use NaN)."""


class IntervalKind(StrEnum):
    """What a rank did during an interval. The value is the ``kind`` field on disk."""

    COMPUTE = "compute"
    DATA = "data"
    OPTIMIZER = "optimizer"
    CHECKPOINT = "checkpoint"
    COMM = "comm"
    P2P = "p2p"


class Phase(StrEnum):
    """Which part of the training step a compute interval belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"


class CommOp(StrEnum):
    """Communication operations. Collectives go with kind ``comm``, ``send``/``recv`` with kind ``p2p``."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    GATHER = "gather"
    SCATTER = "scatter"
    BARRIER = "barrier"
    SEND = "send"
    RECV = "recv"


KINDS: tuple[IntervalKind, ...] = tuple(IntervalKind)
"""Interval kinds in code order: ``IntervalColumns.kind`` holds the index into this tuple."""
PHASES: tuple[Phase, ...] = tuple(Phase)
"""Phases in code order (``IntervalColumns.phase``)."""
OPS: tuple[CommOp, ...] = tuple(CommOp)
"""Operations in code order (``IntervalColumns.op``)."""
P2P_OPS: frozenset[CommOp] = frozenset({CommOp.SEND, CommOp.RECV})
"""The operations an interval of kind ``p2p`` may have; every other operation is a collective."""
SYMMETRIC_OPS: frozenset[CommOp] = frozenset(
    {CommOp.ALL_REDUCE, CommOp.ALL_GATHER, CommOp.REDUCE_SCATTER, CommOp.ALL_TO_ALL, CommOp.BARRIER}
)
"""Collectives whose members all finish together (within microseconds); clocks are aligned on these only."""

KIND_CODE: dict[str, int] = {k.value: i for i, k in enumerate(KINDS)}
PHASE_CODE: dict[str, int] = {p.value: i for i, p in enumerate(PHASES)}
OP_CODE: dict[str, int] = {o.value: i for i, o in enumerate(OPS)}
AXIS_CODE: dict[str, int] = {a.value: i for i, a in enumerate(AXES)}
"""Axis codes are indices into :data:`meshscope.layout.AXES` (dp, tp, pp, cp, ep)."""

COMPUTE_CODE = KIND_CODE["compute"]
COMM_CODE = KIND_CODE["comm"]
P2P_CODE = KIND_CODE["p2p"]
_COLLECTIVE_OP_CODES = np.array([i for i, o in enumerate(OPS) if o not in P2P_OPS], dtype=np.int8)
_P2P_OP_CODES = np.array([i for i, o in enumerate(OPS) if o in P2P_OPS], dtype=np.int8)


# ====================================================================== record objects


@dataclass(frozen=True, slots=True, kw_only=True)
class Note:
    """Something the reader or the analysis had to leave out or adjust, counted: partial data is never silent."""

    code: str
    """Stable identifier, e.g. ``truncated_line``, ``clipped_intervals``, ``incomplete_collectives``."""
    count: int
    """How many lines, intervals or collective instances it concerns."""
    message: str
    """One sentence for people, with the numbers."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """One span of a rank's step. Times are integer microseconds on the rank's host clock.

    Fields after ``end_us`` depend on the kind: ``phase`` for compute; ``axis``, ``op``, ``group``, ``seq`` (required)
    and ``size_bytes``, ``group_size`` for comm; ``axis``, ``op``, ``peer`` (required) and ``group``, ``seq``,
    ``size_bytes`` for p2p. The others stay ``None``.
    """

    kind: IntervalKind
    """What the rank did."""
    start_us: int
    """Start; for comm and p2p the moment the rank entered the operation (its arrival)."""
    end_us: int
    """End, >= ``start_us``."""
    phase: Phase | None = None
    """Compute only: forward, backward or recompute; ``None`` when the source does not know."""
    axis: MeshAxis | None = None
    """Comm/p2p: the mesh axis of the process group."""
    op: CommOp | None = None
    """Comm/p2p: the operation."""
    group: str | None = None
    """Comm/p2p: job-unique process-group id, e.g. ``tp:3``."""
    seq: int | None = None
    """Comm/p2p: the group's operation counter; (group, seq) names one instance across its members."""
    size_bytes: int | None = None
    """Comm/p2p: message size, bytes (``bytes`` on disk)."""
    group_size: int | None = None
    """Comm: members of the process group; ``None`` means infer it from the members seen."""
    peer: int | None = None
    """P2p: global rank of the other side."""

    def __post_init__(self) -> None:
        """Check the fields fit the kind.

        Raises:
            ParseError: naming the field, its value and what would fit.
        """
        for name, enum in (("kind", IntervalKind), ("phase", Phase), ("axis", MeshAxis), ("op", CommOp)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, enum):
                if value not in {m.value for m in enum}:
                    raise ParseError(f"{name} = {value!r} is not one of {[m.value for m in enum]}")
                object.__setattr__(self, name, enum(value))
        if self.end_us < self.start_us:
            raise ParseError(
                f"end_us = {self.end_us} is before start_us = {self.start_us}; an interval must end at or after "
                f"its start"
            )
        _check_net_fields(self)
        for name in ("seq", "size_bytes", "peer"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ParseError(f"{name} = {value} is below 0")
        if self.group_size is not None and self.group_size < 1:
            raise ParseError(f"group_size = {self.group_size} must be >= 1")


def _check_net_fields(iv: Interval) -> None:
    """Comm needs axis, op, group and seq and a collective op; p2p needs axis, op (send/recv) and peer."""
    if iv.kind is IntervalKind.COMM:
        needed = {"axis": iv.axis, "op": iv.op, "group": iv.group, "seq": iv.seq}
    elif iv.kind is IntervalKind.P2P:
        needed = {"axis": iv.axis, "op": iv.op, "peer": iv.peer}
    else:
        return
    missing = [k for k, v in needed.items() if v is None]
    if missing:
        raise ParseError(f"a {iv.kind.value} interval needs {', '.join(missing)} (missing)")
    op = CommOp(str(iv.op))
    if iv.kind is IntervalKind.COMM and op in P2P_OPS:
        raise ParseError(f"op = {op.value!r} is point-to-point; use kind 'p2p' for send/recv")
    if iv.kind is IntervalKind.P2P and op not in P2P_OPS:
        raise ParseError(f"op = {op.value!r} is a collective; a p2p interval has op 'send' or 'recv'")


@dataclass(frozen=True, slots=True, kw_only=True)
class DataStats:
    """What the data loader handed this rank for this step. Every field is optional (``None``: not measured)."""

    tokens: int | None = None
    """Tokens in the rank's batch."""
    sequences: int | None = None
    """Sequences (samples) in the rank's batch."""
    longest_sequence: int | None = None
    """Tokens in the longest sequence."""
    attention_work: float | None = None
    """Σ over sequences of length², the quadratic part of attention cost, tokens²."""
    attention_us: int | None = None
    """Time in attention kernels, microseconds."""
    peak_memory_bytes: int | None = None
    """Peak allocated device memory during the step, bytes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One rank's one step (schema ``meshscope.step/1``)."""

    job: str
    """Job name; every record read together must carry the same one."""
    step: int
    """Training step number, >= 0."""
    rank: int
    """Global rank, >= 0."""
    coord: RankCoord
    """The rank's index along every mesh axis."""
    node: str
    """Host name; clocks are assumed shared within a node and skewed between nodes."""
    start_us: int
    """Step start on the host clock, microseconds."""
    end_us: int
    """Step end, >= ``start_us``."""
    intervals: tuple[Interval, ...] = ()
    """What the rank did; may overlap, may stick out of the step (the breakdown clips and counts them)."""
    nvlink_domain: str | None = None
    """NVLink domain label (e.g. ``nvidia.com/gpu.clique``); ``None`` if unknown."""
    network_tier: str | None = None
    """Network block (leaf switch group) label; ``None`` if unknown."""
    gpu: int | None = None
    """GPU index on the node; ``None`` if unknown."""
    stats: DataStats = field(default_factory=DataStats)
    """Data-loader statistics."""
    gpu_util: float | None = None
    """Reported GPU utilisation over the step, ratio 0–1 (DCGM ``GPU_UTIL`` / 100); ``None`` if not measured."""

    def __post_init__(self) -> None:
        """Check the step's own numbers and that no interval lies wholly outside it.

        Raises:
            ParseError: naming the field, its value and what would fit.
        """
        for name in ("step", "rank"):
            value = getattr(self, name)
            if value < 0:
                raise ParseError(f"{name} = {value} is below 0")
        if self.end_us < self.start_us:
            raise ParseError(
                f"end_us = {self.end_us} is before start_us = {self.start_us}; a step must end at or after its start"
            )
        if self.gpu_util is not None and not 0.0 <= self.gpu_util <= 1.0:
            raise ParseError(f"gpu_util = {self.gpu_util} must be a ratio in [0, 1] (DCGM percent / 100)")
        for i, iv in enumerate(self.intervals):
            if iv.end_us < self.start_us or iv.start_us > self.end_us:
                raise ParseError(
                    f"intervals[{i}] = [{iv.start_us}, {iv.end_us}] lies wholly outside the step "
                    f"[{self.start_us}, {self.end_us}]; an interval must overlap its step (wrong step or rank?)"
                )


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordSet:
    """Step records read from one or more files, with notes on what was skipped."""

    job: str
    """The job every record belongs to (``""`` when nothing was read)."""
    records: tuple[StepRecord, ...]
    """Records in file order."""
    notes: tuple[Note, ...] = ()
    """Partial data: e.g. a truncated last line skipped under ``allow_partial``."""

    def __iter__(self) -> Iterator[StepRecord]:
        """Iterate over the records."""
        return iter(self.records)

    def __len__(self) -> int:
        """Number of records."""
        return len(self.records)


# ====================================================================== columnar form


def _column(values: ArrayLike | None, n: int, dtype: type[np.generic], fill: float, name: str) -> NDArray[Any]:
    if values is None:
        return np.full(n, fill, dtype=dtype)
    out = np.ascontiguousarray(values, dtype=dtype)
    if out.shape != (n,):
        raise ParseError(f"column {name} has shape {out.shape}; expected ({n},), one value per row")
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class StepColumns:
    """The rank-step table: one row per (rank, step). Build with :meth:`build`, which fills optional columns."""

    rank: NDArray[np.int64]
    step: NDArray[np.int64]
    start_us: NDArray[np.int64]
    end_us: NDArray[np.int64]
    coord: NDArray[np.int64]
    """Shape ``(rows, 5)``, columns in :data:`meshscope.layout.AXES` order (dp, tp, pp, cp, ep)."""
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
            raise ParseError(f"column coord has shape {c.shape}; expected ({n}, {len(AXES)}), axes {AXES}")
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
    """Index into :data:`meshscope.layout.AXES`, or -1."""
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
        builder = _TableBuilder()
        for i, rec in enumerate(records):
            builder.add_record(rec, UNKNOWN, i)
        return builder.build(notes=tuple(notes), source_files=())

    def to_records(self) -> tuple[StepRecord, ...]:
        """Record objects for every row, in table order (for small tables: one object per interval)."""
        return tuple(_row_record(self, i, ivs) for i, ivs in enumerate(_intervals_by_row(self)))


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
        raise ParseError(f"{where}: {name} = {int(values[bad])} is not {allowed} (codes {lo}..{hi - 1})")


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
        "source_file",
        "source_line",
    ):
        if getattr(s, name).shape != (n,):
            raise ParseError(f"step column {name} has shape {getattr(s, name).shape}; expected ({n},)")
    if s.coord.shape != (n, len(AXES)):
        raise ParseError(f"step column coord has shape {s.coord.shape}; expected ({n}, {len(AXES)})")
    m = len(iv)
    for name in ("kind", "start_us", "end_us", "phase", "axis", "op", "group", "seq", "size_bytes"):
        if getattr(iv, name).shape != (m,):
            raise ParseError(f"interval column {name} has shape {getattr(iv, name).shape}; expected ({m},)")
    # -- rank-steps
    for name in ("rank", "step"):
        bad = _first(getattr(s, name) < 0)
        if bad is not None:
            raise ParseError(f"{t.where_row(bad)}: {name} = {int(getattr(s, name)[bad])} is below 0")
    bad_c = np.flatnonzero((s.coord < 0).any(axis=1))
    if bad_c.size:
        raise ParseError(f"{t.where_row(int(bad_c[0]))}: coord has a negative index: {s.coord[bad_c[0]].tolist()}")
    bad = _first(s.end_us < s.start_us)
    if bad is not None:
        raise ParseError(
            f"{t.where_row(bad)}: end_us = {int(s.end_us[bad])} is before start_us = {int(s.start_us[bad])}; "
            f"a step must end at or after its start"
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
            f"{t.where_row(bad)}: gpu_util = {float(util[bad])} must be a ratio in [0, 1] (DCGM percent / 100)"
        )
    for name in ("gpu", "tokens", "sequences", "longest_sequence", "attention_us", "peak_memory_bytes"):
        col = getattr(s, name)
        bad = _first(col < UNKNOWN)
        if bad is not None:
            raise ParseError(f"{t.where_row(bad)}: {name} = {int(col[bad])} is below 0 (-1 means unknown)")
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
            f"an interval must end at or after its start"
        )
    row_start, row_end = s.start_us[iv.row], s.end_us[iv.row]
    bad = _first((iv.end_us < row_start) | (iv.start_us > row_end))
    if bad is not None:
        r = int(iv.row[bad])
        raise ParseError(
            f"{t.where_interval(bad)} = [{int(iv.start_us[bad])}, {int(iv.end_us[bad])}] lies wholly outside the "
            f"step [{int(s.start_us[r])}, {int(s.end_us[r])}]; an interval must overlap its step (wrong step or rank?)"
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
        raise ParseError(f"{t.where_interval(bad)}.axis = {int(iv.axis[bad])} is not an axis code 0..4 {AXES}")
    for mask, fits, problem in (
        (comm, _COLLECTIVE_OP_CODES, "is point-to-point; use kind 'p2p' for send/recv"),
        (p2p, _P2P_OP_CODES, "is a collective; a p2p interval has op 'send' or 'recv'"),
    ):
        bad = _first(mask & ~np.isin(iv.op, fits))
        if bad is not None:
            code = int(iv.op[bad])
            if not 0 <= code < len(OPS):
                raise ParseError(f"{t.where_interval(bad)}.op = {code} is not an op code 0..{len(OPS) - 1} {OPS}")
            raise ParseError(f"{t.where_interval(bad)}.op = {OPS[code].value!r} {problem}")
    n_groups = len(t.group_names) if t.group_names else (int(iv.group.max()) + 1 if m else 0)
    bad = _first(comm & ((iv.group < 0) | (iv.group >= n_groups)))
    if bad is not None:
        raise ParseError(f"{t.where_interval(bad)}.group = {int(iv.group[bad])} is not a known group code")
    bad = _first(comm & (iv.seq < 0))
    if bad is not None:
        raise ParseError(f"{t.where_interval(bad)}.seq = {int(iv.seq[bad])}: a comm interval needs seq >= 0")
    bad = _first(p2p & (iv.peer < 0))
    if bad is not None:
        raise ParseError(f"{t.where_interval(bad)}.peer = {int(iv.peer[bad])}: a p2p interval needs its peer rank")
    for name, label in (("size_bytes", "bytes"), ("seq", "seq"), ("peer", "peer")):
        col = getattr(iv, name)
        bad = _first(col < UNKNOWN)
        if bad is not None:
            raise ParseError(f"{t.where_interval(bad)}.{label} = {int(col[bad])} is below 0 (-1 means unknown)")
    bad = _first((iv.group_size == 0) | (iv.group_size < UNKNOWN))
    if bad is not None:
        raise ParseError(f"{t.where_interval(bad)}.group_size = {int(iv.group_size[bad])} must be >= 1")
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
            f"each (rank, step) must have exactly one record"
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
            f"the whole job (seq counts the group's collectives, it does not restart every step)"
        )
    op = iv.op[comm][order]
    bad = _first(same_inst & (op[1:] != op[:-1]))
    if bad is not None:
        a, b = pair(bad)
        raise ParseError(
            f"collective group {t.group_name(int(g[bad]))!r} seq {int(q[bad])}: {t.where_interval(a)} has op "
            f"{OPS[int(op[bad])].value!r} but {t.where_interval(b)} has {OPS[int(op[bad + 1])].value!r}; members of "
            f"one collective must agree"
        )
    ax = iv.axis[comm][order]
    bad = _first(same_group & (ax[1:] != ax[:-1]))
    if bad is not None:
        a, b = pair(bad)
        raise ParseError(
            f"group {t.group_name(int(g[bad]))!r} is on axis {AXES[int(ax[bad])].value} at {t.where_interval(a)} but "
            f"on axis {AXES[int(ax[bad + 1])].value} at {t.where_interval(b)}; a group belongs to one axis"
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
            f"{int(group_given[group_of[bad]])} elsewhere; a group has one size"
        )
    starts = np.flatnonzero(np.concatenate(([True], ~same_inst)))
    members = np.diff(np.append(starts, order.size))
    given = group_given[group_of[starts]]
    bad = _first((given > 0) & (members > given))
    if bad is not None:
        a = int(comm[order[starts[bad]]])
        raise ParseError(
            f"collective group {t.group_name(int(g[starts[bad]]))!r} seq {int(q[starts[bad]])} has "
            f"{int(members[bad])} members but group_size = {int(given[bad])} ({t.where_interval(a)})"
        )
    return comm[order]


# ====================================================================== JSON <-> objects


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _where_field(where: str, name: str) -> str:
    return f"{where}: {name}" if where else name


def _get(obj: dict[str, Any], key: str, where: str, *, required: bool = True) -> object:
    if key in obj:
        return obj[key]
    if required:
        raise ParseError(f"{where}: field {key!r} is missing; it is required ({SCHEMA}, see docs/records.md)")
    return None


def _int(obj: dict[str, Any], key: str, where: str, *, required: bool = True, minimum: int | None = None) -> int | None:
    value = _get(obj, key, where, required=required)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParseError(f"{_where_field(where, key)} = {value!r} ({_type_name(value)}); expected a whole number")
    if minimum is not None and value < minimum:
        raise ParseError(f"{_where_field(where, key)} = {value} is below {minimum}")
    return value


def _str(obj: dict[str, Any], key: str, where: str, *, required: bool = True) -> str | None:
    value = _get(obj, key, where, required=required)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise ParseError(f"{_where_field(where, key)} = {value!r} ({_type_name(value)}); expected a non-empty string")
    return value


def _number(obj: dict[str, Any], key: str, where: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ParseError(f"{_where_field(where, key)} = {value!r} ({_type_name(value)}); expected a finite number")
    return float(value)


def _choice(obj: dict[str, Any], key: str, where: str, allowed: dict[str, int], *, required: bool) -> str | None:
    value = _str(obj, key, where, required=required)
    if value is not None and value not in allowed:
        raise ParseError(f"{_where_field(where, key)} = {value!r} is not one of {list(allowed)}")
    return value


def _object(value: object, where: str, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ParseError(f"{where}: {what} = {str(value)[:60]!r} ({_type_name(value)}); expected a JSON object")
    return value


def _parse_interval(obj: object, where: str) -> Interval:
    d = _object(obj, where, "interval")
    kind = IntervalKind(_choice(d, "kind", where, KIND_CODE, required=True) or "")
    is_comm, is_p2p = kind is IntervalKind.COMM, kind is IntervalKind.P2P
    net = is_comm or is_p2p
    phase = _choice(d, "phase", where, PHASE_CODE, required=False) if kind is IntervalKind.COMPUTE else None
    axis = _choice(d, "axis", where, AXIS_CODE, required=True) if net else None
    op = _choice(d, "op", where, OP_CODE, required=True) if net else None
    start = _int(d, "start_us", where) or 0
    end = _int(d, "end_us", where) or 0
    group = _str(d, "group", where, required=is_comm) if net else None
    seq = _int(d, "seq", where, required=is_comm, minimum=0) if net else None
    size_bytes = _int(d, "bytes", where, required=False, minimum=0) if net else None
    group_size = _int(d, "group_size", where, required=False, minimum=1) if is_comm else None
    peer = _int(d, "peer", where, required=True, minimum=0) if is_p2p else None
    try:
        return Interval(
            kind=kind,
            start_us=start,
            end_us=end,
            phase=Phase(phase) if phase else None,
            axis=MeshAxis(axis) if axis else None,
            op=CommOp(op) if op else None,
            group=group,
            seq=seq,
            size_bytes=size_bytes,
            group_size=group_size,
            peer=peer,
        )
    except ParseError as exc:
        raise ParseError(f"{where}.{exc}") from None


def _parse_record(obj: object, where: str) -> StepRecord:
    """Check one decoded JSON line against the schema and build its :class:`StepRecord`.

    Raises:
        ParseError: naming ``where`` (file and line), the field, its value and what would fit.
    """
    d = _object(obj, where, "line")
    schema = _str(d, "schema", where)
    if schema != SCHEMA:
        raise ParseError(f"{where}: schema = {schema!r} is not supported; this reader reads {SCHEMA!r}")
    coord_obj = _object(_get(d, "coord", where), where, "coord")
    coord = {a.value: _int(coord_obj, a.value, f"{where}: coord", minimum=0) for a in AXES}
    raw_ivs = _get(d, "intervals", where)
    if not isinstance(raw_ivs, list):
        raise ParseError(f"{where}: intervals = {str(raw_ivs)[:60]!r} ({_type_name(raw_ivs)}); expected a list")
    intervals = tuple(_parse_interval(v, f"{where}: intervals[{i}]") for i, v in enumerate(raw_ivs))
    stats_obj = d.get("stats")
    stats = DataStats()
    if stats_obj is not None:
        so = _object(stats_obj, where, "stats")
        sw = f"{where}: stats"
        stats = DataStats(
            tokens=_int(so, "tokens", sw, required=False, minimum=0),
            sequences=_int(so, "sequences", sw, required=False, minimum=0),
            longest_sequence=_int(so, "longest_sequence", sw, required=False, minimum=0),
            attention_work=_number(so, "attention_work", sw),
            attention_us=_int(so, "attention_us", sw, required=False, minimum=0),
            peak_memory_bytes=_int(so, "peak_memory_bytes", sw, required=False, minimum=0),
        )
    job = _str(d, "job", where) or ""
    step = _int(d, "step", where, minimum=0) or 0
    rank = _int(d, "rank", where, minimum=0) or 0
    node = _str(d, "node", where) or ""
    start_us = _int(d, "start_us", where) or 0
    end_us = _int(d, "end_us", where) or 0
    nvlink_domain = _str(d, "nvlink_domain", where, required=False)
    network_tier = _str(d, "network_tier", where, required=False)
    gpu = _int(d, "gpu", where, required=False, minimum=0)
    gpu_util = _number(d, "gpu_util", where)
    try:
        return StepRecord(
            job=job,
            step=step,
            rank=rank,
            coord=RankCoord(**{k: v or 0 for k, v in coord.items()}),
            node=node,
            start_us=start_us,
            end_us=end_us,
            intervals=intervals,
            nvlink_domain=nvlink_domain,
            network_tier=network_tier,
            gpu=gpu,
            stats=stats,
            gpu_util=gpu_util,
        )
    except ParseError as exc:
        raise ParseError(f"{where}: {exc}") from None


def _interval_json(iv: Interval) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": iv.kind.value, "start_us": iv.start_us, "end_us": iv.end_us}
    for key, value in (
        ("phase", iv.phase),
        ("axis", iv.axis),
        ("op", iv.op),
        ("group", iv.group),
        ("seq", iv.seq),
        ("bytes", iv.size_bytes),
        ("group_size", iv.group_size),
        ("peer", iv.peer),
    ):
        if value is not None:
            out[key] = str(value) if isinstance(value, StrEnum) else value
    return out


def record_to_json(record: StepRecord) -> dict[str, Any]:
    """The JSON object of one record (optional fields left out when ``None``)."""
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "job": record.job,
        "step": record.step,
        "rank": record.rank,
        "coord": record.coord.as_dict(),
        "node": record.node,
    }
    optional = {"nvlink_domain": record.nvlink_domain, "network_tier": record.network_tier, "gpu": record.gpu}
    out.update({k: v for k, v in optional.items() if v is not None})
    out["start_us"] = record.start_us
    out["end_us"] = record.end_us
    out["intervals"] = [_interval_json(iv) for iv in record.intervals]
    stats = {
        k: getattr(record.stats, k)
        for k in ("tokens", "sequences", "longest_sequence", "attention_work", "attention_us", "peak_memory_bytes")
        if getattr(record.stats, k) is not None
    }
    if stats:
        out["stats"] = stats
    if record.gpu_util is not None:
        out["gpu_util"] = record.gpu_util
    return out


# ====================================================================== files


def _open(path: Path, mode: Literal["rb", "wb"]) -> BinaryIO | gzip.GzipFile:
    if path.name.endswith(".gz"):
        return gzip.open(path, mode)
    return path.open(mode)


def write_records(path: StrPath, records: Iterable[StepRecord] | RecordTable) -> int:
    """Write records as JSON lines (gzip-compressed when the name ends in ``.gz``).

    Args:
        path: file to (over)write.
        records: record objects, or a whole :class:`RecordTable` (converted row by row).

    Returns:
        Number of lines written.
    """
    objs = _table_json(records) if isinstance(records, RecordTable) else map(record_to_json, records)
    count = 0
    dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
    with _open(Path(path), "wb") as f:
        for obj in objs:
            f.write(dumps(obj).encode() + b"\n")
            count += 1
    return count


def _table_json(table: RecordTable, rows_per_chunk: int = 4096) -> Iterator[dict[str, Any]]:
    """JSON objects of every row straight from the columns (no per-interval objects), a chunk of rows at a time."""
    s, iv = table.steps, table.intervals
    order = np.argsort(iv.row, kind="stable")
    bounds = np.searchsorted(iv.row[order], np.arange(table.n_rows + 1), side="left")
    domains = table.nvlink_domain_names or tuple(f"nvl-{i}" for i in range(int(s.nvlink_domain.max(initial=-1)) + 1))
    tiers = table.network_tier_names or tuple(f"block-{i}" for i in range(int(s.network_tier.max(initial=-1)) + 1))
    groups = table.group_names or tuple(f"group-{i}" for i in range(int(iv.group.max(initial=-1)) + 1))
    for r0 in range(0, table.n_rows, rows_per_chunk):
        r1 = min(table.n_rows, r0 + rows_per_chunk)
        sel = order[bounds[r0] : bounds[r1]]
        cols = [
            getattr(iv, name)[sel].tolist()
            for name in ("kind", "start_us", "end_us", "phase", "axis", "op", "group", "seq", "size_bytes")
        ]
        group_size, peer = iv.group_size[sel].tolist(), iv.peer[sel].tolist()
        for i in range(r0, r1):
            lo, hi = int(bounds[i] - bounds[r0]), int(bounds[i + 1] - bounds[r0])
            intervals = [_interval_obj(j, cols, group_size, peer, groups) for j in range(lo, hi)]
            yield _row_json(table, i, intervals, domains, tiers)


def _interval_obj(
    j: int, cols: list[list[int]], group_size: list[int], peer: list[int], groups: tuple[str, ...]
) -> dict[str, Any]:
    k, start, end, ph, ax, op, g, sq, nb = (c[j] for c in cols)
    out: dict[str, Any] = {"kind": KINDS[k].value, "start_us": start, "end_us": end}
    if ph >= 0:
        out["phase"] = PHASES[ph].value
    if k in {COMM_CODE, P2P_CODE}:
        out["axis"], out["op"] = AXES[ax].value, OPS[op].value
        optional = {"group": groups[g] if g >= 0 else None, "seq": sq, "bytes": nb, "peer": peer[j]}
        out.update({key: v for key, v in optional.items() if v is not None and v != UNKNOWN})
        if group_size[j] > 0:
            out["group_size"] = group_size[j]
    return out


def _row_json(
    table: RecordTable, i: int, intervals: list[dict[str, Any]], domains: tuple[str, ...], tiers: tuple[str, ...]
) -> dict[str, Any]:
    s = table.steps
    obj: dict[str, Any] = {
        "schema": SCHEMA,
        "job": table.job,
        "step": int(s.step[i]),
        "rank": int(s.rank[i]),
        "coord": {a.value: int(s.coord[i, k]) for k, a in enumerate(AXES)},
        "node": table.node_name(int(s.node[i])),
    }
    dom, tier, gpu = int(s.nvlink_domain[i]), int(s.network_tier[i]), int(s.gpu[i])
    if dom >= 0:
        obj["nvlink_domain"] = domains[dom]
    if tier >= 0:
        obj["network_tier"] = tiers[tier]
    if gpu >= 0:
        obj["gpu"] = gpu
    obj["start_us"], obj["end_us"], obj["intervals"] = int(s.start_us[i]), int(s.end_us[i]), intervals
    stats: dict[str, Any] = {}
    for key, col in (
        ("tokens", s.tokens),
        ("sequences", s.sequences),
        ("longest_sequence", s.longest_sequence),
        ("attention_work", s.attention_work),
        ("attention_us", s.attention_us),
        ("peak_memory_bytes", s.peak_memory_bytes),
    ):
        value = col[i]
        if col.dtype.kind == "f":
            if not np.isnan(value):
                stats[key] = float(value)
        elif value >= 0:
            stats[key] = int(value)
    if stats:
        obj["stats"] = stats
    if not np.isnan(s.gpu_util[i]):
        obj["gpu_util"] = float(s.gpu_util[i])
    return obj


def _as_paths(paths: StrPath | Sequence[StrPath]) -> list[Path]:
    if isinstance(paths, str | PathLike):
        return [Path(paths)]
    return [Path(p) for p in paths]


class _TruncatedError(Exception):
    """Internal: the last line of a file does not parse."""


def _lines(path: Path, span: tuple[int, int] | None = None) -> Iterator[tuple[int, bytes]]:
    """Yield (line number, raw line); a compressed stream that ends early ends the iteration with _TruncatedError.

    ``span`` (plain files only) reads the lines starting in byte range [start, end), numbered from 1 (a worker's
    chunk; ``start`` must be a line start). Gzip is decompressed block by block (not through ``gzip.open``, whose
    buffered reads lose the lines decoded just before a truncation), so ``allow_partial`` keeps every complete line.
    """
    if not path.name.endswith(".gz"):
        yield from _plain_lines(path, span)
        return
    lineno = 0
    rest = b""
    with path.open("rb") as f:
        inflate = zlib.decompressobj(wbits=31)
        try:
            while chunk := f.read(1 << 20):
                data = inflate.decompress(chunk)
                while inflate.eof and inflate.unused_data:  # concatenated gzip members
                    tail = inflate.unused_data
                    inflate = zlib.decompressobj(wbits=31)
                    data += inflate.decompress(tail)
                lines = (rest + data).split(b"\n")
                rest = lines.pop()
                for raw in lines:
                    lineno += 1
                    yield lineno, raw
        except zlib.error as exc:
            raise _TruncatedError(f"{path} line {lineno + 1}: compressed stream is corrupt ({exc})") from None
    if not inflate.eof:
        raise _TruncatedError(f"{path} line {lineno + 1}: compressed stream ends early")
    if rest:
        yield lineno + 1, rest


def _plain_lines(path: Path, span: tuple[int, int] | None) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as f:
        if span is None:
            yield from enumerate(f, 1)
            return
        f.seek(span[0])
        left = span[1] - span[0]
        for lineno, raw in enumerate(f, 1):
            yield lineno, raw
            left -= len(raw)
            if left <= 0:
                return


_BATCH_LINES = 256
"""Lines decoded per ``json.loads`` call: json memoises object keys within one call, so a batch decoded as one
array is ~25% faster than line by line."""


def _decoded(
    path: Path,
    allow_partial: bool,  # noqa: FBT001
    notes: list[Note],
    *,
    span: tuple[int, int] | None = None,
    last: bool = True,
    counted: list[int] | None = None,
) -> Iterator[tuple[int, Any]]:
    """Decoded JSON lines (blank lines skipped).

    A bad final line of a file (``last``: this span ends the file) is "truncated": skipped and noted under
    ``allow_partial``, else an error; a bad line anywhere else is an error naming it. ``counted`` receives the
    number of physical lines read.
    """
    held: list[tuple[int, bytes]] = []  # a full batch waits until we know whether more lines follow
    batch: list[tuple[int, bytes]] = []
    lineno = 0
    try:
        for lineno, raw in _lines(path, span):
            if not raw.strip():
                continue
            if held:
                yield from _decode_batch(path, held, final=False, allow_partial=allow_partial, notes=notes)
                held = []
            batch.append((lineno, raw))
            if len(batch) == _BATCH_LINES:
                held, batch = batch, []
    except _TruncatedError as exc:
        yield from _decode_batch(path, held + batch, final=False, allow_partial=allow_partial, notes=notes)
        if not allow_partial:
            raise ParseError(f"{exc}; pass allow_partial=True to keep the lines before it") from None
        notes.append(Note(code="truncated_file", count=1, message=f"{exc}; lines before it kept"))
        return
    if counted is not None:
        counted.append(lineno)
    yield from _decode_batch(path, held + batch, final=last, allow_partial=allow_partial, notes=notes)


def _decode_batch(
    path: Path, batch: list[tuple[int, bytes]], *, final: bool, allow_partial: bool, notes: list[Note]
) -> Iterator[tuple[int, Any]]:
    if not batch:
        return
    objs = None
    # Each line must be one object; joined, the batch is then an array of exactly as many objects.
    if all(raw.lstrip().startswith(b"{") and raw.rstrip().endswith(b"}") for _, raw in batch):
        try:
            objs = json.loads(b"[" + b",".join(raw for _, raw in batch) + b"]")
        except ValueError:
            objs = None  # some line is bad: find it below, line by line
    if objs is not None and len(objs) == len(batch):
        yield from zip((n for n, _ in batch), objs, strict=True)
        return
    for i, (lineno, raw) in enumerate(batch):
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            if not (final and i == len(batch) - 1):
                raise ParseError(
                    f"{path} line {lineno}: not valid JSON ({exc}): {raw[:80]!r}; every line must be one JSON object"
                ) from None
            if not allow_partial:
                raise ParseError(
                    f"{path} line {lineno}: the last line is truncated or corrupt ({exc}): {raw[:80]!r}; pass "
                    f"allow_partial=True to skip it"
                ) from None
            notes.append(
                Note(
                    code="truncated_line", count=1, message=f"{path} line {lineno}: truncated last line skipped ({exc})"
                )
            )
            return
        yield lineno, obj


def read_records(paths: StrPath | Sequence[StrPath], *, allow_partial: bool = False) -> RecordSet:
    """Read and validate record objects from JSON-lines files (``.gz`` is decompressed).

    For large inputs use :func:`read_table`, which builds columns without per-interval objects.

    Args:
        paths: one file or several (e.g. one per rank); all must belong to the same job.
        allow_partial: skip a truncated or corrupt **last** line of a file (a writer killed mid-line) and say so in
            the returned notes, instead of raising. Corrupt lines elsewhere are always errors.

    Returns:
        The records, the job name and notes on skipped lines.

    Raises:
        ParseError: naming file, line, field, value and what would fit: bad JSON, schema violations, mismatched jobs
            (both names), duplicate (rank, step) (both lines).
    """
    notes: list[Note] = []
    records: list[StepRecord] = []
    job: tuple[str, str] | None = None
    seen: dict[tuple[int, int], str] = {}
    for path in _as_paths(paths):
        for lineno, obj in _decoded(path, allow_partial, notes):
            where = f"{path} line {lineno}"
            rec = _parse_record(obj, where)
            if job is None:
                job = (rec.job, where)
            elif rec.job != job[0]:
                raise ParseError(_job_mismatch(rec.job, where, job[0], job[1]))
            key = (rec.rank, rec.step)
            if key in seen:
                raise ParseError(
                    f"rank {rec.rank} step {rec.step} appears twice: {seen[key]} and {where}; each (rank, step) must "
                    f"have exactly one record"
                )
            seen[key] = where
            records.append(rec)
    return RecordSet(job=job[0] if job else "", records=tuple(records), notes=tuple(notes))


def _job_mismatch(job: str, where: str, first_job: str, first_where: str) -> str:
    return (
        f"{where}: job {job!r} does not match job {first_job!r} of {first_where}; records of one analysis must come "
        f"from one job"
    )


def read_table(paths: StrPath | Sequence[StrPath], *, allow_partial: bool = False, workers: int = 1) -> RecordTable:
    """Read JSON-lines step records straight into a :class:`RecordTable` (the fast path for big inputs).

    Lines are decoded with the standard ``json`` module a batch at a time and their values appended to typed arrays;
    range and consistency checks run vectorised over the finished columns, and any line the fast path cannot take
    is re-read by the object parser, which raises the precise error. Same rules and errors as :func:`read_records`,
    plus the cross-record checks of :class:`RecordTable`. (One leniency of the fast path: JSON ``true``/``false`` in
    an integer field reads as 1/0.)

    Args:
        paths: one file or several; all must belong to the same job.
        allow_partial: skip a truncated or corrupt last line of a file, noted in ``RecordTable.notes``.
        workers: processes to decode with. Above 1, inputs of 64 MiB or more are split into byte ranges (plain
            files) or whole files (gzip) and decoded by worker processes (``forkserver``/``spawn``: the calling
            script must guard its top level with ``if __name__ == "__main__":``). If a worker meets bad input, the
            input is read again in this process so that the error names the right line.

    Returns:
        The validated table.

    Raises:
        ParseError: as :func:`read_records` and :class:`RecordTable`; also for ``workers < 1``.
    """
    files = _as_paths(paths)
    if workers < 1:
        raise ParseError(f"workers = {workers}; it must be >= 1")
    if workers > 1 and sum(p.stat().st_size for p in files) >= _PARALLEL_MIN_BYTES:
        table = _read_parallel(files, allow_partial=allow_partial, workers=workers)
        if table is not None:
            return table
    builder = _TableBuilder()
    notes: list[Note] = []
    for file_index, path in enumerate(files):
        builder.read_file(path, file_index, allow_partial, notes)
    return builder.build(notes=tuple(notes), source_files=tuple(str(p) for p in files))


_PARALLEL_MIN_BYTES = 64 << 20
"""Inputs smaller than this are decoded in this process: starting workers would cost more than it saves."""
_CHUNK_MIN_BYTES = 16 << 20
"""Smallest byte range given to one worker."""


def _chunk_plan(files: list[Path], workers: int) -> list[tuple[str, int, tuple[int, int] | None, bool]]:
    """(path, file index, byte span or None for the whole file, whether the span ends the file) per work item."""
    total = sum(p.stat().st_size for p in files)
    target = max(_CHUNK_MIN_BYTES, total // (4 * workers) + 1)  # ~4 items per worker balances uneven lines
    plan: list[tuple[str, int, tuple[int, int] | None, bool]] = []
    for index, path in enumerate(files):
        size = path.stat().st_size
        if path.name.endswith(".gz") or size <= target:
            plan.append((str(path), index, None, True))
            continue
        starts = [0]
        with path.open("rb") as f:
            while starts[-1] + target < size:
                f.seek(starts[-1] + target)
                f.readline()  # move to the next line start
                if f.tell() >= size:
                    break
                starts.append(f.tell())
        ends = [*starts[1:], size]
        plan.extend((str(path), index, (a, b), b == size) for a, b in zip(starts, ends, strict=True))
    return plan


def _read_chunk(
    path: str,
    file_index: int,
    span: tuple[int, int] | None,
    last: bool,  # noqa: FBT001
    allow_partial: bool,  # noqa: FBT001
) -> tuple[_Raw, list[Note]]:
    """Worker: decode one work item into raw columns (line numbers relative to the item)."""
    builder = _TableBuilder()
    notes: list[Note] = []
    lines = builder.read_file(Path(path), file_index, allow_partial, notes, span=span, last=last)
    return builder.raw(lines=lines), notes


def _read_parallel(files: list[Path], *, allow_partial: bool, workers: int) -> RecordTable | None:
    """Decode the work items in worker processes and merge them; ``None`` means "read again in this process"."""
    plan = _chunk_plan(files, workers)
    if len(plan) < 2:
        return None
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    try:
        with ProcessPoolExecutor(max_workers=min(workers, len(plan)), mp_context=context) as pool:
            results = list(pool.map(_read_chunk, *zip(*[(*item, allow_partial) for item in plan], strict=True)))
    except Exception:  # noqa: BLE001 - any failure: the caller reads in-process, which raises the precise error
        return None
    raws = [raw for raw, _ in results]
    if any(notes for _, notes in results) or len({raw.job for raw in raws if raw.job is not None}) > 1:
        return None  # notes and job mismatches would name item-relative lines
    merged = _merge(raws, [item[1] for item in plan])
    return _table_of(
        merged,
        notes=(),
        source_files=tuple(str(p) for p in files),
        paths=dict(enumerate(files)),
    )


def _merge(raws: list[_Raw], file_of: list[int]) -> _Raw:
    """Concatenate work items: renumber name codes, interval indices and (per file) line numbers."""
    tables: dict[str, dict[str, int]] = {"nodes": {}, "domains": {}, "tiers": {}, "groups": {}}

    def recode(kind: str, names: tuple[str, ...], codes: NDArray[Any]) -> NDArray[Any]:
        known = tables[kind]
        lut = np.array([known.setdefault(name, len(known)) for name in names] + [UNKNOWN], dtype=codes.dtype)
        out: NDArray[Any] = lut[codes]  # code -1 picks the trailing UNKNOWN
        return out

    rows: dict[str, list[NDArray[Any]]] = {k: [] for k in raws[0].rows}
    intervals: dict[str, list[NDArray[Any]]] = {k: [] for k in raws[0].intervals}
    phases: dict[str, list[NDArray[Any]]] = {k: [] for k in raws[0].phases}
    nets: dict[str, list[NDArray[Any]]] = {k: [] for k in raws[0].nets}
    line_offset: dict[int, int] = {}
    interval_offset = 0
    for raw, file_index in zip(raws, file_of, strict=True):
        renamed = {
            "node": recode("nodes", raw.nodes, raw.rows["node"]),
            "nvlink_domain": recode("domains", raw.domains, raw.rows["nvlink_domain"]),
            "network_tier": recode("tiers", raw.tiers, raw.rows["network_tier"]),
            "source_line": raw.rows["source_line"] + line_offset.get(file_index, 0),
        }
        for k, v in raw.rows.items():
            rows[k].append(renamed.get(k, v))
        line_offset[file_index] = line_offset.get(file_index, 0) + raw.lines
        for k, v in raw.intervals.items():
            intervals[k].append(v)
        for k, v in raw.phases.items():
            phases[k].append(v + interval_offset if k == "index" else v)
        groups = recode("groups", raw.groups, raw.nets["group"])
        for k, v in raw.nets.items():
            nets[k].append(v + interval_offset if k == "index" else groups if k == "group" else v)
        interval_offset += raw.intervals["kind"].shape[0]
    job = next((raw for raw in raws if raw.job is not None), raws[0])
    return _Raw(
        job=job.job,
        job_where=job.job_where,
        rows={k: np.concatenate(v) for k, v in rows.items()},
        intervals={k: np.concatenate(v) for k, v in intervals.items()},
        phases={k: np.concatenate(v) for k, v in phases.items()},
        nets={k: np.concatenate(v) for k, v in nets.items()},
        nodes=tuple(tables["nodes"]),
        domains=tuple(tables["domains"]),
        tiers=tuple(tables["tiers"]),
        groups=tuple(tables["groups"]),
    )


_ABSENT = -(2**62)
"""Stands for a left-out optional integer in the fast reader's columns until :meth:`_TableBuilder.build` checks them.
(A file that spells this very number reads it as left out.)"""


class _SlowPathError(Exception):
    """Internal: the fast reader cannot take this line; the object parser decides."""


class _TableBuilder:
    """Typed append-only columns shared by :func:`read_table` and :meth:`RecordTable.from_records`."""

    def __init__(self) -> None:
        self.job: str | None = None
        self.job_where = ""
        self.path = ""
        self.paths: dict[int, Path] = {}
        self.nodes: dict[str, int] = {}
        self.domains: dict[str, int] = {}
        self.tiers: dict[str, int] = {}
        self.groups: dict[str, int] = {}
        q, i, d, b = "q", "i", "d", "b"
        # rank-steps
        self.rank, self.step, self.start, self.end = array(q), array(q), array(q), array(q)
        self.coord = [array(q) for _ in AXES]
        self.node, self.domain, self.tier, self.gpu = array(i), array(i), array(i), array(i)
        self.gpu_util: array[float] = array(d)
        self.tokens, self.sequences, self.longest = array(q), array(q), array(q)
        self.attn_work: array[float] = array(d)
        self.attn_us, self.peak_mem = array(q), array(q)
        self.file, self.line, self.n_iv = array(i), array(q), array(q)
        self.row_arrays: list[array[Any]] = [
            self.rank,
            self.step,
            self.start,
            self.end,
            *self.coord,
            self.node,
            self.domain,
            self.tier,
            self.gpu,
            self.gpu_util,
            self.tokens,
            self.sequences,
            self.longest,
            self.attn_work,
            self.attn_us,
            self.peak_mem,
            self.file,
            self.line,
            self.n_iv,
        ]
        # intervals; compute phase and comm/p2p fields are kept sparse (index + value) and spread at build()
        self.kind, self.iv_start, self.iv_end = array(b), array(q), array(q)
        self.ph_idx, self.ph_val = array(q), array(b)
        self.net_idx, self.axis, self.op, self.group = array(q), array(b), array(b), array(i)
        self.seq, self.nbytes, self.gsize, self.peer = array(q), array(q), array(q), array(q)
        self.iv_arrays: list[array[Any]] = [self.kind, self.iv_start, self.iv_end]
        self.ph_arrays: list[array[Any]] = [self.ph_idx, self.ph_val]
        self.net_arrays: list[array[Any]] = [
            self.net_idx,
            self.axis,
            self.op,
            self.group,
            self.seq,
            self.nbytes,
            self.gsize,
            self.peer,
        ]

    # ---------------------------------------------------------------- helpers

    def _check_job(self, job: str, where: str) -> None:
        if self.job is None:
            self.job, self.job_where = job, where
        elif job != self.job:
            raise ParseError(_job_mismatch(job, where, self.job, self.job_where))

    @staticmethod
    def _code(table: dict[str, int], name: str) -> int:
        code = table.get(name)
        if code is None:
            code = table[name] = len(table)
        return code

    def _marks(self) -> tuple[int, int, int, int]:
        return len(self.rank), len(self.kind), len(self.ph_idx), len(self.net_idx)

    def _rollback(self, marks: tuple[int, int, int, int]) -> None:
        for arrays, mark in zip((self.row_arrays, self.iv_arrays, self.ph_arrays, self.net_arrays), marks, strict=True):
            for arr in arrays:
                del arr[mark:]

    # ---------------------------------------------------------------- record objects

    def add_record(self, rec: StepRecord, file_index: int, line: int) -> None:
        """Append one validated record."""
        self._check_job(rec.job, f"record {line}" if file_index < 0 else f"{self.path} line {line}")
        self.rank.append(rec.rank)
        self.step.append(rec.step)
        self.start.append(rec.start_us)
        self.end.append(rec.end_us)
        for k, a in enumerate(AXES):
            self.coord[k].append(rec.coord[a])
        self.node.append(self._code(self.nodes, rec.node))
        self.domain.append(UNKNOWN if rec.nvlink_domain is None else self._code(self.domains, rec.nvlink_domain))
        self.tier.append(UNKNOWN if rec.network_tier is None else self._code(self.tiers, rec.network_tier))
        self.gpu.append(UNKNOWN if rec.gpu is None else rec.gpu)
        self.gpu_util.append(math.nan if rec.gpu_util is None else rec.gpu_util)
        st = rec.stats
        for arr, v in (
            (self.tokens, st.tokens),
            (self.sequences, st.sequences),
            (self.longest, st.longest_sequence),
            (self.attn_us, st.attention_us),
            (self.peak_mem, st.peak_memory_bytes),
        ):
            arr.append(UNKNOWN if v is None else v)
        self.attn_work.append(math.nan if st.attention_work is None else st.attention_work)
        self.file.append(file_index)
        self.line.append(line if file_index >= 0 else UNKNOWN)
        self.n_iv.append(len(rec.intervals))
        for iv in rec.intervals:
            n = len(self.kind)
            self.kind.append(KIND_CODE[iv.kind])
            self.iv_start.append(iv.start_us)
            self.iv_end.append(iv.end_us)
            if iv.phase is not None:
                self.ph_idx.append(n)
                self.ph_val.append(PHASE_CODE[iv.phase])
            if iv.kind in (IntervalKind.COMM, IntervalKind.P2P):
                self.net_idx.append(n)
                self.axis.append(AXIS_CODE[str(iv.axis)])
                self.op.append(OP_CODE[str(iv.op)])
                self.group.append(UNKNOWN if iv.group is None else self._code(self.groups, iv.group))
                self.seq.append(_ABSENT if iv.seq is None else iv.seq)
                self.nbytes.append(_ABSENT if iv.size_bytes is None else iv.size_bytes)
                self.gsize.append(_ABSENT if iv.group_size is None else iv.group_size)
                self.peer.append(_ABSENT if iv.peer is None else iv.peer)

    # ---------------------------------------------------------------- the fast path

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

        Lines the fast path cannot take go through the object parser.

        Returns:
            The number of physical lines read.
        """
        fast = self._add_fast
        self.path = str(path)
        self.paths[file_index] = path
        counted: list[int] = []
        for lineno, obj in _decoded(path, allow_partial, notes, span=span, last=last, counted=counted):
            marks = self._marks()
            try:
                fast(obj, file_index, lineno)
            except (_SlowPathError, KeyError, TypeError, ValueError, OverflowError, AttributeError):
                self._rollback(marks)
                where = f"{path} line {lineno}"
                rec = _parse_record(obj, where)  # raises the precise error in practice
                self._check_job(rec.job, where)
                self.add_record(rec, file_index, lineno)
        return counted[0] if counted else 0

    def _add_fast(self, d: dict[str, Any], file_index: int, lineno: int) -> None:  # noqa: C901, PLR0912, PLR0915 - the hot loop, unrolled on purpose
        """Append one decoded line with as little per-value work as possible; anything unusual -> slow path.

        Values the vectorised checks cannot tell apart from "absent" (negative optional integers) are sent to the
        slow path here, so that they raise instead of reading as unknown.
        """
        if d["schema"] != SCHEMA:
            raise _SlowPathError
        job = d["job"]
        if job != self.job:
            if self.job is not None or type(job) is not str or not job:
                raise _SlowPathError
            self.job, self.job_where = job, f"{self.path} line {lineno}"
        ivs = d["intervals"]
        c = d["coord"]
        node = d["node"]
        if type(ivs) is not list or type(c) is not dict or type(node) is not str or not node:
            raise _SlowPathError
        self.rank.append(d["rank"])
        self.step.append(d["step"])
        self.start.append(d["start_us"])
        self.end.append(d["end_us"])
        cd = self.coord
        cd[0].append(c["dp"])
        cd[1].append(c["tp"])
        cd[2].append(c["pp"])
        cd[3].append(c["cp"])
        cd[4].append(c["ep"])
        code = self.nodes.get(node)
        self.node.append(self._code(self.nodes, node) if code is None else code)
        for key, arr, names in (
            ("nvlink_domain", self.domain, self.domains),
            ("network_tier", self.tier, self.tiers),
        ):
            label = d.get(key)
            if label is None:
                arr.append(UNKNOWN)
            elif type(label) is not str or not label:
                raise _SlowPathError
            else:
                arr.append(self._code(names, label))
        v = d.get("gpu")
        if v is None:
            self.gpu.append(UNKNOWN)
        elif v < 0:
            raise _SlowPathError
        else:
            self.gpu.append(v)
        v = d.get("gpu_util")
        self.gpu_util.append(math.nan if v is None else v)
        st = d.get("stats")
        if st is None:
            for arr in (self.tokens, self.sequences, self.longest, self.attn_us, self.peak_mem):
                arr.append(UNKNOWN)
            self.attn_work.append(math.nan)
        else:
            if type(st) is not dict:
                raise _SlowPathError
            for key, arr in (
                ("tokens", self.tokens),
                ("sequences", self.sequences),
                ("longest_sequence", self.longest),
                ("attention_us", self.attn_us),
                ("peak_memory_bytes", self.peak_mem),
            ):
                v = st.get(key)
                if v is None:
                    arr.append(UNKNOWN)
                elif v < 0:
                    raise _SlowPathError
                else:
                    arr.append(v)
            v = st.get("attention_work")
            if v is not None and not math.isfinite(v):
                raise _SlowPathError
            self.attn_work.append(math.nan if v is None else v)
        self.file.append(file_index)
        self.line.append(lineno)
        self.n_iv.append(len(ivs))
        self._add_intervals_fast(ivs)

    def _add_intervals_fast(self, ivs: list[Any]) -> None:
        """Append one line's intervals in a plain loop with every method bound once.

        (Measured faster than ``map``/``array.extend`` pipelines.) Optional integers read as :data:`_ABSENT` when
        left out; :meth:`build` checks them all at once, and re-reads a line whose values do not fit to raise the
        object parser's precise error.
        """
        kind_code, phase_code, axis_code, op_code, groups = KIND_CODE, PHASE_CODE, AXIS_CODE, OP_CODE, self.groups
        k_app, s_app, e_app = self.kind.append, self.iv_start.append, self.iv_end.append
        ph_idx, ph_val = self.ph_idx.append, self.ph_val.append
        net_idx, axis_app, op_app, group_app = self.net_idx.append, self.axis.append, self.op.append, self.group.append
        seq_app, bytes_app, gsize_app, peer_app = (
            self.seq.append,
            self.nbytes.append,
            self.gsize.append,
            self.peer.append,
        )
        absent = _ABSENT
        n = len(self.kind)
        for iv in ivs:
            k = kind_code[iv["kind"]]
            k_app(k)
            s_app(iv["start_us"])
            e_app(iv["end_us"])
            if k >= COMM_CODE:
                get = iv.get
                net_idx(n)
                axis_app(axis_code[iv["axis"]])
                op_app(op_code[iv["op"]])
                g = get("group")
                code = UNKNOWN if g is None else groups.get(g)
                group_app(self._group_code(g) if code is None else code)
                seq_app(get("seq", absent))
                bytes_app(get("bytes", absent))
                gsize_app(get("group_size", absent))
                peer_app(get("peer", absent))
            elif k == COMPUTE_CODE:
                ph = iv.get("phase")
                if ph is not None:
                    ph_idx(n)
                    ph_val(phase_code[ph])
            n += 1

    def _group_code(self, name: object) -> int:
        if name is None:
            return UNKNOWN
        if type(name) is not str or not name:
            raise _SlowPathError
        return self._code(self.groups, name)

    # ---------------------------------------------------------------- finish

    def raw(self, *, lines: int = 0) -> _Raw:
        """The columns as numpy arrays (views of the typed arrays), with the name tables."""

        def np_of(arr: array[Any], dtype: type[np.generic]) -> NDArray[Any]:
            return np.frombuffer(arr, dtype=dtype) if len(arr) else np.zeros(0, dtype=dtype)

        i64, i32, i8, f64 = np.int64, np.int32, np.int8, np.float64
        row_cols = {
            "rank": np_of(self.rank, i64),
            "step": np_of(self.step, i64),
            "start_us": np_of(self.start, i64),
            "end_us": np_of(self.end, i64),
            **{f"coord_{a.value}": np_of(c, i64) for a, c in zip(AXES, self.coord, strict=True)},
            "node": np_of(self.node, i32),
            "nvlink_domain": np_of(self.domain, i32),
            "network_tier": np_of(self.tier, i32),
            "gpu": np_of(self.gpu, i32),
            "gpu_util": np_of(self.gpu_util, f64),
            "tokens": np_of(self.tokens, i64),
            "sequences": np_of(self.sequences, i64),
            "longest_sequence": np_of(self.longest, i64),
            "attention_work": np_of(self.attn_work, f64),
            "attention_us": np_of(self.attn_us, i64),
            "peak_memory_bytes": np_of(self.peak_mem, i64),
            "source_file": np_of(self.file, i32),
            "source_line": np_of(self.line, i64),
            "n_intervals": np_of(self.n_iv, i64),
        }
        interval_cols = {
            "kind": np_of(self.kind, i8),
            "start_us": np_of(self.iv_start, i64),
            "end_us": np_of(self.iv_end, i64),
        }
        phase_cols = {"index": np_of(self.ph_idx, i64), "phase": np_of(self.ph_val, i8)}
        net_cols = {
            "index": np_of(self.net_idx, i64),
            "axis": np_of(self.axis, i8),
            "op": np_of(self.op, i8),
            "group": np_of(self.group, i32),
            "seq": np_of(self.seq, i64),
            "size_bytes": np_of(self.nbytes, i64),
            "group_size": np_of(self.gsize, i64),
            "peer": np_of(self.peer, i64),
        }
        return _Raw(
            job=self.job,
            job_where=self.job_where,
            rows=row_cols,
            intervals=interval_cols,
            phases=phase_cols,
            nets=net_cols,
            nodes=tuple(self.nodes),
            domains=tuple(self.domains),
            tiers=tuple(self.tiers),
            groups=tuple(self.groups),
            lines=lines,
        )

    def build(self, *, notes: tuple[Note, ...], source_files: tuple[str, ...]) -> RecordTable:
        """Turn the arrays into a validated :class:`RecordTable`."""
        return _table_of(self.raw(), notes=notes, source_files=source_files, paths=self.paths)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Raw:
    """A reader's columns before checks: what a worker process hands back (picklable)."""

    job: str | None
    job_where: str
    rows: dict[str, NDArray[Any]]
    intervals: dict[str, NDArray[Any]]
    phases: dict[str, NDArray[Any]]
    """Sparse: ``index`` (into the intervals) and ``phase`` of compute intervals that name one."""
    nets: dict[str, NDArray[Any]]
    """Sparse: ``index`` and the comm/p2p fields of comm and p2p intervals."""
    nodes: tuple[str, ...]
    domains: tuple[str, ...]
    tiers: tuple[str, ...]
    groups: tuple[str, ...]
    lines: int = 0
    """Physical lines read (a worker's chunk), to number the next chunk's lines."""


def _checked_net_columns(
    raw: _Raw, row: NDArray[np.int32], paths: dict[int, Path]
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """Check the comm/p2p integers the fast path stored unchecked; turn :data:`_ABSENT` into -1.

    A bad value (negative, missing where required) is reported by re-reading its line with the object parser, so
    both readers raise the same message.
    """
    nets = raw.nets
    seq, size, group_size, peer, group = (nets[k] for k in ("seq", "size_bytes", "group_size", "peer", "group"))
    comm = raw.intervals["kind"][nets["index"]] == COMM_CODE
    bad = ((seq < 0) & (seq != _ABSENT)) | ((size < 0) & (size != _ABSENT))
    bad |= comm & (((group_size < 1) & (group_size != _ABSENT)) | (group_size > np.iinfo(np.int32).max))
    bad |= ~comm & (peer < 0)
    bad |= comm & ((group < 0) | (seq == _ABSENT))
    hit = _first(bad)
    if hit is not None:
        r = int(row[nets["index"][hit]])
        _reraise(paths, int(raw.rows["source_file"][r]), int(raw.rows["source_line"][r]))
    return (
        np.where(seq == _ABSENT, UNKNOWN, seq),
        np.where(size == _ABSENT, UNKNOWN, size),
        np.where(comm & (group_size != _ABSENT), group_size, UNKNOWN),
        np.where(comm, UNKNOWN, peer),
    )


def _reraise(paths: dict[int, Path], file_index: int, lineno: int) -> None:
    """Raise the object parser's error for one line."""
    if file_index not in paths:  # pragma: no cover - rows from record objects were checked when they were built
        raise ParseError(f"record {lineno}: a comm or p2p interval has a value out of range")
    path = paths[file_index]
    where = f"{path} line {lineno}"
    for n, raw in _lines(path):
        if n == lineno:
            _parse_record(json.loads(raw), where)
            break
    raise ParseError(f"{where}: a comm or p2p interval has a value out of range")  # pragma: no cover


def _table_of(
    raw: _Raw, *, notes: tuple[Note, ...], source_files: tuple[str, ...], paths: dict[int, Path]
) -> RecordTable:
    """Spread the sparse columns, check what the fast path left unchecked, and build the validated table."""
    r = raw.rows
    n_rows = r["rank"].shape[0]
    steps = StepColumns.build(
        coord=np.stack([r[f"coord_{a.value}"] for a in AXES], axis=1)
        if n_rows
        else np.zeros((0, len(AXES)), dtype=np.int64),
        **{k: v for k, v in r.items() if not k.startswith("coord_") and k != "n_intervals"},
    )
    m = raw.intervals["kind"].shape[0]
    row = np.repeat(np.arange(n_rows, dtype=np.int32), r["n_intervals"])

    def spread(idx: NDArray[np.int64], values: NDArray[Any], dtype: type[np.generic]) -> NDArray[Any]:
        out = np.full(m, UNKNOWN, dtype=dtype)
        out[idx] = values
        return out

    seq, size, group_size, peer = _checked_net_columns(raw, row, paths)
    net = raw.nets["index"]
    intervals = IntervalColumns.build(
        row=row,
        kind=raw.intervals["kind"],
        start_us=raw.intervals["start_us"],
        end_us=raw.intervals["end_us"],
        phase=spread(raw.phases["index"], raw.phases["phase"], np.int8),
        axis=spread(net, raw.nets["axis"], np.int8),
        op=spread(net, raw.nets["op"], np.int8),
        group=spread(net, raw.nets["group"], np.int32),
        seq=spread(net, seq, np.int64),
        size_bytes=spread(net, size, np.int64),
        group_size=spread(net, group_size, np.int32),
        peer=spread(net, peer, np.int64),
    )
    return RecordTable(
        job=raw.job or "",
        steps=steps,
        intervals=intervals,
        node_names=raw.nodes,
        nvlink_domain_names=raw.domains,
        network_tier_names=raw.tiers,
        group_names=raw.groups,
        source_files=source_files,
        notes=notes,
    )

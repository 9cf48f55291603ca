"""The step-record schema (``meshscope.step/1``): its closed sets, their integer codes and the record objects.

Every producer (SDK, simulator, sidecar) and every consumer agrees on what is defined here: the interval kinds,
phases and operations with the codes the columnar form stores, and the frozen record objects (:class:`StepRecord`,
:class:`Interval`, :class:`DataStats`, :class:`Note`) that check their own fields on construction. The on-disk form
is in ``docs/records.md``. This module must not read or write files (:mod:`meshscope.records.reading`,
:mod:`meshscope.records.writing`), must not hold columns (:mod:`meshscope.records.tables`) and must not depend on
anything beyond the standard library and :mod:`meshscope.topology.layout`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Final

from meshscope.errors import ParseCode, ParseError
from meshscope.topology import AXES, MeshAxis, RankCoord

if TYPE_CHECKING:
    from collections.abc import Iterator

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
"""Axis codes are indices into :data:`meshscope.topology.layout.AXES` (dp, tp, pp, cp, ep)."""

BETWEEN_KINDS: tuple[str, ...] = ("data", "compute", "optimizer", "checkpoint", "eval")
"""Keys of a record's ``between_steps`` in code order (``StepColumns.between_us`` columns): what a rank measured
between its previous step and this one. ``compute`` holds the compute phases (forward, backward, recompute, compute)."""

BETWEEN_COMM = "comm"
"""The ``between_steps`` key of the time blocked in collectives between the steps (not a kind: inside them)."""

COMPUTE_CODE = KIND_CODE["compute"]
COMM_CODE = KIND_CODE["comm"]
P2P_CODE = KIND_CODE["p2p"]


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
                    raise ParseError(
                        f"{name} = {value!r} is not one of {[m.value for m in enum]}", code=ParseCode.NOT_ONE_OF
                    )
                object.__setattr__(self, name, enum(value))
        if self.end_us < self.start_us:
            raise ParseError(
                f"end_us = {self.end_us} is before start_us = {self.start_us}; an interval must end at or after "
                f"its start",
                code=ParseCode.ENDS_BEFORE_START,
            )
        _check_net_fields(self)
        for name in ("seq", "size_bytes", "peer"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ParseError(f"{name} = {value} is below 0", code=ParseCode.VALUE_OUT_OF_RANGE)
        if self.group_size is not None and self.group_size < 1:
            raise ParseError(f"group_size = {self.group_size} must be >= 1", code=ParseCode.VALUE_OUT_OF_RANGE)


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
        raise ParseError(
            f"a {iv.kind.value} interval needs {', '.join(missing)} (missing)", code=ParseCode.MISSING_FIELD
        )
    op = CommOp(str(iv.op))
    if iv.kind is IntervalKind.COMM and op in P2P_OPS:
        raise ParseError(
            f"op = {op.value!r} is point-to-point; use kind 'p2p' for send/recv", code=ParseCode.INCONSISTENT
        )
    if iv.kind is IntervalKind.P2P and op not in P2P_OPS:
        raise ParseError(
            f"op = {op.value!r} is a collective; a p2p interval has op 'send' or 'recv'", code=ParseCode.INCONSISTENT
        )


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
class BetweenSteps:
    """What a rank measured between its previous step's end and this step's start, microseconds per kind.

    Phases opened outside a step (``tracker.phase("checkpoint")``, ``"eval"``) are timed, the innermost owning the
    time; the rest of the gap (``StepRecord.gap_before_us`` minus the sum) is unlabelled host time.
    """

    data_us: int = 0
    """Data-loader phases (``tracker.phase("data")``) outside a step."""
    compute_us: int = 0
    """Compute phases (forward, backward, recompute, compute) outside a step."""
    optimizer_us: int = 0
    """Optimizer phases outside a step."""
    checkpoint_us: int = 0
    """Checkpoint save or load outside a step."""
    eval_us: int = 0
    """Evaluation (``tracker.phase("eval")``) outside a step."""
    comm_us: int = 0
    """Of the gap, the time the training thread was blocked in collectives (on the host clock; key ``comm``): an
    evaluation's metric all-reduce or gather, a barrier, waiting for a peer that is still busy. Not a kind: it lies
    inside the kinds above or the unlabelled rest, and is not added to them (:meth:`total_us`). On a GPU an NCCL
    collective does not block the host, so only what blocks it is counted (its wait shows in a later sync)."""

    def as_dict(self) -> dict[str, int]:
        """The non-zero kinds (keys of :data:`BETWEEN_KINDS`) and ``comm`` as the ``between_steps`` object on disk."""
        out = {k: v for k in BETWEEN_KINDS if (v := getattr(self, f"{k}_us"))}
        if self.comm_us:
            out[BETWEEN_COMM] = self.comm_us
        return out

    def total_us(self) -> int:
        """Sum over the kinds, microseconds."""
        return sum(getattr(self, f"{k}_us") for k in BETWEEN_KINDS)


MAX_RAISED_CHARS = 200
"""Longest ``raised`` a record may carry (an exception's qualified type name)."""

_NON_NEGATIVE = (
    "step",
    "rank",
    "user_step",
    "gap_before_us",
    "runqueue_wait_us",
    "on_cpu_us",
    "compute_runqueue_wait_us",
    "data_runqueue_wait_us",
    "optimizer_runqueue_wait_us",
    "attempt_start_us",
)
"""The record's whole-number fields that are at least 0 where given."""


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
    user_step: int | None = None
    """The step number the training loop gave, where it differs from ``step`` (a loop that restarts its count every
    epoch: the SDK renumbers so that ``(rank, step)`` stays unique); ``None``: the same as ``step``."""
    gap_before_us: int | None = None
    """Microseconds between this rank's previous step's end and this step's start (same clock); ``None`` for the
    first step or when not measured."""
    between_steps: BetweenSteps | None = None
    """What that gap was spent on, per kind; ``None`` when not measured."""
    runqueue_wait_us: int | None = None
    """Microseconds the step's training thread was runnable but waiting for a CPU (Linux ``schedstat`` run delay):
    time the host's scheduler, not the job, took; ``None`` when not measured."""
    on_cpu_us: int | None = None
    """Microseconds the step's training thread ran on a CPU (Linux ``schedstat`` time on a CPU); the rest of the
    step, less ``runqueue_wait_us``, it was blocked or asleep (a collective, a device, I/O); ``None`` when not
    measured."""
    compute_runqueue_wait_us: int | None = None
    """The part of ``runqueue_wait_us`` that fell in the step's compute (its compute phases; in a step that marked no
    training compute phase, also its time outside phases), microseconds: with it a rank's compute less the time it
    waited for a CPU compares like for like with its peers'. At most ``runqueue_wait_us``, and only with it; ``None``
    when not measured."""
    data_runqueue_wait_us: int | None = None
    """The part of ``runqueue_wait_us`` that fell in the step's data loading (its ``data`` phases: fetches timed in
    it, a fetch held for it before it opened included), microseconds: a loader slow while off a CPU (a slow disk, a
    remote store) waits little for one, a rank whose loading only waited for a CPU more than its peers' is the
    host's. At most ``runqueue_wait_us``, and only with it; ``None`` when not measured."""
    optimizer_runqueue_wait_us: int | None = None
    """The part of ``runqueue_wait_us`` that fell in the step's optimizer step (its ``optimizer`` phases),
    microseconds: the optimizer step is the same work on every rank of a stage, so less this wait it tells a slower
    core from a busier one. At most ``runqueue_wait_us``, and only with it; ``None`` when not measured."""
    attempt_start_us: int | None = None
    """When the process that wrote the record began tracking (its tracker's start, host-clock microseconds): one
    value per attempt of the rank. A job restarted or resumed into the same records starts a new process, whose
    step numbers may go on where the last attempt's stopped but whose collectives' sequence numbers start over; a
    change of this value in a rank's records is where a new attempt began. ``None`` when the writer does not say."""
    raised: str | None = None
    """The type of the exception that ended the step (``with tracker.step()`` left by it: a crash, an out-of-memory
    error, a collective's timeout, a peer's lost connection): the step was cut short and the record holds what ran
    until then. The readers leave such rank-steps out of the analysis with a note (``raised_steps``); the file keeps
    them. ``None``: the step ended normally."""

    def __post_init__(self) -> None:
        """Check the step's own numbers and that no interval lies wholly outside it.

        Raises:
            ParseError: naming the field, its value and what would fit.
        """
        for name in _NON_NEGATIVE:
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ParseError(f"{name} = {value} is below 0", code=ParseCode.VALUE_OUT_OF_RANGE)
        if self.end_us < self.start_us:
            raise ParseError(
                f"end_us = {self.end_us} is before start_us = {self.start_us}; a step must end at or after its start",
                code=ParseCode.ENDS_BEFORE_START,
            )
        self._check_run_delay()
        self._check_raised()
        if self.gpu_util is not None and not 0.0 <= self.gpu_util <= 1.0:
            raise ParseError(
                f"gpu_util = {self.gpu_util} must be a ratio in [0, 1] (DCGM percent / 100)",
                code=ParseCode.VALUE_OUT_OF_RANGE,
            )
        if self.between_steps is not None:
            for k in (*BETWEEN_KINDS, BETWEEN_COMM):
                value = getattr(self.between_steps, f"{k}_us")
                if value < 0:
                    raise ParseError(f"between_steps.{k} = {value} is below 0", code=ParseCode.VALUE_OUT_OF_RANGE)
        for i, iv in enumerate(self.intervals):
            if iv.end_us < self.start_us or iv.start_us > self.end_us:
                raise ParseError(
                    f"intervals[{i}] = [{iv.start_us}, {iv.end_us}] lies wholly outside the step "
                    f"[{self.start_us}, {self.end_us}]; an interval must overlap its step (wrong step or rank?)",
                    code=ParseCode.OUTSIDE_STEP,
                )

    def _check_raised(self) -> None:
        """``raised`` names an exception type: a string of 1 to :data:`MAX_RAISED_CHARS` characters."""
        if self.raised is not None and not (isinstance(self.raised, str) and 0 < len(self.raised) <= MAX_RAISED_CHARS):
            raise ParseError(
                f"raised = {self.raised!r} must be the exception's type name, 1 to {MAX_RAISED_CHARS} characters",
                code=ParseCode.VALUE_OUT_OF_RANGE,
            )

    def _check_run_delay(self) -> None:
        """The run delay in compute, data loading, the optimizer step: parts of ``runqueue_wait_us``, at most it."""
        total = self.runqueue_wait_us
        for name, part, where in (
            ("compute_runqueue_wait_us", self.compute_runqueue_wait_us, "compute"),
            ("data_runqueue_wait_us", self.data_runqueue_wait_us, "data loading"),
            ("optimizer_runqueue_wait_us", self.optimizer_runqueue_wait_us, "optimizer step"),
        ):
            if part is not None and (total is None or part > total):
                raise ParseError(
                    f"{name} = {part} must come with runqueue_wait_us and be at most it "
                    f"(runqueue_wait_us = {total}): it is the part of the step's run delay in its {where}",
                    code=ParseCode.VALUE_OUT_OF_RANGE,
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


RESTARTED: Final = (
    "; a job restarted or resumed into the same records writes steps again (and its collectives' sequence numbers "
    "start over): give each attempt its own records (MESHSCOPE_COLLECTOR=file:DIR per attempt, or one meshscope run "
    "--out per attempt) and analyse them apart"
)
"""Added to the duplicate-record errors: the other way a job writes a (rank, step) or a collective twice."""


def _job_mismatch(job: str, where: str, first_job: str, first_where: str) -> str:
    """The message for a record of another job than the first one read (every reader says it the same way)."""
    return (
        f"{where}: job {job!r} does not match job {first_job!r} of {first_where}; records of one analysis must come "
        f"from one job"
    )

"""The training-loop source: the SDK's step records over the pod's local socket, broken down per rank, step by step.

Exists to turn the records the SDK sends (``docs/sdk.md`` §5, the wire protocol) into the training-loop metrics of
:data:`~meshscope_sidecar.metrics.METRICS` and into the recent records the operator pulls from ``/v1/steps``. The
socket is read by the core's one reader of the protocol, :class:`meshscope.sdk.RecordReader` (``meshscope run``'s
collector is the same class with a file sink): its thread wakes as soon as a datagram arrives and hands each record
line to this source, which only queues it (bounded by records and bytes; beyond that it drops the newest and counts
it). :meth:`TrainEventsSource.poll` then parses the queued lines with the core's record parser, and once a step is
complete on every rank of this pod (or a later step has gone ahead of it by :attr:`complete_lag_steps`, or too many
steps wait) runs the core's breakdown (:func:`meshscope.analysis.break_down`) over the records of that step.

What the breakdown can and cannot say here: the sidecar sees only its own node's ranks, so every category that
needs no other node is exact (compute, exposed communication **per axis as a whole**, bubble, data, optimizer,
checkpoint, other; they add up to the step time), but the split of exposed communication into transfer and sync wait
(which member of a group arrived last) needs the records of every member: the operator's deep tier pulls the
recent records (:meth:`TrainEventsSource.recent_lines`) from every sidecar and runs the same breakdown over all of
them. No p2p bandwidth is known here, so exposed pipeline p2p time counts as bubble (the activation's own transfer
time included).

It never blocks the SDK (the reader drains the sockets as records arrive), never grows without bound (the queue, the
per-rank tallies, the recent steps and the totals all have limits), and never raises out of :meth:`poll`.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from meshscope.analysis import CATEGORIES, TICKS_PER_US, break_down
from meshscope.errors import ParseError
from meshscope.records import AXIS_CODE, COMM_CODE, OP_CODE, P2P_CODE, UNKNOWN, table_from_lines
from meshscope.sdk import RecordReader, parse_address
from meshscope.topology import AXES
from meshscope_sidecar.sources.base import Sample, SourceHealth

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable, Sequence

    from numpy.typing import NDArray

    from meshscope.records import RecordTable, StepColumns

TICKS_PER_S = TICKS_PER_US * 1_000_000
"""The breakdown's unit (1/60 µs) per second."""
_AXIS_NAMES = tuple(a.value for a in AXES)
# Column of every breakdown category, and which of ours it adds to: comm.<axis>.{transfer,sync_wait} both go to
# exposed_comm of that axis (the split needs the other nodes' records).
_CATEGORY_OF_COLUMN: tuple[tuple[str, str], ...] = tuple(
    ("exposed_comm", c.split(".")[1]) if c.startswith("comm.") else (c, "") for c in CATEGORIES
)
_REJECT_REASONS = ("foreign_rank", "foreign_job", "duplicate")


@dataclass(slots=True)
class _RankTotals:
    """Running totals of one rank (counters since the sidecar started, gauges: the latest value)."""

    steps: int = 0
    step_us: int = 0
    last_step_us: int = 0
    ticks: NDArray[np.int64] = field(default_factory=lambda: np.zeros(len(CATEGORIES), dtype=np.int64))
    axes: set[str] = field(default_factory=set)
    collective_bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    collectives: dict[tuple[str, str], int] = field(default_factory=dict)
    tokens: int | None = None
    longest_sequence: int | None = None
    attention_work: float | None = None
    attention_us: int | None = None
    peak_memory_bytes: int | None = None


class _Header(msgspec.Struct, frozen=True, gc=False):
    """What a record line must say before it is queued for its step: the rest is checked with its step's table."""

    schema: str
    job: str
    rank: int
    step: int
    attempt_start_us: int | None = None
    raised: str | None = None


_decode_header = msgspec.json.Decoder(_Header).decode
_SCHEMA = "meshscope.step/1"
_AXIS_OF_CODE = {code: name for name, code in AXIS_CODE.items()}
_OP_OF_CODE = {code: name for name, code in OP_CODE.items()}
_RECV = OP_CODE["recv"]  # a transfer is counted once, on its sending side


@dataclass(frozen=True, slots=True, kw_only=True)
class _Pending:
    rank: int
    step: int
    line: bytes


class TrainEventsSource:
    """The SDK's step records, read from the pod's datagram socket(s), broken down and tallied per rank."""

    name = "train_events"

    def __init__(
        self,
        *,
        addresses: Sequence[str],
        job: str,
        ranks: frozenset[int] | None,
        max_queued_records: int = 4096,
        max_queued_bytes: int = 64 * 1024 * 1024,
        max_steps_kept: int = 64,
        max_bytes_kept: int = 32 * 1024 * 1024,
        max_ranks: int = 256,
        complete_lag_steps: int = 2,
        max_open_steps: int = 8,
        axes: Collection[str] = (),
    ) -> None:
        """Bind the socket(s) and start reading.

        Args:
            addresses: where the SDK sends (``unix:/path`` or ``unix:@name``, as ``MESHSCOPE_COLLECTOR``).
            job: records of another job are rejected (``foreign_job``).
            ranks: the ranks of this pod; records of other ranks are rejected (``foreign_rank``). ``None``
                (degraded identity): every rank is kept, at most ``max_ranks``.
            max_queued_records: records received but not yet polled, at most (beyond: dropped, counted).
            max_queued_bytes: bytes of those, at most.
            max_steps_kept: steps kept for ``/v1/steps``.
            max_bytes_kept: bytes of record lines kept for ``/v1/steps``.
            max_ranks: ranks tallied, at most (a degraded identity accepts any rank).
            complete_lag_steps: a step is broken down without a missing rank once another rank is this many steps
                ahead of it.
            max_open_steps: steps waiting for missing ranks, at most (the oldest is broken down when exceeded).
            axes: the layout's axes of degree above 1. With ``ranks`` known, every rank's counters are exported
                from the start at 0 (its exposed communication on each of these axes included), as Prometheus
                advises for series known to exist: a series that first appears with a value hides its first
                increment from ``rate()``, and the store then extrapolates each counter of a ratio differently.

        Never raises: a socket that cannot be bound leaves the source down (``last_error``), retried every poll.
        """
        self.health = SourceHealth()
        self.complete_lag_steps = complete_lag_steps
        """A step is complete once some rank is this many steps past it, even if a rank never sent it."""
        self._addresses = tuple(addresses)
        self._job = job
        self._ranks = ranks
        self._max_queued_records = max_queued_records
        self._max_queued_bytes = max_queued_bytes
        self._max_steps_kept = max_steps_kept
        self._max_bytes_kept = max_bytes_kept
        self._max_ranks = max_ranks if ranks is None else len(ranks)
        self._max_open_steps = max_open_steps
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[int, bytes]] = collections.deque()
        self._queued_bytes = 0
        self._dropped = 0
        self._open: dict[int, dict[int, _Pending]] = {}
        self._newest: dict[int, int] = {}
        self._attempts: dict[int, int] = {}  # rank -> attempt_start_us of its newest process
        self._pids: dict[int, int | None] = {}
        self._checked: tuple[RecordTable, list[bytes]] | None = None  # this poll's lines as one table, checked
        self._hello_pids: dict[int, int] = {}  # pid -> rank, every pid a rank said hello with (bounded by restarts)
        self._totals: dict[int, _RankTotals] = {}
        for rank in sorted(ranks or ()):
            self._totals[rank] = _RankTotals(axes=set(axes))
        self._rejected = dict.fromkeys(_REJECT_REASONS, 0)
        self._recent: dict[int, list[bytes]] = {}
        self._recent_bytes = 0
        self._parse_errors = 0
        self._reader: RecordReader | None = None
        self._open_reader()

    # ------------------------------------------------------------------ the reader's side (its thread)

    def _open_reader(self) -> None:
        try:
            reader = RecordReader(
                [parse_address(a) for a in self._addresses],
                self,
                keep_step_times=False,
                max_ranks=self._max_ranks * 2,
            )
        except (OSError, ValueError) as exc:
            self.health.up = False
            self.health.last_error = f"cannot listen on {', '.join(self._addresses)}: {exc}"
            return
        reader.start()
        self._reader = reader

    def write_record(self, rank: int, line: bytes) -> None:
        """Queue one record line (the :class:`meshscope.sdk.RecordSink` side); drop it, counted, when full."""
        with self._lock:
            if len(self._queue) >= self._max_queued_records or self._queued_bytes + len(line) > self._max_queued_bytes:
                self._dropped += 1
                return
            self._queue.append((rank, line))
            self._queued_bytes += len(line)

    # ------------------------------------------------------------------ polling

    def poll(self) -> None:
        """Parse the queued records, break down every complete step, update the totals; never raises."""
        if self._reader is None:
            self._open_reader()
            if self._reader is None:
                return
        with self._lock:
            queued = list(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
        self._restarted_ranks()
        self._checked = None
        for _, line, header in self._valid(queued):
            self._ingest(line, header)
        ready = self._ready_steps()
        if ready:
            self._break_down(ready)
        with self._lock:
            self.health.parse_errors_total = self._parse_errors + self._reader.garbage
            self.health.dropped_total = self._dropped + self._reader.untallied
        self.health.up = True
        self.health.last_error = None
        self.health.last_success_unix_s = time.time()

    def _restarted_ranks(self) -> None:
        """A rank that said hello with a new pid starts its step numbers afresh (a restart from a checkpoint).

        A container restarted in a pod starts a fresh PID namespace, where its processes may get the pids of the last
        run: there the records' ``attempt_start_us`` tells the new process (:meth:`_ingest`).
        """
        if self._reader is None:
            return
        with self._reader.lock:
            pids = {rank: t.pid for rank, t in self._reader.ranks.items()}
        for rank, pid in pids.items():
            before = self._pids.get(rank)
            if before is not None and pid is not None and before != pid:
                self._newest.pop(rank, None)
            self._pids[rank] = pid

    def _valid(self, queued: list[tuple[int, bytes]]) -> list[tuple[int, bytes, _Header]]:
        """The queued lines that are valid records alone, with their headers; the others are counted.

        Every line is checked by the core's columnar reader (:func:`meshscope.records.table_from_lines`), all of a
        poll's lines as one table: a bad one makes that table fail, and then each line is checked alone, so that
        only the bad ones are lost. Checked here, before a record is queued for its step, so that an invalid one
        can neither take a rank's place in a step nor move its newest step number.
        """
        headed: list[tuple[int, bytes, _Header]] = []
        for rank, line in queued:
            try:
                header = _decode_header(line)
            except (msgspec.DecodeError, RecursionError):
                self._parse_errors += 1
                continue
            if header.schema != _SCHEMA or header.rank != rank:
                self._parse_errors += 1
                continue
            headed.append((rank, line, header))
        if not headed:
            return []
        lines = [line for _, line, _ in headed]
        try:
            self._checked = (table_from_lines(lines, where="records"), lines)
        except ParseError:
            pass
        else:
            return headed
        valid = []
        for item in headed:
            try:
                table_from_lines([item[1]])
            except ParseError:
                self._parse_errors += 1
            else:
                valid.append(item)  # valid alone; what it clashes with (a duplicate, another job) is decided next
        return valid

    def _ingest(self, line: bytes, record: _Header) -> None:
        if record.job != self._job:
            self._rejected["foreign_job"] += 1
            return
        if self._ranks is not None and record.rank not in self._ranks:
            self._rejected["foreign_rank"] += 1
            return
        if record.rank not in self._totals and len(self._totals) >= self._max_ranks:
            self._rejected["foreign_rank"] += 1
            return
        started = record.attempt_start_us
        if started is not None and started > self._attempts.get(record.rank, -1):
            if record.rank in self._attempts:  # a new process of this rank: its step numbers start afresh
                self._newest.pop(record.rank, None)
            self._attempts[record.rank] = started
        newest = self._newest.get(record.rank)
        if newest is not None and record.step <= newest:
            self._rejected["duplicate"] += 1
            return
        self._newest[record.rank] = record.step
        self._totals.setdefault(record.rank, _RankTotals())
        if record.raised is not None:
            # cut short by an exception: no step of the run (the readers leave it out with a note), so not in the
            # totals; kept for the operator's deep tier, whose table notes it
            with self._lock:
                self._keep(record.step, line)
            return
        self._open.setdefault(record.step, {})[record.rank] = _Pending(rank=record.rank, step=record.step, line=line)

    def _ready_steps(self) -> list[int]:
        """Open steps that every expected rank sent, that a rank has gone past by the lag, or beyond the limit."""
        if not self._open:
            return []
        expected = self._ranks if self._ranks is not None else frozenset(self._totals)
        ahead = max(self._newest.values(), default=-1)
        ready = [
            s for s, by_rank in self._open.items() if expected <= by_rank.keys() or ahead - s >= self.complete_lag_steps
        ]
        chosen = set(ready)
        waiting = sorted(s for s in self._open if s not in chosen)
        ready.extend(waiting[: max(0, len(waiting) - self._max_open_steps)])
        return sorted(ready)

    def flush(self) -> None:
        """Break down every open step now, complete or not (at shutdown)."""
        if self._open:
            self._break_down(sorted(self._open))

    def _break_down(self, steps: list[int]) -> None:
        pending = [p for s in steps for p in self._open.pop(s).values()]
        checked, self._checked = self._checked, None
        if checked is not None and len(checked[1]) == len(pending):
            # The usual case: what this poll received is exactly the steps now complete, already one valid table.
            at = {id(line): i for i, line in enumerate(checked[1])}
            order = [at.get(id(p.line)) for p in pending]
            if None not in order and len(set(order)) == len(order):
                try:
                    self._apply(sorted(pending, key=lambda p: at[id(p.line)]), checked[0])
                except ParseError:
                    pass
                else:
                    return
        try:
            self._apply(pending)
        except ParseError:
            # One bad record spoils the table (e.g. members of one collective that disagree on its op): break
            # each record down alone, so that only the bad ones are lost.
            for p in pending:
                try:
                    self._apply([p])
                except ParseError:
                    self._parse_errors += 1

    def _apply(self, pending: list[_Pending], table: RecordTable | None = None) -> None:
        """Break down ``pending`` records as one table and add them to the totals and the recent steps.

        ``table``, when given, is the table of exactly these lines in this order (built when they were checked).

        The table is built by the core's columnar reader (:func:`meshscope.records.table_from_lines`), which checks
        every line as the file readers do; the totals are read off its columns.

        Raises:
            ParseError: when the records do not make a valid table.
        """
        if table is None:
            table = table_from_lines([p.line for p in pending], where="records")
        ticks = break_down(table, align_clocks=False).ticks
        st = table.steps
        ranks = st.rank.tolist()
        steps = st.step.tolist()
        step_us = (st.end_us - st.start_us).tolist()
        if ranks != [p.rank for p in pending] or steps != [p.step for p in pending]:  # one row per line, in order
            raise ParseError("a record's rank or step reads differently in its header and in its table")
        ivs = table.intervals
        net = ((ivs.kind == COMM_CODE) | (ivs.kind == P2P_CODE)) & (ivs.axis != UNKNOWN) & (ivs.op != UNKNOWN)
        rows, axes, ops = ivs.row[net], ivs.axis[net], ivs.op[net]
        sizes = ivs.size_bytes[net]
        keys, inverse = np.unique(
            np.stack([rows.astype(np.int64), axes.astype(np.int64), ops.astype(np.int64)], axis=1),
            axis=0,
            return_inverse=True,
        )
        inverse = inverse.reshape(-1)
        counts = np.bincount(inverse, minlength=len(keys))
        byte_sums = np.zeros(len(keys), dtype=np.int64)
        np.add.at(byte_sums, inverse, np.where(sizes >= 0, sizes, 0))
        has_bytes = np.bincount(inverse, weights=sizes >= 0, minlength=len(keys)) > 0
        with self._lock:
            for i, p in enumerate(pending):
                t = self._totals[p.rank]
                t.ticks += ticks[i]
                t.steps += 1
                t.step_us += step_us[i]
                t.last_step_us = step_us[i]
                self._count_stats(t, st, i)
                self._keep(p.step, p.line)
            for (row, axis, op), n, size, sized in zip(
                keys.tolist(), counts.tolist(), byte_sums.tolist(), has_bytes.tolist(), strict=True
            ):
                t = self._totals[ranks[row]]
                axis_name = _AXIS_OF_CODE[axis]
                t.axes.add(axis_name)
                if op == _RECV:
                    continue
                key = (axis_name, _OP_OF_CODE[op])
                t.collectives[key] = t.collectives.get(key, 0) + n
                if sized:
                    t.collective_bytes[key] = t.collective_bytes.get(key, 0) + size

    @staticmethod
    def _count_stats(t: _RankTotals, st: StepColumns, i: int) -> None:
        """Add row ``i``'s data stats to ``t`` (absent ones: ``-1`` or NaN in the columns, left as they are)."""
        if (tokens := int(st.tokens[i])) != UNKNOWN:
            t.tokens = (t.tokens or 0) + tokens
        if (longest := int(st.longest_sequence[i])) != UNKNOWN:
            t.longest_sequence = longest
        if not math.isnan(work := float(st.attention_work[i])):
            t.attention_work = (t.attention_work or 0.0) + work
        if (attention_us := int(st.attention_us[i])) != UNKNOWN:
            t.attention_us = (t.attention_us or 0) + attention_us
        if (peak := int(st.peak_memory_bytes[i])) != UNKNOWN:
            t.peak_memory_bytes = peak

    def _keep(self, step: int, line: bytes) -> None:
        """Keep ``line`` for ``/v1/steps``, evicting the oldest steps beyond the limits (caller holds the lock)."""
        if step not in self._recent and len(self._recent) >= self._max_steps_kept and step < min(self._recent):
            return
        self._recent.setdefault(step, []).append(line)
        self._recent_bytes += len(line)
        while len(self._recent) > self._max_steps_kept or (
            self._recent_bytes > self._max_bytes_kept and len(self._recent) > 1
        ):
            oldest = min(self._recent)
            self._recent_bytes -= sum(len(x) for x in self._recent.pop(oldest))

    # ------------------------------------------------------------------ reading out

    def recent_lines(self, *, since_step: int = -1, limit_steps: int | None = None, max_bytes: int) -> list[bytes]:
        """Kept record lines of steps after ``since_step``, oldest step first, whole steps, at most ``max_bytes``.

        Args:
            since_step: only steps greater than this (``-1``: all kept).
            limit_steps: at most this many steps (``None``: all).
            max_bytes: stop before the lines would exceed this many bytes (at least one line is returned when any
                is kept, so a client always makes progress).
        """
        return self.recent_window(since_step=since_step, limit_steps=limit_steps, max_bytes=max_bytes)[0]

    def recent_window(
        self, *, since_step: int = -1, limit_steps: int | None = None, max_bytes: int
    ) -> tuple[list[bytes], bool]:
        """:meth:`recent_lines`, and whether ``max_bytes`` left out lines of the steps asked for."""
        with self._lock:
            steps = sorted(s for s in self._recent if s > since_step)
            if limit_steps is not None:
                steps = steps[:limit_steps]
            out: list[bytes] = []
            size = 0
            for s in steps:
                for line in self._recent[s]:
                    if out and size + len(line) > max_bytes:
                        return out, True
                    out.append(line)
                    size += len(line)
            return out, False

    def process_ranks(self) -> dict[int, int]:
        """``pid -> global rank`` of every rank of this pod that said hello (the SDK's hello carries both).

        A restarted rank's new pid is added and its old one kept: that process' logs are still that rank's.
        Called from the NCCL source's thread. The reader's thread holds the reader's lock when it hands a record to
        :meth:`write_record`, which takes this source's lock: the reader's lock is never taken here while holding
        this source's (the other order deadlocked the sidecar under a flood of records).
        """
        hello: list[tuple[int, int]] = []
        if self._reader is not None:
            with self._reader.lock:
                hello = [(t.pid, rank) for rank, t in self._reader.ranks.items() if t.pid is not None]
        with self._lock:
            for pid, rank in hello:
                if self._ranks is None or rank in self._ranks:
                    self._hello_pids[pid] = rank
            return dict(self._hello_pids)

    def samples(self) -> Iterable[Sample]:
        """The training-loop metrics of every rank (counters: totals since the sidecar started)."""
        dropped_by_rank: dict[int, int] = {}
        if self._reader is not None:
            with self._reader.lock:
                dropped_by_rank = {r: t.counters.get("records_dropped", 0) for r, t in self._reader.ranks.items()}
        out: list[Sample] = []
        with self._lock:
            for rank, t in sorted(self._totals.items()):
                out.extend(_rank_samples(rank, t))
                if rank in dropped_by_rank:
                    out.append(Sample(metric="meshscope_records_dropped_total", value=dropped_by_rank[rank], rank=rank))
            out.extend(
                Sample(metric="meshscope_records_rejected_total", value=n, labels=(("reason", reason),))
                for reason, n in self._rejected.items()
            )
        return out

    def close(self) -> None:
        """Stop reading and release the socket(s); idempotent."""
        reader, self._reader = self._reader, None
        if reader is not None:
            with contextlib.suppress(OSError):
                reader.stop()


def _rank_samples(rank: int, t: _RankTotals) -> list[Sample]:
    out = [
        Sample(metric="meshscope_steps_total", value=t.steps, rank=rank),
        Sample(metric="meshscope_step_seconds_total", value=t.step_us / 1e6, rank=rank),
    ]
    if t.steps:  # a gauge has no value before the first step
        out.append(Sample(metric="meshscope_last_step_seconds", value=t.last_step_us / 1e6, rank=rank))
    by_category: dict[tuple[str, str], int] = {}
    for column, key in enumerate(_CATEGORY_OF_COLUMN):
        by_category[key] = by_category.get(key, 0) + int(t.ticks[column])
    exposed = 0
    for (category, axis), ticks in by_category.items():
        if category == "exposed_comm":
            exposed += ticks
            if axis not in t.axes and not ticks:
                continue
        elif category == "bubble":
            exposed += ticks
        labels = (("axis", axis), ("category", category))
        out.append(
            Sample(metric="meshscope_breakdown_seconds_total", value=ticks / TICKS_PER_S, rank=rank, labels=labels)
        )
    own_ticks = t.step_us * (TICKS_PER_S // 1_000_000) - exposed
    out.append(Sample(metric="meshscope_own_seconds_total", value=own_ticks / TICKS_PER_S, rank=rank))
    for (axis, op), n in sorted(t.collectives.items()):
        labels = (("axis", axis), ("op", op))
        out.append(Sample(metric="meshscope_collectives_total", value=n, rank=rank, labels=labels))
        if (axis, op) in t.collective_bytes:
            value = t.collective_bytes[axis, op]
            out.append(Sample(metric="meshscope_collective_bytes_total", value=value, rank=rank, labels=labels))
    optional = (
        ("meshscope_data_tokens_total", t.tokens, 1.0),
        ("meshscope_data_longest_sequence_tokens", t.longest_sequence, 1.0),
        ("meshscope_data_attention_work_total", t.attention_work, 1.0),
        ("meshscope_data_attention_seconds_total", t.attention_us, 1e-6),
        ("meshscope_peak_memory_bytes", t.peak_memory_bytes, 1.0),
    )
    out.extend(
        Sample(metric=metric, value=float(value) * scale, rank=rank)
        for metric, value, scale in optional
        if value is not None
    )
    return out

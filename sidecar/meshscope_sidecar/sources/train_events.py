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
import json
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from meshscope.analysis import CATEGORIES, TICKS_PER_US, break_down
from meshscope.errors import ParseError
from meshscope.records import IntervalKind, RecordTable, StepRecord, _parse_record
from meshscope.sdk import RecordReader, parse_address
from meshscope.topology import AXES
from meshscope_sidecar.sources.base import Sample, SourceHealth

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from numpy.typing import NDArray

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


@dataclass(frozen=True, slots=True, kw_only=True)
class _Pending:
    record: StepRecord
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
        self._pids: dict[int, int | None] = {}
        self._hello_pids: dict[int, int] = {}  # pid -> rank, every pid a rank said hello with (bounded by restarts)
        self._totals: dict[int, _RankTotals] = {}
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
        for rank, line in queued:
            self._ingest(rank, line)
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
        """A rank that said hello with a new pid starts its step numbers afresh (a restart from a checkpoint)."""
        if self._reader is None:
            return
        with self._reader.lock:
            pids = {rank: t.pid for rank, t in self._reader.ranks.items()}
        for rank, pid in pids.items():
            before = self._pids.get(rank)
            if before is not None and pid is not None and before != pid:
                self._newest.pop(rank, None)
            self._pids[rank] = pid

    def _ingest(self, rank: int, line: bytes) -> None:
        try:
            record = _parse_record(json.loads(line), f"rank {rank} record")
        except (ParseError, ValueError, RecursionError):
            self._parse_errors += 1
            return
        if record.job != self._job:
            self._rejected["foreign_job"] += 1
            return
        if self._ranks is not None and record.rank not in self._ranks:
            self._rejected["foreign_rank"] += 1
            return
        if record.rank not in self._totals and len(self._totals) >= self._max_ranks:
            self._rejected["foreign_rank"] += 1
            return
        newest = self._newest.get(record.rank)
        if newest is not None and record.step <= newest:
            self._rejected["duplicate"] += 1
            return
        self._newest[record.rank] = record.step
        self._totals.setdefault(record.rank, _RankTotals())
        self._open.setdefault(record.step, {})[record.rank] = _Pending(record=record, line=line)

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

    def _apply(self, pending: list[_Pending]) -> None:
        """Break down ``pending`` records as one table and add them to the totals and the recent steps.

        Raises:
            ParseError: when the records do not make a valid table.
        """
        table = RecordTable.from_records(p.record for p in pending)
        ticks = break_down(table, align_clocks=False).ticks
        row_of = {(int(r), int(s)): i for i, (r, s) in enumerate(zip(table.steps.rank, table.steps.step, strict=True))}
        with self._lock:
            for p in pending:
                t = self._totals[p.record.rank]
                t.ticks += ticks[row_of[p.record.rank, p.record.step]]
                self._count(t, p.record)
                self._keep(p.record.step, p.line)

    @staticmethod
    def _count(t: _RankTotals, record: StepRecord) -> None:
        step_us = record.end_us - record.start_us
        t.steps += 1
        t.step_us += step_us
        t.last_step_us = step_us
        for iv in record.intervals:
            if iv.kind not in {IntervalKind.COMM, IntervalKind.P2P} or iv.axis is None or iv.op is None:
                continue
            t.axes.add(iv.axis.value)
            if iv.op.value == "recv":  # a transfer is counted once, on its sending side
                continue
            key = (iv.axis.value, iv.op.value)
            t.collectives[key] = t.collectives.get(key, 0) + 1
            if iv.size_bytes is not None:
                t.collective_bytes[key] = t.collective_bytes.get(key, 0) + iv.size_bytes
        st = record.stats
        if st.tokens is not None:
            t.tokens = (t.tokens or 0) + st.tokens
        if st.longest_sequence is not None:
            t.longest_sequence = st.longest_sequence
        if st.attention_work is not None:
            t.attention_work = (t.attention_work or 0.0) + st.attention_work
        if st.attention_us is not None:
            t.attention_us = (t.attention_us or 0) + st.attention_us
        if st.peak_memory_bytes is not None:
            t.peak_memory_bytes = st.peak_memory_bytes

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
        with self._lock:
            steps = sorted(s for s in self._recent if s > since_step)
            if limit_steps is not None:
                steps = steps[:limit_steps]
            out: list[bytes] = []
            size = 0
            for s in steps:
                for line in self._recent[s]:
                    if out and size + len(line) > max_bytes:
                        return out
                    out.append(line)
                    size += len(line)
            return out

    def process_ranks(self) -> dict[int, int]:
        """``pid -> global rank`` of every rank of this pod that said hello (the SDK's hello carries both).

        A restarted rank's new pid is added and its old one kept: that process' logs are still that rank's.
        """
        with self._lock:
            if self._reader is not None:
                with self._reader.lock:
                    for rank, tally in self._reader.ranks.items():
                        if tally.pid is not None and (self._ranks is None or rank in self._ranks):
                            self._hello_pids[tally.pid] = rank
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
    if not t.steps:
        return []
    out = [
        Sample(metric="meshscope_steps_total", value=t.steps, rank=rank),
        Sample(metric="meshscope_step_seconds_total", value=t.step_us / 1e6, rank=rank),
        Sample(metric="meshscope_last_step_seconds", value=t.last_step_us / 1e6, rank=rank),
    ]
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

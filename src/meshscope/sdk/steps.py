"""What one step collects on the hot path, and how it becomes a ``meshscope.step/1`` record afterwards.

Why it exists: the tracker's hot path only appends marks and small flat lists (:func:`new_op`, :class:`StepState`);
all interval arithmetic -- resolving marks to host microseconds, merging the windows in which the host was blocked in
communication and cutting them out of compute, sorting, encoding -- happens here, once per step, after the step has
ended. One interval pass feeds two outputs: :func:`build_record` (a dict: the readable reference) and
:func:`encode_record` (the datagram the tracker sends, written directly from JSON fragments encoded once per group and
op). ``encode_record`` is byte for byte ``transport.encode`` of the reference with the ``sdk`` counters added; a test
holds it to that. This module must not import torch and must not touch process-wide state.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from bisect import bisect_right
from itertools import islice
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from meshscope.sdk.clocks import HostClock, Mark

MERGE_GAP_US: Final = 20
"""Blocked windows closer than this many µs are merged (the Python between two waits is not compute)."""
OPTIMIZER: Final = "optimizer"
COMPUTE: Final = "compute"
DATA: Final = "data"
DEVICE_KINDS: Final = frozenset({"compute", OPTIMIZER})
"""Interval kinds whose marks are device marks and from which blocked windows are cut."""
BETWEEN_KINDS: Final = ("data", "compute", "optimizer", "checkpoint", "eval")
"""Keys of a record's ``between_steps``, in the order written (``meshscope.records.BETWEEN_KINDS``; a test holds the
two equal, the SDK must not import the records package)."""
BETWEEN_COMM: Final = "comm"
"""The ``between_steps`` key of the time blocked in collectives between two steps (``meshscope.records.BETWEEN_COMM``:
inside the kinds, not one of them)."""
MAX_RAISED_CHARS: Final = 200
"""Longest ``raised`` a record may carry (``meshscope.records.MAX_RAISED_CHARS``; a test holds the two equal)."""

# One captured operation is a flat list, the only object the hot path allocates per operation. Its slots:
START: Final = 0
"""Mark at issue (this rank's arrival)."""
END: Final = 1
"""Mark at completion; ``None`` until it arrives (maybe set from a backend thread)."""
META: Final = 2
"""The operation's :class:`OpMeta` (kind, axis, op, group, group size, peer), shared by its group and op."""
SEQ: Final = 3
"""Sequence number within the group (or the p2p stream)."""
NBYTES: Final = 4
"""Payload bytes (``None``: unknown)."""
HANDLE: Final = 5
"""What ends it, held until it has been waited on or its record is built: the ``Work`` of a ``ProcessGroup`` call,
the output tensor (or list) of a functional collective. Holding it keeps its ``id()`` unique while that is a key."""
ISSUED: Final = 6
"""Host ``perf_counter_ns`` right after the backend accepted the operation (tells a synchronous call by its wait)."""
WAIT: Final = 7
"""Mark at which the rank began to wait for it (the issue of a synchronous call, the start of the ``Work.wait`` or
``wait_tensor`` of an asynchronous one, the start of DDP's wait for its buckets); ``None``: never waited on. From there
to :data:`END` the rank was blocked on it: the record's ``wait_us``."""

_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_BY_START_END = itemgetter(0, 1)


class OpMeta:
    """The static part of an operation interval, shared by every operation of one group and op (or p2p stream).

    Its JSON fragments are encoded once, so that encoding a captured operation is one string format.
    """

    __slots__ = ("axis", "group", "group_size", "head", "kind", "middle", "op", "peer", "tail")

    def __init__(self, *, kind: str, axis: str, op: str, group: str, group_size: int | None, peer: int | None) -> None:
        """An interval of ``kind`` (``comm``/``p2p``) on ``axis``: ``op`` in ``group`` (docs/records.md)."""
        self.kind = kind
        self.axis = axis
        self.op = op
        self.group = group
        self.group_size = group_size
        self.peer = peer
        self.head = '{"kind":' + _JSON(kind) + ',"start_us":'
        """JSON up to the start: then start, ``,"end_us":``, end, :attr:`middle`, seq, bytes, :attr:`tail`."""
        self.middle = f',"axis":{_JSON(axis)},"op":{_JSON(op)},"group":{_JSON(group)},"seq":'
        """JSON between the end and the sequence number."""
        self.tail = (
            (f',"group_size":{int(group_size)}' if group_size is not None else "")
            + (f',"peer":{int(peer)}' if peer is not None else "")
            + "}"
        )
        """JSON after ``bytes``: ``group_size`` and ``peer`` when known, and the closing brace."""


def new_op(
    meta: OpMeta, seq: int, nbytes: int | None, start: Mark, end: Mark = None, *, wait: Mark = None
) -> list[Any]:
    """A captured operation as the hot path stores it (slots :data:`START` .. :data:`WAIT`)."""
    return [start, end, meta, seq, nbytes, None, 0, wait]


class StepState:
    """Everything one step collects until its record is built."""

    __slots__ = (
        "attention",
        "between_ns",
        "compute_rq_ns",
        "data_rq_ns",
        "declared_compute",
        "end_mark",
        "end_ns",
        "finished_at",
        "gap_ns",
        "longest",
        "on_cpu_ns",
        "ops",
        "optimizer_rq_ns",
        "peak_memory_bytes",
        "phased_rq_ns",
        "raised",
        "runqueue_wait_ns",
        "sched_ns",
        "segments",
        "sequences",
        "start_mark",
        "start_ns",
        "step",
        "tokens",
        "user_step",
        "windows",
        "work",
    )

    def __init__(self, step: int, start_ns: int, start_mark: Mark) -> None:
        """Step ``step``, started at host time ``start_ns`` (ns) and device mark ``start_mark``."""
        self.step = step
        self.start_ns = start_ns
        self.start_mark = start_mark
        self.end_ns = 0
        self.end_mark: Mark = None
        self.segments: list[tuple[str, str | None, Mark, Mark]] = []
        self.declared_compute: bool | None = None
        """Whether a training compute phase (``forward``, ``backward``, ``recompute``, ``compute``; not ``eval``)
        owned time in this step (the tracker says; ``None``: not said, any ``compute`` segment counts). Without one
        the step's time outside its phases is compute of unknown phase (:func:`implicit_compute`): a loop that marks
        only its steps, or only its fetches, still computes."""
        self.ops: list[list[Any]] = []
        """Captured operations (:func:`new_op` lists), in issue order."""
        self.windows: list[Any] = []
        """Blocked windows as ``(start, end)`` marks; DDP's tail is a list whose end is ``None`` until it completes."""
        self.attention: list[tuple[Mark, Mark]] = []
        self.tokens: int | None = None
        self.sequences: int | None = None
        self.longest: int | None = None
        self.work: float | None = None
        self.peak_memory_bytes: int | None = None
        self.finished_at = 0
        self.user_step: int | None = None
        """The loop's own number where it differs from :attr:`step` (the record's ``user_step``)."""
        self.raised: str | None = None
        """The type of the exception that left the step's ``with`` block (the record's ``raised``); ``None``: none."""
        self.gap_ns: int | None = None
        """Host ns since the rank's previous step ended (``None``: the first step)."""
        self.between_ns: dict[str, int] = {}
        """Host ns of the phases timed in that gap, by :data:`BETWEEN_KINDS` key."""
        self.sched_ns: tuple[int, int] | None = None
        """The training thread's time on a CPU and run delay (:class:`SchedStat`) when the step started, ns;
        ``None``: unknown."""
        self.runqueue_wait_ns: int | None = None
        """Run delay between the step's start and end, ns (the record's ``runqueue_wait_us``); ``None``: unknown."""
        self.on_cpu_ns: int | None = None
        """Time on a CPU between the step's start and end, ns (the record's ``on_cpu_us``); ``None``: unknown."""
        self.phased_rq_ns: int | None = None
        """Run delay while one of the step's phases owned the time (its :attr:`segments`, pieces held for it before
        it opened included), ns; ``None``: not measured (the tracker measures it on a host-timed run only: on a GPU
        the kernels run whether or not the launching thread has a core)."""
        self.compute_rq_ns = 0
        """The part of :attr:`phased_rq_ns` in its compute phases, ns."""
        self.data_rq_ns = 0
        """The part of :attr:`phased_rq_ns` in its ``data`` phases (its fetches), ns."""
        self.optimizer_rq_ns = 0
        """The part of :attr:`phased_rq_ns` in its ``optimizer`` phases, ns."""


def between_us(between_ns: Mapping[str, int]) -> dict[str, int]:
    """A step's ``between_steps``: whole µs per kind (:data:`BETWEEN_KINDS` order, then :data:`BETWEEN_COMM`).

    Values under 1 µs are left out.
    """
    out = {}
    for kind in (*BETWEEN_KINDS, BETWEEN_COMM):
        us = between_ns.get(kind, 0) // 1000
        if us > 0:
            out[kind] = us
    return out


def merge_windows(windows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of sorted windows, joining those less than :data:`MERGE_GAP_US` apart."""
    out: list[tuple[int, int]] = []
    for a, b in windows:
        if out and a <= out[-1][1] + MERGE_GAP_US:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, max(a, b)))
    return out


def subtract_windows(a: int, b: int, windows: list[tuple[int, int]], first: int = 0) -> list[tuple[int, int]]:
    """``[a, b]`` minus the union of sorted, disjoint ``windows`` (from index ``first``); empty pieces are left out."""
    pieces: list[tuple[int, int]] = []
    cur = a
    for w0, w1 in islice(windows, first, None):
        if w1 <= cur:
            continue
        if w0 >= b:
            break
        if w0 > cur:
            pieces.append((cur, w0))
        cur = max(cur, w1)
        if cur >= b:
            break
    if cur < b:
        pieces.append((cur, b))
    return pieces


def _computes(st: StepState) -> bool:
    """Whether ``st`` declared its compute (:attr:`StepState.declared_compute`)."""
    if st.declared_compute is not None:
        return st.declared_compute
    return any(kind == COMPUTE for kind, _, _, _ in st.segments)


def compute_runqueue_wait_us(st: StepState) -> int | None:
    """The record's ``compute_runqueue_wait_us``: the part of the step's run delay in its compute, µs.

    The run delay in its compute phases; in a step that declared no training compute phase (:func:`implicit_compute`),
    plus all of it outside its phases (its compute there: blocked windows add none, the thread being asleep). At most
    the step's own run delay; ``None`` where either is unknown.
    """
    total, phased = st.runqueue_wait_ns, st.phased_rq_ns
    if total is None or phased is None:
        return None
    inside = st.compute_rq_ns if _computes(st) else st.compute_rq_ns + max(0, total - phased)
    return min(max(inside, 0), total) // 1000


def phase_runqueue_wait_us(st: StepState, in_phase_ns: int) -> int | None:
    """A record's ``data_runqueue_wait_us`` or ``optimizer_runqueue_wait_us``, µs.

    ``in_phase_ns``: the run delay read across the step's phases of that kind (:attr:`StepState.data_rq_ns`,
    :attr:`StepState.optimizer_rq_ns`). At most the step's own run delay; ``None`` where either is unknown.
    """
    total = st.runqueue_wait_ns
    if total is None or st.phased_rq_ns is None:
        return None
    return min(max(in_phase_ns, 0), total) // 1000


def implicit_compute(
    st: StepState, a: int, b: int, to_us: Callable[[Mark], int], windows: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Where a step that declared no training compute phase computed; empty for a step that did.

    The step's span ``[a, b]`` less the union of its phase pieces (marks read with ``to_us``), less its blocked
    ``windows`` (sorted, disjoint), as out of any compute.
    """
    if _computes(st):
        return []
    declared = sorted((max(to_us(x), a), min(to_us(y), b)) for _, _, x, y in st.segments)
    pieces: list[tuple[int, int]] = []
    cur = a
    for p0, p1 in declared:
        if p0 > cur:
            pieces.extend(subtract_windows(cur, p0, windows))
        cur = max(cur, p1)
    if cur < b:
        pieces.extend(subtract_windows(cur, b, windows))
    return pieces


_Item = tuple[int, int, str, "str | int | None", "list[Any] | None"]
"""``(start_us, end_us, kind, phase, op)``; for an operation (``op`` its list) the fourth slot is its ``wait_us``."""


class StepIntervals:
    """One pass over a finished step's marks: its span, its sorted intervals, its stats, what was incomplete."""

    __slots__ = ("end_us", "incomplete", "intervals", "start_us", "stats")

    def __init__(self, st: StepState, clock: HostClock, *, device: bool) -> None:
        """Resolve ``st``'s marks with ``clock`` (``device``: marks may be CUDA events, left out until completed)."""
        self.start_us = clock.host_ns_to_us(st.start_ns)
        self.end_us = clock.host_ns_to_us(st.end_ns)
        if device:
            if st.end_mark is not None and clock.ready(st.end_mark):
                self.end_us = max(self.end_us, clock.to_us(st.end_mark))
            items, incomplete = self._device_marks(st, clock)
        else:
            items, incomplete = self._host_marks(st, clock)
        items.sort(key=_BY_START_END)  # stable: phase pieces before operations that start and end with them
        self.intervals = items
        """``(start_us, end_us, kind, phase, op)`` sorted by start and end; ``op`` is the operation's list for an
        operation (``kind`` unused, ``phase`` its ``wait_us``: µs blocked on it at its end, ``None``: never waited),
        ``None`` for a phase piece. A step with an optimizer phase always has an optimizer piece (of length 0 when
        the whole phase was blocked in communication or shorter than a µs)."""
        self.incomplete = incomplete
        """Operations left out: not completed (or their marks not yet readable on the device)."""
        stats: dict[str, Any] = {}
        if st.tokens is not None:
            stats["tokens"] = st.tokens
        if st.sequences is not None:
            stats["sequences"] = st.sequences
        if st.longest is not None:
            stats["longest_sequence"] = st.longest
        if st.work is not None:
            stats["attention_work"] = st.work
        if st.attention:
            to_us, ready = clock.to_us, clock.ready
            stats["attention_us"] = sum(
                max(0, to_us(b) - to_us(a)) for a, b in st.attention if not device or (ready(a) and ready(b))
            )
        if st.peak_memory_bytes is not None:
            stats["peak_memory_bytes"] = st.peak_memory_bytes
        self.stats = stats

    @staticmethod
    def _host_marks(st: StepState, clock: HostClock) -> tuple[list[_Item], int]:
        """Intervals from host marks (``perf_counter_ns``), with integer arithmetic on small numbers.

        ``HostClock.to_us(m)`` is ``(m + offset) // 1000``: a sum above 2**60, slow to divide. With ``base`` chosen so
        that ``base + offset`` is a multiple of 1000, ``(m + offset) // 1000 == (m - base) // 1000 + base_us``
        exactly, and ``m - base`` is small: windows and pieces are cut in those small numbers.
        """
        off = clock.offset_ns
        base = st.start_ns - (st.start_ns + off) % 1000
        base_us = (base + off) // 1000
        start = (st.start_ns - base) // 1000
        raw = [((a - base) // 1000, (b - base) // 1000) for a, b in st.windows if b is not None and a is not None]
        raw = [(max(start, a), b) for a, b in raw]
        raw.sort()
        windows = merge_windows(raw)
        ends = [w[1] for w in windows]
        items: list[_Item] = []
        add = items.append
        optimizer_end = None  # the end of the step's last optimizer segment
        kept = False  # whether any piece of an optimizer segment was kept
        for kind, phase, a_ns, b_ns in st.segments:
            a = (a_ns - base) // 1000
            b = (b_ns - base) // 1000
            b = max(b, a)
            if kind in DEVICE_KINDS:
                n = len(items)
                if windows:
                    for p0, p1 in subtract_windows(a, b, windows, bisect_right(ends, a)):
                        add((p0 + base_us, p1 + base_us, kind, phase, None))
                elif b > a:
                    add((a + base_us, b + base_us, kind, phase, None))
                if kind == OPTIMIZER:
                    kept = kept or len(items) > n
                    optimizer_end = b + base_us
            else:
                add((a + base_us, b + base_us, kind, phase, None))
        if optimizer_end is not None and not kept:  # blocked throughout, or too short: the phase is still recorded
            add((optimizer_end, optimizer_end, OPTIMIZER, None, None))
        implicit = implicit_compute(st, start, (st.end_ns - base) // 1000, lambda m: (m - base) // 1000, windows)
        items.extend((p0 + base_us, p1 + base_us, COMPUTE, None, None) for p0, p1 in implicit)
        incomplete = 0
        for rec in st.ops:
            e = rec[END]
            if e is None:
                incomplete += 1
                continue
            s_us = (rec[START] - base) // 1000 + base_us
            e_us = (e - base) // 1000 + base_us
            e_us = e_us if e_us > s_us else s_us  # noqa: FURB136 - a call per op costs more
            w = rec[WAIT]
            wait_us = None if w is None else max(0, e_us - max(s_us, (w - base) // 1000 + base_us))
            add((s_us, e_us, "", wait_us, rec))
        return items, incomplete

    @staticmethod
    def _device_marks(st: StepState, clock: HostClock) -> tuple[list[_Item], int]:
        """Intervals from marks that may be CUDA events: those not yet completed are left out (and counted).

        A step is written before its device work completed only when the host ran
        :data:`~meshscope.sdk.tracker.MAX_DEFERRED_STEPS` steps ahead of the device: then an event's elapsed time
        cannot be read yet (CUDA raises), so operations and phase pieces with such marks are left out, and the rest of
        the record is kept.
        """
        to_us, ready = clock.to_us, clock.ready
        start_us = clock.host_ns_to_us(st.start_ns)
        windows = merge_windows(
            sorted(
                (max(to_us(w[0]), start_us), to_us(w[1]))
                for w in st.windows
                if w[0] is not None and w[1] is not None and ready(w[0]) and ready(w[1])
            )
        )
        items: list[_Item] = []
        optimizer_end = None
        kept = False
        incomplete = 0
        for kind, phase, a, b in st.segments:
            if not (ready(a) and ready(b)):  # a piece of device work not done yet (the record was forced out)
                incomplete += 1
                continue
            a_us = to_us(a)
            b_us = max(a_us, to_us(b))
            if kind in DEVICE_KINDS:
                pieces = subtract_windows(a_us, b_us, windows)
                items.extend((p0, p1, kind, phase, None) for p0, p1 in pieces)
                if kind == OPTIMIZER:
                    kept = kept or bool(pieces)
                    optimizer_end = b_us
            else:
                items.append((a_us, b_us, kind, phase, None))
        if optimizer_end is not None and not kept:
            items.append((optimizer_end, optimizer_end, OPTIMIZER, None, None))
        if st.end_mark is not None and ready(st.start_mark) and ready(st.end_mark):
            implicit = implicit_compute(st, to_us(st.start_mark), to_us(st.end_mark), to_us, windows)
            items.extend((p0, p1, COMPUTE, None, None) for p0, p1 in implicit)
        for rec in st.ops:
            s, e, w = rec[START], rec[END], rec[WAIT]
            if e is None or not (ready(s) and ready(e)):
                incomplete += 1
                continue
            s_us = to_us(s)
            e_us = max(s_us, to_us(e))
            wait_us = None if w is None or not ready(w) else max(0, e_us - max(s_us, to_us(w)))
            items.append((s_us, e_us, "", wait_us, rec))
        return items, incomplete


def build_record(
    st: StepState, *, clock: HostClock, header: Mapping[str, Any], device: bool
) -> tuple[dict[str, Any], int]:
    """The ``meshscope.step/1`` record of a finished step, and the number of operations left out as incomplete.

    Args:
        st: the step.
        clock: resolves marks to host microseconds.
        header: the record's identity fields in schema order (``schema`` .. ``gpu``), the same for every step.
        device: marks may be CUDA events (left out when not yet completed).
    """
    p = StepIntervals(st, clock, device=device)
    intervals = [_interval_dict(*piece) for piece in p.intervals]
    record = dict(header)
    record["step"] = st.step
    record["start_us"] = p.start_us
    record["end_us"] = p.end_us
    record["intervals"] = intervals
    if p.stats:
        record["stats"] = p.stats
    record["gpu_util"] = None
    if st.user_step is not None:
        record["user_step"] = st.user_step
    if st.gap_ns is not None:
        record["gap_before_us"] = st.gap_ns // 1000
        record["between_steps"] = between_us(st.between_ns)
    if st.runqueue_wait_ns is not None:
        record["runqueue_wait_us"] = st.runqueue_wait_ns // 1000
    if (in_compute := compute_runqueue_wait_us(st)) is not None:
        record["compute_runqueue_wait_us"] = in_compute
    if (in_data := phase_runqueue_wait_us(st, st.data_rq_ns)) is not None:
        record["data_runqueue_wait_us"] = in_data
    if (in_optimizer := phase_runqueue_wait_us(st, st.optimizer_rq_ns)) is not None:
        record["optimizer_runqueue_wait_us"] = in_optimizer
    if st.on_cpu_ns is not None:
        record["on_cpu_us"] = st.on_cpu_ns // 1000
    if st.raised is not None:
        record["raised"] = st.raised
    return record, p.incomplete


def _interval_dict(s_us: int, e_us: int, kind: str, phase: Any, rec: list[Any] | None) -> dict[str, Any]:  # noqa: ANN401 - a phase piece's slot holds its phase, an operation's its wait
    """One interval of :func:`build_record`: a phase piece, or an operation from its :class:`OpMeta`."""
    if rec is None:
        iv: dict[str, Any] = {"kind": kind, "start_us": s_us, "end_us": e_us}
        if phase is not None:
            iv["phase"] = phase
        return iv
    m: OpMeta = rec[META]
    iv = {"kind": m.kind, "start_us": s_us, "end_us": e_us, "axis": m.axis, "op": m.op, "group": m.group}
    iv["seq"] = rec[SEQ]
    if rec[NBYTES] is not None:
        iv["bytes"] = rec[NBYTES]
    if phase is not None:
        iv["wait_us"] = phase
    if m.group_size is not None:
        iv["group_size"] = m.group_size
    if m.peer is not None:
        iv["peer"] = m.peer
    return iv


class RecordHeader:
    """A record's identity fields (``schema`` .. ``gpu``), encoded once: the JSON before and after the step number."""

    __slots__ = ("after_step", "before_step", "fields")

    def __init__(self, fields: Mapping[str, Any]) -> None:
        """Encode ``fields`` (in schema order; ``step`` among them, its value ignored)."""
        self.fields = dict(fields)
        keys = list(self.fields)
        cut = keys.index("step")
        self.before_step = "{" + "".join(f"{_JSON(k)}:{_JSON(self.fields[k])}," for k in keys[:cut]) + '"step":'
        self.after_step = "".join(f",{_JSON(k)}:{_JSON(self.fields[k])}" for k in keys[cut + 1 :])


_PHASE_JSON: dict[tuple[str, str | None], tuple[str, str]] = {}


def _phase_fragments(kind: str, phase: str | None) -> tuple[str, str]:
    frags = _PHASE_JSON.get((kind, phase))
    if frags is None:
        tail = "}" if phase is None else f',"phase":{_JSON(phase)}}}'
        frags = _PHASE_JSON.setdefault((kind, phase), ('{"kind":' + _JSON(kind) + ',"start_us":', tail))
    return frags


def encode_record(st: StepState, p: StepIntervals, *, header: RecordHeader, sdk: Mapping[str, int]) -> bytes:
    """The JSON of a finished step's record (``p`` = its intervals) with the sender's ``sdk`` counters, as bytes.

    Equal to the JSON of ``{**build_record(...)[0], "sdk": sdk}`` as ``transport.encode`` writes it before compressing
    (the caller compresses what is too large), at a fraction of the cost: operations are written from their
    :class:`OpMeta` fragments, the header from :class:`RecordHeader`.
    """
    parts: list[str] = []
    add = parts.append
    for s_us, e_us, kind, phase, rec in p.intervals:
        if rec is None:
            head, tail = _phase_fragments(kind, phase)  # type: ignore[arg-type] # a phase piece's slot holds its phase
            add(f'{head}{s_us},"end_us":{e_us}{tail}')
        else:
            m: OpMeta = rec[META]
            nbytes = rec[NBYTES]
            size = "" if nbytes is None else f',"bytes":{nbytes}'
            wait = "" if phase is None else f',"wait_us":{phase}'
            add(f'{m.head}{s_us},"end_us":{e_us}{m.middle}{rec[SEQ]}{size}{wait}{m.tail}')
    stats = f',"stats":{_JSON(p.stats)}' if p.stats else ""
    loop = "" if st.user_step is None else f',"user_step":{st.user_step}'
    if st.gap_ns is not None:
        loop += f',"gap_before_us":{st.gap_ns // 1000},"between_steps":{_JSON(between_us(st.between_ns))}'
    if st.runqueue_wait_ns is not None:
        loop += f',"runqueue_wait_us":{st.runqueue_wait_ns // 1000}'
    if (in_compute := compute_runqueue_wait_us(st)) is not None:
        loop += f',"compute_runqueue_wait_us":{in_compute}'
    if (in_data := phase_runqueue_wait_us(st, st.data_rq_ns)) is not None:
        loop += f',"data_runqueue_wait_us":{in_data}'
    if (in_optimizer := phase_runqueue_wait_us(st, st.optimizer_rq_ns)) is not None:
        loop += f',"optimizer_runqueue_wait_us":{in_optimizer}'
    if st.on_cpu_ns is not None:
        loop += f',"on_cpu_us":{st.on_cpu_ns // 1000}'
    if st.raised is not None:
        loop += f',"raised":{_JSON(st.raised)}'
    text = (
        f'{header.before_step}{st.step}{header.after_step},"start_us":{p.start_us},"end_us":{p.end_us},'
        f'"intervals":[{",".join(parts)}]{stats},"gpu_util":null{loop},"sdk":{_JSON(sdk)}}}'
    )
    return text.encode()


class RssPeak:
    """Peak resident set size of this process during a step, from ``/proc`` (Linux).

    ``reset`` writes ``5`` to ``/proc/self/clear_refs``, which resets the peak (``VmHWM``); ``read`` returns
    ``VmHWM`` from ``/proc/self/status`` in bytes. Where the reset is not permitted, the peak is not reported (a
    lifetime peak would mislead). Both files stay open (a path lookup under ``/proc`` costs more than the read); they
    are opened again in a forked child, which must neither reset nor read its parent's peak.
    """

    def __init__(self) -> None:
        """Probe whether ``/proc/self/clear_refs`` exists (Linux)."""
        self._ok = os.path.exists("/proc/self/clear_refs")  # noqa: PTH110 - a /proc probe, not a path of ours
        self._pid = 0
        self._clear = -1
        self._status = -1

    def _open(self) -> None:
        self.close()
        self._clear = os.open("/proc/self/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
        self._status = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
        self._pid = os.getpid()

    def reset(self) -> None:
        """Reset the peak; on failure stop reporting it."""
        if not self._ok:
            return
        try:
            if self._pid != os.getpid():
                self._open()
            os.write(self._clear, b"5")
        except OSError:
            self._ok = False
            self.close()

    def read(self) -> int | None:
        """Peak RSS since the last reset, bytes; ``None`` when not available."""
        if not self._ok or self._pid != os.getpid():
            return None
        try:
            text = os.pread(self._status, 1 << 16, 0)
        except OSError:
            return None
        i = text.find(b"VmHWM:")
        if i < 0:
            return None
        return int(text[i + 6 : text.index(b"kB", i)].strip()) * 1024

    def close(self) -> None:
        """Close the files (a later :meth:`reset` opens them again)."""
        for fd in (self._clear, self._status):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._clear = self._status = -1
        self._pid = 0


_FORKS = [0]
"""How many times this process's line has forked (0 in the first process): a file opened before a fork belongs to
another process's thread. Counted at fork, so that the hot path need not ask the kernel for its pid."""
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _FORKS.__setitem__(0, _FORKS[0] + 1))


class SchedStat:
    """How long the calling thread has run on a CPU, and waited for one while runnable (the run delay), ns.

    ``/proc/thread-self/schedstat`` holds three numbers: time on a CPU (ns, ``sum_exec_runtime``), time runnable on a
    run queue but not running (ns, the kernel's ``sched_info.run_delay``) and timeslices
    (Documentation/scheduler/sched-stats.rst). Read at a step's start and end, the second is the time the host's
    scheduler took from the training thread: on shared or oversubscribed cores it explains a "slow" rank that did no
    more work than its peers. The first tells a rank that was slow while running (a slower or shared core: on a CPU
    the whole time) from one that was slow while off a CPU (blocked, asleep, or waiting for a device). The file stays
    open (about 5 µs a read instead of a path lookup under ``/proc``) and belongs to the thread that opened it: read
    from another thread or a forked child, it answers ``None``, never another thread's numbers. :meth:`run_delay` is
    the read of every phase boundary: the run delay alone, about 1.3 µs here against 2 µs for :meth:`read`.
    """

    def __init__(self) -> None:
        """Nothing opened yet: the first :meth:`read` opens the file in the thread that reads."""
        self._fd = -1
        self._owner: tuple[int, int] | None = None
        self._ok = True

    def read(self) -> tuple[int, int] | None:
        """The calling thread's time on a CPU and run delay so far, ns; ``None``: not available (other OS, thread)."""
        if not self._ok:
            return None
        owner = (_FORKS[0], threading.get_ident())
        try:
            if self._owner is None or self._owner[0] != owner[0]:
                self.close()
                self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
                self._owner = owner
            elif self._owner != owner:
                return None
            fields = os.pread(self._fd, 128, 0).split()
            return int(fields[0]), int(fields[1])
        except (OSError, ValueError, IndexError):
            self._ok = False
            self.close()
            return None

    def run_delay(self) -> int:
        """The calling thread's run delay so far, ns; -1 where :meth:`read` would answer ``None``."""
        if self._owner != (_FORKS[0], threading.get_ident()):
            sched = self.read()  # opens the file, or refuses another thread's
            return -1 if sched is None else sched[1]
        try:
            return int(os.pread(self._fd, 128, 0).split()[1])
        except (OSError, ValueError, IndexError):
            self._ok = False
            self.close()
            return -1

    def close(self) -> None:
        """Close the file (a later :meth:`read` opens it again, in the thread that reads)."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = -1
        self._owner = None

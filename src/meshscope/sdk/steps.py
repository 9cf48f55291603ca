"""What one step collects on the hot path, and how it becomes a ``meshscope.step/1`` record afterwards.

Why it exists: the tracker's hot path only appends marks and small objects (:class:`Op`, :class:`StepState`); all
interval arithmetic -- resolving marks to host microseconds, merging the windows in which the host was blocked in
communication and cutting them out of compute, sorting, building the record -- happens here, once per step, after
the step has ended. This module must not import torch and must not touch process-wide state.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed import Work
    from torch.futures import Future

    from meshscope.sdk.clocks import HostClock, Mark

MERGE_GAP_US: Final = 20
"""Blocked windows closer than this many µs are merged (the Python between two waits is not compute)."""
DEVICE_KINDS: Final = frozenset({"compute", "optimizer"})
"""Interval kinds whose marks are device marks and from which blocked windows are cut."""


class Op:
    """One captured collective or point-to-point operation (mutable: its end arrives later, maybe on another thread)."""

    __slots__ = (
        "axis",
        "end",
        "group",
        "group_size",
        "issued_ns",
        "kind",
        "nbytes",
        "op",
        "peer",
        "seq",
        "start",
        "work",
    )

    mark: Callable[[], Mark] = time.perf_counter_ns
    """How a completion is marked (replaced by the CUDA clock's event recorder on GPU)."""

    def __init__(
        self,
        *,
        kind: str,
        axis: str,
        op: str,
        group: str,
        seq: int,
        nbytes: int | None,
        group_size: int | None,
        peer: int | None,
        start: Mark,
    ) -> None:
        """An operation issued at mark ``start``; its end comes later."""
        self.kind = kind
        self.axis = axis
        self.op = op
        self.group = group
        self.seq = seq
        self.nbytes = nbytes
        self.group_size = group_size
        self.peer = peer
        self.start = start
        self.end: Mark | None = None
        self.issued_ns = 0
        self.work: Work | None = None
        """The backend's handle of an asynchronous operation until it ends (for a late completion callback)."""

    def done(self, _future: Future[object] | None = None) -> None:
        """Completion callback (``Future.then``): the first end wins."""
        if self.end is None:
            self.end = Op.mark()


class StepState:
    """Everything one step collects until its record is built."""

    __slots__ = (
        "attention",
        "end_mark",
        "end_ns",
        "finished_at",
        "longest",
        "ops",
        "peak_memory_bytes",
        "segments",
        "sequences",
        "start_mark",
        "start_ns",
        "step",
        "tokens",
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
        self.ops: list[Op] = []
        self.windows: list[list[Mark]] = []
        self.attention: list[tuple[Mark, Mark]] = []
        self.tokens: int | None = None
        self.sequences: int | None = None
        self.longest: int | None = None
        self.work: float | None = None
        self.peak_memory_bytes: int | None = None
        self.finished_at = 0


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


def subtract_windows(a: int, b: int, windows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[a, b]`` minus the union of sorted, disjoint ``windows``; empty pieces are left out."""
    pieces: list[tuple[int, int]] = []
    cur = a
    for w0, w1 in windows:
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


def build_record(  # noqa: C901, PLR0912 - one pass over each kind of mark
    st: StepState, *, clock: HostClock, header: dict[str, Any], device: bool
) -> tuple[dict[str, Any], int]:
    """The ``meshscope.step/1`` record of a finished step, and the number of operations left out as incomplete.

    Args:
        st: the step.
        clock: resolves marks to host microseconds.
        header: the record's identity fields in schema order (``schema`` .. ``gpu``), the same for every step.
        device: marks may be CUDA events (left out when not yet completed).
    """
    to_us = clock.to_us
    start_us = clock.host_ns_to_us(st.start_ns)
    end_us = clock.host_ns_to_us(st.end_ns)
    if device and st.end_mark is not None and clock.ready(st.end_mark):
        end_us = max(end_us, to_us(st.end_mark))
    windows = merge_windows(
        sorted(
            (max(to_us(w[0]), start_us), to_us(w[1]))
            for w in st.windows
            if w[1] is not None and (not device or (clock.ready(w[0]) and clock.ready(w[1])))
        )
    )
    intervals: list[dict[str, Any]] = []
    incomplete = 0
    for kind, phase, a, b in st.segments:
        a_us, b_us = to_us(a), to_us(b)
        b_us = max(a_us, b_us)
        pieces = subtract_windows(a_us, b_us, windows) if kind in DEVICE_KINDS else [(a_us, b_us)]
        for p0, p1 in pieces:
            iv: dict[str, Any] = {"kind": kind, "start_us": p0, "end_us": p1}
            if phase is not None:
                iv["phase"] = phase
            intervals.append(iv)
    for rec in st.ops:
        if rec.end is None or (device and not (clock.ready(rec.start) and clock.ready(rec.end))):
            incomplete += 1
            continue
        s_us = to_us(rec.start)
        iv = {
            "kind": rec.kind,
            "start_us": s_us,
            "end_us": max(s_us, to_us(rec.end)),
            "axis": rec.axis,
            "op": rec.op,
            "group": rec.group,
            "seq": rec.seq,
        }
        if rec.nbytes is not None:
            iv["bytes"] = rec.nbytes
        if rec.group_size is not None:
            iv["group_size"] = rec.group_size
        if rec.peer is not None:
            iv["peer"] = rec.peer
        intervals.append(iv)
    intervals.sort(key=lambda d: (d["start_us"], d["end_us"]))
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
        stats["attention_us"] = sum(
            max(0, to_us(b) - to_us(a)) for a, b in st.attention if not device or (clock.ready(a) and clock.ready(b))
        )
    if st.peak_memory_bytes is not None:
        stats["peak_memory_bytes"] = st.peak_memory_bytes
    record = dict(header)
    record["step"] = st.step
    record["start_us"] = start_us
    record["end_us"] = end_us
    record["intervals"] = intervals
    if stats:
        record["stats"] = stats
    record["gpu_util"] = None
    return record, incomplete


class RssPeak:
    """Peak resident set size of this process during a step, from ``/proc`` (Linux).

    ``reset`` writes ``5`` to ``/proc/self/clear_refs``, which resets the peak (``VmHWM``); ``read`` returns
    ``VmHWM`` in bytes. Where the reset is not permitted, the peak is not reported (a lifetime peak would mislead).
    """

    def __init__(self) -> None:
        """Probe whether ``/proc/self/clear_refs`` exists (Linux)."""
        self._ok = os.path.exists("/proc/self/clear_refs")  # noqa: PTH110 - a /proc probe, not a path of ours

    def reset(self) -> None:
        """Reset the peak; on failure stop reporting it."""
        if not self._ok:
            return
        try:  # /proc/self resolves per open, on purpose: a forked child must not reset its parent's peak
            fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
            try:
                os.write(fd, b"5")
            finally:
                os.close(fd)
        except OSError:
            self._ok = False

    def read(self) -> int | None:
        """Peak RSS since the last reset, bytes; ``None`` when not available."""
        if not self._ok:
            return None
        try:
            fd = os.open("/proc/self/status", os.O_RDONLY)
            try:
                text = os.read(fd, 1 << 16)
            finally:
                os.close(fd)
        except OSError:
            return None
        i = text.find(b"VmHWM:")
        if i < 0:
            return None
        return int(text[i + 6 : text.index(b"kB", i)].strip()) * 1024

"""Time marks on the training hot path, resolved to host-clock microseconds later.

Every interval the SDK records is a pair of *marks*. On CPU a mark is ``time.perf_counter_ns()`` (a few tens of
nanoseconds), mapped to the host's wall clock once, so that ranks on one host share a time base. On a GPU, marks of
device work are CUDA events recorded on the current stream: recording one never synchronises, and a step's events
are read **one step late** (when :meth:`CudaClock.ready` says they have all completed), converted through an anchor
event whose host time was measured once with a single synchronisation at start-up (and again every
``recalibrate_steps`` steps, to follow clock drift).

This module must not synchronise a device on the hot path and must not import torch at module level (the CUDA clock
receives the torch module from its caller).
"""

# ruff: noqa: ANN401 - CUDA events and the torch module are passed through untyped to keep torch out of imports

from __future__ import annotations

import time
from typing import Any

Mark = Any
"""An ``int`` (host ``perf_counter_ns``) or a device event with ``query()`` and ``elapsed_time()``."""


class HostClock:
    """Marks from ``time.perf_counter_ns``, mapped to host wall-clock microseconds with one offset."""

    device = False
    """Whether device marks are CUDA events (``False``: everything is host time)."""

    def __init__(self) -> None:
        """Measure the offset between the monotonic counter and the wall clock once."""
        pc1 = time.perf_counter_ns()
        wall = time.time_ns()
        pc2 = time.perf_counter_ns()
        self.offset_ns = wall - (pc1 + pc2) // 2
        """Wall-clock ns minus ``perf_counter_ns``: host marks map to wall time by adding it."""

    @staticmethod
    def host_mark() -> int:
        """A host mark (now)."""
        return time.perf_counter_ns()

    def device_mark(self) -> Mark:
        """A mark on the device timeline; on the host clock, the same as :meth:`host_mark`."""
        return time.perf_counter_ns()

    def ready(self, mark: Mark) -> bool:  # noqa: ARG002 - the device clock needs the mark
        """Whether ``mark`` can be resolved without waiting (always, for host marks)."""
        return True

    def to_us(self, mark: Mark) -> int:
        """Host wall-clock microseconds of a host mark."""
        return (int(mark) + self.offset_ns) // 1000

    def host_ns_to_us(self, ns: int) -> int:
        """Host wall-clock microseconds of a ``perf_counter_ns`` value."""
        return (ns + self.offset_ns) // 1000

    def on_step_start(self, step_index: int) -> None:
        """Hook for clocks that recalibrate between steps (none here)."""


class CudaClock(HostClock):
    """Device marks as CUDA timing events on the current stream, read one step late.

    The conversion ``host_us(event) = anchor_host_us + anchor.elapsed_time(event) * 1000`` needs one synchronisation
    per calibration: at construction and then every ``recalibrate_steps`` steps, at a step boundary.
    """

    device = True

    def __init__(self, torch_module: Any, *, recalibrate_steps: int = 1000) -> None:
        """Calibrate the anchor (one ``Event.synchronize``).

        Args:
            torch_module: the ``torch`` module (passed in so that this module never imports torch).
            recalibrate_steps: steps between two calibrations; 0 disables recalibration.
        """
        super().__init__()
        self._torch = torch_module
        self._recalibrate_steps = recalibrate_steps
        self._anchor: Any = None
        self._anchor_host_ns = 0
        self._calibrate()

    def _event(self) -> Any:
        return self._torch.cuda.Event(enable_timing=True)

    def _calibrate(self) -> None:
        anchor = self._event()
        anchor.record()
        anchor.synchronize()
        self._anchor_host_ns = time.perf_counter_ns()
        self._anchor = anchor

    def device_mark(self) -> Mark:
        """A CUDA event recorded now on the current stream (no synchronisation)."""
        ev = self._event()
        ev.record()
        return ev

    def ready(self, mark: Mark) -> bool:
        """Whether ``mark`` is a host mark or an event that has completed (``Event.query``, non-blocking)."""
        if isinstance(mark, int):
            return True
        return bool(mark.query())

    def to_us(self, mark: Mark) -> int:
        """Host wall-clock microseconds of a host mark or a completed event."""
        if isinstance(mark, int):
            return super().to_us(mark)
        offset_ms = float(self._anchor.elapsed_time(mark))
        return self.host_ns_to_us(self._anchor_host_ns + round(offset_ms * 1e6))

    def on_step_start(self, step_index: int) -> None:
        """Recalibrate every ``recalibrate_steps`` steps (one synchronisation, at a step boundary)."""
        if self._recalibrate_steps and step_index and step_index % self._recalibrate_steps == 0:
            self._calibrate()

"""The tracker's GPU path (CUDA timing events, read one step late) against an emulated device, on this CPU machine.

No GPU can run here, and the path that marks device work with CUDA events (``meshscope.sdk.clocks.CudaClock``,
``StepIntervals._device_marks``, the tracker's deferred flush) runs on every GPU rank. :class:`_Device` stands in for
one CUDA stream with the semantics the SDK relies on (the CUDA runtime's ``cudaEventRecord``, ``cudaEventQuery``,
``cudaEventSynchronize`` and ``cudaEventElapsedTime``, as ``torch.cuda.Event`` exposes them): an event recorded on a
busy device completes ``lag`` after the host recorded it, in stream order; ``query()`` never blocks;
``synchronize()`` blocks the host until the event completed; ``elapsed_time()`` raises unless both events completed.
Which events have completed is up to the test (:meth:`_Device.catch_up`), so that what is sent when does not depend
on this machine's speed. What it cannot show: a real device's clock drift, several streams, CUDA graphs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from invariants import check_records, read_lines
from meshscope import sdk
from meshscope.sdk.tracker import MAX_DEFERRED_STEPS
from runs import listener_messages

if TYPE_CHECKING:
    import socket
    from pathlib import Path

LAG_NS = 50_000_000
"""How far the emulated device runs behind the host while busy."""


class _Device:
    """One stream of an emulated GPU: busy, its work completes ``LAG_NS`` after the host queued it, in order."""

    def __init__(self) -> None:
        self.busy = False
        self.last_done_ns = 0
        self.completed_ns = 0
        """Events done by then have completed (what the test let the device finish)."""
        self.syncs = 0
        self.events = 0

    def catch_up(self) -> None:
        """The device finishes everything queued so far."""
        self.completed_ns = max(self.completed_ns, self.last_done_ns)


class _Event:
    """``torch.cuda.Event(enable_timing=True)`` on :class:`_Device`."""

    def __init__(self, device: _Device) -> None:
        self.device = device
        self.done_ns: int | None = None

    def record(self, stream: object = None) -> None:
        d = self.device
        now = time.perf_counter_ns()
        self.done_ns = max(now + (LAG_NS if d.busy else 0), d.last_done_ns)
        d.last_done_ns = self.done_ns
        d.events += 1
        if not d.busy:
            d.completed_ns = max(d.completed_ns, self.done_ns)

    def query(self) -> bool:
        return self.done_ns is None or self.done_ns <= self.device.completed_ns

    def synchronize(self) -> None:
        d = self.device
        d.syncs += 1
        if self.done_ns is not None:
            while time.perf_counter_ns() < self.done_ns:  # the host blocks until the device got there
                time.sleep(0.001)
            d.completed_ns = max(d.completed_ns, self.done_ns)

    def elapsed_time(self, end: _Event) -> float:
        if self.done_ns is None or end.done_ns is None or not (self.query() and end.query()):
            raise RuntimeError("CUDA error: device not ready")  # what torch raises for an event not yet completed
        return (end.done_ns - self.done_ns) / 1e6


class _Cuda:
    def __init__(self, device: _Device) -> None:
        self.device = device

    def Event(self, *, enable_timing: bool = False) -> _Event:
        assert enable_timing
        return _Event(self.device)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def max_memory_allocated() -> int:
        return 3 << 30

    @staticmethod
    def reset_peak_memory_stats() -> None:
        return None


class _Torch:
    """What the tracker asks of ``torch`` for the device: ``torch.cuda``."""

    def __init__(self, device: _Device) -> None:
        self.cuda = _Cuda(device)


def _tracker_on(device: _Device, path: Path) -> sdk.Tracker:
    tracker = sdk.Tracker(sdk.TrackerSettings(collector=f"unix:{path}", job="dev"))
    tracker._torch = _Torch(device)  # the process's CUDA: the emulated GPU (the clock is chosen at step 0)
    return tracker


def _records(sock: socket.socket) -> list[dict[str, Any]]:
    return [m for m in listener_messages(sock) if m["schema"] == "meshscope.step/1"]


def _train_step(tracker: sdk.Tracker, step: int) -> tuple[int, int]:
    """One step of forward, backward and optimizer; the ``perf_counter_ns`` bracketing the moment forward began."""
    with tracker.step(step):
        before = time.perf_counter_ns()
        with tracker.phase("forward"):
            after = time.perf_counter_ns()
            time.sleep(0.003)
        with tracker.phase("backward"):
            time.sleep(0.003)
        with tracker.phase("optimizer"):
            time.sleep(0.001)
    return before, after


def test_device_work_is_read_one_step_late_on_the_device_timeline(listener) -> None:
    sock, path = listener
    device = _Device()
    tracker = _tracker_on(device, path)
    device.busy = True
    sent, forward_began = [], []
    for step in range(6):
        device.catch_up()  # everything queued before this step has run
        forward_began.append(_train_step(tracker, step))
        sent.append(tracker.counters().records_sent)
    clock = tracker._ops.clock
    calibration_error_ns = clock._anchor_host_ns - clock._anchor.done_ns
    device.catch_up()
    tracker.close()
    # A step's record waits for its device work: at the end of step k only steps before it can have gone out, and
    # they have (the device finished them before step k began). No synchronisation but the clock's calibration.
    assert sent == [0, 1, 2, 3, 4, 5]
    assert device.syncs == 1
    records = _records(sock)
    assert [r["step"] for r in records] == list(range(6))
    assert tracker.counters().incomplete_ops == 0
    assert tracker.counters().hook_errors == 0
    assert check_records(records, every_step=("optimizer",)) == 6
    host_us = clock.host_ns_to_us  # the clock's own map of host marks to wall-clock µs
    for record, (before, after) in zip(records, forward_began, strict=True):
        forward = next(iv for iv in record["intervals"] if iv.get("phase") == "forward")
        # on the device timeline: where the host queued it, LAG later (plus the calibration's own error, >= 0)
        earliest, latest = host_us(before + LAG_NS), host_us(after + LAG_NS + calibration_error_ns)
        assert earliest <= forward["start_us"] <= latest, record["step"]
        assert record["end_us"] >= forward["end_us"]  # the step lasts until its device work ends
        assert record["start_us"] <= host_us(before)  # it starts when the host opened it
        assert record["gpu"] == 0
        assert record["stats"]["peak_memory_bytes"] == 3 << 30


def test_a_device_that_falls_behind_costs_the_late_work_not_the_record(listener) -> None:
    # The host runs more than MAX_DEFERRED_STEPS steps ahead of the device (no synchronising call in the loop): the
    # oldest pending step is written with what has completed; what has not is left out and counted, and the record
    # is still a valid one. Before, a phase whose event had not completed made the record fail as a whole (the
    # elapsed time of an event not yet completed raises) and the step was lost.
    sock, path = listener
    device = _Device()
    tracker = _tracker_on(device, path)
    device.busy = True
    steps = MAX_DEFERRED_STEPS + 3
    for step in range(steps):
        _train_step(tracker, step)  # the device never catches up inside the loop
    counters = tracker.counters()
    assert counters.hook_errors == 0
    assert counters.records_sent == steps - MAX_DEFERRED_STEPS  # the oldest ones, forced out
    device.catch_up()
    tracker.close()
    records = _records(sock)
    assert [r["step"] for r in records] == list(range(steps))
    assert check_records(records) == steps
    forced, on_time = records[: steps - MAX_DEFERRED_STEPS], records[steps - MAX_DEFERRED_STEPS :]
    for record in forced:  # none of their device work had completed: no device phase in them
        assert not [iv for iv in record["intervals"] if iv.get("phase") in ("forward", "backward")], record
    for record in on_time:  # flushed at close, after the device caught up: every phase
        phases = {iv.get("phase") for iv in record["intervals"]}
        assert {"forward", "backward"} <= phases, record
        assert any(iv["kind"] == "optimizer" for iv in record["intervals"]), record
    assert tracker.counters().hook_errors == 0


def _ddp_on_the_device(rank: int, world: int) -> dict[str, int]:
    """A DDP loop whose rank's CUDA is an emulated device that finishes each step's work only as the next begins."""
    device = _Device()
    tracker = sdk.tracker_from_env()
    tracker._torch = _Torch(device)
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    device.busy = True
    sent = []
    for step in range(6):
        device.catch_up()
        with tracker.step(step):
            with tracker.phase("forward"):
                loss = ddp(torch.ones(16, 256)).square().mean()
            with tracker.phase("backward"):
                loss.backward()
            with tracker.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
        sent.append(tracker.counters().records_sent)
    device.catch_up()
    tracker.close()
    counters = tracker.counters()
    return {
        "sent_after_each_step": sent,
        "hook_errors": counters.hook_errors,
        "incomplete_ops": counters.incomplete_ops,
        "syncs": device.syncs,
    }


def test_ddp_bucket_reductions_on_the_device_timeline_keep_the_invariants(fork_job) -> None:
    # DDP's gradient all-reduces marked with (emulated) CUDA events: their issue, completion and the reducer's wait
    # are device marks, read a step late. Every record keeps the real-job invariants (fork_job checks them: a
    # collective's waiting never inside compute, the optimizer in every step), and every bucket's reduction ends
    # before the optimizer starts, on the device timeline as on the host's.
    job = fork_job(_ddp_on_the_device, 2, env={"MESHSCOPE_LAYOUT": "dp=2"}, every_step=("optimizer",))
    for result in job.results:
        assert result["sent_after_each_step"] == [0, 1, 2, 3, 4, 5]
        assert (result["hook_errors"], result["incomplete_ops"], result["syncs"]) == (0, 0, 1)
    records = read_lines(job.records_path)
    assert sorted((r["rank"], r["step"]) for r in records) == [(rank, step) for rank in (0, 1) for step in range(6)]
    for record in records:
        buckets = [iv for iv in record["intervals"] if iv["kind"] == "comm" and iv["axis"] == "dp"]
        assert buckets, record  # DDP's reduction, every step
        optimizer = min(iv["start_us"] for iv in record["intervals"] if iv["kind"] == "optimizer")
        assert all(iv["end_us"] <= optimizer for iv in buckets), (record["rank"], record["step"])

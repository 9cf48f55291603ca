"""The tracker in this process (one rank, no process group): patching, dropping, stats, attention, phases."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from meshscope import sdk
from meshscope.records import IntervalKind, Phase, _parse_record
from meshscope.sdk import capture
from meshscope.sdk.transport import decode

if TYPE_CHECKING:
    import socket


def _patched_objects() -> dict[str, object]:
    return {
        "ProcessGroup.allreduce": dist.ProcessGroup.__dict__["allreduce"],
        "ProcessGroup.send": dist.ProcessGroup.__dict__["send"],
        "Work.wait": dist.Work.__dict__["wait"],
        "functional.all_reduce": torch.ops._c10d_functional.__dict__.get(
            "all_reduce", torch.ops._c10d_functional.all_reduce
        ),
        "functional.wait_tensor": torch.ops._c10d_functional.wait_tensor,
        "sdpa": F.scaled_dot_product_attention,
        "DDP.__init__": DDP.__dict__["__init__"],
    }


def test_disabled_sdk_is_a_null_tracker_that_patches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSCOPE_DISABLE", "1")
    before = _patched_objects()
    tracker = sdk.tracker_from_env()
    assert isinstance(tracker, sdk.NullTracker)
    assert tracker.enabled is False
    with tracker.step(0), tracker.phase("forward"):
        tracker.data_stats(sequence_lengths=[3, 5])
        tracker.register_groups({"tp": None})
    tracker.close()
    assert not capture.installed()
    after = _patched_objects()
    assert all(after[k] is before[k] for k in before), [k for k in before if after[k] is not before[k]]
    assert tracker.counters() == sdk.TrackerCounters()


def test_real_tracker_patches_every_road_and_close_restores_them() -> None:
    before = _patched_objects()
    tracker = sdk.Tracker(sdk.TrackerSettings(collector=None))
    during = _patched_objects()
    assert [k for k in before if during[k] is before[k]] == []  # every road is tapped
    tracker.close()
    after = _patched_objects()
    assert [k for k in before if after[k] is not before[k]] == []
    assert not capture.installed()


def _drain(sock: socket.socket) -> list[dict]:
    out = []
    while True:
        try:
            out.append(decode(sock.recv(1 << 22)))
        except BlockingIOError:
            return out


def _records(messages: list[dict]) -> list[dict]:
    return [m for m in messages if m["schema"] == "meshscope.step/1"]


def test_full_queue_drops_records_without_blocking_and_the_next_record_reports_them(listener) -> None:
    sock, path = listener
    tracker = sdk.Tracker(sdk.TrackerSettings(collector=f"unix:{path}", job="q"))
    step = 0
    while tracker.counters().records_dropped == 0 and step < 5000:  # the kernel queue is finite: drops must come
        with tracker.step(step):
            pass
        step += 1
    dropped = tracker.counters().records_dropped
    sent = tracker.counters().records_sent
    assert dropped == 1
    assert sent + dropped == step
    assert len(_records(_drain(sock))) == sent
    with tracker.step(step):
        pass
    (last,) = _records(_drain(sock))
    assert last["step"] == step
    assert last["sdk"]["records_dropped"] == 1
    assert tracker.counters().records_sent == sent + 1
    tracker.close()


def test_a_compiled_model_with_attention_is_traced_whole_and_computes_the_same(listener) -> None:
    # torch.compile traces into the attention wrapper: its clock reads broke the graph in two at every attention
    # call (nanoGPT compiles by default), so a compiled model ran differently because meshscope was there.
    import torch._dynamo  # noqa: PLC0415

    sock, path = listener
    tracker = sdk.Tracker(sdk.TrackerSettings(collector=f"unix:{path}", job="compiled", rank=0, world_size=1))

    def attend(x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x * w for w in (1.0, 0.5, 2.0))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).relu()

    x = torch.randn(2, 4, 16, 8)
    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="eager", fullgraph=True)  # fullgraph: a graph break raises
    with tracker.step(0):
        out = compiled(x)
    tracker.close()
    assert torch.equal(out, attend(x))
    (raw,) = _records(_drain(sock))
    # Dynamo's eager backend calls the attention builtin itself: not timed (AOTAutograd's backends and inductor call
    # the fused kernel by overload, which is: tests/sdk/test_capture.py)
    assert _parse_record(raw, "datagram").stats.attention_us is None


def test_stats_attention_and_phases_land_in_the_record(listener) -> None:
    sock, path = listener
    tracker = sdk.Tracker(sdk.TrackerSettings(collector=f"unix:{path}", job="stats", rank=0, world_size=1))
    q = torch.randn(2, 4, 6, 8, requires_grad=True)
    k = torch.randn(2, 4, 6, 8, requires_grad=True)
    v = torch.randn(2, 4, 6, 8, requires_grad=True)
    expected = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach())
    with tracker.step(7):
        with tracker.phase("data"):
            tracker.data_stats(sequence_lengths=[3, 5])
            tracker.data_stats(sequence_lengths=torch.tensor([4]))
        with tracker.phase("compute"):
            with tracker.phase("forward"):
                out = F.scaled_dot_product_attention(q, k, v)
            with tracker.phase("backward"):
                out.sum().backward()
        with tracker.phase("no-such-phase"):  # a typo is logged and counted, never raised
            pass
        with tracker.phase("optimizer"):
            pass
    messages = _drain(sock)
    assert messages[0]["event"] == "hello"
    (raw,) = _records(messages)
    rec = _parse_record(raw, "datagram")  # the record parses under the shared schema
    assert rec.step == 7
    assert rec.job == "stats"
    assert rec.stats.tokens == 12
    assert rec.stats.sequences == 3
    assert rec.stats.longest_sequence == 5
    assert rec.stats.attention_work == 3 * 3 + 5 * 5 + 4 * 4
    assert rec.stats.attention_us is not None  # forward and backward spans were recorded
    assert torch.allclose(out.detach(), expected)  # the wrapper does not change attention's result
    kinds = [(iv.kind, iv.phase) for iv in rec.intervals]
    assert (IntervalKind.DATA, None) in kinds
    assert (IntervalKind.COMPUTE, Phase.FORWARD) in kinds
    assert (IntervalKind.COMPUTE, Phase.BACKWARD) in kinds
    assert (IntervalKind.OPTIMIZER, None) in kinds
    # the innermost phase owns the time: the outer compute phase never overlaps forward or backward
    inner = [iv for iv in rec.intervals if iv.phase is not None]
    outer = [iv for iv in rec.intervals if iv.kind is IntervalKind.COMPUTE and iv.phase is None]
    for o in outer:
        for i in inner:
            assert o.end_us <= i.start_us or i.end_us <= o.start_us
    assert tracker.counters().hook_errors == 1  # the unknown phase name
    assert tracker.counters().phases_outside_step == 0
    tracker.close()


def test_phases_outside_a_step_and_nested_steps_are_counted_not_raised() -> None:
    tracker = sdk.Tracker(sdk.TrackerSettings(collector=None))
    with tracker.phase("checkpoint"):
        pass
    with tracker.step(0), tracker.step(1):
        pass
    counters = tracker.counters()
    assert tracker._counters_dict() == counters.as_dict()  # what every record carries, built without the dataclass
    assert counters.phases_outside_step == 1
    assert counters.hook_errors == 1  # the nested step
    assert counters.records_dropped == 1  # one step recorded, no collector
    tracker.close()


@pytest.mark.parametrize(
    "dropout",
    [0.0, 0.5],
    ids=["fused-kernel-node-hooks", "composite-tensor-hooks"],  # dropout takes the math path on CPU
)
def test_attention_backward_is_bracketed_once_per_call(dropout: float) -> None:
    tracker = sdk.Tracker(sdk.TrackerSettings(collector=None))
    q, k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(3))
    with tracker.step(0):
        outs = [F.scaled_dot_product_attention(q * 1.0, k, v, dropout_p=dropout) for _ in range(3)]
        spans = tracker._step.attention
        assert len(spans) == 3  # forward: one span per call
        sum(o.sum() for o in outs).backward()
        assert len(spans) == 6  # backward: one more per call, each after its forward
        assert all(a <= b for a, b in spans)
        assert min(a for a, _ in spans[3:]) >= max(b for _, b in spans[:3])
    assert tracker.counters().hook_errors == 0
    tracker.close()


def test_attention_under_a_dispatch_mode_is_bracketed_once_per_call() -> None:
    # A Python dispatch mode (a FLOP counter, DTensor's dispatch, a debug mode) calls the fused kernel again by its
    # overload, which meshscope times for compiled code: inside an eager call or backward span it adds no span.
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

    class Passthrough(TorchDispatchMode):
        kernels = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if "scaled_dot_product" in str(func):
                Passthrough.kernels += 1
            return func(*args, **(kwargs or {}))

    tracker = sdk.Tracker(sdk.TrackerSettings(collector=None))
    q, k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(3))
    with tracker.step(0), Passthrough():
        outs = [F.scaled_dot_product_attention(q * 1.0, k, v) for _ in range(3)]
        sum(o.sum() for o in outs).backward()
        spans = len(tracker._step.attention)
    assert Passthrough.kernels >= 6  # the mode saw every fused forward and backward kernel
    assert spans == 6
    assert tracker.counters().hook_errors == 0
    tracker.close()

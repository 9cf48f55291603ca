"""Exact model-state and activation counts in the training process, and how they reach the collector."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

import pytest
import torch
from torch import nn

from meshscope import sdk
from meshscope.sdk.measuring import ActivationScope, count_model_state
from meshscope.sdk.transport import decode
from runs import socket_path

if TYPE_CHECKING:
    from pathlib import Path


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))


def test_model_state_counts_parameters_gradients_and_adamw_state() -> None:
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    params = 16 * 32 + 32 + 32 * 8
    assert count_model_state([model, model[0]], optimizer) == {  # a module given twice counts once
        "parameters": params,
        "parameter_bytes": 4 * params,
        "gradient_bytes": 4 * params,
        "optimizer_bytes": 2 * 4 * params,  # exp_avg and exp_avg_sq, fp32
        "optimizer_step_bytes": 3 * 4,  # one fp32 step counter per parameter tensor
        "optimizer_tensors": 3 * 3,
    }
    optimizer.zero_grad(set_to_none=True)
    assert count_model_state([model])["gradient_bytes"] == 0


def test_saved_activations_count_each_storage_once_and_leave_parameters_out() -> None:
    model = _mlp()
    x = torch.randn(4, 16, requires_grad=True)
    totals: list[int] = []
    with ActivationScope(model, totals.append):
        hidden = model[0](x)
        y = model[2](model[1](hidden))
        z = (hidden.view(2, 64) * hidden.view(2, 64)).sum()  # two views of one storage, saved twice by mul
    # The first Linear keeps its input x (4 x 16 fp32; its weight is a parameter), ReLU its output (4 x 32), the
    # second Linear its input, which is that same output; mul keeps two views of one storage, counted once (4 x 32).
    assert totals == [4 * 16 * 4 + 4 * 32 * 4 + 4 * 32 * 4]
    (y.sum() + z).backward()  # the tensors still work for backward: packing returned them unchanged
    assert x.grad is not None


def test_scopes_count_in_the_first_steps_only_and_never_outside_a_step(tmp_path: Path) -> None:
    path = socket_path("m", tmp_path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path.unlink(missing_ok=True)
    sock.bind(str(path))
    sock.setblocking(False)
    try:
        tracker = sdk.Tracker(sdk.TrackerSettings(collector=f"unix:{path}", job="m"))
        model = _mlp()
        with tracker.saved_activations("layers", model):  # outside a step: nothing
            model(torch.randn(4, 16))
        tracker.describe_job({"model": "tiny", "micro_batch_size": 2, "micro_batches": 1})
        for step in range(4):
            with tracker.step(step):
                for _ in range(2):
                    with tracker.saved_activations("layers", model):
                        model(torch.randn(4, 16, requires_grad=True))
        tracker.count_model_state([model])
        tracker.close()
        messages = []
        while True:
            try:
                messages.append(decode(sock.recv(1 << 22)))
            except BlockingIOError:
                break
    finally:
        sock.close()
        path.unlink(missing_ok=True)
    measured = [m["measurements"] for m in messages if m.get("event") == "measurements"]
    last = measured[-1]
    assert last["job"]["micro_batches"] == 1
    assert last["model_state"]["parameter_bytes"] == 4 * (16 * 32 + 32 + 32 * 8)
    per_scope = 4 * 16 * 4 + 4 * 32 * 4  # the input, and the ReLU output that the second Linear also keeps
    assert last["activations"]["layers"] == [
        {"step": 0, "scopes": 2, "bytes": 2 * per_scope},
        {"step": 1, "scopes": 2, "bytes": 2 * per_scope},
    ]
    assert tracker.counters().hook_errors == 0


def test_the_null_tracker_measures_nothing() -> None:
    # The tracker of MESHSCOPE_DISABLE=1: the same calls, and not a hook, a count or a byte sent.
    tracker = sdk.NullTracker()
    model = _mlp()
    assert tracker.enabled is False
    assert tracker.describe_job({"model": "tiny"}) is None
    assert tracker.count_model_state([model], None) is None
    x = torch.randn(4, 16, requires_grad=True)
    with tracker.saved_activations("layers", model) as scope:
        y = model(x)
    assert scope is None
    for module in model.modules():  # no hook left behind (the real scope adds saved-tensor hooks while it is open)
        assert not module._forward_hooks
        assert not module._forward_pre_hooks
        assert not module._backward_hooks
    y.sum().backward()  # the graph works as without meshscope
    assert x.grad is not None
    assert x.grad.shape == (4, 16)
    loader = [1, 2, 3]
    assert tracker.data(loader) is loader
    counters = tracker.counters()
    assert counters == type(counters)()  # all zero
    assert counters.hook_errors == 0


@pytest.mark.parametrize("module", [None, nn.Linear(2, 2)], ids=["no-module", "module"])
def test_a_scope_where_saved_tensor_hooks_are_disabled_counts_nothing_and_raises_nothing(module) -> None:
    totals: list[int] = []
    with torch.autograd.graph.disable_saved_tensors_hooks("not here"), ActivationScope(module, totals.append):
        (torch.randn(3, requires_grad=True) * 2).sum()
    assert totals == []

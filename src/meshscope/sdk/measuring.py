"""Exact counts of what a rank holds: model state from its modules and optimizer, activations from saved tensors.

Why it exists: the planner predicts, per GPU, the bytes of weights, gradients, optimizer state and activations per
micro-batch. A step record's ``peak_memory_bytes`` (peak RSS on CPU) cannot check those numbers: it mixes the runtime,
the allocator and every tensor. Here the training process counts them exactly:

* **model state** (:func:`count_model_state`): every parameter that requires a gradient, its ``.grad`` and every
  tensor of the optimizer's state, at the size this rank stores (the local shard of a DTensor, i.e. after FSDP2 and
  tensor-parallel sharding). Optimizer step counters (AdamW's ``step``) are counted apart from the moments.
* **activations** (:class:`ActivationScope`): inside a scope (a block's forward, a stage's output layer, the loss),
  ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd keeps for backward. Each distinct storage
  is counted once at its full size (views of one buffer share it); parameters and buffers are not activations and
  are left out. Packing returns the tensor itself, so nothing about the computation changes.

Imports torch: only a real tracker loads this module. Nothing here raises into the training loop (the tracker wraps
the calls).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Self

import torch

if TYPE_CHECKING:
    from collections.abc import Iterable
    from types import TracebackType

    from torch import Tensor, nn


def _local(t: Tensor) -> Tensor:
    """The tensor this rank stores: a DTensor's local shard, else the tensor."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _nbytes(t: Tensor) -> int:
    return int(_local(t).nbytes)


def count_model_state(modules: Iterable[nn.Module], optimizer: Any = None) -> dict[str, int]:  # noqa: ANN401 - any torch.optim.Optimizer
    """Bytes of parameters, gradients and optimizer state this rank holds now.

    Args:
        modules: the model parts on this rank (a parameter shared by two of them counts once).
        optimizer: a ``torch.optim.Optimizer`` (or ``None``); its ``state`` tensors are counted.

    Returns:
        ``parameters``, ``parameter_bytes``, ``gradient_bytes``, ``optimizer_bytes`` (state tensors other than step
        counters), ``optimizer_step_bytes`` (``step`` counters), ``optimizer_tensors``.
    """
    seen: set[int] = set()
    params = param_bytes = grad_bytes = 0
    for module in modules:
        for p in module.parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            params += int(_local(p).numel())
            param_bytes += _nbytes(p)
            if p.grad is not None:
                grad_bytes += _nbytes(p.grad)
    state_bytes = step_bytes = tensors = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                tensors += 1
                if key == "step":
                    step_bytes += _nbytes(value)
                else:
                    state_bytes += _nbytes(value)
    return {
        "parameters": params,
        "parameter_bytes": param_bytes,
        "gradient_bytes": grad_bytes,
        "optimizer_bytes": state_bytes,
        "optimizer_step_bytes": step_bytes,
        "optimizer_tensors": tensors,
    }


class ActivationScope:
    """Context manager: the bytes autograd saves for backward inside it, each storage once, parameters left out.

    ``done(nbytes)`` is called with the total when the scope exits (also when the body raised).
    """

    __slots__ = ("_active", "_done", "_excluded", "_hooks", "_seen", "total")

    def __init__(self, module: nn.Module | None, done: Any) -> None:  # noqa: ANN401 - a callable taking bytes
        """A scope whose parameters and buffers (of ``module``) are not counted; ``done`` receives the total."""
        self._done = done
        self._excluded: set[int] = set()
        if module is not None:
            for t in (*module.parameters(), *module.buffers()):
                self._excluded.add(_local(t).untyped_storage().data_ptr())
        self._seen: set[int] = set()
        self.total = 0
        self._active = False
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: Tensor) -> Tensor:
        try:
            if isinstance(t, torch.nn.Parameter):
                return t
            storage = _local(t).untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self._excluded and ptr not in self._seen:
                self._seen.add(ptr)
                self.total += int(storage.nbytes())
        except Exception:  # noqa: BLE001, S110 - a tensor we cannot size is left out, never an error in training
            pass
        return t

    def __enter__(self) -> Self:
        """Start counting (where saved-tensor hooks are disabled, nothing is counted and nothing fails)."""
        try:
            self._hooks.__enter__()
            self._active = True
        except Exception:  # noqa: BLE001, S110 - e.g. inside disable_saved_tensors_hooks: count nothing
            pass
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Stop counting and report the total (only when counting was on)."""
        if not self._active:
            return
        self._active = False
        try:
            self._hooks.__exit__(exc_type, exc, tb)
            self._done(self.total)
        except Exception:  # noqa: BLE001, S110 - never an error in training
            pass


def _unpack(t: Tensor) -> Tensor:
    return t

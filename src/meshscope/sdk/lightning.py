"""PyTorch Lightning: one callback gives a step record per optimizer step of a ``Trainer``, no loop to edit.

Exists because Lightning owns its training loop (``trainer.fit``): a script that uses it has no loop body to open
steps in. Its hooks say where each micro-batch begins, where forward, backward and the optimizer run, and what runs
between batches; :class:`MeshscopeCallback` turns them into the tracker's calls::

    from meshscope.sdk.lightning import MeshscopeCallback

    trainer = L.Trainer(accelerator="cpu", devices=4, strategy="ddp", callbacks=[MeshscopeCallback()])
    trainer.fit(model, train_loader, val_loader)

What each hook becomes (``docs/sdk.md`` §1.7):

- ``on_train_batch_start``: a step opens at the first micro-batch of an optimizer step, numbered as
  ``trainer.global_step``; every micro-batch of the accumulation window (``accumulate_grad_batches``) is in it, with
  DDP's all-reduce of the last one and FSDP's gathers. Within a micro-batch: ``forward`` until ``on_before_backward``,
  ``backward`` until ``on_after_backward``, ``compute`` until ``on_before_optimizer_step``, ``optimizer`` (clipping,
  which Lightning 2.x runs after that hook, the step, ``zero_grad``)
  until ``on_train_batch_end``. A micro-batch of token ids (a 2-D integer tensor, or a mapping with ``input_ids``)
  adds its shape to the step's data statistics (tokens, sequences, the longest sequence, padding included); any
  other batch adds nothing (call ``callback.tracker.data_stats(...)`` in ``training_step`` for those).
- ``on_train_batch_end``: when the optimizer stepped (``trainer.global_step`` moved) or the epoch's last batch ran,
  the step ends; otherwise the step goes on.
- The loader's fetches are timed where they run, by the tracker's own ``DataLoader`` timing (each ``next()`` of
  the loader's iterator), not from hook to hook: between ``on_train_batch_end`` and ``on_train_batch_start``
  Lightning also logs, decides on validation, broadcasts its stop flag and moves the batch to the device, which
  read as data wait (0.8 ms a step where the loader took 0.3: a starved loader on every quiet clean run). A fetch
  between steps (its prefetcher's) is held for the next step as a ``tracker.data`` fetch is; one inside an
  accumulation window is that step's ``data``; the rest of the window is the step's time outside phases.
  Validation is the ``eval`` phase (``on_validation_start`` .. ``on_validation_end``, the sanity check included), a
  checkpoint save the ``checkpoint`` phase (``Trainer.save_checkpoint``, wrapped on the trainer at
  ``on_train_start``: Lightning has no hook at the end of a save), on every rank (rank 0 writes, the others wait in
  the save's barrier); inside the step where one runs mid-accumulation.

It must never raise into the Trainer. It imports lightning (so :mod:`meshscope.sdk` itself never does).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback

from meshscope.sdk.tracker import Tracker
from meshscope.sdk.trainers import HookPhases

if TYPE_CHECKING:
    from meshscope.sdk.tracker import NullTracker

log = logging.getLogger("meshscope.sdk")


class MeshscopeCallback(Callback, HookPhases):
    """A ``lightning.pytorch.Callback`` that records the Trainer's optimizer steps with a meshscope tracker."""

    def __init__(self, tracker: Tracker | NullTracker | None = None) -> None:
        """Record with ``tracker``; by default :func:`~meshscope.sdk.tracker_from_env` (started here).

        Build the callback before ``trainer.fit``: the tracker then sees the process group, the DDP or FSDP wrap and
        every collective.
        """
        HookPhases.__init__(self, tracker, times_fetches=False)
        self._opened_at: int | None = None
        """``trainer.global_step`` when the open step began (``None``: no step open)."""
        self._own_save: Any = None
        """A ``save_checkpoint`` the trainer instance itself held before it was wrapped (put back at the end)."""

    # ------------------------------------------------------------------ steps

    def _end_step(self) -> None:
        self._leave()
        self._opened_at = None
        if self.tracker.in_step:
            self.tracker.end_step()

    # ------------------------------------------------------------------ hooks

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:  # noqa: ANN401, ARG002 - Lightning's types
        """Checkpoint saves are bracketed from now on."""
        self._bracket_checkpoints(trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:  # noqa: ANN401, ARG002
        """A micro-batch begins: the first of an optimizer step opens the step."""
        self._leave()
        if self._opened_at is None:
            self._opened_at = int(trainer.global_step)
            self.tracker.start_step(self._opened_at)
        self._count_tokens(batch)
        self._enter("forward")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:  # noqa: ANN401, ARG002
        """The loss is computed; backward runs next."""
        self._enter("backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:  # noqa: ANN401, ARG002
        """Backward ran; what runs until the optimizer's hook is compute."""
        self._enter("compute")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:  # noqa: ANN401, ARG002
        """The optimizer steps next (then ``zero_grad``: the same phase)."""
        self._enter("optimizer")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:  # noqa: ANN401, ARG002
        """A micro-batch ended: the step ends with its optimizer step (or the epoch's last batch), else goes on."""
        self._leave()
        if self._opened_at is None:
            return
        epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        last = bool(getattr(getattr(epoch_loop, "batch_progress", None), "is_last_batch", False))
        if int(trainer.global_step) > self._opened_at or last:
            self._end_step()
        # accumulating: the step goes on; the next micro-batch's fetch is its data (timed at the loader)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:  # noqa: ANN401, ARG002
        """Validation (or the sanity check) runs: ``eval``, inside the step when it runs mid-accumulation."""
        self._enter("eval")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:  # noqa: ANN401, ARG002
        """Validation ended."""
        self._leave()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:  # noqa: ANN401, ARG002
        """Training ended: no phase stays open, a step still open ends."""
        self._end_step()
        if getattr(getattr(trainer, "__dict__", {}).get("save_checkpoint"), "_meshscope", False):
            own = self._own_save
            if own is None:
                del trainer.save_checkpoint  # the Trainer's method again
            else:
                trainer.save_checkpoint = own  # what the instance held before

    # ------------------------------------------------------------------ checkpoints

    def _bracket_checkpoints(self, trainer: Any) -> None:  # noqa: ANN401
        """Time ``trainer.save_checkpoint`` as the ``checkpoint`` phase, on every rank.

        Lightning has no hook at the end of a save (``on_save_checkpoint`` comes while the checkpoint is assembled,
        before the file is written); ``Trainer.save_checkpoint`` is what ``ModelCheckpoint`` calls on every rank,
        and covers assembling, writing (rank 0) and the barrier after it. It is wrapped on this trainer only.
        """
        save = getattr(trainer, "save_checkpoint", None)
        if save is None or getattr(save, "_meshscope", False):
            return
        self._own_save = getattr(trainer, "__dict__", {}).get("save_checkpoint")

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            self._enter("checkpoint")
            try:
                return save(*args, **kwargs)
            finally:
                self._leave()

        save_checkpoint._meshscope = True  # type: ignore[attr-defined]  # noqa: SLF001 - our own mark
        try:
            trainer.save_checkpoint = save_checkpoint
        except Exception as exc:  # noqa: BLE001 - a Trainer that refuses: checkpoints stay unlabelled
            log.warning("meshscope: checkpoints not timed: %r", exc)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:  # noqa: ARG002, ANN401
        """Training failed: the step in progress ends (its record is sent, cut short), nothing stays open."""
        if isinstance(self.tracker, Tracker):
            self.tracker._cut_short(type(exception))  # noqa: SLF001 - the same package's
        self._end_step()

"""Hugging Face ``transformers.Trainer``: one callback gives a step record per optimizer step, no loop to edit.

Exists because a Trainer owns its training loop: a script that uses one has no loop body to open steps in. Its
callback events say where each optimizer step begins and ends, where the optimizer runs, and what the Trainer does
between steps (log, evaluate, save, fetch the next micro-batches); :class:`MeshscopeCallback` turns them into the
tracker's calls::

    from meshscope.sdk.huggingface import MeshscopeCallback

    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[MeshscopeCallback()])
    trainer.train()

What each event becomes (``docs/sdk.md`` §1.6):

- ``on_step_begin`` (the first micro-batch of an optimizer step): ``start_step(state.global_step)``, so a resumed
  run keeps its numbers; the step holds every micro-batch of the accumulation window, their collectives (DDP's
  all-reduces, FSDP's gathers) and attention. Until ``on_pre_optimizer_step`` the micro-batches' forward and backward
  passes are ``compute`` (the Trainer has no event between the two); from there to ``on_step_end`` (the optimizer,
  the scheduler, ``zero_grad``) ``optimizer``.
- ``on_step_end``: ``end_step()``. The Trainer then does, in this order, what its flags say (``should_log``,
  ``should_evaluate``, ``should_save``) and fetches the next step's micro-batches before ``on_step_begin``: logging
  (its loss gather, until ``on_log``) is left unlabelled, evaluation is the ``eval`` phase (until ``on_evaluate``), a
  save the ``checkpoint`` phase (until ``on_save``), all timed between steps; the fetch is held for the next step
  as a ``tracker.data`` fetch is: that step starts where the fetch began and carries it as its ``data`` interval.
- Every forward of the model inside a step (each micro-batch's): its ``input_ids`` shape is the step's data
  statistics (tokens, sequences, the longest sequence, padding included: a forward pre-hook registered at
  ``on_train_begin``, removed at ``on_train_end``, on the model and on the wrapper the Trainer calls, which runs
  outside ``torch.compile``'s graph); evaluation's forwards are between steps and not counted.

It must never raise into the Trainer. It imports transformers (so :mod:`meshscope.sdk` itself never does).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from transformers import TrainerCallback

from meshscope.sdk.capture import compiling, live_instances
from meshscope.sdk.tracker import NullTracker, Tracker
from meshscope.sdk.trainers import HookPhases

log = logging.getLogger("meshscope.sdk")

LOG, EVAL, CHECKPOINT, MAYBE_CHECKPOINT, FETCH = "log", "eval", "checkpoint", "checkpoint?", "fetch"
"""What the Trainer does between two steps, in its order; ``checkpoint?``: with ``save_strategy="best"`` the Trainer
decides after the evaluation whether to save, so the time from there is named when it ends: a save (``on_save``),
or the next step's fetch (``on_step_begin``)."""

_PHASE_OF_STAGE = {EVAL: "eval", CHECKPOINT: "checkpoint"}


class MeshscopeCallback(TrainerCallback, HookPhases):
    """A ``transformers.TrainerCallback`` that records the Trainer's optimizer steps with a meshscope tracker."""

    def __init__(self, tracker: Tracker | NullTracker | None = None) -> None:
        """Record with ``tracker``; by default :func:`~meshscope.sdk.tracker_from_env` (started here).

        Build the callback before the Trainer, or at least before ``trainer.train()``: the tracker then sees the
        process group, the DDP or FSDP wrap and every collective (it also finds a DDP model wrapped earlier).
        """
        HookPhases.__init__(self, tracker)
        self._stages: list[str] = []
        """What is left to happen before the next step, the first of them happening now."""
        self._since: tuple[int, tuple[int, int] | None, int] | None = None
        """Where the ``checkpoint?`` stage began (a real tracker only): a save, or the fetch, named when it ends."""
        self._tokens_hooks: list[Any] = []
        """The handles of what counts each micro-batch's tokens: the model's forward pre-hook, and its caller's."""
        self._in_call = False
        """Whether the model's caller is running a forward it counted (the model's own hook then counts nothing)."""

    # ------------------------------------------------------------------ phases and stages

    def _plan(self, args: Any, control: Any) -> None:  # noqa: ANN401 - the Trainer's types
        """Between steps: what the Trainer's flags say it does next, then the next step's fetch; start the first."""
        stages = []
        if control.should_log:
            stages.append(LOG)
        if control.should_evaluate:
            stages.append(EVAL)
        if str(getattr(args, "save_strategy", "")).lower().endswith("best"):
            if control.should_evaluate:
                stages.append(MAYBE_CHECKPOINT)
        elif control.should_save:
            stages.append(CHECKPOINT)
        self._stages = [*stages, FETCH]
        self._start_stage()

    def _done(self, stage: str) -> None:
        """``stage`` ended (and any planned before it that did not happen): start the next one."""
        if stage in self._stages:
            del self._stages[: self._stages.index(stage) + 1]
            self._start_stage()

    def _start_stage(self) -> None:
        self._leave()
        if not self._stages:
            return
        stage = self._stages[0]
        if stage in _PHASE_OF_STAGE:
            self._enter(_PHASE_OF_STAGE[stage])
        elif stage == MAYBE_CHECKPOINT and isinstance(self.tracker, Tracker):
            self._since = self.tracker._mark_now()  # noqa: SLF001 - named by on_save or on_step_begin
        elif stage == FETCH:
            self._begin_fetch()

    # ------------------------------------------------------------------ events

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: ANN401, ARG002
        """The first step's micro-batches are fetched next; each one's forward counts its tokens from now on."""
        model = kwargs.get("model")
        if self.tracker.enabled and not self._tokens_hooks and model is not None:
            try:
                self._watch_tokens(model)
            except Exception as exc:  # noqa: BLE001 - never into the Trainer
                log.warning("meshscope: tokens not counted: %r", exc)
        self._stages = [FETCH]
        self._start_stage()

    def _watch_tokens(self, model: Any) -> None:  # noqa: ANN401 - the Trainer's model
        """Count each forward's tokens: at the model, and where the Trainer's call enters compiled code.

        A forward pre-hook runs inside whatever compiles the module's call: with ``torch_compile=True`` (or
        accelerate's dynamo backend) the Trainer calls ``torch.compile``'s wrapper around the DDP-wrapped model, and
        the model's hook is traced once into the graph (where it counts nothing) and never runs again. So the
        outermost caller of the model (:func:`caller_of`) counts too, before its compiled code, and the model's own
        hook counts nothing inside the caller's call (a wrapper may hand it a copy of the batch: one micro-batch
        either way); a caller compiled in place (``module.compile()``) counts in front of its compiled call.
        """
        hooks = self._tokens_hooks  # each kept as soon as it is in place: removed at the end even if a later one fails
        hooks.append(model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        caller = caller_of(model)
        if getattr(caller, "_compiled_call_impl", None) is not None:
            hooks.append(_CountedCall(caller, self._before_call, self._after_call))
        elif caller is not model:
            hooks.append(caller.register_forward_pre_hook(self._before_call, with_kwargs=True))
            hooks.append(caller.register_forward_hook(self._after_call, always_call=True))

    def _before_call(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:  # noqa: ANN401, ARG002
        """The Trainer calls the model through a wrapper: count this micro-batch here."""
        if compiling():
            return
        self._in_call = True
        self._count_tokens(_token_ids(args, kwargs))

    def _after_call(self, *_args: Any) -> None:  # noqa: ANN401 - a forward hook's (module, args, output)
        """The wrapper's forward returned (or raised)."""
        self._in_call = False

    def _before_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:  # noqa: ANN401, ARG002
        """A forward of the model: a micro-batch's ``input_ids`` (a keyword, as the Trainer passes them, or first)."""
        if compiling() or self._in_call:  # inside its caller's call: counted there
            return
        self._count_tokens(_token_ids(args, kwargs))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: ANN401, ARG002
        """An optimizer step's first micro-batch: its step opens, numbered as the Trainer's ``global_step``."""
        self._leave()
        if self._stages[:1] == [MAYBE_CHECKPOINT]:  # no save came: the time since the evaluation fetched this step's
            self._claim(fetch=True)
        self._stages = []
        self._end_fetch(taken=True)
        self.tracker.start_step(int(state.global_step))
        self._enter("compute")

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: ANN401, ARG002
        """Gradients are clipped; the optimizer steps next (then the scheduler and ``zero_grad``: the same phase)."""
        self._enter("optimizer")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: ANN401, ARG002
        """The step ends; what the Trainer does next is timed between steps."""
        self._leave()
        self.tracker.end_step()
        self._plan(args, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: ANN401, ARG002
        """An epoch-end log, evaluation or save comes before the next epoch's fetch when the flags say so."""
        if control.should_log or control.should_evaluate or control.should_save:
            self._leave()
            self._end_fetch(taken=False)
            self._plan(args, control)

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: ANN401, ARG002
        """Logged (between steps: the loss gathered over the ranks)."""
        if self._stages[:1] == [LOG]:
            self._done(LOG)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: ANN401, ARG002
        """An evaluation ended (one the user runs outside training changes nothing)."""
        self._done(EVAL)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: ANN401, ARG002
        """A checkpoint was written (after a ``best`` evaluation: the time since it was the save)."""
        if self._stages[:1] == [MAYBE_CHECKPOINT]:
            self._claim(fetch=False)
            self._done(MAYBE_CHECKPOINT)
        else:
            self._done(CHECKPOINT)

    def _claim(self, *, fetch: bool) -> None:
        """Name the ``checkpoint?`` stage now that it ended: the next step's fetch, or a save."""
        since, self._since = self._since, None
        if since is None or not isinstance(self.tracker, Tracker):
            return
        try:
            if fetch:
                self.tracker._claim_fetch(since, self)  # noqa: SLF001
            else:
                self.tracker._claim_between("checkpoint", since)  # noqa: SLF001
        except Exception as exc:  # noqa: BLE001
            log.warning("meshscope: time after an evaluation not named: %r", exc)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: ANN401, ARG002
        """Training ended: no phase stays open, the last fetch is no step's, a step still open ends."""
        hooks, self._tokens_hooks, self._in_call = self._tokens_hooks, [], False
        for hook in hooks:
            hook.remove()
        self._leave()
        self._stages = []
        self._end_fetch(taken=False)
        if self.tracker.in_step:
            self.tracker.end_step()


def _token_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # noqa: ANN401 - whatever the Trainer passed
    """A forward's token ids: its ``input_ids`` keyword (as the Trainer passes them), or its first argument."""
    ids = kwargs.get("input_ids")
    return ids if ids is not None or not args else args[0]


def caller_of(model: Any) -> Any:  # noqa: ANN401 - a torch module
    """The outermost live module whose call reaches ``model``, or ``model`` itself.

    The wrappers followed: ``torch.compile(module)``'s ``OptimizedModule`` (its ``_orig_mod``), DDP and FSDP (their
    ``module``), nested in any order (accelerate compiles the DDP-wrapped model). Found among live objects once, at
    the start of training, after the Trainer prepared the model.
    """
    types: list[type] = []
    if "torch._dynamo" in sys.modules:  # nothing was compiled before it was imported
        from torch._dynamo.eval_frame import OptimizedModule  # noqa: PLC0415

        types.append(OptimizedModule)
    if "torch.nn.parallel" in sys.modules:
        from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

        types.append(DistributedDataParallel)
    if "torch.distributed.fsdp" in sys.modules:
        from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: PLC0415

        types.append(FullyShardedDataParallel)
    wrapper_of: dict[int, Any] = {}
    for wrapper in live_instances(*types) if types else []:
        inner = getattr(wrapper, "_orig_mod", None)
        if inner is None:
            inner = getattr(wrapper, "module", None)
        if inner is not None:
            wrapper_of[id(inner)] = wrapper
    caller, seen = model, {id(model)}
    while id(caller) in wrapper_of:
        caller = wrapper_of[id(caller)]
        if id(caller) in seen:
            break
        seen.add(id(caller))
    return caller


class _CountedCall:
    """``before(module, args, kwargs)`` and ``after()`` around a module's call compiled in place (``module.compile()``).

    Exists because such a module's forward pre-hooks run inside its compiled call; its ``_compiled_call_impl`` (what
    ``nn.Module.__call__`` calls instead of ``_call_impl``) is replaced on the instance until :meth:`remove`.
    """

    def __init__(self, module: Any, before: Any, after: Any) -> None:  # noqa: ANN401
        self.module = module
        self.compiled = module._compiled_call_impl  # noqa: SLF001 - nn.Module.compile's own attribute

        def counted(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            before(module, args, kwargs)
            try:
                return self.compiled(*args, **kwargs)
            finally:
                after()

        self.counted = counted
        module._compiled_call_impl = counted  # noqa: SLF001

    def remove(self) -> None:
        """Put the compiled call back (unless something replaced it since)."""
        if self.module._compiled_call_impl is self.counted:  # noqa: SLF001
            self.module._compiled_call_impl = self.compiled  # noqa: SLF001

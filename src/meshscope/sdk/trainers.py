"""What the ``Trainer`` callbacks share: one phase open at a time, and the held fetch of the next step's batches.

Exists because a framework's callback can only say "this begins now" at each hook, while the tracker times phases
as ``with`` blocks and a step's fetch through :meth:`~meshscope.sdk.Tracker.data`'s own machinery. The callbacks of
:mod:`~meshscope.sdk.huggingface` and :mod:`~meshscope.sdk.lightning` inherit :class:`HookPhases` beside their
framework's callback class. It must never raise into a framework's loop.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from meshscope.sdk.capture import compiling
from meshscope.sdk.tracker import NullTracker, Tracker, tracker_from_env

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

log = logging.getLogger("meshscope.sdk")


_NOT_IDS = frozenset({"torch.bool", "torch.complex64", "torch.complex128", "torch.complex32"})
"""Non-float tensor types that are no token ids (a mask; complex numbers)."""


def token_ids_shape(batch: Any) -> tuple[int, int] | None:  # noqa: ANN401 - whatever the loader handed over
    """``(sequences, length)`` of a micro-batch of token ids, or ``None`` when it is not one.

    Token ids are a 2-D integer tensor: the batch itself, or its ``input_ids`` (the Hugging Face convention for a
    batch mapping). Read from the shape alone, so nothing waits for a device: the tokens the model computes on,
    padding included (a batch padded to its longest sequence gives that length for every sequence). Anything else
    (images, a tuple, float features) is ``None``: no numbers rather than wrong ones.
    """
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch
    shape = getattr(ids, "shape", None)
    is_float = getattr(ids, "is_floating_point", None)
    if shape is None or len(shape) != 2 or is_float is None or is_float() or str(getattr(ids, "dtype", "")) in _NOT_IDS:
        return None
    return int(shape[0]), int(shape[1])


class HookPhases:
    """A tracker driven from hooks: at most one phase open (entering one leaves the last), and a held fetch."""

    def __init__(self, tracker: Tracker | NullTracker | None = None, *, times_fetches: bool = True) -> None:
        """Record with ``tracker``; by default :func:`~meshscope.sdk.tracker_from_env` (started here).

        ``times_fetches``: the hooks bracket the fetch of the next step's batches (:meth:`_begin_fetch`); ``False``:
        the loader's own ``next()`` is timed (the tracker's ``DataLoader`` timing), where the framework's hooks leave
        more than the fetch between them.
        """
        self.tracker = tracker if tracker is not None else tracker_from_env()
        self._phase: AbstractContextManager[Any] | None = None
        self._fetch: int | None = None
        """The token of the held fetch of the next step's batches (a real tracker only)."""
        if isinstance(self.tracker, Tracker) and times_fetches:
            self.tracker._data_explicit = True  # noqa: SLF001 - the Trainer's hooks time its fetches, not the loader's

    def _enter(self, name: str) -> None:
        """Time what follows as phase ``name``, ending the phase entered before."""
        self._leave()
        try:
            phase = self.tracker.phase(name)
            phase.__enter__()
            self._phase = phase
        except Exception as exc:  # noqa: BLE001 - never into the framework's loop
            log.warning("meshscope: phase %s not entered: %r", name, exc)

    def _leave(self) -> None:
        """End the phase entered last, if one is open."""
        phase, self._phase = self._phase, None
        if phase is not None:
            try:
                phase.__exit__(None, None, None)
            except Exception as exc:  # noqa: BLE001
                log.warning("meshscope: phase not left: %r", exc)

    def _begin_fetch(self) -> None:
        """The next step's batches are fetched from now: held for that step as a ``tracker.data`` fetch is."""
        self._end_fetch(taken=False)
        if isinstance(self.tracker, Tracker):
            try:
                self._fetch = self.tracker._fetch_begin(self)  # noqa: SLF001 - tracker.data's own fetch, same package
            except Exception as exc:  # noqa: BLE001
                log.warning("meshscope: fetch not timed: %r", exc)

    def _end_fetch(self, *, taken: bool) -> None:
        """End the held fetch: ``taken`` by the step opening now, or no step's (something else came first)."""
        token, self._fetch = self._fetch, None
        if token is not None and isinstance(self.tracker, Tracker):
            try:
                self.tracker._fetch_end(token, failed=not taken)  # noqa: SLF001
            except Exception as exc:  # noqa: BLE001
                log.warning("meshscope: fetch not timed: %r", exc)

    def _count_tokens(self, batch: Any) -> None:  # noqa: ANN401 - whatever the loader handed over
        """Add a micro-batch of token ids to the open step's data statistics (:func:`token_ids_shape`)."""
        if compiling() or not self.tracker.in_step:
            return
        try:
            shape = token_ids_shape(batch)
            if shape is not None:
                sequences, length = shape
                self.tracker.data_stats([length] * sequences)
        except Exception as exc:  # noqa: BLE001 - never into the framework's loop
            log.warning("meshscope: tokens not counted: %r", exc)

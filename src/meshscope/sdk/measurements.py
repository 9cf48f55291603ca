"""What a rank measured of its job once (not per step): its description, model-state bytes, saved activations.

Why it exists: ``meshscope run`` lays the planner's per-stage numbers beside what each rank really held (docs/sdk.md,
"Measurements"). The tracker collects them here and sends them in ``measurements`` control messages; the counting
itself (:mod:`meshscope.sdk.measuring`) needs torch and runs only when asked. This module must not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable


class Measurements:
    """The ``measurements`` payload of one rank, built up as the job describes and counts itself."""

    __slots__ = ("activations", "fields")

    def __init__(self) -> None:
        """An empty payload."""
        self.fields: dict[str, Any] = {}
        """JSON-ready fields sent as they are: ``job`` (the job's description), ``model_state`` (bytes by kind)."""
        self.activations: dict[str, dict[int, list[int]]] = {}
        """Per scope name, per step: [scopes counted, bytes saved for backward]."""

    def __bool__(self) -> bool:
        """Whether there is anything to send."""
        return bool(self.fields or self.activations)

    def activation_counter(self, name: str, step: int) -> Callable[[int], None]:
        """A callback adding one scope of ``name`` in ``step`` that saved ``nbytes``."""

        def done(nbytes: int) -> None:
            slot = self.activations.setdefault(name, {}).setdefault(step, [0, 0])
            slot[0] += 1
            slot[1] += nbytes

        return done

    def payload(self) -> dict[str, Any]:
        """The ``measurements`` object of the control message (``docs/sdk.md``)."""
        measurements = dict(self.fields)
        if self.activations:
            measurements["activations"] = {
                name: [{"step": step, "scopes": n, "bytes": b} for step, (n, b) in sorted(per_step.items())]
                for name, per_step in self.activations.items()
            }
        return measurements

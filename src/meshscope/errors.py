"""meshscope's own error hierarchy.

Every error a user can cause (a bad spec, an impossible layout, a corrupt record file) is raised as one of these, with
the offending field, the value and what would fit in the message. The CLI turns them into one line on stderr and exit
code 2; the operator (later) turns them into admission denials. Nothing here may import beyond the standard library.
"""

from __future__ import annotations


class MeshscopeError(Exception):
    """Base class of every error meshscope raises on purpose."""


class LayoutError(MeshscopeError, ValueError):
    """A parallel layout that cannot exist: degrees that do not multiply to the world size, bad rank order, ..."""


class SpecError(MeshscopeError, ValueError):
    """A TrainingJob spec that is malformed or inconsistent.

    Attributes:
        field: dotted path of the offending field (``spec.parallelism.tp``), or ``""`` for the whole document.
    """

    def __init__(self, field: str, message: str) -> None:
        """Build the error; the message is shown as ``field: message``."""
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class PlanError(MeshscopeError, ValueError):
    """A spec that is valid on its own but cannot be planned (e.g. no layout fits the GPU count)."""


class ParseError(MeshscopeError, ValueError):
    """Input data (step records, telemetry files) that cannot be read."""

"""meshscope's own error hierarchy.

Every error a user can cause (a bad spec, an impossible layout, a corrupt record file) is raised as one of these, with
the offending field, the value and what would fit in the message. The CLI turns them into one line on stderr and exit
code 2; the operator (later) turns them into admission denials. Nothing here may import beyond the standard library.
"""

from __future__ import annotations

from enum import StrEnum


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


class ParseCode(StrEnum):
    """What kind of problem a :class:`ParseError` reports: stable names that callers and tests match on.

    The message wording may be improved at any time; a code is renamed only with a note in ``docs/records.md``.
    """

    MISSING_FIELD = "missing_field"
    """A required field is absent (or null), or an interval lacks a field its kind needs."""
    WRONG_TYPE = "wrong_type"
    """A field of the wrong JSON type: a string for a number, a float or boolean for a whole number, a list for an
    object."""
    VALUE_OUT_OF_RANGE = "value_out_of_range"
    """A number outside what the field takes: below its minimum, beyond 64 bits (32 for ``gpu`` and
    ``group_size``), a non-finite float, a ratio outside [0, 1], an empty string where a name is needed."""
    NOT_ONE_OF = "not_one_of"
    """A name or code that is not one of the allowed values (kind, phase, axis, op, a node code, ...)."""
    UNSUPPORTED_SCHEMA = "unsupported_schema"
    """A ``schema`` this reader does not read."""
    BAD_JSON = "bad_json"
    """A line that is not valid JSON, or not a JSON object."""
    TRUNCATED = "truncated"
    """A truncated last line or compressed stream."""
    ENDS_BEFORE_START = "ends_before_start"
    """A step or interval whose end is before its start."""
    OUTSIDE_STEP = "outside_step"
    """An interval that lies wholly outside its step."""
    DUPLICATE = "duplicate"
    """A (rank, step) or (group, seq, rank) seen twice."""
    JOB_MISMATCH = "job_mismatch"
    """Records of another job than the first one read."""
    INCONSISTENT = "inconsistent"
    """Fields that disagree with each other: members of one collective, a collective op on a p2p interval, records
    that do not fit the given layout."""
    BAD_SHAPE = "bad_shape"
    """A column (or an argument array) of the wrong shape."""
    INVALID = "invalid"
    """Anything else (an argument out of range, an empty input)."""


class ParseError(MeshscopeError, ValueError):
    """Input data (step records, telemetry files) that cannot be read.

    Attributes:
        code: the kind of problem (:class:`ParseCode`); the message says where, the field, its value and what
            would fit, in words that may change, the code does not.
    """

    def __init__(self, message: str, *, code: ParseCode = ParseCode.INVALID) -> None:
        """Build the error with its message and code."""
        self.code = code
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        """Pickle with the code (a worker process hands its error to the parent)."""
        return (_parse_error, (str(self), self.code))


def _parse_error(message: str, code: ParseCode) -> ParseError:
    return ParseError(message, code=code)

"""What every source shares: the sample it produces, the health it reports and the bounded buffer it keeps.

Exists so that tagging, the metrics collector and the health metrics (``meshscope_source_up{source}``,
``meshscope_source_parse_errors_total{source}``, ``meshscope_source_dropped_total{source}``) treat every source
alike. It must not know any input format.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One reading, before tagging: a metric of :data:`~meshscope_sidecar.metrics.METRICS`, a value, what it is about.

    A sample names *what it is about* in the source's own terms; :func:`~meshscope_sidecar.tagging.tag` turns that
    into rank coordinates. Exactly one of ``rank``, ``gpu`` or neither (node-level, e.g. a network port) is set.
    """

    metric: str
    """Name in :data:`~meshscope_sidecar.metrics.METRICS` (``meshscope_*``, base units)."""
    value: float
    """The value in the metric's unit (already converted: bytes, seconds, ratios 0-1)."""
    rank: int | None = None
    """Global rank the sample belongs to (training-loop records, NCCL communicators mapped to global ranks)."""
    gpu: int | None = None
    """Local GPU index on this node (``nvidia-smi`` order, the ``gpu`` label of dcgm-exporter), when not by rank."""
    labels: tuple[tuple[str, str], ...] = ()
    """The metric's own bounded labels (``axis``, ``op``, ``category``, ``device``, ``port``), sorted by name."""


@dataclass(slots=True)
class SourceHealth:
    """A source's own state, exported as ``meshscope_source_*{source}`` metrics."""

    up: bool = False
    """Whether the last poll read its input (``meshscope_source_up``)."""
    parse_errors_total: int = 0
    """Lines, datagrams or series that could not be read and were skipped."""
    dropped_total: int = 0
    """Readings lost because a bounded buffer was full (or input arrived faster than it can be kept)."""
    last_error: str | None = None
    """The last problem, in words (for the log and ``/healthz``); ``None`` when the last poll was clean."""
    last_success_unix_s: float = math.nan
    """Wall-clock time of the last successful poll, seconds since the epoch; NaN before the first."""


class Source(Protocol):
    """An input of the sidecar. Constructed with its root path or handle (``NcclLogSource(path=...)``)."""

    name: str
    """The ``source`` label: ``train_events``, ``dcgm``, ``nvml``, ``nccl_log``, ``infiniband``."""
    health: SourceHealth
    """Updated by every :meth:`poll`."""

    def poll(self) -> None:
        """Read whatever new input there is, bounded in time and memory; never raises."""

    def samples(self) -> Iterable[Sample]:
        """The current readings (gauges: latest value; counters: running totals since the sidecar started)."""

    def close(self) -> None:
        """Release files, sockets and handles; idempotent."""


@dataclass(slots=True)
class BoundedBuffer(Generic[T]):
    """A FIFO of at most ``capacity`` items that drops the oldest when full and counts every drop."""

    capacity: int
    """Most items kept."""
    dropped_total: int = 0
    """Items pushed out by newer ones."""
    _items: collections.deque[T] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Check the capacity and make the deque."""
        if self.capacity < 1:
            raise ValueError(f"BoundedBuffer capacity must be at least 1, got {self.capacity}")
        self._items = collections.deque(maxlen=self.capacity)

    def append(self, item: T) -> None:
        """Add ``item``; when full, the oldest item is dropped and counted."""
        if len(self._items) == self.capacity:
            self.dropped_total += 1
        self._items.append(item)

    def drain(self) -> list[T]:
        """Remove and return every item, oldest first."""
        items = list(self._items)
        self._items.clear()
        return items

    def __len__(self) -> int:
        """Items held."""
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        """Items held, oldest first (without removing them)."""
        return iter(self._items)

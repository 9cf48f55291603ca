"""The Prometheus collector: every source's current samples, tagged, as one family per exported metric.

Exists so that ``/metrics`` is built in one place from :data:`~meshscope_sidecar.metrics.METRICS` (the list is
data; nothing is exported that it does not name) and :func:`~meshscope_sidecar.tagging.tag` (one function for every
source's labels). At scrape time it only reads what the sources hold (:meth:`Source.samples` returns from memory;
polling happens in the server's background loop), so a slow or hung input never slows a scrape. Beside the sources'
metrics it yields their health (``meshscope_source_up``, ``..._parse_errors_total``, ``..._dropped_total``,
``..._poll_seconds_total``), the series it could not tag (``meshscope_sidecar_untagged_series``) and
``meshscope_sidecar_info``.

It is registered on an explicit :class:`prometheus_client.CollectorRegistry` (:func:`make_registry`), never the
global one. It must not do I/O and must not know any input format.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshscope_sidecar.metrics import METRICS, MetricSpec, MetricType
from meshscope_sidecar.tagging import Untagged, label_names, node_values, tag

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from meshscope_sidecar.identity import Identity
    from meshscope_sidecar.sources.base import Source


@dataclass(slots=True)
class PollState:
    """How the background loop is doing with one source (written by the server, read at scrape time)."""

    period_s: float
    """Seconds between the end of one poll and the start of the next."""
    seconds_total: float = 0.0
    """Wall time spent in the source's polls, seconds (``meshscope_source_poll_seconds_total``)."""
    polls_total: int = 0
    """Polls finished."""
    started_monotonic_s: float | None = None
    """When the poll now running started (``time.monotonic``); ``None`` between polls."""
    stall_after_s: float | None = None
    """A poll running longer than this many seconds means the source is down; ``None``: ten periods, at least 10 s."""

    def stalled(self, now_monotonic_s: float) -> bool:
        """Whether the poll now running has taken longer than :attr:`stall_after_s`: the source is down."""
        if self.started_monotonic_s is None:
            return False
        limit = self.stall_after_s if self.stall_after_s is not None else max(10.0, 10 * self.period_s)
        return now_monotonic_s - self.started_monotonic_s > limit


class SidecarCollector(Collector):
    """Yields the sidecar's metrics from its sources' current samples."""

    def __init__(
        self,
        sources: Sequence[Source],
        identity: Identity,
        *,
        version: str,
        polls: dict[str, PollState] | None = None,
    ) -> None:
        """Collect from ``sources`` (in this order: the first source's series wins a duplicate).

        Args:
            sources: the sources, each with a distinct ``name``.
            identity: the pod's identity (labels, mode).
            version: the sidecar's version (``meshscope_sidecar_info``).
            polls: the poll state of each source by name (the server's loop fills it); missing: never polled.
        """
        self.sources = tuple(sources)
        self.identity = identity
        self.version = version
        self.polls: dict[str, PollState] = polls if polls is not None else {}
        self._lock = threading.Lock()  # one scrape at a time: the families are built fresh each time

    def describe(self) -> Iterable[Metric]:
        """Nothing: registering must not call :meth:`collect` (it reads the sources)."""
        return []

    def collect(self) -> Iterable[Metric]:
        """One family per metric that has samples, in :data:`METRICS` order, then health and info."""
        with self._lock:
            return self._collect()

    def _collect(self) -> list[Metric]:
        series: dict[str, dict[tuple[str, ...], float]] = {}
        untagged: dict[tuple[str, str], int] = {}
        for source in self.sources:
            for sample in source.samples():
                result = tag(sample, self.identity)
                if isinstance(result, Untagged):
                    key = (source.name, result.value)
                    untagged[key] = untagged.get(key, 0) + 1
                    continue
                spec, values = result
                by_values = series.setdefault(spec.name, {})
                if values in by_values:
                    key = (source.name, "duplicate_series")
                    untagged[key] = untagged.get(key, 0) + 1
                    continue
                by_values[values] = sample.value
        node = node_values(self.identity)
        self._add_health(series, node)
        series["meshscope_sidecar_untagged_series"] = {
            (*node, source, reason): float(n) for (source, reason), n in sorted(untagged.items())
        }
        series["meshscope_sidecar_info"] = {(*node, self.version, self.identity.mode.value): 1.0}
        return [_family(spec, series[spec.name]) for spec in METRICS if series.get(spec.name)]

    def _add_health(self, series: dict[str, dict[tuple[str, ...], float]], node: tuple[str, ...]) -> None:
        now = time.monotonic()
        for source in self.sources:
            h = source.health
            poll = self.polls.get(source.name)
            up = h.up and not (poll is not None and poll.stalled(now))
            key = (*node, source.name)
            series.setdefault("meshscope_source_up", {})[key] = 1.0 if up else 0.0
            series.setdefault("meshscope_source_parse_errors_total", {})[key] = float(h.parse_errors_total)
            series.setdefault("meshscope_source_dropped_total", {})[key] = float(h.dropped_total)
            seconds = poll.seconds_total if poll is not None else 0.0
            series.setdefault("meshscope_source_poll_seconds_total", {})[key] = seconds


def _family(spec: MetricSpec, by_values: dict[tuple[str, ...], float]) -> Metric:
    names = list(label_names(spec))
    family: CounterMetricFamily | GaugeMetricFamily
    if spec.type is MetricType.COUNTER:
        family = CounterMetricFamily(spec.family, spec.help, labels=names, unit="")
    else:
        family = GaugeMetricFamily(spec.name, spec.help, labels=names, unit="")
    for values, value in by_values.items():
        family.add_metric(list(values), value)
    return family


def make_registry(collector: SidecarCollector) -> CollectorRegistry:
    """A fresh registry holding only ``collector`` (never the global ``REGISTRY``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry

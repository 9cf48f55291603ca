"""The sidecar's inputs: one adapter per source, each optional, each with its own health, buffer and counters.

Every source turns raw input (datagrams, a Prometheus text scrape, a log file, a sysfs tree) into typed
:class:`~meshscope_sidecar.sources.base.Sample` objects **in one place**, and counts what it could not read. A source
never raises out of :meth:`~meshscope_sidecar.sources.base.Source.poll`; a missing input (no GPU, no log yet) is a
state it reports (``up`` false, ``last_error``), not a failure of the sidecar.
"""

from meshscope_sidecar.sources.base import BoundedBuffer, Sample, Source, SourceHealth

__all__ = ["BoundedBuffer", "Sample", "Source", "SourceHealth"]

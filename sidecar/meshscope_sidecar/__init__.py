"""The meshscope sidecar: one per training pod; tags every sample it sees with the rank coordinates it belongs to.

A sidecar reads the training loop's step records (the SDK's datagrams), dcgm-exporter or NVML, the NCCL debug log
and the InfiniBand counters of its node; tags every sample with ``job, rank, dp, tp, pp, cp, ep, node,
nvlink_domain, network_tier, gpu`` (:mod:`~meshscope_sidecar.tagging`, one function for every source); runs the
core's breakdown over its own ranks' records; and exports Prometheus metrics (``/metrics``) and recent step records
(``/v1/steps``) for the operator's deep tier. Every source is optional and reports its own health; bad input is
counted and skipped, never fatal (DESIGN.md, "Data flow").

Modules, in the order data flows:

- :mod:`~meshscope_sidecar.sources`: one I/O adapter per input (``train_events``, ``dcgm``, ``nvml``, ``nccl_log``,
  ``infiniband``), each producing :class:`~meshscope_sidecar.sources.base.Sample` objects with its own
  :class:`~meshscope_sidecar.sources.base.SourceHealth`;
- :mod:`~meshscope_sidecar.identity`: who this pod's GPUs are (global rank, coord, node, NVLink domain, network
  tier), from the environment and the placement the operator mounts;
- :mod:`~meshscope_sidecar.tagging`: the one function that turns a sample into labelled series;
- :mod:`~meshscope_sidecar.metrics`: the exported metric list, as data (``docs/metrics.md`` is generated from it);
- :mod:`~meshscope_sidecar.collector`, :mod:`~meshscope_sidecar.server`, :mod:`~meshscope_sidecar.__main__`.

It imports the core (``meshscope``) and never the operator; the core never imports it (``.importlinter``).
"""

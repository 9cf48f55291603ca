"""The one function that turns a source's sample into a labelled series: rank coordinates plus the metric's labels.

Every source (training loop, DCGM, NVML, NCCL log, InfiniBand) goes through :func:`tag`, so a GPU sample from DCGM
and a step record of the same rank carry the same ``job, rank, dp, tp, pp, cp, ep, node, nvlink_domain,
network_tier, gpu`` (:data:`~meshscope_sidecar.metrics.RANK_LABELS`). Two rules make it safe to scrape:

- **never mislabelled**: the rank coordinates come from the pod's :class:`~meshscope_sidecar.identity.Identity`
  only, never from the sample; a sample about a rank or GPU that is not this pod's, or any rank sample in degraded
  mode, is not tagged (:class:`Untagged` says why, and the collector counts it);
- **cardinality bounded by construction**: every label a metric may carry beyond the coordinates is checked against
  a closed set (axes, operations, categories, sources) or a tight pattern of hardware names (an InfiniBand device,
  a port number, a counter file name): a step number, a pointer, a kernel name or free text cannot pass.

It is pure: no I/O, no state; it must not know any input format.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import TYPE_CHECKING

from meshscope.records import OPS
from meshscope.topology import AXES
from meshscope_sidecar.identity import IdentityMode
from meshscope_sidecar.metrics import BREAKDOWN_CATEGORIES, BY_NAME, NODE_LABELS, RANK_LABELS

if TYPE_CHECKING:
    from meshscope_sidecar.identity import Identity
    from meshscope_sidecar.metrics import MetricSpec
    from meshscope_sidecar.sources.base import Sample


class Untagged(StrEnum):
    """Why a sample was not tagged (the ``reason`` label of ``meshscope_sidecar_untagged_series``)."""

    UNKNOWN_METRIC = "unknown_metric"
    """Its metric is not in :data:`~meshscope_sidecar.metrics.METRICS`."""
    BAD_LABELS = "bad_labels"
    """A label the metric does not have, or a value outside the label's closed set or pattern."""
    FOREIGN_RANK = "foreign_rank"
    """About a rank that does not run on this pod."""
    FOREIGN_GPU = "foreign_gpu"
    """About a GPU of this node that runs no rank of this pod."""
    RANKS_UNKNOWN = "ranks_unknown"
    """A per-rank sample while the identity is degraded (ranks unknown)."""
    NO_SUBJECT = "no_subject"
    """A per-rank metric whose sample names neither a rank nor a GPU, or a node metric whose sample names one."""


_SOURCES = frozenset({"train_events", "dcgm", "nvml", "nccl_log", "infiniband"})
_CLOSED: dict[str, frozenset[str]] = {
    # Beyond the five axes: the process groups an NCCL communicator can be that are not one axis (the whole world,
    # dp x cp, the expert-data-parallel group: sources/nccl_comms.py AxisMapper), and "unknown".
    "axis": frozenset({"", "unknown", "world", "dp-cp", "edp", *(a.value for a in AXES)}),
    "op": frozenset(op.value for op in OPS),
    "category": frozenset(BREAKDOWN_CATEGORIES),
    "source": _SOURCES,
    "mode": frozenset(m.value for m in IdentityMode),
    "reason": frozenset({*(u.value for u in Untagged), "foreign_job", "duplicate", "duplicate_series"}),
}
"""Labels whose values form a closed set."""
_PATTERNS: dict[str, re.Pattern[str]] = {
    # An InfiniBand/RoCE device name as /sys/class/infiniband lists it (mlx5_0, ibp12s0, bnxt_re3).
    "device": re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,31}"),
    # Port numbers are 8-bit (IBTA spec vol. 1, PortNum); sysfs names them 1, 2, ...
    "port": re.compile(r"[1-9][0-9]{0,2}"),
    # The local GPU a NIC is the rail of, or empty when it serves none.
    "rail_gpu": re.compile(r"(?:[0-9]{1,2})?"),
    # A MIG GPU instance id (dcgm-exporter's GPU_I_ID; NVML allows at most 7 per GPU), empty for a whole GPU.
    "gpu_instance": re.compile(r"(?:[0-9]{1,2})?"),
    # A counter file name of ports/*/counters or hw_counters (symbol_error, np_cnp_sent).
    "counter": re.compile(r"[a-z][a-z0-9_]{0,47}"),
    "version": re.compile(r"[0-9A-Za-z.+-]{1,32}"),
}
"""Labels whose values come from hardware or the build: bounded by tight patterns."""


def label_names(spec: MetricSpec) -> tuple[str, ...]:
    """The label names of ``spec``'s series, in export order: the scope's labels, then the metric's own."""
    return (*(RANK_LABELS if spec.scope == "rank" else NODE_LABELS), *spec.labels)


def own_label_ok(name: str, value: str) -> bool:
    """Whether ``value`` may be a value of label ``name`` (closed set or pattern)."""
    closed = _CLOSED.get(name)
    if closed is not None:
        return value in closed
    pattern = _PATTERNS.get(name)
    return pattern is not None and pattern.fullmatch(value) is not None


def node_values(identity: Identity) -> tuple[str, ...]:
    """The values of :data:`~meshscope_sidecar.metrics.NODE_LABELS` for this pod."""
    return (identity.job, identity.node, identity.nvlink_domain, identity.network_tier)


def tag(sample: Sample, identity: Identity) -> tuple[MetricSpec, tuple[str, ...]] | Untagged:  # noqa: PLR0911 - one reason each
    """The metric and the label values of ``sample`` (in :func:`label_names` order), or why it cannot be tagged.

    Args:
        sample: a source's reading.
        identity: this pod's identity (the only source of rank coordinates).

    Returns:
        ``(spec, values)``; or an :class:`Untagged` reason.
    """
    spec = BY_NAME.get(sample.metric)
    if spec is None:
        return Untagged.UNKNOWN_METRIC
    given = dict(sample.labels)
    if len(given) != len(sample.labels) or not given.keys() <= set(spec.labels):
        return Untagged.BAD_LABELS
    own: list[str] = []
    for name in spec.labels:
        value = given.get(name, "")
        if (value and not own_label_ok(name, value)) or (not value and name not in _MAY_BE_EMPTY):
            return Untagged.BAD_LABELS
        own.append(value)
    if spec.scope != "rank":
        if sample.rank is not None or sample.gpu is not None:
            return Untagged.NO_SUBJECT
        return spec, (*node_values(identity), *own)
    if sample.rank is None and sample.gpu is None:
        return Untagged.NO_SUBJECT
    if identity.mode is IdentityMode.DEGRADED:
        return Untagged.RANKS_UNKNOWN
    local = identity.by_rank(sample.rank) if sample.rank is not None else identity.by_gpu(sample.gpu or 0)
    if local is None or (sample.gpu is not None and sample.rank is not None and local.gpu != sample.gpu):
        return Untagged.FOREIGN_RANK if sample.rank is not None else Untagged.FOREIGN_GPU
    c = local.coord
    return spec, (
        identity.job,
        str(local.rank),
        str(c.dp),
        str(c.tp),
        str(c.pp),
        str(c.cp),
        str(c.ep),
        identity.node,
        identity.nvlink_domain,
        identity.network_tier,
        str(local.gpu),
        *own,
    )


_MAY_BE_EMPTY = frozenset({"axis", "rail_gpu", "gpu_instance"})
"""Own labels whose value may be empty (``axis`` off ``exposed_comm``; ``rail_gpu`` of a NIC that serves no GPU;
``gpu_instance`` of a whole GPU, which is what a sample that does not give one is about)."""

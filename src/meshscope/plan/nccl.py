"""Seconds of one collective: latency + bandwidth per algorithm and protocol, the cheapest chosen, as NCCL's tuner does.

Exists so that a small message pays its latency and a large one its bandwidth: a bandwidth-only model prices the
64-byte count exchange of an MoE dispatcher and a 2 GiB gradient reduction alike, and misses that a 16-rank ring over
the network takes 30 steps of microseconds each. It follows NCCL's own cost model (``src/graph/tuning.cc`` of
NVIDIA/nccl @ ``b6475625``, ``ncclTopoTuneModel`` / ``ncclTopoGetAlgoTime``; read to learn, not copied): a collective
of ``S`` bytes on algorithm ``a`` with protocol ``p`` costs ``latency(a, p) + S / bandwidth(a, p)``, and NCCL runs the
cheapest enabled pair.

* **Ring** (every collective): ``nsteps = 2(n-1)`` for all-reduce, ``n-1`` for all-gather / reduce-scatter, of which
  the steps that cross a node are priced at the network's hop latency (``2·nodes`` for all-reduce across nodes,
  ``nodes - 1`` otherwise, as NCCL counts them) and the rest at NVLink's; bandwidth = bus bandwidth x the protocol's
  fraction, bytes moved = ``S`` x the nccl-tests bus factor.
* **Tree** (all-reduce only): latency ``2·((ranks per node - 1)·hop_nvlink + log2(nodes)·hop_network)``; NCCL's tree
  moves ``S`` at half the bus bandwidth (its algorithm-bandwidth ratio 0.5), i.e. bytes moved = ``2·S``.
* **Send/recv and all-to-all** (NCCL runs them as grouped point-to-point operations, which ``tuning.cc`` does not
  price): one step of the link's hop latency plus the protocol's base latency, the same bandwidth fractions (own
  approximation).

A "node" here is an NVLink domain (NCCL treats a multi-node NVLink domain as one node). Not modelled: NVLS / CollNet
(in-switch reduction), the per-channel bandwidth caps (they need the channel count NCCL's topology search picks), the
tree correction factors per message size, the ring all-reduce latency "plateau" factor, and the extra network post
overhead; the link's achievable bus bandwidth is ``link bandwidth x {nvlink,network}_efficiency``.

Pure arithmetic on numbers; knows nothing about which collectives a step runs (:mod:`meshscope.plan.comms`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from meshscope.plan.assumptions import NcclProtocolCosts, PlanAssumptions

ALL_REDUCE: Final = "all-reduce"
REDUCE_SCATTER: Final = "reduce-scatter"
ALL_GATHER: Final = "all-gather"
ALL_TO_ALL: Final = "all-to-all"
SEND_RECV: Final = "send-recv"


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveTime:
    """Expected seconds of one collective and how NCCL would run it."""

    seconds: float
    """Latency plus transfer, seconds."""
    latency_seconds: float
    """The latency part, seconds."""
    algorithm: str
    """``ring``, ``tree``, ``p2p`` (send/recv, all-to-all) or ``bandwidth-only`` (``nccl_latency`` off)."""
    protocol: str
    """``ll``, ``ll128`` or ``simple``."""
    bandwidth_bytes_per_s: float
    """Payload bandwidth of the chosen protocol: the link's achievable bus bandwidth x the protocol fraction."""


def bus_factor(op: str, group_size: int) -> float:
    """Bytes each GPU moves per byte of the array ``S`` (nccl-tests ``doc/PERFORMANCE.md``)."""
    n = group_size
    if op == ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if op == SEND_RECV:
        return 1.0
    return (n - 1) / n


def _ring_steps(op: str, n: int, nodes: int) -> tuple[int, int]:
    """``(steps, steps that cross a node)`` of a ring (tuning.cc ``nsteps`` and ``nInterSteps``)."""
    if op == ALL_REDUCE:
        steps, inter = 2 * (n - 1), (2 * nodes if nodes > 1 else 0)
    else:
        steps, inter = n - 1, nodes - 1
    return steps, min(steps, inter)


@functools.lru_cache(maxsize=1 << 16)  # the layout search prices the same few messages thousands of times
def collective_time(
    op: str,
    message_bytes: int,
    *,
    group_size: int,
    nodes: int,
    link: str,
    link_bandwidth_bytes_per_s: float,
    assumptions: PlanAssumptions,
) -> CollectiveTime:
    """Expected seconds of one collective of ``message_bytes`` (NCCL's array ``S``) on a group.

    Args:
        op: ``all-reduce``, ``reduce-scatter``, ``all-gather``, ``all-to-all`` or ``send-recv``.
        message_bytes: the array size ``S`` (module docstring of :mod:`meshscope.plan.comms`).
        group_size: ranks in the group.
        nodes: NVLink domains the group spans (1 inside one domain).
        link: the slowest hop, ``nvlink`` or ``network``.
        link_bandwidth_bytes_per_s: that link's per-direction bandwidth per GPU.
        assumptions: link efficiencies and the NCCL protocol costs.

    Returns:
        The cheapest algorithm and protocol, with its seconds.
    """
    n = max(group_size, 1)
    nodes = max(1, nodes) if link == "network" else 1
    bus_bandwidth = link_bandwidth_bytes_per_s * assumptions.link_efficiency(link)
    moved = message_bytes * bus_factor(op, n)
    if not assumptions.nccl_latency or n == 1:
        return _scaled(
            CollectiveTime(
                seconds=moved / bus_bandwidth,
                latency_seconds=0.0,
                algorithm="bandwidth-only",
                protocol="simple",
                bandwidth_bytes_per_s=bus_bandwidth,
            ),
            assumptions.cpu_time_scale,
        )
    best: CollectiveTime | None = None
    options = assumptions.nccl_options()
    if op != ALL_REDUCE and all(algorithm == "tree" for algorithm, _ in options):
        # NCCL's tree implements all-reduce only; other collectives run on rings whatever NCCL_ALGO says.
        options = {("ring", p): getattr(assumptions, f"ring_{p}") for p in assumptions.nccl_protocols}
    for (algorithm, protocol), costs in options.items():
        if algorithm == "tree" and op != ALL_REDUCE:
            continue  # NCCL's tree implements all-reduce only
        option = _price(op, algorithm, protocol, costs, n=n, nodes=nodes, moved=moved, bus_bandwidth=bus_bandwidth,
                        message_bytes=message_bytes)  # fmt: skip
        if best is None or option.seconds < best.seconds:
            best = option
    assert best is not None  # the ring options always exist
    return _scaled(best, assumptions.cpu_time_scale)


def _scaled(t: CollectiveTime, scale: float) -> CollectiveTime:
    """``t`` stretched by ``scale`` (``cpu_time_scale``: CPU contention); the cheapest option stays the cheapest."""
    if scale == 1.0:
        return t
    return replace(t, seconds=t.seconds * scale, latency_seconds=t.latency_seconds * scale,
                   bandwidth_bytes_per_s=t.bandwidth_bytes_per_s / scale)  # fmt: skip


def _price(
    op: str,
    algorithm: str,
    protocol: str,
    costs: NcclProtocolCosts,
    *,
    n: int,
    nodes: int,
    moved: float,
    bus_bandwidth: float,
    message_bytes: int,
) -> CollectiveTime:
    nvlink_hop, network_hop = costs.nvlink_hop_latency_s, costs.network_hop_latency_s
    bandwidth = bus_bandwidth * costs.bandwidth_fraction
    if op in (SEND_RECV, ALL_TO_ALL):
        latency = costs.base_latency_s + (network_hop if nodes > 1 else nvlink_hop)
        return CollectiveTime(seconds=latency + moved / bandwidth, latency_seconds=latency, algorithm="p2p",
                              protocol=protocol, bandwidth_bytes_per_s=bandwidth)  # fmt: skip
    if algorithm == "tree":
        per_node = n / nodes
        latency = costs.base_latency_s + 2.0 * (
            (per_node - 1) * nvlink_hop + math.floor(math.log2(nodes)) * network_hop
        )
        transfer = 2.0 * message_bytes / bandwidth  # algorithm bandwidth = bus bandwidth / 2 (tuning.cc ratio .5)
        return CollectiveTime(seconds=latency + transfer, latency_seconds=latency, algorithm="tree",
                              protocol=protocol, bandwidth_bytes_per_s=bandwidth)  # fmt: skip
    steps, inter = _ring_steps(op, n, nodes)
    latency = costs.base_latency_s + (steps - inter) * nvlink_hop + inter * network_hop
    return CollectiveTime(seconds=latency + moved / bandwidth, latency_seconds=latency, algorithm="ring",
                          protocol=protocol, bandwidth_bytes_per_s=bandwidth)  # fmt: skip

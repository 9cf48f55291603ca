"""Findings: what a plan warns about, each with the numbers that make it true.

Exists so that the CLI, the admission webhook (as kubectl warnings) and reports all say the same thing in the same
words. A finding never comes without its numbers ("64 of 64 TP groups cross the network at 50 GB/s instead of
450 GB/s"), and findings are sorted by severity, errors first. This module only reads what the planner computed; it
computes no new quantities.

Codes:

==============================  ========  ==========================================================================
code                            severity  fires when
==============================  ========  ==========================================================================
``memory-exceeds-hbm``          error     a stage's peak memory per GPU exceeds ``hardware.usable_hbm_bytes``
``tp-crosses-nvlink-domain``    warning   some TP (or expert-TP) group spans more than one NVLink domain
``ep-all-to-all-over-network``  warning   some EP group of an MoE model spans more than one NVLink domain
``cp-over-network``             warning   some CP group spans more than one NVLink domain
``bubble-large``                warning   the pipeline bubble exceeds ``assumptions.bubble_warning_fraction`` (10 %)
``flops-per-byte-below-budget`` warning   an axis' FLOPs per byte on a group is below its link's budget
``moe-tp-without-sp``           warning   an MoE model with tp > 1 but no sequence parallelism (Megatron-core refuses
                                          to train it: ``MoELayer.forward`` raises)
``pp-over-network``             info      some pipeline crosses an NVLink domain between stages
==============================  ========  ==========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from meshscope.jobs import CpCommType
from meshscope.topology import GiB

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from meshscope.jobs import PipelineSchedule
    from meshscope.plan.assumptions import PlanAssumptions
    from meshscope.plan.comms import CollectivePlan
    from meshscope.plan.memory import MemoryBreakdown
    from meshscope.topology import GroupSpan, HardwareConfig, Link, ParallelLayout


class Severity(StrEnum):
    """How bad a finding is.

    ``error``: the job cannot run as planned; ``warning``: it runs, slower than it could; ``info``: worth knowing.
    """

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        """Sort key: errors first."""
        return {Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 2}[self]


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One thing the plan warns about."""

    code: str
    """Stable identifier, e.g. ``tp-crosses-nvlink-domain``."""
    severity: Severity
    """How bad it is."""
    message: str
    """One sentence with the numbers."""

    def to_dict(self) -> dict[str, str]:
        """``{code, severity, message}``."""
        return {"code": self.code, "severity": self.severity.value, "message": self.message}


@dataclass(frozen=True, slots=True, kw_only=True)
class StageSummary:
    """What the findings need of one pipeline stage."""

    pp_rank: int
    """Pipeline rank."""
    memory: MemoryBreakdown
    """Its peak memory per GPU."""
    collectives: Sequence[CollectivePlan]
    """Every collective one of its GPUs runs per step."""


def _gib(value: float) -> str:
    return f"{value / GiB:,.1f} GiB"


def _gb_per_s(value: float) -> str:
    return f"{value / 1e9:,.0f} GB/s"


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:,.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:,.1f} ms"
    return f"{value * 1e6:,.0f} µs"


@dataclass(frozen=True, slots=True, kw_only=True)
class _Traffic:
    """Per-step traffic of some collectives on one GPU of one stage."""

    pp_rank: int
    collectives: tuple[CollectivePlan, ...]

    @property
    def bytes_per_gpu(self) -> float:
        return sum(c.bytes_per_gpu_per_step for c in self.collectives)

    @property
    def expected_seconds(self) -> float:
        return sum(c.expected_seconds_per_step for c in self.collectives)

    @property
    def exposed_seconds(self) -> float:
        return sum(c.exposed_seconds_per_step for c in self.collectives)


def _matching(
    axis: str, group: str, *, link: Link | None = None, unhideable: bool = False
) -> Callable[[CollectivePlan], bool]:
    """Predicate for collectives of ``axis`` on ``group`` (and ``link``, and below their budget, when asked)."""

    def keep(c: CollectivePlan) -> bool:
        return (
            c.axis == axis
            and c.group == group
            and (link is None or c.link is link)
            and (not unhideable or (not c.hideable and c.in_axis_ratio))
        )

    return keep


def _worst(stages: Sequence[StageSummary], keep: Callable[[CollectivePlan], bool]) -> _Traffic | None:
    """The stage whose kept collectives take the most expected seconds (first stage on ties), or ``None``."""
    best: _Traffic | None = None
    for stage in stages:
        traffic = _Traffic(pp_rank=stage.pp_rank, collectives=tuple(c for c in stage.collectives if keep(c)))
        if traffic.collectives and (best is None or traffic.expected_seconds > best.expected_seconds):
            best = traffic
    return best


def collect_findings(
    *,
    layout: ParallelLayout,
    hardware: HardwareConfig,
    assumptions: PlanAssumptions,
    spans: Mapping[str, GroupSpan],
    stages: Sequence[StageSummary],
    bubble_fraction: float,
    bubble_seconds: float,
    micro_batches: int,
    schedule: PipelineSchedule,
    cp_comm_type: CpCommType = CpCommType.P2P,
    moe_without_sequence_parallel: bool = False,
) -> tuple[Finding, ...]:
    """Every finding of a plan, errors first.

    Traffic numbers in messages are per GPU per step on the stage where that traffic takes the longest.

    Args:
        layout: the parallel layout.
        hardware: HBM, link bandwidths and NVLink domain size.
        assumptions: the bubble threshold.
        spans: group spans (:func:`meshscope.plan.comms.collective_spans`).
        stages: peak memory and collectives of every stage.
        bubble_fraction: pipeline bubble as a fraction of compute.
        bubble_seconds: expected bubble seconds per step.
        micro_batches: micro-batches per step.
        schedule: the pipeline schedule that runs.
        cp_comm_type: how context parallelism exchanges K and V (names its traffic).
        moe_without_sequence_parallel: an MoE model runs with tp > 1 and without sequence parallelism.

    Returns:
        The findings, sorted by severity (stable within one severity).
    """
    network = _Network(layout=layout, hardware=hardware, spans=spans, stages=stages)
    findings = [
        *_memory(hardware, stages),
        *_tp_crossing(network),
        *_axis_over_network("ep-all-to-all-over-network", network, axis="ep", what="all-to-all"),
        *_axis_over_network("cp-over-network", network, axis="cp", what=_CP_TRAFFIC[cp_comm_type]),
        *_moe_tp_without_sp(layout, enabled=moe_without_sequence_parallel),
        *_bubble(
            layout,
            assumptions=assumptions,
            fraction=bubble_fraction,
            seconds=bubble_seconds,
            micro_batches=micro_batches,
            schedule=schedule,
        ),
        *_below_budget(stages),
        *_axis_over_network("pp-over-network", network, axis="pp", what="stage-to-stage send/recv"),
    ]
    return tuple(sorted(findings, key=lambda f: f.severity.rank))


_CP_TRAFFIC = {
    CpCommType.P2P: "ring exchange",
    CpCommType.ALL_GATHER: "K/V all-gather",
    CpCommType.A2A: "Ulysses all-to-all",
}


def _moe_tp_without_sp(layout: ParallelLayout, *, enabled: bool) -> list[Finding]:
    if not enabled:
        return []
    return [
        Finding(
            code="moe-tp-without-sp",
            severity=Severity.WARNING,
            message=(
                f"an MoE model with tp={layout.tp} needs parallelism.sequenceParallel: Megatron-core refuses to train "
                "MoE with tensor parallelism without it (MoELayer.forward raises), because every tp rank would route "
                "and compute the same tokens; the plan assumes each tp rank routes its own sequence shard"
            ),
        )
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Network:
    layout: ParallelLayout
    hardware: HardwareConfig
    spans: Mapping[str, GroupSpan]
    stages: Sequence[StageSummary]


def _memory(hardware: HardwareConfig, stages: Sequence[StageSummary]) -> list[Finding]:
    usable = hardware.usable_hbm_bytes
    over = [s for s in stages if s.memory.total_bytes > usable]
    if not over:
        return []
    worst = max(over, key=lambda s: s.memory.total_bytes)
    mem = worst.memory
    reserved = f" ({_gib(hardware.gpu.hbm_bytes)} minus {_gib(hardware.reserved_bytes)} reserved)"
    message = (
        f"pipeline stage {worst.pp_rank} needs {_gib(mem.total_bytes)} per GPU (weights {_gib(mem.weights_bytes)}, "
        f"gradients {_gib(mem.gradients_bytes)}, optimizer {_gib(mem.optimizer_bytes)}, activations "
        f"{_gib(mem.activations_bytes)}) but {_gib(usable)} of HBM is usable"
        f"{reserved if hardware.reserved_bytes else ''}: over by {_gib(mem.total_bytes - usable)}"
    )
    if len(over) > 1:
        message += f"; {len(over)} of {len(stages)} stages exceed HBM ({', '.join(str(s.pp_rank) for s in over)})"
    return [Finding(code="memory-exceeds-hbm", severity=Severity.ERROR, message=message)]


def _tp_crossing(network: _Network) -> list[Finding]:
    layout, hardware, spans = network.layout, network.hardware, network.spans
    out = []
    nvlink, nic = hardware.scaleup_bandwidth_bytes_per_s, hardware.nic_bandwidth_bytes_per_s
    tp_crosses = "tp" in spans and spans["tp"].groups_crossing_domains > 0
    for key, degree in (("tp", layout.tp), ("etp", layout.expert_tp)):
        span = spans.get(key)
        if span is None or not span.groups_crossing_domains:
            continue
        if key == "etp" and layout.expert_tp == layout.tp and tp_crosses:
            continue  # the same groups as TP: already reported
        traffic = _worst(network.stages, _matching("tp", key))
        numbers = ""
        if traffic is not None:
            numbers = (
                f"; {_gib(traffic.bytes_per_gpu)} per GPU per step, {_seconds(traffic.exposed_seconds)} exposed "
                f"(pipeline stage {traffic.pp_rank})"
            )
        out.append(
            Finding(
                code="tp-crosses-nvlink-domain",
                severity=Severity.WARNING,
                message=(
                    f"{key}={degree} groups span {span.max_domains_per_group} NVLink domains "
                    f"({hardware.nvlink_domain_gpus} GPUs each): {span.groups_crossing_domains} of {span.groups} "
                    f"{key.upper()} groups cross the network at {_gb_per_s(nic)} instead of {_gb_per_s(nvlink)}"
                    f"{numbers}; keep {key} <= {hardware.nvlink_domain_gpus}"
                ),
            )
        )
    return out


def _axis_over_network(code: str, network: _Network, *, axis: str, what: str) -> list[Finding]:
    hardware = network.hardware
    span = network.spans.get(axis)
    traffic = _worst(network.stages, _matching(axis, axis))
    if span is None or not span.groups_crossing_domains or traffic is None:
        return []
    return [
        Finding(
            code=code,
            severity=Severity.INFO if axis == "pp" else Severity.WARNING,
            message=(
                f"{axis}={network.layout.degree(axis)} {what} crosses the network in {span.groups_crossing_domains} "
                f"of {span.groups} {axis.upper()} groups (up to {span.max_domains_per_group} NVLink domains of "
                f"{hardware.nvlink_domain_gpus} GPUs per group): {_gib(traffic.bytes_per_gpu)} per GPU per step at "
                f"{_gb_per_s(hardware.nic_bandwidth_bytes_per_s)} instead of "
                f"{_gb_per_s(hardware.scaleup_bandwidth_bytes_per_s)}; expected {_seconds(traffic.expected_seconds)} "
                f"per step, {_seconds(traffic.exposed_seconds)} exposed (pipeline stage {traffic.pp_rank})"
            ),
        )
    ]


def _bubble(
    layout: ParallelLayout,
    *,
    assumptions: PlanAssumptions,
    fraction: float,
    seconds: float,
    micro_batches: int,
    schedule: PipelineSchedule,
) -> list[Finding]:
    if layout.pp == 1 or fraction <= assumptions.bubble_warning_fraction:
        return []
    interleaved = schedule.value == "interleaved"
    formula = (
        f"(pp-1)/(m·vpp) = {layout.pp - 1}/({micro_batches}·{layout.vpp})"
        if interleaved
        else f"(pp-1)/m = {layout.pp - 1}/{micro_batches}"
    )
    advice = "raise the number of micro-batches (global batch ÷ (micro-batch · dp))"
    if not interleaved:
        advice += " or use the interleaved schedule (vpp > 1)"
    return [
        Finding(
            code="bubble-large",
            severity=Severity.WARNING,
            message=(
                f"pipeline bubble is {fraction:.1%} of compute, above {assumptions.bubble_warning_fraction:.0%}: "
                f"{formula} with pp={layout.pp} and {micro_batches} micro-batches ({schedule.value}); expected "
                f"{_seconds(seconds)} idle per step; {advice}"
            ),
        )
    ]


def _below_budget(stages: Sequence[StageSummary]) -> list[Finding]:
    keys = dict.fromkeys(
        (c.axis, c.group, c.link) for s in stages for c in s.collectives if not c.hideable and c.in_axis_ratio
    )
    out = []
    for axis, group, link in keys:
        traffic = _worst(stages, _matching(axis, group, link=link, unhideable=True))
        if traffic is None:  # pragma: no cover - every key comes from a collective that is not hideable
            continue
        chosen = traffic.collectives
        first = chosen[0]
        ops = " + ".join(dict.fromkeys(c.op.value for c in chosen))
        purposes = "; ".join(dict.fromkeys(c.purpose for c in chosen))
        peak = first.link_budget_flops_per_byte * first.bandwidth_bytes_per_s
        where = group if group == axis else f"{axis} ({group} group)"
        out.append(
            Finding(
                code="flops-per-byte-below-budget",
                severity=Severity.WARNING,
                message=(
                    f"{where} {ops} over {link.value} ({purposes}): {first.flops_per_byte:,.0f} FLOPs per byte "
                    f"< link budget {first.link_budget_flops_per_byte:,.0f} ({peak / 1e12:,.0f} TFLOP/s ÷ "
                    f"{_gb_per_s(first.bandwidth_bytes_per_s)}), so it cannot be hidden behind compute; expected "
                    f"{_seconds(traffic.expected_seconds)} per step on pipeline stage {traffic.pp_rank}, "
                    f"{_seconds(traffic.exposed_seconds)} exposed"
                ),
            )
        )
    return out

"""Layout search: every valid (tp, pp, dp, cp, ep, vpp, micro-batch) for a model on N GPUs, ranked by expected step.

This answers "what does this choice cost before I scale it": each candidate is planned exactly as ``meshscope plan``
plans a manifest (same cross-field checks, same planner, same assumptions), those that do not fit in HBM are dropped,
and the rest are ranked by expected step time. Nothing here has its own cost model.

The space is pruned only by validity and by conventions every large-scale recipe follows, each stated here:

* ``tp`` stays inside one NVLink domain (a TP group over the network is 9-18x slower per byte; the planner's
  ``tp-crosses-nvlink-domain`` finding exists for manifests that do it anyway);
* sequence parallelism is on whenever ``tp > 1`` (it never costs bandwidth and always saves activation memory);
* ``cp`` and ``etp`` are powers of two, ``cp`` at most 16;
* ``vpp`` is at most 8 (more chunks multiply pipeline transfers for a shrinking bubble gain).

Cost grows with the number of candidates, not with GPUs: placement spans are vectorised over ranks and computed
once per (tp, pp, cp, ep) shape, shared by every vpp and micro-batch.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from meshscope.errors import PlanError, SpecError
from meshscope.jobs import (
    JobSpec,
    ParallelismConfig,
    PipelineSchedule,
    Precision,
    Recompute,
    TrainingConfig,
    check_job,
)
from meshscope.plan import plan_job
from meshscope.plan.comms import collective_spans
from meshscope.topology import AXES, ParallelLayout, Placement

if TYPE_CHECKING:
    from collections.abc import Iterator

    from meshscope.jobs import ModelConfig
    from meshscope.plan import Plan, PlanAssumptions
    from meshscope.topology import GroupSpan, HardwareConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchRequest:
    """What to search over."""

    model: ModelConfig
    """The model (its ``seq_length`` unless ``seq_length`` is given)."""
    hardware: HardwareConfig
    """The machines; their GPU count is the world size."""
    global_batch_size: int
    """Sequences per optimizer step."""
    seq_length: int | None = None
    """Tokens per sequence; ``None`` keeps the model's."""
    precision: Precision = Precision.BF16
    """Matmul precision."""
    recompute: Recompute = Recompute.SELECTIVE
    """Activation recomputation for every candidate."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron's distributed optimizer); off where ``zero_stage`` is
    given."""
    zero_stage: int = 0
    """ZeRO stage 1-3 for every candidate instead of the distributed optimizer (3: FSDP); 0: not used."""
    dp_shard: int | None = None
    """Hybrid sharding (HSDP): shard over this many data-parallel ranks, replicated over the rest, in every layout whose
    dp is a multiple of it (one with less dp shards over all of it; others are rejected, counted as ``dp_shard``)."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Micro-batch sizes to try."""
    max_vpp: int = 8
    """Largest virtual pipeline size to try."""
    max_cp: int = 16
    """Largest context-parallel degree to try."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One layout that fits in memory, with what the planner expects of it."""

    layout: ParallelLayout
    """The layout."""
    micro_batch_size: int
    """Sequences per micro-batch."""
    expected_step_seconds: float
    """Expected step time of the slowest stage, seconds."""
    peak_memory_bytes: int
    """Memory of the fullest pipeline stage, bytes."""
    headroom_bytes: int
    """HBM left on the fullest stage, bytes."""
    bubble_fraction: float
    """Pipeline bubble as a fraction of ideal compute."""
    exposed_comm_seconds: float
    """Exposed communication of the slowest stage, all axes, seconds."""
    expected_mfu: float
    """Model FLOPs utilisation at the expected step time."""
    findings: int
    """Planner findings (any severity)."""

    def to_dict(self) -> dict[str, object]:
        """JSON form (base units)."""
        return {
            "layout": {**{a.value: self.layout.degree(a) for a in AXES}, "vpp": self.layout.vpp},
            "micro_batch_size": self.micro_batch_size,
            "expected_step_seconds": self.expected_step_seconds,
            "peak_memory_bytes": self.peak_memory_bytes,
            "headroom_bytes": self.headroom_bytes,
            "bubble_fraction": self.bubble_fraction,
            "exposed_comm_seconds": self.exposed_comm_seconds,
            "expected_mfu": self.expected_mfu,
            "findings": self.findings,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchResult:
    """Ranked candidates plus what was thrown away and why."""

    evaluated: int
    """Layouts planned."""
    candidates: tuple[Candidate, ...]
    """Layouts that fit in HBM, fastest first."""
    rejected: dict[str, int]
    """Why the others were dropped: ``{"exceeds HBM": n, "spec.model.attentionHeads": n, ...}``."""
    closest_misfit: Candidate | None = None
    """The layout that came closest to fitting among those that did not (smallest peak memory)."""

    def to_dict(self, *, top: int | None = None) -> dict[str, object]:
        """JSON form; ``top`` limits the candidates listed."""
        shown = self.candidates if top is None else self.candidates[:top]
        return {
            "evaluated": self.evaluated,
            "fitting": len(self.candidates),
            "rejected": dict(self.rejected),
            "candidates": [c.to_dict() for c in shown],
            "closest_misfit": None if self.closest_misfit is None else self.closest_misfit.to_dict(),
        }


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit]


def enumerate_layouts(request: SearchRequest) -> Iterator[tuple[ParallelLayout, int, bool]]:  # noqa: C901 - one loop per axis
    """Every (layout, micro-batch) the search considers, before validity checks on the model and batch.

    Yields:
        ``(layout, micro_batch_size, split_extra)`` whose degrees multiply to the GPU count; ``split_extra`` means
        the pipeline split counts the embedding and the loss as one layer each.
    """
    gpus = request.hardware.world_size
    model = request.model
    domain = request.hardware.nvlink_domain_gpus
    experts = model.moe.experts if model.moe is not None else 1
    for tp in _divisors(gpus):
        if tp > domain:
            break
        for cp in _powers_of_two(min(request.max_cp, gpus // tp)):
            if gpus % (tp * cp):
                continue
            for pp in _divisors(gpus // (tp * cp)):
                if pp > model.layers:
                    break
                dp = gpus // (tp * cp * pp)
                for ep in _divisors(experts):
                    if (tp * cp * dp) % (tp * ep):
                        continue
                    vpps = [v for v in range(1, request.max_vpp + 1) if pp > 1 or v == 1]
                    for vpp in vpps:
                        layout = ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp)
                        # Megatron can count the embedding and the loss as one layer each in the pipeline split
                        # (Llama 3 405B: 126 + 2 layers over 16 stages); try that where the plain split is uneven.
                        uneven = model.layers % (pp * vpp) != 0
                        split_extra = uneven and pp > 1 and (model.layers + 2) % (pp * vpp) == 0
                        for b in request.micro_batch_sizes:
                            yield layout, b, split_extra


def search_layouts(request: SearchRequest, *, assumptions: PlanAssumptions | None = None) -> SearchResult:
    """Plan every valid layout and rank those that fit in memory by expected step time.

    Raises:
        PlanError: if no layout is valid at all (the message says the most common reasons).
    """
    model = request.model if request.seq_length is None else replace(request.model, seq_length=request.seq_length)
    base_training = TrainingConfig(
        micro_batch_size=1,
        global_batch_size=request.global_batch_size,
        precision=request.precision,
        recompute=request.recompute,
        distributed_optimizer=request.distributed_optimizer and not request.zero_stage,
        zero_stage=request.zero_stage,
    )
    if request.dp_shard is not None and not (request.zero_stage or request.distributed_optimizer):
        raise PlanError(f"dp_shard {request.dp_shard} shards nothing: give a ZeRO stage or the distributed optimizer")
    placement = Placement.for_hardware(request.hardware.world_size, request.hardware)
    rejected: Counter[str] = Counter()
    candidates: list[Candidate] = []
    closest: Candidate | None = None
    evaluated = 0
    spans_by_shape: dict[tuple[int, ...], dict[str, GroupSpan]] = {}
    for layout, b, split_extra in enumerate_layouts(replace(request, model=model)):
        schedule = PipelineSchedule.INTERLEAVED if layout.vpp > 1 else PipelineSchedule.ONE_F_ONE_B
        parallelism = ParallelismConfig(
            layout=layout,
            sequence_parallel=layout.tp > 1,
            account_for_embedding_in_pipeline_split=split_extra,
            account_for_loss_in_pipeline_split=split_extra,
        )
        shard = request.dp_shard if request.dp_shard is not None and request.dp_shard < layout.dp else None
        if shard is not None and layout.dp % shard:
            rejected["dp_shard"] += 1
            continue
        spec = JobSpec(
            name="search",
            model=model,
            parallelism=parallelism,
            training=replace(base_training, micro_batch_size=b, pipeline_schedule=schedule, dp_shard=shard),
            hardware=request.hardware,
        )
        shape = (layout.dp, layout.tp, layout.pp, layout.cp, layout.ep)
        try:
            check_job(spec)
            if shape not in spans_by_shape:
                spans_by_shape[shape] = collective_spans(layout, placement, model, dp_shard=shard)
            plan = plan_job(spec, placement=placement, assumptions=assumptions, spans=spans_by_shape[shape])
        except (SpecError, PlanError) as exc:
            rejected[exc.field if isinstance(exc, SpecError) else "planner"] += 1
            continue
        evaluated += 1
        candidate = _candidate(plan, b)
        if candidate.headroom_bytes < 0:
            rejected["exceeds HBM"] += 1
            if closest is None or candidate.peak_memory_bytes < closest.peak_memory_bytes:
                closest = candidate
            continue
        candidates.append(candidate)
    if not evaluated:
        reasons = ", ".join(f"{field} ({n})" for field, n in rejected.most_common(3))
        raise PlanError(f"no valid layout of {model.name} on {request.hardware.world_size} GPUs; rejected by {reasons}")
    candidates.sort(key=lambda c: (c.expected_step_seconds, c.peak_memory_bytes))
    return SearchResult(
        evaluated=evaluated, candidates=tuple(candidates), rejected=dict(rejected), closest_misfit=closest
    )


def _candidate(plan: Plan, micro_batch_size: int) -> Candidate:
    fullest = max(plan.stages, key=lambda s: s.memory.total_bytes)
    step = plan.expected_step_time
    return Candidate(
        layout=plan.layout,
        micro_batch_size=micro_batch_size,
        expected_step_seconds=step.total_seconds,
        peak_memory_bytes=fullest.memory.total_bytes,
        headroom_bytes=fullest.headroom_bytes,
        bubble_fraction=plan.bubble_fraction,
        exposed_comm_seconds=sum(step.exposed_comm_seconds.values()),
        expected_mfu=plan.expected_mfu,
        findings=len(plan.findings),
    )


__all__ = ["Candidate", "SearchRequest", "SearchResult", "enumerate_layouts", "search_layouts"]

"""The named efficiency assumptions behind every expected time the planner prints.

Formulas give FLOPs and bytes; turning them into seconds needs numbers no formula gives: how close to peak the GPU
runs, how much of a link's bandwidth NCCL achieves, which collectives hide behind compute and by how much. They all
live here, each with its default and the reason for it, so that a plan can always say what it assumed
(``Plan.to_dict()["assumptions"]``) and a user can replace any one of them. Nothing here computes anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshscope.errors import PlanError


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanAssumptions:
    """Efficiencies and overlap fractions that turn FLOPs and bytes into expected seconds.

    An overlap fraction says how much of a collective *may* run under compute; the planner also caps the hidden part
    by the compute actually available in the collective's overlap window (for example the backward pass of the last
    micro-batch for the data-parallel gradient reduction), so a collective that is larger than its window stays
    partly exposed whatever the fraction.
    """

    compute_efficiency: float = 0.5
    """Achieved fraction of the GPU's dense peak FLOP/s on the FLOPs actually executed (hardware FLOPs, recompute
    included), 0-1. Default 0.5: well-tuned Megatron runs reach 0.4-0.55 MFU on H100 (Megatron-LM README, 2024
    table)."""
    nvlink_efficiency: float = 0.8
    """Achieved fraction of the per-direction NVLink bandwidth for large NCCL collectives, 0-1. Default 0.8
    (nccl-tests bus bandwidth on HGX H100 reaches ~360 of 450 GB/s)."""
    network_efficiency: float = 0.7
    """Achieved fraction of the per-direction NIC bandwidth across nodes, 0-1. Default 0.7 (ring all-reduce over
    400 Gb/s InfiniBand typically reaches 35-40 of 50 GB/s)."""
    hbm_efficiency: float = 0.8
    """Achieved fraction of HBM bandwidth for the optimizer step (a streaming, memory-bound kernel), 0-1."""
    causal_attention: bool = True
    """Count attention FLOPs for a causal mask: ``QK^T`` and ``AV`` do half of the ``s^2`` work (Megatron-LM since
    commit 8873b55d6a, 2025-03). ``False`` counts the full ``s^2`` (Korthikanti et al. 2022, Narayanan et al. 2021,
    Megatron-LM before 2025-03) and makes the FLOPs/byte values of reference/planner.md §1.7 reproducible. The plan
    always reports the non-causal model FLOPs as well."""
    tp_comm_overlap: float = 0.8
    """Fraction of tensor-parallel all-reduce / all-gather / reduce-scatter time hidden behind GEMMs when
    ``training.tp_comm_overlap`` is on (Transformer Engine userbuffers); with it off, TP collectives are exposed."""
    sp_backward_allgather_overlap: float = 1.0
    """Fraction of the extra sequence-parallel all-gather in the backward pass (re-gathering the input of each
    column-parallel GEMM for its weight gradient) hidden behind the data-gradient GEMM; Megatron launches it
    asynchronously (Korthikanti et al. 2022, §4.2.2)."""
    dp_grad_reduce_overlap: float = 0.9
    """Fraction of the data-parallel gradient reduction hidden behind the backward pass when
    ``training.overlap_grad_reduce`` is on; the last bucket can only start once backward is over. Capped by the
    backward time of the last micro-batch (once-per-step reductions) or of all micro-batches (ZeRO-2/3, which reduce
    every micro-batch)."""
    dp_param_gather_overlap: float = 0.9
    """Fraction of the distributed-optimizer / ZeRO parameter all-gather hidden behind the forward pass when
    ``training.overlap_param_gather`` is on; the first bucket is needed before the first layer runs. Capped by the
    forward time of the first micro-batch (once per step) or of all micro-batches (ZeRO-3)."""
    cp_comm_overlap: float = 0.8
    """Fraction of the context-parallel ring exchange of K/V hidden behind the attention-core compute of the
    previous chunk (Transformer Engine's ring attention); capped by the attention-core time."""
    ep_comm_overlap: float = 0.0
    """Fraction of the expert-parallel all-to-all hidden behind compute. Default 0: Megatron's default dispatcher
    runs dispatch and combine on the critical path (overlap needs ``--overlap-moe-expert-parallel-comm`` or
    DualPipe)."""
    pp_comm_overlap: float = 0.0
    """Fraction of pipeline send/recv time hidden behind compute. Default 0 (exposed): in 1F1B each transfer sits
    between a stage's forward and its neighbour's."""
    pp_scatter_gather: bool = False
    """Whether pipeline transfers without sequence parallelism send ``1/tp`` of the activation per TP rank
    (Narayanan et al. 2021, §4.1 scatter/gather). Megatron-core sends the full tensor unless sequence parallelism
    already shards it, so the default is ``False``."""
    bubble_warning_fraction: float = 0.10
    """Pipeline bubble, as a fraction of compute, above which the plan reports ``bubble-large``."""

    def __post_init__(self) -> None:
        """Check that efficiencies lie in (0, 1] and overlap fractions in [0, 1].

        Raises:
            PlanError: naming the field and its value.
        """
        for name in ("compute_efficiency", "nvlink_efficiency", "network_efficiency", "hbm_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise PlanError(f"assumption {name} must lie in (0, 1], got {value!r}")
        for name in (
            "tp_comm_overlap",
            "sp_backward_allgather_overlap",
            "dp_grad_reduce_overlap",
            "dp_param_gather_overlap",
            "cp_comm_overlap",
            "ep_comm_overlap",
            "pp_comm_overlap",
        ):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise PlanError(f"assumption {name} must lie in [0, 1], got {value!r}")
        if self.bubble_warning_fraction < 0:
            raise PlanError(f"assumption bubble_warning_fraction must be >= 0, got {self.bubble_warning_fraction!r}")

    def link_efficiency(self, link: str) -> float:
        """Achieved fraction of ``link``'s bandwidth (``nvlink`` or ``network``)."""
        return self.nvlink_efficiency if link == "nvlink" else self.network_efficiency

    def to_dict(self) -> dict[str, float | bool]:
        """Every assumption by name."""
        return dict(asdict(self))

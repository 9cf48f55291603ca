"""The named assumptions behind every expected time the planner prints, each with its default and its source.

Formulas give FLOPs and bytes; turning them into seconds needs numbers no formula gives: how close to peak a GEMM of a
given shape runs, how fast the attention kernel is, what latency and bandwidth fraction each NCCL protocol reaches on
each link, which collectives hide behind compute and by how much. They all live here, each with its default and the
reason for it, so that a plan can always say what it assumed (``Plan.to_dict()["assumptions"]``) and a user (or the
calibration of a measured run) can replace any one of them: in code, from ``spec.assumptions`` of a TrainingJob, or from
a YAML file (``meshscope plan --assumptions FILE``), both read by :func:`assumptions_from_mapping`.

Nothing here computes a time, and nothing here reads a file: the caller parses the YAML.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Final

from meshscope.errors import PlanError

_US: Final = 1e-6


@dataclass(frozen=True, slots=True, kw_only=True)
class NcclProtocolCosts:
    """Latency and bandwidth of one NCCL algorithm x protocol, as NCCL's own tuning model prices it.

    NCCL's tuner (``src/graph/tuning.cc``, NVIDIA/nccl @ ``b6475625``, ``ncclTopoTuneModel`` and
    ``ncclTopoGetAlgoTime``) prices a collective as ``latency + bytes / bandwidth`` for every algorithm and protocol
    and runs the cheapest. The latency is a base cost plus one per-hop cost per step of the algorithm (``baseLat``,
    ``hwLat`` for NVLink and for the network); the bandwidth is the link's bus bandwidth times a protocol factor
    (``LL`` sends 8-byte lines with 4 bytes of data and a flag: ``1/4`` on rings; ``LL128`` 120 of every 128 bytes:
    ``0.92``; trees lose another ``0.92``). Defaults per field are NCCL's numbers for that pair; see
    docs/planner.md, "Collectives: latency and bandwidth".
    """

    base_latency_s: float
    """Fixed cost of one collective, seconds (``baseLat``)."""
    nvlink_hop_latency_s: float
    """Cost of one step over NVLink, seconds (``hwLat[NVLINK]``)."""
    network_hop_latency_s: float
    """Cost of one step over the network, seconds (``hwLat[NET]``)."""
    bandwidth_fraction: float
    """Fraction of the link's achievable bus bandwidth this protocol moves payload at, 0-1."""

    def __post_init__(self) -> None:
        """Check latencies are finite and >= 0 and the fraction lies in (0, 1].

        Raises:
            PlanError: naming the field and its value.
        """
        for name in ("base_latency_s", "nvlink_hop_latency_s", "network_hop_latency_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise PlanError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if not (isinstance(self.bandwidth_fraction, int | float) and 0 < self.bandwidth_fraction <= 1):
            raise PlanError(f"bandwidth_fraction must lie in (0, 1], got {self.bandwidth_fraction!r}")


def _nccl(base_us: float, nvlink_us: float, network_us: float, fraction: float) -> NcclProtocolCosts:
    return NcclProtocolCosts(
        base_latency_s=base_us * _US,
        nvlink_hop_latency_s=nvlink_us * _US,
        network_hop_latency_s=network_us * _US,
        bandwidth_fraction=fraction,
    )


# NCCL tuning.cc @ b6475625 (Hopper-era constants, microseconds): baseLat Ring {LL 6.6, LL128 14.0, Simple 8.4},
# Tree {6.8, 14.0, 0}; hwLat NVLink Ring {.6, 1.9, 3.4}, Tree {.6, 1.25, 28}; NET Ring {2.7, 4.0, 14.0},
# Tree {5.0, 8.5, 28}. Bandwidth factors: Ring LL 1/4 (1/3 for single-node all-gather / reduce-scatter; the planner
# keeps 1/4), Ring LL128 0.92, Tree 0.92 x (LL 1/3.8, LL128 120/128 across nodes).
RING_LL: Final = _nccl(6.6, 0.6, 2.7, 0.25)
RING_LL128: Final = _nccl(14.0, 1.9, 4.0, 0.92)
RING_SIMPLE: Final = _nccl(8.4, 3.4, 14.0, 1.0)
TREE_LL: Final = _nccl(6.8, 0.6, 5.0, 0.92 / 3.8)
TREE_LL128: Final = _nccl(14.0, 1.25, 8.5, 0.92 * 120 / 128)
TREE_SIMPLE: Final = _nccl(0.0, 28.0, 28.0, 0.92)

NCCL_ALGORITHMS: Final = ("ring", "tree")
"""The NCCL algorithms the planner prices (NVLS and CollNet are not modelled)."""
NCCL_PROTOCOLS: Final = ("ll", "ll128", "simple")
"""The NCCL protocols the planner prices."""

GEMM_TILES: Final = ((128, 128), (128, 256), (256, 128))
"""Output tiles (rows x columns) a GEMM library picks from for large BF16 GEMMs: NVIDIA's *Matrix Multiplication
Background User's Guide* (docs.nvidia.com/deeplearning/performance, "Tile quantization": cuBLAS tiles of 256x128,
128x256 and 128x128 are the most efficient; smaller tiles trade reuse for less quantization, which this model does
not price, so they are left out)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanAssumptions:
    """Efficiencies, latencies and overlap fractions that turn FLOPs and bytes into expected seconds.

    An overlap fraction says how much of a collective *may* run under compute; the planner also caps the hidden part
    by the compute actually available in the collective's overlap window (for example the backward pass of the last
    micro-batch for the data-parallel gradient reduction), so a collective that is larger than its window stays
    partly exposed whatever the fraction.

    What calibration fits (issue 12, second half) are the fields of the first two groups below: the compute ceilings
    per operation class (``gemm_efficiency``, ``attention_efficiency``, ``hbm_efficiency``) and the link terms
    (``nvlink_efficiency``, ``network_efficiency`` and the per-hop latencies of the NCCL protocols).
    """

    # ---------------------------------------------------------------------------------------------- compute
    compute_efficiency: float | None = None
    """Flat model override, 0-1: when set, every FLOP (hardware FLOPs, recompute included) runs at this fraction of
    the dense peak, element-wise work costs nothing, and the per-operation roofline below is not used. ``None``
    (default): the roofline per operation class. The emulated accelerator of ``meshscope run`` sets 1 (its compute
    is a sleep of FLOPs ÷ peak). Megatron's 2024 H100 table reaches 0.41-0.48 MFU end to end."""
    gemm_efficiency: float | None = None
    """Ceiling of a GEMM's compute time as a fraction of the dense peak, 0-1, before tile and wave quantization.
    ``None`` (default): the GPU's ``matmul_achievable_fraction`` from the hardware catalogue (0.620 on H100 SXM, what
    NVIDIA's published DGX H100 run of Llama 3.1 405B sustained; 0.824 on A100 SXM, what cuBLAS sustains on normally
    distributed inputs)."""
    gemm_tiles: tuple[tuple[int, int], ...] = GEMM_TILES
    """Output tiles (rows, columns) the GEMM library may pick; the planner takes the one with the least tile and wave
    quantization for each GEMM (NVIDIA *Matrix Multiplication Background User's Guide*)."""
    attention_efficiency: float = 0.55
    """Fraction of the dense peak the fused attention core (FlashAttention) reaches on its model FLOPs, forward and
    backward, 0-1. FlashAttention-2 (Dao 2023, abstract): 50-73 % of A100 peak forward; FlashAttention-3 (Shah et
    al. 2024, abstract): up to 75 % of H100 in FP16 forward; causal masks and the backward pass sit at the low end,
    hence 0.55."""
    hbm_efficiency: float = 0.8
    """Achieved fraction of HBM bandwidth for memory-bound kernels (element-wise ops and norms, the optimizer step,
    the memory side of a GEMM's roofline), 0-1. STREAM-style copies reach ~0.9 of the datasheet bandwidth on H100-class
    GPUs; fused training kernels (norms, activation functions, Adam) less, hence 0.8."""
    causal_attention: bool = True
    """Count attention FLOPs for a causal mask: ``QK^T`` and ``AV`` do half of the ``s^2`` work (Megatron-LM since
    commit 8873b55d6a, 2025-03). ``False`` counts the full ``s^2`` (Korthikanti et al. 2022, Narayanan et al. 2021,
    Megatron-LM before 2025-03) and makes the FLOPs/byte values of reference/planner.md §1.7 reproducible. The plan
    always reports the non-causal model FLOPs as well."""

    # ---------------------------------------------------------------------------------------------- links
    nvlink_efficiency: float = 0.8
    """Achieved fraction of the per-direction NVLink bandwidth for large NCCL collectives (the Simple protocol's bus
    bandwidth), 0-1. Default 0.8 (nccl-tests bus bandwidth on HGX H100 reaches ~360 of 450 GB/s)."""
    network_efficiency: float = 0.7
    """Achieved fraction of the per-direction NIC bandwidth across nodes, 0-1. Default 0.7 (ring all-reduce over
    400 Gb/s InfiniBand typically reaches 35-40 of 50 GB/s)."""
    nccl_latency: bool = True
    """Price collectives as NCCL's tuner does: latency + bandwidth per algorithm (ring, tree) and protocol (LL, LL128,
    Simple), the cheapest one chosen. ``False``: bandwidth only, at the Simple protocol's full bus bandwidth (the flat
    model; the emulated accelerator of ``meshscope run`` uses it, gloo has no NCCL protocols)."""
    ring_ll: NcclProtocolCosts = RING_LL
    """Ring algorithm, LL protocol (NCCL tuning.cc: base 6.6 µs, hop 0.6 µs NVLink / 2.7 µs network, 1/4 of the bus
    bandwidth)."""
    ring_ll128: NcclProtocolCosts = RING_LL128
    """Ring, LL128 (base 14.0 µs, hop 1.9 / 4.0 µs, 0.92 of the bus bandwidth)."""
    ring_simple: NcclProtocolCosts = RING_SIMPLE
    """Ring, Simple (base 8.4 µs, hop 3.4 / 14.0 µs, the full bus bandwidth)."""
    tree_ll: NcclProtocolCosts = TREE_LL
    """Tree (all-reduce only), LL (base 6.8 µs, hop 0.6 / 5.0 µs, 0.92/3.8 of the bus bandwidth)."""
    tree_ll128: NcclProtocolCosts = TREE_LL128
    """Tree, LL128 (base 14.0 µs, hop 1.25 / 8.5 µs, 0.92 x 120/128)."""
    tree_simple: NcclProtocolCosts = TREE_SIMPLE
    """Tree, Simple (base 0, hop 28 µs on either link: the latency of a 256 KiB chunk, 0.92)."""
    nccl_algorithms: tuple[str, ...] = NCCL_ALGORITHMS
    """Algorithms the planner may choose from (``ring``, ``tree``), as ``NCCL_ALGO`` restricts NCCL's. A calibrated
    file (``meshscope calibrate``) keeps only ``ring``: a run measures the algorithm it ran, not the others."""
    nccl_protocols: tuple[str, ...] = NCCL_PROTOCOLS
    """Protocols the planner may choose from (``ll``, ``ll128``, ``simple``), as ``NCCL_PROTO`` restricts NCCL's; a
    calibrated file keeps only ``simple``, whose costs it fitted."""

    # ---------------------------------------------------------------------------------------------- overlap
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
    (Narayanan et al. 2021, §4.1 scatter/gather), the receiver all-gathering the slices over its TP group. Megatron-LM
    before Megatron-core did this by default (``--no-scatter-gather-tensors-in-pipeline`` turned it off;
    ``p2p_communication._communicate`` splits with ``split_tensor_into_1d_equal_chunks`` unless sequence parallelism
    is on, and gathers with ``gather_split_1d_tensor``): set it to plan runs of that code, such as Korthikanti et al.
    2022. Megatron-core sends the full tensor unless sequence parallelism already shards it, so the default is
    ``False``."""
    fp8_attention: bool = False
    """Whether FP8 training runs the attention core (``QK^T``, softmax, ``AV``) in FP8 too. Default ``False``: it runs
    at the BF16 peak, as Transformer Engine does unless its recipe sets ``fp8_dpa`` (``DelayedScaling``'s default is
    off; NeMo's and Megatron's FP8 recipes cast the linear layers' GEMMs only)."""
    grad_accumulation_fusion: bool = True
    """Whether each micro-batch's weight gradients are added to the main-gradient buffer inside the weight-gradient
    GEMM (Megatron-core's ``gradient_accumulation_fusion``, on by default with Transformer Engine or apex: the GEMM
    writes the buffer, no extra pass). ``False``: a separate memory-bound pass per micro-batch over every parameter
    on the GPU, as PyTorch's autograd (``AccumulateGrad``) does under DDP and FSDP and Megatron's
    ``--no-gradient-accumulation-fusion``: it reads the fresh gradient (the weight's bytes) and reads and writes the
    buffer (``grad_reduce_bytes`` each; the first micro-batch of a step only writes it), at ``hbm_efficiency``,
    counted in backward compute."""
    bubble_warning_fraction: float = 0.10
    """Pipeline bubble, as a fraction of compute, above which the plan reports ``bubble-large``."""

    # ---------------------------------------------------------------------------------------------- host side
    optimizer_hbm_efficiency: float | None = None
    """Achieved fraction of HBM bandwidth of the optimizer step alone, 0-1; ``None`` (default): ``hbm_efficiency``.
    Separate because a measured optimizer step (``meshscope calibrate``) says nothing about element-wise kernels."""
    host_seconds_per_layer_pass: float = 0.0
    """Host time (kernel launches, Python, framework dispatch) one transformer layer adds to one micro-batch's forward
    and backward on a GPU, seconds, on top of the kernels' own time (a third in forward, two thirds in backward).
    Default 0. ``meshscope calibrate`` fits it on the emulated accelerator, whose kernels take exactly FLOPs ÷ peak,
    so that what the host adds is what is left; on real GPUs it cannot be told apart from the compute efficiency
    from one layout, and stays 0."""
    host_tokens_exponent: float = 0.0
    """How the host time per layer pass grows with a micro-batch's tokens: it is ``host_seconds_per_layer_pass x
    (tokens ÷ host_reference_tokens) ** host_tokens_exponent``, tokens per rank (``b·s ÷ cp``). Default 0: the same
    time at any micro-batch (launches and dispatch do not depend on the tensors' size). On a CPU testbed the host
    also does the tiny tensors' real math, which does; one run has one micro-batch size and cannot fit it
    (``meshscope.local.emulation.emulated_assumptions`` sets the testbed's measured value)."""
    host_reference_tokens: float | None = None
    """Tokens per rank per micro-batch at which ``host_seconds_per_layer_pass`` was measured (``meshscope calibrate``
    writes it); ``None`` (default): no scaling by tokens."""
    host_tp_factor: float = 1.0
    """How much tensor parallelism multiplies the host time per layer pass: with ``tp > 1`` every op on a sharded
    tensor also goes through the framework's sharding dispatch (DTensor's propagation and redistribution in PyTorch),
    and the ranks wake up after each of the layer's tensor-parallel collectives. Relative to the layout the time was
    measured at (``host_reference_tp``): a layout with ``tp > 1`` planned from one without multiplies by it, the
    other way divides. Default 1 (no change). One run has one tp and cannot fit it
    (``meshscope.local.emulation.emulated_assumptions`` sets the testbed's measured value)."""
    host_reference_tp: float | None = None
    """Tensor-parallel degree at which ``host_seconds_per_layer_pass`` was measured (``meshscope calibrate`` writes
    it); ``None`` (default): no scaling by tensor parallelism."""
    data_wait_seconds: float = 0.0
    """Time each step waits for the data loader, seconds. Default 0: a prefetching loader hides behind compute (no
    formula gives it; ``meshscope calibrate`` measures it)."""
    sync_wait_per_collective_seconds: float = 0.0
    """Mean time a GPU waits in each collective (not pipeline send/recv) for the group's last member to arrive,
    seconds: arrival skew from stragglers, jitter or, on shared CPUs, time slicing. Default 0 (a balanced job); the
    expected sync wait of an axis is this x its collectives per step (``meshscope calibrate`` measures it)."""
    host_overhead_seconds: float = 0.0
    """Time per step outside compute, communication, the optimizer and the loader (launches, Python, logging),
    seconds: the breakdown's ``other``. Default 0 (no formula gives it; ``meshscope calibrate`` measures it)."""
    dp_sync_wait_per_collective_seconds: float | None = None
    """``sync_wait_per_collective_seconds`` for the dp axis alone; ``None`` (default): the all-axes value.
    ``meshscope calibrate`` fits it per axis the run measured: the arrival skew of a data-parallel gradient
    reduce-scatter at the end of backward is not that of a tensor-parallel all-reduce inside every layer."""
    tp_sync_wait_per_collective_seconds: float | None = None
    """The same for tp."""
    cp_sync_wait_per_collective_seconds: float | None = None
    """The same for cp."""
    ep_sync_wait_per_collective_seconds: float | None = None
    """The same for ep."""
    cpu_cores: float | None = None
    """CPU cores every rank of the job shares, on a CPU testbed (``meshscope run`` of ``train_tiny``, many ranks on
    one machine): the cores the ranks could run on less the share other processes took (``OUT/collector.json``'s
    ``cpu.cores`` x (1 - ``foreign_fraction``)). ``None`` (default): every rank has its own accelerator and host
    (a GPU cluster), so the host, sync-wait and collective times do not depend on how many ranks there are. When set,
    the planner models CPU contention: those times are stretched by ``max(1, busy ranks ÷ cpu_cores)`` relative to
    ``cpu_contention_at_fit`` (docs/predict.md, "CPU contention")."""
    cpu_compute: bool = False
    """Whether the job's kernels themselves are CPU work (a script run on CPU ranks under ``meshscope run``: its
    records carry no GPU), so that its compute stretches with the CPU contention as the host time does. ``False``
    (default): the kernels run on an accelerator (a GPU, or the emulated accelerator's sleep, which is not CPU work).
    Only used with ``cpu_cores``."""
    cpu_contention_at_fit: float = 1.0
    """The contention factor ``max(1, busy ranks ÷ cpu_cores)`` of the run the host time per layer pass, the sync
    waits and the link fits were measured on (``meshscope calibrate`` writes it); 1 by default. Only used with
    ``cpu_cores``."""
    cpu_stage_contention_at_fit: float | None = None
    """The contention while a stage reduces its gradients and steps its optimizer, ``max(1, world ÷ pp ÷
    cpu_cores)``, of the run dp's sync wait and collectives and the optimizer were measured on (``meshscope
    calibrate`` writes it); ``None`` (default): ``cpu_contention_at_fit``, which it equals for a run without a
    pipeline. Only used with ``cpu_cores``."""
    cpu_time_scale: float = 1.0
    """Multiplies the expected seconds of the collectives a CPU testbed runs inside compute (tp, cp, ep, pp; latency
    and payload). Default 1; the planner sets it to the CPU contention ratio of the planned layout when ``cpu_cores``
    is set (not meant to be set by hand)."""
    cpu_stage_time_scale: float = 1.0
    """Multiplies the expected seconds of the optimizer step (AdamW on the CPU) on a CPU testbed. Default 1; the
    planner sets it to the ratio of the stage contentions (``cpu_stage_contention_at_fit``) when ``cpu_cores`` is set
    (not meant to be set by hand)."""
    cpu_dp_comm_time_scale: float = 1.0
    """Multiplies the expected seconds of dp's collectives on a CPU testbed. Default 1; the planner sets it to the
    planned layout's stage contention over ``cpu_contention_at_fit``, the contention the link fit is referenced to
    (``meshscope calibrate`` expresses a pipelined run's dp transfers at it), when ``cpu_cores`` is set (not meant to
    be set by hand)."""
    cpu_compute_time_scale: float = 1.0
    """Multiplies the expected compute seconds when ``cpu_compute`` is set. Default 1; the planner sets it to the CPU
    contention ratio of the planned layout (not meant to be set by hand)."""
    _hash: int = field(init=False, repr=False, compare=False, default=0)
    """The hash, computed once: the planner's caches key on the assumptions thousands of times per layout search."""

    def __hash__(self) -> int:
        """Hash of every assumption (computed once, in ``__post_init__``)."""
        return self._hash

    def __post_init__(self) -> None:
        """Check every field's type and range.

        Raises:
            PlanError: naming the field, its value and what fits.
        """
        for name, (low, high, low_open) in _RANGES.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if not (_is_number(value) and _within(value, low, high, low_open=low_open)):
                raise PlanError(f"assumption {name} must be {_fits(low, high, low_open=low_open)}, got {value!r}")
        for name in _BOOLEANS:
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"assumption {name} must be true or false, got {getattr(self, name)!r}")
        for name in NCCL_FIELDS:
            if not isinstance(getattr(self, name), NcclProtocolCosts):
                raise PlanError(f"assumption {name} must be NCCL protocol costs, got {getattr(self, name)!r}")
        if self.host_reference_tp is not None and not _is_degree(self.host_reference_tp):
            raise PlanError(
                f"assumption host_reference_tp must be a whole number >= 1 (a tensor-parallel degree), "
                f"got {self.host_reference_tp!r}"
            )
        _check_tiles(self.gemm_tiles)
        _check_choices("nccl_algorithms", self.nccl_algorithms, NCCL_ALGORITHMS)
        _check_choices("nccl_protocols", self.nccl_protocols, NCCL_PROTOCOLS)
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare)))

    @property
    def flat_compute(self) -> bool:
        """Whether the flat model (one ``compute_efficiency`` for every FLOP) replaces the per-operation roofline."""
        return self.compute_efficiency is not None

    def sync_wait_per_collective(self, axis: str) -> float:
        """Expected sync wait per collective of ``axis``, seconds: its own value if set, else the all-axes one."""
        name = SYNC_WAIT_AXIS_FIELDS.get(axis)
        own = getattr(self, name) if name is not None else None
        return self.sync_wait_per_collective_seconds if own is None else float(own)

    def link_efficiency(self, link: str) -> float:
        """Achieved fraction of ``link``'s bandwidth (``nvlink`` or ``network``)."""
        return self.nvlink_efficiency if link == "nvlink" else self.network_efficiency

    def nccl_options(self) -> dict[tuple[str, str], NcclProtocolCosts]:
        """``{(algorithm, protocol): costs}`` for the NCCL pairs the planner may choose from.

        Those of ``nccl_algorithms`` x ``nccl_protocols``: all six by default.
        """
        return {
            (algorithm, protocol): getattr(self, f"{algorithm}_{protocol}")
            for algorithm in NCCL_ALGORITHMS
            for protocol in NCCL_PROTOCOLS
            if algorithm in self.nccl_algorithms and protocol in self.nccl_protocols
        }

    def to_dict(self) -> dict[str, object]:
        """Every assumption by name (NCCL costs as nested mappings, tiles as lists)."""
        data: dict[str, object] = dict(asdict(self))
        data.pop("_hash", None)
        data["gemm_tiles"] = [list(t) for t in self.gemm_tiles]
        data["nccl_algorithms"] = list(self.nccl_algorithms)
        data["nccl_protocols"] = list(self.nccl_protocols)
        return data


ASSUMPTION_NAMES: Final = tuple(f.name for f in fields(PlanAssumptions) if f.init)
"""Every assumption a mapping may set."""
OVERLAP_FIELDS: Final = (
    "tp_comm_overlap",
    "sp_backward_allgather_overlap",
    "dp_grad_reduce_overlap",
    "dp_param_gather_overlap",
    "cp_comm_overlap",
    "ep_comm_overlap",
    "pp_comm_overlap",
)
"""Assumptions that are overlap fractions in [0, 1]."""
NCCL_FIELDS: Final = ("ring_ll", "ring_ll128", "ring_simple", "tree_ll", "tree_ll128", "tree_simple")
"""Assumptions that are :class:`NcclProtocolCosts`."""
_BOOLEANS: Final = (
    "causal_attention",
    "nccl_latency",
    "pp_scatter_gather",
    "grad_accumulation_fusion",
    "fp8_attention",
    "cpu_compute",
)
SYNC_WAIT_AXIS_FIELDS: Final = {
    "dp": "dp_sync_wait_per_collective_seconds",
    "tp": "tp_sync_wait_per_collective_seconds",
    "cp": "cp_sync_wait_per_collective_seconds",
    "ep": "ep_sync_wait_per_collective_seconds",
}
"""Axis -> its own sync wait per collective (pp sends have no sync wait term: the bubble prices their waits)."""
_OPTIONAL: Final = (
    "compute_efficiency",
    "gemm_efficiency",
    "optimizer_hbm_efficiency",
    "cpu_cores",
    "host_reference_tokens",
    "host_reference_tp",
    "cpu_stage_contention_at_fit",
    *SYNC_WAIT_AXIS_FIELDS.values(),
)
_CHOICES: Final = {"nccl_algorithms": NCCL_ALGORITHMS, "nccl_protocols": NCCL_PROTOCOLS}
_RANGES: Final[dict[str, tuple[float, float | None, bool]]] = {
    **dict.fromkeys(
        ("compute_efficiency", "gemm_efficiency", "attention_efficiency", "hbm_efficiency", "nvlink_efficiency",
         "network_efficiency", "optimizer_hbm_efficiency"),
        (0.0, 1.0, True),
    ),
    **dict.fromkeys(OVERLAP_FIELDS, (0.0, 1.0, False)),
    "bubble_warning_fraction": (0.0, None, False),
    **dict.fromkeys(
        (
            "data_wait_seconds",
            "host_overhead_seconds",
            "sync_wait_per_collective_seconds",
            "host_seconds_per_layer_pass",
            *SYNC_WAIT_AXIS_FIELDS.values(),
        ),
        (0.0, None, False),
    ),
    "cpu_cores": (0.0, None, True),
    "host_tokens_exponent": (0.0, 1.0, False),
    "host_reference_tokens": (0.0, None, True),
    "host_tp_factor": (1.0, None, False),
    "host_reference_tp": (1.0, None, False),
    "cpu_contention_at_fit": (1.0, None, False),
    "cpu_stage_contention_at_fit": (1.0, None, False),
    "cpu_time_scale": (0.0, None, True),
    "cpu_stage_time_scale": (0.0, None, True),
    "cpu_dp_comm_time_scale": (0.0, None, True),
    "cpu_compute_time_scale": (0.0, None, True),
}  # fmt: skip
"""``(low, high, low excluded)`` of every numeric assumption (``high`` ``None``: unbounded)."""


def _within(value: float, low: float, high: float | None, *, low_open: bool) -> bool:
    return not (value < low or (low_open and value == low) or (high is not None and value > high))


def _fits(low: float, high: float | None, *, low_open: bool) -> str:
    if high is None:
        return f"a number >= {low:g}"
    return f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_degree(value: object) -> bool:
    """A parallel degree: a whole number >= 1 (``2`` or ``2.0``)."""
    return _is_number(value) and float(value) >= 1.0 and float(value).is_integer()  # type: ignore[arg-type]


def _check_tiles(tiles: object) -> None:
    if not isinstance(tiles, tuple) or not tiles:
        raise PlanError(f"assumption gemm_tiles must be a non-empty list of [rows, columns] pairs, got {tiles!r}")
    for tile in tiles:
        if not (
            isinstance(tile, tuple)
            and len(tile) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 4096 for v in tile)
        ):
            raise PlanError(
                f"assumption gemm_tiles: each tile must be [rows, columns] of whole numbers in 1..4096, got {tile!r}"
            )


def _check_choices(name: str, value: object, allowed: tuple[str, ...]) -> None:
    good = isinstance(value, tuple) and bool(value) and all(isinstance(v, str) and v in allowed for v in value)
    if not good or len(set(value)) != len(value):  # type: ignore[arg-type,call-overload]
        names = ", ".join(allowed)
        raise PlanError(
            f"assumption {name} must be a non-empty list of distinct names from {names}, got {_show(value)}"
        )


def _snake(key: str) -> str:
    """``nvlinkEfficiency`` -> ``nvlink_efficiency`` (the spec's camelCase); snake_case passes through."""
    return "".join("_" + c.lower() if c.isupper() else c for c in key)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unknown(where: str, key: object, allowed: tuple[str, ...]) -> PlanError:
    close = difflib.get_close_matches(_snake(str(key)), allowed, n=1)
    hint = f"; did you mean {close[0]}?" if close else f"; known: {', '.join(allowed)}"
    return PlanError(f"{where}: unknown assumption {_show(key)}{hint}")


def _number(where: str, value: object, *, low: float, high: float | None, low_open: bool) -> float:
    if not _is_number(value) or not _within(float(value), low, high, low_open=low_open):  # type: ignore[arg-type]
        raise PlanError(f"{where}: expected {_fits(low, high, low_open=low_open)}, got {_show(value)}")
    return float(value)  # type: ignore[arg-type]


def _nccl_costs(where: str, value: object, base: NcclProtocolCosts) -> NcclProtocolCosts:
    if not isinstance(value, Mapping):
        raise PlanError(f"{where}: expected a mapping of {', '.join(f.name for f in fields(NcclProtocolCosts))}, "
                        f"got {_show(value)}")  # fmt: skip
    allowed = tuple(f.name for f in fields(NcclProtocolCosts))
    changes: dict[str, float] = {}
    for raw_key, raw in value.items():
        key = _snake(str(raw_key))
        if key not in allowed:
            raise _unknown(where, raw_key, allowed)
        if key == "bandwidth_fraction":
            changes[key] = _number(f"{where}.{key}", raw, low=0.0, high=1.0, low_open=True)
        else:
            changes[key] = _number(f"{where}.{key}", raw, low=0.0, high=1.0, low_open=False)
    return replace(base, **changes)


def assumptions_from_mapping(
    data: Mapping[str, object], *, base: PlanAssumptions | None = None, origin: str = "assumptions"
) -> PlanAssumptions:
    """Assumptions from a mapping (a parsed YAML file, or ``spec.assumptions``), every other one from ``base``.

    Keys are the field names of :class:`PlanAssumptions`, in snake_case or camelCase (``nvlinkEfficiency``); NCCL
    costs are nested mappings (``ring_simple: {network_hop_latency_s: 2.0e-5}``) and replace only the keys given;
    ``compute_efficiency: null`` selects the per-operation roofline.

    Args:
        data: the overrides.
        base: the assumptions overridden (default :class:`PlanAssumptions()`).
        origin: where the mapping came from, first in every error message (a file name, ``spec.assumptions``).

    Returns:
        The assumptions.

    Raises:
        PlanError: naming the field, the value and what would fit, for an unknown key, a wrong type or a value out of
            range.
    """
    base = PlanAssumptions() if base is None else base
    if not isinstance(data, Mapping):
        raise PlanError(f"{origin}: expected a mapping of assumption names to values, got {_show(data)}")
    allowed = ASSUMPTION_NAMES
    changes: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = _snake(raw_key) if isinstance(raw_key, str) else repr(raw_key)
        if key not in allowed:
            raise _unknown(origin, raw_key, allowed)
        changes[key] = _override(key, value, base, where=f"{origin}.{key}", origin=origin)
    return replace(base, **changes)


def _override(key: str, value: object, base: PlanAssumptions, *, where: str, origin: str) -> object:  # noqa: C901 - one branch per kind of field
    """The checked value of one assumption from a mapping."""
    if key in NCCL_FIELDS:
        return _nccl_costs(where, value, getattr(base, key))
    if key in _BOOLEANS:
        if not isinstance(value, bool):
            raise PlanError(f"{where}: expected true or false, got {_show(value)}")
        return value
    if key == "gemm_tiles":
        if not isinstance(value, list | tuple):
            raise PlanError(f"{where}: expected a list of [rows, columns] pairs, got {_show(value)}")
        tiles = tuple(tuple(t) if isinstance(t, list | tuple) else t for t in value)
        try:
            _check_tiles(tiles)
        except PlanError as exc:
            raise PlanError(f"{origin}: {exc}") from None
        return tiles
    if key in _CHOICES:
        if not isinstance(value, list | tuple):
            raise PlanError(f"{where}: expected a list of names from {', '.join(_CHOICES[key])}, got {_show(value)}")
        try:
            _check_choices(key, tuple(value), _CHOICES[key])
        except PlanError as exc:
            raise PlanError(f"{origin}: {exc}") from None
        return tuple(value)
    if key in _OPTIONAL and value is None:
        return None
    if key == "host_reference_tp" and not _is_degree(value):
        raise PlanError(f"{where}: expected a whole number >= 1 (a tensor-parallel degree), got {_show(value)}")
    low, high, low_open = _RANGES[key]
    return _number(where, value, low=low, high=high, low_open=low_open)

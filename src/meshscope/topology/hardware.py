"""The hardware catalogue: peak FLOP/s, HBM and link bandwidths per GPU, each number with its source.

The planner's "expected" numbers are only as good as these. Conventions:

* FLOP/s are **dense** (no sparsity), per GPU.
* Link bandwidths are **per direction**, per GPU, in bytes/s. NVIDIA's "900 GB/s NVLink" for the H100 is the
  bidirectional total, i.e. 450 GB/s per direction (reference/planner.md §5.4).
* ``hbm_bytes`` is the datasheet capacity read as GiB (HBM stacks come in power-of-two GiB; ``nvidia-smi`` on an
  "80 GB" H100 shows 81,559 MiB), so headroom is computed against what the allocator can actually see, minus
  ``reserved_bytes``.
* A NIC of 400 Gb/s moves 50 GB/s per direction.

Custom hardware comes from the spec (``spec.hardware``) as explicit numbers; see :func:`custom_gpu`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshscope.errors import SpecError

GB = 10**9
GiB = 2**30
TFLOPS = 10**12
EMULATED_GPU = "emulated"
"""Name of the accelerator ``meshscope run`` emulates on CPU cores (:mod:`meshscope.local.emulation`): its seconds are
this machine's by construction, where a catalogue GPU's are another machine's."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSpec:
    """Peak numbers of one GPU type."""

    name: str
    """Catalogue key, e.g. ``H100``."""
    bf16_flops_per_s: float
    """Dense BF16 tensor-core peak, FLOP/s."""
    fp8_flops_per_s: float | None
    """Dense FP8 peak, FLOP/s; ``None`` where the GPU has no FP8 tensor cores."""
    hbm_bytes: int
    """HBM capacity, bytes."""
    hbm_bandwidth_bytes_per_s: float
    """HBM bandwidth, bytes/s."""
    scaleup_bandwidth_bytes_per_s: float
    """NVLink / Infinity Fabric bandwidth per GPU per direction, bytes/s."""
    nvlink_domain_gpus: int
    """GPUs that share one scale-up (NVLink / xGMI) domain."""
    gpus_per_node: int
    """GPUs per node (per tray for NVL72)."""
    nic_bandwidth_bytes_per_s: float
    """Scale-out network bandwidth per GPU per direction, bytes/s."""
    source: str
    """Where the numbers come from."""
    sm_count: int = 132
    """Streaming multiprocessors (compute units on AMD): one GEMM output tile runs on one SM at a time, so a GEMM
    runs in ``ceil(tiles / sm_count)`` waves (wave quantization). Default 132 (H100 SXM5) for custom GPUs."""
    matmul_achievable_fraction: float = 0.80
    """Fraction of the dense peak a large, well-shaped BF16 GEMM sustains on this GPU (the ceiling of the planner's
    GEMM roofline). Stas Bekman's *Maximum Achievable Matmul FLOPS* table (stas00/ml-engineering,
    ``compute/accelerator/README.md``, measured with ``mamf-finder.py``: the fastest of 100 timed iterations of the
    best shape of a search), lowered where a GEMM on normally distributed inputs, as training's are, has been measured
    to sustain less: the power limit lowers the clock when the inputs make the tensor cores switch more (Horace He,
    "Strangely, Matrix Multiplications on GPUs Run Faster When Given 'Predictable' Data!", thonking.ai, 2024), and
    where a published training run measured less (H100: the ceiling under which NVIDIA's own DGX H100 run of Llama 3.1
    405B takes its published step time; docs/planner.md, "Checks against published runs"). Default 0.80 for custom
    GPUs."""

    fp8_matmul_achievable_fraction: float | None = None
    """The same ceiling for an FP8 GEMM, as a fraction of the dense FP8 peak; ``None`` (default): the BF16 figure.
    H100 (and H200), B200, GB200: the ceiling under which NVIDIA's published FP8 training runs on that GPU are
    planned with the least largest error over them (docs/planner.md, "Checks against published runs"); FP8 GEMMs
    reach a smaller share of their peak, and a step in FP8 also casts every GEMM's inputs, which this figure holds
    with it."""

    def matmul_ceiling(self, precision: str) -> float:
        """The GEMM ceiling at ``precision``.

        :attr:`fp8_matmul_achievable_fraction` for FP8 where the catalogue has one (and the GPU FP8 tensor cores),
        else :attr:`matmul_achievable_fraction`.
        """
        if precision == "fp8" and self.fp8_flops_per_s and self.fp8_matmul_achievable_fraction is not None:
            return self.fp8_matmul_achievable_fraction
        return self.matmul_achievable_fraction

    def peak_flops_per_s(self, precision: str) -> float:
        """Dense peak for ``precision`` (``bf16``/``fp16`` or ``fp8``; ``fp32`` uses the BF16 tensor-core peak / 2).

        FP8 falls back to BF16 on GPUs without FP8 tensor cores (A100), which is what frameworks do.
        """
        if precision == "fp8":
            return self.fp8_flops_per_s or self.bf16_flops_per_s
        if precision == "fp32":
            # TF32 tensor cores run at half the BF16 rate on A100/H100/B200 datasheets.
            return self.bf16_flops_per_s / 2
        return self.bf16_flops_per_s


CATALOGUE: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec(
            name="A100",
            bf16_flops_per_s=312 * TFLOPS,
            fp8_flops_per_s=None,
            hbm_bytes=80 * GiB,
            hbm_bandwidth_bytes_per_s=2039 * GB,
            scaleup_bandwidth_bytes_per_s=300 * GB,
            nvlink_domain_gpus=8,
            gpus_per_node=8,
            nic_bandwidth_bytes_per_s=25 * GB,
            source=(
                "NVIDIA A100 datasheet via glennklockwood (312 TF BF16 dense, 80 GB HBM2e, 2,039 GB/s, "
                "NVLink3 600 GB/s total); Narayanan et al. 2021 §5: 8x 200 Gb/s HDR per DGX A100 node"
            ),
            sm_count=108,
            # A100 whitepaper: 108 SMs. MAMF 267.9 of 312 TF (85.9 %, CUDA 12.1) is the best iteration of the best
            # shape; cuBLAS sustains 257 TF on an 8192^3 GEMM of torch.randn inputs (295 on zeros: the 400 W power
            # limit; Horace He, thonking.ai 2024): 257 / 312 = 0.824.
            matmul_achievable_fraction=0.824,
        ),
        GpuSpec(
            name="H100",
            bf16_flops_per_s=989 * TFLOPS,
            fp8_flops_per_s=1979 * TFLOPS,
            hbm_bytes=80 * GiB,
            hbm_bandwidth_bytes_per_s=3350 * GB,
            scaleup_bandwidth_bytes_per_s=450 * GB,
            nvlink_domain_gpus=8,
            gpus_per_node=8,
            nic_bandwidth_bytes_per_s=50 * GB,
            source=(
                "NVIDIA H100 SXM5 datasheet (989 TF BF16 dense, 1,979 TF FP8 dense, 80 GB HBM3, 3.35 TB/s, NVLink4 "
                "900 GB/s bidirectional = 450 per direction); DGX H100: 8x 400 Gb/s ConnectX-7"
            ),
            sm_count=132,
            # H100 whitepaper: 132 SMs (SXM5). MAMF 792.1 of 989 TF (80.1 %, CUDA 12.1) is the best iteration of the
            # best shape; planned at it, NVIDIA's DGX H100 runs of Llama 3.1 405B BF16 (NVIDIA/dgxc-benchmarking
            # llama3.1/README_405b.md, NeMo 24.09: 17.20 s a step on 576 GPUs) came out 22-25 % too fast and Meta's
            # (Llama 3 paper, Table 4) 21-30 %. 0.620 is the ceiling under which the 576-GPU reference run's plan takes
            # its 17.20 s (tests/core/test_plan_published.py derives it); Meta's rows and the same recipe family's
            # Llama 3.1 8B and 70B runs (README_8b.md, README_70b.md) are the held-out check.
            matmul_achievable_fraction=0.620,
            # FP8: 924 of 1,979 TF/s, the ceiling under which NVIDIA's twelve published H100 FP8 runs (the 24.09
            # recipes of Llama 3.1 8B, 70B and 405B; Megatron-Bridge's Llama 3 8B, 70B and 3.1 405B) are planned with
            # the least largest error, 8.4 % (tests/core/test_plan_published.py derives it). One run alone implies
            # 0.42-0.53: the same configuration at two software versions differs by 10 %. It holds the casts of
            # each GEMM's inputs to FP8 with it.
            fp8_matmul_achievable_fraction=0.467,
        ),
        GpuSpec(
            name="H200",
            bf16_flops_per_s=989 * TFLOPS,
            fp8_flops_per_s=1979 * TFLOPS,
            hbm_bytes=141 * GiB,
            hbm_bandwidth_bytes_per_s=4800 * GB,
            scaleup_bandwidth_bytes_per_s=450 * GB,
            nvlink_domain_gpus=8,
            gpus_per_node=8,
            nic_bandwidth_bytes_per_s=50 * GB,
            source=(
                "NVIDIA H200 SXM spec summaries (same die as H100: 989 TF BF16 dense; 141 GB HBM3e, 4.8 TB/s; NVLink4 "
                "450 GB/s per direction); DGX H200: 8x 400 Gb/s ConnectX-7"
            ),
            sm_count=132,
            # same die, SM count and 700 W limit as H100 SXM5: the H100's training ceilings (GH200's MAMF: 83.0 %)
            matmul_achievable_fraction=0.620,
            fp8_matmul_achievable_fraction=0.467,
        ),
        GpuSpec(
            name="B200",
            bf16_flops_per_s=2250 * TFLOPS,
            fp8_flops_per_s=4500 * TFLOPS,
            hbm_bytes=180 * GiB,
            hbm_bandwidth_bytes_per_s=7700 * GB,
            scaleup_bandwidth_bytes_per_s=900 * GB,
            nvlink_domain_gpus=8,
            gpus_per_node=8,
            nic_bandwidth_bytes_per_s=50 * GB,
            source=(
                "NVIDIA HGX B200 (1,000 W) via glennklockwood and Verda: 2,250 TF BF16 dense, 4,500 TF FP8 dense, "
                "180 GB HBM3e, 7.7 TB/s; NVLink5 1.8 TB/s bidirectional = 900 GB/s per direction; DGX B200: 8x "
                "400 Gb/s ConnectX-7"
            ),
            sm_count=148,
            # 148 SMs per NVIDIA's Blackwell figures [S]. No BF16 B200 training run is published (and no MAMF
            # measurement): by analogy with GB200 (the same 148 SMs), GB200's fitted BF16 ceiling times the ratio of
            # the two GPUs' fitted FP8 ceilings (0.532 x 0.462 / 0.438: 1,262 TF/s, GB200's 1,330 less what B200's
            # lower power limit costs in FP8). Not checked.
            matmul_achievable_fraction=0.561,
            # FP8: 2,079 of 4,500 TF/s, fitted as H100's to NVIDIA's two published B200 FP8 runs (Megatron-Bridge
            # 25.11: Llama 3 8B on 8 B200, Llama 3.1 405B on 128; each within 2.7 %); each alone implies 0.445 and
            # 0.480.
            fp8_matmul_achievable_fraction=0.462,
        ),
        GpuSpec(
            name="GB200",
            bf16_flops_per_s=2500 * TFLOPS,
            fp8_flops_per_s=5000 * TFLOPS,
            hbm_bytes=186 * GiB,
            hbm_bandwidth_bytes_per_s=8000 * GB,
            scaleup_bandwidth_bytes_per_s=900 * GB,
            nvlink_domain_gpus=72,
            gpus_per_node=4,
            nic_bandwidth_bytes_per_s=50 * GB,
            source=(
                "GB200 NVL72 (1,200 W) via glennklockwood: 2,500 TF BF16 dense, 5,000 TF FP8 dense, 186 GB HBM3e, "
                "8 TB/s; Megatron-LM DeepSeek-V3 GB200 doc: MNNVL 900 GB/s unidirectional, 72 GPUs per domain; 4 GPUs "
                "per compute tray with 4x 400 Gb/s ConnectX-7 (not re-verified)"
            ),
            sm_count=148,
            # 148 SMs per GPU [S]. BF16: 1,330 of 2,500 TF/s, the ceiling under which NVIDIA's three published GB200
            # BF16 runs of Llama 3.1 405B (NVIDIA/dgxc-benchmarking llama3.1/README.md, NeMo 25.04.01: 9.347, 9.484
            # and 9.508 s on 128, 256 and 512 GPUs) are planned with the least largest error (0.8 %); the H100's
            # microbenchmark 0.801 made them 28 % too fast.
            matmul_achievable_fraction=0.532,
            # FP8: 2,190 of 5,000 TF/s, fitted as H100's to NVIDIA's five published GB200 FP8 runs (Megatron-Bridge
            # 25.11's Llama 3 8B on 8 and 3.1 405B on 256; NeMo 25.04.01's 405B on 128, 256 and 512, which came out
            # within 1 % at the ceiling of the first two alone); each within 5.6 %.
            fp8_matmul_achievable_fraction=0.438,
        ),
        GpuSpec(
            name="MI300X",
            bf16_flops_per_s=1307.4 * TFLOPS,
            fp8_flops_per_s=2614.9 * TFLOPS,
            hbm_bytes=192 * GiB,
            hbm_bandwidth_bytes_per_s=5300 * GB,
            scaleup_bandwidth_bytes_per_s=448 * GB,
            nvlink_domain_gpus=8,
            gpus_per_node=8,
            nic_bandwidth_bytes_per_s=50 * GB,
            source=(
                "AMD MI300X peak constants (1,307.4 TF BF16 dense, 2,614.9 TF FP8 dense), 192 GB HBM3, 5.3 TB/s; "
                "Infinity Fabric 7x 128 GB/s bidirectional = 448 GB/s per direction, 8-GPU xGMI mesh; 400 Gb/s NIC "
                "typical"
            ),
            sm_count=304,
            # CDNA 3 whitepaper: 304 compute units; MAMF 781.9 of 1,300 TF (60.1 %, ROCm 6.2)
            matmul_achievable_fraction=0.601,
        ),
    )
}


def lookup_gpu(name: str) -> GpuSpec:
    """Catalogue entry for ``name`` (case-insensitive).

    Raises:
        SpecError: naming the known GPU types if ``name`` is not one of them.
    """
    for key, gpu in CATALOGUE.items():
        if key.lower() == name.strip().lower():
            return gpu
    raise SpecError("spec.hardware.gpu", f"unknown GPU type {name!r}; known: {', '.join(CATALOGUE)}")


def custom_gpu(base: GpuSpec, **overrides: float | str | None) -> GpuSpec:
    """A catalogue entry with some numbers replaced (explicit hardware in the spec)."""
    return replace(base, **overrides)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class HardwareConfig:
    """The machines a job runs on: a GPU type, how many, and how they are wired."""

    gpu: GpuSpec
    """Per-GPU peaks."""
    nodes: int
    """Number of nodes."""
    gpus_per_node: int
    """GPUs per node."""
    nvlink_domain_gpus: int
    """GPUs per NVLink domain; a multiple of ``gpus_per_node`` (8 on HGX, 72 on GB200 NVL72)."""
    nic_bandwidth_bytes_per_s: float
    """Scale-out bandwidth per GPU per direction, bytes/s."""
    scaleup_bandwidth_bytes_per_s: float
    """NVLink bandwidth per GPU per direction, bytes/s."""
    nodes_per_network_block: int = 32
    """Nodes under one leaf block of the network (a DGX SuperPOD scalable unit is 32 nodes); groups wider than a
    block cross the spine."""
    reserved_bytes: int = 0
    """HBM the planner keeps free for the CUDA context, NCCL buffers and fragmentation, bytes."""

    @property
    def world_size(self) -> int:
        """Total GPUs: ``nodes * gpus_per_node``."""
        return self.nodes * self.gpus_per_node

    @property
    def usable_hbm_bytes(self) -> int:
        """HBM per GPU available to the model: capacity minus ``reserved_bytes``."""
        return self.gpu.hbm_bytes - self.reserved_bytes

    def link_bandwidth_bytes_per_s(self, link: str) -> float:
        """Per-direction bandwidth per GPU of ``link`` (``nvlink`` or ``network``)."""
        return self.scaleup_bandwidth_bytes_per_s if link == "nvlink" else self.nic_bandwidth_bytes_per_s

    def link_budget_flops_per_byte(self, link: str, precision: str = "bf16") -> float:
        """Peak FLOP/s over the link's bytes/s: how many FLOPs must hide each byte sent over ``link``."""
        return self.gpu.peak_flops_per_s(precision) / self.link_bandwidth_bytes_per_s(link)


def default_hardware(gpu_name: str, nodes: int) -> HardwareConfig:
    """Hardware made of ``nodes`` catalogue nodes of ``gpu_name`` with the catalogue's wiring."""
    gpu = lookup_gpu(gpu_name)
    return HardwareConfig(
        gpu=gpu,
        nodes=nodes,
        gpus_per_node=gpu.gpus_per_node,
        nvlink_domain_gpus=gpu.nvlink_domain_gpus,
        nic_bandwidth_bytes_per_s=gpu.nic_bandwidth_bytes_per_s,
        scaleup_bandwidth_bytes_per_s=gpu.scaleup_bandwidth_bytes_per_s,
    )

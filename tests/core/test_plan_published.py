"""The planner against published measured runs (tests/data/published_runs): each error held under its measured bound.

Each bound is the error measured when the model was built (docs/planner.md, "Checks against published runs") plus 2
percentage points: a change that moves a prediction further from a published measurement fails here and must say why
in that table. Published TFLOP/s per GPU are in the source's own FLOPs convention.
"""

from __future__ import annotations

import pytest

from meshscope.jobs.loading import spec_from_manifest
from meshscope.plan import PlanAssumptions, flops_in_convention, plan_job
from meshscope.topology.hardware import CATALOGUE
from published_runs import RUNS, ceiling_groups, error, least_largest_error_ceiling

MARGIN = 0.02
# |ours / published - 1| measured with the roofline + NCCL model, in the order of runs.yaml.
MEASURED = [0.039, 0.072, 0.046, 0.075, 0.054, 0.089, 0.032, 0.041, 0.041, 0.040, 0.071]
MEASURED += [0.001, 0.017, 0.022, 0.023, 0.013]  # NVIDIA's DGX H100 rows; the first sets the H100 GEMM ceiling
MEASURED += [0.073, 0.070, 0.015, 0.061, 0.072]  # the same in FP8
MEASURED += [0.084, 0.040, 0.030]  # Megatron-Bridge on H100 (FP8): Llama 3 70B, 3.1 405B, 3 8B
MEASURED += [0.024, 0.027, 0.056, 0.056]  # Megatron-Bridge on B200 and GB200 (FP8): 8B, 405B each
MEASURED += [0.027, 0.002, 0.019, 0.007, 0.030, 0.040, 0.056, 0.084]  # NeMo 24.09 8B, 70B: BF16, FP8 at 2 scales
MEASURED += [0.005, 0.001, 0.006, 0.009, 0.004, 0.004]  # NeMo 25.04 on GB200, 405B: BF16, FP8 at 3 scales
FLAT_MEASURED_MEAN = 0.167
"""Mean |error| of the flat model (compute_efficiency 0.5, bandwidth-only collectives) on the same runs, each with its
own software assumptions (runs.yaml)."""


@pytest.mark.parametrize(("run", "bound"), list(zip(RUNS, MEASURED, strict=True)), ids=[r["name"] for r in RUNS])
def test_each_published_run_within_its_measured_bound(run, bound):
    assert abs(error(run)) <= bound + MARGIN


def test_the_new_model_beats_the_flat_one_on_average():
    new = sum(abs(error(r)) for r in RUNS) / len(RUNS)
    flat = sum(abs(error(r, PlanAssumptions(compute_efficiency=0.5, nccl_latency=False))) for r in RUNS) / len(RUNS)
    assert flat == pytest.approx(FLAT_MEASURED_MEAN, abs=0.005)
    assert new <= 0.050 + MARGIN
    assert new < flat


def test_flops_conventions_count_as_their_sources_do():
    # Llama 3's own count: 6 FLOPs per parameter and token (3.8e25 for 405B parameters on 15.6T tokens, §1); a step
    # of Table 4 is 2,048 sequences of 8,192 tokens. The planned model has the paper's 405B parameters within 0.5 %.
    llama = next(r for r in RUNS if r["source"] == "llama3-table4")
    plan = plan_job(spec_from_manifest(llama["manifest"]))
    tokens = 2048 * 8192
    six_nd = flops_in_convention(plan.flops, "6nd", params=plan.total_params, tokens=tokens)
    assert six_nd == pytest.approx(6 * 405e9 * tokens, rel=0.005)
    assert flops_in_convention(plan.flops, "causal", params=0, tokens=0) == plan.flops.model_flops
    assert flops_in_convention(plan.flops, "korthikanti", params=0, tokens=0) == plan.flops.model_flops_noncausal
    with pytest.raises(ValueError, match=r"flops convention 'mfu': use one of causal, korthikanti, 6nd"):
        flops_in_convention(plan.flops, "mfu", params=0, tokens=0)


def _llama3_table4(convention: str | None = None) -> list[float]:
    """The errors of Table 4's rows (8K on 8,192 GPUs, 8K on 16,384, 128K with cp 16), in ``convention``."""
    rows = [r for r in RUNS if r["source"] == "llama3-table4"]
    assert len(rows) == 3
    return [error(r if convention is None else {**r, "flops_convention": convention}) for r in rows]


def test_the_two_llama3_8k_rows_miss_by_the_same_factor():
    # Planned as §3.3.2 configures them (one layer per model chunk: vpp 8; asynchronous pipeline transfers), the two
    # 8K rows differ in micro-batches per step (32 and 16) and share the bubble, so a model whose pipeline and dp terms
    # are right misses both by one factor on the per-micro-batch work. Planned with vpp 4 they missed by +16.3 % and
    # +10.5 %: a bubble twice the paper's; this fails if the rows drift apart again.
    a, b, _ = _llama3_table4()
    assert abs(a - b) <= 0.03


def test_llama3_table4_is_read_in_the_one_count_under_which_its_rows_agree():
    # Table 4 does not say how it counts FLOPs. Its 128K row (cp 16, attention 40 % of the work) tells: in the
    # planner's causal count the three rows miss alike (+5.6, +5.4, +8.0 %); read as 6·N·D (the paper's §1 total)
    # the 128K row turns to -35 %, with full s^2 attention to +51 % (tests/data/published_runs/README.md). This fails
    # where a change of the model makes another count fit the three rows better: then the rows' reading is to be
    # argued again.
    spread = {c: max(e) - min(e) for c in ("causal", "6nd", "korthikanti") for e in [_llama3_table4(c)]}
    assert [r["flops_convention"] for r in RUNS if r["source"] == "llama3-table4"] == ["causal"] * 3
    assert spread["causal"] < 0.12
    assert spread["causal"] < spread["6nd"] / 3
    assert spread["causal"] < spread["korthikanti"] / 3


CEILINGS = sorted(ceiling_groups())


@pytest.mark.parametrize("tag", CEILINGS)
def test_each_gpus_gemm_ceiling_is_what_its_published_runs_sustained(tag):
    # A catalogue ceiling is not a microbenchmark's (H100's MAMF 0.801, the fastest of 100 iterations): planned at
    # it, NVIDIA's own DGX H100 runs of Llama 3.1 405B (NeMo 24.09) came out 22-25 % too fast, and so did Meta's
    # (Table 4, 21-30 %). H100's BF16 ceiling is the one under which the recipe's reference configuration (576 GPUs)
    # takes its published 17.20 s; Meta's rows are the held-out check. In FP8 (H100, B200, GB200) the published runs
    # of one GPU imply ceilings up to 28 % apart (H100: 0.417-0.532; the same configuration at two software versions
    # differs by 10 %), so the ceiling is the one with the least largest error over them, and the benchmark prints
    # each row's error at the ceiling fitted without it. This fails where the catalogue, or a change of the model around it, leaves
    # that derivation.
    gpu, precision = tag.split()
    runs = ceiling_groups()[tag]
    assert all(r["manifest"]["spec"]["hardware"]["gpu"] == gpu for r in runs)
    assert all(r["manifest"]["spec"]["training"]["precision"] == precision for r in runs)
    fitted = least_largest_error_ceiling(runs, tag)
    assert CATALOGUE[gpu].matmul_ceiling(precision) == pytest.approx(fitted, abs=0.001)
    if gpu == "H100":  # the same die, SM count and power limit
        assert CATALOGUE["H200"].matmul_ceiling(precision) == CATALOGUE["H100"].matmul_ceiling(precision)


def test_every_fp8_run_is_fitted_to_its_gpus_fp8_ceiling():
    # FP8's ceilings are fitted to every published FP8 run of their GPU: none left out by mistake.
    fp8 = [r for r in RUNS if r["manifest"]["spec"]["training"]["precision"] == "fp8"]
    assert len(fp8) == 19
    assert all(r.get("sets_ceiling") == f"{r['manifest']['spec']['hardware']['gpu']} fp8" for r in fp8)

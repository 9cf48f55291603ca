"""Model presets against published parameter counts; the hardware catalogue against its sources."""

from __future__ import annotations

import pytest

from meshscope.errors import SpecError
from meshscope.jobs.models import (
    PRESETS,
    Activation,
    ModelConfig,
    Norm,
    PositionEmbedding,
    active_params,
    layer_params,
    lookup_model,
    total_params,
)
from meshscope.topology.hardware import CATALOGUE, GB, TFLOPS, default_hardware, lookup_gpu

# Published totals (billions): Llama 3 paper Table 3 and model cards (8.03, 70.6, 405.9 — 70.55 rounds to 70.6),
# GPT-3 paper (175), Mixtral paper (46.7 total / 12.9 active), DeepSeek-V3 report (671 total / 37 active).
PUBLISHED = {
    "llama3-8b": (8.03, None, 0.005),
    "llama3-70b": (70.6, None, 0.005),
    "llama3-405b": (405.9, None, 0.005),
    "gpt3-175b": (175.0, None, 0.01),
    "mixtral-8x7b": (46.7, 12.9, 0.005),
    "deepseek-v3": (671.0, 37.0, 0.02),
}


@pytest.mark.parametrize("name", PUBLISHED, ids=PUBLISHED)
def test_preset_parameter_counts_match_published(name: str) -> None:
    total_b, active_b, tolerance = PUBLISHED[name]
    model = PRESETS[name]
    assert total_params(model) / 1e9 == pytest.approx(total_b, rel=tolerance)
    if active_b is not None:
        assert active_params(model) / 1e9 == pytest.approx(active_b, rel=tolerance)
    else:
        assert active_params(model) == total_params(model)


# Narayanan et al. 2021, Table 1 (h, l, a; published billions), with V = 51,200 and s = 2,048.
PTDP_TABLE_1 = [
    (2304, 24, 24, 1.7),
    (3072, 30, 32, 3.6),
    (4096, 36, 32, 7.5),
    (6144, 40, 48, 18.4),
    (8192, 48, 64, 39.1),
    (10240, 60, 80, 76.1),
    (12288, 80, 96, 145.6),
    (16384, 96, 128, 310.1),
    (20480, 105, 128, 529.6),
    (25600, 128, 160, 1008.0),
]


@pytest.mark.parametrize(("h", "l", "a", "published"), PTDP_TABLE_1, ids=[str(r[3]) for r in PTDP_TABLE_1])
def test_gpt_shape_reproduces_ptdp_eq2(h: int, l: int, a: int, published: float) -> None:  # noqa: E741
    model = ModelConfig(
        name="gpt",
        layers=l,
        hidden_size=h,
        attention_heads=a,
        ffn_hidden_size=4 * h,
        vocab_size=51200,
        seq_length=2048,
        activation=Activation.GELU,
        norm=Norm.LAYERNORM,
        position_embedding=PositionEmbedding.LEARNED,
        tied_embeddings=True,
        linear_bias=True,
    )
    eq2 = 12 * l * h * h * (1 + 13 / (12 * h) + (51200 + 2048) / (12 * l * h))
    final_layernorm = 2 * h  # eq. 2 leaves out the final LayerNorm
    assert total_params(model) == round(eq2) + final_layernorm
    assert round(total_params(model) / 1e9, 1) == published


def test_llama3_8b_layer_by_hand() -> None:
    m = PRESETS["llama3-8b"]
    lp = layer_params(m, 0)
    # q, o: 4096x4096 each; k, v: 4096x(8*128) each; SwiGLU: 3 x 4096 x 14336; two RMSNorms of 4096.
    assert lp.attention == 2 * 4096 * 4096 + 2 * 4096 * 1024
    assert lp.mlp == 3 * 4096 * 14336
    assert lp.replicated == 2 * 4096
    assert lp.routed_experts == 0


def test_deepseek_v3_moe_layer_buckets() -> None:
    m = PRESETS["deepseek-v3"]
    dense, moe = layer_params(m, 0), layer_params(m, 3)
    assert dense.routed_experts == 0
    assert dense.mlp == 3 * 7168 * 18432
    assert moe.routed_experts == 256 * 3 * 7168 * 2048
    assert moe.mlp == 3 * 7168 * 2048  # one shared expert
    # router weight + bias, 2 RMSNorms, the MLA latent norms (kv 512, q 1536)
    assert moe.replicated == 7168 * 256 + 256 + 2 * 7168 + 512 + 1536


def test_lookup_errors_name_the_choices() -> None:
    with pytest.raises(SpecError, match=r"spec.model.preset: unknown model preset 'llama9'; known: llama3-8b"):
        lookup_model("llama9")
    with pytest.raises(SpecError, match=r"spec.hardware.gpu: unknown GPU type 'V100'; known: A100, H100"):
        lookup_gpu("V100")
    assert lookup_gpu(" h100 ").name == "H100"


def test_catalogue_has_sources_and_link_budgets() -> None:
    for gpu in CATALOGUE.values():
        assert gpu.source
        assert gpu.scaleup_bandwidth_bytes_per_s > gpu.nic_bandwidth_bytes_per_s
    # The figures: B200 BF16 ~2,500 FLOPs/byte over NVLink, ~45,000 over a 50 GB/s NIC.
    b200 = default_hardware("B200", nodes=1)
    assert b200.link_budget_flops_per_byte("nvlink") == pytest.approx(2250e12 / 900e9)
    assert b200.link_budget_flops_per_byte("network") == pytest.approx(45_000)
    # planner.md §3: H100 2,198 over NVLink (989 TF / 450 GB/s), 19,780 over 50 GB/s.
    h100 = default_hardware("H100", nodes=1)
    assert round(h100.link_budget_flops_per_byte("nvlink")) == 2198
    assert round(h100.link_budget_flops_per_byte("network")) == 19780
    assert CATALOGUE["A100"].fp8_flops_per_s is None
    assert CATALOGUE["A100"].peak_flops_per_s("fp8") == 312 * TFLOPS
    assert CATALOGUE["GB200"].nvlink_domain_gpus == 72
    assert CATALOGUE["H100"].scaleup_bandwidth_bytes_per_s == 450 * GB

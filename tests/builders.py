"""Model builders shared by the planner tests (importable because pytest puts ``tests/`` on the path)."""

from __future__ import annotations

from meshscope.jobs.models import Activation, ModelConfig, MoEConfig, Norm, PositionEmbedding


def gpt_model(*, layers: int, h: int, a: int, s: int, v: int, tied: bool = True) -> ModelConfig:
    """GPT-3 style: MHA, 4h GELU MLP, LayerNorm, learned positions, dropout 0.1 (Korthikanti et al.'s setting)."""
    return ModelConfig(
        name="gpt",
        layers=layers,
        hidden_size=h,
        attention_heads=a,
        ffn_hidden_size=4 * h,
        vocab_size=v,
        seq_length=s,
        activation=Activation.GELU,
        norm=Norm.LAYERNORM,
        position_embedding=PositionEmbedding.LEARNED,
        dropout=0.1,
        tied_embeddings=tied,
        linear_bias=True,
    )


SMALL_MOE = ModelConfig(
    name="moe",
    layers=4,
    hidden_size=2048,
    attention_heads=16,
    kv_heads=4,
    ffn_hidden_size=8192,
    vocab_size=32000,
    seq_length=4096,
    moe=MoEConfig(experts=64, top_k=4, expert_ffn_hidden_size=1024),
)
"""4 MoE layers of 64 experts, top-4, GQA: the planner findings' expert-parallel cases."""

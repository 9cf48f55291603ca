"""Model builders shared by the planner tests (importable because pytest puts ``tests/`` on the path)."""

from __future__ import annotations

from meshscope.jobs.models import Activation, ModelConfig, Norm, PositionEmbedding


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

"""Transformer model configs, presets and parameter counts.

Parameter counting follows Megatron-core's ``compute_weight_and_optimizer_memory``
(``megatron/training/theoretical_memory_usage.py``, reference/planner.md §1.1), split into the three buckets that
parallelism divides differently:

* **tp-sharded**: attention projections, dense MLPs, shared experts (divided by ``tp``);
* **replicated**: norms, the router, biases of row-parallel layers (every TP rank holds a full copy);
* **routed experts**: divided by ``etp * ep``.

Embedding and output layer are counted apart, because they live on the first and last pipeline stage only.
For a GPT-3 style model this reproduces Narayanan et al. 2021, eq. (2) ``12lh^2 (1 + 13/(12h) + (V+s)/(12lh))``
plus the final norm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from meshscope.errors import SpecError


class Norm(StrEnum):
    """Normalisation layer type."""

    RMSNORM = "rmsnorm"
    LAYERNORM = "layernorm"


class PositionEmbedding(StrEnum):
    """Position embedding type."""

    ROTARY = "rotary"
    LEARNED = "learned"


class Activation(StrEnum):
    """MLP activation; ``swiglu`` and ``geglu`` are gated (three weight matrices)."""

    SWIGLU = "swiglu"
    GEGLU = "geglu"
    GELU = "gelu"
    RELU = "relu"

    @property
    def gated(self) -> bool:
        """Whether the MLP has a gate projection (3 matrices instead of 2)."""
        return self in {Activation.SWIGLU, Activation.GEGLU}


@dataclass(frozen=True, slots=True, kw_only=True)
class MoEConfig:
    """Mixture-of-experts settings."""

    experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts each token is routed to."""
    expert_ffn_hidden_size: int
    """FFN hidden size of one routed expert."""
    shared_experts: int = 0
    """Shared (always-on) experts per MoE layer; their total FFN size is ``shared_experts * expert_ffn_hidden_size``."""
    dense_layers: int = 0
    """Leading layers that use a dense MLP instead of experts (DeepSeek-V3: 3)."""
    router_bias: bool = False
    """Whether the router has a per-expert bias (DeepSeek-V3's aux-loss-free balancing term)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3) dimensions."""

    q_lora_rank: int | None
    """Rank of the query compression; ``None`` means queries are projected directly."""
    kv_lora_rank: int
    """Rank of the joint key/value compression."""
    qk_head_dim: int
    """Per-head query/key dimension without the rotary part."""
    qk_rope_head_dim: int
    """Per-head rotary query/key dimension (the rotary key is shared by all heads)."""
    v_head_dim: int
    """Per-head value dimension."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """A decoder-only transformer."""

    name: str
    """Preset name or a user label."""
    layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width ``h``."""
    attention_heads: int
    """Query heads ``a``."""
    ffn_hidden_size: int
    """Dense MLP hidden size ``f`` (for MoE models: the dense layers' size)."""
    vocab_size: int
    """Vocabulary ``V``."""
    seq_length: int
    """Training sequence length ``s``, tokens."""
    kv_heads: int | None = None
    """Key/value heads (GQA query groups); ``None`` means the same as ``attention_heads`` (MHA)."""
    head_dim: int | None = None
    """Per-head dimension (``kv_channels``); ``None`` means ``hidden_size / attention_heads``."""
    activation: Activation = Activation.SWIGLU
    """MLP activation."""
    norm: Norm = Norm.RMSNORM
    """Normalisation layers."""
    position_embedding: PositionEmbedding = PositionEmbedding.ROTARY
    """Rotary (no parameters) or learned (``seq_length * hidden_size`` parameters)."""
    dropout: float = 0.0
    """Dropout probability; above 0 the activations keep 1-byte masks."""
    tied_embeddings: bool = False
    """Whether the output layer shares the input embedding's weights."""
    linear_bias: bool = False
    """Whether linear layers have biases (GPT-3: yes; Llama: no)."""
    moe: MoEConfig | None = None
    """Mixture-of-experts settings; ``None`` for a dense model."""
    mla: MLAConfig | None = None
    """Multi-head latent attention; ``None`` for standard (GQA/MHA) attention."""

    kv_heads_: int = field(init=False, repr=False, compare=False)
    head_dim_: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Fill defaults that depend on other fields."""
        object.__setattr__(self, "kv_heads_", self.attention_heads if self.kv_heads is None else self.kv_heads)
        hd = self.head_dim if self.head_dim is not None else self.hidden_size // max(self.attention_heads, 1)
        object.__setattr__(self, "head_dim_", hd)

    @property
    def groups(self) -> int:
        """Key/value heads (query groups)."""
        return self.kv_heads_

    @property
    def kv_channels(self) -> int:
        """Per-head dimension ``d_h``."""
        return self.head_dim_

    @property
    def is_moe(self) -> bool:
        """Whether some layers route tokens to experts."""
        return self.moe is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) is an MoE layer."""
        return self.moe is not None and layer >= self.moe.dense_layers

    @property
    def moe_layers(self) -> int:
        """Number of MoE layers."""
        return 0 if self.moe is None else max(self.layers - self.moe.dense_layers, 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerParams:
    """Parameters of one transformer layer, by how parallelism divides them."""

    attention: int
    """Attention projections (tp-sharded)."""
    mlp: int
    """Dense MLP or shared experts (tp-sharded)."""
    routed_experts: int
    """All routed experts of the layer (divided by etp*ep)."""
    replicated: int
    """Norms, router, row-parallel biases: held whole by every TP rank."""

    @property
    def tp_sharded(self) -> int:
        """Parameters divided by tp."""
        return self.attention + self.mlp

    @property
    def total(self) -> int:
        """All parameters of the layer."""
        return self.attention + self.mlp + self.routed_experts + self.replicated


def _norm_params(model: ModelConfig, width: int) -> int:
    return width * (2 if model.norm is Norm.LAYERNORM else 1)


def attention_params(model: ModelConfig) -> tuple[int, int]:
    """(tp-sharded, replicated) parameters of one attention block, norms (also MLA's latent norms) excluded."""
    h, a, d, g = model.hidden_size, model.attention_heads, model.kv_channels, model.groups
    if model.mla is not None:
        m = model.mla
        qk = m.qk_head_dim + m.qk_rope_head_dim
        q = h * m.q_lora_rank + m.q_lora_rank * a * qk if m.q_lora_rank else h * a * qk
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * a * (m.qk_head_dim + m.v_head_dim)
        out = a * m.v_head_dim * h
        return q + kv + out, 0
    sharded = 2 * h * a * d + 2 * h * g * d  # Q and output projection, K and V (Megatron: 2h^2(1+g/a)(a d/h))
    replicated = 0
    if model.linear_bias:
        sharded += (a + 2 * g) * d  # column-parallel QKV bias is sharded
        replicated += h  # row-parallel output bias is replicated
    return sharded, replicated


def mlp_params(model: ModelConfig, ffn: int) -> tuple[int, int]:
    """(tp-sharded, replicated) parameters of one MLP of hidden size ``ffn``."""
    h = model.hidden_size
    matrices = 3 if model.activation.gated else 2
    sharded = matrices * h * ffn
    replicated = 0
    if model.linear_bias:
        sharded += ffn * (2 if model.activation.gated else 1)
        replicated += h
    return sharded, replicated


def layer_params(model: ModelConfig, layer: int) -> LayerParams:
    """Parameters of layer ``layer`` (0-based), split into the buckets parallelism divides differently."""
    att, att_rep = attention_params(model)
    norms = 2 * _norm_params(model, model.hidden_size)
    if model.mla is not None:
        norms += _norm_params(model, model.mla.kv_lora_rank)
        if model.mla.q_lora_rank:
            norms += _norm_params(model, model.mla.q_lora_rank)
    if not model.is_moe_layer(layer):
        mlp, mlp_rep = mlp_params(model, model.ffn_hidden_size)
        return LayerParams(attention=att, mlp=mlp, routed_experts=0, replicated=att_rep + mlp_rep + norms)
    moe = model.moe
    assert moe is not None  # is_moe_layer guarantees it
    expert, expert_rep = mlp_params(model, moe.expert_ffn_hidden_size)
    shared, shared_rep = (
        mlp_params(model, moe.shared_experts * moe.expert_ffn_hidden_size) if moe.shared_experts else (0, 0)
    )
    router = model.hidden_size * moe.experts + (moe.experts if moe.router_bias else 0)
    return LayerParams(
        attention=att,
        mlp=shared,
        routed_experts=moe.experts * (expert + expert_rep),
        replicated=att_rep + shared_rep + norms + router,
    )


def embedding_params(model: ModelConfig) -> int:
    """Input embedding (plus learned position embedding) parameters."""
    pos = model.seq_length * model.hidden_size if model.position_embedding is PositionEmbedding.LEARNED else 0
    return model.vocab_size * model.hidden_size + pos


def output_params(model: ModelConfig) -> int:
    """Final norm plus the output layer (0 for the output layer when embeddings are tied)."""
    head = 0 if model.tied_embeddings else model.vocab_size * model.hidden_size
    return _norm_params(model, model.hidden_size) + head


def total_params(model: ModelConfig) -> int:
    """All parameters of the model."""
    return (
        sum(layer_params(model, i).total for i in range(model.layers)) + embedding_params(model) + output_params(model)
    )


def active_params(model: ModelConfig) -> int:
    """Parameters one token passes through (routed experts counted ``top_k`` times out of ``experts``)."""
    total = embedding_params(model) + output_params(model)
    for i in range(model.layers):
        lp = layer_params(model, i)
        routed = 0
        if model.moe is not None and lp.routed_experts:
            routed = lp.routed_experts * model.moe.top_k // model.moe.experts
        total += lp.attention + lp.mlp + lp.replicated + routed
    return total


PRESETS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        # Llama 3 (Meta, "The Llama 3 Herd of Models", Table 3): 8.03B / 70.6B / 405.9B parameters.
        ModelConfig(
            name="llama3-8b",
            layers=32,
            hidden_size=4096,
            attention_heads=32,
            kv_heads=8,
            ffn_hidden_size=14336,
            vocab_size=128256,
            seq_length=8192,
        ),
        ModelConfig(
            name="llama3-70b",
            layers=80,
            hidden_size=8192,
            attention_heads=64,
            kv_heads=8,
            ffn_hidden_size=28672,
            vocab_size=128256,
            seq_length=8192,
        ),
        ModelConfig(
            name="llama3-405b",
            layers=126,
            hidden_size=16384,
            attention_heads=128,
            kv_heads=8,
            ffn_hidden_size=53248,
            vocab_size=128256,
            seq_length=8192,
        ),
        # GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288, 96 heads, 2048 context.
        ModelConfig(
            name="gpt3-175b",
            layers=96,
            hidden_size=12288,
            attention_heads=96,
            ffn_hidden_size=4 * 12288,
            vocab_size=50257,
            seq_length=2048,
            activation=Activation.GELU,
            norm=Norm.LAYERNORM,
            position_embedding=PositionEmbedding.LEARNED,
            dropout=0.1,
            tied_embeddings=True,
            linear_bias=True,
        ),
        # Mixtral 8x7B (Mistral AI, arXiv 2401.04088): 46.7B total, 12.9B active parameters.
        ModelConfig(
            name="mixtral-8x7b",
            layers=32,
            hidden_size=4096,
            attention_heads=32,
            kv_heads=8,
            ffn_hidden_size=14336,
            vocab_size=32000,
            seq_length=32768,
            moe=MoEConfig(experts=8, top_k=2, expert_ffn_hidden_size=14336),
        ),
        # DeepSeek-V3 (arXiv 2412.19437): 671B total, 37B active; MLA, 1 shared + 256 routed experts, top-8,
        # first 3 layers dense. The multi-token-prediction module (14B) is not counted, as in the published 671B.
        ModelConfig(
            name="deepseek-v3",
            layers=61,
            hidden_size=7168,
            attention_heads=128,
            ffn_hidden_size=18432,
            vocab_size=129280,
            seq_length=4096,
            moe=MoEConfig(
                experts=256,
                top_k=8,
                expert_ffn_hidden_size=2048,
                shared_experts=1,
                dense_layers=3,
                router_bias=True,
            ),
            mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        ),
        # A model small enough to train for real on CPU ranks (meshscope demo).
        ModelConfig(
            name="tiny",
            layers=4,
            hidden_size=64,
            attention_heads=4,
            kv_heads=2,
            ffn_hidden_size=256,
            vocab_size=512,
            seq_length=64,
        ),
    )
}


def lookup_model(name: str) -> ModelConfig:
    """Preset ``name`` (case-insensitive).

    Raises:
        SpecError: naming the presets if ``name`` is not one of them.
    """
    for key, model in PRESETS.items():
        if key == name.strip().lower():
            return model
    raise SpecError("spec.model.preset", f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")

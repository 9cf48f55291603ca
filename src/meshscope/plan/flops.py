"""FLOPs of a training step, by layer and for the whole model, under one stated convention.

Conventions (docs/planner.md, "FLOPs"):

* Only matrix multiplications count (2 FLOPs per multiply-add); norms, softmax, activations, the embedding lookup and
  the optimizer are left out, as in every source the planner compares against.
* Backward = 2 x forward, so **model FLOPs** = 3 x forward (Narayanan et al. 2021 §5.1; Korthikanti et al. 2022
  App. A).
* Attention ``QK^T`` and ``AV`` are ``4·tokens·s·a·d_h`` forward FLOPs without a mask; the **headline** convention
  halves them for a causal mask (Megatron-LM ``num_floating_point_operations`` since commit 8873b55d6a, 2025-03).
  The non-causal count (Korthikanti App. A, PTD-P eq. 3, Megatron-LM before 2025-03) is always available.
* **Hardware FLOPs** add recomputation: full recompute adds one forward pass of every transformer layer (not of the
  output layer), selective recompute adds the forward attention core (Korthikanti et al. 2022 §5).
* Routed experts count ``top_k`` experts per token; the router counts ``2·tokens·h·E``.

This module knows nothing about parallelism: it returns whole-model FLOPs for a number of tokens; the planner divides
by ``tp·cp`` per GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshscope.jobs import Recompute, attention_params

if TYPE_CHECKING:
    from meshscope.jobs import ModelConfig, TrainingConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardFlops:
    """Forward-pass FLOPs of some layers for some tokens, whole model (not per GPU), split by what hides what."""

    linear: float = 0.0
    """Attention projections, dense MLP, shared experts and router GEMMs."""
    attention_core: float = 0.0
    """``QK^T`` and ``AV`` (halved for a causal mask when counted causally)."""
    experts: float = 0.0
    """Routed-expert GEMMs (``top_k`` experts per token)."""
    logits: float = 0.0
    """Output layer ``2·tokens·h·V``."""

    @property
    def layers(self) -> float:
        """Transformer-layer FLOPs (everything but the output layer)."""
        return self.linear + self.attention_core + self.experts

    @property
    def total(self) -> float:
        """All forward FLOPs."""
        return self.layers + self.logits

    def __add__(self, other: ForwardFlops) -> ForwardFlops:
        """Sum of two counts."""
        return ForwardFlops(
            linear=self.linear + other.linear,
            attention_core=self.attention_core + other.attention_core,
            experts=self.experts + other.experts,
            logits=self.logits + other.logits,
        )

    def scaled(self, factor: float) -> ForwardFlops:
        """Every term times ``factor`` (for example ``1/(tp·cp)`` per GPU)."""
        return ForwardFlops(
            linear=self.linear * factor,
            attention_core=self.attention_core * factor,
            experts=self.experts * factor,
            logits=self.logits * factor,
        )


def _mlp_matrices(model: ModelConfig) -> int:
    return 3 if model.activation.gated else 2


def layer_forward_flops(model: ModelConfig, layer: int, *, tokens: float, causal: bool) -> ForwardFlops:
    """Forward FLOPs of transformer layer ``layer`` (0-based) for ``tokens`` tokens of ``seq_length``-long sequences.

    Args:
        model: the model.
        layer: layer index (decides dense MLP vs experts).
        tokens: tokens processed (``micro_batch·seq_length`` for one micro-batch).
        causal: halve ``QK^T`` and ``AV`` for a causal mask.

    Returns:
        The layer's forward FLOPs by category.
    """
    h, a, s = model.hidden_size, model.attention_heads, model.seq_length
    if model.mla is not None:
        mla = model.mla
        # MLA projections are all plain GEMMs: 2 FLOPs per parameter per token.
        projections = 2.0 * tokens * attention_params(model)[0]
        core_width = a * (mla.qk_head_dim + mla.qk_rope_head_dim) + a * mla.v_head_dim
    else:
        d, g = model.kv_channels, model.groups
        # Q and output projection (h x a·d each), K and V (h x g·d each): Megatron's 2h²(1 + g/a)(a·d/h).
        projections = 2.0 * tokens * (2 * h * a * d + 2 * h * g * d)
        core_width = 2 * a * d
    # QK^T and AV: 2·tokens·s·width each (Korthikanti et al. 2022 App. A: 4Bs²h forward for MHA).
    core = 2.0 * tokens * s * core_width * (0.5 if causal else 1.0)
    matrices = _mlp_matrices(model)
    if not model.is_moe_layer(layer):
        mlp = 2.0 * tokens * matrices * h * model.ffn_hidden_size
        return ForwardFlops(linear=projections + mlp, attention_core=core)
    moe = model.moe
    assert moe is not None  # is_moe_layer guarantees it
    router = 2.0 * tokens * h * moe.experts
    shared = 2.0 * tokens * matrices * h * moe.shared_experts * moe.expert_ffn_hidden_size
    experts = 2.0 * tokens * moe.top_k * matrices * h * moe.expert_ffn_hidden_size
    return ForwardFlops(linear=projections + router + shared, attention_core=core, experts=experts)


def logits_forward_flops(model: ModelConfig, *, tokens: float) -> ForwardFlops:
    """Forward FLOPs of the output layer: ``2·tokens·h·V``."""
    return ForwardFlops(logits=2.0 * tokens * model.hidden_size * model.vocab_size)


@functools.lru_cache(maxsize=256)  # the layout search asks for the same model thousands of times
def model_forward_flops(model: ModelConfig, *, tokens: float, causal: bool) -> ForwardFlops:
    """Forward FLOPs of every layer plus the output layer for ``tokens`` tokens."""
    total = logits_forward_flops(model, tokens=tokens)
    for layer in range(model.layers):
        total += layer_forward_flops(model, layer, tokens=tokens, causal=causal)
    return total


def recompute_forward_flops(forward: ForwardFlops, recompute: Recompute) -> float:
    """Extra forward FLOPs that recomputation adds to ``forward`` in the backward pass.

    Full recompute re-runs every transformer layer (not the output layer); selective recompute re-runs the attention
    core (Korthikanti et al. 2022 §5).
    """
    if recompute is Recompute.FULL:
        return forward.layers
    if recompute is Recompute.SELECTIVE:
        return forward.attention_core
    return 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class StepFlops:
    """FLOPs of one optimizer step over the whole job, under the three conventions the planner reports."""

    model_flops: float
    """Model FLOPs, ``3 x forward``, attention counted causally or not per ``causal`` (the headline number)."""
    model_flops_noncausal: float
    """Model FLOPs with the full ``s^2`` attention (Korthikanti et al. 2022 App. A; Megatron-LM before 2025-03)."""
    hardware_flops: float
    """Model FLOPs plus recomputation, attention counted as in ``model_flops``."""
    causal: bool
    """Whether ``model_flops`` and ``hardware_flops`` count attention causally."""

    def to_dict(self) -> dict[str, float | str]:
        """The three counts and the convention."""
        return {
            "model": self.model_flops,
            "model_noncausal": self.model_flops_noncausal,
            "hardware": self.hardware_flops,
            "convention": "causal attention halved" if self.causal else "full s^2 attention",
        }


FLOPS_CONVENTIONS = ("causal", "korthikanti", "6nd")
"""How published runs count a step's FLOPs (:func:`flops_in_convention`)."""


def flops_in_convention(flops: StepFlops, convention: str, *, params: float, tokens: float) -> float:
    """A step's model FLOPs as a published source counts them.

    ``causal``: :attr:`StepFlops.model_flops` (with causal attention); ``korthikanti``: the full ``s^2`` attention of
    Korthikanti et al. 2022 App. A (:attr:`StepFlops.model_flops_noncausal`); ``6nd``: six FLOPs per parameter and
    token, no attention term (``params`` x ``tokens``; the count the Llama 3 paper gives: 3.8e25 FLOPs for 405B
    parameters on 15.6T tokens, §1).

    Raises:
        ValueError: an unknown convention (the message lists :data:`FLOPS_CONVENTIONS`).
    """
    if convention == "causal":
        return flops.model_flops
    if convention == "korthikanti":
        return flops.model_flops_noncausal
    if convention == "6nd":
        return 6.0 * params * tokens
    raise ValueError(f"flops convention {convention!r}: use one of {', '.join(FLOPS_CONVENTIONS)}")


def step_flops(model: ModelConfig, training: TrainingConfig, *, causal: bool = True) -> StepFlops:
    """FLOPs of one optimizer step: ``global_batch_size·seq_length`` tokens, forward and backward.

    For a GPT shape (MHA, 4h GELU MLP) ``model_flops_noncausal`` equals Korthikanti et al. 2022 App. A,
    ``72·B·L·s·h²·(1 + s/(6h) + V/(12hL))``, and ``hardware_flops`` with full recompute and ``causal=False`` equals
    Narayanan et al. 2021 eq. (3), ``96·B·s·L·h²·(1 + s/(6h) + V/(16Lh))``.

    Args:
        model: the model.
        training: batch and recompute settings.
        causal: count attention causally in ``model_flops`` and ``hardware_flops``.

    Returns:
        The step's FLOPs.
    """
    tokens = float(training.global_batch_size * model.seq_length)
    forward = model_forward_flops(model, tokens=tokens, causal=causal)
    forward_noncausal = forward if not causal else model_forward_flops(model, tokens=tokens, causal=False)
    model_flops = 3.0 * forward.total
    return StepFlops(
        model_flops=model_flops,
        model_flops_noncausal=3.0 * forward_noncausal.total,
        hardware_flops=model_flops + recompute_forward_flops(forward, training.recompute),
        causal=causal,
    )

"""Activation bytes of MLA, MoE and Ulysses layers, worked out by hand from plan/memory.py's documented terms.

The dense GPT shapes are pinned to Korthikanti et al. 2022 in test_plan_memory.py; these are the terms that only
DeepSeek-V3-style layers (MLA, shared and routed experts, expert tensor parallelism) and ``cp_comm_type: a2a``
reach. Each expected value is the docstring's formula with the numbers written out (bf16: e = 2 bytes, no dropout,
flash attention: no softmax kept).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from builders import gpt_model
from meshscope.jobs.models import PRESETS
from meshscope.jobs.spec import CpCommType, ParallelismConfig, TrainingConfig
from meshscope.plan.memory import layer_activation_bytes
from meshscope.topology.layout import ParallelLayout

V3 = PRESETS["deepseek-v3"]
"""h 7168, 128 heads, s 4096, MLA (q_lora 1536, kv_lora 512, qk 128 + rope 64, v 128), 256 experts top-8 of
f_e 2048, 1 shared expert, SwiGLU (gated: 3 matrices), layers 0-2 dense."""


def _bytes(model, layout: ParallelLayout, *, layer: int, sp: bool = True, cp_comm: CpCommType = CpCommType.P2P):
    parallelism = ParallelismConfig(layout=layout, sequence_parallel=sp, cp_comm_type=cp_comm)
    training = TrainingConfig(micro_batch_size=1, global_batch_size=layout.dp)
    return layer_activation_bytes(model, layer, parallelism, training)


@pytest.mark.parametrize("etp", [1, 2])
def test_a_deepseek_v3_moe_layer_by_hand(etp: int) -> None:
    e, sb, h, t = 2, 4096, 7168, 2
    sp = t  # sequence parallel: the replicated terms are sharded over tp
    replicated = 4 * e * sb * h / sp  # 2 norm inputs, QKV input, MLP input
    latents = e * sb * (512 + 64 + 1536) / sp  # kv latent, rope key, q latent: inputs of the up-projections
    attention = e * sb * 128 * (2 * (128 + 64) + 2 * 128) / t  # up-projected Q, K (a·192 each), V, output input
    router = (e * 256 + 2 * 8 * 8) * sb / sp  # softmax probabilities, two int64 index sets of top-8
    shared = e * sb * 1 * 2048 * 3 / t  # one shared expert, like a gated MLP of f_e
    copies = 8 * sb * etp / t  # routed token copies per GPU: EP trades them, expert-TP ranks share them
    routed = copies * e * (h + 3 * 2048 / etp + 1)  # expert input, fc1 and activation outputs, the probability
    layout = ParallelLayout(tp=t, dp=8, ep=4, etp=etp)
    got = _bytes(V3, layout, layer=3)
    assert got == pytest.approx(replicated + latents + attention + router + shared + routed, rel=1e-12)


def test_mla_without_a_query_latent_keeps_no_query_latent() -> None:
    assert V3.mla is not None
    model = replace(V3, mla=replace(V3.mla, q_lora_rank=None))
    e, sb, t = 2, 4096, 2
    with_q = _bytes(V3, ParallelLayout(tp=t, dp=8, ep=4), layer=0)
    without_q = _bytes(model, ParallelLayout(tp=t, dp=8, ep=4), layer=0)
    assert with_q - without_q == pytest.approx(e * sb * 1536 / t, rel=1e-9)  # the q latent, ÷ tp under SP


def test_a_dense_deepseek_layer_keeps_the_dense_mlp() -> None:
    e, sb, h, t = 2, 4096, 7168, 2
    expected = (
        4 * e * sb * h / t
        + e * sb * (512 + 64 + 1536) / t
        + e * sb * 128 * (2 * 192 + 2 * 128) / t
        + e * sb * 18432 * 3 / t  # gated MLP: gate and up outputs plus the activation output
    )
    assert _bytes(V3, ParallelLayout(tp=t, dp=8, ep=4), layer=2) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ulysses_keeps_its_head_sharded_output_only_with_context_parallelism(cp: int) -> None:
    # GPT MHA (a·d_h = h): a2a keeps e·(s/cp)·b·h/tp more than all_gather, and nothing more without cp
    h, s, t = 1024, 2048, 2
    model = gpt_model(layers=2, h=h, a=16, s=s, v=1000)
    layout = ParallelLayout(tp=t, cp=cp, dp=2)
    a2a = _bytes(model, layout, layer=0, cp_comm=CpCommType.A2A)
    gather = _bytes(model, layout, layer=0, cp_comm=CpCommType.ALL_GATHER)
    assert a2a - gather == pytest.approx(2 * (s / cp) * h / t if cp > 1 else 0.0, abs=1e-6)

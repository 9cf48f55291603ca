"""Train a tiny transformer for real on every parallelism axis PyTorch offers on CPU/gloo, watched by meshscope.

    meshscope run --nproc 8 --layout pp=2,dp=2,tp=2 -- python examples/train_tiny.py --steps 10 --emulate
    meshscope run --nproc 8 --layout pp=2,cp=2,tp=2 -- python examples/train_tiny.py --steps 10
    meshscope run --nproc 8 --layout pp=2,dp=2,tp=2,ep=2,etp=1 -- python examples/train_tiny.py --steps 10 --moe

Model: meshscope's ``tiny`` preset (4 layers, hidden 64, 4 heads, 2 KV heads, FFN 256, vocab 512, sequence 64, learned
positions) on a learnable synthetic task (arithmetic token sequences), so the loss falls. The layer is built the way
Megatron-core builds it, so that the planner's formulas describe it exactly: fused QKV and gate/up projections,
fused RMSNorm and SwiGLU (they keep only their inputs for backward), flash attention (PyTorch's CPU flash kernel).
Every axis goes through PyTorch's own APIs where they work on gloo (reference: cpu-testbed.md §3):

* tp: DTensor tensor parallelism (``parallelize_module``): column/row-parallel attention and MLP, a vocabulary-
  parallel embedding and output layer, and Megatron's vocabulary-parallel cross entropy. With
  ``--sequence-parallel`` (on by itself for MoE with tp > 1, which Megatron-core requires) the layers run Megatron's
  sequence parallelism on the DTensor weight shards: custom autograd functions gather the sequence-sharded input of a
  column-parallel linear (keeping it sharded, gathering it again in backward) and reduce-scatter the output of a
  row-parallel one; the embedding all-reduces then splits the sequence; norm and router gradients are all-reduced
  over tp once per step (``finalize_model_grads``);
* pp: ``torch.distributed.pipelining`` (``PipelineStage`` + ``Schedule1F1B``, or ``ScheduleGPipe``);
* dp: FSDP2 ``fully_shard`` per block and on the stage over the flattened dp x cp mesh (ZeRO stage 3), or over a
  2-D (replicate, shard) mesh with ``--dp-shard N`` (hybrid sharding, HSDP), or DDP with ``--dp ddp`` when tp = 1;
* cp: the sequence is sharded over cp; keys and values are all-gathered before attention and again in backward, their
  gradients reduce-scattered (Transformer Engine's ``cp_comm_type="all_gather"``, keeping only the local K and V);
* ep: top-1 mixture of experts in every layer (``--moe``, on with ep > 1) as Megatron-core's alltoall token
  dispatcher runs it, experts without tensor parallelism (etp = 1) on the expert rank generator's ep groups: token
  counts all-gathered, tokens and routing probabilities out by uneven ``all_to_all_single``, the probabilities applied
  in the experts' SwiGLU, the output back; each layer's experts one FSDP2 unit over the expert-data-parallel group
  (gradients all-reduced over it with DDP or without data parallelism).

Fault injection, made deterministic by ``--emulate`` (emulated accelerator time: every transformer block and the
output layer sleep their forward FLOPs divided by an emulated peak, twice that in backward, so slowness shows on
shared CPU cores; ``meshscope.local.emulation``): ``--straggler RANK:FACTOR`` (that rank computes FACTOR x slower),
``--imbalance RANK:FACTOR`` (the data-parallel replica holding RANK gets FACTOR x the sequences per micro-batch),
``--slow-loader MS`` (every rank's loader sleeps), ``--checkpoint-every N`` (a distributed checkpoint every N steps),
``--die RANK:STEP`` (that rank exits with code 3 when the step starts).

The script tells meshscope what it is (``tracker.describe_job``), counts its model-state bytes once
(``tracker.count_model_state``) and the activation bytes of every block, the embedding and the output layer per
micro-batch (``tracker.saved_activations``), so that ``meshscope run`` can lay the planner's numbers beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from meshscope import sdk
from meshscope.local import (
    TinyJob,
    block_forward_flops_per_gpu,
    emulated_peak_flops_per_s,
    logits_forward_flops_per_gpu,
    tiny_model,
)
from meshscope.topology import parse_layout

warnings.filterwarnings("ignore")


# ====================================================================== options


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", default=os.environ.get("MESHSCOPE_LAYOUT", ""), help="dp=..,tp=..,pp=..,cp=..,ep=..")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step per replica")
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--moe", action="store_true", help="make every layer's MLP a mixture of experts (on with ep>1)")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--dp", choices=["fsdp", "ddp"], default="fsdp", help="data-parallel implementation")
    p.add_argument(
        "--dp-shard",
        type=int,
        default=0,
        metavar="N",
        help="hybrid sharding (HSDP): FSDP2 over a (replicate, shard) mesh, the state sharded over N consecutive "
        "dp ranks (times cp) and replicated over dp/N such groups; N must divide dp (default: all of dp)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron sequence parallelism (needs tp > 1; on by itself for MoE with tp > 1, as Megatron requires)",
    )
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    p.add_argument("--straggler", default="", help="RANK:FACTOR, that rank computes FACTOR x slower")
    p.add_argument("--imbalance", default="", help="RANK:FACTOR, RANK's replica gets FACTOR x the tokens")
    p.add_argument("--slow-loader", type=float, default=0.0, metavar="MS", help="loader sleep per step, ms")
    p.add_argument("--die", default="", metavar="RANK:STEP", help="RANK exits with code 3 when STEP starts")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="DCP checkpoint every N steps")
    p.add_argument("--checkpoint-dir", default="")
    p.add_argument(
        "--emulate",
        nargs="?",
        const=20.0,
        type=float,
        default=0.0,
        metavar="MS",
        help="emulated accelerator: one block's forward of a nominal micro-batch takes MS ms (20 when given bare)",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default="", help="write step times and losses (JSON) from the loss rank")
    return p.parse_args()


def rank_factor(text: str, option: str) -> tuple[int, float] | None:
    if not text:
        return None
    try:
        rank, factor = text.split(":")
        return int(rank), float(factor)
    except ValueError:
        raise SystemExit(f"{option} {text!r}: expected RANK:FACTOR, e.g. 5:2") from None


# ====================================================================== emulated accelerator time


class Emulation:
    """An accelerator of ``peak`` FLOP/s: an op of F forward FLOPs sleeps F/peak (x ``factor`` on a slow rank)."""

    def __init__(self, peak_flops_per_s: float, factor: float) -> None:
        self.peak = peak_flops_per_s
        self.factor = factor

    def seconds(self, flops: float) -> float:
        return flops / self.peak * self.factor


class SimKernel(torch.autograd.Function):
    """Identity whose forward sleeps ``seconds`` and whose backward sleeps twice that (cpu-testbed.md §5.2)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(2 * ctx.seconds)
        return g, None


# ====================================================================== fused kernels (Megatron-core's memory use)


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm that keeps only its input and the reciprocal RMS for backward (Apex / Transformer Engine fused norm)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return x * rstd * weight

    @staticmethod
    def backward(ctx, g):
        x, rstd, weight = ctx.saved_tensors
        gw = g * weight
        gx = rstd * (gw - x * rstd.pow(2) * (gw * x).mean(-1, keepdim=True))
        gweight = (g * x * rstd).reshape(-1, x.shape[-1]).sum(0)
        return gx, gweight, None


class FusedSwiGLU(torch.autograd.Function):
    """silu(gate) * up from one [gate | up] tensor, keeping only that tensor (Megatron's bias_swiglu_impl)."""

    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g):
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        dgate = g * up * sig * (1 + gate * (1 - sig))
        return torch.cat((dgate, g * silu), dim=-1)


class WeightedSwiGLU(torch.autograd.Function):
    """silu(gate) * up * w for routed tokens: Megatron's ``WeightedSwiGLUFunction`` (the experts apply the routing
    probabilities ``w`` to their activation), keeping only its input and ``w``."""

    @staticmethod
    def forward(ctx, gate_up, w):
        ctx.save_for_backward(gate_up, w)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up * w[:, None]

    @staticmethod
    def backward(ctx, g):
        gate_up, w = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        gw = g * w[:, None]
        dgate = gw * up * sig * (1 + gate * (1 - sig))
        return torch.cat((dgate, gw * silu), dim=-1), (g * silu * up).sum(-1)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocabulary-parallel cross entropy: three all-reduces of one fp32 value per token over tp."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        local = target - vocab_start
        inside = (local >= 0) & (local < logits.shape[-1])
        index = local.clamp(0, logits.shape[-1] - 1)
        predicted = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * inside
        dist.all_reduce(predicted, group=group)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        dist.all_reduce(sum_exp, group=group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, inside)
        return (sum_exp.log() - predicted).mean()

    @staticmethod
    def backward(ctx, g):
        softmax, index, inside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, index.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        grad.mul_(g / index.numel())
        return grad, None, None, None


# ====================================================================== sequence parallelism (Megatron-core's)


def gather_along(x, dim: int, group):
    """All-gather ``x`` along ``dim`` (the sequence) over ``group``, ranks in order: ``n`` times longer there."""
    local = x.movedim(dim, 0).contiguous()  # the collective concatenates along dim 0
    out = local.new_empty((local.shape[0] * dist.get_world_size(group), *local.shape[1:]))
    dist.all_gather_into_tensor(out, local, group=group)
    return out.movedim(0, dim)


def reduce_scatter_along(x, dim: int, group):
    """Sum ``x`` over ``group`` and keep this rank's ``1/n`` of it along ``dim`` (the sequence)."""
    full = x.movedim(dim, 0).contiguous()
    out = full.new_empty((full.shape[0] // dist.get_world_size(group), *full.shape[1:]))
    dist.reduce_scatter_tensor(out, full, group=group)
    return out.movedim(0, dim)


def gather_tokens(x, group):
    """All-gather ``x`` [b, s_local, ...] along the sequence over ``group``: [b, n*s_local, ...]."""
    return gather_along(x, 1, group)


def reduce_scatter_tokens(x, group):
    """Sum ``x`` [b, s, ...] over ``group`` and keep this rank's sequence shard [b, s/n, ...]."""
    return reduce_scatter_along(x, 1, group)


class ScatterToSequenceParallel(torch.autograd.Function):
    """Keep this tp rank's sequence shard (a copy, as Megatron's ``clone_scatter_output_in_embedding``); backward
    all-gathers the gradient (``scatter_to_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n, r = dist.get_world_size(group), dist.get_rank(group)
        s = x.shape[1] // n
        return x[:, r * s : (r + 1) * s].clone()

    @staticmethod
    def backward(ctx, g):
        return gather_tokens(g, ctx.group), None


class SequenceParallelColumnLinear(torch.autograd.Function):
    """Megatron's column-parallel linear with sequence parallelism (``LinearWithGradAccumulationAndAsync
    Communication``): all-gather the sequence-sharded input, multiply by the local weight shard; keep only the sharded
    input, gather it again in backward for the weight gradient, and reduce-scatter the input gradient."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return F.linear(gather_tokens(x, group), weight)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        total = gather_tokens(x, ctx.group)
        grad_x = reduce_scatter_tokens(g @ weight, ctx.group)
        grad_w = g.reshape(-1, g.shape[-1]).t() @ total.reshape(-1, total.shape[-1])
        return grad_x, grad_w, None


class SequenceParallelRowLinear(torch.autograd.Function):
    """Megatron's row-parallel linear with sequence parallelism: multiply, then reduce-scatter the partial sums along
    the sequence; backward all-gathers the output gradient."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return reduce_scatter_tokens(F.linear(x, weight), group)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        full = gather_tokens(g, ctx.group)
        grad_w = full.reshape(-1, full.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return full @ weight, grad_w, None


def linear(module: nn.Linear, x, sp_group, kind: str):
    """``module(x)``, or with sequence parallelism (``sp_group``) the Megatron column/row function on its local
    weight shard (a DTensor from ``parallelize_module``)."""
    if sp_group is None:
        return module(x)
    fn = SequenceParallelColumnLinear if kind == "column" else SequenceParallelRowLinear
    return fn.apply(x, module.weight.to_local(), sp_group)


# ====================================================================== model


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return FusedRMSNorm.apply(x, self.weight, 1e-6)


def gather_sequence(x, group):
    """All-gather ``x`` [b, heads, s_local, d] along the sequence over ``group`` (ranks in sequence order)."""
    return gather_along(x, 2, group)


def reduce_scatter_sequence(x, group):
    """Sum ``x`` [b, heads, s, d] over ``group`` and keep this rank's sequence shard [b, heads, s/n, d]."""
    return reduce_scatter_along(x, 2, group)


# PyTorch's CPU flash-attention kernels (what F.scaled_dot_product_attention runs here), called directly so that the
# forward keeps only what Transformer Engine keeps.
_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # noqa: SLF001
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward  # noqa: SLF001


class AllGatherKVAttention(torch.autograd.Function):
    """Context parallelism as Transformer Engine's ``cp_comm_type="all_gather"`` (``AttnFuncWithCPAndKVAllGather``).

    Forward all-gathers K and V over cp (one collective each) and runs flash attention of the local queries against
    the whole sequence; it keeps only the local Q, K, V, the output and the log-sum-exp. Backward all-gathers K and V
    again, runs the flash backward and reduce-scatters dK and dV. GQA heads are expanded inside, never kept.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, group):  # noqa: PLR0917 - autograd passes them positionally
        rep = q.shape[1] // k.shape[1]
        k_all = gather_sequence(k, group).repeat_interleave(rep, dim=1)
        v_all = gather_sequence(v, group).repeat_interleave(rep, dim=1)
        out, lse = _flash_forward(q, k_all, v_all, 0.0, is_causal=False, attn_mask=mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.group, ctx.rep = mask, group, rep
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved_tensors
        rep, group = ctx.rep, ctx.group
        k_all = gather_sequence(k, group).repeat_interleave(rep, dim=1)
        v_all = gather_sequence(v, group).repeat_interleave(rep, dim=1)
        dq, dk, dv = _flash_backward(
            g.contiguous(), q, k_all, v_all, out, lse, 0.0, is_causal=False, attn_mask=ctx.mask
        )
        dk = reduce_scatter_sequence(dk.unflatten(1, (k.shape[1], rep)).sum(2), group)
        dv = reduce_scatter_sequence(dv.unflatten(1, (v.shape[1], rep)).sum(2), group)
        return dq, dk, dv, None, None


class Attention(nn.Module):
    """Fused QKV projection (one column-parallel GEMM, Megatron's linear_qkv), flash attention, output projection."""

    def __init__(
        self, hidden: int, heads: int, kv_heads: int, *, tp: int, cp_group, cp: int, cp_rank: int, seq_local: int,
        sp_group=None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.sp_group = sp_group
        self.head_dim = hidden // heads
        self.heads, self.kv_heads = heads // tp, kv_heads // tp  # local heads after tensor parallelism
        self.wqkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.cp_group, self.cp = cp_group, cp
        if cp > 1:  # local queries attend to every gathered key up to their global position (a constant mask)
            q_pos = torch.arange(seq_local) + cp_rank * seq_local
            visible = torch.arange(seq_local * cp)[None, :] <= q_pos[:, None]
            mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))  # additive, as the kernel takes it
            self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        d = self.head_dim
        qkv = linear(self.wqkv, x, self.sp_group, "column")  # with SP: the whole (cp-local) sequence
        b, s, _ = qkv.shape
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = q.view(b, s, self.heads, d), k.view(b, s, self.kv_heads, d), v.view(b, s, self.kv_heads, d)
        if self.cp > 1:
            out = AllGatherKVAttention.apply(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.mask, self.cp_group
            )
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
        return linear(self.wo, out.transpose(1, 2).reshape(b, s, self.heads * d), self.sp_group, "row")


class MLP(nn.Module):
    """SwiGLU MLP with fused gate/up projection (Megatron's linear_fc1) and fused activation."""

    def __init__(self, hidden: int, ffn: int, *, sp_group=None) -> None:
        super().__init__()
        self.w13 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.sp_group = sp_group

    def forward(self, x):
        return linear(self.w2, FusedSwiGLU.apply(linear(self.w13, x, self.sp_group, "column")), self.sp_group, "row")


class AllToAll(torch.autograd.Function):
    """Uneven all-to-all whose backward sends the gradients back along the reversed splits."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        gi = g.new_empty((sum(in_splits), *g.shape[1:]))
        dist.all_to_all_single(gi, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return gi, None, None, None


class Expert(nn.Module):
    """One routed expert: a SwiGLU MLP that applies the routing probabilities to its activation."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, probs):
        return self.w2(WeightedSwiGLU.apply(self.w13(x), probs))


class Experts(nn.Module):
    """This rank's routed experts (keyed by global index, so checkpoints keep ranks apart); tokens come sorted by
    expert with their counts (Megatron's ``SequentialMLP``). One FSDP unit over the expert-data-parallel group."""

    def __init__(self, hidden: int, ffn: int, first: int, local: int, *, tracker) -> None:
        super().__init__()
        self.local = nn.ModuleDict({str(first + i): Expert(hidden, ffn) for i in range(local)})
        self.tracker = tracker

    def forward(self, x, probs, counts: list[int]):
        # A scope of its own: as a separate FSDP unit its weights are gathered only now, after the block's scope
        # listed the parameters it leaves out.
        with self.tracker.saved_activations("layers", self):
            pieces = zip(self.local.values(), x.split(counts), probs.split(counts), strict=True)
            return torch.cat([expert(xi, pi) for expert, xi, pi in pieces])


def sort_chunks(x, sizes: list[int], order: list[int]):
    """Chunks of ``x`` of ``sizes``, concatenated in ``order`` (Megatron's ``sort_chunks_by_idxs``: nothing kept)."""
    chunks = x.split(sizes)
    return torch.cat([chunks[i] for i in order])


class MoE(nn.Module):
    """Top-1 mixture of experts as Megatron-core's alltoall token dispatcher runs it (experts without tensor
    parallelism, etp = 1).

    The router sees this rank's tokens (its sequence shard under sequence parallelism). Each rank counts its tokens
    per expert and all-gathers the counts over the expert-parallel group (``preprocess``), so every rank knows what it
    sends to and receives from each other; tokens sorted by expert and their routing probabilities go out in two
    all-to-alls (``token_dispatch``), arrive grouped by source rank and are regrouped by local expert
    (``sort_chunks_by_idxs``); the experts apply the probabilities to their activation; one all-to-all brings the
    output back (``token_combine``) and the tokens return to their places.
    """

    def __init__(self, hidden: int, ffn: int, experts: int, *, ep_group, ep: int, ep_rank: int, tracker) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts_total, self.local = experts, experts // ep
        self.first = ep_rank * self.local
        self.experts = Experts(hidden, ffn, self.first, self.local, tracker=tracker)
        self.ep_group, self.ep = ep_group, ep

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens), dim=-1)
        gate, expert = torch.topk(probs, 1, dim=-1)
        gate, expert = gate.squeeze(1), expert.squeeze(1)
        order = torch.argsort(expert, stable=True)
        routed, gates = tokens[order], gate[order]
        counts = torch.bincount(expert, minlength=self.experts_total)
        if self.ep > 1:
            everyone = counts.new_empty(self.ep * self.experts_total)
            dist.all_gather_into_tensor(everyone, counts, group=self.ep_group)
            mine = everyone.view(self.ep, self.experts_total)[:, self.first : self.first + self.local]
            send = counts.view(self.ep, self.local).sum(1).tolist()
            recv = mine.sum(1).tolist()
            received = AllToAll.apply(routed, recv, send, self.ep_group)
            received_gates = AllToAll.apply(gates, recv, send, self.ep_group)
            # arrived grouped by source rank, then expert: regroup by expert, then source rank
            sizes = mine.reshape(-1).tolist()
            by_expert = [src * self.local + e for e in range(self.local) for src in range(self.ep)]
            xs = sort_chunks(received, sizes, by_expert)
            gs = sort_chunks(received_gates, sizes, by_expert)
            out = self.experts(xs, gs, mine.sum(0).tolist())
            back = [0] * len(by_expert)
            for position, chunk in enumerate(by_expert):
                back[chunk] = position
            out = sort_chunks(out, [sizes[i] for i in by_expert], back)
            out = AllToAll.apply(out, send, recv, self.ep_group)
        else:
            out = self.experts(routed, gates, counts.tolist())
        # back to the tokens' places (Megatron's unpermute: a scatter-add that keeps only the indices)
        place = order[:, None].expand(-1, out.shape[-1])
        return torch.zeros_like(out).scatter_add(0, place, out).reshape(shape)


class Block(nn.Module):
    def __init__(
        self, cfg, layout, index: int, *, cp_group, cp_rank: int, moe, emu, slow, tracker, sp_group=None
    ) -> None:
        super().__init__()
        seq_local = cfg.seq_length // layout.cp
        self.attn_norm = RMSNorm(cfg.hidden_size)
        self.attn = Attention(
            cfg.hidden_size, cfg.attention_heads, cfg.kv_heads, tp=layout.tp, cp_group=cp_group, cp=layout.cp,
            cp_rank=cp_rank, seq_local=seq_local, sp_group=sp_group,
        )  # fmt: skip
        self.mlp_norm = RMSNorm(cfg.hidden_size)
        self.mlp = moe if moe is not None else MLP(cfg.hidden_size, cfg.ffn_hidden_size, sp_group=sp_group)
        self.emu, self.slow, self.tracker = emu, slow, tracker
        # tokens of the micro-batch per token this rank holds between layers: cp shards, and tp with SP
        self.spread = layout.cp * (layout.tp if sp_group is not None else 1)
        # forward FLOPs on this GPU per token of the whole (cp-gathered) micro-batch: linear in tokens
        self.flops_per_token = block_forward_flops_per_gpu(cfg, layout, index, tokens=1.0)

    def forward(self, x):
        with self.tracker.saved_activations("layers", self):
            if self.emu is not None:
                x = SimKernel.apply(x, self.emu.seconds(self.flops_per_token * x.shape[0] * x.shape[1] * self.spread))
            t0 = time.perf_counter()
            x = x + self.attn(self.attn_norm(x))
            x = x + self.mlp(self.mlp_norm(x))
            if self.slow > 1.0 and self.emu is None:  # a straggler without emulation: stretch the real compute
                time.sleep((self.slow - 1.0) * (time.perf_counter() - t0))
            return x


class Stage(nn.Module):
    """One pipeline stage: embedding on the first, its share of the layers, norm and output head on the last."""

    def __init__(
        self, cfg, layout, layers: list[Block], *, first: bool, last: bool, cp_rank: int, emu, tracker, sp_group=None
    ) -> None:
        super().__init__()
        seq_local = cfg.seq_length // layout.cp
        self.first, self.last, self.emu, self.tracker = first, last, emu, tracker
        self.sp_group = sp_group
        self.spread = layout.cp * (layout.tp if sp_group is not None else 1)
        if first:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.pos = nn.Embedding(cfg.seq_length, cfg.hidden_size)
            self.register_buffer("positions", torch.arange(seq_local) + cp_rank * seq_local, persistent=False)
        self.layers = nn.ModuleList(layers)
        if last:
            self.norm = RMSNorm(cfg.hidden_size)
            self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.head_flops_per_token = logits_forward_flops_per_gpu(cfg, layout, tokens=1.0)

    def forward(self, x):
        if self.first:
            with self.tracker.saved_activations("embedding", self):
                x = self.embed(x) + self.pos(self.positions)
                if self.sp_group is not None:  # learned positions: all-reduce, add, then split (Megatron)
                    x = ScatterToSequenceParallel.apply(x, self.sp_group)
        for layer in self.layers:
            x = layer(x)
        if self.last:
            with self.tracker.saved_activations("output", self):
                if self.emu is not None:
                    x = SimKernel.apply(
                        x, self.emu.seconds(self.head_flops_per_token * x.shape[0] * x.shape[1] * self.spread)
                    )
                x = linear(self.head, self.norm(x), self.sp_group, "column")
        return x


# ====================================================================== data


def make_batch(step: int, replica: int, *, sequences: int, seq: int, vocab: int, seed: int):
    """Arithmetic sequences t_i = (a + i*d) mod vocab: learnable from context, different on every replica."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + replica)
    a = torch.randint(0, vocab, (sequences, 1), generator=g)
    d = torch.randint(1, 8, (sequences, 1), generator=g)
    tokens = (a + d * torch.arange(seq + 1)[None, :]) % vocab
    return tokens[:, :-1], tokens[:, 1:]


# ====================================================================== main


def all_reduce_flat(grads, group) -> None:
    """Sum ``grads`` (local shards of DTensors, or tensors) over ``group`` in one flattened all-reduce, in place."""
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if not local:
        return
    flat = torch.cat([t.reshape(-1) for t in local])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in local:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def main() -> None:  # noqa: C901, PLR0912, PLR0915 - a training script reads top to bottom
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = parse_layout(args.layout, world_size=world)
    dp, tp, pp, cp, ep = layout.dp, layout.tp, layout.pp, layout.cp, layout.ep
    moe_on = args.moe or ep > 1
    cfg = tiny_model(moe=moe_on, experts=args.experts)
    if cfg.kv_heads % tp or cfg.attention_heads % tp or cfg.vocab_size % tp:
        raise SystemExit(f"tp={tp} must divide the {cfg.kv_heads} KV heads, {cfg.attention_heads} heads and vocabulary")
    if cfg.layers % pp:
        raise SystemExit(f"pp={pp} must divide the {cfg.layers} layers")
    if cfg.seq_length % cp:
        raise SystemExit(f"cp={cp} must divide the sequence length {cfg.seq_length}")
    if moe_on and args.experts % ep:
        raise SystemExit(f"ep={ep} must divide the {args.experts} experts")
    if pp > 1 and args.micro_batches < pp:
        raise SystemExit(f"--micro-batches {args.micro_batches} must be >= pp={pp}")
    if args.dp == "ddp" and tp > 1:
        raise SystemExit("--dp ddp cannot wrap DTensor tensor-parallel parameters (cpu-testbed.md §4); use fsdp")
    hybrid = 0 < args.dp_shard < dp
    if args.dp_shard and (dp % args.dp_shard or args.dp != "fsdp" or moe_on):
        raise SystemExit(f"--dp-shard {args.dp_shard} needs --dp fsdp, a dense model and a divisor of dp={dp}")
    if moe_on and layout.expert_tp != 1:
        raise SystemExit(
            f"train_tiny runs experts without tensor parallelism; etp={layout.expert_tp} (it follows tp unless given): "
            "add etp=1 to --layout"
        )
    # Megatron-core refuses to train MoE with tp > 1 without sequence parallelism (MoELayer.forward).
    sp = tp > 1 and (args.sequence_parallel or moe_on)
    if args.sequence_parallel and tp == 1:
        raise SystemExit("--sequence-parallel shards activations over tensor-parallel ranks and needs tp > 1")

    tracker = sdk.tracker_from_env()
    if hybrid:  # HSDP: dp split into (replicate, shard); consecutive dp ranks share a shard group
        dims = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        mesh = init_device_mesh("cpu", (pp, dp // args.dp_shard, args.dp_shard, cp, tp), mesh_dim_names=dims)
        dp_cp_mesh = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")  # noqa: SLF001
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # noqa: SLF001
        fsdp_mesh = mesh["dp_replicate", "dp_shard_cp"]  # 2-D: fully_shard replicates over dim 0, shards over dim 1
    else:
        mesh = init_device_mesh("cpu", (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
        dp_cp_mesh = mesh["dp", "cp"]._flatten("dp_cp")  # noqa: SLF001 - the documented way to flatten on 2.13
        fsdp_mesh = dp_cp_mesh
    coord = layout.coord(rank)
    cp_group, tp_group = mesh.get_group("cp"), mesh.get_group("tp")
    tracker.register_mesh(mesh)
    tracker.register_groups({"dp_cp": dp_cp_mesh.get_group()})

    # Expert groups come from Megatron-core's expert rank generator (etp, ep, edp = tp*cp*dp/(etp*ep), pp): with
    # etp = 1 an ep group is ep consecutive ranks, e.g. a tp pair, unlike the dense groups.
    ep_group = edp_group = edp_mesh = None
    experts_sharded = moe_on and layout.expert_dp > 1 and args.dp == "fsdp" and dp * cp > 1  # FSDP2 over edp (ZeRO-3)
    if moe_on and ep > 1:  # every rank creates every group, in the same order
        for ranks in layout.groups("ep").tolist():
            g = dist.new_group(ranks)
            if rank in ranks:
                ep_group = g
        tracker.register_groups({"ep": ep_group})
    if moe_on and layout.expert_dp > 1:
        if experts_sharded:
            edp_mesh = DeviceMesh("cpu", torch.tensor(layout.groups("dp", expert=True)), mesh_dim_names=("rest", "edp"))
            edp_mesh = edp_mesh["edp"]
            edp_group = edp_mesh.get_group()
        else:
            for ranks in layout.groups("dp", expert=True).tolist():
                g = dist.new_group(ranks)
                if rank in ranks:
                    edp_group = g
        tracker.register_groups({"edp": edp_group})

    # -------------------------------------------------------------- batch, emulation, fault injection
    # Without pipelining a step is one forward of all its sequences: one micro-batch of micro_batches x size.
    micro_batches = args.micro_batches if pp > 1 else 1
    nominal_mbs = args.micro_batch_size if pp > 1 else args.micro_batches * args.micro_batch_size
    straggler = rank_factor(args.straggler, "--straggler")
    imbalance = rank_factor(args.imbalance, "--imbalance")
    slow = straggler[1] if straggler and straggler[0] == rank else 1.0
    die = rank_factor(args.die, "--die")
    die_at = int(die[1]) if die and die[0] == rank else None
    heavy_replica = None if imbalance is None else layout.coord(imbalance[0]).dp
    mbs = nominal_mbs
    if heavy_replica is not None and coord.dp == heavy_replica:
        mbs = max(1, round(nominal_mbs * imbalance[1]))
    seq_local = cfg.seq_length // cp
    emu = None
    if args.emulate > 0:
        peak = emulated_peak_flops_per_s(cfg, layout, micro_batch_size=nominal_mbs, block_ms=args.emulate)
        emu = Emulation(peak, slow)
    tracker.describe_job(
        TinyJob(
            micro_batch_size=nominal_mbs,
            micro_batches=micro_batches,
            block_ms=args.emulate or None,
            moe=moe_on,
            experts=args.experts,
            data_parallel=args.dp if dp * cp > 1 else "fsdp",
            schedule=args.schedule,
            cp_comm_type="all_gather",
            sequence_parallel=sp,
            dp_shard=args.dp_shard if hybrid else None,
        ).to_dict()
    )

    # -------------------------------------------------------------- model
    per_stage = cfg.layers // pp
    blocks = []
    for i in range(coord.pp * per_stage, (coord.pp + 1) * per_stage):
        moe = None
        if moe_on:
            moe = MoE(
                cfg.hidden_size, cfg.moe.expert_ffn_hidden_size, args.experts, ep_group=ep_group, ep=ep,
                ep_rank=coord.ep, tracker=tracker,
            )  # fmt: skip
        blocks.append(
            Block(
                cfg, layout, i, cp_group=cp_group, cp_rank=coord.cp, moe=moe, emu=emu, slow=slow, tracker=tracker,
                sp_group=tp_group if sp else None,
            )
        )  # fmt: skip
    first, last = coord.pp == 0, coord.pp == pp - 1
    stage = Stage(
        cfg, layout, blocks, first=first, last=last, cp_rank=coord.cp, emu=emu, tracker=tracker,
        sp_group=tp_group if sp else None,
    )  # fmt: skip
    expert_params = [p for n, p in stage.named_parameters() if ".experts." in n]
    if tp > 1:
        for block in stage.layers:
            block_plan = {"attn.wqkv": ColwiseParallel(), "attn.wo": RowwiseParallel()}
            if isinstance(block.mlp, MLP):
                block_plan.update({"mlp.w13": ColwiseParallel(), "mlp.w2": RowwiseParallel()})
            parallelize_module(block, mesh["tp"], block_plan)
        # vocabulary-parallel embedding (all-reduce of its output) and output layer (local logits, Shard(-1))
        stage_plan = {}
        if first:
            stage_plan["embed"] = RowwiseParallel(input_layouts=Replicate())
        if last:
            stage_plan["head"] = ColwiseParallel(output_layouts=Shard(-1))
        parallelize_module(stage, mesh["tp"], stage_plan)
    model = stage
    if dp * cp > 1:
        if args.dp == "fsdp":
            ignored = None
            if experts_sharded:  # each layer's experts: one FSDP2 unit over the expert-data-parallel group
                for block in stage.layers:
                    fully_shard(block.mlp.experts, mesh=edp_mesh)
            elif expert_params:
                ignored = set(expert_params)
            for block in stage.layers:
                fully_shard(block, mesh=fsdp_mesh, ignored_params=ignored)
            fully_shard(stage, mesh=fsdp_mesh, ignored_params=ignored)
        else:
            names = [n for n, _ in stage.named_parameters() if ".experts." in n]
            DDP._set_params_and_buffers_to_ignore_for_model(stage, names)  # noqa: SLF001
            model = DDP(stage, process_group=dp_cp_mesh.get_group())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # Under sequence parallelism every tp rank sees its own tokens, so the parameters it holds whole (norms, router)
    # get partial gradients: Megatron's finalize_model_grads all-reduces them over tp, in one flat buffer. (Listed
    # after wrapping: FSDP2 replaces the parameters.)
    sp_params = [p for n, p in stage.named_parameters() if n.endswith(("norm.weight", "router.weight"))] if sp else []
    vocab_local = cfg.vocab_size // tp
    vocab_start = dist.get_rank(tp_group) * vocab_local if tp > 1 else 0

    def loss_fn(logits, target):
        with tracker.saved_activations("output"):
            if tp > 1:
                return VocabParallelCrossEntropy.apply(logits, target, tp_group, vocab_start)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))

    schedule = None
    if pp > 1:
        h = cfg.hidden_size
        seq_between = seq_local // tp if sp else seq_local  # SP shards the activations between stages over tp
        if first:
            example_in = torch.zeros(mbs, seq_local, dtype=torch.long)
        else:
            example_in = torch.zeros(mbs, seq_between, h, requires_grad=True)
        out_shape = (mbs, seq_local, vocab_local) if last else (mbs, seq_between, h)
        example_out = torch.zeros(out_shape, requires_grad=True)
        pipe_stage = PipelineStage(
            model,
            coord.pp,
            pp,
            torch.device("cpu"),
            input_args=(example_in,),
            output_args=(example_out,),
            group=mesh.get_group("pp"),
        )
        schedule_cls = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
        schedule = schedule_cls(pipe_stage, n_microbatches=micro_batches, loss_fn=loss_fn)

    # -------------------------------------------------------------- train
    ckpt_dir = args.checkpoint_dir or os.path.join(  # noqa: PTH118
        tempfile.gettempdir(), f"train_tiny_ckpt_{os.environ.get('MASTER_PORT', '0')}"
    )
    loss_rank = layout.rank({"pp": pp - 1, "dp": 0, "tp": 0, "cp": 0})
    times, losses, cpu_times = [], [], []
    sequences = micro_batches * mbs
    cpu0 = time.process_time()
    for step in range(args.steps):
        if step == die_at:  # a rank that dies mid-run: no goodbye, no flush, peers left waiting in a collective
            print(f"rank {rank}: dying at step {step} (--die)", flush=True)
            os._exit(3)
        t0, c0 = time.perf_counter(), time.process_time()
        with tracker.step(step):
            with tracker.phase("data"):
                if args.slow_loader:
                    time.sleep(args.slow_loader / 1000.0)
                inputs, targets = make_batch(
                    step, coord.dp, sequences=sequences, seq=cfg.seq_length, vocab=cfg.vocab_size, seed=args.seed
                )
                sl = slice(coord.cp * seq_local, (coord.cp + 1) * seq_local)
                inputs, targets = inputs[:, sl].contiguous(), targets[:, sl].contiguous()
            tracker.data_stats(sequence_lengths=[cfg.seq_length] * sequences)
            step_losses: list[torch.Tensor] = []
            if schedule is not None:
                with tracker.phase("compute"):  # the stage's forward and backward chunks are labelled by the SDK
                    if first:
                        schedule.step(inputs)
                    elif last:
                        schedule.step(target=targets, losses=step_losses)
                    else:
                        schedule.step()
            else:
                with tracker.phase("forward"):
                    loss = loss_fn(model(inputs), targets)
                with tracker.phase("backward"):
                    loss.backward()
                step_losses = [loss.detach()]
            with tracker.phase("optimizer"):
                if sp_params:
                    all_reduce_flat([p.grad for p in sp_params if p.grad is not None], tp_group)
                if edp_group is not None and not experts_sharded:  # replicated experts: one flat all-reduce, mean
                    grads = [p.grad for p in expert_params if p.grad is not None]
                    all_reduce_flat(grads, edp_group)
                    for g in grads:
                        g.div_(dist.get_world_size(edp_group))
                optimizer.step()
                if step == 0:  # gradients and optimizer state exist now: count them once
                    tracker.count_model_state([stage], optimizer)
                optimizer.zero_grad(set_to_none=True)
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                with tracker.phase("checkpoint"):
                    state = {f"stage{coord.pp}.{k}": t for k, t in stage.state_dict().items()}
                    dcp.save(state, checkpoint_id=os.path.join(ckpt_dir, f"step{step + 1}"))  # noqa: PTH118
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        if rank == loss_rank and step_losses:
            losses.append(float(torch.stack([x.float() for x in step_losses]).mean()))
            print(f"step {step:3d}  loss {losses[-1]:.3f}  {times[-1] * 1000:7.1f} ms", flush=True)

    cpu_s = time.process_time() - cpu0  # this rank's CPU time over the loop, all threads
    counters = tracker.counters()
    if rank == loss_rank:
        median = sorted(times)[len(times) // 2] if times else math.nan
        print(f"done: {args.steps} steps, median {median * 1000:.1f} ms/step; meshscope {counters}", flush=True)
        if args.report:
            with open(args.report, "w") as f:  # noqa: PTH123
                report = {
                    "step_times_s": times,
                    "step_cpu_s": cpu_times,
                    "losses": losses,
                    "cpu_s": cpu_s,
                    "counters": counters.as_dict(),
                }
                json.dump(report, f)
    dist.barrier()
    if args.checkpoint_every and rank == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    tracker.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

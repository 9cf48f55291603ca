"""Train a tiny transformer for real on every parallelism axis PyTorch offers on CPU/gloo, watched by meshscope.

    meshscope run --nproc 8 --layout pp=2,dp=2,tp=2 -- python examples/train_tiny.py --steps 10 --emulate
    meshscope run --nproc 8 --layout pp=2,cp=2,tp=2 -- python examples/train_tiny.py --steps 10
    meshscope run --nproc 8 --layout pp=2,dp=2,tp=2,ep=2 -- python examples/train_tiny.py --steps 10 --moe

Model: meshscope's ``tiny`` preset (4 layers, hidden 64, 4 heads, 2 KV heads, FFN 256, vocab 512, sequence 64) on a
learnable synthetic task (arithmetic token sequences), so the loss falls. Every axis goes through PyTorch's own APIs
where they work on gloo (reference: cpu-testbed.md §3):

* tp: DTensor tensor parallelism (``parallelize_module``, column/row-parallel attention and MLP);
* pp: ``torch.distributed.pipelining`` (``PipelineStage`` + ``Schedule1F1B``, or ``ScheduleGPipe``);
* dp: FSDP2 ``fully_shard`` over the flattened dp x cp mesh (or DDP with ``--dp ddp`` when tp = 1);
* cp: the sequence is sharded over cp; keys and values are all-gathered in forward, reduce-scattered in backward;
* ep: top-1 mixture of experts (``--moe``), experts sharded over ep with uneven ``all_to_all_single`` dispatch and
  combine; expert gradients reduced over the expert-data-parallel group.

Fault injection, made deterministic by ``--emulate`` (emulated accelerator time: every transformer block sleeps a
fixed time proportional to its tokens, 2x in backward, so slowness shows on shared CPU cores):
``--straggler RANK:FACTOR`` (that rank's blocks are FACTOR x slower), ``--imbalance RANK:FACTOR`` (the data-parallel
replica holding RANK gets FACTOR x the sequences per micro-batch), ``--slow-loader MS`` (every rank's loader sleeps),
``--checkpoint-every N`` (a distributed checkpoint every N steps).
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from meshscope import sdk
from meshscope.layout import parse_layout
from meshscope.models import lookup_model

warnings.filterwarnings("ignore")


# ====================================================================== options


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", default=os.environ.get("MESHSCOPE_LAYOUT", ""), help="dp=..,tp=..,pp=..,cp=..,ep=..")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step per replica")
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--moe", action="store_true", help="make every second layer a mixture of experts (on with ep>1)")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--dp", choices=["fsdp", "ddp"], default="fsdp", help="data-parallel implementation")
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    p.add_argument("--straggler", default="", help="RANK:FACTOR, that rank computes FACTOR x slower")
    p.add_argument("--imbalance", default="", help="RANK:FACTOR, RANK's replica gets FACTOR x the tokens")
    p.add_argument("--slow-loader", type=float, default=0.0, metavar="MS", help="loader sleep per step, ms")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="DCP checkpoint every N steps")
    p.add_argument("--checkpoint-dir", default="")
    p.add_argument(
        "--emulate",
        nargs="?",
        const=20.0,
        type=float,
        default=0.0,
        metavar="MS",
        help="emulated accelerator time per block forward at nominal tokens, ms (default 20 when given)",
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
    """Fixed per-block time, proportional to tokens (cpu-testbed.md §5.2); ``factor`` slows one rank."""

    def __init__(self, block_ms: float, nominal_tokens: int, factor: float) -> None:
        self.block_s = block_ms / 1000.0
        self.nominal_tokens = nominal_tokens
        self.factor = factor


class SimKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, emu):
        ctx.r = x.shape[0] * x.shape[1] / emu.nominal_tokens
        ctx.emu = emu
        time.sleep(emu.block_s * ctx.r * emu.factor)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(2 * ctx.emu.block_s * ctx.r * ctx.emu.factor)
        return g, None


# ====================================================================== model


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class GatherSequence(torch.autograd.Function):
    """Context parallelism: all-gather K/V along the sequence in forward, reduce-scatter their gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        local = x.transpose(0, 1).contiguous()  # sequence first: collectives concatenate along dim 0
        out = local.new_empty((local.shape[0] * n, *local.shape[1:]))
        dist.all_gather_single(out, local, group=group)
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx, g):
        n = dist.get_world_size(ctx.group)
        full = g.transpose(0, 1).contiguous()
        out = full.new_empty((full.shape[0] // n, *full.shape[1:]))
        dist.reduce_scatter_single(out, full, group=ctx.group)
        return out.transpose(0, 1), None


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, *, tp: int, cp_group, cp: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.heads, self.kv_heads = heads // tp, kv_heads // tp  # local heads after tensor parallelism
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.cp_group, self.cp = cp_group, cp

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        cp_rank = 0
        if self.cp > 1:
            k = GatherSequence.apply(k, self.cp_group)
            v = GatherSequence.apply(v, self.cp_group)
            cp_rank = dist.get_rank(self.cp_group)
        q_pos = torch.arange(s) + cp_rank * s
        mask = torch.arange(k.shape[1])[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


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


class MoE(nn.Module):
    """Top-1 mixture of experts; experts sharded over the ep group (``ep_group`` None: all experts local)."""

    def __init__(self, hidden: int, ffn: int, experts: int, *, ep_group, ep: int, ep_rank: int) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts_total, self.local = experts, experts // ep
        self.first = ep_rank * self.local
        # keyed by global expert index so that checkpoints keep experts of different ranks apart
        self.experts = nn.ModuleDict({str(self.first + i): MLP(hidden, ffn) for i in range(self.local)})
        self.ep_group, self.ep = ep_group, ep

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens), dim=-1)
        gate, expert = probs.max(dim=-1)
        order = torch.argsort(expert, stable=True)
        routed, expert_sorted = tokens[order], expert[order]
        if self.ep > 1:
            dest = expert_sorted // self.local
            send = torch.bincount(dest, minlength=self.ep)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.ep_group)
            send_l, recv_l = send.tolist(), recv.tolist()
            received = AllToAll.apply(routed, recv_l, send_l, self.ep_group)
            ids = torch.empty(sum(recv_l), dtype=expert_sorted.dtype)
            dist.all_to_all_single(ids, expert_sorted.contiguous(), recv_l, send_l, group=self.ep_group)
        else:
            received, ids = routed, expert_sorted
        out = torch.zeros_like(received)
        for key, mlp in self.experts.items():
            sel = ids == int(key)
            if bool(sel.any()):
                out = out.index_put((sel.nonzero().squeeze(1),), mlp(received[sel]))
        if self.ep > 1:
            out = AllToAll.apply(out, send_l, recv_l, self.ep_group)
        combined = torch.empty_like(out).index_copy(0, order, out)
        return (combined * gate[:, None]).reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg, *, tp: int, cp_group, cp: int, moe: MoE | None, emu: Emulation | None, slow: float) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size)
        self.attn = Attention(cfg.hidden_size, cfg.attention_heads, cfg.kv_heads, tp=tp, cp_group=cp_group, cp=cp)
        self.mlp_norm = RMSNorm(cfg.hidden_size)
        self.mlp = moe if moe is not None else MLP(cfg.hidden_size, cfg.ffn_hidden_size)
        self.emu, self.slow = emu, slow

    def forward(self, x):
        if self.emu is not None:
            x = SimKernel.apply(x, self.emu)
        t0 = time.perf_counter()
        x = x + self.attn(self.attn_norm(x))
        x = x + self.mlp(self.mlp_norm(x))
        if self.slow > 1.0 and self.emu is None:  # a straggler without emulation: stretch the real compute
            time.sleep((self.slow - 1.0) * (time.perf_counter() - t0))
        return x


class Stage(nn.Module):
    """One pipeline stage: embedding on the first, its share of the layers, norm and output head on the last."""

    def __init__(self, cfg, layers: list[Block], *, first: bool, last: bool, seq_local: int, cp_rank: int) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.pos = nn.Embedding(cfg.seq_length, cfg.hidden_size)
            self.register_buffer("positions", torch.arange(seq_local) + cp_rank * seq_local, persistent=False)
        self.layers = nn.ModuleList(layers)
        if last:
            self.norm = RMSNorm(cfg.hidden_size)
            self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x):
        if self.first:
            x = self.embed(x) + self.pos(self.positions)
        for layer in self.layers:
            x = layer(x)
        if self.last:
            x = self.head(self.norm(x))
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


def main() -> None:  # noqa: C901, PLR0912, PLR0915 - a training script reads top to bottom
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = parse_layout(args.layout, world_size=world)
    dp, tp, pp, cp, ep = layout.dp, layout.tp, layout.pp, layout.cp, layout.ep
    cfg = lookup_model("tiny")
    moe_on = args.moe or ep > 1
    if cfg.kv_heads % tp or cfg.attention_heads % tp:
        raise SystemExit(f"tp={tp} must divide the {cfg.kv_heads} KV heads and {cfg.attention_heads} heads")
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

    tracker = sdk.tracker_from_env()
    mesh = init_device_mesh("cpu", (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    dp_cp_mesh = mesh["dp", "cp"]._flatten("dp_cp")  # noqa: SLF001 - the documented way to flatten on 2.13
    coord = layout.coord(rank)
    cp_group = mesh.get_group("cp")
    tracker.register_mesh(mesh)
    tracker.register_groups({"dp_cp": dp_cp_mesh.get_group()})

    ep_group = edp_group = None
    if moe_on and ep > 1:  # every rank creates every group, in the same order
        for ranks in layout.groups("ep").tolist():
            g = dist.new_group(ranks)
            if rank in ranks:
                ep_group = g
        if layout.expert_dp > 1:
            for ranks in layout.groups("dp", expert=True).tolist():
                g = dist.new_group(ranks)
                if rank in ranks:
                    edp_group = g
        tracker.register_groups({"ep": ep_group, "edp": edp_group})

    # -------------------------------------------------------------- fault injection
    straggler = rank_factor(args.straggler, "--straggler")
    imbalance = rank_factor(args.imbalance, "--imbalance")
    slow = straggler[1] if straggler and straggler[0] == rank else 1.0
    heavy_replica = None if imbalance is None else layout.coord(imbalance[0]).dp
    mbs = args.micro_batch_size
    if heavy_replica is not None and coord.dp == heavy_replica:
        mbs = max(1, round(args.micro_batch_size * imbalance[1]))
    seq_local = cfg.seq_length // cp
    emu = None
    if args.emulate > 0:
        emu = Emulation(args.emulate, args.micro_batch_size * seq_local, slow)

    # -------------------------------------------------------------- model
    per_stage = cfg.layers // pp
    blocks = []
    for i in range(coord.pp * per_stage, (coord.pp + 1) * per_stage):
        moe = None
        if moe_on and i % 2 == 1:
            moe = MoE(
                cfg.hidden_size, cfg.ffn_hidden_size // 2, args.experts, ep_group=ep_group, ep=ep, ep_rank=coord.ep
            )
        blocks.append(Block(cfg, tp=tp, cp_group=cp_group, cp=cp, moe=moe, emu=emu, slow=slow))
    stage = Stage(cfg, blocks, first=coord.pp == 0, last=coord.pp == pp - 1, seq_local=seq_local, cp_rank=coord.cp)
    expert_params = [p for n, p in stage.named_parameters() if ".experts." in n]
    if tp > 1:
        plan = {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(),
        }
        for block in stage.layers:
            block_plan = dict(plan)
            if isinstance(block.mlp, MLP):
                block_plan.update(
                    {"mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(), "mlp.w2": RowwiseParallel()}
                )
            parallelize_module(block, mesh["tp"], block_plan)
    model = stage
    if dp * cp > 1:
        if args.dp == "fsdp":
            for block in stage.layers:
                fully_shard(block, mesh=dp_cp_mesh, ignored_params=set(expert_params) or None)
            fully_shard(stage, mesh=dp_cp_mesh, ignored_params=set(expert_params) or None)
        else:
            names = [n for n, _ in stage.named_parameters() if ".experts." in n]
            DDP._set_params_and_buffers_to_ignore_for_model(stage, names)  # noqa: SLF001
            model = DDP(stage, process_group=dp_cp_mesh.get_group())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))

    schedule = None
    if pp > 1:
        h, v = cfg.hidden_size, cfg.vocab_size
        if coord.pp == 0:
            example_in = torch.zeros(mbs, seq_local, dtype=torch.long)
        else:
            example_in = torch.zeros(mbs, seq_local, h, requires_grad=True)
        example_out = torch.zeros(mbs, seq_local, v if coord.pp == pp - 1 else h, requires_grad=True)
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
        schedule = schedule_cls(pipe_stage, n_microbatches=args.micro_batches, loss_fn=loss_fn)

    # -------------------------------------------------------------- train
    ckpt_dir = args.checkpoint_dir or os.path.join(  # noqa: PTH118
        tempfile.gettempdir(), f"train_tiny_ckpt_{os.environ.get('MASTER_PORT', '0')}"
    )
    loss_rank = layout.rank({"pp": pp - 1, "dp": 0, "tp": 0, "cp": 0})
    times, losses = [], []
    sequences = args.micro_batches * mbs
    cpu0 = time.process_time()
    for step in range(args.steps):
        t0 = time.perf_counter()
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
                    if coord.pp == 0:
                        schedule.step(inputs)
                    elif coord.pp == pp - 1:
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
                if edp_group is not None:
                    n = dist.get_world_size(edp_group)
                    for p in expert_params:
                        if p.grad is not None:
                            dist.all_reduce(p.grad, group=edp_group)
                            p.grad.div_(n)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                with tracker.phase("checkpoint"):
                    state = {f"stage{coord.pp}.{k}": t for k, t in stage.state_dict().items()}
                    dcp.save(state, checkpoint_id=os.path.join(ckpt_dir, f"step{step + 1}"))  # noqa: PTH118
        times.append(time.perf_counter() - t0)
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
                report = {"step_times_s": times, "losses": losses, "cpu_s": cpu_s, "counters": counters.as_dict()}
                json.dump(report, f)
    dist.barrier()
    if args.checkpoint_every and rank == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    tracker.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A nanoGPT-style training script: DDP, gradient accumulation, a ``while True`` body, eval and logging on rank 0.

Laid out the way nanoGPT's ``train.py`` is (written here, not copied): module-level config, ``get_batch`` from a
token array, ``require_backward_grad_sync`` on the last micro-step only, ``estimate_loss`` every ``eval_interval``
iterations on every rank, gradient clipping, a cosine learning-rate schedule, a ``while True`` loop that breaks at
``max_iters``. meshscope adds five lines: the tracker after ``init_process_group`` (before the DDP wrap), one
``start_step()`` at the top of the body, the phases, and ``end_step()`` after the loop.

    meshscope run --nproc 4 -- python tests/scripts/nanogpt_ddp.py --iters 8
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from faults import Faults, add_fault_arguments
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from meshscope import sdk

# -------------------------------------------------------------------------------------------------- config
batch_size = 4
block_size = 64
n_layer, n_head, n_embd, vocab_size = 2, 4, 64, 256
gradient_accumulation_steps = 2
learning_rate, min_lr, warmup_iters = 3e-3, 3e-4, 2
eval_interval, eval_iters = 4, 2
grad_clip = 1.0


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (z.view(b, t, n_head, c // n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention()
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, vocab_size), targets.view(-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=8)
    # nanoGPT's configurator overrides the module-level config from the command line; these four do the same
    # (e.g. its shakespeare-char baby GPT: --n-layer 6 --n-embd 384 --block-size 256 --batch-size 64)
    p.add_argument("--n-layer", type=int, default=n_layer)
    p.add_argument("--n-embd", type=int, default=n_embd)
    p.add_argument("--block-size", type=int, default=block_size)
    p.add_argument("--batch-size", type=int, default=batch_size)
    add_fault_arguments(p)
    args = p.parse_args()
    globals().update(n_layer=args.n_layer, n_embd=args.n_embd, block_size=args.block_size, batch_size=args.batch_size)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    master = rank == 0
    torch.manual_seed(1337 + rank)
    torch.set_num_threads(1)
    tracker = sdk.tracker_from_env()
    faults = Faults(args, rank)

    # A learnable token stream: repeating arithmetic sequences, so that the loss falls.
    data = (np.arange(200_000) * 7 % vocab_size).astype(np.int64)
    rows = faults.batch(batch_size)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - block_size - 1, (rows,))
        x = torch.stack([torch.from_numpy(data[i : i + block_size]) for i in ix.tolist()])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size]) for i in ix.tolist()])
        return x, y

    model = DDP(GPT())
    raw = model.module
    optimizer = torch.optim.AdamW(raw.parameters(), lr=learning_rate, weight_decay=0.1)

    def get_lr(it: int) -> float:
        if it < warmup_iters:
            return learning_rate * (it + 1) / warmup_iters
        ratio = (it - warmup_iters) / max(1, args.iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (learning_rate - min_lr)

    @torch.no_grad()
    def estimate_loss() -> float:
        model.eval()
        losses = [raw(*get_batch())[1].item() for _ in range(eval_iters)]
        model.train()
        return float(np.mean(losses))

    x, y = get_batch()
    iter_num = 0
    while True:
        tracker.start_step()
        for group in optimizer.param_groups:
            group["lr"] = get_lr(iter_num)
        if iter_num % eval_interval == 0:
            with tracker.phase("eval"):
                val = estimate_loss()
            if master:
                print(f"step {iter_num}: val loss {val:.4f}", flush=True)
        for micro_step in range(gradient_accumulation_steps):
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            with tracker.phase("forward"), faults.slowed():
                _, loss = model(x, y)
                loss = loss / gradient_accumulation_steps
            with tracker.phase("data"):
                faults.read()  # the training batches only (the evaluation's stay as they are)
                x, y = get_batch()
            tracker.data_stats(tokens=int(x.numel()), sequences=int(x.shape[0]))
            with tracker.phase("backward"), faults.slowed():
                loss.backward()
        faults.pause()
        with tracker.phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if master:
            print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}", flush=True)
        iter_num += 1
        if iter_num >= args.iters:
            break
    tracker.end_step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

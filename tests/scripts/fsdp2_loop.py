"""A script in the shape of PyTorch's FSDP2 example: ``fully_shard`` per block and on the root, a plain epoch loop.

Written here (not copied): a small transformer language model, each block and then the root sharded with
``torch.distributed.fsdp.fully_shard`` over a 1-D device mesh of the world, AdamW, ``with tracker.step():`` around
each iteration with explicit phases. A 1-D mesh over the world needs no registration: FSDP2's groups name their mesh
dim, and the job is data parallel.

    meshscope run --nproc 4 -- python tests/scripts/fsdp2_loop.py --steps 8
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from faults import Faults, add_fault_arguments
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from meshscope import sdk

VOCAB, DIM, HEADS, LAYERS, SEQ = 256, 64, 4, 2, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.w1, self.w2 = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, DIM))
        return x + self.w2(F.silu(self.w1(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4)
    add_fault_arguments(p)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tracker = sdk.tracker_from_env()
    faults = Faults(args, rank)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    model = Transformer()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rows = faults.batch(args.batch_size)
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        with tracker.step(step):
            with tracker.phase("data"):
                faults.read()
                start = torch.randint(0, VOCAB, (rows, 1), generator=g)
                tokens = (start + torch.arange(SEQ + 1) * 3) % VOCAB  # learnable: arithmetic sequences
            tracker.data_stats(tokens=int(rows * SEQ), sequences=rows)
            with tracker.phase("forward"), faults.slowed():
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            faults.pause()
            with tracker.phase("backward"), faults.slowed():
                loss.backward()
            with tracker.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

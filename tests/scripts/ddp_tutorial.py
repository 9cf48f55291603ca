"""A script in the shape of PyTorch's DDP tutorial: a Dataset, a DistributedSampler, epochs of ``for batch in loader``.

Written here in the tutorial's layout (not copied): ``setup()`` from the launcher's environment, a model wrapped in
DDP, a ``DataLoader`` with a ``DistributedSampler`` whose epoch is set every epoch, ``enumerate(loader)`` numbering
steps from 0 in every epoch, and a checkpoint saved by rank 0 at the end of each epoch while the others wait at a
barrier. meshscope adds: the tracker after ``init_process_group``, ``tracker.data(loader)`` so that each fetch is
timed as the data phase of the step that uses it (``--plain-loader``: the loader itself, as a script that never
heard of the wrapper iterates it; its fetches are timed all the same), ``start_step(i)`` at the top of the body (the per-epoch ``i`` is
kept as ``user_step``), the phases, and the checkpoint as a phase.

    meshscope run --nproc 4 -- python tests/scripts/ddp_tutorial.py --epochs 2
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile

import torch
import torch.distributed as dist
from faults import Faults, add_fault_arguments
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817
from torch.utils.data import ConcatDataset, DataLoader, Dataset, default_collate
from torch.utils.data.distributed import DistributedSampler

from meshscope import sdk

FEATURES, HIDDEN, CLASSES = 256, 2048, 10


class Regression(Dataset):
    """Noisy samples of a fixed linear map: the loss falls."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, FEATURES, generator=g)
        w = torch.randn(FEATURES, CLASSES, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(n, CLASSES, generator=g)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def setup() -> int:
    dist.init_process_group("gloo")
    return dist.get_rank()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--plain-loader", action="store_true", help="iterate the DataLoader itself, not tracker.data(...)")
    add_fault_arguments(p)
    args = p.parse_args()
    rank = setup()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tracker = sdk.tracker_from_env()
    faults = Faults(args, rank)

    model = DDP(nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                              nn.Linear(HIDDEN, CLASSES)))  # fmt: skip
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dataset = Regression(args.samples)
    if faults.rows > 1:  # the same number of batches, each of more rows: this rank's shard is the data repeated
        dataset = ConcatDataset([dataset] * math.ceil(faults.rows))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)

    def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        faults.read()  # reading the batch
        return default_collate(samples)

    loader = DataLoader(
        dataset, batch_size=faults.batch(args.batch_size), sampler=sampler, drop_last=True, collate_fn=collate
    )
    steps = args.samples // (args.batch_size * dist.get_world_size())
    checkpoint = os.path.join(tempfile.gettempdir(), f"ddp-tutorial-{os.getpid()}.pt")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader if args.plain_loader else tracker.data(loader)):
            if i >= steps:  # every rank makes the same number of steps, whatever its batch size
                break
            tracker.start_step(i)
            tracker.data_stats(tokens=int(x.shape[0]), sequences=int(x.shape[0]))
            with tracker.phase("forward"), faults.slowed():
                loss = loss_fn(model(x), y)
            faults.pause()
            with tracker.phase("backward"), faults.slowed():
                optimizer.zero_grad()
                loss.backward()
            with tracker.phase("optimizer"):
                optimizer.step()
            if faults.logs_between_steps:  # logging after the step, as docs/sdk.md §1.5 lays a loop out
                tracker.end_step()
                faults.flush_log()
        if rank == 0:
            with tracker.phase("checkpoint"):
                torch.save(model.module.state_dict(), checkpoint)
            print(f"epoch {epoch}: loss {loss.item():.4f}", flush=True)
        dist.barrier()
    tracker.end_step()
    if rank == 0 and os.path.exists(checkpoint):
        os.remove(checkpoint)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

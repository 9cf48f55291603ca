"""A script in the shape of PyTorch's DDP tutorial in its ``mp.spawn`` form: it starts its own ranks.

Written here in the tutorial's layout (not copied): the parent picks the world size and spawns one process per rank
with ``torch.multiprocessing.spawn``; each child sets ``MASTER_ADDR``/``MASTER_PORT`` itself and calls
``init_process_group`` with the rank the spawn gave it, so the launcher's ``RANK`` (0 of 1, inherited by every
child) is wrong in all but one. meshscope adds the tracker after ``init_process_group`` and ``with tracker.step()``.

    meshscope run --nproc 1 -- python tests/scripts/ddp_spawn.py --world 2
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from meshscope import sdk


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train(rank: int, world: int, port: int, steps: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tracker = sdk.tracker_from_env()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 8)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(steps):
        with tracker.step(step):
            with tracker.phase("forward"):
                loss = nn.functional.mse_loss(model(torch.randn(256, 32)), torch.randn(256, 8))
            with tracker.phase("backward"):
                loss.backward()
            with tracker.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
    tracker.close()
    dist.destroy_process_group()
    # The child ends here, skipping the interpreter's finalization, as meshscope run's own ranks do (local/running.py,
    # _KEPT): with PyTorch 2.13 a gloo group freed after destroy_process_group (DDP's reducer holds its last
    # reference; the model is a local of this function) has its worker threads wait for the GIL, and in the
    # finalization of a spawned child the process can abort ("terminate called without an active exception": 4 of
    # the 6 runs of these tests in three runs of the whole suite, none of ~30 outside it). tracker.close() has sent
    # every record.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    mp.spawn(train, args=(args.world, _free_port(), args.steps), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()

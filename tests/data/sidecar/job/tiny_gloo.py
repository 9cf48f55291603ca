"""A tiny 2-rank gloo job with the meshscope SDK: every step computes, all-reduces over dp, steps an optimizer.

Launched by tests/sidecar/test_main.py with the environment torchrun and the operator would give a rank (RANK,
WORLD_SIZE, MASTER_*, MESHSCOPE_JOB/LAYOUT/NODE and MESHSCOPE_COLLECTOR pointing at the sidecar's socket).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from meshscope import sdk


def main() -> None:
    steps = int(sys.argv[1])
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    tracker = sdk.tracker_from_env()
    tracker.register_groups({"dp": dist.group.WORLD})
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        with tracker.step(step):
            with tracker.phase("forward"):
                loss = model(torch.randn(32, 64)).square().mean()
            with tracker.phase("backward"):
                loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            with tracker.phase("optimizer"):
                opt.step()
                opt.zero_grad()
    tracker.close()
    dist.destroy_process_group()
    # PyTorch 2.13 (CPU, gloo) aborts at interpreter exit in about half of the runs of a job that all-reduced
    # autograd's gradients ("terminate called without an active exception", or a segfault; no meshscope involved:
    # the same loop without the SDK does it, one that all-reduces a plain tensor does not). Everything is sent and
    # the group destroyed by now, so end as a forked rank of `meshscope run` does.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

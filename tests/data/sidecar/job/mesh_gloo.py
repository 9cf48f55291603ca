"""A 4-rank gloo job with the meshscope SDK over a tp=2, dp=2 mesh: compute, a TP all-reduce, a DP all-reduce.

Launched by tests/sidecar/test_end_to_end.py as pipeline stage 0 of a tp=2,pp=2,dp=2 job (ranks 0-3 have the same
coords in both layouts), with the environment torchrun and the operator give a rank. Each step sleeps in its forward
phase so that a step lasts long enough (``argv[2]`` seconds) for Prometheus to scrape it several times.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from meshscope import sdk


def main() -> None:
    steps, pause_s = int(sys.argv[1]), float(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    # Every rank creates every group, in the same order (torch.distributed.new_group's rule).
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, dp = tp_groups[rank // 2], dp_groups[rank % 2]
    tracker = sdk.tracker_from_env()
    tracker.register_groups({"tp": tp, "dp": dp})
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        with tracker.step(step):
            with tracker.phase("forward"):
                time.sleep(pause_s)
                out = model(torch.randn(32, 64))
            dist.all_reduce(out.detach(), group=tp)
            with tracker.phase("backward"):
                out.square().mean().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, group=dp)
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

"""The SDK inside real multi-process gloo jobs: what it captures, how it attributes it, and that the job is unchanged."""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from invariants import read_lines
from meshscope import sdk
from meshscope.analysis import analyze
from meshscope.records import IntervalKind, read_records, read_table

F32, I64, F64 = 4, 8, 8  # bytes per element

# Layout tp=2, pp=2 on 4 ranks (tp fastest): tp groups {0,1} {2,3}; pp groups {0,2} {1,3}.
LAYOUT = "tp=2,pp=2"


def _collectives_job(rank: int, world: int) -> dict[str, object]:
    tracker = sdk.tracker_from_env()
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, pp = tp_groups[rank // 2], pp_groups[rank % 2]
    tracker.register_groups({"tp": tp, "pp": pp})
    stage = rank // 2  # index in the pp group
    seen: dict[str, object] = {}
    with tracker.step(0), tracker.phase("forward"):
        if rank == 1:
            time.sleep(0.3)  # rank 0 now waits ~0.3 s in the first tp all-reduce: blocked, not computing
        a = torch.ones(8, 16)
        dist.all_reduce(a, group=tp)
        seen["all_reduce"] = a[0, 0].item()
        gathered = torch.empty(8, 3)
        dist.all_gather_single(gathered, torch.full((4, 3), float(rank)), group=tp)
        seen["all_gather"] = gathered[:, 0].tolist()
        scattered = torch.empty(5)
        dist.reduce_scatter_single(scattered, torch.ones(10), group=pp)
        seen["reduce_scatter"] = scattered.tolist()
        in_splits, out_splits = ([1, 3], [1, 2]) if stage == 0 else ([2, 1], [3, 1])
        sent = torch.full((sum(in_splits), 2), float(rank), dtype=torch.float64)
        received = torch.empty(sum(out_splits), 2, dtype=torch.float64)
        dist.all_to_all_single(received, sent, out_splits, in_splits, group=pp)
        seen["all_to_all"] = received[:, 0].tolist()
        b = torch.full((6,), rank, dtype=torch.int64)
        dist.broadcast(b, src=rank % 2, group=pp)
        seen["broadcast"] = b.tolist()
        work = dist.all_reduce(torch.ones(3), group=pp, async_op=True)
        work.wait()
        y = funcol.all_reduce(torch.ones(5, 2), "sum", tp)
        seen["functional"] = float(y.sum())
        raw = torch.ops._c10d_functional.all_reduce(torch.ones(3, 2), "sum", tp.group_name)
        torch.ops._c10d_functional.wait_tensor(raw[1:])  # waited through a view: found by its storage
        seen["functional_view"] = float(raw.sum())
        rows = torch.zeros(7, 2)  # an _out variant gathering into a view at an offset, waited through another view
        gather_out = rows[1:5]
        torch.ops._c10d_functional.all_gather_into_tensor_out(
            torch.full((2, 2), float(rank)), 2, tp.group_name, out=gather_out
        )
        torch.ops._c10d_functional.wait_tensor(rows)  # found by the storage both views share
        seen["functional_out"] = rows[:, 0].tolist()
        if stage == 0:
            dist.send(torch.arange(7, dtype=torch.float32), dst=rank + 2, group=pp)
        else:
            r = torch.empty(7)
            dist.recv(r, src=rank - 2, group=pp)
            seen["recv"] = r.tolist()
        dist.barrier(group=tp)
        dist.barrier()  # the world group of a tp x pp job maps to no axis: counted, not recorded
    seen["counters"] = tracker.counters().as_dict()
    tracker.close()
    return seen


def _expected(rank: int) -> list[tuple[str, str, str, int]]:
    """(kind, axis, op, bytes) of every operation rank issues, in order, from the tensor shapes above."""
    stage = rank // 2
    a2a_rows = 4 if stage == 0 else 3
    p2p = ("p2p", "pp", "send", 7 * F32) if stage == 0 else ("p2p", "pp", "recv", 7 * F32)
    return [
        ("comm", "tp", "all_reduce", 8 * 16 * F32),  # the whole buffer
        ("comm", "tp", "all_gather", 8 * 3 * F32),  # the gathered buffer
        ("comm", "pp", "reduce_scatter", 10 * F32),  # the unscattered input
        ("comm", "pp", "all_to_all", a2a_rows * 2 * F64),  # the send buffer (uneven splits)
        ("comm", "pp", "broadcast", 6 * I64),
        ("comm", "pp", "all_reduce", 3 * F32),  # async, ended by its wait
        ("comm", "tp", "all_reduce", 5 * 2 * F32),  # functional (DTensor's road)
        ("comm", "tp", "all_reduce", 3 * 2 * F32),  # functional, waited through a view of its output
        ("comm", "tp", "all_gather", 4 * 2 * F32),  # functional _out variant into a view: the gathered rows
        p2p,
        ("comm", "tp", "barrier", 0),
    ]


@pytest.mark.slow
def test_collectives_are_captured_with_axis_op_bytes_and_matching_seq(fork_job) -> None:
    job = fork_job(_collectives_job, 4, env={"MESHSCOPE_LAYOUT": LAYOUT})
    # the job itself is unchanged
    for rank, seen in enumerate(job.results):
        stage = rank // 2
        assert seen["all_reduce"] == 2.0
        tp_peers = [2 * stage, 2 * stage + 1]
        assert seen["all_gather"] == [float(r) for r in tp_peers for _ in range(4)]
        assert seen["reduce_scatter"] == [2.0] * 5
        other = rank + 2 if stage == 0 else rank - 2
        assert seen["all_to_all"] == (
            [float(rank)] + [float(other)] * 2 if stage == 0 else [float(other)] * 3 + [float(rank)]
        )
        assert seen["broadcast"] == [rank % 2] * 6
        assert seen["functional"] == 20.0
        assert seen["functional_view"] == 12.0
        assert seen["functional_out"] == [0.0, *[float(r) for r in tp_peers for _ in range(2)], 0.0, 0.0]
        if stage == 1:
            assert seen["recv"] == [float(i) for i in range(7)]
        assert seen["counters"]["unattributed_ops"] == 1
        assert seen["counters"]["hook_errors"] == 0

    records = read_records(job.records_path)  # validates every record against the schema
    assert sorted((r.rank, r.step) for r in records) == [(0, 0), (1, 0), (2, 0), (3, 0)]
    by_rank = {r.rank: r for r in records}
    net = {
        rank: [iv for iv in rec.intervals if iv.kind in (IntervalKind.COMM, IntervalKind.P2P)]
        for rank, rec in by_rank.items()
    }
    for rank, ivs in net.items():
        got = [(iv.kind.value, str(iv.axis), str(iv.op), iv.size_bytes) for iv in ivs]
        assert got == _expected(rank), f"rank {rank}"
        assert by_rank[rank].coord.as_dict() == {"dp": 0, "tp": rank % 2, "pp": rank // 2, "cp": 0, "ep": 0}

    # every member names a group the same way; (group, seq) is one instance with all its members
    groups = {rank: {str(iv.axis): iv.group for iv in ivs if iv.kind is IntervalKind.COMM} for rank, ivs in net.items()}
    assert groups[0] == groups[2] | {"tp": "tp:0", "pp": "pp:0"} == {"tp": "tp:0", "pp": "pp:0"}
    assert groups[1] == {"tp": "tp:0", "pp": "pp:1"}
    assert groups[3] == {"tp": "tp:2", "pp": "pp:1"}
    members: dict[tuple[str, int], list[tuple[int, str, int]]] = defaultdict(list)
    for rank, ivs in net.items():
        for iv in ivs:
            if iv.kind is IntervalKind.COMM:
                members[(iv.group, iv.seq)].append((rank, str(iv.op), iv.group_size))
    assert len(members) == 2 * 6 + 2 * 4  # tp: 6 collectives x 2 groups; pp: 4 x 2
    for (group, seq), ms in members.items():
        assert len(ms) == 2, (group, seq, ms)
        assert len({op for _, op, _ in ms}) == 1
        assert {size for _, _, size in ms} == {2}

    # a send and its receive carry the same stream id and number, and name each other
    for sender in (0, 1):
        send = next(iv for iv in net[sender] if iv.kind is IntervalKind.P2P)
        recv = next(iv for iv in net[sender + 2] if iv.kind is IntervalKind.P2P)
        assert (send.group, send.seq) == (recv.group, recv.seq) == (f"pp:{sender}-{sender + 2}", 0)
        assert (send.peer, recv.peer) == (sender + 2, sender)

    # rank 0 sat ~0.3 s in its first all-reduce waiting for rank 1: that time is not compute
    first = net[0][0]
    overlap = sum(
        max(0, min(iv.end_us, first.end_us) - max(iv.start_us, first.start_us))
        for iv in by_rank[0].intervals
        if iv.kind is IntervalKind.COMPUTE
    )
    assert overlap < (first.end_us - first.start_us) / 2


def _ddp_job(rank: int, world: int) -> dict[str, object]:
    tracker = sdk.tracker_from_env()
    torch.manual_seed(0)
    model = nn.Linear(8, 4)  # 8*4 + 4 = 36 float32 parameters: one 144-byte bucket
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    x = torch.full((3, 8), float(rank + 1))
    with tracker.step(0):
        with tracker.phase("forward"):
            loss = ddp(x).sum()
        with tracker.phase("backward"):
            loss.backward()
    reference(x).sum().backward()
    expected = [p.grad.clone() for p in reference.parameters()]
    for g in expected:
        dist.all_reduce(g)
        g.div_(world)
    same = all(torch.allclose(p.grad, g) for p, g in zip(model.parameters(), expected, strict=True))
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"same": same, "counters": counters}


@pytest.mark.slow
def test_ddp_bucket_reductions_are_captured_and_gradients_unchanged(fork_job) -> None:
    job = fork_job(_ddp_job, 2, env={"MESHSCOPE_LAYOUT": "dp=2"})
    assert all(r["same"] for r in job.results), "DDP's gradients changed under the meshscope comm hook"
    assert all(r["counters"]["hook_errors"] == 0 for r in job.results)
    records = read_records(job.records_path)
    comm = {
        r.rank: [(str(iv.axis), str(iv.op), iv.size_bytes, iv.group, iv.seq) for iv in r.intervals if iv.axis]
        for r in records
    }
    # the world group of a dp=2 layout is the dp group (inferred from the layout, nothing registered); seq 1: the
    # wrap's parameter broadcast (dist._broadcast_coalesced, before any step: not recorded) was the group's first
    assert comm[0] == comm[1] == [("dp", "all_reduce", (8 * 4 + 4) * F32, "dp:0", 1)]


def _ddp_paths_job(rank: int, world: int) -> dict[str, object]:
    # Every road DDP's reducer averages gradients by (reducer.cpp, ``mark_variable_ready_dense``): copied into the
    # bucket with a multiplication by 1/world (fresh gradients: the default, and after ``zero_grad()`` with
    # ``gradient_as_bucket_view``), or divided in place where the gradient is the bucket's view already (kept between
    # steps with ``zero_grad(set_to_none=False)``, accumulated over ``no_sync`` micro-steps).
    # A sparse embedding's gradient is a bucket of its own, divided (``mark_variable_ready_sparse``).
    tracker = sdk.tracker_from_env()
    grads: list[str] = []
    for as_view in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(32, 16, sparse=True), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        ddp = DDP(model, gradient_as_bucket_view=as_view, bucket_cap_mb=0.001)  # several buckets
        gen = torch.Generator().manual_seed(rank + 1)
        for step, (set_to_none, micro_steps) in enumerate([(True, 1), (False, 1), (False, 3), (True, 2), (True, 1)]):
            model.zero_grad(set_to_none=set_to_none)
            with tracker.step(10 * int(as_view) + step):
                for micro in range(micro_steps):
                    sync = contextlib.nullcontext() if micro == micro_steps - 1 else ddp.no_sync()
                    with sync:
                        ddp(torch.randint(0, 32, (8,), generator=gen)).pow(2).mean().backward()
            dense = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in model.parameters()]
            grads.append(torch.cat([g.flatten() for g in dense]).numpy().tobytes().hex())
    tracker.close()
    return {"grads": grads, "enabled": tracker.enabled}


@pytest.mark.slow
def test_ddp_gradients_are_bit_for_bit_those_of_the_untracked_job(fork_job) -> None:
    # Three ranks: 1/3 is not exact in binary, so multiplying by it and dividing by 3 differ in the last bit of about
    # a third of the gradients (PyTorch's ``allreduce_hook`` divides everything: a tracked job would drift from the
    # untracked one). Each step of each road is compared, bit for bit.
    on = _same_gradients_tracked_or_not(fork_job, _ddp_paths_job, 3)
    assert len({r["grads"][0] for r in on}) == 1  # averaged: the same on every rank


def _same_gradients_tracked_or_not(fork_job, job, world: int) -> list[dict[str, object]]:
    """Run ``job`` on ``world`` dp ranks untracked and tracked; each rank's gradients after every step must be equal,
    bit for bit. The tracked job's results."""
    env = {"MESHSCOPE_LAYOUT": f"dp={world}"}
    off = fork_job(job, world, env={**env, "MESHSCOPE_DISABLE": "1"}, collect=False)
    on = fork_job(job, world, env=env)
    assert [r["enabled"] for r in on.results] == [True] * world
    assert [r["enabled"] for r in off.results] == [False] * world
    for rank in range(world):
        for i, (tracked, untracked) in enumerate(
            zip(on.results[rank]["grads"], off.results[rank]["grads"], strict=True)
        ):
            assert tracked == untracked, f"rank {rank}, step {i}: the tracked job's gradients differ"
    return on.results


def _ddp_join_job(rank: int, world: int) -> dict[str, object]:
    # Uneven inputs under ``Join``: rank r has 2 + r batches. With ``divide_by_initial_world_size=False`` the reducer
    # divides by the ranks not yet joined (4, then 3, 2), counted by an all-reduce in each forward
    # (``Reducer::set_divide_factor``); 3 is not a power of two, so dividing by 4 (or multiplying by 1/3 where the
    # reducer divides a bucket's view) would change the last bits, or every gradient.
    from torch.distributed.algorithms.join import Join  # noqa: PLC0415

    tracker = sdk.tracker_from_env()
    grads: list[str] = []
    step = 0
    for as_view, by_initial in ((False, False), (True, False), (False, True)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        ddp = DDP(model, gradient_as_bucket_view=as_view, bucket_cap_mb=0.001)
        gen = torch.Generator().manual_seed(rank + 1)
        with Join([ddp], divide_by_initial_world_size=by_initial):
            for _ in range(2 + rank):
                model.zero_grad(set_to_none=False)  # kept: with as_view, the gradients are the buckets' views
                with tracker.step(step):
                    ddp(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
                step += 1
                grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).numpy().tobytes().hex())
    tracker.close()
    return {"grads": grads, "enabled": tracker.enabled}


@pytest.mark.slow
def test_ddp_under_join_divides_by_the_ranks_not_yet_joined_like_the_untracked_job(fork_job) -> None:
    on = _same_gradients_tracked_or_not(fork_job, _ddp_join_job, 4)
    assert [len(r["grads"]) for r in on] == [3 * (2 + rank) for rank in range(4)]


def _steps_job(rank: int, world: int) -> dict[str, object]:
    tracker = sdk.tracker_from_env()
    sums = []
    for step in range(3):
        with tracker.step(step):
            t = torch.full((4,), float(rank + 1))
            dist.all_reduce(t)
            sums.append(t.tolist())
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"sums": sums, "counters": counters, "enabled": tracker.enabled}


@pytest.mark.slow
def test_absent_collector_drops_and_counts_records_and_the_job_is_unchanged(fork_job) -> None:
    job = fork_job(_steps_job, 2, env={"MESHSCOPE_LAYOUT": "dp=2"}, collect=False)
    for result in job.results:
        assert result["enabled"] is True
        assert result["sums"] == [[3.0] * 4] * 3
        assert result["counters"]["records_dropped"] == 3
        assert result["counters"]["records_sent"] == 0
        assert result["counters"]["hook_errors"] == 0


@pytest.mark.slow
def test_disabled_sdk_runs_the_same_job_and_sends_nothing(fork_job) -> None:
    job = fork_job(_steps_job, 2, env={"MESHSCOPE_LAYOUT": "dp=2", "MESHSCOPE_DISABLE": "1"})
    for result in job.results:
        assert result["enabled"] is False
        assert result["sums"] == [[3.0] * 4] * 3
    assert job.records_path.read_bytes() == b""
    assert job.collector is not None
    assert job.collector.ranks == {}


def _unwaited_job(rank: int, world: int) -> dict[str, object]:
    tracker = sdk.tracker_from_env()
    t = torch.ones(16)
    with tracker.step(0):
        work = dist.all_reduce(t, async_op=True)  # nobody waits inside the step
    work.wait()
    with tracker.step(1):
        pass
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters, "sum": t[0].item()}


@pytest.mark.slow
def test_an_asynchronous_collective_never_waited_in_its_step_is_ended_by_its_completion(fork_job) -> None:
    job = fork_job(_unwaited_job, 2, env={"MESHSCOPE_LAYOUT": "dp=2"})
    assert [r["sum"] for r in job.results] == [2.0, 2.0]
    assert all(r["counters"]["incomplete_ops"] == 0 for r in job.results)
    records = read_records(job.records_path)
    ops = {(r.rank, r.step): [(str(iv.op), iv.size_bytes, iv.seq) for iv in r.intervals if iv.axis] for r in records}
    assert ops == {(0, 0): [("all_reduce", 16 * F32, 0)], (1, 0): [("all_reduce", 16 * F32, 0)], (0, 1): [], (1, 1): []}


# ---------------------------------------------------------------------- DDP windows and order-free start


class _SlowBackward(torch.autograd.Function):
    """Identity; its backward sleeps, so that this rank's buckets become ready late and its peers wait for them."""

    @staticmethod
    def forward(ctx, x, delay_s):  # type: ignore[no-untyped-def]
        ctx.delay_s = delay_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        time.sleep(ctx.delay_s)
        return g, None


def _ddp_windows_job(rank: int, world: int) -> dict[str, object]:
    tracker = sdk.tracker_from_env()
    clock = tracker._ops.clock
    now_us = lambda: clock.host_ns_to_us(time.perf_counter_ns())  # noqa: E731
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 512), nn.Linear(512, 512))
    ddp = DDP(model)  # the last layer's 1 MiB fills DDP's first bucket: two buckets (from the second backward on)
    entered: list[int] = []

    def slow_hook(state, bucket):  # type: ignore[no-untyped-def]
        entered.append(now_us())  # the bucket's issue, as the user's hook sees it
        time.sleep(0.03)  # Python before the collective (the default hook divides first)
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(dist.group.WORLD, slow_hook)  # replaces meshscope's inner hook
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.full((3, 8), float(rank + 1))
    marks: list[dict[str, int]] = []
    for step in range(2):
        dist.barrier()
        with tracker.step(step):
            with tracker.phase("forward"):
                loss = _SlowBackward.apply(ddp(x), 0.3 if rank == 1 else 0.0).sum()
            with tracker.phase("backward"):
                loss.backward()
                backward_returned = now_us()
            with tracker.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
        marks.append({"backward_returned": backward_returned})
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"entered": entered, "marks": marks, "counters": counters}


def _zero_job(rank: int, world: int) -> dict[str, object]:
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: PLC0415

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))
    ddp = DDP(model)
    tracker = sdk.tracker_from_env()  # after the wrap, as PyTorch's ZeRO recipe builds its model first
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    x = torch.full((4, 64), float(rank + 1))
    for step in range(3):
        with tracker.step(step):
            with tracker.phase("forward"):
                loss = ddp(x).square().mean()
            with tracker.phase("backward"):
                loss.backward()
            with tracker.phase("optimizer"):
                optimizer.step()  # each rank steps its shard, then broadcasts it to the others
                optimizer.zero_grad()
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters, "param_bytes": [p.nbytes for p in model.parameters()]}


@pytest.mark.slow
def test_zero_redundancy_optimizers_parameter_broadcasts_are_dp_traffic_inside_its_step(fork_job) -> None:
    # DDP with torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO-1): gradients all-reduced in backward, then in
    # optimizer.step() each parameter broadcast from the rank that owns its optimizer state. Those broadcasts are the
    # dp group's traffic, with each parameter's bytes, inside the optimizer phase: not optimizer compute.
    job = fork_job(_zero_job, 2, env={"MESHSCOPE_LAYOUT": "dp=2"}, every_step=("optimizer", "comm"))
    param_bytes = sorted(job.results[0]["param_bytes"])
    for result in job.results:
        assert result["counters"]["hook_errors"] == 0
        assert result["counters"]["unattributed_ops"] == 0
    records = read_lines(job.records_path)
    assert len(records) == 6
    for rec in records:
        comm = [iv for iv in rec["intervals"] if iv["kind"] == "comm"]
        assert {(iv["axis"], iv["group"]) for iv in comm} == {("dp", "dp:0")}
        broadcasts = [iv for iv in comm if iv["op"] == "broadcast"]
        assert sorted(iv["bytes"] for iv in broadcasts) == param_bytes, rec["rank"]
        assert sum(iv["bytes"] for iv in comm if iv["op"] == "all_reduce") == sum(param_bytes)
        optimizer = [iv for iv in rec["intervals"] if iv["kind"] == "optimizer"]
        backward_end = max(iv["end_us"] for iv in comm if iv["op"] == "all_reduce")
        for iv in broadcasts:  # issued by the optimizer step, after the gradients were reduced
            assert min(o["start_us"] for o in optimizer) <= iv["start_us"]
            assert iv["start_us"] >= backward_end


@pytest.mark.slow
def test_ddp_windows_start_at_the_bucket_issue_and_end_before_backward_returns(fork_job) -> None:
    job = fork_job(_ddp_windows_job, 2, env={"MESHSCOPE_LAYOUT": "dp=2"}, every_step=("optimizer",))
    records = {(r["rank"], r["step"]): r for r in read_lines(job.records_path)}
    assert sorted(records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, result in enumerate(job.results):
        assert result["counters"]["hook_errors"] == 0
        entered = iter(result["entered"])
        for step, marks in enumerate(result["marks"]):
            rec = records[(rank, step)]
            buckets = [iv for iv in rec["intervals"] if iv["kind"] == "comm"]
            # DDP reduces in one bucket first, then in the buckets it rebuilt from the first backward's order
            assert [(iv["axis"], iv["op"]) for iv in buckets] == [("dp", "all_reduce")] * (step + 1)
            optimizer = next(iv for iv in rec["intervals"] if iv["kind"] == "optimizer")
            for iv in buckets:
                assert iv["start_us"] <= next(entered)  # from the issue, not from the collective 30 ms later
                assert iv["end_us"] <= marks["backward_returned"] <= optimizer["start_us"]
            # rank 0 waits at the end of backward for rank 1's late buckets; that wait is not compute
            if rank == 0:
                assert max(iv["wait_us"] for iv in buckets) > 0
    # the same reductions on both ranks, in the same order
    seqs = {rank: [(iv["group"], iv["seq"]) for s in (0, 1) for iv in records[(rank, s)]["intervals"]
                   if iv["kind"] == "comm"] for rank in (0, 1)}  # fmt: skip
    assert seqs[0] == seqs[1]


def _late_tracker_job(rank: int, world: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)  # one 144-byte bucket
    ddp = DDP(model)  # wrapped before the tracker starts ...
    x = torch.full((3, 8), float(rank + 1))
    ddp(x).sum().backward()  # ... and already through one iteration
    python_hooked = DDP(nn.Linear(8, 2))  # 18 floats, a hook of the user's: its collectives leave from Python
    python_hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    builtin_hooked = DDP(nn.Linear(8, 3))  # 27 floats, a builtin hook: its all-reduce leaves from C++
    builtin_hooked._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    tracker = sdk.tracker_from_env()
    hello = tracker.counters().as_dict()
    with tracker.step(0):
        with tracker.phase("forward"):
            loss = ddp(x).sum() + python_hooked(x).sum() + builtin_hooked(x).sum()
        with tracker.phase("backward"):
            loss.backward()
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"hello": hello, "counters": counters}


@pytest.mark.slow
def test_ddp_wrapped_before_the_tracker_started_is_captured_and_a_user_hook_is_reported(fork_job) -> None:
    job = fork_job(_late_tracker_job, 2, env={"MESHSCOPE_LAYOUT": "dp=2"})
    for result in job.results:
        # the two models with hooks of their own, known from the start: their reducer's wait cannot be timed
        assert result["hello"]["uncaptured_ddp"] == result["counters"]["uncaptured_ddp"] == 2
        assert result["counters"]["hook_errors"] == 0
    records = read_records(job.records_path)
    comm = {r.rank: sorted(iv.size_bytes for iv in r.intervals if iv.axis == "dp") for r in records}
    # the model hooked late and the user's Python hook; the builtin hook's all-reduce is invisible
    assert comm[0] == comm[1] == [18 * F32, 36 * F32]
    late = [iv for r in records for iv in r.intervals if iv.size_bytes == 36 * F32]
    assert all(iv.op == "all_reduce" for iv in late)


def _early_tracker_job(rank: int, world: int) -> dict[str, object]:
    tracker = sdk.tracker_from_env()  # before init_process_group: no group exists yet
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pair = dist.new_group([0, 1])
    tracker.register_groups({"tp": pair})
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(8, 4))
    x = torch.full((3, 8), float(rank + 1))
    with tracker.step(0):
        with tracker.phase("forward"):
            y = torch.ones(4)
            dist.all_reduce(y, group=pair)
            loss = ddp(x).sum()
        with tracker.phase("backward"):
            loss.backward()
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters, "sum": y[0].item()}


@pytest.mark.slow
def test_a_tracker_started_before_init_process_group_sees_the_groups_created_later(fork_job) -> None:
    job = fork_job(_early_tracker_job, 2, env={"MESHSCOPE_LAYOUT": "dp=2"}, init=False)
    assert [r["sum"] for r in job.results] == [2.0, 2.0]
    assert all(r["counters"]["hook_errors"] == r["counters"]["uncaptured_ddp"] == 0 for r in job.results)
    records = read_records(job.records_path)
    comm = {
        r.rank: [(str(iv.axis), str(iv.op), iv.size_bytes, iv.group) for iv in r.intervals if iv.axis] for r in records
    }
    assert comm[0] == comm[1] == [("tp", "all_reduce", 4 * F32, "tp:0"), ("dp", "all_reduce", 36 * F32, "dp:0")]


def _rank_given_to_the_group_job(rank: int, world: int) -> dict[str, object]:
    tracker = sdk.tracker_from_env()  # the environment says RANK=0 of 1 on every rank (mp.spawn, SLURM)
    dist.init_process_group("gloo", rank=rank, world_size=world)  # the script knows better
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(8, 4))
    for step in range(2):
        with tracker.step(step):
            with tracker.phase("forward"):
                loss = ddp(torch.full((3, 8), float(rank + 1))).sum()
            with tracker.phase("backward"):
                loss.backward()
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters}


@pytest.mark.slow
def test_rank_and_world_size_come_from_the_process_group_when_the_environment_says_otherwise(fork_job) -> None:
    # Before: every rank recorded itself as rank 0 of 1 (its environment), and the run's records collided.
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MESHSCOPE_LAYOUT": "dp=1"}
    job = fork_job(_rank_given_to_the_group_job, 2, env=env, init=False)
    assert all(r["counters"]["hook_errors"] == 0 for r in job.results)
    records = read_records(job.records_path)
    assert sorted((r.rank, r.step) for r in records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in records:  # the layout for 1 rank is dropped: each rank is dp = rank of the world (dp=2)
        assert (r.coord.dp, r.coord.tp, r.coord.pp) == (r.rank, 0, 0)
        assert [(str(iv.axis), iv.group, iv.group_size) for iv in r.intervals if iv.axis] == [("dp", "dp:0", 2)]


def _compiled_collective_job(rank: int, world: int) -> dict[str, object]:
    import torch._dynamo  # noqa: PLC0415

    tracker = sdk.tracker_from_env()

    def reduce(x: torch.Tensor) -> torch.Tensor:  # a functional collective inside compiled code (DTensor's road)
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

    torch._dynamo.reset()
    compiled = torch.compile(reduce, backend="eager", fullgraph=True)  # a graph break raises
    with tracker.step(0):
        out = compiled(torch.full((4,), float(rank + 1)))
        eager = reduce(torch.full((4,), float(rank + 1)))
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"out": out.tolist(), "eager": eager.tolist(), "counters": counters}


@pytest.mark.slow
def test_a_functional_collective_inside_compiled_code_is_traced_whole(fork_job) -> None:
    job = fork_job(_compiled_collective_job, 2, env={"MESHSCOPE_LAYOUT": "dp=2"})
    for result in job.results:
        assert result["out"] == result["eager"] == [7.0] * 4  # 2 * (1 + 2) + 1
        assert result["counters"]["hook_errors"] == 0
    for record in read_records(job.records_path):
        # both calls are captured: the eager one, and the compiled graph's, which the "eager" backend runs through
        # torch.ops._c10d_functional (tracing put the packet in the graph; running it is no longer tracing)
        assert [(str(iv.axis), str(iv.op)) for iv in record.intervals if iv.axis] == [("dp", "all_reduce")] * 2


def _chained_functional_job(rank: int, world: int) -> dict[str, object]:
    tracker = sdk.tracker_from_env()
    outs = []
    for step in range(2):
        with tracker.step(step):
            first = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)  # an AsyncCollectiveTensor, unwaited
            second = funcol.all_reduce(first, "sum", dist.group.WORLD)  # its dispatch waits, then calls the op again
            outs.append((second * 1).tolist())
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"outs": outs, "counters": counters}


@pytest.mark.slow
def test_a_collective_on_an_unwaited_result_is_recorded_once(fork_job) -> None:
    # AsyncCollectiveTensor's dispatch waits for its input, then calls the op again by its overload, which the SDK
    # times for compiled code: one all-reduce was recorded twice (three a step instead of two).
    job = fork_job(_chained_functional_job, 2, env={"MESHSCOPE_LAYOUT": "dp=2"})
    for result in job.results:
        assert result["outs"] == [[4.0] * 4] * 2
        assert result["counters"]["hook_errors"] == result["counters"]["incomplete_ops"] == 0
    for record in read_records(job.records_path):
        ops = [(str(iv.op), iv.seq) for iv in record.intervals if iv.axis]
        assert ops == [("all_reduce", 2 * record.step), ("all_reduce", 2 * record.step + 1)], ops


def _compiled_block_job(rank: int, world: int) -> dict[str, object]:
    import os  # noqa: PLC0415

    import torch._dynamo  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: N812, PLC0415

    tracker = sdk.tracker_from_env()

    def block(x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # what a compiled tensor-parallel block holds: a functional collective and fused attention
        y = funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1
        return y, F.scaled_dot_product_attention(q, q, q, is_causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=os.environ["BACKEND"], fullgraph=True)
    torch.manual_seed(0)
    q = torch.randn(2, 4, 32, 8, requires_grad=True)
    x = torch.full((4,), float(rank + 1))
    outs = []
    for step in range(3):
        with tracker.step(step):
            y, a = compiled(x, q)
            a.sum().backward()
        outs.append((y.tolist(), a.detach().clone()))
    y_eager, a_eager = block(x, q)  # outside any step: recorded nowhere
    counters = tracker.counters().as_dict()
    tracker.close()
    return {
        "same": all(y == y_eager.tolist() and torch.allclose(a, a_eager) for y, a in outs),
        "y": outs[-1][0],
        "counters": counters,
    }


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_block_has_its_collective_and_attention_captured(fork_job, tmp_path, backend: str) -> None:
    # AOTAutograd's graphs and inductor's code call ops by overload (torch.ops._c10d_functional.all_reduce_.default):
    # before, those calls were not captured, and the fake tensors AOTAutograd traces with reached the records (the
    # tracker's close then lost every record of the run). A fresh inductor cache: the compile runs every time.
    env = {"MESHSCOPE_LAYOUT": "dp=2", "BACKEND": backend, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    job = fork_job(_compiled_block_job, 2, env=env, timeout_s=240.0)
    for result in job.results:
        assert result["same"]
        assert result["y"] == [7.0] * 4  # 2 * (1 + 2) + 1
        counters = result["counters"]
        assert counters["hook_errors"] == counters["incomplete_ops"] == 0
        assert counters["compiled_graphs"] >= 1
    records = read_records(job.records_path)
    assert sorted((r.rank, r.step) for r in records) == [(rank, step) for rank in (0, 1) for step in range(3)]
    for record in records:
        # one all-reduce a step, the compiled one, numbered alike on both ranks (nothing the compile ran counted)
        assert [(str(iv.axis), str(iv.op), iv.seq) for iv in record.intervals if iv.axis] == [
            ("dp", "all_reduce", record.step)
        ]
        assert record.stats.attention_us is not None
        assert record.stats.attention_us > 0  # the fused kernel's forward and backward, both compiled


def _fsdp_dtensor_before_tracker_job(rank: int, world: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    fully_shard(model, mesh=mesh)  # FSDP2 and a DTensor, both before the tracker starts
    sharded = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    tracker = sdk.tracker_from_env()
    x = torch.full((3, 8), float(rank + 1))
    with tracker.step(0):
        with tracker.phase("forward"):
            whole = sharded.redistribute(mesh, [Replicate()]).to_local()  # a functional all-gather
            loss = model(x).sum()
        with tracker.phase("backward"):
            loss.backward()
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters, "whole": whole.sum().item()}


@pytest.mark.slow
def test_fsdp2_and_dtensor_set_up_before_the_tracker_are_captured(fork_job) -> None:
    job = fork_job(_fsdp_dtensor_before_tracker_job, 2, env={"MESHSCOPE_LAYOUT": "dp=2"})
    assert [r["whole"] for r in job.results] == [28.0, 28.0]
    assert all(r["counters"]["hook_errors"] == 0 for r in job.results)
    records = read_records(job.records_path)
    for rec in records:
        ops = [(str(iv.axis), str(iv.op)) for iv in rec.intervals if iv.axis]
        assert ops[0] == ("dp", "all_gather")  # the DTensor's redistribution (functional road)
        assert ops.count(("dp", "all_gather")) >= 2  # ... and FSDP2's parameter gathers
        assert ("dp", "reduce_scatter") in ops  # FSDP2's gradient reduction


def _hybrid_shard_job(rank: int, world: int) -> dict[str, object]:
    # HSDP as PyTorch's FSDP2 writes it: fully_shard over a 2-D mesh, parameters sharded over "shard" (2 ranks) and
    # replicated over "replicate" (2 ranks). Neither dim names an axis and neither group is the layout's dp group
    # (4 ranks): both are parts of it.
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    torch.manual_seed(0)
    tracker = sdk.tracker_from_env()
    names = tuple(os.environ["HSDP_DIMS"].split(","))
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=names)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.full((4, 16), float(rank + 1))
    for step in range(3):
        with tracker.step(step):
            with tracker.phase("forward"):
                loss = model(x).square().mean()
            with tracker.phase("backward"):
                loss.backward()
            with tracker.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters}


@pytest.mark.slow
@pytest.mark.parametrize("dims", ["replicate,shard", "rows,cols"], ids=["fsdp2-names", "any-names"])
def test_hybrid_sharding_groups_are_parts_of_the_dp_group(fork_job, dims: str) -> None:
    # FSDP2's own names say dp; any other names leave it to the layout: both groups lie inside its dp group
    env = {"MESHSCOPE_LAYOUT": "dp=4", "HSDP_DIMS": dims}
    job = fork_job(_hybrid_shard_job, 4, env=env, every_step=("comm",))
    outer, inner = dims.split(",")
    for result in job.results:
        assert result["counters"]["hook_errors"] == 0
        assert result["counters"]["unattributed_ops"] == 0  # before: every collective, and dp read zero
    records = read_lines(job.records_path)
    assert len(records) == 12
    shard_of = {r: f"{inner}:{r - r % 2}" for r in range(4)}  # mesh rows: ranks {0, 1} and {2, 3}
    replicate_of = {r: f"{outer}:{r % 2}" for r in range(4)}  # columns: {0, 2} and {1, 3}
    by_group: dict[tuple[str, int], list[tuple[int, str, int]]] = defaultdict(list)
    for rec in records:
        comm = [iv for iv in rec["intervals"] if iv["kind"] == "comm"]
        rank = rec["rank"]
        assert {iv["axis"] for iv in comm} == {"dp"}
        assert {iv["group_size"] for iv in comm} == {2}
        ops = {(iv["group"], iv["op"]) for iv in comm}
        # parameters gathered and gradients reduce-scattered in the shard group, then all-reduced across replicas
        assert ops == {
            (shard_of[rank], "all_gather"),
            (shard_of[rank], "reduce_scatter"),
            (replicate_of[rank], "all_reduce"),
        }, rank
        for iv in comm:
            by_group[(iv["group"], rec["step"])].append((rank, iv["op"], iv["seq"]))
    # both members of each group record the same operations with the same sequence numbers: the join holds
    for (group, _step), entries in by_group.items():
        members = {rank for rank, _, _ in entries}
        assert len(members) == 2, group
        per_rank = [sorted((seq, op) for r, op, seq in entries if r == m) for m in sorted(members)]
        assert per_rank[0] == per_rank[1], group


def _background_job(rank: int, world: int) -> dict[str, object]:
    # A logging thread all-reduces on a group of its own while the step thread computes (sleeps 60 ms in forward),
    # and DCP's asynchronous save writes and coordinates on its own thread: neither blocks the step.
    import tempfile  # noqa: PLC0415
    import threading  # noqa: PLC0415

    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    torch.manual_seed(0)
    tracker = sdk.tracker_from_env()
    side = dist.new_group(backend="gloo")  # the world's ranks: in a dp=2 job, a dp group by its members
    writer = dist.new_group(backend="gloo")  # the checkpoint writer's own (one group, one thread at a time)
    model = DDP(nn.Linear(16, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.full((4, 16), float(rank + 1))
    root = tempfile.mkdtemp(prefix="ms-dcp-") if rank == 0 else ""
    holder = [root]
    dist.broadcast_object_list(holder, src=0)
    future = None
    for step in range(3):
        with tracker.step(step):
            logger = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1024), group=side))
            with tracker.phase("forward"):
                logger.start()
                time.sleep(0.06)  # the step thread computes while the other thread's all-reduce runs
                loss = model(x).square().mean()
            logger.join()
            with tracker.phase("backward"):
                loss.backward()
            with tracker.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
            if future is not None:
                future.result()
            future = dcp.async_save(
                {"model": model.state_dict()}, checkpoint_id=f"{holder[0]}/s{step}", process_group=writer
            )
    future.result()
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters}


@pytest.mark.slow
def test_collectives_of_background_threads_are_counted_not_recorded(fork_job) -> None:
    job = fork_job(_background_job, 2, env={"MESHSCOPE_LAYOUT": "dp=2"}, every_step=("comm", "optimizer"))
    records = read_lines(job.records_path)
    assert len(records) == 6
    for rec in records:
        comm = [iv for iv in rec["intervals"] if iv["kind"] == "comm"]
        assert {(iv["group"], iv["op"]) for iv in comm} == {("dp:0", "all_reduce")}  # DDP's bucket only
        forward = sum(iv["end_us"] - iv["start_us"] for iv in rec["intervals"] if iv.get("phase") == "forward")
        assert forward >= 55_000, rec  # not cut by the other thread's wait
    seqs = {r["rank"]: sorted((r["step"], iv["seq"]) for iv in r["intervals"] if iv["kind"] == "comm") for r in records}
    assert seqs[0] == seqs[1]  # the step thread's reductions still join across ranks
    for result in job.results:
        assert result["counters"]["hook_errors"] == 0
        assert result["counters"]["background_ops"] >= 3  # the logging thread's three, and the saves' own


def _subgroup_job(rank: int, world: int) -> dict[str, object]:
    tracker = sdk.tracker_from_env()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # unnamed: "undefined" in torch's words
    mine = pairs[rank // 2]
    for step in range(2):
        with tracker.step(step), tracker.phase("forward"):
            dist.all_reduce(torch.ones(8), group=mine)
            dist.all_reduce(torch.ones(8))  # the world: dp, as the job implies
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["", "dp=4"], ids=["implied", "given"])
def test_an_unnamed_part_of_dp_is_dp_only_under_a_layout_that_was_given(fork_job, layout: str) -> None:
    # Without a layout, dp over the world is an assumption (the job might be tp x dp): a pair of ranks may be a tp
    # group, so it stays unattributed. Given dp=4, a pair can only be a part of the dp group.
    job = fork_job(_subgroup_job, 4, env={"MESHSCOPE_LAYOUT": layout} if layout else {})
    groups = {iv["group"] for rec in read_lines(job.records_path) for iv in rec["intervals"] if iv["kind"] == "comm"}
    if layout:
        assert groups == {"dp:0", "dp_sub2s1:0", "dp_sub2s1:2"}
        assert all(r["counters"]["unattributed_ops"] == 0 for r in job.results)
    else:
        assert groups == {"dp:0"}
        assert all(r["counters"]["unattributed_ops"] == 2 for r in job.results)


def _namesakes_job(rank: int, world: int) -> dict[str, object]:
    tracker = sdk.tracker_from_env()
    logging_group = dist.new_group(list(range(world)))  # the world's ranks again (DeepSpeed's dp group, a logger's)
    calls = [(None, 8), (logging_group, 4)]  # the world's all-reduces of 8 floats, the new group's of 4
    if os.environ["USE_FIRST"] == "new":
        calls.reverse()
    for step in range(2):
        with tracker.step(step), tracker.phase("forward"):
            for group, n in calls:
                dist.all_reduce(torch.ones(n), group=group)
    tracker.close()
    return {"name": str(logging_group.group_name)}


@pytest.mark.slow
@pytest.mark.parametrize("used_first", ["new", "world"])
def test_two_groups_of_the_same_ranks_are_told_apart_by_creation_not_first_use(fork_job, used_first: str) -> None:
    # The world group was created first: it is dp:0 and the later group of the same ranks dp:0~<its name>, whichever
    # the script uses first (before: the first used took dp:0, so the ids changed with the order of the calls).
    job = fork_job(_namesakes_job, 2, env={"USE_FIRST": used_first})
    later = job.results[0]["name"]
    assert all(r["name"] == later for r in job.results)
    sizes = {
        (rec["rank"], iv["group"], iv["bytes"])
        for rec in read_lines(job.records_path)
        for iv in rec["intervals"]
        if iv["kind"] == "comm"
    }
    assert sizes == {(r, g, b) for r in (0, 1) for g, b in (("dp:0", 32), (f"dp:0~{later}", 16))}


def _meshscope_log() -> list[str]:
    """Every message meshscope logs from now on, in this (forked) rank."""
    import logging  # noqa: PLC0415

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("meshscope").addHandler(handler)
    return said


def _mesh_in_its_own_order_job(rank: int, world: int) -> dict[str, object]:
    # init_device_mesh("cpu", (dp, pp), ("dp", "pp")): the mesh's last dim varies fastest, so ranks 0 and 1 are the
    # two pipeline stages of replica 0, where the layout's default order (Megatron's, dp before pp) puts ranks 0 and
    # 1 in one stage.
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    said = _meshscope_log()
    tracker = sdk.tracker_from_env()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "pp"))
    if os.environ.get("REGISTER_MESH") == "1":
        tracker.register_mesh(mesh)
    dp_group, pp_rank = mesh.get_group("dp"), mesh.get_local_rank("pp")
    peer = int(mesh.mesh[mesh.get_local_rank("dp"), 1 - pp_rank])
    x = torch.ones(8)
    for step in range(2):
        with tracker.step(step):
            if pp_rank == 0:
                dist.send(x, peer)
            else:
                dist.recv(x, peer)
            dist.all_reduce(x, group=dp_group)
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters, "said": [m for m in said if "DeviceMesh" in m], "pp": pp_rank}


def test_a_registered_mesh_in_another_rank_order_than_the_layout_gives_the_records_its_coordinates(fork_job) -> None:
    # Before: every rank's record carried the layout's coordinates (rank 1 at pp=0 while it ran stage 1), the
    # records' p2p and dp groups contradicted them, and nothing said so.
    job = fork_job(_mesh_in_its_own_order_job, 4, env={"MESHSCOPE_LAYOUT": "pp=2,dp=2", "REGISTER_MESH": "1"})
    for rank, result in enumerate(job.results):
        assert result["counters"]["hook_errors"] == 0
        assert result["pp"] == rank % 2
    said = [m for result in job.results for m in result["said"]]
    assert said  # each rank the layout misplaces says so once
    assert (
        "meshscope: the registered DeviceMesh (dims dp, pp) puts rank 1 at dp=0, pp=1, where the layout "
        "dp=2,tp=1,pp=2,cp=1,ep=1 puts it at dp=1, pp=0: the records take the mesh's rank order; give --layout "
        "dp=2,tp=1,pp=2,cp=1,ep=1,order=pp-dp-tp-cp-ep to state it"
    ) in said
    records = read_lines(job.records_path)
    assert len(records) == 8
    for rec in records:
        assert (rec["coord"]["dp"], rec["coord"]["pp"]) == (rec["rank"] // 2, rec["rank"] % 2)
        comm = {(iv["axis"], iv["op"]) for iv in rec["intervals"] if iv.get("axis")}
        assert ("dp", "all_reduce") in comm
        assert ("pp", "send" if rec["rank"] % 2 == 0 else "recv") in comm, comm
    assert "layout_order_mismatch" not in {n.code for n in analyze(read_table(job.records_path)).partial_data}


def test_a_registered_mesh_is_the_layout_where_the_launcher_only_assumed_one(fork_job) -> None:
    # meshscope run without --layout passes dp=NPROC as a default (MESHSCOPE_LAYOUT_IMPLIED=1). Before: every rank
    # warned that the mesh placed it elsewhere than "the layout dp=4" and told the user to fix an order= of a layout
    # they never gave, and the mesh's dp group was recorded as dp:0~1 (its id clashed with the world group's).
    env = {"MESHSCOPE_LAYOUT": "dp=4", "MESHSCOPE_LAYOUT_IMPLIED": "1", "REGISTER_MESH": "1"}
    job = fork_job(_mesh_in_its_own_order_job, 4, env=env)
    assert all(result["counters"]["hook_errors"] == 0 for result in job.results)
    assert [m for result in job.results for m in result["said"]] == []  # nothing to fix
    records = read_lines(job.records_path)
    assert len(records) == 8
    for rec in records:
        assert (rec["coord"]["dp"], rec["coord"]["pp"]) == (rec["rank"] // 2, rec["rank"] % 2)
        groups = {(iv["axis"], iv["op"], iv["group"]) for iv in rec["intervals"] if iv.get("axis")}
        dp = f"dp:{rec['rank'] % 2}"  # the mesh's dp groups: {0, 2} and {1, 3}
        peer = rec["rank"] + 1 if rec["rank"] % 2 == 0 else rec["rank"] - 1
        src, dst = (rec["rank"], peer) if rec["rank"] % 2 == 0 else (peer, rec["rank"])
        op = "send" if rec["rank"] % 2 == 0 else "recv"
        assert groups == {("dp", "all_reduce", dp), ("pp", op, f"pp:{src}-{dst}")}, groups
    assert "layout_order_mismatch" not in {n.code for n in analyze(read_table(job.records_path)).partial_data}


def _expert_mesh_job(rank: int, world: int) -> dict[str, object]:
    # An MoE script's mesh: its dp dim is the expert-data-parallel one (4 ranks as 2 x 2, ep inside dp).
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    said = _meshscope_log()
    tracker = sdk.tracker_from_env()
    dims = tuple(os.environ["MESH_DIMS"].split(","))
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=dims)
    tracker.register_mesh(mesh)
    for step in range(2):
        with tracker.step(step):
            dist.all_to_all_single(torch.empty(8), torch.ones(8), group=mesh.get_group("ep"))
            dist.all_reduce(torch.ones(4), group=mesh.get_group("dp"))
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters, "said": [m for m in said if "DeviceMesh" in m]}


@pytest.mark.parametrize(
    ("dims", "layout", "misplaced"),
    [
        ("dp,ep", "dp=4,ep=2", False),  # the layout's own carving: ep varies fastest inside dp
        ("dp,ep", "", False),
        ("ep,dp", "dp=4,ep=2", True),  # ep groups {0, 2}, {1, 3}: not the layout's {0, 1}, {2, 3}
    ],
    ids=["layout", "no-layout", "other-order"],
)
def test_an_expert_mesh_dp_dim_is_the_expert_data_parallel_one(
    fork_job, dims: str, layout: str, misplaced: bool
) -> None:
    # Before: under --layout dp=4,ep=2 every rank warned that the mesh placed it elsewhere and told to give an
    # order= that no layout has, and the records took the mesh's dp (0 or 1) as the dense dp coordinate.
    env = {"MESH_DIMS": dims} | ({"MESHSCOPE_LAYOUT": layout} if layout else {})
    job = fork_job(_expert_mesh_job, 4, env=env)
    said = [m for result in job.results for m in result["said"]]
    for result in job.results:
        assert result["counters"]["hook_errors"] == 0
    records = read_lines(job.records_path)
    assert len(records) == 8
    comm = {(rec["rank"], iv["axis"], iv["op"]) for rec in records for iv in rec["intervals"] if iv.get("axis")}
    assert comm == {(r, a, op) for r in range(4) for a, op in (("ep", "all_to_all"), ("dp", "all_reduce"))}
    ep_inside = dims == "dp,ep"  # the mesh's ep groups: {0, 1} and {2, 3}; else {0, 2} and {1, 3}
    for rec in records:
        edp, ep = (rec["rank"] // 2, rec["rank"] % 2) if ep_inside else (rec["rank"] % 2, rec["rank"] // 2)
        assert (rec["coord"]["dp"], rec["coord"]["ep"]) == (edp * 2 + ep, ep)
    if misplaced:
        assert (
            "meshscope: the registered DeviceMesh (dims ep, dp) groups ranks [0, 2] along ep, where the layout "
            "dp=4,tp=1,pp=1,cp=1,ep=2 groups [0, 1]: the records take the mesh's coordinates of its axes"
        ) in said
    else:
        assert said == []


def test_a_mesh_in_another_rank_order_than_the_layout_is_told_by_the_records_traffic(fork_job) -> None:
    # The same script without register_mesh: the mesh's groups carry their dim names (the all-reduce is dp), but a
    # send on the default group can only follow the layout, which puts ranks 0 and 1 in one stage: the pipeline's
    # sends land on dp. The analysis says so instead of reading it as it is.
    job = fork_job(_mesh_in_its_own_order_job, 4, env={"MESHSCOPE_LAYOUT": "pp=2,dp=2", "REGISTER_MESH": "0"})
    records = read_lines(job.records_path)
    assert {(iv["axis"], iv["op"]) for rec in records for iv in rec["intervals"] if iv.get("axis")} == {
        ("dp", "send"),
        ("dp", "recv"),
        ("dp", "all_reduce"),
    }
    analysis = analyze(read_table(job.records_path))
    (note,) = [n for n in analysis.partial_data if n.code == "layout_order_mismatch"]
    assert note.count == 8  # one send or receive per rank-step
    assert "--layout ...,order=pp-dp-tp-cp-ep for a (dp, pp) mesh" in note.message


def _moe_job(rank: int, world: int) -> dict[str, object]:
    # An MoE layer as it is hand-written (DeepSpeed-MoE, Megatron's all-to-all dispatcher): the counts per expert
    # exchanged first, then each rank's tokens sent to the rank of their expert, the experts' work, the outputs sent
    # back; the dense gradients all-reduced over dp. One expert per rank; the expert's work sleeps 40 µs a token (a
    # device doing it: off the CPU, so its time does not depend on what else runs on the machine).
    tracker = sdk.tracker_from_env()
    ep_group = None  # the world group: dp's and ep's alike (ep=4 carved out of dp=4), registered as neither
    if os.environ.get("REGISTER_EP", "1") == "1":
        ep_group = dist.new_group(list(range(world)))
        tracker.register_groups({"ep": ep_group})
    elif os.environ["REGISTER_EP"] == "world":  # the world group registered as the ep group it also is
        tracker.register_groups({"ep": dist.group.WORLD})
    hot = int(os.environ["HOT_RANK"])
    tokens, hidden = 256, 16
    generator = torch.Generator().manual_seed(rank)
    for step in range(8):
        with tracker.step(step):
            tracker.data_stats(tokens=tokens)
            with tracker.phase("forward"):
                x = torch.randn(tokens, hidden, generator=generator)
                expert = torch.randint(0, world, (tokens,), generator=generator)
                if hot >= 0:  # the router favours one expert: 70 % of every rank's tokens go to it
                    expert[: int(0.7 * tokens)] = hot
                order = torch.argsort(expert)
                send_counts = torch.bincount(expert, minlength=world)
                recv_counts = torch.empty_like(send_counts)
                dist.all_to_all_single(recv_counts, send_counts, group=ep_group)
                received = torch.empty(int(recv_counts.sum()), hidden)
                dist.all_to_all_single(received, x[order], recv_counts.tolist(), send_counts.tolist(), group=ep_group)
                time.sleep(40e-6 * received.shape[0] + 0.004)  # the expert's work, and the dense layers'
                back = torch.empty(tokens, hidden)
                dist.all_to_all_single(back, received * 2, send_counts.tolist(), recv_counts.tolist(), group=ep_group)
            with tracker.phase("backward"):
                dist.all_reduce(torch.ones(1024))  # the dense gradients, over dp (the world)
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters}


@pytest.mark.slow
@pytest.mark.parametrize("hot", [3, -1], ids=["hot-expert", "balanced"])
def test_a_hot_expert_is_an_expert_imbalance_of_its_rank_and_a_balanced_router_is_silent(fork_job, hot: int) -> None:
    # Before: the hot expert's rank was "slow in compute ... with the same work (256 tokens)", a straggler, and with
    # half the ranks hot (ep 2 x edp 2) nothing at all. Each rank sends its own 256 tokens out and its expert's
    # outputs back: rank 3, with 70 % of every rank's tokens, sends back 4 x 179 + 19 of them, its peers ~19 each.
    job = fork_job(_moe_job, 4, env={"MESHSCOPE_LAYOUT": "dp=4,ep=4", "HOT_RANK": str(hot)})
    assert all(r["counters"]["hook_errors"] == 0 for r in job.results)
    records = read_lines(job.records_path)
    ops = {(iv["axis"], iv["op"]) for rec in records for iv in rec["intervals"] if iv.get("axis")}
    assert ops == {("ep", "all_to_all"), ("dp", "all_reduce")}
    analysis = analyze(read_table(job.records_path, skip_steps=1))
    if hot < 0:
        assert analysis.findings == ()
        return
    (finding,) = analysis.findings
    assert finding.code == "expert-imbalance"
    assert [s.rank for s in finding.suspects] == [hot]
    assert "256 tokens like its peers" in finding.message
    assert "step time follows the router" in finding.message
    assert finding.evidence["expert_all_to_all_bytes"] > 2 * finding.evidence["median_expert_all_to_all_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("register", ["0", "world"], ids=["unregistered", "registered-as-ep"])
def test_all_to_alls_on_a_group_that_is_both_dp_and_ep_are_the_expert_dispatch(fork_job, register: str) -> None:
    # dp=4,ep=4 on 4 ranks: the world group is the dp group and the ep group. Its all-reduce is the dense gradients'
    # (dp) and its all-to-alls the experts' tokens (ep); before, unregistered, all of it was dp, and a hot expert's
    # rank was a straggler "with the same work"; registered as ep, the dense all-reduce was ep traffic.
    job = fork_job(_moe_job, 4, env={"MESHSCOPE_LAYOUT": "dp=4,ep=4", "HOT_RANK": "3", "REGISTER_EP": register})
    assert all(r["counters"]["hook_errors"] == 0 for r in job.results)
    records = read_lines(job.records_path)
    ops = {(iv["axis"], iv["op"], iv["group"]) for rec in records for iv in rec["intervals"] if iv.get("axis")}
    assert ops == {("ep", "all_to_all", "ep:0"), ("dp", "all_reduce", "dp:0")}  # a group id is one axis'
    (finding,) = analyze(read_table(job.records_path, skip_steps=1)).findings
    assert finding.code == "expert-imbalance"
    assert [s.rank for s in finding.suspects] == [3]


def _buffers_job(rank: int, world: int) -> dict[str, object]:
    # A model with a buffer (a causal mask, BatchNorm's statistics) under DDP's defaults: before every forward DDP
    # broadcasts its buffers from rank 0 (dist._broadcast_coalesced, waited for in C++). Rank 1 loads its batch 40 ms
    # late, so rank 0 waits for it there.
    tracker = sdk.tracker_from_env()
    model = nn.Linear(8, 8)
    model.register_buffer("mask", torch.ones(64))
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(6):
        with tracker.step(step):
            with tracker.phase("data"):
                time.sleep(0.04 if rank == 1 else 0.0)
            with tracker.phase("forward"):
                loss = ddp(torch.ones(4, 8)).sum()
            with tracker.phase("backward"):
                loss.backward()
            with tracker.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters}


@pytest.mark.slow
def test_ddp_buffer_broadcasts_are_dp_collectives_and_their_wait_is_not_compute(fork_job) -> None:
    # Before: the broadcast was not captured; rank 0's 40 ms wait for rank 1 in each step was forward compute and
    # the analysis named nobody (a user's nanoGPT-style script with a slow loader on one rank: "Findings: none").
    job = fork_job(_buffers_job, 2, env={"MESHSCOPE_LAYOUT": "dp=2"})
    assert all(r["counters"]["hook_errors"] == 0 for r in job.results)
    records = read_lines(job.records_path)
    for rec in records:
        casts = [iv for iv in rec["intervals"] if iv.get("op") == "broadcast"]
        assert [(iv["axis"], iv["group"], iv["bytes"]) for iv in casts] == [("dp", "dp:0", 256)], rec["intervals"]
    waited = {
        rec["step"]: iv["wait_us"]
        for rec in records
        if rec["rank"] == 0
        for iv in rec["intervals"]
        if iv.get("op") == "broadcast"
    }
    assert sorted(waited) == list(range(6))
    # rank 0 sat in it for rank 1's late batch (in step 1 DDP's rebuild of its buckets, at its second forward, syncs
    # the ranks first)
    assert all(waited[step] > 20_000 for step in range(2, 6)), waited
    analysis = analyze(read_table(job.records_path, skip_steps=2))
    first = analysis.findings[0]
    assert (first.code, [s.rank for s in first.suspects]) == ("straggler", [1])
    assert first.message.startswith("rank 1 on vm is slow in data loading: ")

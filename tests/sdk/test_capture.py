"""The SDK inside real multi-process gloo jobs: what it captures, how it attributes it, and that the job is unchanged."""

from __future__ import annotations

import copy
import time
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from meshscope import sdk
from meshscope.records import IntervalKind, read_records

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
    # the world group of a dp=2 layout is the dp group (inferred from the layout, nothing registered)
    assert comm[0] == comm[1] == [("dp", "all_reduce", (8 * 4 + 4) * F32, "dp:0", 0)]


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

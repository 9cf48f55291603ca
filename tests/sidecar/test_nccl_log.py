"""The NCCL source: line grammar, communicator registry, axis mapping, file following, and the node-0 fixtures.

Expected numbers are counted by hand from tests/data/sidecar/nccl/README.md (what each fixture file holds).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshscope.topology import ParallelLayout, Placement
from meshscope_sidecar.metrics import BY_NAME
from meshscope_sidecar.sources.nccl_comms import UNKNOWN, AxisMapper, CommRegistry
from meshscope_sidecar.sources.nccl_files import LogFollower
from meshscope_sidecar.sources.nccl_inspector import InspectorRecord, parse_inspector_line
from meshscope_sidecar.sources.nccl_lines import (
    Collective,
    CommShape,
    Fragment,
    InitLine,
    InitTimings,
    Malformed,
    MnnvlClique,
    MnnvlFabric,
    parse_line,
)
from meshscope_sidecar.sources.nccl_log import NcclLogSource

DATA = Path(__file__).parents[1] / "data" / "sidecar" / "nccl"
LAYOUT = ParallelLayout(tp=2, pp=2, dp=2)
PLACEMENT = Placement.default(8, gpus_per_node=4, nvlink_domain_gpus=4, nodes_per_network_block=2)
P = "node-0:4101:4101 [0] NCCL INFO "
MiB = 1024 * 1024


def coll(
    op="AllReduce",
    *,
    op_count="0",
    count=4,
    dtype=7,
    red=0,
    root=0,
    comm="0x5600",
    nranks=2,
    send="0x1000",
    recv="0x2000",
    stream="0x3000",
    suffix="",
):
    return (
        f"{op}: opCount {op_count} sendbuff {send} recvbuff {recv} count {count} datatype {dtype} op {red} "
        f"root {root} comm {comm} [nranks={nranks}] stream {stream}{suffix}"
    )


def table(source: NcclLogSource, metric: str) -> dict[tuple[int | None, str, str], float]:
    out = {}
    for s in source.samples():
        if s.metric == metric:
            labels = dict(s.labels)
            out[s.rank, labels["axis"], labels.get("op", "")] = s.value
    return out


def fixture_source(**kwargs) -> NcclLogSource:
    source = NcclLogSource(DATA / "logs", layout=LAYOUT, inspector_paths=DATA / "inspector", **kwargs)
    source.poll()
    return source


# ------------------------------------------------------------------------------------------ the node-0 fixtures


def expected_calls(rank: int, pp_axis: str) -> dict[tuple[str, str], tuple[int, int]]:
    """README.md's table: (axis, op) -> (calls, bytes) of one rank."""
    lost = rank == 3  # one DP AllGather cut by the proxy thread; one extra glued world AllReduce
    return {
        ("tp", "all_reduce"): (4, 4 * 8 * MiB),
        (pp_axis, "send"): (2, 2 * 2 * MiB),
        (pp_axis, "recv"): (2, 2 * 2 * MiB),
        ("dp", "reduce_scatter"): (2, 2 * 8 * MiB),
        ("dp", "all_gather"): (1, 4 * MiB) if lost else (2, 2 * 4 * MiB),
        ("world", "all_reduce"): (5, 2 * 8 + 3 * 4) if lost else (4, 2 * 8 + 2 * 4),
        ("world", "broadcast"): (1, 1024),
    }


@pytest.mark.parametrize("placement", [None, PLACEMENT], ids=["no-placement", "placement"])
def test_fixture_calls_and_bytes_per_rank_axis_op(placement):
    source = fixture_source(placement=placement)
    calls = table(source, "meshscope_nccl_collectives_total")
    sizes = table(source, "meshscope_nccl_bytes_total")
    want_calls, want_bytes = {}, {}
    for rank in range(4):
        # without a placement the PP group of ranks 0-2 fits tp, dp and pp alike; rank 3's fits only pp
        pp_axis = "pp" if placement is not None or rank == 3 else UNKNOWN
        for (axis, op), (n, size) in expected_calls(rank, pp_axis).items():
            want_calls[rank, axis, op] = n
            want_bytes[rank, axis, op] = size
    assert calls == want_calls
    assert sizes == want_bytes


def test_fixture_communicators_per_axis():
    source = fixture_source(placement=PLACEMENT)
    comms = table(source, "meshscope_nccl_communicators")
    want = {}
    for rank in range(4):
        want.update({(rank, "world", ""): 2, (rank, "tp", ""): 1, (rank, "dp", ""): 1, (rank, "pp", ""): 1})
    assert comms == want
    # the replaced temporary group still counts its calls, but is not alive
    replaced = [c for c in source.registry.communicators if not c.live]
    assert sorted(c.key[1] for c in replaced) == [4101, 4102, 4103, 4104]


def test_fixture_health_counts_what_it_could_not_read():
    source = fixture_source()
    assert source.health.up
    assert source.stats.malformed == {"coll": 1, "inspector": 2}
    assert source.stats.fragments == {"truncated": 1, "interleaved": 2, "orphan": 1}
    assert source.health.parse_errors_total == 7
    assert source.health.dropped_total == 0
    # rank 1's last line has no newline yet: kept, not counted, not lost
    assert source.registry.live(("node-0", 4102, 0x5600000B2000)).sequence == 4


def test_fixture_inspector_per_rank_axis_op():
    source = fixture_source(placement=PLACEMENT)
    calls = table(source, "meshscope_nccl_inspector_collectives_total")
    seconds = table(source, "meshscope_nccl_inspector_exec_seconds_total")
    sizes = table(source, "meshscope_nccl_inspector_bytes_total")
    # the DP hash has one member on this node and spans one node: tp and dp fit alike -> unknown
    assert calls == {
        (0, "tp", "all_reduce"): 2,
        (0, UNKNOWN, "reduce_scatter"): 1,
        (0, "pp", "send"): 1,  # nnodes 2: only the pp group spans two nodes
        (1, "tp", "all_reduce"): 2,
    }
    assert sizes[0, "tp", "all_reduce"] == 2 * 8 * MiB
    assert sizes[0, "pp", "send"] == 2 * MiB
    assert seconds[0, "tp", "all_reduce"] == pytest.approx((410 + 395) * 1e-6)
    assert seconds[1, "tp", "all_reduce"] == pytest.approx((400 + 405) * 1e-6)
    assert seconds[0, UNKNOWN, "reduce_scatter"] == pytest.approx(1250e-6)


def test_fixture_splits_link_to_parents_and_group_across_versions():
    source = fixture_source()
    reg = source.registry
    tp0 = reg.live(("node-0", 4101, 0x5600000B2000))
    tp1 = reg.live(("node-0", 4102, 0x5600000B2000))  # the same address in another process: another communicator
    assert tp0 is not tp1
    assert reg.parent_of(tp0).key == ("node-0", 4101, 0x5600000A1000)
    world_group = ("id", 0x7C1F3A9E2B4D6081)
    assert reg.group_of(tp0) == reg.group_of(tp1) == ("split", world_group, 1, 0)
    tp2 = next(c for c in reg.communicators if c.key[1] == 4103 and c.nranks == 2 and c.parent is not None)
    assert reg.group_of(tp2) == ("id", 0x708192031425364F)  # 2.22 prints a commId on splits
    # opCount stays 0 on single-node comms since 2.27: the sequence is counted, not read
    assert tp0.last_op_count == 0
    assert tp0.sequence == 4
    assert tp0.init_s == pytest.approx(0.93)


def test_ranks_come_from_the_caller_first_and_unknown_processes_are_not_exported():
    source = NcclLogSource(DATA / "logs")  # no layout: no fallback, every axis unknown
    source.poll()
    assert source.samples() == []
    assert source.stats.unmapped_calls == 4 * 17  # README: 3 + 2 x 7 calls a rank; rank 3 loses one, gains one
    source.set_rank("node-0.cluster.local", 4102, 5)
    calls = table(source, "meshscope_nccl_collectives_total")
    assert {rank for rank, _, _ in calls} == {5}
    assert calls[5, UNKNOWN, "all_reduce"] == 4 + 2 + 2  # tp, world, temporary


def test_metric_names_are_in_the_metric_list():
    source = fixture_source()
    for s in source.samples():
        spec = BY_NAME[s.metric]
        assert spec.source == "nccl_log"
        assert tuple(k for k, _ in s.labels) == spec.labels


def test_no_files_is_a_state_not_an_error(tmp_path):
    source = NcclLogSource(tmp_path / "nothing-here")
    source.poll()
    assert not source.health.up
    assert "no NCCL log file" in source.health.last_error
    source.close()
    source.close()


# ------------------------------------------------------------------------------------------ Init lines by version

INIT_LINES = {
    # NVIDIA/nccl src/init.cc at each tag
    "2.4.8": (
        "comm 0x55aa rank 1 nranks 8 cudaDev 1 nvmlDev 3 - Init COMPLETE",
        {"complete": True, "nvml_dev": 3, "bus_id": None, "comm_id": None},
    ),
    "2.12.12": (
        "comm 0x55aa rank 1 nranks 8 cudaDev 1 busId 1b000 - Init COMPLETE",
        {"complete": True, "nvml_dev": None, "bus_id": 0x1B000, "comm_id": None},
    ),
    "2.17.1": (
        "comm 0x55aa rank 1 nranks 8 cudaDev 1 busId 1b000 commId 0xfeed - Init COMPLETE",
        {"complete": True, "bus_id": 0x1B000, "comm_id": 0xFEED},
    ),
    "2.18.3": (
        "comm 0x55aa rank 1 nranks 8 cudaDev 1 nvmlDev 1 busId 1b000 commId 0xfeed - Init START",
        {"complete": False, "nvml_dev": 1, "comm_id": 0xFEED, "func": None},
    ),
    "2.21.5": (
        "ncclCommInitRank comm 0x55aa rank 1 nranks 8 cudaDev 1 nvmlDev 1 busId 1b000 commId 0xfeed - Init START",
        {"func": "ncclCommInitRank", "comm_id": 0xFEED},
    ),
    "2.22.3 split": (
        (
            "ncclCommSplit comm 0x55aa rank 1 nranks 2 cudaDev 1 nvmlDev 1 busId 1b000 parent 0x4400 color 7 "
            "key 1 commId 0xbeef - Init COMPLETE"
        ),
        {"func": "ncclCommSplit", "parent": 0x4400, "color": 7, "key": 1, "comm_id": 0xBEEF, "nranks": 2},
    ),
    "2.23.4 split": (
        (
            "ncclCommSplit comm 0x55aa rank 1 nranks 2 cudaDev 1 nvmlDev 1 busId 1b000 parent 0x4400 color 7 "
            "key 1- Init START"
        ),
        {"parent": 0x4400, "color": 7, "key": 1, "comm_id": None, "split_count": None},
    ),
    "2.27.7 split": (
        (
            "ncclCommSplit comm 0x55aa rank 1 nranks 2 cudaDev 1 nvmlDev 1 busId 1b000 parent 0x4400 "
            "splitCount 3 color 7 key 1 - Init COMPLETE"
        ),
        {"split_count": 3, "color": 7},
    ),
    "2.30 split": (
        (
            "ncclCommSplit comm 0x55aa rank 1 nranks 2 cudaDev 1 nvmlDev 1 busId 1b000 parent 0x4400 "
            "childCount 2 color 7 key 1- Init START"
        ),
        {"split_count": 2, "parent": 0x4400},
    ),
    "2.30": (
        (
            "[Rank 9] ncclCommInitRankConfig comm 0x55aa rank 1 nranks 8 cudaDev 1 nvmlDev 1 busId 1b000 "
            "commId 0xfeed - Init START"
        ),
        {"logged_rank": 9, "func": "ncclCommInitRankConfig", "comm_id": 0xFEED},
    ),
    "2.30 all": (
        "ncclCommInitAll comm 0x55aa rank 1 nranks 8 cudaDev 1 nvmlDev 1 busId 1b000 commId 0xfeed - Init COMPLETE",
        {"func": "ncclCommInitAll"},
    ),
}


@pytest.mark.parametrize("version", list(INIT_LINES), ids=list(INIT_LINES))
def test_init_line_of_every_version(version):
    text, fields = INIT_LINES[version]
    (event,) = parse_line("host-a:77:78 [5] NCCL INFO " + text)
    assert isinstance(event, InitLine)
    assert (event.host, event.pid, event.tid, event.comm, event.rank, event.cuda_dev) == (
        "host-a",
        77,
        78,
        0x55AA,
        1,
        1,
    )
    for name, value in fields.items():
        assert getattr(event, name) == value, name


def test_comm_shape_timings_and_mnnvl_lines():
    (shape,) = parse_line(P + "comm 0x5600 rank 3 nRanks 8 nNodes 2 localRanks 4 localRank 3 MNNVL 1")
    assert shape == CommShape(
        host="node-0",
        pid=4101,
        tid=4101,
        comm=0x5600,
        rank=3,
        nranks=8,
        n_nodes=2,
        local_ranks=4,
        local_rank=3,
        mnnvl=1,
    )
    old = "Init timings: rank 0 nranks 8 total 0.91 (kernels 0.20, bootstrap 0.40, rest 0.31)"
    new = "Init timings - ncclCommSplit: rank 0 nranks 8 total 1.50 (kernels 0.20, alloc 0.01, rest 1.29)"
    (t_old,), (t_new,) = parse_line(P + old), parse_line(P + new)
    assert isinstance(t_old, InitTimings)
    assert (t_old.func, t_old.total_s, t_old.parts_s[1]) == (None, 0.91, ("bootstrap", 0.40))
    assert (t_new.func, t_new.total_s, dict(t_new.parts_s)["alloc"]) == ("ncclCommSplit", 1.5, 0.01)
    (fabric,) = parse_line(P + "MNNVL busId 0x1b000 fabric UUID 9c1f.00ab cliqueId 0x7 state 3 healthMask 0x0")
    assert isinstance(fabric, MnnvlFabric)
    assert fabric.nvlink_domain == ("9c1f.ab", 7)
    (none,) = parse_line(P + "MNNVL busId 0x1b000 fabric UUID 0.0 cliqueId 0x0 state 3 healthMask 0x0")
    assert none.nvlink_domain is None  # a machine without multi-node NVLink
    (c_old,), (c_new,) = (
        parse_line(P + "MNNVL 1 cliqueId 7 cliqueSize 4 cliqueRank 2 "),
        parse_line(P + "MNNVL 1 cliqueId a cliqueSize 4 cliqueRank 2 nvlDomainSize 72"),
    )
    assert isinstance(c_old, MnnvlClique)
    assert (c_old.clique_id, c_old.nvl_domain_size, c_new.clique_id, c_new.nvl_domain_size) == (7, None, 10, 72)


# ------------------------------------------------------------------------------------------ COLL lines and pitfalls


@pytest.mark.parametrize(
    ("op", "dtype", "count", "label", "size"),
    [
        ("AllReduce", 9, 1000, "all_reduce", 2000),
        ("AllGather", 7, 1000, "all_gather", 4000),  # per-rank send count
        ("ReduceScatter", 8, 10, "reduce_scatter", 80),  # per-rank receive count
        ("Broadcast", 0, 3, "broadcast", 3),
        ("Send", 11, 5, "send", 5),
        ("Recv", 4, 5, "recv", 40),
        ("AlltoAll", 2, 5, "all_to_all", 20),
        ("PutSignal", 6, 5, "other", 10),
    ],
)
def test_collective_op_label_and_message_bytes(op, dtype, count, label, size):
    (event,) = parse_line(P + coll(op, count=count, dtype=dtype))
    assert isinstance(event, Collective)
    assert (event.op_name, event.op, event.message_bytes) == (op, label, size)


def test_collective_fields_nil_buffers_and_rccl_suffix():
    line = P + coll(
        "Send",
        op_count="1f",
        count=7,
        dtype=9,
        root=3,
        comm="0x7fab",
        nranks=4,
        send="(nil)",
        stream="(nil)",
        suffix=" task 12 globalrank 13",
    )
    (e,) = parse_line(line)
    assert e == Collective(
        host="node-0",
        pid=4101,
        tid=4101,
        op_name="Send",
        op="send",
        op_count=0x1F,
        sendbuff=None,
        recvbuff=0x2000,
        element_count=7,
        datatype=9,
        reduction=0,
        root=3,
        comm=0x7FAB,
        nranks=4,
        stream=None,
        task=12,
        global_rank=13,
    )


def test_unknown_datatype_counts_the_call_without_bytes():
    (event,) = parse_line(P + coll(dtype=12))
    assert event.message_bytes is None
    reg = CommRegistry()
    reg.apply(event)
    (comm,) = reg.communicators
    assert comm.ops["all_reduce"].calls == 1
    assert comm.ops["all_reduce"].message_bytes == 0
    assert comm.ops["all_reduce"].unknown_datatype_calls == 1


@pytest.mark.parametrize(
    "front",
    [
        "",
        "(RayTrainWorker pid=4101, ip=10.0.0.11) ",
        "pod-7: ",
        "[1,0]<stdout>:",
        "[default0]:",
        "[4101] ",
        "node-0: ",
        "2026-07-01T10:00:00.123456789Z stdout F ",
        "[2026-07-01 10:00:00] ",  # NCCL's own timestamp (2.23+)
        "\x1b[0m\rsome tqdm text ",
    ],
    ids=["none", "ray", "pod", "mpirun", "torchrun", "pid", "pdsh", "cri", "nccl-ts", "tqdm"],
)
def test_launcher_prefixes_in_front(front):
    (event,) = parse_line(front + "node-0:4101:4102 [3] NCCL INFO " + coll())
    assert (event.host, event.pid, event.tid, event.op) == ("node-0", 4101, 4102, "all_reduce")


def test_other_programs_lines_give_nothing():
    for line in [
        b"",
        b"loss 2.31 step 10",
        b"\xff\xfe\x00garbage NCCL",
        b"NCCL version 2.30.4+cuda12.9",
        (P + "Channel 00/02 : 0 1 2 3").encode(),
        (P + "Connected all rings").encode(),
    ]:
        assert parse_line(line) == ()


def test_truncated_line_is_a_counted_fragment():
    line = (P + "Trees" + "".join(f" [{c}] 1/-1/-1->0->-1" for c in range(64)))[:1023]
    assert parse_line(line + "\n") == (Fragment(reason="truncated"),)


def test_interleaved_line_is_split_where_the_second_prefix_starts():
    other = "node-0:4102:4102 [1] NCCL INFO "
    first = P + coll(comm="0xaaa")
    cut = first[: first.index("recvbuff") + 4]
    events = parse_line(cut + other + coll(comm="0xbbb"))
    assert isinstance(events[0], Fragment)
    assert events[0].reason == "interleaved"
    # glued to the cut text: the host reads "recvnode-0" unless the known host names are given
    assert events[1].host == "recvnode-0"
    (_, fixed) = parse_line(cut + other + coll(comm="0xbbb"), frozenset({"node-0"}))
    assert (fixed.host, fixed.pid, fixed.comm) == ("node-0", 4102, 0xBBB)
    # two complete lines on one line (a lost newline) both read
    both = parse_line(first + " " + other + coll(comm="0xbbb"))
    assert [e.comm for e in both] == [0xAAA, 0xBBB]


def test_a_line_of_many_markers_without_prefixes_is_one_error_and_the_parts_around_them_still_read():
    # Thousands of bare markers on one line (a binary dump, a looping print) gave one Malformed each, thousands
    # of parse errors from one line, and were read in time quadratic in their number (a 64 KiB line: 0.2 s).
    bare = " NCCL INFO " * 5000
    assert parse_line(bare) == (Malformed(kind="prefix", reason="no host:pid:tid [dev] before NCCL INFO"),)
    other = "node-0:4102:4102 [1] NCCL INFO "
    events = parse_line(P + coll(comm="0xaaa") + bare + " " + other + coll(comm="0xbbb"))
    # the first line runs into the markers (cut: no longer read), then the one error, then the second line
    assert [type(e).__name__ for e in events] == ["Fragment", "Malformed", "Collective"]
    assert events[-1].comm == 0xBBB


def test_old_rccls_timestamp_after_the_device_is_part_of_the_prefix():
    # RCCL of 2019 wrote a µs timestamp between "[dev]" and the marker: every such line was a Malformed prefix
    line = (
        "rocm-framework-3:24888:25056 [1] 1558545003174220 NCCL INFO AllReduce: opCount 1 sendbuff 0x7f80b54bad00 "
        "recvbuff 0x7f81cce12200 count 1001 datatype 7 op 0 root 0 comm 0x7f80467b9770 [nranks=2] stream 0x7f804680c090"
    )
    (event,) = parse_line(line)
    assert (event.host, event.pid, event.tid, event.element_count, event.comm) == (
        "rocm-framework-3",
        24888,
        25056,
        1001,
        0x7F80467B9770,
    )
    assert event.message_bytes == 1001 * 4  # datatype 7: float32
    # digits not after "] " are no timestamp
    assert parse_line(line.replace("[1] 1558", "[1]x1558")) == (
        Malformed(kind="prefix", reason="no host:pid:tid [dev] before NCCL INFO"),
    )


def test_colours_and_host_names_outside_ascii_are_read():
    # A colour reset glued to the stream pointer made the whole line Malformed; a host "nöde-1" read as "de-1",
    # which no rank's host matched.
    (event,) = parse_line("\x1b[32m" + P + coll(comm="0xaaa") + "\x1b[0m")
    assert event.comm == 0xAAA
    (event,) = parse_line(("nöde-1:77:77 [0] NCCL INFO " + coll(comm="0xbbb")).encode())
    assert (event.host, event.pid, event.comm) == ("nöde-1", 77, 0xBBB)
    # two lines on one, the second's host outside ascii: the first part ends where that host's bytes begin
    both = parse_line((P + coll(comm="0xaaa") + " nöde-1:77:77 [0] NCCL INFO " + coll(comm="0xbbb")).encode())
    assert [(e.host, e.comm) for e in both] == [(P.split(":", maxsplit=1)[0], 0xAAA), ("nöde-1", 0xBBB)]


def test_cut_and_orphan_and_malformed_lines():
    full = P + coll()
    assert parse_line(full[: full.index(" count ")]) == (Fragment(reason="cut"),)
    assert parse_line("ff 0x2000 count 4 datatype 7 op 0 root 0 comm 0x5600 [nranks=2] stream 0x3000") == (
        Fragment(reason="orphan"),
    )
    for bad in [
        coll(count="4x"),
        coll(dtype="seven"),
        coll(comm="(nil)"),
        coll(nranks="0"),
        coll(op="All-Reduce"),
        coll(suffix=" extra 1 words 2"),
    ]:
        (event,) = parse_line(P + bad)
        assert isinstance(event, Malformed), bad
        assert event.kind == "coll"
    (event,) = parse_line(P + "comm 0x55 rank 9 nranks 8 cudaDev 0 - Init COMPLETE")
    assert isinstance(event, Malformed)
    (event,) = parse_line("node-0:x:1 [0] NCCL INFO " + coll())
    assert event == Malformed(kind="prefix", reason="no host:pid:tid [dev] before NCCL INFO")


def test_cuda_dev_in_the_prefix_is_not_the_rank():
    reg = CommRegistry()
    for line in ["node-0:9:9 [0] NCCL INFO comm 0x10 rank 5 nranks 8 cudaDev 2 busId 1 - Init COMPLETE"]:
        for event in parse_line(line):
            reg.apply(event)
    (comm,) = reg.communicators
    assert (comm.rank, comm.cuda_dev) == (5, 2)


# ------------------------------------------------------------------------------------------ the registry


def feed(reg: CommRegistry, lines: list[str]) -> list[int | None]:
    return [reg.apply(e) for line in lines for e in parse_line(line)]


def test_sequence_is_counted_per_communicator_not_read_from_opcount():
    reg = CommRegistry()
    lines = [
        "h:1:1 [0] NCCL INFO comm 0xa rank 0 nranks 2 cudaDev 0 busId 1 commId 0x1 - Init COMPLETE",
        "h:1:1 [0] NCCL INFO comm 0xb rank 0 nranks 2 cudaDev 0 busId 1 commId 0x2 - Init COMPLETE",
    ]
    lines += ["h:1:1 [0] NCCL INFO " + coll(comm="0xa", op_count="0")] * 3
    lines += ["h:1:1 [0] NCCL INFO " + coll(comm="0xb", op_count="0")]
    assert feed(reg, lines) == [None, None, 1, 2, 3, 1]


def test_pointer_reused_after_destroy_is_a_new_communicator():
    reg = CommRegistry()
    init = "h:1:1 [0] NCCL INFO comm 0xa rank {r} nranks {n} cudaDev 0 nvmlDev 0 busId 1 commId {c} - Init {w}"
    feed(
        reg,
        [
            init.format(r=0, n=2, c="0x1", w="START"),
            init.format(r=0, n=2, c="0x1", w="COMPLETE"),
            "h:1:1 [0] NCCL INFO " + coll(comm="0xa"),
            init.format(r=1, n=4, c="0x2", w="START"),
            init.format(r=1, n=4, c="0x2", w="COMPLETE"),
            "h:1:1 [0] NCCL INFO " + coll(comm="0xa", nranks=4),
        ],
    )
    old, new = reg.communicators
    assert (old.live, old.nranks, old.comm_id, old.sequence) == (False, 2, 1, 1)
    assert (new.live, new.nranks, new.comm_id, new.sequence) == (True, 4, 2, 1)
    # old versions print only COMPLETE: a second COMPLETE at the address is a new communicator too
    reg = CommRegistry()
    feed(reg, ["h:1:1 [0] NCCL INFO comm 0xa rank 0 nranks 2 cudaDev 0 busId 1 - Init COMPLETE"] * 2)
    assert [c.live for c in reg.communicators] == [False, True]


def test_caps_count_what_they_drop():
    reg = CommRegistry(max_communicators=2)
    feed(reg, ["h:1:1 [0] NCCL INFO " + coll(comm=hex(0x10 + i)) for i in range(4)])
    assert len(reg.communicators) == 2
    assert (reg.stats.communicators_dropped, reg.stats.calls_dropped, reg.stats.calls_without_init) == (2, 2, 2)


# ------------------------------------------------------------------------------------------ axes


def test_two_axes_that_fit_alike_are_unknown():
    mapper = AxisMapper(ParallelLayout(tp=2, dp=2))
    assert mapper.axis_of(nranks=2, members={0: 0}, rank=0) == UNKNOWN  # tp {0,1} or dp {0,2}
    assert mapper.axis_of(nranks=2, members={0: 0, 1: 1}, rank=0) == "tp"
    assert mapper.axis_of(nranks=2, members={0: 0, 2: 1}, rank=0) == "dp"
    assert mapper.axis_of(nranks=2, members={1: 0}, rank=1) == "dp"  # position 1 in its tp group, 0 in dp {1,3}
    assert mapper.axis_of(nranks=2, members={0: 1}, rank=0) == UNKNOWN  # no group puts rank 0 second
    assert mapper.axis_of(nranks=4, members={3: 3}, rank=3) == "world"
    assert mapper.axis_of(nranks=3, members={0: 0}, rank=0) == UNKNOWN


def test_placement_tells_same_size_groups_apart():
    placement = Placement.default(8, gpus_per_node=4, nvlink_domain_gpus=4, nodes_per_network_block=2)
    mapper = AxisMapper(LAYOUT, placement)
    assert mapper.axis_of(nranks=2, members={0: 0}, rank=0, n_nodes=2, local_ranks=1) == "pp"
    assert mapper.axis_of(nranks=2, members={0: 0}, rank=0, n_nodes=1, local_ranks=2) == UNKNOWN  # tp or dp
    assert AxisMapper(LAYOUT).axis_of(nranks=2, members={0: 0}, rank=0, n_nodes=2, local_ranks=1) == UNKNOWN


def test_combined_and_world_groups():
    layout = ParallelLayout(dp=2, cp=2, tp=2)  # order tp-cp-ep-dp-pp: dp-cp group of rank 0 is {0, 2, 4, 6}
    mapper = AxisMapper(layout)
    assert mapper.axis_of(nranks=4, members={0: 0, 2: 1, 4: 2}, rank=0) == "dp-cp"
    assert mapper.axis_of(nranks=8, members={5: 5}, rank=5) == "world"
    # a dp group that is the whole world is dp
    assert AxisMapper(ParallelLayout(dp=4)).axis_of(nranks=4, members={2: 2}, rank=2) == "dp"
    # ep = dp (cp=1, etp=tp): the ep and dp groups are the same ranks, two single axes: never guess
    moe = AxisMapper(ParallelLayout(dp=2, ep=2))
    assert moe.axis_of(nranks=2, members={0: 0, 1: 1}, rank=0) == UNKNOWN


# ------------------------------------------------------------------------------------------ following files


def lines_of(follower: LogFollower, budget: int = 1 << 20) -> list[bytes]:
    return follower.poll(budget)


def test_follower_grows_keeps_partial_lines_and_notices_new_files(tmp_path):
    log = tmp_path / "nccl.h.1"
    log.write_bytes(b"a\nb")
    f = LogFollower(tmp_path)
    assert lines_of(f) == [b"a"]
    with log.open("ab") as out:
        out.write(b"c\nd\n")
    assert lines_of(f) == [b"bc", b"d"]
    (tmp_path / "nccl.h.2").write_bytes(b"e\n")
    assert lines_of(f) == [b"e"]
    assert lines_of(f) == []


def test_follower_rotation_truncation_deletion(tmp_path):
    log = tmp_path / "nccl.h.1"
    log.write_bytes(b"one\ntw")
    f = LogFollower(tmp_path / "nccl.h.*")
    assert lines_of(f) == [b"one"]
    # rotated: the old file is renamed out of the glob and a new one takes its path
    with log.open("ab") as out:
        out.write(b"o\n")
    log.rename(tmp_path / "old.1")
    log.write_bytes(b"three\n")
    assert lines_of(f) == [b"two", b"three"]
    assert f.stats.rotations == 1
    # truncated in place: read again from the start, the partial line is lost and counted
    with log.open("ab") as out:
        out.write(b"part")
    assert lines_of(f) == []
    log.write_bytes(b"new\n")
    assert lines_of(f) == [b"new"]
    assert (f.stats.truncations, f.stats.partial_lines) == (1, 1)
    # deleted: what was written before still reads through the open descriptor
    with log.open("ab") as out:
        out.write(b"last\n")
    log.unlink()
    assert lines_of(f) == [b"last"]
    assert f.stats.deletions == 1
    assert f.files == []
    f.close()


def test_follower_reads_a_rotated_file_on_under_its_new_name(tmp_path):
    log = tmp_path / "nccl.h.1"
    log.write_bytes(b"one\n")
    f = LogFollower(tmp_path)
    assert lines_of(f) == [b"one"]
    log.rename(tmp_path / "nccl.h.1.1")
    with (tmp_path / "nccl.h.1.1").open("ab") as out:
        out.write(b"two\n")  # the writer keeps its descriptor to the renamed file
    got = lines_of(f) + lines_of(f)
    assert sorted(got) == [b"two"]


def test_follower_budget_caps_and_overlong_lines(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 10 + b"\n" + b"y" * 10 + b"\n")
    f = LogFollower(tmp_path, max_files=1, max_line_bytes=8)
    (tmp_path / "b").write_bytes(b"z\n")
    assert lines_of(f, budget=6) == []  # 6 bytes of an overlong line
    assert lines_of(f, budget=100) == []
    assert f.stats.overlong_lines == 2
    assert f.stats.files_over_cap == 1
    assert f.stats.bytes_read == 22


def test_source_follows_a_growing_log(tmp_path):
    log = tmp_path / "nccl.node-0.11"
    init = "node-0:11:11 [0] NCCL INFO comm 0xa rank 0 nranks 8 cudaDev 0 busId 1 commId 0x1 - Init COMPLETE\n"
    log.write_text(init + "node-0:11:11 [0] NCCL INFO " + coll(comm="0xa", nranks=8, count=2)[:30])
    source = NcclLogSource(tmp_path, layout=LAYOUT)
    source.poll()
    assert table(source, "meshscope_nccl_collectives_total") == {}
    with log.open("a") as out:
        out.write(coll(comm="0xa", nranks=8, count=2)[30:] + "\n")
    source.poll()
    assert table(source, "meshscope_nccl_bytes_total") == {(0, "world", "all_reduce"): 8}
    log.unlink()
    source.poll()
    assert not source.health.up  # nothing left to follow
    assert table(source, "meshscope_nccl_collectives_total") == {(0, "world", "all_reduce"): 1}  # counters stay


def test_fixture_copied_and_read_in_small_budgets_gives_the_same_totals(tmp_path):
    shutil.copytree(DATA / "logs", tmp_path / "logs")
    source = NcclLogSource(tmp_path / "logs", layout=LAYOUT, budget_bytes=997)
    for _ in range(200):
        source.poll()
    calls = table(source, "meshscope_nccl_collectives_total")
    assert calls[3, "world", "all_reduce"] == 5
    assert calls[0, "tp", "all_reduce"] == 4
    assert sum(calls.values()) == 4 * 17


# ------------------------------------------------------------------------------------------ Inspector


def test_inspector_line_fields_and_rejections():
    line = (DATA / "inspector" / "node-0-pid4101.log").read_text().splitlines()[3]
    r = parse_inspector_line(line)
    assert r == InspectorRecord(
        host="node-0",
        pid=4101,
        comm_hash="0x5eed0003",
        comm_name="unknown",
        rank=0,
        nranks=2,
        n_nodes=2,
        op_name="Send",
        op="send",
        sequence=1,
        message_bytes=2 * MiB,
        exec_time_s=180e-6,
        timing_source="kernel_gpu",
        peer=1,
    )
    assert parse_inspector_line(b"   ") is None
    for bad in [
        b"[]",
        b"{",
        b'{"header": 1}',
        b"\xff\xfe",
        line.replace('"rank":0', '"rank":2'),
        line.replace('"p2p_sn":1', '"p2p_sn":-1'),
        line.replace('"pid":4101', '"pid":true'),
    ]:
        assert isinstance(parse_inspector_line(bad), Malformed), bad


# ------------------------------------------------------------------------------------------ fuzzing from the grammar

hosts = st.from_regex(r"\A[a-z][a-z0-9-]{0,15}\Z")
small = st.integers(min_value=0, max_value=2**31 - 1)
ptrs = st.integers(min_value=1, max_value=2**48 - 1)
fronts = st.sampled_from(["", "[1,0]<stdout>:", "(RayTrainWorker pid=1) ", "x: ", "2026-07-01T10:00:00Z stdout F "])
OPS = ["AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "Send", "Recv", "AlltoAll"]


@st.composite
def coll_lines(draw):
    fields = {
        "host": draw(hosts),
        "pid": draw(small),
        "tid": draw(small),
        "op": draw(st.sampled_from(OPS)),
        "op_count": draw(st.integers(0, 2**63)),
        "count": draw(st.integers(0, 2**62)),
        "dtype": draw(st.integers(0, 11)),
        "red": draw(st.integers(0, 4)),
        "root": draw(st.integers(-1, 1023)),
        "comm": draw(ptrs),
        "nranks": draw(st.integers(1, 2**20)),
        "send": draw(st.none() | ptrs),
        "stream": draw(st.none() | ptrs),
    }
    text = coll(
        fields["op"],
        op_count=f"{fields['op_count']:x}",
        count=fields["count"],
        dtype=fields["dtype"],
        red=fields["red"],
        root=fields["root"],
        comm=hex(fields["comm"]),
        nranks=fields["nranks"],
        send="(nil)" if fields["send"] is None else hex(fields["send"]),
        stream="(nil)" if fields["stream"] is None else hex(fields["stream"]),
    )
    line = (
        f"{draw(fronts)}{fields['host']}:{fields['pid']}:{fields['tid']} [{draw(st.integers(0, 7))}] NCCL INFO {text}"
    )
    return line, fields


@settings(max_examples=300, deadline=None)
@given(coll_lines())
def test_fuzz_valid_coll_lines_round_trip(case):
    line, f = case
    (e,) = parse_line(line.encode())
    assert isinstance(e, Collective)
    assert (
        e.host,
        e.pid,
        e.tid,
        e.op_name,
        e.op_count,
        e.element_count,
        e.datatype,
        e.reduction,
        e.root,
        e.comm,
        e.nranks,
        e.sendbuff,
        e.stream,
    ) == (
        f["host"],
        f["pid"],
        f["tid"],
        f["op"],
        f["op_count"],
        f["count"],
        f["dtype"],
        f["red"],
        f["root"],
        f["comm"],
        f["nranks"],
        f["send"],
        f["stream"],
    )


@st.composite
def init_lines(draw):
    nranks = draw(st.integers(1, 4096))
    f = {
        "comm": draw(ptrs),
        "rank": draw(st.integers(0, nranks - 1)),
        "nranks": nranks,
        "cuda_dev": draw(st.integers(0, 15)),
        "nvml_dev": draw(st.none() | st.integers(0, 15)),
        "bus_id": draw(st.none() | st.integers(0, 2**32)),
        "comm_id": draw(st.none() | st.integers(1, 2**64 - 1)),
        "func": draw(
            st.none()
            | st.sampled_from(["ncclCommInitRank", "ncclCommInitRankConfig", "ncclCommSplit", "ncclCommInitAll"])
        ),
        "split": draw(st.none() | st.tuples(ptrs, st.none() | small, st.integers(0, 99), st.integers(0, 99))),
        "complete": draw(st.booleans()),
        "logged_rank": draw(st.none() | small),
    }
    parts = [f"comm {f['comm']:#x} rank {f['rank']} nranks {nranks} cudaDev {f['cuda_dev']}"]
    if f["nvml_dev"] is not None:
        parts.append(f"nvmlDev {f['nvml_dev']}")
    if f["bus_id"] is not None:
        parts.append(f"busId {f['bus_id']:x}")
    if f["split"] is not None:
        parent, count, color, key = f["split"]
        parts.append(
            f"parent {parent:#x}" + ("" if count is None else f" childCount {count}") + f" color {color} key {key}"
        )
    if f["comm_id"] is not None:
        parts.append(f"commId {f['comm_id']:#x}")
    body = " ".join(parts) + draw(st.sampled_from([" - ", "- "])) + ("Init COMPLETE" if f["complete"] else "Init START")
    if f["func"]:
        body = f"{f['func']} {body}"
    if f["logged_rank"] is not None:
        body = f"[Rank {f['logged_rank']}] {body}"
    return f"{draw(fronts)}h-1:5:6 [0] NCCL INFO {body}", f


@settings(max_examples=300, deadline=None)
@given(init_lines())
def test_fuzz_valid_init_lines_round_trip(case):
    line, f = case
    (e,) = parse_line(line)
    assert isinstance(e, InitLine)
    assert (
        e.comm,
        e.rank,
        e.nranks,
        e.cuda_dev,
        e.nvml_dev,
        e.bus_id,
        e.comm_id,
        e.func,
        e.complete,
        e.logged_rank,
    ) == (
        f["comm"],
        f["rank"],
        f["nranks"],
        f["cuda_dev"],
        f["nvml_dev"],
        f["bus_id"],
        f["comm_id"],
        f["func"],
        f["complete"],
        f["logged_rank"],
    )
    if f["split"] is not None:
        assert (e.parent, e.split_count, e.color, e.key) == f["split"]


FIELDS = ["opCount", "count", "datatype", "op", "root", "comm", "stream", "sendbuff"]


@settings(max_examples=300, deadline=None)
@given(coll_lines(), st.sampled_from(FIELDS), st.sampled_from(["zz", "-", "0x", "1.5", "", "0xg1"]))
def test_fuzz_mangled_value_is_counted_malformed(case, field, garbage):
    line, _ = case
    tokens = line.split(" ")
    at = tokens.index(field, tokens.index("INFO")) + 1
    tokens[at] = garbage
    (event,) = parse_line(" ".join(tokens))
    assert isinstance(event, Malformed | Fragment)


@settings(max_examples=300, deadline=None)
@given(coll_lines(), st.data())
def test_fuzz_cut_coll_line_is_never_a_call(case, data):
    line, _ = case
    lo, hi = line.index(": opCount ") + len(": opCount "), line.index(" stream ")
    cut = data.draw(st.integers(lo, hi))
    events = parse_line(line[:cut])
    assert len(events) == 1
    assert isinstance(events[0], Fragment | Malformed)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=300), st.booleans())
def test_fuzz_any_bytes_never_raise(noise, with_marker):
    line = noise + (b" NCCL INFO " if isinstance(noise, bytes) else " NCCL INFO ") * with_marker
    events = parse_line(line)
    assert all(
        isinstance(
            e, Malformed | Fragment | Collective | InitLine | CommShape | InitTimings | MnnvlFabric | MnnvlClique
        )
        for e in events
    )
    assert isinstance(
        parse_inspector_line(line if isinstance(line, bytes) else line.encode()),
        InspectorRecord | Malformed | type(None),
    )


def test_fixture_files_are_small():
    for path in DATA.rglob("*"):
        if path.is_file():
            assert path.stat().st_size < 100_000, path

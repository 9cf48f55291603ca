"""Regenerate the fixtures beside this file: python tests/data/sidecar/nccl/make_logs.py (README.md says what each shows).

One node (node-0, 4 GPUs) of a job with tp=2 pp=2 dp=2 on 2 nodes (rank = tp + 2·dp + 4·pp, Megatron's order): ranks
0-3 are pipeline stage 0. Every line is written from NCCL's format strings (NVIDIA/nccl src/init.cc, enqueue.cc,
debug.cc at the release tags named in README.md); each process writes a different NCCL version's Init lines.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
HOST = "node-0"
W_ID, T1_ID, T2_ID = 0x7C1F3A9E2B4D6081, 0x0FE1D2C3B4A59687, 0x1F2E3D4C5B6A7988
DP_ID = {0: 0x1A2B3C4D5E6F7081, 1: 0x2B3C4D5E6F708192}  # by tp index: dp groups {0,2} and {1,3}
PP_ID = {0: 0x3C4D5E6F70819203, 1: 0x4D5E6F7081920314, 2: 0x5E6F708192031425, 3: 0x6F70819203142536}
TP_SPLIT_ID = 0x708192031425364F  # 2.21/2.22 print a commId on splits: the hash of "<parent hash>-<color>"
BUS = {0: 0x18000, 1: 0x2A000, 2: 0x3A000, 3: 0x5D000}
MiB = 1024 * 1024


class Rank:
    def __init__(self, rank: int, pid: int, version: str) -> None:
        self.rank, self.pid, self.version, self.tid = rank, pid, version, pid
        base = 0x5600000A1000 if rank < 2 else 0x7F3A00001000 + rank * 0x100000  # ranks 0 and 1 share addresses
        self.world, self.tp, self.dp, self.pp, self.tmp = (base + i * 0x11000 for i in range(5))
        self.lines: list[str] = []
        self.op_counts: dict[int, int] = {}

    def pre(self, tid: int | None = None) -> str:
        return f"{HOST}:{self.pid}:{tid or self.tid} [{self.rank}] NCCL INFO "

    def info(self, text: str, tid: int | None = None) -> None:
        self.lines.append(self.pre(tid) + text)

    def ids(self, comm: int, rank: int, nranks: int) -> str:
        return f"comm {comm:#x} rank {rank} nranks {nranks} cudaDev {self.rank} nvmlDev {self.rank} busId {BUS[self.rank]:x}"

    def init(self, func: str, comm: int, rank: int, nranks: int, comm_id: int, shape: tuple[int, int, int]) -> None:
        ids, v = self.ids(comm, rank, nranks), self.version
        start = f"{func} {ids} commId {comm_id:#x} - Init START"
        self.info(f"[Rank {rank}] {start}" if v == "2.30.4" else start)
        self.info("Bootstrap timings total 0.000412 (create 0.000031, send 0.000090, recv 0.000201)")
        self.info(
            f"comm {comm:#x} rank {rank} nRanks {nranks} nNodes {shape[0]} localRanks {shape[1]} localRank {shape[2]} MNNVL 0"
        )
        self.info(f"Channel 00/02 : {' '.join(str(i) for i in range(nranks))}")
        self.info(f"{func} {ids} commId {comm_id:#x} - Init COMPLETE")
        self.timings(func, rank, nranks)

    def split(self, comm: int, rank: int, nranks: int, parent: int, color: int, shape: tuple[int, int, int]) -> None:
        ids, v = self.ids(comm, rank, nranks), self.version
        tail = {
            "2.30.4": f"parent {parent:#x} childCount 1 color {color} key {rank}",
            "2.27.7": f"parent {parent:#x} splitCount 1 color {color} key {rank}",
        }.get(v)
        if tail is None:  # 2.21.5 / 2.22.3: parent, color, key and a commId
            tail = f"parent {parent:#x} color {color} key {rank} commId {TP_SPLIT_ID:#x}"
            self.info(f"ncclCommSplit {ids} {tail} - Init START")
        else:
            self.info(f"ncclCommSplit {ids} {tail}- Init START")  # sic: no space before '-' (init.cc 2.23+)
        self.info(
            f"comm {comm:#x} rank {rank} nRanks {nranks} nNodes {shape[0]} localRanks {shape[1]} localRank {shape[2]} MNNVL 0"
        )
        self.info(f"ncclCommSplit {ids} {tail} - Init COMPLETE")
        self.timings("ncclCommSplit", rank, nranks)

    def timings(self, func: str, rank: int, nranks: int) -> None:
        if self.version == "2.22.3":
            self.info(
                f"Init timings: rank {rank} nranks {nranks} total 0.91 (kernels 0.20, bootstrap 0.40, allgathers 0.02, topo 0.15, graphs 0.02, connections 0.10, rest 0.02)"
            )
        elif self.version in {"2.27.7", "2.30.4"}:
            self.info(
                f"Init timings - {func}: rank {rank} nranks {nranks} total 0.93 (kernels 0.20, alloc 0.01, bootstrap 0.40, allgathers 0.02, topo 0.15, graphs 0.02, connections 0.10, rest 0.03)"
            )

    def coll(
        self,
        op: str,
        comm: int,
        nranks: int,
        count: int,
        dtype: int,
        root: int = 0,
        *,
        single_node: bool = False,
        red: int = 0,
    ) -> str:
        n = self.op_counts.get(comm, 0)
        stuck = single_node and self.version in {"2.27.7", "2.30.4"}  # opCount stays 0 (NVIDIA/nccl PR #2021)
        self.op_counts[comm] = n + 1
        buf = f"{0x7F3A4C000000 + self.rank * 0x10000000 + n * 0x400000:#x}"
        send = "(nil)" if op == "Recv" else buf
        recv = "(nil)" if op == "Send" else buf
        return (
            f"{op}: opCount {0 if stuck else n:x} sendbuff {send} recvbuff {recv} count {count} datatype {dtype} "
            f"op {red} root {root} comm {comm:#x} [nranks={nranks}] stream 0x5600001c{self.rank:x}000"
        )

    def step(self, *, lose_allgather: bool = False) -> None:
        for _ in range(2):
            self.info(self.coll("AllReduce", self.tp, 2, 4 * MiB, 9, single_node=True))  # 8 MiB bf16
        self.info(self.coll("Send", self.pp, 2, MiB, 9, root=1))  # 2 MiB bf16 to stage 1
        self.info(self.coll("Recv", self.pp, 2, MiB, 9, root=1))
        self.info(self.coll("ReduceScatter", self.dp, 2, 2 * MiB, 7, single_node=True))  # 8 MiB fp32 per rank
        ag = self.coll("AllGather", self.dp, 2, 2 * MiB, 9, single_node=True)  # 4 MiB bf16 per rank
        if lose_allgather:  # cut by the proxy thread's line: the rest arrives on the next line, without a prefix
            cut = ag.index("recvbuff") + 6
            self.lines.append(self.pre() + ag[:cut] + self.pre(4190) + "Connected all rings, use ring PXN 0 GDR 1")
            self.lines.append(ag[cut:])
        else:
            self.info(ag)
        self.info(self.coll("AllReduce", self.world, 8, 1, 7))  # grad norm: 4 bytes fp32


def build(r: Rank) -> None:
    tp_rank, dp_rank = r.rank % 2, r.rank // 2
    if r.version == "2.30.4":
        r.lines.append("NCCL version 2.30.4+cuda12.9")  # the banner has no prefix (debug.cc, NCCL_LOG_VERSION)
    else:
        r.info(f"NCCL version {r.version}+cuda12.4")
    r.info("Bootstrap: Using eth0:10.0.0.11<0>")
    func = "ncclCommInitRank" if r.version in {"2.21.5", "2.22.3"} else "ncclCommInitRankConfig"
    r.init(func, r.world, r.rank, 8, W_ID, (2, 4, r.rank))
    if r.rank == 0:
        r.info(f"MNNVL busId {BUS[0]:#x} fabric UUID 0.0 cliqueId 0x0 state 3 healthMask 0x0")
    r.split(r.tp, tp_rank, 2, r.world, r.rank // 2, (1, 2, tp_rank))
    r.init(func, r.dp, dp_rank, 2, DP_ID[tp_rank], (1, 2, dp_rank))
    r.init(func, r.pp, 0, 2, PP_ID[r.rank], (2, 1, 0))
    # a temporary world-size group: created, used, destroyed; a new one gets the same address
    r.init(func, r.tmp, r.rank, 8, T1_ID, (2, 4, r.rank))
    r.info(r.coll("AllReduce", r.tmp, 8, 1, 4))
    r.info(r.coll("AllReduce", r.tmp, 8, 1, 4))
    r.info(f"comm {r.tmp:#x} rank {r.rank} nranks 8 cudaDev {r.rank} busId {BUS[r.rank]:x} - Destroy COMPLETE")
    r.op_counts.pop(r.tmp)
    r.init(func, r.tmp, r.rank, 8, T2_ID, (2, 4, r.rank))
    r.info(r.coll("Broadcast", r.tmp, 8, 1024, 1))
    r.step()
    r.step(lose_allgather=r.rank == 3)


def write() -> None:
    logs = HERE / "logs"
    logs.mkdir(exist_ok=True)
    ranks = [Rank(0, 4101, "2.30.4"), Rank(1, 4102, "2.27.7"), Rank(2, 4103, "2.22.3"), Rank(3, 4104, "2.21.5")]
    for r in ranks:
        build(r)
    r0, r1, r2, r3 = ranks
    # rank 1: the process died while writing a COLL line: the file ends without a newline
    r1_tail = r1.pre() + r1.coll("AllReduce", r1.tp, 2, 4 * MiB, 9, single_node=True)[:60]
    # rank 2: a Trees line cut at NCCL's 1024-byte buffer (1023 bytes then the newline), a mangled COLL line, junk
    trees = r2.pre() + "Trees" + "".join(f" [{c}] 1/-1/-1->0->-1" for c in range(64))
    r2.lines.insert(12, trees[:1023])
    r2.lines.insert(30, r2.pre() + r2.coll("AllReduce", r2.tp, 2, 4 * MiB, 9).replace("datatype 9", "datatype x9"))
    r2.lines.insert(31, "Traceback (most recent call last): warnings are not NCCL's")
    for r in (r0, r1, r2):
        (logs / f"nccl.{HOST}.{r.pid}").write_text("\n".join(r.lines) + "\n", encoding="ascii")
    with (logs / f"nccl.{HOST}.{r1.pid}").open("a", encoding="ascii") as f:
        f.write(r1_tail)
    # rank 3: its NCCL output went to stdout, captured by the container runtime (CRI log format) behind torchrun's
    # prefix, with the proxy thread's line glued into a COLL line, tqdm's carriage returns and raw garbage
    out: list[bytes] = []
    glued = (
        r3.pre(4190)
        + "Channel 02/0 : 3[3] -> 7[3] [send] via NET/IB/0/GDRDMA"
        + r3.pre()
        + r3.coll("AllReduce", r3.world, 8, 1, 7)
    )
    r3.lines.insert(20, glued)
    for i, line in enumerate(r3.lines):
        out.append(f"2026-07-01T10:00:{i:02d}.000000000Z stdout F [default3]:{line}".encode())
        if i == 5:
            out.append(b"2026-07-01T10:00:05.500000000Z stderr F  12%|##        | 12/100 [00:01<00:09]\r 13%|##")
            out.append(b"\xff\xfe\x00garbage\x80\x81 NCCL")
    (logs / "rank3.stdout.log").write_bytes(b"\n".join(out) + b"\n")
    write_inspector()


def record(
    host_pid: tuple[str, int],
    comm: tuple[str, int, int, int],
    kind: str,
    op: str,
    sn: int,
    size: int,
    us: int,
    **extra: object,
) -> str:
    host, pid = host_pid
    cid, rank, n, nodes = comm
    perf = {
        f"{kind}": op,
        f"{kind}_sn": sn,
        **extra,
        f"{kind}_msg_size_bytes": size,
        f"{kind}_exec_time_us": us,
        f"{kind}_timing_source": "kernel_gpu",
        f"{kind}_algobw_gbs": round(size / us / 1e3, 6),
        f"{kind}_busbw_gbs": "nan",
    }
    return json.dumps(
        {
            "header": {"id": cid, "comm_name": "unknown", "rank": rank, "n_ranks": n, "nnodes": nodes},
            "metadata": {
                "inspector_output_format_version": "v4.0",
                "git_rev": "",
                "rec_mechanism": "nccl_profiler_interface",
                "dump_timestamp_us": 1782900000000000 + sn,
                "hostname": host,
                "pid": pid,
            },
            f"{kind}_perf": perf,
        },
        separators=(",", ":"),
    )


def write_inspector() -> None:
    d = HERE / "inspector"
    d.mkdir(exist_ok=True)
    h0, h1 = ("node-0.cluster.local", 4101), ("node-0.cluster.local", 4102)
    tp0, tp1 = ("0x5eed0001", 0, 2, 1), ("0x5eed0001", 1, 2, 1)
    dp0, pp0 = ("0x5eed0002", 0, 2, 1), ("0x5eed0003", 0, 2, 2)
    rank0 = [
        record(h0, tp0, "coll", "AllReduce", 1, 8 * MiB, 410),
        record(h0, tp0, "coll", "AllReduce", 2, 8 * MiB, 395),
        record(h0, dp0, "coll", "ReduceScatter", 1, 8 * MiB, 1250),
        record(h0, pp0, "p2p", "Send", 1, 2 * MiB, 180, p2p_peer=1),
        '{"header":{"id":"0x5eed0001","rank":0,"n_ranks":2,"nnodes":1},"metadata":{"inspector_output_format_version":"v3.0"},"coll_perf":{}}',
        '{"header":{"id":"0x5eed0001","rank":0,"n_ranks":2,"nnodes":1},"metadata":{"inspector_output_forma',
    ]
    rank1 = [
        record(h1, tp1, "coll", "AllReduce", 1, 8 * MiB, 400),
        record(h1, tp1, "coll", "AllReduce", 2, 8 * MiB, 405),
    ]
    (d / "node-0-pid4101.log").write_text("\n".join(rank0) + "\n", encoding="ascii")
    (d / "node-0-pid4102.log").write_text("\n".join(rank1) + "\n", encoding="ascii")


if __name__ == "__main__":
    write()

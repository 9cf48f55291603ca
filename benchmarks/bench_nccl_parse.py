"""NCCL debug-log parsing speed: lines per second per core on a COLL-heavy log (target above 200,000).

The log is what one process of a tp=8 pp=4 dp job writes with ``NCCL_DEBUG_SUBSYS=INIT,COLL``: a few Init lines,
then COLL lines of 6 op/datatype kinds on 4 communicators, 1 line in 50 something else (channels, a proxy thread's
line, a framework's log line). Timed: :func:`parse_line` alone, and the whole source (file read, split into lines,
parse, registry), as CPU time of this process (steadier than wall time on a shared machine), best of ``--repeat``.

    .venv/bin/python benchmarks/bench_nccl_parse.py
    .venv/bin/python benchmarks/bench_nccl_parse.py --lines 500000 --repeat 3
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from meshscope.topology import ParallelLayout
from meshscope_sidecar.sources.nccl_lines import parse_line
from meshscope_sidecar.sources.nccl_log import NcclLogSource
from timing import machine_reference, peak_rss_mib

PRE = "gpu-node-17:48213:48213 [3] NCCL INFO "
COMMS = {"world": 0x55D1C0A3B2F0, "tp": 0x55D1C0B40000, "dp": 0x55D1C0C51000, "pp": 0x55D1C0D62000}
CALLS = [  # op, comm, nranks, count, datatype
    ("AllReduce", "tp", 8, 4194304, 9),
    ("AllReduce", "tp", 8, 4194304, 9),
    ("ReduceScatter", "dp", 4, 8388608, 7),
    ("AllGather", "dp", 4, 8388608, 9),
    ("Send", "pp", 4, 1048576, 9),
    ("Recv", "pp", 4, 1048576, 9),
]


def make_log(n_lines: int) -> bytes:
    out = [f"{PRE}NCCL version 2.22.3+cuda12.4"]
    for name, comm in COMMS.items():
        n = {"world": 128, "tp": 8, "dp": 4, "pp": 4}[name]
        out.append(
            f"{PRE}ncclCommInitRank comm {comm:#x} rank 3 nranks {n} cudaDev 3 nvmlDev 3 busId 5d000 "
            f"commId {0x1000 + comm:#x} - Init COMPLETE"
        )
    i = 0
    while len(out) < n_lines:
        if i % 50 == 49:
            out.append(f"{PRE}Channel 02/0 : 3[3] -> 11[3] [send] via NET/IB/0/GDRDMA")
        else:
            op, comm, nranks, count, dtype = CALLS[i % len(CALLS)]
            buf = 0x7F3A4C000000 + (i % 64) * 0x400000
            out.append(
                f"{PRE}{op}: opCount {i:x} sendbuff {buf:#x} recvbuff {buf:#x} count {count} datatype {dtype} "
                f"op 0 root {1 if op in {'Send', 'Recv'} else 0} comm {COMMS[comm]:#x} [nranks={nranks}] "
                f"stream 0x55d1c0a3c000"
            )
        i += 1
    return ("\n".join(out) + "\n").encode()


def best_cpu(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=300_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(machine_reference(), flush=True)
    data = make_log(args.lines)
    lines = data.split(b"\n")[:-1]
    print(f"log: {len(lines):,} lines, {len(data) / len(lines):.0f} bytes a line")

    def parse_all() -> None:
        for line in lines:
            parse_line(line)

    cpu = best_cpu(parse_all, args.repeat)
    print(f"parse_line: {len(lines) / cpu:,.0f} lines/s per core ({cpu:.3f} s CPU, best of {args.repeat})")

    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "nccl.gpu-node-17.48213").write_bytes(data)

        def whole_source() -> None:
            source = NcclLogSource(tmp, layout=ParallelLayout(tp=8, pp=4, dp=4), budget_bytes=len(data) + 1)
            source.poll()
            source.samples()
            if source.stats.collectives < len(lines) * 0.9:
                raise SystemExit(f"only {source.stats.collectives} calls read")
            source.close()

        cpu = best_cpu(whole_source, args.repeat)
    print(
        f"NcclLogSource (read + parse + registry + samples): {len(lines) / cpu:,.0f} lines/s per core ({cpu:.3f} s CPU)"
    )
    print(f"peak RSS {peak_rss_mib():.0f} MiB (the log itself is held in memory by the benchmark)")


if __name__ == "__main__":
    main()

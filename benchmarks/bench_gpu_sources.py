"""Cost of the GPU and network sources per poll: one 8-GPU dcgm-exporter scrape, one 8-port InfiniBand tree.

The scrape is ``tests/data/sidecar/dcgm/h100_8gpu_default.prom`` (dcgm-exporter's default counters on 8 H100s, 200
series, 55 KB): timed is :meth:`DcgmSource.ingest` (parse, map, convert, XID bookkeeping; the HTTP exchange is
not included). The tree is 8 mlx5 ports written into a temporary directory with the full set of legacy counters
and RoCE ``hw_counters``: timed is one :meth:`InfinibandSource.poll` after a first one (so rates are computed).
On a training node both run once a second; the issue's budget for the whole sidecar is 5 % of one core.

    .venv/bin/python benchmarks/bench_gpu_sources.py
    .venv/bin/python benchmarks/bench_gpu_sources.py --repeat 500
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from meshscope_sidecar.sources.dcgm import DcgmSource
from meshscope_sidecar.sources.infiniband import InfinibandSource
from timing import machine_reference

SCRAPE = Path(__file__).resolve().parents[1] / "tests" / "data" / "sidecar" / "dcgm" / "h100_8gpu_default.prom"
COUNTERS = [
    "port_xmit_data",
    "port_rcv_data",
    "port_xmit_packets",
    "port_rcv_packets",
    "port_xmit_wait",
    "symbol_error",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_discards",
    "VL15_dropped",
    "link_error_recovery",
    "link_downed",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "unicast_xmit_packets",
    "unicast_rcv_packets",
    "multicast_xmit_packets",
    "multicast_rcv_packets",
]
HW_COUNTERS = [
    "np_cnp_sent",
    "np_ecn_marked_roce_packets",
    "rp_cnp_handled",
    "rp_cnp_ignored",
    "out_of_sequence",
    "packet_seq_err",
    "local_ack_timeout_err",
    "implied_nak_seq_err",
    "rnr_nak_retry_err",
    "duplicate_request",
    "out_of_buffer",
    "req_cqe_error",
    "resp_cqe_error",
    "roce_adp_retrans",
    "roce_adp_retrans_to",
    "roce_slow_restart",
    "lifespan",
]


def build_tree(root: Path, ports: int) -> None:
    for index in range(ports):
        device = root / f"mlx5_{index}"
        port = device / "ports" / "1"
        (port / "counters").mkdir(parents=True)
        (port / "hw_counters").mkdir()
        (device / "device").symlink_to(f"../../../devices/pci0000:00/0000:{0x18 + 16 * index:02x}:00.0")
        (port / "state").write_text("4: ACTIVE\n")
        (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
        (port / "link_layer").write_text("InfiniBand\n")
        for offset, name in enumerate(COUNTERS):
            (port / "counters" / name).write_text(f"{1_000_000 * (index + 1) + offset}\n")
        for offset, name in enumerate(HW_COUNTERS):
            (port / "hw_counters" / name).write_text(f"{offset}\n")


def timed(fn: object, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        out.append(time.perf_counter() - t0)
    return out


def report(label: str, seconds: list[float]) -> None:
    ms = sorted(s * 1e3 for s in seconds)
    print(
        f"{label}: median {statistics.median(ms):.3f} ms, best {ms[0]:.3f} ms, p95 {ms[int(len(ms) * 0.95) - 1]:.3f} ms"
        f" ({len(ms)} runs); at 1 Hz that is {statistics.median(ms) / 10:.3f} % of one core"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--ports", type=int, default=8)
    args = parser.parse_args()
    print(machine_reference(), flush=True)

    text = SCRAPE.read_text()
    dcgm = DcgmSource(hostname="gpu-node-07")
    dcgm.ingest(text)
    report(
        f"dcgm: ingest of an 8-GPU default-counters scrape ({len(text) / 1024:.0f} KiB, "
        f"{dcgm.last_stats.series} series, {len(tuple(dcgm.samples()))} samples out)",
        timed(lambda: dcgm.ingest(text), args.repeat),
    )

    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        build_tree(root, args.ports)
        clock = iter(range(1, 10**9))
        source = InfinibandSource(root=root, clock=lambda: float(next(clock)), gpu_count=args.ports)
        source.poll()
        report(
            f"infiniband: one poll of {args.ports} ports ({len(COUNTERS)} counters + {len(HW_COUNTERS)} hw_counters "
            f"each, {len(tuple(source.samples()))} samples out)",
            timed(source.poll, args.repeat),
        )


if __name__ == "__main__":
    main()

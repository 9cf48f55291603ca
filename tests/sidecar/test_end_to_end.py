"""One sidecar with every source, end to end: real parts in, a real Prometheus and the shipped rules out.

A real ``meshscope-sidecar`` process is the pod's sidecar on node ``gpu-node-07`` (node rank 0 of a tp=2,pp=2,dp=2
job with 4 GPUs per node: ranks 0-3 on GPUs 0-3, pipeline stage 0). It is fed by

- a real 4-rank gloo job with the meshscope SDK (``tests/data/sidecar/job/mesh_gloo.py``: those four ranks, a TP
  and a DP all-reduce every step), over one socket per rank;
- the NCCL log fixtures of ``tests/data/sidecar/nccl/logs`` (that node's four processes), copied into a temporary
  directory under the gloo ranks' host name and pids, and appended to while it runs: the communicators map to
  ranks through the ranks' hello messages;
- a local HTTP server answering with ``tests/data/sidecar/dcgm/h100_8gpu_default.prom`` (8 H100s of host
  ``gpu-node-07``; GPUs 0-3 are this pod's);
- the InfiniBand fixture tree, whose counters move while it runs.

A real Prometheus scrapes it every second with ``sidecar/monitoring/recording-rules.yaml``; everything is checked
over Prometheus' HTTP API against numbers derived here by hand from the job's own records (``/v1/steps``) and the
fixtures' documented contents. Waits are on conditions, never on time: the job starts once Prometheus has
scraped the sidecar's zero-valued counters, so that every rate() ratio of the rules is exactly the job's totals.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from meshscope.local.running import RunSettings, rank_env
from meshscope.topology import Placement, parse_layout
from meshscope_sidecar.sources.nccl_log import nccl_host
from sidecar.promstack import free_port, start_prometheus

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from sidecar.promstack import Service

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "sidecar"
JOB = DATA / "job" / "mesh_gloo.py"
RULES = REPO / "sidecar" / "monitoring" / "recording-rules.yaml"
CLEAN = {k: v for k, v in os.environ.items() if not k.startswith(("MESHSCOPE_", "JOB_COMPLETION", "PET_"))}

JOB_NAME = "e2e"
STEPS = 24
PAUSE_S = 0.25  # each step's forward phase sleeps this long: a step spans about one scrape at 1 s / 4
SCRAPE_S = 1.0
RANKS = 4
NCCL_FILES = ("nccl.node-0.4101", "nccl.node-0.4102", "nccl.node-0.4103", "rank3.stdout.log")
"""The fixture's files of ranks 0-3 (pids 4101-4104), tests/data/sidecar/nccl/README.md."""
MiB = 1 << 20


# ---------------------------------------------------------------------------------------------------- the parts


def _serve(body: bytes) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        body: bytes = r.read()
        return body


def _wait(what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


class Sidecar:
    """A running ``meshscope-sidecar`` with its stderr read in a thread (port, warnings)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshscope_sidecar", "--host", "127.0.0.1", "--port", "0"],
            env={**CLEAN, **env},
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.port: int | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        _wait("the sidecar to serve", lambda: self.port is not None or self.proc.poll() is not None, 30)
        if self.port is None:
            pytest.fail("the sidecar exited without serving:\n" + "".join(self.lines))

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"serving /metrics, /v1/steps, /healthz on 127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.reader.join(timeout=5)
            if self.proc.stderr is not None:
                self.proc.stderr.close()


def _launch_ranks(tmp: Path, socks: list[str]) -> list[subprocess.Popen[bytes]]:
    layout = parse_layout("tp=2,dp=2")  # stage 0 of tp=2,pp=2,dp=2: ranks 0-3 have the same coords in both
    settings = RunSettings(nproc=RANKS, command=("python", str(JOB)), layout=layout, out_dir=tmp, job=JOB_NAME)
    placement = Placement.default(RANKS, gpus_per_node=RANKS, nvlink_domain_gpus=RANKS, nodes_per_network_block=1)
    master = free_port()
    procs = []
    for r in range(RANKS):
        env = rank_env(settings, r, port=master, collector=socks[r], placement=placement)
        env = {k: v for k, v in env.items() if not k.startswith("JOB_COMPLETION")}
        env["MESHSCOPE_NODE"] = "gpu-node-07"
        procs.append(subprocess.Popen([sys.executable, str(JOB), str(STEPS), str(PAUSE_S)], env=env, cwd=tmp))
    return procs


def _nccl_logs_of(pids: list[int], out: Path) -> dict[int, Path]:
    """The fixture's logs as the gloo ranks' processes would have written them: their host name and pids."""
    host = nccl_host(socket.gethostname())
    paths = {}
    for rank, (name, pid) in enumerate(zip(NCCL_FILES, pids, strict=True)):
        text = (DATA / "nccl" / "logs" / name).read_bytes()
        paths[rank] = out / f"nccl.{host}.{pid}"
        paths[rank].write_bytes(text.replace(f"node-0:{4101 + rank}:".encode(), f"{host}:{pid}:".encode()))
    return paths


def _bump(path: Path, by: int) -> None:
    path.write_text(f"{int(path.read_text()) + by}\n")


# ---------------------------------------------------------------------------------------------------- by hand


def _union_s(spans: list[tuple[int, int]]) -> float:
    """Length of the union of ``[start, end)`` spans (µs), in seconds."""
    total, end = 0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e6


def _exposed_s(comm: list[tuple[int, int]], busy: list[tuple[int, int]]) -> float:
    """Time in ``comm`` spans while none of ``busy`` runs, seconds."""
    return _union_s(comm + busy) - _union_s(busy)


def _per_step(record: dict[str, Any]) -> dict[str, float]:
    ivs = record["intervals"]
    busy = [(i["start_us"], i["end_us"]) for i in ivs if i["kind"] in {"compute", "optimizer", "data", "checkpoint"}]
    out = {
        "step": (record["end_us"] - record["start_us"]) / 1e6,
        "compute": _union_s([(i["start_us"], i["end_us"]) for i in ivs if i["kind"] == "compute"]),
    }
    for axis in ("tp", "dp"):
        comm = [(i["start_us"], i["end_us"]) for i in ivs if i["kind"] == "comm" and i.get("axis") == axis]
        out[f"exposed_{axis}"] = _exposed_s(comm, busy)
    tp = [(i["start_us"], i["end_us"]) for i in ivs if i["kind"] == "comm" and i.get("axis") == "tp"]
    dp = [(i["start_us"], i["end_us"]) for i in ivs if i["kind"] == "comm" and i.get("axis") == "dp"]
    assert _union_s(tp + dp) == pytest.approx(_union_s(tp) + _union_s(dp))  # no two axes share idle time here
    return out


# ---------------------------------------------------------------------------------------------------- the test


@pytest.fixture
def parts(tmp_path: Path, sock_dir: Path) -> Iterator[dict[str, Any]]:
    """Everything started, torn down whatever happens."""
    dcgm = _serve((DATA / "dcgm" / "h100_8gpu_default.prom").read_bytes())
    ib_root = tmp_path / "infiniband"
    shutil.copytree(DATA / "infiniband" / "class_infiniband", ib_root, symlinks=True)
    nccl_dir = tmp_path / "nccl"
    nccl_dir.mkdir()
    socks = [f"{sock_dir}/rank-{r}.sock" for r in range(RANKS)]
    env = {
        "MESHSCOPE_JOB": JOB_NAME,
        "MESHSCOPE_NODE_NAME": "gpu-node-07",
        "MESHSCOPE_LAYOUT": "tp=2,pp=2,dp=2",
        "MESHSCOPE_GPUS_PER_NODE": "4",
        "MESHSCOPE_NODE_RANK": "0",
        "MESHSCOPE_NVLINK_DOMAIN": "nvl-7",
        "MESHSCOPE_NETWORK_TIER": "block-1",
        "MESHSCOPE_SIDECAR_SOCKETS": ",".join(f"unix:{s}" for s in socks),
        "MESHSCOPE_SIDECAR_TRAIN_POLL_SECONDS": "0.25",
        "MESHSCOPE_SIDECAR_DCGM_URL": f"http://127.0.0.1:{dcgm.server_address[1]}/metrics",
        "MESHSCOPE_SIDECAR_DCGM_POLL_SECONDS": "0.5",
        "MESHSCOPE_SIDECAR_NVML": "off",
        "MESHSCOPE_SIDECAR_NCCL_LOGS": f"{nccl_dir}/nccl.%h.%p",
        "MESHSCOPE_SIDECAR_NCCL_POLL_SECONDS": "0.5",
        "MESHSCOPE_SIDECAR_INFINIBAND_ROOT": str(ib_root),
        "MESHSCOPE_SIDECAR_INFINIBAND_RAILS": "mlx5_1:1=0,mlx5_0:1=1",
        "MESHSCOPE_SIDECAR_INFINIBAND_POLL_SECONDS": "0.5",
    }
    sidecar = Sidecar(env)
    prom: Service | None = None
    ranks: list[subprocess.Popen[bytes]] = []
    try:
        assert sidecar.port is not None
        prom = start_prometheus(
            tmp_path / "prometheus", targets=[f"127.0.0.1:{sidecar.port}"], rule_files=[RULES], interval_s=SCRAPE_S
        )
        prom.wait_for(
            "a scrape of the ranks' counters at 0",
            lambda: len(prom.query(f'meshscope_steps_total{{job="{JOB_NAME}"}} == 0')) == RANKS,
        )
        ranks = _launch_ranks(tmp_path, socks)
        yield {"sidecar": sidecar, "prom": prom, "ranks": ranks, "nccl_dir": nccl_dir, "ib_root": ib_root}
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
        if prom is not None:
            prom.stop()
        code = sidecar.stop()
        dcgm.shutdown()
        dcgm.server_close()
        assert code == 0, "".join(sidecar.lines)


def _values(prom: Service, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in prom.query(expr)}


def _one(prom: Service, expr: str) -> float:
    got = prom.query(expr)
    assert len(got) == 1, (expr, got)
    return float(got[0]["value"][1])


@pytest.mark.slow
def test_every_source_through_prometheus_and_the_recording_rules(parts: dict[str, Any]) -> None:
    sidecar, prom, ranks = parts["sidecar"], parts["prom"], parts["ranks"]
    nccl = _nccl_logs_of([p.pid for p in ranks], parts["nccl_dir"])
    ib: Path = parts["ib_root"]
    _wait("a first InfiniBand poll", lambda: b"meshscope_network_port_active" in _get(sidecar.port, "/metrics"), 30)
    _bump(ib / "mlx5_0" / "ports" / "1" / "counters" / "port_rcv_errors", 2)
    _bump(ib / "mlx5_1" / "ports" / "1" / "hw_counters" / "np_cnp_sent", 7)
    # Two more TP all-reduces of 8 MiB on ranks 0 and 2 (rank 1's file ends inside a line: its process died).
    for rank in (0, 2):
        tp_lines = [x for x in nccl[rank].read_text().splitlines() if "count 4194304 datatype 9 op 0" in x]
        with nccl[rank].open("a") as f:
            f.write("\n".join(tp_lines[:2]) + "\n")
    assert [p.wait(timeout=120) for p in ranks] == [0] * RANKS

    total = RANKS * STEPS
    _wait(
        "Prometheus to scrape every step",
        lambda: (
            prom.query(f'sum(meshscope_steps_total{{job="{JOB_NAME}"}})') != []
            and _one(prom, f'sum(meshscope_steps_total{{job="{JOB_NAME}"}})') == total
        ),
    )
    full_at = time.time()
    _wait(
        "the rules evaluated over the final counts",
        lambda: any(
            float(r["value"][1]) > full_at + SCRAPE_S
            for r in prom.query("timestamp(job:meshscope_step_seconds:max_rate5m)")
        ),
    )
    records = [json.loads(x) for x in _get(sidecar.port, "/v1/steps").splitlines()]
    assert sorted((r["rank"], r["step"]) for r in records) == [(r, s) for r in range(RANKS) for s in range(STEPS)]

    # ---- every source's series, tagged with the identity's coordinates
    layout = parse_layout("tp=2,pp=2,dp=2")
    up = _values(prom, f'meshscope_source_up{{job="{JOB_NAME}"}}')
    assert {dict(k)["source"]: v for k, v in up.items()} == {
        "train_events": 1.0,
        "dcgm": 1.0,
        "nccl_log": 1.0,
        "infiniband": 1.0,
    }
    for metric in ("meshscope_steps_total", "meshscope_gpu_utilization_ratio", "meshscope_nccl_bytes_total"):
        series = [dict(k) for k in _values(prom, f'{metric}{{job="{JOB_NAME}"}}')]
        assert {s["rank"] for s in series} == {"0", "1", "2", "3"}, metric
        for s in series:
            c = layout.coord(int(s["rank"]))
            assert (s["dp"], s["tp"], s["pp"], s["cp"], s["ep"], s["gpu"]) == (
                str(c.dp),
                str(c.tp),
                str(c.pp),
                "0",
                "0",
                s["rank"],
            ), (metric, s)
            assert (s["node"], s["nvlink_domain"], s["network_tier"]) == ("gpu-node-07", "nvl-7", "block-1")
    ports = {dict(k)["device"]: dict(k)["rail_gpu"] for k in _values(prom, "meshscope_network_port_active")}
    assert ports == {"mlx5_0": "1", "mlx5_1": "0"}

    # ---- step time per rank, from the job's records. The sidecar exports its ranks' counters from 0 before the
    # first step, and Prometheus scraped those zeros before the job started: each rate() ratio is then exactly the
    # job's totals over its steps (no extrapolation to a zero point at the series' start).
    by_rank: dict[int, list[dict[str, float]]] = {r: [] for r in range(RANKS)}
    for rec in sorted(records, key=lambda x: x["step"]):
        by_rank[rec["rank"]].append(_per_step(rec))
    per_rank: dict[str, list[float]] = {"step": [], "exposed_tp": [], "exposed_dp": [], "compute": []}
    for r in range(RANKS):
        steps = by_rank[r]
        per_rank["step"].append(sum(x["step"] for x in steps) / STEPS)
        per_rank["exposed_tp"].append(sum(x["exposed_tp"] for x in steps) / STEPS)
        per_rank["exposed_dp"].append(sum(x["exposed_dp"] for x in steps) / STEPS)
        per_rank["compute"].append(sum(x["compute"] for x in steps) / sum(x["step"] for x in steps))
    tolerance = 1e-9
    rel = pytest.approx
    assert _one(prom, "job:meshscope_step_seconds:max_rate5m") == rel(max(per_rank["step"]), rel=tolerance)
    median = float(np.quantile(per_rank["step"], 0.5))  # PromQL's quantile interpolates as numpy's "linear" does
    assert _one(prom, "job:meshscope_step_seconds:median_rate5m") == rel(median, rel=tolerance)
    assert min(per_rank["step"]) > PAUSE_S

    # ---- exposed communication per axis (the job's collectives are synchronous: all of a collective's time that
    # no compute, optimizer, data or checkpoint interval covers)
    exposed = {
        dict(k)["axis"]: v for k, v in _values(prom, "job_axis:meshscope_exposed_comm_seconds:mean_rate5m").items()
    }
    assert exposed.pop("pp") == 0.0  # stage 0 alone: no pipeline traffic (the series exists from the start)
    assert set(exposed) == {"tp", "dp"}
    for axis in ("tp", "dp"):
        want = float(np.mean(per_rank[f"exposed_{axis}"]))
        assert exposed[axis] == rel(want, rel=tolerance, abs=1e-6), axis

    # ---- reported utilisation (DCGM GPU_UTIL of GPUs 0-3: 100 %) against useful compute (the compute share)
    compute_share = float(np.mean(per_rank["compute"]))
    assert 0.5 < compute_share < 1.0  # the sleep in the forward phase
    assert _one(prom, "job:meshscope_gpu_utilization_ratio:avg5m") == 1.0
    assert _one(prom, "job:meshscope_gpu_tensor_active_ratio:avg5m") == rel(0.41)
    assert _one(prom, "job:meshscope_compute_share:ratio_rate5m") == rel(compute_share, rel=tolerance)
    assert _one(prom, "job:meshscope_utilization_gap:ratio_rate5m") == rel(1.0 - compute_share, rel=1e-6)

    # ---- NCCL bytes per axis, the fixture's hand-counted table (tests/data/sidecar/nccl/README.md), plus the two
    # 8 MiB TP all-reduces appended to ranks 0 and 2
    nccl_bytes = {
        (int(dict(k)["rank"]), dict(k)["axis"], dict(k)["op"]): v
        for k, v in _values(prom, f'meshscope_nccl_bytes_total{{job="{JOB_NAME}"}}').items()
    }
    for rank in range(RANKS):
        tp = 33_554_432 + (2 * 8 * MiB if rank in {0, 2} else 0)
        want = {
            (rank, "tp", "all_reduce"): tp,
            (rank, "pp", "send"): 4_194_304,
            (rank, "pp", "recv"): 4_194_304,
            (rank, "dp", "reduce_scatter"): 16_777_216,
            (rank, "dp", "all_gather"): 8_388_608 if rank != 3 else 4_194_304,
            (rank, "world", "all_reduce"): 24 if rank != 3 else 28,
            (rank, "world", "broadcast"): 1_024,
        }
        assert {k: v for k, v in nccl_bytes.items() if k[0] == rank} == want, rank
    calls = _values(prom, f'meshscope_nccl_collectives_total{{job="{JOB_NAME}",axis="tp",op="all_reduce"}}')
    assert {dict(k)["rank"]: v for k, v in calls.items()} == {"0": 6, "1": 4, "2": 6, "3": 4}

    # ---- the network: the counters moved by hand since the sidecar started
    errors = _values(prom, 'meshscope_network_errors_total{device="mlx5_0",counter="port_rcv_errors"}')
    assert list(errors.values()) == [2.0]
    cnp = _values(prom, 'meshscope_network_congestion_total{device="mlx5_1",counter="np_cnp_sent"}')
    assert list(cnp.values()) == [7.0]
    assert _one(prom, f'job_source:meshscope_source_up:ratio{{job="{JOB_NAME}",source="nccl_log"}}') == 1.0

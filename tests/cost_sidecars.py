"""Real sidecars for the cost table's tests: ``meshscope-sidecar`` processes, one per emulated pod, fed with the
step records of a simulated job over their real record sockets.

The job (:func:`job_manifest`): Llama 3 8B, tp=2 and dp=ranks/2 on nodes of 4 GPUs, simulated by the core's
simulator with rank 5 computing 1.5x as long (a straggler). Sidecar ``i`` is node rank ``i`` (ranks ``4i..4i+3``),
listens on ``host:port`` and gets exactly its ranks' records, oldest step first, through ``RecordSender`` (the
SDK's own transport). Everything started is stopped by the context manager, whatever happens.

Importable by name (``tests/`` is on the path; ``tests/operator`` cannot be a package called ``operator``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshscope.jobs import spec_from_manifest
from meshscope.records import write_records
from meshscope.sdk import RecordSender
from meshscope.simulation import Straggler, simulate

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from meshscope.jobs import JobSpec
    from meshscope.records import RecordTable

JOB = "tiny"
NAMESPACE = "training"
GPUS_PER_NODE = 4
STEPS = 6
TIMEOUT_S = 30.0
CLEAN = {k: v for k, v in os.environ.items() if not k.startswith(("MESHSCOPE_", "JOB_COMPLETION", "PET_"))}


def job_manifest(nodes: int) -> dict[str, Any]:
    """The TrainingJob of the simulated job: ``nodes`` nodes of 4 H100s, tp=2, dp fills the rest."""
    dp = nodes * GPUS_PER_NODE // 2
    return {
        "apiVersion": "meshscope.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {
            "name": JOB,
            "namespace": NAMESPACE,
            "uid": "6f1d0c1e-uid-of-tiny",
            "generation": 1,
            "resourceVersion": "1",
        },
        "spec": {
            "model": {"preset": "llama3-8b"},
            "parallelism": {"tp": 2, "dp": dp},
            "training": {"microBatchSize": 1, "globalBatchSize": dp, "distributedOptimizer": True},
            "hardware": {"gpu": "H100", "nodes": nodes, "gpusPerNode": GPUS_PER_NODE},
        },
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """The simulated job: its spec, its records as a table and as JSON lines per rank."""

    spec: JobSpec
    table: RecordTable
    lines: list[bytes]
    """Every record line, steps in order."""

    def lines_of(self, ranks: Sequence[int]) -> list[bytes]:
        """The lines of ``ranks``, oldest step first."""
        wanted = set(ranks)
        return [line for line in self.lines if json.loads(line)["rank"] in wanted]


def simulated_job(nodes: int, workdir: Path) -> Job:
    """Simulate the job (straggler on rank 5) and write its records once."""
    spec = spec_from_manifest(job_manifest(nodes))
    result = simulate(spec, steps=STEPS, faults=[Straggler(rank=5, factor=1.5)])
    path = workdir / "records.jsonl"
    write_records(path, result.table)
    lines = path.read_bytes().splitlines(keepends=True)
    lines.sort(key=lambda x: (json.loads(x)["step"], json.loads(x)["rank"]))
    return Job(spec=spec, table=result.table, lines=lines)


class Sidecar:
    """A running ``meshscope-sidecar`` for one node of the job, its stderr read in a thread."""

    def __init__(self, *, node_rank: int, host: str, port: int, socket_path: str) -> None:
        """Start it on ``host:port`` (0: a free port), reading records from ``socket_path``."""
        env = {
            **CLEAN,
            "MESHSCOPE_JOB": JOB,
            "MESHSCOPE_NODE_NAME": f"node-{node_rank}",
            "MESHSCOPE_NODE_RANK": str(node_rank),
            "MESHSCOPE_LAYOUT": "",  # set below from the job's layout
            "MESHSCOPE_GPUS_PER_NODE": str(GPUS_PER_NODE),
            "MESHSCOPE_SIDECAR_SOCKETS": f"unix:{socket_path}",
            "MESHSCOPE_SIDECAR_TRAIN_POLL_SECONDS": "0.2",
            "MESHSCOPE_SIDECAR_NVML": "off",
            "MESHSCOPE_SIDECAR_INFINIBAND": "off",
        }
        self.env = env
        self.socket_path = socket_path
        self.host = host
        self.requested_port = port
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self.port: int | None = None
        self.reader: threading.Thread | None = None

    def start(self, layout: str) -> None:
        """Start the process and wait (bounded) until it serves."""
        self.env["MESHSCOPE_LAYOUT"] = layout
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshscope_sidecar", "--host", self.host, "--port", str(self.requested_port)],
            env=self.env,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def wait_serving(self) -> None:
        """Until the log says where it listens; fails with its log when it exits or takes too long."""
        deadline = time.monotonic() + TIMEOUT_S
        while self.port is None:
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the sidecar did not serve:\n" + "".join(self.lines))
            time.sleep(0.05)

    def _read(self) -> None:
        assert self.proc is not None
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"serving /metrics, /v1/steps, /healthz on [0-9.]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def feed(self, lines: Sequence[bytes]) -> None:
        """Send ``lines`` as the SDK does (one datagram each), retrying a full socket until a deadline."""
        sender = RecordSender(f"unix:{self.socket_path}")
        try:
            deadline = time.monotonic() + TIMEOUT_S
            for line in lines:
                message = json.loads(line)
                while not sender.send(message):
                    if time.monotonic() > deadline:
                        raise AssertionError(f"the sidecar took no record: {sender.last_error}")
                    time.sleep(0.01)
        finally:
            sender.close()

    def steps_kept(self) -> int:
        """Records ``/v1/steps`` serves now."""
        with urllib.request.urlopen(self.url + "/v1/steps", timeout=10) as r:
            return len(r.read().splitlines())

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a deadline; joins the reader."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.reader is not None:
            self.reader.join(timeout=5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def layout_of(job: Job) -> str:
    """``MESHSCOPE_LAYOUT`` of the job."""
    layout = job.spec.layout
    return f"tp={layout.tp},dp={layout.dp},pp={layout.pp},cp={layout.cp}"


@contextlib.contextmanager
def sidecars(job: Job, hosts: Sequence[tuple[str, int]]) -> Iterator[list[Sidecar]]:
    """One running sidecar per ``(host, port)`` (node ranks 0, 1, ...), stopped on the way out. Not yet fed."""
    sock_dir = Path(tempfile.mkdtemp(prefix="ms-cost-", dir="/tmp"))  # Unix socket paths are limited to 108 bytes
    running: list[Sidecar] = []
    try:
        for node_rank, (host, port) in enumerate(hosts):
            s = Sidecar(node_rank=node_rank, host=host, port=port, socket_path=str(sock_dir / f"n{node_rank}.sock"))
            running.append(s)
            s.start(layout_of(job))
        for s in running:
            s.wait_serving()
        yield running
    finally:
        for s in running:
            s.stop()
        for p in sock_dir.iterdir():
            p.unlink(missing_ok=True)
        sock_dir.rmdir()


def feed_all(job: Job, running: Sequence[Sidecar]) -> None:
    """Every sidecar gets its node's records; waits (bounded) until each serves them all on ``/v1/steps``."""
    for node_rank, s in enumerate(running):
        s.feed(job.lines_of(range(node_rank * GPUS_PER_NODE, (node_rank + 1) * GPUS_PER_NODE)))
    deadline = time.monotonic() + TIMEOUT_S
    for s in running:
        while s.steps_kept() < GPUS_PER_NODE * STEPS:
            if time.monotonic() > deadline:
                raise AssertionError(f"sidecar {s.url} keeps {s.steps_kept()} records:\n" + "".join(s.lines))
            time.sleep(0.1)

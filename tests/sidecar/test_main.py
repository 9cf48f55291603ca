"""The entry point for real: one-line errors on bad settings, a degraded start, and a real 2-rank gloo job."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshscope.local.running import RunSettings, rank_env
from meshscope.topology import Placement, parse_layout

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "data" / "sidecar" / "job" / "tiny_gloo.py"
CLEAN = {k: v for k, v in os.environ.items() if not k.startswith(("MESHSCOPE_", "JOB_COMPLETION", "PET_"))}


def _sidecar(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "meshscope_sidecar", "--host", "127.0.0.1", "--port", "0", *args],
        env={**CLEAN, **env},
        stderr=subprocess.PIPE,
        text=True,
    )


def _port(proc: subprocess.Popen[str]) -> tuple[int, list[str]]:
    lines: list[str] = []
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"serving /metrics, /v1/steps, /healthz on 127\.0\.0\.1:(\d+)", line)
        if m:
            return int(m.group(1)), lines
    pytest.fail(f"the sidecar exited without serving: {''.join(lines)}")


def _get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.read()


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        (
            {"MESHSCOPE_SIDECAR_PORT": "http"},
            [],
            "MESHSCOPE_SIDECAR_PORT='http' is not a whole number >= 0 and <= 65535",
        ),
        ({"MESHSCOPE_LAYOUT": "tp=2,dp=x"}, [], "MESHSCOPE_LAYOUT='tp=2,dp=x': layout dp='x' is not a whole number"),
        ({"MESHSCOPE_JOB": ""}, [], "MESHSCOPE_JOB is not set"),
        ({}, ["--socket", "tcp://x:1"], "--socket: collector address 'tcp://x:1' is not 'unix:/absolute/path'"),
        ({}, ["--frobnicate"], "unrecognized arguments: --frobnicate"),
        ({"MESHSCOPE_SIDECAR_REQUIRE_RANKS": "1"}, [], "MESHSCOPE_SIDECAR_REQUIRE_RANKS is set but ranks are unknown"),
        ({"MESHSCOPE_SIDECAR_TRAIN_POLL_SECONDS": "0"}, [], "is not a number of seconds in [0.01, 3600]"),
    ],
    ids=["port", "layout", "job", "socket", "flag", "require-ranks", "poll"],
)
def test_bad_settings_exit_with_one_line_and_no_traceback(env: dict[str, str], args: list[str], message: str) -> None:
    base = {"MESHSCOPE_JOB": "j", "MESHSCOPE_NODE_NAME": "n"}
    proc = subprocess.run(
        [sys.executable, "-m", "meshscope_sidecar", *args],
        env={**CLEAN, **base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("meshscope-sidecar: error: ")
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_degraded_start_serves_health_and_says_what_it_cannot_tag(tmp_path: Path) -> None:
    proc = _sidecar({"MESHSCOPE_JOB": "j", "MESHSCOPE_NODE_NAME": "n"}, "--socket", f"unix:{tmp_path}/r.sock")
    try:
        port, lines = _port(proc)
        warning = next(x for x in lines if "degraded: per-rank series are not exported" in x)
        assert "MESHSCOPE_LAYOUT is not set" in warning
        health = json.loads(_get(port, "/healthz"))
        assert health["mode"] == "degraded"
        assert any("MESHSCOPE_GPUS_PER_NODE is not set" in m for m in health["cannot_tag"])
        metrics = _get(port, "/metrics").decode()
        assert re.search(r'meshscope_sidecar_info\{.*mode="degraded".*\} 1\.0', metrics)
        assert re.search(r'meshscope_source_up\{.*source="train_events"\} 1\.0', metrics)
    finally:
        assert _stop(proc) == 0


def _families(text: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        out[fam.name].extend(fam.samples)
    return out


@pytest.mark.slow
def test_a_real_two_rank_gloo_job_sends_to_the_sidecar(tmp_path: Path) -> None:
    steps = 6
    socks = [f"{tmp_path}/rank-{r}.sock" for r in range(2)]  # one per rank, as sidecar/README.md advises
    layout = parse_layout("dp=2")
    identity = {
        "MESHSCOPE_JOB": "sidecar-e2e",
        "MESHSCOPE_NODE_NAME": "node-0",
        "MESHSCOPE_LAYOUT": "dp=2",
        "MESHSCOPE_GPUS_PER_NODE": "2",
        "JOB_COMPLETION_INDEX": "0",
    }
    proc = _sidecar(identity, "--socket", f"unix:{socks[0]}", "--socket", f"unix:{socks[1]}")
    ranks: list[subprocess.Popen[bytes]] = []
    try:
        port, _ = _port(proc)
        settings = RunSettings(
            nproc=2, command=("python", str(JOB)), layout=layout, out_dir=tmp_path, job="sidecar-e2e"
        )
        placement = Placement.default(2, gpus_per_node=2, nvlink_domain_gpus=2, nodes_per_network_block=1)
        master = _free_port()
        for r in range(2):
            env = rank_env(settings, r, port=master, collector=socks[r], placement=placement)
            env = {k: v for k, v in env.items() if not k.startswith("JOB_COMPLETION")}
            env["MESHSCOPE_NODE"] = "node-0"
            ranks.append(subprocess.Popen([sys.executable, str(JOB), str(steps)], env=env, cwd=tmp_path))
        codes = [p.wait(timeout=240) for p in ranks]
        assert codes == [0, 0]
        deadline = time.monotonic() + 20
        while True:
            fams = _families(_get(port, "/metrics").decode())
            done = [s for s in fams.get("meshscope_steps", []) if s.name == "meshscope_steps_total"]
            if sum(s.value for s in done) >= 2 * steps or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        records = [json.loads(x) for x in _get(port, "/v1/steps").splitlines()]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
        assert _stop(proc) == 0
    by_rank = {s.labels["rank"]: s for s in fams["meshscope_steps"] if s.name == "meshscope_steps_total"}
    dropped = [s.value for s in fams.get("meshscope_records_dropped", []) if s.name.endswith("_total")]
    assert dropped == [0.0, 0.0]  # the SDK could send every record (else the counts below would be short)
    assert {r: s.value for r, s in by_rank.items()} == {"0": steps, "1": steps}
    for rank in ("0", "1"):
        labels = by_rank[rank].labels
        coord = layout.coord(int(rank))
        assert (labels["dp"], labels["tp"], labels["pp"], labels["gpu"]) == (str(coord.dp), "0", "0", rank)
        assert (labels["job"], labels["node"]) == ("sidecar-e2e", "node-0")
        step_s = next(
            s.value for s in fams["meshscope_step_seconds"] if s.name.endswith("_total") and s.labels["rank"] == rank
        )
        parts = [
            s for s in fams["meshscope_breakdown_seconds"] if s.name.endswith("_total") and s.labels["rank"] == rank
        ]
        assert {s.labels["category"] for s in parts} >= {"compute", "exposed_comm", "optimizer", "other"}
        assert {s.labels["axis"] for s in parts if s.labels["category"] == "exposed_comm"} == {"dp"}
        assert abs(sum(s.value for s in parts) - step_s) < 1e-6
        assert step_s > 0
        collectives = [
            s for s in fams["meshscope_collectives"] if s.name.endswith("_total") and s.labels["rank"] == rank
        ]
        assert {(s.labels["axis"], s.labels["op"]) for s in collectives} == {("dp", "all_reduce")}
        assert sum(s.value for s in collectives) == 2 * steps  # weight and bias, every step
    assert sorted((r["rank"], r["step"]) for r in records) == [(r, s) for r in (0, 1) for s in range(steps)]


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

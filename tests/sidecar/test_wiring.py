"""Every source wired into the entry point: its settings, which sources run, and what each is told about the pod.

The settings are read from a plain environment mapping and a command line (no process); the sources are built by
:func:`meshscope_sidecar.__main__.build_sources` itself, so a setting that is parsed but not passed on fails here.
The NCCL source's ``(host, pid) -> rank`` map comes from real hello datagrams on a real socket.
"""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any

import pytest

from meshscope.sdk import RecordSender
from meshscope_sidecar.__main__ import build_sources
from meshscope_sidecar.identity import resolve_identity
from meshscope_sidecar.settings import SettingsError, Switch, settings_from
from meshscope_sidecar.sources.dcgm import DcgmSource
from meshscope_sidecar.sources.infiniband import InfinibandSource
from meshscope_sidecar.sources.nccl_log import NcclLogSource, nccl_host
from meshscope_sidecar.sources.nvml import NvmlSource
from meshscope_sidecar.sources.train_events import TrainEventsSource

if TYPE_CHECKING:
    from pathlib import Path

    from meshscope_sidecar.sources.base import Source

BASE = {
    "MESHSCOPE_JOB": "j",
    "MESHSCOPE_NODE_NAME": "gpu-node-07",
    "MESHSCOPE_LAYOUT": "tp=2,dp=2",
    "MESHSCOPE_GPUS_PER_NODE": "2",
    "MESHSCOPE_NODE_RANK": "1",
}


def _built(env: dict[str, str], sock_dir: Path, *args: str) -> list[tuple[Source, float]]:
    settings = settings_from(["--socket", f"unix:{sock_dir}/r.sock", *args], {**BASE, **env})
    return build_sources(settings, resolve_identity(settings.identity))


def _close(sources: list[tuple[Source, float]]) -> None:
    for s, _ in sources:
        s.close()


def test_defaults_run_the_training_loop_and_nothing_that_needs_a_setting(sock_dir: Path, tmp_path: Path) -> None:
    sources = _built(
        {"MESHSCOPE_SIDECAR_NVML": "off", "MESHSCOPE_SIDECAR_INFINIBAND_ROOT": str(tmp_path / "no")}, sock_dir
    )
    try:
        assert [(s.name, period) for s, period in sources] == [("train_events", 1.0)]
    finally:
        _close(sources)


def test_every_source_with_its_settings(sock_dir: Path, tmp_path: Path) -> None:
    env = {
        "MESHSCOPE_SIDECAR_DCGM_URL": "http://10.0.0.7:9400/metrics",
        "MESHSCOPE_SIDECAR_DCGM_TIMEOUT_SECONDS": "0.5",
        "MESHSCOPE_SIDECAR_DCGM_POLL_SECONDS": "15",
        "MESHSCOPE_SIDECAR_NVML": "on",
        "MESHSCOPE_SIDECAR_NVML_POLL_SECONDS": "20",
        "MESHSCOPE_SIDECAR_NCCL_LOGS": f"{tmp_path}/nccl.%h.%p, {tmp_path}/other",
        "MESHSCOPE_SIDECAR_NCCL_INSPECTOR": f"{tmp_path}/inspector",
        "MESHSCOPE_SIDECAR_NCCL_POLL_SECONDS": "2.5",
        "MESHSCOPE_SIDECAR_INFINIBAND": "on",
        "MESHSCOPE_SIDECAR_INFINIBAND_ROOT": str(tmp_path / "absent"),
        "MESHSCOPE_SIDECAR_INFINIBAND_RAILS": "mlx5_0:1=0, mlx5_3:2=1",
        "MESHSCOPE_SIDECAR_INFINIBAND_POLL_SECONDS": "30",
    }
    sources = _built(env, sock_dir)
    try:
        by_name = {s.name: (s, period) for s, period in sources}
        assert [s.name for s, _ in sources] == ["train_events", "dcgm", "nvml", "nccl_log", "infiniband"]
        dcgm, period = by_name["dcgm"]
        assert isinstance(dcgm, DcgmSource)
        assert (dcgm.url, dcgm.timeout_seconds, period) == ("http://10.0.0.7:9400/metrics", 0.5, 15.0)
        # node rank 1 of 2-GPU nodes: ranks 2 and 3 on local GPUs 0 and 1; the exporter's other GPUs are not ours
        assert dcgm.hostname == "gpu-node-07"
        assert (dcgm._gpu_indices, dcgm._gpu_uuids) == (frozenset({0, 1}), frozenset())
        assert isinstance(by_name["nvml"][0], NvmlSource)
        assert by_name["nvml"][1] == 20.0
        nccl, period = by_name["nccl_log"]
        assert isinstance(nccl, NcclLogSource)
        assert period == 2.5
        assert nccl._logs.paths == [f"{tmp_path}/nccl.*.*", f"{tmp_path}/other"]
        assert nccl._inspector is not None
        assert nccl._inspector.paths == [f"{tmp_path}/inspector"]
        assert nccl._mapper is not None
        assert nccl._mapper.world_size == 4
        ib, period = by_name["infiniband"]
        assert isinstance(ib, InfinibandSource)
        assert (str(ib.root), ib._rails, ib._gpu_count, period) == (
            str(tmp_path / "absent"),
            {("mlx5_0", 1): 0, ("mlx5_3", 2): 1},
            2,
            30.0,
        )
        # Absent inputs are the sources' state, not a failure: a poll reports it.
        ib.poll()
        nccl.poll()
        assert not ib.health.up
        assert "cannot list" in (ib.health.last_error or "")
        assert not nccl.health.up
        assert "no NCCL log file matches" in (nccl.health.last_error or "")
    finally:
        _close(sources)


def test_the_dcgm_host_filter_can_be_named_or_lifted(sock_dir: Path) -> None:
    url = {"MESHSCOPE_SIDECAR_DCGM_URL": "http://localhost:9400/metrics", "MESHSCOPE_SIDECAR_NVML": "off"}
    for value, expected in (("h200-node-2", "h200-node-2"), ("*", None)):
        sources = _built({**url, "MESHSCOPE_SIDECAR_DCGM_HOSTNAME": value}, sock_dir)
        try:
            dcgm = next(s for s, _ in sources if isinstance(s, DcgmSource))
            assert dcgm.hostname == expected
        finally:
            _close(sources)


def test_a_degraded_identity_keeps_every_gpu_of_the_exporter(sock_dir: Path) -> None:
    env = {"MESHSCOPE_GPUS_PER_NODE": "", "MESHSCOPE_SIDECAR_DCGM_URL": "http://localhost:9400/metrics"}
    sources = _built(env, sock_dir)
    try:
        dcgm = next(s for s, _ in sources if isinstance(s, DcgmSource))
        ib = next((s for s, _ in sources if isinstance(s, InfinibandSource)), None)
        assert dcgm._gpu_indices is None
        assert ib is None or ib._gpu_count is None
    finally:
        _close(sources)


def test_infiniband_auto_runs_where_the_root_exists(sock_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "ib").mkdir()
    for root, runs in ((tmp_path / "ib", True), (tmp_path / "none", False)):
        sources = _built({"MESHSCOPE_SIDECAR_INFINIBAND_ROOT": str(root), "MESHSCOPE_SIDECAR_NVML": "off"}, sock_dir)
        try:
            assert any(s.name == "infiniband" for s, _ in sources) is runs
        finally:
            _close(sources)
    sources = _built({"MESHSCOPE_SIDECAR_INFINIBAND": "off", "MESHSCOPE_SIDECAR_NVML": "off"}, sock_dir)
    try:
        assert [s.name for s, _ in sources] == ["train_events"]
    finally:
        _close(sources)


def test_the_command_line_wins_over_the_environment(tmp_path: Path) -> None:
    env = {**BASE, "MESHSCOPE_SIDECAR_DCGM_URL": "http://a:1/metrics", "MESHSCOPE_SIDECAR_NCCL_LOGS": "/x"}
    s = settings_from(["--dcgm-url", "http://b:2/m", "--nccl-logs", f"{tmp_path}/a", "--nccl-logs", "/b/*"], env)
    assert (s.dcgm_url, s.nccl_logs) == ("http://b:2/m", (f"{tmp_path}/a", "/b/*"))
    d = settings_from([], BASE)
    assert (d.dcgm_url, d.nvml, d.nccl_logs, d.infiniband, d.infiniband_root) == (
        None,
        Switch.AUTO,
        (),
        Switch.AUTO,
        "/sys/class/infiniband",
    )
    assert (d.dcgm_poll_s, d.nvml_poll_s, d.nccl_poll_s, d.infiniband_poll_s, d.dcgm_timeout_s) == (10, 10, 5, 10, 2)


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        ({"MESHSCOPE_SIDECAR_DCGM_URL": "https://x:9400/metrics"}, [], "is not an http:// URL"),
        ({}, ["--dcgm-url", "localhost:9400"], "--dcgm-url='localhost:9400' is not an http:// URL"),
        ({"MESHSCOPE_SIDECAR_DCGM_URL": "http://x:port/m"}, [], "has a port that is not a number"),
        ({"MESHSCOPE_SIDECAR_DCGM_TIMEOUT_SECONDS": "-1"}, [], "MESHSCOPE_SIDECAR_DCGM_TIMEOUT_SECONDS='-1' is not"),
        ({"MESHSCOPE_SIDECAR_NVML": "maybe"}, [], "MESHSCOPE_SIDECAR_NVML='maybe' is not one of auto, on, off"),
        ({"MESHSCOPE_SIDECAR_INFINIBAND": "yes"}, [], "MESHSCOPE_SIDECAR_INFINIBAND='yes' is not one of auto"),
        ({"MESHSCOPE_SIDECAR_NCCL_POLL_SECONDS": "soon"}, [], "MESHSCOPE_SIDECAR_NCCL_POLL_SECONDS='soon'"),
        ({"MESHSCOPE_SIDECAR_INFINIBAND_RAILS": "mlx5_0=1"}, [], "'mlx5_0=1' is not device:port=gpu"),
        ({"MESHSCOPE_SIDECAR_INFINIBAND_RAILS": "mlx5_0:1=0,mlx5_0:1=1"}, [], "port mlx5_0:1 is given twice"),
    ],
    ids=["https", "no-scheme", "port", "timeout", "nvml", "infiniband", "poll", "rails", "rails-twice"],
)
def test_bad_source_settings_name_the_variable(env: dict[str, str], args: list[str], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        settings_from(args, {**BASE, **env})
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def _nccl_line(pid: int, text: str) -> str:
    return f"{nccl_host(socket.gethostname())}:{pid}:{pid} [0] NCCL INFO {text}\n"


def _wait(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_the_ranks_hello_maps_nccl_processes_to_ranks(sock_dir: Path, tmp_path: Path) -> None:
    # One process of this pod (rank 3: node rank 1, local GPU 1) logs only its TP communicator: no world-size
    # communicator tells its rank, so without the hello it stays unmapped; the hello's pid maps it. Its TP group
    # {2, 3} and DP group {1, 3} both have rank 3 second; the placement (2 GPUs per node) and "nNodes 1" say TP.
    pid = 31337
    log = tmp_path / f"nccl.host.{pid}"
    log.write_text(
        _nccl_line(pid, "ncclCommInitRank comm 0x55aa00 rank 1 nranks 2 cudaDev 1 nvmlDev 1 busId 2a000 "
                        "commId 0x1234abcd - Init COMPLETE")
        + _nccl_line(pid, "comm 0x55aa00 rank 1 nRanks 2 nNodes 1 localRanks 2 localRank 1 MNNVL 0")
        + _nccl_line(pid, "AllReduce: opCount 0 sendbuff 0x7f01 recvbuff 0x7f02 count 1024 datatype 7 op 0 root 0 "
                          "comm 0x55aa00 [nranks=2] stream 0x5501")
    )  # fmt: skip
    sources = _built({"MESHSCOPE_SIDECAR_NCCL_LOGS": str(tmp_path), "MESHSCOPE_SIDECAR_NVML": "off"}, sock_dir)
    train = next(s for s, _ in sources if isinstance(s, TrainEventsSource))
    nccl = next(s for s, _ in sources if isinstance(s, NcclLogSource))
    sender = RecordSender(f"unix:{sock_dir}/r.sock")
    try:
        nccl.poll()
        assert nccl.stats.collectives == 1
        assert list(nccl.samples()) == []
        assert nccl.stats.unmapped_calls == 1
        hello = {"schema": "meshscope.sdk/1", "event": "hello", "job": "j", "rank": 3, "world_size": 4, "pid": pid}
        assert sender.send({**hello, "counters": {}})
        assert sender.send({**hello, "rank": 0, "pid": 999, "counters": {}})  # rank 0 is not this pod's
        _wait(lambda: train.process_ranks() == {pid: 3}, "the hello")
        nccl.poll()
        got = {(s.metric, s.rank, s.labels): s.value for s in nccl.samples()}
        assert got == {
            ("meshscope_nccl_collectives_total", 3, (("axis", "tp"), ("op", "all_reduce"))): 1.0,
            ("meshscope_nccl_bytes_total", 3, (("axis", "tp"), ("op", "all_reduce"))): 4096.0,  # 1024 x float32
            ("meshscope_nccl_communicators", 3, (("axis", "tp"),)): 1.0,
        }
        assert nccl.stats.unmapped_calls == 0
    finally:
        sender.close()
        _close(sources)

"""Fixtures for the SDK tests: real multi-process gloo jobs, forked from this (torch-importing) test process.

torch and its distributed stacks are imported once here, so that forked ranks start in milliseconds instead of paying
``import torch`` each (cpu-testbed.md §5.1). Every rank runs a test-supplied function and returns a JSON value; the
records its tracker sends are collected by a real :class:`~meshscope.sdk.transport.RecordCollector`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from invariants import check_records_file
from meshscope.sdk.transport import RecordCollector
from runs import socket_path
from torch_gate import files_without_torch

try:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives  # pre-imported for the forked ranks
    import torch.nn.parallel
except ImportError as exc:  # torch is the demo/dev extra: without it only the pure tests run, and say so
    collect_ignore = files_without_torch(
        "tests/sdk", ["test_capture.py", "test_tracker.py", "test_running.py", "test_run_failures.py"], exc
    )
    torch = dist = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Job:
    """What a forked job left behind."""

    results: list[Any]
    records_path: Path
    collector: RecordCollector | None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(autouse=True)
def _reset_sdk_state() -> Iterator[None]:
    """No test may leave patches installed or a tracker active (they would leak into later tests and forks)."""
    yield
    if torch is None:
        return
    from meshscope.sdk import capture, tracker  # noqa: PLC0415

    for t in tracker._ACTIVE_TRACKER:
        t.close()
    tracker._ACTIVE_TRACKER.clear()
    capture.uninstall()


def _rank_main(
    fn: Callable[[int, int], Any],
    rank: int,
    world: int,
    env: dict[str, str],
    out: Path,
    collector: RecordCollector | None,
    *,
    init: bool,
) -> None:
    """Body of a forked rank: become the rank, run ``fn``, leave its value in ``out``; never returns into pytest.

    ``init``: join the gloo process group before ``fn`` (else ``fn`` does, e.g. after starting its tracker).
    """
    code = 1
    try:
        if collector is not None:
            collector.close_inherited()
        warnings.simplefilter("ignore")
        os.environ.update(env)
        torch.set_num_threads(1)
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        out.write_text(json.dumps(fn(rank, world)))
        if dist.is_initialized():
            dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: BLE001 - reported through the exit code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pids: list[int], timeout_s: float) -> dict[int, int]:
    """Exit codes by rank; ranks still running at the deadline are killed and left out."""
    deadline = time.monotonic() + timeout_s
    codes: dict[int, int] = {}
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for rank, pid in enumerate(pids):
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    for rank, pid in enumerate(pids):
        if rank not in codes:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return codes


@pytest.fixture
def fork_job(tmp_path: Path) -> Callable[..., Job]:
    """Run ``fn(rank, world)`` on ``world`` forked gloo ranks; returns their values and the collected records.

    Every collected record is checked against the invariants of real jobs (``tests/invariants.py``; ``every_step``:
    interval kinds each record must hold); ``init=False`` leaves ``init_process_group`` to ``fn``.
    """

    def run(
        fn: Callable[[int, int], Any],
        world: int,
        *,
        env: dict[str, str] | None = None,
        collect: bool = True,
        timeout_s: float = 60.0,
        every_step: tuple[str, ...] = (),
        init: bool = True,
    ) -> Job:
        port = _free_port()
        sock_dir = Path(tempfile.mkdtemp(prefix="ms-t-"))  # AF_UNIX paths must stay short
        paths = [sock_dir / f"r{r}.sock" for r in range(world)]
        records = tmp_path / "records.jsonl"
        collector = RecordCollector(paths, records) if collect else None
        pids = []
        for rank in range(world):
            rank_env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "MESHSCOPE_JOB": "test",
                "MESHSCOPE_COLLECTOR": f"unix:{paths[rank]}" if collect else f"unix:{sock_dir}/nobody.sock",
                **(env or {}),
            }
            pid = os.fork()
            if pid == 0:
                _rank_main(fn, rank, world, rank_env, tmp_path / f"result-{rank}.json", collector, init=init)
            pids.append(pid)
        if collector is not None:
            collector.start()
        try:
            codes = _wait(pids, timeout_s)
        finally:
            if collector is not None:
                time.sleep(0.1)
                collector.stop()
            shutil.rmtree(sock_dir, ignore_errors=True)
        assert len(codes) == world, f"ranks {sorted(set(range(world)) - set(codes))} timed out after {timeout_s} s"
        failed = {r: c for r, c in codes.items() if c}
        assert not failed, f"ranks failed with exit codes {failed} (tracebacks above)"
        results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(world)]
        check_records_file(records, every_step=every_step)  # waiting never inside compute (tests/invariants.py)
        return Job(results=results, records_path=records, collector=collector)

    return run


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, Path]]:
    """A bound datagram socket nobody reads until the test does (its queue fills up)."""
    path = socket_path("l", tmp_path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path.unlink(missing_ok=True)
    sock.bind(str(path))
    sock.setblocking(False)
    yield sock, path
    sock.close()
    path.unlink(missing_ok=True)

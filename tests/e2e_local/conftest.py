"""Real 8-rank CPU jobs of ``examples/train_tiny.py`` under ``meshscope run``.

Every job is the demo's (``running.demo_settings``: pp=2, dp=2, tp=2 on two emulated nodes of 4, emulated
accelerator, so timings and findings are deterministic on shared cores), launched by the real command line in a
subprocess (which imports torch once and forks the ranks). The clean run is shared by every test that only reads it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

from invariants import check_records_file
from runs import Run
from torch_gate import files_without_torch

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

try:
    import torch  # noqa: F401 - the demo extra; without it only the pure tests run
except ImportError as exc:
    collect_ignore = files_without_torch(
        "tests/e2e_local", ["test_faults.py", "test_clean_run.py", "test_variants.py"], exc
    )

STEPS = 5
"""Steps of every job: the first is warm-up, four are analysed."""
TIMEOUT_S = 120.0


def run_demo_job(
    out_dir: Path,
    *,
    steps: int = STEPS,
    straggler: str | None = None,
    imbalance: str | None = None,
    cp: bool = False,
    ep: bool = False,
    block_ms: float | None = None,
    layout: str | None = None,
    extra: tuple[str, ...] = (),
) -> Run:
    """``meshscope run`` of the demo job (``--report`` keeps the loss rank's losses) in a subprocess; ``cp`` and
    ``ep`` select the demo's context- and expert-parallel variants, ``block_ms`` the emulated accelerator's speed
    (forward ms of one block; the demo's default when ``None``), ``layout`` another layout of the 8 ranks. Every
    record it collected is checked against the invariants of real jobs (``tests/invariants.py``)."""
    from meshscope.local.running import demo_settings  # noqa: PLC0415
    from meshscope.topology import layout_text  # noqa: PLC0415

    settings = demo_settings(
        out_dir, steps=steps, straggler=straggler, imbalance=imbalance, cp=cp, ep=ep, block_ms=block_ms
    )
    command = [
        sys.executable, "-m", "meshscope", "run", "--nproc", str(settings.nproc), "--layout",
        layout or layout_text(settings.layout), "--gpus-per-node", "4", "--job", "demo", "--out", str(out_dir), "--",
        *settings.command, "--report", str(out_dir / "losses.json"), *extra,
    ]  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False)
    # no waiting sits inside compute (tests/invariants.py), and every step of a job that ran through stepped the
    # optimizer (ranks stopped after a rank died send the step they were in, cut short)
    check_records_file(out_dir / "records.jsonl", every_step=("optimizer",) if done.returncode == 0 else ())
    return Run(code=done.returncode, out=done.stdout + done.stderr, out_dir=out_dir)


@pytest.fixture
def tiny_run(tmp_path: Path) -> Callable[..., Run]:
    """Run the demo job with options (:func:`run_demo_job`); returns its :class:`Run`."""

    def run(**kwargs: Any) -> Run:
        return run_demo_job(tmp_path / "out", **kwargs)

    return run


@pytest.fixture(scope="session")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The clean demo job (pp=2, dp=2, tp=2, nothing injected), run once per session."""
    return run_demo_job(tmp_path_factory.mktemp("clean") / "out")


@pytest.fixture(scope="session")
def cp_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The demo's context-parallel variant (pp=2, cp=2, tp=2), run once per session."""
    return run_demo_job(tmp_path_factory.mktemp("cp") / "out", cp=True)


@pytest.fixture(scope="session")
def ep_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The demo's expert-parallel variant (pp=2, dp=2, tp=2, ep=2 with etp=1, MoE), run once per session."""
    return run_demo_job(tmp_path_factory.mktemp("ep") / "out", ep=True)


@pytest.fixture(scope="session")
def hsdp_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The demo job with hybrid sharding: pp=2, dp=4, FSDP2 over a (replicate 2, shard 2) mesh, run once per session."""
    return run_demo_job(tmp_path_factory.mktemp("hsdp") / "out", layout="pp=2,dp=4", extra=("--dp-shard", "2"))


SPIN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(1_000_000): pass"
"""A spinning process that ends when its parent does (a killed test run leaves no burner behind)."""


@pytest.fixture
def cpu_burner() -> Iterator[int]:
    """Foreign CPU load: one process spinning on every core this machine has, for the test's duration.

    Yields the number of burners. They run at the same priority as the job, so the ranks get a share of the cores
    only; timings stretch, and a clean run must still read clean.
    """
    n = os.cpu_count() or 2
    burners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    try:
        yield n
    finally:
        for p in burners:
            p.kill()
        for p in burners:
            p.wait()

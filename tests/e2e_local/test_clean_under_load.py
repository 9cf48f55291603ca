"""A clean run stays clean whatever the machine: beside foreign CPU load, and on an accelerator 2x faster or slower.

The detectors compare like with like (a rank with the rest of its stage, the pipeline bubble with the plan's fraction
of the measured compute) and set their thresholds from the run's own jitter; these runs prove it by construction
rather than by one lucky run on a quiet machine: the host's share of the step and the noise both change a lot
between them, the verdict must not.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from meshscope.local.cpus import FOREIGN_LOAD_SHARE

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import Run

pytestmark = pytest.mark.slow


def _clean(run: Run) -> None:
    assert run.code == 0, run.out[-3000:]
    assert run.findings == [], [f["message"] for f in run.findings]
    assert "Findings: none" in run.out


def test_a_clean_run_beside_a_cpu_burner_on_every_core_yields_no_finding(
    tiny_run: Callable[..., Run], cpu_burner: int
) -> None:
    assert cpu_burner >= 1
    run = tiny_run()
    _clean(run)
    # The burners took about half of every core: measured as foreign load, whatever the rank count.
    cpu = json.loads((run.out_dir / "collector.json").read_text())["cpu"]
    assert cpu["foreign_fraction"] >= FOREIGN_LOAD_SHARE, cpu
    assert cpu["contended"] is True
    assert any(n["code"] == "cpu_contention" for n in run.analysis["partial_data"]), run.analysis["partial_data"]


@pytest.mark.parametrize("block_ms", [20.0, 80.0], ids=["accelerator-2x-faster", "accelerator-2x-slower"])
def test_a_clean_run_on_a_faster_or_slower_accelerator_yields_no_finding(
    tiny_run: Callable[..., Run], block_ms: float
) -> None:
    run = tiny_run(block_ms=block_ms)
    _clean(run)
    compute = [r for r in run.analysis["expected_vs_measured"]["step_time_by_stage"] if r["category"] == "compute"]
    # The plan follows the emulated accelerator: 2 layers x 4 micro-batches x 3 passes x the block time on stage 0.
    assert compute[0]["expected_seconds"] == pytest.approx(2 * 4 * 3 * block_ms / 1000)

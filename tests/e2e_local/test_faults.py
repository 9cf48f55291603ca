"""Faults injected into the real 8-rank job are named by ``analyze``; losses are reported as partial data.

Emulated accelerator time makes the injected slowness deterministic on shared cores (cpu-testbed.md §5.2). Each
test is one job of a few steps.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from invariants import check_records_file
from meshscope.topology.layout import ParallelLayout

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from conftest import Run

pytestmark = pytest.mark.slow


def test_a_straggler_is_named_with_its_rank_and_cause(tiny_run: Callable[..., Run]) -> None:
    run = tiny_run(straggler="5:2", steps=4)
    assert run.code == 0, run.out[-3000:]
    top = run.findings[0]
    assert top["code"] == "straggler"
    assert top["suspects"][0]["rank"] == 5
    assert top["evidence"]["phase_is_compute"] == 1
    assert "rank 5 on node-1 is slow in compute" in run.out


@pytest.mark.parametrize("slow", [0, 1])
def test_a_slow_pipeline_stage_is_the_bubbles_suspect(tmp_path: Path, slow: int) -> None:
    """Pipeline parallelism alone (pp=2 on 2 ranks): a stage has no peers to be a straggler against, and the other
    stage's bubble is where its slowness shows. The bubble row names the slow stage's rank, whichever stage it is,
    not the rank that waits the most (before: the waiting stage's rank, "spends ... in pipeline bubble"), and the
    slow-pipeline-stage finding names the stage."""
    from meshscope.local.bundled import data_root  # noqa: PLC0415

    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "meshscope", "run", "--nproc", "2", "--layout", "pp=2", "--out", str(out), "-q", "--",
        sys.executable, str(data_root("examples") / "train_tiny.py"), "--steps", "5", "--emulate", "10",
        "--straggler", f"{slow}:3",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    check_records_file(out / "records.jsonl", every_step=("optimizer",))
    analysis = json.loads((out / "analysis.json").read_text(encoding="utf-8"))
    (bubble,) = (r for r in analysis["rows"] if r["category"] == "bubble")
    assert bubble["measured_median_seconds"] > 0
    assert bubble["worst_rank"] == 1 - slow  # the rank that waits the most is the other one
    assert bubble["suspect"]["rank"] == slow, bubble["suspect"]
    assert f"wait for pipeline stage {slow}" in bubble["suspect"]["message"]
    # and a finding says so: the stage, its rank, and what the other stage waits (before: no finding at all)
    assert [f["code"] for f in analysis["findings"]] == ["slow-pipeline-stage"], analysis["findings"]
    (f,) = analysis["findings"]
    assert f["evidence"]["stage"] == slow
    assert [s["rank"] for s in f["suspects"]] == [slow]
    assert f["evidence"]["planned"] == 1  # paced against the plan of the script's own description
    assert f["evidence"]["pace_ratio"] >= 1.5
    assert (
        0 < f["evidence"]["cost_seconds_per_step"] <= bubble["worst_seconds"]
    )  # the waiting stage's bubble carries it


def test_a_data_imbalance_is_named_with_a_rank_of_the_heavy_replica(tiny_run: Callable[..., Run]) -> None:
    run = tiny_run(imbalance="2:2", steps=4)
    assert run.code == 0, run.out[-3000:]
    layout = ParallelLayout(pp=2, dp=4)  # the demo's layout for an imbalance: a majority of normal replicas
    heavy = {r for r in range(8) if layout.coord(r).dp == layout.coord(2).dp}
    top = run.findings[0]
    assert top["code"] == "data-imbalance"
    assert top["suspects"][0]["rank"] in heavy
    assert top["evidence"]["tokens"] == pytest.approx(2 * top["evidence"]["median_tokens"])


def test_a_rank_that_dies_mid_run_stops_the_job_and_the_report_says_what_was_lost(
    tiny_run: Callable[..., Run],
) -> None:
    run = tiny_run(steps=4, extra=("--die", "3:2"))
    assert run.code == 3  # the job's own failure, unchanged
    # Rank 3 is named first. Its peers fail in their next collective (gloo: connection closed by peer): on a loaded
    # machine some exit by themselves before the launcher stops them, and the failed line lists those. Every one of
    # the other 7 ranks is either stopped or listed, never both, never neither.
    first = re.search(r"meshscope run: rank 3 exited with code 3(?:; stopped the other (\d+) ranks)?\n", run.out)
    assert first is not None, run.out[-3000:]
    listed = re.search(r"meshscope run: failed: (.*)\n", run.out)
    assert listed is not None, run.out[-3000:]
    by_themselves = {
        int(r) for r in re.findall(r"\d+", re.sub(r"(exited with code|killed by signal) \d+", "", listed[1]))
    }
    assert 3 in by_themselves
    assert int(first[1] or 0) + len(by_themselves - {3}) == 7, run.out[-3000:]
    assert "PARTIAL DATA" in run.out
    codes = {n["code"]: n for n in run.analysis["partial_data"]}
    assert "rank 3 exited with code 3 after 2 recorded steps" in codes["rank_failed"]["message"]
    assert (run.out_dir / "report.html").exists()


def test_a_stalled_collector_drops_records_the_job_is_unchanged_and_the_loss_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The collector reads nothing until the job ends: each rank's socket queue fills and later records drop."""
    import torch  # noqa: F401, PLC0415 - imported before the ranks fork (they share it)

    from meshscope.local.running import EXIT_NO_ANALYSIS, demo_settings, run_job  # noqa: PLC0415
    from meshscope.local.summarizing import report_run  # noqa: PLC0415
    from meshscope.sdk.transport import RecordCollector  # noqa: PLC0415

    def run(out: Path, env: dict[str, str]) -> tuple[int, list[float]]:
        settings = demo_settings(out, steps=12, block_ms=2)
        command = (*settings.command, "--report", str(out / "losses.json"))
        code = run_job(replace(settings, command=command, extra_env={**settings.extra_env, **env}), report=report_run)
        return code, json.loads((out / "losses.json").read_text())["losses"]

    code_off, losses_off = run(tmp_path / "off", {"MESHSCOPE_DISABLE": "1"})
    monkeypatch.setattr(RecordCollector, "start", lambda self: None)  # nobody reads until stop() drains the queues
    capfd.readouterr()
    code, losses = run(tmp_path / "stalled", {})
    out = capfd.readouterr().out
    check_records_file(tmp_path / "stalled" / "records.jsonl", every_step=("optimizer",))
    assert code == 0
    assert code_off == EXIT_NO_ANALYSIS  # with the SDK off there is nothing to analyse
    assert losses == losses_off  # the job computed exactly what it computes without meshscope
    assert len(losses) == 12
    assert "PARTIAL DATA" in out
    notes = {n["code"]: n for n in json.loads((tmp_path / "stalled" / "analysis.json").read_text())["partial_data"]}
    # Every rank's last messages were dropped at its full socket, goodbye and final counters included.
    assert notes["lost_goodbyes"]["count"] == 8
    received = json.loads((tmp_path / "stalled" / "collector.json").read_text())["ranks"]
    assert all(0 < r["records"] < 12 for r in received.values())

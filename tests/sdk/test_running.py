"""``meshscope run``: launching ranks, stopping them when one fails, and collecting the records of a real job."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from invariants import check_records_file
from meshscope.errors import LayoutError
from meshscope.local.running import RunError, RunSettings, rank_env, settings_from_args
from meshscope.records import IntervalKind, read_records
from meshscope.topology import layout_text
from meshscope.topology.layout import ParallelLayout, parse_layout
from meshscope.topology.placement import Placement

REPO = Path(__file__).resolve().parents[2]
TRAIN_TINY = REPO / "examples" / "train_tiny.py"


def _meshscope(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "meshscope", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )


def _args(**overrides: object) -> argparse.Namespace:
    base = {
        "nproc": 4,
        "layout": None,
        "spec": None,
        "out": "/tmp/x",
        "job": None,
        "launcher": "auto",
        "grace": 5.0,
        "gpus_per_node": None,
        "quiet": False,
        "command": ["--", "python", "train.py"],
    }
    base.update(overrides)
    return argparse.Namespace(**base)


@pytest.fixture
def in_a_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current directory holds the ``train.py`` the commands name (a missing script is refused)."""
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.usefixtures("in_a_project")
def test_run_settings_from_the_command_line() -> None:
    s = settings_from_args(_args(layout="tp=2"))
    assert s.command == ("python", "train.py")
    assert s.layout == ParallelLayout(dp=2, tp=2)
    assert s.job == "local"
    assert s.layout_given
    implied = settings_from_args(_args())
    assert (implied.layout, implied.layout_given) == (ParallelLayout(dp=4), False)  # a mesh the ranks register wins
    with pytest.raises(RunError, match="needs a command"):
        settings_from_args(_args(command=["--"]))
    with pytest.raises(LayoutError, match="does not divide the world size 4"):
        settings_from_args(_args(layout="tp=3"))
    with pytest.raises(RunError, match="does not divide"):
        settings_from_args(_args(gpus_per_node=3))


@pytest.mark.parametrize(
    ("command", "instead"),
    [
        (
            ["torchrun", "--standalone", "--nproc-per-node=4", "train.py", "--lr", "3"],
            "--nproc 4 -- python train.py --lr 3",
        ),
        (["/opt/env/bin/torchrun", "--nnodes", "1", "--nproc_per_node", "8", "t.py"], "--nproc 8 -- python t.py"),
        (["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "a/b.py"], "--nproc 2 -- python a/b.py"),
        # no count in the launcher's options: the run's own --nproc (4 here; before, "N" however many were given)
        (["python3", "-m", "torch.distributed.launch", "x.py"], "--nproc 4 -- python x.py"),
        (["accelerate", "launch", "--cpu", "--num_processes", "2", "x.py", "--y"], "--nproc 2 -- python x.py --y"),
        (["deepspeed", "--num_gpus=4", "ds.py"], "--nproc 4 -- python ds.py"),
        (["torchrun", "--nproc-per-node", "gpu", "-m", "pkg.train"], "--nproc 4 -- python SCRIPT.py"),
    ],
)
def test_a_launcher_in_the_command_is_refused_with_the_command_to_run_instead(command: list[str], instead: str) -> None:
    # meshscope run starts the ranks; a launcher under it would start each rank's processes again, all claiming
    # the rank's records (seen: "rank 1 step 0 appears twice" and no analysis)
    with pytest.raises(RunError, match="is a launcher") as err:
        settings_from_args(_args(command=["--", *command]))
    assert f"Run the script directly: meshscope run {instead} " in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "command",
    [["python", "train.py"], ["python", "-m", "pkg.train"], ["./torchrun_wrapper.sh"], ["bash", "-c", "torchrun x"]],
)
@pytest.mark.usefixtures("in_a_project")
def test_a_command_that_is_not_a_launcher_runs(command: list[str]) -> None:
    assert settings_from_args(_args(command=command)).command == tuple(command)


def test_the_cli_refuses_a_launcher_in_one_line() -> None:
    done = _meshscope("run", "--nproc", "2", "--", "torchrun", "--nproc-per-node", "2", "train.py")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "Run the script directly: meshscope run --nproc 2 -- python train.py" in done.stderr


def test_every_rank_gets_torchrun_and_meshscope_environment(tmp_path: Path) -> None:
    layout = ParallelLayout(dp=2, tp=2, pp=2)
    settings = RunSettings(
        nproc=8, command=("python", "x.py"), layout=layout, out_dir=tmp_path, job="j", gpus_per_node=4
    )
    placement = Placement.default(8, gpus_per_node=4, nvlink_domain_gpus=4, nodes_per_network_block=1 << 20)
    env = rank_env(settings, 6, port=1234, collector="/tmp/c6.sock", placement=placement)
    assert {
        k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    } == {
        "RANK": "6",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1234",
    }
    assert env["MESHSCOPE_JOB"] == "j"
    assert env["MESHSCOPE_COLLECTOR"] == "unix:/tmp/c6.sock"
    assert env["MESHSCOPE_LAYOUT_IMPLIED"] == "0"  # the user's layout
    default = rank_env(replace(settings, layout_given=False), 6, port=1234, collector="c", placement=placement)
    assert default["MESHSCOPE_LAYOUT_IMPLIED"] == "1"
    assert (env["MESHSCOPE_NODE"], env["MESHSCOPE_NVLINK_DOMAIN"]) == ("node-1", "nvl-1")
    assert parse_layout(env["MESHSCOPE_LAYOUT"], world_size=8) == layout
    assert layout_text(ParallelLayout(dp=4, ep=2, vpp=1)) == "dp=4,tp=1,pp=1,cp=1,ep=2"


CRASH = "import os, sys, time\nif os.environ['RANK'] == '1':\n    time.sleep(0.3); sys.exit(3)\ntime.sleep(60)\n"


@pytest.mark.slow
def test_a_crashing_rank_stops_the_run_with_its_rank_and_exit_code(tmp_path: Path) -> None:
    result = _meshscope(
        "run", "--nproc", "3", "--grace", "1", "--out", str(tmp_path), "--", sys.executable, "-c", CRASH
    )
    assert result.returncode == 3
    assert "meshscope run: rank 1 exited with code 3; stopped the other 2 ranks" in result.stderr
    report = json.loads((tmp_path / "collector.json").read_text())
    assert report["exit_codes"]["1"] == 3
    assert report["exit_codes"]["0"] < 0  # terminated by a signal, not left running
    assert report["exit_codes"]["2"] < 0


@pytest.mark.slow
def test_the_exec_launcher_runs_any_command_and_reports_a_killed_rank(tmp_path: Path) -> None:
    script = 'if [ "$RANK" = 0 ]; then kill -9 $$; fi; sleep 60'
    result = _meshscope("run", "--nproc", "2", "--grace", "1", "--out", str(tmp_path), "--", "sh", "-c", script)
    assert result.returncode == 128 + 9
    assert "rank 0 was killed by signal 9 (SIGKILL)" in result.stderr


def _check_job_records(out: Path, layout: ParallelLayout, steps: int) -> dict[str, Counter[str]]:
    records = read_records(out / "records.jsonl")  # every line valid under the shared schema
    assert records.job == "tiny"
    assert check_records_file(out / "records.jsonl", every_step=("optimizer",)) == len(records.records)
    got = sorted((r.rank, r.step) for r in records)
    assert got == [(rank, step) for rank in range(layout.world_size) for step in range(steps)]
    seen: dict[str, Counter[str]] = defaultdict(Counter)
    members: dict[tuple[str, int], int] = Counter()
    sizes: dict[tuple[str, int], int] = {}
    for rec in records:
        assert rec.coord == layout.coord(rec.rank)
        for iv in rec.intervals:
            key = str(iv.axis) if iv.axis is not None else iv.kind.value
            seen[key][str(iv.op) if iv.op is not None else (iv.phase or iv.kind).value] += 1
            if iv.kind is IntervalKind.COMM:
                members[(iv.group, iv.seq)] += 1
                sizes[(iv.group, iv.seq)] = iv.group_size
    incomplete = {k: (n, sizes[k]) for k, n in members.items() if n != sizes[k]}
    assert not incomplete, f"collectives missing members: {dict(list(incomplete.items())[:5])}"
    counters = json.loads((out / "collector.json").read_text())["ranks"]
    assert all(c["counters"]["records_dropped"] == 0 and c["counters"]["hook_errors"] == 0 for c in counters.values())
    return seen


@pytest.mark.slow
def test_train_tiny_with_pipeline_data_and_tensor_parallelism_writes_one_record_per_rank_per_step(
    tmp_path: Path,
) -> None:
    steps = 3
    result = _meshscope(
        "run", "--nproc", "8", "--layout", "pp=2,dp=2,tp=2", "--job", "tiny", "--out", str(tmp_path),
        "--", sys.executable, str(TRAIN_TINY), "--steps", str(steps), "--emulate", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{8 * steps} records from 8 of 8 ranks" in result.stderr
    seen = _check_job_records(tmp_path, ParallelLayout(pp=2, dp=2, tp=2), steps)
    assert seen["tp"]["all_reduce"] > 0  # DTensor tensor parallelism (functional collectives)
    assert seen["dp"]["all_gather"] > 0  # FSDP2 parameter gathers ...
    assert seen["dp"]["reduce_scatter"] > 0  # ... and gradient reductions
    assert seen["pp"]["send"] == seen["pp"]["recv"] > 0  # pipelining 1F1B
    assert seen["compute"]["forward"] > 0  # pipeline stage chunks labelled by the SDK
    assert seen["compute"]["backward"] > 0
    assert seen["optimizer"]["optimizer"] == 8 * steps


@pytest.mark.slow
def test_train_tiny_with_context_expert_parallelism_and_checkpoints(tmp_path: Path) -> None:
    steps = 2
    result = _meshscope(
        "run", "--nproc", "8", "--layout", "dp=2,cp=2,tp=2,ep=2,etp=1", "--job", "tiny", "--out", str(tmp_path),
        "--", sys.executable, str(TRAIN_TINY), "--steps", str(steps), "--moe", "--checkpoint-every", "2",
        "--slow-loader", "5",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    seen = _check_job_records(tmp_path, ParallelLayout(dp=2, cp=2, tp=2, ep=2, etp=1), steps)
    # K and V gathered in forward and again in backward, their gradients reduce-scattered (train_tiny's CP)
    assert seen["cp"]["all_gather"] == 2 * seen["cp"]["reduce_scatter"] > 0
    assert seen["ep"]["all_to_all"] > 0  # expert dispatch and combine
    assert seen["tp"]["all_reduce"] > 0
    assert seen["dp"]["all_gather"] > 0
    assert seen["checkpoint"]["checkpoint"] == 8  # every rank, at step 1
    assert seen["data"]["data"] == 8 * steps


@pytest.mark.slow
def test_train_tiny_with_ddp_keeps_bucket_reductions_inside_backward(tmp_path: Path) -> None:
    steps = 3
    result = _meshscope(
        "run", "--nproc", "4", "--layout", "pp=2,dp=2", "--job", "tiny", "--out", str(tmp_path),
        "--", sys.executable, str(TRAIN_TINY), "--steps", str(steps), "--dp", "ddp", "--emulate", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    seen = _check_job_records(tmp_path, ParallelLayout(pp=2, dp=2), steps)  # the record invariants included
    assert seen["dp"]["all_reduce"] > 0  # DDP's buckets, through meshscope's comm hook
    for rec in read_records(tmp_path / "records.jsonl"):
        optimizer = min(iv.start_us for iv in rec.intervals if iv.kind is IntervalKind.OPTIMIZER)
        buckets = [iv for iv in rec.intervals if iv.axis == "dp" and iv.op == "all_reduce"]
        # no bucket's reduction ends after backward, in the optimizer (DDP's reducer waits for them all)
        assert all(iv.end_us <= optimizer for iv in buckets), (rec.rank, rec.step)


LATE_TRACKER = """
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from meshscope import sdk
dist.init_process_group("gloo")
ddp = DDP(nn.Linear(8, 4))
ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)  # all-reduces from C++, before the tracker
tracker = sdk.tracker_from_env()
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
for step in range(3):
    with tracker.step(step):
        with tracker.phase("forward"):
            loss = ddp(torch.ones(2, 8)).sum()
        with tracker.phase("backward"):
            loss.backward()
        with tracker.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
tracker.close()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_layout_axis_whose_traffic_was_not_captured_is_said_and_noted(tmp_path: Path) -> None:
    result = _meshscope(
        "run", "--nproc", "2", "--layout", "dp=2", "--out", str(tmp_path), "--", sys.executable, "-c", LATE_TRACKER
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "DDP models" in line]
    said = (
        "meshscope run: 2 DDP models on ranks 0, 1 got a comm hook before the tracker started: their gradient "
        "reductions are captured only in part (start the tracker before registering the hook; see the ranks' logs)"
    )
    assert lines == [said]
    assert check_records_file(tmp_path / "records.jsonl", every_step=("optimizer",)) == 6
    notes = {n["code"]: n for n in json.loads((tmp_path / "analysis.json").read_text())["partial_data"]}
    assert "no record holds a dp collective" in notes["missing_axis_traffic"]["message"]
    assert "PARTIAL DATA" in result.stdout


ASYNC_CHECKPOINT = """
import tempfile
import torch, torch.distributed as dist, torch.nn as nn
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel as DDP
from meshscope import sdk
dist.init_process_group("gloo")
tracker = sdk.tracker_from_env()
writer_group = dist.new_group(backend="gloo")  # PyTorch's advice for async_save: a group of its own
ddp = DDP(nn.Linear(64, 32))
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
root = [tempfile.mkdtemp(prefix="ms-async-") if dist.get_rank() == 0 else ""]
dist.broadcast_object_list(root, src=0)
future = None
for step in range(8):
    with tracker.step(step):
        with tracker.phase("forward"):
            loss = ddp(torch.ones(4, 64)).sum()
        with tracker.phase("backward"):
            loss.backward()
        with tracker.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        if step % 2 == 0:
            with tracker.phase("checkpoint"):
                if future is not None:
                    future.result()
                future = dcp.async_save({"model": ddp.state_dict()}, checkpoint_id=f"{root[0]}/s{step}",
                                        process_group=writer_group)
future.result()
tracker.close()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_an_asynchronous_checkpoints_collectives_are_said_and_keep_the_records_readable(tmp_path: Path) -> None:
    # DCP's async_save coordinates on a thread of its own, at times that differ from rank to rank: recorded into
    # whichever step was open, its collectives broke the joins (before: "no analysis: ... members of one collective
    # must agree") and cut the training thread's compute with the writer's waits.
    result = _meshscope(
        "run", "--nproc", "2", "--layout", "dp=2", "--out", str(tmp_path), "--", sys.executable, "-c", ASYNC_CHECKPOINT
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "ran on threads other than the training loop's" in line]
    assert len(lines) == 1, result.stderr[-3000:]
    assert re.search(r"meshscope run: \d+ collectives on 2 ranks ran on threads other", lines[0])
    assert check_records_file(tmp_path / "records.jsonl", every_step=("optimizer",)) == 16
    analysis = json.loads((tmp_path / "analysis.json").read_text())
    joins = {"incomplete_collectives", "finished_before_last_arrival", "clipped_intervals"}
    assert not joins & {n["code"] for n in analysis["partial_data"]}  # (cpu_contention may be said on 2 cores)
    groups = {iv["group"] for line in (tmp_path / "records.jsonl").read_text().splitlines()
              for iv in json.loads(line)["intervals"] if iv["kind"] == "comm"}  # fmt: skip
    assert groups == {"dp:0"}  # DDP's buckets; the writer's group never appears


DDP_STEPS = """
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from meshscope import sdk
dist.init_process_group("gloo")
tracker = sdk.tracker_from_env()
ddp = DDP(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)))
optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
for step in range(5):
    with tracker.step(step):
        loss = ddp(torch.randn(64, 256)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
tracker.close()
dist.destroy_process_group()
"""


def test_analyze_with_the_command_the_run_prints_gives_the_runs_numbers_again(tmp_path: Path) -> None:
    # `meshscope run` leaves its first step out as warm-up; `meshscope analyze OUT` read every step and printed other
    # numbers for the same run, with no way to leave it out. The run now prints the command that gives its numbers.
    out = tmp_path / "out dir"  # a path the printed command must quote
    result = _meshscope("run", "--nproc", "2", "--out", str(out), "--", sys.executable, "-c", DDP_STEPS)
    assert result.returncode == 0, result.stderr[-3000:]
    said = re.search(r"`(meshscope analyze [^`]+)` gives these numbers again", result.stdout)
    assert said is not None, result.stdout[:2000]
    command = shlex.split(said.group(1))
    again = _meshscope(*command[1:], "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    ran, analysed = json.loads((out / "analysis.json").read_text()), json.loads(again.stdout)
    measured = ("category", "measured_median_seconds", "measured_p95_seconds", "worst_rank", "worst_seconds")
    assert analysed["steps"] == ran["steps"] == {"first": 1, "last": 4, "count": 4}
    assert [[row[k] for k in measured] for row in analysed["rows"]] == [
        [row[k] for k in measured] for row in ran["rows"]
    ]
    assert [(f["code"], f["suspects"]) for f in analysed["findings"]] == [
        (f["code"], f["suspects"]) for f in ran["findings"]
    ]
    every = json.loads(_meshscope("analyze", str(out), "--json").stdout)  # the warm-up step read too
    assert every["steps"] == {"first": 0, "last": 4, "count": 5}

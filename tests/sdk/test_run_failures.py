"""``meshscope run`` failing clearly: the interpreter it used, a failing rank's stderr and the fix, a non-zero exit
when no analysis could be written, and CPU contention measured and noted. Real runs of tiny 2-rank scripts."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshscope.errors import ParseError
from meshscope.local.cpus import FOREIGN_LOAD_SHARE, CpuCapacity, CpuUse, measure_capacity, read_busy_seconds
from meshscope.local.running import (
    EXIT_NO_ANALYSIS,
    RankExit,
    RankReceipt,
    RunOutcome,
    RunSettings,
    _free_port,
    _monitor,
    _no_record_fix,
    _RankProcess,
    keep_earlier_run,
    resolve_python,
    run_job,
)
from meshscope.local.summarizing import report_run
from meshscope.local.tails import TAIL_BYTES, StderrTails, fix_for, shown_tail
from meshscope.topology.layout import ParallelLayout

DATA = Path(__file__).resolve().parents[1] / "data"


def _meshscope(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshscope", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
        cwd=cwd,
        check=False,
    )


MISSING_TORCH = "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
"""What every rank of a script run by an interpreter without torch dies of (raised here, so any machine shows it)."""


@pytest.mark.slow
def test_ranks_dying_of_a_missing_module_exit_non_zero_with_their_stderr_tail_and_the_fix(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('starting')\n" + MISSING_TORCH)
    out = tmp_path / "out"
    result = _meshscope("run", "--nproc", "2", "--out", str(out), "--", "python", "train.py", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert f"meshscope run: python = {sys.executable} (meshscope's own interpreter" in result.stderr
    assert "exited with code 1" in result.stderr
    assert "meshscope run: failed: rank" in result.stderr
    assert "  | ModuleNotFoundError: No module named 'torch'" in result.stderr  # the tail, shown again at the end
    assert (
        f"meshscope run: fix: the interpreter {sys.executable} has no torch: install meshscope's demo extra there"
        in result.stderr
    )
    assert "no meshscope tracker" not in result.stderr.split("ranks sent nothing")[1].splitlines()[0]
    tails = sorted(p.name for p in (out / "ranks").iterdir())
    assert "rank-0.stderr" in tails or "rank-1.stderr" in tails
    assert (out / "records.jsonl").exists()


WHO = "import os, sys\nopen(f\"python-{os.environ['RANK']}.txt\", 'w').write(sys.executable)\n"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["exec", "auto"], ids=["exec", "fork"])
def test_a_bare_python_runs_under_meshscopes_interpreter_and_no_records_exit_non_zero(
    tmp_path: Path, launcher: str
) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text("#!/bin/sh\nexit 7\n")  # a wrong 'python' first on PATH is not used
    (fake / "python").chmod(0o755)
    (tmp_path / "who.py").write_text(WHO)
    path = f"{fake}{os.pathsep}{os.environ.get('PATH', '')}"
    result = _meshscope(
        "run", "--nproc", "2", "--launcher", launcher, "--out", str(tmp_path / "out"), "--", "python", "who.py",
        cwd=tmp_path, env={"PATH": path},
    )  # fmt: skip
    assert [(tmp_path / f"python-{r}.txt").read_text() for r in range(2)] == [sys.executable] * 2
    assert f"python = {sys.executable} (meshscope's own interpreter; 'python' on PATH is {fake / 'python'})" in (
        result.stderr
    )
    assert result.returncode == EXIT_NO_ANALYSIS, result.stderr
    assert "fix: ranks 0, 1 sent no step record: the script never started meshscope's tracker" in result.stderr


NO_STEP = "from meshscope import sdk\ntracker = sdk.tracker_from_env()\ntracker.close()\n"
"""A script that starts the tracker and ends no step."""
BROKEN_HOOKS = """from meshscope import sdk
tracker = sdk.tracker_from_env()

def broken(self, now=None):
    raise RuntimeError("a fault inside meshscope")

type(tracker)._end_step = broken  # every step's end fails inside the SDK, as a bug of meshscope's would
for step in range(3):
    with tracker.step(step):
        pass
tracker.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "fix"),
    [
        (NO_STEP, "fix: ranks 0, 1 started meshscope's tracker but ended no step: wrap each step in"),
        (
            BROKEN_HOOKS,
            # 4 a rank: 3 step ends, and close() ending the step the last failure left open
            "fix: ranks 0, 1 started meshscope's tracker, but its hooks failed 8 times and no step record was sent",
        ),
    ],
    ids=["no-step", "hooks-fail"],
)
def test_ranks_whose_tracker_started_but_sent_no_record_are_told_apart_from_ranks_without_one(
    tmp_path: Path, script: str, fix: str
) -> None:
    # The launcher heard each tracker's hello and close (with its hook-error count): "the script never started
    # meshscope's tracker" would send the user to fix what is there.
    (tmp_path / "job.py").write_text(script)
    result = _meshscope("run", "--nproc", "2", "--out", str(tmp_path / "out"), "--", "python", "job.py", cwd=tmp_path)
    assert result.returncode == EXIT_NO_ANALYSIS, result.stderr
    assert fix in result.stderr, result.stderr
    assert "never started meshscope's tracker" not in result.stderr


ALONE = """\
import sys
import torch
import torch.distributed as dist
from meshscope import sdk
if sys.argv[1:] == ["--join"]:
    dist.init_process_group("gloo")
tracker = sdk.tracker_from_env()
for step in range(3):
    with tracker.step(step), tracker.phase("compute"):
        torch.randn(64, 64).matmul(torch.randn(64, 64))
"""
"""Ranks that train without joining a process group (``--join``: the same ranks, joined)."""


@pytest.mark.slow
def test_ranks_that_never_joined_a_process_group_are_said_to_have_trained_alone(tmp_path: Path) -> None:
    # A script that goes distributed only on GPUs (Accelerate, the HF Trainer without cpu=True) runs every rank alone
    # on CPU: the trackers say at close that they never saw a process group, and the run says what that means.
    (tmp_path / "job.py").write_text(ALONE)
    alone = _meshscope("run", "--nproc", "2", "--out", str(tmp_path / "a"), "--", "python", "job.py", cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr
    assert "the 2 ranks never joined a process group: each trained alone" in alone.stderr
    assert "Accelerator(cpu=True)" in alone.stderr
    ranks = json.loads((tmp_path / "a" / "collector.json").read_text())["ranks"]
    assert [r["process_group_size"] for r in ranks.values()] == [None, None]
    joined = _meshscope(
        "run", "--nproc", "2", "--out", str(tmp_path / "j"), "--", "python", "job.py", "--join", cwd=tmp_path
    )
    assert joined.returncode == 0, joined.stderr
    assert "never joined" not in joined.stderr
    ranks = json.loads((tmp_path / "j" / "collector.json").read_text())["ranks"]
    assert [r["process_group_size"] for r in ranks.values()] == [2, 2]


def test_the_no_record_fix_names_each_kind_of_silent_rank() -> None:
    # Rank 0 never said hello; rank 1's tracker closed with 3 hook errors; rank 2's sent 5 records, none arrived;
    # rank 3's closed clean having sent none. One sentence each, in that order of urgency.
    from types import SimpleNamespace  # noqa: PLC0415

    from meshscope.sdk.transport import RankTally  # noqa: PLC0415

    ranks = {
        1: RankTally(hello=True, closed=True, counters={"hook_errors": 3, "records_sent": 0}),
        2: RankTally(hello=True, closed=True, counters={"hook_errors": 0, "records_sent": 5}),
        3: RankTally(hello=True, closed=True, counters={"records_sent": 0}),
    }
    fix = _no_record_fix([0, 1, 2, 3], SimpleNamespace(ranks=ranks))  # type: ignore[arg-type]
    said = [
        "rank 2 ended steps and sent their records, but none arrived",
        "; rank 1 started meshscope's tracker, but its hooks failed 3 times",
        "; rank 3 started meshscope's tracker but ended no step",
        "; rank 0 sent no step record: the script never started meshscope's tracker",
    ]
    at = [fix.find(part) for part in said]
    assert at[0] == 0, fix
    assert -1 not in at, fix
    assert at == sorted(at), fix


TRACKED = """import time
from meshscope import sdk
tracker = sdk.tracker_from_env()
for step in range(4):
    with tracker.step(step):
        with tracker.phase("forward"):
            time.sleep(0.02)
tracker.close()
"""


def test_more_ranks_than_cores_is_measured_and_noted(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "tracked.py"
    script.write_text(TRACKED)
    out = tmp_path / "out"
    settings = RunSettings(
        nproc=2, command=(sys.executable, str(script)), layout=ParallelLayout(dp=2), out_dir=out, launcher="exec"
    )
    code = run_job(settings, report=report_run, capacity=CpuCapacity(affinity=1))
    captured = capfd.readouterr()
    assert code == 0, captured.err + captured.out
    assert "2 ranks on 1 CPU core: timings include CPU contention" in captured.err
    notes = {n["code"]: n for n in json.loads((out / "analysis.json").read_text())["partial_data"]}
    assert notes["cpu_contention"]["count"] == 2
    assert "2 ranks on 1 CPU core: timings include CPU contention" in notes["cpu_contention"]["message"]
    cpu = json.loads((out / "collector.json").read_text())["cpu"]
    assert (cpu["ranks"], cpu["cores"], cpu["oversubscribed"]) == (2, 1.0, True)
    assert cpu["ranks_cpu_seconds"] > 0
    assert json.loads((out / "analysis.json").read_text())["cpu"] == cpu


def test_records_that_cannot_be_analysed_exit_non_zero_with_the_fix_and_are_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = (DATA / "dp8_straggler" / "records.jsonl").read_text().splitlines()
    records = tmp_path / "records.jsonl"  # rank 3's all-reduce of step 1 says it is step 0's: seq 0 twice
    broken = json.loads(lines[11])
    assert (broken["rank"], broken["step"]) == (3, 1)
    broken["intervals"] = [dict(iv, seq=0) if iv["kind"] == "comm" else iv for iv in broken["intervals"]]
    records.write_text("\n".join([*lines[:11], json.dumps(broken), *lines[12:]]) + "\n")
    settings = RunSettings(nproc=8, command=("python", "x.py"), layout=ParallelLayout(dp=8), out_dir=tmp_path)
    receipt = RankReceipt(records=3, hello=True, closed=True, counters={}, measurements={})
    outcome = RunOutcome(settings=settings, records_path=records, failed=None, ranks=dict.fromkeys(range(8), receipt))
    assert report_run(outcome) == EXIT_NO_ANALYSIS
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("meshscope run: no analysis:"))
    assert "seq 0 appears twice on rank 3" in line
    assert "fix: a collective's seq counts its group's collectives over the whole run" in line
    assert line.endswith(f"the records are kept in {records}")
    assert records.read_text().count("\n") == len(lines)


def test_step_numbers_that_start_over_are_analysed_as_the_last_attempt_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A loop that numbers its steps per epoch with an SDK that did not renumber them, or a job restarted into the
    # same records: every rank's steps go 0, 1, then 0 again. Before: no analysis ("appears twice").
    lines = (DATA / "dp8_straggler" / "records.jsonl").read_text().splitlines()
    records = tmp_path / "records.jsonl"
    assert len(lines) == 16  # steps 0 and 1 of 8 ranks
    records.write_text("\n".join([*lines, *lines]) + "\n")
    settings = RunSettings(nproc=8, command=("python", "x.py"), layout=ParallelLayout(dp=8), out_dir=tmp_path)
    receipt = RankReceipt(records=5, hello=True, closed=True, counters={}, measurements={})
    outcome = RunOutcome(settings=settings, records_path=records, failed=None, ranks=dict.fromkeys(range(8), receipt))
    assert report_run(outcome) == 0
    notes = {n["code"]: n for n in json.loads((tmp_path / "analysis.json").read_text())["partial_data"]}
    assert notes["earlier_attempts"]["count"] == 16  # steps 0 and 1 of the first attempt, 8 ranks
    assert "the records hold 1 restart (8 ranks began again" in notes["earlier_attempts"]["message"]
    out = capsys.readouterr().out
    assert "PARTIAL DATA (1 note, listed at the end)\n" in out  # a note that marks no row points at none
    assert "(partial data)" not in out


def test_a_report_that_raises_a_meshscope_error_exits_non_zero_in_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    def report(outcome: RunOutcome) -> int:
        raise ParseError(f"{outcome.records_path} line 1: bad record")

    settings = RunSettings(nproc=2, command=("sh", "-c", "true"), layout=ParallelLayout(dp=2), out_dir=tmp_path)
    assert run_job(settings, report=report, capacity=CpuCapacity(affinity=2)) == EXIT_NO_ANALYSIS
    err = capfd.readouterr().err
    assert f"meshscope run: no analysis: {tmp_path / 'records.jsonl'} line 1: bad record (the records are kept" in err


def test_the_cores_are_the_affinity_capped_by_the_tightest_cgroup_quota(tmp_path: Path) -> None:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/job/rank\n")
    group = tmp_path / "sys/fs/cgroup/job/rank"
    group.mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/cpu.max").write_text("max 100000\n")
    (tmp_path / "sys/fs/cgroup/job/cpu.max").write_text("150000 100000\n")
    (group / "cpu.max").write_text("max 100000\n")
    capacity = measure_capacity(tmp_path)
    assert capacity.quota_cores == 1.5
    assert capacity.cores == min(1.5, len(os.sched_getaffinity(0)))
    assert measure_capacity(tmp_path / "nothing").quota_cores is None
    few = CpuUse(ranks=2, capacity=CpuCapacity(affinity=4), wall_s=1.0, cpu_s=0.5)
    assert few.note() is None
    assert few.headline() == "2 ranks on 4 CPU cores"
    many = CpuUse(ranks=8, capacity=CpuCapacity(affinity=8, quota_cores=2.0), wall_s=10.0, cpu_s=15.0)
    note = many.note()
    assert note is not None
    assert (note.code, note.count) == ("cpu_contention", 8)
    assert note.message.startswith("8 ranks on 2 CPU cores (cgroup quota; 8 in the affinity mask): timings include")
    assert "used 15.0 CPU-s of the 20.0 the cores offered in the 10.0 s they ran (75%)" in note.message


PROC_STAT = """cpu  900 10 300 5000 40 5 6 0 7 0
cpu0 400 5 100 2500 20 2 3 0 7 0
cpu1 500 5 200 2500 20 3 3 1 0 0
intr 12345 0 0
ctxt 999
cpu7x 1 2 3
"""


def test_busy_time_is_read_per_core_from_proc_stat(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/stat").write_text(PROC_STAT)
    tick = os.sysconf("SC_CLK_TCK")
    # Busy = user + nice + system + irq + softirq + steal; idle, iowait and guest (inside user) are not.
    cpu0 = 400 + 5 + 100 + 2 + 3 + 0
    cpu1 = 500 + 5 + 200 + 3 + 3 + 1
    assert read_busy_seconds(tmp_path, frozenset({0})) == pytest.approx(cpu0 / tick)
    assert read_busy_seconds(tmp_path, frozenset({1})) == pytest.approx(cpu1 / tick)
    assert read_busy_seconds(tmp_path) == pytest.approx((cpu0 + cpu1) / tick)
    assert read_busy_seconds(tmp_path, frozenset({5})) is None
    assert read_busy_seconds(tmp_path / "nothing") is None
    # The real file: busy time only grows.
    first = read_busy_seconds()
    assert first is not None
    sum(i * i for i in range(200_000))
    second = read_busy_seconds()
    assert second is not None
    assert second >= first


def test_foreign_cpu_load_makes_a_run_contended_whatever_its_rank_count() -> None:
    two = CpuCapacity(affinity=2)
    # 2 ranks on 2 cores for 10 s: the cores were busy 19 CPU-s; the ranks took 8, the launcher 1, others 10.
    loaded = CpuUse(ranks=2, capacity=two, wall_s=10.0, cpu_s=8.0, machine_busy_s=19.0, own_cpu_s=1.0)
    assert not loaded.oversubscribed
    assert loaded.foreign_cpu_s == pytest.approx(10.0)
    assert loaded.foreign_fraction == pytest.approx(0.5)
    assert loaded.contended
    note = loaded.note()
    assert note is not None
    assert note.code == "cpu_contention"
    assert note.message.startswith("2 ranks on 2 CPU cores, beside foreign CPU load: timings include CPU contention")
    assert "other processes took 10.0 CPU-s of the 20.0 the 2 CPUs offered (50%)" in note.message
    assert loaded.to_dict()["foreign_fraction"] == 0.5
    assert loaded.to_dict()["contended"] is True
    # Just under the share: a quiet machine's background is no contention.
    light_s = FOREIGN_LOAD_SHARE * 20.0 - 0.1
    quiet = CpuUse(ranks=2, capacity=two, wall_s=10.0, cpu_s=8.0, machine_busy_s=9.0 + light_s, own_cpu_s=1.0)
    assert quiet.foreign_fraction == pytest.approx(FOREIGN_LOAD_SHARE - 0.005)
    assert not quiet.contended
    assert quiet.note() is None
    # Unmeasured (no /proc/stat, or a rank's rusage unknown): no foreign figure, and no claim either way.
    blind = CpuUse(ranks=2, capacity=two, wall_s=10.0, cpu_s=None, machine_busy_s=19.0)
    assert (blind.foreign_cpu_s, blind.foreign_fraction, blind.contended) == (None, None, False)
    # Measured busy time below what ours used (counters read a tick apart): never a negative foreign load.
    assert CpuUse(ranks=2, capacity=two, wall_s=1.0, cpu_s=1.5, machine_busy_s=1.4).foreign_cpu_s == 0.0


def test_the_interpreter_and_the_fix_named_for_a_tail() -> None:
    assert resolve_python(["python", "x.py"]) == ((sys.executable, "x.py"), sys.executable)
    assert resolve_python(["/opt/py/bin/python3", "x.py"]) == (("/opt/py/bin/python3", "x.py"), "/opt/py/bin/python3")
    assert resolve_python(["sh", "-c", "true"]) == (("sh", "-c", "true"), None)
    tail = (
        "Traceback (most recent call last):\n  File 'x.py'\nModuleNotFoundError: No module named 'torch.distributed'\n"
    )
    assert fix_for(tail, python="/usr/bin/python3") == (
        "the interpreter /usr/bin/python3 has no torch: install meshscope's demo extra there "
        "(pip install 'meshscope[demo]'), or pass the full path of an interpreter that has torch after '--'"
    )
    assert "has no meshscope" in str(fix_for("ModuleNotFoundError: No module named 'meshscope'", python=None))
    assert fix_for("RuntimeError: boom", python=None) is None
    # the DDP tutorial's mp.spawn script started as two ranks: both spawn a job on the tutorial's fixed port
    spawned = (
        '  File "/venv/lib/python3.11/site-packages/torch/multiprocessing/spawn.py", line 340, in spawn\n'
        "torch.multiprocessing.spawn.ProcessRaisedException:\n-- Process 0 terminated with the following error:\n"
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
        "port: 12355, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n"
    )
    assert "run it as one process, meshscope run --nproc 1 -- ..." in str(fix_for(spawned, python=None))
    assert fix_for(spawned.replace("EADDRINUSE", "ECONNRESET").replace("address already", "x"), python=None) is None
    # a spawned rank that aborted in gloo's teardown at exit (torch 2.13), as the parent's stderr ends then
    aborted = (
        "step 39: loss 0.1\nterminate called without an active exception\nTraceback (most recent call last):\n"
        '  File "ddp_spawn.py", line 80, in <module>\n'
        "torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGABRT\n"
    )
    assert "os._exit(0) after its cleanup" in str(fix_for(aborted, python=None))
    assert fix_for(aborted.replace("terminate called", "exit called"), python=None) is None
    assert shown_tail("\n".join(str(i) for i in range(100)), lines=3) == "97\n98\n99"
    # DTensor's sharding errors end in one line of every operand's spec (~10 kB): the line that says what failed stays
    dtensor = (
        "RuntimeError: All operands in aten.stack.default must have the same mesh\n\nSharding failed " + "x" * 9000
    )
    shown = shown_tail(dtensor)
    assert shown.splitlines()[0] == "RuntimeError: All operands in aten.stack.default must have the same mesh"
    assert shown.splitlines()[-1].endswith(f"... ({len(dtensor.splitlines()[-1]) - 300} more characters)")
    assert len(shown) < 500


def test_a_ranks_stderr_goes_through_unchanged_and_only_its_tail_is_kept(tmp_path: Path) -> None:
    through = tmp_path / "through"
    with through.open("wb") as sink:
        tails = StderrTails(2, out_fd=sink.fileno())
        w = tails.write_fd(1)
        tails.start()
        payload = b"".join(b"line %d\n" % i for i in range(20000))  # > TAIL_BYTES, and more than a pipe holds
        os.write(w, payload[:70000])
        os.write(w, payload[70000:])
        tails.launched(0)  # the writers are gone: the pipes end
        tails.launched(1)
        tails.stop()
    assert through.read_bytes() == payload
    assert tails.tail(1).encode() == payload[-TAIL_BYTES:]
    assert tails.tail(0) == ""


HELD_CLASS = """import sys
class Held:
    def __del__(self):
        sys.stderr.write("freed\\n")
"""
HELD = """import atexit, os, sys
from held_class import Held
held = Held()
atexit.register(sys.stderr.write, "atexit ran\\n")
sys.stderr.write(f"as {__name__} from {os.path.basename(globals().get('__file__', '-c'))}\\n")
"""
"""A program whose namespace is in no reference cycle (its class lives in another module): freed as soon as nothing
holds it."""


@pytest.mark.slow
@pytest.mark.parametrize("form", ["script", "-c"])
def test_a_ranks_program_runs_as_main_and_its_objects_outlive_it(tmp_path: Path, form: str) -> None:
    # A rank's objects are never destroyed when its program returns (the launcher's own namespace holds them until
    # the rank ends with os._exit): freeing a DDP model there deadlocks in gloo's teardown. Its atexit handlers run.
    script = tmp_path / "held.py"
    script.write_text(HELD)
    (tmp_path / "held_class.py").write_text(HELD_CLASS)
    program = [sys.executable, str(script)] if form == "script" else [sys.executable, "-c", HELD]
    out = str(tmp_path / "out")
    result = _meshscope(
        "run", "--nproc", "1", "--out", out, "--", *program, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}
    )
    assert result.returncode == 4, result.stderr  # no tracker, no records: nothing to analyse
    said = (tmp_path / "out" / "ranks" / "rank-0.stderr").read_text()
    assert f"as __main__ from {'held.py' if form == 'script' else '-c'}\n" in said
    assert "atexit ran\n" in said
    assert "freed" not in said


def test_the_first_rank_to_exit_is_the_failure_even_when_both_have_exited_before_the_launcher_looks() -> None:
    """Rank 1 dies at once with code 3; rank 0 fails 0.4 s later with code 1 (as a peer fails in its next
    collective). Both have exited before the launcher looks; it must name rank 1, which exited first, not rank 0, the
    lowest rank found exited (what it named before, and what a loaded machine showed in the e2e tests)."""
    late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.4); raise SystemExit(1)"])
    first = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    for p in (late, first):  # exited, not reaped: the launcher reaps them
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
    procs = [_RankProcess(0, late.pid, late), _RankProcess(1, first.pid, first)]
    failed, stopped = _monitor(procs, grace_s=1.0)
    if Path(f"/proc/{os.getpid()}/sched").exists():
        assert (failed, stopped) == (RankExit(rank=1, code=3), 0)
    else:  # no scheduler statistics: the ranks keep their order (docs: the launcher's first failure)
        assert (failed, stopped) == (RankExit(rank=0, code=1), 0)
    assert [p.code for p in procs] == [1, 3]  # both reaped


@pytest.mark.parametrize("first_cpu", [0, 1])
def test_the_first_rank_to_exit_is_named_when_the_ranks_died_on_cpus_whose_clocks_differ(first_cpu: int) -> None:
    """As above, each rank pinned to its own CPU, both ways round. The kernel stamps a process's last run with its
    CPU's scheduler clock, and the CPUs' clocks drift apart (0.87 s on this kind of virtual machine, more than the
    0.4 s between the exits): compared raw, one of the two orders names the rank that died last (what CI showed)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs in the affinity mask: with one, every stamp is on the same clock (test above)")
    pin_first, pin_late = cpus[first_cpu], cpus[1 - first_cpu]
    late_code = f"import os, time; os.sched_setaffinity(0, {{{pin_late}}}); time.sleep(0.4); raise SystemExit(1)"
    late = subprocess.Popen([sys.executable, "-c", late_code])
    first_code = f"import os; os.sched_setaffinity(0, {{{pin_first}}}); raise SystemExit(3)"
    first = subprocess.Popen([sys.executable, "-c", first_code])
    for p in (late, first):
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
    procs = [_RankProcess(0, late.pid, late), _RankProcess(1, first.pid, first)]
    if not Path(f"/proc/{late.pid}/sched").exists():
        for p in (late, first):
            p.wait()
        pytest.skip("no scheduler statistics under /proc: the ranks keep their order (test above)")
    failed, stopped = _monitor(procs, grace_s=1.0)
    assert (failed, stopped) == (RankExit(rank=1, code=3), 0)
    assert [p.code for p in procs] == [1, 3]


GROUPS_OUTLIVE = """import gc, sys, weakref
import torch.distributed as dist

def main():
    dist.init_process_group("gloo")
    group = dist.new_group([0])
    dist.destroy_process_group()
    return weakref.ref(group), weakref.ref(dist.group.WORLD) if dist.group.WORLD is not None else None

kept, _ = main()
gc.collect()
sys.stderr.write(f"group alive: {kept() is not None}\\n")
"""
"""A program whose group is a local of ``main()``, destroyed there: plain Python frees it when ``main`` returns."""


@pytest.mark.slow
def test_process_groups_a_rank_destroys_outlive_its_program(tmp_path: Path) -> None:
    # A gloo group freed by a Python deallocation (a DDP model's reducer holding its last reference, when main()
    # returns) joins its workers with the GIL held and can deadlock; the forked rank keeps every destroyed group.
    script = tmp_path / "groups.py"
    script.write_text(GROUPS_OUTLIVE)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    plain = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        check=False,
    )
    assert "group alive: False\n" in plain.stderr, plain.stderr  # the control: without the launcher it is freed
    result = _meshscope(
        "run", "--nproc", "1", "--out", str(tmp_path / "out"), "--", sys.executable, str(script), cwd=tmp_path
    )
    assert result.returncode == 4, result.stderr  # no tracker, no records: nothing to analyse
    said = (tmp_path / "out" / "ranks" / "rank-0.stderr").read_text()
    assert "group alive: True\n" in said


HANGS = """
import os, pathlib, sys, time
from meshscope import sdk
tracker = sdk.tracker_from_env()
with tracker.step(0):
    pass  # its record is sent as the step ends, before the pid file says the rank is stuck
pathlib.Path(sys.argv[1], f"rank-{os.environ['RANK']}.pid").write_text(str(os.getpid()))
while True:  # a job stuck in a collective that never completes
    time.sleep(0.05)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("launcher", ["fork", "exec"])
def test_a_stop_signal_stops_every_rank_and_keeps_what_they_sent(tmp_path: Path, sig: int, launcher: str) -> None:
    # `timeout`, `kill`, a CI runner or a scheduler stop `meshscope run` with SIGTERM. Before, the launcher died
    # alone: its ranks ran on under PID 1 (a hung job forever), and no collector.json was written.
    out = tmp_path / "out"
    run = subprocess.Popen(
        [sys.executable, "-m", "meshscope", "run", "--nproc", "2", "--out", str(out), "--launcher", launcher,
         "--grace", "2", "--", sys.executable, "-c", HANGS, str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    pids = [tmp_path / f"rank-{r}.pid" for r in range(2)]
    deadline = time.monotonic() + 60
    while not all(p.is_file() and p.read_text() for p in pids):
        assert run.poll() is None, run.communicate()
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.05)
    run.send_signal(sig)
    try:
        _, stderr = run.communicate(timeout=60)
        alive = [p for p in pids if _alive(int(p.read_text()))]
    finally:  # a launcher that lets its ranks outlive it must not leave them running after the test
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(p.read_text()), signal.SIGKILL)
    assert alive == []  # no rank outlives the launcher
    assert run.returncode == 128 + sig, stderr[-2000:]
    name = signal.Signals(sig).name
    assert f"meshscope run: stopped by {name}; stopped 2 ranks; what they sent is in {out / 'records.jsonl'}" in stderr
    assert f"(meshscope analyze {out} analyses it)" in stderr
    collector = json.loads((out / "collector.json").read_text())
    assert collector["ranks"]
    assert collector["ended_by"] == f"stopped by {name}"
    assert sum(1 for line in (out / "records.jsonl").read_text().splitlines() if line.strip()) == 2


@pytest.mark.parametrize(
    "command",
    [
        ["python", "nothere.py"],
        ["python3", "-u", "-X", "dev", "nothere.py", "--lr", "1"],
        [sys.executable, "nothere.py"],
    ],
)
def test_a_script_that_does_not_exist_is_refused_in_one_line_and_nothing_launched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    from meshscope.cli import main  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert main(["run", "--nproc", "2", "--out", str(out), "--", *command]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        (
            f"meshscope: error: {command[0]}: cannot open the script 'nothere.py': no such file or directory (from "
            f"{tmp_path}); give its path, relative to the current directory or absolute"
        )
    ]
    assert not out.exists()  # nothing launched


def test_a_module_or_code_command_is_not_taken_for_a_script() -> None:
    from meshscope.local.running import _script_of  # noqa: PLC0415

    assert _script_of(["python", "-m", "nothere"]) is None
    assert _script_of(["python", "-mnothere"]) is None
    assert _script_of(["python", "-c", "print(1)"]) is None
    assert _script_of(["bash", "nothere.py"]) is None
    assert _script_of(["python", "-W", "ignore", "train.py", "-m", "x"]) == "train.py"


DIES_IN_A_STEP = """\
import torch
from meshscope.sdk import tracker_from_env

tracker = tracker_from_env()
for i in range(6):
    tracker.start_step(i)  # no block to see an exception leave: the step is still open when the program dies
    torch.ones(64, 64) @ torch.ones(64, 64)
    if i == 3:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
"""


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["fork", "exec"])
def test_a_program_that_dies_inside_an_open_step_marks_it_raised(tmp_path: Path, launcher: str) -> None:
    (tmp_path / "train.py").write_text(DIES_IN_A_STEP)
    out = tmp_path / "out"
    result = _meshscope(
        "run", "--nproc", "1", "--launcher", launcher, "--out", str(out), "--", "python", "train.py", cwd=tmp_path
    )
    assert result.returncode == 1, result.stderr
    lines = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [(o["step"], o.get("raised")) for o in lines] == [
        (0, None),
        (1, None),
        (2, None),
        (3, "torch.OutOfMemoryError"),
    ]
    notes = {n["code"]: n for n in json.loads((out / "analysis.json").read_text())["partial_data"]}
    assert notes["raised_steps"]["message"].startswith("1 rank-step ended by an exception (rank 0 step 3) left out")


@pytest.mark.slow
def test_a_program_that_dies_in_its_first_step_is_told_so_not_an_empty_input(tmp_path: Path) -> None:
    # Before: "no step records to analyse (the input is empty); fix: fix the script's tracker calls", where the
    # records held the step the exception cut short and the tracker calls were right.
    (tmp_path / "train.py").write_text(DIES_IN_A_STEP.replace("if i == 3:", "if i == 0:"))
    out = tmp_path / "out"
    result = _meshscope("run", "--nproc", "1", "--out", str(out), "--", "python", "train.py", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert (
        "no step records to analyse, every one was cut short: 1 rank-step ended by an exception (rank 0 step 0) left "
        "out: cut short where the training loop raised"
    ) in result.stderr, result.stderr[-3000:]
    assert "fix: the exception the script raised (the ranks' output above)" in result.stderr
    assert "the input is empty" not in result.stderr


ASKS_FOR_TWO = """\
import torch.distributed as dist

dist.init_process_group("gloo", world_size=2, rank=0)  # as Lightning's devices=2 does, under --nproc 1
print("joined")
"""


@pytest.mark.slow
def test_a_process_group_of_more_ranks_than_were_started_fails_at_once_with_the_fix(tmp_path: Path) -> None:
    # Before: the rank waited in the rendezvous for a rank that never starts, silently, until killed.
    (tmp_path / "train.py").write_text(ASKS_FOR_TWO)
    started = time.monotonic()
    result = _meshscope("run", "--nproc", "1", "--out", str(tmp_path / "out"), "--", "python", "train.py", cwd=tmp_path)
    assert time.monotonic() - started < 100  # torch's own rendezvous would wait 30 minutes
    assert result.returncode == 1, result.stderr
    assert "joined" not in result.stdout
    assert "asks init_process_group for world_size=2: it would wait for ranks that never start" in result.stderr
    assert (
        "meshscope run: fix: the script's process group has 2 ranks: run it with meshscope run --nproc 2 (with "
        "Lightning, devices x num_nodes must equal --nproc)"
    ) in result.stderr


def test_the_fix_for_a_process_group_of_another_size_names_the_count() -> None:
    from meshscope.local.tails import fix_for  # noqa: PLC0415

    assert fix_for("RuntimeError: ... asks init_process_group for world_size=4: it would ...", python=None) == (
        "the script's process group has 4 ranks: run it with meshscope run --nproc 4 (with Lightning, devices x "
        "num_nodes must equal --nproc)"
    )


def test_an_earlier_run_in_the_same_out_is_kept_aside_not_overwritten(tmp_path: Path) -> None:
    # A crashed run and its resumed run given the same --out: the second overwrote the first's records.jsonl and
    # left the first's ranks' stderr beside its own, without a word.
    out = tmp_path / "out"
    out.mkdir()
    assert keep_earlier_run(out) is None
    (out / "records.jsonl").write_text("first\n")
    (out / "ranks").mkdir()
    (out / "ranks" / "rank-1.stderr").write_text("Traceback ...\n")
    (out / "ckpt.pt").write_text("the script's own")
    os.utime(out / "records.jsonl", (1_700_000_000, 1_700_000_000))
    kept = keep_earlier_run(out)
    assert kept == out / "earlier" / "20231114T221320Z"
    assert (kept / "records.jsonl").read_text() == "first\n"
    assert (kept / "ranks" / "rank-1.stderr").is_file()
    assert not (out / "records.jsonl").exists()
    assert not (out / "ranks").exists()
    assert (out / "ckpt.pt").is_file()  # not meshscope's: left where the script put it
    # A second earlier run of the same second gets its own folder.
    (out / "records.jsonl").write_text("second\n")
    os.utime(out / "records.jsonl", (1_700_000_000, 1_700_000_000))
    again = keep_earlier_run(out)
    assert again == out / "earlier" / "20231114T221320Z-2"
    assert (again / "records.jsonl").read_text() == "second\n"


@pytest.mark.slow
def test_meshscope_run_says_where_the_earlier_runs_files_went(tmp_path: Path) -> None:
    out = tmp_path / "out"
    script = "import sys; print('ran', file=sys.stderr)"
    first = _meshscope("run", "--nproc", "1", "--out", str(out), "--", "python", "-c", script, cwd=tmp_path)
    assert (out / "collector.json").is_file(), first.stderr[-2000:]
    second = _meshscope("run", "--nproc", "1", "--out", str(out), "--", "python", "-c", script, cwd=tmp_path)
    (kept,) = (out / "earlier").iterdir()
    assert f"meshscope run: {out} held an earlier run: its files are kept in {kept}" in second.stderr
    assert (kept / "collector.json").is_file()
    assert (out / "collector.json").is_file()  # the second run's own


@pytest.mark.parametrize(
    ("launch", "said"),
    [
        ({"ended_by": "interrupted"}, "the run ended early (interrupted)"),
        ({"ended_by": "rank 1 was killed by signal 9 (SIGKILL)"}, "(rank 1 was killed by signal 9 (SIGKILL))"),
        ({"exit_codes": {"0": -15, "1": 0}}, "(ranks exited with rank 0: -15)"),  # written before ended_by
        ({"ended_by": None, "exit_codes": {"0": 0, "1": 0}}, None),
    ],
    ids=["interrupted", "rank-failed", "older-file", "completed"],
)
def test_records_of_a_run_that_ended_early_say_so_when_analysed_again(
    tmp_path: Path, launch: dict, said: str | None
) -> None:
    # Ctrl-C'd or killed, then `meshscope analyze OUT`: the records read as a complete run.
    shutil.copy(DATA / "dp8_straggler" / "records.jsonl", tmp_path / "records.jsonl")
    (tmp_path / "collector.json").write_text(json.dumps({"cpu": {}, **launch}))
    done = _meshscope("analyze", str(tmp_path), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    notes = {n["code"]: n["message"] for n in json.loads(done.stdout)["partial_data"]}
    if said is None:
        assert "run_ended_early" not in notes
    else:
        assert said in notes["run_ended_early"]
        assert notes["run_ended_early"].endswith(f"({tmp_path / 'collector.json'})")

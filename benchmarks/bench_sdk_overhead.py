"""What the meshscope SDK costs a training job, measured so that a noisy shared machine cannot fake the answer.

Three measurements, printed as tables (issue 4's bar: step time with the SDK / without <= 1.01 on the CPU job, and
under 5 µs per captured collective):

1. **The job, SDK on vs off.** The same ``examples/train_tiny.py`` job under ``meshscope run`` (fork launcher, run
   in-process with ``running.run_job``), alternately with ``MESHSCOPE_DISABLE=1`` and without, the order swapped
   every round. Every rank runs through this script (``--as-rank``), which times each ``tracker.step(...)`` from
   outside, identically in both arms: wall seconds, CPU seconds of the rank process (all its threads:
   ``time.process_time``) and the training thread's CPU seconds spent ending the step (the SDK's record building and
   sending: ``time.thread_time``, so that waiting for a core is not counted). Per run:
   the median over the measured steps of the step time (mean over ranks) and of the CPU seconds per step (summed
   over ranks). Per round: the paired ratios on/off. Reported: the median of the paired ratios with the
   interquartile range and a bootstrap 95 % interval of the median. The CPU ratio is far less sensitive to foreign
   load than wall time (other processes take wall time from the job, not CPU time). Three jobs: **the CPU job** is the
   one ``meshscope demo`` runs (8 ranks, pp=2 dp=2 tp=2, an emulated accelerator at 40 ms per block forward:
   sleeps make its timing deterministic, cpu-testbed.md §5.2); the **real-compute job** is dp=2 tp=2 on 4 ranks with
   no emulation (every step is CPU work, the worst case for a CPU overhead); the **DDP-style script** is
   ``tests/scripts/nanogpt_ddp.py`` (a nanoGPT-shaped DDP loop with ``start_step()`` at the top of its ``while True``
   body, real compute) on 2 ranks, one per core, at the tests' size (a 15 ms step) and with a larger model (0.5 s).
   Issue 9's bar: on the demo's job and the DDP-style script, the
   CPU-implied ratio (below) <= 1.01 with its 95 % interval. Per kind of thread (the training thread,
   gloo's TCP loops, gloo's workers, others), every thread's CPU clock over the measured steps, and the paired
   differences on - off with their 95 % interval: where extra CPU outside the training thread would come from.
2. **The hot path per captured operation**: a 1-process gloo group, blocks of 100 operations alternating without and
   with a tracker; per operation the difference of the medians in wall time and in CPU time of the calling thread
   (``time.thread_time``: what the SDK itself costs, without the backend thread's wake-up jitter). Also per attention
   call (forward + backward), per phase, and the cost of ending a step of 100 captured collectives (build, encode,
   send its record to a real collector).
3. **The parts**: from a census run of each job (captured collectives, attention calls and phases per rank and
   step), Σ count x µs + the step end measured in the job, beside the measured extra CPU and the step time. The loops
   of 2. run with warm caches; in a job every hook runs between framework code that evicts them, so the measured
   extra CPU is larger than the sum (by 2-4x on this machine).

    .venv/bin/python benchmarks/bench_sdk_overhead.py                 # defaults: ~5 min on this 2-core machine
    .venv/bin/python benchmarks/bench_sdk_overhead.py --rounds 3 --real-rounds 3 --steps 6   # quicker, noisier
    .venv/bin/python benchmarks/bench_sdk_overhead.py --skip-job      # the per-operation part only (~15 s)
    .venv/bin/python benchmarks/bench_sdk_overhead.py --concurrent --rounds 6 --real-rounds 0 --ddp-rounds 10
        # each round's two arms side by side, at once: both see the same machine (docs/sdk.md §8.6)

Every rank pins itself to one core (rank r on core r mod cores, ``--no-pin`` to let the scheduler place them): with
the scheduler free to move ranks mid-step, one round's CPU seconds differed from the next's by up to 6 % on the DDP
job; pinned, the paired CPU ratios of 20 rounds stayed within 0.99-1.02 (2026-12-05, idle 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import runpy
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from timing import machine_reference

if TYPE_CHECKING:
    from collections.abc import Callable

REPO = Path(__file__).resolve().parents[1]
TRAIN_TINY = REPO / "examples" / "train_tiny.py"
DDP_SCRIPT = REPO / "tests" / "scripts" / "nanogpt_ddp.py"
"""The nanoGPT-style DDP loop of the real-script tests: gradient accumulation, ``start_step()`` at the top of a
``while True`` body, eval every 4 iterations, real compute (no emulation); run on 2 ranks, one per core here."""
DDP_LARGER = ("--n-layer", "4", "--n-embd", "256", "--block-size", "128", "--batch-size", "8")
"""The same script with a 3.2 M-parameter model: about 0.5 s a step on this machine's CPU cores, where the test
size takes 15 ms (a step of real training lasts 0.1-10 s; the SDK's cost per step is fixed, its share is not)."""
BAR = 1.01
"""Issue 4's bar on the median step-time ratio, SDK on / off, of the CPU job."""
WARMUP_STEPS = 2
PIN_ENV = "MESHSCOPE_BENCH_PIN"
"""Set in the ranks' environment by ``--pin``: each rank pins itself to one core (:func:`as_rank`)."""
"""Steps left out of every job figure: warm-up (allocations, first gathers) and the SDK's one-off measurements
(model-state count, saved-tensor hooks), which run in steps 0 and 1 only."""

# ====================================================================== inside every rank (--as-rank)


class StepTimer:
    """Times every step of a rank from outside the tracker, identically whether the SDK is on or off.

    A step is either a ``with tracker.step(...)`` block, or runs from one ``start_step()`` to the next (or to
    ``end_step()``), as in loops that call ``start_step()`` at the top of their body (nanoGPT's shape); the call that
    ends a step is its end. Per step: (wall seconds, process CPU seconds, training-thread CPU seconds spent ending
    it, training-thread CPU seconds in all).
    """

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, float, float]] = []
        self.threads = ThreadCpu()
        self._open: tuple[float, float, float] | None = None
        """(wall, process CPU, thread CPU) at the open step's start."""

    def begin(self) -> None:
        self._open = (time.perf_counter(), time.process_time(), time.thread_time())

    def finish(self, e0: float, e1: float) -> None:
        """End the open step (if any) whose ending ran in the thread-CPU span ``e0``..``e1``."""
        if self._open is not None:
            t0, c0, tt0 = self._open
            self._open = None
            self.steps.append((time.perf_counter() - t0, time.process_time() - c0, e1 - e0, e1 - tt0))
            self.threads.after_step(len(self.steps))  # outside every timed span

    def install(self, classes: tuple[type, ...]) -> None:
        """Wrap ``step``, ``start_step`` and ``end_step`` of each tracker class."""
        timer = self

        class Timed:
            __slots__ = ("inner",)

            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __enter__(self) -> None:
                timer.begin()
                self.inner.__enter__()

            def __exit__(self, *exc: object) -> None:
                e0 = time.thread_time()
                self.inner.__exit__(*exc)
                timer.finish(e0, time.thread_time())

        def timed_step(orig: Callable[[Any, int | None], Any]) -> Callable[..., Timed]:
            return lambda self, step=None: Timed(orig(self, step))

        def timed_start(orig: Callable[[Any, int | None], None]) -> Callable[..., None]:
            def start_step(self: Any, step: int | None = None) -> None:
                e0 = time.thread_time()
                orig(self, step)
                timer.finish(e0, time.thread_time())
                timer.begin()

            return start_step

        def timed_end(orig: Callable[[Any], None]) -> Callable[[Any], None]:
            def end_step(self: Any) -> None:
                e0 = time.thread_time()
                orig(self)
                timer.finish(e0, time.thread_time())

            return end_step

        for cls in classes:
            cls.step = timed_step(cls.step)  # type: ignore[attr-defined]
            cls.start_step = timed_start(cls.start_step)  # type: ignore[attr-defined]
            cls.end_step = timed_end(cls.end_step)  # type: ignore[attr-defined]


def as_rank(out_dir: Path, script: str, args: list[str], *, census: bool) -> None:
    """Run ``script`` as this rank's program, timing every step from outside (:class:`StepTimer`); write
    ``rank-N.json``.

    The timing wrapper is the same whether the SDK is on (``Tracker``) or off (``NullTracker``). With ``census`` the
    tracker's callbacks are also counted (a few hundred ns each: only in the census run, never in a timed one).
    """
    from meshscope.sdk import operations as operations_module  # noqa: PLC0415
    from meshscope.sdk import tracker as tracker_module  # noqa: PLC0415

    timer = StepTimer()
    timer.install((tracker_module.Tracker, tracker_module.NullTracker))
    counts: dict[str, int] = dict.fromkeys(("collective", "functional", "p2p", "attention", "phase"), 0)
    if census:
        names = {  # the capture patches' callbacks live on the tracker's Operations; phases on the Tracker
            (operations_module.Operations, "on_collective"): "collective",
            (operations_module.Operations, "on_functional"): "functional",
            (operations_module.Operations, "on_p2p"): "p2p",
            (operations_module.Operations, "on_attention_forward"): "attention",
            (tracker_module.Tracker, "_push"): "phase",
        }
        for (cls, method), key in names.items():
            orig = getattr(cls, method)

            def counted(self: Any, *a: Any, _orig: Any = orig, _key: str = key, **kw: Any) -> Any:
                if self._step is not None if hasattr(self, "_ops") else self.step is not None:
                    counts[_key] += 1
                return _orig(self, *a, **kw)

            setattr(cls, method, counted)
    rank = os.environ.get("RANK", "0")
    if os.environ.get(PIN_ENV) and hasattr(os, "sched_setaffinity"):
        # Rank r on core r mod cores, for the whole run (its gloo threads inherit it): the scheduler no longer moves a
        # rank between cores mid-step, which is what made one round's CPU seconds differ from the next's.
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(rank) % len(cores)]})
    log_fd = os.open(out_dir / f"rank-{rank}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    os.dup2(log_fd, 1)  # the script's progress lines go to a file, not between the benchmark's tables
    os.close(log_fd)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))  # as `python SCRIPT` does (the script's own imports)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        (out_dir / f"rank-{rank}.json").write_text(
            json.dumps(
                {
                    "steps": timer.steps,
                    "counts": counts,
                    "threads": timer.threads.used(),
                    "thread_steps": timer.threads.steps,
                }
            )
        )


def thread_cpu_ns() -> dict[str, int]:
    """CPU ns of every thread of this process so far, by ``kind:tid`` (kind: ``main`` or the thread's comm name).

    A thread's CPU clock is read through its Linux clock id, ``((~tid) << 3) | 6`` (``CPUCLOCK_SCHED`` |
    ``CPUCLOCK_PERTHREAD``: ``MAKE_THREAD_CPUCLOCK`` in the kernel's ``include/linux/posix-timers.h``), in ns, unlike
    ``/proc/.../stat``'s 10 ms ticks; the threads of native code (gloo's workers, OpenMP) are included.
    """
    out: dict[str, int] = {}
    pid = os.getpid()
    for entry in Path("/proc/self/task").iterdir():
        tid = int(entry.name)
        try:
            cpu = time.clock_gettime_ns(((~tid) << 3) | 6)
            comm = "main" if tid == pid else (entry / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[f"{comm}:{tid}"] = cpu
    return out


class ThreadCpu:
    """Every thread's CPU over the measured steps: read at the end of the warm-up and after every later step."""

    __slots__ = ("first", "last", "steps")

    def __init__(self) -> None:
        self.first: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.steps = 0
        """Measured steps between the two readings."""

    def after_step(self, finished: int) -> None:
        """``finished`` steps have ended (this one included)."""
        if finished == WARMUP_STEPS:
            self.first = thread_cpu_ns()
        elif finished > WARMUP_STEPS:
            self.last = thread_cpu_ns()
            self.steps = finished - WARMUP_STEPS

    def used(self) -> dict[str, int]:
        """CPU ns per thread (``kind:tid``) over the measured steps; a thread started meanwhile counts from 0."""
        return {k: v - self.first.get(k, 0) for k, v in self.last.items()}


# ====================================================================== 1. the job, SDK on vs off

THREAD_KINDS: dict[str, str] = {
    "main": "training thread",
    "gloo_tcp_loop": "gloo TCP loops",
    "pt_gloo_runloop": "gloo workers",
}
"""Thread name (``comm``) -> how the per-thread table calls it. gloo's TCP loop (one per process-group device) reads
and writes the sockets; its workers (``ProcessGroupGloo``'s run loops, 2 per group) run the collectives' algorithms
and the completion callbacks of their futures."""
OTHER_THREADS = "other threads"


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """One job of the comparison."""

    name: str
    script: Path
    nproc: int
    layout: str
    args: tuple[str, ...]
    rounds: int
    steps_flag: str = "--steps"
    """The script's flag for how many steps it runs."""


@dataclass(slots=True)
class RunResult:
    """What one run of a job measured (after the warm-up steps)."""

    step_s: float
    """Median over steps of the step time (mean over ranks), seconds."""
    cpu_s: float
    """Median over steps of the CPU seconds of all rank processes together, per step."""
    thread_cpu_s: float
    """Median over steps of the training threads' CPU seconds per step, summed over ranks."""
    end_s: float
    """Median over rank-steps of the training thread's CPU seconds spent ending a step (the SDK's record)."""
    counts: dict[str, float] = field(default_factory=dict)
    """Census: captured calls per rank-step, by kind."""
    threads_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds per rank-step by kind of thread (:data:`THREAD_KINDS`), over the measured steps, mean over ranks."""


def run_once(
    job: JobSpec, *, enabled: bool, steps: int, out: Path, census: bool = False, pin: bool = False
) -> RunResult:
    """Run ``job`` once and read what its ranks measured."""
    from meshscope.local import RunSettings, run_job  # noqa: PLC0415
    from meshscope.topology import parse_layout  # noqa: PLC0415

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--as-rank", str(out)]
    command += ["--census"] if census else []
    command += ["--", str(job.script), job.steps_flag, str(steps + WARMUP_STEPS), *job.args]
    env = {"PYTHONWARNINGS": "ignore"}
    if pin:
        env[PIN_ENV] = "1"
    if not enabled:
        env["MESHSCOPE_DISABLE"] = "1"
    settings = RunSettings(
        nproc=job.nproc,
        command=tuple(command),
        layout=parse_layout(job.layout),
        out_dir=out,
        job="bench",
        launcher="fork",
        extra_env=env,
    )
    code = run_job(settings)
    if code != 0:
        raise SystemExit(f"the {job.name} job failed with exit code {code} (its output is above)")
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(job.nproc)]
    per_rank = [r["steps"][WARMUP_STEPS:] for r in ranks]
    n = min(len(s) for s in per_rank)
    step_s = statistics.median(statistics.fmean(s[i][0] for s in per_rank) for i in range(n))
    cpu_s = statistics.median(sum(s[i][1] for s in per_rank) for i in range(n))
    end_s = statistics.median(x[2] for s in per_rank for x in s)
    thread_cpu_s = statistics.median(sum(s[i][3] for s in per_rank) for i in range(n))
    counted_steps = job.nproc * (steps + WARMUP_STEPS)
    counts = {k: sum(r["counts"][k] for r in ranks) / counted_steps for k in ranks[0]["counts"]}
    threads_s = dict.fromkeys((*THREAD_KINDS.values(), OTHER_THREADS), 0.0)
    for r in ranks:
        for key, ns in r["threads"].items():
            kind = THREAD_KINDS.get(key.rsplit(":", 1)[0], OTHER_THREADS)
            threads_s[kind] += ns / 1e9 / max(1, r["thread_steps"]) / job.nproc
    return RunResult(
        step_s=step_s, cpu_s=cpu_s, thread_cpu_s=thread_cpu_s, end_s=end_s, counts=counts, threads_s=threads_s
    )


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _bootstrap_median(xs: list[float], *, draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of the median of ``xs`` (rounds resampled with replacement)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


@dataclass(slots=True)
class JobSummary:
    """The paired comparison of one job."""

    job: JobSpec
    rounds: list[tuple[RunResult, RunResult]]
    """(off, on) per round."""
    solo_step_s: float | None = None
    """With ``--concurrent``: the median step time of SDK-off runs alone, the step the CPU-implied ratio divides by
    (a pair's own step times are those of two jobs sharing the cores)."""

    def ratios(self, attr: str) -> list[float]:
        return [getattr(on, attr) / getattr(off, attr) for off, on in self.rounds]

    def median(self, attr: str, *, on: bool) -> float:
        return statistics.median(getattr(pair[1 if on else 0], attr) for pair in self.rounds)


def run_pair_at_once(job: JobSpec, *, steps: int, out: Path, pin: bool) -> tuple[RunResult, RunResult]:
    """Run ``job`` with the SDK off and on at the same time (two forked children of this process); (off, on)."""
    out.mkdir(parents=True, exist_ok=True)
    pids: dict[bool, int] = {}
    for enabled in (False, True):
        pid = os.fork()
        if pid == 0:  # the child runs one arm and leaves without running the parent's exit handlers
            code = 1
            try:
                result = run_once(job, enabled=enabled, steps=steps, out=out / f"arm-{enabled}", pin=pin)
                (out / f"arm-{enabled}.json").write_text(json.dumps(asdict(result)))
                code = 0
            finally:
                os._exit(code)
        pids[enabled] = pid
    for enabled, pid in pids.items():
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise SystemExit(f"the {job.name} job with the SDK {'on' if enabled else 'off'} failed (output above)")
    off, on = (RunResult(**json.loads((out / f"arm-{e}.json").read_text())) for e in (False, True))
    return off, on


def bench_job(job: JobSpec, steps: int, tmp: Path, *, pin: bool = False, concurrent: bool = False) -> JobSummary:
    """Alternate SDK-off and SDK-on runs of ``job``, ``job.rounds`` rounds, the first arm swapped every round.

    ``concurrent``: each round runs both arms at the same time instead, so that both see the same machine: on a
    virtual machine the CPU seconds the same work takes drift by tens of per cent from one half-minute to the next
    (another guest on the host), which paired runs one after the other cannot cancel and paired runs side by side
    do. Two SDK-off runs alone give the step time the CPU-implied ratio divides by.
    """
    what = f"{job.script.name} {' '.join(job.args)}".rstrip()
    print(f"\n{job.name}: {what} on {job.nproc} ranks ({job.layout}), {steps} measured steps")
    if concurrent:
        solo = [run_once(job, enabled=False, steps=steps, out=tmp / f"{job.name}-solo-{i}", pin=pin) for i in (0, 1)]
        solo_step_s = statistics.median(r.step_s for r in solo)
        print(f"  (+{WARMUP_STEPS} warm-up) per run, {job.rounds} rounds of (off, on) runs side by side, at once;")
        print(f"  alone with the SDK off: {solo_step_s * 1e3:.1f} ms per step (the CPU-implied ratio's step)")
        print("  (a round's step times are those of two jobs sharing the cores: compare CPU, not step times)")
    else:
        solo_step_s = None
        print(
            f"  (+{WARMUP_STEPS} warm-up) per run, {job.rounds} rounds of (off, on) runs alternating which goes first"
        )
    print(f"  {'round':>5s} {'off ms/step':>12s} {'on ms/step':>11s} {'ratio':>6s}   {'off CPU ms':>10s} "
          f"{'on CPU ms':>10s} {'ratio':>6s}   {'step end µs':>11s}")  # fmt: skip
    rounds = []
    for i in range(job.rounds):
        if concurrent:
            off, on = run_pair_at_once(job, steps=steps, out=tmp / f"{job.name}-{i}", pin=pin)
        else:
            pair: dict[bool, RunResult] = {}
            for enabled in (i % 2 == 1, i % 2 == 0):
                out = tmp / f"{job.name}-{i}-{enabled}"
                pair[enabled] = run_once(job, enabled=enabled, steps=steps, out=out, pin=pin)
            off, on = pair[False], pair[True]
        rounds.append((off, on))
        print(
            f"  {i:5d} {off.step_s * 1e3:12.1f} {on.step_s * 1e3:11.1f} {on.step_s / off.step_s:6.3f}   "
            f"{off.cpu_s * 1e3:10.1f} {on.cpu_s * 1e3:10.1f} {on.cpu_s / off.cpu_s:6.3f}   {on.end_s * 1e6:11.0f}"
        )
    return JobSummary(job=job, rounds=rounds, solo_step_s=solo_step_s)


def print_job_summary(s: JobSummary) -> None:
    print(f"  {s.job.name}: {len(s.rounds)} rounds, paired ratio SDK on / off")
    print(f"    {'measure':34s} {'median':>7s} {'IQR':>15s} {'95 % CI of median':>17s} {'off':>10s} {'on':>10s}")
    for attr, label in (
        ("step_s", "step time"),
        ("cpu_s", "CPU per step, all rank processes"),
        ("thread_cpu_s", "CPU per step, training threads"),
    ):
        r = s.ratios(attr)
        q1, q3 = _quartiles(r)
        lo, hi = _bootstrap_median(r)
        off, on = s.median(attr, on=False) * 1e3, s.median(attr, on=True) * 1e3
        print(
            f"    {label:34s} {statistics.median(r):7.4f} {q1:7.4f}-{q3:7.4f} {lo:8.4f}-{hi:8.4f} "
            f"{off:7.1f} ms {on:7.1f} ms"
        )
    extra_cpu = statistics.median((on.cpu_s - off.cpu_s) / s.job.nproc for off, on in s.rounds)
    print_threads(s)
    step = s.median("step_s", on=False)
    end_on, end_off = s.median("end_s", on=True) * 1e6, s.median("end_s", on=False) * 1e6
    print(
        f"    extra CPU per rank and step {extra_cpu * 1e3:+.2f} ms = {extra_cpu / step * 100:+.3f} % of the "
        f"{step * 1e3:.0f} ms step; ending a step costs the training thread {end_on:.0f} µs (SDK off: {end_off:.0f} µs)"
    )
    cores = min(s.job.nproc, os.cpu_count() or 1)
    implied = [1 + (on.cpu_s - off.cpu_s) / cores / (s.solo_step_s or off.step_s) for off, on in s.rounds]
    i_lo, i_hi = _bootstrap_median(implied)
    print(
        f"    CPU-implied step time ratio {statistics.median(implied):.4f} (95 % interval {i_lo:.4f}-{i_hi:.4f}): "
        f"1 + the extra CPU of all ranks / {cores} cores / step time, as if every extra CPU second lay on the "
        "critical path"
    )
    r = s.ratios("step_s")
    median, (lo, hi) = statistics.median(r), _bootstrap_median(r)
    if hi <= BAR:
        verdict = f"met: median {median:.4f}, and the 95 % interval ends at {hi:.4f}"
    elif lo > BAR:
        verdict = f"NOT met: median {median:.4f}, {(median - BAR) * 100:.2f} points above; interval {lo:.4f}-{hi:.4f}"
    else:
        verdict = (
            f"not resolved by the step times: median {median:.4f}, but the 95 % interval {lo:.4f}-{hi:.4f} spans "
            f"{BAR} (noise; run more rounds on an idle machine). The CPU-implied ratio above is the steadier figure"
        )
    print(f"    bar (step time ratio <= {BAR}): {verdict}")


def print_threads(s: JobSummary) -> None:
    """Extra CPU per rank-step by kind of thread: paired differences on - off, median and 95 % interval."""
    kinds = list(s.rounds[0][0].threads_s)
    if not kinds:
        return
    print("    CPU per rank-step by thread (whole measured steps, read from each thread's CPU clock):")
    print(f"      {'thread':18s} {'off':>9s} {'on':>9s} {'on - off: median':>17s} {'95 % CI of median':>19s}")
    for kind in [*kinds, "all threads"]:

        def total(r: RunResult, kind: str = kind) -> float:
            return sum(r.threads_s.values()) if kind == "all threads" else r.threads_s[kind]

        diffs = [(total(on) - total(off)) * 1e3 for off, on in s.rounds]
        lo, hi = _bootstrap_median(diffs)
        off_ms = statistics.median(total(off) for off, _ in s.rounds) * 1e3
        on_ms = statistics.median(total(on) for _, on in s.rounds) * 1e3
        print(
            f"      {kind:18s} {off_ms:6.2f} ms {on_ms:6.2f} ms {statistics.median(diffs):+14.2f} ms "
            f"{lo:+8.2f}..{hi:+.2f} ms"
        )


# ====================================================================== 2. hot path per operation

PER_BLOCK = 100
WARM_CALLS = 50
"""Calls before each timed block, in both arms, so that neither starts on caches another part left cold."""
"""Operations per block (and per step) in the hot-path loops."""


@dataclass(slots=True)
class HotPath:
    """Per-operation cost, µs: (wall, CPU of the calling thread), median differences with minus without the SDK."""

    per_op: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)
    """case -> (wall without, wall with, CPU without, CPU with), µs per operation."""
    step_end_us: float = 0.0
    """Ending a step of :data:`PER_BLOCK` captured collectives, µs."""
    records: tuple[int, int] = (0, 0)
    """Records received by the collector, records sent."""

    def cost(self, case: str) -> tuple[float, float]:
        w0, w1, c0, c1 = self.per_op[case]
        return w1 - w0, c1 - c0


def _hot_cases(group: Any, torch: Any) -> dict[str, Callable[[], object]]:
    import torch.distributed as dist  # noqa: PLC0415
    import torch.distributed._functional_collectives as funcol  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: N812, PLC0415

    x = torch.ones(1)
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    k = torch.randn(1, 2, 16, 8, requires_grad=True)
    v = torch.randn(1, 2, 16, 8, requires_grad=True)

    def attention() -> None:
        F.scaled_dot_product_attention(q * 1.0, k, v).sum().backward()

    return {
        "all_reduce (sync)": lambda: dist.all_reduce(x, group=group),
        "all_reduce (async + wait)": lambda: dist.all_reduce(x, group=group, async_op=True).wait(),
        "broadcast (sync)": lambda: dist.broadcast(x, src=0, group=group),
        "functional all_reduce + wait": lambda: funcol.all_reduce(x, "sum", group).wait(),
        "attention call (fwd + bwd)": attention,
    }


def _block(fn: Callable[[], object], n: int) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6, (time.thread_time() - c0) / n * 1e6


def bench_hot_path(blocks: int) -> HotPath:
    """Blocks of operations alternating without and with the SDK (so load drift hits both alike)."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from meshscope import sdk  # noqa: PLC0415
    from meshscope.sdk import RecordCollector  # noqa: PLC0415

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.new_group([0])
    sock_dir = Path(tempfile.mkdtemp(prefix="ms-b-"))
    collector = RecordCollector([sock_dir / "r0.sock"], sock_dir / "records.jsonl")
    collector.start()
    settings = sdk.TrackerSettings(collector=f"unix:{sock_dir / 'r0.sock'}", job="bench")
    result = HotPath()
    step = 0
    sent = 0

    def tracker() -> sdk.Tracker:
        t = sdk.Tracker(settings)
        t.register_group(group, "dp")
        return t

    for name, fn in _hot_cases(group, torch).items():
        n = PER_BLOCK // 4 if name.startswith("attention") else PER_BLOCK
        for _ in range(5):
            _block(fn, n)  # warm up
        base, capt = [], []
        for _ in range(blocks):
            _block(fn, WARM_CALLS)
            base.append(_block(fn, n))
            t = tracker()
            with t.step(step):
                # Starting a tracker looks once through every live object for DDP models to hook, which evicts the
                # caches: unwarmed, the block after it measured each captured call 4-20 µs dearer than it is in a
                # job, where that happens once at start (2026-12-06: an attention call 45 µs instead of 25).
                _block(fn, WARM_CALLS)
                capt.append(_block(fn, n))
            step += 1
            assert t.counters().hook_errors == 0
            t.close()
            sent += t.counters().records_sent
        result.per_op[name] = (
            statistics.median(b[0] for b in base),
            statistics.median(c[0] for c in capt),
            statistics.median(b[1] for b in base),
            statistics.median(c[1] for c in capt),
        )
    t = tracker()  # a phase: enter and exit, nothing inside
    phase = t.phase("forward")
    with t.step(step):
        laps = [_block(lambda: phase.__enter__() or phase.__exit__(None, None, None), PER_BLOCK) for _ in range(blocks)]
    step += 1
    result.per_op["phase (enter + exit)"] = (
        0.0,
        statistics.median(x[0] for x in laps),
        0.0,
        statistics.median(x[1] for x in laps),
    )
    fn = _hot_cases(group, torch)["all_reduce (sync)"]
    ends = []
    for _ in range(blocks):
        ctx = t.step(step)
        ctx.__enter__()
        for _ in range(PER_BLOCK):
            fn()
        t0 = time.perf_counter()
        ctx.__exit__(None, None, None)
        ends.append((time.perf_counter() - t0) * 1e6)
        step += 1
    result.step_end_us = statistics.median(ends)
    t.close()
    sent += t.counters().records_sent
    time.sleep(0.2)
    collector.stop()
    shutil.rmtree(sock_dir, ignore_errors=True)
    result.records = (collector.lines, sent)
    dist.destroy_process_group()
    return result


def print_hot_path(h: HotPath, blocks: int) -> None:
    print(f"\nhot path, 1-process gloo group, {blocks} alternating blocks (median per operation):")
    print(f"  {'operation':30s} {'wall without':>12s} {'with SDK':>9s} {'cost':>8s}   {'thread CPU cost':>15s}")
    for name, (w0, w1, c0, c1) in h.per_op.items():
        print(f"  {name:30s} {w0:9.1f} µs {w1:6.1f} µs {w1 - w0:5.1f} µs   {c1 - c0:12.1f} µs")
    print(f"  ending a step of {PER_BLOCK} captured collectives (record built, encoded, sent): {h.step_end_us:.0f} µs")
    print(f"  records received by the collector: {h.records[0]} of {h.records[1]} sent")


# ====================================================================== 3. the parts


def print_parts(census: RunResult, h: HotPath, s: JobSummary) -> None:
    """Expected extra CPU per rank-step from the census and the per-operation costs, beside the measured one."""
    per_kind = {
        "collective": ("ProcessGroup collectives", "all_reduce (async + wait)"),
        "p2p": ("point-to-point", "all_reduce (async + wait)"),
        "functional": ("functional collectives", "functional all_reduce + wait"),
        "attention": ("attention calls", "attention call (fwd + bwd)"),
        "phase": ("phases", "phase (enter + exit)"),
    }
    print(f"\n  the parts, {s.job.name}, per rank and step (census run; µs = thread CPU in the hot-path loops):")
    total = 0.0
    for kind, (label, case) in per_kind.items():
        n = census.counts.get(kind, 0.0)
        cost = max(0.0, h.cost(case)[1])
        total += n * cost
        print(f"    {label:28s} {n:6.1f} x {cost:5.1f} µs = {n * cost:6.0f} µs")
    end_us = (s.median("end_s", on=True) - s.median("end_s", on=False)) * 1e6
    total += end_us
    step_us = s.median("step_s", on=False) * 1e6
    cpu = statistics.median((on.cpu_s - off.cpu_s) / s.job.nproc for off, on in s.rounds) * 1e6
    main = statistics.median((on.thread_cpu_s - off.thread_cpu_s) / s.job.nproc for off, on in s.rounds) * 1e6
    print(f"    {'ending the step (in the job)':28s} {end_us:25.0f} µs")
    print(
        f"    sum {total:.0f} µs = {total / step_us * 100:.3f} % of the {step_us / 1e3:.0f} ms step. Measured extra "
        f"CPU per rank-step: {main:+.0f} µs on the training thread, {cpu:+.0f} µs in all threads "
        f"({cpu / step_us * 100:+.3f} % of the step)"
    )
    cores = os.cpu_count() or 1
    if s.job.nproc > cores:
        print(
            f"    ({s.job.nproc} ranks share {cores} cores here: where the ranks compute all the time, the step lasts "
            f"about their summed CPU / {cores}, so the step-time ratio follows the CPU ratio)"
        )


# ====================================================================== main


def main() -> None:
    if "--as-rank" in sys.argv:  # inside a rank: --as-rank OUT [--census] -- SCRIPT ARGS...
        cut = sys.argv.index("--")
        own, rest = sys.argv[1:cut], sys.argv[cut + 1 :]
        as_rank(Path(own[own.index("--as-rank") + 1]), rest[0], rest[1:], census="--census" in own)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="rounds of (off, on) runs of the CPU (emulated) job")
    p.add_argument("--real-rounds", type=int, default=8, help="rounds of the real-compute job (0: skip it)")
    p.add_argument("--ddp-rounds", type=int, default=8, help="rounds of the DDP-style script's job (0: skip it)")
    p.add_argument("--steps", type=int, default=7, help=f"measured steps per run (+{WARMUP_STEPS} warm-up)")
    p.add_argument("--emulate", type=float, default=40.0, metavar="MS", help="emulated block forward, ms (the demo's)")
    p.add_argument("--blocks", type=int, default=40, help="alternating blocks per case in the hot-path loop")
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pin rank r to core r mod cores (default; steadier rounds: no migrations mid-step)",
    )
    p.add_argument(
        "--concurrent",
        action="store_true",
        help="run each round's SDK-off and SDK-on jobs side by side, at once (both see the same machine: on a VM whose "
        "CPU speed drifts between runs)",
    )
    p.add_argument("--skip-job", action="store_true", help="only the hot-path measurement")
    p.add_argument("--script", type=Path, default=TRAIN_TINY, help="the training script (train_tiny's flags)")
    args = p.parse_args()
    print(machine_reference(), flush=True)
    if args.pin:
        print(f"ranks pinned: rank r on core r mod {len(os.sched_getaffinity(0))}", flush=True)
    import torch  # noqa: PLC0415, F401 - imported once here, before the ranks fork

    jobs = [
        JobSpec(
            name="CPU job (the demo's)",
            script=args.script,
            nproc=8,
            layout="pp=2,dp=2,tp=2",
            args=("--emulate", f"{args.emulate:g}"),
            rounds=args.rounds,
        ),
        JobSpec(
            name="real-compute job", script=args.script, nproc=4, layout="dp=2,tp=2", args=(), rounds=args.real_rounds
        ),
        JobSpec(
            name="DDP-style script",
            script=DDP_SCRIPT,
            nproc=2,
            layout="dp=2",
            args=(),
            rounds=args.ddp_rounds,
            steps_flag="--iters",
        ),
        JobSpec(
            name="DDP-style script, a larger model",
            script=DDP_SCRIPT,
            nproc=2,
            layout="dp=2",
            args=DDP_LARGER,
            rounds=args.ddp_rounds,
            steps_flag="--iters",
        ),
    ]
    started = time.perf_counter()
    done: list[tuple[JobSummary, RunResult]] = []
    if not args.skip_job:
        # not a TemporaryDirectory: its exit-time finalizer would run in every forked rank and remove it early
        tmp = Path(tempfile.mkdtemp(prefix="ms-bench-"))
        try:
            for job in jobs:
                if job.rounds > 0:
                    census = run_once(job, enabled=True, steps=1, out=tmp / "census", census=True)
                    summary = bench_job(job, args.steps, tmp, pin=args.pin, concurrent=args.concurrent)
                    done.append((summary, census))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    hot = bench_hot_path(args.blocks)
    print_hot_path(hot, args.blocks)
    if done:
        print("\nsummary (ratio = SDK on / SDK off; the bar: step time ratio <= 1.01 on the CPU job):")
        for summary, census in done:
            print_job_summary(summary)
            print_parts(census, hot, summary)
        print(
            "\n  The hot-path loops run the SDK with warm caches; inside a job every hook runs between framework code"
            "\n  that evicts them, so the measured extra CPU is larger than the sum of the parts."
        )
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()

"""How often meshscope reads real training runs right: false findings on clean runs, the right cause and rank on faults.

Issue 9's quality bars: over at least 20 clean real runs (mixed scripts, with and without foreign CPU load) the false
findings per run (target 0); over at least 30 runs with an injected fault the share whose findings name the right
cause and rank (target >= 95 %), and how the finding's cost compares with the cost table's own sync-wait figure
(within 20 %; a transient straggler on a busy host is costed by what its slow steps caused beyond its ordinary
steps, quoting the table's figure beside it: both printed).

Every run is a real ``meshscope run`` of one of the third-party-style scripts in ``tests/scripts/`` (a nanoGPT-style
DDP loop, a DDP-tutorial-style epoch loop, an FSDP2 loop) on 4 gloo ranks, or of the demo job (``train_tiny`` on 8
ranks, emulated accelerator). Foreign load, where asked, is one spinning process per core beside the job (the
issue's burner) or, for a third of the clean runs, a single one (one core loaded: the ranks on it wait for a CPU
and the others do not, which once made a clean run name a rank). Faults:
``--straggler RANK:2`` (that rank's passes take twice as long, sleeping), ``--busy RANK:2`` (twice as long, spinning
on its CPU: host work, which on shared cores also slows the ranks beside it), ``--imbalance RANK:3`` (three times
the rows) or ``--pause RANK:40 --pause-every 5`` ("periodic": 40 ms outside the phases in every fifth step, an
evaluation or a log flush every N steps: a transient straggler) or ``--slow-disk RANK:20`` (every batch that rank
reads takes 20 ms more; the DDP tutorial iterates its ``DataLoader`` unwrapped, ``--plain-loader``, as a script
that never heard of ``tracker.data``), the rank drawn from a seeded generator. A clean run is right when it has no
finding; a straggler, busy or periodic run when exactly one straggler finding names exactly the injected rank; a
slow-disk run the same, its cause the data loading; an imbalance run when a data-imbalance finding names it first and
no straggler finding appears.

    .venv/bin/python benchmarks/bench_real_runs.py                      # 24 clean + 30 fault runs, ~10 min here
    .venv/bin/python benchmarks/bench_real_runs.py --clean 4 --faults 6  # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshscope.formatting import human_seconds
from timing import machine_reference

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
JOBS: dict[str, list[str]] = {
    "nanogpt-ddp": ["nanogpt_ddp.py", "--iters", "100"],
    "ddp-tutorial": ["ddp_tutorial.py", "--epochs", "2", "--samples", "3840", "--plain-loader"],
    "fsdp2": ["fsdp2_loop.py", "--steps", "100"],
}
"""The lengths of tests/e2e_local's runs (``RUN_LENGTH``: 100 steps or more, about 2.5 s, so that a burst of slow
steps on a busy host is a burst); ``--short`` runs the 10-step lengths of the earlier figures."""
FAULTS = ("straggler", "imbalance", "busy", "periodic", "slow-disk")
"""The injected faults, in turn (each for one run of every script)."""
SHORT = {"nanogpt-ddp": ["--iters", "10"], "ddp-tutorial": ["--samples", "768"], "fsdp2": ["--steps", "10"]}


def run(job: str, out: Path, extra: list[str], *, short: bool = False) -> dict[str, Any]:
    """One ``meshscope run``; its analysis (``{}`` when it failed)."""
    if job == "demo":
        command = [sys.executable, "-m", "meshscope", "demo", "--out", str(out), "--steps", "6", *extra]
    else:
        script, *args = JOBS[job]
        if short:
            args = [*args, *SHORT[job]]
        command = [sys.executable, "-m", "meshscope", "run", "--nproc", "4", "--out", str(out), "--", sys.executable,
                   str(SCRIPTS / script), *args, *extra]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(SCRIPTS)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, check=False)
    path = out / "analysis.json"
    if done.returncode != 0 or not path.exists():
        print(f"    run failed ({done.returncode}): {(done.stdout + done.stderr)[-400:]}", flush=True)
        return {}
    result: dict[str, Any] = json.loads(path.read_text())
    return result


SPIN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(1_000_000): pass"
"""A spinning process that ends when its parent does (a killed benchmark leaves no burner behind)."""


LOADS = {"": 0, "burner": -1, "one": 1}
"""Foreign load -> spinning processes: none, one per core (-1), a single one."""


def burner(load: str) -> list[subprocess.Popen[bytes]]:
    """The spinning processes of ``load`` (:data:`LOADS`)."""
    count = LOADS[load] if LOADS[load] >= 0 else os.cpu_count() or 2
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def fault_arguments(fault: str | None, rank: int | None) -> list[str]:
    """The script's arguments that inject ``fault`` on ``rank``."""
    if fault is None:
        return []
    if fault == "periodic":  # 40 ms outside the phases in every fifth step: a transient straggler
        return ["--pause", f"{rank}:40", "--pause-every", "5"]
    if fault == "slow-disk":  # every batch that rank reads takes 20 ms more
        return ["--slow-disk", f"{rank}:20"]
    return [f"--{fault}", f"{rank}:{3 if fault == 'imbalance' else 2}"]


def verdict(analysis: dict[str, Any], fault: str | None, rank: int | None) -> tuple[bool, str, Cost | str | None]:
    """(right, what was found, the finding's cost ÷ the table's sync-wait figure for the rank, or why there is none)."""
    findings = analysis.get("findings", [])
    found = "; ".join(f"{f['code']}({','.join(str(s['rank']) for s in f['suspects'])})" for f in findings) or "none"
    if fault is None:
        return not findings, found, None
    code = "data-imbalance" if fault == "imbalance" else "straggler"
    hits = [f for f in findings if f["code"] == code]
    right = len(hits) == 1 and hits[0]["suspects"][0]["rank"] == rank
    if code == "straggler":
        right = right and [s["rank"] for s in hits[0]["suspects"]] == [rank]
        if fault == "slow-disk":  # and the cause is the data loading, not compute
            right = right and hits[0]["evidence"].get("phase_is_data") == 1
    else:
        right = right and not any(f["code"] == "straggler" for f in findings)
    ratio: Cost | str | None = None
    if hits:
        suspect = next((r.get("suspect") or {} for r in analysis["rows"] if r["category"] == "comm.dp.sync_wait"), {})
        evidence = hits[0]["evidence"]
        cost = evidence.get("cost_seconds_per_step")
        per_member = evidence.get("wait_per_member_seconds_per_step")
        slow_steps = evidence.get("slow_steps_wait_per_member_seconds_per_step") is not None
        if not (cost and per_member):
            ratio = f"no cost figure in the finding (cost {cost}, per member {per_member})"
        elif suspect.get("rank") != rank:
            ratio = f"the table's dp sync-wait row names rank {suspect.get('rank')}: {suspect.get('message', '')!r}"
        elif slow_steps and f"charges it {human_seconds(per_member)} per step" not in hits[0]["message"]:
            ratio = f"the finding does not quote the table's {human_seconds(per_member)} beside its slow steps' cost"
        elif not slow_steps and suspect.get("message", "") not in hits[0]["message"]:
            ratio = f"the table's words {suspect.get('message', '')!r} are not in the finding's"
        else:
            ratio = Cost(cost / per_member, cost, slow_steps)
    return right, found, ratio


@dataclass(frozen=True)
class Cost:
    """A fault run's finding cost against the cost table's sync-wait figure for the rank."""

    ratio: float
    """The finding's cost ÷ the table's figure."""
    cost_seconds: float
    """The finding's cost, per step."""
    slow_steps: bool
    """The finding costs a transient straggler by what its slow steps caused beyond its ordinary steps, quoting the
    table's figure beside it (on a busy host that also holds the waits its ordinary steps caused by chance)."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--clean", type=int, default=24, help="clean runs (a third each: no load, a burner, one spinner)")
    p.add_argument("--faults", type=int, default=30, help="runs with an injected fault")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", default="", help="copy the output directory of every wrong run here")
    p.add_argument("--short", action="store_true", help="10-step runs (the earlier figures)")
    args = p.parse_args()
    print(machine_reference())
    rng = random.Random(args.seed)
    jobs = [*JOBS, "demo"]
    plan: list[tuple[str, str, str | None, int | None]] = [
        (jobs[i % len(jobs)], ("", "burner", "one")[i % 3], None, None) for i in range(args.clean)
    ]
    for i in range(args.faults):
        kind = FAULTS[(i // len(JOBS)) % len(FAULTS)]
        plan.append((list(JOBS)[i % len(JOBS)], "burner" if i % 3 == 2 else "", kind, rng.randrange(4)))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, (job, load, fault, rank) in enumerate(plan):
            extra = fault_arguments(fault, rank)
            procs = burner(load)
            t0 = time.perf_counter()
            try:
                analysis = run(job, Path(tmp) / f"run-{k}", extra, short=args.short)
            finally:
                stop(procs)
            right, found, ratio = verdict(analysis, fault, rank) if analysis else (False, "run failed", None)
            if (not right or isinstance(ratio, str)) and args.keep:
                shutil.copytree(Path(tmp) / f"run-{k}", Path(args.keep) / f"run-{k}-{job}", dirs_exist_ok=True)
            wall = time.perf_counter() - t0
            what = "clean" if fault is None else f"{fault} on rank {rank}"
            load_text = {"": "", "burner": " + CPU burner", "one": " + 1 spinner"}[load]
            cost_text = f"  {ratio}" if isinstance(ratio, str) else ""
            if isinstance(ratio, Cost):
                cost_text = f"  cost / table {ratio.ratio:.3f}"
                if ratio.slow_steps:
                    ms = 1e3 * ratio.cost_seconds
                    cost_text += f" (its slow steps' cost, {ms:.2f} ms a step, beside the table's)"
            print(f"{k + 1:3d}. {job:13s} {what:22s}{load_text:15s} {wall:6.1f} s  {'ok ' if right else 'BAD'} {found}"
                  f"{cost_text}", flush=True)  # fmt: skip
            results.append((fault, right, found, ratio, load))
    clean = [r for r in results if r[0] is None]
    faulty = [r for r in results if r[0] is not None]
    false = sum(0 if r[2] == "none" else r[2].count(";") + 1 for r in clean)
    print(
        f"\nclean runs: {len(clean)} ({sum(r[4] == 'burner' for r in clean)} beside a CPU burner, "
        f"{sum(r[4] == 'one' for r in clean)} beside one spinner); false findings: {false} "
        f"({false / max(len(clean), 1):.2f} per run); clean runs with any finding: {sum(not r[1] for r in clean)}"
    )
    n_right = sum(r[1] for r in faulty)
    print(f"fault runs: {len(faulty)}; right cause and rank: {n_right} ({100 * n_right / max(len(faulty), 1):.1f} %)")
    ratios = [r[3].ratio for r in faulty if isinstance(r[3], Cost) and not r[3].slow_steps]
    slow_steps = [r[3].ratio for r in faulty if isinstance(r[3], Cost) and r[3].slow_steps]
    without = [r[3] for r in faulty if isinstance(r[3], str)]
    if ratios:
        inside = sum(0.8 <= x <= 1.2 for x in ratios)
        print(f"finding cost / the table's sync-wait figure for the rank: {len(ratios)} runs, {inside} within 20 % "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f})")  # fmt: skip
    if slow_steps:
        print(f"transient stragglers costed by what their slow steps caused beyond their ordinary steps (the table's "
              f"figure quoted beside it): {len(slow_steps)} runs, cost / table "
              f"{', '.join(f'{x:.3f}' for x in slow_steps)}")  # fmt: skip
    if without:
        print(f"fault runs whose finding has no table figure to compare: {len(without)} (each said above)")


if __name__ == "__main__":
    main()

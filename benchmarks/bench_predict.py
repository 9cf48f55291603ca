"""How well ``meshscope predict`` foresees another layout of a real run, and how fast calibration is.

Issue 12's checks:

* **real runs**: for each (X, Y) pair, ``meshscope run`` runs layout X of the bundled ``train_tiny`` job (CPU ranks,
  gloo, emulated accelerator), ``meshscope predict --from OUT_X --layout Y`` predicts Y from X's calibration, then Y
  runs for real; printed: Y's predicted and measured step and the error, and per category predicted minus measured
  (target: 5 % on step time). Pairs change dp, tp, pp and the micro-batch, on at most 8 ranks;
* **speed**: calibration of a 64-rank, 20-step run (simulated records of examples/llama3-8b-h100.yaml; target under
  5 s), reading excluded.

    .venv/bin/python benchmarks/bench_predict.py                 # all pairs, 16 steps a run, ~4-6 min on 2 cores
    .venv/bin/python benchmarks/bench_predict.py --pairs 2       # a quick look
    .venv/bin/python benchmarks/bench_predict.py --pairs 0       # the speed figure only
    .venv/bin/python benchmarks/bench_predict.py --runs DIR      # keep the runs; again: same runs, new predictions

The measured Y is the stage the prediction is for (the plan's slowest stage), mean per step over the run's steps
after the warm-up step, exposed comm = transfer + sync wait. Timings on a machine shared with other work are noisy:
say so beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from meshscope.analysis import calibrate, predict
from meshscope.analysis.calibration import measured_stage
from meshscope.jobs import load_spec
from meshscope.local import calibrate_run, read_run
from meshscope.simulation import simulate
from meshscope.topology import parse_layout
from timing import machine_reference

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train_tiny.py"
EMULATE_MS = "10"
STEPS = "16"
"""Steps of each run (the first is warm-up): ``--steps`` changes it."""

PAIRS: list[tuple[str, list[str], str, list[str], str]] = [
    ("dp=2,tp=2", [], "dp=4", [], "tp -> dp"),
    ("dp=4", [], "dp=2,tp=2", [], "dp -> tp"),
    ("dp=2,tp=2", [], "dp=2,pp=2", [], "tp -> pp"),
    ("dp=2,pp=2", [], "dp=2,pp=2", ["--micro-batch-size", "1", "--micro-batches", "8"], "micro-batch 2 -> 1"),
    ("dp=2", [], "dp=4", [], "dp 2 -> 4"),
    ("tp=2,pp=2", [], "tp=2,pp=2,dp=2", [], "dp 1 -> 2 under tp, pp"),
    ("tp=2,pp=2,dp=2", [], "pp=4,dp=2", [], "tp -> pp, 8 ranks"),
]
"""(layout X, extra train_tiny args of X, layout Y, extra args of Y, what changes)."""


def run(layout: str, extra: list[str], out: Path, *, steps: str = STEPS) -> None:
    nproc = parse_layout(layout).world_size
    command = [sys.executable, "-m", "meshscope", "run", "--nproc", str(nproc), "--layout", layout, "--out", str(out),
               "-q", "--", sys.executable, str(TRAIN), "--steps", steps, "--emulate", EMULATE_MS, *extra]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"meshscope run {layout} failed ({done.returncode}): {(done.stdout + done.stderr)[-600:]}")


def micro_batch_of(extra: list[str]) -> int | None:
    return int(extra[extra.index("--micro-batch-size") + 1]) if "--micro-batch-size" in extra else None


@dataclass(frozen=True)
class PairResult:
    predicted_s: float
    measured_s: float
    """The mean of Y's runs."""
    runs_s: tuple[float, ...]
    """Y's step in each of its runs."""
    residual_on_x_s: float
    """The calibrated plan of X minus X's measured step."""
    categories: dict[str, tuple[float, float]]
    """Category -> (predicted, measured) seconds per step of Y."""


def run_dir(runs: Path, layout: str, extra: list[str]) -> Path:
    """Where a kept run of ``layout`` with ``extra`` lives under ``runs``."""
    return runs / "_".join([layout.replace(",", "-").replace("=", ""), *(a.lstrip("-") for a in extra)])


def predict_pair(
    x: str,
    x_extra: list[str],
    y: str,
    y_extra: list[str],
    work: Path,
    *,
    keep: bool,
    steps: str = STEPS,
    repeats: int = 2,
) -> PairResult:
    """Run X (unless kept), predict Y from it, run Y ``repeats`` times (unless kept), and compare with their mean.

    With ``keep``, runs are kept under ``work`` by layout, and a run already there is read again instead of run: the
    same measurements predicted by changed code (what the ``(a)`` columns of docs/predict.md compare). Y runs more
    than once because one run of a layout on a shared 2-core machine differs from the next by several per cent: their
    spread is printed beside the error, the floor under which no prediction can be told right or wrong.
    """
    out_x, out_y = (run_dir(work, x, x_extra), run_dir(work, y, y_extra)) if keep else (work / "x", work / "y")
    if not (keep and (out_x / "records.jsonl").exists()):
        run(x, x_extra, out_x, steps=steps)
    size = micro_batch_of(y_extra)
    predicted = json.loads(
        subprocess.run(
            [sys.executable, "-m", "meshscope", "predict", "--from", str(out_x), "--layout", y, "--json", "-q",
             *(["--micro-batch", str(size)] if size else [])],
            capture_output=True, text=True, timeout=300, check=True,
        ).stdout
    )  # fmt: skip
    pp_rank = int(predicted["predicted"]["pp_rank"])
    stages = []
    for i in range(repeats):
        out = out_y if i == 0 else out_y.with_name(f"{out_y.name}_run{i + 1}")
        if not (keep and (out / "records.jsonl").exists()):
            run(y, y_extra, out, steps=steps)
        stages.append(measured_stage(calibrate_run(read_run([str(out)], spec=None)).measured, pp_rank))
    keys = {k for st in stages for k in st.seconds}
    mean = {k: sum(st.seconds.get(k, 0.0) for st in stages) / len(stages) for k in keys}
    return PairResult(
        predicted_s=float(predicted["predicted"]["step_seconds"]),
        measured_s=sum(st.total_seconds for st in stages) / len(stages),
        runs_s=tuple(st.total_seconds for st in stages),
        residual_on_x_s=float(predicted["calibrated_step_seconds"]) - float(predicted["measured"]["step_seconds"]),
        categories={
            k: (v["expected_s"], mean.get(k, 0.0))
            for k, v in predicted["categories"].items()
            if v["expected_s"] or mean.get(k, 0.0)
        },
    )


def calibration_speed() -> None:
    spec = load_spec(ROOT / "examples" / "llama3-8b-h100.yaml")
    result = simulate(spec, steps=20)
    t0 = time.perf_counter()
    c = calibrate(result.table, spec)
    elapsed = time.perf_counter() - t0
    predict(c, spec)
    print(
        f"calibration of a {spec.world_size}-rank, 20-step run ({result.table.n_rows:,} rank-steps, "
        f"{result.table.n_intervals:,} intervals): {elapsed:.2f} s (target < 5 s)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=len(PAIRS), help=f"(X, Y) pairs to run, 0-{len(PAIRS)}")
    parser.add_argument("--steps", type=int, default=int(STEPS), help=f"steps of each run, warm-up included ({STEPS})")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each Y, compared by their mean (2)")
    parser.add_argument(
        "--runs",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the runs under DIR, one per layout, and read a run already there instead of running it again",
    )
    args = parser.parse_args()
    print(f"machine reference: {machine_reference()}", flush=True)
    calibration_speed()
    errors: list[float] = []
    spreads: list[float] = []
    for x, x_extra, y, y_extra, what in PAIRS[: args.pairs]:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            work = args.runs if args.runs is not None else Path(tmp)
            got = predict_pair(
                x, x_extra, y, y_extra, work, keep=args.runs is not None, steps=str(args.steps), repeats=args.repeats
            )
        error = (got.predicted_s - got.measured_s) / got.measured_s
        errors.append(abs(error))
        spread = (max(got.runs_s) - min(got.runs_s)) / got.measured_s
        spreads.append(spread)
        runs = ", ".join(f"{r * 1e3:.1f}" for r in got.runs_s)
        print(f"\n{x} {' '.join(x_extra)} -> {y} {' '.join(y_extra)} ({what}; {time.perf_counter() - t0:.0f} s wall)")
        print(
            f"  step: predicted {got.predicted_s * 1e3:.1f} ms, measured {got.measured_s * 1e3:.1f} ms (mean of "
            f"{runs} ms: runs {spread:.1%} apart), error {error:+.1%}; calibration residual on X "
            f"{got.residual_on_x_s * 1e3:+.1f} ms"
        )
        for category, (p, m) in got.categories.items():
            shown = f"predicted {p * 1e3:8.2f} ms  measured {m * 1e3:8.2f} ms  error {(p - m) * 1e3:+8.2f} ms"
            print(f"  {category:<10} {shown}")
    if errors:
        mean = sum(errors) / len(errors)
        print(f"\nstep-time error over {len(errors)} pairs: mean {mean:.1%}, max {max(errors):.1%} (target 5 %)")
        spread = sum(spreads) / len(spreads)
        print(f"the same layout run again: {spread:.1%} apart on average, {max(spreads):.1%} at most (the noise floor)")


if __name__ == "__main__":
    main()

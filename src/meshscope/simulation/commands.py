"""``meshscope simulate``: write the step records of a scenario (or of a job with faults given as flags).

::

    meshscope simulate SCENARIO.yaml [--out records.jsonl.gz] [--steps N] [--seed S] [--fault ...] [--prefetch]
    meshscope simulate --spec JOB.yaml --steps 20 --fault straggler:rank=3,factor=1.5 --fault noise:sigma=0.02

Prints what it wrote (ranks, steps, intervals, bytes, seconds taken) and the injected faults. Errors are
:class:`~meshscope.errors.MeshscopeError` (exit code 2 in the CLI). This module only parses flags and prints; it
must not simulate anything itself.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshscope.errors import MeshscopeError
from meshscope.formatting import human_bytes, human_count
from meshscope.loading import load_spec
from meshscope.records import write_records
from meshscope.simulation.faults import parse_fault
from meshscope.simulation.scenarios import DEFAULT_STEPS, MAX_STEPS, Scenario, load_scenario
from meshscope.simulation.simulating import simulate

if TYPE_CHECKING:
    import argparse


class SimulateUsageError(MeshscopeError):
    """A ``meshscope simulate`` command line that names too little or too much."""


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:  # noqa: ANN401 - argparse's private action
    """Add ``meshscope simulate`` to the CLI's subparsers (``cli.build_parser`` calls this once)."""
    sim = subparsers.add_parser(
        "simulate",
        help="simulate a job's step records, with named faults (ground truth for analysis)",
        description="Simulate every rank's every step of a job from the plan's expected times (or explicit phase "
        "durations), inject named faults, and write meshscope.step/1 records.",
    )
    sim.add_argument("scenario", nargs="?", help="scenario file (YAML: spec, steps, seed, faults, phases)")
    sim.add_argument("--spec", help="TrainingJob manifest to simulate instead of a scenario")
    sim.add_argument("--out", default="records.jsonl.gz", help="records file (.jsonl, or .jsonl.gz) (records.jsonl.gz)")
    sim.add_argument("--steps", type=int, help=f"steps to simulate (the scenario's, else {DEFAULT_STEPS})")
    sim.add_argument("--seed", type=int, help="seed of noise and random clock offsets (the scenario's, else 0)")
    sim.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND:K=V,...",
        help="inject a fault, e.g. straggler:rank=3,factor=1.5 or slow-link:node=1,factor=0.25 (repeatable)",
    )
    sim.add_argument("--prefetch", action="store_true", help="the data loader runs ahead of compute")
    sim.set_defaults(handler=_cmd_simulate)
    return sim  # type: ignore[no-any-return]


def _cmd_simulate(args: argparse.Namespace) -> int:
    if bool(args.scenario) == bool(args.spec):
        raise SimulateUsageError(
            "simulate needs a SCENARIO file or --spec JOB.yaml (not both), e.g. meshscope simulate "
            "examples/scenarios/dp8-handmade.yaml"
        )
    if args.steps is not None and not 1 <= args.steps <= MAX_STEPS:
        raise SimulateUsageError(f"--steps must be from 1 to {MAX_STEPS}, got {args.steps}")
    if args.seed is not None and args.seed < 0:
        raise SimulateUsageError(f"--seed must be >= 0, got {args.seed}")
    out = Path(args.out)
    if not out.name.endswith((".jsonl", ".jsonl.gz")):
        raise SimulateUsageError(f"--out {out} must end in .jsonl or .jsonl.gz")
    faults = [parse_fault(text, where=f"--fault {text!r}") for text in args.fault]
    if args.scenario:
        scenario = load_scenario(args.scenario)
    else:
        spec = load_spec(args.spec)
        scenario = Scenario(spec=spec, job=spec.name, source=str(args.spec))
    began = time.perf_counter()
    result = simulate(
        scenario,
        steps=args.steps,
        seed=args.seed,
        faults=faults,
        prefetch=True if args.prefetch else None,
    )
    simulated = time.perf_counter() - began
    table = result.table
    world = result.plan.world_size
    steps = result.scenario.steps
    _say(
        f"meshscope simulate: {result.scenario.job} — {world:,} ranks x {steps:,} steps = {table.n_rows:,} "
        f"rank-steps, {table.n_intervals:,} intervals ({table.n_intervals / max(table.n_rows, 1):.1f} per rank-step) "
        f"in {simulated:.2f} s"
    )
    for fault in result.truth.faults:
        _say(f"  fault {fault.kind.value}: {fault.description}")
    began = time.perf_counter()
    lines = write_records(out, table)
    written = time.perf_counter() - began
    size = out.stat().st_size
    _say(f"wrote {out}: {human_count(lines)} records, {human_bytes(size)} in {written:.2f} s")
    return 0


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")

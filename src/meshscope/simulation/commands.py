"""``meshscope simulate``: write the step records of a scenario (or of a job with faults given as flags).

::

    meshscope simulate SCENARIO.yaml [--out records.jsonl.gz] [--steps N] [--seed S] [--fault ...] [--prefetch] [-q]
    meshscope simulate --spec JOB.yaml --steps 20 --fault straggler:rank=3,factor=1.5 --fault noise:sigma=0.02

Prints what it wrote (ranks, steps, intervals, bytes, seconds taken) and the injected faults; on a terminal, unless
``--quiet``, stderr shows the progress of simulating and writing (:func:`meshscope.progress.command_progress`).
Errors are :class:`~meshscope.errors.MeshscopeError` (exit code 2 in the CLI). Its arguments are defined in
:mod:`meshscope.cli`; this module checks them and prints; it must not simulate anything itself.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from meshscope.errors import MeshscopeError
from meshscope.formatting import human_bytes, human_count
from meshscope.jobs import load_spec
from meshscope.progress import command_progress
from meshscope.records import write_records
from meshscope.simulation.faults import parse_fault
from meshscope.simulation.scenarios import MAX_STEPS, Scenario, load_scenario
from meshscope.simulation.simulating import simulate

if TYPE_CHECKING:
    import argparse


class SimulateUsageError(MeshscopeError):
    """A ``meshscope simulate`` command line that names too little or too much."""


def simulate_command(args: argparse.Namespace) -> int:
    """``meshscope simulate SCENARIO | --spec FILE [...]`` (arguments: :mod:`meshscope.cli`).

    Raises:
        SimulateUsageError: for a command line that names too little or too much.
    """
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
    progress = command_progress(quiet=args.quiet)
    began = time.perf_counter()
    result = simulate(
        scenario,
        steps=args.steps,
        seed=args.seed,
        faults=faults,
        prefetch=True if args.prefetch else None,
        progress=progress,
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
    lines = write_records(out, table, progress=progress)
    written = time.perf_counter() - began
    size = out.stat().st_size
    _say(f"wrote {out}: {human_count(lines)} records, {human_bytes(size)} in {written:.2f} s")
    return 0


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")

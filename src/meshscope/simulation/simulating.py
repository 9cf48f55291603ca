"""``simulate()``: plan the job, resolve the faults, run the timeline, hand back records and truth.

The orchestration behind :func:`meshscope.simulation.simulate` (import it from there). It must not build timestamps
itself (:mod:`~meshscope.simulation.timeline` does) nor read files.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshscope.analysis import break_down
from meshscope.errors import LayoutError, SpecError
from meshscope.jobs import JobSpec
from meshscope.plan import plan_job
from meshscope.progress import NO_PROGRESS
from meshscope.simulation.faults import FaultKind, JobShape, Truth, resolve_faults
from meshscope.simulation.model import JobModel, build_model
from meshscope.simulation.scenarios import Phases, Scenario
from meshscope.simulation.timeline import TimelineSettings, run_timeline
from meshscope.topology import Placement

if TYPE_CHECKING:
    from collections.abc import Sequence

    from meshscope.analysis import Breakdown
    from meshscope.plan import Plan, PlanAssumptions
    from meshscope.progress import Progress
    from meshscope.records import RecordTable
    from meshscope.simulation.faults import Fault

DEFAULT_START_US = 1_700_000_000_000_000
"""Timestamp of the first step's start, µs since the epoch (2023-11-14), as a real host clock would give."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationResult:
    """What :func:`simulate` returns."""

    table: RecordTable
    """The step records, one row per (rank, step), ranks in rank order, steps in order."""
    truth: Truth
    """The injected faults resolved to concrete ranks, nodes, groups and steps."""
    plan: Plan
    """The plan the expected times came from."""
    placement: Placement
    """Where every rank ran."""
    model: JobModel
    """Per-stage phase times and groups as simulated (explicit phases applied)."""
    scenario: Scenario
    """The scenario as simulated (keyword overrides applied)."""

    @property
    def p2p_bandwidth_bytes_per_s(self) -> dict[str, float]:
        """Effective pipeline bandwidth per link, as simulated.

        Pass it to :func:`meshscope.analysis.breakdown.break_down` so that the transfer part of pipeline messages is
        split from the bubble (:meth:`break_down` does).
        """
        return self.model.p2p_bandwidth_bytes_per_s

    def break_down(self, *, align_clocks: bool = True) -> Breakdown:
        """:func:`meshscope.analysis.breakdown.break_down` of :attr:`table` with the simulated pipeline bandwidth."""
        return break_down(
            self.table, p2p_bandwidth_bytes_per_s=self.p2p_bandwidth_bytes_per_s, align_clocks=align_clocks
        )


def simulate(
    job: Scenario | JobSpec,
    *,
    steps: int | None = None,
    faults: Sequence[Fault] = (),
    seed: int | None = None,
    prefetch: bool | None = None,
    phases: Phases | None = None,
    placement: Placement | None = None,
    assumptions: PlanAssumptions | None = None,
    job_name: str | None = None,
    start_us: int = DEFAULT_START_US,
    gpu_util: bool = True,
    progress: Progress = NO_PROGRESS,
) -> SimulationResult:
    """Simulate a job's steps and return the step records with the ground truth of the injected faults.

    Args:
        job: a scenario (its steps, seed, prefetch, phases and faults are the defaults) or a bare job spec.
        steps: steps to simulate (default: the scenario's, else 10).
        faults: faults to inject, added after the scenario's own.
        seed: seed of every random draw (default: the scenario's, else 0).
        prefetch: whether the loader overlaps compute (default: the scenario's, else false).
        phases: explicit phase durations replacing the scenario's (default: the scenario's, else none).
        placement: where ranks run (default: consecutive ranks fill nodes, nodes fill NVLink domains).
        assumptions: the planner's efficiencies and overlap fractions (default: :class:`PlanAssumptions()`).
        job_name: job name in the records (default: the scenario's, else the spec's name).
        start_us: timestamp of the first step, µs.
        gpu_util: write reported GPU utilisation (a spinning collective counts as busy, so it reads ~1.0 while a
            rank waits in a collective; only data waits and checkpoints lower it).
        progress: told of the phases "simulating" (steps done of the steps asked for) and "building the records
            table".

    Returns:
        The records, the truth, the plan and the model as simulated.

    Raises:
        SpecError: for a fault or phase that does not fit the job (naming the field), or a bad step count.
        PlanError: if the job cannot be planned.
    """
    scenario = job if isinstance(job, Scenario) else Scenario(spec=job, job=job.name)
    if not isinstance(scenario.spec, JobSpec):
        raise SpecError("", f"simulate() takes a Scenario or a JobSpec, got {type(job).__name__}")
    scenario = dataclasses.replace(
        scenario,
        steps=scenario.steps if steps is None else steps,
        seed=scenario.seed if seed is None else seed,
        prefetch=scenario.prefetch if prefetch is None else prefetch,
        phases=scenario.phases if phases is None else phases,
        job=scenario.job if job_name is None else job_name,
        faults=(*scenario.faults, *faults),
    )
    if isinstance(scenario.steps, bool) or not isinstance(scenario.steps, int) or scenario.steps < 1:
        raise SpecError("steps", f"{scenario.steps!r} must be a whole number >= 1")
    spec = scenario.spec
    if placement is None:
        try:
            placement = Placement.for_hardware(spec.world_size, spec.hardware)
        except LayoutError as exc:
            raise SpecError("spec.hardware", str(exc)) from None
    plan = plan_job(spec, placement=placement, assumptions=assumptions)
    shape = JobShape(layout=spec.layout, placement=placement, steps=scenario.steps, seed=scenario.seed)
    truth = resolve_faults(scenario.faults, shape)
    model = build_model(spec, plan, placement, scenario.phases)
    settings = TimelineSettings(
        steps=scenario.steps,
        seed=scenario.seed,
        prefetch=scenario.prefetch,
        start_us=start_us,
        gpu_util=gpu_util,
        job=scenario.job,
    )
    timeline = run_timeline(model, scenario.faults, settings, truth.clock_offset_us, progress=progress)
    resolved = tuple(
        dataclasses.replace(t, groups=timeline.slowed_groups.get(i, ())) if t.kind is FaultKind.SLOW_LINK else t
        for i, t in enumerate(truth.faults)
    )
    return SimulationResult(
        table=timeline.table,
        truth=dataclasses.replace(truth, faults=resolved),
        plan=plan,
        placement=placement,
        model=model,
        scenario=scenario,
    )

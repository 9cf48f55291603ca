"""The simulator: step records for any job, from the plan's expected times, with named faults and their ground truth.

Public API (stable; the diagnosis accuracy suite and the tests build on it)::

    from meshscope.simulation import load_scenario, simulate, Straggler, SlowLink

    scenario = load_scenario("examples/scenarios/dp8-handmade.yaml")
    result = simulate(scenario)                                  # or simulate(spec, steps=20, faults=[...], seed=1)
    result.table                                                 # RecordTable (meshscope.step/1 columns)
    result.truth.faults[0].ranks                                 # the injected faults, resolved: ranks, nodes, steps
    result.truth.of_kind("straggler"), result.truth.ranks()
    breakdown = result.break_down()                              # meshscope.analysis.break_down with the
                                                                 # right pipeline bandwidth

* :func:`simulate` (``Scenario | JobSpec`` -> :class:`SimulationResult`), :func:`load_scenario`,
  :func:`load_scenario_text`, :class:`Scenario`, :class:`Phases`;
* faults: :class:`Straggler`, :class:`SlowLink`, :class:`DataImbalance`, :class:`SlowLoader`,
  :class:`CheckpointStall`, :class:`ClockSkew`, :class:`Noise` (the :data:`Fault` union, :class:`FaultKind`),
  :func:`parse_fault` for ``"straggler:rank=3,factor=1.5"``;
* ground truth: :class:`Truth` (``faults``, ``clock_offset_us``, ``of_kind``, ``ranks``) of :class:`FaultTruth`
  (``kind``, ``fault``, ``ranks``, ``nodes``, ``node_names``, ``groups``, ``steps``, ``clock_offset_us``,
  ``description``);
* :func:`simulate_command` for ``meshscope simulate`` (:data:`DEFAULT_STEPS`, :data:`MAX_STEPS`).

Why it exists: tests need ground truth, jobs too large for any test machine need records to analyse, and "what
would this layout cost" needs an answer before the job runs. The timeline model, its simplifications and every
fault's meaning are in ``docs/simulator.md``. Its modules:

* :mod:`~meshscope.simulation.faults`: the named faults, their parameters, parsing and what they resolve to;
* :mod:`~meshscope.simulation.scenarios`: scenario files (YAML) and explicit phase durations;
* :mod:`~meshscope.simulation.model`: per-stage phase times and process groups, from the plan and the placement;
* :mod:`~meshscope.simulation.timeline`: the vectorised timeline and the record table it writes;
* :mod:`~meshscope.simulation.simulating`: ``simulate()``, tying plan, faults and timeline together;
* :mod:`~meshscope.simulation.commands`: ``meshscope simulate``.

What it must not do: analyse records (that is :mod:`meshscope.analysis`; ``SimulationResult.break_down`` only calls
it), change the plan's formulas (it takes the plan's expected times as they are), or loop over ranks in Python (a
131,072-rank job must simulate). Import the names from here (``from meshscope.simulation import simulate``).
"""

from __future__ import annotations

from meshscope.simulation.commands import SimulateUsageError, simulate_command
from meshscope.simulation.faults import (
    CheckpointStall,
    ClockSkew,
    DataImbalance,
    Fault,
    FaultError,
    FaultKind,
    FaultTruth,
    Noise,
    SlowLink,
    SlowLoader,
    Straggler,
    Truth,
    fault_text,
    parse_fault,
)
from meshscope.simulation.scenarios import DEFAULT_STEPS, MAX_STEPS, Phases, Scenario, load_scenario, load_scenario_text
from meshscope.simulation.simulating import DEFAULT_START_US, SimulationResult, simulate

__all__ = [
    "DEFAULT_START_US",
    "DEFAULT_STEPS",
    "MAX_STEPS",
    "CheckpointStall",
    "ClockSkew",
    "DataImbalance",
    "Fault",
    "FaultError",
    "FaultKind",
    "FaultTruth",
    "Noise",
    "Phases",
    "Scenario",
    "SimulateUsageError",
    "SimulationResult",
    "SlowLink",
    "SlowLoader",
    "Straggler",
    "Truth",
    "fault_text",
    "load_scenario",
    "load_scenario_text",
    "parse_fault",
    "simulate",
    "simulate_command",
]

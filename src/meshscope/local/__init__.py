"""Local mode: ``meshscope run`` and ``meshscope demo`` on one machine, and what such a run is compared with.

DESIGN.md, "Local mode": everything that needs no cluster works on one machine. This package launches a training
command on local ranks with the environment torchrun would give them, collects their step records through the SDK's
wire protocol (:class:`meshscope.sdk.RecordCollector`, the same reader the sidecar uses), and at the end analyses,
compares with the plan and reports:

- :mod:`~meshscope.local.running`: the launcher and collector (:func:`run_job`, :class:`RunSettings`,
  :class:`RunOutcome`), the demo's settings (:func:`demo_settings`);
- :mod:`~meshscope.local.emulation`: the emulated accelerator and the spec of ``examples/train_tiny.py``
  (:class:`TinyJob`, :func:`tiny_job_spec`);
- :mod:`~meshscope.local.comparisons`: expected vs measured on a real run, stage by stage (:func:`compare_run`);
- :mod:`~meshscope.local.summarizing`: the end of a run (:func:`report_run`, :func:`loss_notes`);
- :mod:`~meshscope.local.bundled`: the example files that ship with meshscope;
- :mod:`~meshscope.local.cpus`: the cores the ranks can run on and the CPU they used (:class:`CpuUse`, the
  ``cpu_contention`` note);
- :mod:`~meshscope.local.tails`: every rank's stderr passed through, its tail kept, the likely fix
  (:func:`fix_for`);
- :mod:`~meshscope.local.commands`: ``meshscope run`` and ``meshscope demo``;
- :mod:`~meshscope.local.predicting`: ``meshscope calibrate`` and ``meshscope predict`` (a run's ``OUT`` directory
  describes its own job: :func:`read_run`).

The launcher must not import the report writers (:mod:`~meshscope.local.commands` ties them), nothing here may
import torch at module level (the fork launcher imports it in the parent just before forking), and a run's exit code
is the job's (or :data:`EXIT_NO_ANALYSIS` when every rank succeeded but no analysis could be written). Import the
names from here (``from meshscope.local import run_job``).
"""

from meshscope.local.bundled import data_root
from meshscope.local.commands import DEMO_RANKS, DemoUsageError, demo_command, run_command
from meshscope.local.comparisons import RunComparison, compare_run
from meshscope.local.cpus import CONTENTION_CODE, CpuCapacity, CpuUse, measure_capacity
from meshscope.local.emulation import (
    DEMO_BLOCK_MS,
    TinyJob,
    block_forward_flops_per_gpu,
    emulated_assumptions,
    emulated_hardware,
    emulated_peak_flops_per_s,
    logits_forward_flops_per_gpu,
    tiny_job_spec,
    tiny_model,
)
from meshscope.local.predicting import (
    MeasuredRun,
    PredictInputError,
    calibrate_command,
    calibrate_run,
    predict_command,
    read_run,
)
from meshscope.local.running import (
    EXIT_NO_ANALYSIS,
    RankExit,
    RankReceipt,
    RunError,
    RunOutcome,
    RunSettings,
    demo_layout,
    demo_settings,
    rank_env,
    resolve_python,
    run_job,
    settings_from_args,
)
from meshscope.local.summarizing import loss_notes, report_run
from meshscope.local.tails import StderrTails, fix_for
from meshscope.topology import layout_text

__all__ = [
    "CONTENTION_CODE",
    "DEMO_BLOCK_MS",
    "DEMO_RANKS",
    "EXIT_NO_ANALYSIS",
    "CpuCapacity",
    "CpuUse",
    "DemoUsageError",
    "MeasuredRun",
    "PredictInputError",
    "RankExit",
    "RankReceipt",
    "RunComparison",
    "RunError",
    "RunOutcome",
    "RunSettings",
    "StderrTails",
    "TinyJob",
    "block_forward_flops_per_gpu",
    "calibrate_command",
    "calibrate_run",
    "compare_run",
    "data_root",
    "demo_command",
    "demo_layout",
    "demo_settings",
    "emulated_assumptions",
    "emulated_hardware",
    "emulated_peak_flops_per_s",
    "fix_for",
    "layout_text",
    "logits_forward_flops_per_gpu",
    "loss_notes",
    "measure_capacity",
    "predict_command",
    "rank_env",
    "read_run",
    "report_run",
    "resolve_python",
    "run_command",
    "run_job",
    "settings_from_args",
    "tiny_job_spec",
    "tiny_model",
]

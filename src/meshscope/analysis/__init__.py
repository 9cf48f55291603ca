"""Analysis: from step records to the step breakdown, the cost table, the findings and ``analyze()``.

The heart of meshscope (DESIGN.md, "The step breakdown" and "The cost table"). Records flow through it in this
order, one module each:

- :mod:`~meshscope.analysis.breakdown`: every rank-step split into categories that add up to the step time
  (:func:`break_down` -> :class:`Breakdown`), collectives joined across their members (:class:`CollectiveJoin`),
  host clocks aligned (:class:`ClockOffsets`);
- :mod:`~meshscope.analysis.chains`: who pays for a sync wait: the last arrival, or the rank at the end of the chain
  of waits that made it late (``Breakdown.wait_paid_us``);
- :mod:`~meshscope.analysis.grouping`: grouped quantiles, medians and means over numpy columns;
- :mod:`~meshscope.analysis.transfers`: every collective and send measured per byte, against its class and the link
  model;
- :mod:`~meshscope.analysis.collectives`: bytes per GPU per step per pipeline stage, plan against records;
- :mod:`~meshscope.analysis.costs`: the cost table (:class:`CostRow`), the summary, memory against the plan;
- :mod:`~meshscope.analysis.diagnosis`: findings (:func:`diagnose` -> :class:`Finding`) naming cause, rank, node;
- :mod:`~meshscope.analysis.analyzing`: :func:`analyze`, the one entry point (records + optional spec ->
  :class:`Analysis`), with :func:`render_analysis` for people and ``Analysis.to_dict()`` for machines (what the
  operator's deep tier writes into its ConfigMap);
- :mod:`~meshscope.analysis.calibration`: the planner assumptions a run can tell (:func:`calibrate` ->
  :class:`Calibration`, :func:`render_file` for ``--assumptions``), and :mod:`~meshscope.analysis.predicting`: another
  layout of the same job planned with them (:func:`retarget`, :func:`predict` -> :class:`Prediction`);
- :mod:`~meshscope.analysis.commands`: ``meshscope analyze`` (:func:`analyze_command`), and :func:`read_inputs`
  (check the records files, load the spec, read the table), which ``meshscope report`` shares.

It computes on numpy columns, vectorised over rank-steps and intervals; it must not read record files (except the
command), draw, launch, or import torch. Import the names from here (``from meshscope.analysis import analyze``).
"""

from meshscope.analysis.analyzing import (
    Analysis,
    analyze,
    check_records_match_layout,
    render_analysis,
    render_analysis_dict,
)
from meshscope.analysis.breakdown import (
    BUBBLE,
    CATEGORIES,
    CATEGORY_INDEX,
    CHECKPOINT,
    COMPUTE,
    DATA,
    OPTIMIZER,
    OTHER,
    SYNC_WAIT,
    TICKS_PER_US,
    TRANSFER,
    Breakdown,
    ClockOffsets,
    CollectiveJoin,
    P2PBandwidth,
    break_down,
    comm_category,
    estimate_clock_offsets,
)
from meshscope.analysis.calibration import (
    BOOTSTRAP_SAMPLES,
    Calibration,
    CalibrationError,
    FittedValue,
    LinkFit,
    StepCategories,
    bootstrap_fit,
    calibrate,
    huber_fit,
    render_calibration,
    render_file,
    ring_hops,
)
from meshscope.analysis.collectives import (
    CollectiveComparison,
    StageTraffic,
    compare_collectives,
    stage_of_rows,
    stage_traffic,
)
from meshscope.analysis.commands import AnalyzeInputError, Inputs, analyze_command, read_inputs
from meshscope.analysis.costs import (
    CostRow,
    MemoryComparison,
    PipelineExpectation,
    RankSteps,
    Summary,
    Suspect,
    expected_pipeline,
    index_rank_steps,
)
from meshscope.analysis.diagnosis import Finding, diagnose
from meshscope.analysis.predicting import Prediction, predict, retarget

__all__ = [
    "BOOTSTRAP_SAMPLES",
    "BUBBLE",
    "CATEGORIES",
    "CATEGORY_INDEX",
    "CHECKPOINT",
    "COMPUTE",
    "DATA",
    "OPTIMIZER",
    "OTHER",
    "SYNC_WAIT",
    "TICKS_PER_US",
    "TRANSFER",
    "Analysis",
    "AnalyzeInputError",
    "Breakdown",
    "Calibration",
    "CalibrationError",
    "ClockOffsets",
    "CollectiveComparison",
    "CollectiveJoin",
    "CostRow",
    "Finding",
    "FittedValue",
    "Inputs",
    "LinkFit",
    "MemoryComparison",
    "P2PBandwidth",
    "PipelineExpectation",
    "Prediction",
    "RankSteps",
    "StageTraffic",
    "StepCategories",
    "Summary",
    "Suspect",
    "analyze",
    "analyze_command",
    "bootstrap_fit",
    "break_down",
    "calibrate",
    "check_records_match_layout",
    "comm_category",
    "compare_collectives",
    "diagnose",
    "estimate_clock_offsets",
    "expected_pipeline",
    "huber_fit",
    "index_rank_steps",
    "predict",
    "read_inputs",
    "render_analysis",
    "render_analysis_dict",
    "render_calibration",
    "render_file",
    "retarget",
    "ring_hops",
    "stage_of_rows",
    "stage_traffic",
]

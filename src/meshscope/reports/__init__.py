"""Reports: the self-contained HTML report, its per-rank timelines, and the Perfetto (Chrome trace-event) trace.

Read by a performance engineer, often on a machine with no network. Everything here **draws**: every number comes
from the records, their breakdown and the analysis (``Analysis.to_dict()``), never from an analysis of its own; all
text from the inputs is HTML-escaped and every number carries its unit.

- :mod:`~meshscope.reports.traces`: the aligned clock, sync-wait parts of collectives, representative steps
  (:func:`step_times`, :func:`trace_steps`) and :func:`write_trace`;
- :mod:`~meshscope.reports.timelines`: the inline-SVG step timeline and the palette;
- :mod:`~meshscope.reports.pages`: :func:`render_report` / :func:`write_report`, the HTML page;
- :mod:`~meshscope.reports.commands`: ``meshscope report`` (:func:`report_command`).

It must not analyse, launch or import torch. Import the names from here (``from meshscope.reports import
write_report``).
"""

from meshscope.reports.commands import ReportInputError, report_command
from meshscope.reports.pages import render_report, write_report
from meshscope.reports.traces import (
    TRACE_ALL_STEPS_MAX_INTERVALS,
    StepTimes,
    build_trace,
    step_times,
    trace_steps,
    write_trace,
)

__all__ = [
    "TRACE_ALL_STEPS_MAX_INTERVALS",
    "ReportInputError",
    "StepTimes",
    "build_trace",
    "render_report",
    "report_command",
    "step_times",
    "trace_steps",
    "write_report",
    "write_trace",
]

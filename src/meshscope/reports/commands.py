"""``meshscope report``: read step records (and a spec), analyse them, write the HTML report and the Perfetto trace.

The command line's arguments are defined in :mod:`meshscope.cli`; this module runs the command. It reads through
:func:`meshscope.analysis.read_inputs` (shared with ``meshscope analyze``), analyses through
:func:`meshscope.analysis.analyze` and draws through :mod:`~meshscope.reports.pages` and
:mod:`~meshscope.reports.traces`; on bad input it raises :class:`ReportInputError` (exit 2, one line). Progress goes
to stderr on a terminal unless ``--quiet`` (:func:`meshscope.progress.command_progress`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from meshscope.analysis import analyze, read_inputs
from meshscope.errors import MeshscopeError
from meshscope.progress import command_progress
from meshscope.reports.pages import write_report
from meshscope.reports.traces import trace_steps, write_trace

if TYPE_CHECKING:
    import argparse


class ReportInputError(MeshscopeError):
    """Records the report command cannot use."""


def report_command(args: argparse.Namespace) -> int:
    """``meshscope report RECORDS... [--spec FILE] [--out DIR] [--attempt N] [--skip-steps N] [-q]`` (the CLI).

    Raises:
        ReportInputError: for missing or unreadable records files.
    """
    progress = command_progress(quiet=args.quiet)
    inputs = read_inputs(
        args.records,
        spec=args.spec,
        progress=progress,
        error=ReportInputError,
        attempt=args.attempt,
        skip_steps=args.skip_steps,
    )
    table = inputs.table
    result = analyze(table, spec=inputs.spec, notes=inputs.notes, one_clock=inputs.one_clock, progress=progress)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with progress.phase("writing the report"):
        report = write_report(out / "report.html", table, result.breakdown, result.to_dict())
    steps = trace_steps(table)
    with progress.phase("writing the trace"):
        trace = write_trace(out / "trace.json", table, result.breakdown, steps=steps)
    which = "every step" if steps is None else f"steps {', '.join(map(str, steps))} (slowest, median)"
    sys.stdout.write(f"report: {report}\ntrace:  {trace} ({which}; open in ui.perfetto.dev or chrome://tracing)\n")
    return 0

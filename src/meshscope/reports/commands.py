"""``meshscope report``: read step records (and a spec), analyse them, write the HTML report and the Perfetto trace.

The command line's arguments are defined in :mod:`meshscope.cli`; this module runs the command. It analyses through
:func:`meshscope.analysis.analyze` and draws through :mod:`~meshscope.reports.pages` and
:mod:`~meshscope.reports.traces`; on bad input it raises :class:`ReportInputError` (exit 2, one line).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from meshscope.analysis import analyze
from meshscope.errors import MeshscopeError
from meshscope.jobs import load_spec
from meshscope.records import default_workers, read_table
from meshscope.reports.pages import write_report
from meshscope.reports.traces import trace_steps, write_trace

if TYPE_CHECKING:
    import argparse


class ReportInputError(MeshscopeError):
    """Records the report command cannot use."""


def report_command(args: argparse.Namespace) -> int:
    """``meshscope report RECORDS... [--spec FILE] [--out DIR]`` (arguments: :mod:`meshscope.cli`).

    Raises:
        ReportInputError: for missing or unreadable records files.
    """
    paths = [Path(p) for p in args.records]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ReportInputError(f"no such records file: {', '.join(missing)}")
    spec = load_spec(args.spec) if args.spec else None
    try:
        table = read_table(paths, workers=default_workers())
    except OSError as exc:
        raise ReportInputError(f"cannot read records: {exc}") from exc
    result = analyze(table, spec=spec)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = write_report(out / "report.html", table, result.breakdown, result.to_dict())
    steps = trace_steps(table)
    trace = write_trace(out / "trace.json", table, result.breakdown, steps=steps)
    which = "every step" if steps is None else f"steps {', '.join(map(str, steps))} (slowest, median)"
    sys.stdout.write(f"report: {report}\ntrace:  {trace} ({which}; open in ui.perfetto.dev or chrome://tracing)\n")
    return 0

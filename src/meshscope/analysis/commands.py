"""``meshscope analyze``: read step records (and a spec), analyse them, print the cost table or its JSON.

The command line's arguments are defined in :mod:`meshscope.cli`; this module runs the command. On bad input it
raises :class:`AnalyzeInputError` (exit 2, one line); it must not compute anything :func:`analyze` does not.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from meshscope.analysis.analyzing import analyze, render_analysis
from meshscope.errors import MeshscopeError, ParseError
from meshscope.jobs import load_spec
from meshscope.records import Note, default_workers, read_table

if TYPE_CHECKING:
    import argparse


class AnalyzeInputError(MeshscopeError):
    """Records or spec the command cannot use."""


def analyze_command(args: argparse.Namespace) -> int:
    """``meshscope analyze RECORDS... [--spec FILE] [--json] [--allow-partial]`` (arguments: :mod:`meshscope.cli`).

    Raises:
        AnalyzeInputError: for missing or unreadable records files.
    """
    paths = [Path(p) for p in args.records]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise AnalyzeInputError(f"no such records file: {', '.join(missing)}")
    spec = load_spec(args.spec) if args.spec else None
    notes: list[Note] = []
    if args.allow_partial:
        paths, notes = _one_job(paths)
    try:
        table = read_table(paths, allow_partial=args.allow_partial, workers=default_workers())
    except OSError as exc:
        raise AnalyzeInputError(f"cannot read records: {exc}") from exc
    except ParseError as exc:
        # The reader speaks to library callers; on the command line the switch is a flag.
        raise AnalyzeInputError(str(exc).replace("allow_partial=True", "--allow-partial")) from exc
    analysis = analyze(table, spec=spec, notes=notes)
    if args.json:
        json.dump(analysis.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_analysis(analysis) + "\n")
    return 0


def _first_job(path: Path) -> str | None:
    """The ``job`` of the first record of ``path``, ``None`` if it has none readable."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    job = json.loads(line).get("job")
                    return job if isinstance(job, str) else None
    except (OSError, ValueError, EOFError, AttributeError):
        return None
    return None


def _one_job(paths: list[Path]) -> tuple[list[Path], list[Note]]:
    """Keep the files of the job most files belong to (by their first record); note the others."""
    jobs = {p: _first_job(p) for p in paths}
    counts = Counter(j for j in jobs.values() if j is not None)
    if len(counts) <= 1:
        return paths, []
    keep_job = counts.most_common(1)[0][0]
    rejected = [p for p, j in jobs.items() if j is not None and j != keep_job]
    note = Note(
        code="rejected_job_files",
        count=len(rejected),
        message=(
            f"{len(rejected)} files hold records of another job than {keep_job!r} and were left out (e.g. "
            f"{rejected[0]}: job {jobs[rejected[0]]!r})"
        ),
    )
    return [p for p in paths if p not in rejected], [note]

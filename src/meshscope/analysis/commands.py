"""``meshscope analyze``: read step records (and a spec), analyse them, print the cost table or its JSON.

The command line's arguments are defined in :mod:`meshscope.cli`; this module runs the command. On bad input it
raises :class:`AnalyzeInputError` (exit 2, one line); it must not compute anything :func:`analyze` does not.
:func:`read_inputs` is the part ``meshscope report`` shares: check the files, load the spec, read the table. Progress
goes to stderr on a terminal unless ``--quiet`` (:func:`meshscope.progress.command_progress`); stdout carries only
the result.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from meshscope.analysis.analyzing import analyze, render_analysis
from meshscope.analysis.costs import grouped_median
from meshscope.analysis.diagnosis import CPU_CONTENTION, WARM_UP
from meshscope.errors import MeshscopeError, ParseError
from meshscope.formatting import human_seconds
from meshscope.jobs import load_spec
from meshscope.progress import NO_PROGRESS, command_progress
from meshscope.records import Note, RecordTable, default_workers, read_table

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

    from meshscope.jobs import JobSpec
    from meshscope.progress import Progress
    from meshscope.records import RecordTable


class AnalyzeInputError(MeshscopeError):
    """Records or spec the command cannot use."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Inputs:
    """What a command over records reads before it analyses: the table, the spec, and notes on files left out."""

    table: RecordTable
    spec: JobSpec | None
    notes: tuple[Note, ...]
    """Files of another job left out (``allow_partial``), and what a local run's ``collector.json`` says (CPU
    contention), for :func:`analyze`'s partial data."""
    one_clock: bool = False
    """Every records file lies beside a ``collector.json`` of ``meshscope run``: one host's clock (``analyze``'s
    ``one_clock``)."""


def read_inputs(
    records: Sequence[str],
    *,
    spec: str | None,
    allow_partial: bool | None = None,
    progress: Progress = NO_PROGRESS,
    error: type[MeshscopeError] = AnalyzeInputError,
    attempt: int | None = None,
    skip_steps: int = 0,
) -> Inputs:
    """Check that the records files exist, load the spec, read the records into a table (worker processes if large).

    Args:
        records: the records files the command line names.
        spec: the ``--spec`` file, if given.
        allow_partial: the command's ``--allow-partial``; ``None`` for a command without that flag (a reading error
            then keeps the reader's own wording).
        progress: told of the reading phases (:func:`meshscope.records.read_table`).
        error: what to raise for a missing or unreadable file (each command names its own).
        attempt: the command's ``--attempt``: which attempt of a restarted job to read (:func:`read_table`).
        skip_steps: the command's ``--skip-steps``: how many of the first step numbers to leave out as warm-up.

    Raises:
        MeshscopeError: ``error`` for missing or unreadable records files (and, under ``allow_partial``, records the
            reader refuses, worded for the command line); the spec's errors as :func:`meshscope.jobs.load_spec`.
    """
    paths = _records_files(records, error)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise error(f"no such records file: {', '.join(missing)}")
    job_spec = load_spec(spec) if spec else None
    notes: list[Note] = []
    if allow_partial:
        paths, notes = _one_job(paths)
    try:
        table = read_table(
            paths,
            allow_partial=bool(allow_partial),
            workers=default_workers(),
            progress=progress,
            attempt=attempt,
            skip_steps=skip_steps,
        )
    except OSError as exc:
        raise error(f"cannot read records: {exc}") from exc
    except ParseError as exc:
        if allow_partial is None:
            raise
        # The reader speaks to library callers; on the command line the switch is a flag.
        raise error(str(exc).replace("allow_partial=True", "--allow-partial")) from exc
    launched, launch_notes = _launches(paths)
    warm_up = warm_up_note(table, skip_steps)
    notes.extend([warm_up] if warm_up is not None else [])
    return Inputs(table=table, spec=job_spec, notes=(*notes, *launch_notes), one_clock=launched)


WARM_UP_RATIO = 2.0
"""A first step read whose median rank took at least this many times the median step of the others is a warm-up."""


def warm_up_note(table: RecordTable, skip_steps: int) -> Note | None:
    """The ``warm_up`` note when the first step read looks like a warm-up, else ``None``.

    Its median rank's step (end less start) at least :data:`WARM_UP_RATIO` x the median over the other steps of
    theirs, with 2 steps or more besides it. One-time work (``torch.compile``, the optimizer state's first allocation,
    cold caches, a DataLoader's workers starting) then sits in every mean and per-rank figure: ``meshscope run`` leaves
    its first step out, records from ``MESHSCOPE_COLLECTOR=file:`` or a sidecar read whole do not (a user's clean
    torchrun job: step 0 906 ms against 223 ms, its optimizer row 5.47 ms at the median rank-step beside 23.06 ms for
    the median rank's mean), so the note says so and gives the flag.
    """
    s = table.steps
    if table.n_rows == 0:
        return None
    steps, index = np.unique(s.step, return_inverse=True)
    if steps.size < 3:
        return None
    medians = grouped_median(index, (s.end_us - s.start_us).astype(np.float64), int(steps.size))
    rest = float(np.median(medians[1:]))
    if rest <= 0 or medians[0] < WARM_UP_RATIO * rest:
        return None
    return Note(
        code=WARM_UP,
        count=1,
        message=(
            f"step {int(steps[0])} took {human_seconds(medians[0] / 1e6)} at the median rank, "
            f"{medians[0] / rest:.1f}x the median step ({human_seconds(rest / 1e6)}): its one-time work (compilation, "
            f"first allocations, cold caches) is in the figures below; --skip-steps {skip_steps + 1} leaves it out "
            "(meshscope run leaves out its first step)"
        ),
    )


RECORDS_SUFFIXES = (".jsonl", ".jsonl.gz")
"""What a records file in a directory is called: ``meshscope run``'s ``OUT/records.jsonl``, the SDK's per-rank files
(``MESHSCOPE_COLLECTOR=file:DIR``: ``DIR/rank-NNNNN.jsonl``), ``meshscope simulate``'s ``.jsonl.gz``."""


def _records_files(records: Sequence[str], error: type[MeshscopeError]) -> list[Path]:
    """The files the command line names, a directory standing for its records files (sorted by name)."""
    paths: list[Path] = []
    for name in records:
        path = Path(name)
        if not path.is_dir():
            paths.append(path)
            continue
        found = sorted(p for p in path.iterdir() if p.name.endswith(RECORDS_SUFFIXES) and p.is_file())
        if not found:
            raise error(f"no records files ({', '.join('*' + s for s in RECORDS_SUFFIXES)}) in the directory {path}")
        paths.extend(found)
    return paths


def _launches(paths: Sequence[Path]) -> tuple[bool, list[Note]]:
    """What ``meshscope run`` measured about the launch of these records: its ``collector.json`` beside them.

    Returns whether every file was a local run's (one host clock), the CPU contention note of a run whose ranks
    outnumbered their cores, and the note of a run that ended early (interrupted, stopped, a rank failed): they keep
    saying so when its records are analysed again (``meshscope analyze OUT``, ``meshscope report``). A missing or
    unreadable file is no launch of ours.
    """
    notes = []
    ended: list[Note] = []
    local = 0
    folders = sorted({p.resolve().parent for p in paths})
    for where in folders:
        try:
            launch = json.loads((where / "collector.json").read_text())
            cpu = launch.get("cpu", {})
            oversubscribed, ranks, cores = cpu.get("oversubscribed"), cpu.get("ranks"), cpu.get("cores")
            foreign = cpu.get("foreign_fraction")
        except (OSError, ValueError, AttributeError):
            continue
        local += 1
        cut = _ended_early(launch)
        if cut is not None:
            ended.append(Note(code=RUN_ENDED_EARLY, count=1, message=f"{cut} ({where / 'collector.json'})"))
        if not (isinstance(ranks, int) and isinstance(cores, int | float)):
            continue
        source = f"from {where / 'collector.json'}"
        if oversubscribed is True:
            message = (
                f"{ranks} ranks on {cores:g} CPU cores: timings include CPU contention (time-sliced: a rank "
                f"waiting for a core counts as its step's time; {source})"
            )
        elif cpu.get("contended") is True and isinstance(foreign, int | float):
            message = (
                f"{ranks} ranks on {cores:g} CPU cores, beside foreign CPU load (other processes took "
                f"{foreign:.0%} of the cores' time): timings include CPU contention ({source})"
            )
        else:
            continue
        notes.append(Note(code=CPU_CONTENTION, count=ranks, message=message))
    return local == len(folders) == 1, notes[:1] + ended[:1]


RUN_ENDED_EARLY = "run_ended_early"
"""Note code: the ``meshscope run`` that wrote these records ended before its ranks did (its ``collector.json``)."""


def _ended_early(launch: dict[str, Any]) -> str | None:
    """How the run a ``collector.json`` describes ended early, as a sentence; ``None`` where every rank exited 0.

    ``ended_by`` says it (``interrupted``, ``stopped by SIGTERM``, ``rank 1 was killed by signal 9 (SIGKILL)``); a file
    written before the field existed says it only in its ranks' exit codes.
    """
    how = launch.get("ended_by")
    if not isinstance(how, str):
        codes = launch.get("exit_codes")
        if not isinstance(codes, dict):
            return None
        bad = {r: c for r, c in codes.items() if isinstance(c, int) and c != 0}
        if not bad:
            return None
        how = "ranks exited with " + ", ".join(f"rank {r}: {c}" for r, c in sorted(bad.items(), key=lambda x: x[0]))
    return (
        f"the run ended early ({how}): its records stop there, and the steps the ranks were in when it stopped "
        "are missing"
    )


def analyze_command(args: argparse.Namespace) -> int:
    """``meshscope analyze RECORDS... [--spec FILE] [--json] [--allow-partial] [--attempt N] [--skip-steps N] [-q]``.

    Raises:
        AnalyzeInputError: for missing or unreadable records files.
    """
    progress = command_progress(quiet=args.quiet)
    inputs = read_inputs(
        args.records,
        spec=args.spec,
        allow_partial=args.allow_partial,
        progress=progress,
        attempt=args.attempt,
        skip_steps=args.skip_steps,
    )
    analysis = analyze(
        inputs.table, spec=inputs.spec, notes=inputs.notes, one_clock=inputs.one_clock, progress=progress
    )
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

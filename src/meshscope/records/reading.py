"""Read step records from JSON-lines files: as record objects, or straight into a validated table.

:func:`read_records` builds a :class:`~meshscope.records.schema.StepRecord` per line (small inputs, tests);
:func:`read_table` builds columns without per-interval objects (:mod:`meshscope.records.building`) and can decode a
large input in worker processes, splitting it into byte ranges and merging the workers' columns. Every problem is a
:class:`~meshscope.errors.ParseError` naming the file, line, field, value and what would fit. This module must not
analyse the records.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from meshscope.errors import ParseError
from meshscope.records.building import _Raw, _table_of, _TableBuilder
from meshscope.records.decoding import _decoded
from meshscope.records.parsing import _parse_record
from meshscope.records.schema import UNKNOWN, Note, RecordSet, StepRecord, _job_mismatch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from numpy.typing import NDArray

    from meshscope.records.tables import RecordTable

    StrPath = str | PathLike[str]


def _as_paths(paths: StrPath | Sequence[StrPath]) -> list[Path]:
    if isinstance(paths, str | PathLike):
        return [Path(paths)]
    return [Path(p) for p in paths]


def read_records(paths: StrPath | Sequence[StrPath], *, allow_partial: bool = False) -> RecordSet:
    """Read and validate record objects from JSON-lines files (``.gz`` is decompressed).

    For large inputs use :func:`read_table`, which builds columns without per-interval objects.

    Args:
        paths: one file or several (e.g. one per rank); all must belong to the same job.
        allow_partial: skip a truncated or corrupt **last** line of a file (a writer killed mid-line) and say so in
            the returned notes, instead of raising. Corrupt lines elsewhere are always errors.

    Returns:
        The records, the job name and notes on skipped lines.

    Raises:
        ParseError: naming file, line, field, value and what would fit: bad JSON, schema violations, mismatched jobs
            (both names), duplicate (rank, step) (both lines).
    """
    notes: list[Note] = []
    records: list[StepRecord] = []
    job: tuple[str, str] | None = None
    seen: dict[tuple[int, int], str] = {}
    for path in _as_paths(paths):
        for lineno, obj in _decoded(path, allow_partial, notes):
            where = f"{path} line {lineno}"
            rec = _parse_record(obj, where)
            if job is None:
                job = (rec.job, where)
            elif rec.job != job[0]:
                raise ParseError(_job_mismatch(rec.job, where, job[0], job[1]))
            key = (rec.rank, rec.step)
            if key in seen:
                raise ParseError(
                    f"rank {rec.rank} step {rec.step} appears twice: {seen[key]} and {where}; each (rank, step) must "
                    f"have exactly one record"
                )
            seen[key] = where
            records.append(rec)
    return RecordSet(job=job[0] if job else "", records=tuple(records), notes=tuple(notes))


def read_table(paths: StrPath | Sequence[StrPath], *, allow_partial: bool = False, workers: int = 1) -> RecordTable:
    """Read JSON-lines step records straight into a :class:`RecordTable` (the fast path for big inputs).

    Lines are decoded with the standard ``json`` module (one ``json.loads`` per line) and turned into numpy columns a
    batch of lines at a time, field by field (:mod:`meshscope.records.building`); range and consistency checks run
    vectorised over the finished columns, and any line the fast path cannot take goes to the object parser, which
    raises the precise error. Same rules and errors as :func:`read_records`, plus the cross-record checks of
    :class:`RecordTable`. (One leniency of the fast path: JSON ``true``/``false`` in an integer field reads as 1/0.)

    Args:
        paths: one file or several; all must belong to the same job.
        allow_partial: skip a truncated or corrupt last line of a file, noted in ``RecordTable.notes``.
        workers: processes to decode with. Above 1, inputs of 64 MiB or more are split into byte ranges (plain
            files) or whole files (gzip) and decoded by worker processes (``forkserver``/``spawn``: the calling
            script must guard its top level with ``if __name__ == "__main__":``; the ``meshscope`` command is
            guarded). :func:`default_workers` is what the command line passes. If a worker meets bad input, or a
            truncated last line under ``allow_partial``, the input is read again in this process so that the error or
            note names the right line.

    Returns:
        The validated table.

    Raises:
        ParseError: as :func:`read_records` and :class:`RecordTable`; also for ``workers < 1``.
    """
    files = _as_paths(paths)
    if workers < 1:
        raise ParseError(f"workers = {workers}; it must be >= 1")
    if workers > 1 and sum(p.stat().st_size for p in files) >= _PARALLEL_MIN_BYTES:
        table = _read_parallel(files, allow_partial=allow_partial, workers=workers)
        if table is not None:
            return table
    builder = _TableBuilder()
    notes: list[Note] = []
    for file_index, path in enumerate(files):
        builder.read_file(path, file_index, allow_partial, notes)
    return builder.build(notes=tuple(notes), source_files=tuple(str(p) for p in files))


_MOST_DEFAULT_WORKERS = 8
"""Beyond this many processes decoding stops paying for the memory each one holds."""


def default_workers() -> int:
    """Processes to decode a large input with on this machine: the CPUs this process may run on, at most 8.

    What the command line passes to :func:`read_table` (``meshscope analyze``, ``meshscope report``); inputs under
    64 MiB are read in this process whatever the number.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - platforms without sched_getaffinity
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, _MOST_DEFAULT_WORKERS))


_PARALLEL_MIN_BYTES = 64 << 20
"""Inputs smaller than this are decoded in this process: starting workers would cost more than it saves."""
_CHUNK_MIN_BYTES = 16 << 20
"""Smallest byte range given to one worker."""


def _chunk_plan(files: list[Path], workers: int) -> list[tuple[str, int, tuple[int, int] | None, bool]]:
    """(path, file index, byte span or None for the whole file, whether the span ends the file) per work item."""
    total = sum(p.stat().st_size for p in files)
    target = max(_CHUNK_MIN_BYTES, total // (4 * workers) + 1)  # ~4 items per worker balances uneven lines
    plan: list[tuple[str, int, tuple[int, int] | None, bool]] = []
    for index, path in enumerate(files):
        size = path.stat().st_size
        if path.name.endswith(".gz") or size <= target:
            plan.append((str(path), index, None, True))
            continue
        starts = [0]
        with path.open("rb") as f:
            while starts[-1] + target < size:
                f.seek(starts[-1] + target)
                f.readline()  # move to the next line start
                if f.tell() >= size:
                    break
                starts.append(f.tell())
        ends = [*starts[1:], size]
        plan.extend((str(path), index, (a, b), b == size) for a, b in zip(starts, ends, strict=True))
    return plan


def _read_chunk(
    path: str,
    file_index: int,
    span: tuple[int, int] | None,
    last: bool,  # noqa: FBT001
    allow_partial: bool,  # noqa: FBT001
) -> tuple[_Raw, list[Note]]:
    """Worker: decode one work item into raw columns (line numbers relative to the item).

    The cyclic garbage collector is off while it decodes: decoded JSON holds no cycles, and the collector's passes
    over millions of fresh objects cost ~5% of the time. (The worker process is this module's own.)
    """
    gc.disable()
    try:
        builder = _TableBuilder()
        notes: list[Note] = []
        lines = builder.read_file(Path(path), file_index, allow_partial, notes, span=span, last=last)
        return builder.raw(lines=lines), notes
    finally:
        gc.enable()


def _read_parallel(files: list[Path], *, allow_partial: bool, workers: int) -> RecordTable | None:
    """Decode the work items in worker processes and merge them; ``None`` means "read again in this process"."""
    plan = _chunk_plan(files, workers)
    if len(plan) < 2:
        return None
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    try:
        with ProcessPoolExecutor(max_workers=min(workers, len(plan)), mp_context=context) as pool:
            results = list(pool.map(_read_chunk, *zip(*[(*item, allow_partial) for item in plan], strict=True)))
    except Exception:  # noqa: BLE001 - any failure: the caller reads in-process, which raises the precise error
        return None
    if any(notes for _, notes in results):
        return None  # notes would name item-relative lines
    raws = [raw for raw, _ in results]
    del results
    if len({raw.job for raw in raws if raw.job is not None}) > 1:
        return None  # so would a job mismatch
    merged = _merge(raws, [item[1] for item in plan])
    return _table_of(merged, notes=(), source_files=tuple(str(p) for p in files))


def _merge(raws: list[_Raw], file_of: list[int]) -> _Raw:
    """Concatenate work items: renumber name codes and (per file) line numbers; frees the items' columns as it goes."""
    names: dict[str, dict[str, int]] = {k: {} for k in raws[0].names}
    line_offset: dict[int, int] = {}
    for raw, file_index in zip(raws, file_of, strict=True):
        for kind in ("node", "nvlink_domain", "network_tier"):
            raw.rows[kind] = _recode(names[kind], raw.names[kind], raw.rows[kind])
        raw.intervals["group"] = _recode(names["group"], raw.names["group"], raw.intervals["group"])
        raw.rows["source_line"] = raw.rows["source_line"] + line_offset.get(file_index, 0)
        line_offset[file_index] = line_offset.get(file_index, 0) + raw.lines
    job = next((raw for raw in raws if raw.job is not None), raws[0])

    def joined(columns: list[dict[str, NDArray[Any]]]) -> dict[str, NDArray[Any]]:
        return {key: np.concatenate([c.pop(key) for c in columns]) for key in list(columns[0])}

    return _Raw(
        job=job.job,
        job_where=job.job_where,
        rows=joined([raw.rows for raw in raws]),
        intervals=joined([raw.intervals for raw in raws]),
        names={kind: tuple(known) for kind, known in names.items()},
    )


def _recode(known: dict[str, int], names: tuple[str, ...], codes: NDArray[Any]) -> NDArray[Any]:
    """Codes into one work item's ``names`` as codes into ``known`` (which learns the names it lacks); -1 stays."""
    lut = np.array([known.setdefault(name, len(known)) for name in names] + [UNKNOWN], dtype=codes.dtype)
    out: NDArray[Any] = lut[codes]  # code -1 picks the trailing UNKNOWN
    return out

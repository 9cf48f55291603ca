"""Read step records from JSON-lines files: as record objects, or straight into a validated table.

:func:`read_records` builds a :class:`~meshscope.records.schema.StepRecord` per line (small inputs, tests);
:func:`read_table` builds columns without per-interval objects (:mod:`meshscope.records.building`) and can decode a
large input in worker processes, splitting it into byte ranges and merging the workers' columns. Every problem is a
:class:`~meshscope.errors.ParseError` naming the file, line, field, value and what would fit. This module must not
analyse the records.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor, wait
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from meshscope.errors import ParseCode, ParseError
from meshscope.progress import BYTES, NO_PROGRESS
from meshscope.records.building import (
    _Described,
    _merge_parts,
    _Raw,
    _table_of,
    _TableBuilder,
    _two_processes,
    earlier_attempts_note,
)
from meshscope.records.decoding import _decoded
from meshscope.records.parsing import _parse_record
from meshscope.records.schema import Note, RecordSet, StepRecord, _job_mismatch

if TYPE_CHECKING:
    from collections.abc import Sequence
    from io import FileIO

    from numpy.typing import NDArray

    from meshscope.progress import Progress
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
        The records, the job name and notes on skipped lines; of a restarted or resumed job (a rank's steps go
        back), each rank's last attempt, with an ``earlier_attempts`` note.

    Raises:
        ParseError: naming file, line, field, value and what would fit: bad JSON, schema violations, mismatched jobs
            (both names).
    """
    notes: list[Note] = []
    records: list[StepRecord] = []
    job: tuple[str, str] | None = None
    seen: set[tuple[int, int]] = set()
    writers: dict[int, int | None] = {}
    places: list[str] = []
    repeated = new_writer = False
    for path in _as_paths(paths):
        for lineno, obj in _decoded(path, allow_partial, notes):
            where = f"{path} line {lineno}"
            rec = _parse_record(obj, where)
            if job is None:
                job = (rec.job, where)
            elif rec.job != job[0]:
                raise ParseError(_job_mismatch(rec.job, where, job[0], job[1]), code=ParseCode.JOB_MISMATCH)
            key = (rec.rank, rec.step)
            repeated = repeated or key in seen
            seen.add(key)
            new_writer = new_writer or writers.setdefault(rec.rank, rec.attempt_start_us) != rec.attempt_start_us
            records.append(rec)
            places.append(where)
    if repeated or new_writer:  # a rank's step went back, or a new process wrote: a restarted or resumed job
        records = _last_attempt_records(records, places, notes, steps_back=repeated)
    return RecordSet(job=job[0] if job else "", records=tuple(records), notes=tuple(notes))


def _last_attempt_records(
    records: list[StepRecord], places: list[str], notes: list[Note], *, steps_back: bool
) -> list[StepRecord]:
    """Each rank's records of its last attempt: its latest process's, after the last place its steps go back.

    The object reader's form of ``meshscope.records.building._last_attempts``, with the same note (appended to
    ``notes``) and the same error for two processes that wrote as one rank at once (``places``: where each record
    was read).
    """
    by_rank: dict[int, list[int]] = {}
    for i, rec in enumerate(records):
        by_rank.setdefault(rec.rank, []).append(i)
    keep: set[int] = set()
    restarts: dict[int, int] = {}
    for rank, rows in by_rank.items():
        by_process: dict[int, list[int]] = {}
        for i in rows:
            by_process.setdefault(_began(records[i]), []).append(i)
        processes = sorted(by_process)
        _check_one_process_at_a_time(records, places, rank, by_process)
        count = len(processes) - 1
        start = 0
        if steps_back:
            for process in processes:
                backs = _steps_back(records, by_process[process])
                count += len(backs)
                if backs and process == processes[-1]:
                    start = backs[-1]
        keep.update(by_process[processes[-1]][start:])
        if count:
            restarts[rank] = count
    kept = [rec for i, rec in enumerate(records) if i in keep]
    dropped = len(records) - len(kept)
    if restarts:
        notes.append(earlier_attempts_note(restarts=max(restarts.values()), ranks=len(restarts), dropped=dropped))
    return kept


def _steps_back(records: list[StepRecord], rows: list[int]) -> list[int]:
    """Positions in ``rows`` (one process's records, as written) whose step is not above the one before."""
    return [j for j in range(1, len(rows)) if records[rows[j]].step <= records[rows[j - 1]].step]


def _check_one_process_at_a_time(
    records: list[StepRecord], places: list[str], rank: int, by_process: dict[int, list[int]]
) -> None:
    """Refuse ``rank`` where one of its processes wrote a step that began after a later process began tracking.

    Raises:
        ParseError: naming the record, the rank and both processes.
    """
    for earlier, later in itertools.pairwise(sorted(by_process)):
        if earlier < 0:
            continue
        clash = next((i for i in by_process[earlier] if records[i].start_us >= later), None)
        if clash is None:
            continue
        rec, first = records[clash], by_process[later][0]
        raise ParseError(
            _two_processes(
                places[first], rank=rank, later=later, earlier=earlier, step=rec.step, start_us=rec.start_us
            ),
            code=ParseCode.INCONSISTENT,
        )


def _began(record: StepRecord) -> int:
    """The record's ``attempt_start_us``, ``-1`` (the earliest) where its writer does not say."""
    return -1 if record.attempt_start_us is None else record.attempt_start_us


def read_table(
    paths: StrPath | Sequence[StrPath],
    *,
    allow_partial: bool = False,
    workers: int = 1,
    progress: Progress = NO_PROGRESS,
    attempt: int | None = None,
    skip_steps: int = 0,
) -> RecordTable:
    """Read JSON-lines step records straight into a :class:`RecordTable` (the fast path for big inputs).

    Lines are decoded by ``msgspec`` straight into typed objects (JSON types checked in C, no dict per interval) and
    turned into numpy columns a batch of lines at a time, field by field (:mod:`meshscope.records.building`); range
    and consistency checks run vectorised over the finished columns, and any line the fast path cannot take goes to
    the object parser, which raises the precise error. The same lines are accepted as by :func:`read_records`, with
    the same per-line errors, plus the cross-record checks of :class:`RecordTable`.

    Args:
        paths: one file or several; all must belong to the same job.
        allow_partial: skip a truncated or corrupt last line of a file, noted in ``RecordTable.notes``.
        workers: processes to decode with. Above 1, inputs of 64 MiB or more are split into byte ranges (plain
            files) or whole files (gzip) and decoded by worker processes (``forkserver``/``spawn``: the calling
            script must guard its top level with ``if __name__ == "__main__":``; the ``meshscope`` command is
            guarded). :func:`default_workers` is what the command line passes. Workers hand their columns back
            through files in ``/dev/shm`` (else the temporary directory), removed before this returns. If a worker
            meets bad input, or a truncated last line under ``allow_partial``, the input is read again in this process
            so that the error or note names the right line.
        progress: told of the phases: "reading records" (bytes of the files read, a batch of lines at a time; the
            workers add theirs to a shared count, looked at every 0.1 s), "merging the workers' columns", "checking
            the table".
        attempt: of a job restarted or resumed into the same records, which attempt of each rank to keep: ``None``
            or -1 the last (with an ``earlier_attempts`` note), 1 the first, 2 the second, -2 the one before the last
            (docs/records.md).
        skip_steps: leave out the first ``skip_steps`` step numbers of the records (of the attempt kept): the
            warm-up, as ``meshscope run`` leaves out its run's first step (lazy initialisation, first gathers,
            optimizer state allocation).

    Returns:
        The validated table.

    Raises:
        ParseError: as :func:`read_records` and :class:`RecordTable`; also for ``workers < 1``, for an
            ``attempt`` that a rank's records do not hold and for ``skip_steps`` that would leave no step
            (``value_out_of_range``).
    """
    files = _as_paths(paths)
    if workers < 1:
        raise ParseError(f"workers = {workers}; it must be >= 1", code=ParseCode.INVALID)
    if skip_steps < 0:
        raise ParseError(f"skip_steps = {skip_steps}; it must be >= 0", code=ParseCode.INVALID)
    if attempt == 0:
        raise ParseError("attempt = 0: give 1 for the first attempt, -1 for the last", code=ParseCode.INVALID)
    total = sum(p.stat().st_size for p in files)
    if workers > 1 and total >= _PARALLEL_MIN_BYTES:
        table = _read_parallel(
            files,
            allow_partial=allow_partial,
            workers=workers,
            progress=progress,
            attempt=attempt,
            skip_steps=skip_steps,
        )
        if table is not None:
            return table
    builder = _TableBuilder()
    notes: list[Note] = []
    with progress.phase(READING, total=total, unit=BYTES) as phase:
        for file_index, path in enumerate(files):
            builder.read_file(path, file_index, allow_partial, notes, phase=phase)
    with progress.phase(CHECKING):
        return builder.build(
            notes=tuple(notes), source_files=tuple(str(p) for p in files), attempt=attempt, skip_steps=skip_steps
        )


READING = "reading records"
"""The phase of decoding record files (:mod:`meshscope.progress`), counted in bytes of the files."""
MERGING = "merging the workers' columns"
"""The phase of putting the workers' columns together (large inputs only)."""
CHECKING = "checking the table"
"""The phase of the vectorised checks of the finished table."""


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


@dataclass(frozen=True, slots=True, kw_only=True)
class _Chunk:
    """What a worker hands back: where it wrote one work item's columns, and what the parent needs to merge them."""

    path: str
    """File holding the columns, back to back, in ``columns`` order."""
    columns: tuple[tuple[str, str, str, tuple[int, ...]], ...]
    """(table part ``rows`` or ``intervals``, column, dtype, shape) of each column in the file."""
    job: str | None
    job_where: str
    names: dict[str, tuple[str, ...]]
    lines: int
    """Physical lines read, to number the next item's lines."""
    notes: tuple[Note, ...]


def _read_chunk(  # noqa: PLR0917 - the pool maps it over positional work items
    path: str,
    file_index: int,
    span: tuple[int, int] | None,
    last: bool,  # noqa: FBT001
    allow_partial: bool,  # noqa: FBT001
    out: str,
) -> _Chunk:
    """Worker: decode one work item (line numbers relative to the item) and write its columns to the file ``out``.

    The columns go through a file, not back through the pool's pipe: the parent reads each straight into its slice of
    the merged column, where pickling would copy it three times (pickle, receive, concatenate). The cyclic garbage
    collector is off while it decodes: decoded lines hold no cycles, and the collector's passes over millions of fresh
    objects cost ~5% of the time. (The worker process is this module's own.) The bytes it reads go to the parent's
    shared count (:func:`_share_bytes_read`), the progress of the read.
    """
    gc.disable()
    try:
        builder = _TableBuilder()
        notes: list[Note] = []
        phase = _SharedBytes(_BYTES_READ) if _BYTES_READ is not None else None
        lines = builder.read_file(Path(path), file_index, allow_partial, notes, span=span, last=last, phase=phase)
        if phase is not None:
            phase.flush()
        raw = builder.raw(lines=lines)
    finally:
        gc.enable()
    columns = []
    with Path(out).open("wb") as f:
        for part, cols in (("rows", raw.rows), ("intervals", raw.intervals)):
            for name, col in cols.items():
                data = np.ascontiguousarray(col)
                if data.size:  # (a memoryview of an empty array cannot be cast to bytes)
                    f.write(data.data.cast("B"))
                columns.append((part, name, data.dtype.str, data.shape))
    return _Chunk(
        path=out,
        columns=tuple(columns),
        job=raw.job,
        job_where=raw.job_where,
        names=raw.names,
        lines=lines,
        notes=tuple(notes),
    )


def _scratch_dir(need_bytes: int) -> str | None:
    """Where workers write their columns: ``/dev/shm`` (memory, never the disk) if it has room, else the temp directory.

    (A container's ``/dev/shm`` is often 64 MiB. Should it fill up all the same, a worker fails and the input is read
    again in this process.)
    """
    shm = Path("/dev/shm")  # noqa: S108 - a private directory is made inside it
    try:
        roomy = shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= need_bytes
    except OSError:
        roomy = False
    return str(shm) if roomy else None


def _read_parallel(
    files: list[Path],
    *,
    allow_partial: bool,
    workers: int,
    progress: Progress,
    attempt: int | None,
    skip_steps: int,
) -> RecordTable | None:
    """Decode the work items in worker processes and merge them; ``None`` means "read again in this process"."""
    plan = _chunk_plan(files, workers)
    if len(plan) < 2:
        return None
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    # The columns take about half the size of the JSON lines, which gzip shrinks ~10x.
    need = sum(p.stat().st_size * (5 if p.name.endswith(".gz") else 1) for p in files)
    with tempfile.TemporaryDirectory(prefix="meshscope-read-", dir=_scratch_dir(need)) as scratch:
        outs = [str(Path(scratch) / f"item-{i}.bin") for i in range(len(plan))]
        shared = context.Value("q", 0)  # bytes the workers have read so far, for the progress
        try:
            with (
                progress.phase(READING, total=sum(p.stat().st_size for p in files), unit=BYTES) as phase,
                ProcessPoolExecutor(
                    max_workers=min(workers, len(plan)),
                    mp_context=context,
                    initializer=_share_bytes_read,
                    initargs=(shared,),
                ) as pool,
            ):
                futures = [
                    pool.submit(_read_chunk, *item, allow_partial, out) for item, out in zip(plan, outs, strict=True)
                ]
                running, told = set(futures), 0
                while running:
                    done, running = wait(running, timeout=_POLL_S)
                    for future in done:
                        future.result()  # (raises a worker's failure now)
                    now = shared.value
                    phase.advance(now - told)
                    told = now
                chunks = [future.result() for future in futures]
        except Exception:  # noqa: BLE001 - any failure: the caller reads in-process, which raises the precise error
            return None
        if any(chunk.notes for chunk in chunks):
            return None  # notes would name item-relative lines
        if len({chunk.job for chunk in chunks if chunk.job is not None}) > 1:
            return None  # so would a job mismatch
        with progress.phase(MERGING):
            merged = _merge(chunks, [item[1] for item in plan])
    with progress.phase(CHECKING):
        return _table_of(
            merged, notes=(), source_files=tuple(str(p) for p in files), attempt=attempt, skip_steps=skip_steps
        )


_POLL_S = 0.1
"""Seconds between two looks at the workers' count of bytes read (the progress of a parallel read)."""
_SHARE_EVERY_BYTES = 1 << 20
"""A worker adds its bytes read to the shared count a MiB at a time (one lock each)."""
_BYTES_READ: Any = None
"""In a worker process: the parent's shared count of bytes read (a ``multiprocessing.Value``)."""


def _share_bytes_read(counter: Any) -> None:  # noqa: ANN401 - a multiprocessing.Value
    """Worker initializer: keep the parent's count of bytes read."""
    global _BYTES_READ  # noqa: PLW0603 - one per worker process, set once when it starts
    _BYTES_READ = counter


class _SharedBytes:
    """A worker's side of the "reading records" phase: bytes read go to the parent's count, a MiB at a time."""

    __slots__ = ("_counter", "_held")

    def __init__(self, counter: Any) -> None:  # noqa: ANN401 - a multiprocessing.Value
        self._counter = counter
        self._held = 0

    def advance(self, amount: int = 1) -> None:
        self._held += amount
        if self._held >= _SHARE_EVERY_BYTES:
            self.flush()

    def flush(self) -> None:
        if self._held:
            with self._counter.get_lock():
                self._counter.value += self._held
            self._held = 0


def _merge(chunks: list[_Chunk], file_of: list[int]) -> _Raw:
    """Read every work item's columns straight into its slice of the merged columns; renumber name codes and lines."""

    def fill(i: int, targets: list[NDArray[Any]]) -> None:
        with Path(chunks[i].path).open("rb", buffering=0) as f:
            for target in targets:
                _read_into(f, target)
        Path(chunks[i].path).unlink()

    described = [
        _Described(columns=c.columns, names=c.names, job=c.job, job_where=c.job_where, lines=c.lines) for c in chunks
    ]
    return _merge_parts(described, file_of, fill)


def _read_into(f: FileIO, target: NDArray[Any]) -> None:
    """Fill ``target`` from the file's next ``target.nbytes`` bytes."""
    if not target.size:
        return
    view = target.data.cast("B")
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise OSError(f"a reader worker's columns in {f.name} end early ({done} of {len(view)} bytes)")
        done += got

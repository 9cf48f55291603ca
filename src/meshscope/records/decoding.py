"""Lines of step-record files: plain or gzip, a batch at a time, with the partial-data rules; and their JSON.

Both readers (:func:`~meshscope.records.reading.read_records` and the columnar fast path) take their lines from here,
so that they agree on line numbers, blank lines and truncation: a bad **last** line of a file (a writer killed
mid-line) or a cut-off gzip stream is skipped and noted under ``allow_partial``, and is an error otherwise; a bad
line anywhere else is always an error naming it. :func:`_raw_batches` hands out undecoded lines (the fast path
decodes them itself, straight into typed objects); :func:`_decode_batch` decodes a batch with the standard ``json``
module and applies those rules, whose messages quote ``json``'s own. This module must not interpret the decoded
objects.
"""

from __future__ import annotations

import json
import zlib
from typing import TYPE_CHECKING, Any

from meshscope.errors import ParseCode, ParseError
from meshscope.records.schema import Note

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


class _TruncatedError(Exception):
    """Internal: the last line of a file does not parse."""


def _lines(
    path: Path, span: tuple[int, int] | None = None, tally: list[int] | None = None
) -> Iterator[tuple[int, bytes]]:
    """Yield (line number, raw line); a compressed stream that ends early ends the iteration with _TruncatedError.

    ``span`` (plain files only) reads the lines starting in byte range [start, end), numbered from 1 (a worker's
    chunk; ``start`` must be a line start). Gzip is decompressed block by block (not through ``gzip.open``, whose
    buffered reads lose the lines decoded just before a truncation), so ``allow_partial`` keeps every complete line.
    ``tally[0]``, if given, grows by the bytes of the file read so far (compressed bytes of a gzip file): what the
    readers' progress counts.
    """
    if not path.name.endswith(".gz"):
        yield from _plain_lines(path, span, tally)
        return
    lineno = 0
    rest = b""
    with path.open("rb") as f:
        inflate = zlib.decompressobj(wbits=31)
        try:
            while chunk := f.read(1 << 20):
                if tally is not None:
                    tally[0] += len(chunk)
                data = inflate.decompress(chunk)
                while inflate.eof and inflate.unused_data:  # concatenated gzip members
                    tail = inflate.unused_data
                    inflate = zlib.decompressobj(wbits=31)
                    data += inflate.decompress(tail)
                lines = (rest + data).split(b"\n")
                rest = lines.pop()
                for raw in lines:
                    lineno += 1
                    yield lineno, raw
        except zlib.error as exc:
            raise _TruncatedError(f"{path} line {lineno + 1}: compressed stream is corrupt ({exc})") from None
    if not inflate.eof:
        raise _TruncatedError(f"{path} line {lineno + 1}: compressed stream ends early")
    if rest:
        yield lineno + 1, rest


_READ_BUFFER_BYTES = 1 << 20
"""Read buffer of plain files: lines of several KiB read through the default 8 KiB buffer cost ~3x more CPU."""


def _plain_lines(path: Path, span: tuple[int, int] | None, tally: list[int] | None) -> Iterator[tuple[int, bytes]]:
    with path.open("rb", buffering=_READ_BUFFER_BYTES) as f:
        if span is None:
            if tally is None:
                yield from enumerate(f, 1)
                return
            for lineno, raw in enumerate(f, 1):
                tally[0] += len(raw)
                yield lineno, raw
            return
        f.seek(span[0])
        left = span[1] - span[0]
        for lineno, raw in enumerate(f, 1):
            if tally is not None:
                tally[0] += len(raw)
            yield lineno, raw
            left -= len(raw)
            if left <= 0:
                return


_BATCH_LINES = 64
"""Lines handed on together (the columnar builder turns a batch into numpy columns at once): few enough that the
batch's decoded objects are still in the CPU cache when they are read again, enough to spread numpy's per-call cost
(measured: 64 and 128 lines are ~10% faster than 512)."""


def _decoded(
    path: Path,
    allow_partial: bool,  # noqa: FBT001
    notes: list[Note],
) -> Iterator[tuple[int, Any]]:
    """(line number, decoded JSON) of every non-blank line of ``path``, with :func:`_raw_batches`' rules."""
    for batch, final in _raw_batches(path, allow_partial, notes):
        linenos, objs = _decode_batch(path, batch, final=final, allow_partial=allow_partial, notes=notes)
        yield from zip(linenos, objs, strict=True)


def _raw_batches(
    path: Path,
    allow_partial: bool,  # noqa: FBT001
    notes: list[Note],
    *,
    span: tuple[int, int] | None = None,
    last: bool = True,
    counted: list[int] | None = None,
    tally: list[int] | None = None,
) -> Iterator[tuple[list[tuple[int, bytes]], bool]]:
    """Non-blank lines, a batch of (line number, raw line) at a time, each with whether it holds the file's last line.

    Whoever decodes a batch passes that flag to :func:`_decode_batch`, which applies the truncation rules: a bad
    final line of a file (``last``: this span ends the file) is "truncated": skipped and noted under
    ``allow_partial``, else an error; a bad line anywhere else is an error naming it. A compressed stream that ends
    early ends the batches with a ``ParseError`` (or a note under ``allow_partial``) after the lines before it.
    ``counted`` receives the number of physical lines read; ``tally[0]`` grows by the bytes read (see
    :func:`_lines`).
    """
    held: list[tuple[int, bytes]] = []  # a full batch waits until we know whether more lines follow
    batch: list[tuple[int, bytes]] = []
    lineno = 0
    try:
        for lineno, raw in _lines(path, span, tally):
            if not raw or raw.isspace():
                continue
            if held:
                yield held, False
                held = []
            batch.append((lineno, raw))
            if len(batch) == _BATCH_LINES:
                held, batch = batch, []
    except _TruncatedError as exc:
        if held or batch:
            yield held + batch, False
        if not allow_partial:
            raise ParseError(
                f"{exc}; pass allow_partial=True to keep the lines before it", code=ParseCode.TRUNCATED
            ) from None
        notes.append(Note(code="truncated_file", count=1, message=f"{exc}; lines before it kept"))
        return
    if counted is not None:
        counted.append(lineno)
    if held or batch:
        yield held + batch, last


def _decode_batch(
    path: Path | str, batch: list[tuple[int, bytes]], *, final: bool, allow_partial: bool, notes: list[Note]
) -> tuple[list[int], list[Any]]:
    """Line numbers and values of a batch; one ``json.loads`` per line (measured faster than one per batch)."""
    linenos = [n for n, _ in batch]
    try:
        return linenos, list(map(json.loads, [raw for _, raw in batch]))
    except ValueError:
        pass  # some line is bad: find it, line by line
    objs: list[Any] = []
    for i, (lineno, raw) in enumerate(batch):
        try:
            objs.append(json.loads(raw))
        except ValueError as exc:
            if not (final and i == len(batch) - 1):
                raise ParseError(
                    f"{path} line {lineno}: not valid JSON ({exc}): {raw[:80]!r}; every line must be one JSON object",
                    code=ParseCode.BAD_JSON,
                ) from None
            if not allow_partial:
                raise ParseError(
                    f"{path} line {lineno}: the last line is truncated or corrupt ({exc}): {raw[:80]!r}; pass "
                    f"allow_partial=True to skip it",
                    code=ParseCode.TRUNCATED,
                ) from None
            notes.append(
                Note(
                    code="truncated_line", count=1, message=f"{path} line {lineno}: truncated last line skipped ({exc})"
                )
            )
            return linenos[:i], objs
    return linenos, objs

"""Following a set of log files as their writers grow, rotate, truncate and delete them: whole lines out, bounded.

Exists because NCCL writes one debug file per process (``NCCL_DEBUG_FILE=/dir/nccl.%h.%p``, ``src/debug.cc``) and
Inspector one JSON file per process, all while the sidecar reads them: files appear as processes start, grow line by
line, are rotated (renamed and recreated: a new inode at the same path), truncated in place (``> file``) or deleted.
The follower hands out complete lines only, keeps a partial last line until its newline (bounded), reads at most a
byte budget per poll and a bounded number of files, and counts everything it had to skip. It must not parse lines
and must not raise: an unreadable file is counted and retried on the next poll.
"""

from __future__ import annotations

import contextlib
import glob
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence


@dataclass(slots=True)
class FollowStats:
    """What the follower saw and skipped, running totals."""

    files_opened: int = 0
    """Files opened (a rotated file counts again)."""
    rotations: int = 0
    """Paths whose inode changed (the old file was read to its end first, within the budget)."""
    truncations: int = 0
    """Files that became shorter than the offset read (read again from the start)."""
    deletions: int = 0
    """Files that disappeared (read to their end first, within the budget)."""
    files_over_cap: int = 0
    """Files not followed because ``max_files`` were followed already (counted once per path)."""
    partial_lines: int = 0
    """Partial last lines lost: the file was truncated, rotated or deleted before their newline."""
    overlong_lines: int = 0
    """Lines longer than ``max_line_bytes``, dropped (up to their newline)."""
    read_errors: int = 0
    """Failed ``open``/``read``/``stat`` calls (retried on the next poll)."""
    bytes_read: int = 0
    """Bytes read."""
    lines: int = 0
    """Complete lines handed out."""
    last_error: str | None = None
    """The latest problem, in words."""


@dataclass(slots=True)
class _Followed:
    path: str
    fd: int
    ident: tuple[int, int]
    offset: int = 0
    pending: bytearray = field(default_factory=bytearray)
    skipping: bool = False  # inside an overlong line: drop bytes until the next newline


def _is_pattern(text: str) -> bool:
    return any(c in text for c in "*?[")


class LogFollower:
    """Follows the files named by some paths: directories (every regular file in them), globs or plain files."""

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        *,
        max_files: int = 256,
        max_line_bytes: int = 64 * 1024,
        chunk_bytes: int = 1024 * 1024,
    ) -> None:
        """Set up; opens nothing until :meth:`poll`.

        Args:
            paths: a directory, a glob (``/logs/nccl.*``) or a file, or several.
            max_files: most files followed at once (default 256: one per process of a node, with room).
            max_line_bytes: longest line kept (default 64 KiB; NCCL's are at most 1024 bytes).
            chunk_bytes: most bytes read from one file in one read call (default 1 MiB).
        """
        self.paths = [str(paths)] if isinstance(paths, str | Path) else [str(p) for p in paths]
        self.max_files = max_files
        self.max_line_bytes = max_line_bytes
        self.chunk_bytes = chunk_bytes
        self.stats = FollowStats()
        self._files: dict[str, _Followed] = {}
        self._over_cap: set[str] = set()
        self._turn = 0
        # (device, inode) -> (offset read, first bytes), of files rotated or renamed away: one that shows up again
        # under its new name (nccl.h.p -> nccl.h.p.1 in a followed directory) is read on from there, not twice. The
        # first bytes tell it from a new file that got a freed inode.
        self._rotated: dict[tuple[int, int], tuple[int, bytes]] = {}

    @property
    def files(self) -> list[str]:
        """Paths followed now."""
        return list(self._files)

    def _discover(self) -> list[str]:
        found: list[str] = []
        for spec in self.paths:
            try:
                if _is_pattern(spec):
                    found.extend(sorted(p for p in glob.glob(spec) if os.path.isfile(p)))  # noqa: PTH207, PTH113 - str paths throughout
                elif os.path.isdir(spec):  # noqa: PTH112
                    with os.scandir(spec) as entries:
                        found.extend(sorted(e.path for e in entries if e.is_file()))
                elif os.path.isfile(spec):  # noqa: PTH113
                    found.append(spec)
            except OSError as exc:
                self._error(f"listing {spec}: {exc}")
        return found

    def _error(self, text: str) -> None:
        self.stats.read_errors += 1
        self.stats.last_error = text

    def poll(self, budget_bytes: int) -> list[bytes]:
        """Read what is new, at most ``budget_bytes`` in all, shared out over the files in turn.

        Returns:
            Complete lines (without their newline), in file order, file by file.
        """
        for path in self._discover():
            if path in self._files or path in self._over_cap:
                continue
            if len(self._files) >= self.max_files:
                self._over_cap.add(path)
                self.stats.files_over_cap += 1
                if len(self._over_cap) > 4 * self.max_files:
                    self._over_cap.clear()
                continue
            self._open(path)
        lines: list[bytes] = []
        paths = list(self._files)
        if not paths:
            return lines
        self._turn = (self._turn + 1) % len(paths)
        order = paths[self._turn :] + paths[: self._turn]
        left = budget_bytes
        for i, path in enumerate(order):
            share = max(1, left // (len(order) - i))  # fair share of what is left; unused shares roll on
            left -= self._poll_file(self._files[path], share, lines)
            if left <= 0:
                break
        return lines

    def _open(self, path: str) -> _Followed | None:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            st = os.fstat(fd)
        except OSError as exc:
            self._error(f"opening {path}: {exc}")
            return None
        ident = (st.st_dev, st.st_ino)
        if any(f.ident == ident for f in self._files.values()):  # followed under its old name until that is gone
            os.close(fd)
            return None
        offset, head = self._rotated.pop(ident, (0, b""))
        if offset and os.pread(fd, len(head), 0) != head:
            offset = 0
        followed = _Followed(path=path, fd=fd, ident=ident, offset=offset)
        self._files[path] = followed
        self.stats.files_opened += 1
        return followed

    def _close(self, f: _Followed) -> None:
        if f.pending:
            self.stats.partial_lines += 1
        with contextlib.suppress(OSError):  # closing our own descriptor
            os.close(f.fd)
        self._files.pop(f.path, None)

    def _remember(self, f: _Followed) -> None:
        """Keep where ``f`` was read to, in case it shows up under another name."""
        if len(self._rotated) >= 4 * self.max_files:
            self._rotated.pop(next(iter(self._rotated)))
        try:
            head = os.pread(f.fd, 64, 0)
        except OSError:
            return
        self._rotated[f.ident] = (f.offset - len(f.pending), head)  # a partial last line is read again there

    def _poll_file(self, f: _Followed, budget: int, lines: list[bytes]) -> int:
        """Read up to ``budget`` bytes of one file, handling rotation, truncation and deletion; bytes read."""
        try:
            st = os.stat(f.path)  # noqa: PTH116 - str paths throughout
        except FileNotFoundError:
            used = self._read(f, budget, lines)  # the open descriptor still reads the deleted (or renamed) file
            self.stats.deletions += 1
            self._remember(f)
            self._close(f)
            return used
        except OSError as exc:
            self._error(f"stat {f.path}: {exc}")
            return 0
        if (st.st_dev, st.st_ino) != f.ident:
            used = self._read(f, budget, lines)
            self.stats.rotations += 1
            self._remember(f)
            self._close(f)
            new = self._open(f.path)
            return used + (self._read(new, budget - used, lines) if new is not None and budget > used else 0)
        if st.st_size < f.offset:
            self.stats.truncations += 1
            if f.pending:
                self.stats.partial_lines += 1
            f.pending.clear()
            f.skipping = False
            f.offset = 0
        return self._read(f, budget, lines)

    def _read(self, f: _Followed, budget: int, lines: list[bytes]) -> int:
        used = 0
        while used < budget:
            try:
                chunk = os.pread(f.fd, min(self.chunk_bytes, budget - used), f.offset)
            except OSError as exc:
                self._error(f"reading {f.path}: {exc}")
                break
            if not chunk:
                break
            used += len(chunk)
            f.offset += len(chunk)
            self._split(f, chunk, lines)
        self.stats.bytes_read += used
        return used

    def _split(self, f: _Followed, chunk: bytes, lines: list[bytes]) -> None:
        before = len(lines)
        parts = chunk.split(b"\n")
        last = parts.pop()
        for part in parts:
            if f.skipping:  # the end of an overlong line
                f.skipping = False
                continue
            if f.pending:
                f.pending += part
                line = bytes(f.pending)
                f.pending.clear()
            else:
                line = part
            if len(line) > self.max_line_bytes:
                self.stats.overlong_lines += 1
                continue
            lines.append(line)
        self.stats.lines += len(lines) - before
        if f.skipping:
            return
        f.pending += last
        if len(f.pending) > self.max_line_bytes:
            self.stats.overlong_lines += 1
            f.pending.clear()
            f.skipping = True

    def close(self) -> None:
        """Close every file; idempotent."""
        for f in list(self._files.values()):
            with contextlib.suppress(OSError):  # closing our own descriptor
                os.close(f.fd)
        self._files.clear()

"""Every rank's stderr, passed through to the terminal as it comes, with its tail kept to explain a failure.

Why it exists: a rank that dies before its tracker starts (a wrong interpreter, a missing module) leaves nothing
but its stderr, and eight interleaved tracebacks say little. :class:`StderrTails` reads one pipe per rank on one
thread, writes every byte through to meshscope's own stderr unchanged, and keeps the last :data:`TAIL_BYTES` of each
rank; :func:`fix_for` names the likely fix for what a tail says. It must never block a rank for long (it reads as soon
as a pipe is readable) and never import torch.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import threading
import time

TAIL_BYTES = 64 * 1024
"""Bytes of each rank's stderr kept in memory (and written to ``OUT/ranks/rank-N.stderr``)."""
SHOWN_LINES = 20
"""Lines of a failing rank's tail printed at the end of a run."""
SHOWN_BYTES = 4096
"""At most this many bytes of them."""
SHOWN_LINE_CHARS = 300
"""A longer line is cut to its first this many characters (DTensor's sharding errors print every operand's spec on
one line of ~10 kB, which would otherwise push the line that says what failed out of the shown tail)."""
DRAIN_S = 1.0
"""After the ranks exit, how long to wait for the end of their pipes (a daemon grandchild may hold one open)."""


class StderrTails:
    """One pipe per rank: read on a thread, passed through to ``out_fd``, the last :data:`TAIL_BYTES` kept."""

    def __init__(self, nproc: int, *, out_fd: int = 2) -> None:
        """Open the pipes of ``nproc`` ranks; what they write goes through to ``out_fd`` (meshscope's stderr)."""
        self.nproc = nproc
        self._pipes = [os.pipe() for _ in range(nproc)]
        self._tails = [bytearray() for _ in range(nproc)]
        self._out_fd = out_fd
        self._thread: threading.Thread | None = None
        self._stop_at: float | None = None

    def write_fd(self, rank: int) -> int:
        """The write end of ``rank``'s pipe, to become the rank's stderr."""
        return self._pipes[rank][1]

    def launched(self, rank: int) -> None:
        """The rank holds its write end now: close ours (the pipe ends when the rank and its children exit)."""
        r, w = self._pipes[rank]
        if w >= 0:
            os.close(w)
            self._pipes[rank] = (r, -1)

    def close_in_child(self, rank: int) -> None:
        """In forked ``rank``: close every pipe end inherited from the launcher but its own write end."""
        for other, (r, w) in enumerate(self._pipes):
            for fd in (r,) if other == rank else (r, w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def start(self) -> None:
        """Start the reader (after forking: children must not inherit a running thread)."""
        self._thread = threading.Thread(target=self._read, name="meshscope-stderr", daemon=True)
        self._thread.start()

    def stop(self, drain_s: float = DRAIN_S) -> None:
        """Read what is left (until every pipe ends, at most ``drain_s``), then close every pipe."""
        self._stop_at = time.monotonic() + drain_s
        if self._thread is not None:
            self._thread.join()
        for rank in range(len(self._pipes)):
            self.launched(rank)
            with contextlib.suppress(OSError):
                os.close(self._pipes[rank][0])

    def _read(self) -> None:
        with selectors.DefaultSelector() as sel:
            for rank, (r, _) in enumerate(self._pipes):
                sel.register(r, selectors.EVENT_READ, rank)
            while sel.get_map():
                if self._stop_at is not None and time.monotonic() > self._stop_at:
                    return
                for key, _ in sel.select(timeout=0.1):
                    rank = int(key.data)
                    try:
                        chunk = os.read(key.fd, 65536)
                    except OSError:
                        chunk = b""
                    if not chunk:
                        sel.unregister(key.fd)
                        continue
                    with contextlib.suppress(OSError):
                        os.write(self._out_fd, chunk)
                    tail = self._tails[rank]
                    tail += chunk
                    if len(tail) > TAIL_BYTES:
                        del tail[: len(tail) - TAIL_BYTES]

    def tail(self, rank: int) -> str:
        """The kept tail of ``rank``'s stderr, decoded."""
        return bytes(self._tails[rank]).decode(errors="replace")


def shown_tail(
    text: str, *, lines: int = SHOWN_LINES, max_bytes: int = SHOWN_BYTES, line_chars: int = SHOWN_LINE_CHARS
) -> str:
    """The last ``lines`` lines of ``text``, at most ``max_bytes`` of them (cut at a line start).

    Each line is cut to its first ``line_chars`` characters, with how many more it had.
    """
    kept = [
        line if len(line) <= line_chars else f"{line[:line_chars]} ... ({len(line) - line_chars} more characters)"
        for line in text.rstrip("\n").splitlines()[-lines:]
    ]
    shown = "\n".join(kept)
    if len(shown.encode()) > max_bytes:
        shown = shown.encode()[-max_bytes:].decode(errors="replace")
        shown = shown.split("\n", 1)[-1]
    return shown


_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^'.]+)[^']*'")


def fix_for(tail: str, *, python: str | None) -> str | None:
    """The likely fix for a rank whose stderr ends with ``tail``, or ``None`` when it says nothing known.

    Args:
        tail: the end of the rank's stderr.
        python: the interpreter the ranks ran under, ``None`` when the command was not a python one.
    """
    found = _NO_MODULE.findall(tail)
    if not found:
        return _another_world_size(tail) or _spawned_twice(tail) or _terminated_at_exit(tail)
    module = found[-1]
    where = f"the interpreter {python}" if python else "the ranks' interpreter"
    if module == "torch":
        return (
            f"{where} has no torch: install meshscope's demo extra there (pip install 'meshscope[demo]'), "
            "or pass the full path of an interpreter that has torch after '--'"
        )
    if module == "meshscope":
        return (
            f"{where} has no meshscope: install it there, or start the script with 'python' (meshscope's own "
            "interpreter)"
        )
    return f"{where} has no module {module!r}: install it there, or pass the full path of an interpreter that has it"


_WORLD_ASKED = re.compile(r"asks init_process_group for world_size=(\d+)")


def _another_world_size(tail: str) -> str | None:
    """The fix for a script whose process group wants more or fewer ranks than were started."""
    found = _WORLD_ASKED.findall(tail)
    if not found:
        return None
    asked = found[-1]
    return (
        f"the script's process group has {asked} ranks: run it with meshscope run --nproc {asked} (with Lightning, "
        "devices x num_nodes must equal --nproc)"
    )


def _spawned_twice(tail: str) -> str | None:
    """The fix for a script that spawns its own ranks, started as several: their rendezvous ports collide."""
    spawned = "torch.multiprocessing.spawn" in tail or "torch/multiprocessing/spawn.py" in tail
    if not (spawned and ("EADDRINUSE" in tail or "Address already in use" in tail)):
        return None
    return (
        "the script starts its own ranks (torch.multiprocessing.spawn), so each rank meshscope run started spawned "
        "a whole job of its own, on the same port: run it as one process, meshscope run --nproc 1 -- ..., and the "
        "ranks it spawns are recorded with the ranks they pass to init_process_group"
    )


_TERMINATE = "terminate called without an active exception"
"""What the C++ runtime prints before aborting when a ``std::thread`` that still runs is destroyed."""


def _terminated_at_exit(tail: str) -> str | None:
    """The fix for a rank that aborted in C++ (``std::terminate``), as PyTorch's gloo teardown does at exit.

    Seen with PyTorch 2.13 (CPU, gloo): in a process that all-reduced over a gloo group and exited without
    ``destroy_process_group()``, no meshscope imported (3 of 18 runs, 2026-12-06), and in ranks started by
    ``torch.multiprocessing.spawn`` after it, under ``meshscope run`` (tests/scripts/ddp_spawn.py, 4 of 6 runs inside
    the whole test suite). ``meshscope run``'s own ranks end with ``os._exit`` for that reason.
    """
    if _TERMINATE not in tail:
        return None
    return (
        "the rank aborted in C++ (std::terminate: a thread destroyed while it still ran), which PyTorch's gloo "
        "process groups do when they are torn down as a process ends, after its training; the steps it recorded "
        "before are kept and analysed. Call torch.distributed.destroy_process_group() once training ends, and where "
        "it still happens (processes started by torch.multiprocessing.spawn), end each rank with os._exit(0) after "
        "its cleanup, as meshscope run's own ranks do"
    )

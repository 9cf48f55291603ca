"""Fault knobs shared by the third-party-style test scripts: the one thing they add to a script as people write it.

``--straggler RANK:FACTOR`` makes that rank's forward and backward take FACTOR x as long, as a GPU FACTOR x slower
would: after each pass it sleeps (FACTOR - 1) x the pass's own duration (a sleep, not more CPU work, so the slow rank
does not also slow its neighbours on shared cores). ``--busy RANK:FACTOR`` does the same with CPU work: after each
pass that rank spins for (FACTOR - 1) x its duration (host work in the pass: a slow CPU-side op, a metric computed
every step), which on shared cores also takes CPU from the ranks beside it. ``--imbalance RANK:FACTOR`` gives that rank FACTOR x the rows
of every batch (more tokens, more real compute), the way a packed batch of long documents does. ``--pause RANK:MS``
makes that rank sleep MS milliseconds in every step outside any phase (host work no phase covers: a log line, a
metric, a host-device sync between the forward and the backward pass), where the script calls :meth:`Faults.pause`
(once a step, in all three scripts);
with ``--pause-every N``, only in every N-th step (an evaluation or a log flush every N steps: a transient straggler).
``--slow-disk RANK:MS`` makes every batch that rank reads take MS milliseconds more (a slow disk or a starved loader):
the scripts call :meth:`Faults.read` where they read a batch. ``--log-flush RANK:MS`` makes that rank flush a log for
MS milliseconds every ``--log-every`` steps between two steps, after ``tracker.end_step()`` as docs/sdk.md §1.5 lays a
loop out (the DDP tutorial-style script calls :meth:`Faults.flush_log` there).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterator


def rank_factor(text: str, flag: str) -> tuple[int, float] | None:
    """``"3:1.5"`` -> ``(3, 1.5)``; ``""`` -> ``None``."""
    if not text:
        return None
    try:
        rank, factor = text.split(":")
        return int(rank), float(factor)
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: expected RANK:FACTOR, e.g. 1:1.5") from None


def add_fault_arguments(p: argparse.ArgumentParser) -> None:
    """``--straggler`` and ``--imbalance``."""
    p.add_argument("--straggler", default="", help="RANK:FACTOR, that rank's passes take FACTOR x as long")
    p.add_argument("--imbalance", default="", help="RANK:FACTOR, that rank gets FACTOR x the rows of every batch")
    p.add_argument("--pause", default="", help="RANK:MS, that rank sleeps MS ms a step outside its phases")
    p.add_argument("--busy", default="", help="RANK:FACTOR, that rank's passes take FACTOR x as long, spinning")
    p.add_argument("--pause-every", type=int, default=1, help="N: --pause in every N-th step only (from the N-th)")
    p.add_argument("--slow-disk", default="", help="RANK:MS, every batch that rank reads takes MS ms more")
    p.add_argument("--log-flush", default="", help="RANK:MS, that rank flushes a log for MS ms between steps")
    p.add_argument("--log-every", type=int, default=1, help="N: --log-flush after every N-th step only")


class Faults:
    """What this rank injects."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        straggler = rank_factor(args.straggler, "--straggler")
        imbalance = rank_factor(args.imbalance, "--imbalance")
        self.slow = straggler[1] if straggler and straggler[0] == rank else 1.0
        busy = rank_factor(args.busy, "--busy")
        self.busy = busy[1] if busy and busy[0] == rank else 1.0
        self.rows = imbalance[1] if imbalance and imbalance[0] == rank else 1.0
        pause = rank_factor(args.pause, "--pause")
        self.pause_s = pause[1] / 1e3 if pause and pause[0] == rank else 0.0
        self.pause_every = max(1, args.pause_every)
        disk = rank_factor(args.slow_disk, "--slow-disk")
        self.read_s = disk[1] / 1e3 if disk and disk[0] == rank else 0.0
        flush = rank_factor(args.log_flush, "--log-flush")
        self.logs_between_steps = flush is not None  # every rank's loop ends its steps alike
        self.flush_s = flush[1] / 1e3 if flush and flush[0] == rank else 0.0
        self.log_every = max(1, args.log_every)
        self._pauses = self._flushes = 0

    def batch(self, rows: int) -> int:
        """This rank's rows for a batch of ``rows``."""
        return max(1, round(rows * self.rows))

    @contextmanager
    def slowed(self) -> Iterator[None]:
        """Stretch the pass inside to ``slow`` x its duration."""
        t0 = time.perf_counter()
        yield
        if self.slow > 1.0:
            time.sleep((self.slow - 1.0) * (time.perf_counter() - t0))
        if self.busy > 1.0:
            t1 = time.perf_counter()
            until = t1 + (self.busy - 1.0) * (t1 - t0)
            while time.perf_counter() < until:
                pass

    def pause(self) -> None:
        """Sleep this rank's ``--pause`` (outside any phase, where the script calls it once a step)."""
        self._pauses += 1
        if self.pause_s > 0 and self._pauses % self.pause_every == 0:
            time.sleep(self.pause_s)

    def flush_log(self) -> None:
        """Sleep this rank's ``--log-flush`` after every ``--log-every``-th step (where the script calls it, between
        steps)."""
        self._flushes += 1
        if self.flush_s > 0 and self._flushes % self.log_every == 0:
            time.sleep(self.flush_s)

    def read(self) -> None:
        """Sleep this rank's ``--slow-disk`` (where the script reads a batch)."""
        if self.read_s > 0:
            time.sleep(self.read_s)

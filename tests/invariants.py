"""Invariants that every record of a real job must keep, checked on the raw JSON lines the collector wrote.

Why it exists: the breakdown trusts the SDK on one point above all (DESIGN.md, "The step breakdown"): exposed comm is a
collective running while no compute runs, so time a rank spends *waiting* for a collective must never sit inside a
compute (or optimizer) interval, or waiting is counted as compute. And a step that stepped the optimizer must say so;
every step carries the training thread's wait for a CPU and its time on one, which together fit in the step.
Real-job tests (forked gloo ranks, ``meshscope run``) call :func:`check_records_file` on everything they collected.

What "waiting" is comes from the record itself: a ``comm`` or ``p2p`` interval's ``wait_us`` (``docs/records.md``) is
how long the rank was blocked on it at its end -- the whole call for a synchronous collective, from ``Work.wait`` /
``wait_tensor`` to completion for an asynchronous one, the reducer's wait at the end of backward for DDP's buckets.
A collective that runs in the background (never waited on, or done before its wait) has no waiting part and may
overlap compute by design.

The intervals are read from the raw lines on purpose: the record parser drops fields it does not know.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable
    from pathlib import Path

BUSY_KINDS = frozenset({"compute", "optimizer"})
"""Interval kinds the SDK cuts blocked windows out of."""
NET_KINDS = frozenset({"comm", "p2p"})
MAX_SHOWN = 8
RUNQUEUE_SLACK_US = 10_000
"""The kernel updates a thread's run delay when it is switched in, its time on a CPU at ticks and switches: a read
may lag by about one scheduler tick."""


def record_violations(record: dict[str, Any], *, every_step: Iterable[str] = ()) -> list[str]:
    """What is wrong with one record (empty: nothing).

    Args:
        record: one decoded record line.
        every_step: interval kinds the job produces in every step (e.g. ``optimizer`` for a job that steps its
            optimizer every step): each must appear at least once.
    """
    where = f"rank {record['rank']} step {record['step']}"
    intervals = record["intervals"]
    busy = sorted(
        (iv["start_us"], iv["end_us"], iv["kind"], iv.get("phase")) for iv in intervals if iv["kind"] in BUSY_KINDS
    )
    problems = []
    for iv in intervals:
        if iv["kind"] not in NET_KINDS or "wait_us" not in iv:
            continue
        wait = iv["wait_us"]
        name = f"{iv['axis']} {iv['op']} {iv['group']}#{iv['seq']} [{iv['start_us']}, {iv['end_us']}]"
        if not 0 <= wait <= iv["end_us"] - iv["start_us"]:
            problems.append(f"{where}: {name} waits {wait} us, outside the interval")
            continue
        w0, w1 = iv["end_us"] - wait, iv["end_us"]
        for b0, b1, kind, phase in busy:
            overlap = min(b1, w1) - max(b0, w0)
            if overlap > 0:
                label = kind if phase is None else f"{kind} ({phase})"
                problems.append(
                    f"{where}: {name} waits [{w0}, {w1}] but {label} [{b0}, {b1}] overlaps it by {overlap} us: "
                    "waiting counted as compute"
                )
    kinds = {iv["kind"] for iv in intervals}
    problems.extend(f"{where}: no {kind} interval" for kind in every_step if kind not in kinds)
    # The training thread's wait for a CPU and time on one (Linux schedstat) are measured on every step, within it:
    # a thread cannot run and wait for a CPU at once.
    span = record["end_us"] - record["start_us"]
    sched = {name: record.get(name) for name in ("runqueue_wait_us", "on_cpu_us")}
    for name, value in sched.items():
        if value is None:
            problems.append(f"{where}: no {name} (the thread's schedstat is readable on Linux)")
        elif not 0 <= value <= span + RUNQUEUE_SLACK_US:
            problems.append(f"{where}: {name} = {value} outside the step's {span} us")
    if None not in sched.values() and sum(sched.values()) > span + 2 * RUNQUEUE_SLACK_US:
        problems.append(f"{where}: runqueue_wait_us + on_cpu_us = {sum(sched.values())} exceed the step's {span} us")
    return problems


def check_records(records: Iterable[dict[str, Any]], *, every_step: Iterable[str] = ()) -> int:
    """Check every record (:func:`record_violations`); returns how many were checked.

    Raises:
        AssertionError: listing the first violations and how many there were.
    """
    kinds = tuple(every_step)
    problems: list[str] = []
    n = 0
    for record in records:
        n += 1
        problems.extend(record_violations(record, every_step=kinds))
    if problems:
        shown = "\n  ".join(problems[:MAX_SHOWN])
        more = f"\n  ... and {len(problems) - MAX_SHOWN} more" if len(problems) > MAX_SHOWN else ""
        raise AssertionError(f"{len(problems)} record invariant violations in {n} records:\n  {shown}{more}")
    return n


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file as decoded objects (blank lines and a truncated last line skipped)."""
    out = []
    lines = path.read_text().splitlines() if path.exists() else []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:  # only a writer killed mid-line may leave a broken (last) line
                raise
    return out


def check_records_file(path: Path, *, every_step: Iterable[str] = ()) -> int:
    """:func:`check_records` on every record of ``path`` (a missing file holds none); returns how many."""
    return check_records(read_lines(path), every_step=every_step)

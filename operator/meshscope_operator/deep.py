"""The deep tier: one window of step records pulled from every sidecar, analysed by the core, off the event loop.

Exists because the split of exposed communication into transfer and sync wait, the late rank and the findings need
the records of every member of every group (DESIGN.md, "Operator"), which no sidecar and no recording rule has. One
analysis:

1. finds the TrainingJob's pods through the API (label ``meshscope.io/trainingjob=NAME``) and each one's IP
   (:func:`targets_of`);
2. asks every sidecar's ``GET /v1/steps?since_step=S&limit=W`` (:func:`pull_window`) with bounded concurrency, a
   timeout per request, a byte cap per pod and one in total (reserved before each request, so the total is never
   exceeded however many run at once); a pod that is not running, has no IP, does not answer or answers an error
   is a partial-data note, never a failure;
3. keeps the steps every answering pod returned (the window), and runs the core's :func:`meshscope.analysis.analyze`
   with the job's spec on them in a worker thread (:func:`analyse_window`), so kopf's loop stays responsive; the
   result is ``Analysis.to_dict()`` and its JSON, already cut to the ConfigMap's budget.

It must not write status or ConfigMaps (:mod:`~meshscope_operator.tiers` does), must not keep records past one
analysis, and must not import kopf.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec

from meshscope.analysis import analyze
from meshscope.errors import ParseError
from meshscope.records import Note, table_from_lines
from meshscope_operator.costs import encode_analysis

if TYPE_CHECKING:
    from collections.abc import Sequence

    from meshscope.jobs import JobSpec

JOB_LABEL = "meshscope.io/trainingjob"
"""The label on every pod of a TrainingJob (the operator's Jobs set it; the pod webhook injects on it)."""
MAX_NAMED = 5
"""Pods named in one note, at most (the count says how many)."""


class _Step(msgspec.Struct, gc=False):
    step: int


_decode_step = msgspec.json.Decoder(_Step).decode


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """One sidecar to ask: its pod and the base URL of its HTTP server."""

    pod: str
    url: str


@dataclass(slots=True, kw_only=True)
class Pulled:
    """What the sidecars answered, and what they did not."""

    lines: list[bytes] = field(default_factory=list)
    """Record lines of the window, every answering pod's."""
    notes: list[Note] = field(default_factory=list)
    """Partial data: pods missing, unreachable, cut, steps left out."""
    pods_answered: int = 0
    bytes_read: int = 0
    last_step: int | None = None
    """Newest step of the window (the next analysis asks for steps after it)."""


def _named(pods: Sequence[str]) -> str:
    shown = ", ".join(pods[:MAX_NAMED])
    return shown + (f" and {len(pods) - MAX_NAMED} more" if len(pods) > MAX_NAMED else "")


def targets_of(pods: Sequence[dict[str, Any]], *, port: int) -> tuple[list[Target], list[Note]]:
    """The sidecars of ``pods`` that can be asked (running, with an IP), and a note for those that cannot."""
    targets, waiting = [], []
    for pod in sorted(pods, key=lambda p: str(p.get("metadata", {}).get("name", ""))):
        name = str(pod.get("metadata", {}).get("name", "?"))
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if status.get("phase") == "Running" and isinstance(ip, str) and ip:
            host = f"[{ip}]" if ":" in ip else ip
            targets.append(Target(pod=name, url=f"http://{host}:{port}"))
        else:
            waiting.append(name)
    notes = []
    if waiting:
        notes.append(
            Note(
                code="pods_not_running",
                count=len(waiting),
                message=f"{len(waiting)} pods are not running or have no IP yet, their ranks are missing: "
                f"{_named(waiting)}",
            )
        )
    return targets, notes


def expected_pods_note(found: int, spec: JobSpec | None) -> Note | None:
    """A note when fewer pods carry the job's label than the spec has nodes."""
    if spec is None or found >= spec.hardware.nodes:
        return None
    return Note(
        code="pods_missing",
        count=spec.hardware.nodes - found,
        message=f"{found} of the spec's {spec.hardware.nodes} pods (one per node) carry {JOB_LABEL}; the ranks of "
        f"the other {spec.hardware.nodes - found} are missing",
    )


async def _pull_one(
    session: aiohttp.ClientSession, target: Target, *, query: dict[str, str], allowance: int, timeout_s: float
) -> tuple[bytes, bool]:
    """The pod's answer (at most ``allowance`` bytes, cut at a whole line) and whether it was cut."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(target.url + "/v1/steps", params=query, timeout=timeout) as response:
        if response.status != 200:
            text = (await response.content.read(300)).decode(errors="replace")
            raise aiohttp.ClientResponseError(
                response.request_info, (), status=response.status, message=text.strip()[:200]
            )
        raw = await response.content.read(allowance + 1)
    if len(raw) <= allowance:
        return raw, False
    return raw[: raw.rfind(b"\n", 0, allowance) + 1], True


async def pull_window(
    session: aiohttp.ClientSession,
    targets: Sequence[Target],
    *,
    since_step: int,
    window_steps: int,
    pod_max_bytes: int,
    total_max_bytes: int,
    timeout_s: float,
    concurrency: int,
) -> Pulled:
    """Ask every sidecar for ``window_steps`` steps after ``since_step``; keep the steps all answering pods have.

    Never raises for a pod: each failure is counted in a note (its pod named).
    """
    query = {"since_step": str(since_step), "limit": str(window_steps)}
    gate = asyncio.Semaphore(concurrency)
    budget = {"left": total_max_bytes}
    answers: dict[str, bytes] = {}
    failed: dict[str, str] = {}
    cut: list[str] = []
    over_budget: list[str] = []

    async def one(target: Target) -> None:
        async with gate:
            allowance = min(pod_max_bytes, budget["left"])
            if allowance <= 0:
                over_budget.append(target.pod)
                return
            budget["left"] -= allowance
            used = 0
            try:
                raw, was_cut = await _pull_one(session, target, query=query, allowance=allowance, timeout_s=timeout_s)
                used = len(raw)
                answers[target.pod] = raw
                if was_cut:
                    cut.append(target.pod)
            except TimeoutError:
                failed[target.pod] = f"no answer within {timeout_s:g} s"
            except aiohttp.ClientResponseError as exc:
                failed[target.pod] = f"HTTP {exc.status} {exc.message}"
            except (aiohttp.ClientError, OSError) as exc:
                failed[target.pod] = type(exc).__name__ + (f": {exc}" if str(exc) else "")
            finally:
                budget["left"] += allowance - used

    await asyncio.gather(*(one(t) for t in targets))
    pulled = Pulled(pods_answered=len(answers), bytes_read=sum(len(r) for r in answers.values()))
    if failed:
        first = sorted(failed)
        pulled.notes.append(
            Note(
                code="sidecars_unreachable",
                count=len(failed),
                message=f"{len(failed)} of {len(targets)} sidecars did not answer /v1/steps, their ranks are missing: "
                + "; ".join(f"{p} ({failed[p][:120]})" for p in first[:MAX_NAMED])
                + (f" and {len(first) - MAX_NAMED} more" if len(first) > MAX_NAMED else ""),
            )
        )
    if cut:
        pulled.notes.append(
            Note(
                code="sidecar_answer_cut",
                count=len(cut),
                message=f"{len(cut)} sidecars' answers were cut at {pod_max_bytes:,} bytes per pod or the "
                f"{total_max_bytes:,}-byte total: {_named(sorted(cut))}",
            )
        )
    if over_budget:
        pulled.notes.append(
            Note(
                code="records_over_budget",
                count=len(over_budget),
                message=f"{len(over_budget)} sidecars were not asked: the {total_max_bytes:,} bytes of one analysis "
                f"were spent: {_named(sorted(over_budget))}",
            )
        )
    _keep_common_steps(pulled, answers)
    return pulled


def _stepped(raw: bytes) -> tuple[list[tuple[int, bytes]], int]:
    """Each line of ``raw`` with its step number, and how many lines had none."""
    lines, unreadable = [], 0
    for line in raw.splitlines(keepends=True):
        if not line.strip():
            continue
        try:
            lines.append((_decode_step(line).step, line))
        except (msgspec.DecodeError, msgspec.ValidationError):
            unreadable += 1
    return lines, unreadable


def _keep_common_steps(pulled: Pulled, answers: dict[str, bytes]) -> None:
    """Keep the lines of the steps every answering pod returned (all steps when they share none)."""
    lines_of: dict[str, list[tuple[int, bytes]]] = {}
    unreadable = 0
    for pod, raw in answers.items():
        lines_of[pod], bad = _stepped(raw)
        unreadable += bad
    step_sets = [{s for s, _ in lines} for lines in lines_of.values() if lines]
    if not step_sets:
        return
    common = set.intersection(*step_sets)
    window = common or set.union(*step_sets)
    left_out = 0
    for lines in lines_of.values():
        for step, line in lines:
            if step in window:
                pulled.lines.append(line)
            else:
                left_out += 1
    pulled.last_step = max(window)
    if left_out:
        pulled.notes.append(
            Note(
                code="steps_outside_window",
                count=left_out,
                message=f"{left_out} records of steps not every sidecar still had were left out; the window is steps "
                f"{min(window)}-{max(window)}",
            )
        )
    if unreadable:
        pulled.notes.append(
            Note(code="unreadable_records", count=unreadable, message=f"{unreadable} lines had no step number")
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """One analysis, ready to write: the dict for status, and the JSON for the ConfigMap."""

    analysis: dict[str, Any]
    json: str
    planner_findings: list[dict[str, str]] = field(default_factory=list)
    """The plan's findings (``{code, severity, message}``), empty without a spec."""


def analyse_window(lines: list[bytes], *, spec: JobSpec | None, notes: Sequence[Note]) -> Result:
    """Build the table of ``lines`` and run :func:`meshscope.analysis.analyze` (blocking: call it in a thread).

    ``lines`` is consumed: emptied once the table is built, so that the records' JSON (as large as the table) is
    not held while the analysis runs.

    A pod whose records spoil the table (one bad line fails the whole table) is not needed to find: the table is
    built from all lines first, and only when that fails line by line, leaving the bad lines out with a note.

    Raises:
        ParseError: no line is a valid record, or the records do not fit the spec's layout.
        PlanError: the spec cannot be planned.
    """
    try:
        table = table_from_lines(lines, where="sidecars")
    except ParseError as exc:
        good = []
        for line in lines:
            with contextlib.suppress(ParseError):
                table_from_lines([line], where="sidecars")
                good.append(line)
        first = str(exc).splitlines()[0][:300]
        notes = [
            *notes,
            Note(
                code="invalid_records",
                count=len(lines) - len(good),
                message=f"{len(lines) - len(good)} records were left out as invalid (first: {first})",
            ),
        ]
        table = table_from_lines(good, where="sidecars")
        good.clear()
    lines.clear()
    done = analyze(table, spec=spec, notes=notes)
    analysis = done.to_dict()
    planner = [f.to_dict() for f in done.plan.findings] if done.plan is not None else []
    return Result(analysis=analysis, json=encode_analysis(analysis), planner_findings=planner)

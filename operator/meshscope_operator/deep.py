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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec

from meshscope.analysis import analyze
from meshscope.errors import ParseError
from meshscope.records import (
    CUT_HEADER,
    PACKED_MEDIA_TYPE,
    Note,
    RecordColumns,
    columns_from_lines,
    packed_steps,
    table_from_columns,
    table_from_lines,
    unpack_columns,
)
from meshscope_operator.bodies import read_at_most
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
class PodRecords:
    """One sidecar's records of the window: packed columns, or (from a sidecar that does not pack) JSON lines."""

    pod: str
    packed: bytes | None = None
    """Its ``meshscope.columns/4`` answer (every step it sent; the window is cut out when it is unpacked)."""
    lines: list[bytes] = field(default_factory=list)
    """Its JSON lines of the window's steps."""


@dataclass(slots=True, kw_only=True)
class Pulled:
    """What the sidecars answered, and what they did not."""

    records: list[PodRecords] = field(default_factory=list)
    """Every answering pod's records of the window."""
    window: frozenset[int] = frozenset()
    """The steps analysed: those every answering pod returned (all when they share none)."""
    notes: list[Note] = field(default_factory=list)
    """Partial data: pods missing, unreachable, cut, steps left out."""
    pods_answered: int = 0
    bytes_read: int = 0
    last_step: int | None = None
    """Newest step of the window (the next analysis asks for steps after it)."""


def window_steps(configured: int, *, max_rank_steps: int, world_size: int | None) -> int:
    """Steps per window: ``configured``, or fewer (at least one) where they would exceed ``max_rank_steps``.

    ``configured`` where the job's size is not known (a spec that does not load).
    """
    if world_size is None or world_size < 1:
        return configured
    return max(1, min(configured, max_rank_steps // world_size))


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


_ACCEPT = f"{PACKED_MEDIA_TYPE}, application/x-ndjson;q=0.5"
"""Packed columns first; a sidecar that does not pack answers JSON lines."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Answer:
    body: bytes
    packed: bool
    cut: bool


async def _pull_one(
    session: aiohttp.ClientSession, target: Target, *, query: dict[str, str], allowance: int, timeout_s: float
) -> _Answer:
    """The pod's answer: at most ``allowance`` bytes, JSON lines cut at a whole line (a cut pack is no use: empty)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    params = {**query, "max_bytes": str(allowance)}
    async with session.get(
        target.url + "/v1/steps", params=params, timeout=timeout, headers={"Accept": _ACCEPT}
    ) as response:
        if response.status != 200:
            text = (await read_at_most(response.content, 300)).decode(errors="replace")
            raise aiohttp.ClientResponseError(
                response.request_info, (), status=response.status, message=text.strip()[:200]
            )
        packed = response.content_type == PACKED_MEDIA_TYPE
        trimmed = CUT_HEADER in response.headers  # the sidecar kept to max_bytes by leaving records out
        raw = await read_at_most(response.content, allowance + 1)
    if len(raw) <= allowance:
        return _Answer(body=raw, packed=packed, cut=trimmed)
    return _Answer(body=b"" if packed else raw[: raw.rfind(b"\n", 0, allowance) + 1], packed=packed, cut=True)


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
    answers: dict[str, _Answer] = {}
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
                answer = await _pull_one(session, target, query=query, allowance=allowance, timeout_s=timeout_s)
                used = len(answer.body)
                answers[target.pod] = answer
                if answer.cut:
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
    pulled = Pulled(pods_answered=len(answers), bytes_read=sum(len(a.body) for a in answers.values()))
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
                f"{total_max_bytes:,}-byte total (a cut answer of packed columns is left out whole): "
                f"{_named(sorted(cut))}",
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


def _steps_of(
    answers: dict[str, _Answer],
) -> tuple[dict[str, list[tuple[int, bytes]]], dict[str, frozenset[int]], int, list[str]]:
    """What each answer holds, read without decoding the records.

    Returns: per pod, its JSON lines with their steps (JSON answers only) and the steps it holds; the lines without
    a step number; the pods whose packed header does not read.
    """
    lines_of: dict[str, list[tuple[int, bytes]]] = {}
    steps_of: dict[str, frozenset[int]] = {}
    unreadable = 0
    unreadable_pods: list[str] = []
    for pod, answer in answers.items():
        if answer.packed:
            if answer.body:
                try:
                    steps_of[pod] = packed_steps(answer.body, where=f"pod {pod}")
                except ParseError:
                    unreadable_pods.append(pod)
            continue
        lines_of[pod], bad = _stepped(answer.body)
        unreadable += bad
        steps_of[pod] = frozenset(s for s, _ in lines_of[pod])
    return lines_of, steps_of, unreadable, unreadable_pods


def _keep_common_steps(pulled: Pulled, answers: dict[str, _Answer]) -> None:
    """Keep the records of the steps every answering pod returned (all steps when they share none).

    A packed answer says which steps it holds in its header (checked against its rows when it is unpacked); its
    window is cut out then, off the event loop.
    """
    lines_of, steps_of, unreadable, unreadable_pods = _steps_of(answers)
    step_sets = [steps for steps in steps_of.values() if steps]
    if step_sets:
        common = frozenset.intersection(*step_sets)
        window = common or frozenset.union(*step_sets)
        left_out = 0
        for pod, steps in steps_of.items():
            if pod in lines_of:
                kept = [line for step, line in lines_of[pod] if step in window]
                left_out += len(lines_of[pod]) - len(kept)
                if kept:
                    pulled.records.append(PodRecords(pod=pod, lines=kept))
            elif steps & window:
                left_out += len(steps - window)
                pulled.records.append(PodRecords(pod=pod, packed=answers[pod].body))
        pulled.window = window
        pulled.last_step = max(window)
        if left_out:
            pulled.notes.append(
                Note(
                    code="steps_outside_window",
                    count=left_out,
                    message=f"{left_out} records (or steps of packed answers) not every sidecar still had were left "
                    f"out; the window is steps {min(window)}-{max(window)}",
                )
            )
    if unreadable:
        pulled.notes.append(
            Note(code="unreadable_records", count=unreadable, message=f"{unreadable} lines had no step number")
        )
    if unreadable_pods:
        pulled.notes.append(
            Note(
                code="unreadable_records",
                count=len(unreadable_pods),
                message=f"{len(unreadable_pods)} sidecars answered packed columns that could not be read: "
                f"{_named(sorted(unreadable_pods))}",
            )
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """One analysis, ready to write: the dict for status, and the JSON for the ConfigMap."""

    analysis: dict[str, Any]
    json: str
    planner_findings: list[dict[str, str]] = field(default_factory=list)
    """The plan's findings (``{code, severity, message}``), empty without a spec."""


def analyse_window(
    records: list[PodRecords], *, window: frozenset[int], spec: JobSpec | None, notes: Sequence[Note]
) -> Result:
    """Build the table of the pods' ``records`` and run :func:`meshscope.analysis.analyze` (blocking: in a thread).

    ``records`` is consumed: emptied once the pods' columns are read, so that their bytes are not held while the
    analysis runs. Packed answers are cut to ``window``.

    Records that spoil the table are left out with a note, never the whole analysis: a pod whose packed columns do
    not read, JSON lines that do not read (the pod's other lines are kept), and, when the pods' columns do not make a
    table together, the pods whose columns do not make one alone.

    Raises:
        ParseError: no record is valid, or the records do not fit the spec's layout.
        PlanError: the spec cannot be planned.
    """
    parts: list[RecordColumns] = []
    first_error: list[str] = []
    pods_left_out: list[str] = []
    lines_left_out = 0
    for pod in records:
        where = f"pod {pod.pod}"
        packed, lines = pod.packed, pod.lines
        pod.packed, pod.lines = None, []  # each answer's bytes go as its columns come: the peak holds one copy
        try:
            if packed is not None:
                parts.append(unpack_columns(packed, where=where).only_steps(window))
            else:
                parts.append(columns_from_lines(lines, where=where))
        except ParseError as exc:
            first_error.append(str(exc).splitlines()[0][:300])
            if packed is not None:
                pods_left_out.append(pod.pod)
                continue
            good = [line for line in lines if _line_reads(line, where)]
            lines_left_out += len(lines) - len(good)
            if good:
                parts.append(columns_from_lines(good, where=where))
        del packed, lines
    records.clear()
    parts = [p for p in parts if p.n_rows]
    try:
        table = table_from_columns(parts)
    except ParseError as exc:
        if not parts:
            raise
        first_error.append(str(exc).splitlines()[0][:300])
        alone = [p for p in parts if _table_reads(p)]
        pods_left_out.extend(p.where.removeprefix("pod ") for p in parts if p not in alone)
        parts = alone
        table = table_from_columns(parts)
    parts.clear()
    if first_error:
        what = [f"{lines_left_out} records"] if lines_left_out else []
        what += (
            [f"every record of {len(pods_left_out)} pods ({_named(sorted(pods_left_out))})"] if pods_left_out else []
        )
        notes = [
            *notes,
            Note(
                code="invalid_records",
                count=lines_left_out + len(pods_left_out),
                message=f"{' and '.join(what)} left out as invalid (first: {first_error[0]})",
            ),
        ]
    done = analyze(table, spec=spec, notes=notes)
    analysis = done.to_dict()
    planner = [f.to_dict() for f in done.plan.findings] if done.plan is not None else []
    return Result(analysis=analysis, json=encode_analysis(analysis), planner_findings=planner)


def _line_reads(line: bytes, where: str) -> bool:
    try:
        table_from_lines([line], where=where)
    except ParseError:
        return False
    return True


def _table_reads(part: RecordColumns) -> bool:
    try:
        table_from_columns([part])
    except ParseError:
        return False
    return True

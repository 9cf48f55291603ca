"""The end of a local run: what ``meshscope run`` and ``meshscope demo`` print and write when the ranks have exited.

Why it exists: a run's records alone say little until they are analysed against what the job should have cost.
:func:`report_run` reads ``OUT/records.jsonl`` and the SDK's measurements, plans the job (``--spec``, else the spec of
:mod:`meshscope.local.emulation` built from the training script's own description), runs
:func:`~meshscope.analysis.analyze` with everything the run lost as partial-data notes (:func:`loss_notes`: dropped
records, silent ranks, a rank that died, trackers that never closed), prints the cost table and findings, lays the
plan beside the measurements stage by stage (:mod:`meshscope.local.comparisons`), and writes ``report.html``,
``trace.json``, ``analysis.json`` and ``plan.json`` into ``OUT``.

It sits above :mod:`meshscope.local.running` (which launches and collects, and must not import the report writers) and
below the CLI, which hands :func:`report_run` to ``run_job``. It must never hide the job's exit code (a failed
rank's code wins); when every rank succeeded but no analysis could be written it returns
:data:`~meshscope.local.running.EXIT_NO_ANALYSIS`, with the fix in one line.
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from meshscope.analysis import analyze, render_analysis
from meshscope.errors import MeshscopeError
from meshscope.formatting import human_seconds
from meshscope.local.comparisons import compare_run
from meshscope.local.emulation import TinyJob, emulated_assumptions, tiny_job_spec
from meshscope.local.running import EXIT_NO_ANALYSIS
from meshscope.plan import plan_job
from meshscope.progress import command_progress
from meshscope.records import BETWEEN_COMM, Note, RecordTable, read_records
from meshscope.reports import trace_steps, write_report, write_trace

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from meshscope.analysis import Analysis
    from meshscope.jobs import JobSpec
    from meshscope.local.comparisons import RunComparison
    from meshscope.local.running import RunOutcome
    from meshscope.progress import Progress

MIN_STEPS_TO_SKIP_WARMUP = 3
"""With at least this many steps recorded, the first one is left out of the end-of-run analysis as warm-up."""


def loss_notes(outcome: RunOutcome) -> list[Note]:
    """What the run lost, as partial-data notes for the analysis: never silent.

    Dropped records (the SDK's own count), ranks that sent nothing, a rank that died (and the steps after it),
    trackers that never closed, operations left out of records, unreadable datagrams.
    """
    notes: list[Note] = []
    nproc = outcome.settings.nproc
    dropped = {r: t.counters.get("records_dropped", 0) for r, t in outcome.ranks.items()}
    lost = sum(dropped.values())
    if lost:
        worst = max(dropped, key=lambda r: dropped[r])
        notes.append(
            Note(
                code="dropped_records",
                count=lost,
                message=(
                    f"{lost} step records were dropped by the SDK before reaching the collector (its queue was full "
                    f"or it was unreachable; rank {worst} lost {dropped[worst]}); those rank-steps are missing"
                ),
            )
        )
    silent = [r for r in range(nproc) if r not in outcome.ranks or not outcome.ranks[r].records]
    if silent and len(silent) < nproc:
        notes.append(
            Note(
                code="silent_ranks",
                count=len(silent),
                message=(
                    f"{len(silent)} of {nproc} ranks sent no step record (ranks {_short_list(silent)}): no tracker, "
                    "MESHSCOPE_DISABLE=1, they died first, or every record they sent was lost"
                ),
            )
        )
    if outcome.failed is not None:
        f = outcome.failed
        got = outcome.ranks[f.rank].records if f.rank in outcome.ranks else 0
        notes.append(
            Note(
                code="rank_failed",
                count=1,
                message=(
                    f"rank {f.rank} {f.describe()} after {got} recorded steps and the run was stopped: the steps "
                    "after that, and the step every rank was in, are missing"
                ),
            )
        )
    unclosed = [r for r, t in outcome.ranks.items() if t.hello and not t.closed]
    if unclosed and outcome.failed is None:
        notes.append(
            Note(
                code="lost_goodbyes",
                count=len(unclosed),
                message=(
                    f"{len(unclosed)} ranks exited without their goodbye reaching the collector (ranks "
                    f"{_short_list(unclosed)}): their last messages, step records and the count of records they "
                    "dropped among them, were lost (the collector's queue was full, or the tracker was never closed)"
                ),
            )
        )
    incomplete = sum(t.counters.get("incomplete_ops", 0) for t in outcome.ranks.values())
    if incomplete:
        notes.append(
            Note(
                code="sdk_incomplete_ops",
                count=incomplete,
                message=f"{incomplete} operations had not completed 4 steps after their step and were left out",
            )
        )
    errors = sum(t.counters.get("hook_errors", 0) for t in outcome.ranks.values())
    if errors:
        notes.append(
            Note(
                code="sdk_hook_errors",
                count=errors,
                message=f"{errors} failures inside meshscope's hooks (training unaffected; see the ranks' logs)",
            )
        )
    if (after := after_last_step_note(outcome)) is not None:
        notes.append(after)
    if outcome.unreadable_datagrams:
        notes.append(
            Note(
                code="unreadable_datagrams",
                count=outcome.unreadable_datagrams,
                message=f"{outcome.unreadable_datagrams} datagrams at the collector were not records and were skipped",
            )
        )
    return notes


AFTER_LAST_STEP_SAID_S = 0.05
"""The time a rank ran after its last step is said from this many seconds (and one median step) up."""


def after_last_step_note(outcome: RunOutcome) -> Note | None:
    """The ``after_last_step`` note: what ranks ran between their last step and their tracker's close.

    A final save, evaluation or test after the loop is in no record (there is no next step to carry it, as the time
    between steps is carried); said where the longest is at least one median step and :data:`AFTER_LAST_STEP_SAID_S`,
    from the ranks' close messages (an SDK that does not say leaves it out).
    """
    after = {r: t.after_last_step_us for r, t in outcome.ranks.items() if t.after_last_step_us is not None}
    if not after:
        return None
    blocked = {r: outcome.ranks[r].after_last_step.get(BETWEEN_COMM, 0) for r in after}
    own = {r: after[r] - min(blocked[r], after[r]) for r in after}  # waiting for a peer's save is not one's own
    steps = [t.median_step_us for t in outcome.ranks.values() if t.median_step_us is not None]
    bar_us = max(AFTER_LAST_STEP_SAID_S * 1e6, statistics.median(steps) if steps else 0.0)
    long = sorted((r for r in after if own[r] >= bar_us), key=lambda r: -own[r])
    if not long:
        return None
    worst = long[0]
    labelled = {k: v for k, v in outcome.ranks[worst].after_last_step.items() if k != BETWEEN_COMM and v}
    parts = [f"{k} {human_seconds(v / 1e6)}" for k, v in sorted(labelled.items(), key=lambda kv: -kv[1])]
    if (rest := after[worst] - sum(labelled.values())) > 0:
        parts.append(f"unlabelled {human_seconds(rest / 1e6)}")
    others = [r for r in after if r not in long]
    rest_said = ""
    if others:
        waited = max(blocked[r] for r in others)
        rest_said = f"; the other ranks up to {human_seconds(max(after[r] for r in others) / 1e6)}"
        if waited >= bar_us:
            rest_said += f", {human_seconds(waited / 1e6)} of it waiting in collectives"
    who = f"rank {worst}" if len(long) == 1 else f"{len(long)} ranks (longest: rank {worst})"
    return Note(
        code="after_last_step",
        count=len(long),
        message=(
            f"{who} ran {human_seconds(after[worst] / 1e6)} after the last step before the tracker closed "
            f"({', '.join(parts)}){rest_said}: a final save, evaluation or test after the loop is in no step's "
            "record and not in the table"
        ),
    )


def _short_list(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in sorted(ranks)[:8])
    return shown + (", ..." if len(ranks) > 8 else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Planned:
    """Where the run's expected numbers come from."""

    spec: JobSpec | None
    """The spec to plan, ``None`` when there is none (``why`` says so)."""
    described: bool = False
    """Built from the script's own description (emulated accelerator), not from ``--spec``."""
    emulated: bool = False
    """The script ran on the emulated accelerator (``--emulate``): expected compute is its sleep."""
    why: str | None = None
    """Why there is no spec."""


def _run_spec(outcome: RunOutcome) -> _Planned:
    """The spec to plan: ``--spec``, else one built from the script's description (:mod:`meshscope.local.emulation`)."""
    settings = outcome.settings
    if settings.spec is not None:
        return _Planned(spec=settings.spec)
    described = next(
        (
            t.measurements["job"]
            for _, t in sorted(outcome.ranks.items())
            if isinstance(t.measurements.get("job"), dict)
        ),
        None,
    )
    if described is None:
        return _Planned(
            spec=None,
            why=(
                "no --spec, and the training script did not describe itself (describe_job); give --spec job.yaml, "
                "a TrainingJob of the model, layout and hardware (docs/spec.md)"
            ),
        )
    try:
        job = TinyJob.from_dict(described)
        spec = tiny_job_spec(job, settings.layout, gpus_per_node=settings.gpus_per_node, name=settings.job)
    except MeshscopeError as exc:
        return _Planned(spec=None, why=f"cannot build a spec from the script's description: {exc}")
    return _Planned(spec=spec, described=True, emulated=job.block_ms is not None)


def _compare(
    analysis: Analysis, measurements: Mapping[int, Mapping[str, Any]], planned: _Planned, spec: JobSpec | None
) -> RunComparison | None:
    """The per-stage comparison of a run analysed with a plan (``spec`` is what was planned), else ``None``."""
    if analysis.plan is None or spec is None:
        return None
    return compare_run(analysis, measurements, emulated=planned.emulated, planned_gpu=spec.hardware.gpu.name)


def _nothing_to_analyse(outcome: RunOutcome, notes: Sequence[Note]) -> bool:
    """Whether the run left nothing to analyse: no records, or ranks several processes wrote as at once (said why)."""
    if not any(t.records for t in outcome.ranks.values()):
        print("no step records to analyse (no meshscope tracker in the script, MESHSCOPE_DISABLE=1, or all lost)")  # noqa: T201
        for n in notes:
            print(f"  {n.code} ({n.count:,}): {n.message}")  # noqa: T201
        return True
    if outcome.claimed_twice:  # not a restart's attempts, which the reader would keep the last of: they collide
        print(  # noqa: T201
            f"meshscope run: no analysis: {len(outcome.claimed_twice)} ranks were claimed by more than one process "
            f"at once (above), so their records collide; the records are kept in {outcome.records_path}",
            file=sys.stderr,
        )
        return True
    return False


def report_run(outcome: RunOutcome) -> int:
    """The end of a local run: the cost table, findings, expected vs measured; ``OUT/report.html`` and ``trace.json``.

    Reads ``OUT/records.jsonl`` and the SDK's measurements, plans the job (``--spec``, else the spec of
    :mod:`meshscope.local.emulation` built from the training script's description), runs
    :func:`~meshscope.analysis.analyze` with everything the run lost as partial-data notes, prints
    :func:`~meshscope.analysis.render_analysis` and the per-stage comparison (:mod:`meshscope.local.comparisons`),
    writes ``report.html``, ``trace.json``, ``analysis.json`` and ``plan.json`` into ``OUT`` and prints their paths.

    A run that ran on more ranks than cores gets the ``cpu_contention`` note (:class:`~meshscope.local.cpus.CpuUse`).

    Returns:
        0 when the analysis was written; :data:`~meshscope.local.running.EXIT_NO_ANALYSIS` when it could not be (no
        records, records that cannot be read or analysed, an output directory that cannot be written), after one
        line with the reason and the fix (the records stay in ``OUT/records.jsonl``).
    """
    notes = loss_notes(outcome)
    if outcome.cpu is not None and (contention := outcome.cpu.note()) is not None:
        notes.append(contention)
    if _nothing_to_analyse(outcome, notes):
        return EXIT_NO_ANALYSIS
    progress = command_progress(quiet=outcome.settings.quiet)
    read = _read(outcome, progress)
    if read is None:
        return EXIT_NO_ANALYSIS
    table, warmup = read
    planned = _run_spec(outcome)
    if warmup is not None:
        _say_warmup(outcome, warmup, planned)
    spec, why, plan = planned.spec, planned.why, None
    if spec is not None:
        try:
            plan = plan_job(spec, assumptions=emulated_assumptions() if planned.described else None)
        except MeshscopeError as exc:
            why, spec = f"the job's spec cannot be planned: {exc}", None
    try:
        analysis = analyze(table, spec=spec, plan=plan, notes=notes, one_clock=True, progress=progress)
    except MeshscopeError as exc:
        _no_analysis(outcome, "cannot analyse the collected records", exc)
        return EXIT_NO_ANALYSIS
    measurements = {r: t.measurements for r, t in outcome.ranks.items() if t.measurements}
    comparison = _compare(analysis, measurements, planned, spec)
    # The per-stage comparison replaces the job-wide collective and memory tables (it is exact per stage).
    shown = analysis if comparison is None else replace(analysis, collectives=(), memory=())
    print(render_analysis(shown))  # noqa: T201
    if comparison is not None:
        source = "the emulated-accelerator spec of the script's description" if planned.described else "--spec"
        print(f"\nExpected vs measured, per pipeline stage (plan from {source}; docs/expected-vs-measured.md)")  # noqa: T201
        if planned.described and not planned.emulated:
            print(  # noqa: T201
                "(the script ran real compute, without --emulate: expected seconds are a nominal emulated "
                "accelerator's, not this CPU's; bytes and counts compare as they are)"
            )
        print(comparison.render())  # noqa: T201
    else:
        print(f"\nNo expected numbers: {why}")  # noqa: T201
    return 0 if _write(outcome, table, analysis, comparison, progress) else EXIT_NO_ANALYSIS


def _no_analysis(outcome: RunOutcome, what: str, exc: Exception) -> None:
    """One line: what failed, the error, the fix, and where the records are."""
    text = str(exc)
    if "every one was cut short" in text:
        fix = "the exception the script raised (the ranks' output above)"
    elif "appears twice" in text:  # a repeated (rank, step) is read as a restart: this is a collective's seq
        fix = (
            "a collective's seq counts its group's collectives over the whole run: where two runs' records share a "
            "file, give each its own; otherwise fix the script's tracker calls (docs/sdk.md)"
        )
    else:
        fix = "fix the script's tracker calls (docs/sdk.md)"
    print(  # noqa: T201
        f"meshscope run: no analysis: {what}: {text}; fix: {fix}; the records are kept in {outcome.records_path}",
        file=sys.stderr,
    )


def _read(outcome: RunOutcome, progress: Progress) -> tuple[RecordTable, int | None] | None:
    """The collected records without the warm-up step, and that step; ``None`` (said why) if they cannot be read."""
    try:
        with progress.phase("reading the collected records"):
            records = read_records(outcome.records_path, allow_partial=True)
            seen_steps = sorted({r.step for r in records})
            warmup = seen_steps[0] if len(seen_steps) >= MIN_STEPS_TO_SKIP_WARMUP else None
            table = RecordTable.from_records([r for r in records if r.step != warmup], notes=records.notes)
    except (OSError, MeshscopeError) as exc:
        _no_analysis(outcome, f"cannot read the collected records {outcome.records_path}", exc)
        return None
    return table, warmup


def _say_warmup(outcome: RunOutcome, warmup: int, planned: _Planned) -> None:
    """That the warm-up step is left out, and the command that analyses the same steps again."""
    again = f"meshscope analyze {shlex.quote(str(outcome.records_path.parent))} --skip-steps 1"
    settings = outcome.settings
    if planned.described:
        how = f"`{again}` measures the same steps again (the expected numbers here are the plan of the script's "
        how += "description; analysis.json keeps them)"
    elif planned.spec is not None and settings.spec_path is not None:
        how = f"`{again} --spec {shlex.quote(str(settings.spec_path))}` gives these numbers again"
    else:
        how = f"`{again}` gives these numbers again"
    print(  # noqa: T201
        f"step {warmup} is left out as warm-up (lazy initialisation, first gathers, optimizer state allocation, "
        f"one-off setup messages); {outcome.records_path} keeps it, and {how}"
    )


def _write(
    outcome: RunOutcome, table: RecordTable, analysis: Analysis, comparison: RunComparison | None, progress: Progress
) -> bool:
    """``analysis.json``, ``plan.json``, ``report.html`` and ``trace.json`` into ``OUT``; print the paths.

    ``analysis.json`` also gets the run's CPU figures (``cpu``: cores, ranks, their CPU seconds). Returns whether
    everything was written.
    """
    out_dir = outcome.settings.out_dir
    data = analysis.to_dict()
    if outcome.cpu is not None:
        data["cpu"] = outcome.cpu.to_dict()
    html = analysis.to_dict()
    if comparison is not None:
        data["expected_vs_measured"].update(comparison.to_dict())
        html["expected_vs_measured"] = {**html["expected_vs_measured"], **comparison.report_rows()}
    try:
        (out_dir / "analysis.json").write_text(json.dumps(data, indent=1) + "\n")
        if analysis.plan is not None:
            (out_dir / "plan.json").write_text(json.dumps(analysis.plan.to_dict(), indent=1) + "\n")
        with progress.phase("writing the report"):
            report = write_report(out_dir / "report.html", table, analysis.breakdown, html)
        with progress.phase("writing the trace"):
            trace = write_trace(out_dir / "trace.json", table, analysis.breakdown, steps=trace_steps(table))
    except (OSError, ValueError) as exc:
        print(  # noqa: T201
            f"meshscope run: no analysis: cannot write the report into {out_dir}: {exc}; fix: give a writable "
            f"--out; the records are kept in {outcome.records_path}",
            file=sys.stderr,
        )
        return False
    print(f"\nreport: {report}\ntrace:  {trace} (open in ui.perfetto.dev or chrome://tracing)")  # noqa: T201
    return True

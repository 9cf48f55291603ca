"""``meshscope calibrate`` and ``meshscope predict``: find a run's records and spec, calibrate, write or predict.

Why it lives in local mode: a ``meshscope run`` output directory (``OUT/``) carries everything a prediction needs
without a ``--spec``: ``records.jsonl``, ``collector.json`` (the layout; one host clock) and ``measurements.json``
(the training script's description of itself, from which :mod:`meshscope.local.emulation` builds the spec of the
emulated accelerator). Records files with ``--spec`` work the same way. The fitting is
:func:`meshscope.analysis.calibrate`'s, the planning :func:`meshscope.analysis.predict`'s; this module reads files,
builds the specs of the measured and the predicted layout, and prints. Errors are
:class:`~meshscope.errors.MeshscopeError` (exit 2, one line).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from meshscope.analysis import (
    Calibration,
    calibrate,
    predict,
    read_inputs,
    render_calibration,
    render_file,
    retarget,
)
from meshscope.errors import MeshscopeError
from meshscope.jobs import Recompute, load_yaml_mapping
from meshscope.local.emulation import TinyJob, emulated_assumptions, tiny_job_spec
from meshscope.local.summarizing import MIN_STEPS_TO_SKIP_WARMUP
from meshscope.plan import PlanAssumptions, assumptions_from_mapping, plan_job
from meshscope.progress import command_progress
from meshscope.records import RecordTable
from meshscope.topology import AXES, parse_layout

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

    from meshscope.jobs import JobSpec
    from meshscope.topology import ParallelLayout


class PredictInputError(MeshscopeError):
    """Records, a run directory or options that calibration or prediction cannot use."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredRun:
    """A measured run as calibration needs it."""

    table: RecordTable
    """Its records (a run directory's without the warm-up step)."""
    spec: JobSpec
    """The job that ran."""
    base: PlanAssumptions
    """The assumptions to calibrate from: the emulated accelerator's for a self-described run, else the defaults."""
    one_clock: bool
    """Timed on one host clock (``meshscope run``)."""
    job: TinyJob | None = None
    """The script's description of itself (a ``train_tiny`` run without ``--spec``)."""
    gpus_per_node: int | None = None
    """Ranks per emulated node the run used (``None``: all on one node)."""
    warmup_step: int | None = None
    """The step left out as warm-up, if any."""


def _records_paths(sources: Sequence[str]) -> tuple[list[str], Path | None]:
    """Records files, with a run directory standing for its ``records.jsonl``; the directory, if one was given."""
    paths, folder = [], None
    for source in sources:
        p = Path(source)
        if p.is_dir():
            if not (p / "records.jsonl").is_file():
                raise PredictInputError(f"{p} is a directory without records.jsonl: give a meshscope run --out "
                                        "directory or records files")  # fmt: skip
            paths.append(str(p / "records.jsonl"))
            folder = p if folder is None else folder
        else:
            paths.append(source)
    return paths, folder


def _described_job(folder: Path) -> tuple[TinyJob, str]:
    """The script's description (``measurements.json``) and the layout text (``collector.json``) of a run."""
    try:
        measurements = json.loads((folder / "measurements.json").read_text())
        layout = json.loads((folder / "collector.json").read_text())["layout"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PredictInputError(
            f"{folder}: no --spec, and the run's measurements.json / collector.json cannot be read ({exc}); give "
            "--spec FILE"
        ) from None
    ranks = measurements if isinstance(measurements, dict) else {}
    described = next(
        (m["job"] for _, m in sorted(ranks.items()) if isinstance(m, dict) and isinstance(m.get("job"), dict)),
        None,
    )
    if described is None or not isinstance(layout, str):
        raise PredictInputError(f"{folder}: the training script did not describe itself (describe_job); give --spec")
    return TinyJob.from_dict(described), layout


MIN_CORE_SHARE = 0.05
"""The least share of its cores a run is taken to have had, however much foreign load ``collector.json`` reports
(a foreign fraction near 1 is a measurement over a run that mostly waited, not a machine with no cores)."""


def cpu_cores_of_run(folder: Path) -> float | None:
    """The cores a ``meshscope run``'s ranks had: ``cpu.cores`` x (1 - ``cpu.foreign_fraction``) of collector.json.

    ``None`` when the file has no usable CPU figures (then no contention model is applied).
    """
    try:
        cpu = json.loads((folder / "collector.json").read_text()).get("cpu")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(cpu, dict):
        return None
    cores, foreign = cpu.get("cores"), cpu.get("foreign_fraction")
    if isinstance(cores, bool) or not isinstance(cores, int | float) or not math.isfinite(cores) or cores <= 0:
        return None
    share = 1.0
    if isinstance(foreign, int | float) and not isinstance(foreign, bool) and math.isfinite(foreign):
        share = min(1.0, max(MIN_CORE_SHARE, 1.0 - float(foreign)))
    return float(cores) * share


def _ranks_per_node(table: RecordTable) -> int | None:
    """Ranks per node of the records (``None``: every rank on one node)."""
    s = table.steps
    nodes = np.unique(s.node)
    if nodes.size <= 1:
        return None
    ranks = np.unique(np.stack([s.node, s.rank], axis=1), axis=0)
    return int(np.bincount(ranks[:, 0].astype(np.int64)).max())


def _without_warmup(table: RecordTable) -> tuple[RecordTable, int | None]:
    steps = np.unique(table.steps.step)
    if steps.size < MIN_STEPS_TO_SKIP_WARMUP:
        return table, None
    first = int(steps[0])
    records = [r for r in table.to_records() if r.step != first]
    return RecordTable.from_records(records, notes=table.notes), first


def _layout_of_records(table: RecordTable, text: str, *, where: Path) -> ParallelLayout:
    """The layout ``text`` names, if it is the one the records were taken in: every rank's coordinates agree."""
    ranks = int(np.unique(table.steps.rank).size)
    try:
        layout = parse_layout(text, world_size=ranks)
    except MeshscopeError as exc:
        raise PredictInputError(
            f"{where}: layout {text!r} does not describe the records' {ranks} ranks: {exc}"
        ) from None
    s = table.steps
    expected = layout.coords_array(s.rank.astype(np.int64))
    for i, axis in enumerate(AXES):
        if not np.array_equal(expected[axis], s.coord[:, i]):
            raise PredictInputError(
                f"{where}: layout {text!r} is not the one the records were taken in (their {axis.value} coordinates "
                "differ); give --spec FILE"
            )
    return layout


def read_run(sources: Sequence[str], *, spec: str | None, quiet: bool = True) -> MeasuredRun:
    """The records and spec of a measured run: records files with ``--spec``, or a ``meshscope run`` directory.

    Raises:
        PredictInputError: for missing files, a directory without records, or no way to know the spec.
    """
    paths, folder = _records_paths(sources)
    progress = command_progress(quiet=quiet)
    inputs = read_inputs(paths, spec=spec, progress=progress, error=PredictInputError)
    table, warmup = inputs.table, None
    if folder is not None:
        table, warmup = _without_warmup(table)
    per_node = _ranks_per_node(table)
    if inputs.spec is not None:
        base = PlanAssumptions()
        if folder is not None and not table.on_gpu:
            # The user's own script on this machine's CPU ranks: its kernels are CPU work, so the contention model
            # applies to its compute as well as to its host time and collectives (docs/predict.md).
            base = replace(base, cpu_cores=cpu_cores_of_run(folder), cpu_compute=True)
        return MeasuredRun(table=table, spec=inputs.spec, base=base, one_clock=inputs.one_clock,
                           gpus_per_node=per_node, warmup_step=warmup)  # fmt: skip
    if folder is None:
        raise PredictInputError("records files need --spec FILE (a meshscope run directory describes its own job)")
    job, layout_text = _described_job(folder)
    layout = _layout_of_records(table, layout_text, where=folder / "collector.json")
    measured_spec = tiny_job_spec(job, layout, gpus_per_node=per_node, name=table.job)
    # train_tiny runs its ranks on this machine's CPU cores: the contention model applies (docs/predict.md).
    base = replace(emulated_assumptions(), cpu_cores=cpu_cores_of_run(folder))
    return MeasuredRun(table=table, spec=measured_spec, base=base, one_clock=inputs.one_clock,
                       job=job, gpus_per_node=per_node, warmup_step=warmup)  # fmt: skip


def calibrate_run(run: MeasuredRun) -> Calibration:
    """:func:`meshscope.analysis.calibrate` of a measured run."""
    emulated = run.job is not None and run.job.block_ms is not None
    return calibrate(run.table, run.spec, base=run.base, one_clock=run.one_clock, emulated=emulated)


def calibrate_command(args: argparse.Namespace) -> int:
    """``meshscope calibrate RECORDS... [--spec FILE] [--out FILE] [--json] [-q]`` (see :mod:`meshscope.cli`)."""
    run = read_run(args.records, spec=args.spec, quiet=args.quiet)
    c = calibrate_run(run)
    out = Path(args.out)
    try:
        out.write_text(render_file(c))
    except OSError as exc:
        raise PredictInputError(f"cannot write {out}: {exc.strerror or exc}") from None
    if args.json:
        json.dump({**c.to_dict(), "file": str(out), "warmup_step": run.warmup_step}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if run.warmup_step is not None:
        print(f"step {run.warmup_step} is left out as warm-up, as meshscope run's own analysis does")  # noqa: T201
    print(render_calibration(c))  # noqa: T201
    print(f"\nassumptions: {out} (meshscope plan --assumptions {out}; meshscope predict --assumptions {out})")  # noqa: T201
    return 0


def _target_spec(run: MeasuredRun, args: argparse.Namespace) -> JobSpec:
    layout = parse_layout(args.layout) if args.layout else run.spec.layout
    recompute = Recompute(args.recompute) if args.recompute else None
    if args.micro_batch is not None and args.micro_batch < 1:
        raise PredictInputError(f"--micro-batch must be >= 1, got {args.micro_batch}")
    if run.job is not None:
        # The emulated accelerator of train_tiny: the same script with another layout, on nodes of the run's size.
        target = tiny_job_spec(
            _tiny_target(run.job, layout, pipelined=run.spec.layout.pp > 1, micro_batch=args.micro_batch),
            layout,
            gpus_per_node=run.gpus_per_node,
            name=run.spec.name,
        )
        if args.gpus is None and args.hardware is None and recompute is None:
            return target
        return retarget(target, gpus=args.gpus, hardware=args.hardware, recompute=recompute)
    return retarget(run.spec, layout=layout, gpus=args.gpus, hardware=args.hardware,
                    micro_batch_size=args.micro_batch, recompute=recompute)  # fmt: skip


TINY_MICRO_BATCH_SIZE = 2
"""``train_tiny``'s default ``--micro-batch-size``."""


def _tiny_target(job: TinyJob, layout: ParallelLayout, *, pipelined: bool, micro_batch: int | None) -> TinyJob:
    """What ``train_tiny`` describes for ``layout`` with the measured run's sequences per replica per step.

    ``train_tiny`` runs the whole step as one micro-batch without a pipeline (``--micro-batch-size`` x
    ``--micro-batches`` sequences) and ``--micro-batches`` micro-batches of ``--micro-batch-size`` with one; its
    emulated accelerator takes ``--emulate`` ms per block for each of them. A run without a pipeline does not say how
    its sequences were split, so a pipelined target takes ``micro_batch`` (else the script's default, 2).

    Raises:
        PredictInputError: for a micro-batch that does not divide the sequences per replica.
    """
    sequences = job.micro_batch_size * job.micro_batches
    if layout.pp == 1:
        return replace(job, micro_batch_size=sequences, micro_batches=1)
    size = micro_batch if micro_batch is not None else (job.micro_batch_size if pipelined else TINY_MICRO_BATCH_SIZE)
    if sequences % size:
        raise PredictInputError(
            f"--micro-batch {size} does not divide the {sequences} sequences per replica per step of the measured "
            f"run (train_tiny --micro-batch-size x --micro-batches); give one that does"
        )
    return replace(job, micro_batch_size=size, micro_batches=sequences // size)


def _with_file(c: Calibration, path: str) -> Calibration:
    """``c`` with the assumptions of an ``--assumptions`` file (over the run's base) instead of its own fit."""
    mapping: dict[str, Any] = load_yaml_mapping(path)
    assumptions = assumptions_from_mapping(mapping, base=c.base, origin=path)
    return replace(c, assumptions=assumptions, plan=plan_job(c.spec, assumptions=assumptions), overrides=mapping)


def predict_command(args: argparse.Namespace) -> int:
    """``meshscope predict --from OUT [--layout L] [...]``: options in :mod:`meshscope.cli`.

    Calibrates the run on the fly (or takes ``--assumptions``), builds the target spec, predicts and prints.
    """
    run = read_run([args.source], spec=args.spec, quiet=args.quiet)
    c = calibrate_run(run)
    if args.assumptions:
        c = _with_file(c, args.assumptions)
    prediction = predict(c, _target_spec(run, args))
    if args.json:
        json.dump(prediction.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    source = f"--assumptions {args.assumptions}" if args.assumptions else f"calibrated from {args.source}"
    print(prediction.render())  # noqa: T201
    print(f"assumptions: {source}")  # noqa: T201
    return 0

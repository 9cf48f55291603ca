"""Scenario files: a job, a number of steps, a seed, faults and optional explicit phase durations.

A scenario is what ``meshscope simulate SCENARIO.yaml`` runs and what tests use as ground truth::

    description: 8 GPUs, data parallel only, every phase given by hand
    spec: ../llama3-8b-h100.yaml   # a TrainingJob file relative to this one, or an inline TrainingJob manifest
    steps: 10                      # default 10
    seed: 0                        # default 0
    prefetch: false                # the loader overlaps the step's compute (only the excess shows); default false
    phases:                        # optional: override the plan's expected times (see :class:`Phases`)
      data_ms: 6
      forward_ms: 10
    faults:                        # optional: a list of mappings (kind + parameters) or 'kind:key=value,...'
      - {kind: straggler, rank: 3, factor: 1.5}
      - slow-link:node=1,factor=0.25

Every problem raises :class:`~meshscope.errors.SpecError` whose field is the scenario path of the offending value
(``faults[1].factor``, ``phases.forward_ms``, ``steps``) and whose message says what would fit; the job's own
errors come through with the ``spec`` field. Nothing else escapes for bad input. This module reads files and checks
values; it must not plan or simulate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import yaml

from meshscope.errors import LayoutError, SpecError
from meshscope.jobs import load_spec, spec_from_manifest
from meshscope.simulation.faults import Fault, JobShape, fault_from_mapping, resolve_faults
from meshscope.topology import Placement

if TYPE_CHECKING:
    from meshscope.jobs import JobSpec

SCENARIO_KEYS: Final = ("description", "job", "spec", "steps", "seed", "prefetch", "phases", "faults")
"""Keys allowed at the top of a scenario file."""
MAX_STEPS: Final = 100_000
"""Most steps a scenario may ask for."""
MAX_FAULTS: Final = 1_000
"""Most faults one scenario may list."""
MAX_PHASE_MS: Final = 1e9
"""Largest phase duration accepted, ms (about 11 days)."""
DEFAULT_STEPS: Final = 10
"""Steps simulated when a scenario does not say."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Phases:
    """Explicit durations that replace the plan's expected times, so that a small case can be simulated exactly.

    Every field is optional (``None``: take the plan's value). Durations are milliseconds on an unloaded GPU and a
    nominal link; faults and noise still apply on top.
    """

    data_ms: float | None = None
    """Data-loader time per step on every rank. ``None``: the plan's ``data_wait_seconds`` (0 unless the assumptions
    were calibrated from a run)."""
    forward_ms: float | None = None
    """Forward compute of one micro-batch on every pipeline stage (all its model chunks together)."""
    backward_ms: float | None = None
    """Backward compute of one micro-batch on every stage, recompute included."""
    optimizer_ms: float | None = None
    """Optimizer step on every rank."""
    dp_ms: float | None = None
    """Transfer time of the data-parallel collectives of one step (gradient reduction, and the parameter
    all-gather under a distributed optimizer), all together; the plan's split between them and its overlap with
    compute (``training.overlapGradReduce``) are kept. Written ``allreduce_ms`` or ``dp_ms`` in a scenario."""
    tp_ms: float | None = None
    """Transfer time of the tensor-parallel collectives of one micro-batch, forward and backward together."""
    cp_ms: float | None = None
    """Transfer time of the context-parallel ring exchange of one micro-batch, forward and backward together."""
    ep_ms: float | None = None
    """Transfer time of the expert-parallel all-to-alls of one micro-batch, forward and backward together."""
    pp_ms: float | None = None
    """Transfer time of one pipeline message (one micro-batch's activations or activation gradients)."""
    checkpoint_ms: float | None = None
    """A checkpoint of this length after the optimizer of every ``checkpoint_every``-th step (all ranks)."""
    checkpoint_every: int | None = None
    """Period of the checkpoints above, steps (>= 1); needed with ``checkpoint_ms``."""

    def __post_init__(self) -> None:
        """Check ranges.

        Raises:
            SpecError: naming ``phases.<field>``.
        """
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name == "checkpoint_every":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise SpecError("phases.checkpoint_every", f"{value!r} must be a whole number of steps >= 1")
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_PHASE_MS:
                raise SpecError(f"phases.{f.name}", f"{value!r} must be a number of ms from 0 to {MAX_PHASE_MS:g}")
        if (self.checkpoint_ms is None) != (self.checkpoint_every is None):
            raise SpecError("phases", "checkpoint_ms and checkpoint_every go together: give both or neither")


PHASE_KEYS: Final = (*(f.name for f in fields(Phases)), "allreduce_ms")
"""Keys allowed under ``phases`` (``allreduce_ms`` is another name for ``dp_ms``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """A job to simulate, with everything that is not the job itself."""

    spec: JobSpec
    """The job: model, layout, training settings, hardware."""
    job: str
    """Job name written into the records (default: the spec's ``metadata.name``)."""
    steps: int = DEFAULT_STEPS
    """Steps to simulate (>= 1)."""
    seed: int = 0
    """Seed of every random draw (noise, random clock offsets)."""
    prefetch: bool = False
    """Whether the data loader runs ahead, overlapping the step's compute so that only the excess shows."""
    phases: Phases = field(default_factory=Phases)
    """Explicit durations replacing the plan's."""
    faults: tuple[Fault, ...] = ()
    """Faults to inject, in order."""
    description: str = ""
    """Free text."""
    source: str = ""
    """Where it was read from (a path, or ``<text>``)."""


# ==================================================================================================== loading


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario file.

    Args:
        path: the YAML file; a ``spec`` path in it is relative to the file's folder.

    Returns:
        The scenario, with its job loaded and its faults checked against the job.

    Raises:
        SpecError: if the file cannot be read, does not parse, or any value does not fit (field = scenario path).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SpecError("", f"{path}: cannot read the scenario file: {reason}") from None
    return load_scenario_text(text, base_dir=path.parent, origin=str(path))


def load_scenario_text(text: str, *, base_dir: str | Path = ".", origin: str = "<text>") -> Scenario:
    """Parse scenario YAML text.

    Args:
        text: the YAML.
        base_dir: folder a ``spec`` path is relative to.
        origin: name for messages.

    Raises:
        SpecError: as :func:`load_scenario`.
    """
    try:
        document = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{origin}:{mark.line + 1}:{mark.column + 1}" if mark is not None else origin
        raise SpecError("", f"{where}: YAML does not parse: {exc.problem or 'unreadable YAML'}") from None
    except yaml.YAMLError as exc:
        raise SpecError("", f"{origin}: YAML does not parse: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise SpecError("", f"{origin}: YAML does not parse: {type(exc).__name__}: {exc}") from None
    if document is None:
        raise SpecError("", f"{origin}: empty document; expected a scenario (a mapping with spec, steps, faults)")
    return scenario_from_mapping(document, base_dir=base_dir, origin=origin)


def scenario_from_mapping(document: object, *, base_dir: str | Path = ".", origin: str = "<text>") -> Scenario:
    """Build a scenario from parsed YAML (a mapping).

    Raises:
        SpecError: as :func:`load_scenario`.
    """
    if not isinstance(document, Mapping):
        raise SpecError(
            "", f"{origin}: expected a scenario (a mapping with spec, steps, faults), got {_show(document)}"
        )
    unknown = [k for k in document if k not in SCENARIO_KEYS]
    if unknown:
        raise SpecError(str(unknown[0]), f"unknown key; a scenario has {', '.join(SCENARIO_KEYS)}")
    spec = _spec(document, Path(base_dir))
    steps = _integer(document, "steps", DEFAULT_STEPS, 1, MAX_STEPS)
    seed = _integer(document, "seed", 0, 0, 2**63 - 1)
    prefetch = document.get("prefetch", False)
    if not isinstance(prefetch, bool):
        raise SpecError("prefetch", f"expected true or false, got {_show(prefetch)}")
    job = document.get("job", spec.name)
    if not isinstance(job, str) or not job.strip():
        raise SpecError("job", f"expected a non-empty job name, got {_show(job)}")
    description = document.get("description", "")
    if not isinstance(description, str):
        raise SpecError("description", f"expected text, got {_show(description)}")
    phases = _phases(document.get("phases"))
    faults = _faults(document.get("faults"))
    try:
        placement = Placement.for_hardware(spec.world_size, spec.hardware)
    except LayoutError as exc:
        raise SpecError("spec.hardware", str(exc)) from None
    resolve_faults(faults, JobShape(layout=spec.layout, placement=placement, steps=steps, seed=seed))
    return Scenario(
        spec=spec,
        job=job,
        steps=steps,
        seed=seed,
        prefetch=prefetch,
        phases=phases,
        faults=faults,
        description=description,
        source=origin,
    )


def _spec(document: Mapping[Any, Any], base_dir: Path) -> JobSpec:
    if "spec" not in document:
        raise SpecError("spec", "required: a TrainingJob file (path relative to the scenario) or an inline manifest")
    value = document["spec"]
    if isinstance(value, str):
        if not value.strip() or "\n" in value:
            raise SpecError("spec", f"expected a TrainingJob file name, got {_show(value)}")
        path = Path(value) if Path(value).is_absolute() else base_dir / value
        try:
            return load_spec(path)
        except SpecError as exc:
            raise SpecError("spec", str(exc)) from None
    if isinstance(value, Mapping):
        try:
            return spec_from_manifest(value)
        except SpecError as exc:
            raise SpecError("spec", f"inline TrainingJob: {exc}") from None
    raise SpecError("spec", f"expected a TrainingJob file name or an inline manifest, got {_show(value)}")


def _integer(document: Mapping[Any, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = document.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SpecError(key, f"{_show(value)} must be a whole number from {lo} to {hi}")
    return value


def _phases(value: object) -> Phases:
    if value is None:
        return Phases()
    if not isinstance(value, Mapping):
        raise SpecError("phases", f"expected a mapping of durations in ms, got {_show(value)}")
    given: dict[str, Any] = {}
    for key, raw in value.items():
        if key not in PHASE_KEYS:
            raise SpecError(f"phases.{key}", f"unknown phase; use {', '.join(PHASE_KEYS)}")
        name = "dp_ms" if key == "allreduce_ms" else key
        if name in given:
            raise SpecError(f"phases.{key}", "allreduce_ms and dp_ms are the same phase; give one of them")
        if isinstance(raw, float) and not math.isfinite(raw):
            raise SpecError(f"phases.{key}", f"{raw!r} must be a finite number of ms")
        given[name] = raw
    return Phases(**given)


def _faults(value: object) -> tuple[Fault, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise SpecError("faults", f"expected a list of faults, got {_show(value)}")
    if len(value) > MAX_FAULTS:
        raise SpecError("faults", f"{len(value)} faults listed; at most {MAX_FAULTS}")
    return tuple(fault_from_mapping(item, where=f"faults[{i}]") for i, item in enumerate(value))


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ==================================================================================================== YAML


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that rejects duplicate keys (PyYAML keeps the last one silently)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[object] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:
            continue  # unhashable key: construct_mapping reports it with its position
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
            )
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

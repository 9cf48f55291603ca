"""Named faults the simulator injects, their parameters, and what each one resolves to on a concrete job.

Why it exists: tests and the diagnosis accuracy suite need ground truth ("rank 3 was 1.5x slow in steps 2-9"), and a
user asking "what would a slow NIC on node 5 cost" needs a name for it. Every fault is a frozen value object with
its parameters checked on construction (:class:`FaultError`, a :class:`~meshscope.errors.SpecError` naming the
parameter); :func:`resolve_faults` checks it against a job (ranks, nodes and steps in range) and returns the
:class:`Truth`: every fault resolved to concrete ranks, nodes, process groups and steps.

The fault kinds and their parameters (string form ``kind:key=value,key=value`` as on the command line; lists are
``a;b;c`` or inclusive ranges ``lo-hi``):

* ``straggler`` (``rank``, ``factor`` > 0, ``steps``): the rank's forward and backward take ``factor`` x as long.
* ``slow-link`` (``node`` or ``nvlink_domain``, ``factor`` > 0, ``steps``): that node's network (every group with a
  member on the node whose traffic crosses the network, and pipeline messages to or from it over the network) or that
  NVLink domain (groups and messages inside it) runs at ``factor`` x its bandwidth.
* ``data-imbalance`` (``rank``, ``factor`` k > 0, ``steps``): the data-parallel replica of ``rank`` (every rank with
  its dp index: its TP, CP and pipeline peers see the same samples) gets sequences k x as long: linear compute x k,
  attention work Σs² x k², activation bytes x k.
* ``slow-loader`` (``data_ms`` >= 0, ``rank`` or every rank, ``steps``): the loader needs ``data_ms`` per step; with
  the scenario's ``prefetch`` only the part beyond the step's compute shows.
* ``checkpoint-stall`` (``every`` N >= 1, ``seconds`` > 0, ``ranks`` or every rank): a checkpoint after the optimizer
  of steps N-1, 2N-1, ...
* ``clock-skew`` (``node`` with ``offset_us``, or ``max_offset_us``): the timestamps of a node (or of every node, each
  drawn uniformly from ``[-max, max]`` with the seed) are shifted; the timeline itself is unchanged.
* ``noise`` (``sigma`` >= 0): every compute and optimizer duration is multiplied by a log-normal factor of mean 1 and
  standard deviation ≈ ``sigma``, drawn per rank and per interval from the seed.

What it must not do: simulate anything (that is :mod:`~meshscope.simulation.timeline`) or read files.
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, field, fields
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

import numpy as np

from meshscope.errors import SpecError
from meshscope.topology import MeshAxis

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from numpy.typing import NDArray

    from meshscope.topology import ParallelLayout, Placement


class FaultKind(StrEnum):
    """Name of a fault, as written in scenario files and on the command line."""

    STRAGGLER = "straggler"
    SLOW_LINK = "slow-link"
    DATA_IMBALANCE = "data-imbalance"
    SLOW_LOADER = "slow-loader"
    CHECKPOINT_STALL = "checkpoint-stall"
    CLOCK_SKEW = "clock-skew"
    NOISE = "noise"


class FaultError(SpecError):
    """A fault parameter that is missing, mistyped or out of range.

    Attributes:
        param: the parameter's name (``factor``); ``""`` for the fault as a whole.
        reason: the message without the field path, so that a scenario can re-anchor it (``faults[2].factor``).
    """

    def __init__(self, where: str, param: str, reason: str) -> None:
        """Build the error; shown as ``where.param: reason``."""
        self.param = param
        self.reason = reason
        super().__init__(f"{where}.{param}" if param else where, reason)


def _positive(where: str, name: str, value: float, *, lo: float = 0.0, hi: float = 1e6) -> None:
    """``lo < value <= hi``; the bounds keep simulated times far from int64 overflow."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise FaultError(where, name, f"{value!r} must be a number > 0")
    if value < lo or value > hi:
        raise FaultError(where, name, f"{value!r} is outside [{lo:g}, {hi:g}]")


def _non_negative(where: str, name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise FaultError(where, name, f"{value!r} must be a number >= 0")


def _whole(where: str, name: str, value: object, *, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise FaultError(where, name, f"{value!r} must be a whole number >= {minimum}")


def _whole_list(where: str, name: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, tuple) or not value:
        raise FaultError(where, name, f"{value!r} must be a non-empty list of whole numbers >= 0")
    for item in value:
        _whole(where, name, item)
    if len(set(value)) != len(value):
        raise FaultError(where, name, f"{list(value)} lists a value twice")


@dataclass(frozen=True, slots=True, kw_only=True)
class Straggler:
    """One GPU computes slower than its peers (thermal throttling, a failing HBM stack, a noisy host)."""

    kind: ClassVar[FaultKind] = FaultKind.STRAGGLER
    rank: int
    """Global rank of the slow GPU."""
    factor: float
    """Its forward and backward compute take ``factor`` times as long (> 0; 1.5 means 50 % slower)."""
    steps: tuple[int, ...] | None = None
    """Steps it acts in; ``None`` means every step."""

    def __post_init__(self) -> None:
        """Check the parameters (ranges against a job are checked by :func:`resolve_faults`)."""
        where = self.kind.value
        _whole(where, "rank", self.rank)
        _positive(where, "factor", self.factor, hi=_MAX_FACTOR)
        _whole_list(where, "steps", self.steps)


_MAX_FACTOR = 1000.0
"""Largest slow-down any fault may ask for (a 1000x straggler is a dead GPU, not a slow one)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowLink:
    """A node's network (NIC, cable, switch port) or a whole NVLink domain runs below its bandwidth."""

    kind: ClassVar[FaultKind] = FaultKind.SLOW_LINK
    factor: float
    """Fraction of the nominal bandwidth left (> 0; 0.25 makes every transfer over it 4x as long)."""
    node: int | None = None
    """Node index whose network is slow (give this or ``nvlink_domain``)."""
    nvlink_domain: int | None = None
    """NVLink domain index whose NVLink is slow (give this or ``node``)."""
    steps: tuple[int, ...] | None = None
    """Steps it acts in; ``None`` means every step."""

    def __post_init__(self) -> None:
        """Check the parameters; exactly one of ``node`` and ``nvlink_domain``."""
        where = self.kind.value
        _positive(where, "factor", self.factor, lo=1 / _MAX_FACTOR, hi=_MAX_FACTOR)
        if (self.node is None) == (self.nvlink_domain is None):
            raise FaultError(where, "", "give exactly one of node (its network) or nvlink_domain (its NVLink)")
        if self.node is not None:
            _whole(where, "node", self.node)
        if self.nvlink_domain is not None:
            _whole(where, "nvlink_domain", self.nvlink_domain)
        _whole_list(where, "steps", self.steps)


@dataclass(frozen=True, slots=True, kw_only=True)
class DataImbalance:
    """One data-parallel replica draws longer sequences than the others (packing or bucketing gone wrong).

    Model: its sequences are ``factor`` x as long, their number unchanged. Linear work (projections, MLP, logits)
    grows k x, the attention core (Σ s²) k² x, activation memory k x, and the activation-sized transfers of its
    tensor-, context- and pipeline-parallel groups k x. Expert all-to-alls and gradient reductions are unchanged.
    """

    kind: ClassVar[FaultKind] = FaultKind.DATA_IMBALANCE
    rank: int
    """Any rank of the affected replica: every rank with its dp index is affected."""
    factor: float
    """Tokens per sequence relative to the other replicas, k (> 0)."""
    steps: tuple[int, ...] | None = None
    """Steps it acts in; ``None`` means every step."""

    def __post_init__(self) -> None:
        """Check the parameters."""
        where = self.kind.value
        _whole(where, "rank", self.rank)
        _positive(where, "factor", self.factor, hi=math.sqrt(_MAX_FACTOR))  # attention grows k²
        _whole_list(where, "steps", self.steps)


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowLoader:
    """The data loader needs ``data_ms`` per step on one rank or on all of them."""

    kind: ClassVar[FaultKind] = FaultKind.SLOW_LOADER
    data_ms: float
    """Loader time per step, ms (>= 0); replaces the job's ``phases.data_ms`` on the ranks it targets."""
    rank: int | None = None
    """The slow rank; ``None`` means every rank."""
    steps: tuple[int, ...] | None = None
    """Steps it acts in; ``None`` means every step."""

    def __post_init__(self) -> None:
        """Check the parameters."""
        where = self.kind.value
        _non_negative(where, "data_ms", self.data_ms)
        if self.data_ms > _MAX_MS:
            raise FaultError(where, "data_ms", f"{self.data_ms!r} is above {_MAX_MS:g} ms")
        if self.rank is not None:
            _whole(where, "rank", self.rank)
        _whole_list(where, "steps", self.steps)


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointStall:
    """A checkpoint save that stalls training every ``every`` steps."""

    kind: ClassVar[FaultKind] = FaultKind.CHECKPOINT_STALL
    every: int
    """Period in steps (>= 1): the stall follows the optimizer of steps ``every-1``, ``2*every-1``, ..."""
    seconds: float
    """Length of each stall, s (> 0)."""
    ranks: tuple[int, ...] | None = None
    """Ranks that save; ``None`` means every rank. The others run on and wait for them in their next collective."""

    def __post_init__(self) -> None:
        """Check the parameters."""
        where = self.kind.value
        _whole(where, "every", self.every, minimum=1)
        _positive(where, "seconds", self.seconds, hi=_MAX_MS / 1000)
        _whole_list(where, "ranks", self.ranks)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClockSkew:
    """Host clocks disagree: timestamps of a node are shifted (the work itself is not)."""

    kind: ClassVar[FaultKind] = FaultKind.CLOCK_SKEW
    node: int | None = None
    """The node whose clock is off (with ``offset_us``)."""
    offset_us: int = 0
    """Its offset, µs (added to its timestamps; may be negative)."""
    max_offset_us: int | None = None
    """Instead of one node: every node gets an offset drawn uniformly from ``[-max, max]`` µs with the seed."""

    def __post_init__(self) -> None:
        """Check the parameters; exactly one of ``node`` and ``max_offset_us``."""
        where = self.kind.value
        if (self.node is None) == (self.max_offset_us is None):
            raise FaultError(
                where, "", "give node (with offset_us) for one node's clock, or max_offset_us for every node's"
            )
        if self.node is not None:
            _whole(where, "node", self.node)
        if isinstance(self.offset_us, bool) or not isinstance(self.offset_us, int):
            raise FaultError(where, "offset_us", f"{self.offset_us!r} must be a whole number of µs")
        if abs(self.offset_us) > _MAX_SKEW_US:
            raise FaultError(where, "offset_us", f"{self.offset_us} is beyond ±{_MAX_SKEW_US} µs (one day)")
        if self.max_offset_us is not None:
            _whole(where, "max_offset_us", self.max_offset_us)
            if self.max_offset_us > _MAX_SKEW_US:
                raise FaultError(where, "max_offset_us", f"{self.max_offset_us} is beyond {_MAX_SKEW_US} µs (one day)")


_MAX_SKEW_US = 86_400_000_000
_MAX_MS = 1e9
"""Longest loader time or checkpoint accepted, ms (about 11 days)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Noise:
    """Run-to-run jitter of kernel times."""

    kind: ClassVar[FaultKind] = FaultKind.NOISE
    sigma: float
    """Relative standard deviation of compute and optimizer durations (>= 0; 0.02 is 2 % jitter). Below 2."""

    def __post_init__(self) -> None:
        """Check the parameter."""
        _non_negative(self.kind.value, "sigma", self.sigma)
        if self.sigma >= 2:
            raise FaultError(self.kind.value, "sigma", f"{self.sigma!r} must be below 2 (a relative jitter)")


Fault: TypeAlias = Straggler | SlowLink | DataImbalance | SlowLoader | CheckpointStall | ClockSkew | Noise
"""Any fault."""

FAULT_TYPES: dict[FaultKind, type[Fault]] = {
    cls.kind: cls for cls in (Straggler, SlowLink, DataImbalance, SlowLoader, CheckpointStall, ClockSkew, Noise)
}
"""The class of every fault kind."""

# Parameter types: "int", "float", "ints" (a list of whole numbers).
_PARAM_TYPES: dict[FaultKind, dict[str, str]] = {
    FaultKind.STRAGGLER: {"rank": "int", "factor": "float", "steps": "ints"},
    FaultKind.SLOW_LINK: {"factor": "float", "node": "int", "nvlink_domain": "int", "steps": "ints"},
    FaultKind.DATA_IMBALANCE: {"rank": "int", "factor": "float", "steps": "ints"},
    FaultKind.SLOW_LOADER: {"data_ms": "float", "rank": "int", "steps": "ints"},
    FaultKind.CHECKPOINT_STALL: {"every": "int", "seconds": "float", "ranks": "ints"},
    FaultKind.CLOCK_SKEW: {"node": "int", "offset_us": "int", "max_offset_us": "int"},
    FaultKind.NOISE: {"sigma": "float"},
}


def _required(kind: FaultKind) -> list[str]:
    return [f.name for f in fields(FAULT_TYPES[kind]) if f.default is MISSING and f.default_factory is MISSING]


# ==================================================================================================== parsing

_KIND_TEXT = re.compile(r"^\s*([A-Za-z_-]+)\s*(?::(.*))?$", re.DOTALL)
_RANGE = re.compile(r"^(\d+)-(\d+)$")
_MAX_LIST = 1 << 20


def _kind(value: object, where: str) -> FaultKind:
    if not isinstance(value, str):
        raise SpecError(where, f"expected a fault name, got {_show(value)}; use one of {_kinds_text()}")
    try:
        return FaultKind(value.strip().lower().replace("_", "-"))
    except ValueError:
        raise SpecError(where, f"unknown fault {value!r}; use one of {_kinds_text()}") from None


def _kinds_text() -> str:
    return ", ".join(k.value for k in FaultKind)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_fault(text: str, *, where: str = "--fault") -> Fault:
    """Parse the string form ``kind:key=value,key=value`` (``straggler:rank=3,factor=1.5``).

    Lists are ``a;b;c`` or inclusive ranges ``lo-hi`` (``steps=2-5;9``).

    Args:
        text: the fault.
        where: what to call it in error messages.

    Returns:
        The fault.

    Raises:
        FaultError: for an unknown parameter or a bad value (a :class:`~meshscope.errors.SpecError`).
        SpecError: for an unknown fault name or a malformed string.
    """
    m = _KIND_TEXT.match(text)
    if not m:
        raise SpecError(where, f"{_show(text)} is not kind:key=value,...; e.g. straggler:rank=3,factor=1.5")
    kind = _kind(m.group(1), where)
    params: dict[str, object] = {}
    for term in filter(None, (t.strip() for t in (m.group(2) or "").split(","))):
        key, eq, raw = term.partition("=")
        key = key.strip()
        if not eq or not key:
            raise SpecError(where, f"{_show(term)} is not key=value (in {_show(text)})")
        if key in params:
            raise FaultError(where, key, "given twice")
        params[key] = _from_text(raw.strip(), _PARAM_TYPES[kind].get(key, "float"), where, key)
    return _build(kind, params, where)


def _from_text(raw: str, kind: str, where: str, key: str) -> object:
    try:
        if kind == "int":
            return int(raw)
        if kind == "ints":
            values: list[int] = []
            for part in filter(None, (p.strip() for p in raw.split(";"))):
                rng = _RANGE.match(part)
                if rng:
                    lo, hi = int(rng.group(1)), int(rng.group(2))
                    if hi < lo or hi - lo >= _MAX_LIST:
                        raise FaultError(where, key, f"range {part!r} must run upwards over at most {_MAX_LIST} values")
                    values.extend(range(lo, hi + 1))
                else:
                    values.append(int(part))
            return tuple(values)
        return float(raw)
    except ValueError:
        what = {"int": "a whole number", "ints": "whole numbers a;b;c or ranges lo-hi"}.get(kind, "a number")
        raise FaultError(where, key, f"{_show(raw)} is not {what}") from None


def fault_from_mapping(value: object, *, where: str) -> Fault:
    """Build a fault from a scenario entry: ``{kind: straggler, rank: 3, factor: 1.5}`` or the string form.

    Args:
        value: a mapping with ``kind`` and the parameters, or a string ``kind:key=value,...``.
        where: the entry's path for error messages (``faults[2]``).

    Returns:
        The fault.

    Raises:
        SpecError: naming ``where`` and the parameter for anything that does not fit (:class:`FaultError` for
            parameter values).
    """
    if isinstance(value, str):
        return parse_fault(value, where=where)
    if not isinstance(value, dict):
        raise SpecError(
            where, f"expected a mapping with kind and parameters (or 'kind:key=value,...'), got {_show(value)}"
        )
    if "kind" not in value:
        raise SpecError(f"{where}.kind", f"required: the fault's name, one of {_kinds_text()}")
    kind = _kind(value["kind"], f"{where}.kind")
    params: dict[str, object] = {}
    types = _PARAM_TYPES[kind]
    for key, raw in value.items():
        if key == "kind":
            continue
        if not isinstance(key, str):
            raise SpecError(where, f"parameter names are strings, got {_show(key)}")
        params[key] = _from_yaml(raw, types.get(key, "float"), where, key)
    return _build(kind, params, where)


def _from_yaml(raw: object, kind: str, where: str, key: str) -> object:
    if kind == "ints":
        if isinstance(raw, int) and not isinstance(raw, bool):
            return (raw,)
        if isinstance(raw, str):
            return _from_text(raw, kind, where, key)
        if isinstance(raw, list):
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in raw):
                raise FaultError(where, key, f"{_show(raw)} must list whole numbers")
            return tuple(raw)
        raise FaultError(where, key, f"{_show(raw)} is not a list of whole numbers")
    if kind == "int" and not (isinstance(raw, int) and not isinstance(raw, bool)):
        raise FaultError(where, key, f"{_show(raw)} is not a whole number")
    if kind == "float" and (isinstance(raw, bool) or not isinstance(raw, int | float)):
        raise FaultError(where, key, f"{_show(raw)} is not a number")
    return raw


def _build(kind: FaultKind, params: dict[str, object], where: str) -> Fault:
    types = _PARAM_TYPES[kind]
    unknown = sorted(set(params) - set(types))
    if unknown:
        raise FaultError(
            where, unknown[0], f"{kind.value} has no parameter {unknown[0]!r}; it takes {', '.join(types)}"
        )
    missing = [name for name in _required(kind) if name not in params]
    if missing:
        raise FaultError(where, missing[0], f"required by {kind.value} (it takes {', '.join(types)})")
    try:
        return FAULT_TYPES[kind](**params)  # type: ignore[arg-type]
    except FaultError as exc:
        raise FaultError(where, exc.param, exc.reason) from None


def fault_text(fault: Fault) -> str:
    """The string form of a fault (inverse of :func:`parse_fault`)."""
    parts = []
    for f in fields(fault):
        value = getattr(fault, f.name)
        if value is None or (f.name == "offset_us" and value == 0 and getattr(fault, "node", None) is None):
            continue
        if isinstance(value, tuple):
            shown = ";".join(str(v) for v in value)
        elif isinstance(value, float):
            shown = f"{value:g}"
        else:
            shown = str(value)
        parts.append(f"{f.name}={shown}")
    return f"{fault.kind.value}:{','.join(parts)}" if parts else fault.kind.value


# ==================================================================================================== resolution


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultTruth:
    """One injected fault resolved on a concrete job: who and what it touched, when. The ground truth of tests."""

    kind: FaultKind
    """The fault's name."""
    fault: Fault
    """The fault as given."""
    ranks: tuple[int, ...]
    """Ranks whose own work it changes (the straggler; every rank of an imbalanced replica; slow loaders;
    checkpointing ranks). Empty for slow links (they slow groups, see ``groups``), clock skew and noise."""
    nodes: tuple[int, ...]
    """Nodes involved: the slow link's node (or the domain's nodes), skewed nodes, the nodes of ``ranks``."""
    node_names: tuple[str, ...]
    """Names of ``nodes``."""
    groups: tuple[str, ...] = ()
    """Process-group ids whose transfers it slows (slow links; pipeline streams ``pp:src-dst`` included)."""
    steps: tuple[int, ...]
    """Steps it acts in (every simulated step for faults without a ``steps`` parameter; the checkpoint steps)."""
    clock_offset_us: Mapping[str, int] = field(default_factory=dict)
    """Clock skew only: node name -> offset added to its timestamps, µs."""
    description: str
    """One sentence with the numbers, e.g. ``rank 3 (node-0) computes 1.5x slower in steps 0-9``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Truth:
    """Every injected fault, resolved, in the order given."""

    faults: tuple[FaultTruth, ...]
    """One entry per fault."""
    clock_offset_us: NDArray[np.int64]
    """Offset added to every node's timestamps (indexed by node), all clock-skew faults together, µs."""

    def of_kind(self, kind: FaultKind | str) -> tuple[FaultTruth, ...]:
        """The resolved faults of one kind."""
        wanted = FaultKind(kind)
        return tuple(f for f in self.faults if f.kind is wanted)

    def ranks(self, kind: FaultKind | str | None = None) -> frozenset[int]:
        """Every rank touched by faults (of ``kind``, if given)."""
        chosen = self.faults if kind is None else self.of_kind(kind)
        return frozenset(r for f in chosen for r in f.ranks)

    def describe(self) -> list[str]:
        """One line per fault."""
        return [f.description for f in self.faults]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobShape:
    """What faults are checked against: the layout, where ranks run, how many steps."""

    layout: ParallelLayout
    placement: Placement
    steps: int
    seed: int

    @property
    def world_size(self) -> int:
        """Ranks."""
        return self.layout.world_size

    @property
    def nodes(self) -> int:
        """Nodes."""
        return self.placement.nodes

    @property
    def domains(self) -> int:
        """NVLink domains."""
        return int(self.placement.domain_of_node.max()) + 1 if self.placement.nodes else 0


def check_fault(fault: Fault, shape: JobShape, *, where: str) -> None:
    """Check a fault's ranks, nodes, domains and steps against a job.

    Raises:
        FaultError: naming ``where`` and the parameter, the value and the range that fits.
    """

    def within(param: str, value: int | None, limit: int, what: str) -> None:
        if value is not None and not 0 <= value < limit:
            raise FaultError(where, param, f"{what} {value} is outside [0, {limit}) of this job")

    within("rank", getattr(fault, "rank", None), shape.world_size, "rank")
    for value in getattr(fault, "ranks", None) or ():
        within("ranks", value, shape.world_size, "rank")
    within("node", getattr(fault, "node", None), shape.nodes, "node")
    within("nvlink_domain", getattr(fault, "nvlink_domain", None), shape.domains, "NVLink domain")
    for value in getattr(fault, "steps", None) or ():
        within("steps", value, shape.steps, "step")


def resolve_faults(faults: Sequence[Fault], shape: JobShape, *, where: str = "faults") -> Truth:
    """Check every fault against the job and resolve it to concrete ranks, nodes, groups and steps.

    Groups slowed by slow links are filled in by the timeline (it knows the groups); here ``groups`` is empty.

    Raises:
        FaultError: for the first fault that does not fit the job, naming ``where[i].param``.
    """
    placement = shape.placement
    offsets = np.zeros(placement.nodes, dtype=np.int64)
    out: list[FaultTruth] = []
    for i, fault in enumerate(faults):
        check_fault(fault, shape, where=f"{where}[{i}]")
        draft = _resolve(fault, shape, index=i)
        offsets += draft.offsets
        nodes = draft.nodes
        if draft.ranks and not nodes:
            nodes = tuple(int(n) for n in np.unique(placement.node_of_rank[list(draft.ranks)]))
        names = tuple(placement.node_name(n) for n in nodes)
        out.append(
            FaultTruth(
                kind=fault.kind,
                fault=fault,
                ranks=draft.ranks,
                nodes=nodes,
                node_names=names,
                steps=draft.steps,
                clock_offset_us={
                    placement.node_name(int(n)): int(draft.offsets[n]) for n in np.flatnonzero(draft.offsets)
                },
                description=draft.text.replace("{node}", ", ".join(names[:3])),
            )
        )
    return Truth(faults=tuple(out), clock_offset_us=offsets)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Draft:
    ranks: tuple[int, ...]
    nodes: tuple[int, ...]
    steps: tuple[int, ...]
    offsets: NDArray[np.int64]
    text: str


def _resolve(fault: Fault, shape: JobShape, *, index: int) -> _Draft:
    placement = shape.placement
    all_steps = tuple(range(shape.steps))
    steps: tuple[int, ...] = getattr(fault, "steps", None) or all_steps
    when = _steps_text(steps, shape.steps)
    ranks: tuple[int, ...] = ()
    nodes: tuple[int, ...] = ()
    offsets = np.zeros(placement.nodes, dtype=np.int64)
    if isinstance(fault, Straggler):
        ranks = (fault.rank,)
        text = f"rank {fault.rank} ({{node}}) computes {fault.factor:g}x as long {when}"
    elif isinstance(fault, DataImbalance):
        dp = shape.layout.coords_array()[MeshAxis.DP]
        ranks = tuple(int(r) for r in np.flatnonzero(dp == dp[fault.rank]))
        text = (
            f"data-parallel replica dp={int(dp[fault.rank])} ({len(ranks)} ranks, incl. rank {fault.rank}) gets "
            f"sequences {fault.factor:g}x as long {when}"
        )
    elif isinstance(fault, SlowLoader):
        ranks = tuple(range(shape.world_size)) if fault.rank is None else (fault.rank,)
        who = "every rank" if fault.rank is None else f"rank {fault.rank} ({{node}})"
        text = f"the data loader of {who} needs {fault.data_ms:g} ms per step {when}"
    elif isinstance(fault, CheckpointStall):
        steps = tuple(s for s in all_steps if (s + 1) % fault.every == 0)
        ranks = tuple(range(shape.world_size)) if fault.ranks is None else tuple(sorted(fault.ranks))
        who = "every rank" if fault.ranks is None else f"ranks {_list_text(ranks)}"
        text = f"{who} checkpoint(s) for {fault.seconds:g} s after steps {_list_text(steps) or '(none)'}"
    elif isinstance(fault, SlowLink):
        if fault.node is not None:
            nodes = (fault.node,)
            text = f"the network of {placement.node_name(fault.node)} runs at {fault.factor:g}x bandwidth {when}"
        else:
            nodes = tuple(int(n) for n in np.flatnonzero(placement.domain_of_node == fault.nvlink_domain))
            text = f"NVLink domain {fault.nvlink_domain} runs at {fault.factor:g}x bandwidth {when}"
    elif isinstance(fault, ClockSkew):
        if fault.node is not None:
            offsets[fault.node] = fault.offset_us
            nodes = (fault.node,)
            text = f"the clock of {placement.node_name(fault.node)} is off by {fault.offset_us:+d} µs"
        else:
            limit = fault.max_offset_us or 0
            offsets = np.random.default_rng([shape.seed, index, 0x5EED]).integers(-limit, limit + 1, placement.nodes)
            nodes = tuple(range(placement.nodes))
            text = f"every node's clock is off by up to ±{limit} µs (seeded)"
    else:
        text = f"compute and optimizer durations jitter by σ = {fault.sigma:g} (seeded)"
    return _Draft(ranks=ranks, nodes=nodes, steps=steps, offsets=offsets.astype(np.int64), text=text)


def _steps_text(steps: Sequence[int], total: int) -> str:
    if len(steps) == total:
        return "in every step"
    return f"in steps {_list_text(steps)}"


def _list_text(values: Iterable[int]) -> str:
    """``0-3, 7, 9-10``."""
    out: list[str] = []
    run: list[int] = []
    for v in sorted(values):
        if run and v == run[-1] + 1:
            run.append(v)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [v]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def active(fault: Any, step: int) -> bool:  # noqa: ANN401 - any fault type
    """Whether ``fault`` acts in ``step`` (faults without ``steps`` act in every step)."""
    steps = getattr(fault, "steps", None)
    return steps is None or step in steps

"""Who this pod's GPUs are: the global rank, coord, node, NVLink domain and network tier of every local GPU.

Exists so that every sample the sidecar exports carries the rank coordinates it belongs to, worked out **once** at
startup from the pod's environment (telemetry.md §8) and nowhere else. It reads, in this order of precedence:

- ``MESHSCOPE_JOB``: the job name (required);
- ``MESHSCOPE_NODE_NAME``: the Kubernetes node the pod runs on, from the downward API
  (``valueFrom.fieldRef.fieldPath: spec.nodeName``) (required);
- ``MESHSCOPE_LAYOUT``: the parallel layout, ``tp=2,pp=2,dp=2`` with an optional ``order=`` term for a rank order
  other than Megatron-core's default (:func:`meshscope.topology.parse_layout`);
- ``MESHSCOPE_GPUS_PER_NODE``: GPUs (ranks) per pod;
- the node rank (the pod's index among the job's pods): ``MESHSCOPE_NODE_RANK``, else ``JOB_COMPLETION_INDEX`` (set
  by Kubernetes in the pods of an Indexed Job), else the pod label ``batch.kubernetes.io/job-completion-index`` in
  the downward API's labels file (``MESHSCOPE_POD_LABELS_FILE``, a ``downwardAPI`` volume with
  ``fieldPath: metadata.labels``), else ``PET_NODE_RANK`` (Kubeflow Trainer v2);
- ``MESHSCOPE_NVLINK_DOMAIN`` and ``MESHSCOPE_NETWORK_TIER``: the node's NVLink domain (``nvidia.com/gpu.clique``)
  and network block (a topograph tier label), copied in by the operator (node labels are not in the downward API);
- ``MESHSCOPE_PLACEMENT_FILE``: a placement the operator mounts (below); where it names this node, it decides which
  ranks run here and the node's NVLink domain and network tier, and no node rank is needed.

By default ranks fill nodes consecutively: the pod with node rank ``n`` holds ranks ``n*g .. n*g+g-1`` on GPUs
``0 .. g-1`` (``g`` GPUs per node), as torchrun and the operator's Indexed Job place them.

Placement file (JSON or YAML; our own format, documented in ``sidecar/README.md``)::

    {"schema": "meshscope.placement/1",
     "nodes": {"gpu-node-17": {"nvlink_domain": "7b968a6d-c8aa-45e1-9e07-e1e51be99c31.1",
                               "network_tier": "block-3", "ranks": [8, 9, 10, 11, 12, 13, 14, 15]}}}

``ranks[i]`` is the global rank on local GPU ``i`` (``null`` for a GPU without a rank); every rank appears at most
once in the file. Per node rather than per rank, so that a node cannot be given two NVLink domains.

Bad identity (a value that does not parse, a node rank outside the layout, a placement that contradicts itself) is an
:class:`IdentityError` naming the variable, its value and what would fit: the sidecar does not start. **Missing**
rank information (no layout, no GPUs per node, no node rank, a placement that does not name this node) gives a
*degraded* identity: job and node are known, ranks are not; :attr:`Identity.missing` says exactly what cannot be
tagged and why, and the sidecar exports ``meshscope_sidecar_info{mode="degraded"}``. It never guesses a rank.

It must not do I/O beyond reading the two files named above, and must not know any source's format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from meshscope.errors import LayoutError
from meshscope.topology import ParallelLayout, Placement, RankCoord, parse_layout

if TYPE_CHECKING:
    from collections.abc import Mapping

ENV_JOB = "MESHSCOPE_JOB"
ENV_NODE_NAME = "MESHSCOPE_NODE_NAME"
ENV_LAYOUT = "MESHSCOPE_LAYOUT"
ENV_GPUS_PER_NODE = "MESHSCOPE_GPUS_PER_NODE"
ENV_NODE_RANK = "MESHSCOPE_NODE_RANK"
ENV_JOB_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"
"""Set by Kubernetes in every container of an Indexed Job's pods (``batch/v1`` Job, ``completionMode: Indexed``)."""
ENV_PET_NODE_RANK = "PET_NODE_RANK"
"""Kubeflow Trainer v2's node rank (telemetry.md §8)."""
ENV_POD_LABELS_FILE = "MESHSCOPE_POD_LABELS_FILE"
ENV_NVLINK_DOMAIN = "MESHSCOPE_NVLINK_DOMAIN"
ENV_NETWORK_TIER = "MESHSCOPE_NETWORK_TIER"
ENV_PLACEMENT_FILE = "MESHSCOPE_PLACEMENT_FILE"

COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
"""The pod label of an Indexed Job's completion index (telemetry.md §8)."""
PLACEMENT_SCHEMA = "meshscope.placement/1"
"""Schema tag of a placement file."""
MAX_LABEL_CHARS = 253
"""Longest label value kept from the identity (a Kubernetes node name is a DNS subdomain: at most 253 characters)."""
MAX_FILE_BYTES = 16 * 1024 * 1024
"""Largest placement or labels file read, bytes (16k ranks take well under 1 MiB)."""

# The downward API writes one ``key="value"`` line per label, the value quoted like a Go string
# (kubernetes/pkg/fieldpath: FormatMap uses strconv.Quote).
_LABEL_LINE = re.compile(r'^([^=\s]+)="((?:[^"\\]|\\.)*)"$')


class IdentityError(ValueError):
    """The pod's identity is bad: names the variable (or file), its value and what would fit."""


class IdentityMode(StrEnum):
    """Whether every local GPU's rank is known."""

    FULL = "full"
    DEGRADED = "degraded"


def sanitize(value: str) -> str:
    """A label value: valid UTF-8 (bad code points replaced), at most :data:`MAX_LABEL_CHARS` characters."""
    text = value.encode("utf-8", "replace").decode("utf-8")[:MAX_LABEL_CHARS]
    return text.replace("\n", " ")


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalGpu:
    """One GPU of this pod and the rank that runs on it."""

    gpu: int
    """Local GPU index (``nvidia-smi`` order; the ``gpu`` label of dcgm-exporter)."""
    rank: int
    """Global rank."""
    coord: RankCoord
    """Index along every mesh axis."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Identity:
    """This pod's place in the job. Build it with :func:`resolve_identity`."""

    job: str
    """Job name (sanitised)."""
    node: str
    """Node name (sanitised)."""
    nvlink_domain: str = ""
    """The node's NVLink domain label; empty when unknown."""
    network_tier: str = ""
    """The node's network block label; empty when unknown."""
    layout: ParallelLayout | None = None
    """The job's layout; ``None`` when unknown."""
    gpus: tuple[LocalGpu, ...] = ()
    """Every local GPU with a rank, by GPU index; empty in degraded mode."""
    missing: tuple[str, ...] = ()
    """Why ranks cannot be tagged, one sentence each (degraded mode); empty in full mode."""
    sources: tuple[str, ...] = ()
    """Where each piece came from (``node rank from JOB_COMPLETION_INDEX=3``), for the startup line."""
    placement: Placement | None = field(default=None, compare=False)
    """Which node every rank of the job runs on, when that is known: the default rule (``n*g .. n*g+g-1`` on node
    rank ``n``), or a placement file that places every rank of the layout; ``None`` otherwise. The NCCL source
    uses it to tell same-size groups apart by the nodes they span."""
    _by_rank: dict[int, LocalGpu] = field(init=False, repr=False, compare=False)
    _by_gpu: dict[int, LocalGpu] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Index the GPUs by rank and by GPU index."""
        object.__setattr__(self, "_by_rank", {g.rank: g for g in self.gpus})
        object.__setattr__(self, "_by_gpu", {g.gpu: g for g in self.gpus})

    @property
    def mode(self) -> IdentityMode:
        """Full when every local GPU's rank is known, else degraded."""
        return IdentityMode.DEGRADED if self.missing or not self.gpus else IdentityMode.FULL

    @property
    def ranks(self) -> frozenset[int] | None:
        """The global ranks of this pod; ``None`` when unknown (degraded)."""
        return frozenset(self._by_rank) if self.mode is IdentityMode.FULL else None

    def by_rank(self, rank: int) -> LocalGpu | None:
        """The local GPU that runs ``rank``; ``None`` if it is not this pod's."""
        return self._by_rank.get(rank)

    def by_gpu(self, gpu: int) -> LocalGpu | None:
        """Local GPU ``gpu`` with its rank; ``None`` if it has none."""
        return self._by_gpu.get(gpu)

    def describe(self) -> str:
        """One line for the startup log."""
        where = f"job {self.job!r} on node {self.node!r}"
        if self.mode is IdentityMode.DEGRADED:
            return f"{where}: degraded, ranks not tagged: " + "; ".join(self.missing)
        ranks = ", ".join(f"gpu {g.gpu} = rank {g.rank}" for g in self.gpus)
        layout = self.layout.describe() if self.layout is not None else "?"
        return f"{where}, layout {layout}: {ranks}" + (f" ({'; '.join(self.sources)})" if self.sources else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class IdentityInputs:
    """The raw identity settings, as the environment gives them (every field a string or ``None``: unset)."""

    job: str | None = None
    """``MESHSCOPE_JOB``."""
    node_name: str | None = None
    """``MESHSCOPE_NODE_NAME`` (downward API ``spec.nodeName``)."""
    layout: str | None = None
    """``MESHSCOPE_LAYOUT``, e.g. ``tp=2,pp=2,dp=2``."""
    gpus_per_node: str | None = None
    """``MESHSCOPE_GPUS_PER_NODE``: a whole number >= 1."""
    node_rank: tuple[tuple[str, str], ...] = ()
    """Candidate node ranks in precedence order, each as (where it came from, value)."""
    nvlink_domain: str | None = None
    """``MESHSCOPE_NVLINK_DOMAIN``."""
    network_tier: str | None = None
    """``MESHSCOPE_NETWORK_TIER``."""
    placement_file: str | None = None
    """``MESHSCOPE_PLACEMENT_FILE``: path of a placement file."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> IdentityInputs:
        """Read the variables of the module docstring (and the downward API's labels file, if one is named).

        Raises:
            IdentityError: if a named labels file cannot be read.
        """

        def get(name: str) -> str | None:
            value = environ.get(name)
            return value if value is not None and value.strip() else None

        candidates = [(n, v) for n in (ENV_NODE_RANK, ENV_JOB_COMPLETION_INDEX) if (v := get(n)) is not None]
        labels_file = get(ENV_POD_LABELS_FILE)
        if labels_file is not None:
            labels = read_pod_labels(Path(labels_file))
            if COMPLETION_INDEX_LABEL in labels:
                candidates.append((f"{labels_file} label {COMPLETION_INDEX_LABEL}", labels[COMPLETION_INDEX_LABEL]))
        if (value := get(ENV_PET_NODE_RANK)) is not None:
            candidates.append((ENV_PET_NODE_RANK, value))
        return cls(
            job=get(ENV_JOB),
            node_name=get(ENV_NODE_NAME),
            layout=get(ENV_LAYOUT),
            gpus_per_node=get(ENV_GPUS_PER_NODE),
            node_rank=tuple(candidates),
            nvlink_domain=get(ENV_NVLINK_DOMAIN),
            network_tier=get(ENV_NETWORK_TIER),
            placement_file=get(ENV_PLACEMENT_FILE),
        )


def read_pod_labels(path: Path) -> dict[str, str]:
    """The labels of a downward API labels file (``key="value"`` per line); unreadable lines are skipped.

    Raises:
        IdentityError: if the file cannot be read.
    """
    text = _read_text(path, f"{ENV_POD_LABELS_FILE}={str(path)!r}")
    labels: dict[str, str] = {}
    for line in text.splitlines():
        m = _LABEL_LINE.match(line.strip())
        if m is None:
            continue
        try:
            labels[m.group(1)] = json.loads(f'"{m.group(2)}"')
        except ValueError:
            continue
    return labels


def _read_text(path: Path, what: str) -> str:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise IdentityError(f"{what} cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise IdentityError(f"{what} is larger than {MAX_FILE_BYTES} bytes; a placement of 16k ranks is under 1 MiB")
    return data.decode("utf-8", "replace")


def _whole(name: str, value: str, *, minimum: int, example: str) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise IdentityError(f"{name}={value!r} is not a whole number >= {minimum}; expected e.g. {example}")
    return number


@dataclass(frozen=True, slots=True, kw_only=True)
class _NodePlacement:
    ranks: tuple[int | None, ...]
    nvlink_domain: str | None
    network_tier: str | None


def read_placement(path: Path, *, world_size: int | None) -> dict[str, _NodePlacement]:
    """The nodes of a placement file (see the module docstring).

    Raises:
        IdentityError: naming the file, the field and the value, for anything that does not fit the format or the
            world size.
    """
    what = f"{ENV_PLACEMENT_FILE}={str(path)!r}"
    try:
        doc: Any = yaml.safe_load(_read_text(path, what))
    except yaml.YAMLError as exc:
        raise IdentityError(f"{what} is not JSON or YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(doc, dict) or doc.get("schema") != PLACEMENT_SCHEMA:
        raise IdentityError(f"{what}: expected an object with schema {PLACEMENT_SCHEMA!r} and nodes")
    nodes = doc.get("nodes")
    if not isinstance(nodes, dict) or not nodes:
        raise IdentityError(f"{what}: nodes must be a non-empty object of node name -> {{ranks, ...}}")
    seen: dict[int, str] = {}
    return {
        str(name): _node_placement(f"{what}: nodes[{str(name)!r}]", str(name), entry, world_size, seen)
        for name, entry in nodes.items()
    }


def _node_placement(
    where: str, name: str, entry: object, world_size: int | None, seen: dict[int, str]
) -> _NodePlacement:
    if not isinstance(entry, dict) or not isinstance(entry.get("ranks"), list):
        raise IdentityError(f"{where}: expected an object with a list 'ranks'")
    ranks: list[int | None] = []
    for i, r in enumerate(entry["ranks"]):
        if r is None:
            ranks.append(None)
            continue
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise IdentityError(f"{where}.ranks[{i}] = {r!r}; expected a global rank >= 0 or null")
        if world_size is not None and r >= world_size:
            raise IdentityError(f"{where}.ranks[{i}] = {r} is outside the layout's world of {world_size} ranks")
        if r in seen:
            raise IdentityError(f"{where}.ranks[{i}] = {r} is also placed on node {seen[r]!r}")
        seen[r] = name
        ranks.append(r)
    labels: dict[str, str | None] = {}
    for key in ("nvlink_domain", "network_tier"):
        value = entry.get(key)
        if value is not None and not isinstance(value, str):
            raise IdentityError(f"{where}.{key} = {value!r}; expected a string")
        labels[key] = value
    return _NodePlacement(
        ranks=tuple(ranks), nvlink_domain=labels["nvlink_domain"], network_tier=labels["network_tier"]
    )


def resolve_identity(inputs: IdentityInputs) -> Identity:
    """Work out this pod's identity (module docstring).

    Raises:
        IdentityError: for bad identity (missing job or node name included), naming the variable, its value and what
            would fit.
    """
    if inputs.job is None:
        raise IdentityError(f"{ENV_JOB} is not set; set it to the job's name (the TrainingJob's metadata.name)")
    if inputs.node_name is None:
        raise IdentityError(
            f"{ENV_NODE_NAME} is not set; set it from the downward API: valueFrom.fieldRef.fieldPath: spec.nodeName"
        )
    layout: ParallelLayout | None = None
    if inputs.layout is not None:
        try:
            layout = parse_layout(inputs.layout)
        except LayoutError as exc:
            raise IdentityError(f"{ENV_LAYOUT}={inputs.layout!r}: {exc}; expected e.g. 'tp=2,pp=2,dp=2'") from None
    world = layout.world_size if layout is not None else None
    missing: list[str] = []
    sources: list[str] = []
    nvlink_domain, network_tier = inputs.nvlink_domain, inputs.network_tier
    local: tuple[int | None, ...] | None = None
    nodes: dict[str, _NodePlacement] | None = None
    if inputs.placement_file is not None:
        nodes = read_placement(Path(inputs.placement_file), world_size=world)
        entry = nodes.get(inputs.node_name)
        if entry is None:
            missing.append(
                f"{ENV_PLACEMENT_FILE}={inputs.placement_file!r} does not name node {inputs.node_name!r} "
                f"({len(nodes)} nodes, e.g. {next(iter(nodes))!r})"
            )
        else:
            local = entry.ranks
            nvlink_domain = entry.nvlink_domain if entry.nvlink_domain is not None else nvlink_domain
            network_tier = entry.network_tier if entry.network_tier is not None else network_tier
            sources.append(f"ranks from {inputs.placement_file}")
    else:
        local = _default_ranks(inputs, world, missing, sources)
    if layout is None:
        missing.append(f"{ENV_LAYOUT} is not set: no dp/tp/pp/cp/ep coords (set it as e.g. 'tp=2,pp=2,dp=2')")
    gpus: tuple[LocalGpu, ...] = ()
    if layout is not None and local is not None and not missing:
        gpus = tuple(LocalGpu(gpu=i, rank=r, coord=layout.coord(r)) for i, r in enumerate(local) if r is not None)
        if not gpus:
            missing.append(f"no rank is placed on node {inputs.node_name!r}")
    placement = _world_placement(world, nodes, local) if not missing else None
    return Identity(
        job=sanitize(inputs.job),
        node=sanitize(inputs.node_name),
        nvlink_domain=sanitize(nvlink_domain or ""),
        network_tier=sanitize(network_tier or ""),
        layout=layout,
        gpus=gpus,
        missing=tuple(missing),
        sources=tuple(sources),
        placement=placement,
    )


def _world_placement(
    world: int | None, nodes: dict[str, _NodePlacement] | None, local: tuple[int | None, ...] | None
) -> Placement | None:
    """Every rank's node: from a placement file that places the whole world, or the default consecutive rule."""
    if world is None:
        return None
    if nodes is None:
        if not local:
            return None
        per_node = len(local)
        return Placement.default(world, gpus_per_node=per_node, nvlink_domain_gpus=per_node, nodes_per_network_block=1)
    rank_nodes: list[str | None] = [None] * world
    for name, entry in nodes.items():
        for r in entry.ranks:
            if r is not None:
                rank_nodes[r] = name
    if any(n is None for n in rank_nodes):
        return None
    return Placement.from_node_names([n for n in rank_nodes if n is not None])


def _default_ranks(
    inputs: IdentityInputs, world: int | None, missing: list[str], sources: list[str]
) -> tuple[int | None, ...] | None:
    """Ranks ``n*g .. n*g+g-1`` of node rank ``n`` with ``g`` GPUs per node; ``None`` (and why) when unknown."""
    per_node = None
    if inputs.gpus_per_node is not None:
        per_node = _whole(ENV_GPUS_PER_NODE, inputs.gpus_per_node, minimum=1, example="'8'")
    else:
        missing.append(f"{ENV_GPUS_PER_NODE} is not set: which ranks run here is unknown")
    node_rank = None
    if inputs.node_rank:
        name, value = inputs.node_rank[0]
        node_rank = _whole(name, value, minimum=0, example="'0' (the pod's index among the job's pods)")
        sources.append(f"node rank from {name}={value}")
    else:
        missing.append(
            f"no node rank: none of {ENV_NODE_RANK}, {ENV_JOB_COMPLETION_INDEX}, the pod label "
            f"{COMPLETION_INDEX_LABEL} ({ENV_POD_LABELS_FILE}) or {ENV_PET_NODE_RANK} is set"
        )
    if per_node is None or node_rank is None or world is None:
        return None
    if world % per_node:
        raise IdentityError(
            f"{ENV_GPUS_PER_NODE}={per_node} does not divide the layout's world of {world} ranks; "
            f"expected the ranks per pod, one of {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    nodes = world // per_node
    if node_rank >= nodes:
        name = inputs.node_rank[0][0]
        raise IdentityError(
            f"{name}={node_rank} is outside the job: {world} ranks at {per_node} per node make {nodes} nodes, "
            f"node ranks 0..{nodes - 1}"
        )
    return tuple(range(node_rank * per_node, (node_rank + 1) * per_node))

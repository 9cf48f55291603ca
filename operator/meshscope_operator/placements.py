"""Pure: where a TrainingJob's pods landed, as a placement, the sidecars' document, and the checks' findings.

The placement is the core's :class:`~meshscope.topology.Placement`; the document is ``meshscope.placement/1``; the
findings are the planner's placement checks re-run on it.

Exists because the real placement is known only once the scheduler has bound every pod of the Job to a node, and
node labels are not in the downward API: the operator reads them and publishes the result for the sidecars
(``sidecar/meshscope_sidecar/identity.py`` reads the document: ``nodes -> {nvlink_domain, network_tier, ranks}``).

- Ranks follow the launcher: the pod of completion index ``n`` holds ranks ``n*g .. n*g+g-1`` (``g`` GPUs per node),
  exactly as torchrun numbers them from ``NODE_RANK`` and as the sidecar's default rule does.
- A node's NVLink domain is the value of the domain label (``spec.topology.nvlinkDomainLabel`` when the manifest sets
  it, else the operator's ``MESHSCOPE_OPERATOR_NVLINK_DOMAIN_LABEL``, default ``nvidia.com/gpu.clique``); a node
  without it is a domain of its own. Its network block is the value of the first network tier label it has (closest
  tier first); a node with none shares one block with the others.
- The placement checks are the planner's: :func:`meshscope.plan.plan_job` with this placement. The findings the
  planned (default) placement did not have are the placement's own; those are raised as Events, each code once.
- Two pods on one node cannot be told apart by a node-keyed document: that node is left out of it (its sidecars run
  degraded and say so) and the placement still goes through the checks.

It must not import kopf and must do no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshscope.plan import plan_job
from meshscope.topology import Placement
from meshscope_operator.children import COMPLETION_INDEX_ANNOTATION
from meshscope_operator.injection import LABEL

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from meshscope.jobs import JobSpec
    from meshscope.plan import Finding
    from meshscope_operator.settings import OperatorSettings

SCHEMA = "meshscope.placement/1"
"""The document's schema tag (``meshscope_sidecar.identity.PLACEMENT_SCHEMA``; tests hold the two together)."""
_FINISHED = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True, slots=True, kw_only=True)
class PodEntry:
    """What placement needs of one pod of a TrainingJob's Job."""

    job: str
    """The TrainingJob (label ``meshscope.io/trainingjob``)."""
    name: str
    """The pod."""
    index: int
    """Its completion index (the node rank)."""
    node: str
    """The node it is bound to; empty while unscheduled."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementResult:
    """A placement with everything published about it."""

    placement: Placement
    """The core's placement of every rank."""
    document: dict[str, object]
    """The ``meshscope.placement/1`` document."""
    findings: tuple[Finding, ...]
    """The plan's findings on this placement."""
    new_findings: tuple[Finding, ...]
    """Findings the planned placement does not have and that were not raised before: one Event each."""
    shared_nodes: tuple[str, ...]
    """Nodes holding more than one pod of the job (left out of the document)."""

    def findings_text(self, raised: Iterable[str]) -> str:
        """The ConfigMap's findings document: every finding, and every code raised so far (``raised`` + new)."""
        codes = sorted({*raised, *(f.code for f in self.new_findings)})
        return json.dumps({"findings": [f.to_dict() for f in self.findings], "raised": codes}, sort_keys=True)


def pod_entry(body: Mapping[str, object]) -> PodEntry | None:
    """The :class:`PodEntry` of a live pod with a TrainingJob label and a completion index; ``None`` otherwise."""
    meta = body.get("metadata")
    if not isinstance(meta, Mapping) or meta.get("deletionTimestamp"):
        return None
    labels = meta.get("labels") if isinstance(meta.get("labels"), Mapping) else {}
    annotations = meta.get("annotations") if isinstance(meta.get("annotations"), Mapping) else {}
    job = labels.get(LABEL)  # type: ignore[union-attr]
    raw_index = annotations.get(COMPLETION_INDEX_ANNOTATION, labels.get(COMPLETION_INDEX_ANNOTATION))  # type: ignore[union-attr]
    status = body.get("status")
    if isinstance(status, Mapping) and status.get("phase") in _FINISHED:
        return None
    spec = body.get("spec")
    node = spec.get("nodeName") if isinstance(spec, Mapping) else None
    if not isinstance(job, str) or not job or not isinstance(raw_index, str) or not raw_index.isdigit():
        return None
    return PodEntry(
        job=job, name=str(meta.get("name", "")), index=int(raw_index), node=node if isinstance(node, str) else ""
    )


def label_keys(body: Mapping[str, object], spec: JobSpec, settings: OperatorSettings) -> tuple[str, tuple[str, ...]]:
    """The NVLink domain label and the network tier labels for this job: the manifest's, else the operator's."""
    raw_spec = body.get("spec")
    topology = raw_spec.get("topology") if isinstance(raw_spec, Mapping) else None
    topology = topology if isinstance(topology, Mapping) else {}
    domain = spec.topology.nvlink_domain_label if "nvlinkDomainLabel" in topology else settings.nvlink_domain_label
    tiers = spec.topology.network_tier_labels if "networkTierLabels" in topology else settings.network_tier_labels
    return domain, tuple(tiers)


def nodes_by_index(spec: JobSpec, pods: Iterable[PodEntry]) -> dict[int, str] | str:
    """The node of every completion index, or why it is not known yet (one sentence).

    Args:
        spec: the loaded TrainingJob.
        pods: its live pods (any order; other jobs' pods and out-of-range indices are ignored).
    """
    nodes = spec.hardware.nodes
    seen: dict[int, set[str]] = {}
    for p in pods:
        if p.job == spec.name and 0 <= p.index < nodes:
            seen.setdefault(p.index, set()).add(p.node)
    unscheduled = [i for i in range(nodes) if not seen.get(i) or "" in seen[i]]
    if unscheduled:
        return f"{nodes - len(unscheduled)} of {nodes} pods scheduled (index {unscheduled[0]} is not)"
    doubled = [i for i in range(nodes) if len(seen[i]) > 1]
    if doubled:
        return f"index {doubled[0]} has pods on {len(seen[doubled[0]])} nodes (a pod is being replaced)"
    return {i: next(iter(seen[i])) for i in range(nodes)}


def resolve_placement(
    spec: JobSpec,
    where: Mapping[int, str],
    node_labels: Mapping[str, Mapping[str, str]],
    *,
    domain_label: str,
    tier_labels: Sequence[str],
    planned_codes: Iterable[str],
    raised: Iterable[str],
) -> PlacementResult:
    """The placement of a fully scheduled job, checked.

    Args:
        spec: the loaded TrainingJob.
        where: node of every completion index (:func:`nodes_by_index`).
        node_labels: labels of those nodes (a node missing here has none).
        domain_label: the NVLink domain label key.
        tier_labels: network tier label keys, closest first.
        planned_codes: codes of the findings of the planned (default) placement.
        raised: codes already raised as Events for this job.

    Raises:
        PlanError: if the planner refuses the placement (it does not for a placement of the spec's own world).
    """
    g = spec.hardware.gpus_per_node
    domains: dict[str, str] = {}
    blocks: dict[str, str] = {}
    for node in set(where.values()):
        labels = node_labels.get(node, {})
        if labels.get(domain_label):
            domains[node] = labels[domain_label]
        tier = next((labels[k] for k in tier_labels if labels.get(k)), None)
        if tier is not None:
            blocks[node] = tier
    rank_nodes = [where[r // g] for r in range(spec.world_size)]
    placement = Placement.from_node_names(rank_nodes, node_domains=domains, node_blocks=blocks)
    findings = plan_job(spec, placement=placement).findings
    counts: dict[str, int] = {}
    for node in where.values():
        counts[node] = counts.get(node, 0) + 1
    shared = tuple(sorted(n for n, c in counts.items() if c > 1))
    entries: dict[str, object] = {}
    for index in sorted(where):
        node = where[index]
        if node in shared:
            continue
        entries[node] = {
            "nvlink_domain": domains.get(node),
            "network_tier": blocks.get(node),
            "ranks": list(range(index * g, (index + 1) * g)),
        }
    skip = {*planned_codes, *raised}
    new = tuple(f for f in findings if f.code not in skip)
    return PlacementResult(
        placement=placement,
        document={"schema": SCHEMA, "nodes": entries},
        findings=findings,
        new_findings=new,
        shared_nodes=shared,
    )


def raised_codes(findings_text: object) -> frozenset[str]:
    """The codes already raised, from a stored ConfigMap's findings document (bad or missing: none)."""
    if not isinstance(findings_text, str):
        return frozenset()
    try:
        doc = json.loads(findings_text)
    except ValueError:
        return frozenset()
    raised = doc.get("raised") if isinstance(doc, dict) else None
    return frozenset(c for c in raised or () if isinstance(c, str)) if isinstance(raised, list) else frozenset()


def describe(result: PlacementResult) -> str:
    """One line: pods, nodes, NVLink domains, network blocks."""
    p = result.placement
    text = (
        f"{p.world_size:,} ranks on {p.nodes:,} nodes in {len(set(p.domain_of_node.tolist())):,} NVLink domains and "
        f"{len(set(p.block_of_node.tolist())):,} network blocks, {len(result.findings)} findings"
    )
    if result.shared_nodes:
        text += f"; nodes holding two pods, left out of the placement: {', '.join(result.shared_nodes[:5])}"
    return text

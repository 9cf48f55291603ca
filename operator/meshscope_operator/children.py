"""Pure: the objects a TrainingJob owns — an Indexed ``batch/v1`` Job, a headless Service, the placement ConfigMap.

Exists so that what the operator materialises is built in one place, from the loaded spec and the raw pod template
(``spec.template``, docs/spec.md), and can be compared with what is stored:

- the **Job** (named as the TrainingJob): ``completionMode: Indexed``, ``completions = parallelism = nodes``, one pod
  per node; the pod template is the user's with the sidecar injected exactly as the pod webhook injects it
  (:func:`~meshscope_operator.injection.injection_for`, so both paths stay one), plus the launcher environment of
  :func:`launcher_env` and the placement ConfigMap mounted into the sidecar; ``subdomain`` is the Service, so pod
  ``NAME-0`` is ``NAME-0.NAME.NAMESPACE.svc`` (Indexed Jobs name pod host names ``$(job-name)-$(index)``:
  kubernetes.io/docs/concepts/workloads/controllers/job/#completion-mode);
- the **Service** (same name): ``clusterIP: None``, ``publishNotReadyAddresses: true`` (rank 0 must resolve before
  any pod is ready: the ranks rendezvous before they serve anything), selecting the Job's pods;
- the **placement ConfigMap** ``NAME-placement`` (:mod:`~meshscope_operator.placements` fills it).

All three carry an ``ownerReference`` to the TrainingJob (``controller: true``), so deleting the TrainingJob deletes
them (the garbage collector), and the label ``meshscope.io/trainingjob=NAME``. The Job carries the hash of what it
was built from (:data:`SPEC_HASH_ANNOTATION`): a Job's pod template cannot be changed once created, so a later spec
that needs another Job is detected by comparing hashes (reconcile then says ``RestartRequired``).

It must not import kopf and must do no I/O. A spec that cannot be materialised raises :class:`ChildError` with the
field, the value and what would fit.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jsonpatch

from meshscope_operator.injection import (
    LABEL,
    SIDECAR_NAME,
    Outcome,
    injection_for,
    target_from_spec,
)

if TYPE_CHECKING:
    from meshscope.jobs import JobSpec
    from meshscope_operator.settings import OperatorSettings

SPEC_HASH_ANNOTATION = "meshscope.io/spec-hash"
"""On the Job: SHA-256 of the Job spec it was created with (:func:`job_hash`)."""
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
"""Set by the Job controller on every pod of an Indexed Job (kubernetes.io/docs/reference/labels-annotations-taints)."""
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
"""Set by the Job controller on its pods (Kubernetes >= 1.27); the Service selects on it."""
PLACEMENT_KEY = "placement.json"
"""The ConfigMap key holding the ``meshscope.placement/1`` document."""
FINDINGS_KEY = "findings.json"
"""The ConfigMap key holding the placement checks' findings (the codes already raised as Events)."""
PLACEMENT_DIR = "/etc/meshscope/placement"
PLACEMENT_FILE = f"{PLACEMENT_DIR}/{PLACEMENT_KEY}"
"""``MESHSCOPE_PLACEMENT_FILE`` in the sidecar."""
VOLUME_PLACEMENT = "meshscope-placement"
MAX_PLACED_NODES = 4096
"""Largest job (nodes) whose placement is published: at about 200 bytes a node the document stays under 1 MiB, the
ConfigMap limit. Larger jobs get no placement volume; their sidecars use the default rank rule."""
MAX_HOSTNAME_CHARS = 63
"""A pod host name (``NAME-INDEX``) and a Service name are DNS labels (RFC 1123): at most 63 characters."""
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

# The launcher's variables: torchrun reads each of its options from PET_<OPTION> when not given on the command line
# (torch/distributed/argparse_util.py, class env), so `torchrun train.py` needs no arguments in these pods.
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_NNODES = "NNODES"
ENV_NPROC_PER_NODE = "NPROC_PER_NODE"
ENV_NODE_RANK = "NODE_RANK"
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"
ENV_MESHSCOPE_NODE_RANK = "MESHSCOPE_NODE_RANK"
"""The sidecar's node rank (``meshscope_sidecar.identity``), first in its order of precedence."""
ENV_PLACEMENT_FILE = "MESHSCOPE_PLACEMENT_FILE"


class ChildError(ValueError):
    """The spec cannot be materialised: names the field, its value and what would fit."""


def placement_name(name: str) -> str:
    """The placement ConfigMap of TrainingJob ``name``."""
    return f"{name}-placement"


def master_addr(name: str, namespace: str) -> str:
    """Pod 0's stable DNS name: ``NAME-0.NAME.NAMESPACE.svc`` (host name, subdomain = the headless Service)."""
    return f"{name}-0.{name}.{namespace}.svc"


def publishes_placement(spec: JobSpec) -> bool:
    """Whether the operator publishes (and the pods mount) a placement for this job."""
    return spec.monitoring.enabled and spec.hardware.nodes <= MAX_PLACED_NODES


def owner_reference(body: Mapping[str, object]) -> dict[str, object]:
    """The ``ownerReference`` of the TrainingJob ``body``.

    Raises:
        ChildError: if the object has no ``metadata.uid`` (every object a real API server returns has one).
    """
    meta = body.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    uid = meta.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ChildError("metadata.uid: missing; an ownerReference needs the TrainingJob's uid")
    return {
        "apiVersion": str(body.get("apiVersion", "meshscope.io/v1alpha1")),
        "kind": "TrainingJob",
        "name": str(meta.get("name", "")),
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned_by(obj: Mapping[str, object], uid: str) -> bool:
    """Whether ``obj`` has an ownerReference to the object of ``uid``."""
    meta = obj.get("metadata")
    refs = meta.get("ownerReferences") if isinstance(meta, Mapping) else None
    return any(isinstance(r, Mapping) and r.get("uid") == uid for r in refs or ())


def check_names(name: str, nodes: int) -> None:
    """Refuse a name the children cannot take.

    Raises:
        ChildError: if ``NAME`` is not a DNS-1035 label (the Service's name) or ``NAME-<last index>`` is longer than a
            host name may be.
    """
    longest = f"{name}-{nodes - 1}"
    if not _DNS_1035.match(name) or len(longest) > MAX_HOSTNAME_CHARS:
        room = MAX_HOSTNAME_CHARS - len(f"-{nodes - 1}")
        raise ChildError(
            f"metadata.name: {name!r} cannot name the headless Service and the pods' host names ({longest!r}); "
            f"use a name of lower-case letters, digits and '-', starting with a letter, at most {room} characters"
        )


def labels(name: str) -> dict[str, str]:
    """Labels of every child."""
    return {LABEL: name, "app.kubernetes.io/managed-by": "meshscope-operator"}


def _metadata(body: Mapping[str, object], name: str, namespace: str) -> dict[str, object]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": labels(_name(body)),
        "ownerReferences": [owner_reference(body)],
    }


def _name(body: Mapping[str, object]) -> str:
    meta = body.get("metadata")
    return str(meta.get("name", "")) if isinstance(meta, Mapping) else ""


def launcher_env(spec: JobSpec, settings: OperatorSettings) -> list[dict[str, object]]:
    """The launcher's variables in every training container: world size, node rank, master, processes per node.

    Each is also set as ``PET_<NAME>``, where torchrun reads its options from.
    """
    addr = master_addr(spec.name, spec.namespace)
    index = {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}}
    values: list[tuple[str, str | None]] = [
        (ENV_WORLD_SIZE, str(spec.world_size)),
        (ENV_NNODES, str(spec.hardware.nodes)),
        (ENV_NPROC_PER_NODE, str(spec.hardware.gpus_per_node)),
        (ENV_NODE_RANK, None),
        (ENV_MASTER_ADDR, addr),
        (ENV_MASTER_PORT, str(settings.master_port)),
    ]
    env: list[dict[str, object]] = []
    for key, value in values:
        for name in (key, f"PET_{key}"):
            if name == "PET_WORLD_SIZE":
                continue  # torchrun has no --world-size: it is nnodes x nproc-per-node
            env.append(
                {"name": name, "valueFrom": copy.deepcopy(index)} if value is None else {"name": name, "value": value}
            )
    return env


def pod_template(body: Mapping[str, object], spec: JobSpec, settings: OperatorSettings) -> dict[str, object]:
    """The Job's pod template: ``spec.template`` with the sidecar, the launcher environment and the placement volume.

    Raises:
        ChildError: if the template has no containers, or a ``restartPolicy`` a Job cannot run.
    """
    raw_spec = body.get("spec")
    raw = raw_spec.get("template") if isinstance(raw_spec, Mapping) else None
    template: dict[str, object] = copy.deepcopy(dict(raw)) if isinstance(raw, Mapping) else {}
    meta = template.get("metadata")
    meta = dict(meta) if isinstance(meta, Mapping) else {}
    pod_spec = template.get("spec")
    pod_spec = dict(pod_spec) if isinstance(pod_spec, Mapping) else {}
    containers = pod_spec.get("containers")
    if not isinstance(containers, list) or not containers or not all(isinstance(c, Mapping) for c in containers):
        raise ChildError(
            f"spec.template.spec.containers: {_show(containers)}; the pod template needs a list of at least one "
            "container (the training process)"
        )
    policy = pod_spec.setdefault("restartPolicy", "Never")
    if policy not in ("Never", "OnFailure"):
        raise ChildError(f"spec.template.spec.restartPolicy: {policy!r}; a Job's pods need Never or OnFailure")
    meta["labels"] = {**(meta.get("labels") if isinstance(meta.get("labels"), Mapping) else {}), LABEL: spec.name}  # type: ignore[dict-item]
    pod_spec["subdomain"] = spec.name
    pod: dict[str, object] = {"metadata": meta, "spec": pod_spec}
    target = target_from_spec(spec)
    injection = injection_for(pod, target, settings)
    if injection.outcome is Outcome.INJECTED:
        pod = jsonpatch.apply_patch(pod, [dict(op) for op in injection.patch])
    elif injection.outcome is Outcome.UNPATCHABLE:
        raise ChildError(f"spec.template: {'; '.join(injection.warnings)}")
    final_spec = pod["spec"]
    assert isinstance(final_spec, dict)  # built above
    launcher = launcher_env(spec, settings)
    for container in final_spec["containers"]:
        env = container.setdefault("env", [])
        have = {e.get("name") for e in env if isinstance(e, Mapping)}
        env.extend(e for e in launcher if e["name"] not in have)
    if injection.outcome is Outcome.INJECTED:
        _placement_into_sidecar(final_spec, spec)
    return pod


def _placement_into_sidecar(pod_spec: dict[str, object], spec: JobSpec) -> None:
    """The sidecar's node rank from the completion index, and the placement ConfigMap mounted for it."""
    init = pod_spec.get("initContainers")
    found = [c for c in init if isinstance(c, dict) and c.get("name") == SIDECAR_NAME] if isinstance(init, list) else []
    if not found:
        return
    sidecar = found[0]
    env = sidecar.setdefault("env", [])
    env.append(
        {
            "name": ENV_MESHSCOPE_NODE_RANK,
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}},
        }
    )
    if not publishes_placement(spec):
        return
    env.append({"name": ENV_PLACEMENT_FILE, "value": PLACEMENT_FILE})
    sidecar.setdefault("volumeMounts", []).append(
        {"name": VOLUME_PLACEMENT, "mountPath": PLACEMENT_DIR, "readOnly": True}
    )
    volumes = pod_spec.setdefault("volumes", [])
    assert isinstance(volumes, list)
    # Not optional on purpose: the kubelet keeps the pod in ContainerCreating until the operator has published where
    # every pod landed, so the sidecar, which reads its identity once at startup, starts with the real placement.
    volumes.append(
        {
            "name": VOLUME_PLACEMENT,
            "configMap": {"name": placement_name(spec.name), "items": [{"key": PLACEMENT_KEY, "path": PLACEMENT_KEY}]},
        }
    )


def job_spec_of(body: Mapping[str, object], spec: JobSpec, settings: OperatorSettings) -> dict[str, object]:
    """The Job's ``spec``."""
    check_names(spec.name, spec.hardware.nodes)
    nodes = spec.hardware.nodes
    return {
        "completionMode": "Indexed",
        "completions": nodes,
        "parallelism": nodes,
        "template": pod_template(body, spec, settings),
    }


def job_hash(job_spec: Mapping[str, object]) -> str:
    """SHA-256 of a Job spec's canonical JSON (sorted keys), hex."""
    return hashlib.sha256(json.dumps(job_spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def job_manifest(body: Mapping[str, object], spec: JobSpec, settings: OperatorSettings) -> dict[str, object]:
    """The Indexed Job of TrainingJob ``body`` (loaded as ``spec``).

    Raises:
        ChildError: for a name or template that cannot be materialised.
    """
    job_spec = job_spec_of(body, spec, settings)
    meta = _metadata(body, spec.name, spec.namespace)
    meta["annotations"] = {SPEC_HASH_ANNOTATION: job_hash(job_spec)}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": job_spec}


def service_manifest(body: Mapping[str, object], spec: JobSpec) -> dict[str, object]:
    """The headless Service of TrainingJob ``body``."""
    check_names(spec.name, spec.hardware.nodes)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(body, spec.name, spec.namespace),
        "spec": service_spec(spec.name),
    }


def service_spec(name: str) -> dict[str, object]:
    """The Service's ``spec``: headless, selecting the Job's pods, addresses published before readiness."""
    return {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {LABEL: name, JOB_NAME_LABEL: name}}


def service_drift(stored: Mapping[str, object], name: str) -> dict[str, object] | None:
    """The merge patch that puts a stored Service's selector and ``publishNotReadyAddresses`` back; ``None`` if none."""
    wanted = service_spec(name)
    spec = stored.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    patch = {k: wanted[k] for k in ("selector", "publishNotReadyAddresses") if spec.get(k) != wanted[k]}
    return {"spec": patch} if patch else None


def placement_manifest(
    body: Mapping[str, object], name: str, namespace: str, *, placement: str, findings: str
) -> dict[str, object]:
    """The placement ConfigMap with its two documents (JSON text)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(body, placement_name(name), namespace),
        "data": {PLACEMENT_KEY: placement, FINDINGS_KEY: findings},
    }


def stored_hash(job: Mapping[str, object]) -> str:
    """The spec hash a stored Job was created with (empty if none)."""
    meta = job.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    value = annotations.get(SPEC_HASH_ANNOTATION) if isinstance(annotations, Mapping) else None
    return value if isinstance(value, str) else ""


def _show(value: object) -> str:
    if value is None:
        return "missing"
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:79] + "…"

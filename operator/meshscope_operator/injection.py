"""The pod webhook's work: the JSON patch that adds the meshscope sidecar to a training pod, built from pure data.

Exists so that pods made by any launcher (JobSet, PyTorchJob, a plain Indexed Job) get the same sidecar as the pods
the operator makes itself: a native sidecar (an init container with ``restartPolicy: Always``, Kubernetes >= 1.29:
it starts before the training containers and outlives them), the volumes it shares with them (the record socket's
``emptyDir``, the NCCL log directory, the host's sysfs read-only for the InfiniBand counters, the downward API's
labels file), its ``MESHSCOPE_*`` settings, and the variables the training containers need (``MESHSCOPE_COLLECTOR``
and the rest of the SDK's, ``NCCL_DEBUG*`` for the NCCL source). The variable names are the sidecar's
(``sidecar/meshscope_sidecar/settings.py`` and ``identity.py``) and the SDK's (``docs/sdk.md``); the operator cannot
import the sidecar (the two are independent), so tests/operator/test_injection.py holds these names against them.

Everything here is pure: :func:`injection_for` takes the pod, what the operator knows of its TrainingJob and the
settings, and returns RFC 6902 operations and warnings. It must not raise on any pod (a pod this cannot patch is left
as it is, with a warning: the webhook fails open), must not change what the user set (a variable or mount the
container already has is kept), and must be idempotent (a pod that has the sidecar gets no patch).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Final, Literal, TypedDict

from meshscope.errors import MeshscopeError
from meshscope.local import layout_text
from meshscope_operator.reviews import bounded_warning
from meshscope_operator.spec import ObjectMeta, job_spec

if TYPE_CHECKING:
    from meshscope.jobs import JobSpec
    from meshscope_operator.settings import OperatorSettings

LABEL = "meshscope.io/trainingjob"
"""Pod label naming the TrainingJob (same namespace) whose sidecar the pod gets."""
INJECTED_ANNOTATION = "meshscope.io/sidecar-injected"
"""Set on an injected pod (value: the sidecar image), so that people and the reconciler can tell."""
SIDECAR_NAME = "meshscope-sidecar"
"""Name of the injected init container; a pod with a container of this name is not injected again."""

RUN_DIR = "/run/meshscope"
"""The record socket's directory in both containers (``meshscope_sidecar.settings.DEFAULT_SOCKET``)."""
SOCKET = f"unix:{RUN_DIR}/records.sock"
"""The ranks' ``MESHSCOPE_COLLECTOR`` and the sidecar's ``MESHSCOPE_SIDECAR_SOCKETS``."""
NCCL_LOG_DIR = "/var/log/meshscope/nccl"
"""Where the training containers' NCCL writes its debug logs and the sidecar follows them."""
NCCL_DEBUG_FILE = f"{NCCL_LOG_DIR}/nccl.%h.%p"
"""``NCCL_DEBUG_FILE``: one file per process (NCCL expands ``%h`` to the host name and ``%p`` to the pid; NCCL's
environment variables documentation)."""
INFINIBAND_ROOT = "/sys/class/infiniband"
"""``MESHSCOPE_SIDECAR_INFINIBAND_ROOT``: the RDMA devices in the sidecar's own sysfs. The kernel shows a container
every RDMA device in its default (shared) namespace mode, and only the pod's own in exclusive mode: the counters of
the links this pod's NCCL can use either way, with no volume. A ``hostPath`` of the host's ``/sys`` (mounted here
before) is what Pod Security's baseline and restricted levels forbid: the pod was refused in such namespaces, because
of the injection."""
PODINFO_DIR = "/etc/meshscope/podinfo"
"""Mount point of the downward API volume."""
LABELS_FILE = f"{PODINFO_DIR}/labels"
"""``MESHSCOPE_POD_LABELS_FILE``: the pod's labels, one ``key="value"`` per line (downward API), where the sidecar
finds ``batch.kubernetes.io/job-completion-index``: the Job controller sets ``JOB_COMPLETION_INDEX`` only in the
containers of its template, not in one added here."""

VOLUME_RUN = "meshscope-run"
VOLUME_NCCL = "meshscope-nccl-logs"
VOLUME_PODINFO = "meshscope-podinfo"

SIDECAR_UID = 65532
"""The sidecar image's user (sidecar/Dockerfile ``USER 65532:65532``), numeric so ``runAsNonRoot`` can check it."""

# The sidecar's variables (meshscope_sidecar.identity and .settings) and the SDK's (meshscope.sdk.settings).
ENV_JOB = "MESHSCOPE_JOB"
ENV_NODE_NAME = "MESHSCOPE_NODE_NAME"
ENV_LAYOUT = "MESHSCOPE_LAYOUT"
ENV_GPUS_PER_NODE = "MESHSCOPE_GPUS_PER_NODE"
ENV_POD_LABELS_FILE = "MESHSCOPE_POD_LABELS_FILE"
ENV_HOST_IP = "MESHSCOPE_HOST_IP"
"""Ours, not the sidecar's: the node's IP from the downward API, for ``$(MESHSCOPE_HOST_IP)`` in the DCGM URL."""
ENV_SIDECAR_PORT = "MESHSCOPE_SIDECAR_PORT"
ENV_SIDECAR_SOCKETS = "MESHSCOPE_SIDECAR_SOCKETS"
ENV_SIDECAR_DCGM_URL = "MESHSCOPE_SIDECAR_DCGM_URL"
ENV_SIDECAR_NVML = "MESHSCOPE_SIDECAR_NVML"
ENV_SIDECAR_NCCL_LOGS = "MESHSCOPE_SIDECAR_NCCL_LOGS"
ENV_SIDECAR_INFINIBAND = "MESHSCOPE_SIDECAR_INFINIBAND"
ENV_SIDECAR_INFINIBAND_ROOT = "MESHSCOPE_SIDECAR_INFINIBAND_ROOT"
ENV_COLLECTOR = "MESHSCOPE_COLLECTOR"
ENV_NODE = "MESHSCOPE_NODE"
"""The SDK's node name (``meshscope.sdk.settings``): the Kubernetes node, not the pod's host name."""


class Source(StrEnum):
    """The telemetry sources a TrainingJob turns on (``spec.monitoring.sources``)."""

    TRAIN = "train"
    DCGM = "dcgm"
    NCCL = "nccl"
    INFINIBAND = "infiniband"


_SOURCES = frozenset(s.value for s in Source)


class Outcome(StrEnum):
    """What the pod webhook did with a pod."""

    INJECTED = "injected"
    ALREADY_INJECTED = "already-injected"
    DISABLED = "disabled"
    """The TrainingJob says ``monitoring.enabled: false``."""
    NO_TRAININGJOB = "no-trainingjob"
    INVALID_TRAININGJOB = "invalid-trainingjob"
    UNPATCHABLE = "unpatchable"
    """The pod's spec is not what the API server sends (no containers, a list that is not a list)."""


class JsonPatchOp(TypedDict):
    """One RFC 6902 operation; this module only adds."""

    op: Literal["add"]
    path: str
    value: object


class EnvVar(TypedDict, total=False):
    """core/v1 ``EnvVar``."""

    name: str
    value: str
    valueFrom: dict[str, object]


class VolumeMount(TypedDict, total=False):
    """core/v1 ``VolumeMount``."""

    name: str
    mountPath: str
    readOnly: bool


class Container(TypedDict, total=False):
    """core/v1 ``Container``, the keys read or written here."""

    name: str
    image: str
    env: list[EnvVar]
    volumeMounts: list[VolumeMount]
    restartPolicy: str


class PodSpec(TypedDict, total=False):
    """core/v1 ``PodSpec``, the keys read or written here."""

    containers: list[Container]
    initContainers: list[Container]
    volumes: list[dict[str, object]]


class PodBody(TypedDict, total=False):
    """A Pod as the admission request carries it."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: PodSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class InjectionTarget:
    """What the pod webhook needs of a TrainingJob: kept in the operator's index, one per TrainingJob."""

    job: str
    """The TrainingJob's name (``MESHSCOPE_JOB``)."""
    layout: str
    """Its layout as ``MESHSCOPE_LAYOUT`` text (``dp=16,tp=8,pp=4,cp=1,ep=1,vpp=5``)."""
    gpus_per_node: int
    """Ranks per pod (``MESHSCOPE_GPUS_PER_NODE``): one pod per node, as the operator's Indexed Job runs them."""
    enabled: bool = True
    """``spec.monitoring.enabled``."""
    sources: frozenset[Source] = frozenset(Source)
    """``spec.monitoring.sources``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Injection:
    """The pod webhook's answer for one pod."""

    outcome: Outcome
    """What was done."""
    patch: tuple[JsonPatchOp, ...] = ()
    """RFC 6902 operations on the pod; empty unless :attr:`outcome` is ``injected``."""
    warnings: tuple[str, ...] = ()
    """Admission warnings (why there is no sidecar, or what of the user's settings keeps it from seeing data)."""


def target_from_spec(spec: JobSpec) -> InjectionTarget:
    """The :class:`InjectionTarget` of a loaded TrainingJob."""
    return InjectionTarget(
        job=spec.name,
        layout=layout_text(spec.layout),
        gpus_per_node=spec.hardware.gpus_per_node,
        enabled=spec.monitoring.enabled,
        sources=frozenset(Source(s) for s in spec.monitoring.sources if s in _SOURCES),
    )


def target_from_body(body: Mapping[str, object]) -> InjectionTarget | str:
    """The :class:`InjectionTarget` of a TrainingJob object, or the loader's message if it does not load.

    Never raises: the operator's index keeps the message, and the pod webhook repeats it as a warning.
    """
    try:
        return target_from_spec(job_spec(body))
    except MeshscopeError as exc:
        return str(exc)


def injection_for(
    pod: Mapping[str, object], found: InjectionTarget | str | None, settings: OperatorSettings
) -> Injection:
    """What to do with a pod labelled ``meshscope.io/trainingjob``.

    Args:
        pod: the pod being created (the admission request's ``object``).
        found: its TrainingJob as the operator's index holds it: the target, the loader's message if the
            TrainingJob does not load, or ``None`` if there is no TrainingJob of that name in the pod's namespace.
        settings: the operator's settings (image, port, resources, the DCGM URL).

    Returns:
        The patch and the warnings. The pod is never refused: when no sidecar can be added, the patch is empty and a
        warning says why.
    """
    metadata = pod.get("metadata")
    meta: Mapping[str, object] = metadata if isinstance(metadata, Mapping) else {}
    spec = pod.get("spec")
    refused = _no_injection(meta, spec, found)
    if refused is not None:
        return refused
    assert isinstance(found, InjectionTarget)  # _no_injection returned None, so it is one
    assert isinstance(spec, Mapping)  # likewise
    ops: list[JsonPatchOp] = []
    warnings: list[str] = []
    init = spec.get("initContainers")
    sidecar = sidecar_container(found, settings)
    if guaranteed(spec):  # keep the pod Guaranteed: its training containers keep their exclusive, NUMA-aligned CPUs
        sidecar["resources"] = {
            "requests": {"cpu": settings.sidecar_cpu_request, "memory": settings.sidecar_memory_limit},
            "limits": {"cpu": settings.sidecar_cpu_request, "memory": settings.sidecar_memory_limit},
        }
    if isinstance(init, list) and init:
        ops.append(_add("/spec/initContainers/0", sidecar))  # first, so it is up before the other init containers
    else:
        ops.append(_add("/spec/initContainers", [sidecar]))
    ops += _list_adds("/spec/volumes", spec.get("volumes"), _missing_volumes(spec.get("volumes"), found))
    for i, container in enumerate(spec["containers"]):
        ops += _training_container_ops(i, container, found, settings, warnings)
    if isinstance(meta.get("annotations"), Mapping):
        ops.append(_add(f"/metadata/annotations/{_escape(INJECTED_ANNOTATION)}", settings.sidecar_image))
    elif isinstance(metadata, Mapping):
        ops.append(_add("/metadata/annotations", {INJECTED_ANNOTATION: settings.sidecar_image}))
    return Injection(outcome=Outcome.INJECTED, patch=tuple(ops), warnings=tuple(map(bounded_warning, warnings)))


def _no_injection(meta: Mapping[str, object], spec: object, found: InjectionTarget | str | None) -> Injection | None:
    """Why the pod gets no sidecar (an :class:`Injection` without a patch), or ``None`` if it gets one."""
    labels = meta.get("labels")
    job = labels.get(LABEL, "") if isinstance(labels, Mapping) else ""
    where = f"pod {_pod_name(meta)!r}"
    outcome, warning = None, ""
    if _has_sidecar(meta, spec):
        outcome = Outcome.ALREADY_INJECTED
    elif found is None:
        outcome = Outcome.NO_TRAININGJOB
        warning = (
            f"meshscope: no TrainingJob {job!r} in namespace {meta.get('namespace', '')!r} (label {LABEL}); "
            f"{where} runs without the meshscope sidecar"
        )
    elif isinstance(found, str):
        outcome = Outcome.INVALID_TRAININGJOB
        warning = f"meshscope: TrainingJob {job!r} does not load ({found}); {where} runs without the sidecar"
    elif not found.enabled:
        outcome = Outcome.DISABLED
    elif not isinstance(spec, Mapping) or not _containers(spec.get("containers")):
        outcome, warning = Outcome.UNPATCHABLE, f"meshscope: {where} cannot take the sidecar: it has no containers"
    else:
        bad = [key for key in ("initContainers", "volumes") if key in spec and not isinstance(spec[key], list)]
        if bad:
            outcome = Outcome.UNPATCHABLE
            warning = f"meshscope: {where} cannot take the sidecar: spec.{bad[0]} is not a list"
    if outcome is None:
        return None
    return Injection(outcome=outcome, warnings=(bounded_warning(warning),) if warning else ())


_QUANTITY: Final = re.compile(r"\A([0-9]+(?:\.[0-9]+)?)(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?\Z")
_SUFFIX: Final = {
    None: 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50, "Ei": 2.0**60,
}  # fmt: skip


def _quantity(value: object) -> float | None:
    """A Kubernetes quantity (``"96"``, ``"500m"``, ``"1600Gi"``, ``"1e3"`` aside) as a number; ``None`` if not one."""
    match = _QUANTITY.match(str(value).strip()) if isinstance(value, str | int | float) else None
    return None if match is None else float(match.group(1)) * _SUFFIX[match.group(2)]


def guaranteed(spec: Mapping[str, object]) -> bool:
    """Whether a pod spec is of the Guaranteed QoS class: every container's CPU and memory limited, requests equal.

    Its containers then get exclusive CPUs under the static CPU manager and NUMA alignment with their GPUs and NICs
    under the Topology Manager: a sidecar with requests below its limits (Burstable) made such a pod Burstable and
    took that away from the training containers.
    """
    containers: list[Mapping[str, object]] = []
    for key in ("containers", "initContainers"):
        listed = spec.get(key)
        containers += [c for c in (listed if isinstance(listed, list) else []) if isinstance(c, Mapping)]
    if not containers:
        return False
    for container in containers:
        resources = container.get("resources")
        resources = resources if isinstance(resources, Mapping) else {}
        limits, requests = resources.get("limits"), resources.get("requests")
        limits = limits if isinstance(limits, Mapping) else {}
        requests = requests if isinstance(requests, Mapping) else {}
        for name in ("cpu", "memory"):
            limit = _quantity(limits.get(name))
            if limit is None:
                return False
            if name in requests and _quantity(requests.get(name)) != limit:
                return False
    return True


def sidecar_container(target: InjectionTarget, settings: OperatorSettings) -> dict[str, object]:
    """The sidecar as a native sidecar container of ``target``'s pods (sidecar/README.md, "In the pod")."""
    env: list[dict[str, object]] = [
        {"name": ENV_JOB, "value": target.job},
        _field_env(ENV_NODE_NAME, "spec.nodeName"),
        _field_env(ENV_HOST_IP, "status.hostIP"),
        {"name": ENV_LAYOUT, "value": target.layout},
        {"name": ENV_GPUS_PER_NODE, "value": str(target.gpus_per_node)},
        {"name": ENV_POD_LABELS_FILE, "value": LABELS_FILE},
        {"name": ENV_SIDECAR_PORT, "value": str(settings.sidecar_port)},
        {"name": ENV_SIDECAR_SOCKETS, "value": SOCKET},
    ]
    if Source.DCGM in target.sources and settings.dcgm_url:
        env.append({"name": ENV_SIDECAR_DCGM_URL, "value": settings.dcgm_url})
    if Source.DCGM not in target.sources:
        env.append({"name": ENV_SIDECAR_NVML, "value": "off"})  # dcgm stands for the GPU sources, NVML included
    mounts: list[dict[str, object]] = [
        {"name": VOLUME_RUN, "mountPath": RUN_DIR},
        {"name": VOLUME_PODINFO, "mountPath": PODINFO_DIR, "readOnly": True},
    ]
    if Source.NCCL in target.sources:
        env.append({"name": ENV_SIDECAR_NCCL_LOGS, "value": NCCL_LOG_DIR})
        mounts.append({"name": VOLUME_NCCL, "mountPath": NCCL_LOG_DIR, "readOnly": True})
    if Source.INFINIBAND in target.sources:
        env.append({"name": ENV_SIDECAR_INFINIBAND_ROOT, "value": INFINIBAND_ROOT})
    else:
        env.append({"name": ENV_SIDECAR_INFINIBAND, "value": "off"})
    return {
        "name": SIDECAR_NAME,
        "image": settings.sidecar_image,
        "imagePullPolicy": settings.sidecar_image_pull_policy,
        "restartPolicy": "Always",
        "ports": [{"name": "meshscope", "containerPort": settings.sidecar_port, "protocol": "TCP"}],
        "env": env,
        "volumeMounts": mounts,
        "resources": {
            "requests": {"cpu": settings.sidecar_cpu_request, "memory": settings.sidecar_memory_request},
            "limits": {"memory": settings.sidecar_memory_limit},
        },
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": SIDECAR_UID,
            "runAsGroup": SIDECAR_UID,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def pod_volumes(target: InjectionTarget) -> list[dict[str, object]]:
    """The volumes the sidecar and the training containers share, for ``target``'s sources."""
    volumes: list[dict[str, object]] = [
        {"name": VOLUME_RUN, "emptyDir": {}},
        {
            "name": VOLUME_PODINFO,
            "downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]},
        },
    ]
    if Source.NCCL in target.sources:
        volumes.append({"name": VOLUME_NCCL, "emptyDir": {}})
    return volumes


def training_env(target: InjectionTarget, settings: OperatorSettings) -> list[dict[str, object]]:
    """The variables every training container gets (each only where the container does not set it already)."""
    env: list[dict[str, object]] = [
        {"name": ENV_JOB, "value": target.job},
        {"name": ENV_LAYOUT, "value": target.layout},
        _field_env(ENV_NODE, "spec.nodeName"),
    ]
    if Source.TRAIN in target.sources:
        env.append({"name": ENV_COLLECTOR, "value": SOCKET})
    if Source.NCCL in target.sources:
        env += [
            {"name": "NCCL_DEBUG", "value": "INFO"},
            {"name": "NCCL_DEBUG_SUBSYS", "value": settings.nccl_debug_subsys},
            {"name": "NCCL_DEBUG_FILE", "value": NCCL_DEBUG_FILE},
        ]
    return env


# ---------------------------------------------------------------------------------------------------- helpers


def _pod_name(meta: Mapping[str, object]) -> str:
    name = meta.get("name") or (f"{meta.get('generateName')}*" if meta.get("generateName") else "")
    return str(name)


def _containers(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(c, Mapping) for c in value)


def _names(value: object) -> set[str]:
    if not isinstance(value, list):
        return set()
    return {str(item["name"]) for item in value if isinstance(item, Mapping) and "name" in item}


def _has_sidecar(meta: Mapping[str, object], spec: object) -> bool:
    annotations = meta.get("annotations")
    if isinstance(annotations, Mapping) and INJECTED_ANNOTATION in annotations:
        return True
    if not isinstance(spec, Mapping):
        return False
    return SIDECAR_NAME in _names(spec.get("initContainers")) | _names(spec.get("containers"))


def _add(path: str, value: object) -> JsonPatchOp:
    return {"op": "add", "path": path, "value": value}


def _escape(key: str) -> str:
    """A key as one JSON-pointer token (RFC 6901 §3: ``~`` is ``~0``, ``/`` is ``~1``)."""
    return key.replace("~", "~0").replace("/", "~1")


def _list_adds(path: str, existing: object, items: list[dict[str, object]]) -> list[JsonPatchOp]:
    """Append ``items`` to the list at ``path``, creating it when absent (``-`` is the end: RFC 6901 §4)."""
    if not items:
        return []
    if isinstance(existing, list):
        return [_add(f"{path}/-", item) for item in items]
    return [_add(path, items)]


def _missing_volumes(existing: object, target: InjectionTarget) -> list[dict[str, object]]:
    taken = _names(existing)
    return [v for v in pod_volumes(target) if v["name"] not in taken]


def _field_env(name: str, field_path: str) -> dict[str, object]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def _training_container_ops(
    index: int,
    container: Mapping[str, object],
    target: InjectionTarget,
    settings: OperatorSettings,
    warnings: list[str],
) -> list[JsonPatchOp]:
    base = f"/spec/containers/{index}"
    cname = str(container.get("name", index))
    env = container.get("env")
    env_list = env if isinstance(env, list) else None
    have = _names(env_list)
    user_file = next(
        (e.get("value") for e in env_list or [] if isinstance(e, Mapping) and e.get("name") == "NCCL_DEBUG_FILE"),
        None,
    )
    if Source.NCCL in target.sources and "NCCL_DEBUG_FILE" in have and user_file != NCCL_DEBUG_FILE:
        warnings.append(
            f"meshscope: container {cname!r} sets NCCL_DEBUG_FILE={user_file!r}; the sidecar reads NCCL logs from "
            f"{NCCL_LOG_DIR}, so it sees none of this container's"
        )
    ops = _list_adds(f"{base}/env", env_list, [e for e in training_env(target, settings) if e["name"] not in have])
    mounts = container.get("volumeMounts")
    mount_list = mounts if isinstance(mounts, list) else None
    paths = {str(m.get("mountPath")) for m in mount_list or [] if isinstance(m, Mapping)}
    names = _names(mount_list)
    wanted = [{"name": VOLUME_RUN, "mountPath": RUN_DIR}]
    if Source.NCCL in target.sources:
        wanted.append({"name": VOLUME_NCCL, "mountPath": NCCL_LOG_DIR})
    new: list[dict[str, object]] = []
    for m in wanted:
        if m["name"] in names:
            continue
        if m["mountPath"] in paths:
            warnings.append(
                f"meshscope: container {cname!r} already mounts something at {m['mountPath']}; the sidecar's "
                f"{m['name']} volume is not mounted there"
            )
            continue
        new.append(dict(m))
    return ops + _list_adds(f"{base}/volumeMounts", mount_list, new)

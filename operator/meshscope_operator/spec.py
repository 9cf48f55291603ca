"""TrainingJob objects as the API server hands them over, and the one place they become the core's ``JobSpec``.

Exists so that the operator reads a TrainingJob exactly as ``meshscope plan`` reads the same file: through the core
loader (:func:`meshscope.jobs.spec_from_manifest`), with its defaults and its error messages (the field, the value
and what would fit). The raw JSON is typed with ``TypedDict(total=False)``, as kopf's ``_cogs/structs/bodies.py``
types Kubernetes objects: every key may be absent, nothing is trusted.

It must not apply defaults or check fields itself (the loader does, in one place for the CLI, the webhook and the
reconciler), must not plan, and must not import kopf: it is pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, TypedDict

from meshscope.errors import SpecError
from meshscope.jobs import API_VERSION, KIND, spec_from_manifest

if TYPE_CHECKING:
    from meshscope.jobs import JobSpec

GROUP, VERSION = API_VERSION.split("/")
"""``meshscope.io`` and ``v1alpha1``: the CRD's group and served version (crds/trainingjobs.meshscope.io.yaml)."""
GENERATED_SUFFIX = "00000"
"""Stands in for the five characters the API server appends to a ``generateName`` after admission."""
PLURAL = "trainingjobs"
"""The CRD's plural name, as admission requests and API paths spell the resource."""

__all__ = ["GROUP", "KIND", "PLURAL", "VERSION", "ObjectMeta", "TrainingJobBody", "job_spec", "spec_changed"]


class ObjectMeta(TypedDict, total=False):
    """``metadata`` of any object, the keys meshscope reads (core/v1 ``ObjectMeta``)."""

    name: str
    generateName: str
    namespace: str
    uid: str
    generation: int
    resourceVersion: str
    labels: dict[str, str]
    annotations: dict[str, str]
    deletionTimestamp: str
    finalizers: list[str]


class TrainingJobBody(TypedDict, total=False):
    """A TrainingJob as JSON: ``spec`` is the CRD's (docs/spec.md); ``status`` is the operator's own."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: dict[str, object]
    status: dict[str, object]


# What the API server adds to every object and a user never writes: not part of the spec the loader checks.
_SERVER_METADATA = ("metadata", "status")


def job_spec(body: Mapping[str, object]) -> JobSpec:
    """The core's :class:`~meshscope.jobs.JobSpec` of a TrainingJob object.

    Args:
        body: the object as the API server sends it (an admission request's ``object``, a watch event's body):
            ``apiVersion``, ``kind``, ``metadata`` (of which only ``name`` and ``namespace`` are read; the server's
            own fields, ``uid``, ``managedFields``, ..., are dropped first) and ``spec``; ``status`` is ignored.

    Returns:
        The validated spec with every default applied.

    Raises:
        SpecError: naming the field, the value and what would fit, exactly as ``meshscope plan`` would for the same
            manifest in a file.
    """
    if not isinstance(body, Mapping):
        raise SpecError("", f"expected a TrainingJob object (a mapping), got {type(body).__name__}")
    manifest: dict[str, object] = {k: v for k, v in body.items() if k not in _SERVER_METADATA}
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping):
        meta = {k: metadata[k] for k in ("name", "namespace") if k in metadata}
        generate = metadata.get("generateName")
        if "name" not in meta and isinstance(generate, str) and generate:
            # A create with generateName reaches admission before the server picks the name (it appends five
            # random characters: k8s.io/apiserver pkg/storage/names/generate.go); check a name of that shape.
            meta["name"] = generate + GENERATED_SUFFIX
        manifest["metadata"] = meta
    elif metadata is not None:
        manifest["metadata"] = metadata  # not a mapping: the loader names it
    return spec_from_manifest(manifest)


def spec_changed(new: Mapping[str, object] | None, old: Mapping[str, object] | None) -> bool:
    """Whether an update changes the TrainingJob's ``spec`` (rather than only its metadata or status).

    Args:
        new: the object after the update.
        old: the object before it; ``None`` for a create.

    Returns:
        ``True`` for a create, or when ``spec`` differs.
    """
    if old is None or new is None:
        return True
    return bool(new.get("spec") != old.get("spec"))

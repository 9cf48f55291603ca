"""The Helm chart rendered by real Helm (helm-python-sdk: Helm v4's Go SDK in the wheel), for tests/chart.

Each supported configuration is a values file in ``charts/meshscope/ci/`` (STYLE.md §7); :func:`render` renders one
offline, the way ``helm template`` does (``lookup`` returns nothing, so self-signed certificates are fresh each time),
and returns the manifests as objects. Renders are cached per values: every test reads the same objects.

Importable by name (``pythonpath = ["tests"]``), like ``operator_serving``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "meshscope"
RELEASE = "demo"
NAMESPACE = "ml"
KUBE_VERSION = "1.32.0"
CONFIGURATIONS = sorted(p.name.removesuffix("-values.yaml") for p in (CHART / "ci").glob("*-values.yaml"))
"""The supported configurations: ``default``, ``cert-manager``, ``no-crds``, ``custom``, ..."""


@dataclass(frozen=True)
class Rendered:
    """One render: every object (in template order), and NOTES.txt."""

    objects: tuple[dict[str, Any], ...]
    notes: str

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if name is None or o["metadata"]["name"] == name]
        assert len(found) == 1, f"{len(found)} {kind} objects named {name!r}"
        return found[0]


def ci_values(configuration: str) -> dict[str, Any]:
    """The values of ``charts/meshscope/ci/<configuration>-values.yaml``."""
    return yaml.safe_load((CHART / "ci" / f"{configuration}-values.yaml").read_text()) or {}


def render(values: dict[str, Any] | None = None, *, release: str = RELEASE, namespace: str = NAMESPACE) -> Rendered:
    """Render the chart with ``values`` (merged over values.yaml by Helm, checked against values.schema.json)."""
    return _render(json.dumps(values or {}, sort_keys=True), release, namespace)


@functools.cache
def _render(values_json: str, release: str, namespace: str) -> Rendered:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(json.loads(values_json), name=release, namespace=namespace)
    objects = []
    notes = ""
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return Rendered(objects=tuple(objects), notes=notes)


def render_configuration(configuration: str) -> Rendered:
    """Render one of the supported configurations."""
    return render(ci_values(configuration))


def schema_error(values: dict[str, Any]) -> str | None:
    """Helm's message when ``values`` break values.schema.json, ``None`` when they fit."""
    with helm.Chart.load(str(CHART)) as chart:
        try:
            chart.validate_schema(values)
        except helm.HelmValuesError as exc:
            return str(exc)
    return None

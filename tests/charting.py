"""The Helm chart rendered by real Helm (helm-python-sdk: Helm v4's Go SDK in the wheel), for tests/chart.

Each supported configuration is a values file in ``charts/meshscope/ci/`` (STYLE.md §7); :func:`render` renders one
offline, the way ``helm template`` does (``lookup`` returns nothing, so self-signed certificates are fresh each time),
and returns the manifests as objects. Renders are cached per values: every test reads the same objects.

Importable by name (``pythonpath = ["tests"]``), like ``operator_serving``.
"""

from __future__ import annotations

import functools
import json
import re
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


def container(rendered: Rendered) -> dict[str, Any]:
    (only,) = rendered.one("Deployment")["spec"]["template"]["spec"]["containers"]
    return only


def kubelet_env(env: list[dict[str, Any]]) -> dict[str, str]:
    """The environment the process sees: Kubernetes' ``$(VAR)`` expansion of each value, in order.

    As k8s.io/kubernetes ``third_party/forked/golang/expansion``: ``$$`` is a literal ``$``, ``$(NAME)`` becomes the
    value of a variable defined earlier in the list and stays as written otherwise.
    """
    seen: dict[str, str] = {}
    for item in env:
        assert set(item) == {"name", "value"}, item  # every setting is a plain value
        seen[item["name"]] = re.sub(
            r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
            lambda m: "$" if m.group(0) == "$$" else seen.get(m.group(1), m.group(0)),
            item["value"],
        )
    return seen


def chart_webhooks(rendered: Rendered) -> dict[str, dict[str, Any]]:
    out = {}
    for kind, reason in (
        ("ValidatingWebhookConfiguration", "validating"),
        ("MutatingWebhookConfiguration", "mutating"),
    ):
        for webhook in rendered.one(kind)["webhooks"]:
            out[f"{reason}/{webhook['name']}"] = webhook
    return out


def schema_error(values: dict[str, Any]) -> str | None:
    """Helm's message when ``values`` break values.schema.json, ``None`` when they fit."""
    with helm.Chart.load(str(CHART)) as chart:
        try:
            chart.validate_schema(values)
        except helm.HelmValuesError as exc:
            return str(exc)
    return None


# -- values.yaml's `# --` comments: the README's "Values" table ------------------------------------------------------

VALUES_BEGIN = "<!-- values: generated from values.yaml by `python tests/charting.py`; do not edit -->"
VALUES_END = "<!-- values: end -->"


@dataclass(frozen=True)
class DocumentedValue:
    """One key of values.yaml with a ``# --`` comment above it."""

    path: str
    default: Any
    description: str


def documented_values(text: str | None = None) -> list[DocumentedValue]:
    """Every ``# --``-documented key of values.yaml, in file order, with its default and its comment's text.

    The comment is the ``# --`` line and every ``#`` line after it up to the key; a key's path comes from the
    indentation of the keys above it (two spaces a level, as values.yaml is written).
    """
    text = (CHART / "values.yaml").read_text() if text is None else text
    values = yaml.safe_load(text)
    out: list[DocumentedValue] = []
    stack: list[tuple[int, str]] = []
    doc: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            doc = [stripped.removeprefix("# --").strip()]
            continue
        if stripped.startswith("#"):
            if doc is not None:
                doc.append(stripped.removeprefix("#").strip())
            continue
        if not stripped or stripped.startswith("- ") or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        key = stripped.split(":", 1)[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        if doc is not None:
            path = [k for _, k in stack]
            default: Any = values
            for k in path:
                default = default[k]
            out.append(DocumentedValue(path=".".join(path), default=default, description=" ".join(doc)))
            doc = None
    return out


def values_table() -> str:
    """The README's "Values" table."""
    rows = ["| Key | Default | Description |", "|---|---|---|"]
    for value in documented_values():
        default = json.dumps(value.default, separators=(", ", ": "))
        description = value.description.replace("|", r"\|")
        rows.append(f"| `{value.path}` | `{default}` | {description} |")
    return "\n".join(rows)


def readme_with_values_table(readme: str) -> str:
    """``readme`` with the text between the two markers replaced by :func:`values_table`."""
    head, _, rest = readme.partition(VALUES_BEGIN)
    _, _, tail = rest.partition(VALUES_END)
    return f"{head}{VALUES_BEGIN}\n{values_table()}\n{VALUES_END}{tail}"


if __name__ == "__main__":
    readme_path = CHART / "README.md"
    readme_path.write_text(readme_with_values_table(readme_path.read_text()))

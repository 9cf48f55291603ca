"""The Helm chart rendered by real Helm (helm-python-sdk: Helm v4's Go SDK in the wheel), for tests/chart.

Each supported configuration is a values file in ``charts/meshscope/ci/`` (STYLE.md §7); :func:`render` renders one
offline, the way ``helm template`` does (``lookup`` returns nothing, so self-signed certificates are fresh each time),
and returns the manifests as objects. Renders are cached per values: every test reads the same objects.

Importable by name (``pythonpath = ["tests"]``), like ``operator_serving``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import helm_python as helm
import kmock
import yaml

if TYPE_CHECKING:
    from collections.abc import Iterator

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
    """Render the chart with ``values`` (merged over values.yaml by Helm, checked against values.schema.json).

    Renders are cached; each call gets its own copy of the objects, so that a test changing one cannot change what
    the next test reads.
    """
    return copy.deepcopy(_render(json.dumps(values or {}, sort_keys=True), release, namespace))


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


# -- kmock, the Kubernetes API emulator, served on loopback ---------------------------------------------------------

API_TIMEOUT_S = 30.0


class KmockApi:
    """kmock's emulator with ``resources`` declared, served on loopback from a thread and loop of its own (every
    wait bounded); :meth:`close` stops both."""

    def __init__(self, resources: dict[str, dict[str, Any]]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kmock", daemon=True)
        self.thread.start()
        self.emulator, self.server = self.run(self._start(resources))
        self.url = str(self.server.url).rstrip("/")

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(API_TIMEOUT_S)

    @staticmethod
    async def _start(resources: dict[str, dict[str, Any]]) -> tuple[Any, Any]:
        emulator = kmock.KubernetesEmulator()
        await emulator.__aenter__()
        server = kmock.Server(emulator)
        await server.__aenter__()
        for key, info in resources.items():
            emulator.resources[key] = kmock.ResourceInfo(**info)
        return emulator, server

    def paths(self) -> list[str]:
        """The paths of every request the API has had, in order."""

        async def collect() -> list[str]:
            return [request.url.path for request in self.emulator]

        return list(self.run(collect()))

    async def _stop(self) -> None:
        await self.server.__aexit__(None, None, None)
        await self.emulator.__aexit__(None, None, None)

    def close(self) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(API_TIMEOUT_S)
        if not self.thread.is_alive():
            self.loop.close()


OPERATOR_RESOURCES: dict[str, dict[str, Any]] = {
    # what kopf waits for before any watch (shared/reference/kubernetes-testing.md, trap T5)
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition",
        "namespaced": False,
        "verbs": {"list", "watch"},
    },
    "v1/namespaces": {"kind": "Namespace", "namespaced": False, "verbs": {"list", "watch"}},
    # the pod webhook's resource: kopf serves a webhook only for resources discovery lists
    "v1/pods": {"kind": "Pod", "namespaced": True, "verbs": {"list", "watch", "get"}},
    "meshscope.io/v1alpha1/trainingjobs": {
        "kind": "TrainingJob",
        "namespaced": True,
        "verbs": {"list", "watch", "get", "patch"},
        "subresources": {"status"},
    },
}
"""What the operator needs of the API to start and serve its webhooks."""


# -- meshscope-operator in a process of its own, started with the rendered Deployment's environment ------------------


@dataclass(frozen=True)
class OperatorProcess:
    """A running ``meshscope-operator`` and where it listens."""

    process: subprocess.Popen[bytes]
    webhook_port: int
    liveness_port: int
    log: Path
    """Its stdout and stderr (a file, never a pipe: kopf logs every request, and a full pipe would stop it)."""

    def ready(self, timeout_s: float, api: KmockApi) -> str | None:
        """Wait until kopf's /healthz answers 200 and kopf has asked ``api`` for TrainingJobs (it logged in: /healthz
        alone answers before kopf's first API call); ``None`` then, else why not (the process' last output)."""
        deadline = time.monotonic() + timeout_s
        healthy = False
        while time.monotonic() < deadline and self.process.poll() is None:
            if not healthy:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=5) as r:
                        healthy = r.status == 200
                except OSError:
                    pass
            if healthy and any(path.endswith("/trainingjobs") for path in api.paths()):
                return None
            time.sleep(0.1)
        self.stop()
        err = self.log.read_text(errors="replace")
        return f"not ready within {timeout_s} s (exit status {self.process.returncode}): {err[-1500:]}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def operator_process(
    rendered: Rendered, workdir: Path, api_url: str, argv: list[str] | None = None
) -> Iterator[OperatorProcess]:
    """Start ``meshscope-operator`` (this environment's entry point, as the image's ENTRYPOINT; or ``argv``) with the
    Deployment's environment; only the listen address and ports (loopback, free) and the certificate directory
    (``workdir``, holding the rendered Secret's files) differ. It reaches the API through a kubeconfig for
    ``api_url``.
    """
    c = container(rendered)
    env = kubelet_env(c["env"])
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "webhook-certificates")
    certs = workdir / "webhook"
    certs.mkdir()
    for key, value in rendered.one("Secret")["data"].items():
        (certs / key).write_bytes(base64.b64decode(value))
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "api", "cluster": {"server": api_url}}],
                "users": [{"name": "operator", "user": {"token": "dummy"}}],
                "contexts": [{"name": "api", "context": {"cluster": "api", "user": "operator"}}],
                "current-context": "api",
            }
        )
    )
    webhook_port, liveness_port = _free_port(), _free_port()
    child = {k: v.replace(mount, str(certs)) for k, v in env.items()} | {
        "MESHSCOPE_OPERATOR_WEBHOOK_ADDR": "127.0.0.1",
        "MESHSCOPE_OPERATOR_WEBHOOK_PORT": str(webhook_port),
        "MESHSCOPE_OPERATOR_LIVENESS_PORT": str(liveness_port),
        "KUBECONFIG": str(kubeconfig),
        "PATH": os.environ.get("PATH", ""),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    entry = Path(sys.executable).with_name("meshscope-operator")
    log = workdir / "operator.log"
    with log.open("wb") as out:
        process = subprocess.Popen(argv or [str(entry)], env=child, stdout=out, stderr=subprocess.STDOUT)
    running = OperatorProcess(process=process, webhook_port=webhook_port, liveness_port=liveness_port, log=log)
    try:
        yield running
    finally:
        running.stop()

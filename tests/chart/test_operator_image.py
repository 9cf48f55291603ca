"""operator/Dockerfile, as far as it can be checked without a container runtime (as tests/sidecar/test_container.py
does for the sidecar's): user, entry point, ports, what it copies, and that the extra it installs brings every
module the operator imports."""

from __future__ import annotations

import ast
import json
import re
import shlex
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from meshscope_operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "operator" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _final_stage() -> list[tuple[str, str]]:
    ins = _instructions()
    last_from = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    return ins[last_from:]


def test_the_base_is_pinned_and_shared_by_both_stages() -> None:
    ins = _instructions()
    (arg,) = [rest for word, rest in ins if word == "ARG" and rest.startswith("BASE=")]
    base = arg.removeprefix("BASE=")
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", base), base  # a patch release, not a moving minor tag
    froms = [rest.split()[0] for word, rest in ins if word == "FROM"]
    assert froms == ["${BASE}", "${BASE}"]


def test_the_image_runs_as_the_numeric_non_root_user_of_the_chart() -> None:
    users = [rest for word, rest in _final_stage() if word == "USER"]
    assert users == ["65532:65532"]  # numeric, so that runAsNonRoot can verify it
    values = (REPO / "charts" / "meshscope" / "values.yaml").read_text()
    assert "runAsUser: 65532" in values
    assert "runAsGroup: 65532" in values


def test_the_entry_point_is_meshscope_operator_in_exec_form() -> None:
    (entry,) = [rest for word, rest in _final_stage() if word == "ENTRYPOINT"]
    argv = json.loads(entry)  # exec form: no shell, SIGTERM reaches kopf
    assert argv == ["/opt/meshscope/bin/meshscope-operator"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["meshscope-operator"] == "meshscope_operator.__main__:main"


def test_it_exposes_the_operators_default_ports() -> None:
    (exposed,) = [rest for word, rest in _final_stage() if word == "EXPOSE"]
    defaults = OperatorSettings()
    assert sorted(int(p) for p in exposed.split()) == sorted([defaults.webhook_port, defaults.liveness_port])


def test_every_copied_source_exists_and_the_wheel_needs_nothing_else() -> None:
    copies = [shlex.split(rest) for word, rest in _instructions() if word == "COPY" and "--from=" not in rest]
    for *sources, _dest in copies:
        for src in sources:
            assert (REPO / src).exists(), f"COPY {src}: not in the build context (the repository root)"
    wheel = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    needed = {Path(p).parts[0] for p in wheel["packages"]} | set(wheel["force-include"])
    copied = {Path(src).parts[0] for *sources, _ in copies for src in sources}
    assert needed <= copied


def test_the_final_stage_is_read_only_friendly_and_carries_no_pip() -> None:
    final = _final_stage()
    env = " ".join(rest for word, rest in final if word == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    assert not [rest for word, rest in final if word == "RUN"]
    assert [rest for word, rest in final if word == "COPY"] == ["--from=build /opt/meshscope /opt/meshscope"]
    build = " ".join(rest for word, rest in _instructions()[: len(_instructions()) - len(final)] if word == "RUN")
    assert "install '.[operator]'" in build
    assert "pip uninstall --yes --quiet pip setuptools" in build
    assert build.index("compileall") < build.index("pip uninstall")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_closure(extra: str) -> set[str]:
    """Distributions ``pip install '.[extra]'`` brings: pyproject.toml's own requirements, then theirs from the
    installed metadata (names normalised)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [Requirement(t) for t in project["dependencies"] + project["optional-dependencies"][extra]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = _norm(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed here (kubernetes: the operator extra's, not dev's): counted, not walked
        wanted = set(req.extras) | {""}
        todo.extend(
            child
            for child in map(Requirement, requires)
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in wanted)
        )
    return seen


def test_the_operator_extra_brings_every_module_the_operator_imports() -> None:
    # What the image installs ('.[operator]') against what meshscope_operator and the core import at the top level.
    closure = _requirement_closure("operator")
    providers = metadata.packages_distributions()
    imported: set[str] = set()
    for package in ("operator/meshscope_operator", "src/meshscope"):
        for source in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m in providers and m not in {"meshscope", "meshscope_operator"}}
    assert "kopf" in third_party
    # pandas is lazily imported behind the frames extra, torch behind demo (STYLE.md §3); transformers and lightning
    # only by the Trainer callbacks (sdk/huggingface.py, sdk/lightning.py), which only training scripts import:
    # none of them is needed by the operator
    optional = {"pandas", "torch", "transformers", "lightning"}
    missing = {m for m in third_party - optional if not {_norm(d) for d in providers[m]} & closure}
    assert missing == set(), f"imported by the operator image but not installed by '.[operator]': {missing}"

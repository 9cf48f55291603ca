"""The container, as far as it can be checked without a container runtime: user, entry point, copied files."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "sidecar" / "Dockerfile"


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


def test_the_image_runs_as_a_numeric_non_root_user() -> None:
    users = [rest for word, rest in _final_stage() if word == "USER"]
    assert users, "the final stage sets no USER: it would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit()  # numeric, so that runAsNonRoot can verify it
    assert int(uid) != 0


def test_the_entry_point_is_meshscope_sidecar_and_exists_in_the_distribution() -> None:
    entry = [rest for word, rest in _final_stage() if word == "ENTRYPOINT"]
    assert len(entry) == 1
    argv = json.loads(entry[0])  # exec form: no shell, signals reach the process
    assert Path(argv[0]).name == "meshscope-sidecar"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["meshscope-sidecar"] == "meshscope_sidecar.__main__:main"


def test_every_copied_source_exists_in_the_build_context() -> None:
    copies = [rest for word, rest in _instructions() if word == "COPY" and "--from=" not in rest]
    assert copies
    for rest in copies:
        *sources, _dest = shlex.split(rest)
        for src in sources:
            assert (REPO / src).exists(), f"COPY {src}: not in the build context (the repository root)"


def test_the_wheel_the_image_installs_includes_what_it_copies() -> None:
    # hatchling's force-include and packages name the folders the build needs: each must be copied in.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    wheel = project["tool"]["hatch"]["build"]["targets"]["wheel"]
    needed = {Path(p).parts[0] for p in wheel["packages"]} | set(wheel["force-include"])
    copied = {
        Path(src).parts[0]
        for word, rest in _instructions()
        if word == "COPY" and "--from=" not in rest
        for src in shlex.split(rest)[:-1]
    }
    assert needed <= copied


def test_nothing_needs_a_writable_root_or_privileges() -> None:
    final = _final_stage()
    env = " ".join(rest for word, rest in final if word == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    assert not [rest for word, rest in final if word == "RUN"]  # nothing mutates the final image at build or run
    text = DOCKERFILE.read_text()
    assert "--privileged" not in text
    assert "setcap" not in text
    readme = (REPO / "sidecar" / "README.md").read_text()
    for needed in (
        "readOnlyRootFilesystem: true",
        "drop: [ALL]",
        "runAsNonRoot: true",
        "/run/meshscope",
        "spec.nodeName",
    ):
        assert needed in readme

"""``meshscope-operator``: a bad setting ends it at once with one line and status 2, before kopf is imported."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

from operator_serving import ROOT


def test_the_entry_point_is_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["meshscope-operator"] == "meshscope_operator.__main__:main"
    assert any(dep.startswith("kopf") for dep in project["optional-dependencies"]["operator"])


def test_a_bad_setting_is_one_line_and_exit_status_2() -> None:
    code = (
        "import sys; from meshscope_operator.__main__ import main;"
        "rc = main([], {'MESHSCOPE_OPERATOR_WEBHOOK_PORT': 'x'}); print('kopf' in sys.modules); sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr == (
        "meshscope-operator: error: MESHSCOPE_OPERATOR_WEBHOOK_PORT='x' is not a whole number from 0 to 65535\n"
    )
    assert done.stdout == "False\n"


def test_help_lists_the_variables() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meshscope_operator", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0
    assert "MESHSCOPE_OPERATOR_WEBHOOK_CERT_FILE" in done.stdout
    assert "MESHSCOPE_OPERATOR_SIDECAR_IMAGE" in done.stdout


def test_peered_replicas_each_draw_a_priority_of_their_own() -> None:
    # kopf pauses every operator that sees a live peer of its own priority: two replicas left at kopf's default (0)
    # both paused, and no TrainingJob was handled. kopf.run is replaced by a recorder in the child process.
    code = (
        "import json, kopf; from meshscope_operator.__main__ import main; seen = [];"
        "kopf.run = lambda **kw: seen.append({k: kw[k] for k in ('priority', 'standalone', 'peering_name')});"
        "env = {'MESHSCOPE_OPERATOR_PEERING': 'meshscope'};"
        "[main([], env) for _ in range(2)]; main([], {}); print(json.dumps(seen))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    first, second, alone = json.loads(done.stdout.splitlines()[-1])
    assert first["peering_name"] == second["peering_name"] == "meshscope"
    assert first["priority"] > 0
    assert second["priority"] > 0
    assert first["priority"] != second["priority"]
    assert (alone["standalone"], alone["priority"]) == (True, 0)

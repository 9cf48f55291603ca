"""``meshscope-operator``: a bad setting ends it at once with one line and status 2, before kopf is imported."""

from __future__ import annotations

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

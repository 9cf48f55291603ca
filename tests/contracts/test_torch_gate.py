"""A missing torch drops the SDK and end-to-end test files loudly, and fails ``make test`` (tests/torch_gate.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _collect_without_torch(tmp_path: Path, *, required: bool) -> subprocess.CompletedProcess[str]:
    shadow = tmp_path / "shadow" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("no torch in this test (a shadow package)")\n')
    env = {k: v for k, v in os.environ.items() if k != "MESHSCOPE_REQUIRE_TORCH"}
    env["PYTHONPATH"] = str(tmp_path / "shadow")
    if required:
        env["MESHSCOPE_REQUIRE_TORCH"] = "1"
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    command += ["tests/sdk/test_tracker.py", "tests/e2e_local/test_faults.py"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.slow
def test_without_torch_the_left_out_files_are_named_in_the_summary(tmp_path: Path) -> None:
    done = _collect_without_torch(tmp_path, required=False)
    out = done.stdout + done.stderr
    assert "NOT RUN: torch is missing" in out, out
    assert "tests/sdk/test_tracker.py" in out
    assert "tests/e2e_local/test_faults.py" in out


@pytest.mark.slow
def test_make_test_fails_without_torch(tmp_path: Path) -> None:
    done = _collect_without_torch(tmp_path, required=True)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "TorchMissingError" in out, out
    assert "no torch in this test" in out


def test_make_unit_requires_torch() -> None:
    recipe = (ROOT / "Makefile").read_text().split("\nunit:", 1)[1].split("\n\n", 1)[0]
    assert "MESHSCOPE_REQUIRE_TORCH=1 $(BIN)/pytest" in recipe

"""The architecture contracts (.importlinter) run with the tests, as kopf does."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    proc = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "broken" in proc.stdout
    assert "0 broken" in proc.stdout


def test_core_would_be_caught_importing_kopf(tmp_path: Path) -> None:
    # The contract must be able to fail: a throwaway config that forbids something the core really imports.
    config = tmp_path / "contracts.ini"
    config.write_text(
        "[importlinter]\nroot_packages =\n    meshscope\ninclude_external_packages = True\n"
        "[importlinter:contract:probe]\nname = probe\ntype = forbidden\nsource_modules =\n    meshscope\n"
        "forbidden_modules =\n    numpy\n"
    )
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    proc = subprocess.run([exe, "--config", str(config)], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode != 0
    assert "1 broken" in proc.stdout

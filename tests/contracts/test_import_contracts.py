"""The architecture contracts (.importlinter) run with the tests, as kopf does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def _copy_of_the_tree(root: Path) -> Path:
    """The three packages, copied where a probe may add an import without touching the checkout."""
    for name, source in (
        ("meshscope", ROOT / "src" / "meshscope"),
        ("meshscope_operator", ROOT / "operator" / "meshscope_operator"),
        ("meshscope_sidecar", ROOT / "sidecar" / "meshscope_sidecar"),
    ):
        shutil.copytree(source, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    return root


PROBES = [
    # (file the probe adds or extends, the import it adds, the contract that must break)
    ("meshscope/local/probe.py", "from meshscope.analysis.breakdown import break_down", "face-analysis"),
    ("meshscope/reports/probe.py", "from meshscope.records.reading import read_table", "face-records"),
    ("meshscope_operator/probe.py", "from meshscope.plan.memory import stage_params", "units-use-faces"),
    ("meshscope_sidecar/probe.py", "from meshscope.cli import main", "units-use-faces"),
    ("meshscope/records/probe.py", "from meshscope.analysis import analyze", "core-layers"),
    ("meshscope/sdk/capture.py", "from meshscope.sdk import tracker", "inside-sdk"),
    ("meshscope/analysis/breakdown.py", "from meshscope.analysis import costs", "inside-analysis"),
]


@pytest.mark.parametrize(
    ("path", "line", "contract"),
    PROBES,
    ids=[f"{contract}:{path}" for path, _, contract in PROBES],
)
def test_a_reach_past_a_contract_breaks_it(tmp_path: Path, path: str, line: str, contract: str) -> None:
    # The real .importlinter over a copy of the tree with one import added: that contract alone must break.
    tree = _copy_of_the_tree(tmp_path / "tree")
    target = tree / path
    before = target.read_text() if target.exists() else ""
    target.write_text(before + f"\n{line}  # probe\n")
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the copy shadows the editable install
    cmd = [exe, "--config", str(ROOT / ".importlinter"), "--no-cache", "--contract", contract]
    broken = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    assert broken.returncode != 0, broken.stdout
    assert "1 broken" in broken.stdout
    target.write_text(before)  # without the probe the same contract holds on the copy
    kept = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    assert kept.returncode == 0, kept.stdout + kept.stderr

"""The real ``kubectl`` (/usr/bin/kubectl) in a subprocess, pointed at an emulator, every call with a timeout.

Each :class:`Kubectl` has its own kubeconfig and ``HOME`` (so kubectl's discovery cache is the test's own), and puts
the test's virtual environment's ``bin`` first on ``PATH``, where kubectl finds plugins such as ``kubectl-meshscope``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
TIMEOUT_S = 60.0
"""Longest one kubectl call may take (generous: the machine may be shared)."""
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Kubectl:
    """kubectl with one kubeconfig and home."""

    kubeconfig: Path
    home: Path

    def run(self, *args: str, stdin: str | None = None, check: bool = False) -> subprocess.CompletedProcess[str]:
        """``kubectl ARGS`` in the repository root; the finished process (stdout and stderr as text)."""
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("KUBE")},
            "KUBECONFIG": str(self.kubeconfig),
            "HOME": str(self.home),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        done = subprocess.run(
            [KUBECTL, *args],  # HOME is the test's own, so is the discovery cache in it
            input=stdin,
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=TIMEOUT_S,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {done.returncode}: {done.stderr}")
        return done

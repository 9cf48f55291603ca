"""What one ``meshscope run`` left behind, for the tests that launch real jobs (importable: ``tests/`` is on the path)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path


@dataclass
class Run:
    """What one job left: exit code, what meshscope printed, the output directory."""

    code: int
    out: str
    out_dir: Path

    @property
    def analysis(self) -> dict[str, Any]:
        return json.loads((self.out_dir / "analysis.json").read_text())

    @property
    def findings(self) -> list[dict[str, Any]]:
        return self.analysis["findings"]

    def losses(self) -> list[float]:
        return json.loads((self.out_dir / "losses.json").read_text())["losses"]

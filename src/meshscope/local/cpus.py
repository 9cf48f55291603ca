"""The CPU cores a local run's ranks can run on, and the CPU time they used: contention measured, never guessed.

Why it exists: on one machine every rank shares the same cores (cpu-testbed.md §1: 8 ranks on 2 cores are
time-sliced), so a run with more ranks than cores measures CPU contention as much as the job. ``meshscope run``
says so at the start, and passes a ``cpu_contention`` note to the analysis. The cores are the process's affinity
(``os.sched_getaffinity``) capped by a cgroup v2 CPU quota (``cpu.max`` of the process's cgroup and its parents);
the CPU time is the ranks' rusage from ``os.wait4``. It reads files under a root given to it (tests pass a fixture
tree) and must not import torch.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from meshscope.records import Note

CONTENTION_CODE = "cpu_contention"
"""The note's code (read by code elsewhere: keep it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CpuCapacity:
    """The cores this process (and so every rank it launches) can run on."""

    affinity: int
    """CPUs in the affinity mask (``os.sched_getaffinity(0)``; ``os.cpu_count()`` where that is missing)."""
    quota_cores: float | None = None
    """The tightest cgroup CPU quota, in cores (quota / period); ``None``: no quota."""

    @property
    def cores(self) -> float:
        """The cores available: the affinity, capped by the quota."""
        return min(float(self.affinity), self.quota_cores) if self.quota_cores is not None else float(self.affinity)

    def describe(self) -> str:
        """``2 CPU cores`` or ``1.5 CPU cores (cgroup quota; 8 in the affinity mask)``."""
        text = f"{self.cores:g} CPU core" + ("" if self.cores == 1 else "s")
        if self.quota_cores is not None and self.quota_cores < self.affinity:
            text += f" (cgroup quota; {self.affinity} in the affinity mask)"
        return text


def _quota(path: Path) -> float | None:
    """Cores allowed by one ``cpu.max`` file (``max 100000`` or ``200000 100000``), ``None`` when unlimited."""
    try:
        fields = path.read_text().split()
        if len(fields) == 2 and fields[0] != "max" and int(fields[1]) > 0:  # "QUOTA PERIOD"
            return int(fields[0]) / int(fields[1])
    except (OSError, ValueError):
        pass
    return None


def measure_capacity(root: Path = Path("/")) -> CpuCapacity:
    """The cores this process can run on: its affinity, capped by the cgroup v2 quotas above it.

    Args:
        root: the filesystem root to read ``proc/self/cgroup`` and ``sys/fs/cgroup`` under (tests pass a fixture).
    """
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    group = "/"
    with contextlib.suppress(OSError):
        for line in (root / "proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                group = line[3:].strip() or "/"
    base = root / "sys/fs/cgroup"
    quotas = []
    parts = [p for p in group.split("/") if p]
    for depth in range(len(parts), -1, -1):
        q = _quota(base.joinpath(*parts[:depth]) / "cpu.max")
        if q is not None:
            quotas.append(q)
    return CpuCapacity(affinity=max(1, affinity), quota_cores=min(quotas) if quotas else None)


@dataclass(frozen=True, slots=True, kw_only=True)
class CpuUse:
    """How a run's ranks used the cores: written into ``OUT/collector.json`` and the contention note."""

    ranks: int
    """Ranks launched."""
    capacity: CpuCapacity
    """The cores they could run on."""
    wall_s: float
    """Seconds from launch to the last exit."""
    cpu_s: float | None = None
    """User + system CPU seconds of the ranks (rusage of each, ``None`` where it could not be read)."""

    @property
    def oversubscribed(self) -> bool:
        """More ranks than cores."""
        return self.ranks > self.capacity.cores

    @property
    def busy_fraction(self) -> float | None:
        """The ranks' CPU time over what the cores offered (wall × cores)."""
        offered = self.wall_s * self.capacity.cores
        return None if self.cpu_s is None or offered <= 0 else self.cpu_s / offered

    def headline(self) -> str:
        """``8 ranks on 2 CPU cores: timings include CPU contention`` (or ``... 2 ranks on 4 CPU cores``)."""
        text = f"{self.ranks} ranks on {self.capacity.describe()}"
        return text + ": timings include CPU contention" if self.oversubscribed else text

    def usage(self) -> str:
        """``the ranks used 35.2 CPU-s of the 40.0 the cores offered in 20.0 s (88 %)``, or ``''`` unmeasured."""
        busy = self.busy_fraction
        if busy is None or self.cpu_s is None:
            return ""
        offered = self.wall_s * self.capacity.cores
        return (
            f"the ranks used {self.cpu_s:.1f} CPU-s of the {offered:.1f} the cores offered in {self.wall_s:.1f} s "
            f"({busy:.0%})"
        )

    def to_dict(self) -> dict[str, object]:
        """The figures, in base units."""
        return {
            "ranks": self.ranks,
            "cores": self.capacity.cores,
            "affinity_cpus": self.capacity.affinity,
            "cgroup_quota_cores": self.capacity.quota_cores,
            "wall_seconds": round(self.wall_s, 3),
            "ranks_cpu_seconds": None if self.cpu_s is None else round(self.cpu_s, 3),
            "busy_fraction": None if self.busy_fraction is None else round(self.busy_fraction, 4),
            "oversubscribed": self.oversubscribed,
        }

    def note(self) -> Note | None:
        """The ``cpu_contention`` partial-data note of an oversubscribed run, else ``None``."""
        if not self.oversubscribed:
            return None
        used = self.usage()
        return Note(
            code=CONTENTION_CODE,
            count=self.ranks,
            message=(
                f"{self.headline()} (time-sliced: a rank waiting for a core counts as its step's time)"
                + (f"; {used}" if used else "")
            ),
        )

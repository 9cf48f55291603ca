"""The CPU cores a local run's ranks can run on, and the CPU time they used: contention measured, never guessed.

Why it exists: on one machine every rank shares the same cores (cpu-testbed.md §1: 8 ranks on 2 cores are
time-sliced), so a run with more ranks than cores measures CPU contention as much as the job. ``meshscope run``
says so at the start, and passes a ``cpu_contention`` note to the analysis. The cores are the process's affinity
(``os.sched_getaffinity``) capped by a cgroup v2 CPU quota (``cpu.max`` of the process's cgroup and its parents);
the CPU time is the ranks' rusage from ``os.wait4``. Foreign load is measured too: the busy time of the cores in
the affinity mask (``/proc/stat``) over the run, less the ranks' and the launcher's own CPU, is what other processes
took from them; a run where they took :data:`FOREIGN_LOAD_SHARE` of the cores' time is contended as an
oversubscribed one is, whatever the rank count (a CPU burner on a hyperthread sibling slows a rank without making
it wait for a core, so its run delay alone does not show it). It reads files under a root given to it (tests pass
a fixture tree) and must not import torch.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from meshscope.records import Note

CONTENTION_CODE = "cpu_contention"
"""The note's code (read by code elsewhere: keep it)."""
FOREIGN_LOAD_SHARE = 0.2
"""Other processes' share of the affinity cores' time over a run at which the run is CPU-contended: a burner on one
of 2 cores takes half; an editor, a shell and a language server a few percent. benchmarks/bench_real_runs.py and
tests/e2e_local/test_clean_under_load.py run beside a burner on every core."""
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""``/proc/stat`` cpuN fields counted busy: user, nice, system, irq, softirq, steal (proc(5); guest time is already
in user; idle and iowait are not busy)."""


def read_busy_seconds(root: Path = Path("/"), cpus: frozenset[int] | None = None) -> float | None:
    """CPU-seconds the cores ``cpus`` (every core when ``None``) have been busy since boot, from ``proc/stat``.

    ``None`` when the file cannot be read or names none of them.
    """
    try:
        text = (root / "proc/stat").read_text()
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    busy = 0
    seen = False
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            cpu = int(name[3:])
            fields = [int(x) for x in rest.split()]
        except ValueError:
            continue
        if (cpus is None or cpu in cpus) and len(fields) >= 8:
            busy += sum(fields[i] for i in _BUSY_FIELDS)
            seen = True
    return busy / tick if seen and tick > 0 else None


def affinity_cpus() -> frozenset[int] | None:
    """The CPUs in this process's affinity mask, ``None`` where the platform cannot tell."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


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
    """Seconds the ranks ran: from the launch (after the fork launcher's import of torch, which the run's
    ``records ... in N s`` line includes) to the last exit."""
    cpu_s: float | None = None
    """User + system CPU seconds of the ranks (rusage of each, ``None`` where it could not be read)."""
    machine_busy_s: float | None = None
    """CPU-seconds the affinity mask's cores were busy during the run, whoever ran (``/proc/stat``)."""
    own_cpu_s: float | None = None
    """The launcher's own CPU-seconds during the run (its collector and monitor threads)."""

    @property
    def oversubscribed(self) -> bool:
        """More ranks than cores."""
        return self.ranks > self.capacity.cores

    @property
    def foreign_cpu_s(self) -> float | None:
        """CPU-seconds other processes took from the cores during the run; ``None`` unmeasured."""
        if self.machine_busy_s is None or self.cpu_s is None:
            return None
        return max(0.0, self.machine_busy_s - self.cpu_s - (self.own_cpu_s or 0.0))

    @property
    def foreign_fraction(self) -> float | None:
        """:attr:`foreign_cpu_s` over the affinity cores' time (wall × CPUs in the mask)."""
        foreign = self.foreign_cpu_s
        offered = self.wall_s * self.capacity.affinity
        return None if foreign is None or offered <= 0 else foreign / offered

    @property
    def foreign_load(self) -> bool:
        """Other processes took at least :data:`FOREIGN_LOAD_SHARE` of the cores' time."""
        share = self.foreign_fraction
        return share is not None and share >= FOREIGN_LOAD_SHARE

    @property
    def contended(self) -> bool:
        """The ranks competed for CPU: more of them than cores, or foreign load on the cores."""
        return self.oversubscribed or self.foreign_load

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
        """``the ranks used 35.2 CPU-s of the 40.0 the cores offered in the 20.0 s they ran (88 %)``, or ``''``."""
        busy = self.busy_fraction
        if busy is None or self.cpu_s is None:
            return ""
        offered = self.wall_s * self.capacity.cores
        return (
            f"the ranks used {self.cpu_s:.1f} CPU-s of the {offered:.1f} the cores offered in the {self.wall_s:.1f} s "
            "they ran "
            f"({busy:.0%})"
        )

    def foreign(self) -> str:
        """``other processes took 9.1 CPU-s of the 20.0 the 2 CPUs offered (46%)``, or ``''`` unmeasured."""
        foreign, share = self.foreign_cpu_s, self.foreign_fraction
        if foreign is None or share is None:
            return ""
        return (
            f"other processes took {foreign:.1f} CPU-s of the {self.wall_s * self.capacity.affinity:.1f} the "
            f"{self.capacity.affinity} CPUs offered ({share:.0%})"
        )

    def to_dict(self) -> dict[str, object]:
        """The figures, in base units."""
        foreign, share = self.foreign_cpu_s, self.foreign_fraction
        return {
            "ranks": self.ranks,
            "cores": self.capacity.cores,
            "affinity_cpus": self.capacity.affinity,
            "cgroup_quota_cores": self.capacity.quota_cores,
            "wall_seconds": round(self.wall_s, 3),
            "ranks_cpu_seconds": None if self.cpu_s is None else round(self.cpu_s, 3),
            "busy_fraction": None if self.busy_fraction is None else round(self.busy_fraction, 4),
            "oversubscribed": self.oversubscribed,
            "machine_busy_cpu_seconds": None if self.machine_busy_s is None else round(self.machine_busy_s, 3),
            "launcher_cpu_seconds": None if self.own_cpu_s is None else round(self.own_cpu_s, 3),
            "foreign_cpu_seconds": None if foreign is None else round(foreign, 3),
            "foreign_fraction": None if share is None else round(share, 4),
            "contended": self.contended,
        }

    def note(self) -> Note | None:
        """The ``cpu_contention`` partial-data note of a contended run (:attr:`contended`), else ``None``."""
        if not self.contended:
            return None
        used, foreign = self.usage(), self.foreign()
        if self.oversubscribed:
            head = f"{self.headline()} (time-sliced: a rank waiting for a core counts as its step's time)"
        else:
            head = (
                f"{self.headline()}, beside foreign CPU load: timings include CPU contention (a rank slowed by "
                "another process counts it as its step's time)"
            )
        return Note(
            code=CONTENTION_CODE,
            count=self.ranks,
            message=head + "".join(f"; {part}" for part in (used, foreign) if part),
        )

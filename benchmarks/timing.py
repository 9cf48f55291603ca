"""Timers and memory readings shared by the benchmark scripts (which run as ``python benchmarks/bench_*.py``)."""

from __future__ import annotations

import resource
import time


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, MiB (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Clock:
    """Wall and CPU seconds since the last lap (CPU time is steadier on a shared machine)."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> str:
        wall, cpu = time.perf_counter(), time.process_time()
        out = f"{wall - self.wall:6.2f} s wall {cpu - self.cpu:6.2f} s CPU"
        self.wall, self.cpu = wall, cpu
        return out

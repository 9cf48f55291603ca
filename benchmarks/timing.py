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


def machine_reference() -> str:
    """The same fixed work timed on this machine: a pure-Python loop and a numpy sort (best of 5 each).

    Figures from different machines compare as ratios to these: the same ``analyze`` benchmark read 17 s on one
    machine of this project's kind and 46 s on another. Printed by every benchmark beside its own figures.
    """
    import numpy as np  # noqa: PLC0415 - the benchmarks that need no numpy stay importable without it

    def loop() -> int:
        total = 0
        for i in range(2_000_000):
            total += i * i % 7
        return total

    rng = np.random.default_rng(0)
    keys = rng.integers(0, 1 << 62, size=4_000_000, dtype=np.int64)

    def sort() -> None:
        np.sort(keys, kind="stable")

    def best_ms(fn: object) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3

    return (
        f"machine reference: python loop (2 M iterations) {best_ms(loop):.0f} ms, numpy stable sort of 4 M int64 "
        f"{best_ms(sort):.0f} ms (best of 5; divide a figure by these to compare machines)"
    )

"""What the recording rules cost a real Prometheus and VictoriaMetrics as the job grows, and what they record.

A synthetic job of N ranks (tp=8, pp=4, dp=N/32, Megatron order; 8 GPUs per node) is served by one exposition in
the sidecar's metric names (steps, step and own seconds, 9 breakdown series, tokens, attention work, utilisation,
SM and tensor activity per rank; 3 sources per node). A real Prometheus scrapes it and evaluates
sidecar/monitoring/recording-rules.yaml every ``--interval`` seconds; a real VictoriaMetrics scrapes it too. Printed
per N: the input series, the recorded series (bounded: they depend on pp and the axes, not on N), Prometheus' rule
evaluation time per round (``/api/v1/rules`` ``evaluationTime``, median of the rounds seen), and the wall time of
evaluating all rule expressions once through VictoriaMetrics' ``/api/v1/query``.

    .venv/bin/python benchmarks/bench_recording_rules.py                    # N = 256 and 2048
    .venv/bin/python benchmarks/bench_recording_rules.py --ranks 64 512 4096 --interval 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from timing import machine_reference

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from sidecar.promstack import http_get, serve, start_prometheus, start_victoria_metrics  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Iterator

    from prometheus_client.metrics_core import Metric

RULES = ROOT / "sidecar" / "monitoring" / "recording-rules.yaml"
RANK_LABELS = ["job", "rank", "dp", "tp", "pp", "cp", "ep", "node", "nvlink_domain", "network_tier", "gpu"]
CATEGORIES = [
    ("compute", ""),
    ("exposed_comm", "tp"),
    ("exposed_comm", "dp"),
    ("exposed_comm", "pp"),
    ("bubble", ""),
    ("data", ""),
    ("optimizer", ""),
    ("checkpoint", ""),
    ("other", ""),
]


class ScaledJob:
    """N ranks whose counters grow at fixed rates (rank-dependent so medians and maxima have work to do)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.started = time.monotonic()
        self.labels = []
        for r in range(ranks):
            tp, dp, pp = r % 8, (r // 8) % (ranks // 32), r // (8 * (ranks // 32))
            node = r // 8
            self.labels.append(
                [
                    "bench",
                    str(r),
                    str(dp),
                    str(tp),
                    str(pp),
                    "0",
                    "0",
                    f"node-{node}",
                    f"nvl-{node // 9}",
                    "leaf",
                    str(r % 8),
                ]
            )

    def collect(self) -> Iterator[Metric]:
        steps = 0.4 * (1000.0 + time.monotonic() - self.started)
        fam = {
            "steps": CounterMetricFamily("meshscope_steps", "", labels=RANK_LABELS),
            "step": CounterMetricFamily("meshscope_step_seconds", "", labels=RANK_LABELS),
            "own": CounterMetricFamily("meshscope_own_seconds", "", labels=RANK_LABELS),
            "bd": CounterMetricFamily("meshscope_breakdown_seconds", "", labels=[*RANK_LABELS, "category", "axis"]),
            "tok": CounterMetricFamily("meshscope_data_tokens", "", labels=RANK_LABELS),
            "att": CounterMetricFamily("meshscope_data_attention_work", "", labels=RANK_LABELS),
            "util": GaugeMetricFamily("meshscope_gpu_utilization_ratio", "", labels=RANK_LABELS),
            "sm": GaugeMetricFamily("meshscope_gpu_sm_active_ratio", "", labels=RANK_LABELS),
            "tensor": GaugeMetricFamily("meshscope_gpu_tensor_active_ratio", "", labels=RANK_LABELS),
        }
        for r, labels in enumerate(self.labels):
            slow = 1.0 + (r % 7) * 0.01
            fam["steps"].add_metric(labels, steps)
            fam["step"].add_metric(labels, 2.0 * slow * steps)
            fam["own"].add_metric(labels, 1.5 * slow * steps)
            for i, (c, a) in enumerate(CATEGORIES):
                fam["bd"].add_metric([*labels, c, a], (0.1 + 0.01 * i) * slow * steps)
            fam["tok"].add_metric(labels, 16384 * steps)
            fam["att"].add_metric(labels, 16384 * 4096 * steps)
            fam["util"].add_metric(labels, 0.97)
            fam["sm"].add_metric(labels, 0.7)
            fam["tensor"].add_metric(labels, 0.4)
        yield from fam.values()
        up = GaugeMetricFamily("meshscope_source_up", "", labels=["job", "node", "source"])
        errors = CounterMetricFamily("meshscope_source_parse_errors", "", labels=["job", "node", "source"])
        dropped = CounterMetricFamily("meshscope_source_dropped", "", labels=["job", "node", "source"])
        poll = CounterMetricFamily("meshscope_source_poll_seconds", "", labels=["job", "node", "source"])
        for node in range(self.ranks // 8):
            for source in ("train_events", "dcgm", "nccl_log"):
                up.add_metric(["bench", f"node-{node}", source], 1)
                errors.add_metric(["bench", f"node-{node}", source], steps)
                dropped.add_metric(["bench", f"node-{node}", source], 0)
                poll.add_metric(["bench", f"node-{node}", source], 0.001 * steps)
        yield from (up, errors, dropped, poll)


def bench(ranks: int, interval_s: float, rounds: int) -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    exprs, names = [r["expr"] for r in rules], [r["record"] for r in rules]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shutil.copy(RULES, work / "rules.yaml")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ScaledJob(ranks))
        exposition = serve(registry)
        try:
            t0 = time.perf_counter()
            body = http_get(f"http://{exposition.target}/metrics")
            expose_s = time.perf_counter() - t0
            with (
                start_prometheus(
                    work / "prom", targets=[exposition.target], rule_files=[work / "rules.yaml"], interval_s=interval_s
                ) as prom,
                start_victoria_metrics(work / "vm", targets=[exposition.target], interval_s=interval_s) as vm,
            ):
                prom.wait_for(
                    "recorded series",
                    lambda: bool(prom.query("job:meshscope_step_seconds:median_rate5m")),
                    timeout_s=120,
                )
                per_round: list[float] = []
                per_rule: dict[str, list[float]] = {}
                seen: set[str] = set()
                deadline = time.monotonic() + rounds * interval_s * 4 + 30
                while len(per_round) < rounds and time.monotonic() < deadline:
                    groups = json.loads(http_get(prom.url + "/api/v1/rules"))["data"]["groups"]
                    stamp = max(g["lastEvaluation"] for g in groups)
                    if stamp not in seen:
                        seen.add(stamp)
                        per_round.append(sum(g["evaluationTime"] for g in groups))
                        for g in groups:
                            for r in g["rules"]:
                                per_rule.setdefault(r["name"], []).append(r["evaluationTime"])
                    time.sleep(interval_s / 2)
                inputs = float(prom.query('count({__name__=~"meshscope_.+"})')[0]["value"][1])
                recorded = float(prom.query('count({__name__=~".+:meshscope_.+:.+"})')[0]["value"][1])
                vm.wait_for("scraped series", lambda: bool(vm.query(exprs[0])), timeout_s=120)
                t0 = time.perf_counter()
                empty = [name for name, e in zip(names, exprs, strict=True) if not vm.query(e)]
                vm_s = time.perf_counter() - t0
        finally:
            exposition.stop()
    print(
        f"ranks {ranks:6d}: {inputs:8.0f} input series ({len(body) / 1e6:5.1f} MB exposition, {expose_s:5.2f} s to "
        f"render) -> {recorded:4.0f} recorded series; Prometheus evaluates the {len(exprs)} rules in "
        f"{statistics.median(per_round) * 1e3:7.1f} ms per round (median of {len(per_round)}); VictoriaMetrics "
        f"answers all {len(exprs)} expressions in {vm_s * 1e3:7.1f} ms ({len(empty)} empty)"
    )
    if empty:
        print("    empty on VictoriaMetrics: " + ", ".join(empty))
    slowest = sorted(per_rule.items(), key=lambda kv: -statistics.median(kv[1]))[:3]
    print("    slowest rules: " + "; ".join(f"{n} {statistics.median(t) * 1e3:.0f} ms" for n, t in slowest))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[256, 2048], help="job sizes (multiples of 32)")
    parser.add_argument("--interval", type=float, default=5.0, help="scrape and evaluation interval, seconds")
    parser.add_argument("--rounds", type=int, default=3, help="rule evaluation rounds to time per size")
    args = parser.parse_args()
    print(machine_reference())
    for n in args.ranks:
        bench(n, args.interval, args.rounds)


if __name__ == "__main__":
    main()

"""What the recording rules cost a real Prometheus as the job grows: before and after the per-rank level, in one run.

A synthetic job of N ranks (tp=8, pp=4, dp=N/32, Megatron order; 8 GPUs per node) is served by one exposition in
the sidecar's metric names (steps, step and own seconds, 9 breakdown series, tokens, attention work, utilisation,
SM and tensor activity per rank; 3 sources per node), written by a small HTTP server of its own here (prometheus_client
renders 300k series too slowly to be scraped every few seconds at 16k ranks). A real Prometheus scrapes it every
``--interval`` seconds and evaluates, in turn, two rule files on the same data:

- ``direct``: benchmarks/recording-rules-direct.yaml, the rules as they were, every aggregate straight from the
  counters (the same rate() taken again by every rule that needs it);
- ``two-level``: sidecar/monitoring/recording-rules.yaml, a per-rank level recorded once and the aggregates read from
  it.

It waits until every series holds ``--samples`` samples in the rules' 5-minute window (10: a 30 s scrape interval's
worth, what the rules see in production; the cost of rate() grows with it), measures Prometheus with no rules, then
loads ``direct`` (SIGHUP) and measures it, then ``two-level`` (which sees a few more samples per window: that only
disfavours it). Printed per N and file: the input series, the series the rules record, Prometheus' CPU time per
evaluation interval beyond what it spends with no rules (the steadiest figure on a shared machine: it is what the
rules cost, whatever else runs), the evaluation time per round (sum of the groups' ``evaluationTime`` from
``/api/v1/rules``, median of ``--rounds`` rounds; wall time, so it grows when the machine is busy) and the slowest
group's (what must fit in the evaluation interval: groups run concurrently, a group's rules one after another); then
straight-line fits through the sizes measured, extrapolated to 16,384 ranks.

    .venv/bin/python benchmarks/bench_recording_rules.py                    # N = 256 and 2048
    .venv/bin/python benchmarks/bench_recording_rules.py --ranks 256 2048 8192 --interval 10
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from timing import machine_reference

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from sidecar.promstack import Service, http_get, start_prometheus  # noqa: E402

RULE_FILES = {
    "direct": ROOT / "benchmarks" / "recording-rules-direct.yaml",
    "two-level": ROOT / "sidecar" / "monitoring" / "recording-rules.yaml",
}
TARGET_RANKS = 16384
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
SOURCES = ("train_events", "dcgm", "nccl_log")


class ScaledJob:
    """N ranks whose counters grow at fixed rates (rank-dependent so medians and maxima have work to do).

    Every counter is ``coefficient x steps`` with steps growing 0.4 per second; the exposition's text is built once
    as (series, coefficient) pairs, and a scrape only formats the numbers.
    """

    def __init__(self, ranks: int) -> None:
        self.started = time.monotonic()
        counters: list[tuple[str, str, float]] = []
        gauges: list[tuple[str, str, float]] = []
        for r in range(ranks):
            tp, dp, pp = r % 8, (r // 8) % (ranks // 32), r // (8 * (ranks // 32))
            node = r // 8
            values = ["bench", str(r), str(dp), str(tp), str(pp), "0", "0", f"node-{node}", f"nvl-{node // 9}"]
            labels = ",".join(f'{k}="{v}"' for k, v in zip(RANK_LABELS, [*values, "leaf", str(r % 8)], strict=True))
            slow = 1.0 + (r % 7) * 0.01
            counters += [
                ("meshscope_steps_total", labels, 1.0),
                ("meshscope_step_seconds_total", labels, 2.0 * slow),
                ("meshscope_own_seconds_total", labels, 1.5 * slow),
            ]
            for i, (c, a) in enumerate(CATEGORIES):
                bd = f'{labels},category="{c}",axis="{a}"'
                counters.append(("meshscope_breakdown_seconds_total", bd, (0.1 + 0.01 * i) * slow))
            counters += [
                ("meshscope_data_tokens_total", labels, 16384.0),
                ("meshscope_data_attention_work_total", labels, 16384.0 * 4096),
            ]
            gauges += [
                ("meshscope_gpu_utilization_ratio", labels, 0.97),
                ("meshscope_gpu_sm_active_ratio", labels, 0.7),
                ("meshscope_gpu_tensor_active_ratio", labels, 0.4),
            ]
        for node in range(ranks // 8):
            for source in SOURCES:
                labels = f'job="bench",node="node-{node}",source="{source}"'
                gauges.append(("meshscope_source_up", labels, 1.0))
                counters += [
                    ("meshscope_source_parse_errors_total", labels, 1.0),
                    ("meshscope_source_dropped_total", labels, 0.0),
                    ("meshscope_source_poll_seconds_total", labels, 0.001),
                ]
        self.series = len(counters) + len(gauges)
        self._counters = [(f"{n}{{{lab}}} ", k) for n, lab, k in sorted(counters)]
        self._gauges = "".join(f"{n}{{{lab}}} {v!r}\n" for n, lab, v in sorted(gauges)).encode()
        self._lock = threading.Lock()
        self._body = b""
        self._body_at = -1.0

    def body(self) -> bytes:
        """The exposition now; two scrapes within 0.5 s share one rendering."""
        with self._lock:
            now = time.monotonic()
            if now - self._body_at > 0.5:
                steps = 0.4 * (1000.0 + now - self.started)
                text = "".join(f"{prefix}{k * steps!r}\n" for prefix, k in self._counters)
                self._body, self._body_at = text.encode() + self._gauges, now
            return self._body


def serve(job: ScaledJob) -> ThreadingHTTPServer:
    """Serve ``job`` at ``/metrics`` on a free loopback port, in a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = job.body()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@dataclass(frozen=True, slots=True, kw_only=True)
class Figures:
    """One rule file at one size."""

    rules: int
    recorded_series: int
    round_s: float
    """Sum of the groups' evaluationTime, median over the rounds (wall time: inflated on a busy machine)."""
    slowest_group_s: float
    slowest_group: str
    rounds: int
    cpu_per_round_s: float
    """Prometheus' CPU time per evaluation interval, less what it spends with no rules (scraping, compaction)."""


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its threads so far (``/proc/PID/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


STAMP = re.compile(r"^(?P<s>[\d-]+T[\d:]+)(?P<f>\.\d+)?(?P<z>Z|[+-]\d\d:\d\d)$")


def unix_s(stamp: str) -> float:
    """``lastEvaluation`` (Go's RFC 3339 with up to 9 fraction digits) as Unix seconds."""
    m = STAMP.match(stamp)
    if m is None:
        raise ValueError(f"not an RFC 3339 time: {stamp!r}")
    zone = "+00:00" if m["z"] == "Z" else m["z"]
    return datetime.fromisoformat(m["s"] + zone).timestamp() + float(m["f"] or 0)


def measure(
    prom: Service, groups: set[str], rounds: int, *, interval_s: float, after_unix_s: float
) -> tuple[list[float], dict[str, float]]:
    """Per-round evaluation time (sum over ``groups``) of ``rounds`` rounds begun after ``after_unix_s``, and each
    group's median (a reload copies the old groups' figures to the new ones until they evaluate)."""
    per_round: list[float] = []
    per_group: dict[str, list[float]] = {}
    last = after_unix_s
    deadline = time.monotonic() + rounds * interval_s * 6 + 120
    while len(per_round) < rounds and time.monotonic() < deadline:
        loaded = json.loads(http_get(prom.url + "/api/v1/rules", timeout_s=60))["data"]["groups"]
        loaded = [g for g in loaded if g["name"] in groups]
        if {g["name"] for g in loaded} == groups:
            # a round is new once every group has evaluated again since the last one counted
            stamp = min(unix_s(g["lastEvaluation"]) for g in loaded)
            if stamp > last:
                last = max(unix_s(g["lastEvaluation"]) for g in loaded)
                per_round.append(sum(g["evaluationTime"] for g in loaded))
                for g in loaded:
                    per_group.setdefault(g["name"], []).append(g["evaluationTime"])
        time.sleep(interval_s / 4)
    if not per_round:
        raise SystemExit(f"no rule evaluation seen in time:\n{prom.log_tail()}")
    return per_round, {name: statistics.median(t) for name, t in per_group.items()}


def run_size(ranks: int, *, interval_s: float, rounds: int, samples: int) -> dict[str, Figures]:
    """Both rule files at one job size, on one Prometheus."""
    job = ScaledJob(ranks)
    server = serve(job)
    out: dict[str, Figures] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            rules_path = work / "rules.yaml"
            names = list(RULE_FILES)
            rules_path.write_text(RULE_FILES[names[0]].read_text())
            target = f"127.0.0.1:{server.server_port}"
            rules_path.write_text("groups: []\n")
            with start_prometheus(work / "prom", targets=[target], rule_files=[rules_path], interval_s=interval_s) as p:
                enough = f'count_over_time(meshscope_steps_total{{rank="{ranks - 1}"}}[5m]) >= {samples}'
                p.wait_for(f"{samples} samples per series", lambda: bool(p.query(enough)), timeout_s=samples * 30)
                inputs = int(float(p.query('count({__name__=~"meshscope_.+"})')[0]["value"][1]))
                # what Prometheus spends without rules: scraping, appending, the head's upkeep
                cpu0, t0 = cpu_s(p.process.pid), time.monotonic()
                time.sleep(rounds * interval_s)
                idle_cpu_per_round_s = (cpu_s(p.process.pid) - cpu0) / ((time.monotonic() - t0) / interval_s)
                for name in names:
                    loaded_at = time.time()
                    rules_path.write_text(RULE_FILES[name].read_text())
                    p.process.send_signal(signal.SIGHUP)
                    doc = yaml.safe_load(RULE_FILES[name].read_text())
                    groups = {g["name"] for g in doc["groups"]}
                    records = [r["record"] for g in doc["groups"] for r in g["rules"]]
                    # the first round creates the recorded series: not counted
                    measure(p, groups, 1, interval_s=interval_s, after_unix_s=loaded_at)
                    cpu0, t0 = cpu_s(p.process.pid), time.monotonic()
                    per_round, per_group = measure(p, groups, rounds, interval_s=interval_s, after_unix_s=time.time())
                    cpu_per_round_s = (cpu_s(p.process.pid) - cpu0) / ((time.monotonic() - t0) / interval_s)
                    selector = "|".join(records)
                    recorded = int(float(p.query(f'count({{__name__=~"{selector}"}})')[0]["value"][1]))
                    slowest = max(per_group, key=lambda g: per_group[g])
                    out[name] = Figures(
                        rules=len(records),
                        recorded_series=recorded,
                        round_s=statistics.median(per_round),
                        slowest_group_s=per_group[slowest],
                        slowest_group=slowest,
                        rounds=len(per_round),
                        cpu_per_round_s=cpu_per_round_s - idle_cpu_per_round_s,
                    )
                    f = out[name]
                    print(
                        f"ranks {ranks:6d} {name:>9}: {inputs:8d} input series -> {f.recorded_series:7d} recorded "
                        f"by {f.rules} rules; CPU {f.cpu_per_round_s * 1e3:8.1f} ms per round (beyond "
                        f"{idle_cpu_per_round_s * 1e3:.0f} ms without rules); evaluation {f.round_s * 1e3:8.1f} ms "
                        f"per round (median of {f.rounds}), slowest group {f.slowest_group} "
                        f"{f.slowest_group_s * 1e3:8.1f} ms",
                        flush=True,
                    )
    finally:
        server.shutdown()
        server.server_close()
    return out


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``a + b x N`` through the points (the line through both when there are two)."""
    if len(points) == 1:
        return 0.0, points[0][1] / points[0][0]
    xs, ys = [float(n) for n, _ in points], [t for _, t in points]
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[256, 2048], help="job sizes (multiples of 32)")
    parser.add_argument("--interval", type=float, default=5.0, help="scrape and evaluation interval, seconds")
    parser.add_argument("--rounds", type=int, default=3, help="rule evaluation rounds to time per size and file")
    parser.add_argument("--samples", type=int, default=10, help="samples per series in the 5 m window first")
    args = parser.parse_args()
    print(machine_reference())
    print(f"interval {args.interval:g} s, {args.samples} samples per series in the window, {args.rounds} rounds")
    results = {n: run_size(n, interval_s=args.interval, rounds=args.rounds, samples=args.samples) for n in args.ranks}
    for name in RULE_FILES:
        ca, cb = fit([(n, r[name].cpu_per_round_s) for n, r in results.items()])
        a, b = fit([(n, r[name].round_s) for n, r in results.items()])
        ga, gb = fit([(n, r[name].slowest_group_s) for n, r in results.items()])
        print(
            f"{name:>9} at {TARGET_RANKS} ranks (a straight line through {len(results)} sizes): CPU "
            f"{(ca + cb * TARGET_RANKS):7.2f} s per round ({cb * 1e6:6.1f} us per rank); evaluation "
            f"{(a + b * TARGET_RANKS):7.2f} s per round, slowest group {(ga + gb * TARGET_RANKS):7.2f} s"
        )


if __name__ == "__main__":
    main()

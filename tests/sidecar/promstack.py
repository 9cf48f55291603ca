"""A real Prometheus, VictoriaMetrics and vmalert for the tests, on loopback ports in a temporary directory.

Exists so that every test that needs a metrics store starts the real binaries from Debian's ``prometheus`` and
``victoria-metrics`` packages the same way: a config written from arguments, a free loopback port, a wait for
readiness, queries over the HTTP API, and a stop that never leaves a process behind. It also serves expositions:
a :class:`Exposition` puts a prometheus_client registry on a loopback port for the stores to scrape, and
:class:`SyntheticJob` is a collector for one node of a small training job whose counters grow at known rates
(the scenario :data:`RANKS` and :data:`NODES`; the tests derive their expected numbers from it by hand).

The binaries are required, never optional: a missing one fails the test with a message that says to run
``make system-deps``. Nothing here listens on anything but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from meshscope_sidecar.metrics import BY_NAME, NODE_LABELS, RANK_LABELS

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from pathlib import Path
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric

PACKAGES = {
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "victoria-metrics": "victoria-metrics",
    "vmalert": "victoria-metrics",
}
"""Binary -> the Debian package that ships it (checked with ``dpkg -L``)."""

READY_TIMEOUT_S = 30.0
"""How long a store may take to become ready; Prometheus replays an empty WAL in well under a second."""


def binary(name: str) -> str:
    """The path of a required binary; fails the test (never skips) with the fix when it is missing."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"`{name}` is not installed, and this test runs it for real: run `make system-deps` (it installs "
            f"Debian's `{PACKAGES.get(name, name)}` package: `apt-get update && apt-get install -y "
            f"{PACKAGES.get(name, name)}`)",
            pytrace=False,
        )
    return path


def free_port() -> int:
    """A loopback port free at the time of asking (the caller retries if another process takes it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_get(url: str, *, timeout_s: float = 10.0) -> bytes:
    """GET a loopback URL; raises :class:`urllib.error.URLError` (or ``HTTPError``) when it fails."""
    if not url.startswith("http://127.0.0.1:"):
        raise ValueError(f"only loopback URLs are queried here, not {url}")
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        body: bytes = response.read()
        return body


@dataclass
class Service:
    """One running binary: its process, its base URL, its log; :meth:`stop` ends it."""

    name: str
    process: subprocess.Popen[bytes]
    url: str
    log: Path
    flush_path: str | None = None
    """An endpoint that makes what the store ingested searchable now (VictoriaMetrics' ``/internal/force_flush``)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Terminate (then kill) the process and wait for it; idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the service's log, for failure messages."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def query(self, expr: str, *, at_unix_s: float | None = None) -> list[dict[str, Any]]:
        """An instant query over ``/api/v1/query``; the result vector (``[{"metric": {...}, "value": [t, "v"]}]``).

        Raises:
            AssertionError: the store answered with an error (the message has the expression and the error).
        """
        params = {"query": expr}
        if at_unix_s is not None:
            params["time"] = f"{at_unix_s:.3f}"
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}"
        try:
            body = json.loads(http_get(url))
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{self.name} refused {expr!r}: {e.read().decode(errors='replace')[:2000]}") from e
        if body.get("status") != "success":
            raise AssertionError(f"{self.name} failed on {expr!r}: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(self, what: str, check: Callable[[], bool], *, timeout_s: float = 30.0) -> None:
        """Poll ``check`` every 0.25 s until it holds; fail with ``what`` and the log when it does not in time.

        A store with a :attr:`flush_path` is flushed before each check: VictoriaMetrics otherwise makes a new series
        searchable only ~10 s after it arrived, and a rule read by a rule (scrape -> per-rank level -> aggregate)
        waits for that once per level (measured: 30 s to the aggregates without the flush, 6 s with it). What the
        store computes is unchanged; only when it shows it.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(
                    f"{self.name} exited ({self.process.returncode}) while waiting for {what}:\n{self.log_tail()}"
                )
            if self.flush_path is not None:
                with contextlib.suppress(OSError):
                    http_get(self.url + self.flush_path)
            if check():
                return
            time.sleep(0.25)
        pytest.fail(f"{self.name}: no {what} after {timeout_s:.0f} s:\n{self.log_tail()}")


def _with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that it gets SIGTERM when the test process dies: a killed test run leaves no store behind.

    util-linux's ``setpriv --pdeathsig`` (prctl PR_SET_PDEATHSIG, kept across exec) rather than a ``preexec_fn``,
    which is unsafe while the expositions' server threads run.
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *argv] if setpriv else argv


def _start(
    name: str, argv: Callable[[int], list[str]], workdir: Path, ready_path: str, *, flush_path: str | None = None
) -> Service:
    """Start a binary on a free port (retrying when another process takes the port first) and wait until ready.

    The caller owns the returned service: enter it (``with``) or stop it; on failure here it is already stopped.
    """
    for attempt in range(3):
        port = free_port()
        log = workdir / f"{name}.{attempt}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(_with_parent(argv(port)), stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
        service = Service(name=name, process=process, url=f"http://127.0.0.1:{port}", log=log, flush_path=flush_path)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and process.poll() is None:
            with contextlib.suppress(OSError):
                http_get(service.url + ready_path, timeout_s=1.0)
                return service
            time.sleep(0.1)
        service.stop()
        if "address already in use" not in service.log_tail(20000):
            break
    pytest.fail(f"{name} did not become ready on {service.url}{ready_path}:\n{service.log_tail()}")


def scrape_config(targets: Sequence[str], *, interval_s: float) -> dict[str, Any]:
    """A Prometheus-format scrape config for the sidecars at ``targets`` (``host:port``).

    ``honor_labels`` keeps the sidecars' ``job`` label (the training job), as the chart's scrape config must.
    """
    return {
        "global": {"scrape_interval": f"{interval_s:g}s"},
        "scrape_configs": [
            {
                "job_name": "meshscope-sidecar",
                "honor_labels": True,
                "scrape_interval": f"{interval_s:g}s",
                "scrape_timeout": f"{interval_s:g}s",
                "static_configs": [{"targets": list(targets)}],
            }
        ],
    }


def start_prometheus(
    workdir: Path, *, targets: Sequence[str], rule_files: Sequence[Path] = (), interval_s: float = 1.0
) -> Service:
    """Prometheus scraping ``targets`` and evaluating ``rule_files`` every ``interval_s``, data in ``workdir``."""
    exe = binary("prometheus")
    workdir.mkdir(parents=True, exist_ok=True)
    config = scrape_config(targets, interval_s=interval_s)
    config["global"]["evaluation_interval"] = f"{interval_s:g}s"
    config["rule_files"] = [str(p) for p in rule_files]
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    return _start(
        "prometheus",
        lambda port: [
            exe,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        workdir,
        "/-/ready",
    )


def start_victoria_metrics(workdir: Path, *, targets: Sequence[str], interval_s: float = 1.0) -> Service:
    """Single-node VictoriaMetrics scraping ``targets`` itself (``-promscrape.config``), data in ``workdir``.

    ``-search.latencyOffset=0s``: by default it hides the last 30 s of samples from queries, longer than a test.
    """
    exe = binary("victoria-metrics")
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "scrape.yml"
    config_path.write_text(yaml.safe_dump(scrape_config(targets, interval_s=interval_s)))
    return _start(
        "victoria-metrics",
        lambda port: [
            exe,
            f"-storageDataPath={workdir / 'data'}",
            f"-httpListenAddr=127.0.0.1:{port}",
            f"-promscrape.config={config_path}",
            "-search.latencyOffset=0s",
            "-search.disableCache",
            "-loggerLevel=WARN",
        ],
        workdir,
        "/health",
        flush_path="/internal/force_flush",
    )


def start_vmalert(workdir: Path, *, rule_files: Sequence[Path], store_url: str, interval_s: float = 1.0) -> Service:
    """vmalert evaluating ``rule_files`` against the store at ``store_url`` and writing the results back to it."""
    exe = binary("vmalert")
    workdir.mkdir(parents=True, exist_ok=True)
    return _start(
        "vmalert",
        lambda port: [
            exe,
            *(f"-rule={p}" for p in rule_files),
            f"-datasource.url={store_url}",
            f"-remoteWrite.url={store_url}",
            f"-remoteWrite.flushInterval={interval_s:g}s",
            f"-evaluationInterval={interval_s:g}s",
            f"-httpListenAddr=127.0.0.1:{port}",
            "-loggerLevel=WARN",
        ],
        workdir,
        "/health",
    )


# ---- expositions ----------------------------------------------------------------------------------------------


@dataclass
class Exposition:
    """A registry served on a loopback port by prometheus_client's own HTTP server."""

    registry: CollectorRegistry
    server: WSGIServer

    @property
    def target(self) -> str:
        """``127.0.0.1:PORT``, as a scrape config lists it."""
        return f"127.0.0.1:{self.server.server_port}"

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.server.shutdown()
        self.server.server_close()


def serve(registry: CollectorRegistry) -> Exposition:
    """Serve ``registry`` on a free loopback port until :meth:`Exposition.stop`."""
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    return Exposition(registry=registry, server=server)


# ---- the synthetic job ----------------------------------------------------------------------------------------
# A job of 8 ranks, tp=2, dp=2, pp=2 in Megatron's tp-cp-ep-dp-pp order (rank = tp + 2*dp + 4*pp), on two nodes of
# four GPUs (node-0 holds stage 0, node-1 stage 1). Every rank takes STEPS_PER_SECOND steps per second of wall time;
# each rank's seconds per step by breakdown category are in RANKS. Rank 2 got a heavier batch (more data wait, it
# makes its DP partners wait less); rank 5 is a straggler (slower compute; its DP partners wait 0.3 s per step on it).
# Own time = step time - exposed comm - bubble.

STEPS_PER_SECOND = 0.4
"""Steps per second of every rank: a step every 2.5 s of wall time (steps of 2.0-2.05 s plus the time between)."""

HISTORY_S = 1000.0
"""Wall time the job had run when the exposition started, at the rates below: every counter starts well above zero,
so no store's zero-clamp of rate() extrapolation applies."""

WARMUP_STEPS = 100.0
WARMUP_SECONDS_PER_STEP = 3.0
"""Before that history, 100 warm-up steps of 3 s each, all in ``other``: the counters' lifetime ratios differ from
their rates, so a rule that forgot rate() is wrong."""

JOB = "llama-8b-test"

_STAGE0 = {
    ("compute", ""): 1.2,
    ("exposed_comm", "tp"): 0.1,
    ("exposed_comm", "dp"): 0.2,
    ("exposed_comm", "pp"): 0.05,
    ("bubble", ""): 0.25,
    ("data", ""): 0.05,
    ("optimizer", ""): 0.1,
    ("checkpoint", ""): 0.02,
    ("other", ""): 0.03,
}  # 2.0 s per step; own 1.4 s
_STAGE1 = _STAGE0 | {("compute", ""): 1.3, ("exposed_comm", "dp"): 0.3, ("bubble", ""): 0.1}  # 2.05 s; own 1.5 s


@dataclass(frozen=True, slots=True, kw_only=True)
class Rank:
    """One rank of the synthetic job: coordinates, placement and per-step seconds, tokens and GPU readings."""

    rank: int
    node: int
    seconds_per_step: dict[tuple[str, str], float]
    """(category, axis) -> seconds per step (axis only on exposed_comm)."""
    tokens_per_step: float = 16384.0
    sequence_tokens: int = 4096
    """Every batch holds sequences of this length (so attention work per step = tokens x sequence length)."""
    utilization_ratio: float = 0.97
    sm_active_ratio: float = 0.7
    tensor_active_ratio: float = 0.4

    @property
    def labels(self) -> dict[str, str]:
        """The rank's :data:`RANK_LABELS`."""
        tp, dp, pp = self.rank % 2, (self.rank // 2) % 2, self.rank // 4
        return {
            "job": JOB,
            "rank": str(self.rank),
            "dp": str(dp),
            "tp": str(tp),
            "pp": str(pp),
            "cp": "0",
            "ep": "0",
            "node": f"node-{self.node}",
            "nvlink_domain": "nvl-a",
            "network_tier": "leaf-1",
            "gpu": str(self.rank % 4),
        }

    @property
    def step_seconds(self) -> float:
        """Seconds per step: the categories add up to it."""
        return sum(self.seconds_per_step.values())

    @property
    def own_seconds(self) -> float:
        """Step time minus exposed communication and bubble."""
        waiting = sum(v for (c, _a), v in self.seconds_per_step.items() if c in {"exposed_comm", "bubble"})
        return self.step_seconds - waiting


RANKS: tuple[Rank, ...] = (
    Rank(rank=0, node=0, seconds_per_step=_STAGE0),
    Rank(rank=1, node=0, seconds_per_step=_STAGE0),
    # heavy batch: 24576 tokens as 3 sequences of 8192; data wait 0.15 s, DP wait 0.1 s: 2.0 s, own 1.5 s
    Rank(
        rank=2,
        node=0,
        seconds_per_step=_STAGE0 | {("data", ""): 0.15, ("exposed_comm", "dp"): 0.1},
        tokens_per_step=24576.0,
        sequence_tokens=8192,
    ),
    Rank(rank=3, node=0, seconds_per_step=_STAGE0),
    Rank(
        rank=4, node=1, seconds_per_step=_STAGE1, utilization_ratio=0.98, sm_active_ratio=0.75, tensor_active_ratio=0.45
    ),
    # straggler: compute 1.6 s, nobody to wait for on DP: 2.05 s, own 1.8 s; reads 99 % busy
    Rank(
        rank=5,
        node=1,
        seconds_per_step=_STAGE1 | {("compute", ""): 1.6, ("exposed_comm", "dp"): 0.0},
        utilization_ratio=0.99,
        sm_active_ratio=0.75,
        tensor_active_ratio=0.45,
    ),
    Rank(
        rank=6, node=1, seconds_per_step=_STAGE1, utilization_ratio=0.98, sm_active_ratio=0.75, tensor_active_ratio=0.45
    ),
    Rank(
        rank=7, node=1, seconds_per_step=_STAGE1, utilization_ratio=0.98, sm_active_ratio=0.75, tensor_active_ratio=0.45
    ),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeHealth:
    """One sidecar's sources: up or not, and how fast each health counter grows (per second; 0 = flat)."""

    node: int
    up: dict[str, float]
    parse_errors_per_s: dict[str, float]
    dropped_per_s: dict[str, float]
    poll_seconds_per_s: dict[str, float]


SOURCES = ("train_events", "dcgm", "nccl_log")
NODES: tuple[NodeHealth, ...] = (
    NodeHealth(
        node=0,
        up={"train_events": 1, "dcgm": 1, "nccl_log": 1},
        parse_errors_per_s={"train_events": 0, "dcgm": 0, "nccl_log": 0},
        dropped_per_s={"train_events": 1.0, "dcgm": 0, "nccl_log": 0},  # a record flood on node-0
        poll_seconds_per_s={"train_events": 0.002, "dcgm": 0.001, "nccl_log": 0.003},
    ),
    NodeHealth(
        node=1,
        up={"train_events": 1, "dcgm": 0, "nccl_log": 1},  # node-1's dcgm-exporter is down
        parse_errors_per_s={"train_events": 0, "dcgm": 0, "nccl_log": 3.0},  # garbage in node-1's NCCL log
        dropped_per_s={"train_events": 0, "dcgm": 0, "nccl_log": 0},
        poll_seconds_per_s={"train_events": 0.002, "dcgm": 0.0005, "nccl_log": 0.004},
    ),
)


def _family(name: str, labels: Sequence[str]) -> CounterMetricFamily | GaugeMetricFamily:
    spec = BY_NAME[name]
    if spec.type == "counter":
        return CounterMetricFamily(spec.family, spec.help, labels=labels)
    return GaugeMetricFamily(spec.name, spec.help, labels=labels)


@dataclass(eq=False)  # registered in a registry, which keys collectors by identity
class SyntheticJob:
    """A prometheus_client collector for one node of the synthetic job: counters at their rates, read at scrape time.

    Every counter is ``rate x (HISTORY_S + seconds since start)`` (plus the warm-up on the step, own and ``other``
    counters), so what a store sees grows between scrapes and every ratio of two of a rank's rates is exact.
    """

    node: int
    started_s: float = field(default_factory=time.monotonic)

    def collect(self) -> Iterator[Metric]:
        """Yield the node's families (prometheus_client calls this on every scrape)."""
        t = HISTORY_S + time.monotonic() - self.started_s
        steps = STEPS_PER_SECOND * t
        ranks = [r for r in RANKS if r.node == self.node]
        rank_labels = list(RANK_LABELS)
        f = {
            name: _family(name, rank_labels + list(BY_NAME[name].labels))
            for name in (
                "meshscope_steps_total",
                "meshscope_step_seconds_total",
                "meshscope_own_seconds_total",
                "meshscope_breakdown_seconds_total",
                "meshscope_data_tokens_total",
                "meshscope_data_longest_sequence_tokens",
                "meshscope_data_attention_work_total",
                "meshscope_gpu_utilization_ratio",
                "meshscope_gpu_sm_active_ratio",
                "meshscope_gpu_tensor_active_ratio",
            )
        }
        warmup_s = WARMUP_STEPS * WARMUP_SECONDS_PER_STEP
        for r in ranks:
            values = [r.labels[k] for k in RANK_LABELS]
            f["meshscope_steps_total"].add_metric(values, WARMUP_STEPS + steps)
            f["meshscope_step_seconds_total"].add_metric(values, warmup_s + r.step_seconds * steps)
            f["meshscope_own_seconds_total"].add_metric(values, warmup_s + r.own_seconds * steps)
            for (category, axis), seconds in r.seconds_per_step.items():
                extra = warmup_s if category == "other" else 0.0
                f["meshscope_breakdown_seconds_total"].add_metric([*values, category, axis], extra + seconds * steps)
            f["meshscope_data_tokens_total"].add_metric(values, r.tokens_per_step * steps)
            f["meshscope_data_longest_sequence_tokens"].add_metric(values, r.sequence_tokens)
            f["meshscope_data_attention_work_total"].add_metric(values, r.tokens_per_step * r.sequence_tokens * steps)
            f["meshscope_gpu_utilization_ratio"].add_metric(values, r.utilization_ratio)
            f["meshscope_gpu_sm_active_ratio"].add_metric(values, r.sm_active_ratio)
            f["meshscope_gpu_tensor_active_ratio"].add_metric(values, r.tensor_active_ratio)
        yield from f.values()

        health = next(n for n in NODES if n.node == self.node)
        node_values = [JOB, f"node-{self.node}", "nvl-a", "leaf-1"]
        node_labels = [*NODE_LABELS, "source"]
        up = _family("meshscope_source_up", node_labels)
        errors = _family("meshscope_source_parse_errors_total", node_labels)
        dropped = _family("meshscope_source_dropped_total", node_labels)
        poll = _family("meshscope_source_poll_seconds_total", node_labels)
        for source in SOURCES:
            up.add_metric([*node_values, source], health.up[source])
            # flat counters sit at a non-zero level: rate() of them is 0, not absent
            errors.add_metric([*node_values, source], 5.0 + health.parse_errors_per_s[source] * t)
            dropped.add_metric([*node_values, source], 7.0 + health.dropped_per_s[source] * t)
            poll.add_metric([*node_values, source], health.poll_seconds_per_s[source] * t)
        yield from (up, errors, dropped, poll)


@contextlib.contextmanager
def synthetic_job() -> Iterator[list[Exposition]]:
    """Serve the synthetic job's two nodes, one exposition each, and stop them on the way out."""
    expositions = []
    try:
        for node in (0, 1):
            registry = CollectorRegistry(auto_describe=False)
            registry.register(SyntheticJob(node=node))
            expositions.append(serve(registry))
        yield expositions
    finally:
        for e in expositions:
            e.stop()

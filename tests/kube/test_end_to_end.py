"""End to end on an emulated cluster: TrainingJobs applied with kubectl -> the Job and the Service with the sidecar ->
pods scheduled onto labelled nodes -> real sidecars fed by simulated and by real gloo ranks, scraped by a real
Prometheus -> the cost table in status, in the ConfigMap, in ``kubectl get tj`` and ``kubectl meshscope cost``.

Real parts: the emulated API server (tests/kube_emulator) with the CRD applied by the real kubectl; the operator as
``meshscope-operator`` registers it (kopf, its HTTPS webhooks registered by kopf, reconcile, placement, both cost
tiers with a 1 s store interval, on demand deep analysis); ``meshscope-sidecar`` processes; a Prometheus with the
shipped recording rules; a 4-rank gloo job with the meshscope SDK (tests/data/sidecar/job/mesh_gloo.py).

What the test plays, as nothing else runs here: the Job controller (it creates the pods from the stored Job's
template, with the completion index), the scheduler (it binds them to labelled Nodes), the kubelet (it marks them
Running with a loopback pod IP, resolves the containers' environment from the pod object: values, downward API
fields, ``$(VAR)`` references; maps each volume to a directory: emptyDir, the downward API's labels file, the
placement ConfigMap; and starts the sidecar and the training processes with it), torchrun (one process per GPU,
``RANK = NODE_RANK x NPROC_PER_NODE + LOCAL_RANK``) and the cluster's DNS (``MASTER_ADDR``, pod 0's host name in the
headless Service, is pod 0's IP).

Two jobs: ``sim`` (Llama 3 8B, tp=2 dp=4 on 2 nodes of 4 GPUs; the core's simulator stands in for its training
processes, a straggler on rank 5) and ``gloo`` (tp=2 dp=2 on 2 nodes of 2 GPUs, the real gloo job). Expected values
come from independent paths: the records each sidecar holds (``/v1/steps``) for the continuous tier's step time,
and ``meshscope analyze --spec`` run as a command on those same records for the deep tier. Every wait has a deadline
and asserts on values, never on timings.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import yaml

from cost_sidecars import CLEAN, Sidecar
from kube_serving import NAMESPACE, Cluster, running_operator, wait_reconciled, write
from meshscope.analysis import CATEGORIES, break_down
from meshscope.jobs import spec_from_manifest
from meshscope.plan import plan_job
from meshscope.records import table_from_lines, write_records
from meshscope.simulation import Straggler, simulate
from meshscope_operator.costs import ANALYSIS_KEY, COST_TABLE_AVAILABLE, METRICS_AVAILABLE, status_from_analysis
from meshscope_operator.tiers import ANALYZE_NOW
from sidecar.promstack import start_prometheus

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from numpy.typing import NDArray

    from meshscope_operator.settings import OperatorSettings
    from sidecar.promstack import Service

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "sidecar" / "monitoring" / "recording-rules.yaml"
GLOO_SCRIPT = "tests/data/sidecar/job/mesh_gloo.py"
TIMEOUT_S = 180.0  # a deadline, not an expectation: every wait ends as soon as its condition holds
"""Longest any one wait may take (generous: the machine is shared)."""
STEPS = 6
"""Steps of each job; every sidecar keeps them all (its default is 64)."""
WINDOW = (0, 1)
"""The steps of the first deep analysis: ``deep_window_steps`` (2) from the oldest a sidecar keeps."""
SCRAPE_S = 1.0
CLIQUE = "nvidia.com/gpu.clique"
LEAF = "network.topology.nvidia.com/leaf"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


@dataclass(frozen=True)
class JobCase:
    """One TrainingJob of the test: its nodes (name, pod IP) and the labels those nodes carry."""

    name: str
    gpus_per_node: int
    tp: int
    dp: int
    nodes: tuple[tuple[str, str], ...]
    """(node name, the IP its pod gets), in completion-index order."""
    command: tuple[str, ...]

    @property
    def world(self) -> int:
        return self.gpus_per_node * len(self.nodes)

    def manifest(self) -> dict[str, Any]:
        return {
            "apiVersion": "meshscope.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": self.name},
            "spec": {
                "model": {"preset": "llama3-8b"},
                "parallelism": {"tp": self.tp, "dp": self.dp},
                "training": {"microBatchSize": 1, "globalBatchSize": self.dp, "distributedOptimizer": True},
                "hardware": {"gpu": "H100", "nodes": len(self.nodes), "gpusPerNode": self.gpus_per_node},
                "monitoring": {"sources": ["train"]},
                "template": {
                    "spec": {
                        "containers": [{"name": "trainer", "image": "trainer:test", "command": list(self.command)}]
                    }
                },
            },
        }


SIM = JobCase(
    name="sim",
    gpus_per_node=4,
    tp=2,
    dp=4,
    nodes=(("node-a", "127.0.0.2"), ("node-b", "127.0.0.3")),
    command=("python", "-c", "pass"),  # never run: the simulator stands in for these ranks
)
GLOO = JobCase(
    name="gloo",
    gpus_per_node=2,
    tp=2,
    dp=2,
    nodes=(("node-c", "127.0.0.4"), ("node-d", "127.0.0.5")),
    command=("python", GLOO_SCRIPT, str(STEPS), "0.05"),
)
NODE_LABELS = {
    "node-a": {CLIQUE: "clique-1", LEAF: "leaf-1"},
    "node-b": {CLIQUE: "clique-2", LEAF: "leaf-1"},
    "node-c": {CLIQUE: "clique-3", LEAF: "leaf-2"},
    "node-d": {CLIQUE: "clique-3", LEAF: "leaf-2"},
}


def _shared_port(hosts: list[str]) -> int:
    """One port free on every pod IP (every sidecar listens on its pod's IP, the operator's one sidecar port)."""
    for _ in range(20):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port: int = s.getsockname()[1]
        try:
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise AssertionError(f"no port free on all of {hosts}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, check: Callable[[], Any], timeout_s: float = TIMEOUT_S) -> Any:
    """``check()``'s first truthy result, polled until a deadline; fails naming ``what`` and the last result."""
    deadline = time.monotonic() + timeout_s
    got: Any = None
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}; last: {got!r}")
        time.sleep(0.2)


def _get_json(cluster: Cluster, *args: str) -> dict[str, Any]:
    done = cluster.kubectl.run("get", *args, "-o", "json")
    return json.loads(done.stdout) if done.returncode == 0 else {}


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c.get("type") == kind), {})


def _analysed(cluster: Cluster, name: str) -> dict[str, Any]:
    """The TrainingJob once a deep analysis answered the annotation (removed) with ``CostTableAvailable=True``."""
    obj = _get_json(cluster, "tj", name)
    done = obj and _condition(obj, COST_TABLE_AVAILABLE).get("status") == "True"
    return obj if done and ANALYZE_NOW not in (obj["metadata"].get("annotations") or {}) else {}


# ---------------------------------------------------------------------------------------------------- the kubelet


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _field(pod: dict[str, Any], path: str) -> str:
    """A downward API ``fieldRef`` of ``pod`` (the paths the operator uses; any other fails the test)."""
    m = re.fullmatch(r"metadata\.(annotations|labels)\['([^']+)'\]", path)
    if m:
        return str(pod["metadata"][m.group(1)][m.group(2)])
    known = {
        "spec.nodeName": pod["spec"].get("nodeName"),
        "status.hostIP": pod["status"].get("hostIP"),
        "status.podIP": pod["status"].get("podIP"),
        "metadata.name": pod["metadata"]["name"],
    }
    if path not in known or known[path] is None:
        raise AssertionError(f"the test's kubelet cannot resolve fieldRef {path!r} of pod {pod['metadata']['name']}")
    return str(known[path])


def container_env(pod: dict[str, Any], container: dict[str, Any], mounts: dict[str, Path]) -> dict[str, str]:
    """The container's environment as a kubelet gives it: values with ``$(VAR)`` expanded, downward API fields; a
    path under one of the container's mounts becomes the directory the test gave that volume."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            value = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), str(item["value"]))
        else:
            value = _field(pod, item["valueFrom"]["fieldRef"]["fieldPath"])
        for mount_path in sorted(mounts, key=len, reverse=True):
            value = value.replace(mount_path, str(mounts[mount_path]))
        env[item["name"]] = value
    return env


def volume_dirs(pod: dict[str, Any], root: Path, configmaps: dict[str, dict[str, str]]) -> dict[str, Path]:
    """Each volume of ``pod`` as a directory: emptyDir empty, downwardAPI its labels file, configMap its items."""
    dirs: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes", []):
        d = root / volume["name"]
        d.mkdir(parents=True)
        if "downwardAPI" in volume:
            for item in volume["downwardAPI"]["items"]:
                assert item["fieldRef"]["fieldPath"] == "metadata.labels", item
                labels = pod["metadata"]["labels"]
                (d / item["path"]).write_text("".join(f'{k}="{v}"\n' for k, v in sorted(labels.items())))
        elif "configMap" in volume:
            data = configmaps[volume["configMap"]["name"]]
            for item in volume["configMap"]["items"]:
                (d / item["path"]).write_text(data[item["key"]])
        else:
            assert "emptyDir" in volume, volume  # sources: [train] asks for no host path
        dirs[volume["name"]] = d
    return dirs


def mounts_of(container: dict[str, Any], dirs: dict[str, Path]) -> dict[str, Path]:
    return {m["mountPath"]: dirs[m["name"]] for m in container.get("volumeMounts", [])}


@dataclass
class Running:
    """Everything the test started; :meth:`stop` ends it all, whatever happened."""

    sidecars: list[Sidecar] = field(default_factory=list)
    ranks: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def stop(self) -> None:
        for p in self.ranks:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        for s in self.sidecars:
            s.stop()


@pytest.fixture(scope="module")
def pods_root() -> Iterator[Path]:
    """A short directory for the pods' volumes (the record socket's path is limited to 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="ms-e2e-", dir="/tmp"))
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False, timeout=30)


@pytest.fixture(scope="module")
def sidecar_port() -> int:
    return _shared_port([ip for case in (SIM, GLOO) for _, ip in case.nodes])


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory, sidecar_port: int) -> Iterator[Service]:
    targets = [f"{ip}:{sidecar_port}" for case in (SIM, GLOO) for _, ip in case.nodes]
    with start_prometheus(
        tmp_path_factory.mktemp("prometheus"), targets=targets, rule_files=[RULES], interval_s=SCRAPE_S
    ) as prom:
        yield prom


@pytest.fixture(scope="module")
def e2e_operator(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory, prometheus: Service, sidecar_port: int
) -> Iterator[OperatorSettings]:
    with running_operator(
        cluster,
        tmp_path_factory.mktemp("certs"),
        sidecar_port=sidecar_port,
        master_port=_free_port(),
        metrics_url=prometheus.url,
        metrics_interval_seconds=SCRAPE_S,
        metrics_timeout_seconds=5.0,
        deep_interval_seconds=3600.0,  # only on demand here
        deep_timeout_seconds=30.0,
    ) as settings:
        yield settings


@pytest.fixture
def running() -> Iterator[Running]:
    r = Running()
    try:
        yield r
    finally:
        r.stop()


# ---------------------------------------------------------------------------------------------------- by hand


def _records_of(sidecars: list[Sidecar]) -> list[bytes]:
    """Every record the job's sidecars hold, from ``/v1/steps``."""
    lines: list[bytes] = []
    for s in sidecars:
        with urllib.request.urlopen(s.url + "/v1/steps", timeout=10) as r:
            lines += [x + b"\n" for x in r.read().splitlines() if x.strip()]
    return lines


def _median_step_seconds(lines: list[bytes]) -> float:
    """The median over ranks of each rank's mean step time, interpolated as PromQL's ``quantile``."""
    per_rank: dict[int, list[float]] = {}
    for line in lines:
        r = json.loads(line)
        per_rank.setdefault(r["rank"], []).append((r["end_us"] - r["start_us"]) / 1e6)
    return float(np.quantile([sum(v) / len(v) for v in per_rank.values()], 0.5))


def _suffix_shares(lines: list[bytes]) -> dict[str, list[NDArray[np.float64]]]:
    """Each category beyond compute as the continuous tier sees it (exposed comm per axis as a whole), by the core's
    breakdown of the records: per rank, its share of its step time over its steps from its k-th on, for every k. The
    tier's rates start from each rank's first scrape, which falls after a number of steps that depends on when the
    job started against the scrapes."""
    table = table_from_lines(lines)
    ticks = break_down(table, align_clocks=False).ticks.astype(np.float64)
    s = table.steps
    names = [f"exposed comm {c.split('.')[1]}" if c.startswith("comm.") else c for c in CATEGORIES]
    shares: dict[str, list[NDArray[np.float64]]] = {}
    for r in np.unique(s.rank):
        rows = np.flatnonzero(s.rank == r)
        rows = rows[np.argsort(s.step[rows])]
        # suffix sums: the rank's steps from the k-th on, for every k
        total = np.cumsum(ticks[rows].sum(axis=1)[::-1])[::-1]
        for name in set(names):
            cols = [i for i, n in enumerate(names) if n == name]
            part = np.cumsum(ticks[rows][:, cols].sum(axis=1)[::-1])[::-1]
            shares.setdefault(name, []).append(part / total)
    return {c: vs for c, vs in shares.items() if c != "compute"}


TOP_COST_TIE = 0.01
"""Shares of the step this close to the costliest category's are a tie: the continuous tier's rates and the core's
breakdown of the same records round and weigh ranks differently (a real gloo job measured exposed comm dp 11.28 %
against tp 11.18 %; under load a run named dp where the records put tp first)."""


def _check_top_cost(top_cost: str, lines: list[bytes]) -> None:
    """``topCost`` ("exposed comm dp 23.3%") names a costliest category of the records, or one tied with it
    (:data:`TOP_COST_TIE`), over steps the tier can have seen (the mean over ranks of their shares from some step k
    on, :func:`_suffix_shares`: the shares drift over a real job's steps, and a real gloo job's tier named dp at 29 %
    where the whole run put another axis first, 23 % against 18 %), with a share between the mean over ranks of the
    lowest and of the highest of a rank's shares from any k on."""
    name, _, percent_text = top_cost.rpartition(" ")
    per_rank = _suffix_shares(lines)
    assert name in per_rank, top_cost
    n = min(len(v) for vs in per_rank.values() for v in vs)
    by_start = {c: np.mean([v[:n] for v in vs], axis=0) for c, vs in per_rank.items()}
    summary = {c: (float(v[0]), float(v.min()), float(v.max())) for c, v in by_start.items()}
    best = np.max(np.stack(list(by_start.values())), axis=0)
    assert bool(np.any(by_start[name] >= best - TOP_COST_TIE)), (top_cost, summary)
    low = float(np.mean([v.min() for v in per_rank[name]]))
    high = float(np.mean([v.max() for v in per_rank[name]]))
    assert 100 * (low - TOP_COST_TIE) <= float(percent_text.rstrip("%")) <= 100 * (high + TOP_COST_TIE), (
        top_cost,
        summary,
    )


def _meshscope(*args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "meshscope", *args], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True
    ).stdout


# ---------------------------------------------------------------------------------------------------- the test


def _schedule(cluster: Cluster, case: JobCase, job: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
    """Play the Job controller, the scheduler and the kubelet's status: the Job's pods, bound and Running."""
    template = job["spec"]["template"]
    pods = []
    for index, (node, ip) in enumerate(case.nodes):
        meta = template["metadata"]
        labels = {
            **meta.get("labels", {}),
            COMPLETION_INDEX: str(index),
            "batch.kubernetes.io/job-name": case.name,
            "batch.kubernetes.io/controller-uid": job["metadata"]["uid"],
        }
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{case.name}-{index}-x{index}k9z",
                "labels": labels,
                "annotations": {**meta.get("annotations", {}), COMPLETION_INDEX: str(index)},
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": case.name,
                        "uid": job["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {**template["spec"], "hostname": f"{case.name}-{index}"},
        }
        done = cluster.kubectl.run(
            "create", "--validate=false", "-f", str(write(tmp, f"{case.name}-{index}.yaml", yaml.safe_dump(pod)))
        )
        assert done.returncode == 0, done.stderr
        name = pod["metadata"]["name"]
        cluster.kubectl.run(
            "patch", "pod", name, "--type=merge", "-p", json.dumps({"spec": {"nodeName": node}}), check=True
        )
        status = {"phase": "Running", "hostIP": "127.0.0.1", "podIP": ip, "podIPs": [{"ip": ip}]}
        cluster.kubectl.run(
            "patch",
            "pod",
            name,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": status}),
            check=True,
        )
        pods.append(_get_json(cluster, "pod", name))
    return pods


@dataclass
class World:
    """What the phases of the test share: the parts, and what each phase found."""

    cluster: Cluster
    settings: OperatorSettings
    prometheus: Service
    running: Running
    pods_root: Path
    tmp: Path
    pods: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    sidecars: dict[str, list[Sidecar]] = field(default_factory=dict)
    trainers: dict[str, list[tuple[dict[str, Any], dict[str, str]]]] = field(default_factory=dict)
    """Per job, per pod: the training container and its environment as the kubelet resolved it."""
    records: dict[str, list[bytes]] = field(default_factory=dict)


def _apply_and_schedule(w: World) -> None:
    """Nodes and TrainingJobs through kubectl; reconcile's Job and Service; the Job's pods, bound and Running."""
    nodes = [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": n, "labels": v}} for n, v in NODE_LABELS.items()]
    path = write(w.tmp, "nodes.yaml", yaml.safe_dump_all(nodes))
    done = w.cluster.kubectl.run("create", "--validate=false", "-f", str(path))
    assert done.returncode == 0, done.stderr
    for case in (SIM, GLOO):
        path = write(w.tmp, f"{case.name}.yaml", yaml.safe_dump(case.manifest()))
        done = w.cluster.kubectl.run("apply", "--validate=false", "-f", str(path))
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"trainingjob.meshscope.io/{case.name} created\n"
    for case in (SIM, GLOO):
        tj = wait_reconciled(w.cluster, case.name)
        job = _wait(f"Job {case.name}", lambda c=case: _get_json(w.cluster, "job", c.name))
        assert job["metadata"]["ownerReferences"][0]["uid"] == tj["metadata"]["uid"]
        assert (job["spec"]["completionMode"], job["spec"]["completions"]) == ("Indexed", len(case.nodes))
        init = job["spec"]["template"]["spec"]["initContainers"]
        assert [(c["name"], c["restartPolicy"], c["image"]) for c in init] == [
            ("meshscope-sidecar", "Always", w.settings.sidecar_image)
        ]
        service = _wait(f"Service {case.name}", lambda c=case: _get_json(w.cluster, "service", c.name))
        assert (service["spec"]["clusterIP"], service["spec"]["publishNotReadyAddresses"]) == ("None", True)
        w.pods[case.name] = _schedule(w.cluster, case, job, w.tmp)
        for pod in w.pods[case.name]:  # the pod webhook saw the template's injection and added nothing
            assert [c["name"] for c in pod["spec"]["initContainers"]] == ["meshscope-sidecar"]


def _placement_data(cluster: Cluster, name: str) -> dict[str, str]:
    data = _get_json(cluster, "configmap", f"{name}-placement").get("data") or {}
    return data if "placement.json" in data else {}


def _published_placements(w: World) -> dict[str, dict[str, str]]:
    """The placement ConfigMaps, once the operator wrote them from the nodes' labels."""
    placements = {}
    for case in (SIM, GLOO):
        data = _wait(f"ConfigMap {case.name}-placement", lambda c=case: _placement_data(w.cluster, c.name))
        g = case.gpus_per_node
        assert json.loads(data["placement.json"])["nodes"] == {
            node: {
                "nvlink_domain": NODE_LABELS[node][CLIQUE],
                "network_tier": NODE_LABELS[node][LEAF],
                "ranks": list(range(i * g, (i + 1) * g)),
            }
            for i, (node, _) in enumerate(case.nodes)
        }
        placements[f"{case.name}-placement"] = data
    return placements


def _start_sidecars(w: World, placements: dict[str, dict[str, str]]) -> None:
    """The kubelet: one sidecar per pod with the pod object's environment and volumes; the trainers' environment."""
    for case in (SIM, GLOO):
        w.sidecars[case.name], w.trainers[case.name] = [], []
        for index, pod in enumerate(w.pods[case.name]):
            dirs = volume_dirs(pod, w.pods_root / f"{case.name}{index}", placements)
            [spec] = pod["spec"]["initContainers"]
            env = container_env(pod, spec, mounts_of(spec, dirs))
            port = int(env["MESHSCOPE_SIDECAR_PORT"])
            # cost_sidecars.Sidecar runs and reads the process; its environment is the pod's, whole
            sidecar = Sidecar(node_rank=index, host=pod["status"]["podIP"], port=port, socket_path="")
            sidecar.socket_path = env["MESHSCOPE_SIDECAR_SOCKETS"].removeprefix("unix:")
            sidecar.env = {**CLEAN, **env, "MESHSCOPE_SIDECAR_TRAIN_POLL_SECONDS": "0.2"}
            w.running.sidecars.append(sidecar)
            sidecar.start(env["MESHSCOPE_LAYOUT"])
            w.sidecars[case.name].append(sidecar)
            [trainer] = pod["spec"]["containers"]
            w.trainers[case.name].append((trainer, container_env(pod, trainer, mounts_of(trainer, dirs))))
    for s in w.running.sidecars:
        s.wait_serving()


def _check_identities(w: World) -> None:
    """The placement reached the sidecars: each one's identity is its node's ranks, clique and leaf."""
    for case in (SIM, GLOO):
        for index, ((node, _), s) in enumerate(zip(case.nodes, w.sidecars[case.name], strict=True)):
            with urllib.request.urlopen(s.url + "/healthz", timeout=10) as r:
                health = json.loads(r.read())
            assert health["mode"] == "full", health
            g = case.gpus_per_node
            assert f"job {case.name!r} on node {node!r}" in health["identity"]
            assert ", ".join(f"gpu {i} = rank {index * g + i}" for i in range(g)) in health["identity"]
            assert "ranks from " in health["identity"]  # from the placement file, not the default rule

    def zeros() -> list[dict[str, Any]]:
        got = w.prometheus.query("meshscope_steps_total == 0")
        return got if len(got) == SIM.world + GLOO.world else []

    # Scraped at zero before any step: every rate() ratio of the rules is then exactly the job's totals.
    scraped = _wait("Prometheus to scrape every rank's counters at 0", zeros)
    labelled = {(r["metric"]["node"], r["metric"]["nvlink_domain"], r["metric"]["network_tier"]) for r in scraped}
    assert labelled == {(n, v[CLIQUE], v[LEAF]) for n, v in NODE_LABELS.items()}


def _feed_simulated(w: World) -> None:
    """(a) The core's simulator as the sim job's ranks, through the SDK's transport into each pod's socket."""
    spec = spec_from_manifest({**SIM.manifest(), "metadata": {"name": SIM.name, "namespace": NAMESPACE}})
    write_records(w.tmp / "sim.jsonl", simulate(spec, steps=STEPS, faults=[Straggler(rank=5, factor=1.5)]).table)
    lines = (w.tmp / "sim.jsonl").read_bytes().splitlines(keepends=True)
    lines.sort(key=lambda x: (json.loads(x)["step"], json.loads(x)["rank"]))
    g = SIM.gpus_per_node
    for index, s in enumerate(w.sidecars[SIM.name]):
        s.feed([x for x in lines if index * g <= json.loads(x)["rank"] < (index + 1) * g])


def _run_gloo(w: World) -> None:
    """(b) The real gloo ranks, started as torchrun starts them in each pod, with the pod's environment."""
    master = w.pods[GLOO.name][0]["status"]["podIP"]  # the cluster's DNS: gloo-0.gloo.training.svc is pod 0
    for trainer, env in w.trainers[GLOO.name]:
        assert env["MASTER_ADDR"] == f"gloo-0.gloo.{NAMESPACE}.svc"
        assert env["MESHSCOPE_COLLECTOR"].endswith("/records.sock")
        nproc = int(env["NPROC_PER_NODE"])
        for local in range(nproc):
            rank_env = {
                **CLEAN,
                **env,
                "MASTER_ADDR": master,
                "RANK": str(int(env["NODE_RANK"]) * nproc + local),
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(nproc),
                "OMP_NUM_THREADS": "1",
            }
            command = [sys.executable if c == "python" else c for c in trainer["command"]]
            w.running.ranks.append(subprocess.Popen(command, env=rank_env, cwd=ROOT))
    assert [p.wait(timeout=180) for p in w.running.ranks] == [0] * GLOO.world


def _collect(w: World) -> None:
    """Every step in every sidecar (their records kept for the checks) and scraped by Prometheus."""

    def all_records(c: JobCase) -> list[bytes]:
        lines = _records_of(w.sidecars[c.name])
        return lines if len(lines) == c.world * STEPS else []

    for case in (SIM, GLOO):
        w.records[case.name] = _wait(f"{case.name}'s records", lambda c=case: all_records(c))
        total = f'sum(meshscope_steps_total{{job="{case.name}"}})'
        _wait(
            f"every step of {case.name} scraped",
            lambda t=total, c=case: [r["value"][1] for r in w.prometheus.query(t)] == [str(c.world * STEPS)],
        )


def _continuous_status(w: World, case: JobCase) -> dict[str, Any]:
    """The status once the continuous tier wrote the step time the records give (polled: the rules catch up)."""
    want = _median_step_seconds(w.records[case.name])

    def read() -> dict[str, Any]:
        obj = _get_json(w.cluster, "tj", case.name)
        status = obj.get("status") or {}
        ok = _condition(obj, METRICS_AVAILABLE).get("status") == "True"
        return status if ok and status.get("stepTimeSeconds") == pytest.approx(want, rel=1e-6) else {}

    return _wait(f"the continuous tier's step time of {case.name} ({want:.6f} s)", read)


SETTLE_S = 60.0
"""How long the continuous tier's shares may take to settle after the job ended, seconds (a deadline)."""


def _settled_top_cost(w: World, case: JobCase) -> dict[str, Any]:
    """The continuous tier's status once its ``topCost`` holds against the records (:func:`_check_top_cost`).

    Prometheus extrapolates each counter's ``rate()`` beyond its first sample by half a scrape interval, or only back
    to where the counter would have been zero when that is nearer (``extrapolatedRate``: ``sampled interval x first
    value / increase`` before the first sample): while a short job's series span one or two intervals, a share's
    numerator and denominator stretch differently (a 6-step gloo job read "exposed comm tp 32.6%" where the records'
    shares from any step on reached 27.7 %). After the job ended the counters stay flat and the sampled interval
    grows with every scrape, so both zero points fall out of reach and both stretch alike: the share settles on the
    records'. Polled every scrape until the deadline; then the check's own assertion.
    """
    deadline = time.monotonic() + SETTLE_S
    while True:
        status = _continuous_status(w, case)
        try:
            _check_top_cost(status["topCost"], w.records[case.name])
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(SCRAPE_S)
        else:
            return status


def _check_deep(w: World, case: JobCase) -> dict[str, Any]:
    """The deep tier's ConfigMap, status and ``kubectl meshscope cost`` against ``meshscope analyze`` of the same
    records; returns that independent analysis."""
    obj = _wait(f"the deep analysis of {case.name}", lambda: _analysed(w.cluster, case.name))
    status = obj["status"]
    assert status["costTableRef"] == f"{case.name}-meshscope-costs"
    configmap = _get_json(w.cluster, "configmap", status["costTableRef"])
    assert configmap["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    written = json.loads(configmap["data"][ANALYSIS_KEY])

    # The independent path: the window's records as the sidecars hold them, through `meshscope analyze --spec`.
    # The operator concatenates the sidecars' answers in the order they arrive, and the core's analysis of the same
    # records depends on their order by microseconds (node codes follow first appearance, and the clock offsets
    # differ with the reference node: tests/core/test_record_order.py), so both orders of the two pods are analysed
    # and the ConfigMap must be exactly one of them.
    manifest = {**case.manifest(), "metadata": {"name": case.name, "namespace": NAMESPACE}}
    spec_file = str(write(w.tmp, f"{case.name}-spec.yaml", yaml.safe_dump(manifest)))
    per_pod = [[x for x in _records_of([s]) if json.loads(x)["step"] in WINDOW] for s in w.sidecars[case.name]]
    candidates = []
    for i, order in enumerate((per_pod, per_pod[::-1])):
        window = w.tmp / f"{case.name}-window-{i}.jsonl"
        window.write_bytes(b"".join(b"".join(lines) for lines in order))
        args = (str(window), "--spec", spec_file, "--quiet")
        candidates.append((args, json.loads(_meshscope("analyze", *args, "--json"))))
    matching = [(a, e) for a, e in candidates if e["rows"] == written["rows"]]
    assert matching, (written["rows"], [e["rows"] for _, e in candidates])
    args, expected = matching[0]
    assert written["steps"] == {"first": WINDOW[0], "last": WINDOW[-1], "count": len(WINDOW)}
    assert written["ranks_seen"] == case.world
    for key in ("summary", "findings", "expected_vs_measured"):
        assert written[key] == expected[key], key
    # every pod answered: the only partial-data notes are the core's own, on these records
    assert written["partial_data"] == expected["partial_data"]
    condition = _condition(obj, COST_TABLE_AVAILABLE)
    assert condition["reason"] == ("PartialData" if expected["partial_data"] else "Analysed"), condition
    summary = status_from_analysis(expected, configmap=status["costTableRef"], planner_findings=[])
    assert status["costTable"] == summary["costTable"]
    assert status["topCost"] == summary["topCost"]
    planned = {f.code for f in plan_job(spec_from_manifest(manifest)).findings}
    measured = {f["code"] for f in expected["findings"]}
    assert status["findings"] == len(expected["findings"]) + len(planned - measured)

    printed = w.cluster.kubectl.run("meshscope", "cost", case.name, "-n", NAMESPACE)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == _meshscope("analyze", *args)
    return expected


def test_trainingjobs_to_cost_tables_through_kubectl(
    cluster: Cluster,
    e2e_operator: OperatorSettings,
    prometheus: Service,
    running: Running,
    pods_root: Path,
    tmp_path: Path,
) -> None:
    w = World(cluster, e2e_operator, prometheus, running, pods_root, tmp_path)
    _apply_and_schedule(w)
    _start_sidecars(w, _published_placements(w))
    _check_identities(w)
    _feed_simulated(w)
    _run_gloo(w)
    _collect(w)

    # the continuous tier: the step time and (before any deep analysis) the top cost, from the recording rules
    for case in (SIM, GLOO):
        status = _settled_top_cost(w, case)
        assert "costTableRef" not in status

    # the deep tier, on demand
    for case in (SIM, GLOO):
        cluster.kubectl.run("annotate", "tj", case.name, f"{ANALYZE_NOW}=1", check=True)
    analyses = {case.name: _check_deep(w, case) for case in (SIM, GLOO)}

    # kubectl get tj: the printer columns from that status. The continuous tier keeps writing the store's step time
    # (the deep tier wrote its window's once): wait for it, so that nothing writes the row while kubectl reads it.
    statuses = {case.name: _continuous_status(w, case) for case in (SIM, GLOO)}
    text = cluster.kubectl.run("get", "tj", check=True).stdout
    table = [re.split(r"\s{2,}", line.strip()) for line in text.strip().splitlines()]
    assert table[0] == ["NAME", "LAYOUT", "WORLD", "PHASE", "STEP", "TOP COST", "FINDINGS", "AGE"]
    assert [r[0] for r in table[1:]] == ["gloo", "sim"]
    for case, row in zip((GLOO, SIM), table[1:], strict=True):
        s = statuses[case.name]
        assert row[1:4] == [f"dp{case.dp}-tp{case.tp}", str(case.world), s["phase"]]
        assert float(row[4]) == pytest.approx(_median_step_seconds(w.records[case.name]), rel=1e-6)
        expected = status_from_analysis(analyses[case.name], configmap="", planner_findings=[])
        assert row[5:7] == [expected["topCost"], str(s["findings"])]

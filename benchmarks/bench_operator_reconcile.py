"""Reconcile's cost: one 16,384-GPU TrainingJob reconciled in process, its 2,048-node placement, and the operator's
memory with 100 TrainingJobs of assorted sizes reconciled and indexed.

1. **Reconcile, in process, no API**: ``examples/llama3-405b-h100.yaml`` (2,048 nodes x 8 H100 = 16,384 GPUs) loaded,
   planned, its Job and Service built and its status patch made: what :func:`~meshscope_operator.reconciling.
   reconcile_training_job` does besides its requests. Also the sizes of the Job, the status and the placement.
2. **Placement, pure**: its 2,048 pods bound to 2,048 nodes (256 NVLink domains of 8 nodes, 32 leaves) into a
   placement, the planner's placement checks re-run on it, the document the sidecars read.
3. **Operator memory**: the operator (kopf, every handler of ``meshscope-operator``) in this process against kmock
   in another process (so the mock's objects are not counted); 100 TrainingJobs, the examples in turn (32 to 18,432
   GPUs), created and reconciled (each Job and Service made, the status written, kopf's indices filled). The peak
   resident memory of this process is printed beside its figure before the operator started. Issue bar: under
   300 MiB apart from the deep tier's working set (the deep tier is another slice's and is not running here).

No assertions on time: the figures are printed.

    .venv/bin/python benchmarks/bench_operator_reconcile.py                # all three
    .venv/bin/python benchmarks/bench_operator_reconcile.py --skip-memory  # 1 and 2 only
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from timing import machine_reference, peak_rss_mib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from meshscope.plan import plan_job  # noqa: E402
from meshscope_operator.children import job_manifest, service_manifest  # noqa: E402
from meshscope_operator.placements import PodEntry, nodes_by_index, resolve_placement  # noqa: E402
from meshscope_operator.settings import OperatorSettings  # noqa: E402
from meshscope_operator.spec import job_spec  # noqa: E402
from meshscope_operator.statuses import Condition, ConditionType, Phase, planned_fields, status_patch  # noqa: E402
from operator_serving import NAMESPACE, RESOURCES, load_example  # noqa: E402 - tests/ is put on the path above

TEMPLATE = {"spec": {"containers": [{"name": "trainer", "image": "nvcr.io/nvidia/pytorch:25.01-py3"}]}}
JOBS = 100
CLIQUE = "nvidia.com/gpu.clique"
LEAF = "network.topology.nvidia.com/leaf"
TIMEOUT_S = 300.0
STARTUP_S = 60.0


def _body(name: str, example: str) -> dict[str, Any]:
    body = load_example(example)
    body["metadata"] = {"name": name, "namespace": NAMESPACE, "uid": str(uuid.uuid4()), "generation": 1}
    body["spec"]["template"] = copy.deepcopy(TEMPLATE)
    return body


def _ms(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"p50 {statistics.median(ordered) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms over {len(ordered)} runs"


def bench_reconcile(runs: int) -> None:
    """Step 1: the in-process part of reconcile for 16,384 GPUs."""
    settings = OperatorSettings(api_server="http://127.0.0.1:1")
    body = _body("llama-405b", "llama3-405b-h100")
    times, status, job = [], {}, {}
    for _ in range(runs):
        t0 = time.perf_counter()
        spec = job_spec(body)
        plan = plan_job(spec)
        fields = planned_fields(spec, plan)
        job = job_manifest(body, spec, settings)
        service_manifest(body, spec)
        planned = Condition(type=ConditionType.PLANNED, status=True, reason="Planned", message="planned")
        status = status_patch(
            body, phase=Phase.PENDING, fields=fields, conditions=[planned], now="2026-01-01T00:00:00Z"
        )
        times.append(time.perf_counter() - t0)
    print(
        f"reconcile of {spec.world_size:,} GPUs ({spec.hardware.nodes:,} nodes) in process (load, plan, Job, Service, "
        f"status): {_ms(times)}; the Job {len(json.dumps(job)):,} bytes, the status {len(json.dumps(status)):,} bytes",
        flush=True,
    )


def bench_placement(runs: int) -> None:
    """Step 2: 2,048 bound pods into a placement, checked."""
    spec = job_spec(_body("llama-405b", "llama3-405b-h100"))
    nodes = spec.hardware.nodes
    planned_codes = frozenset(f.code for f in plan_job(spec).findings)
    entries = [PodEntry(job=spec.name, name=f"{spec.name}-{i}", index=i, node=f"node-{i:04d}") for i in range(nodes)]
    labels = {
        f"node-{i:04d}": {
            "nvidia.com/gpu.clique": f"clique-{i // 8}",
            "network.topology.nvidia.com/leaf": f"leaf-{i // 64}",
        }
        for i in range(nodes)
    }
    times, document = [], ""
    for _ in range(runs):
        t0 = time.perf_counter()
        where = nodes_by_index(spec, entries)
        assert isinstance(where, dict)  # every pod is bound
        result = resolve_placement(
            spec,
            where,
            labels,
            domain_label=CLIQUE,
            tier_labels=(LEAF,),
            planned_codes=planned_codes,
            raised=frozenset(),
        )
        document = json.dumps(result.document, sort_keys=True)
        times.append(time.perf_counter() - t0)
    print(
        f"placement of {nodes:,} nodes (index, resolve, checks, document): {_ms(times)}; "
        f"placement.json {len(document):,} bytes (ConfigMap limit 1,048,576)",
        flush=True,
    )


def serve_mock() -> None:
    """``--serve-mock``: kmock in this process, its URL on stdout, until stdin closes."""
    import kmock  # noqa: PLC0415

    from operator_serving import NamingEmulator  # noqa: PLC0415

    async def main() -> None:
        emulator = NamingEmulator()
        async with emulator, kmock.Server(emulator) as server:
            for key, info in RESOURCES.items():
                emulator.resources[key] = kmock.ResourceInfo(**info)
            print(str(server.url).rstrip("/"), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio.run(main())


def _current_rss_mib() -> float:
    """Resident memory now, MiB (``VmRSS`` of /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _api(url: str, method: str, path: str, body: object = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read() or b"{}")


def bench_memory() -> None:
    """Step 3: the operator's peak RSS with 100 TrainingJobs reconciled and indexed."""
    import kopf  # noqa: PLC0415
    import trustme  # noqa: PLC0415

    from meshscope_operator.handlers import register  # noqa: PLC0415

    mock = subprocess.Popen(
        [sys.executable, __file__, "--serve-mock"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert mock.stdout is not None
        url = mock.stdout.readline().strip()
        examples = sorted(p.stem for p in (ROOT / "examples").glob("*.yaml"))
        bodies = [_body(f"tj-{i:03d}", examples[i % len(examples)]) for i in range(JOBS)]
        gpus = [job_spec(b).world_size for b in bodies]
        before = peak_rss_mib()
        certs = Path(tempfile.mkdtemp(prefix="meshscope-bench-"))
        ca = trustme.CA()
        issued = ca.issue_cert("127.0.0.1")
        issued.cert_chain_pems[0].write_to_path(str(certs / "tls.crt"))
        issued.private_key_pem.write_to_path(str(certs / "tls.key"))
        settings = OperatorSettings(
            api_server=url,
            liveness_port=0,
            namespaces=(NAMESPACE,),
            webhook_addr="127.0.0.1",
            webhook_port=_free_port(),
            webhook_cert_file=str(certs / "tls.crt"),
            webhook_key_file=str(certs / "tls.key"),
        )
        registry = kopf.OperatorRegistry()
        register(registry, settings)

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url, insecure=True, scheme="Bearer", token="dummy")

        @kopf.on.startup(registry=registry)
        def plain_kmock(settings: kopf.OperatorSettings, **_: Any) -> None:
            settings.scanning.disabled = True  # kmock's /api/v1/namespaces is broken (reference, trap T6)

        took, peak, phases = asyncio.run(_run_operator(registry, url, bodies))
        rss = _current_rss_mib()
        counted = ", ".join(f"{n} {phase}" for phase, n in sorted(phases.items()))
        print(
            f"operator with {JOBS} TrainingJobs ({min(gpus):,} to {max(gpus):,} GPUs, {sum(gpus):,} in all) created "
            f"and reconciled in {took:.1f} s ({counted}): peak RSS {peak:.0f} MiB, {rss:.0f} MiB resident at the end "
            f"(this process before the operator started: {before:.0f} MiB; target under 300 MiB apart from the deep "
            "tier's working set)",
            flush=True,
        )
    finally:
        if mock.stdin is not None:
            mock.stdin.close()
        try:
            mock.wait(30)
        except subprocess.TimeoutExpired:
            mock.kill()
            mock.wait(30)


async def _run_operator(
    registry: Any,
    url: str,
    bodies: list[dict[str, Any]],
) -> tuple[float, float, dict[str, int]]:
    """Run the operator, create ``bodies``, wait until each is reconciled: seconds, peak RSS (MiB), phases."""
    import kopf  # noqa: PLC0415

    stop, ready = asyncio.Event(), asyncio.Event()
    running = kopf.operator(
        registry=registry, standalone=True, namespaces=[NAMESPACE], stop_flag=stop, ready_flag=ready
    )
    task = asyncio.create_task(running)
    phases: dict[str, int] = {}
    try:
        waiting = asyncio.create_task(ready.wait())
        await asyncio.wait({task, waiting}, timeout=STARTUP_S, return_when=asyncio.FIRST_COMPLETED)
        if not ready.is_set():
            waiting.cancel()
            raise RuntimeError(f"the operator did not start: {task.exception() if task.done() else 'timeout'}")
        t0 = time.perf_counter()
        collection = f"/apis/meshscope.io/v1alpha1/namespaces/{NAMESPACE}/trainingjobs"
        for body in bodies:
            await asyncio.to_thread(_api, url, "POST", collection, body)
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            listed = await asyncio.to_thread(_api, url, "GET", collection)
            phases = {}
            for o in listed["items"]:
                phase = str((o.get("status") or {}).get("phase") or "none")
                phases[phase] = phases.get(phase, 0) + 1
            if phases.get("none", 0) == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        return time.perf_counter() - t0, peak_rss_mib(), phases
    finally:
        stop.set()
        await asyncio.wait({task}, timeout=STARTUP_S)


def main() -> None:
    """Print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of steps 1 and 2 (default 20)")
    parser.add_argument("--skip-memory", action="store_true", help="skip step 3 (the operator with 100 jobs)")
    parser.add_argument("--serve-mock", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_mock:
        serve_mock()
        return
    if args.memory_only:
        bench_memory()
        return
    print(machine_reference(), flush=True)
    bench_reconcile(args.runs)
    bench_placement(args.runs)
    if not args.skip_memory:
        # In a process of its own, so its peak resident memory is the operator's, not steps 1 and 2's.
        subprocess.run([sys.executable, __file__, "--memory-only"], check=True, timeout=TIMEOUT_S + 2 * STARTUP_S)


if __name__ == "__main__":
    main()

"""The operator as the chart runs it: ``meshscope-operator`` in a process of its own, with the environment of the
rendered Deployment, and its memory against the chart's request and limit.

The chart is rendered by real Helm (tests/charting.py); the process gets the Deployment's environment after the
kubelet's ``$(VAR)`` expansion, with the listen address on loopback, free ports, and the certificate directory
replaced by a temporary one holding the rendered Secret's files. kopf logs in through a kubeconfig pointing at
kmock (plain HTTP on loopback, in a thread of this process). The client trusts only the rendered ``caBundle`` and
checks the Service's DNS name, as the API server does. Printed: the process' resident memory (VmRSS) and its peak
(VmHWM) once ready, after N TrainingJob reviews of ``examples/llama3-405b-h100.yaml`` (16,384 GPUs: loaded, planned,
warnings) and after N pod reviews, beside the chart's default request and limit. The deep tier's working set is
not in it (no reconcile or cost tier runs here).

meshscope-operator as it is cannot log in (tests/chart/test_chart_runs_the_operator.py, the xfail: its plain
kopf.OperatorRegistry has no login handler), so this runs its ``main()`` with kopf's default registry class, which
adds kopf's kubeconfig and service-account logins, and says so; everything else is the entry point's.

    .venv/bin/python benchmarks/bench_chart_operator.py                 # 200 reviews of each
    .venv/bin/python benchmarks/bench_chart_operator.py --requests 1000
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import socket
import ssl
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from charting import (  # noqa: E402 - tests/ is on the path
    NAMESPACE,
    OPERATOR_RESOURCES,
    KmockApi,
    chart_webhooks,
    container,
    operator_process,
    render,
)

TIMEOUT_S = 60.0
LAUNCHER = (
    "import sys, kopf; from kopf._core.intents.registries import SmartOperatorRegistry; "
    "kopf.OperatorRegistry = SmartOperatorRegistry; "
    "from meshscope_operator.__main__ import main; sys.exit(main([]))"
)
"""``meshscope-operator`` with kopf's default registry class (its login handlers): see the module's docstring."""


def _memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB, from /proc."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in {"VmRSS", "VmHWM"}:
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def _review(obj: dict[str, Any], resource: tuple[str, str, str, str]) -> bytes:
    group, version, plural, kind = resource
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()),
                "kind": {"group": group, "version": version, "kind": kind},
                "resource": {"group": group, "version": version, "resource": plural},
                "name": obj["metadata"]["name"],
                "namespace": NAMESPACE,
                "operation": "CREATE",
                "userInfo": {"username": "kubernetes-admin"},
                "object": obj,
                "oldObject": None,
                "dryRun": False,
            },
        }
    ).encode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="reviews of each webhook (default 200)")
    args = parser.parse_args()

    rendered = render()
    webhooks = chart_webhooks(rendered)
    service_host = f"{rendered.one('Service')['metadata']['name']}.{NAMESPACE}.svc"
    api = KmockApi(OPERATOR_RESOURCES)
    try:
        with (
            tempfile.TemporaryDirectory() as tmp,
            operator_process(rendered, Path(tmp), api.url, [sys.executable, "-c", LAUNCHER]) as operator,
        ):
            problem = operator.ready(TIMEOUT_S, api)
            if problem is not None:
                sys.stderr.write(f"meshscope-operator: {problem}\n")
                return 1
            pid = operator.process.pid
            ready = _memory_mib(pid)

            def send(webhook: str, payload: bytes) -> float:
                config = webhooks[webhook]["clientConfig"]
                context = ssl.create_default_context(cadata=base64.b64decode(config["caBundle"]).decode())
                raw = socket.create_connection(("127.0.0.1", operator.webhook_port), timeout=TIMEOUT_S)
                with context.wrap_socket(raw, server_hostname=service_host) as tls:
                    connection = http.client.HTTPConnection(service_host, timeout=TIMEOUT_S)
                    connection.sock = tls
                    started = time.perf_counter()
                    for _ in range(args.requests):
                        connection.request(
                            "POST", config["service"]["path"], payload, {"Content-Type": "application/json"}
                        )
                        response = connection.getresponse()
                        answer = json.loads(response.read())
                        if response.status != 200 or not answer["response"]["allowed"]:
                            raise SystemExit(f"unexpected answer: {response.status} {answer}")
                    return (time.perf_counter() - started) / args.requests

            job = yaml.safe_load((ROOT / "examples" / "llama3-405b-h100.yaml").read_text())
            job["metadata"]["namespace"] = NAMESPACE
            job_s = send(
                "validating/trainingjobs.meshscope.io",
                _review(job, ("meshscope.io", "v1alpha1", "trainingjobs", "TrainingJob")),
            )
            after_jobs = _memory_mib(pid)
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "w-0", "namespace": NAMESPACE, "labels": {"meshscope.io/trainingjob": "absent"}},
                "spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]},
            }
            pod_s = send("mutating/sidecar.meshscope.io", _review(pod, ("", "v1", "pods", "Pod")))
            after_pods = _memory_mib(pid)
    finally:
        api.close()

    resources = container(rendered)["resources"]
    print(f"meshscope-operator with the chart's default settings ({os.cpu_count()} CPUs, shared machine)")
    print(f"  chart: requests memory {resources['requests']['memory']}, limits memory {resources['limits']['memory']}")
    print(f"  ready:                                   RSS {ready[0]:6.1f} MiB, peak {ready[1]:6.1f} MiB")
    print(
        f"  after {args.requests} TrainingJob reviews ({job_s * 1000:5.1f} ms each): "
        f"RSS {after_jobs[0]:6.1f} MiB, peak {after_jobs[1]:6.1f} MiB  (16,384 GPUs, planned)"
    )
    print(
        f"  after {args.requests} pod reviews         ({pod_s * 1000:5.1f} ms each): "
        f"RSS {after_pods[0]:6.1f} MiB, peak {after_pods[1]:6.1f} MiB"
    )
    print("  (kopf's default registry class for its login handlers: see the docstring)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

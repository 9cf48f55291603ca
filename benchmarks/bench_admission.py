"""Admission latency of the validating webhook for a 16,384-GPU TrainingJob, through kopf's real HTTPS server.

The operator runs as in tests/operator (kopf's ``WebhookServer`` with trustme certificates, kmock as the API, each in
a thread of its own); the spec is ``examples/llama3-405b-h100.yaml`` (2,048 nodes x 8 H100 = 16,384 GPUs, dp 128
tp 8 pp 16 vpp 4: loaded, planned, three findings returned as warnings). Latency is measured at the client, from
sending the AdmissionReview to the last byte of the answer, over one kept-alive TLS connection as the API server
keeps them (and, apart, with a TLS handshake per request). Target: p99 under 100 ms. The pod webhook and the pure
review (no HTTP) are timed beside it.

    .venv/bin/python benchmarks/bench_admission.py              # 300 requests of each
    .venv/bin/python benchmarks/bench_admission.py --requests 1000
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from timing import machine_reference, peak_rss_mib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from meshscope_operator.reviews import review_training_job  # noqa: E402
from operator_serving import NAMESPACE, labelled_pod, load_example, serve  # noqa: E402 - tests/ is put on the path above

TARGET_P99_MS = 100.0


def _review(obj: dict, resource: tuple[str, str, str, str]) -> bytes:
    group, version, plural, kind = resource
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()),
                "kind": {"group": group, "version": version, "kind": kind},
                "resource": {"group": group, "version": version, "resource": plural},
                "namespace": NAMESPACE,
                "operation": "CREATE",
                "userInfo": {"username": "bench"},
                "object": obj,
                "dryRun": False,
            },
        }
    ).encode()


def _percentiles(samples_s: list[float]) -> str:
    ms = sorted(s * 1e3 for s in samples_s)
    p50 = statistics.median(ms)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return f"p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  max {ms[-1]:6.2f} ms  (n={len(ms)})"


def _time(served, path: str, body: bytes, n: int, *, keep_alive: bool) -> list[float]:
    host, port = served.base_url.removeprefix("https://").split(":")
    conn = None
    samples = []
    for _ in range(n):
        if conn is None or not keep_alive:
            if conn is not None:
                conn.close()
            conn = http.client.HTTPSConnection(host, int(port), context=served.context, timeout=30)
        t = time.perf_counter()
        conn.request("POST", f"/{path}", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        samples.append(time.perf_counter() - t)
        if response.status != 200 or not json.loads(data)["response"]["allowed"]:
            raise SystemExit(f"unexpected answer {response.status}: {data[:300]!r}")
    if conn is not None:
        conn.close()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    job = load_example("llama3-405b-h100")
    job["metadata"]["namespace"] = NAMESPACE
    tj = _review(job, ("meshscope.io", "v1alpha1", "trainingjobs", "TrainingJob"))
    pod = _review(labelled_pod("llama3-70b-h100"), ("", "v1", "pods", "Pod"))
    print(f"machine: {machine_reference()}")
    t = time.perf_counter()
    for _ in range(20):
        review = review_training_job(job, max_warnings=10, max_planned_gpus=1 << 18)
    print(f"pure review of the 16,384-GPU spec (load + plan + warnings): {(time.perf_counter() - t) / 20 * 1e3:.2f} ms")
    print(f"  {len(review.warnings)} warnings: {[w.split(':')[0] for w in review.warnings]}")
    with tempfile.TemporaryDirectory() as tmp:
        stack = serve(Path(tmp))
        served = next(stack)
        try:
            _time(served, "trainingjobs", tj, 20, keep_alive=True)  # warm up
            kept = _time(served, "trainingjobs", tj, args.requests, keep_alive=True)
            fresh = _time(served, "trainingjobs", tj, max(args.requests // 3, 10), keep_alive=False)
            pods = _time(served, "sidecar", pod, args.requests, keep_alive=True)
        finally:
            stack.close()
    print(f"TrainingJob webhook, 16,384 GPUs, kept-alive TLS:  {_percentiles(kept)}")
    print(f"TrainingJob webhook, 16,384 GPUs, TLS per request: {_percentiles(fresh)}")
    print(f"pod webhook (sidecar injection), kept-alive TLS:   {_percentiles(pods)}")
    p99 = sorted(kept)[min(len(kept) - 1, round(0.99 * (len(kept) - 1)))] * 1e3
    verdict = "meets" if p99 < TARGET_P99_MS else "MISSES"
    print(f"target: p99 < {TARGET_P99_MS:.0f} ms: {verdict} ({p99:.2f} ms); peak RSS {peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()

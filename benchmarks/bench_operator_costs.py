"""What the operator's cost table costs at 16,384 ranks: the deep tier's analysis of one window, and the status update.

The records are the core simulator's Llama 3 405B job on 16,384 H100s (``examples/llama3-405b-h100.yaml``: tp 8,
pp 16 with 4 virtual stages, dp 128, 16 micro-batches) with rank 1234 computing 1.4x as long, for one window of
``--window`` steps (the operator's default ``MESHSCOPE_OPERATOR_DEEP_WINDOW_STEPS`` is 2). Printed:

- **deep tier**: ``analyze`` of the window with the spec (what ``deep.analyse_window`` runs in its worker thread)
  plus ``to_dict`` and the JSON cut to the ConfigMap's budget: wall time and the peak RSS it adds (the working set
  beyond the records' table), in a process of its own;
- **records**: the JSON-lines bytes a window is (what the operator pulls from the sidecars) and what parsing them
  into a table costs, measured on the first rows of the window and scaled to all of them (marked *scaled*);
- **status update**: building the status summary and the ConfigMap from that analysis, validating the summary
  against the CRD's status schema, and the bytes of each; and the continuous tier's summary from a reading.

No assertions on time; the machine's load is printed first (``timing.machine_reference``).

    .venv/bin/python benchmarks/bench_operator_costs.py               # 16,384 ranks, a window of 2 steps
    .venv/bin/python benchmarks/bench_operator_costs.py --window 1
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from timing import machine_reference

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SAMPLE_ROWS = 2048
"""Rank-steps encoded and parsed to measure the records' bytes and parse rate."""


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(window: int) -> dict[str, object]:
    """Everything measured, in this process (run by ``main`` in a fresh one)."""
    import jsonschema  # noqa: PLC0415 - imported in the measuring process only
    import msgspec  # noqa: PLC0415
    import yaml  # noqa: PLC0415

    from meshscope.analysis import analyze  # noqa: PLC0415
    from meshscope.jobs.loading import load_spec  # noqa: PLC0415
    from meshscope.records import table_from_lines  # noqa: PLC0415
    from meshscope.records.writing import _table_lines  # noqa: PLC0415 - the writer's own encoder, one chunk
    from meshscope.simulation import Straggler, simulate  # noqa: PLC0415
    from meshscope_operator.costs import (  # noqa: PLC0415
        MetricsReading,
        configmap_for,
        encode_analysis,
        status_from_analysis,
        status_from_reading,
    )

    spec = load_spec(ROOT / "examples" / "llama3-405b-h100.yaml")
    t = time.perf_counter()
    sim = simulate(spec, steps=window, faults=[Straggler(rank=1234, factor=1.4)])
    simulate_s = time.perf_counter() - t
    table = sim.table
    del sim
    rss_table = _rss_mib()

    # the records as the sidecars serve them: JSON lines, measured on the first SAMPLE_ROWS rank-steps
    encoder = msgspec.json.Encoder()
    lines: list[bytes] = []
    for chunk in _table_lines(table):
        lines.extend(encoder.encode(x) + b"\n" for x in chunk)
        if len(lines) >= SAMPLE_ROWS:
            break
    lines = lines[:SAMPLE_ROWS]
    sample_bytes = sum(map(len, lines))
    t, cpu = time.perf_counter(), time.process_time()
    table_from_lines(lines, where="bench")
    parse_s, parse_cpu_s = time.perf_counter() - t, time.process_time() - cpu
    scale = table.n_rows / len(lines)

    t, cpu = time.perf_counter(), time.process_time()
    analysis = analyze(table, spec=spec)
    analyze_s, analyze_cpu_s = time.perf_counter() - t, time.process_time() - cpu
    t = time.perf_counter()
    as_dict = analysis.to_dict()
    text = encode_analysis(as_dict)
    encode_s = time.perf_counter() - t
    rss_deep = _rss_mib()

    crd = yaml.safe_load((ROOT / "crds" / "trainingjobs.meshscope.io.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    validator = jsonschema.Draft202012Validator(schema)
    owner = {"apiVersion": "meshscope.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "llama3-405b-h100"}}
    t = time.perf_counter()
    status = status_from_analysis(as_dict, configmap="llama3-405b-h100-meshscope-costs")
    configmap = configmap_for({**owner, "metadata": {**owner["metadata"], "namespace": "training", "uid": "u"}}, text)
    errors = list(validator.iter_errors({k: v for k, v in status.items() if v is not None}))
    status_s = time.perf_counter() - t
    reading = MetricsReading(
        median_step_seconds=as_dict["summary"]["median_step_seconds"],
        shares={("compute", ""): 0.6, ("exposed_comm", "dp"): 0.1, ("bubble", ""): 0.3},
    )
    t = time.perf_counter()
    continuous = status_from_reading(reading)
    continuous_errors = list(validator.iter_errors(continuous))
    continuous_s = time.perf_counter() - t
    return {
        "ranks": int(analysis.ranks_seen),
        "steps": window,
        "rank_steps": table.n_rows,
        "intervals": table.n_intervals,
        "simulate_s": simulate_s,
        "rss_after_table_mib": rss_table,
        "record_bytes_per_rank_step": sample_bytes / len(lines),
        "window_bytes_scaled": sample_bytes * scale,
        "parse_s_scaled": parse_s * scale,
        "parse_cpu_s_scaled": parse_cpu_s * scale,
        "analyze_s": analyze_s,
        "analyze_cpu_s": analyze_cpu_s,
        "to_dict_and_json_s": encode_s,
        "peak_rss_mib": rss_deep,
        "status_s": status_s,
        "status_bytes": len(json.dumps(status).encode()),
        "status_valid": not errors,
        "configmap_data_bytes": len(text.encode()),
        "configmap_bytes": len(json.dumps(configmap).encode()),
        "continuous_s": continuous_s,
        "continuous_bytes": len(json.dumps(continuous).encode()),
        "continuous_valid": not continuous_errors,
        "findings": [f.code for f in analysis.findings],
    }


def main() -> None:
    """Run :func:`one` in a fresh process (so its peak RSS is its own) and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=2, help="steps in the window (default 2)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.window)))
        return
    print(machine_reference(), flush=True)
    proc = subprocess.run(
        [sys.executable, __file__, "--one", "--window", str(args.window)],
        capture_output=True,
        text=True,
        check=False,
        cwd=HERE,
    )
    if proc.returncode != 0:
        sys.exit(proc.stderr[-4000:])
    r = json.loads(proc.stdout.splitlines()[-1])
    mib = 1 << 20
    print(
        f"Llama 3 405B, {r['ranks']:,} ranks x {r['steps']} steps: {r['rank_steps']:,} rank-steps, "
        f"{r['intervals']:,} intervals (simulated in {r['simulate_s']:.1f} s)"
    )
    print("deep tier, one window:")
    print(
        f"  records pulled        {r['window_bytes_scaled'] / mib:,.0f} MiB ({r['record_bytes_per_rank_step']:,.0f} "
        f"bytes per rank-step; scaled from {SAMPLE_ROWS:,} rank-steps)"
    )
    print(
        f"  parse to a table      {r['parse_s_scaled']:.1f} s wall, {r['parse_cpu_s_scaled']:.1f} s CPU (scaled from "
        f"{SAMPLE_ROWS:,} rank-steps)"
    )
    print(f"  analyze (with spec)   {r['analyze_s']:.1f} s wall, {r['analyze_cpu_s']:.1f} s CPU (one thread)")
    print(f"  to_dict + JSON        {r['to_dict_and_json_s'] * 1000:.0f} ms")
    print(
        f"  peak RSS              {r['peak_rss_mib']:,.0f} MiB ({r['rss_after_table_mib']:,.0f} MiB with the "
        f"table alone; the working set adds {r['peak_rss_mib'] - r['rss_after_table_mib']:,.0f} MiB)"
    )
    print(f"  findings              {', '.join(r['findings']) or 'none'}")
    print("status update:")
    print(
        f"  deep summary          {r['status_s'] * 1000:.1f} ms to build + validate; {r['status_bytes']:,} bytes; "
        f"valid against the CRD: {r['status_valid']}"
    )
    print(
        f"  ConfigMap             {r['configmap_data_bytes']:,} bytes of analysis.json, {r['configmap_bytes']:,} "
        f"bytes in all (limit 1,048,576)"
    )
    print(
        f"  continuous summary    {r['continuous_s'] * 1000:.1f} ms; {r['continuous_bytes']:,} bytes; valid: "
        f"{r['continuous_valid']}"
    )


if __name__ == "__main__":
    main()

"""What the operator's cost table costs at 16,384 ranks: the deep tier's analysis of one window, and the status update.

The records are the core simulator's Llama 3 405B job on 16,384 H100s (``examples/llama3-405b-h100.yaml``: tp 8,
pp 16 with 4 virtual stages, dp 128, 16 micro-batches) with rank 1234 computing 1.4x as long, for one window of
``--window`` steps (the operator's ``MESHSCOPE_OPERATOR_DEEP_WINDOW_STEPS``, default 2, bounded by
``MESHSCOPE_OPERATOR_DEEP_WINDOW_RANK_STEPS``). Printed:

- **records**: the JSON lines a window is (what a sidecar keeps), and the packed columns the sidecars answer instead
  (``meshscope.columns/2``): bytes, and what packing costs one sidecar (its node's 8 ranks);
- **the operator's side**, in a process of its own so that its peak RSS is its own, as ``deep.analyse_window``
  runs it: unpacking the 2,048 answers into one table, ``analyze`` with the spec, ``to_dict`` and the JSON cut to
  the ConfigMap's budget; beside it, what parsing the same window as JSON lines in the operator would cost
  (measured on the first rank-steps and scaled, marked *scaled*: the path of sidecars that do not pack);
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
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import machine_reference

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SAMPLE_ROWS = 2048
"""Rank-steps parsed as JSON lines to measure the operator's parse rate of the unpacked path."""


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def sidecars(window: int, packs_file: Path) -> dict[str, object]:
    """Simulate the window, encode each node's records as its sidecar keeps them, pack them, write the packs."""
    import msgspec  # noqa: PLC0415 - imported in the measuring process only

    from meshscope.jobs.loading import load_spec  # noqa: PLC0415
    from meshscope.records import pack_lines, table_from_lines  # noqa: PLC0415
    from meshscope.records.writing import _table_lines  # noqa: PLC0415 - the writer's own encoder
    from meshscope.simulation import Straggler, simulate  # noqa: PLC0415

    spec = load_spec(ROOT / "examples" / "llama3-405b-h100.yaml")
    t = time.perf_counter()
    sim = simulate(spec, steps=window, faults=[Straggler(rank=1234, factor=1.4)])
    simulate_s = time.perf_counter() - t
    table = sim.table
    del sim
    encoder = msgspec.json.Encoder()
    node_of_row = table.steps.node.tolist()
    by_node: dict[int, list[bytes]] = {}
    row = 0
    for chunk in _table_lines(table):
        for x in chunk:
            by_node.setdefault(node_of_row[row], []).append(encoder.encode(x) + b"\n")
            row += 1
    names = table.node_names
    rank_steps, intervals = table.n_rows, table.n_intervals
    del table
    json_bytes = sum(len(x) for lines in by_node.values() for x in lines)
    sample = [x for lines in by_node.values() for x in lines][:SAMPLE_ROWS]
    t, cpu = time.perf_counter(), time.process_time()
    table_from_lines(sample, where="bench")
    parse_s, parse_cpu_s = time.perf_counter() - t, time.process_time() - cpu
    scale = rank_steps / len(sample)
    pack_s, packed_bytes = [], 0
    with packs_file.open("wb") as f:
        for node in sorted(by_node):
            t = time.perf_counter()
            data, _ = pack_lines(by_node.pop(node), where="sidecar")
            pack_s.append(time.perf_counter() - t)
            packed_bytes += len(data)
            where = f"pod {names[node]}".encode()
            f.write(struct.pack("<IQ", len(where), len(data)) + where + data)
    pack_s.sort()
    return {
        "ranks": int(spec.world_size),
        "steps": window,
        "rank_steps": rank_steps,
        "intervals": intervals,
        "simulate_s": simulate_s,
        "pods": len(pack_s),
        "json_bytes": json_bytes,
        "packed_bytes": packed_bytes,
        "pack_s_median": pack_s[len(pack_s) // 2],
        "pack_s_max": pack_s[-1],
        "parse_s_scaled": parse_s * scale,
        "parse_cpu_s_scaled": parse_cpu_s * scale,
    }


def operator_side(packs_file: Path) -> dict[str, object]:
    """What the operator does with the pulled answers (``deep.analyse_window``), and the status update."""
    import jsonschema  # noqa: PLC0415
    import yaml  # noqa: PLC0415

    from meshscope.jobs.loading import load_spec  # noqa: PLC0415
    from meshscope_operator.costs import (  # noqa: PLC0415
        MetricsReading,
        configmap_for,
        status_from_analysis,
        status_from_reading,
    )
    from meshscope_operator.deep import PodRecords, analyse_window  # noqa: PLC0415

    spec = load_spec(ROOT / "examples" / "llama3-405b-h100.yaml")
    records = []
    with packs_file.open("rb") as f:
        while head := f.read(12):
            n_where, n_data = struct.unpack("<IQ", head)
            where = f.read(n_where).decode()
            records.append(PodRecords(pod=where.removeprefix("pod "), packed=f.read(n_data)))
    steps = set()
    rss_answers = _rss_mib()
    from meshscope.records import packed_steps  # noqa: PLC0415

    for r in records:
        steps |= packed_steps(r.packed or b"", where=r.pod)
    t, cpu = time.perf_counter(), time.process_time()
    result = analyse_window(records, window=frozenset(steps), spec=spec, notes=[])
    deep_s, deep_cpu_s = time.perf_counter() - t, time.process_time() - cpu
    rss_deep = _rss_mib()

    crd = yaml.safe_load((ROOT / "crds" / "trainingjobs.meshscope.io.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    validator = jsonschema.Draft202012Validator(schema)
    owner = {"apiVersion": "meshscope.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "llama3-405b-h100"}}
    t = time.perf_counter()
    status = status_from_analysis(result.analysis, configmap="llama3-405b-h100-meshscope-costs")
    configmap = configmap_for(
        {**owner, "metadata": {**owner["metadata"], "namespace": "training", "uid": "u"}}, result.json
    )
    errors = list(validator.iter_errors({k: v for k, v in status.items() if v is not None}))
    status_s = time.perf_counter() - t
    reading = MetricsReading(
        median_step_seconds=result.analysis["summary"]["median_step_seconds"],
        shares={("compute", ""): 0.6, ("exposed_comm", "dp"): 0.1, ("bubble", ""): 0.3},
    )
    t = time.perf_counter()
    continuous = status_from_reading(reading)
    continuous_errors = list(validator.iter_errors(continuous))
    continuous_s = time.perf_counter() - t
    return {
        "deep_s": deep_s,
        "deep_cpu_s": deep_cpu_s,
        "rss_answers_mib": rss_answers,
        "peak_rss_mib": rss_deep,
        "status_s": status_s,
        "status_bytes": len(json.dumps(status).encode()),
        "status_valid": not errors,
        "configmap_data_bytes": len(result.json.encode()),
        "configmap_bytes": len(json.dumps(configmap).encode()),
        "continuous_s": continuous_s,
        "continuous_bytes": len(json.dumps(continuous).encode()),
        "continuous_valid": not continuous_errors,
        "findings": [f["code"] for f in result.analysis["findings"]],
    }


def _in_process(*args: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False, cwd=HERE)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-4000:])
    result: dict[str, object] = json.loads(proc.stdout.splitlines()[-1])
    return result


def main() -> None:
    """Run the sidecars' part and the operator's part each in a fresh process, and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=2, help="steps in the window (default 2)")
    parser.add_argument("--sidecars", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--operator", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sidecars:
        print(json.dumps(sidecars(args.window, args.sidecars)))
        return
    if args.operator:
        print(json.dumps(operator_side(args.operator)))
        return
    print(machine_reference(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-deep-") as tmp:
        packs = Path(tmp) / "packs.bin"
        r = _in_process("--sidecars", str(packs), "--window", str(args.window))
        o = _in_process("--operator", str(packs))
    mib = 1 << 20
    print(
        f"Llama 3 405B, {r['ranks']:,} ranks x {r['steps']} steps: {r['rank_steps']:,} rank-steps, "
        f"{r['intervals']:,} intervals (simulated in {r['simulate_s']:.1f} s)"
    )
    print(f"records of the window, {r['pods']:,} pods:")
    print(f"  as JSON lines         {r['json_bytes'] / mib:,.0f} MiB")
    print(
        f"  packed columns        {r['packed_bytes'] / mib:,.0f} MiB ({r['packed_bytes'] / r['json_bytes']:.0%} of "
        f"the lines); packing one pod's records in its sidecar: median {r['pack_s_median'] * 1000:.0f} ms, max "
        f"{r['pack_s_max'] * 1000:.0f} ms"
    )
    print("deep tier, the operator's side of one window (deep.analyse_window, one thread):")
    print(
        f"  unpack + analyze      {o['deep_s']:.1f} s wall, {o['deep_cpu_s']:.1f} s CPU (2,048 packed answers -> "
        f"one table -> analyze with the spec -> to_dict + JSON)"
    )
    print(
        f"  the same as JSON      parsing the lines alone would add {r['parse_s_scaled']:.1f} s wall, "
        f"{r['parse_cpu_s_scaled']:.1f} s CPU (scaled from {SAMPLE_ROWS:,} rank-steps)"
    )
    print(
        f"  peak RSS              {o['peak_rss_mib']:,.0f} MiB ({o['rss_answers_mib']:,.0f} MiB with the answers "
        f"read; the table and the analysis add {o['peak_rss_mib'] - o['rss_answers_mib']:,.0f} MiB)"
    )
    print(f"  findings              {', '.join(o['findings']) or 'none'}")
    print("status update:")
    print(
        f"  deep summary          {o['status_s'] * 1000:.1f} ms to build + validate; {o['status_bytes']:,} bytes; "
        f"valid against the CRD: {o['status_valid']}"
    )
    print(
        f"  ConfigMap             {o['configmap_data_bytes']:,} bytes of analysis.json, {o['configmap_bytes']:,} "
        f"bytes in all (limit 1,048,576)"
    )
    print(
        f"  continuous summary    {o['continuous_s'] * 1000:.1f} ms; {o['continuous_bytes']:,} bytes; valid: "
        f"{o['continuous_valid']}"
    )


if __name__ == "__main__":
    main()

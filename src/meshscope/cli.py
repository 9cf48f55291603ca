"""The ``meshscope`` command line.

Exit codes: 0 success, 2 invalid input (the message on stderr, no traceback), 1 an internal error (a one-line
message; ``MESHSCOPE_DEBUG=1`` shows the traceback). Human output carries a unit on every number; ``--json`` prints
base units (bytes, seconds, FLOPs) for machines.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshscope import __version__
from meshscope.analysis import add_analyze_parser
from meshscope.emulation import DEMO_BLOCK_MS
from meshscope.errors import MeshscopeError
from meshscope.formatting import human_bytes, human_count, human_seconds, human_si, percent, render_table
from meshscope.hardware import default_hardware
from meshscope.loading import load_spec
from meshscope.models import PRESETS, lookup_model
from meshscope.plan import plan_job
from meshscope.records.memory import tune_memory_for_columns
from meshscope.reporting import add_report_parser
from meshscope.running import add_run_parser, demo_settings, run_job
from meshscope.search import SearchRequest, search_layouts
from meshscope.simulate import add_simulate_parser
from meshscope.spec import Precision, Recompute
from meshscope.summarizing import report_run

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from meshscope.search import Candidate

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that exits with 2 and one line, like every other invalid input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"meshscope: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The whole command-line surface (frozen by a snapshot test)."""
    parser = _Parser(prog="meshscope", description="Which parallelism axis is costing your training run time.")
    parser.add_argument("--version", action="version", version=f"meshscope {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    plan = sub.add_parser("plan", help="plan a TrainingJob: memory per stage, collectives, expected step time")
    plan.add_argument("file", nargs="?", help="TrainingJob manifest (YAML)")
    plan.add_argument("--json", action="store_true", help="print one JSON object (base units) instead of tables")
    plan.add_argument("--search", action="store_true", help="enumerate layouts for --model on --gpus x --hardware")
    plan.add_argument("--gpus", type=int, help="with --search: number of GPUs")
    plan.add_argument("--model", help=f"with --search: model preset ({', '.join(PRESETS)})")
    plan.add_argument("--hardware", help="with --search: GPU type from the catalogue (e.g. H100, B200, GB200)")
    plan.add_argument("--global-batch", type=int, default=1024, help="with --search: sequences per step (1024)")
    plan.add_argument("--seq-length", type=int, help="with --search: sequence length in tokens (model default)")
    plan.add_argument("--precision", default="bf16", choices=[p.value for p in Precision], help="with --search")
    plan.add_argument(
        "--recompute", default="selective", choices=[r.value for r in Recompute], help="with --search (selective)"
    )
    plan.add_argument("--top", type=int, default=15, help="with --search: layouts to print (15)")
    plan.set_defaults(handler=_cmd_plan)

    demo = sub.add_parser(
        "demo",
        help="run the bundled tiny job on 8 local CPU ranks and show what meshscope measures",
        description="Train examples/train_tiny.py on 8 local CPU ranks (pp=2, dp=2, tp=2 on two emulated nodes of 4, "
        "emulated accelerator time), then print the cost table with the plan's expectations, the findings, the "
        "per-stage expected-vs-measured comparison, and write OUT/report.html and OUT/trace.json.",
    )
    demo.add_argument("--cp", action="store_true", help="context-parallel variant: pp=2, cp=2, tp=2")
    demo.add_argument("--ep", action="store_true", help="expert-parallel variant: MoE in every layer, ep=2")
    demo.add_argument("--straggler", metavar="RANK:FACTOR", help="make RANK compute FACTOR x slower (e.g. 5:2)")
    demo.add_argument(
        "--imbalance", metavar="RANK:FACTOR", help="give RANK's data-parallel replica FACTOR x the tokens (e.g. 2:3)"
    )
    demo.add_argument("--steps", type=int, default=DEMO_STEPS, help=f"training steps ({DEMO_STEPS})")
    demo.add_argument("--out", default="meshscope-demo", help="output directory (./meshscope-demo)")
    demo.set_defaults(handler=_cmd_demo)
    add_run_parser(sub, report=report_run)
    add_analyze_parser(sub)
    add_report_parser(sub)
    add_simulate_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("analyze", "report", "simulate"):  # (``run`` keeps its training command in args.command)
        tune_memory_for_columns()  # millions of intervals: cheap page faults, freed memory reused
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except MeshscopeError as exc:
        sys.stderr.write(f"meshscope: error: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("meshscope: interrupted\n")
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - the last line of defence: no traceback unless asked for
        if os.environ.get("MESHSCOPE_DEBUG"):
            traceback.print_exc()
        sys.stderr.write(
            f"meshscope: internal error: {type(exc).__name__}: {exc} (set MESHSCOPE_DEBUG=1 for the traceback)\n"
        )
        return EXIT_INTERNAL


# ---------------------------------------------------------------------------------------------------------- plan


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.search:
        return _cmd_search(args)
    if not args.file:
        raise _UsageError("plan needs a TrainingJob FILE, or --search --gpus N --model NAME --hardware GPU")
    spec = load_spec(args.file)
    plan = plan_job(spec)
    data = plan.to_dict()
    if args.json:
        _print_json(data)
    else:
        header = (
            f"meshscope plan: {spec.name} — {spec.model.name} ({human_count(plan.total_params)} params) on "
            f"{spec.world_size} x {spec.hardware.gpu.name} ({spec.hardware.nodes} nodes x "
            f"{spec.hardware.gpus_per_node} GPUs), {spec.layout.describe()}"
        )
        print(header)
        print(render_plan(data))
    return EXIT_OK


class _UsageError(MeshscopeError):
    """A command line that names too little."""


def render_plan(data: dict[str, Any]) -> str:
    """The plan as readable tables, findings first."""
    out: list[str] = []
    findings = data["findings"]
    if findings:
        rows = [[f["severity"].upper(), f["code"], f["message"]] for f in findings]
        out.append(_render_left(["severity", "finding", "evidence"], rows, title=f"\nFindings ({len(findings)})"))
    else:
        out.append("\nFindings: none")

    rows = []
    for st in data["stages"]:
        mem = st["memory_bytes"]
        rows.append(
            [
                str(st["pp_rank"]),
                str(st["layers"]),
                human_count(st["params"]),
                human_bytes(mem["weights"]),
                human_bytes(mem["gradients"]),
                human_bytes(mem["optimizer"]),
                human_bytes(mem["activations"]),
                human_bytes(mem["total"]),
                human_bytes(st.get("headroom_bytes", 0)),
            ]
        )
    out.append(
        render_table(
            ["stage", "layers", "params/GPU", "weights", "gradients", "optimizer", "activations", "total", "headroom"],
            rows,
            title="\nMemory per GPU, per pipeline stage",
        )
    )

    rows = []
    for c in data["collectives"]:
        rows.append(
            [
                c["axis"],
                c["op"],
                human_bytes(c["message_bytes"]),
                f"{c['count_per_step']:,}",
                human_bytes(c["bytes_per_gpu_per_step"]),
                c["link"],
                f"{c['flops_per_byte']:,.0f}",
                f"{c['link_budget_flops_per_byte']:,.0f}",
                human_seconds(c["exposed_seconds_per_step"]),
                c["purpose"],
            ]
        )
    out.append(
        render_table(
            [
                "axis",
                "collective",
                "message",
                "count/step",
                "bytes/GPU/step",
                "link",
                "FLOPs/byte",
                "budget",
                "exposed",
                "what",
            ],
            rows,
            title="\nCollectives per step (per GPU; FLOPs/byte below the link budget cannot be hidden)",
        )
    )

    t = data["expected_step_seconds"]
    total = t["total"] or 1.0
    rows = [["compute", human_seconds(t["compute"]), percent(t["compute"] / total)]]
    rows += [
        [f"exposed comm {axis}", human_seconds(s), percent(s / total)] for axis, s in sorted(t["exposed_comm"].items())
    ]
    rows += [
        ["pipeline bubble", human_seconds(t["bubble"]), percent(t["bubble"] / total)],
        ["optimizer", human_seconds(t["optimizer"]), percent(t["optimizer"] / total)],
        ["total", human_seconds(t["total"]), "100.0 %"],
    ]
    out.append(render_table(["category", "expected", "share"], rows, title="\nExpected step time"))
    out.append(
        f"\nFLOPs per step: {human_si(data['flops_per_step'], 'FLOP')} (model FLOPs, causal attention halved); "
        f"pipeline bubble: {percent(data['bubble_fraction'])} of ideal compute"
    )
    return "\n".join(out)


def _render_left(headers: list[str], rows: list[list[str]], *, title: str) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers[:-1])]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(headers[:-1], widths, strict=True)) + "  " + headers[-1]]
    lines.extend("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows)
    return "\n".join(lines)


def _cmd_search(args: argparse.Namespace) -> int:
    missing = [
        flag
        for flag, value in (("--gpus", args.gpus), ("--model", args.model), ("--hardware", args.hardware))
        if not value
    ]
    if missing:
        raise _UsageError(f"plan --search needs {', '.join(missing)}")
    model = lookup_model(args.model)
    gpu = default_hardware(args.hardware, nodes=1).gpu
    if args.gpus < 1 or args.gpus % gpu.gpus_per_node:
        raise _UsageError(f"--gpus {args.gpus} is not a whole number of {gpu.gpus_per_node}-GPU {gpu.name} nodes")
    request = SearchRequest(
        model=model,
        hardware=default_hardware(args.hardware, nodes=args.gpus // gpu.gpus_per_node),
        global_batch_size=args.global_batch,
        seq_length=args.seq_length,
        precision=Precision(args.precision),
        recompute=Recompute(args.recompute),
    )
    result = search_layouts(request)
    if args.json:
        _print_json(result.to_dict(top=args.top))
        return EXIT_OK
    print(
        f"meshscope plan --search: {model.name} on {args.gpus} x {gpu.name}, global batch {args.global_batch} "
        f"sequences; {result.evaluated:,} layouts evaluated, {len(result.candidates):,} fit in memory"
    )
    if result.candidates:
        print(render_search(result.candidates[: args.top]))
    if result.closest_misfit is not None and not result.candidates:
        c = result.closest_misfit
        print(
            f"closest to fitting: {c.layout.describe()}, micro-batch {c.micro_batch_size}: "
            f"{human_bytes(c.peak_memory_bytes)} on the fullest stage, {human_bytes(-c.headroom_bytes)} over HBM; "
            f"try --recompute full, more GPUs or a smaller --global-batch"
        )
    return EXIT_OK


def render_search(candidates: Sequence[Candidate]) -> str:
    """Ranked layouts as a table."""
    rows = [
        [
            str(i + 1),
            c.layout.describe().replace(" ", ","),
            str(c.micro_batch_size),
            human_seconds(c.expected_step_seconds),
            human_bytes(c.peak_memory_bytes),
            percent(c.bubble_fraction),
            human_seconds(c.exposed_comm_seconds),
            str(c.findings),
        ]
        for i, c in enumerate(candidates)
    ]
    return render_table(
        ["#", "layout", "micro-batch", "step", "peak memory", "bubble", "exposed comm", "findings"], rows
    )


# ---------------------------------------------------------------------------------------------------------- demo


DEMO_STEPS = 8
"""Training steps of ``meshscope demo`` (the first is left out of the analysis as warm-up)."""
DEMO_RANKS = 8


def _rank_factor(option: str, text: str | None) -> str | None:
    """Check ``RANK:FACTOR`` (a rank of the demo, a factor > 0); returns it unchanged."""
    if text is None:
        return None
    try:
        rank_text, factor_text = text.split(":")
        rank, factor = int(rank_text), float(factor_text)
    except ValueError:
        raise _UsageError(f"{option} {text!r}: expected RANK:FACTOR, e.g. 5:2") from None
    if not 0 <= rank < DEMO_RANKS or not factor > 0:
        raise _UsageError(f"{option} {text!r}: the rank must be 0..{DEMO_RANKS - 1} and the factor > 0")
    return text


def _cmd_demo(args: argparse.Namespace) -> int:
    straggler = _rank_factor("--straggler", args.straggler)
    imbalance = _rank_factor("--imbalance", args.imbalance)
    if args.steps < 1:
        raise _UsageError(f"--steps must be >= 1, got {args.steps}")
    if importlib.util.find_spec("torch") is None:
        raise _UsageError(
            "meshscope demo trains a real PyTorch job: install the demo extra (pip install 'meshscope[demo]', "
            "torch==2.13.0), or run 'make demo'"
        )
    settings = demo_settings(
        Path(args.out), steps=args.steps, cp=args.cp, ep=args.ep, straggler=straggler, imbalance=imbalance
    )
    injected = []
    if straggler:
        rank, factor = straggler.split(":")
        injected.append(f"rank {rank} computes {float(factor):g}x slower")
    if imbalance:
        rank, factor = imbalance.split(":")
        injected.append(f"the data-parallel replica of rank {rank} gets {float(factor):g}x the tokens")
        if settings.layout.dp < 3:
            print(
                f"meshscope demo: with {settings.layout.dp} data-parallel replicas an imbalance cannot be told from "
                "a slow replica (it needs a majority of normal ones, docs/cost-table.md); expect a wait, not a finding"
            )
    print(
        f"meshscope demo: examples/train_tiny.py on {DEMO_RANKS} local CPU ranks, {settings.layout.describe()}, "
        f"two emulated nodes of 4 ranks, emulated accelerator ({DEMO_BLOCK_MS:g} ms per transformer block forward), "
        f"{args.steps} steps; injected: {', '.join(injected) if injected else 'nothing (a clean run)'}\n",
        flush=True,
    )
    return run_job(settings, report=report_run)


def _print_json(data: object) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")

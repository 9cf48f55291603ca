"""The ``meshscope`` command line.

Exit codes: 0 success, 2 invalid input (the message on stderr, no traceback), 1 an internal error (a one-line
message; ``MESHSCOPE_DEBUG=1`` shows the traceback); ``meshscope run`` also exits with a failed rank's code, 4 when
no analysis could be written, 130 on Ctrl-C (docs/sdk.md §6). Human output carries a unit on every number;
``--json`` prints base units (bytes, seconds, FLOPs) for machines.

Every command's arguments are defined here, in one place (the surface is frozen by a snapshot test); a command's
modules are imported only when that command runs, so ``meshscope --version`` and ``meshscope --help`` import
nothing of the core but this module, :mod:`meshscope.errors` and :mod:`meshscope.formatting`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import TYPE_CHECKING

from meshscope import __version__
from meshscope.errors import MeshscopeError
from meshscope.formatting import human_bytes, human_seconds, percent, render_table

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Sequence

    from meshscope.plan import Candidate, PlanAssumptions

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that exits with 2 and one line, like every other invalid input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"meshscope: error: {message} (see '{self.prog} --help')\n")


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The whole command-line surface (frozen by a snapshot test).

    Args:
        commands: build only these commands' arguments (``meshscope --help`` still lists every command); ``None``
            builds them all. :func:`main` passes the one command being run (none for ``--version`` or ``--help``),
            so that no other command's modules load.
    """
    parser = _Parser(prog="meshscope", description="Which parallelism axis is costing your training run time.")
    parser.add_argument("--version", action="version", version=f"meshscope {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help_text, description, add_arguments) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=description)
        if commands is None or name in commands:
            add_arguments(p)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (the top level takes no values)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    words = sys.argv[1:] if argv is None else list(argv)
    command = _command_in(words)
    parser = build_parser(() if command is None else (command,))
    args = parser.parse_args(words)
    if args.command in ("analyze", "report", "simulate"):  # (``run`` keeps its training command in args.command)
        from meshscope.records import tune_memory_for_columns  # noqa: PLC0415

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
    from meshscope.jobs import load_spec  # noqa: PLC0415 - a command's modules load when it runs
    from meshscope.plan import plan_job, render_plan_report  # noqa: PLC0415

    spec = load_spec(args.file)
    plan = plan_job(spec, assumptions=_assumptions(args.assumptions))
    data = plan.to_dict()
    if args.json:
        _print_json(data)
    else:
        print(render_plan_report(spec, plan))
    return EXIT_OK


class _UsageError(MeshscopeError):
    """A command line that names too little."""


def _assumptions(path: str | None) -> PlanAssumptions | None:
    """``--assumptions FILE``: a YAML mapping of assumption names to values over the defaults; ``None`` without one."""
    if path is None:
        return None
    from meshscope.jobs import load_yaml_mapping  # noqa: PLC0415 - loaded when the command runs
    from meshscope.plan import assumptions_from_mapping  # noqa: PLC0415

    return assumptions_from_mapping(load_yaml_mapping(path), origin=path)


def _cmd_search(args: argparse.Namespace) -> int:
    missing = [
        flag
        for flag, value in (("--gpus", args.gpus), ("--model", args.model), ("--hardware", args.hardware))
        if not value
    ]
    if missing:
        raise _UsageError(f"plan --search needs {', '.join(missing)}")
    if args.dp_shard is not None and args.dp_shard < 1:
        raise _UsageError(f"--dp-shard {args.dp_shard}: give the data-parallel ranks to shard over, 1 or more")
    from meshscope.jobs import Precision, Recompute, lookup_model  # noqa: PLC0415 - loaded when the command runs
    from meshscope.plan import SearchRequest, search_layouts  # noqa: PLC0415
    from meshscope.topology import default_hardware  # noqa: PLC0415

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
        zero_stage=args.zero_stage,
        dp_shard=args.dp_shard,
    )
    result = search_layouts(request, assumptions=_assumptions(args.assumptions))
    if args.json:
        _print_json(result.to_dict(top=args.top))
        return EXIT_OK
    sharding = f"ZeRO-{args.zero_stage}" if args.zero_stage else "distributed optimizer"
    if args.dp_shard:
        sharding += f" over {args.dp_shard} data-parallel ranks (hybrid sharding)"
    print(
        f"meshscope plan --search: {model.name} on {args.gpus} x {gpu.name}, global batch {args.global_batch} "
        f"sequences, {sharding}; {result.evaluated:,} layouts evaluated, {len(result.candidates):,} fit in memory"
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


def _print_json(data: object) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


# ---------------------------------------------------------------------------------------------------------- the surface
# Each command: (help, description, a function adding its arguments and handler). A handler imports the package that
# runs the command when it is called; an arguments function imports only what its defaults and choices need.


QUIET_HELP = (
    "show no progress: by default, when stderr is a terminal, it shows the phase being run and how far it is "
    "(bytes or steps done, rate); never when stderr is a file or a pipe. Results and errors are printed either way"
)
"""Help of ``--quiet``, the same on every command that has one."""


def _quiet_argument(p: argparse.ArgumentParser, *, what: str = "") -> None:
    p.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP + what)


def _plan_arguments(plan: argparse.ArgumentParser) -> None:
    from meshscope.jobs import PRESETS, Precision, Recompute  # noqa: PLC0415 - choices and help of this command

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
    plan.add_argument(
        "--zero-stage",
        type=int,
        default=0,
        choices=[0, 1, 2, 3],
        help="with --search: ZeRO stage of every layout instead of the distributed optimizer (3: FSDP; 0: not used)",
    )
    plan.add_argument(
        "--dp-shard",
        type=int,
        metavar="N",
        help="with --search: hybrid sharding (HSDP), the sharded state over N data-parallel ranks, replicated over "
        "the rest; layouts whose dp is not a multiple of N are left out",
    )
    plan.add_argument(
        "--assumptions",
        metavar="FILE",
        help="YAML mapping of planner assumptions over the defaults (docs/planner.md, 'Assumptions'), e.g. "
        "'network_efficiency: 0.6' or 'compute_efficiency: 0.45' for the flat compute model",
    )
    plan.set_defaults(handler=_cmd_plan)


DEMO_STEPS = 8
"""Training steps of ``meshscope demo`` (the first is left out of the analysis as warm-up)."""


def _demo_arguments(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--cp", action="store_true", help="context-parallel variant: pp=2, cp=2, tp=2")
    demo.add_argument("--ep", action="store_true", help="expert-parallel variant: MoE in every layer, ep=2")
    demo.add_argument("--straggler", metavar="RANK:FACTOR", help="make RANK compute FACTOR x slower (e.g. 5:2)")
    demo.add_argument(
        "--imbalance", metavar="RANK:FACTOR", help="give RANK's data-parallel replica FACTOR x the tokens (e.g. 2:3)"
    )
    demo.add_argument("--steps", type=int, default=DEMO_STEPS, help=f"training steps ({DEMO_STEPS})")
    demo.add_argument("--out", default="meshscope-demo", help="output directory (./meshscope-demo)")
    _quiet_argument(demo, what=" (it applies to the analysis and report after training)")
    demo.set_defaults(handler=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from meshscope.local import demo_command  # noqa: PLC0415 - loaded when the command runs

    return demo_command(args)


def _run_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("--nproc", type=int, required=True, help="ranks to launch (the world size)")
    run.add_argument("--layout", help="parallel layout, e.g. dp=2,tp=2,pp=2 (default: the spec's, else dp=NPROC)")
    run.add_argument("--spec", help="TrainingJob manifest the run stands for (layout, hardware, model)")
    run.add_argument(
        "--out",
        help="output directory (default: ./meshscope-run-<time>; an earlier run's files there are moved to "
        "OUT/earlier/<time>/)",
    )
    run.add_argument("--job", help="job name written into the records (default: the spec's name, else 'local')")
    run.add_argument(
        "--launcher",
        choices=["auto", "fork", "exec"],
        default="auto",
        help="fork: python only, torch imported once (fast); exec: any command; auto (default): fork when possible",
    )
    run.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL (5)")
    run.add_argument("--gpus-per-node", type=int, help="ranks per emulated node (default: the spec's, else all)")
    _quiet_argument(run, what=" (it applies to the analysis and report after the ranks exit)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    run.set_defaults(handler=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    from meshscope.local import run_command  # noqa: PLC0415 - loaded when the command runs

    return run_command(args)


def _analyze_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("records", nargs="+", help="step-record files (JSON lines, .gz ok), or directories of them")
    p.add_argument("--spec", help="TrainingJob manifest (YAML): adds the plan's expected numbers")
    p.add_argument("--json", action="store_true", help="print one JSON object (base units) instead of tables")
    p.add_argument(
        "--allow-partial",
        action="store_true",
        help="skip a truncated last line and files of another job (noted under partial data) instead of failing",
    )
    _attempt_argument(p)
    _skip_steps_argument(p)
    _quiet_argument(p)
    p.set_defaults(handler=_cmd_analyze)


def _attempt_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--attempt",
        type=_attempt_number,
        metavar="N",
        help="of a job restarted or resumed into the same records: the attempt to read, 1 the first, -1 the last "
        "(the default), -2 the one before",
    )


def _skip_steps_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--skip-steps",
        type=_skip_count,
        default=0,
        metavar="N",
        help="leave out the first N step numbers as warm-up (0, the default, keeps every step; `meshscope run` "
        "leaves out its first step, so `--skip-steps 1` on its OUT gives the numbers it printed)",
    )


def _skip_count(text: str) -> int:
    """``--skip-steps``'s value: a whole number, 0 or more."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number: give how many of the first steps to leave out, e.g. 1"
        ) from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"{number}: give 0 or more steps to leave out")
    return number


def _attempt_number(text: str) -> int:
    """``--attempt``'s value: a whole number other than 0."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number: give 1 for the first attempt, -1 for the last"
        ) from None
    if number == 0:
        raise argparse.ArgumentTypeError("0: give 1 for the first attempt, -1 for the last")
    return number


def _cmd_analyze(args: argparse.Namespace) -> int:
    from meshscope.analysis import analyze_command  # noqa: PLC0415 - loaded when the command runs

    return analyze_command(args)


def _report_arguments(report: argparse.ArgumentParser) -> None:
    report.add_argument(
        "records", nargs="+", help="step-record files (JSON lines, .gz allowed), or directories of them"
    )
    report.add_argument("--spec", help="TrainingJob manifest the records belong to (for expected numbers)")
    report.add_argument("--out", default="meshscope-report", help="output directory (./meshscope-report)")
    _attempt_argument(report)
    _skip_steps_argument(report)
    _quiet_argument(report)
    report.set_defaults(handler=_cmd_report)


def _cmd_report(args: argparse.Namespace) -> int:
    from meshscope.reports import report_command  # noqa: PLC0415 - loaded when the command runs

    return report_command(args)


def _simulate_arguments(sim: argparse.ArgumentParser) -> None:
    from meshscope.simulation import DEFAULT_STEPS  # noqa: PLC0415 - the default this command's help names

    sim.add_argument("scenario", nargs="?", help="scenario file (YAML: spec, steps, seed, faults, phases)")
    sim.add_argument("--spec", help="TrainingJob manifest to simulate instead of a scenario")
    sim.add_argument("--out", default="records.jsonl.gz", help="records file (.jsonl, or .jsonl.gz) (records.jsonl.gz)")
    sim.add_argument("--steps", type=int, help=f"steps to simulate (the scenario's, else {DEFAULT_STEPS})")
    sim.add_argument("--seed", type=int, help="seed of noise and random clock offsets (the scenario's, else 0)")
    sim.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND:K=V,...",
        help="inject a fault, e.g. straggler:rank=3,factor=1.5 or slow-link:node=1,factor=0.25 (repeatable)",
    )
    sim.add_argument("--prefetch", action="store_true", help="the data loader runs ahead of compute")
    _quiet_argument(sim)
    sim.set_defaults(handler=_cmd_simulate)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from meshscope.simulation import simulate_command  # noqa: PLC0415 - loaded when the command runs

    return simulate_command(args)


def _calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "records", nargs="+", help="step-record files (JSON lines, .gz ok), or a meshscope run output directory"
    )
    p.add_argument("--spec", help="TrainingJob manifest of the run (not needed for a meshscope run directory)")
    p.add_argument(
        "--out", default="assumptions.yaml", help="assumptions file to write, for --assumptions (assumptions.yaml)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (base units) instead of tables")
    _quiet_argument(p)
    p.set_defaults(handler=_cmd_calibrate)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from meshscope.local import calibrate_command  # noqa: PLC0415 - loaded when the command runs

    return calibrate_command(args)


def _predict_arguments(p: argparse.ArgumentParser) -> None:
    from meshscope.jobs import Recompute  # noqa: PLC0415 - choices of this command

    p.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="OUT",
        help="the measured run: a meshscope run output directory, or a records file with --spec",
    )
    p.add_argument("--layout", help="layout to predict, e.g. tp=4,pp=2,dp=1 (default: the measured one)")
    p.add_argument("--gpus", type=int, help="GPUs of the predicted job (default: the layout's world size)")
    p.add_argument("--hardware", help="GPU type from the catalogue (default: the measured run's)")
    p.add_argument("--micro-batch", type=int, help="sequences per micro-batch (default: the measured run's)")
    p.add_argument("--recompute", choices=[r.value for r in Recompute], help="activation recompute policy")
    p.add_argument(
        "--assumptions", metavar="FILE", help="a meshscope calibrate file (default: calibrate from --from on the fly)"
    )
    p.add_argument("--spec", help="TrainingJob manifest of the measured run (not needed for a meshscope run directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object (base units) instead of tables")
    _quiet_argument(p)
    p.set_defaults(handler=_cmd_predict)


def _cmd_predict(args: argparse.Namespace) -> int:
    from meshscope.local import predict_command  # noqa: PLC0415 - loaded when the command runs

    return predict_command(args)


_COMMANDS: dict[str, tuple[str, str | None, Callable[[argparse.ArgumentParser], None]]] = {
    "plan": ("plan a TrainingJob: memory per stage, collectives, expected step time", None, _plan_arguments),
    "demo": (
        "run the bundled tiny job on 8 local CPU ranks and show what meshscope measures",
        (
            "Train examples/train_tiny.py on 8 local CPU ranks (pp=2, dp=2, tp=2 on two emulated nodes of 4, "
            "emulated accelerator time), then print the cost table with the plan's expectations, the findings, the "
            "per-stage expected-vs-measured comparison, and write OUT/report.html and OUT/trace.json."
        ),
        _demo_arguments,
    ),
    "run": (
        "launch a training command on local ranks and collect its step records",
        (
            "Launch N local ranks of a training command (torchrun-style environment), collect the records "
            "of the meshscope SDK into OUT/records.jsonl, and when every rank has exited print the cost table with the "
            "plan's expectations (--spec, or the spec of a script that describes itself), the findings and the "
            "per-stage "
            "expected-vs-measured comparison, and write OUT/report.html and OUT/trace.json."
        ),
        _run_arguments,
    ),
    "analyze": (
        "cost table, findings and partial-data notes from step records",
        (
            "Break step records down per rank and step and print the cost table (which axis, rank and node cost "
            "time), a summary and findings. See docs/cost-table.md."
        ),
        _analyze_arguments,
    ),
    "report": (
        "write an HTML report and a Perfetto trace from step records",
        (
            "Read step records, analyse them, and write OUT/report.html (self-contained) and OUT/trace.json "
            "(Chrome trace-event JSON for Perfetto UI or chrome://tracing); print both paths."
        ),
        _report_arguments,
    ),
    "simulate": (
        "simulate a job's step records, with named faults (ground truth for analysis)",
        (
            "Simulate every rank's every step of a job from the plan's expected times (or explicit phase "
            "durations), inject named faults, and write meshscope.step/1 records."
        ),
        _simulate_arguments,
    ),
    "calibrate": (
        "fit the planner's assumptions to a measured run (for --assumptions)",
        (
            "Fit the planner assumptions a run can tell (compute efficiency, link latency and bandwidth per link "
            "class, optimizer, data wait, host overhead) to its step breakdown, each with a 90 % interval; refuse "
            "what the run cannot tell; write the file plan, predict and --search load. See docs/predict.md."
        ),
        _calibrate_arguments,
    ),
    "predict": (
        "predict another layout of a measured job, per category",
        (
            "Plan the measured job in another layout (GPU count, GPU, micro-batch, recompute) with the assumptions "
            "calibrated from its run, and print the expected step per category beside the measured one, the change "
            "and the memory check. See docs/predict.md."
        ),
        _predict_arguments,
    ),
}
"""The commands in the order ``meshscope --help`` lists them."""

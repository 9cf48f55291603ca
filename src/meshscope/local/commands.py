"""``meshscope run`` and ``meshscope demo``: launch the ranks, then report the run.

The launching is :mod:`~meshscope.local.running`'s, the report :mod:`~meshscope.local.summarizing`'s. The command
line's arguments are defined in :mod:`meshscope.cli`; this module checks them and ties the launcher to the report.
The launcher must not import the report writers, so the two meet here. Errors are
:class:`~meshscope.errors.MeshscopeError` (exit code 2 in the CLI, one line).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from meshscope.errors import MeshscopeError
from meshscope.local.emulation import DEMO_BLOCK_MS
from meshscope.local.running import demo_settings, run_job, settings_from_args
from meshscope.local.summarizing import report_run

if TYPE_CHECKING:
    import argparse

DEMO_RANKS = 8
"""Local ranks of ``meshscope demo``."""


class DemoUsageError(MeshscopeError):
    """A ``meshscope demo`` command line that asks for something the demo cannot do."""


def run_command(args: argparse.Namespace) -> int:
    """``meshscope run --nproc N [...] -- COMMAND`` (arguments: :mod:`meshscope.cli`); the job's exit code."""
    return run_job(settings_from_args(args), report=report_run)


def _rank_factor(option: str, text: str | None) -> str | None:
    """Check ``RANK:FACTOR`` (a rank of the demo, a factor > 0); returns it unchanged."""
    if text is None:
        return None
    try:
        rank_text, factor_text = text.split(":")
        rank, factor = int(rank_text), float(factor_text)
    except ValueError:
        raise DemoUsageError(f"{option} {text!r}: expected RANK:FACTOR, e.g. 5:2") from None
    if not 0 <= rank < DEMO_RANKS or not factor > 0:
        raise DemoUsageError(f"{option} {text!r}: the rank must be 0..{DEMO_RANKS - 1} and the factor > 0")
    return text


def demo_command(args: argparse.Namespace) -> int:
    """``meshscope demo [--cp | --ep] [--straggler R:F] [--imbalance R:F] [--steps N] [--out DIR]``.

    Raises:
        DemoUsageError: for a bad fault, step count, or a missing torch.
    """
    straggler = _rank_factor("--straggler", args.straggler)
    imbalance = _rank_factor("--imbalance", args.imbalance)
    if args.steps < 1:
        raise DemoUsageError(f"--steps must be >= 1, got {args.steps}")
    if importlib.util.find_spec("torch") is None:
        raise DemoUsageError(
            "meshscope demo trains a real PyTorch job: install the demo extra (pip install 'meshscope[demo]', "
            "torch==2.13.0), or run 'make demo'"
        )
    settings = demo_settings(
        Path(args.out),
        steps=args.steps,
        cp=args.cp,
        ep=args.ep,
        straggler=straggler,
        imbalance=imbalance,
        quiet=args.quiet,
    )
    injected = []
    if straggler:
        rank, factor = straggler.split(":")
        injected.append(f"rank {rank} computes {float(factor):g}x slower")
    if imbalance:
        rank, factor = imbalance.split(":")
        injected.append(f"the data-parallel replica of rank {rank} gets {float(factor):g}x the tokens")
        if settings.layout.dp < 3:
            print(  # noqa: T201
                f"meshscope demo: with {settings.layout.dp} data-parallel replicas an imbalance cannot be told from "
                "a slow replica (it needs a majority of normal ones, docs/cost-table.md); expect a wait, not a finding"
            )
    print(  # noqa: T201
        f"meshscope demo: examples/train_tiny.py on {DEMO_RANKS} local CPU ranks, {settings.layout.describe()}, "
        f"two emulated nodes of 4 ranks, emulated accelerator ({DEMO_BLOCK_MS:g} ms per transformer block forward), "
        f"{args.steps} steps; injected: {', '.join(injected) if injected else 'nothing (a clean run)'}\n",
        flush=True,
    )
    return run_job(settings, report=report_run)

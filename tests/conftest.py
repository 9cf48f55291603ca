"""Shared pytest setup: opt-in markers for GPU and cluster tests (kopf's conftest pattern), cold caches for mutants."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

import torch_gate


@pytest.fixture(autouse=True)
def _cold_caches_under_mutation() -> None:
    """Empty the core's memoised functions before each test of a mutation run (``make mutate``).

    mutmut runs every mutant's tests in a process forked from one that already ran them, so the planner's
    cached functions (collective times, GEMM efficiencies, FLOPs) would answer from the parent's caches and
    never run the mutated code: every mutant of them would survive. Outside a mutation run nothing is cleared.
    """
    if "MUTANT_UNDER_TEST" not in os.environ:
        return
    for name, module in list(sys.modules.items()):
        if name == "meshscope" or name.startswith("meshscope."):
            for value in list(vars(module).values()):
                clear = getattr(value, "cache_clear", None)
                if callable(clear):
                    clear()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--with-gpu", action="store_true", default=False, help="run tests that need a CUDA device")
    parser.addoption("--with-e2e", action="store_true", default=False, help="run tests that need a cluster")


RANKS_LANE = "ranks"
"""Under ``make test`` (``-n 2 --dist loadscope``, pytest-xdist) the scope of every test that runs training ranks as
processes: one worker runs them one after another, as on a machine of their own beside some foreign load (they are
built to pass beside a CPU burner on every core; two of them at once would put 8 ranks on 2 cores), while every
other file runs, whole, on whichever worker is free (its module fixtures start once)."""
RANKS_PATHS = ("e2e_local/", "sdk/", "cli/test_progress_cli.py", "sidecar/test_end_to_end.py")
"""Under ``tests/``: what starts ranks (the real-job tests, the SDK's forked gloo jobs, ``meshscope run``'s progress
on a real job, the sidecar fed by real ranks)."""
STRUCTURAL_PATHS = ("e2e_local/test_variants.py", "sdk/test_running.py", "sdk/test_run_failures.py")
"""Under :data:`RANKS_PATHS`, files that run ranks but assert no timing: what was recorded (every rank's every step,
the plan's collectives counted exactly), what a failing run says and its exit code. They run as whole files on
whichever worker is free, beside the ranks lane (as foreign load, within what its verdict tests are built for: a
burner on every core), and that lane no longer holds two thirds of the suite's time alone (727 s of pytest, the
lane 708 s of it, the other worker idle half the run: 2026-12-07)."""


def lane(nodeid: str) -> str:
    """The xdist scope of the test ``nodeid``: :data:`RANKS_LANE`, or its file."""
    path = nodeid.split("::", 1)[0]
    under = path.split("tests/", 1)[-1]
    return RANKS_LANE if under.startswith(RANKS_PATHS) and not under.startswith(STRUCTURAL_PATHS) else path


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope`` with :func:`lane` as the scope (xdist's ``loadgroup`` marks are lost on pytest 9's node
    ids: ``item.nodeid`` no longer shows the ``@group`` xdist appends to ``item._nodeid``)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415 - only under xdist

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid)

    return Lanes(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gpu") is not None and not config.getoption("--with-gpu"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; run with --with-gpu"))
        if item.get_closest_marker("e2e") is not None and not config.getoption("--with-e2e"):
            item.add_marker(pytest.mark.skip(reason="needs a cluster; run with --with-e2e"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Name the test files left out because torch is missing (``make test`` refuses to run without it)."""
    if torch_gate.DROPPED:
        terminalreporter.write_sep("!", f"{len(torch_gate.DROPPED)} test files NOT RUN: torch is missing", red=True)
        for name in torch_gate.DROPPED:
            terminalreporter.write_line(f"  {name}")
        terminalreporter.write_line(f"  (make test sets {torch_gate.REQUIRE_TORCH_ENV}=1 and fails instead)")

"""Shared pytest setup: opt-in markers for GPU and cluster tests (kopf's conftest pattern), cold caches for mutants."""

from __future__ import annotations

import os
import sys

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
"""The xdist group of every test that runs training ranks as processes (``make test`` runs ``-n 2 --dist
loadgroup``): one worker runs them one after another, while every other file runs, whole, on whichever worker is
free (its module fixtures start once). These tests are
built to pass beside a CPU burner on every core; two of them at once would put 8 ranks on 2 cores."""
RANKS_PATHS = ("e2e_local/", "sdk/", "cli/test_progress_cli.py", "sidecar/test_end_to_end.py")
"""Under ``tests/``: what starts ranks (the real-job tests, the SDK's forked gloo jobs, ``meshscope run``'s progress
on a real job, the sidecar fed by real ranks)."""


def _lane(item: pytest.Item) -> str:
    path = item.path.as_posix()
    under = path.split("/tests/", 1)[-1]
    return RANKS_LANE if under.startswith(RANKS_PATHS) else under


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    grouped = config.pluginmanager.hasplugin("xdist")
    for item in items:
        if grouped:
            item.add_marker(pytest.mark.xdist_group(_lane(item)))
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

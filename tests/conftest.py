"""Shared pytest setup: opt-in markers for GPU and cluster tests (kopf's conftest pattern)."""

from __future__ import annotations

import pytest

import torch_gate


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--with-gpu", action="store_true", default=False, help="run tests that need a CUDA device")
    parser.addoption("--with-e2e", action="store_true", default=False, help="run tests that need a cluster")


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

"""Shared pytest setup: opt-in markers for GPU and cluster tests (kopf's conftest pattern)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--with-gpu", action="store_true", default=False, help="run tests that need a CUDA device")
    parser.addoption("--with-e2e", action="store_true", default=False, help="run tests that need a cluster")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gpu") is not None and not config.getoption("--with-gpu"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; run with --with-gpu"))
        if item.get_closest_marker("e2e") is not None and not config.getoption("--with-e2e"):
            item.add_marker(pytest.mark.skip(reason="needs a cluster; run with --with-e2e"))

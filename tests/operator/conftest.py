"""The operator's webhooks served for real, once per session (tests/operator_serving.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from operator_serving import Served, serve

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve(tmp_path_factory.mktemp("certs"))

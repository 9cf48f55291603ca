"""The operator's webhooks served for real, once per test module (tests/operator_serving.py).

Module scope, not session: kopf's thread talks to kmock through aiohttp, whose connector shuffles its waiters with
the global ``random``; left running through the rest of the suite, it changed that state under other modules'
Hypothesis draws, which Hypothesis reports as an error (a passing property test failed as flaky in CI).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from operator_serving import Served, serve

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve(tmp_path_factory.mktemp("certs"))

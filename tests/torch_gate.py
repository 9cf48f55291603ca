"""Test files that need torch: dropped with a loud note where torch is missing, a collection error under ``make test``.

torch (the CPU build, pinned in the ``dev`` extra) runs the SDK's real gloo jobs and the local end-to-end runs. A
checkout without it may still run the pure tests, but never silently: the files left out are named in the run's
summary, and ``make test`` (which sets :data:`REQUIRE_TORCH_ENV`) refuses to start without torch, so that a broken
install cannot pass by running 35 fewer tests. This module must not import torch itself.
"""

from __future__ import annotations

import os

REQUIRE_TORCH_ENV = "MESHSCOPE_REQUIRE_TORCH"
"""Set to ``1`` (``make unit`` does) to make a missing torch an error instead of a note."""

DROPPED: list[str] = []
"""Test files left out in this run because torch is missing (the root conftest names them in the summary)."""


class TorchMissingError(ImportError):
    """torch is required by this run (``MESHSCOPE_REQUIRE_TORCH=1``) but cannot be imported."""


def files_without_torch(folder: str, files: list[str], error: ImportError) -> list[str]:
    """The ``collect_ignore`` list of a folder whose ``files`` need torch, which failed to import with ``error``.

    Raises:
        TorchMissingError: if this run requires torch.
    """
    if os.environ.get(REQUIRE_TORCH_ENV) == "1":
        message = (
            f"torch cannot be imported ({error}); {folder}: {', '.join(files)} need it and {REQUIRE_TORCH_ENV}=1 "
            f"(make test) requires them: run `make venv` (it installs torch==2.13.0, the CPU build)"
        )
        raise TorchMissingError(message) from error
    DROPPED.extend(f"{folder}/{name}" for name in files)
    return files

"""The ``meshscope`` command line."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    del argv
    sys.stderr.write("meshscope: not built yet\n")
    return 2

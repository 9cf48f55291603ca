"""What one ``meshscope run`` left behind, for the tests that launch real jobs (importable: ``tests/`` is on the path)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import socket

    from meshscope.records import RecordTable, StepRecord


@dataclass
class Run:
    """What one job left: exit code, what meshscope printed, the output directory."""

    code: int
    out: str
    out_dir: Path

    @property
    def analysis(self) -> dict[str, Any]:
        return json.loads((self.out_dir / "analysis.json").read_text())

    @property
    def findings(self) -> list[dict[str, Any]]:
        return self.analysis["findings"]

    def shown(self) -> str:
        """For an assertion's message: the findings, then the end of what meshscope printed (the cost table and its
        notes), so that a detection that failed once on a loaded machine says why (the run's directory is gone by
        the time a CI log is read)."""
        messages = "\n".join(f["message"] for f in self.findings) or "(no finding)"
        return f"findings:\n{messages}\n--- meshscope printed (end):\n{self.out[-4000:]}"

    def losses(self) -> list[float]:
        return json.loads((self.out_dir / "losses.json").read_text())["losses"]


def records_by_rank(table: RecordTable) -> dict[int, list[StepRecord]]:
    """A table's records per rank, each rank's in step order."""
    by_rank: dict[int, list[StepRecord]] = {}
    for rec in table.to_records():
        by_rank.setdefault(rec.rank, []).append(rec)
    return {rank: sorted(records, key=lambda r: r.step) for rank, records in sorted(by_rank.items())}


def socket_path(kind: str, tmp_path: Path) -> Path:
    """A unix socket path for a test: short (at most 107 bytes, which ``tmp_path`` may exceed) and unique across
    processes (the test's pid: two xdist workers name their temporary directories alike)."""
    return Path(f"/tmp/ms-{kind}-{os.getpid()}-{tmp_path.name[-20:]}.sock")


def listener_messages(sock: socket.socket) -> list[dict[str, Any]]:
    """The step messages queued on a test's ``listener`` socket (non-blocking), as sent (wire dicts), in order."""
    from meshscope.sdk.transport import decode  # noqa: PLC0415

    out = []
    while True:
        try:
            message = decode(sock.recv(1 << 22))
        except BlockingIOError:
            return out
        if message["schema"] == "meshscope.step/1":
            out.append(message)


def listener_records(sock: socket.socket) -> list[StepRecord]:
    """:func:`listener_messages`, parsed."""
    from meshscope.records import _parse_record  # noqa: PLC0415 - the wire form's own parser

    return [_parse_record(raw, f"record {i}") for i, raw in enumerate(listener_messages(sock))]

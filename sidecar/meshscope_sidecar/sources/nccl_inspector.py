"""NCCL Inspector's JSON lines (``inspector_output_format_version`` ``v4.0``): one pure function per line.

Exists because the Inspector profiler plugin measures what the debug log cannot: each collective's execution time,
timed on the GPU. It writes one JSON object per line per completed collective (or point-to-point call) per
communicator (NVIDIA/nccl ``plugins/profiler/inspector/inspector_json.cc`` at 5067397c, its README;
``../shared/reference/telemetry.md`` §2), into ``<dump dir>/<hostname>-pid<pid>.log`` (``inspector.cc``)::

    {"header": {"id": "0x7f8c496ae9f661", "comm_name": "…", "rank": 2, "n_ranks": 8, "nnodes": 1},
     "metadata": {"inspector_output_format_version": "v4.0", "git_rev": "", "rec_mechanism": "…",
                  "dump_timestamp_us": 1748030377748202, "hostname": "…", "pid": 1639453},
     "coll_perf": {"coll": "AllReduce", "coll_sn": 1407, "coll_msg_size_bytes": 17179869184,
                   "coll_exec_time_us": 61974, "coll_timing_source": "kernel_gpu",
                   "coll_algobw_gbs": 277.2, "coll_busbw_gbs": 485.1}}

Point-to-point records carry ``p2p_perf`` with ``p2p``, ``p2p_sn``, ``p2p_peer``, ``p2p_msg_size_bytes``,
``p2p_exec_time_us``, …; verbose mode adds ``event_trace_sn``/``event_trace_ts`` (ignored here); a bandwidth may be
the string ``"nan"``. ``header.id`` is the Inspector's own communicator hash, shared by the members of one
communicator, and matches neither the log's ``commId`` nor a comm address. This module must not do I/O or keep
state, and never raises: a line that is not such an object is a :class:`~meshscope_sidecar.sources.nccl_lines.
Malformed` event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final

from meshscope_sidecar.sources.nccl_lines import Malformed, op_label

FORMAT_VERSIONS: Final = frozenset({"v4.0"})
"""Output format versions read (``inspector_output_format_version``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class InspectorRecord:
    """One completed collective or point-to-point call of one communicator, as Inspector measured it."""

    host: str
    """``metadata.hostname``, cut at the first ``.`` as NCCL's log prefix cuts it."""
    pid: int
    """``metadata.pid``."""
    comm_hash: str
    """``header.id``: the Inspector's communicator hash (the same in every member)."""
    comm_name: str
    """``header.comm_name`` (``unknown`` when the framework set none)."""
    rank: int
    """``header.rank``: rank in the communicator."""
    nranks: int
    """``header.n_ranks``."""
    n_nodes: int
    """``header.nnodes``."""
    op_name: str
    """``coll`` or ``p2p``: NCCL's op name (``AllReduce``, ``Send``, ...)."""
    op: str
    """The bounded ``op`` label (:func:`~meshscope_sidecar.sources.nccl_lines.op_label`)."""
    sequence: int
    """``coll_sn`` / ``p2p_sn``."""
    message_bytes: int
    """``coll_msg_size_bytes`` / ``p2p_msg_size_bytes``."""
    exec_time_s: float
    """``coll_exec_time_us`` / ``p2p_exec_time_us``, in seconds."""
    timing_source: str
    """``kernel_gpu``, ``kernel_cpu``, ``collective_cpu`` or ``unknown``."""
    peer: int | None = None
    """``p2p_peer`` of a point-to-point record; ``None`` for collectives."""


def _int(obj: dict[str, object], key: str) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(key)
    return value


def _str(obj: dict[str, object], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise TypeError(key)
    return value


def _obj(obj: dict[str, object], key: str) -> dict[str, object]:
    value = obj.get(key)
    if not isinstance(value, dict):
        raise TypeError(key)
    return value


def parse_inspector_line(line: bytes | str) -> InspectorRecord | Malformed | None:
    """Read one Inspector JSON line.

    Returns:
        The record; ``None`` for a blank line; a :class:`~meshscope_sidecar.sources.nccl_lines.Malformed` (kind
        ``inspector``) for anything else. Never raises.
    """
    if not line.strip():
        return None
    try:
        doc = json.loads(line)
        if not isinstance(doc, dict):
            raise TypeError("not an object")  # noqa: TRY301 - one handler for every shape error below
        header, meta = _obj(doc, "header"), _obj(doc, "metadata")
        version = _str(meta, "inspector_output_format_version")
        if version not in FORMAT_VERSIONS:
            return Malformed(kind="inspector", reason=f"format version {version!r} not read")
        if "coll_perf" in doc:
            perf, prefix, peer = _obj(doc, "coll_perf"), "coll", None
        else:
            perf, prefix = _obj(doc, "p2p_perf"), "p2p"
            peer = _int(perf, "p2p_peer")
        rank, nranks = _int(header, "rank"), _int(header, "n_ranks")
        if not rank < nranks:
            return Malformed(kind="inspector", reason=f"rank {rank} outside [0, {nranks})")
        host = _str(meta, "hostname").split(".", 1)[0]
        op_name = _str(perf, prefix)
        comm_name = header.get("comm_name", "unknown")
        return InspectorRecord(
            host=host,
            pid=_int(meta, "pid"),
            comm_hash=_str(header, "id"),
            comm_name=comm_name if isinstance(comm_name, str) else "unknown",
            rank=rank,
            nranks=nranks,
            n_nodes=_int(header, "nnodes"),
            op_name=op_name,
            op=op_label(op_name),
            sequence=_int(perf, f"{prefix}_sn"),
            message_bytes=_int(perf, f"{prefix}_msg_size_bytes"),
            exec_time_s=_int(perf, f"{prefix}_exec_time_us") / 1e6,
            timing_source=str(perf.get(f"{prefix}_timing_source", "unknown")),
            peer=peer,
        )
    except (ValueError, TypeError, RecursionError) as exc:  # json.JSONDecodeError is a ValueError
        return Malformed(kind="inspector", reason=f"{type(exc).__name__}: {str(exc)[:80]}")

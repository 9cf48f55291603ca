"""Write step records as JSON lines (``meshscope.step/1``), from record objects or straight from a table's columns.

A :class:`~meshscope.records.tables.RecordTable` is written a chunk of rows at a time without building an object per
interval, so the simulator can write a 16,384-rank job. Files whose name ends in ``.gz`` are gzip-compressed. This
module must not read files and must not check records (objects and tables are validated when they are built).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

import numpy as np

from meshscope.layout import AXES
from meshscope.records.parsing import record_to_json
from meshscope.records.schema import COMM_CODE, KINDS, OPS, P2P_CODE, PHASES, SCHEMA, UNKNOWN, StepRecord
from meshscope.records.tables import RecordTable

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator
    from os import PathLike

    StrPath = str | PathLike[str]


def _open(path: Path, mode: Literal["rb", "wb"]) -> BinaryIO | gzip.GzipFile:
    if path.name.endswith(".gz"):
        return gzip.open(path, mode)
    return path.open(mode)


def write_records(path: StrPath, records: Iterable[StepRecord] | RecordTable) -> int:
    """Write records as JSON lines (gzip-compressed when the name ends in ``.gz``).

    Args:
        path: file to (over)write.
        records: record objects, or a whole :class:`RecordTable` (converted row by row).

    Returns:
        Number of lines written.
    """
    objs = _table_json(records) if isinstance(records, RecordTable) else map(record_to_json, records)
    count = 0
    dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
    with _open(Path(path), "wb") as f:
        for obj in objs:
            f.write(dumps(obj).encode() + b"\n")
            count += 1
    return count


def _table_json(table: RecordTable, rows_per_chunk: int = 4096) -> Iterator[dict[str, Any]]:
    """JSON objects of every row straight from the columns (no per-interval objects), a chunk of rows at a time."""
    s, iv = table.steps, table.intervals
    order = np.argsort(iv.row, kind="stable")
    bounds = np.searchsorted(iv.row[order], np.arange(table.n_rows + 1), side="left")
    domains = table.nvlink_domain_names or tuple(f"nvl-{i}" for i in range(int(s.nvlink_domain.max(initial=-1)) + 1))
    tiers = table.network_tier_names or tuple(f"block-{i}" for i in range(int(s.network_tier.max(initial=-1)) + 1))
    groups = table.group_names or tuple(f"group-{i}" for i in range(int(iv.group.max(initial=-1)) + 1))
    for r0 in range(0, table.n_rows, rows_per_chunk):
        r1 = min(table.n_rows, r0 + rows_per_chunk)
        sel = order[bounds[r0] : bounds[r1]]
        cols = [
            getattr(iv, name)[sel].tolist()
            for name in ("kind", "start_us", "end_us", "phase", "axis", "op", "group", "seq", "size_bytes")
        ]
        group_size, peer = iv.group_size[sel].tolist(), iv.peer[sel].tolist()
        for i in range(r0, r1):
            lo, hi = int(bounds[i] - bounds[r0]), int(bounds[i + 1] - bounds[r0])
            intervals = [_interval_obj(j, cols, group_size, peer, groups) for j in range(lo, hi)]
            yield _row_json(table, i, intervals, domains, tiers)


def _interval_obj(
    j: int, cols: list[list[int]], group_size: list[int], peer: list[int], groups: tuple[str, ...]
) -> dict[str, Any]:
    k, start, end, ph, ax, op, g, sq, nb = (c[j] for c in cols)
    out: dict[str, Any] = {"kind": KINDS[k].value, "start_us": start, "end_us": end}
    if ph >= 0:
        out["phase"] = PHASES[ph].value
    if k in {COMM_CODE, P2P_CODE}:
        out["axis"], out["op"] = AXES[ax].value, OPS[op].value
        optional = {"group": groups[g] if g >= 0 else None, "seq": sq, "bytes": nb, "peer": peer[j]}
        out.update({key: v for key, v in optional.items() if v is not None and v != UNKNOWN})
        if group_size[j] > 0:
            out["group_size"] = group_size[j]
    return out


def _row_json(
    table: RecordTable, i: int, intervals: list[dict[str, Any]], domains: tuple[str, ...], tiers: tuple[str, ...]
) -> dict[str, Any]:
    s = table.steps
    obj: dict[str, Any] = {
        "schema": SCHEMA,
        "job": table.job,
        "step": int(s.step[i]),
        "rank": int(s.rank[i]),
        "coord": {a.value: int(s.coord[i, k]) for k, a in enumerate(AXES)},
        "node": table.node_name(int(s.node[i])),
    }
    dom, tier, gpu = int(s.nvlink_domain[i]), int(s.network_tier[i]), int(s.gpu[i])
    if dom >= 0:
        obj["nvlink_domain"] = domains[dom]
    if tier >= 0:
        obj["network_tier"] = tiers[tier]
    if gpu >= 0:
        obj["gpu"] = gpu
    obj["start_us"], obj["end_us"], obj["intervals"] = int(s.start_us[i]), int(s.end_us[i]), intervals
    stats: dict[str, Any] = {}
    for key, col in (
        ("tokens", s.tokens),
        ("sequences", s.sequences),
        ("longest_sequence", s.longest_sequence),
        ("attention_work", s.attention_work),
        ("attention_us", s.attention_us),
        ("peak_memory_bytes", s.peak_memory_bytes),
    ):
        value = col[i]
        if col.dtype.kind == "f":
            if not np.isnan(value):
                stats[key] = float(value)
        elif value >= 0:
            stats[key] = int(value)
    if stats:
        obj["stats"] = stats
    if not np.isnan(s.gpu_util[i]):
        obj["gpu_util"] = float(s.gpu_util[i])
    return obj

"""One decoded JSON line <-> one :class:`~meshscope.records.schema.StepRecord`: the object parser and its inverse.

The object parser is the reference reading of ``meshscope.step/1``: it checks every field of one decoded line and
raises a :class:`~meshscope.errors.ParseError` naming where (file and line), the field, its value and what would fit.
The columnar fast path (:mod:`meshscope.records.building`) hands every line it cannot take to this parser, so both
readers raise the same messages. This module must not open files and must not guess at bad input.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any

from meshscope.errors import ParseCode, ParseError
from meshscope.records.schema import (
    AXIS_CODE,
    BETWEEN_COMM,
    BETWEEN_KINDS,
    KIND_CODE,
    OP_CODE,
    PHASE_CODE,
    SCHEMA,
    BetweenSteps,
    CommOp,
    DataStats,
    Interval,
    IntervalKind,
    Phase,
    StepRecord,
)
from meshscope.topology import AXES, MeshAxis, RankCoord

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Every whole number of a record must fit in 64 bits (the table's columns are int64)."""
INT32_MAX = 2**31 - 1
"""``gpu`` and ``group_size`` must fit in 32 bits (int32 columns)."""


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _where_field(where: str, name: str) -> str:
    return f"{where}: {name}" if where else name


def _get(obj: dict[str, Any], key: str, where: str, *, required: bool = True) -> object:
    if key in obj:
        return obj[key]
    if required:
        raise ParseError(
            f"{where}: field {key!r} is missing; it is required ({SCHEMA}, see docs/records.md)",
            code=ParseCode.MISSING_FIELD,
        )
    return None


def _int(
    obj: dict[str, Any],
    key: str,
    where: str,
    *,
    required: bool = True,
    minimum: int | None = None,
    maximum: int = INT64_MAX,
) -> int | None:
    """A whole-number field: not a bool, not a float, within ``[minimum or INT64_MIN, maximum]``.

    The upper bound is what the table's columns hold, so both readers refuse the same values (and name them alike).
    """
    value = _get(obj, key, where, required=required)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParseError(
            f"{_where_field(where, key)} = {value!r} ({_type_name(value)}); expected a whole number",
            code=ParseCode.WRONG_TYPE if value is not None else ParseCode.MISSING_FIELD,
        )
    if minimum is not None and value < minimum:
        raise ParseError(f"{_where_field(where, key)} = {value} is below {minimum}", code=ParseCode.VALUE_OUT_OF_RANGE)
    if value < INT64_MIN or value > maximum:
        bits = 32 if maximum == INT32_MAX else 64
        bound = f"above {maximum}" if value > maximum else f"below {INT64_MIN}"
        raise ParseError(
            f"{_where_field(where, key)} = {value} is {bound}; it must fit in {bits} bits",
            code=ParseCode.VALUE_OUT_OF_RANGE,
        )
    return value


def _str(obj: dict[str, Any], key: str, where: str, *, required: bool = True) -> str | None:
    value = _get(obj, key, where, required=required)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        code = ParseCode.MISSING_FIELD if value is None else ParseCode.WRONG_TYPE
        if value == "":
            code = ParseCode.VALUE_OUT_OF_RANGE
        raise ParseError(
            f"{_where_field(where, key)} = {value!r} ({_type_name(value)}); expected a non-empty string", code=code
        )
    return value


def _number(obj: dict[str, Any], key: str, where: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    message = f"{_where_field(where, key)} = {value!r} ({_type_name(value)}); expected a finite number"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ParseError(message, code=ParseCode.WRONG_TYPE)
    try:
        number = float(value)  # a whole number beyond a double's range raises OverflowError
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ParseError(message, code=ParseCode.VALUE_OUT_OF_RANGE)
    return number


def _choice(obj: dict[str, Any], key: str, where: str, allowed: dict[str, int], *, required: bool) -> str | None:
    value = _str(obj, key, where, required=required)
    if value is not None and value not in allowed:
        raise ParseError(
            f"{_where_field(where, key)} = {value!r} is not one of {list(allowed)}", code=ParseCode.NOT_ONE_OF
        )
    return value


def _object(value: object, where: str, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        code = ParseCode.BAD_JSON if what == "line" else ParseCode.WRONG_TYPE
        if value is None and what != "line":
            code = ParseCode.MISSING_FIELD
        raise ParseError(
            f"{where}: {what} = {str(value)[:60]!r} ({_type_name(value)}); expected a JSON object", code=code
        )
    return value


def _parse_interval(obj: object, where: str) -> Interval:
    d = _object(obj, where, "interval")
    kind = IntervalKind(_choice(d, "kind", where, KIND_CODE, required=True) or "")
    is_comm, is_p2p = kind is IntervalKind.COMM, kind is IntervalKind.P2P
    net = is_comm or is_p2p
    phase = _choice(d, "phase", where, PHASE_CODE, required=False) if kind is IntervalKind.COMPUTE else None
    axis = _choice(d, "axis", where, AXIS_CODE, required=True) if net else None
    op = _choice(d, "op", where, OP_CODE, required=True) if net else None
    start = _int(d, "start_us", where) or 0
    end = _int(d, "end_us", where) or 0
    group = _str(d, "group", where, required=is_comm) if net else None
    seq = _int(d, "seq", where, required=is_comm, minimum=0) if net else None
    size_bytes = _int(d, "bytes", where, required=False, minimum=0) if net else None
    group_size = _int(d, "group_size", where, required=False, minimum=1, maximum=INT32_MAX) if is_comm else None
    peer = _int(d, "peer", where, required=True, minimum=0) if is_p2p else None
    try:
        return Interval(
            kind=kind,
            start_us=start,
            end_us=end,
            phase=Phase(phase) if phase else None,
            axis=MeshAxis(axis) if axis else None,
            op=CommOp(op) if op else None,
            group=group,
            seq=seq,
            size_bytes=size_bytes,
            group_size=group_size,
            peer=peer,
        )
    except ParseError as exc:
        raise ParseError(f"{where}.{exc}", code=exc.code) from None


def _parse_record(obj: object, where: str) -> StepRecord:
    """Check one decoded JSON line against the schema and build its :class:`StepRecord`.

    Raises:
        ParseError: naming ``where`` (file and line), the field, its value and what would fit.
    """
    d = _object(obj, where, "line")
    schema = _str(d, "schema", where)
    if schema != SCHEMA:
        raise ParseError(
            f"{where}: schema = {schema!r} is not supported; this reader reads {SCHEMA!r}",
            code=ParseCode.UNSUPPORTED_SCHEMA,
        )
    coord_obj = _object(_get(d, "coord", where), where, "coord")
    coord = {a.value: _int(coord_obj, a.value, f"{where}: coord", minimum=0) for a in AXES}
    raw_ivs = _get(d, "intervals", where)
    if not isinstance(raw_ivs, list):
        raise ParseError(
            f"{where}: intervals = {str(raw_ivs)[:60]!r} ({_type_name(raw_ivs)}); expected a list",
            code=ParseCode.MISSING_FIELD if raw_ivs is None else ParseCode.WRONG_TYPE,
        )
    intervals = tuple(_parse_interval(v, f"{where}: intervals[{i}]") for i, v in enumerate(raw_ivs))
    stats_obj = d.get("stats")
    stats = DataStats()
    if stats_obj is not None:
        so = _object(stats_obj, where, "stats")
        sw = f"{where}: stats"
        stats = DataStats(
            tokens=_int(so, "tokens", sw, required=False, minimum=0),
            sequences=_int(so, "sequences", sw, required=False, minimum=0),
            longest_sequence=_int(so, "longest_sequence", sw, required=False, minimum=0),
            attention_work=_number(so, "attention_work", sw),
            attention_us=_int(so, "attention_us", sw, required=False, minimum=0),
            peak_memory_bytes=_int(so, "peak_memory_bytes", sw, required=False, minimum=0),
        )
    job = _str(d, "job", where) or ""
    step = _int(d, "step", where, minimum=0) or 0
    rank = _int(d, "rank", where, minimum=0) or 0
    node = _str(d, "node", where) or ""
    start_us = _int(d, "start_us", where) or 0
    end_us = _int(d, "end_us", where) or 0
    nvlink_domain = _str(d, "nvlink_domain", where, required=False)
    network_tier = _str(d, "network_tier", where, required=False)
    gpu = _int(d, "gpu", where, required=False, minimum=0, maximum=INT32_MAX)
    gpu_util = _number(d, "gpu_util", where)
    user_step = _int(d, "user_step", where, required=False, minimum=0)
    gap_before_us = _int(d, "gap_before_us", where, required=False, minimum=0)
    runqueue_wait_us = _int(d, "runqueue_wait_us", where, required=False, minimum=0)
    on_cpu_us = _int(d, "on_cpu_us", where, required=False, minimum=0)
    compute_runqueue_wait_us = _int(d, "compute_runqueue_wait_us", where, required=False, minimum=0)
    data_runqueue_wait_us = _int(d, "data_runqueue_wait_us", where, required=False, minimum=0)
    optimizer_runqueue_wait_us = _int(d, "optimizer_runqueue_wait_us", where, required=False, minimum=0)
    attempt_start_us = _int(d, "attempt_start_us", where, required=False, minimum=0)
    raised = _str(d, "raised", where, required=False)
    between_obj = d.get("between_steps")
    between = None
    if between_obj is not None:
        bo = _object(between_obj, where, "between_steps")
        bw = f"{where}: between_steps"
        between = BetweenSteps(
            **{f"{k}_us": _int(bo, k, bw, required=False, minimum=0) or 0 for k in (*BETWEEN_KINDS, BETWEEN_COMM)}
        )
    try:
        return StepRecord(
            job=job,
            step=step,
            rank=rank,
            coord=RankCoord(**{k: v or 0 for k, v in coord.items()}),
            node=node,
            start_us=start_us,
            end_us=end_us,
            intervals=intervals,
            nvlink_domain=nvlink_domain,
            network_tier=network_tier,
            gpu=gpu,
            stats=stats,
            gpu_util=gpu_util,
            user_step=user_step,
            gap_before_us=gap_before_us,
            between_steps=between,
            runqueue_wait_us=runqueue_wait_us,
            on_cpu_us=on_cpu_us,
            compute_runqueue_wait_us=compute_runqueue_wait_us,
            data_runqueue_wait_us=data_runqueue_wait_us,
            optimizer_runqueue_wait_us=optimizer_runqueue_wait_us,
            attempt_start_us=attempt_start_us,
            raised=raised,
        )
    except ParseError as exc:
        raise ParseError(f"{where}: {exc}", code=exc.code) from None


def _interval_json(iv: Interval) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": iv.kind.value, "start_us": iv.start_us, "end_us": iv.end_us}
    for key, value in (
        ("phase", iv.phase),
        ("axis", iv.axis),
        ("op", iv.op),
        ("group", iv.group),
        ("seq", iv.seq),
        ("bytes", iv.size_bytes),
        ("group_size", iv.group_size),
        ("peer", iv.peer),
    ):
        if value is not None:
            out[key] = str(value) if isinstance(value, StrEnum) else value
    return out


def record_to_json(record: StepRecord) -> dict[str, Any]:
    """The JSON object of one record (optional fields left out when ``None``)."""
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "job": record.job,
        "step": record.step,
        "rank": record.rank,
        "coord": record.coord.as_dict(),
        "node": record.node,
    }
    optional = {
        "nvlink_domain": record.nvlink_domain,
        "network_tier": record.network_tier,
        "gpu": record.gpu,
        "attempt_start_us": record.attempt_start_us,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    out["start_us"] = record.start_us
    out["end_us"] = record.end_us
    out["intervals"] = [_interval_json(iv) for iv in record.intervals]
    stats = {
        k: getattr(record.stats, k)
        for k in ("tokens", "sequences", "longest_sequence", "attention_work", "attention_us", "peak_memory_bytes")
        if getattr(record.stats, k) is not None
    }
    if stats:
        out["stats"] = stats
    between = record.between_steps
    tail = {
        "gpu_util": record.gpu_util,
        "user_step": record.user_step,
        "gap_before_us": record.gap_before_us,
        "between_steps": None if between is None else between.as_dict(),
        "runqueue_wait_us": record.runqueue_wait_us,
        "on_cpu_us": record.on_cpu_us,
        "compute_runqueue_wait_us": record.compute_runqueue_wait_us,
        "data_runqueue_wait_us": record.data_runqueue_wait_us,
        "optimizer_runqueue_wait_us": record.optimizer_runqueue_wait_us,
        "raised": record.raised,
    }
    out.update({k: v for k, v in tail.items() if v is not None})
    return out

"""Server-side ``meta.k8s.io/v1`` Tables, as kubectl asks for them (``Accept: ...;as=Table;g=meta.k8s.io``).

kubectl does not compute a CRD's ``additionalPrinterColumns`` itself: it prints the Table the API server returns.
The API server's custom-resource table convertor (k8s.io/apiextensions-apiserver ``tableconvertor``) gives a
``Name`` column, then the declared columns (a CRD without any gets ``Age`` from ``metadata.creationTimestamp``);
each cell is the JSONPath's first result, typed by the column: ``string`` printed as text, ``integer``/``number``/
``boolean`` as JSON values, ``date`` as a human duration since then ("5s", "3m20s", "2d"), a missing value as
``None`` (kubectl prints ``<none>``). Every row carries the object as ``PartialObjectMetadata`` (kubectl's ``-A``
takes the namespace from it) unless ``includeObject`` says otherwise.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import jsonpath_ng

NAME_COLUMN = {
    "name": "Name",
    "type": "string",
    "format": "name",
    "description": "Name must be unique within a namespace. More info: "
    "https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names",
    "priority": 0,
}
AGE_COLUMN = {
    "name": "Age",
    "type": "date",
    "jsonPath": ".metadata.creationTimestamp",
    "description": "CreationTimestamp is a timestamp representing the server time when this object was created.",
}


def human_duration(seconds: float) -> str:  # noqa: C901 - one branch per range, as the API server has them
    """A duration as k8s.io/apimachinery ``duration.HumanDuration`` prints it.

    Up to 2 minutes in seconds, then minutes (with seconds under 10 minutes), hours (with minutes under 8 hours),
    days (with hours under 8 days), years (with days under 8 years); "0s" for up to a second in the future,
    "<invalid>" further.
    """
    whole = int(seconds)
    if whole < -1:
        return "<invalid>"
    if whole < 0:
        return "0s"
    if whole < 120:
        return f"{whole}s"
    minutes = whole // 60
    if minutes < 10:
        s = whole % 60
        return f"{minutes}m" if s == 0 else f"{minutes}m{s}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = whole // 3600
    if hours < 8:
        m = minutes % 60
        return f"{hours}h" if m == 0 else f"{hours}h{m}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        h = hours % 24
        return f"{hours // 24}d" if h == 0 else f"{hours // 24}d{h}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        dy = (hours // 24) % 365
        return f"{hours // 24 // 365}y" if dy == 0 else f"{hours // 24 // 365}y{dy}d"
    return f"{hours // 24 // 365}y"


def parse_timestamp(text: str) -> dt.datetime:
    """An RFC 3339 timestamp such as ``2026-12-04T02:30:00Z``."""
    return dt.datetime.fromisoformat(text)  # Python 3.11 reads the trailing Z


def _first(path: str, obj: dict[str, Any]) -> tuple[bool, Any]:
    expression = jsonpath_ng.parse("$" + path if path.startswith((".", "[")) else path)
    found = expression.find(obj)
    return (True, found[0].value) if found else (False, None)


def cell(column: dict[str, Any], obj: dict[str, Any], now: dt.datetime) -> Any:
    """One cell: the column's JSONPath in ``obj``, typed as the API server types it."""
    found, value = _first(column["jsonPath"], obj)
    if not found or value is None:
        return None
    kind = column.get("type", "string")
    if kind == "string":
        return value if isinstance(value, str) else json.dumps(value)
    if kind == "integer" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    if kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind == "boolean" and isinstance(value, bool):
        return value
    if kind == "date" and isinstance(value, str):
        try:
            then = parse_timestamp(value)
        except ValueError:
            return "<invalid>"
        return human_duration((now - then).total_seconds())
    return None


def column_definitions(printer_columns: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The Table's ``columnDefinitions``: ``Name``, then the declared columns (or ``Age`` if none)."""
    declared = printer_columns or [AGE_COLUMN]
    return [
        NAME_COLUMN,
        *(
            {
                "name": c["name"],
                "type": c.get("type", "string"),
                "format": c.get("format", ""),
                "description": c.get("description", ""),
                "priority": int(c.get("priority", 0)),
            }
            for c in declared
        ),
    ]


def _row_object(obj: dict[str, Any], include: str) -> dict[str, Any] | None:
    if include == "None":
        return None
    if include == "Object":
        return obj
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj.get("metadata", {})}


def render_table(
    objects: list[dict[str, Any]],
    printer_columns: list[dict[str, Any]] | None,
    *,
    resource_version: str,
    include_object: str = "Metadata",
    now: dt.datetime | None = None,
) -> dict[str, Any]:
    """The ``meta.k8s.io/v1`` Table of ``objects``.

    Args:
        objects: the objects, in list order.
        printer_columns: the CRD version's ``additionalPrinterColumns`` (``None`` or empty: ``Age`` only).
        resource_version: the list's resourceVersion.
        include_object: the request's ``includeObject``: ``None``, ``Metadata`` (the default) or ``Object``.
        now: the time ``date`` cells count from (default: now, UTC).
    """
    now = now or dt.datetime.now(tz=dt.UTC)
    declared = printer_columns or [AGE_COLUMN]
    rows = []
    for obj in objects:
        row: dict[str, Any] = {
            "cells": [obj.get("metadata", {}).get("name", "")] + [cell(c, obj, now) for c in declared]
        }
        if (partial := _row_object(obj, include_object)) is not None:
            row["object"] = partial
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": column_definitions(printer_columns),
        "rows": rows,
    }


def wants_table(accept: str) -> bool:
    """Whether an ``Accept`` header asks for a ``meta.k8s.io`` Table first."""
    first = accept.split(",", maxsplit=1)[0]
    params = {p.split("=", 1)[0].strip(): p.split("=", 1)[-1].strip() for p in first.split(";")[1:] if "=" in p}
    return params.get("as") == "Table" and params.get("g") == "meta.k8s.io"

"""A CRD's ``openAPIV3Schema`` applied to custom objects as the API server applies it: defaults, pruning, validation.

- :func:`default_and_prune` fills ``default`` values of absent properties and removes fields the schema does not
  declare (unless ``x-kubernetes-preserve-unknown-fields`` or ``additionalProperties`` allow them), returning the
  paths it removed: the API server's ``unknown field "spec.bogus"`` warnings (``fieldValidation=Warn``, the default)
  or its strict-decoding error (``Strict``).
- :func:`validate` returns :class:`FieldError`\\ s worded as the API server words them (k8s.io/apiextensions-apiserver
  turns kube-openapi's validation results into ``field.Error``\\ s: ``spec.parallelism.tp: Invalid value: 0:
  spec.parallelism.tp in body should be greater than or equal to 1``).

Root ``apiVersion``, ``kind`` and ``metadata`` are the API server's own and never pruned. Not emulated: CEL
``x-kubernetes-validations``, ``format`` checks, structural-schema checks of the CRD itself, ratcheting.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

_ROOT_FIELDS = ("apiVersion", "kind", "metadata")
_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
}


@dataclass(frozen=True, slots=True)
class FieldError:
    """One validation error: a ``field.Error`` of k8s.io/apimachinery."""

    type: str
    """``FieldValueInvalid``, ``FieldValueRequired``, ``FieldValueNotSupported``, ``FieldValueTooLong``,
    ``FieldValueTooMany`` or ``FieldValueTypeInvalid`` (the Status cause's ``reason``)."""
    field: str
    body: str
    """What the error says after the field: ``Invalid value: 0: ...``, ``Required value``."""

    @property
    def message(self) -> str:
        """``field: body``, as the Status message lists it."""
        return f"{self.field}: {self.body}"


def _go_value(value: Any) -> str:
    """A value as ``field.Error`` prints it: strings quoted, numbers and booleans bare."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return json.dumps(value)
    return json.dumps(value, sort_keys=True)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _type_ok(value: Any, wanted: str) -> bool:
    if wanted == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if wanted == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    kind = _TYPES.get(wanted)
    return kind is None or (isinstance(value, kind) and not (kind is not bool and isinstance(value, bool)))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def default_and_prune(obj: dict[str, Any], schema: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A copy of ``obj`` with defaults filled and undeclared fields removed; the removed fields' paths.

    Args:
        obj: a custom object (its ``apiVersion``, ``kind``, ``metadata`` are kept as they are).
        schema: the version's ``openAPIV3Schema``.
    """
    out = copy.deepcopy(obj)
    unknown: list[str] = []
    _walk(out, schema, "", unknown, root=True)
    return out, unknown


def _walk(node: Any, schema: dict[str, Any], path: str, unknown: list[str], *, root: bool = False) -> None:  # noqa: C901 - one case per schema keyword
    if isinstance(node, dict):
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        if properties is not None:
            for key, sub in properties.items():
                if key not in node and "default" in sub:
                    node[key] = copy.deepcopy(sub["default"])
        for key in list(node):
            if root and key in _ROOT_FIELDS:
                continue
            if properties is not None and key in properties:
                _walk(node[key], properties[key], _join(path, key), unknown)
            elif isinstance(extra, dict):
                _walk(node[key], extra, _join(path, key), unknown)
            elif extra is True or preserve:
                continue
            else:
                unknown.append(_join(path, key))
                del node[key]
    elif isinstance(node, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(node):
            _walk(item, schema["items"], f"{path}[{i}]", unknown)


def validate(obj: dict[str, Any], schema: dict[str, Any]) -> list[FieldError]:
    """Every schema violation of ``obj`` (defaulted and pruned first), in the API server's words."""
    errors: list[FieldError] = []
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    root = {
        **schema,
        "properties": {k: v for k, v in (schema.get("properties") or {}).items() if k not in _ROOT_FIELDS},
    }
    _check(body, root, "", errors)
    return errors


def _check(value: Any, schema: dict[str, Any], path: str, errors: list[FieldError]) -> None:  # noqa: C901
    where = path or "<root>"
    if value is None:
        if not schema.get("nullable") and "type" in schema:
            errors.append(
                FieldError(
                    "FieldValueTypeInvalid",
                    where,
                    f'Invalid value: "null": {where} in body must be of type {schema["type"]}: "null"',
                )
            )
        return
    wanted = schema.get("type")
    if wanted and not _type_ok(value, wanted):
        actual = _json_type(value)
        errors.append(
            FieldError(
                "FieldValueTypeInvalid",
                where,
                f'Invalid value: "{actual}": {where} in body must be of type {wanted}: "{actual}"',
            )
        )
        return
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(_go_value(v) for v in schema["enum"])
        errors.append(
            FieldError(
                "FieldValueNotSupported", where, f"Unsupported value: {_go_value(value)}: supported values: {supported}"
            )
        )
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema:
            low = schema["minimum"]
            if value < low or (schema.get("exclusiveMinimum") is True and value == low):
                than = "greater than" if schema.get("exclusiveMinimum") is True else "greater than or equal to"
                errors.append(_invalid(where, value, f"{where} in body should be {than} {_num(low)}"))
        if "maximum" in schema:
            high = schema["maximum"]
            if value > high or (schema.get("exclusiveMaximum") is True and value == high):
                than = "less than" if schema.get("exclusiveMaximum") is True else "less than or equal to"
                errors.append(_invalid(where, value, f"{where} in body should be {than} {_num(high)}"))
        if "multipleOf" in schema and value % schema["multipleOf"]:
            errors.append(
                _invalid(where, value, f"{where} in body should be a multiple of {_num(schema['multipleOf'])}")
            )
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(
                FieldError("FieldValueTooLong", where, f"Too long: may not be longer than {schema['maxLength']}")
            )
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(
                _invalid(where, value, f"{where} in body should be at least {schema['minLength']} chars long")
            )
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(_invalid(where, value, f"{where} in body should match '{schema['pattern']}'"))
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(
                FieldError(
                    "FieldValueTooMany", where, f"Too many: {len(value)}: must have at most {schema['maxItems']} items"
                )
            )
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(_invalid(where, value, f"{where} in body should have at least {schema['minItems']} items"))
        if isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                _check(item, schema["items"], f"{path}[{i}]", errors)
    if isinstance(value, dict):
        errors.extend(
            FieldError("FieldValueRequired", _join(path, key), "Required value")
            for key in schema.get("required") or ()
            if key not in value
        )
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in properties:
                _check(item, properties[key], _join(path, key), errors)
            elif isinstance(extra, dict):
                _check(item, extra, _join(path, key), errors)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _invalid(where: str, value: Any, detail: str) -> FieldError:
    return FieldError("FieldValueInvalid", where, f"Invalid value: {_go_value(value)}: {detail}")

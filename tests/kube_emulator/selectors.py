"""Label and field selectors, as the API server parses and applies them on list and watch.

Label selectors follow k8s.io/apimachinery ``labels.Parse``: requirements joined by commas, each one of ``key``,
``!key``, ``key=value``, ``key==value``, ``key!=value``, ``key in (a,b)``, ``key notin (a,b)``. ``!=`` and
``notin`` also match objects without the key (as the API server does). Field selectors are ``path=value``,
``path==value``, ``path!=value``, joined by commas; a missing field reads as the empty string.

A selector that does not parse raises :class:`SelectorError` with the API server's wording (the emulator turns it
into a 400 BadRequest).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_SET = re.compile(r"^(?P<key>\S+)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")
_BINARY = re.compile(r"^(?P<key>[^=!\s]+)\s*(?P<op>==|=|!=)\s*(?P<value>\S*)$")


class SelectorError(ValueError):
    """A selector that does not parse."""


@dataclass(frozen=True, slots=True)
class Requirement:
    """One requirement of a label selector."""

    key: str
    op: str
    """``exists``, ``!``, ``=``, ``!=``, ``in`` or ``notin`` (``==`` is stored as ``=``)."""
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether ``labels`` satisfy this requirement."""
        has = self.key in labels
        value = labels.get(self.key)
        match self.op:
            case "exists":
                return has
            case "!":
                return not has
            case "=" | "in":
                return has and value in self.values
            case _:  # "!=" and "notin" match a missing key too
                return not has or value not in self.values


def _split(selector: str) -> list[str]:
    """Split at commas outside parentheses."""
    parts, depth, current = [], 0, []
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts]


def _check_key(key: str, selector: str) -> str:
    if not _KEY.match(key) or len(key.rsplit("/", 1)[-1]) > 63:
        raise SelectorError(f"unable to parse requirement: invalid label key {key!r} in {selector!r}")
    return key


def _check_value(value: str, selector: str) -> str:
    if not _VALUE.match(value) or len(value) > 63:
        raise SelectorError(f"unable to parse requirement: invalid label value {value!r} in {selector!r}")
    return value


def parse_label_selector(selector: str) -> tuple[Requirement, ...]:
    """The requirements of ``selector`` (empty: everything matches).

    Raises:
        SelectorError: for a selector the API server would refuse.
    """
    if not selector.strip():
        return ()
    requirements = []
    for part in _split(selector):
        if not part:
            raise SelectorError(f"found '', expected: identifier in label selector {selector!r}")
        if m := _SET.match(part):
            values = tuple(_check_value(v.strip(), selector) for v in m["values"].split(","))
            requirements.append(Requirement(_check_key(m["key"], selector), m["op"], values))
        elif m := _BINARY.match(part):
            op = "=" if m["op"] == "==" else m["op"]
            requirements.append(Requirement(_check_key(m["key"], selector), op, (_check_value(m["value"], selector),)))
        elif part.startswith("!"):
            requirements.append(Requirement(_check_key(part[1:].strip(), selector), "!"))
        else:
            requirements.append(Requirement(_check_key(part, selector), "exists"))
    return tuple(requirements)


def match_labels(requirements: tuple[Requirement, ...], labels: Mapping[str, str] | None) -> bool:
    """Whether every requirement holds for ``labels``."""
    labels = labels or {}
    return all(r.matches(labels) for r in requirements)


def selector_from_object(selector: Mapping[str, Any] | None) -> tuple[Requirement, ...]:
    """A ``metav1.LabelSelector`` (``matchLabels``, ``matchExpressions``), as webhook ``objectSelector``s hold.

    Raises:
        SelectorError: for an operator other than In, NotIn, Exists, DoesNotExist.
    """
    if not selector:
        return ()
    requirements = [Requirement(k, "=", (str(v),)) for k, v in (selector.get("matchLabels") or {}).items()]
    ops = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}
    for expr in selector.get("matchExpressions") or ():
        op = ops.get(expr.get("operator", ""))
        if op is None:
            raise SelectorError(f"{expr.get('operator')!r} is not a valid label selector operator")
        requirements.append(Requirement(str(expr.get("key", "")), op, tuple(str(v) for v in expr.get("values") or ())))
    return tuple(requirements)


@dataclass(frozen=True, slots=True)
class FieldRequirement:
    """One requirement of a field selector: ``path`` (dotted) equal or not equal to ``value``."""

    path: str
    equal: bool
    value: str

    def matches(self, obj: Mapping[str, Any]) -> bool:
        """Whether ``obj``'s field satisfies this requirement (a missing field reads as "")."""
        return (field_value(obj, self.path) == self.value) is self.equal


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The field at dotted ``path`` as the API server's field sets hold it: a string, "" if missing."""
    node: Any = obj
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return ""
        node = node[part]
    if isinstance(node, bool):
        return "true" if node else "false"
    return "" if node is None else str(node)


def parse_field_selector(selector: str, allowed: Callable[[str], bool] | None = None) -> tuple[FieldRequirement, ...]:
    """The requirements of ``selector``.

    Args:
        selector: the ``fieldSelector`` parameter.
        allowed: which paths the resource supports (custom resources: ``metadata.name``, ``metadata.namespace``);
            ``None``: any path.

    Raises:
        SelectorError: for a selector that does not parse, or a path the resource does not support.
    """
    if not selector.strip():
        return ()
    requirements = []
    for part in _split(selector):
        m = _BINARY.match(part)
        if not m:
            raise SelectorError(f"invalid selector: {selector!r}; can't understand {part!r}")
        if allowed is not None and not allowed(m["key"]):
            raise SelectorError(f"field label not supported: {m['key']}")
        requirements.append(FieldRequirement(m["key"], m["op"] != "!=", m["value"]))
    return tuple(requirements)


def match_fields(requirements: tuple[FieldRequirement, ...], obj: Mapping[str, Any]) -> bool:
    """Whether every field requirement holds for ``obj``."""
    return all(r.matches(obj) for r in requirements)

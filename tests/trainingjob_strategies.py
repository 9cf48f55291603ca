"""Hypothesis strategies of TrainingJobs generated from the CRD's own schema (the admission and reconcile fuzz suites).

The generator walks ``crds/trainingjobs.meshscope.io.yaml``'s ``openAPIV3Schema`` (types, ranges, enums, patterns,
``maxItems``, required keys), so what it makes is what the API server would let through. Most examples start from
one of the examples and re-draw one to three fields anywhere in the spec from their schema, so they reach the
loader's arithmetic and the planner rather than stopping at the first check; some are whole specs drawn from the
schema; a minority are corrupted in one place (a wrong type, a value out of range, an unknown key).
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from hypothesis import strategies as st

from operator_serving import NAMESPACE, ROOT, load_example

CRD = yaml.safe_load((ROOT / "crds" / "trainingjobs.meshscope.io.yaml").read_text())
SPEC_SCHEMA: dict[str, Any] = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
EXAMPLES = {p.stem: load_example(p.stem) for p in sorted((ROOT / "examples").glob("*.yaml"))}

_EDGE_INTS = (0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 32, 64, 72, 80, 96, 126, 128, 512, 1000, 1024, 4096, 8192)


def _from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values the schema accepts (CEL rules aside), biased to the small and edge values layouts are made of."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        lo, hi = schema.get("minimum", 0), schema.get("maximum", 1 << 31)
        edges = [v for v in (*_EDGE_INTS, lo, hi) if lo <= v <= hi]
        return st.sampled_from(edges) | st.integers(lo, hi)
    if kind == "number":
        lo, hi = schema.get("minimum", 0), schema.get("maximum", 1e6)
        return st.sampled_from([lo, hi, 1, 4, 80]).filter(lambda v: lo <= v <= hi) | st.floats(
            lo, hi, allow_nan=False, allow_infinity=False
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        if "pattern" in schema:
            known = ["nvidia.com/gpu.clique", "network.topology.nvidia.com/leaf", "fabric.topograph.run/tier-1"]
            return st.sampled_from(known) | st.from_regex(schema["pattern"].strip(), fullmatch=True).filter(
                lambda s: len(s) <= schema.get("maxLength", 317)
            )
        return st.text(max_size=schema.get("maxLength", 64))
    if kind == "array":
        items = _from_schema(schema["items"])
        unique = schema.get("x-kubernetes-list-type") == "set"
        return st.lists(items, max_size=schema.get("maxItems", 4), unique=unique)
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return st.just({}) | st.just({"spec": {"containers": [{"name": "trainer", "image": "pytorch"}]}})
    properties = schema.get("properties", {})
    required = set(schema.get("required", ()))
    return st.fixed_dictionaries(
        {k: _from_schema(v) for k, v in properties.items() if k in required},
        optional={k: _from_schema(v) for k, v in properties.items() if k not in required},
    )


def _paths(schema: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """Every field under ``spec`` with its schema, sections and leaves alike."""
    out = []
    for key, sub in schema.get("properties", {}).items():
        out.append(((*prefix, key), sub))
        out += _paths(sub, (*prefix, key))
    return out


PATHS = _paths(SPEC_SCHEMA)
# Leaves are re-drawn far more often than whole sections; the layout's own fields come first, since hypothesis leans
# to the first of a list it samples from.
LEAVES = sorted(
    ((p, s) for p, s in PATHS if s.get("type") != "object" or "properties" not in s),
    key=lambda ps: (ps[0][0] != "parallelism", ps[0][0] != "training", ps[0]),
)
SECTIONS = [(p, s) for p, s in PATHS if s.get("type") == "object" and "properties" in s]
_CORRUPT = st.sampled_from(["two", -1, 0, 1.5, True, None, [], {"x": 1}, 10**12, "8"])


@st.composite
def training_jobs(draw: st.DrawFn) -> dict[str, Any]:
    """A TrainingJob: an example with fields re-drawn from the CRD, a spec drawn whole, or one of those corrupted."""
    # Each choice below lists its common case first: hypothesis leans to the first element it samples from.
    name = draw(st.sampled_from(sorted(EXAMPLES)))
    job = copy.deepcopy(EXAMPLES[name])
    job["metadata"] = {"name": "fuzz", "namespace": NAMESPACE}
    how = draw(st.sampled_from(["leaves"] * 8 + ["section", "whole"]))
    if how == "whole":
        job["spec"] = draw(_from_schema(SPEC_SCHEMA))
    else:
        pool = LEAVES if how == "leaves" else SECTIONS
        for path, sub in draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3)):
            removed = draw(st.sampled_from([False] * 5 + [True]))
            _set(job["spec"], path, None if removed else draw(_from_schema(sub)))
    corruption = draw(st.sampled_from([None] * 8 + ["value", "key"]))
    if corruption is not None:
        path, _ = draw(st.sampled_from(LEAVES))
        if corruption == "value":
            _set(job["spec"], path, draw(_CORRUPT))
        else:
            _set(job["spec"], (*path[:-1], "bogus" + path[-1]), 1)
    return job


def _set(spec: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set (or, for ``None``, remove) ``path`` in ``spec``, making the sections on the way."""
    node = spec
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if value is None:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value

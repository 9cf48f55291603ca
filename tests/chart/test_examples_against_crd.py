"""Every example TrainingJob is valid against the CRD the chart installs, as OpenAPI 3.0 (openapi-schema-validator).

The schema is taken from the rendered chart, not from crds/, so that what ``helm install`` puts in the cluster is
what is checked. As the API server does with ``kubectl apply`` (strict field validation), a field the schema does
not declare is an error unless the node preserves unknown fields, and ``x-kubernetes-list-type: set`` means unique
items. CEL rules are tests/contracts/test_crd.py's.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from openapi_schema_validator import OAS30Validator

from charting import ROOT, render

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def strict(schema: Any) -> Any:
    """The schema with undeclared fields refused and list-type sets unique, as the API server applies it."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        if schema.get("x-kubernetes-list-type") == "set":
            out["uniqueItems"] = True
        return out
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    return schema


def validator() -> OAS30Validator:
    (version,) = render().one("CustomResourceDefinition")["spec"]["versions"]
    return OAS30Validator(strict(version["schema"]["openAPIV3Schema"]))


def errors(doc: dict[str, Any]) -> list[str]:
    # metadata is the API server's (ObjectMeta), not the CRD's
    body = {k: v for k, v in doc.items() if k != "metadata"}
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator().iter_errors(body)]


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: Path(p).stem)
def test_every_example_is_valid_against_the_installed_crd(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "meshscope.io/v1alpha1"
    assert doc["kind"] == "TrainingJob"
    assert errors(doc) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: d["spec"]["parallelism"].update(tp=0), "spec.parallelism.tp: 0 is less than the minimum of 1"),
        (lambda d: d["spec"]["parallelism"].update(tp="8"), "spec.parallelism.tp: '8' is not of type 'integer'"),
        (lambda d: d["spec"].update(parallelizm={}), "spec: Additional properties are not allowed ('parallelizm'"),
        (lambda d: d["spec"]["model"].update(preset=None), "spec.model.preset: None is not of type 'string'"),
    ],
    ids=["tp-zero", "tp-string", "misspelt-section", "null-preset"],
)
def test_a_broken_example_is_refused_with_the_path(change: Any, expected: str) -> None:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "llama3-8b-h100.yaml").read_text()))
    change(doc)
    found = errors(doc)
    assert any(e.startswith(expected) for e in found), found

"""The TrainingJob CRD: well-formed, examples valid against its schema, and mirrored exactly by meshscope.jobs.loading.

The schema is checked with a real JSON-schema validator (jsonschema's Draft 2020-12; the CRD uses no OpenAPI-only
keywords). Two things the API server does that a validator does not are emulated here: unknown fields are errors
(``kubectl apply --validate=strict``, the default), and ``x-kubernetes-list-type: set`` means unique items. CEL rules
are evaluated with cel-python when it is installed.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema
import pytest
import yaml

from meshscope.errors import SpecError
from meshscope.jobs import loading
from meshscope.jobs.loading import BOUNDS, SECTION_KEYS, spec_from_manifest
from meshscope.jobs.models import PRESETS, Activation, Norm, PositionEmbedding
from meshscope.jobs.spec import AttentionImpl, CpCommType, PipelineSchedule, Precision, Recompute
from meshscope.topology.hardware import CATALOGUE
from meshscope.topology.layout import parse_order

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "trainingjobs.meshscope.io.yaml"
CRD = yaml.safe_load(CRD_PATH.read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = SCHEMA["properties"]["spec"]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def strict(schema: Any) -> Any:
    """The schema as the API server applies it: undeclared fields rejected, list-type sets unique."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items() if k != "properties"}
        if "properties" in schema:
            out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
            if not schema.get("x-kubernetes-preserve-unknown-fields"):
                out["additionalProperties"] = False
        if schema.get("x-kubernetes-list-type") == "set":
            out["uniqueItems"] = True
        return out
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    return schema


VALIDATOR = jsonschema.Draft202012Validator(strict(SCHEMA))


def schema_errors(doc: Any) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(doc)]


def nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node with its dotted path (list items as ``path[]``)."""
    yield path, schema
    for key, child in schema.get("properties", {}).items():
        yield from nodes(child, f"{path}.{key}" if path else key)
    if "items" in schema:
        yield from nodes(schema["items"], f"{path}[]")


def section(path: str) -> dict[str, Any]:
    """The schema node of a dotted spec path such as ``spec.model.moe``."""
    node = SCHEMA
    for key in path.split("."):
        node = node["properties"][key]
    return node


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())


# ---------------------------------------------------------------------------------------------------- well-formed


def test_crd_identity() -> None:
    assert CRD["apiVersion"] == "apiextensions.k8s.io/v1"
    assert CRD["kind"] == "CustomResourceDefinition"
    spec = CRD["spec"]
    assert spec["group"] == "meshscope.io"
    assert spec["scope"] == "Namespaced"
    names = spec["names"]
    assert (names["kind"], names["plural"], names["singular"]) == ("TrainingJob", "trainingjobs", "trainingjob")
    assert "tj" in names["shortNames"]
    assert CRD["metadata"]["name"] == f"{names['plural']}.{spec['group']}"
    assert [v["name"] for v in spec["versions"]] == ["v1alpha1"]
    assert VERSION["served"] is True
    assert VERSION["storage"] is True
    assert f"{spec['group']}/{VERSION['name']}" == loading.API_VERSION
    assert names["kind"] == loading.KIND


def test_status_subresource() -> None:
    assert VERSION["subresources"]["status"] == {}
    assert "status" in SCHEMA["properties"]


def test_printer_columns_point_at_declared_fields() -> None:
    columns = {c["name"]: c for c in VERSION["additionalPrinterColumns"]}
    assert list(columns) == ["Layout", "World", "Phase", "Step", "Top cost", "Findings", "Age"]
    assert columns["Age"] == {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    declared = {f".{path}": node for path, node in nodes(SCHEMA)}
    for name, column in columns.items():
        if name == "Age":
            continue
        node = declared[column["jsonPath"]]
        assert column["jsonPath"].startswith(".status."), name
        assert node["type"] == column["type"], name


def test_schema_is_a_valid_json_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_schema_is_structural() -> None:
    """A few of the API server's structural-schema rules, plus meshscope's own conventions."""
    for path, node in nodes(SCHEMA):
        if path in {"", "metadata"} or node.get("x-kubernetes-preserve-unknown-fields"):
            assert node.get("type") == "object", path
            continue
        assert "type" in node, f"{path}: every node needs a type"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert "default" not in node, f"{path}: defaults belong in meshscope.jobs.loading, not the CRD"
        assert not node.get("uniqueItems"), f"{path}: use x-kubernetes-list-type: set"
        if node["type"] == "array":
            assert "maxItems" in node, f"{path}: bounded lists keep the object small and CEL costs estimable"
        if node["type"] == "object":
            assert "properties" in node, f"{path}: an object with no declared fields would be pruned"
        for rule in node.get("x-kubernetes-validations", []):
            assert set(rule) == {"rule", "message"}, path


def test_status_fields_are_bounded() -> None:
    status = SCHEMA["properties"]["status"]["properties"]
    assert {
        "phase",
        "observedGeneration",
        "conditions",
        "worldSize",
        "layout",
        "plan",
        "stepTimeSeconds",
        "topCost",
        "findings",
        "findingsList",
        "costTable",
        "costTableRef",
    } <= set(status)
    assert status["findingsList"]["maxItems"] == 20
    assert status["costTable"]["maxItems"] == 16
    assert set(status["costTable"]["items"]["properties"]) == {
        "category",
        "expectedSeconds",
        "measuredSeconds",
        "shareOfStep",
        "suspect",
    }
    assert set(status["findingsList"]["items"]["properties"]) == {"code", "severity", "message"}
    assert set(status["plan"]["properties"]) == {
        "peakMemoryBytesPerGpu",
        "headroomBytes",
        "expectedStepSeconds",
        "bubbleFraction",
        "flopsPerStep",
    }
    # FLOPs per step of a 405B model on 16M tokens (~4e19) overflow int64: it must be a float.
    assert status["plan"]["properties"]["flopsPerStep"]["type"] == "number"
    for path, node in nodes(SCHEMA["properties"]["status"], "status"):
        if node.get("type") == "string" and "enum" not in node and path != "status.conditions[].lastTransitionTime":
            assert "maxLength" in node, f"{path}: status strings must be bounded"


def test_a_full_status_validates_and_stays_small() -> None:
    doc = example("llama3-70b-h100")
    doc["status"] = {
        "phase": "Running",
        "observedGeneration": 3,
        "conditions": [
            {
                "type": "Planned",
                "status": "True",
                "observedGeneration": 3,
                "lastTransitionTime": "2025-01-01T00:00:00Z",
                "reason": "PlanFits",
                "message": "peak 61.2 GiB of 80 GiB",
            }
        ],
        "worldSize": 512,
        "layout": "dp16-tp8-pp4",
        "plan": {
            "peakMemoryBytesPerGpu": 65_000_000_000,
            "headroomBytes": -1_000,
            "expectedStepSeconds": 11.5,
            "bubbleFraction": 0.0188,
            "flopsPerStep": 4.1e19,
        },
        "stepTimeSeconds": 12.1,
        "topCost": "exposed comm dp",
        "findings": 25,
        "findingsList": [{"code": "bubble", "severity": "warning", "message": "x" * 1024}] * 20,
        "costTable": [
            {
                "category": "exposed comm tp",
                "expectedSeconds": 0.4,
                "measuredSeconds": 0.9,
                "shareOfStep": 0.07,
                "suspect": "s" * 256,
            }
        ]
        * 16,
        "costTableRef": "llama3-70b-h100-costs",
    }
    assert schema_errors(doc) == []
    # kubernetes-testing.md §9: the status must stay well under the 1.5 MiB object limit.
    assert len(yaml.safe_dump(doc["status"]).encode()) < 64 * 1024


# ---------------------------------------------------------------------------------------------------- examples


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_validates_against_the_schema(path: Path) -> None:
    assert schema_errors(yaml.safe_load(path.read_text())) == []


def with_value(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return out


INVALID = [
    ("negative-tp", "spec.parallelism.tp", -8, "less than the minimum"),
    ("zero-nodes", "spec.hardware.nodes", 0, "less than the minimum"),
    ("unknown-precision", "spec.training.precision", "fp4", "is not one of"),
    ("string-tp", "spec.parallelism.tp", "8", "is not of type 'integer'"),
    ("bool-tp", "spec.parallelism.tp", True, "is not of type 'integer'"),
    ("unknown-key", "spec.parallelism.tensorParallel", 8, "Additional properties"),
    ("unknown-gpu", "spec.hardware.gpu", "H900", "is not one of"),
    ("unknown-preset", "spec.model.preset", "llama4", "is not one of"),
    ("dropout-above-one", "spec.model.dropout", 2, "greater than the maximum"),
    ("bad-rank-order", "spec.parallelism.rankOrder", "tp-dp", "does not match"),
    ("zero-stage-4", "spec.training.zeroStage", 4, "greater than the maximum"),
    ("duplicate-source", "spec.monitoring.sources", ["dcgm", "dcgm"], "non-unique"),
    ("unknown-source", "spec.monitoring.sources", ["gpu"], "is not one of"),
    ("bad-label", "spec.topology.nvlinkDomainLabel", "not a label", "does not match"),
    ("too-many-findings", "status.findingsList", [{"code": "c", "severity": "info", "message": "m"}] * 21, "too long"),
]


@pytest.mark.parametrize(("path", "value", "expected"), [i[1:] for i in INVALID], ids=[i[0] for i in INVALID])
def test_invalid_manifests_are_rejected_by_the_schema(path: str, value: Any, expected: str) -> None:
    errors = schema_errors(with_value(example("llama3-70b-h100"), path, value))
    assert errors
    assert any(expected in e for e in errors), errors


@pytest.mark.parametrize("path", ["spec.hardware.nodes", "spec.training.globalBatchSize", "spec.model"], ids=str)
def test_required_fields(path: str) -> None:
    doc = example("llama3-70b-h100")
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node = node[key]
    del node[last]
    assert any("is a required property" in e for e in schema_errors(doc))


# ---------------------------------------------------------------------------------------------------- loader mirror


@pytest.mark.parametrize("path", sorted(SECTION_KEYS), ids=str)
def test_loader_allows_exactly_the_crd_keys(path: str) -> None:
    assert list(section(path)["properties"]) == list(SECTION_KEYS[path])


def numeric_nodes() -> dict[str, dict[str, Any]]:
    return {path: node for path, node in nodes(SPEC_SCHEMA, "spec") if node.get("type") in {"integer", "number"}}


def test_loader_bounds_equal_the_crd_bounds() -> None:
    crd = {path: (node["minimum"], node["maximum"]) for path, node in numeric_nodes().items()}
    assert crd == dict(BOUNDS)


@pytest.mark.parametrize("path", sorted(numeric_nodes()), ids=str)
def test_loader_agrees_on_whole_numbers(path: str) -> None:
    """A fractional value is a type error in the loader exactly where the CRD says integer."""
    lo, _ = BOUNDS[path]
    doc = with_value(example("deepseek-v3-h100"), path, lo + 0.5)
    try:
        spec_from_manifest(doc)
        type_error = False
    except SpecError as err:
        type_error = err.field == path and "whole number" in str(err)
    assert type_error == (numeric_nodes()[path]["type"] == "integer")


ENUMS = {
    "spec.model.preset": list(PRESETS),
    "spec.model.activation": [a.value for a in Activation],
    "spec.model.norm": [n.value for n in Norm],
    "spec.model.positionEmbedding": [p.value for p in PositionEmbedding],
    "spec.parallelism.cpCommType": [c.value for c in CpCommType],
    "spec.training.precision": [p.value for p in Precision],
    "spec.training.recompute": [r.value for r in Recompute],
    "spec.training.attention": [a.value for a in AttentionImpl],
    "spec.training.pipelineSchedule": [s.value for s in PipelineSchedule],
    "spec.training.gradReduceDtype": list(loading.GRAD_REDUCE_BYTES),
    "spec.hardware.gpu": list(CATALOGUE),
}


@pytest.mark.parametrize("path", sorted(ENUMS), ids=str)
def test_enums_match_the_code(path: str) -> None:
    assert section(path)["enum"] == ENUMS[path]


def test_monitoring_sources_enum() -> None:
    assert section("spec.monitoring.sources")["items"]["enum"] == list(loading.MONITORING_SOURCES)


def test_every_crd_enum_is_checked() -> None:
    enums = {path for path, node in nodes(SPEC_SCHEMA, "spec") if "enum" in node}
    assert enums == {*ENUMS, "spec.monitoring.sources[]"}


def test_required_keys_match_the_loader() -> None:
    assert SPEC_SCHEMA["required"] == ["model", "parallelism", "training", "hardware"]
    assert section("spec.hardware")["required"] == ["nodes"]
    assert section("spec.training")["required"] == ["globalBatchSize"]
    core_rule = section("spec.model")["x-kubernetes-validations"][0]["rule"]
    for key in loading.MODEL_CORE_KEYS:
        assert f"has(self.{key})" in core_rule
    peak_rule = section("spec.hardware")["x-kubernetes-validations"][0]["rule"]
    for key in loading.HARDWARE_PEAK_KEYS:
        assert f"has(self.{key})" in peak_rule


def test_moe_presets_named_in_the_ep_rule() -> None:
    rule = SPEC_SCHEMA["x-kubernetes-validations"][1]["rule"]
    moe_presets = [name for name, model in PRESETS.items() if model.moe is not None]
    assert f"[{', '.join(repr(p) for p in moe_presets)}]" in rule


def test_rank_order_pattern_accepts_what_the_loader_accepts() -> None:
    validator = jsonschema.Draft202012Validator(section("spec.parallelism.rankOrder"))
    for order in itertools.permutations(["tp", "cp", "ep", "dp", "pp"]):
        text = "-".join(order)
        assert validator.is_valid(text)
        parse_order(text)
    for text in ["tp-cp-ep-dp", "tp-cp-ep-dp-xx", "tp_cp_ep_dp_pp", ""]:
        assert not validator.is_valid(text)


@pytest.mark.parametrize(
    ("key", "ok"),
    [
        ("nvidia.com/gpu.clique", True),
        ("rack", True),
        ("network.topology.nvidia.com/leaf", True),
        ("a/b/c", False),
        ("Example.com/rack", False),
        ("not a label", False),
        ("example.com/", False),
        ("example.com/" + "x" * 64, False),
    ],
    ids=["gfd", "bare", "topograph", "two-slashes", "uppercase-prefix", "spaces", "empty-name", "long-name"],
)
def test_label_keys_agree(key: str, ok: bool) -> None:
    doc = with_value(example("llama3-70b-h100"), "spec.topology.nvlinkDomainLabel", key)
    schema_ok = not schema_errors(doc)
    try:
        spec_from_manifest(doc)
        loader_ok = True
    except SpecError:
        loader_ok = False
    # The schema has no per-segment length limit; the loader (like the API server's label validation) does.
    assert loader_ok == ok
    if ok:
        assert schema_ok


def test_docs_describe_every_field() -> None:
    docs = (ROOT / "docs" / "spec.md").read_text()
    for key in SECTION_KEYS["spec"]:
        assert f"## spec.{key}\n" in docs, f"docs/spec.md has no section for spec.{key}"
    for path, keys in SECTION_KEYS.items():
        for key in keys if path != "spec" else ():
            assert f"`{key}`" in docs, f"{path}.{key} is not in docs/spec.md"
    for key in SCHEMA["properties"]["status"]["properties"]:
        assert f"`{key}" in docs, f"status.{key} is not in docs/spec.md"


# ---------------------------------------------------------------------------------------------------- CEL


@pytest.fixture(scope="module")
def celpy() -> Any:
    return pytest.importorskip("celpy", reason="cel-python evaluates the CRD's x-kubernetes-validations")


def cel_rules() -> list[tuple[str, str]]:
    return [
        (path, rule["rule"])
        for path, node in nodes(SPEC_SCHEMA, "spec")
        for rule in node.get("x-kubernetes-validations", [])
    ]


def cel_failures(celpy: Any, doc: dict[str, Any]) -> list[str]:
    env = celpy.Environment()
    failed = []
    for path, rule in cel_rules():
        value: Any = doc
        for key in path.split("."):
            if not isinstance(value, dict) or key not in value:
                value = None
                break
            value = value[key]
        if value is None:
            continue
        result = env.program(env.compile(rule)).evaluate({"self": celpy.json_to_cel(value)})
        if isinstance(result, Exception) or not bool(result):
            failed.append(f"{path}: {rule}")
    return failed


def test_cel_rules_compile(celpy: Any) -> None:
    env = celpy.Environment()
    for _, rule in cel_rules():
        env.compile(rule)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_pass_the_cel_rules(celpy: Any, path: Path) -> None:
    assert cel_failures(celpy, yaml.safe_load(path.read_text())) == []


CEL_VIOLATIONS = [
    ("batch-below-micro-batch", {"spec.training.microBatchSize": 8, "spec.training.globalBatchSize": 4}),
    ("no-preset-no-core", {"spec.model": {"layers": 4}}),
    ("kv-heads", {"spec.model.kvHeads": 5, "spec.model.attentionHeads": 64}),
    ("top-k", {"spec.model.moe": {"experts": 8, "topK": 9, "expertFfnHiddenSize": 1}}),
    ("sp-without-tp", {"spec.parallelism.tp": 1, "spec.parallelism.sequenceParallel": True}),
    ("vpp-without-pp", {"spec.parallelism.pp": 1, "spec.parallelism.vpp": 2}),
    ("1f1b-with-vpp", {"spec.training.pipelineSchedule": "1f1b"}),
    ("ep-on-dense", {"spec.parallelism.ep": 8}),
    ("dist-opt-and-zero", {"spec.training.distributedOptimizer": True, "spec.training.zeroStage": 1}),
    ("no-gpu-no-peaks", {"spec.hardware": {"nodes": 8, "bf16Tflops": 900}}),
    ("domain-not-whole-nodes", {"spec.hardware.gpusPerNode": 8, "spec.hardware.nvlinkDomainGpus": 12}),
]


@pytest.mark.parametrize("changes", [c[1] for c in CEL_VIOLATIONS], ids=[c[0] for c in CEL_VIOLATIONS])
def test_cel_rules_reject_and_the_loader_agrees(celpy: Any, changes: dict[str, Any]) -> None:
    doc = example("llama3-70b-h100")  # vpp 5, dense model, H100
    for path, value in changes.items():
        doc = with_value(doc, path, value)
    assert cel_failures(celpy, doc)
    with pytest.raises(SpecError):
        spec_from_manifest(doc)

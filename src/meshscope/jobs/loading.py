"""Loading TrainingJob manifests: YAML text, a file or a dict in, a validated :class:`~meshscope.jobs.spec.JobSpec` out.

Why it exists: a TrainingJob reaches meshscope from three places (``meshscope plan FILE``, the operator's watch, the
validating webhook) and must mean the same thing in all three. This module is the one place that reads the wire
format of ``crds/trainingjobs.meshscope.io.yaml`` (camelCase), applies **every default** and checks **every rule**.

Two layers of checks:

* what the CRD's OpenAPI schema also says (types, ranges, enums, unknown keys, the CEL invariants), repeated here
  because local files never meet an API server. :data:`SECTION_KEYS` and :data:`BOUNDS` mirror the schema and
  ``tests/contracts/test_crd.py`` keeps them equal;
* the arithmetic a schema cannot express: degrees multiplying to the world size, heads/layers/FFN/batch
  divisibility, pipeline-schedule constraints, expert parallelism against the experts.

Every invalid input raises :class:`~meshscope.errors.SpecError` whose field is the dotted path
(``spec.parallelism.tp``) and whose message has the value and what would fit. Nothing else may escape for bad input:
no ``KeyError``, no ``TypeError``, no YAML traceback. This module must not import anything Kubernetes; the operator
hands it the object as a mapping.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import yaml

from meshscope.errors import LayoutError, SpecError
from meshscope.jobs.models import PRESETS, Activation, MLAConfig, ModelConfig, MoEConfig, Norm, PositionEmbedding
from meshscope.jobs.spec import (
    AttentionImpl,
    CpCommType,
    JobSpec,
    MonitoringConfig,
    ParallelismConfig,
    PipelineSchedule,
    Precision,
    Recompute,
    TopologyConfig,
    TrainingConfig,
)
from meshscope.jobs.validation import (
    check_batch,
    check_context_parallel,
    check_cp_comm_type,
    check_experts,
    check_ffn,
    check_heads,
    check_pipeline_split,
    divisors_text,
    nearest_multiples,
)
from meshscope.topology import (
    CATALOGUE,
    DEFAULT_ORDER,
    GB,
    TFLOPS,
    GiB,
    GpuSpec,
    HardwareConfig,
    ParallelLayout,
    parse_order,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from enum import StrEnum

API_VERSION: Final = "meshscope.io/v1alpha1"
"""``apiVersion`` of a TrainingJob."""
KIND: Final = "TrainingJob"
"""``kind`` of a TrainingJob."""

TOP_LEVEL_KEYS: Final = ("apiVersion", "kind", "metadata", "spec", "status")
"""Keys allowed at the top of a manifest (``status`` is accepted and ignored, as in ``kubectl get -o yaml``)."""


def _keys(names: str) -> tuple[str, ...]:
    return tuple(names.split())


SECTION_KEYS: Final[Mapping[str, tuple[str, ...]]] = {
    "spec": ("model", "parallelism", "training", "hardware", "topology", "template", "monitoring"),
    "spec.model": _keys(
        "preset layers hiddenSize attentionHeads kvHeads headDim ffnHiddenSize vocabSize seqLength activation norm "
        "positionEmbedding dropout tiedEmbeddings linearBias moe mla"
    ),
    "spec.model.moe": ("experts", "topK", "expertFfnHiddenSize", "sharedExperts", "denseLayers", "routerBias"),
    "spec.model.mla": ("qLoraRank", "kvLoraRank", "qkHeadDim", "qkRopeHeadDim", "vHeadDim"),
    "spec.parallelism": _keys(
        "dp tp pp cp ep etp vpp sequenceParallel cpCommType rankOrder accountForEmbeddingInPipelineSplit "
        "accountForLossInPipelineSplit"
    ),
    "spec.training": _keys(
        "microBatchSize globalBatchSize precision recompute attention distributedOptimizer zeroStage dpShard "
        "pipelineSchedule gradReduceDtype overlapGradReduce overlapParamGather tpCommOverlap fp8ParamGather"
    ),
    "spec.hardware": _keys(
        "gpu bf16Tflops fp8Tflops hbmGiB hbmBandwidthGBps nvlinkGBpsPerDirection nicGbpsPerGpu nodes gpusPerNode "
        "nvlinkDomainGpus nodesPerNetworkBlock reservedGiB"
    ),
    "spec.topology": ("nvlinkDomainLabel", "networkTierLabels"),
    "spec.monitoring": ("enabled", "scrapeIntervalSeconds", "sources"),
}
"""Allowed keys of every section of ``spec`` (``template`` is free-form: a pod template)."""

_DEGREE = (1, 2**20)
_WIDTH = (1, 2**16)
BOUNDS: Final[Mapping[str, tuple[int, int]]] = {
    "spec.model.layers": (1, 4096),
    "spec.model.hiddenSize": (1, 2**20),
    "spec.model.attentionHeads": _WIDTH,
    "spec.model.kvHeads": _WIDTH,
    "spec.model.headDim": _WIDTH,
    "spec.model.ffnHiddenSize": (1, 2**22),
    "spec.model.vocabSize": (1, 2**24),
    "spec.model.seqLength": (1, 2**24),
    "spec.model.dropout": (0, 1),
    "spec.model.moe.experts": _WIDTH,
    "spec.model.moe.topK": (1, 1024),
    "spec.model.moe.expertFfnHiddenSize": (1, 2**22),
    "spec.model.moe.sharedExperts": (0, 1024),
    "spec.model.moe.denseLayers": (0, 4096),
    "spec.model.mla.qLoraRank": (0, 2**16),
    "spec.model.mla.kvLoraRank": _WIDTH,
    "spec.model.mla.qkHeadDim": _WIDTH,
    "spec.model.mla.qkRopeHeadDim": _WIDTH,
    "spec.model.mla.vHeadDim": _WIDTH,
    "spec.parallelism.dp": _DEGREE,
    "spec.parallelism.tp": _DEGREE,
    "spec.parallelism.pp": _DEGREE,
    "spec.parallelism.cp": _DEGREE,
    "spec.parallelism.ep": _DEGREE,
    "spec.parallelism.etp": _DEGREE,
    "spec.parallelism.vpp": _DEGREE,
    "spec.training.microBatchSize": (1, 2**16),
    "spec.training.globalBatchSize": (1, 2**24),
    "spec.training.zeroStage": (0, 3),
    "spec.training.dpShard": _DEGREE,
    "spec.hardware.bf16Tflops": (1, 10**6),
    "spec.hardware.fp8Tflops": (1, 10**6),
    "spec.hardware.hbmGiB": (1, 2**16),
    "spec.hardware.hbmBandwidthGBps": (1, 10**6),
    "spec.hardware.nvlinkGBpsPerDirection": (1, 10**6),
    "spec.hardware.nicGbpsPerGpu": (1, 10**6),
    "spec.hardware.nodes": _DEGREE,
    "spec.hardware.gpusPerNode": (1, 1024),
    "spec.hardware.nvlinkDomainGpus": _DEGREE,
    "spec.hardware.nodesPerNetworkBlock": _DEGREE,
    "spec.hardware.reservedGiB": (0, 2**16),
    "spec.monitoring.scrapeIntervalSeconds": (1, 3600),
}
"""Inclusive ``(minimum, maximum)`` of every numeric field, equal to the CRD's ``minimum``/``maximum``."""

MODEL_CORE_KEYS: Final = ("layers", "hiddenSize", "attentionHeads", "ffnHiddenSize", "vocabSize", "seqLength")
"""Model fields required when no preset is named."""
HARDWARE_PEAK_KEYS: Final = (
    "bf16Tflops",
    "hbmGiB",
    "hbmBandwidthGBps",
    "nvlinkGBpsPerDirection",
    "nicGbpsPerGpu",
    "gpusPerNode",
)
"""Hardware fields required when no catalogue GPU is named (``fp8Tflops`` absent means no FP8 tensor cores)."""
MONITORING_SOURCES: Final = ("train", "dcgm", "nccl", "infiniband")
"""Telemetry sources the sidecar knows."""
GRAD_REDUCE_BYTES: Final[Mapping[str, int]] = {"fp32": 4, "bf16": 2}
"""``training.gradReduceDtype`` -> bytes per gradient element in the data-parallel reduction."""

# Megatron-style names people type out of habit -> the key meant.
_HINTS: Final[Mapping[str, str]] = {
    "tensorparallel": "tp",
    "tensormodelparallelsize": "tp",
    "pipelineparallel": "pp",
    "pipelinemodelparallelsize": "pp",
    "dataparallel": "dp",
    "contextparallel": "cp",
    "contextparallelsize": "cp",
    "expertparallel": "ep",
    "expertmodelparallelsize": "ep",
    "experttensorparallel": "etp",
    "virtualpipeline": "vpp",
    "virtualpipelinemodelparallelsize": "vpp",
    "numlayers": "layers",
    "numattentionheads": "attentionHeads",
    "numquerygroups": "kvHeads",
    "seqlen": "seqLength",
    "numexperts": "experts",
}

_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

_E = TypeVar("_E", bound="StrEnum")


# ==================================================================================================== entry points


def load_spec(source: str | Path) -> JobSpec:
    """Load a TrainingJob from a YAML file, or from YAML text.

    Args:
        source: a path (``str`` or :class:`~pathlib.Path`), or YAML text; a ``str`` containing a newline is text.

    Returns:
        The validated spec, defaults applied.

    Raises:
        SpecError: if the file cannot be read, does not parse, or the manifest is invalid.
    """
    if isinstance(source, str) and "\n" in source:
        return load_spec_text(source)
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, or a NUL byte in the path (from a scenario file)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SpecError("", f"{path}: cannot read the TrainingJob file: {reason}") from None
    return load_spec_text(text, origin=str(path))


def load_spec_text(text: str, *, origin: str = "<text>") -> JobSpec:
    """Parse YAML text holding one TrainingJob manifest.

    Args:
        text: the YAML document.
        origin: where the text came from, used in parse errors (a file name).

    Returns:
        The validated spec, defaults applied.

    Raises:
        SpecError: if the YAML does not parse (the message has the line and column) or the manifest is invalid.
    """
    document = _parse_yaml(text, origin=origin)
    if document is None:
        raise SpecError("", f"{origin}: empty document; expected a TrainingJob manifest")
    if not isinstance(document, Mapping):
        raise SpecError("", f"{origin}: expected a TrainingJob manifest (a mapping), got {_show(document)}")
    return spec_from_manifest(document)


def _parse_yaml(text: str, *, origin: str) -> object:
    """YAML text -> Python data with the strict loader; every parse failure a :class:`SpecError` with its place."""
    try:
        document = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - _StrictLoader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{origin}:{mark.line + 1}:{mark.column + 1}" if mark is not None else origin
        problem = exc.problem or "unreadable YAML"
        if exc.context:
            problem += f" ({exc.context})"
        raise SpecError("", f"{where}: YAML does not parse: {problem}") from None
    except yaml.YAMLError as exc:
        raise SpecError("", f"{origin}: YAML does not parse: {exc}") from None
    except (ValueError, RecursionError) as exc:
        # int() of a number too long to convert, or nesting deeper than the parser's recursion allows.
        raise SpecError("", f"{origin}: YAML does not parse: {type(exc).__name__}: {exc}") from None
    return document


def load_yaml_mapping(source: str | Path) -> dict[str, object]:
    """Read a YAML file holding one mapping (a ``meshscope plan --assumptions`` file) with the spec's strict parser.

    Args:
        source: the file.

    Returns:
        The mapping (an empty file is an empty mapping).

    Raises:
        SpecError: if the file cannot be read, does not parse (duplicate keys included), or is not a mapping.
    """
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SpecError("", f"{path}: cannot read the file: {reason}") from None
    document = _parse_yaml(text, origin=str(path))
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise SpecError("", f"{path}: expected a mapping of names to values, got {_show(document)}")
    return document


def spec_from_manifest(manifest: Mapping[str, object]) -> JobSpec:
    """Build a :class:`JobSpec` from a whole TrainingJob object, as a user would ``kubectl apply`` it.

    Args:
        manifest: ``{"apiVersion": "meshscope.io/v1alpha1", "kind": "TrainingJob", "metadata": {...},
            "spec": {...}}``; a ``status`` is ignored.

    Returns:
        The validated spec, with every default applied.

    Raises:
        SpecError: naming the field, the value and what would fit, for any invalid input.
    """
    if not isinstance(manifest, Mapping):
        raise SpecError("", f"expected a TrainingJob manifest (a mapping), got {_show(manifest)}")
    _check_keys("", manifest, TOP_LEVEL_KEYS)
    api_version, kind = manifest.get("apiVersion"), manifest.get("kind")
    if api_version != API_VERSION:
        raise SpecError("apiVersion", f"expected {API_VERSION!r}, got {_show(api_version)}")
    if kind != KIND:
        raise SpecError("kind", f"expected {KIND!r}, got {_show(kind)}")
    name, namespace = _metadata(manifest.get("metadata"))
    if "spec" not in manifest:
        raise SpecError("spec", "required: the TrainingJob has no spec")
    spec = _Section("spec", manifest["spec"])
    return _job_spec(spec, name=name, namespace=namespace)


# ==================================================================================================== YAML


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that rejects duplicate keys (PyYAML keeps the last one silently; kubectl rejects them)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[object, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # '<<: *anchor': merged keys may be overridden, that is the point of a merge
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:
            continue  # unhashable key: construct_mapping below reports it with its position
        if first is None:
            seen[key] = key_node.start_mark.line
        else:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping",
                node.start_mark,
                f"duplicate key {key!r} (first given on line {first + 1})",
                key_node.start_mark,
            )
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


# ==================================================================================================== sections


class _Section:
    """One mapping of the manifest with its dotted path, and typed getters that raise :class:`SpecError`.

    Getters return ``None`` for an absent key; a key given as ``null`` is a type error (it says nothing).
    """

    __slots__ = ("_data", "path")

    def __init__(self, path: str, value: object) -> None:
        if not isinstance(value, Mapping):
            raise SpecError(path, f"expected a mapping of keys to values, got {_show(value)}")
        _check_keys(path, value, SECTION_KEYS[path])
        self.path = path
        self._data: Mapping[str, object] = value

    def field(self, key: str) -> str:
        """Dotted path of ``key``."""
        return f"{self.path}.{key}"

    def has(self, key: str) -> bool:
        """Whether ``key`` is given."""
        return key in self._data

    def _value(self, key: str) -> object:
        # Reading an undeclared key is a bug here, not bad input.
        assert key in SECTION_KEYS[self.path], f"{self.field(key)} is not declared in SECTION_KEYS"
        return self._data[key]

    def integer(self, key: str) -> int | None:
        """A whole number within :data:`BOUNDS`."""
        if key not in self._data:
            return None
        value = self._value(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(self.field(key), f"expected a whole number, got {_show(value)}")
        lo, hi = BOUNDS[self.field(key)]
        if not lo <= value <= hi:
            raise SpecError(self.field(key), f"{_show(value)} is out of range; use a whole number from {lo} to {hi}")
        return value

    def number(self, key: str) -> float | None:
        """A finite number (whole or not) within :data:`BOUNDS`."""
        if key not in self._data:
            return None
        value = self._value(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SpecError(self.field(key), f"expected a number, got {_show(value)}")
        lo, hi = BOUNDS[self.field(key)]
        if not lo <= value <= hi:  # NaN fails this too
            raise SpecError(self.field(key), f"{_show(value)} is out of range; use a number from {lo} to {hi}")
        return float(value)

    def boolean(self, key: str) -> bool | None:
        """``true`` or ``false``."""
        if key not in self._data:
            return None
        value = self._value(key)
        if not isinstance(value, bool):
            raise SpecError(self.field(key), f"expected true or false, got {_show(value)}")
        return value

    def string(self, key: str) -> str | None:
        """A string."""
        if key not in self._data:
            return None
        value = self._value(key)
        if not isinstance(value, str):
            raise SpecError(self.field(key), f"expected a string, got {_show(value)}")
        return value

    def choice(self, key: str, choices: Sequence[str]) -> str | None:
        """One of ``choices``, spelt exactly (as the CRD's ``enum`` requires)."""
        value = self.string(key)
        if value is None or value in choices:
            return value
        near = [c for c in choices if c.lower() == value.strip().lower()]
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise SpecError(self.field(key), f"unknown value {value!r}; {hint}use one of {', '.join(choices)}")

    def enum(self, key: str, enum_type: type[_E]) -> _E | None:
        """A member of a string enum, by value."""
        value = self.choice(key, [member.value for member in enum_type])
        return None if value is None else enum_type(value)

    def strings(self, key: str, *, max_items: int, choices: Sequence[str] | None = None) -> tuple[str, ...] | None:
        """A list of distinct strings (each one of ``choices`` when given)."""
        if key not in self._data:
            return None
        value = self._value(key)
        if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
            raise SpecError(self.field(key), f"expected a list of strings, got {_show(value)}")
        if len(value) > max_items:
            raise SpecError(self.field(key), f"{len(value)} items given; at most {max_items} are allowed")
        items: list[str] = []
        for i, item in enumerate(value):
            where = f"{self.field(key)}[{i}]"
            if not isinstance(item, str):
                raise SpecError(where, f"expected a string, got {_show(item)}")
            if choices is not None and item not in choices:
                raise SpecError(where, f"unknown value {item!r}; use one of {', '.join(choices)}")
            if item in items:
                raise SpecError(where, f"{item!r} is listed twice")
            items.append(item)
        return tuple(items)

    def raw(self, key: str) -> object:
        """The value of ``key`` as given (``None`` when absent), for free-form fields such as the pod template."""
        return self._value(key) if key in self._data else None

    def section(self, key: str) -> _Section | None:
        """A nested section."""
        if key not in self._data:
            return None
        return _Section(self.field(key), self._value(key))


def _check_keys(path: str, data: Mapping[Any, object], allowed: Sequence[str]) -> None:
    where = path or "the manifest"
    for key in data:
        if not isinstance(key, str):
            raise SpecError(path, f"key {_show(key)} in {where} is not a string; allowed keys: {', '.join(allowed)}")
        if key not in allowed:
            field = f"{path}.{key}" if path else key
            raise SpecError(field, f"unknown key {key!r} in {where}; {_suggest(key, allowed)}")


def _suggest(key: str, allowed: Sequence[str]) -> str:
    hinted = _HINTS.get(key.replace("_", "").replace("-", "").lower())
    near = [hinted] if hinted in allowed else difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    lowered = [a for a in allowed if a.lower() == key.lower()]
    guess = lowered or near
    did_you_mean = f"did you mean {guess[0]!r}? " if guess else ""
    return f"{did_you_mean}allowed keys: {', '.join(allowed)}"


def _show(value: object) -> str:
    """A value for an error message, with its YAML type when that is what is wrong."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = f"{str(value).lower()} (a boolean)"
    elif isinstance(value, int):
        # str() of a number with more than 4300 digits raises; nobody needs to read it anyway.
        text = repr(value) if value.bit_length() <= 128 else f"a {value.bit_length()}-bit number"
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, str):
        text = f"{value if len(value) <= 60 else value[:57] + '...'!r} (a string)"
    elif isinstance(value, Mapping):
        text = "a mapping"
    elif isinstance(value, list | tuple):
        text = "a list"
    else:
        text = f"a {type(value).__name__}"
    return text


def _metadata(value: object) -> tuple[str, str]:
    if not isinstance(value, Mapping):
        raise SpecError("metadata", f"expected a mapping with at least a name, got {_show(value)}")
    name, namespace = value.get("name"), value.get("namespace", "default")
    if not isinstance(name, str) or not name:
        raise SpecError("metadata.name", f"required: a lowercase DNS name such as 'llama3-70b', got {_show(name)}")
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        raise SpecError(
            "metadata.name",
            f"{name!r} is not a DNS subdomain name: at most 253 lowercase letters, digits, '-' and '.', "
            f"starting and ending with a letter or digit",
        )
    if not isinstance(namespace, str) or len(namespace) > 63 or not _DNS_LABEL.match(namespace):
        raise SpecError(
            "metadata.namespace", f"{_show(namespace)} is not a namespace name (a DNS label of at most 63 characters)"
        )
    return name, namespace


# ==================================================================================================== the spec


def _job_spec(spec: _Section, *, name: str, namespace: str) -> JobSpec:
    model = _model(_required_section(spec, "model"))
    hardware = _hardware(_required_section(spec, "hardware"))
    parallelism = _parallelism(_required_section(spec, "parallelism"), hardware)
    check_heads(model, parallelism.layout)
    check_ffn(model, parallelism.layout)
    check_context_parallel(model, parallelism.layout)
    check_cp_comm_type(model, parallelism)
    check_experts(model, parallelism.layout)
    check_pipeline_split(model, parallelism)
    training = _training(_required_section(spec, "training"), parallelism)
    template = spec.raw("template")
    if template is not None and not isinstance(template, Mapping):
        raise SpecError("spec.template", f"expected a pod template (a mapping), got {_show(template)}")
    return JobSpec(
        name=name,
        namespace=namespace,
        model=model,
        parallelism=parallelism,
        training=training,
        hardware=hardware,
        topology=_topology(spec.section("topology")),
        monitoring=_monitoring(spec.section("monitoring")),
    )


def _required_section(parent: _Section, key: str) -> _Section:
    section = parent.section(key)
    if section is None:
        raise SpecError(parent.field(key), f"required: {parent.path} has no {key}")
    return section


def _missing(section: _Section, keys: Iterable[str]) -> list[str]:
    return [key for key in keys if not section.has(key)]


# ---------------------------------------------------------------------------------------------------- model

_MODEL_INTS: Final[Mapping[str, str]] = {
    "layers": "layers",
    "hiddenSize": "hidden_size",
    "attentionHeads": "attention_heads",
    "kvHeads": "kv_heads",
    "headDim": "head_dim",
    "ffnHiddenSize": "ffn_hidden_size",
    "vocabSize": "vocab_size",
    "seqLength": "seq_length",
}
_MOE_INTS: Final[Mapping[str, str]] = {
    "experts": "experts",
    "topK": "top_k",
    "expertFfnHiddenSize": "expert_ffn_hidden_size",
    "sharedExperts": "shared_experts",
    "denseLayers": "dense_layers",
}
_MOE_REQUIRED: Final = ("experts", "topK", "expertFfnHiddenSize")
_MLA_INTS: Final[Mapping[str, str]] = {
    "qLoraRank": "q_lora_rank",
    "kvLoraRank": "kv_lora_rank",
    "qkHeadDim": "qk_head_dim",
    "qkRopeHeadDim": "qk_rope_head_dim",
    "vHeadDim": "v_head_dim",
}
_MLA_REQUIRED: Final = ("kvLoraRank", "qkHeadDim", "qkRopeHeadDim", "vHeadDim")


def _ints(section: _Section, keys: Mapping[str, str]) -> dict[str, int]:
    """The given whole-number fields of ``section``, by their snake_case dataclass names."""
    return {snake: value for camel, snake in keys.items() if (value := section.integer(camel)) is not None}


def _model(sec: _Section) -> ModelConfig:
    preset = sec.choice("preset", tuple(PRESETS))
    changes: dict[str, Any] = _ints(sec, _MODEL_INTS)
    if preset is not None:
        base = PRESETS[preset]
    else:
        missing = _missing(sec, MODEL_CORE_KEYS)
        if missing:
            raise SpecError(
                "spec.model",
                f"give a preset ({', '.join(PRESETS)}) or all of {', '.join(MODEL_CORE_KEYS)}; "
                f"missing: {', '.join(missing)}",
            )
        base = ModelConfig(
            name="custom",
            layers=changes["layers"],
            hidden_size=changes["hidden_size"],
            attention_heads=changes["attention_heads"],
            ffn_hidden_size=changes["ffn_hidden_size"],
            vocab_size=changes["vocab_size"],
            seq_length=changes["seq_length"],
        )
    for key, attr, enum_type in (
        ("activation", "activation", Activation),
        ("norm", "norm", Norm),
        ("positionEmbedding", "position_embedding", PositionEmbedding),
    ):
        if (member := sec.enum(key, enum_type)) is not None:
            changes[attr] = member
    for key, attr in (("tiedEmbeddings", "tied_embeddings"), ("linearBias", "linear_bias")):
        if (flag := sec.boolean(key)) is not None:
            changes[attr] = flag
    if (dropout := sec.number("dropout")) is not None:
        changes["dropout"] = dropout
    changes["moe"] = _moe(sec.section("moe"), base.moe)
    changes["mla"] = _mla(sec.section("mla"), base.mla)
    return _resolve_model(replace(base, **changes))


def _moe(sec: _Section | None, base: MoEConfig | None) -> MoEConfig | None:
    if sec is None:
        return base
    changes: dict[str, Any] = _ints(sec, _MOE_INTS)
    if (router_bias := sec.boolean("routerBias")) is not None:
        changes["router_bias"] = router_bias
    if base is None:
        missing = _missing(sec, _MOE_REQUIRED)
        if missing:
            raise SpecError(
                "spec.model.moe",
                f"a model without experts needs all of {', '.join(_MOE_REQUIRED)} to add them; "
                f"missing: {', '.join(missing)}",
            )
        base = MoEConfig(
            experts=changes["experts"], top_k=changes["top_k"], expert_ffn_hidden_size=changes["expert_ffn_hidden_size"]
        )
    moe: MoEConfig = replace(base, **changes)
    if moe.top_k > moe.experts:
        raise SpecError(
            "spec.model.moe.topK",
            f"model.moe.topK ({moe.top_k}) exceeds model.moe.experts ({moe.experts}); use topK <= {moe.experts}",
        )
    return moe


def _mla(sec: _Section | None, base: MLAConfig | None) -> MLAConfig | None:
    if sec is None:
        return base
    changes: dict[str, Any] = _ints(sec, _MLA_INTS)
    if changes.get("q_lora_rank") == 0:
        changes["q_lora_rank"] = None  # 0 means queries are projected directly
    if base is None:
        missing = _missing(sec, _MLA_REQUIRED)
        if missing:
            raise SpecError(
                "spec.model.mla",
                f"a model without latent attention needs all of {', '.join(_MLA_REQUIRED)} to add it; "
                f"missing: {', '.join(missing)}",
            )
        base = MLAConfig(
            q_lora_rank=None,
            kv_lora_rank=changes["kv_lora_rank"],
            qk_head_dim=changes["qk_head_dim"],
            qk_rope_head_dim=changes["qk_rope_head_dim"],
            v_head_dim=changes["v_head_dim"],
        )
    mla: MLAConfig = replace(base, **changes)
    return mla


def _resolve_model(model: ModelConfig) -> ModelConfig:
    """Fill ``kv_heads`` and ``head_dim`` and check the model on its own."""
    heads, hidden = model.attention_heads, model.hidden_size
    kv_heads = heads if model.kv_heads is None else model.kv_heads
    if heads % kv_heads:
        raise SpecError(
            "spec.model.kvHeads",
            f"model.kvHeads ({kv_heads}) does not divide model.attentionHeads ({heads}); use one of "
            f"{divisors_text(heads)}",
        )
    head_dim = model.head_dim
    if head_dim is None and hidden % heads == 0:
        head_dim = hidden // heads
    elif head_dim is None and model.mla is None:
        raise SpecError(
            "spec.model.headDim",
            f"model.hiddenSize ({hidden}) is not divisible by model.attentionHeads ({heads}); give headDim "
            f"explicitly, or use attentionHeads among {divisors_text(hidden)}",
        )
    if model.moe is not None and model.moe.dense_layers >= model.layers:
        raise SpecError(
            "spec.model.moe.denseLayers",
            f"model.moe.denseLayers ({model.moe.dense_layers}) leaves no MoE layer out of model.layers "
            f"({model.layers}); use denseLayers < {model.layers}, or drop moe for a dense model",
        )
    return replace(model, kv_heads=kv_heads, head_dim=head_dim)


# ---------------------------------------------------------------------------------------------------- hardware

# spec key -> (GpuSpec attribute, factor to base units)
_GPU_NUMBERS: Final[Mapping[str, tuple[str, float]]] = {
    "bf16Tflops": ("bf16_flops_per_s", TFLOPS),
    "fp8Tflops": ("fp8_flops_per_s", TFLOPS),
    "hbmGiB": ("hbm_bytes", GiB),
    "hbmBandwidthGBps": ("hbm_bandwidth_bytes_per_s", GB),
    "nvlinkGBpsPerDirection": ("scaleup_bandwidth_bytes_per_s", GB),
    "nicGbpsPerGpu": ("nic_bandwidth_bytes_per_s", GB / 8),  # Gb/s (bits) -> bytes/s
}


def _hardware(sec: _Section) -> HardwareConfig:
    nodes = sec.integer("nodes")
    if nodes is None:
        raise SpecError("spec.hardware.nodes", "required: the number of nodes (NVL72 compute trays count as nodes)")
    gpu = _gpu(sec)
    reserved_gib = sec.number("reservedGiB")
    reserved_bytes = 0 if reserved_gib is None else round(reserved_gib * GiB)
    if reserved_bytes >= gpu.hbm_bytes:
        raise SpecError(
            "spec.hardware.reservedGiB",
            f"reservedGiB ({reserved_gib:g}) leaves no HBM: the GPU has {gpu.hbm_bytes / GiB:g} GiB; use less",
        )
    hardware = HardwareConfig(
        gpu=gpu,
        nodes=nodes,
        gpus_per_node=gpu.gpus_per_node,
        nvlink_domain_gpus=gpu.nvlink_domain_gpus,
        nic_bandwidth_bytes_per_s=gpu.nic_bandwidth_bytes_per_s,
        scaleup_bandwidth_bytes_per_s=gpu.scaleup_bandwidth_bytes_per_s,
        reserved_bytes=reserved_bytes,
    )
    if (block := sec.integer("nodesPerNetworkBlock")) is not None:
        hardware = replace(hardware, nodes_per_network_block=block)
    return hardware


def _gpu(sec: _Section) -> GpuSpec:
    """The catalogue GPU named by ``gpu`` with explicit numbers applied, or a custom GPU made of them."""
    name = sec.choice("gpu", tuple(CATALOGUE))
    if name is None:
        missing = _missing(sec, HARDWARE_PEAK_KEYS)
        if missing:
            raise SpecError(
                "spec.hardware",
                f"name a gpu ({', '.join(CATALOGUE)}) or give all of {', '.join(HARDWARE_PEAK_KEYS)}; "
                f"missing: {', '.join(missing)}",
            )
        base = GpuSpec(
            name="custom",
            bf16_flops_per_s=0.0,
            fp8_flops_per_s=None,
            hbm_bytes=0,
            hbm_bandwidth_bytes_per_s=0.0,
            scaleup_bandwidth_bytes_per_s=0.0,
            nvlink_domain_gpus=1,
            gpus_per_node=1,
            nic_bandwidth_bytes_per_s=0.0,
            source="spec.hardware (explicit numbers)",
        )
    else:
        base = CATALOGUE[name]
    changes: dict[str, Any] = {}
    for key, (attr, unit) in _GPU_NUMBERS.items():
        if (value := sec.number(key)) is not None:
            changes[attr] = round(value * unit) if attr == "hbm_bytes" else value * unit
    gpus_per_node = sec.integer("gpusPerNode")
    domain = sec.integer("nvlinkDomainGpus")
    if gpus_per_node is not None:
        changes["gpus_per_node"] = gpus_per_node
        if domain is None and base.nvlink_domain_gpus == base.gpus_per_node:
            domain = gpus_per_node  # the NVLink domain is the node (HGX-style): it follows the node's size
    if domain is not None:
        changes["nvlink_domain_gpus"] = domain
    if name is not None and changes:
        overridden = [key for key in (*_GPU_NUMBERS, "gpusPerNode", "nvlinkDomainGpus") if sec.has(key)]
        changes["source"] = f"{base.source}; overridden by spec.hardware: {', '.join(overridden)}"
    gpu: GpuSpec = replace(base, **changes)
    if gpu.nvlink_domain_gpus % gpu.gpus_per_node:
        raise SpecError(
            "spec.hardware.nvlinkDomainGpus",
            f"nvlinkDomainGpus ({gpu.nvlink_domain_gpus}) is not a multiple of gpusPerNode ({gpu.gpus_per_node}): "
            f"an NVLink domain is made of whole nodes; use "
            f"{nearest_multiples(gpu.nvlink_domain_gpus, gpu.gpus_per_node)}",
        )
    return gpu


# ---------------------------------------------------------------------------------------------------- parallelism


def _parallelism(sec: _Section, hardware: HardwareConfig) -> ParallelismConfig:
    tp, pp, cp = (sec.integer(axis) or 1 for axis in ("tp", "pp", "cp"))
    world = hardware.world_size
    machines = f"world size {world} ({hardware.nodes} nodes x {hardware.gpus_per_node} GPUs)"
    rest = tp * pp * cp
    dp = sec.integer("dp")
    if dp is None:
        if world % rest:
            raise SpecError(
                "spec.parallelism",
                f"tp*pp*cp = {tp}*{pp}*{cp} = {rest} does not divide the {machines}, so dp cannot take the "
                f"leftover ranks; make tp*pp*cp one of {divisors_text(world)}, or change hardware.nodes",
            )
        dp = world // rest
    elif dp * rest != world:
        fits = (
            f"with tp*pp*cp = {rest}, dp = {world // rest} fits (or leave dp out)"
            if world % rest == 0
            else f"tp*pp*cp = {rest} does not divide {world} either; change tp, pp, cp or hardware.nodes"
        )
        raise SpecError("spec.parallelism", f"dp({dp})*tp({tp})*pp({pp})*cp({cp}) = {dp * rest} != {machines}; {fits}")
    order_text = sec.string("rankOrder")
    try:
        order = DEFAULT_ORDER if order_text is None else parse_order(order_text)
    except LayoutError as exc:
        raise SpecError("spec.parallelism.rankOrder", str(exc)) from None
    try:
        layout = ParallelLayout(
            dp=dp,
            tp=tp,
            pp=pp,
            cp=cp,
            ep=sec.integer("ep") or 1,
            etp=sec.integer("etp"),
            vpp=sec.integer("vpp") or 1,
            order=order,
        )
    except LayoutError as exc:
        raise SpecError("spec.parallelism", str(exc)) from None
    sequence_parallel = bool(sec.boolean("sequenceParallel"))
    if sequence_parallel and tp == 1:
        raise SpecError(
            "spec.parallelism.sequenceParallel",
            "sequenceParallel shards activations over tensor-parallel ranks and needs tp > 1, but tp is 1; "
            "set tp or drop sequenceParallel",
        )
    config = ParallelismConfig(
        layout=layout,
        sequence_parallel=sequence_parallel,
        cp_comm_type=sec.enum("cpCommType", CpCommType) or CpCommType.P2P,
        account_for_embedding_in_pipeline_split=bool(sec.boolean("accountForEmbeddingInPipelineSplit")),
        account_for_loss_in_pipeline_split=bool(sec.boolean("accountForLossInPipelineSplit")),
    )
    if pp == 1 and (config.account_for_embedding_in_pipeline_split or config.account_for_loss_in_pipeline_split):
        raise SpecError(
            "spec.parallelism",
            "accountForEmbeddingInPipelineSplit / accountForLossInPipelineSplit change how layers are split over "
            "pipeline stages and need pp > 1, but pp is 1; drop them",
        )
    return config


# ---------------------------------------------------------------------------------------------------- training


def _training(sec: _Section, parallelism: ParallelismConfig) -> TrainingConfig:
    layout = parallelism.layout
    global_batch = sec.integer("globalBatchSize")
    if global_batch is None:
        raise SpecError("spec.training.globalBatchSize", "required: sequences per optimizer step over the whole job")
    micro_batch = sec.integer("microBatchSize") or 1
    schedule = _schedule(sec, layout)
    check_batch(global_batch, micro_batch, layout, schedule)
    changes: dict[str, Any] = {}
    for key, attr, enum_type in (
        ("precision", "precision", Precision),
        ("recompute", "recompute", Recompute),
        ("attention", "attention", AttentionImpl),
    ):
        if (member := sec.enum(key, enum_type)) is not None:
            changes[attr] = member
    for key, attr in (
        ("distributedOptimizer", "distributed_optimizer"),
        ("overlapGradReduce", "overlap_grad_reduce"),
        ("overlapParamGather", "overlap_param_gather"),
        ("tpCommOverlap", "tp_comm_overlap"),
        ("fp8ParamGather", "fp8_param_gather"),
    ):
        if (flag := sec.boolean(key)) is not None:
            changes[attr] = flag
    for key, attr in (("zeroStage", "zero_stage"), ("dpShard", "dp_shard")):
        if (number := sec.integer(key)) is not None:
            changes[attr] = number
    grad_dtype = sec.choice("gradReduceDtype", tuple(GRAD_REDUCE_BYTES)) or "fp32"
    training: TrainingConfig = replace(
        TrainingConfig(micro_batch_size=micro_batch, global_batch_size=global_batch, pipeline_schedule=schedule),
        grad_reduce_bytes=GRAD_REDUCE_BYTES[grad_dtype],
        **changes,
    )
    _check_training(training, parallelism)
    return training


def _check_training(training: TrainingConfig, parallelism: ParallelismConfig) -> None:
    """Settings of ``training`` that contradict each other or the parallelism."""
    if training.distributed_optimizer and training.zero_stage:
        raise SpecError(
            "spec.training.zeroStage",
            f"distributedOptimizer and zeroStage ({training.zero_stage}) both shard training state over dp; use "
            f"one of them (Megatron's distributed optimizer is ZeRO stage 1)",
        )
    _check_dp_shard(training, parallelism.layout.dp)
    if training.tp_comm_overlap and not parallelism.sequence_parallel:
        raise SpecError(
            "spec.training.tpCommOverlap",
            "tpCommOverlap overlaps the reduce-scatter/all-gather of sequence parallelism with GEMMs and needs "
            "parallelism.sequenceParallel (Megatron-core requires it); set sequenceParallel or drop tpCommOverlap",
        )
    if training.fp8_param_gather and training.precision is not Precision.FP8:
        raise SpecError(
            "spec.training.fp8ParamGather",
            f"fp8ParamGather keeps the GEMM weights in FP8 and needs precision: fp8, got precision: "
            f"{training.precision.value}; set precision: fp8 or drop fp8ParamGather",
        )


def _check_dp_shard(training: TrainingConfig, dp: int) -> None:
    """Hybrid sharding splits the sharded state over a part of dp: a divisor of dp, and something must be sharded."""
    shard = training.dp_shard
    if shard is None or shard == dp:
        return
    field = "spec.training.dpShard"
    if shard > dp or dp % shard:
        fits = ", ".join(str(d) for d in range(1, dp + 1) if dp % d == 0) if dp <= 4096 else "a divisor of dp"
        raise SpecError(
            field,
            f"dpShard ({shard}) is the number of data-parallel ranks the sharded state is split over and must "
            f"divide dp ({dp}); use one of {fits}",
        )
    if not training.zero_stage and not training.distributed_optimizer:
        raise SpecError(
            field,
            f"dpShard ({shard}) splits sharded training state over part of dp ({dp}), but nothing is sharded; set "
            f"zeroStage (1-3) or distributedOptimizer, or drop dpShard",
        )


def _schedule(sec: _Section, layout: ParallelLayout) -> PipelineSchedule:
    given = sec.enum("pipelineSchedule", PipelineSchedule)
    field = "spec.training.pipelineSchedule"
    if layout.vpp > 1:
        if given is None:
            return PipelineSchedule.INTERLEAVED
        if given is not PipelineSchedule.INTERLEAVED:
            raise SpecError(
                field,
                f"{given.value} cannot run virtual pipeline stages, but parallelism.vpp is {layout.vpp}; use "
                f"interleaved (or leave pipelineSchedule out), or set vpp to 1",
            )
        return given
    if given is PipelineSchedule.INTERLEAVED:
        raise SpecError(
            field,
            "interleaved needs virtual pipeline stages, but parallelism.vpp is 1; set vpp > 1 (with pp > 1) or use "
            "1f1b",
        )
    return PipelineSchedule.ONE_F_ONE_B if given is None else given


# ------------------------------------------------------------------------------------------ topology, monitoring


def _topology(sec: _Section | None) -> TopologyConfig:
    topology = TopologyConfig()
    if sec is None:
        return topology
    if (label := sec.string("nvlinkDomainLabel")) is not None:
        _check_label_key(sec.field("nvlinkDomainLabel"), label)
        topology = replace(topology, nvlink_domain_label=label)
    if (tiers := sec.strings("networkTierLabels", max_items=8)) is not None:
        for i, tier in enumerate(tiers):
            _check_label_key(f"{sec.field('networkTierLabels')}[{i}]", tier)
        topology = replace(topology, network_tier_labels=tiers)
    return topology


def _check_label_key(field: str, key: str) -> None:
    prefix, _, name = key.rpartition("/")
    if len(key) > 317 or len(prefix) > 253 or len(name) > 63 or not _LABEL_KEY.match(key):
        raise SpecError(
            field,
            f"{key!r} is not a node label key: an optional DNS prefix and '/', then at most 63 letters, digits, "
            f"'-', '_' or '.', e.g. 'nvidia.com/gpu.clique'",
        )


def _monitoring(sec: _Section | None) -> MonitoringConfig:
    monitoring = MonitoringConfig()
    if sec is None:
        return monitoring
    changes: dict[str, Any] = {}
    if (enabled := sec.boolean("enabled")) is not None:
        changes["enabled"] = enabled
    if (interval := sec.number("scrapeIntervalSeconds")) is not None:
        changes["scrape_interval_seconds"] = interval
    if (sources := sec.strings("sources", max_items=len(MONITORING_SOURCES), choices=MONITORING_SOURCES)) is not None:
        changes["sources"] = sources
    result: MonitoringConfig = replace(monitoring, **changes)
    return result


# ---------------------------------------------------------------------------------------------------- hints

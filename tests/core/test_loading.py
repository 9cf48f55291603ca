"""Loading TrainingJob manifests: every example loads, defaults, error messages, and fuzzing for stray exceptions."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshscope.errors import SpecError
from meshscope.jobs.loading import SECTION_KEYS, load_spec, load_spec_text, spec_from_manifest
from meshscope.jobs.models import PRESETS
from meshscope.jobs.spec import CpCommType, JobSpec, Precision, TopologyConfig
from meshscope.topology.hardware import CATALOGUE, GB, TFLOPS, GiB
from meshscope.topology.layout import DEFAULT_ORDER, parse_order

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
RAW_EXAMPLES = {p.stem: yaml.safe_load(p.read_text()) for p in EXAMPLES}


def manifest(**spec: Any) -> dict[str, Any]:
    """A TrainingJob around ``spec``; Llama 3 70B on 64 H100 nodes unless sections are given."""
    base: dict[str, Any] = {
        "model": {"preset": "llama3-70b"},
        "parallelism": {"tp": 8, "pp": 4},
        "training": {"microBatchSize": 1, "globalBatchSize": 512},
        "hardware": {"gpu": "H100", "nodes": 64},
    }
    base.update(spec)
    return {"apiVersion": "meshscope.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "job"}, "spec": base}


def with_value(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of ``doc`` with the dotted ``path`` set (missing mappings are created)."""
    out = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return out


def without(doc: dict[str, Any], path: str) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    del node[last]
    return out


def load_error(doc: Any) -> SpecError:
    with pytest.raises(SpecError) as info:
        spec_from_manifest(doc)
    return info.value


# ---------------------------------------------------------------------------------------------------- examples


def test_there_are_examples() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"llama3-405b-h100", "llama3-405b-gb200-nvl72", "mixtral-8x7b-h100", "bad-tp16-h100"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_loads_and_agrees_with_its_yaml(path: Path) -> None:
    raw = RAW_EXAMPLES[path.stem]
    spec = load_spec(path)
    assert isinstance(spec, JobSpec)
    assert spec.name == raw["metadata"]["name"] == path.stem
    assert spec.namespace == raw["metadata"].get("namespace", "default")
    assert path.read_text().startswith("# "), "each example opens with a comment saying what it shows"
    hardware = raw["spec"]["hardware"]
    gpus_per_node = hardware.get("gpusPerNode", CATALOGUE[hardware["gpu"]].gpus_per_node)
    assert spec.world_size == hardware["nodes"] * gpus_per_node
    for axis, degree in raw["spec"]["parallelism"].items():
        if axis in {"dp", "tp", "pp", "cp", "ep", "vpp"}:
            actual = spec.layout.vpp if axis == "vpp" else spec.layout.degree(axis)
            assert actual == degree, axis
    model_raw = raw["spec"]["model"]
    preset = PRESETS[model_raw["preset"]]
    assert spec.model.layers == model_raw.get("layers", preset.layers)
    assert spec.model.seq_length == model_raw.get("seqLength", preset.seq_length)


# Facts worked out by hand from each file (see their headers).
EXPECTED = {
    "llama3-8b-h100": {"world": 64, "dp": 32, "schedule": "1f1b", "m": 16},
    "llama3-70b-h100": {"world": 512, "dp": 16, "schedule": "interleaved", "m": 32},
    "llama3-405b-h100": {"world": 16384, "dp": 128, "schedule": "interleaved", "m": 16},
    "llama3-8b-b200": {"world": 32, "dp": 32, "schedule": "1f1b", "m": 8},
    "llama3-405b-b200": {"world": 8192, "dp": 128, "schedule": "interleaved", "m": 16},
    "llama3-405b-gb200-nvl72": {"world": 9216, "dp": 128, "schedule": "interleaved", "m": 18},
    "mixtral-8x7b-h100": {"world": 128, "dp": 32, "schedule": "1f1b", "m": 8},
    "bad-tp16-h100": {"world": 128, "dp": 8, "schedule": "1f1b", "m": 16},
}


@pytest.mark.parametrize("name", sorted(EXPECTED), ids=sorted(EXPECTED))
def test_example_layouts(name: str) -> None:
    spec = load_spec(ROOT / "examples" / f"{name}.yaml")
    want = EXPECTED[name]
    assert spec.world_size == want["world"]
    assert spec.layout.dp == want["dp"]
    assert spec.training.pipeline_schedule == want["schedule"]
    assert spec.training.micro_batches(spec.layout.dp) == want["m"]


def test_405b_uses_the_llama3_pipeline_split() -> None:
    spec = load_spec(ROOT / "examples" / "llama3-405b-h100.yaml")
    assert (spec.layout.tp, spec.layout.pp, spec.layout.dp, spec.layout.cp) == (8, 16, 128, 1)
    assert spec.training.global_batch_size * spec.model.seq_length == 2048 * 8192
    assert spec.parallelism.account_for_embedding_in_pipeline_split
    assert spec.parallelism.account_for_loss_in_pipeline_split


def test_gb200_nvl72_wiring_comes_from_the_catalogue() -> None:
    spec = load_spec(ROOT / "examples" / "llama3-405b-gb200-nvl72.yaml")
    assert spec.hardware.gpus_per_node == 4
    assert spec.hardware.nvlink_domain_gpus == 72
    assert spec.layout.tp * spec.layout.pp == 72  # one replica per NVLink domain, as the header says


def test_bad_placement_example_is_a_valid_spec() -> None:
    spec = load_spec(ROOT / "examples" / "bad-tp16-h100.yaml")
    assert spec.layout.tp > spec.hardware.gpus_per_node


# ---------------------------------------------------------------------------------------------------- entry points


def test_load_spec_accepts_a_path_a_path_string_and_text(tmp_path: Path) -> None:
    text = yaml.safe_dump(manifest())
    file = tmp_path / "job.yaml"
    file.write_text(text)
    from_path, from_str, from_text = load_spec(file), load_spec(str(file)), load_spec(text)
    assert from_path == from_str == from_text == load_spec_text(text)


def test_missing_file_is_a_spec_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"nope\.yaml: cannot read"):
        load_spec(tmp_path / "nope.yaml")


def test_unreadable_paths_are_spec_errors(tmp_path: Path) -> None:
    # A NUL byte in a path (a scenario file's ``spec:`` can hold one) and a file that is not UTF-8.
    with pytest.raises(SpecError, match="cannot read the TrainingJob file: embedded null byte"):
        load_spec("job\x00.yaml")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"metadata: {name: caf\xe9}\n")
    with pytest.raises(SpecError, match=r"latin\.yaml: cannot read the TrainingJob file: 'utf-8' codec"):
        load_spec(latin)


def test_status_in_the_manifest_is_ignored() -> None:
    doc = manifest()
    doc["status"] = {"phase": "Running", "worldSize": 512}
    assert spec_from_manifest(doc) == spec_from_manifest(manifest())


# ---------------------------------------------------------------------------------------------------- defaults


def test_defaults() -> None:
    spec = spec_from_manifest(manifest(parallelism={"tp": 8}))
    assert spec.namespace == "default"
    assert spec.layout.dp == 64  # 512 GPUs / tp 8
    assert (spec.layout.pp, spec.layout.cp, spec.layout.ep, spec.layout.vpp, spec.layout.etp) == (1, 1, 1, 1, None)
    assert spec.layout.order == DEFAULT_ORDER
    assert not spec.parallelism.sequence_parallel
    assert spec.parallelism.cp_comm_type is CpCommType.P2P  # Megatron-core's --cp-comm-type default
    t = spec.training
    assert t.precision is Precision.BF16
    assert (t.recompute, t.attention, t.pipeline_schedule) == ("none", "flash", "1f1b")
    assert (t.distributed_optimizer, t.zero_stage, t.grad_reduce_bytes) == (False, 0, 4)
    assert (t.overlap_grad_reduce, t.overlap_param_gather, t.tp_comm_overlap) == (True, True, False)
    h100 = CATALOGUE["H100"]
    hw = spec.hardware
    assert (hw.gpus_per_node, hw.nvlink_domain_gpus) == (h100.gpus_per_node, h100.nvlink_domain_gpus)
    assert hw.nic_bandwidth_bytes_per_s == h100.nic_bandwidth_bytes_per_s
    assert hw.scaleup_bandwidth_bytes_per_s == h100.scaleup_bandwidth_bytes_per_s
    assert (hw.nodes_per_network_block, hw.reserved_bytes) == (32, 0)
    assert spec.topology == TopologyConfig()
    assert spec.monitoring.enabled
    assert spec.monitoring.sources == ("train", "dcgm", "nccl", "infiniband")


@pytest.mark.parametrize("kind", list(CpCommType), ids=str)
def test_cp_comm_type(kind: CpCommType) -> None:
    # tp 2 leaves 32 query and 4 key/value heads per rank: every type fits cp 2.
    spec = spec_from_manifest(manifest(parallelism={"tp": 2, "cp": 2, "pp": 4, "cpCommType": kind.value}))
    assert spec.parallelism.cp_comm_type is kind


def test_micro_batch_size_defaults_to_one() -> None:
    spec = spec_from_manifest(manifest(training={"globalBatchSize": 512}))
    assert spec.training.micro_batch_size == 1


def test_preset_values_pass_through() -> None:
    spec = spec_from_manifest(manifest())
    preset = PRESETS["llama3-70b"]
    for attr in ("layers", "hidden_size", "attention_heads", "kv_heads", "ffn_hidden_size", "vocab_size"):
        assert getattr(spec.model, attr) == getattr(preset, attr)
    assert spec.model.head_dim == preset.hidden_size // preset.attention_heads


def test_kv_heads_default_to_heads_for_a_custom_model() -> None:
    model = {
        "layers": 4,
        "hiddenSize": 256,
        "attentionHeads": 8,
        "ffnHiddenSize": 1024,
        "vocabSize": 1000,
        "seqLength": 128,
    }
    spec = spec_from_manifest(manifest(model=model, parallelism={"tp": 8}))
    assert spec.model.name == "custom"
    assert spec.model.kv_heads == 8
    assert spec.model.head_dim == 32


@pytest.mark.parametrize(
    ("given", "schedule"),
    [({}, "interleaved"), ({"pipelineSchedule": "interleaved"}, "interleaved")],
    ids=["default", "explicit"],
)
def test_vpp_makes_the_schedule_interleaved(given: dict[str, str], schedule: str) -> None:
    doc = manifest(parallelism={"tp": 8, "pp": 4, "vpp": 2}, training={"globalBatchSize": 512, **given})
    assert spec_from_manifest(doc).training.pipeline_schedule == schedule


@pytest.mark.parametrize(("dtype", "nbytes"), [("fp32", 4), ("bf16", 2)], ids=["fp32", "bf16"])
def test_grad_reduce_dtype(dtype: str, nbytes: int) -> None:
    doc = with_value(manifest(), "spec.training.gradReduceDtype", dtype)
    assert spec_from_manifest(doc).training.grad_reduce_bytes == nbytes


def test_explicit_fields_override_the_preset() -> None:
    doc = manifest(model={"preset": "llama3-70b", "seqLength": 4096, "kvHeads": 16, "dropout": 0.1})
    model = spec_from_manifest(doc).model
    assert (model.seq_length, model.kv_heads, model.dropout) == (4096, 16, 0.1)
    assert model.layers == PRESETS["llama3-70b"].layers


def test_moe_fields_merge_with_the_preset() -> None:
    doc = manifest(model={"preset": "mixtral-8x7b", "moe": {"topK": 1}}, parallelism={"tp": 8, "ep": 8})
    moe = spec_from_manifest(doc).model.moe
    assert moe is not None
    assert (moe.experts, moe.top_k) == (8, 1)


def test_moe_added_to_a_dense_preset() -> None:
    doc = manifest(
        model={"preset": "llama3-8b", "moe": {"experts": 16, "topK": 2, "expertFfnHiddenSize": 4096}},
        parallelism={"tp": 8, "ep": 16},
    )
    spec = spec_from_manifest(doc)
    assert spec.model.moe is not None
    assert spec.model.moe.experts == 16
    assert spec.layout.ep == 16


def test_mla_q_lora_rank_zero_means_direct_queries() -> None:
    doc = manifest(model={"preset": "deepseek-v3", "mla": {"qLoraRank": 0}}, parallelism={"tp": 8, "ep": 8})
    mla = spec_from_manifest(doc).model.mla
    assert mla is not None
    assert mla.q_lora_rank is None


def test_hardware_without_a_catalogue_gpu() -> None:
    hardware = {
        "nodes": 4,
        "bf16Tflops": 1000,
        "hbmGiB": 96,
        "hbmBandwidthGBps": 4000,
        "nvlinkGBpsPerDirection": 450,
        "nicGbpsPerGpu": 400,
        "gpusPerNode": 4,
    }
    spec = spec_from_manifest(manifest(hardware=hardware, parallelism={"tp": 4}))
    gpu = spec.hardware.gpu
    assert gpu.bf16_flops_per_s == 1000 * TFLOPS
    assert gpu.fp8_flops_per_s is None
    assert gpu.hbm_bytes == 96 * GiB
    assert gpu.hbm_bandwidth_bytes_per_s == 4000 * GB
    assert spec.hardware.scaleup_bandwidth_bytes_per_s == 450 * GB
    assert spec.hardware.nic_bandwidth_bytes_per_s == 50 * GB  # 400 Gb/s are 50 GB/s
    assert spec.hardware.nvlink_domain_gpus == 4 == spec.hardware.gpus_per_node
    assert spec.world_size == 16


def test_explicit_numbers_override_the_catalogue() -> None:
    doc = manifest(hardware={"gpu": "H100", "nodes": 128, "gpusPerNode": 4, "hbmGiB": 94, "reservedGiB": 2})
    hw = spec_from_manifest(doc).hardware
    assert hw.gpu.hbm_bytes == 94 * GiB
    assert hw.reserved_bytes == 2 * GiB
    assert hw.usable_hbm_bytes == 92 * GiB
    assert hw.gpus_per_node == 4
    assert hw.nvlink_domain_gpus == 4  # an HGX NVLink domain is the node, so it follows gpusPerNode
    assert hw.gpu.bf16_flops_per_s == CATALOGUE["H100"].bf16_flops_per_s
    assert "hbmGiB" in hw.gpu.source


def test_rank_order_and_topology_and_monitoring() -> None:
    doc = manifest(
        parallelism={"tp": 8, "pp": 4, "rankOrder": "tp-dp-cp-ep-pp"},
        topology={"nvlinkDomainLabel": "example.com/rack", "networkTierLabels": ["example.com/leaf"]},
        monitoring={"enabled": False, "scrapeIntervalSeconds": 30, "sources": ["train", "nccl"]},
    )
    spec = spec_from_manifest(doc)
    assert spec.layout.order == parse_order("tp-dp-cp-ep-pp")
    assert spec.topology.nvlink_domain_label == "example.com/rack"
    assert spec.topology.network_tier_labels == ("example.com/leaf",)
    assert (spec.monitoring.enabled, spec.monitoring.scrape_interval_seconds) == (False, 30.0)
    assert spec.monitoring.sources == ("train", "nccl")


@pytest.mark.parametrize(
    ("tp", "nodes"),
    [(16, 64), (4, 64)],
    ids=["tp16-replicates-8-kv-heads", "tp4-splits-8-kv-heads"],
)
def test_tp_and_kv_heads_that_fit(tp: int, nodes: int) -> None:
    doc = manifest(parallelism={"tp": tp}, hardware={"gpu": "H100", "nodes": nodes})
    assert spec_from_manifest(doc).layout.tp == tp


def test_vocab_that_tp_does_not_divide_is_padded_not_rejected() -> None:
    doc = manifest(model={"preset": "llama3-70b", "vocabSize": 128257})
    assert spec_from_manifest(doc).model.vocab_size == 128257


# ---------------------------------------------------------------------------------------------------- required messages


def test_world_size_message() -> None:
    doc = manifest(parallelism={"dp": 8, "tp": 8, "pp": 4})
    err = load_error(doc)
    assert err.field == "spec.parallelism"
    assert "dp(8)*tp(8)*pp(4)*cp(1) = 256 != world size 512 (64 nodes x 8 GPUs)" in str(err)
    assert "dp = 16 fits" in str(err)


def test_heads_not_divisible_by_tp_message() -> None:
    doc = manifest(parallelism={"tp": 24}, hardware={"gpu": "H100", "nodes": 3})
    err = load_error(doc)
    assert err.field == "spec.model.attentionHeads"
    assert "model.heads (64) is not divisible by tp (24)" in str(err)
    assert "32, 64" in str(err)  # what would fit


def test_layers_not_divisible_by_pipeline_message() -> None:
    doc = manifest(parallelism={"tp": 8, "pp": 3}, hardware={"gpu": "H100", "nodes": 3})
    err = load_error(doc)
    assert err.field == "spec.model.layers"
    assert "model.layers (80) is not divisible by pp*vpp (3*1)" in str(err)


def test_llama3_405b_on_16_stages_needs_the_embedding_and_loss_split() -> None:
    doc = copy.deepcopy(RAW_EXAMPLES["llama3-405b-h100"])
    del doc["spec"]["parallelism"]["accountForEmbeddingInPipelineSplit"]
    del doc["spec"]["parallelism"]["accountForLossInPipelineSplit"]
    err = load_error(doc)
    assert err.field == "spec.model.layers"
    assert "model.layers (126) is not divisible by pp*vpp (16*4)" in str(err)
    assert "126 + 2 = 128" in str(err)  # the hint names the split that fits


# ---------------------------------------------------------------------------------------------------- other errors

H100_3 = {"gpu": "H100", "nodes": 3}
MIXTRAL = {"preset": "mixtral-8x7b"}

# (id, spec sections to use, field expected, substrings expected in the message)
ERRORS: list[tuple[str, dict[str, Any], str, list[str]]] = [
    (
        "kv-heads-do-not-divide-heads",
        {"model": {"preset": "llama3-70b", "kvHeads": 5}},
        "spec.model.kvHeads",
        ["(5)", "(64)"],
    ),
    (
        "tp-and-kv-heads-do-not-divide",
        {"model": {"preset": "llama3-70b", "attentionHeads": 48, "kvHeads": 12, "hiddenSize": 6144}},
        "spec.model.kvHeads",
        ["(12)", "tp (8)"],
    ),
    (
        "ffn-not-divisible-by-tp",
        {"model": {"preset": "llama3-70b", "ffnHiddenSize": 28673}},
        "spec.model.ffnHiddenSize",
        ["(28673)", "tp (8)"],
    ),
    (
        "hidden-not-divisible-by-heads",
        {"model": {"preset": "llama3-70b", "hiddenSize": 8200}},
        "spec.model.headDim",
        ["(8200)", "(64)"],
    ),
    (
        "global-batch-not-divisible",
        {"parallelism": {"tp": 8}, "training": {"globalBatchSize": 1000}},
        "spec.training.globalBatchSize",
        ["(1000)", "(1*64 = 64)", "960 or 1024"],
    ),
    (
        "1f1b-needs-m-at-least-pp",
        {"training": {"globalBatchSize": 32}},
        "spec.training.globalBatchSize",
        ["= 2 < pp (4)", "globalBatchSize >= 64"],
    ),
    (
        "interleaved-needs-m-multiple-of-pp",
        {"parallelism": {"tp": 8, "pp": 4, "vpp": 5}, "training": {"globalBatchSize": 96}},
        "spec.training.globalBatchSize",
        ["= 6 is not a multiple of pp (4)", "64 or 128"],
    ),
    (
        "1f1b-with-vpp",
        {"parallelism": {"tp": 8, "pp": 4, "vpp": 2}, "training": {"globalBatchSize": 512, "pipelineSchedule": "1f1b"}},
        "spec.training.pipelineSchedule",
        ["1f1b", "vpp is 2"],
    ),
    (
        "interleaved-without-vpp",
        {"training": {"globalBatchSize": 512, "pipelineSchedule": "interleaved"}},
        "spec.training.pipelineSchedule",
        ["vpp is 1"],
    ),
    (
        "cp-does-not-divide-sequence-in-2cp-chunks",
        {"parallelism": {"tp": 8, "cp": 3}, "hardware": H100_3, "training": {"globalBatchSize": 8}},
        "spec.parallelism.cp",
        ["(8192)", "2*cp (2*3 = 6)"],
    ),
    (
        "sequence-per-cp-rank-is-odd",
        {
            "model": {"preset": "llama3-70b", "seqLength": 4098},
            "parallelism": {"tp": 8, "cp": 2},
            "training": {"globalBatchSize": 512},
        },
        "spec.parallelism.cp",
        ["(4098)", "2*cp (2*2 = 4)"],
    ),
    (
        "experts-not-divisible-by-ep",
        {"model": MIXTRAL, "parallelism": {"ep": 3}, "hardware": H100_3, "training": {"globalBatchSize": 24}},
        "spec.parallelism.ep",
        ["experts (8)", "ep (3)"],
    ),
    (
        "ep-exceeds-experts",
        {"model": MIXTRAL, "parallelism": {"ep": 16}, "hardware": {"gpu": "H100", "nodes": 2}},
        "spec.parallelism.ep",
        ["ep (16)", "experts (8)"],
    ),
    ("ep-needs-moe", {"parallelism": {"tp": 1, "ep": 8}}, "spec.parallelism.ep", ["ep (8)", "'llama3-70b'"]),
    (
        # Llama 3 70B: 64 heads, 8 KV heads; with tp 8 a rank holds 8 and 1, and Ulysses cannot split 1 head over 2.
        "ulysses-needs-heads-divisible-by-cp",
        {"parallelism": {"tp": 8, "cp": 2, "cpCommType": "a2a"}},
        "spec.parallelism.cpCommType",
        ["8 query and 1 key/value heads", "cp (2)", "use cp among 1", "p2p or all_gather"],
    ),
    (
        "sequence-parallel-needs-tp",
        {"parallelism": {"tp": 1, "sequenceParallel": True}},
        "spec.parallelism.sequenceParallel",
        ["tp is 1"],
    ),
    (
        "nvlink-domain-not-whole-nodes",
        {"hardware": {"gpu": "H100", "nodes": 64, "nvlinkDomainGpus": 12}},
        "spec.hardware.nvlinkDomainGpus",
        ["(12)", "(8)", "8 or 16"],
    ),
    (
        "rank-order-unknown-axis",
        {"parallelism": {"tp": 8, "rankOrder": "tp-cp-ep-dp-xx"}},
        "spec.parallelism.rankOrder",
        ["xx"],
    ),
    (
        "layout-error-is-wrapped",
        {"model": MIXTRAL, "parallelism": {"tp": 8, "ep": 8, "rankOrder": "tp-ep-cp-dp-pp"}},
        "spec.parallelism",
        ["ep and dp must be adjacent"],
    ),
    (
        "tp-does-not-divide-world",
        {"parallelism": {"tp": 3}},
        "spec.parallelism",
        ["tp*pp*cp = 3*1*1 = 3 does not divide the world size 512 (64 nodes x 8 GPUs)"],
    ),
    (
        "tp-comm-overlap-needs-sequence-parallel",
        {"training": {"globalBatchSize": 512, "tpCommOverlap": True}},
        "spec.training.tpCommOverlap",
        ["sequenceParallel"],
    ),
    (
        "fp8-param-gather-needs-fp8",
        {"training": {"globalBatchSize": 512, "fp8ParamGather": True}},
        "spec.training.fp8ParamGather",
        ["needs precision: fp8, got precision: bf16"],
    ),
    (
        "distributed-optimizer-and-zero",
        {"training": {"globalBatchSize": 512, "distributedOptimizer": True, "zeroStage": 2}},
        "spec.training.zeroStage",
        ["zeroStage (2)"],
    ),
    (
        "top-k-exceeds-experts",
        {"model": {"preset": "mixtral-8x7b", "moe": {"topK": 9}}},
        "spec.model.moe.topK",
        ["(9)", "(8)"],
    ),
    (
        "dense-layers-leave-no-moe-layer",
        {"model": {"preset": "mixtral-8x7b", "moe": {"denseLayers": 32}}},
        "spec.model.moe.denseLayers",
        ["(32)"],
    ),
    (
        "moe-added-without-required-fields",
        {"model": {"preset": "llama3-70b", "moe": {"experts": 8}}},
        "spec.model.moe",
        ["topK", "expertFfnHiddenSize"],
    ),
    (
        "pipeline-split-flags-need-pp",
        {"parallelism": {"tp": 8, "accountForLossInPipelineSplit": True}},
        "spec.parallelism",
        ["pp is 1"],
    ),
    (
        "no-preset-and-missing-core-fields",
        {"model": {"layers": 4, "hiddenSize": 256}},
        "spec.model",
        ["attentionHeads", "ffnHiddenSize", "vocabSize", "seqLength"],
    ),
    ("unknown-preset", {"model": {"preset": "llama4"}}, "spec.model.preset", ["'llama4'", "llama3-70b"]),
    ("gpu-spelt-lowercase", {"hardware": {"gpu": "h100", "nodes": 64}}, "spec.hardware.gpu", ["did you mean 'H100'"]),
    (
        "no-gpu-and-missing-peaks",
        {"hardware": {"nodes": 64, "bf16Tflops": 900}},
        "spec.hardware",
        ["hbmGiB", "nicGbpsPerGpu", "gpusPerNode"],
    ),
    ("nodes-missing", {"hardware": {"gpu": "H100"}}, "spec.hardware.nodes", ["required"]),
    (
        "reserved-exceeds-hbm",
        {"hardware": {"gpu": "H100", "nodes": 64, "reservedGiB": 80}},
        "spec.hardware.reservedGiB",
        ["80 GiB"],
    ),
    ("global-batch-missing", {"training": {"microBatchSize": 1}}, "spec.training.globalBatchSize", ["required"]),
    (
        "monitoring-source-unknown",
        {"monitoring": {"sources": ["train", "gpu"]}},
        "spec.monitoring.sources[1]",
        ["'gpu'", "dcgm"],
    ),
    (
        "monitoring-source-twice",
        {"monitoring": {"sources": ["train", "train"]}},
        "spec.monitoring.sources[1]",
        ["twice"],
    ),
    (
        "bad-label-key",
        {"topology": {"nvlinkDomainLabel": "not a label"}},
        "spec.topology.nvlinkDomainLabel",
        ["'not a label'"],
    ),
    ("template-not-a-mapping", {"template": "pod"}, "spec.template", ["'pod' (a string)"]),
]


@pytest.mark.parametrize(("sections", "field", "parts"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_error_messages(sections: dict[str, Any], field: str, parts: list[str]) -> None:
    err = load_error(manifest(**sections))
    assert err.field == field, str(err)
    assert str(err).startswith(f"{field}: ")
    for part in parts:
        assert part in str(err)


# (id, dotted path, value, field expected, substrings)
BAD_VALUES: list[tuple[str, str, Any, str, list[str]]] = [
    ("string-for-int", "spec.parallelism.tp", "8", "spec.parallelism.tp", ["whole number", "'8' (a string)"]),
    ("bool-for-int", "spec.parallelism.tp", True, "spec.parallelism.tp", ["whole number", "true (a boolean)"]),
    ("float-for-int", "spec.hardware.nodes", 8.0, "spec.hardware.nodes", ["whole number", "8.0"]),
    ("null-for-int", "spec.parallelism.pp", None, "spec.parallelism.pp", ["null"]),
    ("negative", "spec.parallelism.tp", -1, "spec.parallelism.tp", ["-1", "from 1 to"]),
    ("zero-nodes", "spec.hardware.nodes", 0, "spec.hardware.nodes", ["0 is out of range"]),
    ("zero-batch", "spec.training.globalBatchSize", 0, "spec.training.globalBatchSize", ["0 is out of range"]),
    ("huge", "spec.model.layers", 10**40, "spec.model.layers", ["out of range", "4096"]),
    ("gigantic", "spec.model.layers", 10**5000, "spec.model.layers", ["bit number", "out of range"]),
    ("nan", "spec.model.dropout", math.nan, "spec.model.dropout", ["nan", "out of range"]),
    ("inf", "spec.hardware.reservedGiB", math.inf, "spec.hardware.reservedGiB", ["inf"]),
    ("dropout-above-one", "spec.model.dropout", 1.5, "spec.model.dropout", ["from 0 to 1"]),
    (
        "string-for-bool",
        "spec.parallelism.sequenceParallel",
        "yes",
        "spec.parallelism.sequenceParallel",
        ["true or false"],
    ),
    ("int-for-string", "spec.model.preset", 7, "spec.model.preset", ["expected a string", "7"]),
    (
        "unknown-cp-comm-type",
        "spec.parallelism.cpCommType",
        "allgather",
        "spec.parallelism.cpCommType",
        ["'allgather'", "p2p, all_gather, a2a"],
    ),
    (
        "unknown-precision",
        "spec.training.precision",
        "fp4",
        "spec.training.precision",
        ["'fp4'", "bf16, fp16, fp8, fp32"],
    ),
    ("list-for-section", "spec.parallelism", [8], "spec.parallelism", ["expected a mapping", "a list"]),
    ("string-for-list", "spec.monitoring.sources", "dcgm", "spec.monitoring.sources", ["list of strings"]),
    (
        "typo-tensor-parallel",
        "spec.parallelism.tensorParallel",
        8,
        "spec.parallelism.tensorParallel",
        ["unknown key 'tensorParallel'", "did you mean 'tp'", "allowed keys: dp, tp, pp, cp, ep, etp, vpp"],
    ),
    ("typo-hidden", "spec.model.hiddenSise", 8, "spec.model.hiddenSise", ["did you mean 'hiddenSize'"]),
    ("typo-deep", "spec.model.moe.topk", 2, "spec.model.moe.topk", ["did you mean 'topK'"]),
    ("typo-section", "spec.trainig", {}, "spec.trainig", ["did you mean 'training'"]),
    ("typo-top-level", "specs", {}, "specs", ["unknown key 'specs'", "apiVersion, kind, metadata, spec, status"]),
    ("api-version", "apiVersion", "meshscope.io/v1", "apiVersion", ["'meshscope.io/v1alpha1'", "'meshscope.io/v1'"]),
    ("kind", "kind", "PyTorchJob", "kind", ["'TrainingJob'", "'PyTorchJob'"]),
    ("metadata-name-missing", "metadata", {}, "metadata.name", ["required"]),
    ("metadata-name-invalid", "metadata.name", "Llama_70B", "metadata.name", ["'Llama_70B'", "DNS"]),
    ("namespace-invalid", "metadata.namespace", "a.b", "metadata.namespace", ["'a.b'"]),
]


@pytest.mark.parametrize(
    ("path", "value", "field", "parts"), [b[1:] for b in BAD_VALUES], ids=[b[0] for b in BAD_VALUES]
)
def test_bad_values(path: str, value: Any, field: str, parts: list[str]) -> None:
    err = load_error(with_value(manifest(), path, value))
    assert err.field == field, str(err)
    for part in parts:
        assert part in str(err)


@pytest.mark.parametrize(
    "path", ["spec", "spec.model", "spec.hardware", "spec.parallelism", "spec.training"], ids=lambda p: p
)
def test_required_sections(path: str) -> None:
    err = load_error(without(manifest(), path))
    assert err.field == path
    assert "required" in str(err)


def test_non_string_key() -> None:
    err = load_error(with_value(manifest(), "spec.parallelism", {8: 8}))
    assert err.field == "spec.parallelism"
    assert "key 8" in str(err)


def test_yaml_anchors_and_merge_keys_work() -> None:
    text = (
        "apiVersion: meshscope.io/v1alpha1\nkind: TrainingJob\nmetadata: {name: merged}\n"
        "spec:\n  model: {preset: llama3-8b}\n  parallelism: {tp: 2}\n  training: {globalBatchSize: 512}\n"
        "  hardware:\n    <<: &h100 {gpu: H100, nodes: 4}\n    nodes: 8\n"
    )
    spec = load_spec_text(text)
    assert spec.hardware.gpu.name == "H100"
    assert spec.hardware.nodes == 8  # an explicit key overrides the merged one; it is not a duplicate


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("apiVersion: a\nkind: b\n  spec: c\n", ["job.yaml:3:", "YAML does not parse"]),
        ("spec: [unclosed\n", ["job.yaml:2:1", "YAML does not parse"]),
        ("spec:\n  parallelism:\n    tp: 1\n    tp: 2\n", ["job.yaml:4:", "duplicate key 'tp'", "line 3"]),
        ("- a\n- b\n", ["expected a TrainingJob manifest", "a list"]),
        ("just a string\n", ["expected a TrainingJob manifest", "a string"]),
        ("", ["empty document"]),
        ("a: 1\n---\nb: 2\n", ["job.yaml:2:", "single document"]),
        ("a: " + "[" * 5000 + "\n", ["YAML does not parse"]),
    ],
    ids=["bad-indent", "unclosed", "duplicate-key", "list", "scalar", "empty", "two-documents", "deep"],
)
def test_yaml_errors_have_positions_and_no_traceback(text: str, parts: list[str]) -> None:
    with pytest.raises(SpecError) as info:
        load_spec_text(text, origin="job.yaml")
    assert info.value.field == ""
    assert info.value.__cause__ is None
    for part in parts:
        assert part in str(info.value)


# ---------------------------------------------------------------------------------------------------- fuzzing

SPEC_KEYS = sorted({k for keys in SECTION_KEYS.values() for k in keys})
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["H100", "llama3-8b", "bf16", "interleaved", "tp-cp-ep-dp-pp", "dcgm", "fp32"])
)
keys = st.sampled_from(SPEC_KEYS) | st.text(max_size=8)
structures = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=5),
    max_leaves=20,
)


def outcome(doc: Any) -> JobSpec | SpecError:
    try:
        return spec_from_manifest(doc)
    except SpecError as err:
        return err


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(section=st.sampled_from([*SECTION_KEYS["spec"], "spec"]), value=structures)
def test_fuzz_arbitrary_structures_under_spec(section: str, value: Any) -> None:
    doc = manifest()
    if section == "spec":
        doc["spec"] = value
    else:
        doc["spec"][section] = value
    assert isinstance(outcome(doc), JobSpec | SpecError)


def leaf_paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys and list indices) into ``node``, containers included."""
    paths = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, child in node.items():
            paths += leaf_paths(child, (*prefix, key))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            paths += leaf_paths(child, (*prefix, i))
    return paths


mutations = st.sampled_from(["drop", "small", "replace", "negate", "huge", "zero"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_mutations_of_valid_examples(data: st.DataObject) -> None:
    doc = copy.deepcopy(RAW_EXAMPLES[data.draw(st.sampled_from(sorted(RAW_EXAMPLES)), label="example")])
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        # Mostly inside spec, where the rules are; sometimes the envelope.
        paths = [p for p in leaf_paths(doc) if p[0] == "spec" and len(p) > 1] or leaf_paths(doc)
        if data.draw(st.integers(0, 9), label="envelope") == 0:
            paths = leaf_paths(doc)
        path = data.draw(st.sampled_from(paths), label="path")
        *parents, last = path
        node = doc
        for key in parents:
            node = node[key]
        kind = data.draw(mutations, label="kind")
        old = node[last]
        if kind == "drop":
            del node[last]
        elif kind == "small":  # plausible numbers reach the arithmetic checks
            node[last] = data.draw(st.integers(1, 64), label="small")
        elif kind == "replace":
            node[last] = data.draw(structures, label="value")
        elif kind == "negate" and isinstance(old, int | float) and not isinstance(old, bool):
            node[last] = -old
        elif kind == "huge":
            node[last] = data.draw(st.sampled_from([2**63, 10**30, 1e308, -(2**63)]), label="huge")
        else:
            node[last] = 0
    assert isinstance(outcome(doc), JobSpec | SpecError)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=200) | st.sampled_from([p.read_text() for p in EXAMPLES]).map(lambda t: t[: len(t) // 2]))
def test_fuzz_yaml_text(text: str) -> None:
    try:
        result: JobSpec | SpecError = load_spec_text(text)
    except SpecError as err:
        result = err
    assert isinstance(result, JobSpec | SpecError)

"""Fuzzers that generate from the grammar: fault strings, TrainingJob YAML and scenario files.

The older fuzzers (tests/core/test_simulate.py, test_loading.py) feed random text, which almost never passes the
first syntax check. These build valid documents from each format's grammar (docs/simulator.md for faults and
scenarios, docs/spec.md for the TrainingJob) and corrupt a minority of them in one place, so most examples reach the
deep checks. Properties: a grammatical document with values in range loads, to exactly what it says; a corrupted one
is refused with a ``SpecError`` naming a field, or loads to something valid; what loads has degrees >= 1 and a world
size of nodes x GPUs per node, and planning it raises nothing but ``PlanError``.
"""

from __future__ import annotations

import math

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshscope.errors import PlanError, SpecError
from meshscope.jobs.loading import load_spec_text
from meshscope.plan import plan_job
from meshscope.simulation import (
    CheckpointStall,
    ClockSkew,
    DataImbalance,
    SlowLink,
    SlowLoader,
    Straggler,
)
from meshscope.simulation.faults import fault_text, parse_fault
from meshscope.simulation.scenarios import load_scenario_text

# ---------------------------------------------------------------------------------------------------- faults

_RANK = st.integers(0, 4095)
_STEPS = st.lists(st.integers(0, 50), min_size=1, max_size=4, unique=True).map(lambda v: tuple(sorted(v)))
_FACTOR = st.floats(0.01, 50.0, allow_nan=False).map(lambda f: round(f, 3)).filter(lambda f: f > 0)


@st.composite
def _faults(draw: st.DrawFn) -> tuple[str, object]:
    """A fault as ``kind:key=value,...`` (keys in any order, optional ones sometimes) and the object it means."""
    kind = draw(st.sampled_from(["straggler", "slow-link", "data-imbalance", "slow-loader", "checkpoint", "skew"]))
    params: dict[str, object] = {}
    if kind in {"straggler", "data-imbalance"}:
        params = {
            "rank": draw(_RANK),
            "factor": draw(_FACTOR if kind == "straggler" else _FACTOR.filter(lambda f: f < 30)),
        }
        cls = Straggler if kind == "straggler" else DataImbalance
    elif kind == "slow-link":
        params = {"factor": draw(_FACTOR), draw(st.sampled_from(["node", "nvlink_domain"])): draw(_RANK)}
        cls = SlowLink
    elif kind == "slow-loader":
        params = {"data_ms": draw(st.floats(0, 5000).map(lambda f: round(f, 2)))}
        if draw(st.booleans()):
            params["rank"] = draw(_RANK)
        cls = SlowLoader
    elif kind == "checkpoint":
        params = {"every": draw(st.integers(1, 100)), "seconds": draw(st.floats(0.001, 100).map(lambda f: round(f, 3)))}
        if draw(st.booleans()):
            params["ranks"] = draw(_STEPS)
        kind, cls = "checkpoint-stall", CheckpointStall
    else:
        if draw(st.booleans()):
            params = {"node": draw(_RANK), "offset_us": draw(st.integers(-(10**9), 10**9))}
        else:
            params = {"max_offset_us": draw(st.integers(0, 10**9))}
        kind, cls = "clock-skew", ClockSkew
    if "steps" in cls.__dataclass_fields__ and draw(st.booleans()):
        params["steps"] = draw(_STEPS)
    order = draw(st.permutations(list(params)))
    spelled = draw(st.sampled_from([kind, kind.replace("-", "_"), kind.upper()]))
    terms = [f"{k}={_spell(params[k])}" for k in order]
    sep = draw(st.sampled_from([",", ", "]))
    return f"{spelled}:{sep.join(terms)}", cls(**params)  # type: ignore[arg-type]


def _spell(value: object) -> str:
    if isinstance(value, tuple):
        return ";".join(str(v) for v in value)
    return str(value)


_CORRUPTIONS = ["drop-equals", "bad-number", "unknown-key", "twice", "bad-kind", "truncate"]


def _corrupt(text: str, how: str) -> str:
    kind, _, rest = text.partition(":")
    first = rest.split(",")[0].strip()
    key = first.partition("=")[0]
    if how == "drop-equals":
        return text.replace("=", "", 1)
    if how == "bad-number":
        return f"{kind}:{key}=1.2.3" + rest[len(first) :]
    if how == "unknown-key":
        return f"{text},zz=1"
    if how == "twice":
        return f"{text},{first}"
    if how == "bad-kind":
        return f"strangler:{rest}"
    return text[: max(1, len(text) // 2)]


@settings(max_examples=300, deadline=None)
@given(fault=_faults(), corruption=st.none() | st.none() | st.none() | st.sampled_from(_CORRUPTIONS))
def test_fuzz_fault_strings_from_the_grammar(fault: tuple[str, object], corruption: str | None) -> None:
    text, expected = fault
    if corruption is None:
        # Every grammatical fault with values in range parses to exactly what it says, and prints back.
        got = parse_fault(text)
        assert got == expected, text
        assert parse_fault(fault_text(got)) == got
        return
    bad = _corrupt(text, corruption)
    try:
        got = parse_fault(bad)
    except SpecError as exc:
        refused = str(exc)
    else:
        # Only a truncation may leave a valid fault (cut at a separator): then it prints back.
        assert corruption == "truncate", (bad, got)
        assert parse_fault(fault_text(got)) == got
        return
    assert refused.startswith("--fault"), refused  # names where


# ---------------------------------------------------------------------------------------------------- TrainingJob YAML


@st.composite
def _manifests(draw: st.DrawFn) -> dict:
    """A TrainingJob whose layout fits its GPUs (llama3-8b: 32 heads, 8 KV heads, 32 layers, s = 8192)."""
    gpu, per_node = draw(st.sampled_from([("H100", 8), ("B200", 8)]))
    tp, pp, cp = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2]))
    inner = tp * pp * cp
    nodes = max(1, inner // per_node) * draw(st.sampled_from([1, 2, 4]))
    dp = nodes * per_node // inner
    mbs = draw(st.sampled_from([1, 2]))
    gbs = dp * mbs * draw(st.sampled_from([pp, 2 * pp, 8]))
    parallelism: dict[str, object] = {"tp": tp, "pp": pp, "cp": cp}
    if draw(st.booleans()):
        parallelism["dp"] = dp  # else inferred from the GPUs
    if tp > 1 and draw(st.booleans()):
        parallelism["sequenceParallel"] = True
    training: dict[str, object] = {"microBatchSize": mbs, "globalBatchSize": gbs}
    training.update(draw(st.sampled_from([{}, {"distributedOptimizer": True}, {"zeroStage": 1}, {"zeroStage": 2}])))
    if len(training) > 2 and draw(st.booleans()):  # hybrid sharding: a divisor of dp
        training["dpShard"] = draw(st.sampled_from([d for d in range(1, dp + 1) if dp % d == 0]))
    return {
        "apiVersion": "meshscope.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "fuzz"},
        "spec": {
            "model": {"preset": "llama3-8b"},
            "parallelism": parallelism,
            "training": training,
            "hardware": {"gpu": gpu, "nodes": nodes},
        },
    }


_SPEC_CORRUPTIONS = st.sampled_from(
    [
        ("parallelism", "tp", 3),
        ("parallelism", "pp", 0),
        ("parallelism", "cp", -2),
        ("parallelism", "dp", 7),
        ("parallelism", "tp", "two"),
        ("training", "globalBatchSize", 3),
        ("training", "microBatchSize", 0),
        ("training", "zeroStage", 5),
        ("training", "dpShard", 3),  # divides no power-of-two dp, or shards nothing
        ("training", "dpShard", 0),
        ("hardware", "nodes", 0),
        ("hardware", "gpu", "Z999"),
        ("model", "preset", "llama9"),
        ("parallelism", "xp", 2),
    ]
)


def _check_loaded(spec) -> None:
    layout = spec.layout
    degrees = (layout.dp, layout.tp, layout.pp, layout.cp, layout.ep, layout.vpp)
    assert min(degrees) >= 1, degrees
    assert layout.world_size == spec.hardware.nodes * spec.hardware.gpus_per_node
    try:
        plan = plan_job(spec)
    except PlanError:
        return
    assert len(plan.stages) == layout.pp
    assert all(stage.memory.total_bytes > 0 for stage in plan.stages)
    groups = {c.group for c in plan.collectives if c.axis == "dp"}
    hybrid = spec.training.hybrid_shard(layout.dp) is not None
    assert ("dp-shard" in groups) == hybrid, (groups, spec.training)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    manifest=_manifests(),
    corruption=st.none() | st.none() | _SPEC_CORRUPTIONS,
    flow=st.booleans(),
)
def test_fuzz_training_job_yaml_from_the_grammar(manifest: dict, corruption: tuple | None, flow: bool) -> None:
    if corruption is not None:
        section, key, value = corruption
        manifest["spec"][section][key] = value
    text = yaml.safe_dump(manifest, default_flow_style=flow, sort_keys=False)
    try:
        spec = load_spec_text(text)
    except SpecError as exc:
        refused: SpecError | None = exc
    else:
        refused = None
    if refused is not None:
        assert corruption is not None, (text, str(refused))  # a grammatical job always loads
        assert refused.field.startswith("spec."), (corruption, refused.field, str(refused))
        return
    if corruption is None:
        p = manifest["spec"]["parallelism"]
        assert (spec.layout.tp, spec.layout.pp, spec.layout.cp) == (p["tp"], p["pp"], p["cp"])
        per_node = 8
        assert spec.layout.dp == manifest["spec"]["hardware"]["nodes"] * per_node // (p["tp"] * p["pp"] * p["cp"])
    _check_loaded(spec)


# ---------------------------------------------------------------------------------------------------- scenarios

_DP8_SPEC = {
    "apiVersion": "meshscope.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "fuzz-scenario"},
    "spec": {
        "model": {"preset": "tiny"},
        "parallelism": {"dp": 8},
        "training": {"microBatchSize": 1, "globalBatchSize": 8},
        "hardware": {"gpu": "H100", "nodes": 1},
    },
}


@st.composite
def _scenarios(draw: st.DrawFn) -> tuple[dict, int]:
    """A scenario on the 8-rank tiny job: steps, phases, and faults in range for its ranks, node and steps."""
    steps = draw(st.integers(1, 6))
    in_steps = st.lists(st.integers(0, steps - 1), min_size=1, max_size=3, unique=True)
    faults = draw(
        st.lists(
            st.one_of(
                st.fixed_dictionaries({"kind": st.just("straggler"), "rank": st.integers(0, 7), "factor": st.floats(1.01, 3)}),
                st.fixed_dictionaries({"kind": st.just("data-imbalance"), "rank": st.integers(0, 7), "factor": st.floats(1.01, 3)}),
                st.fixed_dictionaries({"kind": st.just("slow-loader"), "data_ms": st.floats(0, 50)}),
                st.fixed_dictionaries({"kind": st.just("noise"), "sigma": st.floats(0, 0.2)}),
                st.fixed_dictionaries({"kind": st.just("checkpoint-stall"), "every": st.integers(1, 4), "seconds": st.floats(0.001, 1)}),
                st.fixed_dictionaries({"kind": st.just("straggler"), "rank": st.integers(0, 7), "factor": st.floats(1.01, 3), "steps": in_steps}),
            ),
            max_size=3,
        )
    )  # fmt: skip
    phases = draw(st.fixed_dictionaries({}, optional={"data_ms": st.floats(0, 20), "forward_ms": st.floats(0.1, 20)}))
    doc: dict[str, object] = {"steps": steps, "spec": _DP8_SPEC, "faults": faults}
    if phases:
        doc["phases"] = phases
    return doc, steps


def _corrupt_scenario(doc: dict, steps: int, corruption: str | None) -> str:
    """The scenario's text, broken in one place by ``corruption`` (or not)."""
    bad_fault = {
        "rank": {"kind": "straggler", "rank": 8, "factor": 2},  # the job has ranks 0-7
        "steps": {"kind": "straggler", "rank": 0, "factor": 2, "steps": [steps]},
        "kind": {"kind": "strangler", "rank": 0, "factor": 2},
    }
    if corruption in bad_fault:
        doc["faults"] = [*doc["faults"], bad_fault[corruption]]
    elif corruption == "phase":
        doc["phases"] = {"forward": 3}
    elif corruption == "key":
        doc["stepz"] = 2
    text = yaml.safe_dump(doc)
    if corruption == "yaml":
        text = text.replace(":", "", 1) + "\n  - ["
    return text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scenario=_scenarios(),
    corruption=st.none() | st.none() | st.sampled_from(["rank", "steps", "phase", "kind", "key", "yaml"]),
)
def test_fuzz_scenario_files_from_the_grammar(scenario: tuple[dict, int], corruption: str | None) -> None:
    doc, steps = scenario
    doc = yaml.safe_load(yaml.safe_dump(doc))
    faults = list(doc["faults"])
    text = _corrupt_scenario(doc, steps, corruption)
    try:
        loaded = load_scenario_text(text)
    except SpecError:
        assert corruption is not None, text
        return
    assert corruption is None, (corruption, text)
    assert loaded.steps == steps
    assert len(loaded.faults) == len(faults)
    assert loaded.spec.layout.world_size == 8 == loaded.spec.hardware.nodes * loaded.spec.hardware.gpus_per_node
    for fault, raw in zip(loaded.faults, faults, strict=True):
        assert fault.kind.value == raw["kind"]
        for key, value in raw.items():
            if key != "kind":
                got = getattr(fault, key)
                assert got == (tuple(value) if isinstance(value, list) else pytest.approx(value)), (key, got, value)
    assert math.isfinite(float(loaded.steps))

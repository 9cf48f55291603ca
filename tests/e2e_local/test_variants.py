"""The demo's context- and expert-parallel variants: the planner's numbers beside what the real 8-rank job ran.

Expected numbers are written from the ``tiny`` model's shapes and from how Transformer Engine (context parallelism,
``cp_comm_type="all_gather"``) and Megatron-core (sequence parallelism, the alltoall token dispatcher) run a layer,
not read from meshscope. Per GPU, micro-batches of 2 x 64 tokens, 4 per step, 2 layers per pipeline stage.

* ``--cp``: pp=2, cp=2, tp=2 (dense; FSDP2 over the cp ranks).
* ``--ep``: pp=2, dp=2, tp=2, ep=2 with etp=1, top-1 mixture of 4 experts of FFN 128 in every layer; sequence
  parallelism (Megatron-core requires it for MoE with tp > 1); dense parts sharded by FSDP2 over dp, each layer's
  experts over the expert-data-parallel group.
* ``--dp-shard 2``: pp=2, dp=4, hybrid sharding (HSDP): FSDP2 over a (replicate 2, shard 2) mesh, the plan told so by
  the script (``spec.training.dpShard``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Run

pytestmark = pytest.mark.slow

# tiny: 4 layers, hidden 64, 4 heads, 2 KV heads (head dim 16), FFN 256, vocab 512, sequence 64, learned positions.
L, H, A, G, HD, FF, V, S = 4, 64, 4, 2, 16, 256, 512, 64
PP, TP, M, B = 2, 2, 4, 2  # both variants: pp and tp degrees, micro-batches per step, micro-batch size
LAYERS = L // PP  # per stage
FP32 = 4
ATTENTION_TP = (H * (A + 2 * G) * HD + A * HD * H) // TP  # fused QKV and output projection, one tp rank
FIRST_ROOT = V * H // TP + S * H  # vocabulary-parallel embedding, learned positions (whole)
LAST_ROOT = V * H // TP + H  # vocabulary-parallel output layer, final norm


def _rows(run: Run, key: str) -> list[dict]:
    return run.analysis["expected_vs_measured"][key]


def _collectives(run: Run) -> dict[tuple[int, str, str, float], dict]:
    return {(r["pp_rank"], r["axis"], r["op"], r["message_bytes"]): r for r in _rows(run, "collectives_by_stage")}


def _assert_collectives(run: Run, expected: dict[tuple[int, str, str, float], int]) -> None:
    got = _collectives(run)
    assert set(got) == set(expected)
    for key, count in expected.items():
        assert got[key]["expected_count_per_step"] == count, key
        assert got[key]["measured_count_per_step"] == count, key
        assert got[key]["match"], key


def _fsdp_unit(params: int) -> dict[tuple[int, str, str, float], int]:
    """FSDP2 under pipelining, a unit on every layer of both stages: m + 1 all-gathers, one reduce-scatter."""
    return {
        key: count
        for stage in (0, 1)
        for key, count in (
            ((stage, "dp", "all_gather", params * FP32), (M + 1) * LAYERS),
            ((stage, "dp", "reduce_scatter", params * FP32), LAYERS),
        )
    }


def _fsdp_roots() -> dict[tuple[int, str, str, float], int]:
    """The root unit of each stage (embedding, or output layer and final norm): gathered and reduced once."""
    return {
        (stage, "dp", op, root * FP32): 1
        for stage, root in ((0, FIRST_ROOT), (1, LAST_ROOT))
        for op in ("all_gather", "reduce_scatter")
    }


def _assert_state(run: Run, params_by_stage: dict[int, int]) -> None:
    rows = {(r["pp_rank"], r["field"]): r for r in _rows(run, "model_state")}
    for stage, params in params_by_stage.items():
        for field, per_param in (("weights", FP32), ("gradients", FP32), ("optimizer", 2 * FP32)):
            row = rows[(stage, field)]
            assert row["measured_bytes"] == params * per_param, (stage, field)
            assert row["match"], (stage, field)
            assert row["ranks_agree"], (stage, field)


def _layer_bytes_per_microbatch(run: Run) -> dict[int, list[dict[int, float]]]:
    """Stage -> its ranks' ``layers`` activation bytes per micro-batch, by measured step."""
    measurements = json.loads((run.out_dir / "measurements.json").read_text())
    plan = json.loads((run.out_dir / "plan.json").read_text())
    per_stage = 8 // plan["layout"]["pp"]
    out: dict[int, list[dict[int, float]]] = {0: [], 1: []}
    for rank, measured in measurements.items():
        steps = {e["step"]: e["bytes"] / M for e in measured["activations"]["layers"]}
        out[int(rank) // per_stage].append(steps)
    return out


def _assert_no_unexplained_difference(run: Run) -> None:
    assert run.code == 0, run.out[-3000:]
    notes = " ".join(run.analysis["expected_vs_measured"]["notes"])
    compared = len(_rows(run, "collectives_by_stage"))
    assert f"collectives: {compared} of {compared} " in notes
    assert "model state: 6 of 6 " in notes
    activations = {(r["pp_rank"], r["part"]): r for r in _rows(run, "activations_per_microbatch")}
    for key in ((0, "layers"), (1, "layers"), (1, "output")):
        assert activations[key]["within_tolerance"], (key, activations[key])
    assert "views of the step's whole input batch" in notes  # the embedding's token ids (docs §4)


# ---------------------------------------------------------------------------------------------------- --cp


def test_cp_variant_declares_the_all_gather_type_it_runs(cp_run: Run) -> None:
    _assert_no_unexplained_difference(cp_run)
    plan = json.loads((cp_run.out_dir / "plan.json").read_text())
    assert plan["cp_comm_type"] == "all_gather"
    assert not plan["sequence_parallel"]


def test_cp_collectives_match_exactly(cp_run: Run) -> None:
    cp = 2
    activation = B * (S // cp) * H * FP32  # one micro-batch between layers: the cp-local half of the sequence
    kv = B * S * (G // TP) * HD * FP32  # K (or V) of this tp rank's KV head, gathered over the whole sequence
    layer = ATTENTION_TP + 3 * H * FF // TP + 2 * H  # a dense layer's FSDP2 unit: attention, MLP, two norms
    expected = {
        # DTensor TP without SP: 2 all-reduces forward and 2 backward per layer, plus the embedding or output layer;
        # the cross entropy's 3 fp32 all-reduces.
        (0, "tp", "all_reduce", activation): 4 * LAYERS * M + M,
        (1, "tp", "all_reduce", activation): 4 * LAYERS * M + M,
        (1, "tp", "all_reduce", B * (S // cp) * FP32): 3 * M,
        (0, "pp", "send", activation): M,
        (1, "pp", "send", activation): M,
        # cp_comm_type="all_gather": K and V gathered before attention and again in backward; dK, dV reduce-scattered
        (0, "cp", "all_gather", kv): 2 * 2 * LAYERS * M,
        (1, "cp", "all_gather", kv): 2 * 2 * LAYERS * M,
        (0, "cp", "reduce_scatter", kv): 2 * LAYERS * M,
        (1, "cp", "reduce_scatter", kv): 2 * LAYERS * M,
        # FSDP2 over the dp x cp ranks (here the cp pair): a unit per layer, the root
        **_fsdp_unit(layer),
        **_fsdp_roots(),
    }
    _assert_collectives(cp_run, expected)


def test_cp_model_state_and_activations(cp_run: Run) -> None:
    layer = ATTENTION_TP + 3 * H * FF // TP + 2 * H
    _assert_state(cp_run, {0: (FIRST_ROOT + LAYERS * layer) // 2, 1: (LAST_ROOT + LAYERS * layer) // 2})
    tokens = B * S // 2  # this rank's half of the sequence
    # Korthikanti term by term with s -> s/cp: the local Q, K, V are all all_gather keeps (no gathered K, V)
    planned = LAYERS * FP32 * tokens * (4 * H + HD * (2 * A + 2 * G) // TP + 3 * FF // TP)
    rows = {(r["pp_rank"], r["part"]): r for r in _rows(cp_run, "activations_per_microbatch")}
    assert rows[(0, "layers")]["expected_bytes"] == planned
    # measured: plus 1/rms of the two fused norms and the flash log-sum-exp of the local heads, per token
    assert rows[(0, "layers")]["measured_bytes"] == planned + LAYERS * FP32 * tokens * (2 + A // TP)


# ---------------------------------------------------------------------------------------------------- --ep

EXPERTS, FE, DP, EP = 4, FF // 2, 2, 2
EXPERTS_LOCAL = EXPERTS // EP * 3 * H * FE  # the layer's experts on this rank (etp = 1: whole experts)
MOE_LAYER_DENSE = ATTENTION_TP + 2 * H + EXPERTS * H  # attention, two norms, router: the dense FSDP2 unit


def test_ep_variant_runs_sequence_parallel_with_etp_1(ep_run: Run) -> None:
    _assert_no_unexplained_difference(ep_run)
    plan = json.loads((ep_run.out_dir / "plan.json").read_text())
    assert plan["sequence_parallel"]
    assert plan["layout"]["etp"] == 1
    assert not [f for f in plan["findings"] if f["code"] == "moe-tp-without-sp"]


def test_ep_collectives_match_exactly(ep_run: Run) -> None:
    whole = B * S * H * FP32  # a micro-batch's activation over the whole sequence (sequence-parallel messages)
    tokens = B * S // TP  # tokens a rank routes: its sequence shard
    sp_grads = LAYERS * (2 * H + EXPERTS * H)  # norms and routers, whole on every tp rank
    expected = {
        # Megatron SP per attention block: all-gather forward, again in backward, and for the row-parallel output
        # gradient; reduce-scatter forward and of the input gradient. First stage: the embedding all-reduces and
        # splits (learned positions), backward all-gathers; last stage: the output layer gathers forward and
        # backward and reduce-scatters its input gradient.
        (0, "tp", "all_gather", whole): 3 * LAYERS * M + M,
        (0, "tp", "reduce_scatter", whole): 2 * LAYERS * M,
        (0, "tp", "all_reduce", whole): M,
        (1, "tp", "all_gather", whole): 3 * LAYERS * M + 2 * M,
        (1, "tp", "reduce_scatter", whole): 2 * LAYERS * M + M,
        (1, "tp", "all_reduce", B * S * FP32): 3 * M,
        # finalize_model_grads: one all-reduce of the norm and router gradients, FSDP2 shards of them (÷ dp)
        (0, "tp", "all_reduce", sp_grads * FP32 // DP): 1,
        (1, "tp", "all_reduce", (sp_grads + H) * FP32 // DP): 1,
        (0, "pp", "send", whole // TP): M,
        (1, "pp", "send", whole // TP): M,
        # the dispatcher: token counts (ep x experts int64) all-gathered once per MoE layer and micro-batch ...
        (0, "ep", "all_gather", EP * EXPERTS * 8): LAYERS * M,
        (1, "ep", "all_gather", EP * EXPERTS * 8): LAYERS * M,
        # ... then tokens out and back and their probabilities, forward and backward; their mean message below
        (0, "ep", "all_to_all", (4 * tokens * H * FP32 + 2 * tokens * FP32) / 6): 6 * LAYERS * M,
        (1, "ep", "all_to_all", (4 * tokens * H * FP32 + 2 * tokens * FP32) / 6): 6 * LAYERS * M,
        # FSDP2: each layer's dense unit over dp, its experts over the expert-data-parallel pair; the root over dp
        **_fsdp_unit(MOE_LAYER_DENSE),
        **_fsdp_unit(EXPERTS_LOCAL),
        **_fsdp_roots(),
    }
    _assert_collectives(ep_run, expected)
    for stage in (0, 1):  # over a stage, the uneven all-to-alls' mean message is the plan's
        a2a = next(
            r for (s, axis, op, _), r in _collectives(ep_run).items() if (s, axis, op) == (stage, "ep", "all_to_all")
        )
        assert a2a["measured_message_bytes"] == pytest.approx(a2a["message_bytes"], rel=1e-9)


def test_ep_model_state_matches_to_the_byte(ep_run: Run) -> None:
    dense = {0: FIRST_ROOT + LAYERS * MOE_LAYER_DENSE, 1: LAST_ROOT + LAYERS * MOE_LAYER_DENSE}
    # dense parameters sharded over dp, experts over the expert-data-parallel group (edp = tp*dp/ep = 2)
    _assert_state(ep_run, {stage: (n + LAYERS * EXPERTS_LOCAL) // 2 for stage, n in dense.items()})


def test_ep_activations_follow_the_routed_tokens(ep_run: Run) -> None:
    tokens = B * S // TP  # a rank's sequence shard
    per_copy = FP32 * (H + 3 * FE + 1)  # expert input, fc1 output, activation output, routing probability
    router = tokens * (FP32 * EXPERTS + 2 * 8)  # softmax probabilities, top-1 expert and the sort (int64)
    attention = FP32 * B * S * HD * (2 * A + 2 * G) // TP  # whole sequence after the SP all-gather, local heads
    layer = FP32 * tokens * 4 * H + attention + router + tokens * per_copy
    rows = {(r["pp_rank"], r["part"]): r for r in _rows(ep_run, "activations_per_microbatch")}
    assert rows[(0, "layers")]["expected_bytes"] == LAYERS * layer
    # A rank keeps what its experts received; an ep pair receives every token its two ranks sent, so over the
    # stage (two ep pairs), on every measured step, the mean is the plan's plus the fused norms' 1/rms and the
    # flash log-sum-exp.
    extra = LAYERS * FP32 * (2 * tokens + (A // TP) * B * S)
    for stage, ranks in _layer_bytes_per_microbatch(ep_run).items():
        for step in ranks[0]:
            mean = sum(r[step] for r in ranks) / len(ranks)
            assert mean == pytest.approx(LAYERS * layer + extra, abs=1e-6), (stage, step)


# ---------------------------------------------------------------------------------------------------- --dp-shard


def test_hybrid_sharding_runs_the_plans_collectives_and_holds_its_shard(hsdp_run: Run) -> None:
    # tp=1: a layer unit is the whole layer; FSDP2's HSDP gathers it and reduce-scatters its gradients within the shard
    # group (2 ranks), then all-reduces the gradient shard it keeps across the 2 replicas, once per unit and step
    assert hsdp_run.code == 0, hsdp_run.out[-3000:]
    layer = H * (A + 2 * G) * HD + A * HD * H + 3 * H * FF + 2 * H  # fused QKV, output, SwiGLU MLP, two norms
    roots = {0: V * H + S * H, 1: V * H + H}  # embedding and learned positions; output layer and final norm
    expected: dict[tuple[int, str, str, float], int] = {}
    for stage, root in roots.items():
        expected[(stage, "dp", "all_gather", layer * FP32)] = (M + 1) * LAYERS
        expected[(stage, "dp", "reduce_scatter", layer * FP32)] = LAYERS
        expected[(stage, "dp", "all_reduce", layer * FP32 / 2)] = LAYERS  # the shard, across replicas
        expected[(stage, "dp", "all_gather", root * FP32)] = 1
        expected[(stage, "dp", "reduce_scatter", root * FP32)] = 1
        expected[(stage, "dp", "all_reduce", root * FP32 / 2)] = 1
        expected[(stage, "pp", "send", B * S * H * FP32)] = M  # activations forward, gradients back
    _assert_collectives(hsdp_run, expected)
    _assert_state(hsdp_run, {stage: (LAYERS * layer + root) // 2 for stage, root in roots.items()})  # / dp_shard
    plan = json.loads((hsdp_run.out_dir / "plan.json").read_text())
    groups = {(c["group"], c["op"], c["link"]) for c in plan["collectives"] if c["axis"] == "dp"}
    assert {g for g, _, _ in groups} == {"dp-shard", "dp-replicate"}
    assert {op for g, op, _ in groups if g == "dp-replicate"} == {"all-reduce"}

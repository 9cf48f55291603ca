"""The simulator: hand-computed timelines, barrier semantics, the pipeline bubble, clock skew, each fault in
isolation, scenario errors and a fuzzed loader. Breakdowns go through the real meshscope.analysis.breakdown."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshscope.analysis.breakdown import BUBBLE, CHECKPOINT, COMPUTE, DATA, OPTIMIZER, OTHER, SYNC_WAIT, TRANSFER
from meshscope.analysis.breakdown import comm_category as cat
from meshscope.cli import main
from meshscope.errors import ParseError, SpecError
from meshscope.jobs.loading import load_spec_text, spec_from_manifest
from meshscope.plan import PlanAssumptions, plan_job
from meshscope.plan.timing import stage_compute
from meshscope.records import AXIS_CODE, KIND_CODE, OP_CODE, PHASE_CODE, read_table, write_records
from meshscope.simulation import (
    CheckpointStall,
    ClockSkew,
    DataImbalance,
    FaultError,
    FaultKind,
    Noise,
    Phases,
    Scenario,
    SimulationResult,
    SlowLink,
    SlowLoader,
    Straggler,
    fault_text,
    load_scenario,
    load_scenario_text,
    parse_fault,
    simulate,
)
from meshscope.simulation.model import Slot, build_model
from meshscope.simulation.scenarios import scenario_from_mapping
from meshscope.topology.layout import AXES, MeshAxis
from meshscope.topology.placement import Placement

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "examples" / "scenarios"
DP8 = SCENARIOS / "dp8-handmade.yaml"
MS = 1000  # µs per ms
DP_XFER, DP_WAIT = cat("dp", TRANSFER), cat("dp", SYNC_WAIT)
DP = AXES.index(MeshAxis.DP)


@pytest.fixture(scope="module")
def dp8() -> Scenario:
    return load_scenario(DP8)


def job(*, model: dict | None = None, nodes: int = 1, gpus_per_node: int = 8, name: str = "t", **sections) -> dict:
    """A TrainingJob manifest; ``sections`` are parallelism=..., training=..."""
    training = {"microBatchSize": 1, "overlapGradReduce": False, **sections.pop("training", {})}
    return {
        "apiVersion": "meshscope.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "model": model or {"preset": "tiny"},
            "parallelism": sections.pop("parallelism", {}),
            "training": training,
            "hardware": {"gpu": "H100", "nodes": nodes, "gpusPerNode": gpus_per_node},
        },
    }


HAND = Phases(data_ms=6, forward_ms=10, backward_ms=16, dp_ms=10, optimizer_ms=2)


def comm_rows(result: SimulationResult, *, kind: str = "comm") -> dict[str, np.ndarray]:
    t = result.table
    iv = t.intervals
    sel = np.flatnonzero(iv.kind == KIND_CODE[kind])
    return {
        "rank": t.steps.rank[iv.row[sel]],
        "step": t.steps.step[iv.row[sel]],
        "start": iv.start_us[sel],
        "end": iv.end_us[sel],
        "group": iv.group[sel],
        "seq": iv.seq[sel],
        "op": iv.op[sel],
        "axis": iv.axis[sel],
        "peer": iv.peer[sel],
    }


def transfers(result: SimulationResult) -> dict[tuple[str, int], int]:
    """(group id, seq) -> end - last arrival of every collective instance, µs."""
    c = comm_rows(result)
    last: dict[tuple[str, int], int] = defaultdict(lambda: -(2**62))
    end: dict[tuple[str, int], int] = {}
    for g, q, s, e in zip(c["group"].tolist(), c["seq"].tolist(), c["start"].tolist(), c["end"].tolist(), strict=True):
        key = (result.table.group_name(g), q)
        last[key] = max(last[key], s)
        end[key] = e
    return {k: end[k] - last[k] for k in end}


# ---------------------------------------------------------------------------------------------------- hand-made


def test_handmade_dp8_breaks_down_exactly(dp8: Scenario) -> None:
    result = simulate(dp8)
    b = result.break_down()
    # data 6 + forward 10 + backward 16 + all-reduce 10 (not overlapped) + optimizer 2 = 44 ms, on every rank-step.
    assert b.table.n_rows == 8 * 5
    assert (b.step_us == (6 + 10 + 16 + 10 + 2) * MS).all()
    assert (b.us(DATA) == 6 * MS).all()
    assert (b.us(COMPUTE) == (10 + 16) * MS).all()
    assert (b.us(DP_XFER) == 10 * MS).all()
    assert (b.us(DP_WAIT) == 0).all()
    assert (b.us(OPTIMIZER) == 2 * MS).all()
    for category in (BUBBLE, CHECKPOINT, OTHER, cat("tp", TRANSFER), cat("pp", TRANSFER)):
        assert (b.us(category) == 0).all()
    assert b.notes == ()


def test_handmade_records_look_like_the_sdks(dp8: Scenario) -> None:
    result = simulate(dp8)
    c = comm_rows(result)
    names = {result.table.group_name(g) for g in c["group"].tolist()}
    assert names == {"dp:0"}  # the SDK's id: "<name>:<first member rank>"
    assert set(c["op"].tolist()) == {OP_CODE["all_reduce"]}
    # seq counts the group's collectives over the whole job: one per step here, the same on every member.
    for rank in range(8):
        assert c["seq"][c["rank"] == rank].tolist() == list(range(5))
    assert (result.table.intervals.group_size[result.table.intervals.kind == KIND_CODE["comm"]] == 8).all()
    # Records carry the rank's place and stats.
    s = result.table.steps
    assert s.coord[:, DP].tolist() == list(range(8)) * 5
    assert set(result.table.node_names) == {"node-0"}
    assert (s.tokens == 64).all()  # tiny: 1 sequence of 64 tokens per step
    assert (s.longest_sequence == 64).all()


def test_records_survive_a_round_trip_through_jsonl(tmp_path: Path, dp8: Scenario) -> None:
    result = simulate(dp8, faults=[Straggler(rank=1, factor=1.2)], steps=2)
    path = tmp_path / "r.jsonl.gz"
    write_records(path, result.table)
    again = read_table(path)
    assert again.to_records() == result.table.to_records()


# ---------------------------------------------------------------------------------------------------- barrier semantics


def test_a_stragglers_late_arrival_holds_every_member_and_is_charged_to_it(dp8: Scenario) -> None:
    result = simulate(dp8, faults=[Straggler(rank=3, factor=1.5)])
    c = comm_rows(result)
    transfer = 10 * MS
    for step in range(5):
        here = c["step"] == step
        arrival = dict(zip(c["rank"][here].tolist(), c["start"][here].tolist(), strict=True))
        ends = c["end"][here]
        # Nobody leaves before the last member (rank 3) arrived plus the transfer time; all leave together.
        assert (ends >= arrival[3] + transfer).all()
        assert (ends == arrival[3] + transfer).all()
        # Rank 3 computes 26 ms x 1.5 = 39 ms, the others 26 ms: it arrives 13 ms after them.
        assert all(arrival[3] - arrival[r] == 13 * MS for r in arrival if r != 3)
    b = result.break_down()
    rank = b.table.steps.rank
    assert (b.us(DP_WAIT)[rank != 3] == 13 * MS).all()
    assert (b.us(DP_WAIT)[rank == 3] == 0).all()
    assert (b.us(DP_XFER) == transfer).all()
    # The wait of the seven others is charged to rank 3: 7 x 13 ms per step.
    assert np.allclose(b.wait_caused_us[rank == 3, DP], 7 * 13 * MS)
    assert (b.wait_caused_us[rank != 3] == 0).all()
    assert [t.ranks for t in result.truth.of_kind("straggler")] == [(3,)]


def test_reported_utilisation_counts_a_waiting_collective_as_busy(dp8: Scenario) -> None:
    b = simulate(dp8, faults=[Straggler(rank=3, factor=1.5)]).break_down()
    waiting = b.table.steps.rank != 3
    step = (6 + 39 + 10 + 2) * MS  # the straggler's step sets everyone's
    # Only the 6 ms of data wait read as idle; the 13 ms spent spinning in the all-reduce read as busy.
    assert np.allclose(b.gpu_util[waiting], 1 - 6 * MS / step)
    assert np.allclose(b.compute_share[waiting], 26 * MS / step)
    assert (b.gpu_util[waiting] - b.compute_share[waiting] > 0.4).all()


# ---------------------------------------------------------------------------------------------------- pipeline

BALANCED = {  # 16 layers over 4 stages and a small vocabulary: the last stage's logits are ~1 % of its work
    "layers": 16,
    "hiddenSize": 4096,
    "attentionHeads": 32,
    "kvHeads": 8,
    "ffnHiddenSize": 14336,
    "vocabSize": 2048,
    "seqLength": 4096,
}


@pytest.mark.parametrize(
    ("schedule", "vpp", "micro_batches"),
    [("1f1b", 1, 8), ("gpipe", 1, 8), ("interleaved", 2, 8), ("1f1b", 1, 16)],
    ids=["1f1b-m8", "gpipe-m8", "interleaved-v2-m8", "1f1b-m16"],
)
def test_pipeline_bubble_matches_the_planners_fraction(schedule: str, vpp: int, micro_batches: int) -> None:
    manifest = job(
        model=BALANCED,
        gpus_per_node=4,
        parallelism={"pp": 4, "vpp": vpp},
        training={"globalBatchSize": micro_batches, "pipelineSchedule": schedule},
    )
    # The flat compute model (half of peak), for which the 5 % below was sized: with the faster roofline the same
    # pipeline transfers weigh more against the compute the closed form scales.
    result = simulate(spec_from_manifest(manifest), steps=3, assumptions=PlanAssumptions(compute_efficiency=0.5))
    plan = result.plan
    chunks = vpp if schedule == "interleaved" else 1
    assert plan.bubble_fraction == pytest.approx(3 / (micro_batches * chunks))  # (p - 1) / (m·v)
    b = result.break_down()
    s = b.table.steps
    for stage in (0, 3):
        # Steady state (from step 1): step 0 starts with every stage idle, which no later step repeats.
        sel = (s.step >= 1) & (s.coord[:, AXES.index(MeshAxis.PP)] == stage)
        expected_us = plan.bubble_fraction * plan.stages[stage].step_time.compute_seconds * 1e6
        assert b.us(COMPUTE)[sel] == pytest.approx(plan.stages[stage].step_time.compute_seconds * 1e6, rel=1e-4)
        # Tolerance 5 %: pipeline transfers (~0.1 ms each) lie on the critical path; the closed form ignores them.
        assert b.us(BUBBLE)[sel].mean() == pytest.approx(expected_us, rel=0.05)


def test_gpipe_runs_every_forward_before_any_backward_and_1f1b_interleaves() -> None:
    def phases_of_rank0(schedule: str) -> list[int]:
        manifest = job(
            model=BALANCED,
            gpus_per_node=4,
            parallelism={"pp": 4},
            training={"globalBatchSize": 8, "pipelineSchedule": schedule},
        )
        result = simulate(spec_from_manifest(manifest), steps=1)
        iv = result.table.intervals
        sel = (iv.kind == KIND_CODE["compute"]) & (result.table.steps.rank[iv.row] == 0)
        return iv.phase[sel].tolist()

    f, b = PHASE_CODE["forward"], PHASE_CODE["backward"]
    assert phases_of_rank0("gpipe") == [f] * 8 + [b] * 8
    # 1F1B on the first of 4 stages: 3 warm-up forwards, then forward/backward pairs, then 3 backwards.
    assert phases_of_rank0("1f1b") == [f] * 3 + [f, b] * 5 + [b] * 3


def test_a_receive_never_ends_before_the_neighbours_send_started_plus_its_transfer() -> None:
    manifest = job(model=BALANCED, gpus_per_node=4, parallelism={"pp": 4}, training={"globalBatchSize": 8})
    result = simulate(spec_from_manifest(manifest), steps=2, faults=[Straggler(rank=1, factor=1.3)])
    p = comm_rows(result, kind="p2p")
    sends = {
        (g, q): s for g, q, s, o in zip(p["group"], p["seq"], p["start"], p["op"], strict=True) if o == OP_CODE["send"]
    }
    xfer_us = result.model.pp_seconds_nvlink * 1e6
    recvs = [
        (g, q, e) for g, q, e, o in zip(p["group"], p["seq"], p["end"], p["op"], strict=True) if o == OP_CODE["recv"]
    ]
    assert recvs
    for g, q, end in recvs:
        assert end >= sends[g, q] + round(xfer_us)
    names = {result.table.group_name(int(g)) for g in p["group"]}
    assert "pp:0-1" in names
    assert "pp:1-0" in names  # gradients flow back on their own stream


# ---------------------------------------------------------------------------------------------------- clock skew


def test_skewed_clocks_give_the_same_breakdown() -> None:
    manifest = job(nodes=2, parallelism={"dp": 16}, training={"globalBatchSize": 16})
    base = Scenario(spec=spec_from_manifest(manifest), job="skew", steps=4, phases=HAND)
    straggler = Straggler(rank=11, factor=1.3)
    plain = simulate(base, faults=[straggler])
    skewed = simulate(base, faults=[straggler, ClockSkew(node=1, offset_us=7_000)])
    # The records do differ: node 1's timestamps are 7 ms later.
    node1 = skewed.table.steps.node == 1
    assert (skewed.table.steps.start_us - plain.table.steps.start_us).tolist() == np.where(node1, 7_000, 0).tolist()
    a, b = plain.break_down(), skewed.break_down()
    assert (a.ticks == b.ticks).all()
    assert np.array_equal(a.wait_caused_us, b.wait_caused_us)
    assert {n.code for n in b.notes} == {"clock_offsets"}
    assert skewed.truth.of_kind("clock-skew")[0].clock_offset_us == {"node-1": 7_000}


def test_random_clock_offsets_are_seeded_and_aligned_away() -> None:
    manifest = job(nodes=4, parallelism={"dp": 32}, training={"globalBatchSize": 32})
    base = Scenario(spec=spec_from_manifest(manifest), job="skew", steps=3, phases=HAND)
    one = simulate(base, faults=[ClockSkew(max_offset_us=5_000)], seed=5)
    again = simulate(base, faults=[ClockSkew(max_offset_us=5_000)], seed=5)
    assert np.array_equal(one.truth.clock_offset_us, again.truth.clock_offset_us)
    assert np.abs(one.truth.clock_offset_us).max() <= 5_000
    assert np.count_nonzero(one.truth.clock_offset_us) >= 2
    assert (one.break_down().ticks == simulate(base, seed=5).break_down().ticks).all()


# ---------------------------------------------------------------------------------------------------- faults, one by one


@pytest.fixture(scope="module")
def four_nodes() -> Scenario:
    """tp 2 (NVLink, inside a node), pp 2, dp 8 over 4 nodes: stage 0 on nodes 0-1, stage 1 on nodes 2-3."""
    manifest = job(
        model={"preset": "llama3-8b"},
        nodes=4,
        parallelism={"tp": 2, "pp": 2, "dp": 8},
        training={"globalBatchSize": 16},
    )
    return Scenario(spec=spec_from_manifest(manifest), job="four", steps=2)


def test_slow_node_network_slows_only_the_groups_crossing_it(four_nodes: Scenario) -> None:
    base = simulate(four_nodes)
    slow = simulate(four_nodes, faults=[SlowLink(node=1, factor=0.25)])
    before, after = transfers(base), transfers(slow)
    assert before.keys() == after.keys()
    assert min(before.values()) > 0
    changed = {g for (g, _), t in after.items() if t != before[g, _]}
    # Node 1 holds ranks 8-15 (stage 0). Its data-parallel groups (dp:8 with ranks 8, 10, ..., and dp:9) cross the
    # network and run 4x as long; tensor-parallel groups stay inside a node (NVLink), stage 1's groups avoid node 1.
    assert changed == {"dp:0", "dp:1"}
    for (g, q), t in after.items():
        if g in changed:
            assert t == pytest.approx(4 * before[g, q], abs=2)
    p = comm_rows(slow, kind="p2p")
    p0 = comm_rows(base, kind="p2p")
    send = p["op"] == OP_CODE["send"]
    duration, duration0 = (p["end"] - p["start"])[send], (p0["end"] - p0["start"])[p0["op"] == OP_CODE["send"]]
    on_node1 = (p["rank"][send] // 8 == 1) | (p["peer"][send] // 8 == 1)
    assert np.allclose(duration[on_node1], 4 * duration0[on_node1], atol=2)
    assert (duration[~on_node1] == duration0[~on_node1]).all()
    truth = slow.truth.of_kind("slow-link")[0]
    assert truth.nodes == (1,)
    assert truth.node_names == ("node-1",)
    assert {"dp:0", "dp:1"} <= set(truth.groups)
    assert all(g.startswith(("dp:", "pp:")) for g in truth.groups)


def test_slow_nvlink_domain_slows_only_the_groups_inside_it(four_nodes: Scenario) -> None:
    before = transfers(simulate(four_nodes))
    after = transfers(simulate(four_nodes, faults=[SlowLink(nvlink_domain=2, factor=0.5)]))
    assert min(before.values()) > 0
    changed = {g for (g, q), t in after.items() if t != before[g, q]}
    # H100 NVLink domains are single 8-GPU nodes: domain 2 = node 2 = ranks 16-23, four tp pairs.
    assert changed == {"tp:16", "tp:18", "tp:20", "tp:22"}


def test_straggler_lengthens_only_its_own_compute(dp8: Scenario) -> None:
    def compute(result: SimulationResult) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        iv = result.table.intervals
        sel = iv.kind == KIND_CODE["compute"]
        rows = iv.row[sel]
        return result.table.steps.rank[rows], result.table.steps.step[rows], (iv.end_us - iv.start_us)[sel]

    rank, step, base = compute(simulate(dp8))
    _, _, slow = compute(simulate(dp8, faults=[Straggler(rank=6, factor=1.25, steps=(1, 2))]))
    hit = (rank == 6) & np.isin(step, [1, 2])
    assert hit.sum() == 2 * 2  # forward and backward in steps 1 and 2
    assert np.array_equal(slow[hit], np.rint(base[hit] * 1.25).astype(np.int64))
    assert np.array_equal(slow[~hit], base[~hit])


def test_data_imbalance_grows_linear_work_k_times_and_attention_k_squared() -> None:
    manifest = job(parallelism={"tp": 2, "dp": 4}, training={"globalBatchSize": 4})
    scenario = Scenario(spec=spec_from_manifest(manifest), job="imb", steps=2, phases=HAND)
    base = simulate(scenario)
    k = 3.0
    hit = simulate(scenario, faults=[DataImbalance(rank=5, factor=k)])
    # Rank 5 is tp 1 of dp replica 2; its tp peer rank 4 sees the same samples.
    assert hit.truth.of_kind(FaultKind.DATA_IMBALANCE)[0].ranks == (4, 5)
    spec = scenario.spec
    stage = base.plan.stages[0]
    compute = stage_compute(
        spec.model, spec.layout, spec.training, spec.hardware, base.plan.assumptions,
        pp_rank=0, layer_indices=list(range(spec.model.layers)), micro_batches=1,
    )  # fmt: skip
    alpha = compute.attention_core_seconds_per_microbatch / (
        stage.forward_seconds_per_microbatch + stage.backward_seconds_per_microbatch
    )
    growth = (1 - alpha) * k + alpha * k * k
    b0, b1 = base.break_down(), hit.break_down()
    replica = np.isin(b1.table.steps.rank, [4, 5])
    assert b1.us(COMPUTE)[replica] == pytest.approx(26 * MS * growth, abs=2)
    assert (b1.us(COMPUTE)[~replica] == b0.us(COMPUTE)[~replica]).all()
    s0, s1 = base.table.steps, hit.table.steps
    assert (s1.tokens[replica] == k * s0.tokens[replica]).all()
    assert (s1.longest_sequence[replica] == k * s0.longest_sequence[replica]).all()
    assert np.allclose(s1.attention_work[replica], k * k * s0.attention_work[replica])
    assert np.allclose(s1.attention_us[replica], k * k * s0.attention_us[replica], atol=1)
    assert (s1.peak_memory_bytes[replica] > s0.peak_memory_bytes[replica]).all()
    for column in ("tokens", "longest_sequence", "attention_work", "attention_us", "peak_memory_bytes"):
        assert np.array_equal(getattr(s1, column)[~replica], getattr(s0, column)[~replica]), column
    # The replica's tensor-parallel activations grow k x as well; the other replicas' do not.
    before, after = transfers(base), transfers(hit)
    assert after["tp:4", 0] == pytest.approx(k * before["tp:4", 0], abs=2)
    assert after["tp:0", 0] == before["tp:0", 0]


@pytest.mark.parametrize(
    ("prefetch", "exposed_ms"), [(False, 30), (True, 30 - (10 + 16 + 2))], ids=["plain", "prefetch"]
)
def test_slow_loader_shows_whole_or_only_its_excess_over_compute(
    dp8: Scenario, *, prefetch: bool, exposed_ms: int
) -> None:
    b = simulate(dp8, faults=[SlowLoader(rank=2, data_ms=30)], prefetch=prefetch).break_down()
    rank = b.table.steps.rank
    assert (b.us(DATA)[rank == 2] == exposed_ms * MS).all()
    # Everyone else's 6 ms loader is exposed without prefetch, hidden under 28 ms of compute + optimizer with it.
    assert (b.us(DATA)[rank != 2] == (0 if prefetch else 6) * MS).all()
    assert np.allclose(b.wait_caused_us[rank == 2, DP], 7 * (exposed_ms - (0 if prefetch else 6)) * MS)


def test_checkpoint_stall_lands_after_every_nth_step(dp8: Scenario) -> None:
    b = simulate(dp8, faults=[CheckpointStall(every=2, seconds=0.05)]).break_down()
    step = b.table.steps.step
    assert (b.us(CHECKPOINT)[np.isin(step, [1, 3])] == 50 * MS).all()
    assert (b.us(CHECKPOINT)[~np.isin(step, [1, 3])] == 0).all()


def test_checkpoint_on_some_ranks_makes_the_others_wait_next_step(dp8: Scenario) -> None:
    result = simulate(dp8, faults=[CheckpointStall(every=2, seconds=0.05, ranks=(1,))])
    b = result.break_down()
    rank, step = b.table.steps.rank, b.table.steps.step
    assert (b.us(CHECKPOINT)[(rank == 1) & np.isin(step, [1, 3])] == 50 * MS).all()
    assert (b.us(CHECKPOINT)[rank != 1] == 0).all()
    # Steps 2 and 4 start 50 ms late on rank 1: the others wait for it in those steps' all-reduce.
    late = np.isin(step, [2, 4])
    assert (b.us(DP_WAIT)[late & (rank != 1)] == 50 * MS).all()
    assert np.allclose(b.wait_caused_us[late & (rank == 1), DP], 7 * 50 * MS)
    assert result.truth.of_kind("checkpoint-stall")[0].steps == (1, 3)


def test_noise_is_seeded_and_keeps_the_mean(dp8: Scenario) -> None:
    scenario = dataclasses.replace(dp8, steps=40)
    one = simulate(scenario, faults=[Noise(sigma=0.05)], seed=1)
    same = simulate(scenario, faults=[Noise(sigma=0.05)], seed=1)
    other = simulate(scenario, faults=[Noise(sigma=0.05)], seed=2)
    assert one.table.to_records() == same.table.to_records()
    assert not np.array_equal(one.table.intervals.end_us, other.table.intervals.end_us)
    b = one.break_down()
    compute = b.us(COMPUTE)
    assert compute.std() > 0.02 * 26 * MS
    assert compute.mean() == pytest.approx(26 * MS, rel=0.02)
    assert (b.us(DATA) == 6 * MS).all()  # noise touches compute and optimizer only


def test_truth_names_every_fault_in_order(dp8: Scenario) -> None:
    faults = [Straggler(rank=3, factor=1.5), SlowLoader(data_ms=9), Noise(sigma=0.01)]
    truth = simulate(dp8, faults=faults).truth
    assert [t.kind for t in truth.faults] == [FaultKind.STRAGGLER, FaultKind.SLOW_LOADER, FaultKind.NOISE]
    assert [t.fault for t in truth.faults] == faults
    assert truth.ranks("straggler") == {3}
    assert truth.ranks("slow-loader") == set(range(8))
    assert truth.faults[0].steps == tuple(range(5))
    assert truth.faults[0].description == "rank 3 (node-0) computes 1.5x as long in every step"


# ---------------------------------------------------------------------------------------------------- scale shape


def test_intervals_per_rank_step_stay_small() -> None:
    manifest = job(
        model={"preset": "llama3-70b"},
        nodes=16,
        parallelism={"tp": 8, "pp": 4, "dp": 4},
        training={"globalBatchSize": 16, "distributedOptimizer": True},
    )
    result = simulate(spec_from_manifest(manifest), steps=2)
    # 4 micro-batches x (receive, compute, tp all-reduce, compute, send) x (forward, backward) + dp + optimizer.
    per = result.table.n_intervals / result.table.n_rows
    assert 20 <= per <= 45


# ---------------------------------------------------------------------------------------------------- scenario files


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.yaml")), ids=lambda p: p.stem)
def test_example_scenarios_simulate(path: Path) -> None:
    scenario = load_scenario(path)
    assert scenario.description
    result = simulate(scenario, steps=min(scenario.steps, 3))
    b = result.break_down()
    assert (b.ticks.sum(axis=1) == b.step_us * 60).all()
    assert len(result.truth.faults) == len(scenario.faults)


def test_every_fault_kind_has_an_example_scenario() -> None:
    kinds = {f.kind for path in SCENARIOS.glob("*.yaml") for f in load_scenario(path).faults}
    assert kinds == set(FaultKind)


def scenario_text(extra: str = "", *, faults: str = "", spec: str | None = None) -> str:
    manifest = (
        spec
        if spec is not None
        else "spec: " + yaml.safe_dump(yaml.safe_load(DP8.read_text())["spec"], default_flow_style=True, width=10_000)
    )
    return f"{manifest}\nsteps: 3\n{extra}\n" + (f"faults:\n{faults}\n" if faults else "")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (scenario_text(faults="  - {kind: strangler, rank: 1, factor: 2}"), "faults[0].kind: unknown fault 'strangler'; use one of straggler, slow-link"),
        (scenario_text(faults="  - {kind: straggler, rank: 8, factor: 2}"), "faults[0].rank: rank 8 is outside [0, 8) of this job"),
        (scenario_text(faults="  - {kind: straggler, rank: 1, factor: 0}"), "faults[0].factor: 0 must be a number > 0"),
        (scenario_text(faults="  - {kind: slow-link, node: 0, factor: -1}"), "faults[0].factor: -1 must be a number > 0"),
        (scenario_text(faults="  - {kind: straggler, rank: 1}"), "faults[0].factor: required by straggler"),
        (scenario_text(faults="  - {kind: straggler, rank: 1, factr: 2}"), "faults[0].factr: straggler has no parameter 'factr'"),
        (scenario_text(faults="  - {kind: slow-link, node: 3, factor: 0.5}"), "faults[0].node: node 3 is outside [0, 1) of this job"),
        (scenario_text(faults="  - {kind: slow-link, factor: 0.5}"), "faults[0]: give exactly one of node (its network) or nvlink_domain"),
        (scenario_text(faults="  - straggler:rank=1,factor=x"), "faults[0].factor: 'x' is not a number"),
        (scenario_text(faults="  - {kind: straggler, rank: 1, factor: 2, steps: [5]}"), "faults[0].steps: step 5 is outside [0, 3) of this job"),
        (scenario_text(faults="  - {kind: checkpoint-stall, every: 0, seconds: 1}"), "faults[0].every: 0 must be a whole number >= 1"),
        (scenario_text(faults="  - {kind: noise, sigma: 3}"), "faults[0].sigma: 3 must be below 2"),
        ("steps: 3\nfaults: []\n", "spec: required: a TrainingJob file"),
        (scenario_text(spec="spec: missing.yaml"), "missing.yaml: cannot read the TrainingJob file: No such file"),
        (scenario_text("stepz: 4"), "stepz: unknown key; a scenario has description, job, spec, steps"),
        (scenario_text("phases: {forward: 3}"), "phases.forward: unknown phase; use data_ms, forward_ms"),
        (scenario_text("phases: {forward_ms: -3}"), "phases.forward_ms: -3 must be a number of ms from 0"),
        (scenario_text("phases: {allreduce_ms: 3, dp_ms: 3}"), "phases.dp_ms: allreduce_ms and dp_ms are the same phase"),
        (scenario_text("phases: {checkpoint_ms: 3}"), "phases: checkpoint_ms and checkpoint_every go together"),
        (scenario_text("prefetch: yes please"), "prefetch: expected true or false, got 'yes please'"),
        ("faults: [\n", "<text>:2:1: YAML does not parse"),
        ("- a\n- b\n", "<text>: expected a scenario (a mapping with spec, steps, faults), got ['a', 'b']"),
        (scenario_text(spec="spec: {kind: TrainingJob}"), "spec: inline TrainingJob: apiVersion: expected"),
    ],
    ids=[
        "bad-fault-name", "rank-out-of-range", "factor-zero", "factor-negative", "missing-param", "unknown-param",
        "node-out-of-range", "slow-link-target", "string-form-value", "step-out-of-range", "every-zero", "sigma",
        "missing-spec", "missing-spec-file", "unknown-key", "unknown-phase", "negative-phase", "phase-alias-twice",
        "checkpoint-pair", "prefetch-type", "yaml", "not-a-mapping", "bad-inline-spec",
    ],
)  # fmt: skip
def test_scenario_errors_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        load_scenario_text(text, base_dir=tmp_path)
    assert message in str(info.value)


def test_spec_paths_are_relative_to_the_scenario_file(tmp_path: Path) -> None:
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "job.yaml").write_text(yaml.safe_dump(yaml.safe_load(DP8.read_text())["spec"]))
    (tmp_path / "s.yaml").write_text("spec: jobs/job.yaml\nsteps: 2\nfaults: ['straggler:rank=1,factor=2']\n")
    scenario = load_scenario(tmp_path / "s.yaml")
    assert scenario.spec.world_size == 8
    assert scenario.faults == (Straggler(rank=1, factor=2.0),)
    assert scenario.job == "dp8-handmade"


def test_phase_override_of_a_missing_axis_is_refused(dp8: Scenario) -> None:
    with pytest.raises(SpecError, match=r"phases\.tp_ms: this job has no tp collectives"):
        simulate(dp8, phases=Phases(tp_ms=3))
    with pytest.raises(SpecError, match=r"phases\.pp_ms: this job has no pipeline"):
        simulate(dp8, phases=Phases(pp_ms=3))


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("straggler:rank=3,factor=1.5", Straggler(rank=3, factor=1.5)),
        ("slow-link:node=2,factor=0.25,steps=1-3;7", SlowLink(node=2, factor=0.25, steps=(1, 2, 3, 7))),
        ("data_imbalance:rank=0,factor=2", DataImbalance(rank=0, factor=2.0)),
        ("slow-loader:data_ms=40", SlowLoader(data_ms=40.0)),
        ("checkpoint-stall:every=10,seconds=30,ranks=0;1", CheckpointStall(every=10, seconds=30.0, ranks=(0, 1))),
        ("clock-skew:node=1,offset_us=-250", ClockSkew(node=1, offset_us=-250)),
        ("clock-skew:max_offset_us=5000", ClockSkew(max_offset_us=5000)),
        ("noise:sigma=0.02", Noise(sigma=0.02)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_fault_strings_parse_and_print_back(text: str, fault: object) -> None:
    assert parse_fault(text) == fault
    assert parse_fault(fault_text(fault)) == fault  # type: ignore[arg-type]


def test_fault_objects_check_their_parameters() -> None:
    with pytest.raises(FaultError, match=r"straggler\.factor: -1 must be a number > 0"):
        Straggler(rank=0, factor=-1)
    with pytest.raises(FaultError, match=r"clock-skew: give node"):
        ClockSkew(node=1, max_offset_us=3)
    with pytest.raises(SpecError, match=r"--fault: 'nope!' is not kind:key=value"):
        parse_fault("nope!")


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_KEYS = st.sampled_from(["spec", "steps", "seed", "prefetch", "phases", "faults", "job", "description", "x"])
_FAULT_KEYS = st.sampled_from(["kind", "rank", "factor", "node", "nvlink_domain", "steps", "data_ms", "every", "seconds", "ranks", "sigma", "offset_us", "max_offset_us", "z"])  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_the_scenario_loader_raises_only_spec_errors(data: st.DataObject, dp8_document: dict) -> None:
    document = yaml.safe_load(yaml.safe_dump(dp8_document))
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(["top", "phases", "fault", "spec"]))
        if where == "top":
            document[data.draw(_KEYS)] = data.draw(_VALUES)
        elif where == "phases" and isinstance(document.get("phases"), dict):
            key = data.draw(
                st.sampled_from(["data_ms", "forward_ms", "allreduce_ms", "checkpoint_every", "tp_ms", "q"])
            )
            document["phases"][key] = data.draw(_VALUES)
        elif where == "fault":
            fault = {"kind": data.draw(st.sampled_from([k.value for k in FaultKind] + ["bogus"]))}
            fault.update(data.draw(st.dictionaries(_FAULT_KEYS, _VALUES, max_size=4)))
            document["faults"] = [fault]
        elif isinstance(document.get("spec"), dict) and isinstance(document["spec"].get("spec"), dict):
            document["spec"]["spec"]["parallelism"] = data.draw(_VALUES)
    try:
        scenario = scenario_from_mapping(document)
    except (SpecError, ParseError):
        return
    assert isinstance(scenario, Scenario)


@pytest.fixture(scope="module")
def dp8_document() -> dict:
    return yaml.safe_load(DP8.read_text())


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=200))
def test_fuzz_scenario_text_raises_only_spec_errors(text: str) -> None:
    with contextlib.suppress(SpecError, ParseError):
        load_scenario_text(text)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60))
def test_fuzz_fault_strings_raise_only_spec_errors(text: str) -> None:
    with contextlib.suppress(SpecError):
        parse_fault(text)


# ---------------------------------------------------------------------------------------------------- CLI


def test_cli_simulates_a_scenario_and_says_what_it_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "records.jsonl"
    code = main(["simulate", str(DP8), "--out", str(out), "--steps", "2", "--fault", "straggler:rank=3,factor=1.5"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "8 ranks x 2 steps = 16 rank-steps, 80 intervals" in printed
    assert "fault straggler: rank 3 (node-0) computes 1.5x as long in every step" in printed
    assert f"wrote {out}: 16 records" in printed
    table = read_table(out)
    assert table.n_rows == 16


def test_cli_simulates_a_bare_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.jsonl.gz"
    code = main(
        ["simulate", "--spec", str(ROOT / "examples" / "llama3-8b-h100.yaml"), "--steps", "1", "--out", str(out)]
    )
    assert code == 0
    assert "64 ranks x 1 steps" in capsys.readouterr().out
    assert read_table(out).n_rows == 64


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate"], "simulate needs a SCENARIO file or --spec JOB.yaml"),
        (["simulate", str(DP8), "--fault", "straggler:rank=99,factor=2"], "rank 99 is outside [0, 8)"),
        (["simulate", str(DP8), "--fault", "bogus"], "unknown fault 'bogus'"),
        (["simulate", str(DP8), "--steps", "0"], "--steps must be from 1"),
        (["simulate", str(DP8), "--out", "x.csv"], "must end in .jsonl or .jsonl.gz"),
    ],
    ids=["nothing", "rank", "name", "steps", "out"],
)
def test_cli_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_simulate_refuses_a_bad_step_count(dp8: Scenario) -> None:
    with pytest.raises(SpecError, match="steps: 0 must be a whole number >= 1"):
        simulate(dp8, steps=0)


def test_axis_codes_of_recorded_collectives(four_nodes: Scenario) -> None:
    c = comm_rows(simulate(four_nodes))
    by_axis = defaultdict(set)
    for g, a in zip(c["group"].tolist(), c["axis"].tolist(), strict=True):
        by_axis[AXES[a].value].add(g)
    assert set(by_axis) == {"tp", "dp"}
    p = comm_rows(simulate(four_nodes), kind="p2p")
    assert set(p["axis"].tolist()) == {AXIS_CODE["pp"]}


MULTI_AXIS = {
    "cp": ({"preset": "llama3-8b"}, {"tp": 2, "cp": 2, "pp": 2, "dp": 4}, {"globalBatchSize": 8, "distributedOptimizer": True}),
    "moe": ({"preset": "mixtral-8x7b"}, {"tp": 2, "ep": 4, "pp": 2, "dp": 8, "sequenceParallel": True}, {"globalBatchSize": 16, "distributedOptimizer": True}),
    "zero3": ({"preset": "llama3-8b"}, {"dp": 32}, {"globalBatchSize": 64, "zeroStage": 3}),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(MULTI_AXIS))
def test_recorded_bytes_per_axis_are_the_plans(case: str) -> None:
    # A consistency check: the simulator issues what the plan lists (it builds its records from the plan's
    # collectives, so it cannot catch a planner error). The bytes themselves are counted by hand in
    # tests/core/test_collectives.py (test_the_plan_and_the_simulated_records_carry_the_hand_counted_bytes).
    model, parallelism, training = MULTI_AXIS[case]
    spec = spec_from_manifest(job(model=model, nodes=4, parallelism=parallelism, training=training))
    result = simulate(spec, steps=2)
    t, iv = result.table, result.table.intervals
    pp_code = AXIS_CODE["pp"]
    counted = (iv.kind == KIND_CODE["comm"]) | ((iv.kind == KIND_CODE["p2p"]) & (iv.axis != pp_code))
    counted |= (iv.kind == KIND_CODE["p2p"]) & (iv.op == OP_CODE["send"])  # the plan counts pipeline sends
    stage_of = t.steps.coord[:, AXES.index(MeshAxis.PP)]
    for stage in result.plan.stages:
        rows = np.flatnonzero((stage_of == stage.pp_rank) & (t.steps.step == 1))
        expected: dict[str, float] = defaultdict(float)
        for c in stage.collectives:
            expected[c.axis] += c.message_bytes * c.count_per_step
        sel = counted & np.isin(iv.row, rows)
        got = np.bincount(iv.axis[sel], weights=iv.size_bytes[sel], minlength=len(AXES)) / rows.size
        for axis, value in expected.items():
            assert got[AXIS_CODE[axis]] == pytest.approx(value, rel=1e-5), (case, stage.pp_rank, axis)
        assert {AXES[a].value for a in np.flatnonzero(got)} == set(expected)


def test_context_parallel_ring_runs_a_third_forward_two_thirds_backward() -> None:
    model, parallelism, training = MULTI_AXIS["cp"]
    result = simulate(
        spec_from_manifest(job(model=model, nodes=4, parallelism=parallelism, training=training)), steps=1
    )
    t, iv = result.table, result.table.intervals
    ring = np.flatnonzero((iv.kind == KIND_CODE["p2p"]) & (iv.axis == AXIS_CODE["cp"]) & (t.steps.rank[iv.row] == 0))
    compute = np.flatnonzero((iv.kind == KIND_CODE["compute"]) & (t.steps.rank[iv.row] == 0))
    # Each ring message follows a compute chunk of the pass it belongs to.
    phase_before = [int(iv.phase[compute[compute < j].max()]) for j in ring]
    forward = iv.size_bytes[ring][np.array(phase_before) == PHASE_CODE["forward"]].sum()
    backward = iv.size_bytes[ring][np.array(phase_before) == PHASE_CODE["backward"]].sum()
    assert backward == pytest.approx(2 * forward, rel=1e-6)
    names = {t.group_name(int(g)) for g in iv.group[ring]}
    assert names == {"cp:2-0"}  # rank 0 receives from the previous member of its ring (ranks 0 and 2)


@pytest.mark.parametrize(("kind", "cp"), [("p2p", 4), ("p2p", 2), ("all_gather", 4), ("a2a", 2)])
def test_context_parallel_traffic_is_split_between_forward_and_backward_as_its_comm_type_runs(
    kind: str, cp: int
) -> None:
    # Per attention layer and micro-batch, with c = the K/V chunk one rank holds (tiny: K and V of equal width):
    # p2p: forward cp - 1 ring steps of c; backward c first, dK/dV last, 2c in each of the cp - 2 middle steps.
    # all_gather: forward gathers K and V (cp·c in all); backward gathers them again and reduce-scatters dK, dV.
    # a2a: Q, K, V and the output forward; their gradients backward, the same sizes.
    forward_units, backward_units = {
        "p2p": (cp - 1, 2 + 2 * (cp - 2)),
        "all_gather": (cp, 2 * cp),
        "a2a": (1, 1),
    }[kind]
    manifest = job(parallelism={"cp": cp, "cpCommType": kind}, training={"globalBatchSize": 4}, gpus_per_node=cp)
    spec = spec_from_manifest(manifest)
    placement = Placement.for_hardware(spec.world_size, spec.hardware)
    model = build_model(spec, plan_job(spec, placement=placement), placement, Phases())
    moved = dict.fromkeys((Slot.IN_FORWARD, Slot.IN_BACKWARD), 0.0)
    for stage in model.stages:
        for item in stage.items:
            if item.group.name == "cp":
                moved[item.slot] += item.instances * item.message_bytes
    assert set(moved) == {Slot.IN_FORWARD, Slot.IN_BACKWARD}
    assert moved[Slot.IN_FORWARD] > 0
    assert moved[Slot.IN_FORWARD] / moved[Slot.IN_BACKWARD] == pytest.approx(forward_units / backward_units)


PEERS_SPEC = """
apiVersion: meshscope.io/v1alpha1
kind: TrainingJob
metadata: {name: peers}
spec:
  model: {preset: llama3-8b}
  parallelism: {pp: 4, dp: 2, tp: 2}
  training: {microBatchSize: 1, globalBatchSize: 16}
  hardware: {gpu: H100, nodes: 2, gpusPerNode: 8}
"""


def test_pipeline_sends_and_receives_name_the_other_stage_as_peer() -> None:
    spec = load_spec_text(PEERS_SPEC)
    table = simulate(spec, steps=2, seed=0).table
    iv, s = table.intervals, table.steps
    p2p = np.flatnonzero((iv.kind == KIND_CODE["p2p"]) & (iv.axis == AXIS_CODE["pp"]))
    assert p2p.size
    me = s.rank[iv.row[p2p]].astype(np.int64)
    peer = iv.peer[p2p].astype(np.int64)
    mine, theirs = spec.layout.coords_array(me), spec.layout.coords_array(peer)
    assert (peer != me).all()
    assert (np.abs(mine[MeshAxis.PP] - theirs[MeshAxis.PP]) == 1).all()
    for axis in (MeshAxis.DP, MeshAxis.TP):
        assert (mine[axis] == theirs[axis]).all()
    recv = iv.op[p2p] == OP_CODE["recv"]
    assert recv.any()
    assert (recv & (mine[MeshAxis.PP] == 0)).any()  # stage 0 receives gradients from stage 1 in backward

"""Collectives per pipeline stage, plan vs records: bytes per GPU per step (meshscope.analysis.collectives).

Three kinds of evidence: hand-made records whose every number is counted by hand; clean simulated jobs of many
layouts, where every (stage, axis, op) must agree with the plan's message x count (the simulator aggregates instances
into one interval per collective phase, so only bytes compare); and the same records perturbed (an interval dropped,
a message doubled, sizes stripped), where the comparison must show exactly the difference made. The per-size run
comparison (meshscope.local.comparisons, built on the same grouping) is checked on records written from a plan.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest

from meshscope.analysis import analyze, render_analysis
from meshscope.analysis.collectives import STATUSES, compare_collectives, plan_op_name, stage_of_rows, stage_traffic
from meshscope.jobs.loading import spec_from_manifest
from meshscope.local.comparisons import compare_run
from meshscope.plan import plan_job
from meshscope.records import AXIS_CODE, KIND_CODE, OP_CODE, Interval, IntervalColumns, RecordTable, StepRecord
from meshscope.simulation import Noise, simulate
from meshscope.topology import AXES, MeshAxis
from meshscope.topology.layout import RankCoord

MIB = 1 << 20


def manifest(model: dict, parallelism: dict, training: dict, *, nodes: int = 4) -> dict:
    return {
        "apiVersion": "meshscope.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "collectives"},
        "spec": {
            "model": model,
            "parallelism": parallelism,
            "training": {"microBatchSize": 1, **training},
            "hardware": {"gpu": "H100", "nodes": nodes, "gpusPerNode": 8},
        },
    }


def with_intervals(table: RecordTable, *, keep: np.ndarray | None = None, size: np.ndarray | None = None):
    """``table`` with its intervals subset to ``keep`` and/or their sizes replaced by ``size``."""
    iv = table.intervals
    cols = {f.name: getattr(iv, f.name) for f in dataclasses.fields(iv)}
    if size is not None:
        cols["size_bytes"] = size
    if keep is not None:
        cols = {k: v[keep] for k, v in cols.items()}
    return dataclasses.replace(table, intervals=IntervalColumns(**cols))


def planned_bytes(plan) -> dict[tuple[int, str, str], float]:
    """(stage, axis, op) -> the plan's message x count, summed, written out independently of the module."""
    out: dict[tuple[int, str, str], float] = defaultdict(float)
    for stage in plan.stages:
        for c in stage.collectives:
            out[(stage.pp_rank, c.axis, c.op.value.replace("-", "_"))] += c.message_bytes * c.count_per_step
    return dict(out)


# ---------------------------------------------------------------------------- hand-made records

SMALL = manifest({"preset": "tiny"}, {"dp": 2, "tp": 2, "pp": 2}, {"globalBatchSize": 8}, nodes=1)


def hand_records() -> list[StepRecord]:
    """8 ranks of dp2 tp2 pp2 (tp fastest, then dp, then pp: stage 0 = ranks 0-3), 3 steps. Per rank-step:

    * tp all-reduce recorded as two aggregated intervals, 3 MiB and 5 MiB (rank 1, step 2: the 5 MiB one missing);
    * stage 0: pipeline sends 2 x 1 MiB and receives 2 x 2 MiB; stage 1: receives 3 x 1 MiB only (a recorder that
      records one side);
    * dp reduce-scatter of 16 MiB: on stage 0 only ranks 0 and 1 record its size; on stage 1 nobody does;
    * a barrier (no size) on stage 1, step 0 only.
    """
    records = []
    for step in range(3):
        for rank in range(8):
            tp, dp, pp = rank % 2, (rank // 2) % 2, rank // 4
            ivs: list[Interval] = []

            def add(
                kind: str,
                axis: str,
                op: str,
                size: int | None,
                *,
                ivs: list[Interval] = ivs,
                step: int = step,
                **where: object,
            ) -> None:
                t0 = step * 1000 + 10 * len(ivs)
                net = (
                    {"group": where["group"], "seq": 100 * step + len(ivs), "group_size": 2}
                    if kind == "comm"
                    else where
                )
                ivs.append(Interval(kind=kind, start_us=t0, end_us=t0 + 5, axis=axis, op=op, size_bytes=size, **net))

            for size in [3 * MIB] if (rank, step) == (1, 2) else [3 * MIB, 5 * MIB]:
                add("comm", "tp", "all_reduce", size, group=f"tp:{rank // 2}")
            for op in ["send", "send", "recv", "recv"] if pp == 0 else ["recv", "recv", "recv"]:
                add(
                    "p2p", "pp", op, 2 * MIB if (pp, op) == (0, "recv") else MIB, peer=rank + 4 if pp == 0 else rank - 4
                )
            sized = pp == 0 and rank in (0, 1)
            add("comm", "dp", "reduce_scatter", 16 * MIB if sized else None, group=f"dp:{pp}-{tp}")
            if pp == 1 and step == 0:
                add("comm", "dp", "barrier", None, group=f"dp:{pp}-{tp}")
            coord = RankCoord(dp=dp, tp=tp, pp=pp, cp=0, ep=0)
            start = step * 1000
            records.append(
                StepRecord(
                    job="hand",
                    step=step,
                    rank=rank,
                    coord=coord,
                    node="node-0",
                    start_us=start,
                    end_us=start + 900,
                    intervals=tuple(ivs),
                )
            )
    return records


def test_hand_made_records_are_counted_per_stage_by_hand() -> None:
    spec = spec_from_manifest(SMALL)
    plan = plan_job(spec)
    got = {(c.pp_rank, c.axis, c.op): c for c in compare_collectives(RecordTable.from_records(hand_records()), plan)}
    # Stage 0, tp all-reduce: 8 MiB on 11 of 12 rank-steps, 3 MiB on one: median 8 MiB; 23 intervals of 91 MiB.
    ag = got[(0, "tp", "all_reduce")]
    assert (ag.measured_bytes_per_step, ag.measured_min_bytes_per_step, ag.measured_max_bytes_per_step) == (
        8 * MIB,
        3 * MIB,
        8 * MIB,
    )
    assert ag.measured_count_per_step == 2
    assert ag.measured_message_bytes == pytest.approx((11 * 8 + 3) * MIB / 23)
    assert (ag.share_of_rank_steps, ag.sized_share) == (1.0, 1.0)
    assert got[(1, "tp", "all_reduce")].measured_min_bytes_per_step == 8 * MIB  # nothing missing on stage 1
    # Point-to-point: stage 0 counts its 2 sends (not the receives), stage 1 its 3 receives (it records no send).
    p0, p1 = got[(0, "pp", "send_recv")], got[(1, "pp", "send_recv")]
    assert (p0.measured_bytes_per_step, p0.measured_count_per_step) == (2 * MIB, 2)
    assert (p1.measured_bytes_per_step, p1.measured_count_per_step) == (3 * MIB, 3)
    # The plan's pipeline sends: the tiny model's b·s·h activations of 4 micro-batches (8 sequences over dp 2).
    assert p0.expected_count_per_step == 4
    assert p0.expected_bytes_per_step == 4 * p0.expected_message_bytes
    assert p0.ratio == pytest.approx(2 * MIB / p0.expected_bytes_per_step)
    assert p0.delta_bytes_per_step == pytest.approx(2 * MIB - p0.expected_bytes_per_step)
    # dp reduce-scatter: not in the plan (it all-reduces); sizes on 6 of 12 intervals of stage 0, none on stage 1.
    rs0, rs1 = got[(0, "dp", "reduce_scatter")], got[(1, "dp", "reduce_scatter")]
    assert (rs0.status, rs0.sized_share, rs0.measured_message_bytes) == ("records_only", 0.5, 16 * MIB)
    assert rs0.measured_bytes_per_step == 8 * MIB  # 16 MiB on 6 rank-steps, 0 on 6: the midpoint
    assert (rs1.measured_bytes_per_step, rs1.measured_count_per_step, rs1.sized_share) == (None, 1, 0.0)
    # A barrier in one step of three: the median rank-step runs none; its share says so.
    barrier = got[(1, "dp", "barrier")]
    assert (barrier.measured_count_per_step, barrier.share_of_rank_steps, barrier.status) == (0, 1 / 3, "records_only")
    # What the plan has and the records do not.
    assert got[(0, "dp", "all_reduce")].status == "plan_only"
    assert got[(0, "dp", "all_reduce")].measured_bytes_per_step is None
    assert list(got) == sorted(got, key=lambda k: (k[0], ["dp", "tp", "pp", "cp", "ep"].index(k[1]), k[2]))


def test_statuses_of_sizes_missing_in_part_or_whole() -> None:
    spec = spec_from_manifest(SMALL)
    plan = plan_job(spec)
    table = RecordTable.from_records(hand_records())
    iv = table.intervals
    tp = np.flatnonzero(iv.op == OP_CODE["all_reduce"])
    size = iv.size_bytes.copy()
    size[tp[::2]] = -1  # every other tp all-reduce interval loses its size
    got = {(c.pp_rank, c.axis, c.op): c for c in compare_collectives(with_intervals(table, size=size), plan)}
    assert got[(1, "tp", "all_reduce")].status == "partial_sizes"
    assert got[(1, "tp", "all_reduce")].sized_share == 0.5
    size[tp] = -1
    got = {(c.pp_rank, c.axis, c.op): c for c in compare_collectives(with_intervals(table, size=size), plan)}
    row = got[(1, "tp", "all_reduce")]
    assert (row.status, row.measured_bytes_per_step, row.measured_count_per_step) == ("no_sizes", None, 2)
    assert {c.status for c in got.values()} <= set(STATUSES)


def test_records_without_any_collective_leave_every_planned_row_plan_only() -> None:
    table = RecordTable.from_records(hand_records())
    bare = with_intervals(table, keep=table.intervals.kind < KIND_CODE["comm"])
    assert len(stage_traffic(bare, stage_of_rows(bare), split_sizes_except={"all_to_all"})) == 0
    rows = compare_collectives(bare, plan_job(spec_from_manifest(SMALL)))
    assert rows
    assert {c.status for c in rows} == {"plan_only"}


def test_stage_traffic_splits_by_message_size_except_the_named_ops() -> None:
    table = RecordTable.from_records(hand_records())
    traffic = stage_traffic(table, stage_of_rows(table), split_sizes_except={"reduce_scatter"})
    keys = {
        (int(s), int(o), int(z)): traffic.segment(j)
        for j, (s, o, z) in enumerate(zip(traffic.pp_rank, traffic.op, traffic.size_bytes, strict=True))
    }
    stage0_ar = [(z, int(traffic.count[keys[(0, OP_CODE["all_reduce"], z)]].sum())) for z in (3 * MIB, 5 * MIB)]
    assert stage0_ar == [(3 * MIB, 12), (5 * MIB, 11)]
    # Not split: one key for sized and unsized reduce-scatters alike.
    assert [z for (s, o, z) in keys if o == OP_CODE["reduce_scatter"]] == [-1, -1]
    seg = keys[(0, OP_CODE["reduce_scatter"], -1)]
    assert (int(traffic.count[seg].sum()), int(traffic.sized[seg].sum())) == (12, 6)
    assert float(traffic.total_bytes[seg].sum()) == 6 * 16 * MIB
    assert traffic.rows[seg].size == 12  # every rank-step of stage 0
    # Rank-steps given no stage (-1) are left out.
    stage = stage_of_rows(table)
    stage[stage == 1] = -1
    assert set(stage_traffic(table, stage).pp_rank.tolist()) == {0}


# ---------------------------------------------------------------------------- clean simulated jobs agree

LAYOUTS = {
    "pp4-1f1b-tp2": ({"preset": "llama3-8b"}, {"tp": 2, "pp": 4, "dp": 4}, {"globalBatchSize": 32}),
    "pp4-interleaved-vpp2": (
        {"preset": "llama3-8b"},
        {"tp": 2, "pp": 4, "dp": 4, "vpp": 2},
        {"globalBatchSize": 32, "pipelineSchedule": "interleaved"},
    ),
    "pp4-gpipe": ({"preset": "llama3-8b"}, {"pp": 4, "dp": 8}, {"globalBatchSize": 32, "pipelineSchedule": "gpipe"}),
    "moe-ep4-sp-distributed-optimizer": (
        {"preset": "mixtral-8x7b"},
        {"tp": 2, "ep": 4, "pp": 2, "dp": 8, "sequenceParallel": True},
        {"globalBatchSize": 16, "distributedOptimizer": True},
    ),
    "moe-etp1": ({"preset": "mixtral-8x7b"}, {"tp": 2, "etp": 1, "ep": 4, "pp": 2, "dp": 8}, {"globalBatchSize": 16}),
    "cp2-ring-distributed-optimizer": (
        {"preset": "llama3-8b"},
        {"tp": 2, "cp": 2, "pp": 2, "dp": 4},
        {"globalBatchSize": 8, "distributedOptimizer": True},
    ),
    "zero3-dp32": ({"preset": "llama3-8b"}, {"dp": 32}, {"globalBatchSize": 64, "zeroStage": 3}),
    "zero3-pp4": ({"preset": "llama3-8b"}, {"dp": 8, "pp": 4}, {"globalBatchSize": 64, "zeroStage": 3}),
    "zero2-tp2": ({"preset": "llama3-8b"}, {"tp": 2, "dp": 16}, {"globalBatchSize": 64, "zeroStage": 2}),
    "tied-embeddings-pp2": ({"preset": "gpt3-175b", "layers": 8}, {"tp": 2, "pp": 2, "dp": 8}, {"globalBatchSize": 32}),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_clean_simulated_job_agrees_with_the_plan_on_every_row(name: str) -> None:
    model, parallelism, training = LAYOUTS[name]
    spec = spec_from_manifest(manifest(model, parallelism, training))
    result = simulate(spec, steps=2, faults=[Noise(sigma=0.02)])  # noise moves times, never bytes
    rows = compare_collectives(result.table, result.plan)
    planned = planned_bytes(result.plan)
    assert {(c.pp_rank, c.axis, c.op) for c in rows} == set(planned)
    for c in rows:
        where = (name, c.pp_rank, c.axis, c.op)
        assert c.status == "match", where
        assert c.expected_bytes_per_step == planned[(c.pp_rank, c.axis, c.op)], where
        # Per-interval sizes are rounded to whole bytes: a tight tolerance, far inside MATCH_TOLERANCE.
        assert c.measured_bytes_per_step == pytest.approx(c.expected_bytes_per_step, rel=1e-6), where
        assert c.measured_min_bytes_per_step == pytest.approx(c.measured_max_bytes_per_step, rel=1e-6), where
        assert (c.share_of_rank_steps, c.sized_share) == (1.0, 1.0), where
    # (A per-stage "total = sum of the rows" check held by construction and is gone. This test checks that the
    # simulator and the comparison agree with the plan; that the plan is right is checked against hand counts by
    # test_the_plan_and_the_simulated_records_carry_the_hand_counted_bytes.)


# The checks above compare records with the plan, and the simulator builds its records from the plan's collectives:
# they cannot catch a planner error (a ZeRO-2 reduce-scatter issued once per step instead of once per micro-batch
# passed them). These counts and bytes are written out by hand from the model and the layout, and both the plan and
# the simulated records must carry them.
#
# llama3-8b (Meta's config): L = 32 layers, h = 4096, a = 32 heads of d = 128, g = 8 KV heads, SwiGLU f = 14336,
# V = 128,256 untied, s = 8192; micro-batch b = 1, bf16 activations, fp32 gradient reduction.
L8, H8, A8, G8, D8, F8, V8, S8 = 32, 4096, 32, 8, 128, 14336, 128_256, 8192
X8 = S8 * H8 * 2  # one micro-batch of activations [s, b, h] in bf16: 67,108,864 bytes
CE8 = 3 * S8 * 4  # the vocabulary-parallel cross entropy's three fp32 all-reduces per token (max, target, sum)


def l8_layer_params(t: int) -> int:
    """One layer on a tensor-parallel rank: Q, O (h x a·d), K, V (h x g·d) and the MLP split over t; two norms whole."""
    return (2 * H8 * A8 * D8 + 2 * H8 * G8 * D8 + 3 * H8 * F8) // t + 2 * H8


def test_hand_counted_llama3_8b_parameters() -> None:
    assert l8_layer_params(1) == 218_112_000
    assert L8 * l8_layer_params(1) + 2 * V8 * H8 + H8 == 8_030_261_248  # "8B"


def _hand_bytes() -> dict[str, dict[tuple[int, str, str], int]]:
    """(stage, axis, op) -> bytes per GPU per step (messages x count, not bus bytes), by hand, per layout."""
    out: dict[str, dict[tuple[int, str, str], int]] = {}
    # zero2-tp2: tp=2, dp=16, global batch 64 -> m = 64 / 16 = 4 micro-batches.
    m, p = 4, L8 * l8_layer_params(2) + V8 * H8 // 2 * 2 + H8  # 4,015,263,744 params per GPU
    out["zero2-tp2"] = {
        # 4 layer all-reduces per layer per micro-batch (2 forward, 2 backward; Narayanan §3.2), the embedding
        # output (forward) and the output layer's input gradient (backward) once per micro-batch, and the
        # cross entropy's three small ones.
        (0, "tp", "all_reduce"): 4 * L8 * m * X8 + m * X8 + m * X8 + 3 * m * (CE8 // 3),
        (0, "dp", "reduce_scatter"): m * p * 4,  # ZeRO-2: fp32 gradients every micro-batch
        (0, "dp", "all_gather"): p * 2,  # bf16 weights once per step
    }
    # pp4-1f1b-tp2: tp=2, pp=4, dp=4, global batch 32 -> m = 8; 8 layers per stage.
    m, layers = 8, 8 * l8_layer_params(2)
    out["pp4-1f1b-tp2"] = {
        (0, "tp", "all_reduce"): 4 * 8 * m * X8 + m * X8,  # layers + embedding output
        (0, "pp", "send"): m * X8,  # activations forward
        (0, "dp", "all_reduce"): (layers + V8 * H8 // 2) * 4,
        (1, "tp", "all_reduce"): 4 * 8 * m * X8,
        (1, "pp", "send"): 2 * m * X8,  # activations forward, their gradients backward
        (1, "dp", "all_reduce"): layers * 4,
        (2, "tp", "all_reduce"): 4 * 8 * m * X8,
        (2, "pp", "send"): 2 * m * X8,
        (2, "dp", "all_reduce"): layers * 4,
        (3, "tp", "all_reduce"): 4 * 8 * m * X8 + m * X8 + m * CE8,  # layers + output gradient + cross entropy
        (3, "pp", "send"): m * X8,  # gradients backward
        (3, "dp", "all_reduce"): (layers + H8 + V8 * H8 // 2) * 4,
    }
    # zero3-dp32: dp=32, global batch 64 -> m = 2. FSDP2: every layer gathered (bf16) before its forward and again
    # before its backward, its fp32 gradients reduce-scattered, every micro-batch; the root unit (embedding, output
    # layer, final norm) gathered once and reduced once per micro-batch.
    m, layer, root = 2, l8_layer_params(1), 2 * V8 * H8 + H8
    out["zero3-dp32"] = {
        (0, "dp", "all_gather"): 2 * L8 * m * layer * 2 + m * root * 2,
        (0, "dp", "reduce_scatter"): L8 * m * layer * 4 + m * root * 4,
    }
    return out


HAND_BYTES = _hand_bytes()


def _recorded_bytes(result, step: int = 1) -> dict[tuple[int, str, str], float]:
    """(stage, axis, op) -> bytes per rank-step in the records of ``step`` (comm intervals and p2p sends)."""
    t, iv = result.table, result.table.intervals
    stage_of_row = t.steps.coord[:, AXES.index(MeshAxis.PP)]
    rows = np.flatnonzero(t.steps.step == step)
    sel = np.isin(iv.row, rows) & (
        (iv.kind == KIND_CODE["comm"]) | ((iv.kind == KIND_CODE["p2p"]) & (iv.op == OP_CODE["send"]))
    )
    out: dict[tuple[int, str, str], float] = defaultdict(float)
    ops = {code: name for name, code in OP_CODE.items()}
    for r, a, o, z in zip(iv.row[sel], iv.axis[sel], iv.op[sel], iv.size_bytes[sel], strict=True):
        out[(int(stage_of_row[r]), AXES[int(a)].value, ops[int(o)])] += float(z)
    per_stage = np.bincount(stage_of_row[rows])
    return {k: v / per_stage[k[0]] for k, v in out.items()}


@pytest.mark.parametrize("name", sorted(HAND_BYTES))
def test_the_plan_and_the_simulated_records_carry_the_hand_counted_bytes(name: str) -> None:
    model, parallelism, training = LAYOUTS[name]
    spec = spec_from_manifest(manifest(model, parallelism, training))
    expected = HAND_BYTES[name]
    planned = {k: v for k, v in planned_bytes(plan_job(spec)).items() if k[1] != "pp"}
    planned.update({(k[0], "pp", "send"): v for k, v in planned_bytes(plan_job(spec)).items() if k[1] == "pp"})
    assert planned == pytest.approx(expected, rel=1e-12)
    recorded = _recorded_bytes(simulate(spec, steps=2))
    assert set(recorded) == set(expected)
    for key, value in expected.items():
        assert recorded[key] == pytest.approx(value, rel=1e-6), (name, key)


def test_analyze_reports_the_per_stage_comparison_in_text_and_json() -> None:
    model, parallelism, training = LAYOUTS["cp2-ring-distributed-optimizer"]
    spec = spec_from_manifest(manifest(model, parallelism, training))
    result = simulate(spec, steps=2)
    analysis = analyze(result.table, spec=spec, plan=result.plan)
    rows = analysis.to_dict()["expected_vs_measured"]["collectives"]
    assert {r["status"] for r in rows} == {"match"}
    assert {r["pp_rank"] for r in rows} == {0, 1}
    assert set(rows[0]) == {
        "pp_rank",
        "axis",
        "op",
        "expected_bytes_per_step",
        "measured_bytes_per_step",
        "ratio",
        "delta_bytes_per_step",
        "measured_min_bytes_per_step",
        "measured_max_bytes_per_step",
        "expected_count_per_step",
        "measured_count_per_step",
        "expected_message_bytes",
        "measured_message_bytes",
        "share_of_rank_steps",
        "sized_share",
        "status",
    }
    text = render_analysis(analysis)
    assert "Collectives per GPU per step, by pipeline stage" in text
    assert "not bus bytes" in text
    assert f"{len(rows)} of {len(rows)} compared rows match within 1.0 % in bytes per step" in text
    assert "fewer, larger collectives per step than the plan counts, the same bytes in all" in text


# ---------------------------------------------------------------------------- perturbed records show the difference


@pytest.fixture(scope="module")
def simulated():
    """A clean pp2 tp2 cp2 dp4 job: dp all-gather and reduce-scatter, tp all-reduces, pipeline sends, cp ring."""
    model, parallelism, training = LAYOUTS["cp2-ring-distributed-optimizer"]
    result = simulate(spec_from_manifest(manifest(model, parallelism, training)), steps=2)
    return result.table, result.plan


def _by_key(table, plan):
    return {(c.pp_rank, c.axis, c.op): c for c in compare_collectives(table, plan)}


def _intervals_of(table, *, stage: int, axis: str, op: str):
    iv = table.intervals
    stage_of = stage_of_rows(table)[iv.row]
    return np.flatnonzero((stage_of == stage) & (iv.op == OP_CODE[op]) & (iv.axis == AXIS_CODE[axis]))


def test_dropping_one_collective_per_rank_step_shows_its_bytes_missing(simulated) -> None:
    table, plan = simulated
    rows = _intervals_of(table, stage=1, axis="tp", op="all_reduce")
    first = rows[np.unique(table.intervals.row[rows], return_index=True)[1]]  # each rank-step's first tp all-reduce
    dropped = table.intervals.size_bytes[first]
    assert np.unique(dropped).size == 1  # the same interval on every rank-step of a clean run
    keep = np.ones(table.n_intervals, dtype=bool)
    keep[first] = False
    before, after = _by_key(table, plan), _by_key(with_intervals(table, keep=keep), plan)
    row = after[(1, "tp", "all_reduce")]
    assert row.status == "differs"
    assert row.measured_bytes_per_step == before[(1, "tp", "all_reduce")].measured_bytes_per_step - dropped[0]
    assert row.delta_bytes_per_step == pytest.approx(-float(dropped[0]), abs=2.0)
    assert row.measured_count_per_step == before[(1, "tp", "all_reduce")].measured_count_per_step - 1
    changed = {k for k in before if before[k].to_dict() != after[k].to_dict()}
    assert changed == {(1, "tp", "all_reduce")}


def test_dropping_a_whole_kind_leaves_it_plan_only(simulated) -> None:
    table, plan = simulated
    gone = _intervals_of(table, stage=0, axis="cp", op="recv")  # the simulator records the ring's receives
    keep = np.ones(table.n_intervals, dtype=bool)
    keep[gone] = False
    row = _by_key(with_intervals(table, keep=keep), plan)[(0, "cp", "send_recv")]
    assert (row.status, row.measured_bytes_per_step, row.expected_bytes_per_step > 0) == ("plan_only", None, True)


def test_doubling_a_message_on_every_rank_step_of_a_stage_shows_the_excess(simulated) -> None:
    table, plan = simulated
    rs = _intervals_of(table, stage=0, axis="dp", op="reduce_scatter")
    first = rs[np.unique(table.intervals.row[rs], return_index=True)[1]]
    size = table.intervals.size_bytes.copy()
    extra = int(size[first][0])
    size[first] *= 2
    row = _by_key(with_intervals(table, size=size), plan)[(0, "dp", "reduce_scatter")]
    assert row.status == "differs"
    assert row.delta_bytes_per_step == pytest.approx(extra, abs=2.0)
    assert row.measured_count_per_step == row.expected_count_per_step  # same count, larger messages
    assert row.measured_message_bytes > row.expected_message_bytes


def test_one_rank_that_differs_keeps_the_median_and_shows_in_the_range(simulated) -> None:
    table, plan = simulated
    rs = _intervals_of(table, stage=1, axis="dp", op="all_gather")
    mine = rs[table.steps.rank[table.intervals.row[rs]] == int(table.steps.rank[table.intervals.row[rs][0]])]
    size = table.intervals.size_bytes.copy()
    size[mine] *= 2
    row = _by_key(with_intervals(table, size=size), plan)[(1, "dp", "all_gather")]
    assert row.status == "match"  # one rank of 16 on the stage: the median is the stage's
    assert row.measured_max_bytes_per_step == pytest.approx(2 * row.expected_bytes_per_step, rel=1e-6)
    assert row.measured_min_bytes_per_step == pytest.approx(row.expected_bytes_per_step, rel=1e-6)
    text = render_analysis(analyze(with_intervals(table, size=size), plan=plan))
    assert "stage 1 dp all_gather: rank-steps differ, from" in text


# ---------------------------------------------------------------------------- the run comparison stays exact


def records_from_plan(plan, *, steps: int, setup: bool = False, drop: tuple[int, str, str] | None = None):
    """Records that run exactly the plan's instances (each its own interval); ``setup``: a 4-byte pp send in the
    first step only; ``drop``: (stage, axis, op): its first plan entry loses one instance in every step after the
    first."""
    records = []
    for step in range(steps):
        for rank in range(plan.world_size):
            c = plan.layout.coord(rank)
            ivs: list[Interval] = []
            entries = [
                (p.axis, p.op.value.replace("-", "_"), p.message_bytes, p.count_per_step)
                for p in plan.stages[c.pp].collectives
            ]
            if setup and step == 0:
                entries.append(("pp", "send_recv", 4, 1))
            dropping = drop is not None and drop[0] == c.pp and step > 0
            for axis, op, size, count in entries:
                n = count - (1 if dropping and (axis, op) == drop[1:] else 0)
                dropping &= n == count  # only the first entry of that kind
                for _ in range(n):
                    t0 = step * 100_000 + 10 * len(ivs)
                    if op == "send_recv":
                        ivs.append(
                            Interval(
                                kind="p2p",
                                start_us=t0,
                                end_us=t0 + 5,
                                axis=axis,
                                op="send",
                                peer=(rank + 1) % plan.world_size,
                                size_bytes=size,
                            )
                        )
                    else:
                        ivs.append(
                            Interval(
                                kind="comm",
                                start_us=t0,
                                end_us=t0 + 5,
                                axis=axis,
                                op=op,
                                group=f"{axis}:{rank}",
                                seq=10_000 * step + len(ivs),
                                size_bytes=size,
                                group_size=1,
                            )
                        )
            coord = RankCoord(dp=c.dp, tp=c.tp, pp=c.pp, cp=c.cp, ep=c.ep)
            start = step * 100_000
            records.append(
                StepRecord(
                    job="run",
                    step=step,
                    rank=rank,
                    coord=coord,
                    node="node-0",
                    start_us=start,
                    end_us=start + 90_000,
                    intervals=tuple(ivs),
                )
            )
    return records


def test_the_run_comparison_counts_every_instance_by_size_exactly() -> None:
    spec = spec_from_manifest(
        manifest({"preset": "tiny"}, {"dp": 2, "tp": 2, "pp": 2}, {"globalBatchSize": 8}, nodes=1)
    )
    plan = plan_job(spec)
    analysis = analyze(RecordTable.from_records(records_from_plan(plan, steps=3, setup=True)), spec=spec, plan=plan)
    checks = compare_run(analysis).collectives
    setup = [c for c in checks if c.setup_only]
    assert [(c.pp_rank, c.axis, c.op, c.message_bytes, c.first_step_count) for c in setup] == [
        (0, "pp", "send", 4.0, 1),
        (1, "pp", "send", 4.0, 1),
    ]
    compared = [c for c in checks if not c.setup_only]
    assert compared
    assert all(c.exact for c in compared)
    expected: dict[tuple[int, str, str, float], int] = defaultdict(int)
    for stage in plan.stages:
        for p in stage.collectives:
            op = "send" if p.op.value == "send-recv" else p.op.value.replace("-", "_")
            expected[(stage.pp_rank, p.axis, op, float(p.message_bytes))] += p.count_per_step
    assert {(c.pp_rank, c.axis, c.op, c.message_bytes): c.measured_count_per_step for c in compared} == expected
    # One tp all-reduce fewer per step on stage 1 after the first step: that entry alone stops matching.
    dropped = analyze(
        RecordTable.from_records(records_from_plan(plan, steps=3, drop=(1, "tp", "all_reduce"))), spec=spec, plan=plan
    )
    off = [c for c in compare_run(dropped).collectives if not c.exact]
    assert len(off) == 1
    assert (off[0].pp_rank, off[0].axis, off[0].op) == (1, "tp", "all_reduce")
    assert off[0].measured_count_per_step == off[0].expected_count_per_step - 1


# ---------------------------------------------------------------------------- edges the mutation run found


def test_plan_ops_are_spelled_as_the_records_spell_them() -> None:
    # docs/cost-table.md: the plan writes ops with a hyphen, the records with an underscore; an op outside the
    # table is spelled the same way, not dropped.
    assert [plan_op_name(op) for op in ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "send-recv")] == [
        "all_reduce",
        "reduce_scatter",
        "all_gather",
        "all_to_all",
        "send_recv",
    ]
    assert plan_op_name("all-to-all-v") == "all_to_all_v"


def test_unsized_records_have_no_byte_range() -> None:
    # hand_records: stage 1's reduce-scatter carries no size on any rank-step: no bytes, no smallest, no largest.
    plan = plan_job(spec_from_manifest(SMALL))
    got = {(c.pp_rank, c.axis, c.op): c for c in compare_collectives(RecordTable.from_records(hand_records()), plan)}
    rs1 = got[(1, "dp", "reduce_scatter")]
    assert (rs1.measured_min_bytes_per_step, rs1.measured_max_bytes_per_step) == (None, None)
    assert rs1.expected_message_bytes is None  # not in the plan: nothing to divide


def test_unsplit_traffic_has_no_message_size_and_keeps_table_order() -> None:
    # Without splitting by size every key's size is -1 (not known per key). 8 ranks x 8 steps of hand-made records
    # (32 rank-steps per stage, enough for numpy's unstable sort to reorder): each key's segment lists its stage's
    # rank-steps in table order, as StageTraffic documents.
    def later(r: StepRecord, k: int) -> StepRecord:  # the same step k x 3 steps later, its collectives numbered on
        shift = 3000 * k
        ivs = tuple(
            replace(
                i, start_us=i.start_us + shift, end_us=i.end_us + shift, seq=None if i.seq is None else i.seq + shift
            )
            for i in r.intervals
        )
        return replace(r, step=r.step + 3 * k, start_us=r.start_us + shift, end_us=r.end_us + shift, intervals=ivs)

    records = [later(r, k) for k in range(3) for r in hand_records()][: 8 * 8]
    table = RecordTable.from_records(records)
    traffic = stage_traffic(table, stage_of_rows(table))
    assert set(traffic.size_bytes.tolist()) == {-1}
    for j in range(len(traffic)):
        rows = traffic.rows[traffic.segment(j)]
        assert rows.size == 32
        assert (np.diff(rows) > 0).all(), j

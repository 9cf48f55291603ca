"""The cost table, summary, partial-data notes and expected vs measured: hand-computed numbers on tiny jobs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from meshscope.analysis import analyze, read_inputs, render_analysis
from meshscope.analysis.breakdown import CATEGORIES
from meshscope.analysis.costs import (
    category_label,
    expected_by_category,
    grouped_median,
    stage_expected,
)
from meshscope.cli import build_parser, main
from meshscope.errors import ParseError
from meshscope.jobs.loading import load_spec_text
from meshscope.plan import plan_job
from meshscope.records import BetweenSteps, DataStats, Interval, RecordTable, StepRecord, write_records
from meshscope.topology.layout import RankCoord

MS = 1000  # µs per ms
DATA_DIR = Path(__file__).parent.parent / "data"


# ---------------------------------------------------------------------------- a 4-rank dp job with one straggler
#
# Every step (18 ms): data 0.2 ms; compute 10 ms (rank 3: 13 ms); dp all-reduce entered at the end of compute, the
# transfer starts when rank 3 arrives and takes 3 ms; optimizer 1.8 ms. So ranks 0-2 wait 3 ms in sync wait and
# rank 3 none; every rank-step is exactly 18 ms.


def straggler_records(*, steps: int = 2, drop: tuple[int, int] | None = None, lose_comm: tuple[int, int] | None = None):
    records = []
    for step in range(steps):
        t0 = step * 18 * MS
        for rank in range(4):
            if drop == (rank, step):
                continue
            compute_end = t0 + 200 + (13 * MS if rank == 3 else 10 * MS)
            ivs = [
                Interval(kind="data", start_us=t0, end_us=t0 + 200),
                Interval(kind="compute", start_us=t0 + 200, end_us=compute_end, phase="forward"),
                Interval(kind="optimizer", start_us=t0 + 16_200, end_us=t0 + 18 * MS),
            ]
            if lose_comm != (rank, step):
                ivs.append(
                    Interval(
                        kind="comm",
                        start_us=compute_end,
                        end_us=t0 + 16_200,
                        axis="dp",
                        op="all_reduce",
                        group="dp:0",
                        seq=step,
                        size_bytes=64 << 20,
                        group_size=4,
                    )
                )
            records.append(
                StepRecord(
                    job="costs",
                    step=step,
                    rank=rank,
                    coord=RankCoord(dp=rank, tp=0, pp=0, cp=0, ep=0),
                    node=f"node-{rank}",
                    start_us=t0,
                    end_us=t0 + 18 * MS,
                    intervals=tuple(ivs),
                    stats=DataStats(tokens=4096, longest_sequence=2048, peak_memory_bytes=(30 + rank) << 30),
                    gpu_util=0.95,
                )
            )
    return records


def straggler_table(**kw) -> RecordTable:
    return RecordTable.from_records(straggler_records(**kw))


def row(analysis, category):
    return next(r for r in analysis.rows if r.category == category)


def test_cost_rows_hand_computed() -> None:
    a = analyze(straggler_table())
    assert [r.category for r in a.rows] == [
        "compute",
        "comm.dp.transfer",
        "comm.dp.sync_wait",
        "bubble",
        "data",
        "optimizer",
        "checkpoint",
        "other",
    ]
    compute = row(a, "compute")
    assert compute.measured_median_seconds == pytest.approx(0.010)
    assert compute.measured_p95_seconds == pytest.approx(0.013)  # 6 x 10 ms, 2 x 13 ms: the 95th is 13 ms
    assert compute.worst_rank == 3
    assert compute.worst_seconds == pytest.approx(0.013)
    assert compute.share_of_step == pytest.approx(10 / 18)
    assert compute.gpu_hours_per_day == pytest.approx(10 / 18 * 4 * 24)
    assert compute.expected_seconds is None
    assert compute.delta_seconds is None

    wait = row(a, "comm.dp.sync_wait")
    assert wait.label == "dp sync wait"
    assert wait.measured_median_seconds == pytest.approx(0.003)
    assert wait.share_of_step == pytest.approx(3 / 18)
    assert wait.gpu_hours_per_day == pytest.approx(16.0)
    assert wait.worst_rank == 0  # ranks 0-2 tie at 3 ms; the lowest wins
    assert wait.suspect is not None
    assert (wait.suspect.rank, wait.suspect.node, wait.suspect.group) == (3, "node-3", "dp:0")
    assert wait.suspect.message == (
        "rank 3 on node-3 makes its dp group dp:0 wait 3.00 ms per step (9.00 ms of GPU time over 3 waiting ranks)"
    )

    transfer = row(a, "comm.dp.transfer")
    assert transfer.measured_median_seconds == pytest.approx(0.003)
    assert transfer.suspect is not None
    assert transfer.suspect.message.startswith("spread evenly over ranks")
    assert row(a, "optimizer").measured_median_seconds == pytest.approx(0.0018)
    assert row(a, "data").measured_median_seconds == pytest.approx(0.0002)
    assert row(a, "bubble").suspect is None
    assert row(a, "bubble").worst_rank is None
    assert sum(r.measured_median_seconds for r in a.rows) == pytest.approx(0.018)


def test_summary_hand_computed() -> None:
    s = analyze(straggler_table()).summary
    assert s.median_step_seconds == pytest.approx(0.018)
    assert s.max_step_seconds == pytest.approx(0.018)
    # Own time (step - sync wait): 15 ms for ranks 0-2, 18 ms for rank 3.
    assert s.slowest_rank == 3
    assert s.straggler_gap_seconds == pytest.approx(0.003)
    # No plan: ideal = median of compute + optimizer = 10 + 1.8 ms.
    assert s.ideal_step_seconds == pytest.approx(0.0118)
    assert s.efficiency == pytest.approx(11.8 / 18)
    assert s.useful_compute_share == pytest.approx(10 / 18)
    assert s.reported_gpu_util == pytest.approx(0.95)


def test_the_straggler_gap_is_a_mean_within_a_pipeline_stage_against_its_median_rank() -> None:
    """pp=2 with dp=2 per stage: stage 1 computes 20 ms a step (the logits), stage 0 10 ms, and rank 1 of stage 0
    stalls 8 ms in one step of four. No collective: own time is the step. The stage's heavier work is no straggler;
    rank 1's stall is 2 ms per step on average beyond its stage's median rank (of two, the lower: rank 0 at 10 ms),
    the whole gap between the two, as a finding quotes a pair."""
    records = []
    for step in range(4):
        t0 = step * 40 * MS
        for rank in range(4):
            pp, dp = divmod(rank, 2)
            compute_us = (20 if pp else 10) * MS + (8 * MS if (rank, step) == (1, 2) else 0)
            records.append(
                StepRecord(
                    job="stages",
                    step=step,
                    rank=rank,
                    coord=RankCoord(dp=dp, tp=0, pp=pp, cp=0, ep=0),
                    node="node-0",
                    start_us=t0,
                    end_us=t0 + compute_us,
                    intervals=(Interval(kind="compute", start_us=t0, end_us=t0 + compute_us, phase="forward"),),
                )
            )
    s = analyze(RecordTable.from_records(records)).summary
    assert s.slowest_rank == 1
    assert s.straggler_gap_seconds == pytest.approx(0.002)


def test_the_time_between_steps_is_summed_up_for_the_median_rank_and_said() -> None:
    """Every step of 10 ms is followed by 5 ms between steps on rank 0 (3 ms of it an evaluation) and 7 ms on rank 1
    (3 ms eval, 2 ms a save): no step's breakdown holds it. The median rank (the lower of two: rank 0) spends 5 ms per
    step there, half as much again as its step, 1 ms of it (in its evaluation) waiting in a collective."""
    records = []
    for step in range(4):
        t0 = step * 20 * MS
        for rank in range(2):
            gap, between = None, None
            if step:
                gap = (5 if rank == 0 else 7) * MS
                between = BetweenSteps(
                    eval_us=3 * MS, checkpoint_us=0 if rank == 0 else 2 * MS, comm_us=MS if rank == 0 else 0
                )
            records.append(
                StepRecord(
                    job="gaps",
                    step=step,
                    rank=rank,
                    coord=RankCoord(dp=rank, tp=0, pp=0, cp=0, ep=0),
                    node="node-0",
                    start_us=t0,
                    end_us=t0 + 10 * MS,
                    intervals=(Interval(kind="compute", start_us=t0, end_us=t0 + 10 * MS, phase="forward"),),
                    gap_before_us=gap,
                    between_steps=between,
                )
            )
    a = analyze(RecordTable.from_records(records))
    assert a.summary.between_steps_seconds == pytest.approx(0.005)
    assert a.summary.between_steps_kinds_seconds == pytest.approx({"eval": 0.003, "unlabelled": 0.002})
    assert a.summary.between_steps_comm_seconds == pytest.approx(0.001)
    assert (
        "  between steps: 5.00 ms per step at the median rank (eval 3.00 ms, unlabelled 2.00 ms; 1.00 ms of it blocked "
        "in collectives), 50.0 % on top of "
        "the median step: outside every step, so not in the table above"
    ) in render_analysis(a).splitlines()
    assert analyze(straggler_table()).summary.between_steps_seconds is None  # records without the gap fields
    assert "between steps:" not in render_analysis(analyze(straggler_table()))


def test_unused_axes_are_left_out_but_used_ones_stay_at_zero() -> None:
    a = analyze(straggler_table())
    axes = {r.category.split(".")[1] for r in a.rows if r.category.startswith("comm.")}
    assert axes == {"dp"}


def test_checkpoint_row_is_amortised() -> None:
    records = straggler_records(steps=4)
    # Rank 1 checkpoints for 4 ms in step 3 only: the median is 0, the amortised mean is 4 ms / 16 rank-steps.
    patched = []
    for r in records:
        if (r.rank, r.step) == (1, 3):
            end = r.end_us + 4 * MS
            ivs = (*r.intervals, Interval(kind="checkpoint", start_us=r.end_us, end_us=end))
            patched.append(StepRecord(**{**{f: getattr(r, f) for f in r.__slots__}, "end_us": end, "intervals": ivs}))
        else:
            patched.append(r)
    a = analyze(RecordTable.from_records(patched))
    ckpt = row(a, "checkpoint")
    assert ckpt.label == "checkpoint (amortised)"
    assert ckpt.measured_median_seconds == pytest.approx(0.004 / 16)
    assert ckpt.worst_rank == 1
    assert ckpt.worst_seconds == pytest.approx(0.001)  # 4 ms over rank 1's 4 steps
    # p95 amortised as well: over the 4 ranks' means (0, 1, 0, 0 ms), 0.85 ms; of rank-steps it would be 1 ms here,
    # and 0 for a save in fewer than 1 in 20 rank-steps, under the row's own median
    assert ckpt.measured_p95_seconds == pytest.approx(0.00085)
    assert ckpt.measured_median_seconds <= ckpt.measured_p95_seconds <= ckpt.worst_seconds


def test_to_dict_has_exactly_the_documented_keys() -> None:
    d = analyze(straggler_table()).to_dict()
    assert list(d) == [
        "job",
        "world_size",
        "ranks_seen",
        "device",
        "steps",
        "partial_data",
        "summary",
        "rows",
        "expected_vs_measured",
        "findings",
    ]
    assert d["steps"] == {"first": 0, "last": 1, "count": 2}
    assert (d["job"], d["world_size"], d["ranks_seen"]) == ("costs", 4, 4)
    assert set(d["summary"]) == {
        "median_step_seconds",
        "max_step_seconds",
        "straggler_gap_seconds",
        "slowest_rank",
        "efficiency",
        "ideal_step_seconds",
        "ideal_step_source",
        "useful_compute_share",
        "reported_gpu_util",
        "between_steps_seconds",
        "between_steps_kinds_seconds",
        "between_steps_comm_seconds",
    }
    assert set(d["rows"][0]) == {
        "category",
        "label",
        "expected_seconds",
        "expected_basis",
        "measured_median_seconds",
        "measured_p95_seconds",
        "worst_rank",
        "worst_seconds",
        "share_of_step",
        "delta_seconds",
        "gpu_hours_per_day",
        "suspect",
    }
    assert set(d["rows"][0]["suspect"]) == {"rank", "node", "group", "message"}
    assert d["expected_vs_measured"] == {"collectives": [], "memory": []}
    finding = d["findings"][0]
    assert set(finding) == {"code", "severity", "message", "evidence", "suspects"}
    assert set(finding["suspects"][0]) == {"rank", "node", "group"}
    json.dumps(d)  # serialisable as is


# ---------------------------------------------------------------------------- partial data


def test_missing_rank_step_marks_every_row() -> None:
    a = analyze(straggler_table(drop=(2, 1)))
    codes = {n.code: n for n in a.partial_data}
    assert codes["missing_rank_steps"].count == 1
    assert "1 of 8 rank-steps (4 ranks x 2 steps) have no record" in codes["missing_rank_steps"].message
    assert all(r.label.endswith("(partial data)") for r in a.rows)
    assert all(r.partial for r in a.rows)


def test_incomplete_collective_marks_the_axis_rows_only() -> None:
    a = analyze(straggler_table(lose_comm=(1, 1)))
    codes = {n.code: n for n in a.partial_data}
    assert codes["incomplete_collectives"].count == 1
    partial = {r.category for r in a.rows if r.partial}
    assert partial == {"comm.dp.transfer", "comm.dp.sync_wait"}
    assert row(a, "comm.dp.sync_wait").label == "dp sync wait (partial data)"


def test_missing_ranks_against_the_world_size() -> None:
    records = [r for r in straggler_records() if r.rank != 1]
    a = analyze(RecordTable.from_records(records))
    codes = {n.code: n for n in a.partial_data}
    assert codes["missing_ranks"].count == 1
    assert "(e.g. rank 1)" in codes["missing_ranks"].message
    assert a.ranks_seen == 3
    assert a.world_size == 3  # no spec: the ranks seen


def test_complete_data_has_no_partial_notes() -> None:
    a = analyze(straggler_table())
    assert a.partial_data == ()
    assert not any(r.partial for r in a.rows)


def test_an_axis_the_coords_enable_without_any_traffic_is_noted() -> None:
    """dp = 4 by the records' coords, yet no dp collective anywhere (e.g. DDP's all-reduces never captured)."""
    table = RecordTable.from_records(
        [
            StepRecord(
                job=r.job, step=r.step, rank=r.rank, coord=r.coord, node=r.node, start_us=r.start_us,
                end_us=r.end_us, intervals=tuple(iv for iv in r.intervals if iv.kind != "comm"), stats=r.stats,
            )
            for r in straggler_records()
        ]
    )  # fmt: skip
    notes = {n.code: n for n in analyze(table).partial_data}
    assert list(notes) == ["missing_axis_traffic"]
    assert notes["missing_axis_traffic"].message.startswith(
        "the records' coords enable dp (dp >= 4) but no record holds a dp collective"
    )
    assert "DDP" in notes["missing_axis_traffic"].message


def test_an_axis_the_plan_enables_without_any_traffic_is_noted() -> None:
    """dp2 tp2 pp2 records with dp and tp collectives but no pipeline transfer; then without tp either."""
    spec = load_spec_text(SPEC)
    notes = analyze(RecordTable.from_records(spec_records()), spec=spec).partial_data
    assert [n.message.split(" but")[0] for n in notes if n.code == "missing_axis_traffic"] == [
        "the layout enables pp (pp=2)"
    ]
    bare = RecordTable.from_records(
        [
            StepRecord(
                job=r.job, step=r.step, rank=r.rank, coord=r.coord, node=r.node, start_us=r.start_us,
                end_us=r.end_us, intervals=tuple(iv for iv in r.intervals if iv.axis != "tp"), stats=r.stats,
            )
            for r in spec_records()
        ]
    )  # fmt: skip
    notes = [n for n in analyze(bare, spec=spec).partial_data if n.code == "missing_axis_traffic"]
    assert [n.message.split(" but")[0] for n in notes] == [
        "the layout enables tp (tp=2)",
        "the layout enables pp (pp=2)",
    ]


def test_empty_table_is_an_input_error() -> None:
    empty = RecordTable.from_records([])
    with pytest.raises(ParseError, match="no step records"):
        analyze(empty)


# ---------------------------------------------------------------------------- with a spec

SPEC = """
apiVersion: meshscope.io/v1alpha1
kind: TrainingJob
metadata: {name: costs}
spec:
  model: {preset: llama3-8b}
  parallelism: {dp: 2, tp: 2, pp: 2}
  training: {microBatchSize: 1, globalBatchSize: 8}
  hardware: {gpu: H100, nodes: 1}
"""


def spec_records(*, on_gpu: bool = True) -> list[StepRecord]:
    """Ranks 0-7 of dp2 tp2 pp2 (Megatron order: tp fastest, then dp, then pp); one step, 100 ms, one tp
    all-reduce of 32 MiB and one dp reduce-scatter of 64 MiB per rank; each on GPU ``rank`` (``on_gpu``), else on
    CPU cores."""
    records = []
    for rank in range(8):
        tp, dp, pp = rank % 2, (rank // 2) % 2, rank // 4
        ivs = [
            Interval(kind="compute", start_us=0, end_us=80 * MS, phase="forward"),
            Interval(
                kind="comm",
                start_us=80 * MS,
                end_us=85 * MS,
                axis="tp",
                op="all_reduce",
                group=f"tp:{rank // 2}",
                seq=0,
                size_bytes=32 << 20,
                group_size=2,
            ),
            Interval(
                kind="comm",
                start_us=85 * MS,
                end_us=95 * MS,
                axis="dp",
                op="reduce_scatter",
                group=f"dp:{pp}-{tp}",
                seq=0,
                size_bytes=64 << 20,
                group_size=2,
            ),
            Interval(kind="optimizer", start_us=95 * MS, end_us=100 * MS),
        ]
        records.append(
            StepRecord(
                job="costs",
                step=0,
                rank=rank,
                coord=RankCoord(dp=dp, tp=tp, pp=pp, cp=0, ep=0),
                node="node-0",
                nvlink_domain="nvl-0",
                gpu=rank if on_gpu else None,
                start_us=0,
                end_us=100 * MS,
                intervals=tuple(ivs),
                stats=DataStats(peak_memory_bytes=(40 + pp) << 30),
            )
        )
    return records


def test_expected_column_maps_the_plan() -> None:
    spec = load_spec_text(SPEC)
    plan = plan_job(spec)
    t = plan.expected_step_time
    expected = expected_by_category(plan)
    assert expected["compute"] == t.compute_seconds
    assert expected["comm.tp.transfer"] == t.exposed_comm_seconds["tp"]
    assert expected["comm.tp.sync_wait"] == 0.0
    assert expected["comm.cp.transfer"] == 0.0
    assert expected["bubble"] == t.bubble_seconds
    assert expected["optimizer"] == t.optimizer_seconds
    assert expected["data"] == 0.0
    assert expected["checkpoint"] is None
    assert expected["other"] is None
    assert set(expected_by_category(None).values()) == {None}

    # Per stage: the stage's own numbers; its bubble adds the wait for the slowest stage.
    s0, s1 = (st.step_time for st in plan.stages)
    assert t.pp_rank == 1
    stage0 = stage_expected(plan, 0)
    assert stage0["compute"] == s0.compute_seconds
    assert stage0["bubble"] == pytest.approx(t.bubble_seconds + t.total_seconds - s0.total_seconds)
    assert stage_expected(plan, 1)["bubble"] == t.bubble_seconds
    # The column is the median over rank-steps of their stage's value: 3 of 4 rank-steps on stage 1 -> stage 1.
    assert expected_by_category(plan, np.array([0, 1, 1, 1]))["compute"] == s1.compute_seconds
    assert expected_by_category(plan, np.array([0, 0, 0, 1]))["compute"] == s0.compute_seconds

    a = analyze(RecordTable.from_records(spec_records()), spec=spec)
    compute = row(a, "compute")
    # 4 rank-steps on each stage: the midpoint of the two stages.
    assert compute.expected_seconds == pytest.approx((s0.compute_seconds + s1.compute_seconds) / 2)
    assert compute.delta_seconds == pytest.approx(0.080 - compute.expected_seconds)
    # pp is in use by the layout, so its rows stay although no record communicates on pp.
    assert {r.category for r in a.rows if r.category.startswith("comm.")} == {
        "comm.dp.transfer",
        "comm.dp.sync_wait",
        "comm.tp.transfer",
        "comm.tp.sync_wait",
        "comm.pp.transfer",
        "comm.pp.sync_wait",
    }
    assert a.summary.ideal_step_seconds == pytest.approx(t.compute_seconds + t.optimizer_seconds)
    assert a.summary.ideal_step_source == "plan"
    assert a.world_size == 8


def test_a_plan_for_gpus_beside_ranks_on_cpu_cores_gives_no_ideal_step() -> None:
    # An H100 spec beside records of CPU ranks (a script tried on a laptop with its cluster's spec): the plan's
    # seconds are an H100's, so the ideal step (and the efficiency) come from the measured compute and optimizer:
    # 80 ms + 5 ms of each 100 ms step, not the plan's milliseconds.
    spec = load_spec_text(SPEC)
    a = analyze(RecordTable.from_records(spec_records(on_gpu=False)), spec=spec)
    assert a.summary.ideal_step_source == "measured"
    assert a.summary.ideal_step_seconds == pytest.approx(0.085)
    assert a.summary.efficiency == pytest.approx(0.85)
    text = render_analysis(a)
    assert "ideal step 85.00 ms = compute + optimizer of the median rank" in text
    gpu = analyze(RecordTable.from_records(spec_records()), spec=spec)
    assert "compute + optimizer as planned" in render_analysis(gpu)


def test_expected_vs_measured_collectives_per_stage_and_memory() -> None:
    spec = load_spec_text(SPEC)
    plan = plan_job(spec)
    a = analyze(RecordTable.from_records(spec_records()), spec=spec)
    by_key = {(c.pp_rank, c.axis, c.op): c for c in a.collectives}
    for stage in (0, 1):
        # Every rank of the stage records one 32 MiB tp all-reduce: 32 MiB per step, where the plan has its own.
        tp = by_key[(stage, "tp", "all_reduce")]
        assert (tp.measured_bytes_per_step, tp.measured_count_per_step, tp.measured_message_bytes) == (
            32 << 20,
            1,
            32 << 20,
        )
        planned = [c for c in plan.stages[stage].collectives if c.axis == "tp" and c.op.value == "all-reduce"]
        assert tp.expected_bytes_per_step == sum(c.message_bytes * c.count_per_step for c in planned)
        assert tp.expected_count_per_step == sum(c.count_per_step for c in planned)
        assert tp.status == "differs"
        assert tp.ratio == pytest.approx((32 << 20) / tp.expected_bytes_per_step)
        # The records' reduce-scatter is not in the plan (no distributed optimizer: it all-reduces), and vice versa.
        assert by_key[(stage, "dp", "reduce_scatter")].status == "records_only"
        assert by_key[(stage, "dp", "reduce_scatter")].measured_bytes_per_step == 64 << 20
        assert by_key[(stage, "dp", "all_reduce")].status == "plan_only"
        # The plan's pipeline sends have no records: measured stays None.
        pp = by_key[(stage, "pp", "send_recv")]
        assert (pp.status, pp.measured_bytes_per_step, pp.measured_count_per_step) == ("plan_only", None, None)
        assert pp.expected_count_per_step == 4  # 8 sequences over dp 2 = 4 micro-batches, one send each
    assert [m for m in by_key if m[0] not in (0, 1)] == []
    assert [(m.pp_rank, m.measured_peak_bytes) for m in a.memory] == [(0, 40 << 30), (1, 41 << 30)]
    assert [m.expected_bytes for m in a.memory] == [s.memory.total_bytes for s in plan.stages]


def test_world_size_from_the_spec_notes_missing_ranks() -> None:
    spec = load_spec_text(SPEC)
    records = [r for r in spec_records() if r.rank < 6]
    a = analyze(RecordTable.from_records(records), spec=spec)
    notes = {n.code: n for n in a.partial_data}
    assert notes["missing_ranks"].count == 2
    assert "the spec's world size" in notes["missing_ranks"].message
    assert a.world_size == 8


# ---------------------------------------------------------------------------- helpers and rendering


def test_grouped_median() -> None:
    key = np.array([0, 0, 0, 1, 1, 3])
    values = np.array([5.0, 1.0, 3.0, 4.0, 2.0, 7.0])
    out = grouped_median(key, values, 4)
    assert out[:2].tolist() == [3.0, 3.0]
    assert np.isnan(out[2])
    assert out[3] == 7.0


def test_labels() -> None:
    assert [category_label(c) for c in CATEGORIES if not c.startswith("comm.")] == [
        "compute",
        "pipeline bubble",
        "data wait",
        "optimizer",
        "checkpoint (amortised)",
        "other",
    ]
    assert category_label("comm.ep.sync_wait") == "ep sync wait"


def test_render_puts_units_on_every_number() -> None:
    text = render_analysis(analyze(straggler_table()))
    assert text.index("Findings") < text.index("Cost table") < text.index("Summary")
    table = text[text.index("Cost table") : text.index("Summary")]
    for line in table.splitlines()[3:]:
        if not line.strip():
            continue
        cells = re.split(r"\s{2,}", line.split("  rank ")[0].split("  spread evenly")[0].strip())
        for cell in cells[1:]:
            # every cell is a dash, a rank number (the worst-rank column) or a number with a unit
            assert cell == "-" or re.fullmatch(r"\d+", cell) or re.search(r"(s|%|GPU-h)$", cell), (cell, line)
    assert "dp sync wait" in table
    assert "makes its dp group dp:0 wait 3.00 ms per step" in table
    assert "reported GPU utilisation: 95.0 %" in text


# ---------------------------------------------------------------------------- the command


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.jsonl"
    write_records(path, straggler_records())
    assert main(["analyze", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["summary"]["slowest_rank"] == 3
    assert d["findings"][0]["code"] == "straggler"


def test_cli_text_on_the_recorded_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", str(DATA_DIR / "dp8_straggler" / "records.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "straggler: rank 2 on node-0 is slow in compute" in out


OVERSUBSCRIBED_TEXT = "CPU CONTENTION: 8 ranks on 2 CPU cores: timings include CPU contention"
FOREIGN_TEXT = (
    "CPU CONTENTION: 8 ranks on 8 CPU cores, beside foreign CPU load (other processes took 46% of the cores' time): "
    "timings include CPU contention"
)


@pytest.mark.parametrize(
    ("collector", "text"),
    [
        ({"cpu": {"oversubscribed": True, "ranks": 8, "cores": 2.0}}, OVERSUBSCRIBED_TEXT),
        ({"cpu": {"oversubscribed": False, "ranks": 2, "cores": 2.0}}, None),
        (
            {"cpu": {"oversubscribed": False, "ranks": 8, "cores": 8, "contended": True, "foreign_fraction": 0.46}},
            FOREIGN_TEXT,
        ),
        ({"cpu": {"oversubscribed": False, "ranks": 8, "cores": 8, "contended": False, "foreign_fraction": 0.1}}, None),
        ("not json {", None),
        ({"cpu": "eight"}, None),
        (None, None),
    ],
    ids=["oversubscribed", "not", "foreign-load", "light-foreign-load", "garbage", "wrong-shape", "absent"],
)
def test_records_of_a_contended_local_run_keep_saying_so_when_analysed_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], collector: object, text: str | None
) -> None:
    # meshscope run writes collector.json beside records.jsonl; analysing OUT/records.jsonl again reads its CPU use.
    path = tmp_path / "records.jsonl"
    path.write_bytes((DATA_DIR / "dp8_straggler" / "records.jsonl").read_bytes())
    if collector is not None:
        raw = collector if isinstance(collector, str) else json.dumps(collector)
        (tmp_path / "collector.json").write_text(raw)
    # A local run's records share one host clock: they are analysed without aligning node clocks.
    local_run = isinstance(collector, dict) and isinstance(collector.get("cpu"), dict)
    assert read_inputs([str(path)], spec=None).one_clock is local_run
    assert main(["analyze", str(path)]) == 0
    out = capsys.readouterr().out
    said = text is not None
    assert (text in out) if text is not None else ("CPU CONTENTION" not in out), out
    # Contention holds a straggler to 25 % over the rest (CONTENDED_MIN_EXCESS); this one is slower by less.
    assert ("straggler: rank 2 on node-0 is slow in compute" in out) is not said


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["analyze", "nope.jsonl"], "no such records file: nope.jsonl"),
        (["analyze", "{good}", "--spec", "nope.yaml"], "nope.yaml"),
        (["analyze", "{good}", "{other}"], "does not match job"),
        (["analyze", "{bad}"], "line 1"),
    ],
    ids=["missing-file", "missing-spec", "mismatched-jobs", "bad-json"],
)
def test_cli_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv, message) -> None:
    good, other, bad = tmp_path / "good.jsonl", tmp_path / "other.jsonl", tmp_path / "bad.jsonl"
    write_records(good, straggler_records())
    recs = straggler_records()
    write_records(other, [StepRecord(**{**{f: getattr(r, f) for f in r.__slots__}, "job": "other"}) for r in recs])
    bad.write_text('{"schema": "meshscope.step/1", "job": 3}\n')
    argv = [a.format(good=good, other=other, bad=bad) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshscope: error:")
    assert message in err
    assert "Traceback" not in err


def test_cli_allow_partial_leaves_out_files_of_another_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = straggler_records()
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    write_records(a, recs[:4])
    write_records(b, recs[4:])
    write_records(c, [StepRecord(**{**{f: getattr(r, f) for f in r.__slots__}, "job": "other"}) for r in recs])
    assert main(["analyze", str(a), str(b), str(c), "--allow-partial", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    notes = {n["code"]: n for n in d["partial_data"]}
    assert notes["rejected_job_files"]["count"] == 1
    assert "c.jsonl" in notes["rejected_job_files"]["message"]
    assert d["job"] == "costs"
    assert all(r["label"].endswith("(partial data)") for r in d["rows"])


def test_cli_truncated_last_line_needs_allow_partial(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.jsonl"
    write_records(path, straggler_records())
    with path.open("a") as f:
        f.write('{"schema": "meshscope.step/1", "job": "costs", "step": 2, "ra')
    assert main(["analyze", str(path)]) == 2
    assert "pass --allow-partial to skip it" in capsys.readouterr().err
    assert main(["analyze", str(path), "--allow-partial", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [n["code"] for n in d["partial_data"]] == ["truncated_line"]
    assert all(r["label"].endswith("(partial data)") for r in d["rows"])


def test_analyze_cli_surface_is_frozen() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    parser = sub.choices["analyze"]  # type: ignore[attr-defined]
    options = sorted(opt for action in parser._actions for opt in action.option_strings)
    assert options == [
        "--allow-partial", "--attempt", "--help", "--json", "--quiet", "--skip-steps", "--spec", "-h", "-q"
    ]  # fmt: skip
    assert [a.dest for a in parser._actions if not a.option_strings] == ["records"]


def test_a_rank_waiting_in_two_groups_of_the_same_ranks_is_one_waiting_rank() -> None:
    # DeepSpeed's data-parallel group is a group of its own over the whole world, beside the default world group;
    # a script's logging all-reduce runs on the latter. Rank 1 arrives 3 ms late to the first all-reduce (dp:0) and
    # 2 ms late to the next (dp:0~1, the same two ranks): rank 0 waits 5 ms a step, for rank 1. Counted once per
    # group, that was "2.50 ms per step over 2 waiting ranks": half the cost, in the finding too.
    records = []
    for step in range(3):
        t0 = step * 30 * MS
        for rank in range(2):
            first, second = (13, 22) if rank == 1 else (10, 20)  # ms: where each rank enters the two all-reduces

            def comm(group: str, start_ms: int, end_ms: int, seq: int, t0: int = t0) -> Interval:
                return Interval(
                    kind="comm", start_us=t0 + start_ms * MS, end_us=t0 + end_ms * MS, axis="dp", op="all_reduce",
                    group=group, seq=seq, size_bytes=1 << 20, group_size=2,
                )  # fmt: skip

            ivs = (
                Interval(kind="compute", start_us=t0, end_us=t0 + first * MS),
                comm("dp:0", first, 16, step),
                Interval(kind="compute", start_us=t0 + 16 * MS, end_us=t0 + second * MS),
                comm("dp:0~1", second, 25, step),
                Interval(kind="optimizer", start_us=t0 + 25 * MS, end_us=t0 + 30 * MS),
            )
            records.append(
                StepRecord(
                    job="two-groups",
                    step=step,
                    rank=rank,
                    coord=RankCoord(dp=rank, tp=0, pp=0, cp=0, ep=0),
                    node="node-0",
                    start_us=t0,
                    end_us=t0 + 30 * MS,
                    intervals=ivs,
                )
            )
    wait = row(analyze(RecordTable.from_records(records)), "comm.dp.sync_wait")
    assert wait.worst_seconds == pytest.approx(0.005)  # rank 0's, every step
    assert wait.suspect is not None
    assert wait.suspect.message == (
        "rank 1 on node-0 makes 2 dp groups wait 5.00 ms per step (5.00 ms of rank time over 1 waiting rank)"
    )


def _warm_records(path: Path, first_ms: float) -> Path:
    """2 ranks, steps 0-4 of 100 ms each but step 0 (``first_ms``): compute, a 10 ms all-reduce, a 10 ms optimizer."""
    from record_samples import make_record  # noqa: PLC0415 - tests/ is on the path

    records, start = [], 1_700_000_000_000_000
    for step in range(5):
        took = int((first_ms if step == 0 else 100) * 1000)
        end = start + took
        intervals = (
            Interval(kind="compute", start_us=start, end_us=end - 20_000, phase="forward"),
            Interval(
                kind="comm", start_us=end - 20_000, end_us=end - 10_000, axis="dp", op="all_reduce", group="dp:0",
                seq=step, size_bytes=1 << 20, group_size=2,
            ),
            Interval(kind="optimizer", start_us=end - 10_000, end_us=end),
        )  # fmt: skip
        coords = {rank: RankCoord(dp=rank, tp=0, pp=0, cp=0, ep=0) for rank in (0, 1)}
        records.extend(
            make_record(rank, step, coord=coords[rank], start_us=start, end_us=end, intervals=intervals)
            for rank in (0, 1)
        )
        start = end
    write_records(path, records)
    return path


@pytest.mark.parametrize(("first_ms", "skip", "said"), [(400, 0, True), (400, 1, False), (150, 0, False)])
def test_a_first_step_that_looks_like_a_warm_up_is_said_with_the_flag_that_leaves_it_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], first_ms: float, skip: int, said: bool
) -> None:
    # Records read whole (MESHSCOPE_COLLECTOR=file:, a sidecar's) keep their first step, which meshscope run leaves
    # out: a torchrun job's step 0 at 4x the others went into every mean without a word.
    path = _warm_records(tmp_path / "records.jsonl", first_ms)
    assert main(["analyze", str(path), "--skip-steps", str(skip)]) == 0
    out = capsys.readouterr().out
    line = (
        "WARM-UP: step 0 took 400.00 ms at the median rank, 4.0x the median step (100.00 ms): its one-time work "
        "(compilation, first allocations, cold caches) is in the figures below; --skip-steps 1 leaves it out "
        "(meshscope run leaves out its first step)"
    )
    assert (line in out) is said, out
    assert ("WARM-UP" in out) is said
    assert "PARTIAL DATA" not in out  # a caveat, not data missing

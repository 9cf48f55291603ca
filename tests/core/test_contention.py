"""The CPU contention model and the per-axis sync wait of calibration (issue 12: predictions on the CPU testbed).

Expected values are derived by hand from the model's definition (docs/predict.md, "CPU contention"):
``kappa = max(1, world ÷ (1 + bubble fraction) ÷ cpu_cores)`` and every host, sync-wait and collective time of a
layout stretched by ``kappa ÷ cpu_contention_at_fit``. Calibrated runs are simulated (an independent path: the
simulator schedules the records itself from a plan made with known assumptions).
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshscope.analysis import calibrate, predict
from meshscope.local import TinyJob, emulated_assumptions, tiny_job_spec
from meshscope.local.predicting import cpu_cores_of_run
from meshscope.plan import contended, cpu_contention, plan_job
from meshscope.simulation import Noise, Phases, simulate
from meshscope.topology import parse_layout

JOB = TinyJob(micro_batch_size=2, micro_batches=4, block_ms=10)


def tiny(layout: str):
    return tiny_job_spec(JOB, parse_layout(layout), gpus_per_node=None)


def value(c, name):
    return next(v for v in c.values if v.name == name)


# ---------------------------------------------------------------------------------------------------- the factor


@pytest.mark.parametrize(
    ("world", "bubble", "cores", "expected"),
    [
        (4, 0.0, 2.0, 2.0),  # 4 ranks computing at once on 2 cores: each gets half a core
        (4, 0.25, 2.0, 1.6),  # pp=2, m=4: a stage computes 4/5 of the step, 3.2 ranks busy on 2 cores
        (2, 0.0, 4.0, 1.0),  # fewer ranks than cores: no contention, never below 1
        (8, 0.75, 0.5, 8 / 1.75 / 0.5),  # pp=4, m=4 on half a core's worth of free CPU
    ],
)
def test_contention_is_busy_ranks_over_cores(world, bubble, cores, expected):
    assert cpu_contention(world, bubble, cores) == pytest.approx(expected, rel=1e-12)


def test_contended_stretches_host_sync_and_collectives_by_the_ratio():
    a = dataclasses.replace(
        emulated_assumptions(),
        cpu_cores=2.0,
        cpu_contention_at_fit=1.6,
        host_seconds_per_layer_pass=0.01,
        sync_wait_per_collective_seconds=0.001,
        tp_sync_wait_per_collective_seconds=0.002,
    )
    got = contended(a, 8, 0.0)  # kappa = 8 / 2 = 4; ratio 4 / 1.6 = 2.5
    assert got.host_seconds_per_layer_pass == pytest.approx(0.025)
    assert got.sync_wait_per_collective_seconds == pytest.approx(0.0025)
    assert got.tp_sync_wait_per_collective_seconds == pytest.approx(0.005)
    assert got.dp_sync_wait_per_collective_seconds is None  # unset stays unset (falls back to the all-axes value)
    assert got.sync_wait_per_collective("dp") == pytest.approx(0.0025)
    assert got.cpu_time_scale == pytest.approx(2.5)
    # A GPU cluster (no cpu_cores): nothing depends on ranks ÷ cores.
    gpu = dataclasses.replace(a, cpu_cores=None)
    assert contended(gpu, 8, 0.0) is gpu


def test_the_planner_applies_contention_to_host_compute_and_collectives():
    spec = tiny("dp=4")  # 4 micro-batches x 4 layers = 16 layer passes
    free = dataclasses.replace(emulated_assumptions(), host_seconds_per_layer_pass=0.01)
    # 1 core, fitted at contention 2: dp=4 has kappa 4, so every host and collective time doubles.
    busy = dataclasses.replace(free, cpu_cores=1.0, cpu_contention_at_fit=2.0)
    p_free, p_busy = plan_job(spec, assumptions=free), plan_job(spec, assumptions=busy)
    sleep = plan_job(spec, assumptions=emulated_assumptions()).expected_step_time.compute_seconds
    assert p_free.micro_batches == 4
    assert p_free.expected_step_time.compute_seconds == pytest.approx(sleep + 16 * 0.01)
    assert p_busy.expected_step_time.compute_seconds == pytest.approx(sleep + 16 * 0.01 * 2)
    for a, b in zip(p_free.collectives, p_busy.collectives, strict=True):
        assert b.seconds_per_instance == pytest.approx(2 * a.seconds_per_instance, rel=1e-12)
    # AdamW runs on the CPU too.
    assert p_busy.expected_step_time.optimizer_seconds == pytest.approx(2 * p_free.expected_step_time.optimizer_seconds)
    assert p_busy.assumptions == busy  # the plan keeps the assumptions it was given, not the stretched ones


# ---------------------------------------------------------------------------------------------------- calibration

TRUTH = dataclasses.replace(emulated_assumptions(), nccl_latency=False, nvlink_efficiency=0.3,
                            optimizer_hbm_efficiency=0.2, host_seconds_per_layer_pass=0.004, cpu_cores=2.0)  # fmt: skip
"""A simulated CPU testbed: 4 ms of host work per layer pass with every rank alone on a core, 2 cores."""
BASE = dataclasses.replace(emulated_assumptions(), nccl_latency=False, cpu_cores=2.0)


def simulated(layout: str, *, sigma: float = 0.03):
    spec = tiny(layout)
    result = simulate(spec, steps=6, assumptions=TRUTH, phases=Phases(data_ms=1), faults=[Noise(sigma=sigma)])
    return spec, result


@pytest.fixture(scope="module")
def dp4():
    spec, result = simulated("dp=4")
    return spec, result, calibrate(result.table, spec, base=BASE, emulated=True)


def test_calibration_records_the_contention_it_measured_at(dp4):
    _, _, c = dp4
    # dp=4 without a pipeline: 4 busy ranks on 2 cores.
    assert value(c, "cpu_contention_at_fit").value == pytest.approx(2.0)
    assert c.assumptions.cpu_contention_at_fit == pytest.approx(2.0)
    # The host time per layer pass is what the run measured: 4 ms stretched by 2.
    assert value(c, "host_seconds_per_layer_pass").value == pytest.approx(0.008, rel=0.05)
    assert c.overrides["cpu_cores"] == 2.0


def test_predicting_the_measured_layout_is_unchanged_by_the_contention_model(dp4):
    spec, _, c = dp4
    p = predict(c, spec)
    assert p.expected_step_seconds == pytest.approx(c.critical.total_seconds, rel=0.005)


def test_the_simulator_fed_the_calibration_reproduces_the_run(dp4):
    spec, result, c = dp4
    again = simulate(spec, steps=6, assumptions=c.assumptions, faults=[Noise(sigma=0.03)])  # data wait calibrated
    measured = float(np.mean(result.table.steps.end_us - result.table.steps.start_us))
    resimulated = float(np.mean(again.table.steps.end_us - again.table.steps.start_us))
    assert resimulated == pytest.approx(measured, rel=0.02)


def test_a_pipeline_frees_cores_and_the_prediction_follows(dp4):
    _, _, c = dp4
    target = tiny("dp=2,pp=2")  # 4 micro-batches of 2: bubble 1/4, 3.2 busy ranks, kappa 1.6
    p = predict(c, target)
    plain = plan_job(target, assumptions=emulated_assumptions())  # the emulated sleep alone
    passes = p.plan.micro_batches * p.plan.stages[p.plan.expected_step_time.pp_rank].layers
    host = (
        p.plan.expected_step_time.compute_seconds
        - plain.stages[p.plan.expected_step_time.pp_rank].step_time.compute_seconds
    )
    fitted = value(c, "host_seconds_per_layer_pass").value
    assert host / passes == pytest.approx(fitted * 1.6 / 2.0, rel=1e-6)
    # ... and against the simulated run of the target (4 ms x 1.6 per pass there).
    _, result_y = simulated("dp=2,pp=2")
    simulated_step = float(np.mean(result_y.table.steps.end_us - result_y.table.steps.start_us)) / 1e6
    assert p.expected_step_seconds == pytest.approx(simulated_step, rel=0.15)  # the simulator's own bubble: 15 %


def test_dp_and_the_optimizer_in_a_pipeline_follow_the_stages_contention(dp4):
    # dp=4 measured its dp sync wait and optimizer at 4 ranks on 2 cores (stage contention 2, no pipeline). In
    # dp=2,pp=2 a stage has 2 ranks, one core each, while it reduces its gradients and steps: ratio 1 / 2, where
    # the busy-rank ratio (1.6 / 2) still applies to the host time (above).
    _, _, c = dp4
    assert value(c, "cpu_stage_contention_at_fit").value == pytest.approx(2.0)
    assert c.overrides["cpu_stage_contention_at_fit"] == pytest.approx(2.0)
    target = tiny("dp=2,pp=2")
    p = predict(c, target)
    wait = p.plan.expected_step_time.sync_wait_seconds or {}
    dp_count = sum(x.count_per_step for x in p.plan.stages[p.plan.expected_step_time.pp_rank].collectives
                   if x.axis == "dp")  # fmt: skip
    fitted = value(c, "dp_sync_wait_per_collective_seconds").value
    assert wait["dp"] == pytest.approx(dp_count * fitted * 1 / 2, rel=1e-9)
    # The optimizer of each stage: the same state at full contention 1 over the fit's 2, with no contention model.
    free = dataclasses.replace(c.assumptions, cpu_cores=None)
    for with_model, without in zip(p.plan.stages, plan_job(target, assumptions=free).stages, strict=True):
        assert with_model.step_time.optimizer_seconds == pytest.approx(without.step_time.optimizer_seconds / 2)


def test_a_pipelined_run_records_its_stage_contention_apart_from_the_busy_ranks():
    spec, result = simulated("dp=2,pp=2")
    c = calibrate(result.table, spec, base=BASE, emulated=True)
    assert value(c, "cpu_contention_at_fit").value == pytest.approx(1.6)  # 4 ranks ÷ (1 + 1/4) on 2 cores
    assert value(c, "cpu_stage_contention_at_fit").value == pytest.approx(1.0)  # a stage's 2 ranks on 2 cores
    # Planned again as measured, nothing moves.
    assert predict(c, spec).expected_step_seconds == pytest.approx(c.plan.expected_step_time.total_seconds, rel=1e-9)


def test_the_simulator_fed_the_calibration_reproduces_a_pipelined_run_with_tp_and_dp():
    # 8 ranks in 2 stages on 2 cores: tp's collectives ran at the busy ranks' contention (3.2), dp's at the stage's
    # (2). One link fit serves both only if calibration expresses dp's transfers at the busy ranks' contention and
    # the planner prices them back at the stage's; fitted on the two as measured, the resimulated step was 4.5 % long.
    spec, result = simulated("dp=2,tp=2,pp=2")
    c = calibrate(result.table, spec, base=BASE, emulated=True)
    assert value(c, "cpu_contention_at_fit").value == pytest.approx(3.2)
    assert value(c, "cpu_stage_contention_at_fit").value == pytest.approx(2.0)
    again = simulate(spec, steps=6, assumptions=c.assumptions, faults=[Noise(sigma=0.03)])
    measured = float(np.mean(result.table.steps.end_us - result.table.steps.start_us))
    resimulated = float(np.mean(again.table.steps.end_us - again.table.steps.start_us))
    assert resimulated == pytest.approx(measured, rel=0.02)


def test_the_planner_stretches_in_compute_collectives_by_busy_ranks_and_dp_by_a_stages_ranks():
    spec = tiny("dp=2,tp=2,pp=2")  # 8 ranks, bubble 1/4: 6.4 busy; a stage has 4 ranks
    free = emulated_assumptions()
    busy = dataclasses.replace(free, cpu_cores=2.0)  # fitted alone on a core: both contentions 1 at the fit
    p_free, p_busy = plan_job(spec, assumptions=free), plan_job(spec, assumptions=busy)
    for a, b in zip(p_free.stages, p_busy.stages, strict=True):
        for x, y in zip(a.collectives, b.collectives, strict=True):
            ratio = {"dp": 4 / 2}.get(x.axis, 6.4 / 2)
            assert y.seconds_per_instance == pytest.approx(ratio * x.seconds_per_instance, rel=1e-12), x.axis
        assert {x.axis for x in a.collectives} >= {"dp", "tp", "pp"}
        assert b.step_time.optimizer_seconds == pytest.approx(2 * a.step_time.optimizer_seconds, rel=1e-12)


def test_an_axis_the_run_never_measured_is_not_calibrated(dp4):
    _, _, c = dp4
    dp_wait = value(c, "dp_sync_wait_per_collective_seconds")
    assert dp_wait.refused is None
    assert dp_wait.value > 0  # the noise makes ranks arrive apart
    tp_wait = value(c, "tp_sync_wait_per_collective_seconds")
    assert tp_wait.value is None
    assert "not calibrated" in tp_wait.refused
    p = predict(c, tiny("dp=2,tp=2"))
    assert p.not_calibrated() == ("tp",)
    sync = p.plan.expected_step_time.sync_wait_seconds or {}
    assert sync.get("tp", 0.0) == 0.0  # the base's model (0 s), not dp's fit
    assert sync["dp"] > 0
    assert "exposed comm tp (not calibrated)" in p.render()
    assert p.to_dict()["not_calibrated"] == ["tp"]
    assert predict(c, tiny("dp=4")).not_calibrated() == ()


def test_without_cpu_figures_no_contention_is_modelled():
    spec, result = simulated("dp=4")
    c = calibrate(result.table, spec, base=dataclasses.replace(BASE, cpu_cores=None), emulated=True)
    assert "every rank has its own host" in value(c, "cpu_cores").refused
    assert "cpu_contention_at_fit" not in c.overrides


def test_the_host_time_per_layer_pass_is_measured_at_the_runs_micro_batch_and_scales_with_its_tokens():
    spec, result = simulated("dp=4")
    c = calibrate(result.table, spec, base=dataclasses.replace(BASE, cpu_cores=None), emulated=True)
    reference = value(c, "host_reference_tokens")
    assert reference.value == spec.training.micro_batch_size * spec.model.seq_length  # b·s, cp = 1
    assert c.overrides["host_reference_tokens"] == reference.value  # written to the file, loaded by --assumptions
    host = value(c, "host_seconds_per_layer_pass").value
    assert host == pytest.approx(0.004 * 2, rel=0.1)  # TRUTH's 4 ms at 4 ranks on 2 cores, not modelled here
    # Half the sequences per micro-batch, twice the micro-batches: each layer pass has half the tokens, so its host
    # time is 0.5 ** (1/3) of the measured one (the emulated base's exponent), over 8 micro-batches x the layers.
    target = tiny_job_spec(
        dataclasses.replace(JOB, micro_batch_size=1, micro_batches=8), spec.layout, gpus_per_node=None
    )
    scaled = predict(c, target).plan.stages[0].step_time.compute_seconds
    flat = dataclasses.replace(c.assumptions, host_tokens_exponent=0.0)
    unscaled = predict(dataclasses.replace(c, assumptions=flat), target).plan.stages[0].step_time.compute_seconds
    passes = 8 * target.model.layers
    assert scaled - unscaled == pytest.approx(passes * host * (0.5 ** (1 / 3) - 1), rel=1e-9)


def test_the_host_time_per_layer_pass_is_measured_at_the_runs_tp_and_scales_with_tensor_parallelism():
    spec, result = simulated("dp=4")
    c = calibrate(result.table, spec, base=dataclasses.replace(BASE, cpu_cores=None), emulated=True)
    reference = value(c, "host_reference_tp")
    assert reference.value == 1.0  # dp=4 has no tensor parallelism
    assert c.overrides["host_reference_tp"] == 1  # written to the file, loaded by --assumptions
    host = value(c, "host_seconds_per_layer_pass").value
    # dp=2,tp=2: the same ranks and micro-batch; every layer pass gains tp's dispatch, the emulated base's factor.
    factor = emulated_assumptions().host_tp_factor
    assert factor > 1.0
    target = tiny("dp=2,tp=2")
    scaled = predict(c, target)
    flat = dataclasses.replace(c.assumptions, host_tp_factor=1.0)
    unscaled = predict(dataclasses.replace(c, assumptions=flat), target)
    passes = JOB.micro_batches * target.model.layers
    compute = [p.plan.stages[0].step_time.compute_seconds for p in (scaled, unscaled)]
    assert compute[0] - compute[1] == pytest.approx(passes * host * (factor - 1.0), rel=1e-9)
    assert scaled.host_tp() == (1, 2, factor)
    assert predict(c, tiny("dp=4")).host_tp() is None  # the measured layout: nothing scaled
    # And back: a tp run's time planned without tp is divided by the factor.
    spec, result = simulated("dp=2,tp=2")
    c = calibrate(result.table, spec, base=dataclasses.replace(BASE, cpu_cores=None), emulated=True)
    assert value(c, "host_reference_tp").value == 2.0
    assert predict(c, tiny("dp=4")).host_tp() == (2, 1, pytest.approx(1.0 / factor, rel=1e-12))


# ---------------------------------------------------------------------------------------------------- collector.json


@pytest.mark.parametrize(
    ("cpu", "expected"),
    [
        ({"cores": 2.0, "foreign_fraction": 0.25}, 1.5),
        ({"cores": 2.0, "foreign_fraction": None}, 2.0),
        ({"cores": 4, "foreign_fraction": 0.999}, 4 * 0.05),  # at least 5 % of the cores
        ({"cores": 0, "foreign_fraction": 0.1}, None),
        ({"cores": "2"}, None),
        ("junk", None),
    ],
)
def test_cores_of_a_run_come_from_collector_json(tmp_path, cpu, expected):
    (tmp_path / "collector.json").write_text(json.dumps({"cpu": cpu}))
    got = cpu_cores_of_run(tmp_path)
    assert got == (None if expected is None else pytest.approx(expected))


def test_a_run_without_collector_json_has_no_cores(tmp_path):
    assert cpu_cores_of_run(tmp_path) is None
    (tmp_path / "collector.json").write_text("{not json")
    assert cpu_cores_of_run(tmp_path) is None


_JSON = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers(-10, 10) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=80, deadline=None)
@given(cpu=_JSON, cores=_JSON, foreign=_JSON)
def test_any_collector_json_gives_positive_cores_or_none(tmp_path_factory, cpu, cores, foreign):
    folder = tmp_path_factory.mktemp("run")
    body = {"cpu": {"cores": cores, "foreign_fraction": foreign}} if cpu is None else {"cpu": cpu}
    (folder / "collector.json").write_text(json.dumps(body))
    got = cpu_cores_of_run(folder)
    assert got is None or (math.isfinite(got) and got > 0)


# ---------------------------------------------------------------------------------------------------- the bubble


def test_the_bubble_includes_the_micro_batches_in_path_communication():
    """Narayanan et al. 2021 §2.2: bubble = (p - 1)(t_f + t_b), and a micro-batch's t_f + t_b waits for its tp
    collectives; dp's gradient reduction is once per step, outside the micro-batches' path. With 2 unequal stages
    the slowest one idles while a micro-batch passes the other: that stage's t_f + t_b."""
    spec = tiny("tp=2,pp=2,dp=2")  # 4 micro-batches: bubble fraction 1/4
    a = dataclasses.replace(emulated_assumptions(), nvlink_efficiency=0.01, tp_sync_wait_per_collective_seconds=1e-3)
    plan = plan_job(spec, assumptions=a)
    assert plan.bubble_fraction == pytest.approx(0.25)
    per_stage = []
    for s in plan.stages:
        t = s.step_time
        tp = t.exposed_comm_seconds["tp"] + (t.sync_wait_seconds or {}).get("tp", 0.0)
        assert tp > 0.01 * t.compute_seconds  # slow links: the tp term is not negligible here
        per_stage.append(t.compute_seconds + tp)
    assert plan.expected_step_time.bubble_seconds == pytest.approx(0.25 * min(per_stage), rel=1e-12)
    assert plan.expected_step_time.bubble_seconds > 0.25 * min(s.step_time.compute_seconds for s in plan.stages)


def test_predict_says_where_it_extrapolates_from_a_run_without_contention_to_shared_cores(dp4):
    # From dp=2 on 2 cores (a core for each rank, κ 1) to dp=4 (κ 2): the model stretches by 2 what a run without
    # contention cannot say grows faster (gloo's transfers and sync waits once ranks are time-sliced): the prediction
    # says so, in its text and its JSON. From the contended dp=4 run back to dp=2 it does not.
    spec2, result2 = simulated("dp=2")
    c2 = calibrate(result2.table, spec2, base=BASE, emulated=True)
    assert c2.assumptions.cpu_contention_at_fit == pytest.approx(1.0)
    up = predict(c2, tiny("dp=4"))
    assert up.contention_extrapolated() == (pytest.approx(1.0), pytest.approx(2.0))
    assert "CPU contention extrapolated: the measured run had a core for every busy rank (κ 1)" in up.render()
    assert up.to_dict()["cpu_contention_extrapolated"] == {"measured": pytest.approx(1.0), "target": pytest.approx(2.0)}
    _, _, c4 = dp4
    down = predict(c4, tiny("dp=2"))
    assert down.contention_extrapolated() is None
    assert "extrapolated" not in down.render()
    assert down.to_dict()["cpu_contention_extrapolated"] is None
    same = predict(c2, spec2)  # dp=2 again: κ 1
    assert same.contention_extrapolated() is None

"""``meshscope calibrate`` and ``meshscope predict`` on the command line: a run directory as ``meshscope run`` leaves
it (records, collector.json, measurements.json; the records simulated here), records files with ``--spec``, the file
loaded by ``plan`` and ``predict``, ``plan --search --assumptions`` and the errors bad input gets."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshscope.analysis import calibrate, predict
from meshscope.cli import main
from meshscope.errors import MeshscopeError
from meshscope.jobs import load_yaml_mapping
from meshscope.local import TinyJob, emulated_assumptions, layout_text, read_run, tiny_job_spec
from meshscope.plan import assumptions_from_mapping, plan_job
from meshscope.records import write_records
from meshscope.simulation import Phases, simulate
from meshscope.topology import parse_layout

ROOT = Path(__file__).resolve().parents[2]
JOB = TinyJob(micro_batch_size=8, micro_batches=1, block_ms=10)
"""How ``train_tiny --micro-batch-size 2 --micro-batches 4 --emulate 10`` describes itself without a pipeline: the
whole step as one micro-batch."""
TRUTH = emulated_assumptions().__class__(
    compute_efficiency=1.0,
    nccl_latency=False,
    nvlink_efficiency=0.3,
    network_efficiency=0.1,
    hbm_efficiency=0.2,
    host_seconds_per_layer_pass=0.003,
    host_reference_tp=2.0,
    host_tp_factor=emulated_assumptions().host_tp_factor,
)
"""The emulated accelerator's world: kernels take exactly their sleep, the host adds 3 ms per layer pass with tp=2
(``host_tp_factor`` less without tp, as the testbed measured), slow links."""


def _simulated(layout: str, steps: int = 6):
    spec = tiny_job_spec(JOB, parse_layout(layout), gpus_per_node=4)
    return spec, simulate(spec, steps=steps, assumptions=TRUTH, phases=Phases(data_ms=3))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """What ``meshscope run --gpus-per-node 4 -- python examples/train_tiny.py --emulate 10`` leaves behind."""
    out = tmp_path_factory.mktemp("run")
    spec, result = _simulated("tp=2,dp=4")
    write_records(out / "records.jsonl", result.table)
    (out / "collector.json").write_text(json.dumps({"layout": layout_text(spec.layout), "cpu": {}}))
    (out / "measurements.json").write_text(json.dumps({"0": {"job": JOB.to_dict()}}))
    return out


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _step_of(layout: str) -> float:
    _, result = _simulated(layout)
    steps = result.table.steps
    keep = steps.step != steps.step.min()  # the command leaves the first step out as warm-up, so does this
    return float(np.mean((steps.end_us - steps.start_us)[keep])) / 1e6


def test_calibrate_a_run_directory_writes_what_plan_loads(run_dir, tmp_path, capsys):
    path = tmp_path / "a.yaml"
    code, out, err = _run(capsys, "calibrate", str(run_dir), "--out", str(path))
    assert (code, err) == (0, "")
    assert "step 0 is left out as warm-up" in out
    assert "Fitted assumptions" in out
    assert "never crossed" not in out  # dp crosses the two emulated nodes
    loaded = assumptions_from_mapping(load_yaml_mapping(path), base=emulated_assumptions(), origin=str(path))
    # The emulated accelerator's efficiency is known (1); what the run spent beyond its sleep is the host's, per
    # layer and micro-batch: the simulated 3 ms, at the run's tp=2.
    assert loaded.compute_efficiency == 1.0
    assert loaded.host_seconds_per_layer_pass == pytest.approx(0.003, rel=0.01)
    assert loaded.host_reference_tp == 2.0
    assert loaded.network_efficiency == pytest.approx(0.1, rel=0.01)
    code, out, err = _run(capsys, "plan", str(ROOT / "examples" / "llama3-8b-h100.yaml"), "--assumptions", str(path))
    assert (code, err) == (0, "")
    assert "data wait" in out  # a calibrated data wait is expected per step


def test_calibrate_json(run_dir, tmp_path, capsys):
    code, out, _ = _run(capsys, "calibrate", str(run_dir), "--out", str(tmp_path / "a.yaml"), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["warmup_step"] == 0
    values = {v["name"]: v for v in data["values"]}
    assert values["attention_efficiency"]["refused"]
    low, high = values["optimizer_hbm_efficiency"]["interval"]
    assert low <= values["optimizer_hbm_efficiency"]["value"] <= high
    assert set(data["residuals"]) >= {"compute", "comm.dp", "comm.tp", "optimizer", "data"}


@pytest.mark.parametrize("target", ["tp=4,dp=2", "tp=1,dp=8"], ids=["tp4", "dp8"])
def test_predict_from_a_run_directory_against_the_simulated_target(run_dir, capsys, target):
    code, out, err = _run(capsys, "predict", "--from", str(run_dir), "--layout", target, "--json")
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert data["predicted"]["layout"] == parse_layout(target).describe()
    assert data["predicted"]["step_seconds"] == pytest.approx(_step_of(target), rel=0.03)
    assert data["memory"]["fits"] is True
    assert sum(c["expected_s"] for c in data["categories"].values()) == pytest.approx(data["predicted"]["step_seconds"])


def test_predict_text_shows_the_change_and_the_memory_check(run_dir, capsys):
    code, out, _ = _run(capsys, "predict", "--from", str(run_dir), "--layout", "tp=1,dp=8")
    assert code == 0
    assert "change: exposed comm tp -" in out
    assert "memory: fits" in out
    assert "assumptions: calibrated from" in out


def test_predict_with_a_calibrated_file_is_predict_on_the_fly(run_dir, tmp_path, capsys):
    path = tmp_path / "a.yaml"
    assert _run(capsys, "calibrate", str(run_dir), "--out", str(path))[0] == 0
    fly = json.loads(_run(capsys, "predict", "--from", str(run_dir), "--layout", "tp=4,dp=2", "--json")[1])
    filed = json.loads(
        _run(capsys, "predict", "--from", str(run_dir), "--layout", "tp=4,dp=2", "--assumptions", str(path), "--json")[
            1
        ]
    )
    assert filed["predicted"]["step_seconds"] == pytest.approx(fly["predicted"]["step_seconds"], rel=1e-12)


def test_records_with_a_spec(tmp_path, capsys):
    spec_path = ROOT / "examples" / "llama3-8b-h100.yaml"
    from meshscope.jobs import load_spec  # noqa: PLC0415

    result = simulate(load_spec(spec_path), steps=3)
    records = tmp_path / "r.jsonl"
    write_records(records, result.table)
    code, out, err = _run(capsys, "calibrate", str(records), "--spec", str(spec_path), "--out", str(tmp_path / "a"))
    assert (code, err) == (0, "")
    assert "gemm_efficiency" in out  # the roofline's GEMM ceiling, not a flat efficiency
    code, out, err = _run(capsys, "predict", "--from", str(records), "--spec", str(spec_path), "--layout",
                          "tp=4,dp=16", "--json")  # fmt: skip
    assert (code, err) == (0, "")
    assert json.loads(out)["predicted"]["world_size"] == 64


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["calibrate", "{tmp}"], "is a directory without records.jsonl"),
        (["calibrate", "{tmp}/none.jsonl"], "no such records file"),
        (["calibrate", "{records}"], "records files need --spec FILE"),
        (["predict", "--from", "{run}", "--layout", "tp=3,dp=2"], "needs dp·tp·pp·cp = 6 GPUs"),
        (["predict", "--from", "{run}", "--layout", "tp=2,pp=2,dp=2", "--micro-batch", "3"], "--micro-batch 3 does"),
        (["predict", "--from", "{run}", "--layout", "tq=2"], "layout term"),
        (["predict", "--from", "{run}", "--hardware", "Z80"], "Z80"),
    ],
    ids=["empty-dir", "missing", "no-spec", "bad-world", "micro-batch", "bad-axis", "bad-gpu"],
)
def test_bad_input_gets_one_line(run_dir, tmp_path, capsys, argv, message):
    records = tmp_path / "r.jsonl"
    records.write_text((run_dir / "records.jsonl").read_text())
    words = [a.format(tmp=tmp_path, run=run_dir, records=records) for a in argv]
    code, _, err = _run(capsys, *words)
    assert code == 2
    assert message in err
    assert err.count("\n") == 1
    assert "Traceback" not in err


@functools.cache
def _calibration():
    spec, result = _simulated("tp=2,dp=4")
    return calibrate(result.table, spec, base=emulated_assumptions())


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet="dtpcev=,0123456789x -", max_size=16))
def test_any_layout_text_is_predicted_or_refused_in_one_line(text):
    """What ``predict --layout=TEXT`` does with the text (the CLI path without reading the run again)."""
    error: MeshscopeError | None = None
    try:
        prediction = predict(_calibration(), tiny_job_spec(JOB, parse_layout(text), gpus_per_node=4))
    except MeshscopeError as exc:  # the only exception allowed
        error = exc
    if error is not None:
        assert str(error)
        assert "\n" not in str(error)
    else:
        assert prediction.expected_step_seconds > 0


def test_a_layout_text_that_looks_like_an_option(run_dir, capsys):
    code, _, err = _run(capsys, "predict", "--from", str(run_dir), "--layout=-tp=2")
    assert code == 2
    assert err.count("\n") == 1


def test_plan_search_ranks_with_the_assumptions_file(tmp_path, capsys):
    args = ["plan", "--search", "--gpus", "64", "--model", "llama3-8b", "--hardware", "H100", "--json", "--top", "3"]
    default = json.loads(_run(capsys, *args)[1])["candidates"]
    slow_network = tmp_path / "net.yaml"
    slow_network.write_text("network_efficiency: 0.01\n")  # a network 70 x slower than the default's
    slowed = json.loads(_run(capsys, *args, "--assumptions", str(slow_network))[1])["candidates"]
    assert [c["layout"] for c in slowed] != [c["layout"] for c in default]
    assert slowed[0]["expected_step_seconds"] > default[0]["expected_step_seconds"]


_JSON_JUNK = st.one_of(
    st.none(), st.integers(), st.text(max_size=6), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.sampled_from(["0", "job", "layout"]), st.one_of(st.integers(), st.text(max_size=4),
                    st.dictionaries(st.sampled_from(["job", "micro_batch_size"]), st.integers(-1, 3))), max_size=2),
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(which=st.sampled_from(["measurements.json", "collector.json"]), junk=_JSON_JUNK, raw=st.booleans())
def test_a_run_directory_with_broken_files_gets_one_clear_error(run_dir, tmp_path_factory, which, junk, raw):
    """A run directory whose description files are garbage: the spec cannot be known, and the error says so."""
    out = tmp_path_factory.mktemp("broken")
    for name in ("records.jsonl", "collector.json", "measurements.json"):
        (out / name).write_text((run_dir / name).read_text())
    (out / which).write_text(str(junk)[:40] if raw else json.dumps(junk))
    try:
        run = read_run([str(out)], spec=None)
    except MeshscopeError as exc:  # the only exception allowed: one line, naming the directory or the field
        message = str(exc)
        assert "\n" not in message
        assert message
        return
    assert run.spec.layout == parse_layout("tp=2,dp=4")  # accepted only when what it read still describes the run


@pytest.fixture(scope="module")
def cpu_run_dir(tmp_path_factory) -> Path:
    """A dp=4 run on one machine whose collector measured 2 cores, half of their time taken by other processes."""
    out = tmp_path_factory.mktemp("cpu-run")
    spec = tiny_job_spec(JOB, parse_layout("dp=4"), gpus_per_node=None)
    result = simulate(spec, steps=6, assumptions=TRUTH, phases=Phases(data_ms=3))
    write_records(out / "records.jsonl", result.table)
    cpu = {"ranks": 4, "cores": 2.0, "busy_fraction": 0.4, "foreign_fraction": 0.5}
    (out / "collector.json").write_text(json.dumps({"layout": layout_text(spec.layout), "cpu": cpu}))
    (out / "measurements.json").write_text(json.dumps({"0": {"job": JOB.to_dict()}}))
    return out


def test_a_cpu_run_is_calibrated_and_predicted_with_its_contention(cpu_run_dir, tmp_path, capsys):
    path = tmp_path / "a.yaml"
    code, _, err = _run(capsys, "calibrate", str(cpu_run_dir), "--out", str(path))
    assert (code, err) == (0, "")
    mapping = load_yaml_mapping(path)
    assert mapping["cpu_cores"] == pytest.approx(1.0)  # 2 cores, half taken by others
    assert mapping["cpu_contention_at_fit"] == pytest.approx(4.0)  # 4 busy ranks on 1 core
    host = mapping["host_seconds_per_layer_pass"]
    # dp=2 has 2 busy ranks: contention 2, half the measured run's, so the host time per layer pass halves.
    code, out, err = _run(capsys, "predict", "--from", str(cpu_run_dir), "--layout", "dp=2", "--json", "-q")
    assert (code, err) == (0, "")
    got = json.loads(out)
    sleep = plan_job(
        tiny_job_spec(JOB, parse_layout("dp=2"), gpus_per_node=None), assumptions=emulated_assumptions()
    ).expected_step_time.compute_seconds
    assert got["categories"]["compute"]["expected_s"] == pytest.approx(sleep + 4 * host / 2, rel=1e-6)
    assert got["not_calibrated"] == []
    assert got["host_tokens_scale"] is None  # the same micro-batch: nothing scaled


def test_a_prediction_at_another_micro_batch_says_how_it_scaled_the_host_time(cpu_run_dir, capsys):
    measured = tiny_job_spec(JOB, parse_layout("dp=4"), gpus_per_node=None)
    tokens = measured.training.micro_batch_size * measured.model.seq_length  # the whole step is one micro-batch
    code, out, err = _run(capsys, "predict", "--from", str(cpu_run_dir), "--layout", "dp=2,pp=2", "--json", "-q")
    assert (code, err) == (0, "")
    got = json.loads(out)
    size = got["predicted"]["micro_batch_size"]
    assert size < measured.training.micro_batch_size  # a pipeline splits the step into micro-batches
    scale = (size * measured.model.seq_length / tokens) ** (1 / 3)
    assert got["host_tokens_scale"] == pytest.approx(scale, rel=1e-12)
    code, out, err = _run(capsys, "predict", "--from", str(cpu_run_dir), "--layout", "dp=2,pp=2")
    assert (code, err) == (0, "")
    line = next(x for x in out.splitlines() if x.startswith("host time per layer pass:"))
    assert (
        f"measured at {tokens} tokens per micro-batch per rank, x {scale:.3g} at {size * measured.model.seq_length}"
        in line
    )
    assert "host_tokens_exponent, a testbed constant the run cannot fit" in line


def test_a_prediction_with_tensor_parallelism_says_how_it_scaled_the_host_time(cpu_run_dir, capsys):
    factor = emulated_assumptions().host_tp_factor  # the measured run is dp=4: no tp
    code, out, err = _run(capsys, "predict", "--from", str(cpu_run_dir), "--layout", "dp=2,tp=2", "--json", "-q")
    assert (code, err) == (0, "")
    got = json.loads(out)
    assert got["host_tp_scale"] == pytest.approx(factor, rel=1e-12)
    assert got["host_tokens_scale"] is None  # the same micro-batch per rank
    code, out, err = _run(capsys, "predict", "--from", str(cpu_run_dir), "--layout", "dp=2,tp=2")
    assert (code, err) == (0, "")
    line = next(x for x in out.splitlines() if x.startswith("host time per layer pass:"))
    assert f"measured at tp=1, x {factor:.3g} at tp=2 (tensor parallelism's dispatch: host_tp_factor" in line
    code, out, _ = _run(capsys, "predict", "--from", str(cpu_run_dir), "--layout", "dp=2", "--json", "-q")
    assert json.loads(out)["host_tp_scale"] is None


def test_an_axis_the_run_never_had_is_marked_not_calibrated(cpu_run_dir, capsys):
    code, out, err = _run(capsys, "predict", "--from", str(cpu_run_dir), "--layout", "tp=2,dp=2")
    assert (code, err) == (0, "")
    assert "exposed comm tp (not calibrated)" in out
    assert "not calibrated: tp: the measured run had no such collectives" in out
    code, out, _ = _run(capsys, "predict", "--from", str(cpu_run_dir), "--layout", "tp=2,dp=2", "--json", "-q")
    assert json.loads(out)["not_calibrated"] == ["tp"]


USER_SPEC = """\
apiVersion: meshscope.io/v1alpha1
kind: TrainingJob
metadata: {name: user-ddp}
spec:
  model: {layers: 2, hiddenSize: 64, attentionHeads: 4, ffnHiddenSize: 256, vocabSize: 256, seqLength: 64,
          activation: gelu, norm: layernorm, positionEmbedding: learned, linearBias: true}
  parallelism: {dp: 4}
  training: {microBatchSize: 8, globalBatchSize: 32, precision: fp32}
  hardware: {bf16Tflops: 1, hbmGiB: 16, hbmBandwidthGBps: 1000, nvlinkGBpsPerDirection: 1, nicGbpsPerGpu: 1,
             gpusPerNode: 4, nodes: 1}
"""


@pytest.fixture(scope="module")
def user_cpu_run(tmp_path_factory) -> tuple[Path, Path]:
    """A user's own dp=4 script under ``meshscope run --spec`` on 2 cores: records without a GPU, CPU figures."""
    from meshscope.jobs import load_spec  # noqa: PLC0415
    from meshscope.records import RecordTable  # noqa: PLC0415

    out = tmp_path_factory.mktemp("user-cpu-run")
    spec_path = out / "job.yaml"
    spec_path.write_text(USER_SPEC)
    spec = load_spec(spec_path)
    result = simulate(spec, steps=6, assumptions=emulated_assumptions().__class__(compute_efficiency=0.05))
    on_cpu = [dataclasses.replace(r, gpu=None, gpu_util=None) for r in result.table.to_records()]
    write_records(out / "records.jsonl", RecordTable.from_records(on_cpu))
    cpu = {"ranks": 4, "cores": 2.0, "busy_fraction": 0.9, "foreign_fraction": 0.0}
    (out / "collector.json").write_text(json.dumps({"layout": "dp=4", "cpu": cpu}))
    return out, spec_path


def test_a_users_cpu_script_has_its_compute_stretched_by_the_contention(user_cpu_run, tmp_path, capsys):
    """4 ranks on 2 cores compute at half a core each; dp=2 on the same cores at a whole one. A rank of dp=2 has twice
    the rows, so its compute per step is what a dp=4 rank measured, not twice it (as on a GPU per rank)."""
    out, spec_path = user_cpu_run
    path = tmp_path / "a.yaml"
    code, text, err = _run(capsys, "calibrate", str(out), "--spec", str(spec_path), "--out", str(path))
    assert (code, err) == (0, "")
    assert "its compute is stretched with the contention too" in text
    mapping = load_yaml_mapping(path)
    assert mapping["cpu_compute"] is True
    assert mapping["cpu_contention_at_fit"] == pytest.approx(2.0)
    code, text, err = _run(capsys, "predict", "--from", str(out), "--spec", str(spec_path), "--layout", "dp=2",
                           "--json", "-q")  # fmt: skip
    assert (code, err) == (0, "")
    compute = json.loads(text)["categories"]["compute"]
    assert compute["expected_s"] == pytest.approx(compute["measured_s"], rel=0.05)
    on_gpus = _run(capsys, "predict", "--from", str(out / "records.jsonl"), "--spec", str(spec_path), "--layout",
                   "dp=2", "--json", "-q")  # fmt: skip  # records files alone: no CPU figures, a GPU per rank
    gpu_compute = json.loads(on_gpus[1])["categories"]["compute"]
    assert gpu_compute["expected_s"] == pytest.approx(2 * compute["expected_s"], rel=0.05)


def test_a_layout_smaller_than_a_node_is_part_of_one_node(user_cpu_run, capsys):
    out, spec_path = user_cpu_run
    code, text, err = _run(capsys, "predict", "--from", str(out), "--spec", str(spec_path), "--layout", "dp=2",
                           "--json", "-q")  # fmt: skip
    assert (code, err) == (0, "")
    assert json.loads(text)["predicted"]["world_size"] == 2
    code, _, err = _run(capsys, "predict", "--from", str(out), "--spec", str(spec_path), "--layout", "dp=6")
    assert code == 2
    assert "layout dp=6 tp=1 pp=1 cp=1 ep=1 vpp=1 (6 GPUs) is not a whole number of nodes of 4 GPUs" in err
    assert "give a multiple of 4 GPUs, or fewer than 4 for part of one node" in err
    code, _, err = _run(capsys, "predict", "--from", str(out), "--spec", str(spec_path), "--gpus", "6")
    assert "--gpus 6 is not a whole number of nodes of 4 GPUs (hardware.gpusPerNode in the spec)" in err

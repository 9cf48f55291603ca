"""The ``meshscope plan`` command: tables, JSON, search, exit codes and the frozen CLI surface."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshscope.cli import build_parser, main
from meshscope.jobs.loading import load_spec
from meshscope.jobs.models import lookup_model, total_params
from meshscope.jobs.spec import JobSpec, ParallelismConfig, Recompute, TrainingConfig
from meshscope.plan import plan_job
from meshscope.plan.search import SearchRequest, search_layouts
from meshscope.topology.hardware import default_hardware
from meshscope.topology.layout import ParallelLayout

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "plan", str(EXAMPLES / "llama3-70b-h100.yaml"), "--json")
    assert code == 0, err
    data = json.loads(out)
    manifest_spec = load_spec(EXAMPLES / "llama3-70b-h100.yaml")
    hw = manifest_spec.hardware
    assert data["world_size"] == hw.nodes * hw.gpus_per_node
    layout = manifest_spec.layout
    assert {k: data["layout"][k] for k in ("dp", "tp", "pp", "cp", "ep", "vpp")} == {
        "dp": layout.dp,
        "tp": layout.tp,
        "pp": layout.pp,
        "cp": layout.cp,
        "ep": layout.ep,
        "vpp": layout.vpp,
    }
    assert len(data["stages"]) == layout.pp
    for stage in data["stages"]:
        mem = stage["memory_bytes"]
        assert set(mem) >= {"weights", "gradients", "optimizer", "activations", "total"}
        assert mem["total"] == mem["weights"] + mem["gradients"] + mem["optimizer"] + mem["activations"]
    # Every parameter lives on exactly one stage, sharded tp ways (a dense model's replicated norms are tiny).
    per_gpu = sum(s["params"] for s in data["stages"])
    assert per_gpu * layout.tp == pytest.approx(total_params(manifest_spec.model), rel=0.001)
    assert sum(s["layers"] for s in data["stages"]) == manifest_spec.model.layers
    for c in data["collectives"]:
        assert set(c) >= {
            "axis",
            "op",
            "message_bytes",
            "count_per_step",
            "bytes_per_gpu_per_step",
            "link",
            "flops_per_byte",
            "link_budget_flops_per_byte",
        }
        assert c["link"] in {"nvlink", "network"}
    t = data["expected_step_seconds"]
    assert t["total"] == pytest.approx(t["compute"] + sum(t["exposed_comm"].values()) + t["bubble"] + t["optimizer"])
    assert all({"code", "severity", "message"} <= set(f) for f in data["findings"])


def test_plan_table_shows_findings_first_with_units(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "plan", str(EXAMPLES / "bad-tp16-h100.yaml"))
    assert code == 0
    assert out.index("Findings") < out.index("Memory per GPU")
    assert "tp-crosses-nvlink-domain" in out
    assert "GiB" in out
    assert " s " in out or "ms" in out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("apiVersion: meshscope.io/v1alpha1\nkind: TrainingJob\nmetadata: {name: x}\nspec: [1, 2]\n", "spec"),
        (
            "apiVersion: meshscope.io/v1alpha1\nkind: TrainingJob\nmetadata: {name: x}\nspec: {model: {preset: nope}}\n",
            "nope",
        ),
        (": : :\n", "job.yaml:1:1: YAML does not parse"),
    ],
    ids=["spec-not-mapping", "unknown-preset", "bad-yaml"],
)
def test_invalid_input_exits_2_without_traceback(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "meshscope", "plan", str(path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("meshscope: error: ")
    assert message in proc.stderr


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--gpus", "many"])
    assert exc.value.code == 2
    code, _, err = run_cli(capsys, "plan", "--search", "--gpus", "64")
    assert code == 2
    assert "--model" in err
    assert "--hardware" in err
    code, _, err = run_cli(capsys, "plan", "--search", "--gpus", "60", "--model", "llama3-8b", "--hardware", "H100")
    assert code == 2
    assert "--gpus 60 is not a whole number of 8-GPU H100 nodes" in err


def test_search_ranks_fitting_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capsys,
        "plan", "--search", "--gpus", "64", "--model", "llama3-8b", "--hardware", "H100", "--global-batch", "256",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    steps = [c["expected_step_seconds"] for c in data["candidates"]]
    assert steps == sorted(steps)
    assert data["fitting"] >= len(data["candidates"]) > 0
    hbm = default_hardware("H100", nodes=8).usable_hbm_bytes
    assert all(c["peak_memory_bytes"] <= hbm for c in data["candidates"])


def test_search_beats_or_matches_a_hand_picked_layout() -> None:
    model, hw = lookup_model("llama3-8b"), default_hardware("H100", nodes=8)
    result = search_layouts(SearchRequest(model=model, hardware=hw, global_batch_size=256))
    # A sensible hand-picked layout, planned directly: tp=8 inside each node, dp=8, micro-batch 1.
    spec = JobSpec(
        name="hand",
        model=model,
        parallelism=ParallelismConfig(layout=ParallelLayout(dp=8, tp=8), sequence_parallel=True),
        training=TrainingConfig(
            micro_batch_size=1, global_batch_size=256, recompute=Recompute.SELECTIVE, distributed_optimizer=True
        ),
        hardware=hw,
    )
    hand = plan_job(spec).expected_step_time.total_seconds
    assert result.candidates[0].expected_step_seconds <= hand + 1e-12
    listed = {(c.layout.dp, c.layout.tp, c.layout.pp, c.layout.cp, c.layout.vpp, c.micro_batch_size)
              for c in result.candidates}  # fmt: skip
    assert (8, 8, 1, 1, 1, 1) in listed


def test_search_reports_closest_misfit_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "plan", "--search", "--gpus", "8", "--model", "llama3-405b", "--hardware", "H100", "--global-batch", "8"
    )
    assert code == 0
    assert "0 fit in memory" in out
    assert "closest" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--straggler", "5"], "--straggler '5': expected RANK:FACTOR, e.g. 5:2"),
        (["--imbalance", "9:2"], "--imbalance '9:2': the rank must be 0..7 and the factor > 0"),
        (["--straggler", "5:0"], "the factor > 0"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
    ],
    ids=["no-factor", "rank-out-of-range", "zero-factor", "no-steps"],
)
def test_demo_rejects_bad_fault_options_before_starting_anything(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    code, _, err = run_cli(capsys, "demo", "--out", str(tmp_path / "demo"), *argv)
    assert code == 2
    assert message in err
    assert not (tmp_path / "demo").exists()


def test_demo_layouts() -> None:
    from meshscope.local.running import demo_layout, demo_settings  # noqa: PLC0415

    assert demo_layout() == ParallelLayout(pp=2, dp=2, tp=2)
    assert demo_layout(cp=True) == ParallelLayout(pp=2, cp=2, tp=2)
    assert demo_layout(ep=True) == ParallelLayout(pp=2, dp=2, tp=2, ep=2, etp=1)
    # an imbalance is identifiable only against a majority of normal replicas: dp gets the ranks
    assert demo_layout(imbalance=True) == ParallelLayout(pp=2, dp=4)
    settings = demo_settings(Path("out"), steps=3, ep=True, straggler="5:2")
    assert settings.nproc == 8
    assert settings.gpus_per_node == 4
    assert settings.command[1].endswith("train_tiny.py")
    assert settings.command[2:] == ("--steps", "3", "--emulate", "40", "--moe", "--straggler", "5:2")


# The CLI surface, frozen (torchtitan's test_no_new_cli_options): a new or renamed option must change this list.
CLI_SURFACE = {
    "plan": ["--assumptions", "--dp-shard", "--global-batch", "--gpus", "--hardware", "--json", "--model", "--precision", "--recompute", "--search",
             "--seq-length", "--top", "--zero-stage", "-h", "--help"],
    "demo": ["--cp", "--ep", "--imbalance", "--out", "--steps", "--straggler", "-q", "--quiet", "-h", "--help"],
    "run": ["--gpus-per-node", "--grace", "--job", "--launcher", "--layout", "--nproc", "--out", "--spec", "-q",
            "--quiet", "-h", "--help"],
    "analyze": ["--allow-partial", "--attempt", "--json", "--skip-steps", "--spec", "-q", "--quiet", "-h", "--help"],
    "report": ["--attempt", "--out", "--skip-steps", "--spec", "-q", "--quiet", "-h", "--help"],
    "simulate": ["--fault", "--out", "--prefetch", "--seed", "--spec", "--steps", "-q", "--quiet", "-h", "--help"],
    "calibrate": ["--json", "--out", "--spec", "-q", "--quiet", "-h", "--help"],
    "predict": ["--assumptions", "--from", "--gpus", "--hardware", "--json", "--layout", "--micro-batch", "--recompute",
                "--spec", "-q", "--quiet", "-h", "--help"],
}  # fmt: skip


def test_cli_surface_is_frozen() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    surface = {
        name: sorted(opt for action in p._actions for opt in action.option_strings)
        for name, p in sub.choices.items()  # type: ignore[attr-defined]
    }
    expected = {name: sorted(opts) for name, opts in CLI_SURFACE.items()}
    assert surface == expected


@pytest.mark.parametrize(
    ("value", "said"),
    [("0", "0: give 1 for the first attempt, -1 for the last"), ("last", "'last' is not a whole number: give 1 for")],
)
def test_attempt_takes_a_whole_number_other_than_zero(
    value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in ("analyze", "report"):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args([command, "records.jsonl", "--attempt", value])
        assert info.value.code == 2
        assert said in capsys.readouterr().err
    assert build_parser().parse_args(["analyze", "r.jsonl", "--attempt", "-2"]).attempt == -2


@pytest.mark.parametrize(
    ("value", "said"),
    [("-1", "-1: give 0 or more steps to leave out"), ("first", "'first' is not a whole number: give how many")],
)
def test_skip_steps_takes_a_count(value: str, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("analyze", "report"):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args([command, "records.jsonl", "--skip-steps", value])
        assert info.value.code == 2
        assert said in capsys.readouterr().err
    assert build_parser().parse_args(["report", "r.jsonl"]).skip_steps == 0
    assert build_parser().parse_args(["analyze", "r.jsonl", "--skip-steps", "2"]).skip_steps == 2

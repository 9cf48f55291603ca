"""The emulated accelerator and the TrainingJob meshscope builds for ``train_tiny``: hand-computed numbers."""

from __future__ import annotations

import pytest

from meshscope.errors import SpecError
from meshscope.jobs.models import PositionEmbedding
from meshscope.jobs.spec import CpCommType, Precision
from meshscope.local.emulation import (
    TinyJob,
    emulated_assumptions,
    emulated_peak_flops_per_s,
    tiny_job_spec,
    tiny_model,
)
from meshscope.plan import plan_job
from meshscope.topology.layout import ParallelLayout

L, H, A, G, HD, FF, V, S = 4, 64, 4, 2, 16, 256, 512, 64


def _block_flops(tokens: int) -> float:
    """Forward FLOPs of one tiny layer (whole model): projections, SwiGLU, causal attention core."""
    projections = 2 * tokens * (2 * H * A * HD + 2 * H * G * HD)
    mlp = 2 * tokens * 3 * H * FF
    core = 2 * tokens * S * 2 * A * HD * 0.5
    return projections + mlp + core


def test_the_emulated_peak_makes_one_block_forward_take_the_given_time() -> None:
    layout = ParallelLayout(pp=2, dp=2, tp=2)
    peak = emulated_peak_flops_per_s(tiny_model(), layout, micro_batch_size=2, block_ms=40)
    assert peak == pytest.approx(_block_flops(2 * S) / 2 / 0.040)


def test_expected_compute_of_a_stage_is_the_trainers_sleep() -> None:
    layout, m, block_ms = ParallelLayout(pp=2, dp=2, tp=2), 4, 40.0
    spec = tiny_job_spec(TinyJob(micro_batch_size=2, micro_batches=m, block_ms=block_ms), layout, gpus_per_node=4)
    plan = plan_job(spec, assumptions=emulated_assumptions())
    first, last = plan.stages
    # 2 layers x m micro-batches x (forward + 2 x backward) x block time
    assert first.step_time.compute_seconds == pytest.approx(2 * m * 3 * block_ms / 1000)
    # the last stage also runs the output layer: 2·tokens·h·V / tp FLOPs at the same emulated peak
    peak = _block_flops(2 * S) / 2 / (block_ms / 1000)
    logits = 2 * (2 * S) * H * V / 2
    assert last.step_time.compute_seconds == pytest.approx(first.step_time.compute_seconds + 3 * m * logits / peak)


def test_the_spec_is_the_job_train_tiny_runs() -> None:
    spec = tiny_job_spec(TinyJob(micro_batch_size=2, micro_batches=4, block_ms=40), ParallelLayout(pp=2, dp=2, tp=2))
    assert spec.model.position_embedding is PositionEmbedding.LEARNED
    assert spec.training.precision is Precision.FP32
    assert spec.training.zero_stage == 3  # FSDP2
    assert spec.training.global_batch_size == 2 * 4 * 2
    assert spec.hardware.world_size == 8
    moe = tiny_job_spec(TinyJob(micro_batch_size=2, micro_batches=4, moe=True), ParallelLayout(pp=2, dp=2, ep=2))
    assert moe.model.moe is not None
    assert moe.model.moe.experts == 4
    assert moe.model.moe_layers == L


@pytest.mark.parametrize(
    ("description", "message"),
    [
        ({"micro_batches": 4}, "cannot read"),
        ({"model": "llama3-8b", "micro_batch_size": 2, "micro_batches": 4}, "only train_tiny's 'tiny' model"),
        ({"micro_batch_size": 0, "micro_batches": 4}, "must be >= 1"),
        ({"micro_batch_size": 2, "micro_batches": 4, "data_parallel": "zero++"}, "unknown data parallelism"),
        (
            {"micro_batch_size": 2, "micro_batches": 4, "cp_comm_type": "ring"},
            "cp_comm_type 'ring' is not one of p2p, all_gather, a2a",
        ),
    ],
    ids=["missing", "other-model", "zero-batch", "unknown-dp", "unknown-cp-comm-type"],
)
def test_a_description_meshscope_cannot_plan_is_an_error(description: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        TinyJob.from_dict(description)


def test_ep_without_moe_is_an_error() -> None:
    with pytest.raises(SpecError, match="needs the MoE model"):
        tiny_job_spec(TinyJob(micro_batch_size=2, micro_batches=4), ParallelLayout(dp=2, ep=2))


def test_sequence_parallelism_without_tp_is_an_error() -> None:
    with pytest.raises(SpecError, match="sequence parallelism needs tp > 1"):
        tiny_job_spec(TinyJob(micro_batch_size=2, micro_batches=4, sequence_parallel=True), ParallelLayout(dp=8))


def test_the_description_declares_how_cp_and_sp_run() -> None:
    job = TinyJob(micro_batch_size=2, micro_batches=4, moe=True, cp_comm_type="all_gather", sequence_parallel=True)
    assert TinyJob.from_dict(job.to_dict()) == job
    spec = tiny_job_spec(job, ParallelLayout(pp=2, dp=2, tp=2, ep=2, etp=1))
    assert spec.parallelism.cp_comm_type is CpCommType.ALL_GATHER
    assert spec.parallelism.sequence_parallel
    # a script that says nothing about them: Megatron-core's defaults
    old = TinyJob.from_dict({"micro_batch_size": 2, "micro_batches": 4})
    assert (old.cp_comm_type, old.sequence_parallel) == ("p2p", False)

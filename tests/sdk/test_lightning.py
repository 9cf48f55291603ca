"""A real PyTorch Lightning ``Trainer`` (DDP on 2 forked gloo ranks), recorded through ``meshscope.sdk.lightning``.

Lightning owns the loop (its own process-group setup from the launcher's environment, the DDP wrap, gradient
accumulation with ``no_sync``, the sanity check and validation, checkpoints, a prefetching data fetcher); the
callback is the only meshscope line. Each check is against what the Trainer's arguments say must happen when.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from meshscope.analysis import analyze
from meshscope.records import IntervalKind, read_table
from runs import listener_records, records_by_rank

if TYPE_CHECKING:
    from pathlib import Path


STEPS, ACCUM, VAL_EVERY = 6, 2, 4
"""Optimizer steps, micro-batches per step, validation every this many micro-batches (every second step)."""


def _lightning_job(rank: int, world: int, out: str, *, between_s: float = 0.0) -> dict[str, object]:
    import lightning as L  # noqa: N812, PLC0415 - Lightning's own idiom
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415
    from torch.utils.data import DataLoader, TensorDataset  # noqa: PLC0415

    from meshscope.sdk.lightning import MeshscopeCallback  # noqa: PLC0415

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Busy(L.Callback):
        """Work between two micro-batches that is no fetch: a logger's flush, a metric, a progress line."""

        def on_train_batch_end(self, *args: object) -> None:
            time.sleep(between_s)

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 16, generator=generator), torch.randn(256, 1, generator=generator))
    callback = MeshscopeCallback()
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        max_steps=STEPS,
        accumulate_grad_batches=ACCUM,
        val_check_interval=VAL_EVERY,
        limit_val_batches=2,
        num_sanity_val_steps=1,
        default_root_dir=out,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[callback, Busy()] if between_s else [callback],
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    counters = callback.tracker.counters().as_dict()
    callback.tracker.close()
    return {"counters": counters, "global_step": int(trainer.global_step)}


@pytest.mark.slow
def test_a_lightning_trainer_gives_one_record_per_optimizer_step(fork_job, tmp_path: Path) -> None:
    job = fork_job(
        lambda rank, world: _lightning_job(rank, world, str(tmp_path / "lightning")),
        2,
        init=False,  # Lightning joins the process group itself, from the launcher's environment
        timeout_s=180.0,
        every_step=("data", "compute", "comm", "optimizer"),
    )
    for result in job.results:
        assert result["global_step"] == STEPS
        assert result["counters"]["hook_errors"] == 0
        assert result["counters"]["uncaptured_ddp"] == 0
    table = read_table(job.records_path)
    by_rank = records_by_rank(table)
    assert sorted(by_rank) == [0, 1]
    for rank, records in by_rank.items():
        assert [r.step for r in records] == list(range(STEPS)), rank  # trainer.global_step at each step's start
        for rec in records:
            first = rec.intervals[0]  # the step starts where its first batch's fetch began, and holds it
            assert (first.kind, first.start_us) == (IntervalKind.DATA, rec.start_us), (rank, rec.step)
            fetches = [iv for iv in rec.intervals if iv.kind is IntervalKind.DATA]
            assert len(fetches) >= ACCUM, (rank, rec.step)  # and the second micro-batch's fetch, inside it
            phases = [iv.phase.value for iv in rec.intervals if iv.phase]
            assert phases.count("forward") == ACCUM, (rank, rec.step, phases)
            # one sync per optimizer step: the last micro-batch's all-reduce (the first ran under no_sync)
            reduces = {(str(iv.axis), str(iv.op), iv.group) for iv in rec.intervals if iv.axis}
            assert ("dp", "all_reduce", "dp:0") in reduces, (rank, rec.step, reduces)  # (and DDP's buffer broadcast)
            assert rec.stats.tokens is None  # float features are no token ids: no numbers rather than wrong ones
        # validation every VAL_EVERY micro-batches = after steps 1 and 3, each followed by ModelCheckpoint's save:
        # between steps, before steps 2 and 4
        for rec in records[1:]:
            b = rec.between_steps
            assert b is not None
            assert (b.eval_us > 0) == (rec.step in {2, 4}), (rank, rec.step, b)
            assert (b.checkpoint_us > 0) == (rec.step in {2, 4}), (rank, rec.step, b)
    measured = {row.category for row in analyze(table).rows if row.measured_median_seconds > 0}
    assert measured >= {"compute", "data", "optimizer", "comm.dp.transfer"}


def test_with_meshscope_disabled_the_callback_does_nothing_and_never_raises() -> None:
    from types import SimpleNamespace  # noqa: PLC0415

    from meshscope import sdk  # noqa: PLC0415
    from meshscope.sdk.lightning import MeshscopeCallback  # noqa: PLC0415

    cb = MeshscopeCallback(sdk.NullTracker())
    trainer = SimpleNamespace(global_step=0, save_checkpoint=lambda *_a, **_k: None)
    cb.on_train_start(trainer, None)
    for step in range(2):
        cb.on_train_batch_start(trainer, None, None, step)
        cb.on_before_backward(trainer, None, None)
        cb.on_after_backward(trainer, None)
        cb.on_before_optimizer_step(trainer, None, None)
        trainer.global_step += 1
        cb.on_train_batch_end(trainer, None, None, None, step)
    trainer.save_checkpoint("x")  # wrapped at on_train_start: times nothing here, and calls the original
    cb.on_validation_start(trainer, None)
    cb.on_validation_end(trainer, None)
    cb.on_exception(trainer, None, RuntimeError("x"))
    cb.on_train_end(trainer, None)
    assert "save_checkpoint" in trainer.__dict__  # a plain attribute, not ours: left as it was


@pytest.mark.slow
def test_batches_of_token_ids_are_the_steps_tokens(listener) -> None:
    # Lightning's hooks in its order for two optimizer steps of two micro-batches each, the batches as a Hugging Face
    # collator makes them (a mapping with input_ids, padded to the batch's longest sequence), then a batch that is
    # not token ids.
    from types import SimpleNamespace  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from meshscope import sdk  # noqa: PLC0415
    from meshscope.sdk.lightning import MeshscopeCallback  # noqa: PLC0415

    sock, path = listener
    tracker = sdk.Tracker(sdk.TrackerSettings(collector=f"unix:{path}", job="pl", rank=0, world_size=1))
    cb = MeshscopeCallback(tracker)
    trainer = SimpleNamespace(global_step=0, save_checkpoint=lambda *_a, **_k: None)
    cb.on_train_start(trainer, None)
    batches = [
        {"input_ids": torch.zeros(4, 32, dtype=torch.long), "attention_mask": torch.ones(4, 32)},
        {"input_ids": torch.zeros(3, 48, dtype=torch.long)},
        torch.zeros(2, 8, dtype=torch.int32),  # a bare tensor of token ids
        (torch.randn(8, 16), torch.randn(8, 1)),  # features and targets: nothing
    ]
    for i, batch in enumerate(batches):
        cb.on_train_batch_start(trainer, None, batch, i)
        if i % 2:
            trainer.global_step += 1
        cb.on_train_batch_end(trainer, None, None, batch, i)
    cb.on_train_end(trainer, None)
    tracker.close()
    records = listener_records(sock)
    assert [(r.stats.tokens, r.stats.sequences, r.stats.longest_sequence) for r in records] == [
        (4 * 32 + 3 * 48, 7, 48),
        (16, 2, 8),
    ]
    assert records[0].stats.attention_work == 4 * 32**2 + 3 * 48**2


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        ("ids", (4, 32)),
        ("mapping", (4, 32)),
        ("floats", None),
        ("bools", None),
        ("three-d", None),
        ("tuple", None),
        ("none", None),
        ("mapping-without-ids", None),
    ],
)
def test_token_ids_are_read_from_a_2d_integer_tensor_only(batch: str, expected: tuple[int, int] | None) -> None:
    import torch  # noqa: PLC0415

    from meshscope.sdk.trainers import token_ids_shape  # noqa: PLC0415

    ids = torch.zeros(4, 32, dtype=torch.long)
    value = {
        "ids": ids,
        "mapping": {"input_ids": ids, "labels": ids},
        "floats": torch.zeros(4, 32),
        "bools": torch.zeros(4, 32, dtype=torch.bool),
        "three-d": torch.zeros(4, 32, 8, dtype=torch.long),
        "tuple": (ids, ids),
        "none": None,
        "mapping-without-ids": {"pixel_values": torch.zeros(4, 3, 8, 8)},
    }[batch]
    assert token_ids_shape(value) == expected


@pytest.mark.slow
def test_lightning_s_work_between_micro_batches_is_no_data_wait(fork_job, tmp_path: Path) -> None:
    # A callback sleeps 60 ms after every micro-batch (between steps, or inside an accumulation window). The step's
    # data is the loader's own next() (8 rows of a TensorDataset): before, everything from on_train_batch_end to
    # on_train_batch_start was the next step's data wait, and a clean quiet run read as a starved loader.
    job = fork_job(
        lambda rank, world: _lightning_job(rank, world, str(tmp_path / "lightning"), between_s=0.06),
        2,
        init=False,
        timeout_s=180.0,
    )
    assert all(r["counters"]["hook_errors"] == 0 for r in job.results)
    table = read_table(job.records_path)
    for rec in table.to_records():
        data_us = sum(iv.end_us - iv.start_us for iv in rec.intervals if iv.kind is IntervalKind.DATA)
        assert data_us < 60_000, (rec.rank, rec.step, data_us)  # each step holds ACCUM fetches, not the sleeps
    assert "data-loader-starved" not in [f.code for f in analyze(table).findings]


def _slow_validation_job(rank: int, world: int, out: str) -> dict[str, object]:
    """20 steps of a DDP Lightning job validating every 5 (2 batches, ``sync_dist`` logging, no checkpoint): rank 1
    spends 60 ms more in each validation batch. Sleeps: the time is the job's, not the host's."""
    import lightning as L  # noqa: N812, PLC0415 - Lightning's own idiom
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415
    from torch.utils.data import DataLoader, TensorDataset  # noqa: PLC0415

    from meshscope.sdk.lightning import MeshscopeCallback  # noqa: PLC0415

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(16, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            time.sleep(0.01)
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
            time.sleep(0.06 if self.global_rank == 1 else 0.0)
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 16, generator=generator), torch.randn(512, 1, generator=generator))
    callback = MeshscopeCallback()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        max_steps=20,
        val_check_interval=5,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        default_root_dir=out,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[callback],
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    counters = callback.tracker.counters().as_dict()
    callback.tracker.close()
    return {"counters": counters}


@pytest.mark.slow
def test_a_rank_slow_only_in_validation_is_named_between_steps(fork_job, tmp_path: Path) -> None:
    # Lightning validates between two steps on every rank, fetching the validation loader's batches (held as a
    # possible next step's fetch, then let go) and all-reducing the logged metric: rank 0 waits there for rank 1's
    # slower validation, every gap is equally long and no step holds the wait. Before: no finding.
    job = fork_job(
        lambda rank, world: _slow_validation_job(rank, world, str(tmp_path / "lightning")),
        2,
        init=False,
        timeout_s=180.0,
    )
    assert all(r["counters"]["hook_errors"] == 0 for r in job.results)
    table = read_table(job.records_path)
    validated = [r for r in table.to_records() if r.between_steps is not None and r.between_steps.eval_us > 0]
    assert sorted({r.step for r in validated}) == [5, 10, 15]
    waited = [r.between_steps.comm_us for r in validated if r.rank == 0 and r.between_steps is not None]
    assert sum(w >= 80_000 for w in waited) >= 2, waited  # ~120 ms for rank 1's two batches, less the host's share
    findings = analyze(read_table(job.records_path, skip_steps=1)).findings
    (f,) = [f for f in findings if f.code == "between-steps"]
    assert [s.rank for s in f.suspects] == [1], f.message
    assert "in collectives between the steps" in f.message

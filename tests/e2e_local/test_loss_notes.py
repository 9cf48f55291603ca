"""What a run lost becomes partial-data notes: dropped records, silent ranks, a failed rank, lost goodbyes."""

from __future__ import annotations

from pathlib import Path

from meshscope.local.running import EXIT_NO_ANALYSIS, RankExit, RankReceipt, RunOutcome, RunSettings
from meshscope.local.summarizing import loss_notes, report_run
from meshscope.topology.layout import ParallelLayout


def _outcome(ranks: dict[int, RankReceipt], *, failed: RankExit | None = None, garbage: int = 0) -> RunOutcome:
    settings = RunSettings(nproc=4, command=("python", "x.py"), layout=ParallelLayout(dp=4), out_dir=Path("out"))
    return RunOutcome(
        settings=settings,
        records_path=Path("out/records.jsonl"),
        failed=failed,
        ranks=ranks,
        unreadable_datagrams=garbage,
    )


def _receipt(records: int, *, dropped: int = 0, closed: bool = True) -> RankReceipt:
    return RankReceipt(
        records=records, hello=True, closed=closed, counters={"records_dropped": dropped}, measurements={}
    )


def test_a_clean_run_lost_nothing() -> None:
    assert loss_notes(_outcome({r: _receipt(5) for r in range(4)})) == []


def test_dropped_records_silent_ranks_and_garbage_are_each_noted() -> None:
    ranks = {0: _receipt(5), 1: _receipt(3, dropped=2), 2: _receipt(4, dropped=1)}
    notes = {n.code: n for n in loss_notes(_outcome(ranks, garbage=7))}
    assert notes["dropped_records"].count == 3
    assert "rank 1 lost 2" in notes["dropped_records"].message
    assert notes["silent_ranks"].count == 1
    assert "ranks 3" in notes["silent_ranks"].message
    assert notes["unreadable_datagrams"].count == 7


def test_a_failed_rank_and_lost_goodbyes() -> None:
    ranks = {r: _receipt(2, closed=r != 3) for r in range(4)}
    failed = loss_notes(_outcome(ranks, failed=RankExit(rank=3, code=-9)))
    assert [n.code for n in failed] == ["rank_failed"]
    assert "rank 3 was killed by signal 9 (SIGKILL) after 2 recorded steps" in failed[0].message
    stalled = {n.code: n for n in loss_notes(_outcome(ranks))}
    assert stalled["lost_goodbyes"].count == 1


def test_a_run_without_records_says_so(capsys) -> None:
    assert report_run(_outcome({r: _receipt(0) for r in range(4)})) == EXIT_NO_ANALYSIS
    assert "no step records to analyse" in capsys.readouterr().out


def _after(after_us: int, kinds: dict[str, int], *, step_us: float = 20_000) -> RankReceipt:
    return RankReceipt(
        records=5,
        hello=True,
        closed=True,
        counters={},
        measurements={},
        after_last_step_us=after_us,
        after_last_step=kinds,
        median_step_us=step_us,
    )


def test_what_ran_after_the_last_step_is_noted_on_the_rank_whose_own_time_it_was() -> None:
    # Rank 0 saves for 600 ms after the loop; the others wait for it at a barrier, 598 ms blocked in collectives:
    # the rank named is the one whose own time it was, not the one that waited longest.
    ranks = {
        0: _after(604_000, {"checkpoint": 600_000}),
        **{r: _after(605_000 + r, {"comm": 598_000}) for r in (1, 2, 3)},
    }
    (note,) = loss_notes(_outcome(ranks))
    assert (note.code, note.count) == ("after_last_step", 1)
    assert note.message == (
        "rank 0 ran 604.00 ms after the last step before the tracker closed (checkpoint 600.00 ms, unlabelled "
        "4.00 ms); the other ranks up to 605.00 ms, 598.00 ms of it waiting in collectives: a final save, evaluation "
        "or test after the loop is in no step's record and not in the table"
    )
    # under one median step (or 50 ms) it is the loop's ordinary end: nothing said
    quiet = {r: _after(15_000, {}) for r in range(4)}
    assert loss_notes(_outcome(quiet)) == []
    assert loss_notes(_outcome({r: _after(40_000, {}, step_us=10_000) for r in range(4)})) == []
    slow = {r: _after(900_000, {}, step_us=2e6) for r in range(4)}  # 0.9 s after steps of 2 s: no more than a step
    assert loss_notes(_outcome(slow)) == []

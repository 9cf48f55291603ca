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

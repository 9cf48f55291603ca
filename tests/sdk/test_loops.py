"""Steps that fit real training loops: start_step/end_step, tracker.data(loader), step numbers, time between steps.

One rank in this process, a real tracker sending to a real datagram socket; every record is read back under the
shared schema (and, where it matters, through a file and the analysis).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from typing import TYPE_CHECKING, Any

import pytest

from meshscope import sdk
from meshscope.analysis import analyze
from meshscope.records import IntervalKind, StepRecord, read_table
from runs import listener_messages, listener_records

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

MS = 1000  # µs
SLACK_US = 250 * MS
"""Upper margin on a loaded 2-core machine: a measured span is at least what the test slept and at most this more."""


def _tracker(path: Path, job: str = "loop") -> sdk.Tracker:
    return sdk.Tracker(sdk.TrackerSettings(collector=f"unix:{path}", job=job, rank=0, world_size=1))


_raw_records = listener_messages
_records = listener_records


def _kinds(rec: StepRecord) -> list[tuple[str, str | None]]:
    return [(iv.kind.value, iv.phase.value if iv.phase else None) for iv in rec.intervals]


def _span_us(rec: StepRecord, kind: IntervalKind) -> int:
    return sum(iv.end_us - iv.start_us for iv in rec.intervals if iv.kind is kind)


class SlowLoader:
    """A loader whose every ``next()`` sleeps ``fetch_s`` (a deterministic data wait); ``len()`` works."""

    def __init__(self, n: int, fetch_s: float) -> None:
        self.n = n
        self.fetch_s = fetch_s

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            time.sleep(self.fetch_s)
            yield i


def _body(tracker: sdk.Tracker) -> None:
    with tracker.phase("forward"):
        time.sleep(0.002)
    with tracker.phase("optimizer"):
        pass


# ---------------------------------------------------------------------------- start_step / end_step


def test_start_step_and_end_step_give_the_records_of_the_context_manager(listener) -> None:
    sock, path = listener
    tracker = _tracker(path)
    for i in range(3):
        with tracker.step(i):
            _body(tracker)
    tracker.close()
    with_block = _records(sock)
    tracker = _tracker(path)
    for i in range(3):
        tracker.start_step(i)
        _body(tracker)
        tracker.end_step()
    tracker.close()
    calls = _records(sock)
    assert [r.step for r in calls] == [r.step for r in with_block] == [0, 1, 2]
    assert [_kinds(r) for r in calls] == [_kinds(r) for r in with_block]
    assert [(r.user_step, r.gap_before_us is None) for r in calls] == [(None, True), (None, False), (None, False)]
    assert [r.between_steps is None for r in calls] == [r.between_steps is None for r in with_block]
    assert tracker.counters().unmatched_end_steps == 0


def test_while_true_with_start_step_at_the_top_records_every_pass(listener) -> None:
    sock, path = listener
    tracker = _tracker(path)
    passes = 0
    while True:
        tracker.start_step()  # ends the previous pass's step first
        _body(tracker)
        passes += 1
        if passes == 4:
            break
    assert tracker.in_step  # the last one is open until end_step, the next start_step or close
    tracker.end_step()
    tracker.end_step()  # nothing open: counted, never raised
    tracker.close()
    records = _records(sock)
    assert [r.step for r in records] == [0, 1, 2, 3]
    assert all(("compute", "forward") in _kinds(r) for r in records)
    assert all(r.end_us <= nxt.start_us for r, nxt in itertools.pairwise(records))
    counters = tracker.counters()
    assert counters.unmatched_end_steps == 1
    assert counters.hook_errors == 0


def test_bad_step_numbers_are_counted_and_numbered_never_raised(listener) -> None:
    sock, path = listener
    tracker = _tracker(path)
    tracker.start_step(-3)
    tracker.start_step("seven")  # type: ignore[arg-type]
    tracker.end_step()
    with tracker.step(2.5):  # type: ignore[arg-type]
        pass
    tracker.close()
    assert [(r.step, r.user_step) for r in _records(sock)] == [(0, None), (1, None), (2, None)]
    assert tracker.counters().hook_errors == 3


def test_a_with_block_ends_only_the_step_it_opened(listener) -> None:
    sock, path = listener
    tracker = _tracker(path)
    with tracker.step(0):
        tracker.start_step(1)  # ends step 0, opens step 1: the block's exit leaves step 1 open
    assert tracker.in_step
    tracker.end_step()
    tracker.close()
    assert [r.step for r in _records(sock)] == [0, 1]


# ---------------------------------------------------------------------------- tracker.data(loader)

FETCH_S = 0.03


@pytest.mark.parametrize("style", ["with-step", "start-step"])
def test_each_fetch_is_the_data_phase_of_the_step_that_consumes_the_batch(listener, style: str) -> None:
    sock, path = listener
    tracker = _tracker(path)
    loader = SlowLoader(4, FETCH_S)
    data = tracker.data(loader)
    assert len(data) == 4
    consumed: list[int] = []
    for batch in data:
        if style == "with-step":
            with tracker.step():
                consumed.append(batch)
                _body(tracker)
        else:
            tracker.start_step()  # the next fetch ends it; the loader's end ends the last one
            consumed.append(batch)
            _body(tracker)
    if style == "start-step":
        assert not tracker.in_step
        tracker.end_step()  # as docs/sdk.md §1.1 ends the loop: the step the loader's end already ended
        tracker.end_step()  # a second one matches nothing
    tracker.close()
    records = _records(sock)
    # before: the first end_step() after the loop counted as unmatched in every run of the documented loop
    assert tracker.counters().unmatched_end_steps == (1 if style == "start-step" else 0)
    assert consumed == [0, 1, 2, 3]
    assert [r.step for r in records] == [0, 1, 2, 3]
    for rec in records:
        (fetch,) = [iv for iv in rec.intervals if iv.kind is IntervalKind.DATA]
        assert fetch.start_us == rec.start_us  # the step starts where its batch's fetch started
        assert FETCH_S * 1e6 <= fetch.end_us - fetch.start_us < FETCH_S * 1e6 + SLACK_US
        forward = next(iv for iv in rec.intervals if iv.phase is not None)
        assert forward.start_us >= fetch.end_us  # and the body comes after its fetch, in the same record
        assert rec.end_us - rec.start_us >= FETCH_S * 1e6 + 2 * MS
    for prev, rec in itertools.pairwise(records):
        assert prev.end_us <= rec.start_us
        assert rec.gap_before_us is not None
        assert rec.gap_before_us < 20 * MS  # the next fetch is in the next step, not between the two
    assert tracker.counters().phases_outside_step == 0
    assert tracker.counters().hook_errors == 0


def test_fetches_inside_a_step_are_its_data_phase(listener) -> None:
    sock, path = listener
    tracker = _tracker(path)
    it = iter(tracker.data(SlowLoader(4, 0.01)))
    for i in range(2):
        with tracker.step(i):
            for _ in range(2):  # gradient accumulation: two micro-batches per step
                next(it)
                _body(tracker)
    tracker.close()
    records = _records(sock)
    assert [r.step for r in records] == [0, 1]
    for rec in records:
        assert [k for k in _kinds(rec) if k[0] == "data"] == [("data", None)] * 2
        assert _span_us(rec, IntervalKind.DATA) >= 20 * MS


def test_loader_errors_reach_the_loop_and_the_tracker_stays_usable(listener) -> None:
    sock, path = listener
    tracker = _tracker(path)

    def broken() -> Iterator[int]:
        yield 0
        raise OSError("disk gone")

    def loop() -> None:
        for _ in tracker.data(broken()):
            tracker.start_step()

    with pytest.raises(OSError, match="disk gone"):
        loop()
    tracker.start_step()
    tracker.close()
    assert [r.step for r in _records(sock)] == [0, 1]
    assert tracker.counters().hook_errors == 0


def test_the_wrapped_loader_answers_for_the_loader(listener) -> None:
    # PyTorch's DDP tutorial keeps the loader it iterates and calls ``train_data.sampler.set_epoch(epoch)`` on it:
    # with the tracker off ``data()`` is the loader itself, so with it on the wrapper must answer the same.
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: PLC0415

    sock, path = listener
    tracker = _tracker(path)
    dataset = TensorDataset(torch.arange(8))
    loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=3))
    data = tracker.data(loader)
    assert data.sampler is loader.sampler
    assert data.dataset is dataset
    assert data.batch_size == 2
    seen, expected = [], []
    for epoch in range(2):
        data.sampler.set_epoch(epoch)
        for (batch,) in data:
            tracker.start_step()
            seen.extend(int(x) for x in batch)
        reference = DistributedSampler(dataset, num_replicas=1, rank=0, seed=3)
        reference.set_epoch(epoch)
        expected.extend(reference)
    assert seen == expected  # each epoch shuffled anew, in the sampler's order for that epoch
    assert seen[:8] != seen[8:]
    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = data.no_such_thing
    tracker.close()
    assert len(_records(sock)) == 8


# ---------------------------------------------------------------------------- a DataLoader without tracker.data


class _SlowSamples:
    """A map-style dataset whose every sample sleeps ``fetch_s`` (a slow disk); batches of one are one sleep each."""

    def __init__(self, n: int, fetch_s: float) -> None:
        self.n = n
        self.fetch_s = fetch_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.fetch_s)
        return i


def _loader(n: int, fetch_s: float) -> Any:  # a torch DataLoader (torch imported lazily)
    torch = pytest.importorskip("torch")
    return torch.utils.data.DataLoader(_SlowSamples(n, fetch_s), batch_size=1)


@pytest.mark.parametrize("style", ["for-batch-with-step", "for-batch-start-step", "next-inside-the-step"])
def test_a_dataloaders_fetches_are_timed_without_tracker_data(listener, style: str) -> None:
    # Scripts as people write them never call tracker.data: a slow loader's time was compute (next() inside the
    # step) or unlabelled time between steps (for batch in loader), and a rank on a slow disk read as a straggler
    # in compute. Every DataLoader's next() is a fetch now, under the rules of tracker.data.
    sock, path = listener
    tracker = _tracker(path)
    loader = _loader(4, FETCH_S)
    if style == "next-inside-the-step":
        it = iter(loader)
        for i in range(4):
            with tracker.step(i):
                next(it)
                _body(tracker)
    else:
        for _batch in loader:
            if style == "for-batch-with-step":
                with tracker.step():
                    _body(tracker)
            else:
                tracker.start_step()
                _body(tracker)
        assert not tracker.in_step  # the loader's end ended the last step, as with tracker.data
        if style == "for-batch-start-step":
            tracker.end_step()  # the script's own end of that step (docs/sdk.md §1.1), not an unmatched one
    tracker.close()
    assert tracker.counters().unmatched_end_steps == 0
    records = _records(sock)
    assert [r.step for r in records] == [0, 1, 2, 3]
    for rec in records:
        (fetch,) = [iv for iv in rec.intervals if iv.kind is IntervalKind.DATA]
        assert FETCH_S * 1e6 <= fetch.end_us - fetch.start_us < FETCH_S * 1e6 + SLACK_US
        if style != "next-inside-the-step":
            assert fetch.start_us == rec.start_us  # the step starts where its batch's fetch started
        compute = [iv for iv in rec.intervals if iv.kind is IntervalKind.COMPUTE]
        assert all(iv.end_us <= fetch.start_us or iv.start_us >= fetch.end_us for iv in compute)
    assert tracker.counters().hook_errors == 0


@pytest.mark.parametrize("style", ["for-batch", "next-inside-the-step"])
def test_an_evaluation_that_stops_early_between_steps_is_not_the_next_steps_fetch(listener, style: str) -> None:
    # An evaluation every N steps over a few batches of the validation loader, between two steps: only the training
    # loader's fetch is the next step's (for-batch: it fetches again before the step; next-inside: the steps fetch
    # inside themselves), and the evaluation stays time between steps.
    sock, path = listener
    tracker = _tracker(path)
    train, val = _loader(3, 0.01), _loader(8, 0.01)
    eval_s = 0.5  # far above a step's own time plus a loaded machine's slack: inside a step, it could not hide

    def evaluate() -> None:
        for j, _ in enumerate(val):
            time.sleep(eval_s / 2)  # the evaluation's own forward
            if j == 1:
                break

    if style == "for-batch":
        for i, _ in enumerate(train):
            with tracker.step():
                _body(tracker)
            if i == 0:
                evaluate()
    else:
        it = iter(train)
        for i in range(3):
            with tracker.step():
                next(it)
                _body(tracker)
            if i == 0:
                evaluate()
    tracker.close()
    records = _records(sock)
    assert [r.step for r in records] == [0, 1, 2]
    after = records[1]
    (fetch,) = [iv for iv in after.intervals if iv.kind is IntervalKind.DATA]
    if style == "for-batch":
        assert fetch.start_us == after.start_us
    assert fetch.end_us - fetch.start_us < 10 * MS + SLACK_US
    assert after.end_us - after.start_us < eval_s * 1e6  # the evaluation is not inside the step
    assert after.gap_before_us is not None
    assert after.gap_before_us >= eval_s * 1e6 + 2 * 10 * MS  # it is the time between the two steps
    assert after.between_steps.data_us >= 2 * 10 * MS  # and its fetches are labelled as data there


def test_a_step_over_several_batches_of_one_loader_keeps_its_held_fetch(listener) -> None:
    # Accumulation by hand: the loop's fetch opens the step, the body fetches k - 1 more from the same iterator.
    sock, path = listener
    tracker = _tracker(path)
    it = iter(_loader(6, 0.01))
    for _ in it:
        with tracker.step():
            next(it)
            _body(tracker)
    tracker.close()
    records = _records(sock)
    assert [r.step for r in records] == [0, 1, 2]
    for rec in records:
        fetches = [iv for iv in rec.intervals if iv.kind is IntervalKind.DATA]
        assert len(fetches) == 2
        assert fetches[0].start_us == rec.start_us  # each step starts at its first batch's fetch


class _Nested:
    """A dataset whose every sample is read through another DataLoader (a loader of shards, each its own loader)."""

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> int:
        return sum(int(b) for b in _loader(2, 0.01))


def test_a_dataloader_under_tracker_data_or_on_another_thread_is_timed_by_its_step_thread_only(listener) -> None:
    import threading  # noqa: PLC0415

    sock, path = listener
    tracker = _tracker(path)
    for i, _ in enumerate(tracker.data(_loader(2, 0.01))):  # the script's own timing: each fetch once
        with tracker.step(i):
            _body(tracker)
    prefetched: list[int] = []
    background = iter(_loader(4, 0.01))
    with tracker.step(2):
        worker = threading.Thread(target=lambda: prefetched.extend(int(b) for b in background))
        with tracker.phase("forward"):
            worker.start()
            worker.join()  # a prefetching thread's fetches while the step thread computes
    tracker.close()
    records = _records(sock)
    assert prefetched == [0, 1, 2, 3]
    assert [r.step for r in records] == [0, 1, 2]
    for rec in records[:2]:
        assert [k for k in _kinds(rec) if k[0] == "data"] == [("data", None)]
    assert [k for k in _kinds(records[2]) if k[0] == "data"] == []
    assert _span_us(records[2], IntervalKind.COMPUTE) >= 4 * 10 * MS  # the forward, not cut by the thread's fetches
    assert tracker.counters().hook_errors == 0


def test_a_fetch_that_reads_another_loader_is_one_fetch(listener) -> None:
    torch = pytest.importorskip("torch")
    sock, path = listener
    tracker = _tracker(path)
    for _ in torch.utils.data.DataLoader(_Nested(), batch_size=1):
        with tracker.step():
            _body(tracker)
    tracker.close()
    records = _records(sock)
    assert [r.step for r in records] == [0, 1, 2]
    for rec in records:
        (fetch,) = [iv for iv in rec.intervals if iv.kind is IntervalKind.DATA]
        assert fetch.start_us == rec.start_us
        assert fetch.end_us - fetch.start_us >= 2 * 10 * MS  # the inner loader's two fetches, inside the outer one
    assert tracker.counters().hook_errors == 0


def test_null_tracker_hands_the_loader_back_and_ignores_step_calls() -> None:
    null = sdk.NullTracker()
    loader = [1, 2, 3]
    assert null.data(loader) is loader
    null.start_step()
    null.start_step(4)
    null.end_step()
    with null.step():
        pass
    assert null.counters() == sdk.TrackerCounters()


# ---------------------------------------------------------------------------- step numbers


def test_two_epochs_of_enumerate_give_unique_records_that_keep_the_loops_numbers(listener, tmp_path) -> None:
    sock, path = listener
    tracker = _tracker(path, job="epochs")
    data = tracker.data(SlowLoader(3, 0.0))
    for _epoch in range(2):
        for i, _batch in enumerate(data):  # i restarts every epoch
            with tracker.step(i):
                _body(tracker)
    tracker.close()
    raw = _raw_records(sock)
    assert [(r["step"], r.get("user_step")) for r in raw] == [
        (0, None),
        (1, None),
        (2, None),
        (3, 0),
        (4, 1),
        (5, 2),
    ]
    out = tmp_path / "records.jsonl"
    out.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "sdk"}) + "\n" for r in raw))
    table = read_table(out)
    assert table.steps.user_step.tolist() == [-1, -1, -1, 0, 1, 2]
    analysis = analyze(table)  # no "rank 0 step 0 appears twice"
    assert analysis.to_dict()


@pytest.mark.parametrize(
    ("calls", "expected"),
    [
        ([1000, 1001, 1002], [(1000, None), (1001, None), (1002, None)]),  # a resumed job keeps its numbers
        ([0, 2, 4], [(0, None), (2, None), (4, None)]),  # gaps in increasing numbers are kept
        ([5, 3, 9], [(5, None), (6, 3), (9, None)]),  # backwards: the next free number, the loop's kept
        ([None, 7, None, 7], [(0, None), (7, None), (8, None), (9, 7)]),
    ],
    ids=["resumed", "increasing-gaps", "backwards", "mixed-none"],
)
def test_step_numbers_stay_the_loops_while_they_increase(listener, calls, expected) -> None:
    sock, path = listener
    tracker = _tracker(path)
    for n in calls:
        tracker.start_step(n)
    tracker.close()
    assert [(r.step, r.user_step) for r in _records(sock)] == expected


# ---------------------------------------------------------------------------- time between steps


def test_gap_before_us_is_the_time_between_two_steps(listener) -> None:
    sock, path = listener
    tracker = _tracker(path)
    sleep_s = 0.05
    outer_us: list[int] = []
    before_end = 0
    for i in range(3):
        if i:
            time.sleep(sleep_s)
        with tracker.step(i):
            if i:  # the test's own clock, from before the previous step ended to after this one started
                outer_us.append((time.perf_counter_ns() - before_end) // 1000)
            _body(tracker)
            before_end = time.perf_counter_ns()
    tracker.close()
    records = _records(sock)
    assert records[0].gap_before_us is None
    assert records[0].between_steps is None
    for rec, outer, prev in zip(records[1:], outer_us, records[:-1], strict=True):
        assert rec.gap_before_us is not None
        assert sleep_s * 1e6 <= rec.gap_before_us <= outer
        assert rec.gap_before_us < sleep_s * 1e6 + SLACK_US
        assert rec.start_us - prev.end_us in {rec.gap_before_us, rec.gap_before_us + 1}  # same clock (µs floors)
        assert rec.between_steps is not None
        assert rec.between_steps.total_us() == 0  # nothing labelled in the gap


def test_the_close_message_says_what_ran_after_the_last_step(listener) -> None:
    # A final save after the loop: no next step carries it, so the tracker's goodbye does (meshscope run notes it).
    from meshscope.sdk.transport import decode  # noqa: PLC0415

    sock, path = listener
    tracker = _tracker(path)
    for i in range(2):
        with tracker.step(i):
            _body(tracker)
    with tracker.phase("checkpoint"):
        time.sleep(0.06)
    time.sleep(0.02)
    tracker.close()
    messages = []
    with contextlib.suppress(BlockingIOError):
        while True:
            messages.append(decode(sock.recv(1 << 22)))
    (close,) = [m for m in messages if m.get("event") == "close"]
    assert 80 * MS <= close["after_last_step_us"] < 80 * MS + SLACK_US
    assert set(close["after_last_step"]) == {"checkpoint"}
    assert 60 * MS <= close["after_last_step"]["checkpoint"] <= close["after_last_step_us"] - 20 * MS


def test_phases_between_steps_are_timed_into_the_next_record(listener) -> None:
    sock, path = listener
    tracker = _tracker(path)
    with tracker.step(0):
        _body(tracker)
    with tracker.phase("eval"):
        time.sleep(0.03)
        with tracker.phase("checkpoint"):  # the innermost phase owns the time
            time.sleep(0.04)
    time.sleep(0.02)  # unlabelled
    with tracker.step(1):
        _body(tracker)
    with tracker.step(2):
        _body(tracker)
    tracker.close()
    records = _records(sock)
    one = records[1]
    assert one.gap_before_us is not None
    assert one.between_steps is not None
    b = one.between_steps
    assert 40 * MS <= b.checkpoint_us < 40 * MS + SLACK_US
    assert 30 * MS <= b.eval_us < 30 * MS + SLACK_US
    assert b.total_us() + 20 * MS <= one.gap_before_us < 90 * MS + SLACK_US
    assert not any(iv.kind is IntervalKind.CHECKPOINT for iv in one.intervals)  # between steps, not in step 1
    assert records[2].between_steps is not None
    assert records[2].between_steps.total_us() == 0
    assert tracker.counters().phases_outside_step == 2


def test_a_phase_after_the_fetch_lands_in_the_step_that_the_fetch_opened(listener) -> None:
    # A checkpoint between the fetch and the step: the step starts at its fetch, so the checkpoint is inside it.
    sock, path = listener
    tracker = _tracker(path)
    for i, _ in enumerate(tracker.data(SlowLoader(2, 0.01))):
        if i == 1:
            with tracker.phase("checkpoint"):
                time.sleep(0.03)
        with tracker.step(i):
            _body(tracker)
    tracker.close()
    records = _records(sock)
    assert [k for k in _kinds(records[1]) if k[0] in {"data", "checkpoint"}] == [("data", None), ("checkpoint", None)]
    assert _span_us(records[1], IntervalKind.CHECKPOINT) >= 30 * MS
    assert records[1].between_steps is not None
    assert records[1].between_steps.checkpoint_us == 0


@pytest.mark.parametrize("closing", ["next-start", "end-step"])
def test_a_step_every_k_batches_holds_its_k_fetches_and_bodies(listener, closing: str) -> None:
    # Gradient accumulation over the loader's own micro-batches (Hugging Face Accelerate's loop): a step opens every
    # second batch, so the fetch in between is the open step's own, not the next step's.
    sock, path = listener
    tracker = _tracker(path)
    for i, batch in enumerate(tracker.data(SlowLoader(9, 0.01))):
        if i % 2 == 0:
            tracker.start_step(i // 2)
        tracker.data_stats(tokens=batch + 1)  # after the fetch: the micro-batch's tokens, whichever step it is in
        with tracker.phase("forward"):
            time.sleep(0.002)
        with tracker.phase("optimizer"):
            time.sleep(0.001)
        if closing == "end-step" and i % 2 == 1:
            tracker.end_step()
    tracker.close()
    records = _records(sock)
    assert [r.step for r in records] == [0, 1, 2, 3, 4]
    for rec in records[:4]:
        kinds = _kinds(rec)
        assert kinds == [("data", None), ("compute", "forward"), ("optimizer", None)] * 2
        (first, *_) = rec.intervals
        assert first.start_us == rec.start_us  # the step starts at its first batch's fetch
        assert _span_us(rec, IntervalKind.DATA) >= 20 * MS
    # tokens: batches 2k and 2k+1 (each batch's value + 1); the ninth batch alone, ended by the loader's end
    assert [r.stats.tokens for r in records] == [1 + 2, 3 + 4, 5 + 6, 7 + 8, 9]
    assert _kinds(records[4]) == [("data", None), ("compute", "forward"), ("optimizer", None)]
    for prev, rec in itertools.pairwise(records):
        assert prev.end_us <= rec.start_us
        assert rec.gap_before_us is not None
        assert rec.gap_before_us < 20 * MS
    counters = tracker.counters()
    assert (counters.phases_outside_step, counters.hook_errors, counters.unmatched_end_steps) == (0, 0, 0)


def test_data_stats_between_a_fetch_and_start_step_go_to_the_step_it_opens(listener) -> None:
    sock, path = listener
    tracker = _tracker(path)
    for i, _ in enumerate(tracker.data(SlowLoader(3, 0.0))):
        tracker.data_stats(sequence_lengths=[2, 3 + i])  # before start_step: the next step's, not the open one's
        tracker.start_step(i)
        tracker.data_stats(tokens=1)
    tracker.close()
    records = _records(sock)
    assert [(r.stats.tokens, r.stats.longest_sequence) for r in records] == [(6, 3), (7, 4), (8, 5)]
    for rec in records:
        (fetch,) = [iv for iv in rec.intervals if iv.kind is IntervalKind.DATA]
        assert fetch.start_us == rec.start_us


# ---------------------------------------------------------------------------- a step without compute phases


def _compute_us(rec: StepRecord) -> list[tuple[int, int, str | None]]:
    return [
        (iv.start_us, iv.end_us, iv.phase.value if iv.phase else None)
        for iv in rec.intervals
        if iv.kind is IntervalKind.COMPUTE
    ]


def test_a_step_that_declares_no_compute_phase_computes_outside_its_phases(listener) -> None:
    # The loops people write first: only the step marked, or only the fetches (tracker.data), or an eval phase on
    # some steps. Their time outside the phases they did mark is compute of unknown phase, not "other".
    sock, path = listener
    tracker = _tracker(path)
    with tracker.step(0):  # nothing but the step
        time.sleep(0.02)
    for batch in tracker.data(SlowLoader(1, 0.01)):  # a fetch, then the body
        with tracker.step(1):
            del batch
            time.sleep(0.02)
    with tracker.step(2):  # eval inside the step is compute too, and declares no training compute
        time.sleep(0.01)
        with tracker.phase("eval"):
            time.sleep(0.01)
    with tracker.step(3):  # a training compute phase declared: the time outside it is not compute
        with tracker.phase("forward"):
            time.sleep(0.01)
        time.sleep(0.02)
    with tracker.step(4):  # an optimizer phase alone declares no compute: the rest is compute
        time.sleep(0.01)
        with tracker.phase("optimizer"):
            time.sleep(0.01)
    for batch in tracker.data(SlowLoader(1, 0.005)):  # a forward phase between the fetch and its step declares it
        with tracker.phase("forward"):
            del batch
            time.sleep(0.01)
        with tracker.step(5):
            time.sleep(0.02)
    tracker.close()
    recs = {r.step: r for r in _records(sock)}
    # Step 0: one compute piece, the whole step.
    assert _compute_us(recs[0]) == [(recs[0].start_us, recs[0].end_us, None)]
    # Step 1: the fetch, then compute from its end to the step's end.
    (fetch,) = [iv for iv in recs[1].intervals if iv.kind is IntervalKind.DATA]
    assert _compute_us(recs[1]) == [(fetch.end_us, recs[1].end_us, None)]
    assert recs[1].end_us - fetch.end_us >= 20 * MS
    # Step 2: compute covers the whole step (before eval, and eval itself).
    pieces = _compute_us(recs[2])
    assert pieces[0][0] == recs[2].start_us
    assert pieces[-1][1] == recs[2].end_us
    assert sum(b - a for a, b, _ in pieces) == recs[2].end_us - recs[2].start_us
    # Step 3: only the forward phase is compute; the 20 ms after it is left to "other".
    ((a, b, phase),) = _compute_us(recs[3])
    assert phase == "forward"
    assert 10 * MS <= b - a < 10 * MS + SLACK_US
    assert recs[3].end_us - b >= 20 * MS
    # Step 4: compute before the optimizer, which keeps its own interval.
    (opt,) = [iv for iv in recs[4].intervals if iv.kind is IntervalKind.OPTIMIZER]
    first, *tail = _compute_us(recs[4])
    assert first == (recs[4].start_us, opt.start_us, None)
    assert all(a >= opt.end_us for a, _, _ in tail)  # the step's own end after the phase (microseconds)
    # Step 5: the forward phase (before the step opened, after its fetch) is its only compute.
    ((a, b, phase),) = _compute_us(recs[5])
    assert phase == "forward"
    assert recs[5].end_us - b >= 20 * MS


class ScriptedSched:
    """Stands in for the tracker's ``SchedStat``: run delay (ns) the test adds itself (``wait``), time on a CPU 0."""

    def __init__(self) -> None:
        self.rq_ns = 0

    def wait(self, ms: int) -> None:
        self.rq_ns += ms * MS * 1000

    def read(self) -> tuple[int, int]:
        return 0, self.rq_ns

    def run_delay(self) -> int:
        return self.rq_ns

    def close(self) -> None:
        pass


class ScriptedLoader:
    """Each ``next()`` waits ``ms`` for a CPU on the scripted clock."""

    def __init__(self, sched: ScriptedSched, n: int, ms: int) -> None:
        self.sched, self.n, self.ms = sched, n, ms

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            self.sched.wait(self.ms)
            yield i


def test_the_run_delay_in_compute_and_in_fetches_is_told_from_the_rest_of_the_step(listener) -> None:
    # Every way a loop marks (or does not mark) its compute: what the record says waited for a CPU in compute is the
    # wait the test put inside compute, in data loading and the optimizer step the waits the test put in its fetches
    # and its optimizer phase, and the step's total is all of it, fetches held for the step included.
    sock, path = listener
    tracker = _tracker(path)
    sched = ScriptedSched()
    tracker._sched = sched  # type: ignore[assignment]  # the scheduler's clock is the test's
    with tracker.step(0):  # phases: 3 ms in forward, 2 in backward, 1 in the optimizer, 4 in none
        with tracker.phase("forward"):
            sched.wait(3)
        with tracker.phase("backward"):
            sched.wait(2)
        sched.wait(4)
        with tracker.phase("optimizer"):
            sched.wait(1)
    with tracker.step(1):  # nothing marked but a fetch: the rest of the step is compute, 5 ms
        sched.wait(5)
        with tracker.phase("data"):
            sched.wait(2)
    with tracker.step(2):  # eval only: eval (2 ms) and the time outside it (3 ms) are compute
        sched.wait(3)
        with tracker.phase("eval"):
            sched.wait(2)
    sched.wait(7)  # between steps: no step's
    with tracker.phase("checkpoint"):
        sched.wait(6)
    # A loader whose fetch waits 1 ms; the body's forward 3 ms and 2 ms outside phases. Each fetch belongs to the
    # step that consumes its batch (the one after the fetch of the start_step loop, which the tracker moves there).
    for batch in tracker.data(ScriptedLoader(sched, 3, 1)):
        tracker.start_step(3 + batch)
        with tracker.phase("forward"):
            sched.wait(3)
        sched.wait(2)
    for batch in tracker.data(ScriptedLoader(sched, 2, 1)):  # the same with no phase: compute is the rest, 5 ms
        tracker.start_step(6 + batch)
        sched.wait(5)
    tracker.close()
    recs = {r.step: r for r in _records(sock)}
    got = {
        n: (r.runqueue_wait_us, r.compute_runqueue_wait_us, r.data_runqueue_wait_us, r.optimizer_runqueue_wait_us)
        for n, r in recs.items()
    }
    assert got == {  # (the step's, in compute, in its fetches, in its optimizer step)
        0: (10 * MS, 5 * MS, 0, 1 * MS),
        1: (7 * MS, 5 * MS, 2 * MS, 0),
        2: (5 * MS, 5 * MS, 0, 0),
        3: (6 * MS, 3 * MS, 1 * MS, 0),  # the fetch held for it before it opened
        4: (6 * MS, 3 * MS, 1 * MS, 0),  # fetched while step 3 was open: moved to this step with its run delay
        5: (6 * MS, 3 * MS, 1 * MS, 0),
        6: (6 * MS, 5 * MS, 1 * MS, 0),
        7: (6 * MS, 5 * MS, 1 * MS, 0),
    }
    assert tracker.counters().hook_errors == 0


# ---------------------------------------------------------------------------- a real gloo job


# ---------------------------------------------------------------------------- optimizer.step() without a phase


def _slow_sgd(step_s: float, *, fail_at: int | None = None):
    import torch  # noqa: PLC0415

    class SlowSGD(torch.optim.SGD):
        """SGD whose ``step()`` also sleeps ``step_s`` (a deterministic optimizer time), and raises on call ``fail_at``."""

        calls = 0

        def step(self, closure=None):  # type: ignore[no-untyped-def]
            SlowSGD.calls += 1
            time.sleep(step_s)
            if SlowSGD.calls - 1 == fail_at:
                raise RuntimeError("found inf in the gradients")
            return super().step(closure)

    return SlowSGD


def _optimizer_spans(rec: StepRecord) -> list[int]:
    return [iv.end_us - iv.start_us for iv in rec.intervals if iv.kind is IntervalKind.OPTIMIZER]


@pytest.mark.parametrize("style", ["no phases", "forward and backward only", "optimizer phase"])
def test_optimizer_step_is_the_optimizer_phase_unless_the_script_says_otherwise(listener, style: str) -> None:
    # Every torch.optim optimizer's step() is timed as the optimizer phase where no phase is open: a loop with no
    # phases, or with forward and backward only (its optimizer was "other" there), gets its optimizer interval; one
    # that opens the optimizer phase itself gets one interval, not two.
    import torch  # noqa: PLC0415

    sock, path = listener
    tracker = _tracker(path)
    param = torch.nn.Parameter(torch.ones(4))
    opt = _slow_sgd(0.03)([param], lr=0.1)
    for i in range(3):
        with tracker.step(i):
            phase = tracker.phase("forward") if style != "no phases" else contextlib.nullcontext()
            with phase:
                loss = (param * 2).sum()
                time.sleep(0.01)
            with tracker.phase("backward") if style != "no phases" else contextlib.nullcontext():
                loss.backward()
            with tracker.phase("optimizer") if style == "optimizer phase" else contextlib.nullcontext():
                opt.step()
            opt.zero_grad()
    tracker.close()
    records = _records(sock)
    assert len(records) == 3
    for rec in records:
        spans = _optimizer_spans(rec)
        assert len(spans) == 1, (style, _kinds(rec))
        assert 30 * MS <= spans[0] < 30 * MS + SLACK_US
        assert _span_us(rec, IntervalKind.COMPUTE) >= 10 * MS
        assert _span_us(rec, IntervalKind.COMPUTE) + spans[0] <= rec.end_us - rec.start_us
    assert tracker.counters().hook_errors == 0


def test_an_optimizer_step_that_raises_ends_its_phase_and_the_loop_goes_on(listener) -> None:
    # A loop that skips a step whose optimizer raised (an inf check of its own): PyTorch runs no post-hook then, so
    # that step's optimizer phase ends with the step (its last 40 ms with it); the next steps' optimizer phases are
    # their own optimizer's time only, nothing stays open.
    import torch  # noqa: PLC0415

    sock, path = listener
    tracker = _tracker(path)
    param = torch.nn.Parameter(torch.ones(4))
    opt = _slow_sgd(0.02, fail_at=1)([param], lr=0.1)
    for i in range(4):
        with tracker.step(i):
            (param * 2).sum().backward()
            with contextlib.suppress(RuntimeError):
                opt.step()
            time.sleep(0.04)  # after the optimizer: compute, in every step, the failed one's included
            opt.zero_grad()
    with tracker.step(4):
        time.sleep(0.01)  # no optimizer here: no optimizer phase, nothing left open from before
    tracker.close()
    records = _records(sock)
    assert [len(_optimizer_spans(r)) for r in records] == [1, 1, 1, 1, 0]
    for rec in (records[0], records[2], records[3]):
        assert 20 * MS <= _optimizer_spans(rec)[0] < 20 * MS + SLACK_US, rec.step
        assert _span_us(rec, IntervalKind.COMPUTE) >= 40 * MS, rec.step
    failed = records[1]
    assert _optimizer_spans(failed)[0] >= 60 * MS
    assert _optimizer_spans(failed)[0] + _span_us(failed, IntervalKind.COMPUTE) <= failed.end_us - failed.start_us
    assert tracker.counters().hook_errors == 0


def test_an_optimizer_step_given_a_closure_is_not_the_optimizer_phase(listener) -> None:
    # step(closure) runs forward and backward inside the optimizer (LBFGS): that time is the model's compute
    import torch  # noqa: PLC0415

    sock, path = listener
    tracker = _tracker(path)
    param = torch.nn.Parameter(torch.ones(4))
    opt = _slow_sgd(0.0)([param], lr=0.1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (param * 2).sum()
        time.sleep(0.03)
        loss.backward()
        return loss

    for i in range(2):
        with tracker.step(i):
            opt.step(closure) if i == 0 else opt.step(closure=closure)
    tracker.close()
    for rec in _records(sock):
        assert not _optimizer_spans(rec), _kinds(rec)
        assert _span_us(rec, IntervalKind.COMPUTE) >= 30 * MS


def test_an_optimizer_step_between_steps_is_timed_into_the_next_record(listener) -> None:
    import torch  # noqa: PLC0415

    sock, path = listener
    tracker = _tracker(path)
    param = torch.nn.Parameter(torch.ones(4))
    opt = _slow_sgd(0.03)([param], lr=0.1)
    with tracker.step(0):
        (param * 2).sum().backward()
    opt.step()  # outside the step the user marked
    with tracker.step(1):
        time.sleep(0.001)
    tracker.close()
    one = _records(sock)[1]
    assert one.between_steps is not None
    assert 30 * MS <= one.between_steps.optimizer_us < 30 * MS + SLACK_US
    assert not _optimizer_spans(one)


def test_a_closed_tracker_leaves_optimizers_alone(listener) -> None:
    import torch  # noqa: PLC0415
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks  # noqa: PLC0415

    _sock, path = listener
    before = (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks))
    tracker = _tracker(path)
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == (before[0] + 1, before[1] + 1)
    tracker.close()
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == before
    torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1).step()


# ---------------------------------------------------------------------------- checkpoints without a phase


class _SlowToSave:
    """An object whose pickling sleeps ``seconds`` (a deterministic save time); it saves as the integer 0."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self) -> tuple[type, tuple[int]]:
        time.sleep(self.seconds)
        return (int, (0,))


def _checkpoint_spans(rec: StepRecord) -> list[int]:
    return [iv.end_us - iv.start_us for iv in rec.intervals if iv.kind is IntervalKind.CHECKPOINT]


@pytest.mark.parametrize("style", ["no phases", "checkpoint phase", "inside forward"])
def test_torch_save_is_the_checkpoint_phase_unless_the_script_says_otherwise(listener, tmp_path, style: str) -> None:
    # torch.save in a step is timed as the checkpoint phase where no phase is open (a loop that marks only its
    # steps had its checkpoints in compute); the script's own checkpoint phase gets one interval, not two; inside
    # another phase (a save in the forward pass, say) the innermost phase the script opened wins.
    import torch  # noqa: PLC0415

    sock, path = listener
    tracker = _tracker(path)
    for i in range(2):
        with tracker.step(i):
            time.sleep(0.01)
            if style == "checkpoint phase":
                ctx: contextlib.AbstractContextManager[None] = tracker.phase("checkpoint")
            elif style == "inside forward":
                ctx = tracker.phase("forward")
            else:
                ctx = contextlib.nullcontext()
            with ctx:
                torch.save({"state": _SlowToSave(0.03)}, tmp_path / f"ckpt{i}.pt")
    tracker.close()
    records = _records(sock)
    assert len(records) == 2
    for rec in records:
        spans = _checkpoint_spans(rec)
        if style == "inside forward":
            assert spans == [], _kinds(rec)
            assert _span_us(rec, IntervalKind.COMPUTE) >= 30 * MS  # the forward phase's (the sleep before: other)
            continue
        assert len(spans) == 1, (style, _kinds(rec))
        assert 30 * MS <= spans[0] < 30 * MS + SLACK_US
        assert _span_us(rec, IntervalKind.COMPUTE) >= 10 * MS
        assert _span_us(rec, IntervalKind.COMPUTE) + spans[0] <= rec.end_us - rec.start_us
    assert torch.load(tmp_path / "ckpt1.pt", weights_only=False) == {"state": 0}  # the save itself is untouched
    assert tracker.counters().hook_errors == 0


def test_a_save_between_steps_on_another_thread_or_in_a_stretch_named_late(listener, tmp_path) -> None:
    # Between steps: the next record's between_steps. On another thread (an asynchronous checkpoint's writer): no
    # phase, the step's own thread is not blocked by it (its time is the step's, as whatever the loop does). In a
    # stretch named when it ends (the Hugging Face Trainer with save_strategy="best" learns at on_save that the time
    # since its evaluation was a save), the save's torch.save inside it counts once, not twice.
    import threading  # noqa: PLC0415

    import torch  # noqa: PLC0415

    sock, path = listener
    tracker = _tracker(path)
    with tracker.step(0):
        time.sleep(0.001)
    torch.save(_SlowToSave(0.03), tmp_path / "between.pt")
    with tracker.step(1):
        writer = threading.Thread(target=torch.save, args=(_SlowToSave(0.03), tmp_path / "thread.pt"))
        writer.start()
        writer.join()
    since = tracker._mark_now()
    torch.save(_SlowToSave(0.03), tmp_path / "best.pt")
    time.sleep(0.02)  # the rest of the save: writing its other files
    tracker._claim_between("checkpoint", since)
    with tracker.step(2):
        time.sleep(0.001)
    tracker.close()
    zero, one, two = _records(sock)
    assert one.between_steps is not None
    assert 30 * MS <= one.between_steps.checkpoint_us < 30 * MS + SLACK_US
    assert not _checkpoint_spans(zero)
    assert not _checkpoint_spans(one), _kinds(one)
    assert _span_us(one, IntervalKind.COMPUTE) >= 30 * MS
    assert two.between_steps is not None
    assert 50 * MS <= two.between_steps.checkpoint_us < 50 * MS + SLACK_US
    assert two.gap_before_us is not None
    assert two.between_steps.total_us() <= two.gap_before_us
    assert tracker.counters().hook_errors == 0


def test_a_closed_tracker_leaves_the_checkpoint_functions_alone(listener) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    _sock, path = listener
    before = (torch.save, dcp.save, dcp.async_save, dcp.load)
    tracker = _tracker(path)
    with tracker.step(0):  # a step start patches DCP where it was loaded after the tracker started
        pass
    assert torch.save is not before[0]
    assert dcp.save is not before[1]
    tracker.close()
    assert (torch.save, dcp.save, dcp.async_save, dcp.load) == before


def _dcp_loop(rank: int, world: int) -> dict[str, object]:
    """DDP and torch.distributed.checkpoint.save every third step, the steps marked and nothing else (no phases)."""
    import os  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817, PLC0415

    tracker = sdk.tracker_from_env()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    where = os.environ["CKPT_DIR"]
    for i in range(6):
        with tracker.step(i):
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            if i % 3 == 2:
                dcp.save({"model": model.state_dict()}, checkpoint_id=f"{where}/step{i}")
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters}


@pytest.mark.slow
def test_a_distributed_checkpoint_is_the_checkpoint_phase_of_its_step(fork_job, tmp_path) -> None:
    job = fork_job(_dcp_loop, 2, env={"CKPT_DIR": str(tmp_path / "ckpt")})
    assert all(r["counters"]["hook_errors"] == 0 for r in job.results)
    records = read_table(job.records_path).to_records()
    assert sorted((r.rank, r.step) for r in records) == [(rank, i) for rank in (0, 1) for i in range(6)]
    for rec in records:
        spans = _checkpoint_spans(rec)
        if rec.step % 3 == 2:  # one interval: DCP's own torch.save calls inside it open nothing
            assert len(spans) == 1, _kinds(rec)
            assert spans[0] > 0
        else:
            assert spans == [], _kinds(rec)
    assert (tmp_path / "ckpt" / "step5" / ".metadata").exists()


def _plain_ddp_loop(rank: int, world: int) -> dict[str, object]:
    """The "five minutes" script: DDP with no registration, tracker.data, start_step, eval on rank 0 between steps."""
    import torch  # noqa: PLC0415 - the forked rank's torch, pre-imported by conftest
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817, PLC0415

    tracker = sdk.tracker_from_env()  # after init_process_group, before the DDP wrap
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [torch.full((2, 8), float(i + rank)) for i in range(3)]
    for _epoch in range(2):
        for i, batch in enumerate(tracker.data(loader)):
            tracker.start_step(i)  # i restarts every epoch: the records renumber, user_step keeps i
            with tracker.phase("forward"):
                loss = model(batch).sum()
            with tracker.phase("backward"):
                loss.backward()
            with tracker.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
            if rank == 0 and i == 1:
                tracker.end_step()
                with tracker.phase("eval"):
                    time.sleep(0.1)
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters}


@pytest.mark.slow
def test_a_plain_ddp_loop_needs_no_registration_and_its_records_analyse(fork_job) -> None:
    job = fork_job(_plain_ddp_loop, 2)  # no MESHSCOPE_LAYOUT, nothing registered
    for result in job.results:
        assert result["counters"]["hook_errors"] == 0
        assert result["counters"]["unattributed_ops"] == 0
    table = read_table(job.records_path)
    by_rank: dict[int, list[StepRecord]] = {}
    for rec in table.to_records():
        by_rank.setdefault(rec.rank, []).append(rec)
    for rank, records in by_rank.items():
        records.sort(key=lambda r: r.step)
        assert [(r.step, r.user_step) for r in records] == [(0, None), (1, None), (2, None), (3, 0), (4, 1), (5, 2)]
        for rec in records:  # the world group of a plain DDP job is the dp group
            assert [(str(iv.axis), str(iv.op), iv.group) for iv in rec.intervals if iv.axis] == [
                ("dp", "all_reduce", "dp:0")
            ], rank
            assert any(iv.kind is IntervalKind.DATA for iv in rec.intervals)
    for step in (2, 5):  # after rank 0's eval
        (zero,) = [r for r in by_rank[0] if r.step == step]
        assert zero.between_steps is not None
        assert zero.between_steps.eval_us >= 100 * MS
        assert zero.gap_before_us is not None
        assert zero.gap_before_us >= zero.between_steps.eval_us
        (one,) = [r for r in by_rank[1] if r.step == step]
        assert one.between_steps is not None
        assert one.between_steps.eval_us == 0
    assert analyze(table).to_dict()


SLOW_DISK_RANK = 2


def _slow_disk_ddp_loop(rank: int, world: int) -> dict[str, object]:
    """A DDP loop over a DataLoader it never wraps; one rank reads its samples from a slow disk (20 ms a batch)."""
    import torch  # noqa: PLC0415 - the forked rank's torch, pre-imported by conftest
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817, PLC0415
    from torch.utils.data import DataLoader, DistributedSampler  # noqa: PLC0415

    tracker = sdk.tracker_from_env()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    samples = _SlowSamples(64 * world, 0.02 if rank == SLOW_DISK_RANK else 0.0)
    loader = DataLoader(samples, batch_size=1, sampler=DistributedSampler(samples, world, rank))
    for i, batch in enumerate(loader):
        if i == 16:
            break
        with tracker.step(i):
            x = torch.randn(8, 64) + batch.float()
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters}


@pytest.mark.slow
def test_a_rank_on_a_slow_disk_is_slow_in_data_loading_without_tracker_data(fork_job) -> None:
    # The user's loop as written (for batch in loader, the step inside): before, the slow rank's fetch was time
    # between steps ("between-steps ... unlabelled"), or, with next() inside the step, "slow in compute".
    job = fork_job(_slow_disk_ddp_loop, 4, every_step=("data", "compute"))
    assert all(r["counters"]["hook_errors"] == 0 for r in job.results)
    result = analyze(read_table(job.records_path)).to_dict()
    stragglers = [f for f in result["findings"] if f["code"] == "straggler"]
    assert [(f["evidence"]["rank"], f["evidence"]["phase_is_data"]) for f in stragglers] == [(SLOW_DISK_RANK, 1)]
    assert "slow in data loading" in stragglers[0]["message"]
    assert stragglers[0]["evidence"]["phase_seconds"] >= 0.02


def _bare_ddp_loop(rank: int, world: int) -> dict[str, object]:
    """The least a user adds: the tracker and ``with tracker.step(i):`` around a DDP loop's body, no phase at all."""
    import torch  # noqa: PLC0415 - the forked rank's torch, pre-imported by conftest
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817, PLC0415

    tracker = sdk.tracker_from_env()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(6):
        with tracker.step(i):
            batch = torch.randn(32, 64)
            loss = model(batch).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 1:
                time.sleep(0.03)  # host work on one rank (a log line, a metric): the other waits for it
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters}


@pytest.mark.slow
def test_a_ddp_loop_that_marks_only_its_steps_has_its_compute_measured(fork_job) -> None:
    # Every record holds compute (where the rank ran, its waits cut out: the invariants check that no wait sits in
    # it), and the breakdown puts the steps' own time in compute, not in "other": rank 1's 30 ms of host work a step
    # is its compute, and the table says it made rank 0 wait.
    job = fork_job(_bare_ddp_loop, 2)
    table = read_table(job.records_path)
    for rec in table.to_records():
        assert any(iv.kind is IntervalKind.COMPUTE for iv in rec.intervals), (rec.rank, rec.step)
    result = analyze(table).to_dict()
    rows = {r["category"]: r for r in result["rows"]}
    assert rows["compute"]["measured_median_seconds"] > 0
    assert rows["other"]["measured_median_seconds"] < 0.1 * rows["compute"]["measured_median_seconds"]
    assert rows["compute"]["worst_rank"] == 1
    assert rows["comm.dp.sync_wait"]["suspect"]["rank"] == 1


def _accumulating_ddp_loop(rank: int, world: int) -> dict[str, object]:
    """Accelerate's loop: one micro-batch per loader batch, ``no_sync`` on all but every second, a step per two."""
    import torch  # noqa: PLC0415 - the forked rank's torch, pre-imported by conftest
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817, PLC0415

    tracker = sdk.tracker_from_env()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [torch.full((2, 8), float(i + rank)) for i in range(6)]
    for i, batch in enumerate(tracker.data(loader)):
        if i % 2 == 0:
            tracker.start_step()
        sync = i % 2 == 1
        with contextlib.nullcontext() if sync else model.no_sync():
            with tracker.phase("forward"):
                loss = model(batch).sum()
            with tracker.phase("backward"):
                loss.backward()
        if sync:
            with tracker.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters}


@pytest.mark.slow
def test_a_ddp_step_over_several_loader_batches_keeps_its_all_reduce(fork_job) -> None:
    # The second micro-batch's backward all-reduces; before, its fetch ended the step and it ran outside any step.
    job = fork_job(_accumulating_ddp_loop, 2, every_step=("data", "comm", "optimizer"))
    for result in job.results:
        assert (result["counters"]["phases_outside_step"], result["counters"]["hook_errors"]) == (0, 0)
    records = sorted(read_table(job.records_path).to_records(), key=lambda r: (r.rank, r.step))
    assert [(r.rank, r.step) for r in records] == [(rank, step) for rank in (0, 1) for step in (0, 1, 2)]
    for rec in records:
        assert [str(iv.op) for iv in rec.intervals if iv.axis] == ["all_reduce"]
        assert len([iv for iv in rec.intervals if iv.kind is IntervalKind.DATA]) == 2
        phases = [phase for phase, _ in itertools.groupby(iv.phase.value for iv in rec.intervals if iv.phase)]
        assert phases == ["forward", "backward"] * 2  # (backward cut around the all-reduce's wait)


def test_data_stats_between_a_fetch_and_its_step_go_to_that_step(listener) -> None:
    sock, path = listener
    tracker = _tracker(path)
    tracker.data_stats(tokens=99)  # no fetch held, no step open: ignored
    for i, _ in enumerate(tracker.data(SlowLoader(2, 0.0))):
        tracker.data_stats(sequence_lengths=[3, 4 + i])  # after the fetch, before the step it opens
        with tracker.step(i):
            tracker.data_stats(tokens=1)
    tracker.close()
    records = _records(sock)
    assert [(r.stats.tokens, r.stats.sequences, r.stats.longest_sequence) for r in records] == [(8, 2, 4), (9, 2, 5)]


def _pipelined_loop_marking_only_its_steps(rank: int, world: int) -> dict[str, object]:
    """PyTorch's pipelining tutorial's loop: a stage per rank, 1F1B over 4 micro-batches, no phase of its own."""
    import torch  # noqa: PLC0415 - the forked rank's torch, pre-imported by conftest
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # noqa: PLC0415

    tracker = sdk.tracker_from_env()
    torch.manual_seed(rank)
    torch.set_num_threads(1)
    block = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    stage = PipelineStage(block, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=lambda out, target: (out - target).square().mean())
    optimizer = torch.optim.SGD(block.parameters(), lr=0.01)
    for i in range(4):
        with tracker.step(i):
            x, y = torch.randn(16, 64), torch.randn(16, 64)
            if rank == 0:
                schedule.step(x)
            else:
                losses: list[torch.Tensor] = []
                schedule.step(target=y, losses=losses)
                torch.stack(losses).mean().item()  # the loop's own work: the loss it logs
            optimizer.step()
            optimizer.zero_grad()
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters}


def test_a_pipelined_loop_that_marks_only_its_steps_computes_outside_the_stages_labels(fork_job) -> None:
    # The SDK labels a pipelining stage's forward and backward chunks by itself. Those labels declared the step's
    # compute as a script's own phases do, so the loop's other work (batches, the loss, the schedule's own code)
    # was `other` instead of compute (docs/sdk.md §1.1: a step without a compute phase of its own computes outside
    # its phases).
    job = fork_job(_pipelined_loop_marking_only_its_steps, 2, env={"MESHSCOPE_LAYOUT": "pp=2"})
    for result in job.results:
        assert result["counters"]["hook_errors"] == 0
    records = read_table(job.records_path).to_records()
    assert len(records) == 8
    for rec in records:
        phases = {iv.phase for iv in rec.intervals if iv.kind is IntervalKind.COMPUTE}
        assert {"forward", "backward"} <= {str(p) for p in phases if p is not None}, (rec.rank, rec.step)
        assert None in phases, (rec.rank, rec.step)  # compute outside the labels: the loop's own
        assert any(iv.axis == "pp" for iv in rec.intervals)


def _loop_that_raises(rank: int, world: int) -> dict[str, object]:
    """A DDP loop whose loss check raises in step 3 on every rank (after backward, as a NaN guard would), caught
    outside the step; the job goes on with two more steps."""
    import torch  # noqa: PLC0415 - the forked rank's torch, pre-imported by conftest
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817, PLC0415

    tracker = sdk.tracker_from_env()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    caught = []
    for i in range(6):
        try:
            with tracker.step(i):
                loss = model(torch.randn(4, 16)).sum()
                loss.backward()
                if i == 3:
                    raise FloatingPointError("loss is not finite")  # noqa: TRY301 - the loop's own loss check
                optimizer.step()
                optimizer.zero_grad()
        except FloatingPointError as exc:
            caught.append(type(exc).__name__)
            optimizer.zero_grad()
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters, "caught": caught}


@pytest.mark.slow
def test_a_step_left_by_an_exception_says_so_and_the_analysis_leaves_it_out(fork_job) -> None:
    job = fork_job(_loop_that_raises, 2)
    assert [r["caught"] for r in job.results] == [["FloatingPointError"]] * 2
    assert all(r["counters"]["hook_errors"] == 0 for r in job.results)
    lines = [json.loads(line) for line in job.records_path.read_text().splitlines()]
    raised = sorted((o["rank"], o["step"], o["raised"]) for o in lines if "raised" in o)
    assert raised == [(0, 3, "FloatingPointError"), (1, 3, "FloatingPointError")]
    assert len(lines) == 12  # the file keeps every step, the cut ones too
    table = read_table(job.records_path)
    assert sorted({r.step for r in table.to_records()}) == [0, 1, 2, 4, 5]
    (note,) = [n for n in analyze(table).to_dict()["partial_data"] if n["code"] == "raised_steps"]
    assert note["message"].startswith("2 rank-steps ended by an exception (rank 0 step 3, rank 1 step 3) left out")


def _loop_with_a_synced_evaluation(rank: int, world: int) -> dict[str, object]:
    """A DDP loop that evaluates on every rank before every third step, outside the steps, and all-reduces the
    metric there (Lightning's validation with ``sync_dist``, a Trainer's gathered predictions): rank 1 evaluates for
    80 ms, rank 0 for 5 ms, then waits for rank 1 in the all-reduce. Sleeps: the time is the loop's, not the host's."""
    import torch  # noqa: PLC0415 - the forked rank's torch, pre-imported by conftest
    import torch.distributed as dist  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817, PLC0415

    tracker = sdk.tracker_from_env()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(13):
        if i and i % 3 == 0:
            with tracker.phase("eval"), torch.no_grad():
                time.sleep(0.08 if rank == 1 else 0.005)
                metric = model(torch.ones(4, 16)).sum().reshape(1)
                dist.all_reduce(metric)
        with tracker.step(i):
            time.sleep(0.01)
            loss = model(torch.randn(4, 16)).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    counters = tracker.counters().as_dict()
    tracker.close()
    return {"counters": counters}


@pytest.mark.slow
def test_a_rank_slow_in_an_evaluation_every_rank_runs_between_steps_is_named(fork_job) -> None:
    # Every rank's gap before an evaluated step is ~80 ms: rank 1's own, rank 0's mostly waiting for rank 1 in the
    # metric all-reduce, between the steps, where no step's collective is. The records say how long each rank was
    # blocked in collectives there (between_steps.comm); before, nothing told the slow rank from the waiting one.
    job = fork_job(_loop_with_a_synced_evaluation, 2)
    assert all(r["counters"]["hook_errors"] == 0 for r in job.results)
    records = read_table(job.records_path).to_records()
    evaluated = {(r.rank, r.step): r.between_steps for r in records if r.step in (3, 6, 9, 12)}
    assert all(b is not None and b.eval_us >= b.comm_us for b in evaluated.values())  # inside the evaluation
    # rank 0 waits ~75 ms for rank 1 there (less what the host took from it); a host that holds rank 0 off its core
    # for longer than rank 1's evaluation can turn one step's roles around, not most
    waits = [(evaluated[0, k].comm_us, evaluated[1, k].comm_us) for k in (3, 6, 9, 12)]
    assert sum(w0 >= 60 * MS and w1 < 20 * MS for w0, w1 in waits) >= 3, evaluated
    assert all(r.between_steps is None or r.between_steps.comm_us < 20 * MS for r in records if r.step % 3)
    findings = analyze(read_table(job.records_path, skip_steps=1)).findings
    (f,) = [f for f in findings if f.code == "between-steps"]
    assert [s.rank for s in f.suspects] == [1], f.message
    assert "in collectives between the steps" in f.message
    assert 0.06 <= f.evidence["peer_wait_between_steps_seconds"] <= 0.1
    assert "straggler" not in [x.code for x in findings]

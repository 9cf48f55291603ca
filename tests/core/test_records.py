"""Step records: round trips through JSON lines (plain and gzip), the columnar table, and every bad-input error."""

from __future__ import annotations

import gzip
import json
import pickle
import platform
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import meshscope.records.reading as records_module
from meshscope.analysis import analyze
from meshscope.errors import ParseCode, ParseError
from meshscope.records import (
    BETWEEN_KINDS,
    COMM_CODE,
    KIND_CODE,
    OP_CODE,
    RAISED_STEPS,
    SCHEMA,
    BetweenSteps,
    DataStats,
    Interval,
    IntervalColumns,
    RecordTable,
    StepColumns,
    StepRecord,
    lexsort_keys,
    pack_lines,
    read_records,
    read_table,
    record_to_json,
    table_from_columns,
    table_from_lines,
    unpack_columns,
    write_records,
)
from meshscope.records.memory import mapped_empty
from record_samples import _outcome, _records_one_field_changed, good_json, make_record, sample_records, write_lines

DATA_DIR = Path(__file__).parent.parent / "data"


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", ["records.jsonl", "records.jsonl.gz"], ids=["plain", "gzip"])
def test_write_then_read_round_trips(tmp_path, name):
    records = sample_records()
    path = tmp_path / name
    assert write_records(path, records) == len(records)
    read = read_records(path)
    assert read.records == tuple(records)
    assert read.job == "demo"
    assert read.notes == ()
    table = read_table(path)
    assert table.to_records() == tuple(records)
    assert table.source_files == (str(path),)
    if name.endswith(".gz"):
        with gzip.open(path, "rt") as f:
            assert json.loads(f.readline())["schema"] == SCHEMA


def test_table_round_trips_through_a_file(tmp_path):
    table = RecordTable.from_records(sample_records())
    write_records(tmp_path / "t.jsonl", table)
    again = read_table(tmp_path / "t.jsonl")
    assert again.to_records() == table.to_records()
    np.testing.assert_array_equal(again.intervals.kind, table.intervals.kind)
    np.testing.assert_array_equal(again.steps.coord, table.steps.coord)


def test_a_table_is_written_as_its_records_json(tmp_path):
    # The columnar writer against the object path (record_to_json): same objects, same key order, line by line,
    # including left-out optional fields and a row without stats, gpu or domains.
    records = [
        *sample_records(),
        make_record(9, nvlink_domain=None, network_tier=None, gpu=None, stats=DataStats(), gpu_util=None),
        make_record(10, stats=DataStats(tokens=5), intervals=()),
    ]
    path = tmp_path / "t.jsonl"
    assert write_records(path, RecordTable.from_records(records)) == len(records)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    expected = [record_to_json(r) for r in records]
    assert lines == expected
    assert [list(obj) for obj in lines] == [list(obj) for obj in expected]
    assert [list(iv) for obj in lines for iv in obj["intervals"]] == [
        list(iv) for obj in expected for iv in obj["intervals"]
    ]


def test_loop_fields_read_as_columns_with_minus_one_for_unknown(tmp_path):
    # user_step, gap_before_us and between_steps: optional; the table holds -1 where a record leaves them out, and a
    # between_steps object gives 0 for the kinds it leaves out.
    records = [
        make_record(
            0,
            0,
            user_step=None,
            gap_before_us=None,
            between_steps=None,
            runqueue_wait_us=None,
            on_cpu_us=None,
            compute_runqueue_wait_us=None,
            data_runqueue_wait_us=None,
            optimizer_runqueue_wait_us=None,
        ),
        make_record(
            0,
            1,
            user_step=0,
            gap_before_us=180_000,
            between_steps=BetweenSteps(checkpoint_us=150_000, comm_us=20_000),
            runqueue_wait_us=0,
            compute_runqueue_wait_us=0,
            data_runqueue_wait_us=0,
            optimizer_runqueue_wait_us=0,
        ),
        make_record(
            0,
            2,
            user_step=None,
            gap_before_us=40,
            between_steps=BetweenSteps(),
            runqueue_wait_us=31_000,
            on_cpu_us=0,
            compute_runqueue_wait_us=30_999,
            data_runqueue_wait_us=1,
            optimizer_runqueue_wait_us=2,
        ),
    ]
    path = tmp_path / "loop.jsonl"
    write_records(path, records)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert "user_step" not in lines[0]
    assert "gap_before_us" not in lines[0]
    assert "between_steps" not in lines[0]
    assert "runqueue_wait_us" not in lines[0]
    assert "on_cpu_us" not in lines[0]
    assert "compute_runqueue_wait_us" not in lines[0]
    assert "data_runqueue_wait_us" not in lines[0]
    assert "optimizer_runqueue_wait_us" not in lines[0]
    assert (lines[1]["data_runqueue_wait_us"], lines[2]["data_runqueue_wait_us"]) == (0, 1)
    assert (lines[1]["optimizer_runqueue_wait_us"], lines[2]["optimizer_runqueue_wait_us"]) == (0, 2)
    assert (lines[1]["compute_runqueue_wait_us"], lines[2]["compute_runqueue_wait_us"]) == (0, 30_999)
    assert lines[2]["on_cpu_us"] == 0
    assert lines[1]["runqueue_wait_us"] == 0
    assert lines[1]["between_steps"] == {"checkpoint": 150_000, "comm": 20_000}  # comm: inside the kinds
    assert lines[2]["between_steps"] == {}
    for table in (read_table(path), RecordTable.from_records(records)):
        s = table.steps
        assert s.user_step.tolist() == [-1, 0, -1]
        assert s.gap_before_us.tolist() == [-1, 180_000, 40]
        assert s.runqueue_wait_us.tolist() == [-1, 0, 31_000]
        assert s.on_cpu_us.tolist() == [-1, 90_000, 0]
        assert s.compute_runqueue_wait_us.tolist() == [-1, 0, 30_999]
        assert s.data_runqueue_wait_us.tolist() == [-1, 0, 1]
        assert s.optimizer_runqueue_wait_us.tolist() == [-1, 0, 2]
        checkpoint = BETWEEN_KINDS.index("checkpoint")
        assert s.between_us.tolist()[0] == [-1] * len(BETWEEN_KINDS)
        assert s.between_us[1, checkpoint] == 150_000
        assert s.between_us[1].sum() == 150_000
        assert s.between_us.tolist()[2] == [0] * len(BETWEEN_KINDS)
        assert s.between_comm_us.tolist() == [-1, 20_000, 0]
        assert table.to_records() == tuple(records)
    assert read_records(path).records == tuple(records)
    write_records(tmp_path / "again.jsonl", read_table(path))  # the table writer writes the same lines
    assert (tmp_path / "again.jsonl").read_text() == path.read_text()


_RANGE, _TYPE = ParseCode.VALUE_OUT_OF_RANGE, ParseCode.WRONG_TYPE


@pytest.mark.parametrize(
    ("change", "code", "fragment"),
    [
        ({"user_step": -1}, _RANGE, "user_step = -1 is below 0"),
        ({"gap_before_us": -5}, _RANGE, "gap_before_us = -5 is below 0"),
        ({"gap_before_us": 1.5}, _TYPE, "gap_before_us = 1.5 (float); expected a whole number"),
        ({"runqueue_wait_us": -3}, _RANGE, "runqueue_wait_us = -3 is below 0"),
        ({"runqueue_wait_us": "7"}, _TYPE, "runqueue_wait_us = '7' (str); expected a whole number"),
        ({"on_cpu_us": -1}, _RANGE, "on_cpu_us = -1 is below 0"),
        ({"compute_runqueue_wait_us": -1}, _RANGE, "compute_runqueue_wait_us = -1 is below 0"),
        ({"data_runqueue_wait_us": -1}, _RANGE, "data_runqueue_wait_us = -1 is below 0"),
        (
            {"data_runqueue_wait_us": 701},
            _RANGE,
            "data_runqueue_wait_us = 701 must come with runqueue_wait_us and be at most it (runqueue_wait_us = 700",
        ),
        ({"optimizer_runqueue_wait_us": -1}, _RANGE, "optimizer_runqueue_wait_us = -1 is below 0"),
        (
            {"optimizer_runqueue_wait_us": 701},
            _RANGE,
            "optimizer_runqueue_wait_us = 701 must come with runqueue_wait_us and be at most it",
        ),
        ({"attempt_start_us": -1}, _RANGE, "attempt_start_us = -1 is below 0"),
        ({"attempt_start_us": 2.5}, _TYPE, "attempt_start_us = 2.5 (float); expected a whole number"),
        (
            {"compute_runqueue_wait_us": 701},
            _RANGE,
            "compute_runqueue_wait_us = 701 must come with runqueue_wait_us and be at most it (runqueue_wait_us = 700",
        ),
        (
            {"runqueue_wait_us": None},
            _RANGE,
            "compute_runqueue_wait_us = 500 must come with runqueue_wait_us and be at most it",
        ),
        ({"between_steps": {"checkpoint": -2}}, _RANGE, "between_steps: checkpoint = -2 is below 0"),
        ({"between_steps": {"comm": -1}}, _RANGE, "between_steps: comm = -1 is below 0"),
        ({"between_steps": [1]}, _TYPE, "between_steps = '[1]' (list); expected a JSON object"),
        ({"raised": ""}, _RANGE, "raised = '' (str); expected a non-empty string"),
        ({"raised": 7}, _TYPE, "raised = 7 (int); expected a non-empty string"),
        ({"raised": "E" * 201}, _RANGE, "must be the exception's type name, 1 to 200 characters"),
    ],
    ids=[
        "user-step",
        "gap",
        "gap-float",
        "runqueue-negative",
        "runqueue-str",
        "on-cpu-negative",
        "in-compute-negative",
        "in-data-negative",
        "in-data-above-total",
        "in-optimizer-negative",
        "in-optimizer-above-total",
        "attempt-negative",
        "attempt-float",
        "in-compute-above-total",
        "in-compute-without-total",
        "between-negative",
        "between-comm-negative",
        "between-list",
        "raised-empty",
        "raised-int",
        "raised-too-long",
    ],
)
def test_loop_field_errors_in_both_readers(tmp_path, change, code, fragment):
    path = write_lines(tmp_path / "r.jsonl", [good_json(1), good_json(2, **change)])
    _both_readers_raise(path, f"{path} line 2", fragment, code=code)


def test_a_step_that_raised_is_left_out_of_every_table_with_a_note_and_kept_in_the_file(tmp_path):
    """A step its ``with tracker.step()`` left by an exception was cut short: every reader leaves it out (the file
    readers, records in memory, lines, packed columns) and says which; the file and the record objects keep it."""
    records = list(sample_records())
    cut = {(records[3].rank, records[3].step), (records[6].rank, records[6].step)}
    records[3] = replace(records[3], raised="RuntimeError")
    records[6] = replace(records[6], raised="torch.OutOfMemoryError")
    path = tmp_path / "r.jsonl"
    write_records(path, records)
    lines = path.read_bytes().splitlines()
    assert json.loads(lines[3])["raised"] == "RuntimeError"
    assert read_records(path).records == tuple(records)  # the record objects keep what the file holds
    ran = tuple(r for r in records if r.raised is None)
    packed, _ = pack_lines(lines, where="pod-0")
    tables = {
        "file": read_table(path),
        "objects": RecordTable.from_records(records),
        "lines": table_from_lines(lines),
        "packed": table_from_columns([unpack_columns(packed, where="pod-0")]),
    }
    which = ", ".join(f"rank {r} step {st}" for st, r in sorted((st, r) for r, st in cut))
    for name, table in tables.items():
        assert table.to_records() == ran, name
        (note,) = [n for n in table.notes if n.code == RAISED_STEPS]
        assert note.count == 2, name
        assert note.message.startswith(f"2 rank-steps ended by an exception ({which}) left out: cut short"), name


def test_table_columns_hold_codes_and_the_rows_they_belong_to():
    table = RecordTable.from_records(sample_records())
    assert table.n_rows == 8
    assert table.n_intervals == 8 * 7
    iv = table.intervals
    np.testing.assert_array_equal(np.bincount(iv.row), [7] * 8)
    comm = iv.kind == COMM_CODE
    assert (iv.op[comm] == OP_CODE["all_reduce"]).all()
    assert [table.group_name(int(g)) for g in iv.group[comm][:4]] == ["tp:0", "tp:0", "tp:1", "tp:1"]
    assert (iv.group[iv.kind == KIND_CODE["data"]] == -1).all()
    assert table.node_names == ("node-0",)
    assert table.steps.gpu_util.tolist() == [0.97] * 8


def test_optional_fields_may_be_left_out(tmp_path):
    obj = good_json()
    for key in ("nvlink_domain", "network_tier", "gpu", "stats", "gpu_util"):
        del obj[key]
    obj["intervals"] = [{"kind": "compute", "start_us": obj["start_us"], "end_us": obj["end_us"]}]
    path = write_lines(tmp_path / "r.jsonl", [obj])
    (rec,) = read_records(path).records
    assert (rec.gpu, rec.gpu_util, rec.stats, rec.intervals[0].phase) == (None, None, DataStats(), None)
    table = read_table(path)
    assert table.to_records() == (rec,)
    assert np.isnan(table.steps.gpu_util[0])
    assert table.steps.nvlink_domain[0] == -1


def test_several_files_of_one_job_read_together(tmp_path):
    records = sample_records()
    a = tmp_path / "rank0.jsonl"
    b = tmp_path / "rank1.jsonl.gz"
    write_records(a, records[:3])
    write_records(b, records[3:])
    assert read_records([a, b]).records == tuple(records)
    table = read_table([a, b])
    assert table.to_records() == tuple(records)
    assert table.where_row(4) == f"{b} line 2"


def test_from_arrays_builds_the_same_table_as_from_records():
    records = [make_record(0), make_record(1)]
    expected = RecordTable.from_records(records)
    e = expected.intervals
    built = RecordTable(
        job="demo",
        steps=StepColumns.build(
            rank=[0, 1],
            step=[0, 0],
            start_us=expected.steps.start_us,
            end_us=expected.steps.end_us,
            coord=expected.steps.coord,
            node=[0, 0],
            nvlink_domain=[0, 0],
            network_tier=[0, 0],
            gpu=[0, 1],
            gpu_util=[0.97, 0.97],
            tokens=[16384] * 2,
            sequences=[4] * 2,
            longest_sequence=[8192] * 2,
            attention_work=[2.1e8] * 2,
            attention_us=[5100] * 2,
            peak_memory_bytes=[123_456_789] * 2,
            user_step=[0, 0],
            gap_before_us=[2_500] * 2,
            between_us=[[0, 0, 0, 1_500, 500]] * 2,
            between_comm_us=[300] * 2,
            runqueue_wait_us=[700] * 2,
            on_cpu_us=[90_000] * 2,
            compute_runqueue_wait_us=[500] * 2,
            data_runqueue_wait_us=[150] * 2,
            optimizer_runqueue_wait_us=[50] * 2,
            attempt_start_us=[1_699_999_990_000_000, 1_699_999_990_000_001],
        ),
        intervals=IntervalColumns.build(
            row=e.row,
            kind=e.kind,
            start_us=e.start_us,
            end_us=e.end_us,
            phase=e.phase,
            axis=e.axis,
            op=e.op,
            group=e.group,
            seq=e.seq,
            size_bytes=e.size_bytes,
            group_size=e.group_size,
            peer=e.peer,
        ),
        node_names=("node-0",),
        nvlink_domain_names=("nvl-0",),
        network_tier_names=("block-0",),
        group_names=("pp:0-1", "tp:0"),  # every table numbers names in natural order, whatever came first
    )
    assert expected.group_names == ("pp:0-1", "tp:0")
    assert built.to_records() == tuple(records)


# ---------------------------------------------------------------------------- partial files


def test_truncated_last_line_is_an_error_naming_the_line(tmp_path):
    objs = [good_json(0), good_json(1)]
    cut = json.dumps(good_json(2))[:120]
    path = write_lines(tmp_path / "r.jsonl", objs, tail=cut)
    for reader in (read_records, read_table):
        with pytest.raises(ParseError, match=re.escape(f"{path} line 3: the last line is truncated")) as info:
            reader(path)
        assert "allow_partial=True" in str(info.value)


def test_truncated_last_line_is_skipped_and_noted_when_partial_data_is_allowed(tmp_path):
    cut = json.dumps(good_json(2))[:120]
    path = write_lines(tmp_path / "r.jsonl", [good_json(0), good_json(1)], tail=cut)
    read = read_records(path, allow_partial=True)
    assert [r.rank for r in read.records] == [0, 1]
    (note,) = read.notes
    assert (note.code, note.count) == ("truncated_line", 1)
    assert "line 3" in note.message
    table = read_table(path, allow_partial=True)
    assert table.n_rows == 2
    assert [n.code for n in table.notes] == ["truncated_line"]


def test_truncated_gzip_stream(tmp_path):
    path = tmp_path / "r.jsonl.gz"
    records = [make_record(rank, step) for step in range(10) for rank in range(8)]
    write_records(path, records)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ParseError, match="compressed stream ends early"):
        read_records(path)
    table = read_table(path, allow_partial=True)
    assert 0 < table.n_rows < len(records)
    assert table.to_records() == tuple(records[: table.n_rows])
    assert [n.code for n in table.notes] == ["truncated_file"]


def test_corrupt_line_in_the_middle_is_an_error_even_with_partial_data_allowed(tmp_path):
    path = write_lines(tmp_path / "r.jsonl", [good_json(0)], tail='{"schema": oops\n' + json.dumps(good_json(1)) + "\n")
    for reader in (read_records, read_table):
        with pytest.raises(ParseError, match=re.escape(f"{path} line 2: not valid JSON")):
            reader(path, allow_partial=True)


def test_blank_lines_are_ignored(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(good_json(0)) + "\n\n" + json.dumps(good_json(1)) + "\n\n")
    assert len(read_records(path)) == 2
    assert read_table(path).where_row(1) == f"{path} line 3"


# ---------------------------------------------------------------------------- schema errors


def _lines_in_memory(path: Path) -> RecordTable:
    """The in-memory reader (the sidecar's) over a file's lines, named as the file so that messages compare."""
    return table_from_lines(path.read_bytes().splitlines(keepends=True), where=str(path))


def _both_readers_raise(path: Path, *fragments: str, code: ParseCode) -> None:
    """Both readers refuse ``path`` with the error code ``code``; the message names where and what (``fragments``).

    The in-memory reader of the same lines (:func:`table_from_lines`) refuses them with the same error too.
    """
    for reader in (read_records, read_table, _lines_in_memory):
        with pytest.raises(ParseError) as info:
            reader(path)
        assert info.value.code is code, (reader.__name__, info.value.code, str(info.value))
        for fragment in fragments:
            assert fragment in str(info.value), (reader.__name__, str(info.value))


def test_mismatched_jobs_name_both_jobs(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [good_json(0)])
    b = write_lines(tmp_path / "b.jsonl", [good_json(1, job="other-job")])
    for reader in (read_records, read_table):
        with pytest.raises(ParseError) as info:
            reader([a, b])
        message = str(info.value)
        assert "'other-job'" in message
        assert "'demo'" in message
        assert f"{b} line 1" in message
        assert f"{a} line 1" in message


def test_interval_ending_before_it_starts(tmp_path):
    obj = good_json()
    iv = obj["intervals"][2]
    iv["end_us"] = iv["start_us"] - 7
    path = write_lines(tmp_path / "r.jsonl", [obj])
    _both_readers_raise(
        path,
        f"{path} line 1: intervals[2].end_us = {iv['end_us']} is before start_us = {iv['start_us']}",
        code=ParseCode.ENDS_BEFORE_START,
    )


def test_step_ending_before_it_starts(tmp_path):
    obj = good_json()
    obj["end_us"] = obj["start_us"] - 1
    obj["intervals"] = []
    path = write_lines(tmp_path / "r.jsonl", [obj])
    _both_readers_raise(
        path,
        f"{path} line 1: end_us = {obj['end_us']} is before start_us = {obj['start_us']}",
        code=ParseCode.ENDS_BEFORE_START,
    )


def test_interval_wholly_outside_its_step(tmp_path):
    obj = good_json()
    obj["intervals"][1]["start_us"] = obj["end_us"] + 10
    obj["intervals"][1]["end_us"] = obj["end_us"] + 20
    path = write_lines(tmp_path / "r.jsonl", [obj])
    _both_readers_raise(path, "line 1: intervals[1] = [", "lies wholly outside the step [", code=ParseCode.OUTSIDE_STEP)


def test_unknown_kind_lists_the_kinds_that_fit(tmp_path):
    obj = good_json()
    obj["intervals"][0]["kind"] = "idle"
    path = write_lines(tmp_path / "r.jsonl", [obj])
    _both_readers_raise(
        path,
        "line 1: intervals[0]: kind = 'idle' is not one of ['compute', 'data'",
        "'p2p']",
        code=ParseCode.NOT_ONE_OF,
    )


def test_a_repeated_rank_step_is_read_as_a_restart_by_every_reader(tmp_path):
    # Rank 0 writes step 0 twice: its step numbers went back, so a second attempt began (the readers cannot tell a
    # repeated line from a restart, and a real job only repeats steps by restarting); its last attempt is kept.
    path = write_lines(tmp_path / "r.jsonl", [good_json(0), good_json(1), good_json(0, start_us=5), good_json(1, 1)])
    for reader in (read_records, read_table, _lines_in_memory):
        got = reader(path)
        records = got.records if hasattr(got, "records") else got.to_records()
        assert sorted((r.rank, r.step) for r in records) == [(0, 0), (1, 0), (1, 1)], reader.__name__
        assert next(r for r in records if r.rank == 0).start_us == 5, reader.__name__  # the later one
        assert [(n.code, n.count) for n in got.notes] == [("earlier_attempts", 1)], reader.__name__


def _attempt(rank: int, steps: range, *, first_seq: int, shift_us: int) -> list[dict]:
    """Rank ``rank``'s records of ``steps`` in one attempt: its collectives numbered from ``first_seq``, its process
    started ``shift_us`` after the first attempt's."""
    out = []
    for i, step in enumerate(steps):
        obj = good_json(rank, step)
        obj["attempt_start_us"] += shift_us
        for iv in obj["intervals"]:
            for key in ("start_us", "end_us"):
                iv[key] += shift_us
            if iv["kind"] == "comm":
                iv["seq"] = first_seq + i
        obj["start_us"] += shift_us
        obj["end_us"] += shift_us
        out.append(obj)
    return out


def test_a_restarted_jobs_records_are_read_as_its_last_attempt(tmp_path):
    # Attempt 1 ran steps 0-5 and died; attempt 2 resumed from a checkpoint at step 3 and ran 3-8, its collectives
    # numbered from 0 again, into the same per-rank files (MESHSCOPE_COLLECTOR=file:DIR appends). Before: "rank 0
    # step 3 appears twice", no analysis at all.
    later = 60_000_000
    paths = []
    for rank in (0, 1):
        lines = _attempt(rank, range(6), first_seq=0, shift_us=0) + _attempt(
            rank, range(3, 9), first_seq=0, shift_us=later
        )
        paths.append(write_lines(tmp_path / f"rank-{rank:05d}.jsonl", lines))
    for table in (
        read_table(paths),
        table_from_lines([line for p in paths for line in p.read_bytes().splitlines()], where="x"),
    ):
        assert sorted(zip(table.steps.rank.tolist(), table.steps.step.tolist(), strict=True)) == [
            (rank, step) for rank in (0, 1) for step in range(3, 9)
        ]
        assert (table.steps.start_us >= later).all()  # attempt 2's own records, not attempt 1's steps 3-5
        (note,) = [n for n in table.notes if n.code == "earlier_attempts"]
        assert note.count == 12  # steps 0-5 of both ranks
        assert note.message.startswith("the records hold 1 restart (2 ranks began again")
    assert "earlier_attempts" in {n["code"] for n in analyze(read_table(paths)).to_dict()["partial_data"]}


def test_a_step_an_earlier_attempt_died_in_is_not_noted_in_the_attempt_read(tmp_path):
    # Attempt 1 died in rank 0's step 4 (marked raised); attempt 2 resumed at step 3 and ran its step 4 cleanly. The
    # last attempt's analysis said "rank 0 step 4 ... left out: cut short" of a step it holds and analyses.
    later = 60_000_000
    paths = []
    for rank in (0, 1):
        first = _attempt(rank, range(5), first_seq=0, shift_us=0)
        if rank == 0:
            first[4]["raised"] = "RuntimeError"
        lines = first + _attempt(rank, range(3, 9), first_seq=0, shift_us=later)
        paths.append(write_lines(tmp_path / f"rank-{rank:05d}.jsonl", lines))
    for table in (
        read_table(paths),
        table_from_lines([line for p in paths for line in p.read_bytes().splitlines()], where="x"),
    ):
        assert (0, 4) in set(zip(table.steps.rank.tolist(), table.steps.step.tolist(), strict=True))
        assert [n.code for n in table.notes] == ["earlier_attempts"]
    # The attempt that died, read as such, says so.
    first = read_table(paths, attempt=1)
    (note,) = [n for n in first.notes if n.code == RAISED_STEPS]
    assert "(rank 0 step 4)" in note.message


def test_a_repeated_sequence_number_without_a_restart_is_still_refused(tmp_path):
    # Steps go up, but one collective's seq repeats: not a restart, a broken record; the error stands.
    lines = _attempt(0, range(2), first_seq=0, shift_us=0) + _attempt(1, range(2), first_seq=0, shift_us=0)
    lines[1]["intervals"] = [dict(iv, seq=0) if iv["kind"] == "comm" else iv for iv in lines[1]["intervals"]]
    path = write_lines(tmp_path / "r.jsonl", lines)
    with pytest.raises(ParseError, match="seq 0 appears twice on rank 0"):
        read_table(path)


def _packed(path: Path) -> RecordTable:
    """The packed-columns path (a sidecar's answer to the operator) over a file's lines."""
    data, _ = pack_lines(path.read_bytes().splitlines(keepends=True), where=str(path))
    return table_from_columns([unpack_columns(data, where=str(path))])


def _objects(path: Path) -> RecordTable:
    """The object reader, its records then made a table (what ``meshscope run``'s summary does)."""
    got = read_records(path)
    return RecordTable.from_records(got.records, notes=got.notes)


def _kept_by_every_reader(path: Path, steps: range, *, dropped: int) -> list[RecordTable]:
    """Every reader keeps steps ``steps`` of ranks 0 and 1 from ``path``, and notes ``dropped`` rank-steps left out."""
    tables = []
    for reader in (read_table, _lines_in_memory, _packed, _objects):
        table = reader(path)
        assert sorted(zip(table.steps.rank.tolist(), table.steps.step.tolist(), strict=True)) == [
            (rank, step) for rank in (0, 1) for step in steps
        ], reader.__name__
        (note,) = [n for n in table.notes if n.code == "earlier_attempts"]
        assert note.count == dropped, reader.__name__
        tables.append(table)
    return tables


def test_a_job_resumed_right_after_its_last_step_is_read_as_its_last_attempt(tmp_path):
    # Attempt 1 ran steps 0-5 and saved a checkpoint after its last step (a preemption handler's save, then exit);
    # attempt 2, a new process, resumed at step 6: its step numbers go on, its collectives' seqs start over. Nothing
    # but the new process's attempt_start_us says a new attempt began. Before: "seq 0 appears twice on rank 0".
    later = 60_000_000
    lines = []
    for rank in (0, 1):
        lines += _attempt(rank, range(6), first_seq=0, shift_us=0)
    for rank in (0, 1):  # a collector's arrivals: the ranks' records interleaved, each rank's in order
        lines += _attempt(rank, range(6, 10), first_seq=0, shift_us=later)
    path = write_lines(tmp_path / "records.jsonl", lines)
    for table in _kept_by_every_reader(path, range(6, 10), dropped=12):  # steps 0-5 of both ranks left out
        (note,) = [n for n in table.notes if n.code == "earlier_attempts"]
        assert note.message.startswith("the records hold 1 restart (2 ranks began again")
    analysis = analyze(read_table(path)).to_dict()
    assert "earlier_attempts" in {n["code"] for n in analysis["partial_data"]}


def test_a_new_process_is_a_new_attempt_only_where_it_writes_for_its_own_rank(tmp_path):
    # Every rank is its own process with its own attempt_start_us: a change from rank to rank is no restart.
    lines = [good_json(rank, step, attempt_start_us=1_000 + 7 * rank) for step in range(3) for rank in range(4)]
    path = write_lines(tmp_path / "records.jsonl", lines)
    for reader in (read_table, _lines_in_memory, _packed, _objects):
        table = reader(path)
        assert table.n_rows == 12, reader.__name__
        assert not table.notes, reader.__name__


def test_an_earlier_attempt_is_read_when_asked_for(tmp_path):
    # The job crashed in attempt 1 (steps 0-5) and resumed from step 3: the attempt that crashed is the one to look
    # at. read_table(attempt=1) keeps every rank's first process; -2 is the same one counted from the last.
    later = 60_000_000
    lines = []
    for rank in (0, 1):
        lines += _attempt(rank, range(6), first_seq=0, shift_us=0) + _attempt(
            rank, range(3, 9), first_seq=0, shift_us=later
        )
    path = write_lines(tmp_path / "records.jsonl", lines)
    for attempt in (1, -2):
        table = read_table(path, attempt=attempt)
        assert sorted(zip(table.steps.rank.tolist(), table.steps.step.tolist(), strict=True)) == [
            (rank, step) for rank in (0, 1) for step in range(6)
        ]
        assert (table.steps.start_us < good_json(0, 0)["start_us"] + later).all()  # attempt 1's own records
        (note,) = [n for n in table.notes if n.code == "earlier_attempts"]
        assert note.count == 12  # steps 3-8 of the later attempt, both ranks
        assert note.message.endswith(
            f"12 rank-steps of its other attempts are left out and attempt {attempt} of each rank is analysed"
        )
    last = read_table(path, attempt=-1)
    assert sorted(set(last.steps.step.tolist())) == list(range(3, 9))
    assert "meshscope analyze --attempt N" in next(n.message for n in last.notes if n.code == "earlier_attempts")
    for attempt, held in ((3, 2), (-3, 2)):
        with pytest.raises(ParseError) as info:
            read_table(path, attempt=attempt)
        assert info.value.code is ParseCode.VALUE_OUT_OF_RANGE
        assert str(info.value) == (
            f"attempt {attempt} was asked for, but rank 0's records hold {held} attempts: give 1 to {held} (1 the "
            f"first), or -1 to -{held} counted from the last"
        )
    with pytest.raises(ParseError, match=r"attempt = 0: give 1 for the first attempt, -1 for the last"):
        read_table(path, attempt=0)
    single = write_lines(tmp_path / "one.jsonl", _attempt(0, range(3), first_seq=0, shift_us=0))
    assert read_table(single, attempt=1).n_rows == read_table(single, attempt=-1).n_rows == 3
    with pytest.raises(ParseError, match=r"attempt 2 was asked for, but rank 0's records hold 1 attempt: give 1 to 1"):
        read_table(single, attempt=2)


def test_the_first_steps_are_left_out_of_the_attempt_read_when_asked_for(tmp_path):
    # meshscope run leaves its first step out as warm-up; --skip-steps N does the same to any records, counted in the
    # attempt that is read (a resumed job's warm-up is its own first step, not step 0).
    later = 60_000_000
    first = {rank: _attempt(rank, range(6), first_seq=0, shift_us=0) for rank in (0, 1)}
    second = {rank: _attempt(rank, range(3, 9), first_seq=0, shift_us=later) for rank in (0, 1)}
    lines = [obj for rank in (0, 1) for obj in first[rank] + second[rank]]
    path = write_lines(tmp_path / "records.jsonl", lines)
    for attempt, skip, steps in ((None, 1, range(4, 9)), (-1, 3, range(6, 9)), (1, 2, range(2, 6)), (1, 0, range(6))):
        table = read_table(path, attempt=attempt, skip_steps=skip)
        assert sorted(zip(table.steps.rank.tolist(), table.steps.step.tolist(), strict=True)) == [
            (rank, step) for rank in (0, 1) for step in steps
        ], (attempt, skip)
        # the left-out steps' intervals go with them
        read = first if attempt == 1 else second
        kept = [obj for rank in (0, 1) for obj in read[rank] if obj["step"] in steps]
        assert table.n_intervals == sum(len(obj["intervals"]) for obj in kept)
        assert sorted(table.intervals.start_us.tolist()) == sorted(
            iv["start_us"] for obj in kept for iv in obj["intervals"]
        )
    with pytest.raises(ParseError) as info:
        read_table(path, skip_steps=6)
    assert info.value.code is ParseCode.VALUE_OUT_OF_RANGE
    assert str(info.value) == (
        "leaving out the first 6 step numbers leaves no step to analyse: the records hold 6 step numbers (3..8); "
        "give at most 5"
    )
    with pytest.raises(ParseError, match=r"skip_steps = -1; it must be >= 0"):
        read_table(path, skip_steps=-1)


def test_an_earlier_attempt_of_records_that_do_not_say_their_process_is_read_by_the_step_rule(tmp_path):
    # Records of a writer without attempt_start_us: the attempts are where a rank's steps go back (and collide).
    later = 60_000_000
    lines = []
    for rank in (0, 1):
        lines += _attempt(rank, range(6), first_seq=0, shift_us=0) + _attempt(
            rank, range(3, 9), first_seq=0, shift_us=later
        )
    for obj in lines:
        del obj["attempt_start_us"]
    path = write_lines(tmp_path / "records.jsonl", lines)
    assert sorted(set(read_table(path, attempt=1).steps.step.tolist())) == list(range(6))
    assert sorted(set(read_table(path, attempt=-1).steps.step.tolist())) == list(range(3, 9))
    with pytest.raises(ParseError, match=r"attempt 3 was asked for, but rank 0's records hold 2 attempts"):
        read_table(path, attempt=3)


def test_a_restart_is_read_as_its_last_attempt_in_whatever_order_the_records_come(tmp_path):
    # A sidecar serves its recent records step by step: a rank restarted from step 3 after step 5 comes as step 3 of
    # attempt 1, step 3 of attempt 2, step 4 of attempt 1, ... Its latest process's records are kept, not the last
    # record's (the step rule alone, on that order, would keep rank 0's step 8 and nothing else).
    later = 60_000_000
    attempts = [_attempt(rank, range(6), first_seq=0, shift_us=0) for rank in (0, 1)]
    attempts += [_attempt(rank, range(3, 9), first_seq=0, shift_us=later) for rank in (0, 1)]
    lines = sorted((obj for attempt in attempts for obj in attempt), key=lambda o: (o["step"], o["start_us"]))
    path = write_lines(tmp_path / "records.jsonl", lines)
    for table in _kept_by_every_reader(path, range(3, 9), dropped=12):
        assert (table.steps.start_us >= good_json(0, 0)["start_us"] + later).all()  # attempt 2's own records


def test_two_processes_writing_as_one_rank_at_once_are_refused_by_every_reader(tmp_path):
    # A script started twice with the same RANK into one collector: rank 0's second process began tracking at
    # step 1's time, and its first process went on writing steps 2 and 3 after that. No restart does that; keeping
    # "the latest process" would silently keep half of the rank's steps.
    t0 = good_json(0, 0)["start_us"]
    first, second = t0 - 5_000_000, t0 + 150_000  # the second process starts during step 1
    lines = [good_json(1, step) for step in range(4)]
    lines += [good_json(0, step, attempt_start_us=first if step % 2 == 0 else second) for step in range(4)]
    path = write_lines(tmp_path / "records.jsonl", lines)
    for reader in (read_records, read_table, _lines_in_memory, _packed):
        with pytest.raises(ParseError) as info:
            reader(path)
        assert info.value.code is ParseCode.INCONSISTENT, reader.__name__
        message = str(info.value)
        assert message == (
            f"{path} line 6: rank 0's records come from two processes at once: the one that wrote this record began "
            f"tracking at attempt_start_us = {second}, and the one that began at {first} still wrote after that (its "
            f"step 2 began at {t0 + 200_000} µs). A script started twice with the same RANK, or two trackers in one "
            "process, does this; no restart does: give every process its own rank or its own records"
        ), reader.__name__


@pytest.mark.parametrize(
    ("change", "code", "fragments"),
    [
        ({"schema": "meshscope.step/2"}, ParseCode.UNSUPPORTED_SCHEMA, ["schema = 'meshscope.step/2'", SCHEMA]),
        ({"start_us": "soon"}, _TYPE, ["start_us = 'soon' (str); expected a whole number"]),
        ({"start_us": 1.5}, _TYPE, ["start_us = 1.5 (float); expected a whole number"]),
        ({"rank": -3}, _RANGE, ["rank = -3 is below 0"]),
        ({"gpu_util": 97}, _RANGE, ["gpu_util = 97", "ratio in [0, 1]"]),
        ({"gpu": -2}, _RANGE, ["gpu = -2 is below 0"]),
        ({"coord": {"dp": 0, "tp": 0, "pp": 0, "cp": 0}}, ParseCode.MISSING_FIELD, ["coord: field 'ep' is missing"]),
        ({"node": ""}, _RANGE, ["node = ''", "non-empty string"]),
        ({"intervals": {"kind": "compute"}}, _TYPE, ["intervals = ", "expected a list"]),
        ({"stats": {"tokens": -1}}, _RANGE, ["stats: tokens = -1 is below 0"]),
    ],
    ids=["schema", "str-time", "float-time", "neg-rank", "util-percent", "neg-gpu", "coord", "node", "ivs", "stats"],
)
def test_field_errors_name_field_value_and_what_fits(tmp_path, change, code, fragments):
    bad = good_json(1)
    bad.update(change)
    path = write_lines(tmp_path / "r.jsonl", [good_json(0), bad])
    _both_readers_raise(path, f"{path} line 2", *fragments, code=code)


@pytest.mark.parametrize(
    ("index", "change", "code", "fragment"),
    [
        (2, {"axis": "xp"}, ParseCode.NOT_ONE_OF, "intervals[2]: axis = 'xp' is not one of ['dp', 'tp', 'pp', 'cp'"),
        (2, {"op": "send"}, ParseCode.INCONSISTENT, "intervals[2].op = 'send' is point-to-point"),
        (3, {"op": "all_reduce"}, ParseCode.INCONSISTENT, "intervals[3].op = 'all_reduce' is a collective"),
        (2, {"seq": None}, ParseCode.MISSING_FIELD, "intervals[2]: seq = None (null); expected a whole number"),
        (2, {"bytes": -5}, _RANGE, "intervals[2]: bytes = -5 is below 0"),
        (2, {"group_size": 0}, _RANGE, "intervals[2]: group_size = 0 is below 1"),
        (3, {"peer": -1}, _RANGE, "intervals[3]: peer = -1 is below 0"),
        (1, {"phase": "sideways"}, ParseCode.NOT_ONE_OF, "intervals[1]: phase = 'sideways' is not one of ['forward'"),
    ],
    ids=["axis", "comm-send", "p2p-collective", "seq-null", "neg-bytes", "group-size", "neg-peer", "phase"],
)
def test_interval_field_errors(tmp_path, index, change, code, fragment):
    obj = good_json()
    obj["intervals"][index].update(change)
    path = write_lines(tmp_path / "r.jsonl", [obj])
    _both_readers_raise(path, f"{path} line 1", fragment, code=code)
    if change.get("seq", 0) is None:  # null or left out: the same error
        del obj["intervals"][index]["seq"]
        path = write_lines(tmp_path / "r.jsonl", [obj])
        _both_readers_raise(path, "intervals[2]: field 'seq' is missing", code=ParseCode.MISSING_FIELD)


def test_missing_required_field(tmp_path):
    obj = good_json()
    del obj["node"]
    path = write_lines(tmp_path / "r.jsonl", [obj])
    _both_readers_raise(path, f"{path} line 1: field 'node' is missing; it is required", code=ParseCode.MISSING_FIELD)


def test_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("[1, 2]\n")
    _both_readers_raise(path, f"{path} line 1: line = ", "expected a JSON object", code=ParseCode.BAD_JSON)


# ---------------------------------------------------------------------------- cross-record rules of the table


def test_same_collective_twice_on_one_rank_is_an_error():
    # seq restarting every step makes (group, seq) ambiguous: the table refuses it.
    records = [make_record(0, 0), make_record(0, 1)]
    fixed = [
        replace_interval(r, 2, seq=0)  # both steps claim tp:0 seq 0
        for r in records
    ]
    with pytest.raises(ParseError, match=r"seq 0 appears twice on rank 0.*does not restart every step"):
        RecordTable.from_records(fixed)


def test_members_of_one_collective_must_agree_on_the_op():
    a = make_record(0)
    b = replace_interval(make_record(1), 2, op="all_gather")
    with pytest.raises(ParseError, match=r"has op 'all_reduce' but .* has 'all_gather'"):
        RecordTable.from_records([a, b])


def test_a_group_belongs_to_one_axis_and_has_one_size():
    a = make_record(0)
    with pytest.raises(ParseError, match=r"is on axis tp at .* but on axis dp"):
        RecordTable.from_records([a, replace_interval(make_record(1), 2, axis="dp")])
    with pytest.raises(ParseError, match=r"group 'tp:0' has group_size 2 at .* but 4 elsewhere; a group has one size"):
        RecordTable.from_records([a, replace_interval(make_record(1), 2, group_size=4)])
    with pytest.raises(ParseError, match="has 2 members but group_size = 1"):
        RecordTable.from_records(
            [replace_interval(a, 2, group_size=1), replace_interval(make_record(1), 2, group_size=1)]
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"row": [0, 5]}, "row = 5 is not a rank-step row"),
        ({"kind": [0, 9]}, "kind = 9 is not a kind of"),
        ({"end_us": [5, 1]}, "row 0 (rank 7, step 3): intervals[1].end_us = 1 is before start_us = 2"),
        ({"start_us": [0, 50], "end_us": [5, 60]}, "lies wholly outside the step [0, 10]"),
        ({"size_bytes": [-1, -7]}, "intervals[1].bytes = -7 is below 0 (-1 means unknown)"),
    ],
    ids=["row", "kind", "end-before-start", "outside", "bytes"],
)
def test_tables_built_from_arrays_are_validated(change, message):
    columns = {"row": [0, 0], "kind": [0, 0], "start_us": [0, 2], "end_us": [5, 6], **change}
    with pytest.raises(ParseError, match=re.escape(message)):
        RecordTable(
            job="sim",
            steps=StepColumns.build(rank=[7], step=[3], start_us=[0], end_us=[10]),
            intervals=IntervalColumns.build(**columns),
        )


def test_array_columns_of_the_wrong_length_are_refused():
    with pytest.raises(ParseError, match=re.escape("column step has shape (3,); expected (2,)")):
        StepColumns.build(rank=[0, 1], step=[0, 0, 0], start_us=[0, 0], end_us=[1, 1])


def test_duplicate_rank_steps_in_arrays():
    with pytest.raises(ParseError, match=re.escape("rank 1 step 0 appears twice: row 0 (rank 1, step 0) and row 1")):
        RecordTable(
            job="sim",
            steps=StepColumns.build(rank=[1, 1], step=[0, 0], start_us=[0, 0], end_us=[1, 1]),
            intervals=IntervalColumns.build(row=[], kind=[], start_us=[], end_us=[]),
        )


def test_record_objects_check_themselves():
    with pytest.raises(ParseError, match="end_us = 1 is before start_us = 2"):
        Interval(kind="compute", start_us=2, end_us=1)
    with pytest.raises(ParseError, match="a comm interval needs group, seq"):
        Interval(kind="comm", start_us=0, end_us=1, axis="dp", op="all_reduce")
    with pytest.raises(ParseError, match="kind = 'nap' is not one of"):
        Interval(kind="nap", start_us=0, end_us=1)


def test_the_scenario_files_are_valid_and_small():
    for path in (DATA_DIR / "dp8_straggler").glob("*.jsonl*"):
        assert path.stat().st_size < 100_000, path
        assert read_table(path).n_rows > 0


def replace_interval(record: StepRecord, index: int, **changes) -> StepRecord:
    ivs = list(record.intervals)
    ivs[index] = replace(ivs[index], **changes)
    return replace(record, intervals=tuple(ivs))


@pytest.mark.parametrize("wide", [False, True], ids=["packed", "lexsort-fallback"])
def test_lexsort_keys_sorts_by_the_first_key_first(wide):
    rng = np.random.default_rng(3)
    a = rng.integers(0, 5, 500)
    b = rng.integers(-(2**40) if wide else -50, 2**40 if wide else 50, 500)
    c = rng.integers(0, 2**30 if wide else 7, 500)
    order = lexsort_keys(a, b, c)
    keys = list(zip(a[order].tolist(), b[order].tolist(), c[order].tolist(), strict=True))
    assert keys == sorted(keys)


# ---------------------------------------------------------------------------- parallel decoding


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(records_module, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(records_module, "_CHUNK_MIN_BYTES", 4096)  # a few records per worker item


def test_worker_processes_read_the_same_table(tmp_path, small_chunks, monkeypatch):
    module = records_module
    records = [make_record(rank, step) for step in range(6) for rank in range(8)]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"
    write_records(a, records[:30])
    write_records(b, records[30:])
    one = read_table([a, b], workers=1)
    parallel = module._read_parallel
    used = []
    monkeypatch.setattr(module, "_read_parallel", lambda *a, **k: used.append(parallel(*a, **k)) or used[-1])
    many = read_table([a, b], workers=2)
    assert used
    assert used[0] is not None  # the workers' result, not the in-process fallback
    assert len(module._chunk_plan([a, b], 2)) > 2
    assert many.to_records() == one.to_records() == tuple(records)
    np.testing.assert_array_equal(many.steps.source_line, one.steps.source_line)
    assert many.where_row(29) == f"{a} line 30"
    assert many.group_names == one.group_names


def test_worker_errors_name_the_right_line(tmp_path, small_chunks):
    objs = [good_json(rank, step) for step in range(5) for rank in range(8)]
    objs[33]["intervals"][2]["bytes"] = -5
    path = write_lines(tmp_path / "r.jsonl", objs)
    with pytest.raises(ParseError, match=re.escape(f"{path} line 34: intervals[2]: bytes = -5 is below 0")):
        read_table(path, workers=2)
    objs[33] = good_json(1, 4)
    objs[33]["intervals"][2]["seq"] = 0  # rank 1's tp all-reduce of step 0 (line 2), in another worker's byte range
    path = write_lines(tmp_path / "r.jsonl", objs)
    with pytest.raises(ParseError, match=re.escape("seq 0 appears twice on rank 1")) as info:
        read_table(path, workers=2)
    assert f"{path} line 2" in str(info.value)
    assert f"{path} line 34" in str(info.value)


def test_worker_path_keeps_the_partial_data_rules(tmp_path, small_chunks):
    objs = [good_json(rank, step) for step in range(5) for rank in range(8)]
    path = write_lines(tmp_path / "r.jsonl", objs, tail=json.dumps(good_json(0, 9))[:100])
    with pytest.raises(ParseError, match="line 41: the last line is truncated"):
        read_table(path, workers=2)
    table = read_table(path, workers=2, allow_partial=True)
    assert table.n_rows == 40
    assert [n.code for n in table.notes] == ["truncated_line"]


def test_worker_scratch_files_are_removed(tmp_path, small_chunks, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    records = [make_record(rank, step) for step in range(6) for rank in range(8)]
    path = tmp_path / "r.jsonl"
    write_records(path, records)
    monkeypatch.setattr(records_module, "_scratch_dir", lambda _need: str(scratch))
    assert read_table(path, workers=2).to_records() == tuple(records)
    assert list(scratch.iterdir()) == []


# ---------------------------------------------------------------------------- the typed fast path vs the object parser


def test_unusual_but_valid_spellings_read_the_same_in_both_readers(tmp_path):
    # Nulls for optional fields, unknown fields of any type, and fields that do not apply to an interval's kind
    # (the object parser ignores them): the fast path takes the line, or hands it to the object parser, and the
    # table holds what the object parser reads.
    objs = [good_json(rank, step) for step in range(3) for rank in range(8)]  # 24 lines, over batch boundaries
    objs[1].update(nvlink_domain=None, network_tier=None, gpu=None, gpu_util=None, stats=None)
    objs[2]["stats"] = {"tokens": None, "attention_work": 7, "sdk_extra": [1, 2]}
    objs[3]["sdk"] = {"dropped": 0, "nested": [{"a": None}]}
    objs[4]["intervals"][0].update(axis=5, op=None, peer="x", phase=None)  # a data interval: not its fields
    objs[5]["intervals"][1]["phase"] = None
    objs[6]["intervals"][3].update(seq=None, bytes=None, group=None)  # optional on a p2p interval
    objs[7]["intervals"][2].update(bytes=None, group_size=None)
    objs[8]["intervals"][2]["peer"] = "not a p2p field"
    path = write_lines(tmp_path / "r.jsonl", objs)
    expected = read_records(path).records
    assert expected[2].stats == DataStats(attention_work=7.0)
    assert expected[6].intervals[3].seq is None
    assert read_table(path).to_records() == expected


@pytest.mark.parametrize(
    ("where", "value", "fragment"),
    [
        ("gpu", True, "gpu = True (bool); expected a whole number"),
        ("step", False, "step = False (bool); expected a whole number"),
        ("gpu_util", True, "gpu_util = True (bool); expected a finite number"),
        ("intervals.0.start_us", True, "intervals[0]: start_us = True (bool); expected a whole number"),
        ("intervals.2.seq", True, "intervals[2]: seq = True (bool); expected a whole number"),
    ],
    ids=["gpu-index", "step", "util", "start", "seq"],
)
def test_booleans_are_not_numbers_in_either_reader(tmp_path, where, value, fragment):
    obj = good_json()
    target, *path_keys, key = [obj, *where.split(".")]
    for k in path_keys:
        target = target[int(k) if k.isdigit() else k]
    target[key] = value
    path = write_lines(tmp_path / "r.jsonl", [good_json(1), obj])
    _both_readers_raise(path, f"{path} line 2", fragment, code=_TYPE)


_EDGE_VALUES = [
    None,
    True,
    False,
    "",
    "x",
    0,
    -1,
    -(2**62),
    2**31 - 1,
    2**31,
    2**63 - 1,
    2**63,
    -(2**63),
    -(2**63) - 1,
    10**30,
    10**400,
    1.0,
    1.5,
    1e300,
    {},
    [],
]
"""Values at the edges of what a field takes: null, booleans, an empty and an odd string, zero, negative, far
negative, the last int32 and the first past it, the last int64 and the first past it (both signs), huge whole numbers
(one past a double's range), a whole, a fractional and a huge float, an object, a list."""
_INTERVAL_FIELDS = ["kind", "start_us", "end_us", "phase", "axis", "op", "group", "seq", "bytes", "group_size", "peer"]


def _mutations():
    """(place, interval index, field) of every field of a record, and of every interval field on one interval of
    each kind (data, compute, comm, p2p), present or not."""
    obj = good_json(1)
    yield from (("line", None, key) for key in [*obj, "extra"])
    yield from (("coord", None, key) for key in [*obj["coord"], "extra"])
    yield from (("stats", None, key) for key in obj["stats"])
    yield from (("between", None, key) for key in [*BETWEEN_KINDS, "extra"])
    for index in range(4):
        assert obj["intervals"][index]["kind"] == ["data", "compute", "comm", "p2p"][index]
        yield from (("interval", index, key) for key in _INTERVAL_FIELDS)


def _mutated(place, index, key, value):
    obj = good_json(1)
    target = {"line": obj, "coord": obj["coord"], "stats": obj["stats"], "between": obj["between_steps"]}.get(place)
    if target is None:
        target = obj["intervals"][index]
    if value is _DELETE:
        target.pop(key, None)
    else:
        target[key] = value
    return obj


_DELETE = object()


def _read_or_code(reader, path):
    try:
        return reader(path)
    except ParseError as exc:
        return exc


def test_every_edge_value_of_every_field_reads_as_the_object_parser_reads_it(tmp_path):
    # Each field of a valid record (of the line, its coord, stats, between_steps and every interval) set to each edge
    # value, or deleted. Whatever the object parser reads, the table reads too; whatever it refuses, the table
    # refuses with the same error code, naming the same line. The table refuses more only by its rules across
    # intervals (a group's size must agree with the other line's), which the object parser does not check: that is
    # the one code allowed to differ.
    checked = refused = across = 0
    codes: set[ParseCode] = set()
    for place, index, key in _mutations():
        for value in [*_EDGE_VALUES, _DELETE]:
            path = write_lines(tmp_path / "m.jsonl", [good_json(0), _mutated(place, index, key, value)])
            case = (place, index, key, value)
            objects = _read_or_code(lambda p: read_records(p).records, path)
            table = _read_or_code(lambda p: read_table(p).to_records(), path)
            if isinstance(objects, ParseError):
                assert isinstance(table, ParseError), (case, "the table took what the object parser refused")
                assert table.code is objects.code, (case, str(objects), str(table))
                assert f"{path} line 2" in str(objects), (case, str(objects))
                assert f"{path} line 2" in str(table), (case, str(table))
                codes.add(objects.code)
                refused += 1
            elif isinstance(table, ParseError):
                assert table.code is ParseCode.INCONSISTENT, (case, str(table))
                across += 1
            else:
                assert table == objects, case
                checked += 1
    assert checked > 100
    assert refused > 600
    assert across <= 2  # group_size given as another size than the first line's (2**31 - 1 is the only one that fits)
    assert codes >= {ParseCode.WRONG_TYPE, ParseCode.VALUE_OUT_OF_RANGE, ParseCode.MISSING_FIELD}


_INTEGER_FIELDS = [
    ("line", "rank", 64),
    ("line", "step", 64),
    ("line", "start_us", 64),
    ("line", "end_us", 64),
    ("line", "gpu", 32),
    ("line", "user_step", 64),
    ("line", "gap_before_us", 64),
    ("line", "runqueue_wait_us", 64),
    ("line", "on_cpu_us", 64),
    ("coord", "dp", 64),
    ("stats", "tokens", 64),
    ("stats", "peak_memory_bytes", 64),
    ("between", "checkpoint", 64),
    ("between", "eval", 64),
    ("interval 2", "end_us", 64),
    ("interval 2", "seq", 64),
    ("interval 2", "bytes", 64),
    ("interval 2", "group_size", 32),
    ("interval 3", "peer", 64),
]
"""(where, field, bits) of the whole-number fields, the newest (``user_step``, ``gap_before_us``,
``runqueue_wait_us``, ``on_cpu_us``, ``between_steps``) included."""


@pytest.mark.parametrize(("place", "key", "bits"), _INTEGER_FIELDS, ids=[f"{p}-{k}" for p, k, _ in _INTEGER_FIELDS])
def test_the_last_whole_number_that_fits_reads_and_the_next_is_refused_by_both_readers(tmp_path, place, key, bits):
    # The rule: every whole number fits in 64 signed bits, gpu and group_size in 32 (the table's column types).
    # Both readers refuse the first one past it with value_out_of_range and name the field; 2**63 in rank, step,
    # end_us or tokens used to read as a record in one reader and be refused by the other.
    last = 2 ** (bits - 1) - 1
    name, index = (place.split()[0], int(place.split()[1])) if " " in place else (place, None)
    # A value that fits and is valid on its own: end times at the last value, start times left where they are.
    fits = _mutated(name, index, key, last)
    if key == "start_us" and name == "line":
        fits["end_us"] = last
        fits["intervals"] = []
    if key == "end_us" and name == "line":
        fits["intervals"] = []
    path = write_lines(tmp_path / "fits.jsonl", [fits])  # alone: a group of one line may claim any size
    (record,) = read_records(path).records
    target = record if name == "line" else None
    if name == "interval":
        target = record.intervals[index]
    if target is not None:
        assert getattr(target, "size_bytes" if key == "bytes" else key) == last
    assert read_table(path).to_records() == (record,)
    past = write_lines(tmp_path / "past.jsonl", [good_json(0), _mutated(name, index, key, last + 1)])
    label = {"between": "between_steps: ", "stats": "stats: ", "coord": "coord: "}.get(name, "")
    if name == "interval":
        label = f"intervals[{index}]: "
    _both_readers_raise(past, f"{past} line 2: {label}{key} = {last + 1} is above {last}", f"{bits} bits", code=_RANGE)
    if bits == 64:
        big = write_lines(tmp_path / "big.jsonl", [good_json(0), _mutated(name, index, key, 10**30)])
        _both_readers_raise(big, f"{label}{key} = {10**30}", code=_RANGE)


@pytest.mark.parametrize("field", ["gpu_util", "attention_work"])
def test_a_whole_number_past_a_doubles_range_is_refused_not_a_traceback(tmp_path, field):
    obj = good_json(1)
    (obj["stats"] if field == "attention_work" else obj)[field] = 10**400  # float(10**400) raises OverflowError
    path = write_lines(tmp_path / "r.jsonl", [good_json(0), obj])
    _both_readers_raise(path, f"{path} line 2", f"{field} = ", "expected a finite number", code=_RANGE)


def test_parse_errors_keep_their_code_through_pickling():
    # A worker process hands its error back pickled.
    error = pickle.loads(pickle.dumps(ParseError("x line 2: rank = -1 is below 0", code=_RANGE)))
    assert error.code is _RANGE
    assert str(error) == "x line 2: rank = -1 is below 0"
    assert ParseError("anything").code is ParseCode.INVALID


def test_a_worker_item_of_blank_lines_only(tmp_path, small_chunks, monkeypatch):
    # One byte range holds nothing but blank lines: its empty columns merge with the others'.
    records = [make_record(rank, step) for step in range(3) for rank in range(8)]
    text = "".join(json.dumps(record_to_json(r)) + "\n" for r in records[:12])
    text += "\n" * 20_000 + "".join(json.dumps(record_to_json(r)) + "\n" for r in records[12:])
    path = tmp_path / "r.jsonl"
    path.write_text(text)
    used = []
    parallel = records_module._read_parallel
    monkeypatch.setattr(records_module, "_read_parallel", lambda *a, **k: used.append(parallel(*a, **k)) or used[-1])
    table = read_table(path, workers=2)
    assert used[0] is not None  # the workers' result, not the in-process fallback
    assert len(records_module._chunk_plan([path], 2)) >= 3
    assert table.to_records() == tuple(records)
    assert table.where_row(12) == f"{path} line {12 + 20_000 + 1}"


# ---------------------------------------------------------------------------- memory for big columns


def test_mapped_empty_is_a_writable_array_of_the_shape_asked_for():
    big = mapped_empty((3_000_000, 5), np.dtype(np.int64))  # 120 MB: mapped up front where Linux allows
    small = mapped_empty((7,), np.dtype(np.int32))
    for array, shape, dtype in ((big, (3_000_000, 5), np.int64), (small, (7,), np.int32)):
        assert array.shape == shape
        assert array.dtype == dtype
        array[...] = 3
        assert int(array.sum()) == 3 * array.size
    view = big[10:12]
    del big
    assert view.tolist() == [[3] * 5] * 2  # the mapping lives as long as a view of it


def test_tune_memory_for_columns_turns_off_numpys_huge_page_advice():
    code = (
        "import numpy._core.multiarray as m\n"
        "from meshscope.records.memory import tune_memory_for_columns\n"
        "took = tune_memory_for_columns()\n"
        "print(took, m._set_madvise_hugepage(False))\n"  # returns the setting it replaces
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[1] == "False"
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert out[0] == "True"


@pytest.mark.parametrize("spelling", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["gpu_util", "attention_work"])
def test_non_finite_numbers_are_refused_by_both_readers(tmp_path, field, spelling):
    # Python's json reads these non-JSON spellings; the schema wants finite numbers.
    obj = good_json(1)
    (obj["stats"] if field == "attention_work" else obj)[field] = "__X__"
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(good_json(0)) + "\n" + json.dumps(obj).replace('"__X__"', spelling) + "\n")
    _both_readers_raise(path, f"{path} line 2", f"{field} = ", "expected a finite number", code=_RANGE)


# ---------------------------------------------------------------------------- lines already in memory


def _same_columns(a: RecordTable, b: RecordTable) -> None:
    for part in ("steps", "intervals"):
        cols_a, cols_b = getattr(a, part), getattr(b, part)
        for name in type(cols_a).__dataclass_fields__:
            np.testing.assert_array_equal(getattr(cols_a, name), getattr(cols_b, name), err_msg=f"{part}.{name}")
    names = ("job", "node_names", "nvlink_domain_names", "network_tier_names", "group_names", "notes")
    assert [getattr(a, n) for n in names] == [getattr(b, n) for n in names]


@pytest.mark.parametrize(
    "source",
    ["sample", "pp2_tp2_dp2_straggler/records.jsonl", "dp8_straggler/records.jsonl"],
    ids=["sample", "pp2-tp2-dp2", "dp8"],
)
def test_lines_in_memory_make_the_table_the_file_reader_makes(tmp_path, source):
    if source == "sample":
        path = tmp_path / "r.jsonl"
        write_records(path, sample_records())
    else:
        path = DATA_DIR / source
    lines = path.read_bytes().splitlines(keepends=True)
    table = table_from_lines(lines, where="datagrams")
    _same_columns(table, read_table(path))
    assert table.source_files == ("datagrams",)
    assert table.where_row(0) == "datagrams line 1"
    # Without their newlines, and in another order: the same records, in the order given.
    again = table_from_lines([line.rstrip(b"\n") for line in reversed(lines)])
    assert again.to_records() == table.to_records()[::-1]


def test_lines_in_memory_have_no_truncation_rule():
    good = json.dumps(good_json(0)).encode()
    with pytest.raises(ParseError) as info:
        table_from_lines([good, good[:40]], where="socket")
    assert info.value.code is ParseCode.BAD_JSON
    assert "socket line 2: not valid JSON" in str(info.value)
    assert len(table_from_lines([b"", good, b"  \n"]).steps.rank) == 1
    assert len(table_from_lines([]).steps.rank) == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(objs=_records_one_field_changed())
def test_the_in_memory_reader_agrees_with_the_file_reader_on_any_change(tmp_path, objs):
    path = write_lines(tmp_path / "fuzz.jsonl", objs)
    lines = [json.dumps(o).encode() for o in objs]
    from_file, in_memory = (
        _outcome(lambda: read_table(path)),
        _outcome(lambda: table_from_lines(lines, where=str(path))),
    )
    assert from_file == in_memory


def test_names_are_numbered_in_natural_order_whatever_order_the_records_come_in(tmp_path):
    objs = []
    for rank, node in enumerate(["node-10", "node-2", "node-2", "node-10"]):
        obj = good_json(rank)
        obj["node"] = node
        objs.append(obj)
    lines = [json.dumps(o).encode() + b"\n" for o in objs]
    forward, backward = table_from_lines(lines), table_from_lines(lines[::-1])
    path = write_lines(tmp_path / "r.jsonl", objs[::-1])
    by_objects = RecordTable.from_records(read_records(path).records)
    for table in (forward, backward, by_objects):
        assert table.node_names == ("node-2", "node-10")  # natural order: 2 before 10
        nodes = {int(r): table.node_name(int(c)) for r, c in zip(table.steps.rank, table.steps.node, strict=True)}
        assert nodes == {0: "node-10", 1: "node-2", 2: "node-2", 3: "node-10"}
    assert forward.group_names == backward.group_names == by_objects.group_names
    assert list(forward.group_names) == sorted(forward.group_names)

"""Step records: the one schema every source (SDK, simulator, sidecar) produces, and its columnar in-memory form.

A **step record** describes one rank's one training step: where the rank sits (coord, node, NVLink domain, network
tier, GPU), when the step started and ended, and the intervals it spent computing, communicating, loading data,
stepping the optimizer and checkpointing. On disk it is one JSON object per line (``meshscope.step/1``, see
``docs/records.md``); in memory it is either a :class:`StepRecord` (small inputs, tests, writers) or a
:class:`RecordTable` (numpy columns: one table of rank-steps, one of intervals) for analysis at scale.

This package exists so that every producer and every consumer agrees on one schema and one set of checks. It reads,
writes and validates; it must not analyse (no breakdown, no joins across ranks: that is
:mod:`meshscope.analysis.breakdown`), must not guess at bad input (every problem is a
:class:`~meshscope.errors.ParseError` naming the file, line, field, value and what would fit) and must not depend on
anything beyond numpy, msgspec (typed JSON in C) and the standard library. Its modules, lowest first:

- :mod:`~meshscope.records.schema`: enums, code tables, the record objects and their per-record checks;
- :mod:`~meshscope.records.tables`: :class:`StepColumns`, :class:`IntervalColumns`, :class:`RecordTable` and the
  vectorised checks;
- :mod:`~meshscope.records.parsing`: one decoded JSON line <-> one :class:`StepRecord` (the object parser);
- :mod:`~meshscope.records.memory`: allocator settings and pre-mapped arrays for columns of millions of rows;
- :mod:`~meshscope.records.writing`: :func:`write_records`;
- :mod:`~meshscope.records.decoding`: lines of plain and gzip files, a batch at a time, truncation rules;
- :mod:`~meshscope.records.building`: the columnar fast path from JSON lines (typed decoding) to a table, also
  for lines already in memory (:func:`table_from_lines`);
- :mod:`~meshscope.records.reading`: :func:`read_records`, :func:`read_table` and its worker processes;
- :mod:`~meshscope.records.packing`: one source's columns as bytes (``meshscope.columns/4``), for records that travel
  in bulk (a sidecar's answer to the operator), and their checked way back.

Import the public names from here (``from meshscope.records import read_table``).
"""

from meshscope.records.building import RecordColumns, columns_from_lines, table_from_columns, table_from_lines
from meshscope.records.memory import tune_memory_for_columns
from meshscope.records.packing import (
    CUT_HEADER,
    PACKED_MEDIA_TYPE,
    PACKED_SCHEMA,
    pack_columns,
    pack_lines,
    packed_steps,
    unpack_columns,
)
from meshscope.records.parsing import _parse_record, record_to_json
from meshscope.records.reading import default_workers, read_records, read_table
from meshscope.records.schema import (
    AXIS_CODE,
    BETWEEN_COMM,
    BETWEEN_KINDS,
    COMM_CODE,
    COMPUTE_CODE,
    KIND_CODE,
    KINDS,
    MAX_RAISED_CHARS,
    OP_CODE,
    OPS,
    P2P_CODE,
    P2P_OPS,
    PHASE_CODE,
    PHASES,
    SCHEMA,
    SYMMETRIC_OPS,
    UNKNOWN,
    BetweenSteps,
    CommOp,
    DataStats,
    Interval,
    IntervalKind,
    Note,
    Phase,
    RecordSet,
    StepRecord,
)
from meshscope.records.tables import (
    RAISED_STEPS,
    IntervalColumns,
    RecordTable,
    StepColumns,
    lexsort_keys,
    raised_steps_note,
)
from meshscope.records.writing import write_records

__all__ = [
    "AXIS_CODE",
    "BETWEEN_COMM",
    "BETWEEN_KINDS",
    "COMM_CODE",
    "COMPUTE_CODE",
    "CUT_HEADER",
    "KINDS",
    "KIND_CODE",
    "MAX_RAISED_CHARS",
    "OPS",
    "OP_CODE",
    "P2P_CODE",
    "P2P_OPS",
    "PACKED_MEDIA_TYPE",
    "PACKED_SCHEMA",
    "PHASES",
    "PHASE_CODE",
    "RAISED_STEPS",
    "SCHEMA",
    "SYMMETRIC_OPS",
    "UNKNOWN",
    "BetweenSteps",
    "CommOp",
    "DataStats",
    "Interval",
    "IntervalColumns",
    "IntervalKind",
    "Note",
    "Phase",
    "RecordColumns",
    "RecordSet",
    "RecordTable",
    "StepColumns",
    "StepRecord",
    "_parse_record",  # the object parser; the SDK's tests check its output against it
    "columns_from_lines",
    "default_workers",
    "lexsort_keys",
    "pack_columns",
    "pack_lines",
    "packed_steps",
    "raised_steps_note",
    "read_records",
    "read_table",
    "record_to_json",
    "table_from_columns",
    "table_from_lines",
    "tune_memory_for_columns",
    "unpack_columns",
    "write_records",
]

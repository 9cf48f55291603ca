"""Loading planner assumptions from a mapping (``--assumptions FILE``): overrides, errors that name what fits, fuzzing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshscope.cli import main
from meshscope.errors import MeshscopeError, PlanError
from meshscope.plan import PlanAssumptions, assumptions_from_mapping
from meshscope.plan.assumptions import ASSUMPTION_NAMES, NCCL_FIELDS, OVERLAP_FIELDS, SYNC_WAIT_AXIS_FIELDS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_overrides_replace_only_what_they_name_in_either_case():
    a = assumptions_from_mapping({"networkEfficiency": 0.6, "tp_comm_overlap": 0.5, "compute_efficiency": None})
    assert a.network_efficiency == 0.6
    assert a.tp_comm_overlap == 0.5
    assert a.compute_efficiency is None
    assert a.nvlink_efficiency == PlanAssumptions().nvlink_efficiency


def test_nccl_costs_merge_into_the_defaults():
    a = assumptions_from_mapping({"ring_simple": {"network_hop_latency_s": 2.0e-5}})
    assert a.ring_simple.network_hop_latency_s == 2.0e-5
    assert a.ring_simple.base_latency_s == PlanAssumptions().ring_simple.base_latency_s


def test_tiles_come_as_lists():
    assert assumptions_from_mapping({"gemm_tiles": [[256, 128]]}).gemm_tiles == ((256, 128),)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"network_efficency": 0.5}, r"unknown assumption 'network_efficency'; did you mean network_efficiency\?"),
        ({"network_efficiency": 1.5}, r"f\.network_efficiency: expected a number in \(0, 1\], got 1\.5"),
        ({"network_efficiency": 0}, r"expected a number in \(0, 1\], got 0"),
        ({"pp_comm_overlap": "half"}, r"f\.pp_comm_overlap: expected a number in \[0, 1\], got 'half'"),
        ({"nccl_latency": 1}, r"f\.nccl_latency: expected true or false, got 1"),
        ({"ring_ll": {"hop": 1}}, r"f\.ring_ll: unknown assumption 'hop'"),
        ({"ring_ll": 3}, r"f\.ring_ll: expected a mapping of base_latency_s, nvlink_hop_latency_s"),
        ({"ring_ll": {"bandwidth_fraction": 0}}, r"bandwidth_fraction: expected a number in \(0, 1\], got 0"),
        ({"gemm_tiles": [[128]]}, r"each tile must be \[rows, columns\] of whole numbers in 1\.\.4096"),
        ({"bubble_warning_fraction": -1}, r"expected a number >= 0, got -1"),
        ({"hbm_efficiency": float("nan")}, r"expected a number in \(0, 1\], got nan"),
        ({"compute_efficiency": True}, r"expected a number in \(0, 1\], got True"),
        ({"host_reference_tp": 1.5}, r"f\.host_reference_tp: expected a whole number >= 1 \(a tensor-parallel .*got 1\.5"),
        ({"host_tp_factor": 0.7}, r"f\.host_tp_factor: expected a number >= 1, got 0\.7"),
    ],
    ids=["typo", "above-one", "zero", "text", "int-for-bool", "nested-typo", "nested-scalar", "zero-fraction",
         "short-tile", "negative", "nan", "bool-for-number", "fractional-tp", "tp-factor-below-one"],
)  # fmt: skip
def test_bad_values_name_the_field_the_value_and_what_fits(data, message):
    with pytest.raises(PlanError, match=message):
        assumptions_from_mapping(data, origin="f")


def test_not_a_mapping():
    with pytest.raises(PlanError, match=r"f: expected a mapping of assumption names to values, got \[1\]"):
        assumptions_from_mapping([1], origin="f")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- fuzzing

_FRACTION = st.floats(min_value=1e-6, max_value=1.0)
_SECONDS = st.floats(min_value=0.0, max_value=1e-3)
_NCCL = st.fixed_dictionaries(
    {},
    optional={
        "base_latency_s": _SECONDS,
        "nvlink_hop_latency_s": _SECONDS,
        "network_hop_latency_s": _SECONDS,
        "bandwidth_fraction": _FRACTION,
    },
)


_MEASURED_TIMES: dict[str, st.SearchStrategy[object]] = {
    **dict.fromkeys(SYNC_WAIT_AXIS_FIELDS.values(), st.none() | st.floats(min_value=0.0, max_value=1.0)),
    "cpu_cores": st.none() | st.floats(min_value=0.1, max_value=64.0),
    "cpu_contention_at_fit": st.floats(min_value=1.0, max_value=20.0),
    "cpu_time_scale": st.floats(min_value=1.0, max_value=20.0),
    "cpu_stage_contention_at_fit": st.none() | st.floats(min_value=1.0, max_value=20.0),
    "cpu_stage_time_scale": st.floats(min_value=1.0, max_value=20.0),
    "cpu_dp_comm_time_scale": st.floats(min_value=1.0, max_value=20.0),
    "cpu_compute_time_scale": st.floats(min_value=1.0, max_value=20.0),
    "host_tp_factor": st.floats(min_value=1.0, max_value=4.0),
    "host_reference_tp": st.none() | st.sampled_from([1.0, 2.0, 8.0]),
    **dict.fromkeys(("data_wait_seconds", "host_overhead_seconds"), st.floats(min_value=0.0, max_value=10.0)),
}
"""Valid values of the measured-time assumptions: per-step waits, per-axis sync waits, CPU contention."""


DEFAULTS = PlanAssumptions()


def _valid_value(name: str) -> st.SearchStrategy[object]:
    if name in NCCL_FIELDS:
        return _NCCL
    if isinstance(getattr(DEFAULTS, name), bool):  # the switches: causal_attention, fp8_attention, ...
        return st.booleans()
    if name == "gemm_tiles":
        side = st.sampled_from([64, 128, 256])
        return st.lists(st.lists(side, min_size=2, max_size=2), min_size=1, max_size=3)
    if name in OVERLAP_FIELDS:
        return st.floats(min_value=0.0, max_value=1.0)
    if name == "bubble_warning_fraction":
        return st.floats(min_value=0.0, max_value=10.0)
    if name in ("compute_efficiency", "gemm_efficiency", "optimizer_hbm_efficiency"):
        return st.none() | _FRACTION
    if name in _MEASURED_TIMES:
        return _MEASURED_TIMES[name]
    if name == "nccl_algorithms":
        return st.lists(st.sampled_from(["ring", "tree"]), min_size=1, max_size=2, unique=True)
    if name == "nccl_protocols":
        return st.lists(st.sampled_from(["ll", "ll128", "simple"]), min_size=1, max_size=3, unique=True)
    return _FRACTION


_VALID = st.lists(st.sampled_from(ASSUMPTION_NAMES), unique=True, max_size=8).flatmap(
    lambda names: st.fixed_dictionaries({n: _valid_value(n) for n in names})
)
_JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
    st.lists(st.integers(-1, 5000), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(_VALID)
def test_every_valid_mapping_loads_and_is_what_it_says(data):
    a = assumptions_from_mapping(data)
    for name, value in data.items():
        got = getattr(a, name)
        if name in NCCL_FIELDS:
            assert all(getattr(got, k) == v for k, v in value.items())
        elif name == "gemm_tiles":
            assert got == tuple(tuple(t) for t in value)
        elif name in ("nccl_algorithms", "nccl_protocols"):
            assert got == tuple(value)
        else:
            assert got == value
    assert hash(a) == hash(assumptions_from_mapping(data))  # the planner's caches key on it


@settings(max_examples=400, deadline=None)
@given(_VALID, st.sampled_from(ASSUMPTION_NAMES), _JUNK)
def test_a_corrupted_value_is_accepted_only_if_valid_and_never_crashes(data, name, junk):
    data = {**data, name: junk}
    error: PlanError | None = None
    try:
        a = assumptions_from_mapping(data, origin="fuzz")
    except PlanError as exc:  # the only exception allowed, and it says where it came from
        error = exc
    if error is not None:
        assert str(error).startswith("fuzz")
        return
    # Accepted: it must then be a value that fits the field.
    value = getattr(a, name)
    if isinstance(value, float) and name not in NCCL_FIELDS:
        assert math.isfinite(value)


# ---------------------------------------------------------------------------------------------------- CLI


def test_plan_takes_an_assumptions_file(tmp_path, capsys):
    path = tmp_path / "a.yaml"
    path.write_text("compute_efficiency: 0.25\nnccl_latency: false\n")
    assert main(["plan", str(EXAMPLES / "llama3-8b-h100.yaml"), "--json", "--assumptions", str(path)]) == 0
    out = capsys.readouterr().out
    assert '"compute_model": "flat"' in out
    assert '"compute_efficiency": 0.25' in out


def test_a_bad_assumptions_file_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "a.yaml"
    path.write_text("network_efficiency: 7\n")
    code = main(["plan", str(EXAMPLES / "llama3-8b-h100.yaml"), "--assumptions", str(path)])
    err = capsys.readouterr().err
    assert code != 0
    assert f"{path}.network_efficiency: expected a number in (0, 1], got 7" in err
    assert "Traceback" not in err


def test_a_duplicate_key_in_the_file_is_refused(tmp_path):
    from meshscope.jobs import load_yaml_mapping  # noqa: PLC0415

    path = tmp_path / "a.yaml"
    path.write_text("hbm_efficiency: 0.5\nhbm_efficiency: 0.6\n")
    with pytest.raises(MeshscopeError, match="duplicate"):
        load_yaml_mapping(path)

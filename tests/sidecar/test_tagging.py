"""Tagging: rank coordinates only from the identity, foreign samples dropped, label values from closed sets only."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from meshscope_sidecar.identity import IdentityInputs, resolve_identity
from meshscope_sidecar.metrics import METRICS, NODE_LABELS, RANK_LABELS
from meshscope_sidecar.sources.base import Sample
from meshscope_sidecar.tagging import Untagged, label_names, own_label_ok, tag

# layout tp=2,pp=2,dp=2 on 4-GPU nodes; node rank 1 holds ranks 4..7 (tp, dp, pp) = (0,0,1) (1,0,1) (0,1,1) (1,1,1)
IDENT = resolve_identity(
    IdentityInputs(
        job="j",
        node_name="node-a",
        layout="tp=2,pp=2,dp=2",
        gpus_per_node="4",
        node_rank=(("MESHSCOPE_NODE_RANK", "1"),),
        nvlink_domain="nvl-7",
        network_tier="block-2",
    )
)


def test_a_rank_sample_gets_the_identitys_coordinates_in_label_order() -> None:
    s = Sample(
        metric="meshscope_breakdown_seconds_total",
        value=1.5,
        rank=6,
        labels=(("axis", "tp"), ("category", "exposed_comm")),
    )
    spec, values = tag(s, IDENT)
    assert label_names(spec) == (*RANK_LABELS, "category", "axis")
    assert values == ("j", "6", "1", "0", "1", "0", "0", "node-a", "nvl-7", "block-2", "2", "exposed_comm", "tp")


def test_a_gpu_sample_gets_the_rank_of_that_gpu() -> None:
    spec, values = tag(Sample(metric="meshscope_gpu_utilization_ratio", value=0.9, gpu=3), IDENT)
    assert dict(zip(label_names(spec), values, strict=True)) == {
        "job": "j", "rank": "7", "dp": "1", "tp": "1", "pp": "1", "cp": "0", "ep": "0",
        "node": "node-a", "nvlink_domain": "nvl-7", "network_tier": "block-2", "gpu": "3",
        "gpu_instance": "",  # a whole GPU: the sample names no MIG instance
    }  # fmt: skip


def test_a_node_sample_gets_the_node_labels_and_its_own() -> None:
    s = Sample(
        metric="meshscope_network_errors_total",
        value=2,
        labels=(("counter", "symbol_error"), ("device", "mlx5_0"), ("port", "1"), ("rail_gpu", "")),
    )
    spec, values = tag(s, IDENT)
    assert label_names(spec) == (*NODE_LABELS, "device", "port", "rail_gpu", "counter")
    assert values == ("j", "node-a", "nvl-7", "block-2", "mlx5_0", "1", "", "symbol_error")


@pytest.mark.parametrize(
    ("sample", "reason"),
    [
        (Sample(metric="meshscope_steps_total", value=1, rank=3), Untagged.FOREIGN_RANK),
        (Sample(metric="meshscope_gpu_power_watts", value=1, gpu=4), Untagged.FOREIGN_GPU),
        (Sample(metric="meshscope_gpu_power_watts", value=1, gpu=0, rank=5), Untagged.FOREIGN_RANK),
        (Sample(metric="meshscope_steps_total", value=1), Untagged.NO_SUBJECT),
        (Sample(metric="meshscope_source_up", value=1, rank=4, labels=(("source", "dcgm"),)), Untagged.NO_SUBJECT),
        (Sample(metric="meshscope_gpu_flops", value=1, rank=4), Untagged.UNKNOWN_METRIC),
        (Sample(metric="meshscope_steps_total", value=1, rank=4, labels=(("step", "12"),)), Untagged.BAD_LABELS),
        (Sample(metric="meshscope_collectives_total", value=1, rank=4, labels=(("axis", "tp"),)), Untagged.BAD_LABELS),
    ],
    ids=[
        "rank-elsewhere",
        "gpu-without-rank",
        "rank-gpu-disagree",
        "no-subject",
        "node-metric-with-rank",
        "unknown-metric",
        "label-not-of-metric",
        "op-missing",
    ],
)
def test_samples_that_cannot_be_tagged_say_why(sample: Sample, reason: Untagged) -> None:
    assert tag(sample, IDENT) is reason


def test_in_degraded_mode_no_rank_sample_is_tagged_but_node_samples_are(make_identity) -> None:
    degraded = make_identity(layout=None)
    assert tag(Sample(metric="meshscope_steps_total", value=1, rank=0), degraded) is Untagged.RANKS_UNKNOWN
    assert tag(Sample(metric="meshscope_gpu_power_watts", value=1, gpu=0), degraded) is Untagged.RANKS_UNKNOWN
    _, values = tag(Sample(metric="meshscope_source_up", value=1, labels=(("source", "dcgm"),)), degraded)
    assert values == ("j", "node-a", "", "", "dcgm")


STEP_NUMBERS = st.integers(min_value=256, max_value=2**63).map(str)
POINTERS = st.integers(min_value=1, max_value=2**64).map(lambda n: f"0x{n:x}")
FREE_TEXT = st.text(min_size=1, max_size=80).filter(lambda t: not t.isalnum() or " " in t or len(t) > 48)
KERNELS = st.sampled_from(
    ["ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "void at::native::vectorized_elementwise_kernel<4>"]
)
HOSTILE = st.one_of(STEP_NUMBERS, POINTERS, FREE_TEXT, KERNELS)
OWN_LABELS = sorted({name for m in METRICS for name in m.labels})


@settings(max_examples=400, deadline=None)
@given(metric=st.sampled_from(METRICS), label=st.sampled_from(OWN_LABELS), value=HOSTILE, rank=st.integers(0, 10))
def test_no_label_value_can_come_from_a_step_number_pointer_or_free_text(metric, label, value, rank) -> None:
    # Every metric, every own label of any metric, every kind of unbounded value: a sample carrying one is never
    # exported (the pattern labels admit only short hardware names, which none of these are).
    if (
        label == "device"
        and value.isascii()
        and value[:1].isalpha()
        and len(value) <= 32
        and all(c.isalnum() or c in "_.-" for c in value)
    ):
        return  # a plausible device name (e.g. a 'kernel' of letters only): bounded by the pattern, not unbounded
    if (
        label == "counter"
        and value.isascii()
        and value[:1].islower()
        and len(value) <= 48
        and all(c.islower() or c.isdigit() or c == "_" for c in value)
    ):
        return
    s = Sample(metric=metric.name, value=1, rank=rank if metric.scope == "rank" else None, labels=((label, value),))
    assert tag(s, IDENT) is Untagged.BAD_LABELS


@settings(max_examples=300, deadline=None)
@given(rank=st.integers(-5, 40), gpu=st.one_of(st.none(), st.integers(-2, 12)))
def test_rank_coordinates_never_come_from_the_sample(rank: int, gpu: int | None) -> None:
    result = tag(Sample(metric="meshscope_steps_total", value=1, rank=rank, gpu=gpu), IDENT)
    local = IDENT.by_rank(rank)
    if local is None or (gpu is not None and gpu != local.gpu):
        assert result is Untagged.FOREIGN_RANK
        return
    _, values = result
    c = local.coord
    assert values[:11] == (
        "j",
        str(rank),
        str(c.dp),
        str(c.tp),
        str(c.pp),
        str(c.cp),
        str(c.ep),
        "node-a",
        "nvl-7",
        "block-2",
        str(local.gpu),
    )


@pytest.mark.parametrize(
    ("label", "good", "bad"),
    [
        ("axis", ["tp", "ep", "", "unknown"], ["TP", "tp ", "dp_replicate"]),
        ("op", ["all_reduce", "send", "recv"], ["AllReduce", "allreduce", "0x1"]),
        ("category", ["compute", "exposed_comm", "other"], ["comm.tp.sync_wait", "idle"]),
        ("port", ["1", "2", "255"], ["0", "1000", "01", "p1"]),
        ("device", ["mlx5_0", "ibp12s0", "bnxt_re3"], ["", "0mlx", "mlx5 0", "x" * 33]),
        ("rail_gpu", ["", "0", "7", "15"], ["123", "gpu0"]),
        ("counter", ["symbol_error", "np_cnp_sent"], ["Symbol", "a b", "x" * 49]),
        ("mode", ["full", "degraded"], ["partial"]),
    ],
)
def test_label_closed_sets_and_patterns(label: str, good: list[str], bad: list[str]) -> None:
    assert all(own_label_ok(label, v) for v in good)
    assert not any(own_label_ok(label, v) for v in bad)

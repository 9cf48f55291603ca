"""The collector: tagged families from the sources' samples, health, info, untagged series; one golden exposition."""

from __future__ import annotations

import time
from pathlib import Path

from prometheus_client import generate_latest

from meshscope_sidecar.collector import PollState, SidecarCollector, make_registry
from meshscope_sidecar.sources.base import Sample, SourceHealth

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "sidecar" / "collector" / "metrics.golden.txt"


class FixedSource:
    """A test-only source: fixed samples and a fixed health."""

    def __init__(
        self, name: str, samples: list[Sample], *, up: bool = True, parse_errors: int = 0, dropped: int = 0
    ) -> None:
        self.name = name
        self.health = SourceHealth(up=up, parse_errors_total=parse_errors, dropped_total=dropped)
        self._samples = samples
        self.polled = 0

    def poll(self) -> None:
        self.polled += 1

    def samples(self) -> list[Sample]:
        return list(self._samples)

    def close(self) -> None:
        pass


TRAIN = [
    Sample(metric="meshscope_steps_total", value=3, rank=2),
    Sample(metric="meshscope_step_seconds_total", value=0.3, rank=2),
    Sample(
        metric="meshscope_breakdown_seconds_total", value=0.25, rank=2, labels=(("axis", ""), ("category", "compute"))
    ),
    Sample(
        metric="meshscope_breakdown_seconds_total",
        value=0.05,
        rank=2,
        labels=(("axis", "tp"), ("category", "exposed_comm")),
    ),
    Sample(metric="meshscope_steps_total", value=3, rank=3),
    Sample(metric="meshscope_steps_total", value=9, rank=7),  # not this pod's: dropped, counted
    Sample(metric="meshscope_records_rejected_total", value=1, labels=(("reason", "foreign_rank"),)),
]
GPU = [
    Sample(metric="meshscope_gpu_utilization_ratio", value=0.97, gpu=1),
    Sample(metric="meshscope_gpu_utilization_ratio", value=0.5, rank=3),  # gpu 1 again, by rank: a duplicate
    Sample(metric="meshscope_gpu_sm_active_ratio", value=0.41, gpu=0),
    Sample(metric="meshscope_gpu_power_watts", value=1, gpu=0, labels=(("kernel", "ncclDevKernel_AllReduce"),)),
]


def _collector(make_identity, **kw) -> tuple[SidecarCollector, FixedSource, FixedSource]:
    # tp=2,dp=2 on 2-GPU nodes, node rank 1: gpu 0 = rank 2 (dp 1, tp 0), gpu 1 = rank 3 (dp 1, tp 1)
    ident = make_identity("tp=2,dp=2", "2", "1", nvlink_domain="nvl-0", network_tier="block-1")
    train = FixedSource("train_events", TRAIN, parse_errors=2)
    gpu = FixedSource("dcgm", GPU, up=False, dropped=5)
    polls = {"train_events": PollState(period_s=1.0, seconds_total=0.125, polls_total=4)}
    return SidecarCollector([train, gpu], ident, version="0.1.0", polls=polls, **kw), train, gpu


def test_samples_become_tagged_series_and_health(make_identity) -> None:
    collector, _, _ = _collector(make_identity)
    reg = make_registry(collector)
    rank2 = {
        "job": "j",
        "rank": "2",
        "dp": "1",
        "tp": "0",
        "pp": "0",
        "cp": "0",
        "ep": "0",
        "node": "node-a",
        "nvlink_domain": "nvl-0",
        "network_tier": "block-1",
        "gpu": "0",
    }
    rank3 = {**rank2, "rank": "3", "tp": "1", "gpu": "1"}
    node = {"job": "j", "node": "node-a", "nvlink_domain": "nvl-0", "network_tier": "block-1"}
    assert reg.get_sample_value("meshscope_steps_total", rank2) == 3
    assert reg.get_sample_value("meshscope_steps_total", rank3) == 3
    assert reg.get_sample_value("meshscope_steps_total", {**rank2, "rank": "7"}) is None
    assert (
        reg.get_sample_value("meshscope_breakdown_seconds_total", {**rank2, "category": "exposed_comm", "axis": "tp"})
        == 0.05
    )
    whole = {"gpu_instance": ""}  # GPU series: a whole GPU
    assert reg.get_sample_value("meshscope_gpu_utilization_ratio", {**rank3, **whole}) == 0.97  # the first one wins
    assert reg.get_sample_value("meshscope_gpu_sm_active_ratio", {**rank2, **whole}) == 0.41
    assert reg.get_sample_value("meshscope_gpu_power_watts", {**rank2, **whole}) is None  # a kernel name is not a label
    assert reg.get_sample_value("meshscope_source_up", {**node, "source": "train_events"}) == 1
    assert reg.get_sample_value("meshscope_source_up", {**node, "source": "dcgm"}) == 0
    assert reg.get_sample_value("meshscope_source_parse_errors_total", {**node, "source": "train_events"}) == 2
    assert reg.get_sample_value("meshscope_source_dropped_total", {**node, "source": "dcgm"}) == 5
    assert reg.get_sample_value("meshscope_source_poll_seconds_total", {**node, "source": "train_events"}) == 0.125
    assert reg.get_sample_value("meshscope_source_poll_seconds_total", {**node, "source": "dcgm"}) == 0
    untagged = {**node, "source": "train_events", "reason": "foreign_rank"}
    assert reg.get_sample_value("meshscope_sidecar_untagged_series", untagged) == 1
    assert (
        reg.get_sample_value(
            "meshscope_sidecar_untagged_series", {**untagged, "source": "dcgm", "reason": "duplicate_series"}
        )
        == 1
    )
    assert (
        reg.get_sample_value(
            "meshscope_sidecar_untagged_series", {**untagged, "source": "dcgm", "reason": "bad_labels"}
        )
        == 1
    )
    assert reg.get_sample_value("meshscope_sidecar_info", {**node, "version": "0.1.0", "mode": "full"}) == 1


def test_scraping_reads_the_sources_and_polls_none_of_them(make_identity) -> None:
    collector, train, gpu = _collector(make_identity)
    generate_latest(make_registry(collector))
    assert (train.polled, gpu.polled) == (0, 0)


def test_a_stalled_poll_reports_its_source_down(make_identity) -> None:
    collector, _, _ = _collector(make_identity)
    collector.polls["train_events"].started_monotonic_s = (
        time.monotonic() - 11.0
    )  # a poll running for 11 s (> 10 periods)
    reg = make_registry(collector)
    node = {"job": "j", "node": "node-a", "nvlink_domain": "nvl-0", "network_tier": "block-1"}
    assert reg.get_sample_value("meshscope_source_up", {**node, "source": "train_events"}) == 0


def test_degraded_mode_exports_health_and_info_but_no_rank_series(make_identity) -> None:
    ident = make_identity(layout=None)
    collector = SidecarCollector([FixedSource("train_events", TRAIN)], ident, version="0.1.0")
    text = generate_latest(make_registry(collector)).decode()
    assert (
        'meshscope_sidecar_info{job="j",mode="degraded",network_tier="",node="node-a",nvlink_domain="",version="0.1.0"} 1.0'
        in text
    )
    assert "meshscope_steps_total" not in text
    assert 'reason="ranks_unknown",source="train_events"} 6.0' in text


def test_the_exposition_matches_the_golden_file(make_identity) -> None:
    collector, _, _ = _collector(make_identity)
    text = generate_latest(make_registry(collector))
    assert text == GOLDEN.read_bytes()

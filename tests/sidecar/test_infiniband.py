"""The InfiniBand source on a hand-written sysfs tree: rates between polls with an injected clock, saturation,
``N/A (no PMA)``, resets, rails; fuzzed counter files from the kernel's grammar."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshscope_sidecar.metrics import BY_NAME
from meshscope_sidecar.sources.infiniband import InfinibandSource

TREE = Path(__file__).resolve().parents[1] / "data" / "sidecar" / "infiniband" / "class_infiniband"


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "infiniband"
    shutil.copytree(TREE, root, symlinks=True)
    return root


def write(root: Path, relative: str, value: object) -> None:
    (root / relative).write_text(f"{value}\n")


def series(source: InfinibandSource) -> dict[tuple[str, ...], float]:
    """(metric, device, port[, counter]) -> value; fails on a duplicate."""
    out: dict[tuple[str, ...], float] = {}
    for sample in source.samples():
        labels = dict(sample.labels)
        key = (sample.metric, labels["device"], labels["port"], *([labels["counter"]] if "counter" in labels else []))
        assert key not in out, key
        out[key] = sample.value
    return out


def rails(source: InfinibandSource) -> dict[tuple[str, str], str]:
    return {
        (dict(s.labels)["device"], dict(s.labels)["port"]): dict(s.labels)["rail_gpu"]
        for s in source.samples()
        if s.metric == "meshscope_network_port_active"
    }


def test_first_poll_has_gauges_and_zero_totals_but_no_rates(tree: Path) -> None:
    source = InfinibandSource(root=tree, clock=FakeClock(), gpu_count=2)
    source.poll()
    values = series(source)
    assert source.health.up
    assert not [k for k in values if k[0].endswith("_per_second") and "link_rate" not in k[0]]
    assert values["meshscope_network_link_rate_bytes_per_second", "mlx5_0", "1"] == 400 * 125_000_000
    assert values["meshscope_network_link_rate_bytes_per_second", "mlx5_1", "1"] == 200 * 125_000_000
    assert values["meshscope_network_port_active", "mlx5_0", "1"] == 1
    assert values["meshscope_network_errors_total", "mlx5_0", "1", "port_rcv_errors"] == 0
    assert values["meshscope_network_congestion_total", "mlx5_1", "1", "np_cnp_sent"] == 0
    assert values["meshscope_network_errors_total", "mlx5_1", "", "roce_slow_restart"] == 0  # device-level
    assert values["meshscope_network_transmit_wait_ticks_total", "mlx5_0", "1"] == 0
    # saturated symbol_error and N/A VL15_dropped: unknown, so absent rather than a flat 0
    assert ("meshscope_network_errors_total", "mlx5_0", "1", "symbol_error") not in values
    assert ("meshscope_network_errors_total", "mlx5_1", "1", "VL15_dropped") not in values
    assert ("meshscope_network_errors_total", "mlx5_1", "1", "rx_write_requests") not in values
    assert source.saturated_total == 1  # the legacy data counters were not read: counters_ext wins
    assert source.unavailable_total == 1
    assert source.health.parse_errors_total == 0


def test_every_sample_names_a_listed_metric_with_its_labels(tree: Path) -> None:
    clock = FakeClock()
    source = InfinibandSource(root=tree, clock=clock, gpu_count=2)
    source.poll()
    clock.now += 1
    source.poll()
    for sample in source.samples():
        spec = BY_NAME[sample.metric]
        assert spec.source == "infiniband"
        assert tuple(sorted(spec.labels)) == tuple(name for name, _ in sample.labels)
        assert sample.gpu is None
        assert sample.rank is None


def test_rates_and_totals_between_two_polls(tree: Path) -> None:
    clock = FakeClock(100.0)
    source = InfinibandSource(root=tree, clock=clock, gpu_count=2)
    source.poll()
    write(tree, "mlx5_0/ports/1/counters_ext/port_xmit_data_64", 1_500_000_000)  # +5e8 words
    write(tree, "mlx5_0/ports/1/counters_ext/port_rcv_data_64", 2_250_000_000)  # +2.5e8 words
    write(tree, "mlx5_0/ports/1/counters_ext/port_xmit_packets_64", 7_000_000)
    write(tree, "mlx5_0/ports/1/counters_ext/port_rcv_packets_64", 6_500_000)
    write(tree, "mlx5_0/ports/1/counters/port_rcv_errors", 5)
    write(tree, "mlx5_0/ports/1/counters/port_xmit_wait", 13_345)
    write(tree, "mlx5_1/ports/1/counters/port_xmit_data", 300_000_000)  # +5e7 words
    write(tree, "mlx5_1/ports/1/counters/port_rcv_data", 1000)  # went backwards: a reset
    write(tree, "mlx5_1/ports/1/counters/port_xmit_packets", 1_100_000)
    write(tree, "mlx5_1/ports/1/counters/port_rcv_packets", 100)
    write(tree, "mlx5_1/ports/1/counters/port_xmit_wait", 8000)
    write(tree, "mlx5_1/ports/1/hw_counters/np_cnp_sent", 160)
    clock.now = 102.0
    source.poll()
    values = series(source)
    assert values["meshscope_network_transmit_bytes_per_second", "mlx5_0", "1"] == 5e8 * 4 / 2
    assert values["meshscope_network_receive_bytes_per_second", "mlx5_0", "1"] == 2.5e8 * 4 / 2
    assert values["meshscope_network_transmit_packets_per_second", "mlx5_0", "1"] == 1e6
    assert values["meshscope_network_receive_packets_per_second", "mlx5_0", "1"] == 2.5e5
    assert values["meshscope_network_transmit_bytes_per_second", "mlx5_1", "1"] == 5e7 * 4 / 2
    assert values["meshscope_network_transmit_packets_per_second", "mlx5_1", "1"] == 5e4
    assert ("meshscope_network_receive_bytes_per_second", "mlx5_1", "1") not in values  # reset: no rate, not 0
    assert ("meshscope_network_receive_packets_per_second", "mlx5_1", "1") not in values
    assert values["meshscope_network_errors_total", "mlx5_0", "1", "port_rcv_errors"] == 2
    assert values["meshscope_network_errors_total", "mlx5_0", "1", "link_downed"] == 0
    assert values["meshscope_network_transmit_wait_ticks_total", "mlx5_0", "1"] == 1000
    assert values["meshscope_network_transmit_wait_ticks_total", "mlx5_1", "1"] == 8000
    assert values["meshscope_network_congestion_total", "mlx5_1", "1", "np_cnp_sent"] == 60
    assert values["meshscope_network_congestion_total", "mlx5_1", "1", "rp_cnp_handled"] == 0

    # after the reset the next interval has a rate again
    write(tree, "mlx5_1/ports/1/counters/port_rcv_data", 51_000)
    clock.now = 104.0
    source.poll()
    values = series(source)
    assert values["meshscope_network_receive_bytes_per_second", "mlx5_1", "1"] == 50_000 * 4 / 2
    assert values["meshscope_network_errors_total", "mlx5_0", "1", "port_rcv_errors"] == 2  # unchanged counter


def test_a_saturated_counter_gives_no_rate_and_resumes_after_a_reset(tree: Path) -> None:
    clock = FakeClock()
    (tree / "mlx5_0/ports/1/counters_ext/port_xmit_data_64").unlink()  # read the legacy 32-bit file
    write(tree, "mlx5_0/ports/1/counters/port_xmit_data", 4_000_000_000)
    source = InfinibandSource(root=tree, clock=clock)
    source.poll()
    write(tree, "mlx5_0/ports/1/counters/port_xmit_data", 4_294_967_295)  # stuck at 2**32 - 1
    clock.now += 1
    source.poll()
    assert ("meshscope_network_transmit_bytes_per_second", "mlx5_0", "1") not in series(source)
    clock.now += 1
    source.poll()  # still saturated
    assert ("meshscope_network_transmit_bytes_per_second", "mlx5_0", "1") not in series(source)
    write(tree, "mlx5_0/ports/1/counters/port_xmit_data", 10)  # cleared (perfquery -x)
    clock.now += 1
    source.poll()  # previous reading unknown: still no rate
    assert ("meshscope_network_transmit_bytes_per_second", "mlx5_0", "1") not in series(source)
    write(tree, "mlx5_0/ports/1/counters/port_xmit_data", 110)
    clock.now += 1
    source.poll()
    assert series(source)["meshscope_network_transmit_bytes_per_second", "mlx5_0", "1"] == 400

    write(tree, "mlx5_0/ports/1/counters/symbol_error", 10)  # the saturated 16-bit counter, cleared
    source.poll()
    assert series(source)["meshscope_network_errors_total", "mlx5_0", "1", "symbol_error"] == 0
    write(tree, "mlx5_0/ports/1/counters/symbol_error", 12)
    source.poll()
    assert series(source)["meshscope_network_errors_total", "mlx5_0", "1", "symbol_error"] == 2


@pytest.mark.parametrize(
    ("counter", "width"),
    [("symbol_error", 16), ("link_downed", 8), ("local_link_integrity_errors", 4), ("port_xmit_wait", 32)],
)
def test_each_legacy_width_saturates_at_its_maximum(tree: Path, counter: str, width: int) -> None:
    source = InfinibandSource(root=tree, clock=FakeClock())
    write(tree, f"mlx5_1/ports/1/counters/{counter}", 2**width - 1)
    source.poll()
    assert source.saturated_total == 2  # this one and mlx5_0's symbol_error
    write(tree, f"mlx5_1/ports/1/counters/{counter}", 2**width - 2)  # one below: a value
    fresh = InfinibandSource(root=tree, clock=FakeClock())
    fresh.poll()
    assert fresh.saturated_total == 1


def test_unreadable_and_garbage_files_are_counted_not_fatal(tree: Path) -> None:
    discards = tree / "mlx5_0/ports/1/counters/port_xmit_discards"
    discards.unlink()
    discards.mkdir()  # reading it fails with an OSError, as a failed PMA query does on newer kernels
    write(tree, "mlx5_0/ports/1/counters/port_rcv_errors", "banana")
    write(tree, "mlx5_1/ports/1/rate", "fast")
    source = InfinibandSource(root=tree, clock=FakeClock())
    source.poll()
    values = series(source)
    assert source.health.up
    assert source.unavailable_total == 2  # the directory and VL15_dropped's N/A
    assert source.health.parse_errors_total == 2  # banana and the rate
    assert ("meshscope_network_errors_total", "mlx5_0", "1", "port_xmit_discards") not in values
    assert ("meshscope_network_errors_total", "mlx5_0", "1", "port_rcv_errors") not in values
    assert ("meshscope_network_link_rate_bytes_per_second", "mlx5_1", "1") not in values
    assert values["meshscope_network_errors_total", "mlx5_0", "1", "link_downed"] == 0


def test_ports_are_listed_in_pci_order_with_their_facts(tree: Path) -> None:
    source = InfinibandSource(root=tree, clock=FakeClock(), gpu_count=2)
    source.poll()
    ports = source.ports()
    assert [(p.device, p.pci_address, p.link_layer, p.state) for p in ports] == [
        ("mlx5_1", "0000:18:00.0", "Ethernet", "ACTIVE"),
        ("mlx5_0", "0000:9a:00.0", "InfiniBand", "ACTIVE"),
    ]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"gpu_count": 2}, {("mlx5_1", "1"): "0", ("mlx5_0", "1"): "1"}),  # PCI order, not name order
        ({"gpu_count": 8}, {("mlx5_1", "1"): "", ("mlx5_0", "1"): ""}),  # counts differ: no guess
        ({}, {("mlx5_1", "1"): "", ("mlx5_0", "1"): ""}),
        ({"rails": {("mlx5_0", 1): 3}, "gpu_count": 2}, {("mlx5_1", "1"): "", ("mlx5_0", "1"): "3"}),
    ],
    ids=["pci-order", "count-mismatch", "no-gpu-count", "settings"],
)
def test_rails(tree: Path, kwargs: dict[str, object], expected: dict[tuple[str, str], str]) -> None:
    source = InfinibandSource(root=tree, clock=FakeClock(), **kwargs)  # type: ignore[arg-type]
    source.poll()
    assert rails(source) == expected


def test_a_down_port_serves_no_rail(tree: Path) -> None:
    write(tree, "mlx5_1/ports/1/state", "1: DOWN")
    source = InfinibandSource(root=tree, clock=FakeClock(), gpu_count=1)
    source.poll()
    assert rails(source) == {("mlx5_1", "1"): "", ("mlx5_0", "1"): "0"}
    assert series(source)["meshscope_network_port_active", "mlx5_1", "1"] == 0


def test_no_rdma_devices_is_a_state_not_an_error(tmp_path: Path) -> None:
    missing = InfinibandSource(root=tmp_path / "absent", clock=FakeClock())
    missing.poll()
    assert not missing.health.up
    assert "cannot list" in (missing.health.last_error or "")
    assert list(missing.samples()) == []
    empty = InfinibandSource(root=tmp_path, clock=FakeClock())
    empty.poll()
    assert empty.health.up
    assert "no RDMA devices" in (empty.health.last_error or "")


def test_a_vanished_device_leaves_no_state(tree: Path) -> None:
    clock = FakeClock()
    source = InfinibandSource(root=tree, clock=clock)
    source.poll()
    shutil.rmtree(tree / "mlx5_0")
    clock.now += 1
    source.poll()
    assert {key[1] for key in series(source)} == {"mlx5_1"}
    assert {key[0] for key in source._totals} == {"mlx5_1"}


# --- fuzzing counter files from the kernel's grammar ---------------------------------------------------------------

counter_texts = st.one_of(
    st.integers(min_value=0, max_value=2**64 - 1).map(str),
    st.sampled_from([str(2**32 - 1), "N/A (no PMA)", "", "-1", "0x10", "1e3", "١٢٣"]),
    st.text(max_size=12),
)


def _one_port_tree(root: Path, xmit: str, xmit_wait: str, state: str, rate: str) -> None:
    port = root / "mlx5_0" / "ports" / "1"
    (port / "counters").mkdir(parents=True, exist_ok=True)
    (port / "counters" / "port_xmit_data").write_text(xmit + "\n")
    (port / "counters" / "port_xmit_wait").write_text(xmit_wait + "\n")
    (port / "state").write_text(state + "\n")
    (port / "rate").write_text(rate + "\n")


def _known(text: str, width: int) -> int | None:
    """The value a counter file holds, by the kernel's grammar: decimal digits below the saturation point."""
    stripped = text.strip()
    if not (stripped.isascii() and stripped.isdigit()):
        return None
    value = int(stripped)
    return None if value == 2**width - 1 else value


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(counter_texts, counter_texts), min_size=2, max_size=5),
    st.lists(st.floats(min_value=0.001, max_value=1000), min_size=5, max_size=5),
    st.sampled_from(["4: ACTIVE", "1: DOWN", "ACTIVE", "", "9: WEIRD_STATE"]),
    st.sampled_from(["400 Gb/sec (4X NDR)", "2.5 Gb/sec (1X SDR)", "N/A", "Gb/sec", ""]),
)
def test_fuzz_rates_are_exact_or_absent(polls: list[tuple[str, str]], gaps: list[float], state: str, rate: str) -> None:
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        clock = FakeClock(0.0)
        source = InfinibandSource(root=root, clock=clock, gpu_count=1)
        previous: tuple[int | None, int | None] | None = None
        expected_ticks = 0
        for (xmit, wait), gap in zip(polls, gaps, strict=False):
            _one_port_tree(root, xmit, wait, state, rate)
            clock.now += gap
            source.poll()
            assert source.health.up
            values = series(source)
            current = (_known(xmit, 32), _known(wait, 32))
            rate_key = ("meshscope_network_transmit_bytes_per_second", "mlx5_0", "1")
            if previous is not None and None not in (previous[0], current[0]) and current[0] >= previous[0]:  # type: ignore[operator]
                assert values[rate_key] == pytest.approx((current[0] - previous[0]) * 4 / gap)  # type: ignore[operator]
            else:
                assert rate_key not in values
            if previous is not None and None not in (previous[1], current[1]) and current[1] >= previous[1]:  # type: ignore[operator]
                expected_ticks += current[1] - previous[1]  # type: ignore[operator]
            ticks_key = ("meshscope_network_transmit_wait_ticks_total", "mlx5_0", "1")
            if current[1] is None:
                assert ticks_key not in values
            else:
                assert values[ticks_key] == pytest.approx(expected_ticks)
            previous = current
            active = state == "4: ACTIVE"
            assert values["meshscope_network_port_active", "mlx5_0", "1"] == float(active)
            assert rails(source) == {("mlx5_0", "1"): "0" if active else ""}

"""The NVML source: a small fake of pynvml for values and failures, and the real pynvml (no driver on CI machines)."""

from __future__ import annotations

import logging
import shutil
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from meshscope_sidecar.metrics import BY_NAME
from meshscope_sidecar.sources.nvml import NvmlSource, normalize_pci_bus_id

# nvml.h return codes the fake raises
NOT_SUPPORTED, LIBRARY_NOT_FOUND, GPU_IS_LOST = 3, 12, 15


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    uuid: str
    bus_id: bytes
    name: bytes
    util_percent: int | None  # None: NOT_SUPPORTED (a GPU in MIG mode)
    used_bytes: int
    total_bytes: int
    power_mw: int
    sm_mhz: int
    temp_c: int


@dataclass
class FakeNvml:
    gpus: list[FakeGpu]
    init_error: int | None = None
    lost: set[int] = field(default_factory=set)
    shutdowns: int = 0
    NVMLError: type[Exception] = FakeNVMLError

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:
        return index

    def _gpu(self, handle: object) -> FakeGpu:
        assert isinstance(handle, int)
        if handle in self.lost:
            raise FakeNVMLError(GPU_IS_LOST)
        return self.gpus[handle]

    def nvmlDeviceGetUUID(self, handle: object) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: object) -> bytes:
        return self._gpu(handle).name

    def nvmlDeviceGetPciInfo(self, handle: object) -> object:
        return SimpleNamespace(busId=self._gpu(handle).bus_id)

    def nvmlDeviceGetUtilizationRates(self, handle: object) -> object:
        gpu = self._gpu(handle)
        if gpu.util_percent is None:
            raise FakeNVMLError(NOT_SUPPORTED)
        return SimpleNamespace(gpu=gpu.util_percent, memory=10)

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> object:
        gpu = self._gpu(handle)
        return SimpleNamespace(used=gpu.used_bytes, total=gpu.total_bytes, free=gpu.total_bytes - gpu.used_bytes)

    def nvmlDeviceGetPowerUsage(self, handle: object) -> int:
        return self._gpu(handle).power_mw

    def nvmlDeviceGetClockInfo(self, handle: object, clock_type: int) -> int:
        assert clock_type == 1  # NVML_CLOCK_SM
        return self._gpu(handle).sm_mhz

    def nvmlDeviceGetTemperature(self, handle: object, sensor: int) -> int:
        assert sensor == 0  # NVML_TEMPERATURE_GPU
        return self._gpu(handle).temp_c


def two_gpus() -> FakeNvml:
    return FakeNvml(
        gpus=[
            FakeGpu(
                "GPU-aaaa", b"00000000:18:00.0", b"NVIDIA H100 80GB HBM3", 37, 60 * 2**30, 80 * 2**30, 412_345, 1980, 55
            ),
            FakeGpu(
                "GPU-bbbb", b"00000000:2A:00.0", b"NVIDIA H100 80GB HBM3", None, 2**30, 80 * 2**30, 95_000, 345, 31
            ),
        ]
    )


def values(source: NvmlSource) -> dict[tuple[str, int | None], float]:
    out = {}
    for sample in source.samples():
        assert BY_NAME[sample.metric].source in {"nvml", "dcgm|nvml"}
        assert sample.labels == (("gpu_instance", ""),)
        out[sample.metric, sample.gpu] = sample.value
    return out


def test_readings_in_base_units() -> None:
    source = NvmlSource(lib=two_gpus())
    source.poll()
    got = values(source)
    assert source.health.up
    assert got["meshscope_gpu_utilization_ratio", 0] == pytest.approx(0.37)
    assert got["meshscope_gpu_memory_used_bytes", 0] == 60 * 2**30
    assert got["meshscope_gpu_memory_total_bytes", 1] == 80 * 2**30
    assert got["meshscope_gpu_power_watts", 0] == pytest.approx(412.345)  # milliwatts
    assert got["meshscope_gpu_sm_clock_hertz", 1] == 345e6  # MHz
    assert got["meshscope_gpu_temperature_celsius", 0] == 55


def test_no_utilisation_is_absent_not_zero_and_said() -> None:
    source = NvmlSource(lib=two_gpus())
    source.poll()
    got = values(source)
    assert ("meshscope_gpu_utilization_ratio", 1) not in got
    assert got["meshscope_gpu_power_watts", 1] == pytest.approx(95.0)
    assert any(note.startswith("GPU 1: no utilisation") for note in source.notes())
    assert source.health.up


def test_identity_records() -> None:
    source = NvmlSource(lib=two_gpus())
    source.poll()
    assert [(d.index, d.uuid, d.pci_bus_id, d.model) for d in source.devices()] == [
        (0, "GPU-aaaa", "0000:18:00.0", "NVIDIA H100 80GB HBM3"),
        (1, "GPU-bbbb", "0000:2a:00.0", "NVIDIA H100 80GB HBM3"),
    ]


def test_no_library_is_a_state_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    lib = FakeNvml(gpus=[], init_error=LIBRARY_NOT_FOUND)
    source = NvmlSource(lib=lib)
    with caplog.at_level(logging.INFO, logger="meshscope_sidecar.sources.nvml"):
        for _ in range(3):
            source.poll()
    assert not source.health.up
    assert "NVML error 12" in (source.health.last_error or "")
    assert list(source.samples()) == []
    assert len(caplog.records) == 1
    lib.init_error = None
    lib.gpus = two_gpus().gpus
    source.poll()  # the driver came back: init is retried
    assert source.health.up
    assert source.health.last_error is None


def test_a_lost_gpu_fails_the_poll_and_recovers() -> None:
    lib = two_gpus()
    source = NvmlSource(lib=lib)
    source.poll()
    lib.lost = {1}
    source.poll()
    assert not source.health.up
    assert "NVML error 15" in (source.health.last_error or "")
    assert list(source.samples()) == []  # no stale gauges
    lib.lost = set()
    source.poll()
    assert source.health.up


def test_no_gpu_is_not_up() -> None:
    source = NvmlSource(lib=FakeNvml(gpus=[]))
    source.poll()
    assert not source.health.up
    assert source.health.last_error == "NVML sees no GPU on this node"


def test_close_shuts_down_once_and_is_idempotent() -> None:
    lib = two_gpus()
    source = NvmlSource(lib=lib)
    source.close()
    assert lib.shutdowns == 0  # never initialised
    source.poll()
    source.close()
    source.close()
    assert lib.shutdowns == 1


def test_pynvml_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml now raises ImportError
    source = NvmlSource()
    source.poll()
    assert not source.health.up
    assert "pynvml is not installed" in (source.health.last_error or "")


def test_real_pynvml_without_a_driver_is_a_state() -> None:
    source = NvmlSource()
    source.poll()  # must not raise, whatever the machine
    if shutil.which("nvidia-smi") is None:
        assert not source.health.up
        assert "NVML" in (source.health.last_error or "")
    else:
        assert source.health.up or source.health.last_error
    source.close()


@pytest.mark.gpu
def test_real_nvml_on_a_gpu() -> None:
    source = NvmlSource()
    source.poll()
    assert source.health.up, source.health.last_error
    got = values(source)
    devices = source.devices()
    assert devices
    for device in devices:
        assert device.uuid.startswith("GPU-")
        assert normalize_pci_bus_id(device.pci_bus_id) == device.pci_bus_id != ""
        assert got["meshscope_gpu_memory_total_bytes", device.index] > 0
        assert (
            0
            <= got["meshscope_gpu_memory_used_bytes", device.index]
            <= got["meshscope_gpu_memory_total_bytes", device.index]
        )
        assert 1e8 < got["meshscope_gpu_sm_clock_hertz", device.index] < 5e9
    source.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("00000000:18:00.0", "0000:18:00.0"),
        ("0000:9A:00.1", "0000:9a:00.1"),
        ("3a:00.0", "0000:3a:00.0"),
        ("00010000:01:00.0", "10000:01:00.0"),
        ("not a bus id", ""),
        ("0000:18:00.8", ""),
    ],
)
def test_normalize_pci_bus_id(text: str, expected: str) -> None:
    assert normalize_pci_bus_id(text) == expected

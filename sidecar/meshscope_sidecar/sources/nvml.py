"""The NVML source: per-GPU utilisation, memory, power, SM clock and temperature read through ``pynvml``.

Exists for nodes where no dcgm-exporter runs (or beside it, as a cross-check): NVML is what ``nvidia-smi`` and DCGM
themselves read. It also defines the identity record of a GPU, :class:`GpuDevice`, that the DCGM source fills from
dcgm-exporter's labels (they come from NVML too), so that the sidecar's identity can join on UUID or PCI bus id.

It must not treat an absent library, an absent driver or a machine without GPUs as a failure: those are the normal
state of most machines that run the tests (``up`` false, ``last_error`` says why, logged once, no exception). It
must not import ``pynvml`` at module import time (the sidecar runs without it), and it must not do anything but
read: no clocks, no persistence mode, no MIG changes.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from meshscope_sidecar.sources.base import Sample, SourceHealth

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

_log = logging.getLogger(__name__)

_MHZ_HERTZ = 1_000_000
_MILLIWATTS_PER_WATT = 1000.0

# NVML return codes that mean "this reading does not exist here", not "something broke" (nvml.h:
# NVML_ERROR_NOT_SUPPORTED = 3, e.g. utilisation of a GPU in MIG mode; NVML_ERROR_NO_PERMISSION = 4).
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_NO_PERMISSION = 4
# nvml.h: NVML_TEMPERATURE_GPU = 0, NVML_CLOCK_SM = 1.
_NVML_TEMPERATURE_GPU = 0
_NVML_CLOCK_SM = 1

_PCI_BUS_ID = re.compile(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])")


def normalize_pci_bus_id(text: str) -> str:
    """The PCI address in sysfs form, ``dddd:bb:dd.f`` in lower case, so that NVML, DCGM and sysfs ids compare.

    NVML and dcgm-exporter write an 8-digit domain (``00000000:19:00.0``, ``nvmlPciInfo_t.busId``); sysfs and
    ``lspci -D`` write 4 (``0000:19:00.0``). A domain above 0xffff keeps all its digits.

    Args:
        text: a PCI address as NVML, DCGM, sysfs or ``lspci`` writes it (domain optional).

    Returns:
        The normalised address, or ``""`` when ``text`` is not a PCI address.
    """
    match = _PCI_BUS_ID.fullmatch(text.strip())
    if match is None:
        return ""
    domain_text, bus, device, function = match.groups()
    domain = int(domain_text, 16) if domain_text else 0
    return f"{domain:04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{function}"


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuDevice:
    """One GPU (or one MIG instance of a GPU) a GPU source saw: what the identity joins on."""

    index: int
    """Local index on the node (``nvidia-smi`` order; dcgm-exporter's ``gpu`` label)."""
    uuid: str
    """``GPU-…`` UUID of the physical GPU (dcgm-exporter puts the parent GPU's UUID on MIG series)."""
    pci_bus_id: str
    """PCI address in sysfs form (:func:`normalize_pci_bus_id`); ``""`` when unknown."""
    model: str
    """Model name as NVML reports it (``NVIDIA H100 80GB HBM3``; dcgm-exporter's ``modelName``)."""
    mig_instance: int | None = None
    """MIG GPU instance id (``GPU_I_ID``) when this record is one MIG instance; ``None`` for a whole GPU."""
    mig_profile: str = ""
    """MIG profile (``GPU_I_PROFILE``, e.g. ``1g.10gb``); ``""`` for a whole GPU."""
    pod: str = ""
    """Kubernetes pod the exporter attributed the GPU to (``pod`` label); ``""`` when none or not known."""
    namespace: str = ""
    """That pod's namespace; ``""`` when none."""


class NvmlLibrary(Protocol):
    """What this source uses of ``pynvml`` (nvidia-ml-py), so that tests can pass a small fake.

    Every call may raise ``NVMLError`` (``pynvml.NVMLError``, whose ``value`` is NVML's return code).
    """

    NVMLError: type[Exception]

    def nvmlInit(self) -> None: ...  # noqa: D102, N802 - pynvml's names
    def nvmlShutdown(self) -> None: ...  # noqa: D102, N802
    def nvmlDeviceGetCount(self) -> int: ...  # noqa: D102, N802
    def nvmlDeviceGetHandleByIndex(self, index: int) -> object: ...  # noqa: D102, N802
    def nvmlDeviceGetUUID(self, handle: object) -> str | bytes: ...  # noqa: D102, N802
    def nvmlDeviceGetName(self, handle: object) -> str | bytes: ...  # noqa: D102, N802
    def nvmlDeviceGetPciInfo(self, handle: object) -> Any: ...  # noqa: D102, N802, ANN401 - a ctypes struct
    def nvmlDeviceGetUtilizationRates(self, handle: object) -> Any: ...  # noqa: D102, N802, ANN401
    def nvmlDeviceGetMemoryInfo(self, handle: object) -> Any: ...  # noqa: D102, N802, ANN401
    def nvmlDeviceGetPowerUsage(self, handle: object) -> int: ...  # noqa: D102, N802
    def nvmlDeviceGetClockInfo(self, handle: object, clock_type: int) -> int: ...  # noqa: D102, N802
    def nvmlDeviceGetTemperature(self, handle: object, sensor: int) -> int: ...  # noqa: D102, N802


def _text(value: str | bytes) -> str:
    """Text of a pynvml string: ``bytes`` before nvidia-ml-py 11.5, ``str`` since."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _load_pynvml() -> NvmlLibrary | str:
    """The real ``pynvml`` module, or why it cannot be had (a reason in words)."""
    try:
        import pynvml  # noqa: PLC0415 - optional dependency, imported only when the source is used
    except ImportError as exc:
        return f"pynvml is not installed (pip install nvidia-ml-py): {exc}"
    module: NvmlLibrary = pynvml
    return module


class NvmlSource:
    """Reads every GPU NVML sees, once per :meth:`poll`; gauges only.

    Construct with ``lib=None`` to use the installed ``pynvml``, or pass an object with the same functions
    (:class:`NvmlLibrary`). NVML is initialised on the first poll, retried on later polls while it fails, and shut
    down by :meth:`close`.
    """

    name = "nvml"

    def __init__(self, *, lib: NvmlLibrary | None = None, wall_clock: Callable[[], float] = time.time) -> None:
        """Remember the library; touch nothing yet.

        Args:
            lib: the NVML bindings (``pynvml`` or a fake); ``None`` imports ``pynvml`` on the first poll.
            wall_clock: seconds since the epoch, for ``last_success_unix_s`` (``time.time``).
        """
        self.health = SourceHealth()
        self._lib = lib
        self._wall_clock = wall_clock
        self._initialised = False
        self._logged: str | None = None
        self._samples: list[Sample] = []
        self._devices: tuple[GpuDevice, ...] = ()
        self._notes: tuple[str, ...] = ()

    def devices(self) -> tuple[GpuDevice, ...]:
        """The GPUs of the last successful poll, by index."""
        return self._devices

    def notes(self) -> tuple[str, ...]:
        """What the last poll could not read and why (e.g. no utilisation for a GPU in MIG mode)."""
        return self._notes

    def samples(self) -> Iterable[Sample]:
        """The readings of the last successful poll (none while NVML is unavailable)."""
        return tuple(self._samples)

    def poll(self) -> None:
        """Read every GPU; on any failure keep running, with ``up`` false and the reason in ``last_error``."""
        lib = self._library()
        if lib is None:
            return
        try:
            if not self._initialised:
                lib.nvmlInit()
                self._initialised = True
            self._read_all(lib)
        except lib.NVMLError as exc:
            self._fail(f"NVML: {exc}")
        except Exception as exc:  # noqa: BLE001 - a foreign library at the edge: whatever it raises is a state
            self._fail(f"NVML raised {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Shut NVML down if this source initialised it; idempotent."""
        if self._initialised and self._lib is not None:
            # Closing must not raise, and nothing is left to do when shutdown fails.
            with contextlib.suppress(Exception):
                self._lib.nvmlShutdown()
        self._initialised = False

    def _library(self) -> NvmlLibrary | None:
        if self._lib is None:
            loaded = _load_pynvml()
            if isinstance(loaded, str):
                self._fail(loaded)
                return None
            self._lib = loaded
        return self._lib

    def _fail(self, reason: str) -> None:
        self.health.up = False
        self.health.last_error = reason
        self._samples = []
        if reason != self._logged:
            # Logged once per distinct reason: a machine without a GPU says so once, not every second.
            _log.info("nvml source is not reading: %s", reason)
            self._logged = reason

    def _read_all(self, lib: NvmlLibrary) -> None:
        count = lib.nvmlDeviceGetCount()
        samples: list[Sample] = []
        devices: list[GpuDevice] = []
        notes: list[str] = []
        for index in range(count):
            handle = lib.nvmlDeviceGetHandleByIndex(index)
            pci = _optional(lib, notes, index, "PCI info", lib.nvmlDeviceGetPciInfo, handle)
            bus_id = normalize_pci_bus_id(_text(pci.busId)) if pci is not None else ""
            devices.append(
                GpuDevice(
                    index=index,
                    uuid=_text(lib.nvmlDeviceGetUUID(handle)),
                    pci_bus_id=bus_id,
                    model=_text(lib.nvmlDeviceGetName(handle)),
                )
            )
            samples.extend(self._read_one(lib, handle, index, notes))
        if count == 0:
            notes.append("NVML sees no GPU on this node")
        self._samples = samples
        self._devices = tuple(devices)
        self._notes = tuple(notes)
        self.health.up = count > 0
        self.health.last_error = None if count > 0 else "NVML sees no GPU on this node"
        self.health.last_success_unix_s = float(self._wall_clock())

    def _read_one(self, lib: NvmlLibrary, handle: object, index: int, notes: list[str]) -> list[Sample]:
        def gauge(metric: str, value: float) -> Sample:
            return Sample(metric=metric, value=value, gpu=index, labels=(("gpu_instance", ""),))

        out: list[Sample] = []
        util = _optional(lib, notes, index, "utilisation", lib.nvmlDeviceGetUtilizationRates, handle)
        if util is not None:
            # nvmlUtilization_t.gpu: percent of the sample period a kernel ran (nvml.h).
            out.append(gauge("meshscope_gpu_utilization_ratio", float(util.gpu) / 100.0))
        memory = _optional(lib, notes, index, "memory", lib.nvmlDeviceGetMemoryInfo, handle)
        if memory is not None:
            # nvmlMemory_t: bytes.
            out.append(gauge("meshscope_gpu_memory_used_bytes", float(memory.used)))
            out.append(gauge("meshscope_gpu_memory_total_bytes", float(memory.total)))
        power = _optional(lib, notes, index, "power", lib.nvmlDeviceGetPowerUsage, handle)
        if power is not None:
            # nvmlDeviceGetPowerUsage: milliwatts (nvml.h).
            out.append(gauge("meshscope_gpu_power_watts", float(power) / _MILLIWATTS_PER_WATT))
        clock = _optional(lib, notes, index, "SM clock", lib.nvmlDeviceGetClockInfo, handle, _NVML_CLOCK_SM)
        if clock is not None:
            # nvmlDeviceGetClockInfo: MHz.
            out.append(gauge("meshscope_gpu_sm_clock_hertz", float(clock) * _MHZ_HERTZ))
        temperature = _optional(
            lib, notes, index, "temperature", lib.nvmlDeviceGetTemperature, handle, _NVML_TEMPERATURE_GPU
        )
        if temperature is not None:
            out.append(gauge("meshscope_gpu_temperature_celsius", float(temperature)))
        return out


def _optional(
    lib: NvmlLibrary,
    notes: list[str],
    index: int,
    what: str,
    read: Callable[..., Any],
    *args: object,
) -> Any:  # noqa: ANN401 - whatever the pynvml call returns
    """``read(*args)``, or ``None`` when NVML says the reading does not exist on this GPU (noted, not an error).

    Raises:
        NVMLError: any other NVML failure (the poll reports it).
    """
    try:
        return read(*args)
    except lib.NVMLError as exc:
        code = getattr(exc, "value", None)
        if code not in {_NVML_ERROR_NOT_SUPPORTED, _NVML_ERROR_NO_PERMISSION}:
            raise
        notes.append(f"GPU {index}: no {what} ({exc}); the series is absent, not 0")
        return None


__all__ = ["GpuDevice", "NvmlLibrary", "NvmlSource", "normalize_pci_bus_id"]

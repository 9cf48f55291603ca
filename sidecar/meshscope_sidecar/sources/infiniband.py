"""The InfiniBand / RoCE source: per-port byte and packet rates, wait ticks and error counters from sysfs.

Exists because DCGM does not cover the network (dcgm-exporter#155), and because a rank that waits on a collective
across nodes waits on these ports: a rail's throughput against its link rate, its transmit-wait ticks and its
congestion notifications are what tell "the network is slow" from "a peer is late". Each port is mapped to the
local GPU its rail serves (the ``rail_gpu`` label).

It must not turn an unknown into a number: a legacy counter that saturated, a value that reads ``N/A (no PMA)``,
an unreadable file and a counter that went backwards (a reset) give no rate and no increment for that interval —
never a rate of 0. It must not sleep or read the wall clock for rates (the clock is injected), must not keep state
for ports that vanished, and never raises out of :meth:`poll`.

Formats, from the kernel: ``Documentation/ABI/stable/sysfs-class-infiniband`` and
``drivers/infiniband/core/sysfs.c`` (``PORT_PMA_ATTR``: each PortCounters field's width — 32 bits for data,
packets and ``port_xmit_wait``, 16 for ``symbol_error``, ``port_rcv_errors``, ``port_xmit_discards``,
``VL15_dropped`` and the remote/relay errors, 8 for ``link_downed``, ``link_error_recovery`` and the constraint
errors, 4 for ``local_link_integrity_errors`` and ``excessive_buffer_overrun_errors``; ``N/A (no PMA)`` when the
PMA query fails on older kernels, a read error on newer ones; ``rate`` as ``"%d Gb/sec (%dX%s)"``; ``state`` as
``"%d: %s"``). ``port_xmit_data``/``port_rcv_data`` count octets divided by 4 (per lane), so bytes are × 4
(node_exporter and procfs apply the same). Before kernel 4.5 the 64-bit variants live in ``counters_ext/*_64``.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshscope_sidecar.sources.base import Sample, SourceHealth

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

_log = logging.getLogger(__name__)

# Legacy PortCounters widths (drivers/infiniband/core/sysfs.c PORT_PMA_ATTR); a value at 2**width - 1 is saturated:
# the counter stopped there and its true value is unknown. Data and packet counters are 64-bit when the PMA has
# extended counters, but the file does not say which: 2**32 - 1 read on a 64-bit counter costs one interval's rate.
_WIDTH_BITS: dict[str, int] = {
    "port_xmit_data": 32,
    "port_rcv_data": 32,
    "port_xmit_packets": 32,
    "port_rcv_packets": 32,
    "port_xmit_wait": 32,
    "symbol_error": 16,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16,
    "VL15_dropped": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_xmit_constraint_errors": 8,
    "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
}
_ERROR_COUNTERS = (
    "symbol_error",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_discards",
    "port_rcv_discards",
    "VL15_dropped",
    "link_error_recovery",
    "link_downed",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)
"""Port error counters exported as ``meshscope_network_errors_total{counter}`` (a closed set: bounded labels)."""

# RoCE / vendor hw_counters (port or device level), 64-bit, names as prometheus/procfs sysfs/class_infiniband.go
# lists them for mlx5; only these are read, so the ``counter`` label stays a closed set.
_CONGESTION_COUNTERS = ("np_cnp_sent", "np_ecn_marked_roce_packets", "rp_cnp_handled", "rp_cnp_ignored")
_HW_ERROR_COUNTERS = (
    "out_of_sequence",
    "packet_seq_err",
    "local_ack_timeout_err",
    "implied_nak_seq_err",
    "rnr_nak_retry_err",
    "duplicate_request",
    "out_of_buffer",
    "req_cqe_error",
    "resp_cqe_error",
    "roce_adp_retrans",
    "roce_adp_retrans_to",
    "roce_slow_restart",
)

# counters_ext (kernels before 4.5): 64-bit, preferred over the legacy file of the same meaning.
_EXT_FILES = {
    "port_xmit_data": "port_xmit_data_64",
    "port_rcv_data": "port_rcv_data_64",
    "port_xmit_packets": "port_xmit_packets_64",
    "port_rcv_packets": "port_rcv_packets_64",
}
_TOTAL_METRICS: dict[str, str] = {
    **dict.fromkeys((*_ERROR_COUNTERS, *_HW_ERROR_COUNTERS), "meshscope_network_errors_total"),
    **dict.fromkeys(_CONGESTION_COUNTERS, "meshscope_network_congestion_total"),
    "port_xmit_wait": "meshscope_network_transmit_wait_ticks_total",
}
"""Counter file -> the running-total metric it feeds."""
_DATA_WORD_BYTES = 4  # port_*_data count 4-octet words (sysfs-class-infiniband: "divided by 4")
_GBIT_BYTES = 125_000_000  # 1 Gb/s in bytes per second
_RATE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*Gb/sec\b.*", re.DOTALL)
_STATE = re.compile(r"\s*(\d+)\s*:\s*([A-Z_]+)\s*")
_ACTIVE_STATE = 4  # IB PortState: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER
_NATURAL = re.compile(r"(\d+)")


def _natural_key(name: str) -> tuple[object, ...]:
    """``mlx5_2`` before ``mlx5_10``."""
    return tuple(int(part) if part.isdigit() else part for part in _NATURAL.split(name))


@dataclass(frozen=True, slots=True, kw_only=True)
class PortInfo:
    """One port of one RDMA device, as the last poll saw it."""

    device: str
    """Device name (``mlx5_0``)."""
    port: int
    """Port number (from 1)."""
    pci_address: str
    """PCI address of the device (the ``device`` link's target, ``0000:0c:00.0``); ``""`` when not a link."""
    state: str
    """Logical state (``ACTIVE``, ``DOWN``, …); ``""`` when unreadable."""
    link_layer: str
    """``InfiniBand`` or ``Ethernet`` (RoCE); ``""`` when unreadable."""
    rate_bytes_per_second: float | None
    """Signalling rate, from ``rate``; ``None`` when unreadable."""
    rail_gpu: str
    """The local GPU index this port's rail serves, as text; ``""`` when no rule gives one."""


@dataclass(frozen=True, slots=True)
class _Reading:
    """A counter as read: its value, or why there is none."""

    value: int | None
    """``None`` when unavailable, unreadable, saturated or garbage."""
    saturated: bool = False


class InfinibandSource:
    """Reads every device and port under ``root`` once per :meth:`poll`; rates between the last two polls.

    Rails (``rail_gpu``): ``rails`` from the settings maps ``(device, port)`` to a local GPU index and wins when
    given (ports it does not name get ``""``). Otherwise, when ``gpu_count`` is given and exactly that many ports
    are ACTIVE, the ports sorted by PCI address (then device name, then port number) serve GPUs 0, 1, … in that
    order — GPU indices follow PCI order too (``nvidia-smi``'s default), and an HGX board puts one NIC beside each
    GPU. Any other count (a front-end or storage NIC also up, a rail down, no ``gpu_count``) gives ``""`` for every
    port: a wrong rail is worse than none. Ports that are not ACTIVE always get ``""``.
    """

    name = "infiniband"

    def __init__(
        self,
        *,
        root: str | os.PathLike[str] = "/sys/class/infiniband",
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rails: Mapping[tuple[str, int], int] | None = None,
        gpu_count: int | None = None,
    ) -> None:
        """Remember where and how to read; nothing is read until :meth:`poll`.

        Args:
            root: the ``infiniband`` class directory (a fixture tree in tests).
            clock: monotonic seconds, for rates between polls.
            wall_clock: seconds since the epoch, for ``last_success_unix_s``.
            rails: explicit ``(device, port) -> local GPU index``; ``None`` applies the PCI-order rule.
            gpu_count: GPUs on this node, for the PCI-order rule; ``None`` disables it.
        """
        self.health = SourceHealth()
        self.root = Path(root)
        self._clock = clock
        self._wall_clock = wall_clock
        self._rails = dict(rails) if rails is not None else None
        self._gpu_count = gpu_count
        self._previous: dict[tuple[str, str, str], _Reading] = {}
        self._previous_time: float | None = None
        self._totals: dict[tuple[str, str, str], int] = {}
        self._ports: tuple[PortInfo, ...] = ()
        self._samples: list[Sample] = []
        self._logged: str | None = None
        self.unavailable_total = 0
        """Counter reads that gave no value (``N/A (no PMA)``, a read error): not parse errors, a state of the PMA."""
        self.saturated_total = 0
        """Counter reads at their legacy maximum (unknown from then on)."""

    def ports(self) -> tuple[PortInfo, ...]:
        """Every port of the last poll, in PCI order."""
        return self._ports

    def samples(self) -> Iterable[Sample]:
        """Rates of the last interval, running totals of the error, congestion and wait counters, port gauges."""
        return tuple(self._samples)

    def close(self) -> None:
        """Nothing is held open between polls; idempotent."""

    def poll(self) -> None:
        """Read every counter once; a missing root is a normal state (no RDMA devices), not an error."""
        now = self._clock()
        self.health.last_error = None
        try:
            devices = sorted((p for p in self.root.iterdir() if p.is_dir()), key=lambda p: _natural_key(p.name))
        except OSError as exc:
            self._fail(f"cannot list {self.root}: {exc.strerror or exc}")
            return
        readings: dict[tuple[str, str, str], _Reading] = {}
        ports: list[tuple[str, PortInfo]] = []
        for device in devices:
            pci = _pci_address(device)
            for port_dir in _port_dirs(device):
                info = self._read_port(device.name, int(port_dir.name), pci, port_dir, readings)
                ports.append((pci, info))
            hw_dir = device / "hw_counters"
            for name in _present(hw_dir, _HW_NAMES):
                self._read_counter(hw_dir / name, (device.name, "", name), None, readings)
        ports.sort(key=lambda item: (item[0] or "~", _natural_key(item[1].device), item[1].port))
        infos = self._assign_rails([info for _, info in ports])
        interval = None if self._previous_time is None else now - self._previous_time
        self._samples = self._build(infos, readings, interval)
        self._previous = readings
        self._previous_time = now
        self._ports = tuple(infos)
        self.health.up = True
        self.health.last_success_unix_s = float(self._wall_clock())
        if not devices:
            self.health.last_error = f"no RDMA devices under {self.root}"

    def _fail(self, reason: str) -> None:
        self.health.up = False
        self.health.last_error = reason
        self._samples = []
        self._previous = {}
        self._previous_time = None
        if reason != self._logged:
            _log.info("infiniband source is not reading: %s", reason)
            self._logged = reason

    def _read_counter(
        self,
        path: Path,
        key: tuple[str, str, str],
        width_bits: int | None,
        readings: dict[tuple[str, str, str], _Reading],
    ) -> None:
        try:
            text = _read_small(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            # Newer kernels fail the read when the PMA query fails (sysfs.c returns the error).
            self.unavailable_total += 1
            self.health.last_error = f"{path}: {exc.strerror or exc}"
            readings[key] = _Reading(None)
            return
        stripped = text.strip()
        if stripped.startswith("N/A"):
            self.unavailable_total += 1
            self.health.last_error = f"{path}: {stripped[:40]}"
            readings[key] = _Reading(None)
            return
        if not (stripped.isascii() and stripped.isdigit()):
            self.health.parse_errors_total += 1
            self.health.last_error = f"{path}: not a counter: {stripped[:40]!r}"
            readings[key] = _Reading(None)
            return
        value = int(stripped)
        if width_bits is not None and value == (1 << width_bits) - 1:
            self.saturated_total += 1
            readings[key] = _Reading(None, saturated=True)
            return
        readings[key] = _Reading(value)

    def _read_port(
        self,
        device: str,
        port: int,
        pci: str,
        port_dir: Path,
        readings: dict[tuple[str, str, str], _Reading],
    ) -> PortInfo:
        port_text = str(port)
        # One directory listing each instead of a failed open per absent file (most ports lack most of them).
        counters, ext_dir, hw_dir = port_dir / "counters", port_dir / "counters_ext", port_dir / "hw_counters"
        ext_present = _present(ext_dir, frozenset(_EXT_FILES.values()))
        for name in _present(counters, _PORT_NAMES) | {n for n, e in _EXT_FILES.items() if e in ext_present}:
            ext = _EXT_FILES.get(name)
            if ext is not None and ext in ext_present:
                self._read_counter(ext_dir / ext, (device, port_text, name), None, readings)
            else:
                self._read_counter(counters / name, (device, port_text, name), _WIDTH_BITS.get(name), readings)
        for name in _present(hw_dir, _HW_NAMES):
            self._read_counter(hw_dir / name, (device, port_text, name), None, readings)
        state = self._read_text(port_dir / "state")
        state_match = _STATE.fullmatch(state or "")
        if state is not None and state_match is None:
            self.health.parse_errors_total += 1
        rate_text = self._read_text(port_dir / "rate")
        rate_match = _RATE.fullmatch(rate_text or "")
        if rate_text is not None and rate_match is None:
            self.health.parse_errors_total += 1
        link_layer = self._read_text(port_dir / "link_layer")
        return PortInfo(
            device=device,
            port=port,
            pci_address=pci,
            state=state_match.group(2) if state_match else "",
            link_layer=(link_layer or "").strip(),
            rate_bytes_per_second=float(rate_match.group(1)) * _GBIT_BYTES if rate_match else None,
            rail_gpu="",
        )

    def _read_text(self, path: Path) -> str | None:
        try:
            return _read_small(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.unavailable_total += 1
            self.health.last_error = f"{path}: {exc.strerror or exc}"
            return None

    def _assign_rails(self, ports: list[PortInfo]) -> list[PortInfo]:
        rails: dict[tuple[str, int], str] = {}
        if self._rails is not None:
            rails = {key: str(gpu) for key, gpu in self._rails.items()}
        elif self._gpu_count is not None:
            active = [p for p in ports if p.state == "ACTIVE"]
            if len(active) == self._gpu_count:
                rails = {(p.device, p.port): str(i) for i, p in enumerate(active)}
        return [
            PortInfo(
                device=p.device,
                port=p.port,
                pci_address=p.pci_address,
                state=p.state,
                link_layer=p.link_layer,
                rate_bytes_per_second=p.rate_bytes_per_second,
                rail_gpu=rails.get((p.device, p.port), "") if p.state == "ACTIVE" else "",
            )
            for p in ports
        ]

    def _delta(self, key: tuple[str, str, str], readings: Mapping[tuple[str, str, str], _Reading]) -> int | None:
        """Increase since the last poll, or ``None`` when unknown (first poll, saturated, unavailable, reset)."""
        current = readings.get(key)
        previous = self._previous.get(key)
        if current is None or previous is None or current.value is None or previous.value is None:
            return None
        if current.value < previous.value:
            return None  # reset (perfquery -x, driver reload): this interval is unknown
        return current.value - previous.value

    def _build(
        self,
        infos: list[PortInfo],
        readings: Mapping[tuple[str, str, str], _Reading],
        interval: float | None,
    ) -> list[Sample]:
        samples: list[Sample] = []
        rail_by_port = {(p.device, str(p.port)): p.rail_gpu for p in infos}
        for info in infos:
            port = str(info.port)
            labels = (("device", info.device), ("port", port), ("rail_gpu", info.rail_gpu))
            samples.append(
                Sample(metric="meshscope_network_port_active", value=float(info.state == "ACTIVE"), labels=labels)
            )
            if info.rate_bytes_per_second is not None:
                samples.append(
                    Sample(
                        metric="meshscope_network_link_rate_bytes_per_second",
                        value=info.rate_bytes_per_second,
                        labels=labels,
                    )
                )
            for counter, metric, factor in (
                ("port_xmit_data", "meshscope_network_transmit_bytes_per_second", _DATA_WORD_BYTES),
                ("port_rcv_data", "meshscope_network_receive_bytes_per_second", _DATA_WORD_BYTES),
                ("port_xmit_packets", "meshscope_network_transmit_packets_per_second", 1),
                ("port_rcv_packets", "meshscope_network_receive_packets_per_second", 1),
            ):
                delta = self._delta((info.device, port, counter), readings)
                if delta is not None and interval is not None and interval > 0:
                    samples.append(Sample(metric=metric, value=delta * factor / interval, labels=labels))
        # Running totals: every counter with a value now; an unknown interval adds nothing, and a counter without a
        # value now (saturated, N/A) is left out rather than shown flat.
        totals: dict[tuple[str, str, str], int] = {}
        for key, reading in sorted(readings.items()):
            if key[2] not in _TOTAL_METRICS:
                continue
            metric = _TOTAL_METRICS[key[2]]
            total = self._totals.get(key, 0) + (self._delta(key, readings) or 0)
            totals[key] = total
            if reading.value is None:
                continue
            device, port, counter = key
            rail = rail_by_port.get((device, port), "")
            base: tuple[tuple[str, str], ...] = (("device", device), ("port", port), ("rail_gpu", rail))
            own = base if metric.endswith("ticks_total") else (("counter", counter), *base)
            samples.append(Sample(metric=metric, value=float(total), labels=own))
        self._totals = totals
        return samples


_PORT_NAMES = frozenset((*_WIDTH_BITS, "port_rcv_discards"))
_HW_NAMES = frozenset((*_CONGESTION_COUNTERS, *_HW_ERROR_COUNTERS))


def _present(directory: Path, wanted: frozenset[str]) -> frozenset[str]:
    """The wanted names that ``directory`` holds (none when it is absent or unreadable)."""
    try:
        return wanted.intersection(os.listdir(directory))  # noqa: PTH208 - names only, no Path per entry
    except OSError:
        return frozenset()


_MAX_FILE_BYTES = 4096  # a sysfs attribute is at most one page


def _read_small(path: Path) -> str:
    """One sysfs attribute, read with one ``read`` (cheaper than ``Path.read_text``; these are read every second)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, _MAX_FILE_BYTES).decode(errors="replace")
    finally:
        os.close(fd)


def _pci_address(device: Path) -> str:
    """The PCI address the device's ``device`` link points at (``…/0000:0c:00.0``), or ``""``."""
    try:
        target = (device / "device").readlink()
    except OSError:
        return ""
    return target.name


def _port_dirs(device: Path) -> list[Path]:
    try:
        entries = [p for p in (device / "ports").iterdir() if p.name.isascii() and p.name.isdigit()]
    except OSError:
        return []
    return sorted(entries, key=lambda p: int(p.name))


__all__ = ["InfinibandSource", "PortInfo"]

"""The DCGM source: scrape a dcgm-exporter endpoint and turn its per-GPU fields into meshscope's GPU metrics.

Exists because dcgm-exporter is how most GPU clusters already publish GPU telemetry, and because the profiling
fields it carries (SM, tensor and DRAM activity) are what tell reported utilisation from useful compute. It reads
the Prometheus text exposition (format 0.0.4: prometheus/docs ``exposition_formats.md``) tolerantly — a junk line
is counted and skipped, not the whole scrape — keys every series on its DCGM field (old names and the DCGM 4.6
names alike), converts to base units, and keeps the GPU's identity (:class:`~meshscope_sidecar.sources.nvml.GpuDevice`)
so that the sidecar can join a local GPU index to a rank.

It must not hang or grow without bound on a bad exporter: one scrape has one deadline (every ``recv`` waits at most
the time left) and a size cap. It must not export a value it does not have: DCGM's blank sentinels, a MIG
instance's utilisation and a failed scrape give absent series, never 0. It never raises out of :meth:`poll`.

Formats and constants, from the sources at the commits of ``reference/telemetry.md`` §5:

- the series layout: dcgm-exporter ``internal/pkg/rendermetrics/render_metrics.go`` (labels ``gpu``, ``UUID`` or
  ``uuid``, ``pci_bus_id``, ``device``, ``modelName``, MIG ``GPU_I_PROFILE``/``GPU_I_ID``, ``hostname`` — spelled
  ``Hostname`` before PR #655 —, then ``pod``/``namespace``/``container`` on the series of GPUs given to a pod);
- field names and ids: DCGM ``dcgmlib/dcgm_fields.h`` (4.6.0, ``72fa3fea``), whose closing block keeps every old
  name as an alias of the new one with the same id;
- how values are written: dcgm-exporter ``internal/pkg/collector/gpu_collector.go`` ``toString`` (int64 fields with
  ``%d``, double fields with ``%f``) and ``utils.go`` (the blank sentinels it already drops; older builds print them).
"""

from __future__ import annotations

import logging
import math
import re
import socket
import time
import zlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from meshscope_sidecar.sources.base import Sample, SourceHealth
from meshscope_sidecar.sources.nvml import GpuDevice, normalize_pci_bus_id

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterable, Mapping

_log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------------------------
# The Prometheus text exposition, read tolerantly
# --------------------------------------------------------------------------------------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
# A value as Go's strconv.ParseFloat reads it in the text format: decimal or exponent notation, NaN, +Inf, -Inf
# (Go accepts any letter case and "Infinity"). Python's float() alone would also take "1_000" and " 1 ".
_VALUE = r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[Nn][Aa][Nn]|[Ii][Nn][Ff](?:[Ii][Nn][Ii][Tt][Yy])?)"
_SAMPLE_LINE = re.compile(rf"({_NAME})[ \t]*(?:\{{(.*)\}})?[ \t]*({_VALUE})(?:[ \t]+(-?\d+))?[ \t]*")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\[\\"n])*)"[ \t]*(,)?')
_ESCAPE = re.compile(r"\\([\\\"n])")
_TYPE_LINE = re.compile(rf"#[ \t]+TYPE[ \t]+({_NAME})[ \t]+(counter|gauge|histogram|summary|untyped)[ \t]*")
_UNESCAPED = {"\\": "\\", '"': '"', "n": "\n"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpositionSample:
    """One sample line of a scrape."""

    name: str
    """Metric name (the DCGM field name, for dcgm-exporter)."""
    labels: Mapping[str, str]
    """Label names to unescaped values, as written."""
    value: float
    """The value (``nan`` and ``inf`` as the text says)."""
    value_text: str
    """The value as written: dcgm-exporter writes int64 fields without a decimal point and doubles with one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Exposition:
    """A parsed scrape: the samples that could be read and a count of the lines that could not."""

    samples: tuple[ExpositionSample, ...]
    """Every readable sample line, in order."""
    types: Mapping[str, str]
    """``# TYPE`` per metric name (the last one wins; a field typed counter in one build and gauge in another is
    read the same way, by its name)."""
    junk_lines: int
    """Lines that are neither a sample, a comment nor blank, or whose labels do not parse."""
    first_junk: str | None
    """The first such line (cut to 120 characters), for ``last_error``."""


def _parse_labels(body: str) -> Mapping[str, str] | None:
    """The labels between the braces, read-only, or ``None`` when they do not parse (bad syntax, a label twice)."""
    labels: dict[str, str] = {}
    position, end = 0, len(body)
    while True:
        if not body[position:].strip(" \t"):
            return MappingProxyType(labels)
        match = _LABEL.match(body, position)
        if match is None:
            return None
        name, raw = match.group(1), match.group(2)
        if name in labels:
            return None
        labels[name] = _ESCAPE.sub(lambda m: _UNESCAPED[m.group(1)], raw) if "\\" in raw else raw
        position = match.end()
        if match.group(3) is None:
            return MappingProxyType(labels) if not body[position:end].strip(" \t") else None


_LABELS_SEEN: dict[str, Mapping[str, str] | None] = {}
"""Label blocks already read, by their text: dcgm-exporter writes one GPU's label block on every field of that GPU
and the same blocks on every scrape, and reading them was most of a scrape's parse (2.2 ms for 8 H100s)."""
_LABELS_SEEN_MAX = 4096
"""Blocks kept (emptied when full): a node's GPUs, MIG instances and entities, with room for label churn."""
_LABELS_SEEN_LONGEST = 2048
"""Longest block kept, characters (a real one is ~300): the cache stays under ~10 MiB whatever an exporter sends."""
_UNSEEN: Mapping[str, str] = MappingProxyType({})


def _labels_of(body: str) -> Mapping[str, str] | None:
    """:func:`_parse_labels` through :data:`_LABELS_SEEN`."""
    labels = _LABELS_SEEN.get(body, _UNSEEN)
    if labels is _UNSEEN:
        labels = _parse_labels(body)
        if len(body) <= _LABELS_SEEN_LONGEST:
            if len(_LABELS_SEEN) >= _LABELS_SEEN_MAX:
                _LABELS_SEEN.clear()
            _LABELS_SEEN[body] = labels
    return labels


def parse_exposition(text: str) -> Exposition:
    r"""Read a Prometheus text exposition; never raises.

    Comments (``# HELP`` with or without text, ``# TYPE``, anything else after ``#``) and blank lines are skipped;
    a line that is not a valid sample is counted in :attr:`Exposition.junk_lines` and skipped, so one bad line
    costs one line. Label values may hold ``\\``, ``\"`` and ``\n`` escapes, commas, braces and spaces.

    Args:
        text: the body of a scrape.

    Returns:
        The samples and the count of unreadable lines.
    """
    samples: list[ExpositionSample] = []
    types: dict[str, str] = {}
    junk = 0
    first_junk: str | None = None
    for raw_line in text.split("\n"):
        line = raw_line.strip(" \t\r")
        if not line:
            continue
        if line.startswith("#"):
            type_match = _TYPE_LINE.fullmatch(line)
            if type_match is not None:
                types[type_match.group(1)] = type_match.group(2)
            continue
        match = _SAMPLE_LINE.fullmatch(line)
        labels = None if match is None else _labels_of(match.group(2) or "")
        if match is None or labels is None:
            junk += 1
            if first_junk is None:
                first_junk = line[:120]
            continue
        value_text = match.group(3)
        samples.append(
            ExpositionSample(name=match.group(1), labels=labels, value=float(value_text), value_text=value_text)
        )
    return Exposition(samples=tuple(samples), types=types, junk_lines=junk, first_junk=first_junk)


# --------------------------------------------------------------------------------------------------------------------
# DCGM fields -> meshscope metrics
# --------------------------------------------------------------------------------------------------------------------

# Field ids (dcgm_fields.h 4.6.0), and every name a scrape may use for each: the 4.6 name and the old alias that
# the default counters CSV still exports. Keyed on the id, so that a renamed field is the same field.
FIELD_NAMES: dict[int, tuple[str, ...]] = {
    100: ("DCGM_FI_DEV_SM_CLOCK",),
    150: ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_GPU_TEMP_CELSIUS"),
    155: ("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_BOARD_POWER_WATTS"),
    203: ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_UTIL_RATIO"),
    230: ("DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_XID_ERROR"),
    250: ("DCGM_FI_DEV_FB_TOTAL",),
    251: ("DCGM_FI_DEV_FB_FREE",),
    252: ("DCGM_FI_DEV_FB_USED",),
    253: ("DCGM_FI_DEV_FB_RESERVED",),
    1001: ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO"),
    1002: ("DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_UTIL_RATIO"),
    1004: ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_TENSOR_UTIL_RATIO"),
    1005: ("DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_DRAM_UTIL_RATIO"),
    1009: ("DCGM_FI_PROF_PCIE_TX_BYTES",),
    1010: ("DCGM_FI_PROF_PCIE_RX_BYTES",),
    1011: ("DCGM_FI_PROF_NVLINK_TX_BYTES",),
    1012: ("DCGM_FI_PROF_NVLINK_RX_BYTES",),
}
"""DCGM field id -> the names it is exported under (dcgm_fields.h 4.6.0 and its legacy alias block)."""

_FIELD_BY_NAME: dict[str, int] = {name: fid for fid, names in FIELD_NAMES.items() for name in names}
"""Upper-case name -> field id: dcgm-exporter 1.x and the first 2.x releases exported the same fields in lower case
(``dcgm_fi_prof_gr_engine_active{..., pod_name="", pod_namespace=""}``, dcgm-exporter#272); the names compare without
case."""

_GPU_UTIL, _XID, _FB_TOTAL, _FB_FREE, _FB_USED, _FB_RESERVED = 203, 230, 250, 251, 252, 253
_MIB_BYTES = 1 << 20  # FB_* fields are in MiB (counters CSV: "Framebuffer memory used (in MiB)")

# Field id -> (metric, factor to base units). Sources of the units: the counters CSV help lines ("SM clock frequency
# (in MHz)", "Power draw (in W)", "GPU utilization (in %)", "The rate of data transmitted over the PCIe bus ... in
# bytes per second"); the PROF_*_ACTIVE / *_UTIL_RATIO fields are ratios 0-1 (dcgm_fields.h: "The ratio of cycles").
# PROF_PCIE/NVLINK_*_BYTES are rates in B/s as exported (dcgm-exporter#87); DCGM converts NVML GPM's MiB/s inside
# (dcgm_fields_internal.hpp), which is to be checked on real hardware.
_DIRECT: dict[int, tuple[str, float]] = {
    100: ("meshscope_gpu_sm_clock_hertz", 1e6),
    150: ("meshscope_gpu_temperature_celsius", 1.0),
    155: ("meshscope_gpu_power_watts", 1.0),
    1001: ("meshscope_gpu_engine_active_ratio", 1.0),
    1002: ("meshscope_gpu_sm_active_ratio", 1.0),
    1004: ("meshscope_gpu_tensor_active_ratio", 1.0),
    1005: ("meshscope_gpu_dram_active_ratio", 1.0),
    1009: ("meshscope_gpu_pcie_transmit_bytes_per_second", 1.0),
    1010: ("meshscope_gpu_pcie_receive_bytes_per_second", 1.0),
    1011: ("meshscope_gpu_nvlink_transmit_bytes_per_second", 1.0),
    1012: ("meshscope_gpu_nvlink_receive_bytes_per_second", 1.0),
    252: ("meshscope_gpu_memory_used_bytes", float(_MIB_BYTES)),
}

# DCGM's blank values (dcgm_structs.h "DCGM_BLANK_VALUES"): DCGM_INT32_BLANK = 0x7ffffff0 and
# DCGM_INT64_BLANK = 0x7ffffffffffffff0, each followed by NOT_FOUND, NOT_SUPPORTED and NOT_PERMISSIONED (+1..+3);
# DCGM_FP64_BLANK = 2**47 (+1.0..+3.0). The README's own example prints MEMORY_TEMP 9223372036854775794
# (INT64 NOT_SUPPORTED). Any value at or above the int64 blank (within float rounding: all of them read as 2**63)
# is missing; the int32 and fp64 blanks are missing when written exactly.
_INT64_BLANK_FLOAT = float(0x7FFFFFFFFFFFFFF0)
_INT32_BLANKS = frozenset(range(0x7FFFFFF0, 0x7FFFFFF4))
_FP64_BLANKS = frozenset(float(2**47 + k) for k in range(4))

# Series about an NVLink or NVSwitch entity (render_metrics.go's link and switch templates) are not per-GPU.
_ENTITY_LABELS = ("nvlink", "nvswitch", "cpu", "cpucore")


def is_blank(value: float, value_text: str) -> bool:
    """Whether ``value`` is one of DCGM's blank sentinels (no data, not found, not supported, not permitted)."""
    if math.isnan(value) or value >= _INT64_BLANK_FLOAT:
        return True
    if value in _FP64_BLANKS:
        return True
    return value_text.isdigit() and int(value_text) in _INT32_BLANKS


@dataclass(frozen=True, slots=True, kw_only=True)
class ScrapeStats:
    """What one scrape held, for tests and ``/healthz``."""

    series: int = 0
    """Sample lines read."""
    junk_lines: int = 0
    """Lines skipped as unreadable (also added to ``parse_errors_total``)."""
    bad_series: int = 0
    """Known fields with no usable ``gpu`` label (also added to ``parse_errors_total``)."""
    blank_values: int = 0
    """Values that were DCGM blank sentinels (treated as missing)."""
    other_node: int = 0
    """Series whose ``hostname`` names another node (skipped)."""
    other_gpus: int = 0
    """Series of GPUs not in this pod's set (skipped)."""
    unknown_fields: int = 0
    """Series of fields this source does not map (skipped, not an error)."""


@dataclass(slots=True)
class _GpuReadings:
    """Per (gpu, MIG instance), the fields of one scrape."""

    device: GpuDevice
    values: dict[int, float] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)


_EXPORTER_POD = "dcgm-exporter"
"""What the name of dcgm-exporter's pod holds (the GPU operator's ``nvidia-dcgm-exporter-<hash>``, the Helm chart's
``dcgm-exporter-<hash>``): a ``Hostname`` label holding it names the exporter's pod, not a node."""


def _hostname_matches(label: str, hostname: str) -> bool:
    """Host names compare without case, and a short name matches its FQDN (``node-3`` vs ``node-3.cluster``)."""
    a, b = label.lower(), hostname.lower()
    return a == b or a.split(".", 1)[0] == b.split(".", 1)[0]


# --------------------------------------------------------------------------------------------------------------------
# HTTP with one deadline
# --------------------------------------------------------------------------------------------------------------------

_MAX_HEAD_BYTES = 64 * 1024
_RECV_BYTES = 64 * 1024


class ScrapeError(Exception):
    """A scrape that gave no usable body (refused, timed out, too large, not 200, bad framing)."""


def _decode_chunked(body: bytes) -> bytes:
    """RFC 9112 §7.1 chunked transfer coding, from a complete body in memory."""
    out = bytearray()
    position = 0
    while True:
        line_end = body.find(b"\r\n", position)
        if line_end < 0:
            raise ScrapeError("chunked body ends inside a chunk header")
        size_text = body[position:line_end].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise ScrapeError(f"bad chunk size {size_text[:20]!r}") from None
        if size == 0:
            return bytes(out)
        start = line_end + 2
        if start + size > len(body):
            raise ScrapeError("chunked body ends inside a chunk")
        out += body[start : start + size]
        position = start + size + 2


def fetch(url: str, *, timeout_seconds: float, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> bytes:
    """GET ``url`` over plain HTTP and return the body, all of it within ``timeout_seconds``.

    A socket timeout alone bounds each ``recv``, so a server that trickles one byte a second would hold it for ever;
    here every ``recv`` waits at most the time left before one deadline, and the answer may not exceed
    ``max_bytes`` (plus its head). Asks for ``Connection: close`` and reads to the end, then frames the body by
    ``Transfer-Encoding: chunked`` or ``Content-Length``; ``Content-Encoding: gzip`` is undone within the same cap.

    Args:
        url: ``http://host:port/path``.
        timeout_seconds: the whole exchange's budget.
        max_bytes: largest body accepted.
        clock: monotonic seconds (tests may pass their own).

    Returns:
        The body.

    Raises:
        ScrapeError: refused, timed out, too large, not 200, or badly framed.
    """
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ScrapeError(f"only http://host:port/path URLs are read, got {url!r}")
    try:
        port = parts.port or 80
    except ValueError:
        raise ScrapeError(f"bad port in {url!r}") from None
    host = parts.hostname
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host_header = f"[{host}]" if ":" in host else host
    request = (
        f"GET {path} HTTP/1.1\r\nHost: {host_header}:{port}\r\nAccept: text/plain\r\n"
        "Accept-Encoding: identity\r\nConnection: close\r\nUser-Agent: meshscope-sidecar\r\n\r\n"
    ).encode("ascii", errors="replace")
    deadline = clock() + timeout_seconds
    limit = max_bytes + _MAX_HEAD_BYTES
    received = bytearray()
    try:
        with socket.create_connection((host, port), timeout=max(timeout_seconds, 1e-3)) as sock:
            sock.sendall(request)
            while True:
                remaining = deadline - clock()
                if remaining <= 0:
                    raise ScrapeError(f"no complete answer within {timeout_seconds:g} s")
                sock.settimeout(remaining)
                chunk = sock.recv(_RECV_BYTES)
                if not chunk:
                    break
                received += chunk
                if len(received) > limit:
                    raise ScrapeError(f"answer larger than {max_bytes} bytes")
    except TimeoutError:
        raise ScrapeError(f"no complete answer within {timeout_seconds:g} s") from None
    except (OSError, ValueError) as exc:  # ValueError: a host name IDNA cannot encode
        raise ScrapeError(f"cannot read {url}: {exc}") from None
    return _body(bytes(received), max_bytes=max_bytes)


def _head(received: bytes) -> tuple[dict[str, str], bytes]:
    """The headers (lower-case names) of a 200 answer and the raw body after them."""
    head_end = received.find(b"\r\n\r\n")
    if head_end < 0:
        raise ScrapeError("answer ends before its head does")
    head = received[:head_end].decode("latin-1").split("\r\n")
    status = head[0].split(" ", 2)
    if len(status) < 2 or not status[0].startswith("HTTP/"):
        raise ScrapeError(f"not an HTTP answer: {head[0][:60]!r}")
    if status[1] != "200":
        raise ScrapeError(f"HTTP {' '.join(status[1:])[:60]}")
    headers: dict[str, str] = {}
    for line in head[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return headers, received[head_end + 4 :]


def _body(received: bytes, *, max_bytes: int) -> bytes:
    """The body of a whole answer, framed (chunked or Content-Length) and inflated (gzip) within ``max_bytes``."""
    headers, body = _head(received)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = _decode_chunked(body)
    elif "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise ScrapeError(f"bad Content-Length {headers['content-length'][:20]!r}") from None
        if len(body) < length:
            raise ScrapeError(f"answer cut short: {len(body)} of {length} bytes")
        body = body[:length]
    if headers.get("content-encoding", "").lower() == "gzip":
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            body = inflater.decompress(body, max_bytes + 1)
        except zlib.error as exc:
            raise ScrapeError(f"bad gzip body: {exc}") from None
    if len(body) > max_bytes:
        raise ScrapeError(f"answer larger than {max_bytes} bytes")
    return body


# --------------------------------------------------------------------------------------------------------------------
# The source
# --------------------------------------------------------------------------------------------------------------------


class DcgmSource:
    """Scrapes dcgm-exporter once per :meth:`poll`; GPU gauges plus the XID change counter.

    Filters to this node (``hostname`` given: a series whose ``hostname``/``Hostname`` label names another host is
    skipped; one without the label is kept) and to this pod's GPUs (``gpus`` given: local indices and/or UUIDs).

    Memory: FB_TOTAL when exported; otherwise total = FB_USED + FB_FREE + FB_RESERVED, NVML's own identity for
    ``nvmlMemory_v2_t`` (total = reserved + free + used), which the default counters allow (they export FREE, USED
    and RESERVED, not TOTAL). Without RESERVED the sum would understate the size by the driver's reservation, so
    no total is given then.

    Utilisation: GPU_UTIL is a percentage (an int64 field in DCGM 4.6 under both names, written ``%d``); a value
    written with a decimal point comes from a double field, which DCGM's ``*_RATIO`` naming standard makes a ratio
    already. A GPU with MIG series has no GPU_UTIL (dcgm-exporter#216): no utilisation is exported for it or its
    instances, and :meth:`notes` says so.

    XID: DCGM_FI_DEV_XID_ERRORS holds the *last* XID code, not a count. ``meshscope_gpu_xid_errors_total`` counts
    the scrapes where that code changed to another non-zero code, starting from the first value seen (an XID from
    before the sidecar started is not counted). The same code raised twice between two scrapes counts once.
    """

    name = "dcgm"

    def __init__(
        self,
        *,
        url: str = "http://localhost:9400/metrics",
        timeout_seconds: float = 2.0,
        max_bytes: int = 4 * 1024 * 1024,
        hostname: str | None = None,
        gpus: Collection[int | str] | None = None,
        wall_clock: Callable[[], float] = time.time,
        one_host_is_this_node: bool = True,
    ) -> None:
        """Configure the scrape; nothing is read until :meth:`poll`.

        Args:
            url: the exporter's metrics URL (``http://`` only; dcgm-exporter listens on ``:9400`` by default).
            timeout_seconds: budget of one whole scrape, connect to last byte (default 2 s).
            max_bytes: largest scrape body accepted (default 4 MiB; an 8-GPU node's default counters are ~60 KB).
            hostname: this node's name (the downward API's ``spec.nodeName``); ``None`` keeps every host.
            gpus: this pod's GPUs as local indices (``int``) and/or UUIDs (``str``); ``None`` keeps every GPU.
            wall_clock: seconds since the epoch for ``last_success_unix_s``.
            one_host_is_this_node: a scrape whose series all name one host other than ``hostname`` is this node's
                exporter in a pod of its own (:meth:`_own_host`); ``False`` where ``hostname`` was given to filter by.

        Raises:
            ValueError: a timeout or size cap that is not positive.
        """
        if not timeout_seconds > 0 or max_bytes < 1:
            raise ValueError(
                f"DcgmSource needs timeout_seconds > 0 and max_bytes >= 1, got {timeout_seconds} and {max_bytes}"
            )
        self.health = SourceHealth()
        self.url = url
        self.timeout_seconds = timeout_seconds
        self.max_bytes = max_bytes
        self.hostname = hostname
        self._gpu_indices = frozenset(g for g in gpus if isinstance(g, int)) if gpus is not None else None
        self._gpu_uuids = frozenset(g.lower() for g in gpus if isinstance(g, str)) if gpus is not None else None
        self._wall_clock = wall_clock
        self._gauges: list[Sample] = []
        self._devices: tuple[GpuDevice, ...] = ()
        self._notes: tuple[str, ...] = ()
        self._host_note: str | None = None
        self.one_host_is_this_node = one_host_is_this_node
        self._last_xid: dict[tuple[int, str], float] = {}
        self._xid_total: dict[tuple[int, str], int] = {}
        self._logged: str | None = None
        self.last_stats = ScrapeStats()
        """What the last scrape held."""

    def devices(self) -> tuple[GpuDevice, ...]:
        """GPUs and MIG instances of the last successful scrape, by (index, instance)."""
        return self._devices

    def notes(self) -> tuple[str, ...]:
        """What the last scrape lacked and why (MIG without utilisation, memory total not derivable)."""
        return self._notes

    def samples(self) -> Iterable[Sample]:
        """Gauges of the last successful scrape (none after a failed one), and the XID counters."""
        counters = [
            Sample(
                metric="meshscope_gpu_xid_errors_total", value=float(total), gpu=gpu, labels=(("gpu_instance", inst),)
            )
            for (gpu, inst), total in sorted(self._xid_total.items())
        ]
        return (*self._gauges, *counters)

    def poll(self) -> None:
        """Scrape once; a failed scrape sets ``up`` false and clears the gauges (a stale gauge would lie)."""
        try:
            body = fetch(self.url, timeout_seconds=self.timeout_seconds, max_bytes=self.max_bytes)
        except ScrapeError as exc:
            self._fail(str(exc))
            return
        self.ingest(body.decode("utf-8", errors="replace"))

    def ingest(self, text: str) -> None:
        """Read one scrape's body (what :meth:`poll` does after the HTTP exchange; tests and benchmarks call it).

        Args:
            text: the exposition text.
        """
        exposition = parse_exposition(text)
        readings, stats = self._collect(exposition)
        gauges, devices, notes = self._convert(readings)
        self._count_xid(readings)
        self._gauges = gauges
        self._devices = devices
        self._notes = tuple(notes) if self._host_note is None else (self._host_note, *notes)
        self.last_stats = stats
        self.health.parse_errors_total += stats.junk_lines + stats.bad_series
        self.health.last_error = (
            f"{stats.junk_lines} unreadable line(s) skipped, first: {exposition.first_junk!r}"
            if exposition.first_junk is not None
            else None
        )
        if stats.other_node and not readings:
            hosts = sorted(
                {h for smp in exposition.samples if (h := smp.labels.get("hostname", smp.labels.get("Hostname")))}
            )
            self.health.last_error = (
                f"every series names another host ({', '.join(hosts[:3])}{', ...' if len(hosts) > 3 else ''}), "
                f"none this node {self.hostname!r}: the scrape reached another node's exporter (point "
                "MESHSCOPE_SIDECAR_DCGM_URL at this node's), or its hosts are named otherwise (set "
                "MESHSCOPE_SIDECAR_DCGM_HOSTNAME, '*' for every host)"
            )
        # An answer with no sample line and some junk (an HTML error page from a proxy) is not the exporter.
        self.health.up = bool(exposition.samples) or exposition.junk_lines == 0
        if self.health.up:
            self.health.last_success_unix_s = float(self._wall_clock())

    def close(self) -> None:
        """Nothing is held between scrapes; idempotent."""

    def _fail(self, reason: str) -> None:
        self.health.up = False
        self.health.last_error = reason
        self._gauges = []
        if reason != self._logged:
            _log.warning("dcgm source: %s (%s)", reason, self.url)
            self._logged = reason

    def _wanted(self, index: int, uuid: str) -> bool:
        if self._gpu_indices is None or self._gpu_uuids is None:
            return True
        return index in self._gpu_indices or uuid.lower() in self._gpu_uuids

    def _own_host(self, exposition: Exposition) -> str | None:
        """The ``Hostname`` label value that stands for this node in this scrape (``None``: no filter).

        dcgm-exporter's ``Hostname`` label is its own host name: the node's where the exporter runs in the host's
        network namespace, but its pod's name (``nvidia-dcgm-exporter-5e5b02``, ``dcgm-exporter-lcxpl``) where it
        runs in a pod of its own, as the GPU operator deploys it. A scrape whose series all name one such pod is the
        exporter the sidecar was pointed at: it is read as this node's, and a note says so. Before, every series was
        dropped as another node's and the sidecar reported no GPU, with nothing to say why. A single host that is
        not an exporter pod's name is another node (a Service that balanced the scrape to another node's exporter):
        still dropped, and :meth:`ingest` says why.
        """
        if self.hostname is None or not self.one_host_is_this_node:
            return self.hostname
        hosts = {
            h
            for sample in exposition.samples
            if (h := sample.labels.get("hostname", sample.labels.get("Hostname"))) is not None
        }
        if len(hosts) == 1:
            (host,) = hosts
            if not _hostname_matches(host, self.hostname) and _EXPORTER_POD in host.lower():
                return host
        return self.hostname

    def _collect(self, exposition: Exposition) -> tuple[dict[tuple[int, str], _GpuReadings], ScrapeStats]:
        readings: dict[tuple[int, str], _GpuReadings] = {}
        bad = blank = other_node = other_gpus = unknown = 0
        own = self._own_host(exposition)
        self._host_note = (
            None
            if own is None or own == self.hostname
            else (
                f"dcgm-exporter names its host {own!r}, not this node {self.hostname!r} (an exporter in a pod of its "
                f"own reports its pod's name): its series are read as this node's; set "
                f"MESHSCOPE_SIDECAR_DCGM_HOSTNAME={own} to say so, or '*' to keep every host"
            )
        )
        for sample in exposition.samples:
            field_id = _FIELD_BY_NAME.get(sample.name)
            if field_id is None:
                field_id = _FIELD_BY_NAME.get(sample.name.upper())
            labels = sample.labels
            if field_id is None or any(name in labels for name in _ENTITY_LABELS):
                unknown += 1
                continue
            host = labels.get("hostname", labels.get("Hostname"))
            if own is not None and host is not None and not _hostname_matches(host, own):
                other_node += 1
                continue
            gpu_text = labels.get("gpu", "")
            if not (gpu_text.isascii() and gpu_text.isdigit()):
                bad += 1
                continue
            index = int(gpu_text)
            uuid = labels.get("UUID", labels.get("uuid", ""))
            if not self._wanted(index, uuid):
                other_gpus += 1
                continue
            if is_blank(sample.value, sample.value_text):
                blank += 1
                continue
            instance = labels.get("GPU_I_ID", "")
            key = (index, instance)
            entry = readings.get(key)
            if entry is None:
                entry = readings[key] = _GpuReadings(device=_device(index, uuid, labels))
            elif not entry.device.pod and labels.get("pod"):
                # One metric mixes label sets: pod labels appear only on some series (dcgm-exporter#138).
                entry.device = _device(index, uuid or entry.device.uuid, labels)
            entry.values[field_id] = sample.value
            entry.texts[field_id] = sample.value_text
        stats = ScrapeStats(
            series=len(exposition.samples),
            junk_lines=exposition.junk_lines,
            bad_series=bad,
            blank_values=blank,
            other_node=other_node,
            other_gpus=other_gpus,
            unknown_fields=unknown,
        )
        return readings, stats

    @staticmethod
    def _convert(
        readings: Mapping[tuple[int, str], _GpuReadings],
    ) -> tuple[list[Sample], tuple[GpuDevice, ...], list[str]]:
        gauges: list[Sample] = []
        notes: list[str] = []
        mig_gpus = sorted({gpu for gpu, instance in readings if instance})
        notes.extend(
            f"GPU {gpu} is in MIG mode: DCGM has no GPU_UTIL for MIG (dcgm-exporter#216), so "
            "meshscope_gpu_utilization_ratio is absent for it"
            for gpu in mig_gpus
        )
        for (gpu, instance), entry in sorted(readings.items(), key=_by_gpu_and_instance):
            labels = (("gpu_instance", instance),)
            values = entry.values
            for field_id, (metric, factor) in _DIRECT.items():
                if field_id in values:
                    gauges.append(Sample(metric=metric, value=values[field_id] * factor, gpu=gpu, labels=labels))
            if _GPU_UTIL in values and gpu not in mig_gpus:
                text = entry.texts[_GPU_UTIL]
                # int64 percent written with %d; a double (*_RATIO naming standard) written with %f is a ratio.
                is_ratio = "." in text or "e" in text.lower()
                ratio = values[_GPU_UTIL] if is_ratio else values[_GPU_UTIL] / 100.0
                gauges.append(Sample(metric="meshscope_gpu_utilization_ratio", value=ratio, gpu=gpu, labels=labels))
            total_mib = _total_mib(values)
            if total_mib is not None:
                gauges.append(
                    Sample(
                        metric="meshscope_gpu_memory_total_bytes", value=total_mib * _MIB_BYTES, gpu=gpu, labels=labels
                    )
                )
            elif _FB_USED in values:
                where = f"GPU {gpu} instance {instance}" if instance else f"GPU {gpu}"
                notes.append(f"{where}: no memory total (neither FB_TOTAL nor FB_USED + FB_FREE + FB_RESERVED)")
        devices = tuple(entry.device for _, entry in sorted(readings.items(), key=_by_gpu_and_instance))
        return gauges, devices, notes

    def _count_xid(self, readings: Mapping[tuple[int, str], _GpuReadings]) -> None:
        for key, entry in readings.items():
            value = entry.values.get(_XID)
            if value is None:
                continue
            previous = self._last_xid.get(key)
            total = self._xid_total.setdefault(key, 0)
            if previous is not None and value not in {previous, 0.0}:
                self._xid_total[key] = total + 1
            self._last_xid[key] = value


def _by_gpu_and_instance(item: tuple[tuple[int, str], _GpuReadings]) -> tuple[int, int]:
    """GPU index, then MIG instance as a number (a whole GPU first)."""
    (gpu, instance), _ = item
    return gpu, int(instance) if instance.isascii() and instance.isdigit() else -1


def _total_mib(values: Mapping[int, float]) -> float | None:
    if _FB_TOTAL in values:
        return values[_FB_TOTAL]
    if _FB_USED in values and _FB_FREE in values and _FB_RESERVED in values:
        return values[_FB_USED] + values[_FB_FREE] + values[_FB_RESERVED]
    return None


def _device(index: int, uuid: str, labels: Mapping[str, str]) -> GpuDevice:
    instance = labels.get("GPU_I_ID", "")
    return GpuDevice(
        index=index,
        uuid=uuid,
        pci_bus_id=normalize_pci_bus_id(labels.get("pci_bus_id", "")),
        model=labels.get("modelName", labels.get("model_name", "")),
        mig_instance=int(instance) if instance.isascii() and instance.isdigit() else None,
        mig_profile=labels.get("GPU_I_PROFILE", ""),
        pod=labels.get("pod", labels.get("pod_name", "")),
        namespace=labels.get("namespace", labels.get("pod_namespace", "")),
    )


__all__ = [
    "FIELD_NAMES",
    "DcgmSource",
    "Exposition",
    "ExpositionSample",
    "ScrapeError",
    "ScrapeStats",
    "fetch",
    "is_blank",
    "parse_exposition",
]

"""The sidecar's settings: one dataclass, built once from the environment and the command line in ``__main__``.

Exists so that every knob has one name, one unit, one default and one place that checks it
(:func:`settings_from`), and is passed down explicitly (STYLE.md §4). Every setting has an environment variable
(what a pod spec sets) and most have a flag (what a person types); the flag wins. A bad value is a
:class:`SettingsError` naming the variable or flag, the value and what would fit; the entry point prints it on one
line and exits non-zero. The identity variables are read here too, raw, and checked by
:func:`~meshscope_sidecar.identity.resolve_identity`.

It must not open sockets or files (the identity's placement file is read by :mod:`~meshscope_sidecar.identity`).
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, NoReturn
from urllib.parse import urlsplit

from meshscope.sdk import AddressError, parse_address
from meshscope_sidecar.identity import IdentityError, IdentityInputs

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

MiB = 1024 * 1024

ENV_HOST = "MESHSCOPE_SIDECAR_HOST"
ENV_PORT = "MESHSCOPE_SIDECAR_PORT"
ENV_SOCKETS = "MESHSCOPE_SIDECAR_SOCKETS"
ENV_TRAIN_POLL = "MESHSCOPE_SIDECAR_TRAIN_POLL_SECONDS"
ENV_STEPS_KEPT = "MESHSCOPE_SIDECAR_STEPS_KEPT"
ENV_STEPS_BYTES = "MESHSCOPE_SIDECAR_STEPS_BYTES"
ENV_RESPONSE_BYTES = "MESHSCOPE_SIDECAR_STEPS_RESPONSE_BYTES"
ENV_REQUIRE_RANKS = "MESHSCOPE_SIDECAR_REQUIRE_RANKS"
ENV_LOG_LEVEL = "MESHSCOPE_SIDECAR_LOG_LEVEL"
ENV_DCGM_URL = "MESHSCOPE_SIDECAR_DCGM_URL"
ENV_DCGM_TIMEOUT = "MESHSCOPE_SIDECAR_DCGM_TIMEOUT_SECONDS"
ENV_DCGM_HOSTNAME = "MESHSCOPE_SIDECAR_DCGM_HOSTNAME"
ENV_DCGM_POLL = "MESHSCOPE_SIDECAR_DCGM_POLL_SECONDS"
ENV_NVML = "MESHSCOPE_SIDECAR_NVML"
ENV_NVML_POLL = "MESHSCOPE_SIDECAR_NVML_POLL_SECONDS"
ENV_NCCL_LOGS = "MESHSCOPE_SIDECAR_NCCL_LOGS"
ENV_NCCL_INSPECTOR = "MESHSCOPE_SIDECAR_NCCL_INSPECTOR"
ENV_NCCL_POLL = "MESHSCOPE_SIDECAR_NCCL_POLL_SECONDS"
ENV_INFINIBAND = "MESHSCOPE_SIDECAR_INFINIBAND"
ENV_INFINIBAND_ROOT = "MESHSCOPE_SIDECAR_INFINIBAND_ROOT"
ENV_INFINIBAND_RAILS = "MESHSCOPE_SIDECAR_INFINIBAND_RAILS"
ENV_INFINIBAND_POLL = "MESHSCOPE_SIDECAR_INFINIBAND_POLL_SECONDS"

DEFAULT_PORT = 9402
"""Next to dcgm-exporter's 9400 (prometheus/prometheus wiki, "Default port allocations")."""
DEFAULT_SOCKET = "unix:/run/meshscope/records.sock"
"""In an ``emptyDir`` mounted at ``/run/meshscope`` in the training container and the sidecar (sidecar/README.md)."""


DEFAULT_INFINIBAND_ROOT = "/sys/class/infiniband"
"""Where the kernel lists RDMA devices (``Documentation/ABI/stable/sysfs-class-infiniband``)."""
ALL_HOSTS = "*"
"""``MESHSCOPE_SIDECAR_DCGM_HOSTNAME`` value that keeps the series of every host."""


class SettingsError(ValueError):
    """A setting that does not fit: names the variable or flag, its value and what would fit."""


class Switch(StrEnum):
    """A source that can be forced on, off, or left to what the node has."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


@dataclass(frozen=True, slots=True, kw_only=True)
class SidecarSettings:
    """Everything the sidecar is told. Build it with :func:`settings_from`."""

    host: str = "0.0.0.0"  # noqa: S104 - Prometheus scrapes the pod's IP
    """Address the HTTP server listens on (``MESHSCOPE_SIDECAR_HOST``, ``--host``); default all interfaces."""
    port: int = DEFAULT_PORT
    """TCP port of ``/metrics``, ``/v1/steps`` and ``/healthz`` (``MESHSCOPE_SIDECAR_PORT``, ``--port``); 0 picks a
    free port (tests)."""
    sockets: tuple[str, ...] = (DEFAULT_SOCKET,)
    """Where the training ranks send their records (``MESHSCOPE_SIDECAR_SOCKETS``, comma-separated; ``--socket``,
    repeated): ``unix:/path`` or ``unix:@abstract-name``, as the ranks' ``MESHSCOPE_COLLECTOR``. One per local rank
    keeps one rank's burst from filling another's queue."""
    train_poll_s: float = 1.0
    """Seconds between two polls of the training-loop source (``MESHSCOPE_SIDECAR_TRAIN_POLL_SECONDS``); records are
    read as they arrive whatever this is, the poll breaks them down."""
    steps_kept: int = 64
    """Steps kept for ``/v1/steps`` (``MESHSCOPE_SIDECAR_STEPS_KEPT``), the newest ones."""
    steps_bytes: int = 32 * MiB
    """Bytes of record lines kept for ``/v1/steps``, at most (``MESHSCOPE_SIDECAR_STEPS_BYTES``)."""
    response_bytes: int = 8 * MiB
    """Bytes of one ``/v1/steps`` response, at most (``MESHSCOPE_SIDECAR_STEPS_RESPONSE_BYTES``)."""
    require_ranks: bool = False
    """Refuse to start in degraded mode (``MESHSCOPE_SIDECAR_REQUIRE_RANKS=1``, ``--require-ranks``); default: start
    degraded and say what cannot be tagged."""
    log_level: str = "info"
    """``debug``, ``info``, ``warning`` or ``error`` (``MESHSCOPE_SIDECAR_LOG_LEVEL``, ``--log-level``)."""
    identity: IdentityInputs = field(default_factory=IdentityInputs)
    """The raw identity variables (:mod:`~meshscope_sidecar.identity`)."""
    dcgm_url: str | None = None
    """dcgm-exporter's metrics URL (``MESHSCOPE_SIDECAR_DCGM_URL``, ``--dcgm-url``), ``http://`` only, e.g.
    ``http://$(NODE_IP):9400/metrics``; default ``None``: no DCGM source. An exporter that does not answer is the
    source being down (``meshscope_source_up{source="dcgm"} 0``), not a failure to start."""
    dcgm_timeout_s: float = 2.0
    """Seconds one whole scrape of dcgm-exporter may take, connect to last byte
    (``MESHSCOPE_SIDECAR_DCGM_TIMEOUT_SECONDS``); default 2. A hung exporter costs at most this per poll."""
    dcgm_hostname: str | None = None
    """Keep only dcgm-exporter series whose ``hostname``/``Hostname`` label is this (series without the label are
    kept) (``MESHSCOPE_SIDECAR_DCGM_HOSTNAME``); default ``None``: the node name (``MESHSCOPE_NODE_NAME``), which
    dcgm-exporter on Kubernetes reports; ``*``: every host."""
    dcgm_poll_s: float = 10.0
    """Seconds between two scrapes of dcgm-exporter (``MESHSCOPE_SIDECAR_DCGM_POLL_SECONDS``); default 10
    (dcgm-exporter itself collects every 30 s by default)."""
    nvml: Switch = Switch.AUTO
    """NVML through ``pynvml`` (``MESHSCOPE_SIDECAR_NVML``): ``auto`` (default) runs it when ``pynvml`` is
    installed, ``on`` always (``up`` 0 and the reason when the library or driver is absent), ``off`` never. No GPU
    or no driver is a normal state (``up`` 0, says why)."""
    nvml_poll_s: float = 10.0
    """Seconds between two NVML readings (``MESHSCOPE_SIDECAR_NVML_POLL_SECONDS``); default 10."""
    nccl_logs: tuple[str, ...] = ()
    """NCCL debug logs to follow (``MESHSCOPE_SIDECAR_NCCL_LOGS``, comma-separated; ``--nccl-logs``, repeated):
    directories (every file in them), globs, files, or the ``NCCL_DEBUG_FILE`` value itself (``%h`` and ``%p``
    read as ``*``: ``/var/log/nccl/nccl.%h.%p`` follows ``/var/log/nccl/nccl.*.*``). Default none: no NCCL source.
    Files that do not exist yet are a normal state (``up`` 0 until the first one appears)."""
    nccl_inspector: tuple[str, ...] = ()
    """NCCL Inspector output to follow too (``MESHSCOPE_SIDECAR_NCCL_INSPECTOR``, comma-separated, the same forms;
    NCCL's ``NCCL_INSPECTOR_DUMP_DIR``); default none."""
    nccl_poll_s: float = 5.0
    """Seconds between two reads of the NCCL logs (``MESHSCOPE_SIDECAR_NCCL_POLL_SECONDS``); default 5."""
    infiniband: Switch = Switch.AUTO
    """The InfiniBand / RoCE counters (``MESHSCOPE_SIDECAR_INFINIBAND``): ``auto`` (default) reads them when the
    root directory exists at startup (a node without RDMA drivers has none), ``on`` always (a missing root reports
    ``up`` 0 and why), ``off`` never."""
    infiniband_root: str = DEFAULT_INFINIBAND_ROOT
    """The ``infiniband`` class directory (``MESHSCOPE_SIDECAR_INFINIBAND_ROOT``); default
    ``/sys/class/infiniband``."""
    infiniband_rails: dict[tuple[str, int], int] | None = None
    """Which local GPU each port's rail serves (``MESHSCOPE_SIDECAR_INFINIBAND_RAILS``, ``device:port=gpu``
    comma-separated, e.g. ``mlx5_0:1=0,mlx5_1:1=1``); default ``None``: the PCI-order rule of
    :class:`~meshscope_sidecar.sources.infiniband.InfinibandSource` (one ACTIVE port per local GPU, in PCI order)."""
    infiniband_poll_s: float = 10.0
    """Seconds between two reads of the counters (``MESHSCOPE_SIDECAR_INFINIBAND_POLL_SECONDS``); default 10."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise SettingsError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="meshscope-sidecar",
        description="Tag every training-loop, GPU, NCCL and network sample with its rank coordinates; serve "
        "/metrics, /v1/steps and /healthz. Identity comes from MESHSCOPE_* variables (sidecar/README.md).",
    )
    p.add_argument("--host", help=f"listen address (env {ENV_HOST}; default 0.0.0.0)")
    p.add_argument("--port", help=f"listen port (env {ENV_PORT}; default {DEFAULT_PORT})")
    p.add_argument(
        "--socket", action="append", help=f"record socket, repeatable (env {ENV_SOCKETS}; default {DEFAULT_SOCKET})"
    )
    p.add_argument("--require-ranks", action="store_true", default=None, help="refuse to start degraded")
    p.add_argument("--log-level", help=f"debug, info, warning or error (env {ENV_LOG_LEVEL}; default info)")
    p.add_argument("--dcgm-url", help=f"dcgm-exporter metrics URL, http:// (env {ENV_DCGM_URL}; default: none)")
    p.add_argument(
        "--nccl-logs",
        action="append",
        help=f"NCCL debug log directory, glob, file or NCCL_DEBUG_FILE value, repeatable (env {ENV_NCCL_LOGS})",
    )
    return p


def _int(name: str, value: str, *, minimum: int, maximum: int | None = None) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        number = minimum - 1
    if number < minimum or (maximum is not None and number > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise SettingsError(f"{name}={value!r} is not a whole number >= {minimum}{upper}")
    return number


def _seconds(name: str, value: str) -> float:
    try:
        number = float(value.strip())
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and 0.01 <= number <= 3600):
        raise SettingsError(f"{name}={value!r} is not a number of seconds in [0.01, 3600]")
    return number


def _bool(name: str, value: str) -> bool:
    text = value.strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off", ""}:
        return False
    raise SettingsError(f"{name}={value!r} is not a boolean; expected 1 or 0 (true/false, yes/no)")


def _switch(name: str, value: str) -> Switch:
    try:
        return Switch(value.strip().lower())
    except ValueError:
        raise SettingsError(f"{name}={value!r} is not one of auto, on, off") from None


def _url(name: str, value: str) -> str:
    url = value.strip()
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise SettingsError(f"{name}={value!r} is not an http:// URL; expected e.g. http://localhost:9400/metrics")
    try:
        _ = parts.port
    except ValueError:
        raise SettingsError(f"{name}={value!r} has a port that is not a number in [0, 65535]") from None
    return url


def _paths(name: str, values: list[str] | None, env: str | None) -> tuple[str, ...]:
    """Paths, globs or ``NCCL_DEBUG_FILE`` values; ``%h`` (host) and ``%p`` (pid) become ``*`` (NCCL ``debug.cc``)."""
    raw = values or ([] if env is None else env.split(","))
    out: list[str] = []
    for item in (x.strip() for x in raw):
        if not item:
            continue
        if "\0" in item:
            raise SettingsError(f"{name}: {item!r} is not a path")
        out.append(item.replace("%h", "*").replace("%p", "*"))
    return tuple(dict.fromkeys(out))


_RAIL = re.compile(r"([A-Za-z][A-Za-z0-9_.-]{0,31}):([1-9][0-9]{0,2})=([0-9]{1,3})")


def _rails(name: str, value: str) -> dict[tuple[str, int], int]:
    rails: dict[tuple[str, int], int] = {}
    for item in (x.strip() for x in value.split(",")):
        if not item:
            continue
        m = _RAIL.fullmatch(item)
        if m is None:
            raise SettingsError(f"{name}: {item!r} is not device:port=gpu; expected e.g. mlx5_0:1=0,mlx5_1:1=1")
        key = (m.group(1), int(m.group(2)))
        if key in rails:
            raise SettingsError(f"{name}: port {key[0]}:{key[1]} is given twice")
        rails[key] = int(m.group(3))
    return rails


def _sockets(flags: list[str] | None, env: str | None) -> tuple[str, ...]:
    sockets = SidecarSettings().sockets
    if flags:
        sockets = tuple(flags)
    elif env is not None:
        sockets = tuple(s.strip() for s in env.split(",") if s.strip())
    if not sockets:
        raise SettingsError(f"{ENV_SOCKETS} names no socket; expected e.g. {DEFAULT_SOCKET}")
    for s in sockets:
        try:
            parse_address(s)
        except AddressError as exc:
            raise SettingsError(f"{'--socket' if flags else ENV_SOCKETS}: {exc}") from None
    return sockets


def settings_from(argv: Sequence[str], environ: Mapping[str, str]) -> SidecarSettings:
    """The settings from the command line (``argv`` without the program name) and the environment.

    Raises:
        SettingsError: for an unknown flag or a value that does not fit, naming it.
    """
    args = _parser().parse_args(list(argv))

    def pick(flag: object, env: str) -> str | None:
        if flag is not None:
            return str(flag)
        value = environ.get(env)
        return value if value is not None and value.strip() else None

    d = SidecarSettings()
    host = pick(args.host, ENV_HOST) or d.host
    port = d.port
    if (raw_port := pick(args.port, ENV_PORT)) is not None:
        port = _int("--port" if args.port is not None else ENV_PORT, raw_port, minimum=0, maximum=65535)
    sockets = _sockets(args.socket, pick(None, ENV_SOCKETS))
    level = (pick(args.log_level, ENV_LOG_LEVEL) or d.log_level).lower()
    if level not in {"debug", "info", "warning", "error"}:
        raise SettingsError(f"log level {level!r} is not one of debug, info, warning, error")
    require: bool = d.require_ranks
    if args.require_ranks:
        require = True
    elif (raw_require := pick(None, ENV_REQUIRE_RANKS)) is not None:
        require = _bool(ENV_REQUIRE_RANKS, raw_require)
    try:
        identity = IdentityInputs.from_env(environ)
    except IdentityError as exc:
        raise SettingsError(str(exc)) from None

    def seconds(env: str, default: float) -> float:
        raw = pick(None, env)
        return _seconds(env, raw) if raw is not None else default

    dcgm_flag = args.dcgm_url is not None
    raw_url = pick(args.dcgm_url, ENV_DCGM_URL)
    raw_rails = pick(None, ENV_INFINIBAND_RAILS)
    return SidecarSettings(
        host=host,
        port=port,
        sockets=sockets,
        train_poll_s=_seconds(ENV_TRAIN_POLL, v) if (v := pick(None, ENV_TRAIN_POLL)) else d.train_poll_s,
        steps_kept=_int(ENV_STEPS_KEPT, v, minimum=1) if (v := pick(None, ENV_STEPS_KEPT)) else d.steps_kept,
        steps_bytes=_int(ENV_STEPS_BYTES, v, minimum=MiB) if (v := pick(None, ENV_STEPS_BYTES)) else d.steps_bytes,
        response_bytes=(
            _int(ENV_RESPONSE_BYTES, v, minimum=64 * 1024)
            if (v := pick(None, ENV_RESPONSE_BYTES))
            else d.response_bytes
        ),
        require_ranks=require,
        log_level=level,
        identity=identity,
        dcgm_url=_url("--dcgm-url" if dcgm_flag else ENV_DCGM_URL, raw_url) if raw_url is not None else None,
        dcgm_timeout_s=seconds(ENV_DCGM_TIMEOUT, d.dcgm_timeout_s),
        dcgm_hostname=pick(None, ENV_DCGM_HOSTNAME),
        dcgm_poll_s=seconds(ENV_DCGM_POLL, d.dcgm_poll_s),
        nvml=_switch(ENV_NVML, v) if (v := pick(None, ENV_NVML)) else d.nvml,
        nvml_poll_s=seconds(ENV_NVML_POLL, d.nvml_poll_s),
        nccl_logs=_paths("--nccl-logs" if args.nccl_logs else ENV_NCCL_LOGS, args.nccl_logs, pick(None, ENV_NCCL_LOGS)),
        nccl_inspector=_paths(ENV_NCCL_INSPECTOR, None, pick(None, ENV_NCCL_INSPECTOR)),
        nccl_poll_s=seconds(ENV_NCCL_POLL, d.nccl_poll_s),
        infiniband=_switch(ENV_INFINIBAND, v) if (v := pick(None, ENV_INFINIBAND)) else d.infiniband,
        infiniband_root=pick(None, ENV_INFINIBAND_ROOT) or d.infiniband_root,
        infiniband_rails=_rails(ENV_INFINIBAND_RAILS, raw_rails) if raw_rails is not None else None,
        infiniband_poll_s=seconds(ENV_INFINIBAND_POLL, d.infiniband_poll_s),
    )

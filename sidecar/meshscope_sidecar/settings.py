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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

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

DEFAULT_PORT = 9402
"""Next to dcgm-exporter's 9400 (prometheus/prometheus wiki, "Default port allocations")."""
DEFAULT_SOCKET = "unix:/run/meshscope/records.sock"
"""In an ``emptyDir`` mounted at ``/run/meshscope`` in the training container and the sidecar (sidecar/README.md)."""


class SettingsError(ValueError):
    """A setting that does not fit: names the variable or flag, its value and what would fit."""


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
    )

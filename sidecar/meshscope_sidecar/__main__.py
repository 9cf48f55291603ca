"""The ``meshscope-sidecar`` entry point: settings and identity once, the sources, the pollers and the server.

Exists to wire the parts together in one place (STYLE.md §4: one settings object, built here, passed down) and to
turn every startup problem into one line on stderr and a non-zero exit (2: bad settings or identity; 1: the port
cannot be bound), never a traceback. It must not hold logic of its own beyond choosing which sources run.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import socket
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from meshscope.topology import AXES
from meshscope_sidecar.collector import PollState, SidecarCollector, make_registry
from meshscope_sidecar.identity import IdentityError, IdentityMode, resolve_identity
from meshscope_sidecar.server import Poller, SidecarServer, serve_until
from meshscope_sidecar.settings import ALL_HOSTS, ENV_REQUIRE_RANKS, SettingsError, Switch, settings_from
from meshscope_sidecar.sources.dcgm import DcgmSource
from meshscope_sidecar.sources.infiniband import InfinibandSource
from meshscope_sidecar.sources.nccl_log import NcclLogSource
from meshscope_sidecar.sources.nvml import NvmlSource
from meshscope_sidecar.sources.train_events import TrainEventsSource

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from meshscope_sidecar.identity import Identity
    from meshscope_sidecar.settings import SidecarSettings
    from meshscope_sidecar.sources.base import Source

log = logging.getLogger("meshscope_sidecar")

EXIT_BAD_SETTINGS = 2
"""Exit status for settings or identity that do not fit (the message names the variable)."""
EXIT_CANNOT_SERVE = 1
"""Exit status when the HTTP port cannot be bound."""


def version() -> str:
    """The installed distribution's version (``meshscope_sidecar_info{version}``)."""
    try:
        return metadata.version("meshscope")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def build_sources(settings: SidecarSettings, identity: Identity) -> list[tuple[Source, float]]:
    """The sources that run, each with its poll period in seconds, in export order.

    The training-loop source always runs. DCGM runs when a URL is set, NCCL when log paths are set, NVML and
    InfiniBand unless switched off (``auto``: when ``pynvml`` is installed / the sysfs root exists). An input that
    is absent once running (no exporter answering, no log file yet, no GPU) is the source's state, never a reason
    not to start. Every source gets the identity's view of this pod: DCGM its node name and GPUs, NCCL the layout,
    the job's placement and the ``(host, pid) -> rank`` map of the ranks' hello messages, InfiniBand its GPU count.
    """
    train = TrainEventsSource(
        addresses=settings.sockets,
        job=identity.job,
        ranks=identity.ranks,
        max_steps_kept=settings.steps_kept,
        max_bytes_kept=settings.steps_bytes,
        axes=[a.value for a in AXES if identity.layout.degree(a) > 1] if identity.layout is not None else (),
    )
    sources: list[tuple[Source, float]] = [(train, settings.train_poll_s)]
    local_gpus = [g.gpu for g in identity.gpus] if identity.mode is IdentityMode.FULL else None
    if settings.dcgm_url is not None:
        hostname = settings.dcgm_hostname or identity.node
        dcgm = DcgmSource(
            url=settings.dcgm_url,
            timeout_seconds=settings.dcgm_timeout_s,
            hostname=None if hostname == ALL_HOSTS else hostname,
            gpus=local_gpus,
            one_host_is_this_node=settings.dcgm_hostname is None,
        )
        sources.append((dcgm, settings.dcgm_poll_s))
    if settings.nvml is Switch.ON or (settings.nvml is Switch.AUTO and importlib.util.find_spec("pynvml")):
        sources.append((NvmlSource(), settings.nvml_poll_s))
    if settings.nccl_logs:
        # The training containers of a pod share its UTS namespace, hence the host name NCCL prints in its prefix.
        host = socket.gethostname()
        nccl = NcclLogSource(
            list(settings.nccl_logs),
            layout=identity.layout,
            placement=identity.placement,
            inspector_paths=list(settings.nccl_inspector) or None,
            ranks_from=lambda: {(host, pid): rank for pid, rank in train.process_ranks().items()},
        )
        sources.append((nccl, settings.nccl_poll_s))
    if settings.infiniband is Switch.ON or (
        settings.infiniband is Switch.AUTO and Path(settings.infiniband_root).is_dir()
    ):
        ib = InfinibandSource(
            root=settings.infiniband_root,
            rails=settings.infiniband_rails,
            gpu_count=len(local_gpus) if local_gpus else None,
        )
        sources.append((ib, settings.infiniband_poll_s))
    return sources


def _identity(settings: SidecarSettings) -> Identity:
    identity = resolve_identity(settings.identity)
    if settings.require_ranks and identity.mode is IdentityMode.DEGRADED:
        raise SettingsError(f"{ENV_REQUIRE_RANKS} is set but ranks are unknown: {'; '.join(identity.missing)}")
    return identity


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run the sidecar until SIGTERM or SIGINT; returns the exit status.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        environ: the environment (default ``os.environ``).
    """
    try:
        settings = settings_from(sys.argv[1:] if argv is None else argv, os.environ if environ is None else environ)
        identity = _identity(settings)
    except (SettingsError, IdentityError) as exc:
        sys.stderr.write(f"meshscope-sidecar: error: {exc}\n")
        return EXIT_BAD_SETTINGS
    logging.basicConfig(level=settings.log_level.upper(), format="meshscope-sidecar: %(levelname)s: %(message)s")
    log.info("%s", identity.describe())
    if identity.mode is IdentityMode.DEGRADED:
        log.warning("degraded: per-rank series are not exported (%s)", "; ".join(identity.missing))
    sources = build_sources(settings, identity)
    log.info("sources: %s", ", ".join(f"{s.name} every {period:g} s" for s, period in sources))
    polls = {s.name: PollState(period_s=period) for s, period in sources}
    collector = SidecarCollector([s for s, _ in sources], identity, version=version(), polls=polls)
    train = next((s for s, _ in sources if isinstance(s, TrainEventsSource)), None)
    server = SidecarServer(
        collector=collector,
        registry=make_registry(collector),
        train=train,
        steps_limit=settings.steps_kept,
        response_bytes=settings.response_bytes,
    )
    pollers = [Poller(s, polls[s.name]) for s, _ in sources]
    for p in pollers:
        p.start()
    try:
        asyncio.run(_serve(server, settings))
    except OSError as exc:
        sys.stderr.write(f"meshscope-sidecar: error: cannot serve on {settings.host}:{settings.port}: {exc}\n")
        return EXIT_CANNOT_SERVE
    finally:
        for p in pollers:
            if not p.stop():
                log.warning("source %s is still in a poll; leaving it", p.source.name)
        if train is not None:
            train.flush()
        for s, _ in sources:
            s.close()
    return 0


async def _serve(server: SidecarServer, settings: SidecarSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(ValueError, RuntimeError):  # not the main thread (tests): stop from outside
            loop.add_signal_handler(sig, stop.set)
    await serve_until(server, settings.host, settings.port, stop)


if __name__ == "__main__":
    sys.exit(main())

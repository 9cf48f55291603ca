"""The sidecar's HTTP server and its background polling: ``/metrics``, ``/v1/steps``, ``/healthz``.

Exists to serve what the sources hold without letting any one of them stall the rest: every source is polled by its
own daemon thread on its own period (:class:`Poller`), so a slow or hung input delays only itself (the collector
reports it down once its poll runs past ten periods), and a scrape reads only the sources' current samples. The
endpoints (aiohttp):

- ``GET /metrics``: the explicit registry (:func:`prometheus_client.generate_latest`), built in a worker thread;
- ``GET /v1/steps?since_step=N&limit=M&max_bytes=B``: the recent step records of this pod's ranks as JSON lines
  (``application/x-ndjson``), oldest step first, steps after ``N`` (default: every kept step), at most ``M`` steps
  and ``B`` (or the configured) bytes (whole records; a client pages on by passing the last step it got as
  ``since_step``); to a client that accepts ``application/vnd.meshscope.columns``, the same records as packed
  columns (:mod:`meshscope.records.packing`: decoded here, on every node, so that the operator only copies them);
- ``GET /healthz``: 200 with the identity, its mode and every source's state, as JSON (liveness: the sidecar
  answers; a source being down is reported, not fatal).

It must not parse any input format itself (the core packs records) and must not block the event loop on a source.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from meshscope.errors import ParseError
from meshscope.records import CUT_HEADER, PACKED_MEDIA_TYPE, pack_lines

if TYPE_CHECKING:
    from collections.abc import Callable

    from prometheus_client import CollectorRegistry

    from meshscope_sidecar.collector import PollState, SidecarCollector
    from meshscope_sidecar.sources.base import Source
    from meshscope_sidecar.sources.train_events import TrainEventsSource

log = logging.getLogger("meshscope_sidecar")

MAX_QUERY_INT = 1 << 62
"""Largest ``since_step`` / ``limit`` accepted (step numbers are 64-bit)."""


class Poller:
    """Polls one source on its own daemon thread, every ``state.period_s`` seconds, timing each poll."""

    def __init__(self, source: Source, state: PollState) -> None:
        """Poll ``source``; ``state`` is updated after every poll (and read by the collector)."""
        self.source = source
        self.state = state
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"meshscope-poll-{source.name}", daemon=True)

    def start(self) -> None:
        """Start polling."""
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.state.started_monotonic_s = time.monotonic()
            cpu0 = time.thread_time()
            try:
                self.source.poll()
            except Exception as exc:  # noqa: BLE001 - a source must never raise; one that does is down, not fatal
                self.source.health.up = False
                self.source.health.last_error = f"poll raised {type(exc).__name__}: {exc}"
                log.warning("source %s: poll raised %r", self.source.name, exc)
            # CPU of the polling thread: the sidecar's own overhead, not the time an input took to answer.
            self.state.seconds_total += time.thread_time() - cpu0
            self.state.polls_total += 1
            self.state.started_monotonic_s = None
            self._stop.wait(self.state.period_s)

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Ask the thread to stop and wait up to ``timeout_s``; ``False`` if its poll is still running (hung)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()


def _query_int(request: web.Request, name: str, default: int, minimum: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if not minimum <= value <= MAX_QUERY_INT:
        raise web.HTTPBadRequest(text=f"{name}={raw[:40]!r} is not a whole number >= {minimum}\n")
    return value


def _packed_within(lines: list[bytes], cap: int) -> tuple[bytes, int] | None:
    """The first of ``lines`` packed within ``cap`` bytes, and how many; ``None`` when they do not make a table.

    Kept lines were each valid when they arrived; should they not make one table together, the answer is the lines
    as they are, so that the client's reader names the line at fault.
    """
    try:
        return pack_lines(lines, where="sidecar", max_bytes=cap)
    except ParseError as exc:
        log.warning("answering /v1/steps with JSON lines: the kept records do not pack: %s", str(exc)[:300])
        return None


class SidecarServer:
    """The aiohttp application over a collector, its registry and the training-loop source."""

    def __init__(
        self,
        *,
        collector: SidecarCollector,
        registry: CollectorRegistry,
        train: TrainEventsSource | None,
        steps_limit: int,
        response_bytes: int,
    ) -> None:
        """Serve ``registry`` and ``train``'s recent steps.

        Args:
            collector: the collector (its sources, identity and poll states make ``/healthz``).
            registry: the explicit registry holding ``collector``.
            train: the training-loop source (``/v1/steps``), or ``None`` when it is off.
            steps_limit: most steps one ``/v1/steps`` response holds (and its default ``limit``).
            response_bytes: most bytes one ``/v1/steps`` response holds.
        """
        self.collector = collector
        self.registry = registry
        self.train = train
        self.steps_limit = steps_limit
        self.response_bytes = response_bytes

    def app(self) -> web.Application:
        """The routes."""
        app = web.Application(client_max_size=64 * 1024)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/steps", self.steps)
        app.router.add_get("/healthz", self.healthz)
        return app

    async def metrics(self, _request: web.Request) -> web.Response:
        """The Prometheus text exposition of the registry."""
        body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def steps(self, request: web.Request) -> web.Response:
        """Recent step records (``?since_step=``, ``?limit=``, ``?max_bytes=``).

        JSON lines, or packed columns when the client accepts :data:`~meshscope.records.PACKED_MEDIA_TYPE` (packed
        in a worker thread).
        """
        since = _query_int(request, "since_step", -1, -1)
        limit = min(_query_int(request, "limit", self.steps_limit, 1), self.steps_limit)
        cap = min(_query_int(request, "max_bytes", self.response_bytes, 1), self.response_bytes)
        if self.train is None:
            return web.Response(body=b"", content_type="application/x-ndjson")
        if PACKED_MEDIA_TYPE in request.headers.get("Accept", ""):
            # the lines within the sidecar's own bound, then as many of them as fit the client's cap once packed
            lines, cut = self.train.recent_window(since_step=since, limit_steps=limit, max_bytes=self.response_bytes)
            packed = await asyncio.to_thread(_packed_within, lines, cap) if lines else None
            if packed is not None:
                body, held = packed
                headers = {CUT_HEADER: "max_bytes"} if cut or held < len(lines) else {}
                return web.Response(body=body, content_type=PACKED_MEDIA_TYPE, headers=headers)
        lines, cut = self.train.recent_window(since_step=since, limit_steps=limit, max_bytes=cap)
        headers = {CUT_HEADER: "max_bytes"} if cut else {}
        return web.Response(body=b"".join(lines), content_type="application/x-ndjson", headers=headers)

    async def healthz(self, _request: web.Request) -> web.Response:
        """The identity and every source's state, as JSON."""
        identity = self.collector.identity
        now = time.monotonic()
        sources = {}
        for s in self.collector.sources:
            poll = self.collector.polls.get(s.name)
            sources[s.name] = {
                "up": s.health.up,
                "last_error": s.health.last_error,
                "parse_errors_total": s.health.parse_errors_total,
                "dropped_total": s.health.dropped_total,
                "polls_total": poll.polls_total if poll is not None else 0,
                "stalled": poll.stalled(now) if poll is not None else False,
            }
        body = {
            "status": "ok",
            "mode": identity.mode.value,
            "identity": identity.describe(),
            "cannot_tag": list(identity.missing),
            "sources": sources,
        }
        return web.json_response(body, dumps=lambda o: json.dumps(o, ensure_ascii=False))


async def serve_until(
    server: SidecarServer,
    host: str,
    port: int,
    stop: asyncio.Event,
    on_ready: Callable[[list[tuple[str, int]]], None] | None = None,
) -> None:
    """Serve on ``host:port`` until ``stop`` is set.

    Args:
        server: what to serve.
        host: listen address.
        port: listen port (0: a free one).
        stop: set it to shut down.
        on_ready: called with the bound ``(host, port)`` addresses once listening.

    Raises:
        OSError: if the port cannot be bound.
    """
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound = [(str(a[0]), int(a[1])) for a in runner.addresses]
        log.info("serving /metrics, /v1/steps, /healthz on %s", ", ".join(f"{h}:{p}" for h, p in bound))
        if on_ready is not None:
            on_ready(bound)
        await stop.wait()
    finally:
        await runner.cleanup()

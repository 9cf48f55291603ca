"""The emulator served in a thread of its own, with its own event loop; a kubeconfig for kubectl and kopf.

Sync tests, kopf (in another thread, ``tests/operator_serving.py``'s recipe) and ``kubectl`` subprocesses all talk
to it over HTTP, so none of them shares a loop with the server (traps T2 and T3 of
shared/reference/kubernetes-testing.md). :meth:`RunningEmulator.call` runs a function on the emulator's loop (to
read or seed its store safely); every wait has a deadline. ``python -m kube_emulator PORT KUBECONFIG`` serves one
standalone until interrupted.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from kube_emulator.emulator import KubeEmulator, make_server

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    import kmock

T = TypeVar("T")
TIMEOUT_S = 30.0
"""Every start, stop and call ends by then (generous: the machine may be shared)."""


def write_kubeconfig(path: Path, server: str, *, namespace: str = "default") -> Path:
    """A kubeconfig with one context pointing at ``server`` (plain HTTP, a dummy bearer token)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "tester", "user": {"token": "dummy"}}],
        "contexts": [
            {"name": "emulator", "context": {"cluster": "emulator", "user": "tester", "namespace": namespace}}
        ],
        "current-context": "emulator",
    }
    path.write_text(yaml.safe_dump(config))
    return path


class RunningEmulator:
    """A :class:`~kube_emulator.emulator.KubeEmulator` serving on 127.0.0.1 from a daemon thread."""

    def __init__(self, *, port: int | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kube-emulator", daemon=True)
        self._thread.start()

        async def start() -> tuple[KubeEmulator, kmock.Server]:
            emulator = KubeEmulator()
            await emulator.__aenter__()
            server = make_server(emulator, port=port)
            await server.__aenter__()
            return emulator, server

        self.emulator, self._server = self._run(start())
        self.url = str(self._server.url).rstrip("/")

    def _run(self, coro: Any, timeout_s: float = TIMEOUT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call(self, fn: Callable[[KubeEmulator], T]) -> T:
        """``fn(emulator)`` run on the emulator's loop; its result."""

        async def run() -> T:
            return fn(self.emulator)

        return self._run(run())  # type: ignore[no-any-return]

    def kubeconfig(self, path: Path, *, namespace: str = "default") -> Path:
        """Write a kubeconfig for this server to ``path``."""
        return write_kubeconfig(path, self.url, namespace=namespace)

    def close(self) -> None:
        """Stop the server (open watches end) and the loop; wait for the thread."""

        async def stop() -> None:
            self.emulator.end_watches()
            await self._server.__aexit__(None, None, None)
            await self.emulator.__aexit__(None, None, None)

        try:
            self._run(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(TIMEOUT_S)
            if not self._thread.is_alive():
                self.loop.close()

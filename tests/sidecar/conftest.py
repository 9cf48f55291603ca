"""Shared sidecar test helpers: an identity from a few variables, and step records built by hand."""

from __future__ import annotations

from typing import Any

import pytest

from meshscope_sidecar.identity import Identity, IdentityInputs, resolve_identity

T0_US = 1_700_000_000_000_000
"""A realistic host clock origin for hand-built records, µs."""


def _make_identity(
    layout: str | None = "tp=2", gpus: str | None = "2", node_rank: str | None = "0", **kw: str
) -> Identity:
    """An identity as the pod's environment would give it (job ``j`` on node ``node-a`` unless overridden)."""
    return resolve_identity(
        IdentityInputs(
            job=kw.get("job", "j"),
            node_name=kw.get("node", "node-a"),
            layout=layout,
            gpus_per_node=gpus,
            node_rank=(("MESHSCOPE_NODE_RANK", node_rank),) if node_rank is not None else (),
            nvlink_domain=kw.get("nvlink_domain"),
            network_tier=kw.get("network_tier"),
        )
    )


def _step_record(
    rank: int, step: int, intervals: list[dict[str, Any]], *, end_ms: float = 100.0, **extra: Any
) -> dict[str, Any]:
    """A ``meshscope.step/1`` record of job ``j`` whose step starts at ``T0_US + step`` seconds; times in ms from it."""
    t0 = T0_US + step * 1_000_000

    def us(ms: float) -> int:
        return t0 + round(ms * 1000)

    ivs = [{**iv, "start_us": us(iv["start_us"]), "end_us": us(iv["end_us"])} for iv in intervals]
    return {
        "schema": "meshscope.step/1",
        "job": extra.pop("job", "j"),
        "step": step,
        "rank": rank,
        "coord": extra.pop("coord", {"dp": 0, "tp": rank % 2, "pp": 0, "cp": 0, "ep": 0}),
        "node": "node-a",
        "start_us": t0,
        "end_us": us(end_ms),
        "intervals": ivs,
        **extra,
    }


@pytest.fixture
def sock_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A short directory for Unix sockets (their paths are limited to 108 bytes)."""
    import tempfile  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    d = Path(tempfile.mkdtemp(prefix="ms-sc-", dir="/tmp"))
    yield d
    for p in d.iterdir():
        p.unlink(missing_ok=True)
    d.rmdir()


@pytest.fixture
def make_identity() -> Any:
    """:func:`_make_identity`: an identity from a few variables."""
    return _make_identity


@pytest.fixture
def step_record() -> Any:
    """:func:`_step_record`: a record built by hand, times in ms from its step's start."""
    return _step_record

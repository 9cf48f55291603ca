"""Tracker settings: everything the SDK learns from the launcher's environment, read once.

A training process learns who it is from the variables ``torchrun`` (and ``meshscope run``) set -- ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` -- plus meshscope's own ``MESHSCOPE_*`` variables. This module turns them into one
frozen :class:`TrackerSettings` so that the tracker never reads the environment again. It must not import torch and
must not raise on a malformed variable: the SDK never breaks a training job, so a bad value falls back to its default
and is reported in :attr:`TrackerSettings.problems`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshscope.errors import LayoutError
from meshscope.topology import ParallelLayout, parse_layout

if TYPE_CHECKING:
    from collections.abc import Mapping

ENV_DISABLE = "MESHSCOPE_DISABLE"
"""``1`` (or ``true``/``yes``) turns the SDK off completely: a null tracker, no patching."""
ENV_JOB = "MESHSCOPE_JOB"
"""Job name written into every record."""
ENV_LAYOUT = "MESHSCOPE_LAYOUT"
"""Parallel layout as ``dp=2,tp=2,pp=2`` (the ``--layout`` syntax of :func:`meshscope.topology.layout.parse_layout`)."""
ENV_LAYOUT_IMPLIED = "MESHSCOPE_LAYOUT_IMPLIED"
"""``1``: ``MESHSCOPE_LAYOUT`` is a launcher's default (``meshscope run`` without ``--layout``: data parallelism over
every rank), not the user's: a registered DeviceMesh whose dims are axes replaces it without a word of difference."""
ENV_COLLECTOR = "MESHSCOPE_COLLECTOR"
"""Where records go: ``unix:/path/to/socket`` or ``unix:@abstract-name`` (see ``docs/sdk.md``)."""
ENV_NODE = "MESHSCOPE_NODE"
"""Node name written into records; defaults to the host name."""
ENV_NVLINK_DOMAIN = "MESHSCOPE_NVLINK_DOMAIN"
"""NVLink domain label of this rank's GPU; unset means unknown."""
ENV_NETWORK_TIER = "MESHSCOPE_NETWORK_TIER"
"""Network block (leaf switch group) label of this rank's node; unset means unknown."""
ENV_GPU = "MESHSCOPE_GPU"
"""GPU index on the node; defaults to ``LOCAL_RANK`` when CUDA is in use, else unknown."""

DEFAULT_JOB = "job"
"""Job name when ``MESHSCOPE_JOB`` is unset."""

_TRUE = frozenset({"1", "true", "yes", "on"})


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackerSettings:
    """Who this process is and where its records go."""

    rank: int = 0
    """Global rank (``RANK``); 0 when unset."""
    world_size: int = 1
    """Ranks in the job (``WORLD_SIZE``); 1 when unset."""
    local_rank: int = 0
    """Rank within the node (``LOCAL_RANK``); 0 when unset."""
    job: str = DEFAULT_JOB
    """Job name (``MESHSCOPE_JOB``)."""
    layout: ParallelLayout | None = None
    """Parallel layout (``MESHSCOPE_LAYOUT``); ``None``: coords come from a registered DeviceMesh, else dp=rank."""
    layout_implied: bool = False
    """The layout is a launcher's default, not the user's (``MESHSCOPE_LAYOUT_IMPLIED=1``): a registered DeviceMesh
    whose dims are axes and span the world takes its place (:meth:`~meshscope.sdk.Tracker.register_mesh`)."""
    collector: str | None = None
    """Collector address (``MESHSCOPE_COLLECTOR``); ``None``: records are built, counted and dropped."""
    node: str = field(default_factory=lambda: socket.gethostname() or "node-0")
    """Node name (``MESHSCOPE_NODE``, else the host name); never empty."""
    nvlink_domain: str | None = None
    """NVLink domain label (``MESHSCOPE_NVLINK_DOMAIN``); ``None`` if unknown."""
    network_tier: str | None = None
    """Network block label (``MESHSCOPE_NETWORK_TIER``); ``None`` if unknown."""
    gpu: int | None = None
    """GPU index on the node (``MESHSCOPE_GPU``); ``None``: ``LOCAL_RANK`` on CUDA, unknown on CPU."""
    disabled: bool = False
    """``MESHSCOPE_DISABLE`` is set: the null tracker is used."""
    problems: tuple[str, ...] = ()
    """Variables that could not be read, one sentence each (the tracker logs them once)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TrackerSettings:
        """Read the settings from ``environ`` (default: ``os.environ``); never raises."""
        env = os.environ if environ is None else environ
        problems: list[str] = []
        disabled = env.get(ENV_DISABLE, "").strip().lower() in _TRUE
        rank = _int(env, "RANK", 0, problems)
        world = max(1, _int(env, "WORLD_SIZE", 1, problems))
        local_rank = _int(env, "LOCAL_RANK", 0, problems)
        layout: ParallelLayout | None = None
        text = env.get(ENV_LAYOUT, "").strip()
        if text and not disabled:
            try:
                layout = parse_layout(text, world_size=world)
            except LayoutError as exc:
                problems.append(f"{ENV_LAYOUT}={text!r} ignored: {exc}")
        gpu_text = env.get(ENV_GPU)
        gpu = _int(env, ENV_GPU, -1, problems) if gpu_text else -1
        return cls(
            rank=rank,
            world_size=world,
            local_rank=local_rank,
            job=env.get(ENV_JOB, "").strip() or DEFAULT_JOB,
            layout=layout,
            layout_implied=layout is not None and env.get(ENV_LAYOUT_IMPLIED, "").strip().lower() in _TRUE,
            collector=env.get(ENV_COLLECTOR, "").strip() or None,
            node=env.get(ENV_NODE, "").strip() or socket.gethostname() or "node-0",
            nvlink_domain=env.get(ENV_NVLINK_DOMAIN, "").strip() or None,
            network_tier=env.get(ENV_NETWORK_TIER, "").strip() or None,
            gpu=gpu if gpu >= 0 else None,
            disabled=disabled,
            problems=tuple(problems),
        )


def _int(env: Mapping[str, str], name: str, default: int, problems: list[str]) -> int:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        problems.append(f"{name}={raw!r} is not a whole number; using {default}")
        return default
    if value < 0:
        problems.append(f"{name}={raw!r} is negative; using {default}")
        return default
    return value

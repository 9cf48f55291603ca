"""The NCCL source: NCCL's debug logs (and NCCL Inspector's JSON lines) -> calls and bytes per rank, axis and op.

Exists so the sidecar measures what each rank's NCCL communicators actually moved, per mesh axis, from the logs that
``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL NCCL_DEBUG_FILE=/dir/nccl.%h.%p`` writes (one file per process),
without touching the training process. It wires the pieces together: :class:`~meshscope_sidecar.sources.nccl_files.
LogFollower` (files as they grow, rotate, truncate, disappear), :func:`~meshscope_sidecar.sources.nccl_lines.
parse_line` (the grammar), :class:`~meshscope_sidecar.sources.nccl_comms.CommRegistry` (communicators by
``(host, pid, comm)``, grouped by commId) and :class:`~meshscope_sidecar.sources.nccl_comms.AxisMapper` (the axis of
each communicator), and :func:`~meshscope_sidecar.sources.nccl_inspector.parse_inspector_line` for Inspector files.

Each process' global rank comes from the caller (:meth:`NcclLogSource.set_rank`, from the SDK's hello, which
carries ``pid`` and ``rank``); without it, from the process' rank in its first communicator of world size (the
default process group), or RCCL's ``globalrank`` suffix. A process with no known rank is counted
(:attr:`NcclLogStats.unmapped_calls`) and not exported: a sample is never tagged with a guessed rank.

It must not raise out of :meth:`~NcclLogSource.poll` (bad input is counted in :attr:`~NcclLogSource.health`), must
not export pointers, commIds or pids as labels, and keeps memory bounded (files, communicators, line length and the
bytes read per poll are capped, and what the caps cut is counted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshscope_sidecar.sources.base import Sample, SourceHealth
from meshscope_sidecar.sources.nccl_comms import (
    UNKNOWN,
    AxisMapper,
    CommKey,
    CommRegistry,
    Communicator,
    GroupKey,
    ProcessKey,
    fallback_ranks,
)
from meshscope_sidecar.sources.nccl_files import LogFollower
from meshscope_sidecar.sources.nccl_inspector import InspectorRecord, parse_inspector_line
from meshscope_sidecar.sources.nccl_lines import Collective, Fragment, InitLine, Malformed, parse_line

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from pathlib import Path

    from meshscope.topology import ParallelLayout, Placement
    from meshscope_sidecar.sources.nccl_files import FollowStats


def nccl_host(hostname: str) -> str:
    """A host name as NCCL prints it in its prefix: cut at the first ``.``, ``%`` and ``/`` made ``-`` (debug.cc)."""
    return hostname.split(".", 1)[0].replace("%", "-").replace("/", "-")


@dataclass(slots=True)
class NcclLogStats:
    """What the source read, running totals (beyond :class:`~meshscope_sidecar.sources.base.SourceHealth`)."""

    lines: int = 0
    """Log lines read."""
    collectives: int = 0
    """COLL lines read."""
    malformed: dict[str, int] = field(default_factory=dict)
    """Lines with NCCL's prefix and a known shape that did not parse, by kind (``coll``, ``init``, ...)."""
    fragments: dict[str, int] = field(default_factory=dict)
    """Partial lines, by reason (``truncated``, ``interleaved``, ``cut``, ``orphan``)."""
    unmapped_calls: int = 0
    """Calls of processes whose global rank is not known (not exported), as of the latest :meth:`samples`."""
    inspector_records: int = 0
    """Inspector JSON lines read."""
    inspector_dropped: int = 0
    """Inspector records of communicators beyond the cap."""


@dataclass(slots=True)
class InspectorComm:
    """One communicator of one process as Inspector reports it."""

    process: ProcessKey
    """``(host, pid)``."""
    comm_hash: str
    """``header.id``."""
    rank: int
    """Rank in the communicator."""
    nranks: int
    """Ranks in it."""
    n_nodes: int
    """Nodes it spans."""
    ops: dict[str, list[float]] = field(default_factory=dict)
    """op label -> [calls, message bytes, execution seconds]."""


_DEFAULT_BUDGET_BYTES = 8 * 1024 * 1024


class NcclLogSource:
    """NCCL debug logs (and optionally Inspector JSON lines) as per-rank, per-axis, per-op samples."""

    name = "nccl_log"

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        *,
        layout: ParallelLayout | None = None,
        placement: Placement | None = None,
        ranks: Mapping[ProcessKey, int] | None = None,
        inspector_paths: str | Path | Sequence[str | Path] | None = None,
        budget_bytes: int = _DEFAULT_BUDGET_BYTES,
        max_files: int = 256,
        max_communicators: int = 4096,
        max_line_bytes: int = 64 * 1024,
        ranks_from: Callable[[], Mapping[ProcessKey, int]] | None = None,
    ) -> None:
        """Configure; reads nothing until :meth:`poll`.

        Args:
            paths: the debug log files: a directory (every file in it), a glob (``/logs/nccl.*``) or files. Name the
                live files only: a glob that also matches copies made by ``copytruncate`` reads them twice.
            layout: the job's layout; without it every communicator's axis is ``unknown``.
            placement: where ranks run (optional; tells same-size groups apart by the nodes they span).
            ranks: ``(host, pid) -> global rank`` known at start (more through :meth:`set_rank`); hosts as NCCL
                prints them (:func:`nccl_host`).
            inspector_paths: NCCL Inspector output (``NCCL_INSPECTOR_DUMP_DIR``), same forms as ``paths``.
            budget_bytes: most bytes read per poll, logs and Inspector together (default 8 MiB).
            max_files: most files followed per kind (default 256).
            max_communicators: most communicators kept (default 4096), per kind.
            max_line_bytes: longest line kept (default 64 KiB).
            ranks_from: called at the start of every poll, in the polling thread, for more ``(host, pid) -> global
                rank`` (the sidecar passes what the training loop's hello messages said); each is given to
                :meth:`set_rank`.
        """
        self.health = SourceHealth()
        self.stats = NcclLogStats()
        self.registry = CommRegistry(max_communicators=max_communicators)
        self.budget_bytes = budget_bytes
        self.max_communicators = max_communicators
        self._paths = paths
        self._logs = LogFollower(paths, max_files=max_files, max_line_bytes=max_line_bytes)
        self._inspector = (
            None
            if inspector_paths is None
            else LogFollower(inspector_paths, max_files=max_files, max_line_bytes=max_line_bytes)
        )
        self._mapper = AxisMapper(layout, placement) if layout is not None else None
        self._world_size = layout.world_size if layout is not None else None
        self._given: dict[ProcessKey, int] = {(nccl_host(h), p): r for (h, p), r in (ranks or {}).items()}
        self._given_version = 0
        self._hosts: frozenset[str] = frozenset()
        self._hosts_version = -1
        self._inspector_comms: dict[tuple[str, int, str], InspectorComm] = {}
        self._cache_key: tuple[int, int, int] = (-1, -1, -1)
        self._axes: dict[CommKey, str] = {}
        self._inspector_axes: dict[tuple[str, int, str], str] = {}
        self._ranks: dict[ProcessKey, int] = {}
        self._ranks_from = ranks_from

    # ------------------------------------------------------------------ input

    def set_rank(self, host: str, pid: int, rank: int) -> None:
        """Tell the source the global rank of process ``pid`` on ``host`` (from the SDK's hello)."""
        key = (nccl_host(host), pid)
        if self._given.get(key) != rank:
            self._given[key] = rank
            self._given_version += 1

    def poll(self) -> None:
        """Read what is new in the files, within the byte budget; never raises."""
        try:
            self._poll()
        except Exception as exc:  # noqa: BLE001 - a source never takes the sidecar down; the error is reported
            self.health.up = False
            self.health.last_error = f"{type(exc).__name__}: {exc}"

    def _poll(self) -> None:
        if self._ranks_from is not None:
            for (host, pid), rank in self._ranks_from().items():
                self.set_rank(host, pid, rank)
        log_budget = self.budget_bytes if self._inspector is None else self.budget_bytes - self.budget_bytes // 4
        lines = self._logs.poll(log_budget)
        self._read_log(lines)
        files = len(self._logs.files)
        if self._inspector is not None:
            self._read_inspector(self._inspector.poll(self.budget_bytes - log_budget))
            files += len(self._inspector.files)
        errors = self._logs.stats.last_error or (self._inspector.stats.last_error if self._inspector else None)
        h = self.health
        h.parse_errors_total = (
            sum(self.stats.malformed.values())
            + sum(self.stats.fragments.values())
            + self._logs.stats.partial_lines
            + (self._inspector.stats.partial_lines if self._inspector else 0)
        )
        h.dropped_total = (
            self.registry.stats.calls_dropped
            + self.stats.inspector_dropped
            + self._drops(self._logs.stats)
            + (self._drops(self._inspector.stats) if self._inspector else 0)
        )
        if files:
            h.up = True
            h.last_error = errors
            h.last_success_unix_s = time.time()
        else:
            h.up = False
            h.last_error = errors or f"no NCCL log file matches {self._paths!s}"

    @staticmethod
    def _drops(stats: FollowStats) -> int:
        return stats.overlong_lines + stats.files_over_cap

    def _read_log(self, lines: list[bytes]) -> None:
        if self.registry.version != self._hosts_version:
            seen = {c.key[0] for c in self.registry.communicators}
            self._hosts = frozenset(seen) if len(seen) <= 256 else frozenset()
            self._hosts_version = self.registry.version
        hosts, apply, call, stats = self._hosts, self.registry.apply, self.registry.call, self.stats
        collectives = 0
        for line in lines:
            for event in parse_line(line, hosts):
                if type(event) is Collective:
                    collectives += 1
                    call(event)
                elif isinstance(event, Malformed):
                    stats.malformed[event.kind] = stats.malformed.get(event.kind, 0) + 1
                elif isinstance(event, Fragment):
                    stats.fragments[event.reason] = stats.fragments.get(event.reason, 0) + 1
                else:
                    apply(event)
                    if isinstance(event, InitLine) and event.host not in hosts and len(hosts) < 256:
                        hosts = self._hosts = hosts | {event.host}  # lines later in this poll may be glued to it
        stats.lines += len(lines)
        stats.collectives += collectives

    def _read_inspector(self, lines: list[bytes]) -> None:
        for line in lines:
            record = parse_inspector_line(line)
            if record is None:
                continue
            if isinstance(record, Malformed):
                self.stats.malformed[record.kind] = self.stats.malformed.get(record.kind, 0) + 1
                continue
            self.stats.inspector_records += 1
            self._add_inspector(record)

    def _add_inspector(self, r: InspectorRecord) -> None:
        key = (r.host, r.pid, r.comm_hash)
        comm = self._inspector_comms.get(key)
        if comm is None:
            if len(self._inspector_comms) >= self.max_communicators:
                self.stats.inspector_dropped += 1
                return
            comm = InspectorComm(
                process=(r.host, r.pid), comm_hash=r.comm_hash, rank=r.rank, nranks=r.nranks, n_nodes=r.n_nodes
            )
            self._inspector_comms[key] = comm
            self._inspector_axes.clear()
        totals = comm.ops.setdefault(r.op, [0, 0, 0.0])
        totals[0] += 1
        totals[1] += r.message_bytes
        totals[2] += r.exec_time_s

    # ------------------------------------------------------------------ state

    def process_ranks(self) -> dict[ProcessKey, int]:
        """Global rank of each process: given ranks first, then the world-size communicator, then RCCL's hint."""
        ranks = dict(self.registry.rank_hints())
        if self._world_size is not None:
            ranks.update(fallback_ranks(self.registry.communicators, self._world_size))
            for comm in self._inspector_comms.values():
                if comm.nranks == self._world_size:
                    ranks.setdefault(comm.process, comm.rank)
        ranks.update(self._given)
        return ranks

    def _refresh(self) -> None:
        key = (self.registry.version, self._given_version, len(self._inspector_comms))
        if key == self._cache_key:
            return
        self._cache_key = key
        self._ranks = self.process_ranks()
        self._axes.clear()
        self._inspector_axes.clear()
        if self._mapper is None:
            return
        groups: dict[GroupKey, dict[int, int]] = {}
        comms = self.registry.communicators
        keyed: list[tuple[Communicator, GroupKey | None]] = [(c, self.registry.group_of(c)) for c in comms]
        for comm, group in keyed:
            rank = self._ranks.get(comm.process)
            if group is not None and rank is not None and comm.rank is not None:
                groups.setdefault(group, {})[rank] = comm.rank
        for comm, group in keyed:
            rank = self._ranks.get(comm.process)
            if rank is None or comm.rank is None:
                self._axes[comm.key] = UNKNOWN
                continue
            members = groups.get(group, {rank: comm.rank}) if group is not None else {rank: comm.rank}
            self._axes[comm.key] = self._mapper.axis_of(
                nranks=comm.nranks, members=members, rank=rank, n_nodes=comm.n_nodes, local_ranks=comm.local_ranks
            )
        by_hash: dict[str, dict[int, int]] = {}
        for ic in self._inspector_comms.values():
            rank = self._ranks.get(ic.process)
            if rank is not None:
                by_hash.setdefault(ic.comm_hash, {})[rank] = ic.rank
        for ikey, ic in self._inspector_comms.items():
            rank = self._ranks.get(ic.process)
            self._inspector_axes[ikey] = (
                UNKNOWN
                if rank is None
                else self._mapper.axis_of(
                    nranks=ic.nranks, members=by_hash.get(ic.comm_hash, {rank: ic.rank}), rank=rank, n_nodes=ic.n_nodes
                )
            )

    def axis_of(self, comm: Communicator) -> str:
        """The axis label of one communicator of :attr:`registry` (``unknown`` when none fits or no layout)."""
        self._refresh()
        return self._axes.get(comm.key, UNKNOWN)

    def samples(self) -> list[Sample]:
        """Per rank: calls and bytes by (axis, op), live communicators by axis; Inspector's by (axis, op).

        Counters are running totals since the source started; a communicator replaced by a new one at the same
        address keeps counting under the axis it had.
        """
        self._refresh()
        calls: dict[tuple[int, str, str], list[int]] = {}
        live: dict[tuple[int, str], int] = {}
        unmapped = 0
        for comm in self.registry.communicators:
            rank = self._ranks.get(comm.process)
            if rank is None:
                unmapped += sum(t.calls for t in comm.ops.values())
                continue
            axis = self._axes.get(comm.key, UNKNOWN)
            for op, t in comm.ops.items():
                entry = calls.setdefault((rank, axis, op), [0, 0])
                entry[0] += t.calls
                entry[1] += t.message_bytes
            if comm.live:
                live[rank, axis] = live.get((rank, axis), 0) + 1
        self.stats.unmapped_calls = unmapped
        out: list[Sample] = []
        for (rank, axis, op), (n, size) in sorted(calls.items()):
            labels = (("axis", axis), ("op", op))
            out.append(Sample(metric="meshscope_nccl_collectives_total", value=float(n), rank=rank, labels=labels))
            out.append(Sample(metric="meshscope_nccl_bytes_total", value=float(size), rank=rank, labels=labels))
        for (rank, axis), n in sorted(live.items()):
            out.append(
                Sample(metric="meshscope_nccl_communicators", value=float(n), rank=rank, labels=(("axis", axis),))
            )
        out.extend(self._inspector_samples())
        return out

    def _inspector_samples(self) -> list[Sample]:
        totals: dict[tuple[int, str, str], list[float]] = {}
        for key, ic in self._inspector_comms.items():
            rank = self._ranks.get(ic.process)
            if rank is None:
                continue
            axis = self._inspector_axes.get(key, UNKNOWN)
            for op, (n, size, seconds) in ic.ops.items():
                entry = totals.setdefault((rank, axis, op), [0, 0, 0.0])
                entry[0] += n
                entry[1] += size
                entry[2] += seconds
        out: list[Sample] = []
        for (rank, axis, op), (n, size, seconds) in sorted(totals.items()):
            labels = (("axis", axis), ("op", op))
            for metric, value in (
                ("meshscope_nccl_inspector_collectives_total", n),
                ("meshscope_nccl_inspector_bytes_total", size),
                ("meshscope_nccl_inspector_exec_seconds_total", seconds),
            ):
                out.append(Sample(metric=metric, value=float(value), rank=rank, labels=labels))
        return out

    def close(self) -> None:
        """Close every file; idempotent."""
        self._logs.close()
        if self._inspector is not None:
            self._inspector.close()

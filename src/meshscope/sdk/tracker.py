"""The tracker: turns one rank's training steps into ``meshscope.step/1`` records and hands them to the transport.

Why it exists: the step breakdown needs, per rank and step, *when* the rank computed, loaded data, stepped the
optimizer and sat in which collective of which axis. A researcher adds a few lines (``tracker.step``,
``tracker.phase``, ``tracker.data_stats``); everything else -- every collective, point-to-point op, attention call,
DDP's tail wait, pipeline stage phases -- is captured by :mod:`meshscope.sdk.capture` and reported here.

How time is split, on CPU: phases give the compute, optimizer, data and checkpoint intervals; every moment the host
thread is **blocked** in communication (a ``Work.wait``, a functional ``wait_tensor``, a synchronous collective from
issue to return, DDP's wait for its last bucket) is cut out of the compute and optimizer intervals, because a blocked
host computes nothing. A collective's own interval runs from the rank's arrival (issue) to its completion (the
completion callback, or the return of its wait when the backend offers no callback). On a GPU the same marks are CUDA
events on the current stream (:mod:`meshscope.sdk.clocks`), so "blocked" means the compute stream waited on the
collective.

A step's record is sent when all its marks can be read: at once on CPU, one step late on GPU; an operation that has
not completed :data:`MAX_DEFERRED_STEPS` steps later is left out and counted.

Rules this module keeps: it never raises into the training loop (hooks are wrapped; failures are counted in
:class:`TrackerCounters` and logged once), never blocks it (the transport drops instead of waiting), never
synchronises a device on the hot path, and imports torch only when a real tracker starts.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import re
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from meshscope.sdk.clocks import HostClock
from meshscope.sdk.groups import GroupInfo, axis_of_name, infer_from_layout, make_group, p2p_axis, p2p_group_id
from meshscope.sdk.steps import (
    DEVICE_KINDS,
    END,
    HANDLE,
    ISSUED,
    START,
    OpMeta,
    RecordHeader,
    RssPeak,
    StepIntervals,
    StepState,
    encode_record,
)
from meshscope.sdk.transport import CONTROL_SCHEMA, RECORD_SCHEMA, RecordSender, pack
from meshscope.topology import AXES, MeshAxis

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping
    from types import TracebackType

    from torch import Tensor
    from torch.distributed import ProcessGroup, Work
    from torch.futures import Future

    from meshscope.sdk.clocks import Mark
    from meshscope.sdk.settings import TrackerSettings

log = logging.getLogger("meshscope.sdk")
_perf_ns = time.perf_counter_ns

MAX_DEFERRED_STEPS: Final = 4
"""Steps a record may wait for its operations to complete before they are left out (and counted)."""
ACTIVATION_STEPS: Final = 2
"""Steps (the first ones) in which :meth:`Tracker.saved_activations` scopes count; later scopes cost nothing."""
_SEQUENCES: Final = (list, tuple)
SYNC_GAP_NS: Final = 100_000
"""A wait that starts within this many ns of its operation's issue makes the whole issue..return span blocked."""

PHASES: Final[dict[str, tuple[str, str | None]]] = {
    "data": ("data", None),
    "forward": ("compute", "forward"),
    "backward": ("compute", "backward"),
    "recompute": ("compute", "recompute"),
    "compute": ("compute", None),
    "optimizer": ("optimizer", None),
    "checkpoint": ("checkpoint", None),
}
"""Phase names :meth:`Tracker.phase` accepts -> (interval kind, compute phase). ``compute`` is compute of unknown
phase; the innermost phase wins where phases nest."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackerCounters:
    """What the tracker had to drop, skip or survive. Cumulative since the tracker started."""

    records_sent: int = 0
    """Records the transport accepted."""
    records_dropped: int = 0
    """Records dropped: no collector, a full queue, a record too large."""
    hook_errors: int = 0
    """Exceptions inside meshscope's hooks (each kind logged once); the training loop never saw them."""
    unattributed_ops: int = 0
    """Collectives on groups that map to no axis (e.g. the world group of a multi-axis job): counted, not recorded."""
    incomplete_ops: int = 0
    """Operations left out of a record because they had not completed :data:`MAX_DEFERRED_STEPS` steps later."""
    phases_outside_step: int = 0
    """Phases entered while no step was open (not recorded)."""

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain mapping (the ``sdk`` object of a record)."""
        return {
            "records_sent": self.records_sent,
            "records_dropped": self.records_dropped,
            "hook_errors": self.hook_errors,
            "unattributed_ops": self.unattributed_ops,
            "incomplete_ops": self.incomplete_ops,
            "phases_outside_step": self.phases_outside_step,
        }


class _Frame:
    """An open phase on the phase stack."""

    __slots__ = ("kind", "phase", "seg_start", "step")

    def __init__(self, kind: str, phase: str | None, seg_start: Mark, step: StepState | None) -> None:
        self.kind = kind
        self.phase = phase
        self.seg_start = seg_start
        self.step = step


class _Group:
    """A process group as the hot path sees it: attribution, sequence counter, and one :class:`OpMeta` per op."""

    __slots__ = ("axis", "counter", "info", "metas", "pg", "size")

    def __init__(self, pg: object, info: GroupInfo, counter: Iterator[int]) -> None:
        self.pg = pg
        self.info = info
        self.axis = info.axis.value if info.axis is not None else None
        """The axis' name; ``None``: unattributed (counted, not recorded)."""
        self.size = info.size
        """Members."""
        self.counter = counter
        """Sequence numbers of the group id (shared by every road that reaches the group)."""
        self.metas: dict[str, OpMeta] = {}

    def meta(self, op: str) -> OpMeta:
        """The interval meta of ``op`` on this (attributed) group."""
        meta = self.metas.get(op)
        if meta is None:
            info = self.info
            meta = OpMeta(kind="comm", axis=str(self.axis), op=op, group=info.group_id, group_size=info.size, peer=None)
            self.metas[op] = meta
        return meta


class _PhaseContext:
    """Reusable context manager of one phase name (stateless: the stack lives on the tracker)."""

    __slots__ = ("kind", "phase", "tracker")

    def __init__(self, tracker: Tracker, kind: str, phase: str | None) -> None:
        self.tracker = tracker
        self.kind = kind
        self.phase = phase

    def __enter__(self) -> None:
        try:
            self.tracker._push(self.kind, self.phase)  # noqa: SLF001 - the context is the tracker's own helper
        except Exception as exc:  # noqa: BLE001
            self.tracker.fault("phase", exc)

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.tracker._pop()  # noqa: SLF001
        except Exception as exc:  # noqa: BLE001
            self.tracker.fault("phase", exc)


class _StepContext:
    __slots__ = ("step", "tracker")

    def __init__(self, tracker: Tracker, step: int) -> None:
        self.tracker = tracker
        self.step = step

    def __enter__(self) -> None:
        try:
            self.tracker._start_step(self.step)  # noqa: SLF001
        except Exception as exc:  # noqa: BLE001
            self.tracker.fault("step start", exc)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.tracker._end_step()  # noqa: SLF001
        except Exception as err:  # noqa: BLE001
            self.tracker.fault("step end", err)


class _NullContext:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_CONTEXT = _NullContext()


class NullTracker:
    """The tracker of ``MESHSCOPE_DISABLE=1``: same API, does nothing, patches nothing, never imports torch."""

    enabled = False
    """Always ``False``."""

    def register_groups(self, groups: Mapping[str, Any]) -> None:
        """Do nothing."""

    def register_group(self, group: object, axis: MeshAxis | str, *, name: str | None = None) -> None:
        """Do nothing."""

    def register_mesh(self, mesh: object) -> None:
        """Do nothing."""

    def step(self, step: int) -> _NullContext:  # noqa: ARG002 - same signature as the real tracker
        """A context that does nothing."""
        return _NULL_CONTEXT

    def phase(self, name: str) -> _NullContext:  # noqa: ARG002
        """A context that does nothing."""
        return _NULL_CONTEXT

    def data_stats(
        self,
        sequence_lengths: Iterable[int] | None = None,
        *,
        tokens: int | None = None,
        sequences: int | None = None,
    ) -> None:
        """Do nothing."""

    def describe_job(self, description: Mapping[str, Any]) -> None:
        """Do nothing."""

    def count_model_state(self, modules: Iterable[Any], optimizer: Any = None) -> None:  # noqa: ANN401
        """Do nothing."""

    def saved_activations(self, name: str, module: Any = None) -> _NullContext:  # noqa: ARG002, ANN401
        """A context that does nothing."""
        return _NULL_CONTEXT

    def counters(self) -> TrackerCounters:
        """All zero."""
        return TrackerCounters()

    def close(self) -> None:
        """Do nothing."""


class Tracker:
    """Records one rank's steps. Build it with :func:`meshscope.sdk.tracker_from_env`; one per process.

    Thread-safety: steps and phases belong to the training thread; operations may be captured and completed on
    other threads (autograd, backend workers), which only append to lists and set attributes.
    """

    enabled = True
    """Always ``True`` (``False`` on :class:`NullTracker`)."""

    def __init__(self, settings: TrackerSettings) -> None:
        """Start tracking: open the transport, install the capture patches, say hello to the collector.

        Args:
            settings: who this rank is and where records go (:meth:`TrackerSettings.from_env`).
        """
        import torch  # noqa: PLC0415 - the SDK imports torch only when a real tracker starts
        import torch.distributed as dist  # noqa: PLC0415

        from meshscope.sdk import capture  # noqa: PLC0415

        self._torch = torch
        self._dist = dist
        self._capture = capture
        self.settings = settings
        self._clock: HostClock = HostClock()
        self._clock_chosen = False
        self.on_device = False
        """Whether marks of device work are CUDA events (``False``: everything is host time)."""
        self._mark_end: Callable[[], Mark] = time.perf_counter_ns
        """How a completion callback marks an operation's end (the CUDA clock's event recorder on GPU)."""
        self._sender = RecordSender(settings.collector)
        self._faults: dict[str, int] = {}
        self._sent = 0
        self._dropped = 0
        self._unattributed = 0
        self._incomplete = 0
        self._outside = 0
        self._step: StepState | None = None
        self._steps_finished = 0
        self._stack: list[_Frame] = []
        self._pending: list[StepState] = []
        self._groups: dict[int, _Group] = {}
        """By ``id()`` of the ProcessGroup object (checked against :attr:`_Group.pg`)."""
        self._by_name: dict[str, _Group] = {}
        """By c10d group name (the functional collectives' road)."""
        self._p2p: dict[tuple[str, str, int], OpMeta] = {}
        self._registered: dict[str, tuple[str, MeshAxis | None]] = {}
        self._ids: dict[str, str] = {}
        self._seq: dict[str, Iterator[int]] = {}
        self._by_work: dict[int, list[Any]] = {}
        """Operations in flight by ``id()`` of their ``Work`` (held in the operation, so the id stays unique)."""
        self._by_storage: dict[int, list[Any]] = {}
        """Functional collectives in flight by the storage address of their outputs (held in the operation, so the
        address stays theirs). The storage, as in c10d's own registry, so that a wait on a view finds them too."""
        self._head: RecordHeader | None = None
        self._phase_contexts = {name: _PhaseContext(self, kind, ph) for name, (kind, ph) in PHASES.items()}
        self._mesh_coord: dict[str, int] = {}
        self._coord_cache: dict[str, int] | None = None
        self._rss = RssPeak()
        self._closed = False
        self._measurements: dict[str, Any] = {}
        self._activations: dict[str, dict[int, list[int]]] = {}
        for problem in settings.problems:
            log.warning("meshscope: %s", problem)
        capture.install(self)
        self._send_control("hello")

    # ------------------------------------------------------------------ public API

    def register_groups(self, groups: Mapping[str, Any]) -> None:
        """Map process groups to axes by name.

        Args:
            groups: name -> ``ProcessGroup`` (or a 1-D ``DeviceMesh``, or ``None`` to skip). The name gives the
                axis: an axis (``tp``), a DeviceMesh dim (``dp_cp`` -> dp), a Megatron-core group name
                (``tensor_model_parallel``, ``expert_data_parallel`` -> dp). A name that says no axis is logged and
                its collectives are counted as unattributed. The name also prefixes the group's id (``tp:4``).
        """
        for name, group in groups.items():
            if group is None:
                continue
            axis = axis_of_name(name)
            if axis is None:
                log.warning("meshscope: group name %r names no axis (dp, tp, pp, cp, ep); not attributed", name)
            self._register(group, name, axis)

    def register_group(self, group: object, axis: MeshAxis | str, *, name: str | None = None) -> None:
        """Map one process group to ``axis`` explicitly (``name`` defaults to the axis; it prefixes the id)."""
        ax = MeshAxis(axis)
        self._register(group, name or ax.value, ax)

    def register_mesh(self, mesh: Any) -> None:  # noqa: ANN401 - a DeviceMesh, typed loosely to keep torch lazy
        """Register every dim of a ``DeviceMesh`` under its dim name, and take this rank's coords from it.

        Dims named after an axis (or a combination such as ``dp_cp``) map to it; coords are taken from dims named
        exactly dp, tp, pp, cp, ep when no ``MESHSCOPE_LAYOUT`` was given.
        """
        try:
            names = tuple(mesh.mesh_dim_names or ())
            coordinate = mesh.get_coordinate()
            for i, name in enumerate(names):
                self.register_groups({name: mesh.get_group(name)})
                if coordinate is not None and name in {a.value for a in AXES}:
                    self._mesh_coord[name] = int(coordinate[i])
            self._coord_cache = None
            self._head = None
        except Exception as exc:  # noqa: BLE001
            self.fault("register_mesh", exc)

    def step(self, step: int) -> _StepContext:
        """Context manager around one training step; its record is sent when it ends (one step late on GPU).

        Args:
            step: the step number (>= 0, unique per rank: ``(rank, step)`` names a record).
        """
        return _StepContext(self, step)

    def phase(self, name: str) -> _PhaseContext | _NullContext:
        """Context manager around a part of the step, named as in :data:`PHASES`.

        ``data``, ``forward``, ``backward``, ``recompute``, ``compute`` (compute of unknown phase), ``optimizer``,
        ``checkpoint``. The innermost phase wins where phases nest. An unknown name is logged once and ignored (the
        training loop never sees an exception).
        """
        ctx = self._phase_contexts.get(name)
        if ctx is None:
            self.fault("phase name", ValueError(f"unknown phase {name!r}; use one of {', '.join(PHASES)}"))
            return _NULL_CONTEXT
        return ctx

    def data_stats(
        self,
        sequence_lengths: Iterable[int] | None = None,
        *,
        tokens: int | None = None,
        sequences: int | None = None,
    ) -> None:
        """Add what the data loader handed this rank in the current step (call once per micro-batch or once).

        Args:
            sequence_lengths: token count of every sequence (a list or a 1-D integer tensor). Gives tokens
                (the sum), sequences, the longest sequence and the attention work Σ s² (tokens²).
            tokens: tokens, when lengths are not at hand (adds to the step's count).
            sequences: sequences, when lengths are not at hand.
        """
        st = self._step
        if st is None:
            return
        try:
            if sequence_lengths is not None:
                lengths = sequence_lengths.tolist() if hasattr(sequence_lengths, "tolist") else list(sequence_lengths)
                lengths = [int(x) for x in lengths]
                st.tokens = (st.tokens or 0) + sum(lengths)
                st.sequences = (st.sequences or 0) + len(lengths)
                if lengths:
                    st.longest = max(st.longest or 0, *lengths)
                st.work = (st.work or 0.0) + float(sum(x * x for x in lengths))
            if tokens is not None:
                st.tokens = (st.tokens or 0) + int(tokens)
            if sequences is not None:
                st.sequences = (st.sequences or 0) + int(sequences)
        except Exception as exc:  # noqa: BLE001
            self.fault("data_stats", exc)

    def describe_job(self, description: Mapping[str, Any]) -> None:
        """Tell the collector what this job is (JSON-ready mapping), so that it can plan it without a spec.

        ``examples/train_tiny.py`` sends :class:`meshscope.local.emulation.TinyJob`'s fields (model, micro-batch size
        and count, emulated block time, data parallelism); ``meshscope run`` builds the job's spec from it. Sent at once
        in a ``measurements`` control message (``docs/sdk.md``, "Measurements").
        """
        try:
            self._measurements["job"] = dict(description)
            self._send_measurements()
        except Exception as exc:  # noqa: BLE001
            self.fault("describe_job", exc)

    def count_model_state(self, modules: Iterable[Any], optimizer: Any = None) -> None:  # noqa: ANN401 - nn.Modules and a torch optimizer, typed loosely to keep torch lazy
        """Count parameter, gradient and optimizer-state bytes this rank holds now, and send them.

        Call it once, where gradients and optimizer state exist (after ``optimizer.step()``, before ``zero_grad``).
        DTensor parameters (FSDP2, tensor parallelism) count at their local shard's size; AdamW's step counters are
        counted apart (:func:`meshscope.sdk.measuring.count_model_state`).

        Args:
            modules: this rank's model parts.
            optimizer: its optimizer, or ``None``.
        """
        try:
            from meshscope.sdk.measuring import count_model_state  # noqa: PLC0415

            self._measurements["model_state"] = count_model_state(modules, optimizer)
            self._send_measurements()
        except Exception as exc:  # noqa: BLE001
            self.fault("count_model_state", exc)

    def saved_activations(self, name: str, module: Any = None) -> Any:  # noqa: ANN401 - a context manager; module is an nn.Module
        """Context manager: count the bytes autograd saves for backward inside it, in the first steps only.

        Each distinct storage counts once at its full size; ``module``'s parameters and buffers (and any parameter)
        are left out. Per step, the totals of all scopes of one ``name`` add up, and their number is kept (e.g.
        blocks x micro-batches). Counting runs in the first :data:`ACTIVATION_STEPS` steps; afterwards, and outside
        a step, the scope does nothing. Sent with the measurements when those steps are over.

        Args:
            name: what the scope holds, e.g. ``layers``, ``embedding``, ``output``.
            module: the module whose forward the scope wraps.
        """
        st = self._step
        if st is None or self._steps_finished >= ACTIVATION_STEPS or self._closed:
            return _NULL_CONTEXT
        try:
            from meshscope.sdk.measuring import ActivationScope  # noqa: PLC0415

            step = st.step

            def done(nbytes: int) -> None:
                slot = self._activations.setdefault(name, {}).setdefault(step, [0, 0])
                slot[0] += 1
                slot[1] += nbytes

            return ActivationScope(module, done)
        except Exception as exc:  # noqa: BLE001
            self.fault("saved_activations", exc)
            return _NULL_CONTEXT

    def _send_measurements(self) -> None:
        measurements = dict(self._measurements)
        if self._activations:
            measurements["activations"] = {
                name: [{"step": step, "scopes": n, "bytes": b} for step, (n, b) in sorted(per_step.items())]
                for name, per_step in self._activations.items()
            }
        self._send_control("measurements", measurements=measurements)

    def _counters_dict(self) -> dict[str, int]:
        """:meth:`counters` as the ``sdk`` object of a record, without the dataclass (built every step)."""
        return {
            "records_sent": self._sent,
            "records_dropped": self._dropped,
            "hook_errors": sum(self._faults.values()),
            "unattributed_ops": self._unattributed,
            "incomplete_ops": self._incomplete,
            "phases_outside_step": self._outside,
        }

    def counters(self) -> TrackerCounters:
        """A snapshot of the drop and failure counters."""
        return TrackerCounters(
            records_sent=self._sent,
            records_dropped=self._dropped,
            hook_errors=sum(self._faults.values()),
            unattributed_ops=self._unattributed,
            incomplete_ops=self._incomplete,
            phases_outside_step=self._outside,
        )

    def close(self) -> None:
        """Finish an open step, send what is pending, say goodbye, remove the patches. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._step is not None:
                self._end_step()
            self._flush(final=True)
            if self._measurements or self._activations:
                self._send_measurements()
        except Exception as exc:  # noqa: BLE001
            self.fault("close", exc)
        with contextlib.suppress(Exception):
            self._send_control("close")
        with contextlib.suppress(Exception):
            self._capture.uninstall()
        self._sender.close()
        self._rss.close()

    @property
    def in_step(self) -> bool:
        """Whether a step is open."""
        return self._step is not None

    @property
    def last_drop_reason(self) -> str | None:
        """Why the transport last dropped something, for people (``None``: nothing dropped)."""
        return self._sender.last_error

    # ------------------------------------------------------------------ failures

    def fault(self, where: str, exc: BaseException) -> None:
        """Count a failure inside meshscope and log its first occurrence per ``where``."""
        n = self._faults.get(where, 0)
        self._faults[where] = n + 1
        if n == 0:
            log.warning("meshscope: %s failed (counted, training unaffected): %r", where, exc, exc_info=exc)

    # ------------------------------------------------------------------ marks

    def device_mark(self, host_ns: int) -> Mark:
        """A mark for device work: ``host_ns`` itself on CPU, a CUDA event on GPU (``host_ns`` if recording fails)."""
        if self.on_device:
            try:
                return self._clock.device_mark()
            except Exception as exc:  # noqa: BLE001 - a host mark is a valid mark on the CUDA clock too
                self.fault("device mark", exc)
        return host_ns

    def _choose_clock(self) -> None:
        self._clock_chosen = True
        torch = self._torch
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                from meshscope.sdk.clocks import CudaClock  # noqa: PLC0415

                clock = CudaClock(torch)
                self._clock = clock
                self.on_device = True
                self._mark_end = clock.device_mark
                self._head = None  # the record's gpu field follows LOCAL_RANK on CUDA
        except Exception as exc:  # noqa: BLE001
            self.fault("cuda clock", exc)

    # ------------------------------------------------------------------ groups

    def _register(self, group: object, name: str, axis: MeshAxis | None) -> None:
        try:
            pg: Any = group
            if hasattr(group, "get_group") and not hasattr(group, "group_name"):  # a 1-D DeviceMesh
                pg = pg.get_group()
            self._registered[pg.group_name] = (name, axis)
            self._groups.pop(id(pg), None)
            self._by_name.pop(pg.group_name, None)
            self._p2p.clear()
            self._group_of_pg(pg)
        except Exception as exc:  # noqa: BLE001
            self.fault("register_groups", exc)

    def _group_of_pg(self, pg: ProcessGroup) -> _Group:
        group = self._groups.get(id(pg))
        if group is not None and group.pg is pg:
            return group
        info = self._resolve(pg)
        counter = self._seq.get(info.group_id)
        if counter is None:
            counter = self._seq.setdefault(info.group_id, itertools.count())
        group = _Group(pg, info, counter)
        self._groups[id(pg)] = group
        self._by_name[pg.group_name] = group
        return group

    def _group_of_name(self, group_name: object) -> _Group:
        group: _Group | None = self._by_name.get(group_name)  # type: ignore[call-overload]
        if group is None:
            resolve = getattr(self._dist.distributed_c10d, "_resolve_process_group")  # noqa: B009 - private API
            group = self._group_of_pg(resolve(str(group_name)))
            self._by_name[group_name] = group  # type: ignore[index]
        return group

    def _resolve(self, pg: ProcessGroup) -> GroupInfo:
        ranks = tuple(int(r) for r in self._dist.get_process_group_ranks(pg))
        pg_name = str(pg.group_name)
        registered = self._registered.get(pg_name)
        if registered is not None:
            name, axis = registered
        else:
            desc = str(getattr(pg, "group_desc", "") or "")
            axis = axis_of_name(desc) if desc else None
            name = re.sub(r"^mesh_", "", desc) if axis is not None else (desc or "group")
            layout = self.settings.layout
            if axis is None and layout is not None:
                inferred = infer_from_layout(layout, ranks)
                if inferred is not None:
                    name, axis = inferred
            if len(ranks) < 2:
                axis = None
        info = make_group(name, axis, ranks)
        owner = self._ids.setdefault(info.group_id, pg_name)
        if owner != pg_name:  # two distinct groups of one name and first rank on this rank: keep ids apart
            info = replace(info, group_id=f"{info.group_id}~{pg_name}")
        return info

    def _next_seq(self, group_id: str) -> int:
        counter = self._seq.get(group_id)
        if counter is None:
            counter = self._seq.setdefault(group_id, itertools.count())
        return next(counter)

    # ------------------------------------------------------------------ capture callbacks (hot path)
    #
    # Per captured operation: one dict lookup for the group (cached per ProcessGroup object or group name), one
    # ``next()`` for its sequence number, one small list (steps.new_op's layout) appended to the step, one dict entry
    # keyed by the id of what ends it, and two clock reads; the wait adds one window tuple. No per-op dicts, objects
    # or keyword calls: records are assembled after the step (meshscope.sdk.steps).

    def on_collective(  # noqa: PLR0917 - the hot path passes positionals, no keyword dict
        self,
        pg: ProcessGroup,
        op: str,
        size_of: Callable[[tuple[Any, ...], int], int],
        args: tuple[Any, ...],
        work: Work | None,
        start: Mark,
        completion: bool,  # noqa: FBT001
    ) -> None:
        """A ``ProcessGroup`` collective issued at mark ``start`` was accepted by the backend, which returned ``work``.

        Args:
            pg: the group.
            op: the recorded op (``all_reduce`` ...).
            size_of: its bytes from ``(args, group size)``.
            args: the positional arguments of the call.
            work: what the backend returned (a ``Work`` or ``None`` for a call that already completed).
            start: the issue mark.
            completion: mark the end at completion now (``Future.then``), for operations never waited on from Python
                (DDP's buckets). Otherwise the end is the return of its wait (or a completion callback attached when
                its step ends unwaited).
        """
        group = self._groups.get(id(pg))
        if group is None or group.pg is not pg:
            group = self._group_of_pg(pg)
        if group.axis is None:
            if group.size > 1:
                self._unattributed += 1
            return
        seq = next(group.counter)
        st = self._step
        if st is None:
            return
        meta = group.metas.get(op) or group.meta(op)
        rec = [start, None, meta, seq, size_of(args, group.size), work, _perf_ns()]
        st.ops.append(rec)
        if work is None:
            rec[END] = self._mark_end()
            return
        self._by_work[id(work)] = rec
        if completion:
            _on_completion(work, rec, self._mark_end)

    def on_p2p(  # noqa: PLR0917 - positionals on the hot path
        self, pg: ProcessGroup, op: str, peer_in_group: int | None, nbytes: int | None, work: Work | None, start: Mark
    ) -> None:
        """A ``send``/``recv`` issued at mark ``start`` was accepted by the backend, which returned ``work``.

        ``peer_in_group`` is the other side's rank in ``pg`` (``None`` for a receive from any source: unattributed).
        """
        group = self._groups.get(id(pg))
        if group is None or group.pg is not pg:
            group = self._group_of_pg(pg)
        if peer_in_group is None:  # recv_anysource: no peer to join with
            self._unattributed += 1
            return
        peer = group.info.global_rank(peer_in_group)
        key = (op, group.info.group_id, peer)
        meta = self._p2p.get(key)
        if meta is None:
            rank = self.settings.rank
            axis = group.info.axis if group.info.axis is not None else p2p_axis(self.settings.layout, rank, peer)
            if axis is None:
                self._unattributed += 1
                return
            src, dst = (rank, peer) if op == "send" else (peer, rank)
            gid = p2p_group_id(axis, src, dst)
            meta = OpMeta(kind="p2p", axis=axis.value, op=op, group=gid, group_size=None, peer=peer)
            self._p2p[key] = meta
        seq = self._next_seq(meta.group)
        st = self._step
        if st is None:
            return
        rec = [start, None, meta, seq, nbytes, work, _perf_ns()]
        st.ops.append(rec)
        if work is None:
            rec[END] = self._mark_end()
        else:
            self._by_work[id(work)] = rec

    def on_wait(self, work: Work, t0: int, m0: Mark) -> None:
        """A ``Work.wait`` that started at ``t0`` (host ns) / ``m0`` (mark) returned now."""
        t1 = _perf_ns()
        m1 = self.device_mark(t1) if self.on_device else t1
        rec = self._by_work.pop(id(work), None) if self._by_work else None
        if rec is not None and rec[HANDLE] is work:
            rec[HANDLE] = None
            if rec[END] is None:
                rec[END] = m1
            if t0 - rec[ISSUED] < SYNC_GAP_NS:  # a synchronous call: blocked from its issue
                m0 = rec[START]
        st = self._step
        if st is not None:
            st.windows.append((m0, m1))

    def on_tensor_wait(self, tensor: Tensor | None, t0: int, m0: Mark) -> None:
        """A functional ``wait_tensor`` that started at ``t0`` / ``m0`` returned now."""
        t1 = _perf_ns()
        m1 = self.device_mark(t1) if self.on_device else t1
        by_storage = self._by_storage
        if by_storage and tensor is not None:
            # The output itself first (its address is its storage's: no storage object to build); then, for a view,
            # the storage's address. A view's own address lies inside its storage, which it keeps alive, so it is
            # never the key of another held output.
            rec = by_storage.pop(tensor.data_ptr(), None)
            if rec is None:
                rec = by_storage.pop(tensor.untyped_storage().data_ptr(), None)
            if rec is not None:
                if isinstance(rec[HANDLE], _SEQUENCES):  # a coalesced op: its other outputs are done too
                    self._forget_outputs(rec)
                else:
                    rec[HANDLE] = None
                if rec[END] is None:
                    rec[END] = m1
                if t0 - rec[ISSUED] < SYNC_GAP_NS:
                    m0 = rec[START]
        st = self._step
        if st is not None:
            st.windows.append((m0, m1))

    def _forget_outputs(self, rec: list[Any]) -> None:
        """Drop a functional collective's outputs (held since issue) and their lookup entries."""
        outs = rec[HANDLE]
        rec[HANDLE] = None
        by_storage = self._by_storage
        for out in outs if isinstance(outs, _SEQUENCES) else (outs,):
            key = _storage_key(out)
            if by_storage.get(key) is rec:
                del by_storage[key]

    def on_functional(
        self, op: str, group_name: object, nbytes: int | None, out: Tensor | list[Tensor], start: Mark
    ) -> None:
        """A functional collective (``torch.ops._c10d_functional``) on ``group_name``, issued at ``start``, returned.

        ``out`` is its output; the first ``wait_tensor`` on it ends the operation.
        """
        group = self._by_name.get(group_name)  # type: ignore[call-overload]
        if group is None:
            group = self._group_of_name(group_name)
        if group.axis is None:
            if group.size > 1:
                self._unattributed += 1
            return
        seq = next(group.counter)
        st = self._step
        if st is None:
            return
        meta = group.metas.get(op) or group.meta(op)
        rec = [start, None, meta, seq, nbytes, out, _perf_ns()]
        st.ops.append(rec)
        for tensor in out if isinstance(out, _SEQUENCES) else (out,):
            self._by_storage[_storage_key(tensor)] = rec

    def on_ddp_last_bucket(self, future: Future[object]) -> None:
        """DDP issued its last bucket: backward now waits until that bucket's reduction completes."""
        st = self._step
        if st is None:
            return
        window: list[Mark] = [self.device_mark(_perf_ns()), None]
        st.windows.append(window)
        mark = self._mark_end

        def closed(_fut: Future[object]) -> None:
            window[1] = mark()

        future.then(closed)

    def on_attention_forward(self, m0: Mark) -> None:
        """An attention call that started at ``m0`` returned now."""
        st = self._step
        if st is not None:
            st.attention.append((m0, self.device_mark(_perf_ns())))

    def on_attention_backward(self, start: Mark) -> None:
        """An attention backward that started at ``start`` finished now."""
        st = self._step
        if st is not None and start is not None:
            st.attention.append((start, self.device_mark(_perf_ns())))

    # ------------------------------------------------------------------ steps and phases

    def _start_step(self, step: int) -> None:
        if self._closed:
            return
        if self._step is not None:
            self.fault("step", RuntimeError(f"step {step} opened inside step {self._step.step}; ignored"))
            return
        if not self._clock_chosen:
            self._choose_clock()
        self._capture.patch_pipelining_if_loaded()
        self._clock.on_step_start(self._steps_finished)
        if self.on_device:
            self._torch.cuda.reset_peak_memory_stats()
        else:
            self._rss.reset()
        now = _perf_ns()
        st = StepState(int(step), now, self.device_mark(now))
        self._step = st
        for frame in self._stack:  # phases opened before the step count from its start
            if frame.step is None:
                frame.step, frame.seg_start = st, self._mark_for(frame.kind, now)

    def _end_step(self) -> None:
        st = self._step
        if st is None:
            return
        now = _perf_ns()
        if self._stack and self._stack[-1].step is st:  # only the innermost open phase owns the time now
            top = self._stack[-1]
            st.segments.append((top.kind, top.phase, top.seg_start, self._mark_for(top.kind, now)))
        for frame in self._stack:
            if frame.step is st:
                frame.step = None
        self._step = None
        st.end_ns = now
        st.end_mark = self.device_mark(now)
        st.peak_memory_bytes = self._peak_memory()
        work_type = self._dist.Work
        for rec in st.ops:  # asynchronous operations nobody waited on: their completion ends them
            if rec[END] is None and isinstance(rec[HANDLE], work_type):
                _on_completion(rec[HANDLE], rec, self._mark_end)
        self._steps_finished += 1
        if self._steps_finished == ACTIVATION_STEPS and self._activations:
            self._send_measurements()
        st.finished_at = self._steps_finished
        self._pending.append(st)
        self._flush(final=False)

    def _push(self, kind: str, phase: str | None) -> None:
        now = _perf_ns()
        st = self._step
        if st is None:
            self._outside += 1
            self._stack.append(_Frame(kind, phase, None, None))
            return
        if self._stack:
            top = self._stack[-1]
            if top.step is st:
                st.segments.append((top.kind, top.phase, top.seg_start, self._mark_for(top.kind, now)))
        self._stack.append(_Frame(kind, phase, self._mark_for(kind, now), st))

    def _pop(self) -> None:
        if not self._stack:
            return
        now = _perf_ns()
        frame = self._stack.pop()
        st = self._step
        if st is None or frame.step is not st:
            return
        st.segments.append((frame.kind, frame.phase, frame.seg_start, self._mark_for(frame.kind, now)))
        if self._stack and self._stack[-1].step is st:
            top = self._stack[-1]
            top.seg_start = self._mark_for(top.kind, now)

    def _mark_for(self, kind: str, now: int) -> Mark:
        return self.device_mark(now) if kind in DEVICE_KINDS else now

    def _peak_memory(self) -> int | None:
        try:
            if self.on_device:
                return int(self._torch.cuda.max_memory_allocated())
            return self._rss.read()
        except Exception as exc:  # noqa: BLE001
            self.fault("peak memory", exc)
            return None

    # ------------------------------------------------------------------ records

    def _flush(self, *, final: bool) -> None:
        while self._pending:
            st = self._pending[0]
            age = self._steps_finished - st.finished_at
            if not final and age < MAX_DEFERRED_STEPS and not self._ready(st):
                return
            self._pending.pop(0)
            try:
                intervals = StepIntervals(st, self._clock, device=self.on_device)
                self._incomplete += intervals.incomplete
                data = encode_record(st, intervals, header=self._record_header(), sdk=self._counters_dict())
            except Exception as exc:  # noqa: BLE001
                self.fault("record", exc)
                continue
            finally:
                self._release(st)
            if self._sender.send_bytes(pack(data)):
                self._sent += 1
            else:
                self._dropped += 1

    def _ready(self, st: StepState) -> bool:
        if any(rec[END] is None for rec in st.ops) or any(w[1] is None for w in st.windows):
            return False
        if not self.on_device:
            return True
        ready = self._clock.ready
        return ready(st.end_mark) and all(ready(rec[END]) for rec in st.ops) and all(ready(w[1]) for w in st.windows)

    def _release(self, st: StepState) -> None:
        """Forget the step's operations: what ends them is no longer held, nor looked up."""
        by_work = self._by_work
        for rec in st.ops:
            handle = rec[HANDLE]
            if handle is None:
                continue
            if by_work.get(id(handle)) is rec:
                del by_work[id(handle)]
                rec[HANDLE] = None
            else:
                self._forget_outputs(rec)

    def _coord(self) -> dict[str, int]:
        if self._coord_cache is None:
            s = self.settings
            if s.layout is not None:
                coord = s.layout.coord(s.rank).as_dict()
            elif self._mesh_coord:
                coord = {a.value: self._mesh_coord.get(a.value, 0) for a in AXES}
            else:
                coord = {a.value: 0 for a in AXES}
                coord["dp"] = s.rank
            self._coord_cache = coord
        return self._coord_cache

    def _record_header(self) -> RecordHeader:
        """The encoded identity fields; encoded again after what they depend on changed (a mesh, the CUDA clock)."""
        if self._head is None:
            self._head = RecordHeader(self._header())
        return self._head

    def _header(self) -> dict[str, Any]:
        """The identity fields of every record, in schema order (``step`` is filled in per record)."""
        s = self.settings
        header: dict[str, Any] = {"schema": RECORD_SCHEMA, "job": s.job, "step": 0, "rank": s.rank}
        header["coord"] = self._coord()
        header["node"] = s.node
        if s.nvlink_domain is not None:
            header["nvlink_domain"] = s.nvlink_domain
        if s.network_tier is not None:
            header["network_tier"] = s.network_tier
        gpu = s.gpu if s.gpu is not None else (s.local_rank if self.on_device else None)
        if gpu is not None:
            header["gpu"] = gpu
        return header

    def _send_control(self, event: str, **extra: Any) -> None:  # noqa: ANN401 - JSON-ready values
        s = self.settings
        self._sender.send(
            {
                "schema": CONTROL_SCHEMA,
                "event": event,
                "job": s.job,
                "rank": s.rank,
                "world_size": s.world_size,
                "pid": os.getpid(),
                "counters": self.counters().as_dict(),
                **extra,
            }
        )


def _storage_key(tensor: Tensor) -> int:
    """The address of ``tensor``'s storage, the key of a functional collective's output in flight.

    Its own address when it starts the storage: ``untyped_storage()`` builds a Python object per call, which costs
    several times more than ``data_ptr()`` inside a job.
    """
    if tensor.storage_offset():
        return tensor.untyped_storage().data_ptr()
    return tensor.data_ptr()


def _on_completion(work: Work, rec: list[Any], mark: Callable[[], Mark]) -> None:
    """End ``rec`` when ``work`` completes (at once if it has); backends without futures (gloo p2p) end at wait."""

    def done(_future: Future[object]) -> None:  # runs on a backend thread: the first end wins
        if rec[END] is None:
            rec[END] = mark()

    with contextlib.suppress(RuntimeError):
        work.get_future().then(done)


_ACTIVE_TRACKER: list[Tracker] = []


def tracker_from_env(environ: Mapping[str, str] | None = None) -> Tracker | NullTracker:
    """The tracker for this process, configured from the environment (see :mod:`meshscope.sdk.settings`).

    ``MESHSCOPE_DISABLE=1`` gives a :class:`NullTracker` (nothing patched, torch not even imported). Otherwise the
    first call starts a :class:`Tracker` (closed at interpreter exit) and later calls return the same one. Never
    raises: if the tracker cannot start, the failure is logged and a :class:`NullTracker` is returned.
    """
    from meshscope.sdk.settings import TrackerSettings  # noqa: PLC0415

    settings = TrackerSettings.from_env(environ)
    if settings.disabled:
        return NullTracker()
    if _ACTIVE_TRACKER and not _ACTIVE_TRACKER[0]._closed:  # noqa: SLF001
        return _ACTIVE_TRACKER[0]
    try:
        tracker = Tracker(settings)
    except Exception as exc:  # meshscope must never stop a training job from starting
        log.warning("meshscope: tracking disabled, the tracker could not start: %r", exc, exc_info=exc)
        return NullTracker()
    _ACTIVE_TRACKER[:] = [tracker]
    atexit.register(tracker.close)
    return tracker

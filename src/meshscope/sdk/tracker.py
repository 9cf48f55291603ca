"""The tracker: turns one rank's training steps into ``meshscope.step/1`` records and hands them to the transport.

Why it exists: the step breakdown needs, per rank and step, *when* the rank computed, loaded data, stepped the
optimizer and sat in which collective of which axis. A researcher adds a few lines (``tracker.step`` or
``tracker.start_step``, ``tracker.data(loader)``, ``tracker.phase``, ``tracker.data_stats``); everything else --
every collective, point-to-point op, attention call, DDP's tail wait, pipeline stage phases -- is captured by
:mod:`meshscope.sdk.capture` and reported to the tracker's operation log (:mod:`meshscope.sdk.operations`), which
appends it to the open step.

Between steps the tracker keeps time too: each record carries the gap since the rank's previous step ended and the
phases timed in it (``gap_before_us``, ``between_steps``), and a fetch made before its step opened (``tracker.data``)
is moved into that step. Step numbers are the loop's while they increase, renumbered (the loop's kept as
``user_step``) when they repeat, so ``(rank, step)`` stays unique.

The tracker's rooms: steps and phases (here), the operations of a step and their groups
(:class:`~meshscope.sdk.operations.Operations`), a step's intervals and its encoded record (:mod:`meshscope.sdk.steps`),
the one-off measurements (:class:`~meshscope.sdk.measurements.Measurements`, counted by :mod:`meshscope.sdk.measuring`)
and the transport (:mod:`meshscope.sdk.transport`).

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
import logging
import math
import operator
import os
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final, Generic, TypeAlias, TypeVar

from meshscope.errors import LayoutError
from meshscope.sdk.groups import axis_of_name
from meshscope.sdk.measurements import Measurements
from meshscope.sdk.operations import Operations
from meshscope.sdk.steps import (
    BETWEEN_COMM,
    COMPUTE,
    DATA,
    DEVICE_KINDS,
    END,
    MAX_RAISED_CHARS,
    OPTIMIZER,
    RecordHeader,
    RssPeak,
    SchedStat,
    StepIntervals,
    StepState,
    between_us,
    encode_record,
)
from meshscope.sdk.transport import CONTROL_SCHEMA, RECORD_SCHEMA, open_sender
from meshscope.topology import AXES, MeshAxis, ParallelLayout, layout_text

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping
    from types import TracebackType

    from meshscope.sdk.clocks import Mark
    from meshscope.sdk.settings import TrackerSettings

log = logging.getLogger("meshscope.sdk")
_perf_ns = time.perf_counter_ns
_T = TypeVar("_T")

StretchMark: TypeAlias = "tuple[int, tuple[int, int] | None, int]"
""":meth:`Tracker._mark_now`: host ns, the :class:`SchedStat` reading, the ns timed between steps so far."""

_IN_STEP, _HELD, _BOUNDARY = 0, 1, 2
"""What a fetch of :meth:`Tracker.data` is when it begins: the open step's ``data`` phase, held for the step opened
next (no step open), or a :class:`_Boundary` fetch of the iterator that fed the open step."""

MAX_DEFERRED_STEPS: Final = 4
"""Steps a record may wait for its operations to complete before they are left out (and counted)."""
ACTIVATION_STEPS: Final = 2
"""Steps (the first ones) in which :meth:`Tracker.saved_activations` scopes count; later scopes cost nothing."""

PHASES: Final[dict[str, tuple[str, str | None]]] = {
    "data": ("data", None),
    "forward": ("compute", "forward"),
    "backward": ("compute", "backward"),
    "recompute": ("compute", "recompute"),
    "compute": ("compute", None),
    "optimizer": ("optimizer", None),
    "checkpoint": ("checkpoint", None),
    "eval": ("compute", None),
}
"""Phase names :meth:`Tracker.phase` accepts -> (interval kind, compute phase). ``compute`` is compute of unknown
phase, and so is ``eval`` inside a step; the innermost phase wins where phases nest."""
BETWEEN_KIND_OF_PHASE: Final[dict[str, str]] = {
    "data": "data",
    "forward": "compute",
    "backward": "compute",
    "recompute": "compute",
    "compute": "compute",
    "optimizer": "optimizer",
    "checkpoint": "checkpoint",
    "eval": "eval",
}
"""Phase name -> its key in a record's ``between_steps`` when the phase runs between two steps."""


def _trains(kind: str, between: str) -> bool:
    """Whether a phase of interval ``kind`` (``between_steps`` key ``between``) is training compute.

    Such a phase declares its step's compute (``StepState.declared_compute``); ``eval`` is compute but not training.
    """
    return kind == COMPUTE and between != "eval"


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
    """Operations (and, on a GPU, phase pieces) left out of a record because their device work had not completed
    :data:`MAX_DEFERRED_STEPS` steps later."""
    phases_outside_step: int = 0
    """Phases entered while no step was open (timed into the next record's ``between_steps``)."""
    uncaptured_ddp: int = 0
    """DDP models that got a comm hook of the user's before the tracker started (a reducer takes one hook, once): the
    reducer's wait for their buckets is not timed, and a builtin hook's all-reduces are not captured at all."""
    unmatched_end_steps: int = 0
    """:meth:`Tracker.end_step` calls while no step was open (ignored)."""
    compiled_graphs: int = 0
    """Graphs ``torch.compile`` built in this process (Dynamo's own count): what compiled code runs is captured where
    it calls its collectives and attention kernels from Python (docs/sdk.md §4.6)."""
    background_ops: int = 0
    """Collectives issued by a thread that neither runs the steps nor executes a backward pass (an asynchronous
    checkpoint's writer, a logging thread): they block no step, so they are counted, not recorded."""

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain mapping (the ``sdk`` object of a record)."""
        return {
            "records_sent": self.records_sent,
            "records_dropped": self.records_dropped,
            "hook_errors": self.hook_errors,
            "unattributed_ops": self.unattributed_ops,
            "incomplete_ops": self.incomplete_ops,
            "phases_outside_step": self.phases_outside_step,
            "uncaptured_ddp": self.uncaptured_ddp,
            "unmatched_end_steps": self.unmatched_end_steps,
            "compiled_graphs": self.compiled_graphs,
            "background_ops": self.background_ops,
        }


def _compiled_graphs() -> int:
    """Graphs ``torch.compile`` built in this process so far (Dynamo's ``unique_graphs``; 0 where it never ran)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    try:
        return int(utils.counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a torch that counts otherwise: not known, not fatal
        return 0


class _Frame:
    """An open phase on the phase stack.

    In a step (``step`` set) ``seg_start`` is a mark of the piece the frame owns; between steps (``step`` is
    ``None``) it is host ``perf_counter_ns``, and the pieces are timed under ``between`` (a ``between_steps`` key).
    ``seg_rq`` is the training thread's run delay (ns) when the piece began (:meth:`Tracker._run_delay`).
    """

    __slots__ = ("between", "declares", "kind", "phase", "seg_rq", "seg_start", "step")

    def __init__(
        self,
        kind: str,
        phase: str | None,
        between: str,
        seg_start: Mark,
        step: StepState | None,
        *,
        seg_rq: int,
        declares: bool = True,
    ) -> None:
        self.kind = kind
        self.phase = phase
        self.between = between
        self.seg_start = seg_start
        self.step = step
        self.seg_rq = seg_rq
        self.declares = declares
        """Whether the script opened it: a training compute phase it opened declares its step's compute; one the SDK
        opens by itself (a pipelining stage's forward) labels time and declares nothing (:meth:`Tracker._push`)."""


class _Boundary:
    """A fetch of the iterator that fed the open :meth:`Tracker.start_step` step, made while that step is open.

    It is the next step's fetch (``for batch in tracker.data(loader): tracker.start_step()``) when the body calls
    ``start_step`` next with nothing in between; then the open step ends where the fetch began and the fetch goes to
    the step it opens. Anything else first (a phase, a collective, attention, another fetch) makes it the open step's
    own fetch: a loop that opens a step every k batches (gradient accumulation over the loader's micro-batches).
    """

    __slots__ = ("after", "attention", "ops", "rq_ns", "sched_ns", "segments", "source", "start_ns", "windows")

    def __init__(self, source: object, start_ns: int, sched_ns: tuple[int, int] | None, st: StepState) -> None:
        self.source = source
        self.start_ns = start_ns
        self.sched_ns = sched_ns
        """The training thread's time on a CPU and run delay when the fetch began."""
        self.segments, self.ops, self.windows, self.attention = (
            len(st.segments),
            len(st.ops),
            len(st.windows),
            len(st.attention),
        )
        """Where the fetch's own pieces begin in the open step's lists (moved to the next step with it)."""
        self.rq_ns = (st.phased_rq_ns, st.compute_rq_ns, st.data_rq_ns, st.optimizer_rq_ns)
        """The step's run delay in phases, in compute, data and optimizer phases then (the fetch's own goes with
        it)."""
        self.after: tuple[int, ...] | None = None
        """The lists' lengths and the phase stack's depth when the (last) fetch ended: unchanged = nothing since."""


class _PhaseContext:
    """Reusable context manager of one phase name (stateless: the stack lives on the tracker)."""

    __slots__ = ("between", "declares", "kind", "phase", "tracker")

    def __init__(self, tracker: Tracker, kind: str, phase: str | None, between: str, *, declares: bool = True) -> None:
        self.tracker = tracker
        self.kind = kind
        self.phase = phase
        self.between = between
        self.declares = declares

    def __enter__(self) -> None:
        try:
            self.tracker._push(self.kind, self.phase, self.between, declares=self.declares)  # noqa: SLF001 - the context is the tracker's own helper
        except Exception as exc:  # noqa: BLE001
            self.tracker.fault("phase", exc)

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.tracker._pop()  # noqa: SLF001
        except Exception as exc:  # noqa: BLE001
            self.tracker.fault("phase", exc)


def _type_name(exc_type: type[BaseException]) -> str:
    """An exception type as the record's ``raised`` names it: ``RuntimeError``, ``torch.OutOfMemoryError``."""
    module = getattr(exc_type, "__module__", "") or ""
    name = getattr(exc_type, "__qualname__", None) or exc_type.__name__
    full = name if module in {"builtins", ""} else f"{module}.{name}"
    return full[:MAX_RAISED_CHARS] or "Exception"


class _StepContext:
    __slots__ = ("opened", "step", "tracker")

    def __init__(self, tracker: Tracker, step: int | None) -> None:
        self.tracker = tracker
        self.step = step
        self.opened: StepState | None = None

    def __enter__(self) -> None:
        try:
            self.opened = self.tracker._start_step(self.step, explicit=False)  # noqa: SLF001
        except Exception as exc:  # noqa: BLE001
            self.tracker.fault("step start", exc)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            # Only the step this context opened (a nested one that failed to open, or one already ended by
            # ``start_step`` inside the block, leaves the open step alone).
            if self.opened is not None and self.tracker._step is self.opened:  # noqa: SLF001
                if exc_type is not None:  # cut short: the record says so, and the readers leave it out
                    self.opened.raised = _type_name(exc_type)
                self.tracker._end_step()  # noqa: SLF001
        except Exception as err:  # noqa: BLE001
            self.tracker.fault("step end", err)
        self.opened = None


class _DataIterator(Generic[_T]):
    """Iterates a loader, timing each ``next()`` as the ``data`` phase of the step the batch is for.

    A fetch while no step is open is held and given to the next step that opens: that step starts where the fetch
    started and carries it as its ``data`` interval (so ``for batch in tracker.data(loader): with tracker.step():``
    charges every fetch to the step that consumes its batch). A fetch inside an open step is that step's ``data``
    phase, except in the loop ``for batch in tracker.data(loader): tracker.start_step()``: when a step that
    :meth:`Tracker.start_step` opened right after a fetch of this iterator is still open at this iterator's next
    fetch, and the body calls ``start_step`` (or ``end_step``) next with nothing in between, the step ends where that
    fetch started, since the fetch was for the next step; the loader's end ends the last step the same way. When
    anything else comes first (a phase, a collective, another fetch: a loop that opens a step every k batches), the
    fetch was the open step's own (:class:`_Boundary`).
    """

    __slots__ = ("_it", "_tracker")

    def __init__(self, tracker: Tracker, it: Iterator[_T]) -> None:
        self._tracker = tracker
        self._it = it

    def __iter__(self) -> _DataIterator[_T]:
        return self

    def __next__(self) -> _T:
        tracker = self._tracker
        try:
            token = tracker._fetch_begin(self)  # noqa: SLF001
        except Exception as exc:  # noqa: BLE001
            tracker.fault("data", exc)
            token = None
        try:
            batch = next(self._it)
        except BaseException:  # StopIteration and the loader's own errors go on to the loop unchanged
            tracker._fetch_end(token, failed=True)  # noqa: SLF001
            raise
        tracker._fetch_end(token, failed=False)  # noqa: SLF001
        return batch


class _Data(Generic[_T]):
    """What :meth:`Tracker.data` returns: an iterable like the loader (each ``iter()`` starts the loader anew)."""

    __slots__ = ("_loader", "_tracker")

    def __init__(self, tracker: Tracker, loader: Iterable[_T]) -> None:
        self._tracker = tracker
        self._loader = loader

    def __iter__(self) -> _DataIterator[_T]:
        return _DataIterator(self._tracker, iter(self._loader))

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]  # TypeError, as len() of the loader itself

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401 - whatever the loader holds
        # The rest is the loader's, as with the tracker off (``data()`` returns the loader itself): scripts keep the
        # wrapper and call ``loader.sampler.set_epoch(epoch)``, read ``loader.dataset`` or ``loader.batch_size``.
        if name in _Data.__slots__:  # not set yet (copy, pickle): never look for it in a loader that is not there
            raise AttributeError(name)
        return getattr(self._loader, name)


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

    def step(self, step: int | None = None) -> _NullContext:  # noqa: ARG002 - same signature as the real tracker
        """A context that does nothing."""
        return _NULL_CONTEXT

    def start_step(self, step: int | None = None) -> None:
        """Do nothing."""

    def end_step(self) -> None:
        """Do nothing."""

    @property
    def in_step(self) -> bool:
        """Always ``False``."""
        return False

    def data(self, loader: Iterable[_T]) -> Iterable[_T]:
        """The loader itself."""
        return loader

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

    def __init__(self, settings: TrackerSettings) -> None:  # noqa: PLR0915 - the state, each with its docstring
        """Start tracking: open the transport, install the capture patches, say hello to the collector.

        Args:
            settings: who this rank is and where records go (:meth:`TrackerSettings.from_env`).
        """
        import torch  # noqa: PLC0415 - the SDK imports torch only when a real tracker starts
        import torch.distributed as dist  # noqa: PLC0415

        from meshscope.sdk import capture  # noqa: PLC0415

        self._torch = torch
        self._capture = capture
        self.settings = settings
        self._faults: dict[str, int] = {}
        self._ops = Operations(
            settings,
            dist,
            phase=self._label,
            fault=self.fault,
            checkpointing=self._checkpointing,
            fetching=self._fetching,
        )
        """What the capture patches report to; holds the open step and the clock."""
        self._clock_chosen = False
        self._sender = open_sender(settings.collector, lambda: self.settings.rank)
        self._sent = 0
        self._dropped = 0
        self._incomplete = 0
        self._outside = 0
        self._steps_finished = 0
        self._stack: list[_Frame] = []
        self._pending: list[StepState] = []
        self._head: RecordHeader | None = None
        self._attempt_start_us = time.time_ns() // 1000
        """When this tracker began (host wall-clock µs), in every record: a restarted or resumed job's new process
        is a new attempt of its rank, even where its step numbers go on from the last attempt's (docs/records.md)."""
        self._phase_contexts = {
            name: _PhaseContext(self, kind, ph, BETWEEN_KIND_OF_PHASE[name]) for name, (kind, ph) in PHASES.items()
        }
        self._labels = {
            name: _PhaseContext(self, kind, ph, BETWEEN_KIND_OF_PHASE[name], declares=False)
            for name, (kind, ph) in PHASES.items()
        }
        """Phases the SDK opens by itself (:meth:`_label`)."""
        self._last_step: int | None = None
        """The previous record's step number (numbering, :meth:`_number`)."""
        self._prev_end_ns: int | None = None
        """Host ns at which the previous step ended (``None`` before the first)."""
        self._between_ns: dict[str, int] = {}
        """Phases timed since the previous step ended (before any pending fetch), ns per ``between_steps`` key."""
        self._pre_step: list[tuple[str, str, str | None, int, int]] = []
        """Pieces (between key, kind, phase, start ns, end ns) since the first pending fetch: the next step's."""
        self._pre_step_rq = [0, 0, 0, 0]
        """The run delay in those pieces, and in their compute, data and optimizer pieces, ns
        (:attr:`StepState.phased_rq_ns`)."""
        self._fetch_ns: int | None = None
        """Start of the first fetch held for the next step (:class:`_DataIterator`), host ns."""
        self._fetch_from: object = None
        self._fed_by: object = None
        """The data iterator whose held fetch the open step took, when :meth:`start_step` opened it."""
        self._data_explicit = False
        """Whether the script times its own fetches (:meth:`data`, a Trainer's callback): ``DataLoader`` fetches are
        then left to it (:meth:`_fetching`)."""
        self._fetching_depth = 0
        """``DataLoader`` fetches under way (a dataset that reads another loader: the inner fetch is the outer's)."""
        self._fetched_inside: list[object] = [None, None]
        """The ``DataLoader`` iterator fetched inside the previous and the open step as its own ``data`` phase (or
        ``None``): a loop that fetches inside its steps gives them no held fetch of another (:meth:`_fetching`)."""
        self._unmatched_ends = 0
        self._ended_by_loader = False
        """The last step was ended by its loader's end (:meth:`_fetch_end`): the script's own ``end_step()`` after the
        loop ends that step, not an unmatched one."""
        self._step_thread = threading.get_ident()
        """The thread that runs the steps (where the tracker started, then the one that opened the last step)."""
        self._boundary: _Boundary | None = None
        """A fetch of the iterator that fed the open step, not yet known to be the next step's or this one's."""
        self._carried: tuple[list[Any], list[Any], list[Any]] | None = None
        """Operations, blocked windows and attention spans of a boundary fetch, for the step that takes it."""
        self._held_stats: StepState | None = None
        """Data statistics given after a held fetch (or a :class:`_Boundary` fetch), before its step opened (only
        the stats fields are used)."""
        self._mesh_coord: dict[str, int] = {}
        self._mesh_wins = False
        """The registered mesh's coordinates of its axes override the layout's (:meth:`_follow_the_mesh`)."""
        self._coord_cache: dict[str, int] | None = None
        self._rss = RssPeak()
        self._sched = SchedStat()
        self._fetch_sched_ns: tuple[int, int] | None = None
        """The training thread's time on a CPU and run delay when the held fetch began (the step that consumes it
        starts there)."""
        self._closed = False
        self._measurements = Measurements()
        for problem in settings.problems:
            log.warning("meshscope: %s", problem)
        self._optimizer_frames: list[tuple[int, _Frame | None]] = []
        """``optimizer.step()`` calls running now, outermost first: ``(id(optimizer), the optimizer phase opened for
        it)``, ``None`` where a phase was open already (the script's, or an outer optimizer's)."""
        self._optimizer_hooks: list[Any] = []
        capture.install(self._ops)
        self._hook_optimizers()
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
            self._ops.register(group, name, axis)

    def register_group(self, group: object, axis: MeshAxis | str, *, name: str | None = None) -> None:
        """Map one process group to ``axis`` explicitly (``name`` defaults to the axis; it prefixes the id)."""
        ax = MeshAxis(axis)
        self._ops.register(group, name or ax.value, ax)

    def register_mesh(self, mesh: Any) -> None:  # noqa: ANN401 - a DeviceMesh, typed loosely to keep torch lazy
        """Register every dim of a ``DeviceMesh`` under its dim name, and take this rank's coords from it.

        Dims named after an axis (or a combination such as ``dp_cp``) map to it; coords are taken from dims named
        exactly dp, tp, pp, cp, ep when no ``MESHSCOPE_LAYOUT`` was given, and where one was given but places ranks
        elsewhere than the mesh, the mesh's rank order wins (:meth:`_follow_the_mesh`).
        """
        try:
            names = tuple(mesh.mesh_dim_names or ())
            coordinate = mesh.get_coordinate()
            for i, name in enumerate(names):
                self.register_groups({name: mesh.get_group(name)})
                if coordinate is not None and name in {a.value for a in AXES}:
                    self._mesh_coord[name] = int(coordinate[i])
            if "dp" in names and "ep" in names and coordinate is not None:
                # Expert parallelism is carved out of dp (Megatron-core's, and the layout's, model): beside an ep dim
                # the mesh's dp dim is the expert-data-parallel one, and the rank's dense dp coordinate is
                # edp * ep_degree + ep (ep varies fastest inside dp).
                self._mesh_coord["dp"] = self._mesh_coord["dp"] * int(mesh.size(names.index("ep"))) + int(
                    coordinate[names.index("ep")]
                )
            self._follow_the_mesh(names, mesh.mesh.tolist())
            self._coord_cache = None
            self._head = None
        except Exception as exc:  # noqa: BLE001
            self.fault("register_mesh", exc)

    def _follow_the_mesh(self, names: tuple[str, ...], ranks: Any) -> None:  # noqa: ANN401 - nested lists of ints
        """Where the registered mesh places ranks elsewhere than the layout does, take the mesh's rank order.

        A ``DeviceMesh`` is row-major (its last dim varies fastest); the layout's rank order defaults to
        Megatron-core's (dp before pp). A script that builds ``init_device_mesh(..., ("dp", "pp"))`` under
        ``--layout pp=2,dp=2`` runs rank 1 as pipeline stage 1 while the layout says stage 0: its records carried
        the layout's coordinates, its p2p went on the dp axis, every finding compared ranks of different stages, and
        nothing said so. Every rank of the mesh decides alike from the whole mesh (``ranks``: its global ranks,
        nested as its dims): the layout takes the mesh's rank order where one fits, else the mesh's coordinates of
        its named axes win for this rank; each rank says it once, naming the first rank the layout misplaced and the
        ``order=`` that states the mesh's order.
        """
        s = self._ops.settings
        layout = s.layout
        axes = {a.value for a in AXES}
        if layout is None or not any(n in axes for n in names):
            return
        placed = _mesh_positions(ranks, len(names))
        if s.layout_implied and self._adopt_the_mesh(names, placed):
            return
        if "dp" in names and "ep" in names:
            self._follow_an_expert_mesh(layout, names, placed)
            return
        misplaced = next(
            (
                (rank, where)
                for rank, where in placed
                if 0 <= rank < layout.world_size
                and any(layout.coord(rank).as_dict()[n] != i for n, i in zip(names, where, strict=True) if n in axes)
            ),
            None,
        )
        if misplaced is None:
            return
        shape = _mesh_shape(placed, len(names))
        fitting = _layout_in_mesh_order(layout, names, shape)
        if fitting is not None and all(
            fitting.coord(rank).as_dict()[n] == i for rank, where in placed for n, i in zip(names, where, strict=True)
        ):
            self.settings = replace(s, layout=fitting)
            self._ops.relayout(self.settings)
            fix = f"the records take the mesh's rank order; give --layout {layout_text(fitting)} to state it"
        else:
            self._mesh_wins = True
            fix = "the records take the mesh's coordinates of its axes; give a --layout whose order= matches the mesh"
        rank, where = misplaced
        said = layout.coord(rank).as_dict()
        named = [(n, i) for n, i in zip(names, where, strict=True) if n in axes]
        log.warning(
            "meshscope: the registered DeviceMesh (dims %s) puts rank %d at %s, where the layout %s puts it at %s: %s",
            ", ".join(names),
            rank,
            ", ".join(f"{n}={i}" for n, i in named),
            layout_text(layout),
            ", ".join(f"{n}={said[n]}" for n, _ in named),
            fix,
        )

    def _adopt_the_mesh(self, names: tuple[str, ...], placed: list[tuple[int, tuple[int, ...]]]) -> bool:
        """Where the layout is a launcher's default (``meshscope run`` without ``--layout``), the mesh's is the job's.

        A mesh whose dims are all axes (``("dp", "tp")``; ep beside dp is left to the layout's rules) and hold every
        rank of the world defines the layout, in its rank order; every rank decides alike and says it once. The
        default, data parallelism over the world, put a 2 x 2 mesh's rank 1 at dp=1 and told the user to fix an
        ``order=`` of a layout they never gave.
        """
        s = self._ops.settings
        shape = _mesh_shape(placed, len(names))
        axes = {a.value for a in AXES}
        if not set(names) <= axes or "ep" in names or math.prod(shape) != s.world_size:
            return False
        try:
            degrees = ParallelLayout(**dict(zip(names, shape, strict=True)))  # type: ignore[arg-type]
        except (ValueError, TypeError):
            return False
        adopted = _layout_in_mesh_order(degrees, names, shape)
        if adopted is None or any(
            adopted.coord(rank).as_dict()[n] != i for rank, where in placed for n, i in zip(names, where, strict=True)
        ):
            return False
        self.settings = replace(s, layout=adopted, layout_implied=False)
        self._ops.relayout(self.settings)
        log.info("meshscope: no layout was given: the registered DeviceMesh's is the job's, %s", layout_text(adopted))
        return True

    def _follow_an_expert_mesh(
        self, layout: ParallelLayout, names: tuple[str, ...], placed: list[tuple[int, tuple[int, ...]]]
    ) -> None:
        """The check of :meth:`_follow_the_mesh` for a mesh with an ep dim beside a dp dim (its expert-dp dim).

        Its dp dim is not the layout's dp (4 ranks of ``dp=4,ep=2`` are a 2 x 2 mesh of ``("dp", "ep")``), so its
        groups are held to the layout's: each of its dims' groups (the ranks that differ along that dim only) must
        be the layout's group of that axis, its dp groups the layout's expert-data-parallel ones. Where they are,
        the layout's coordinates stand; where not, the records take the mesh's (dp as ``edp * ep + ep``: ep inside
        dp) and every rank says so once, with the first group that differs.
        """
        axes = {a.value for a in AXES}
        for d, name in enumerate(names):
            if name not in axes:
                continue
            rows: dict[tuple[int, ...], list[int]] = {}
            for rank, where in placed:
                rows.setdefault(where[:d] + where[d + 1 :], []).append(rank)
            for members in rows.values():
                if not all(0 <= r < layout.world_size for r in members):
                    continue
                try:
                    want = layout.group_of(members[0], name, expert=name in {"dp", "ep"})
                except LayoutError:
                    want = ()
                if sorted(want) != sorted(members):
                    self._mesh_wins = True
                    log.warning(
                        "meshscope: the registered DeviceMesh (dims %s) groups ranks %s along %s, where the layout %s "
                        "groups %s%s: the records take the mesh's coordinates of its axes",
                        ", ".join(names),
                        members,
                        name,
                        layout_text(layout),
                        list(want),
                        " (its expert-data-parallel group)" if name == "dp" else "",
                    )
                    return

    def step(self, step: int | None = None) -> _StepContext:
        """Context manager around one training step; its record is sent when it ends (one step late on GPU).

        Args:
            step: the loop's step number (an integer >= 0), or ``None`` for the next one. The record's ``step`` is
                this number while the numbers increase; a number that repeats or goes backwards (a count that
                restarts every epoch) gets the next free one, and the loop's number is kept as ``user_step``.
        """
        return _StepContext(self, step)

    def start_step(self, step: int | None = None) -> None:
        """Start a step without a ``with`` block; a step still open is ended first (the loop's top is enough).

        Same numbering and record as :meth:`step`. ``while True: tracker.start_step(); ...`` records every pass of
        the body; the last step ends at :meth:`end_step`, the next ``start_step``, the end of a
        :meth:`data` loop, or :meth:`close`. Never raises.
        """
        try:
            if self._ops.step is not None and not self._split_at_boundary():
                self._end_step()
            self._start_step(step, explicit=True)
        except Exception as exc:  # noqa: BLE001
            self.fault("step start", exc)

    def end_step(self) -> None:
        """End the open step (its record is sent as at the end of a ``with tracker.step()``).

        With no step open it does nothing but count (``unmatched_end_steps``). Never raises.
        """
        try:
            if self._ops.step is None:
                if self._ended_by_loader:  # `for batch in loader: start_step() ...` then `end_step()`: that step's
                    self._ended_by_loader = False
                    return
                self._unmatched_ends += 1
                return
            if not self._split_at_boundary():
                self._end_step()
        except Exception as exc:  # noqa: BLE001
            self.fault("step end", exc)

    def data(self, loader: Iterable[_T]) -> Iterable[_T]:
        """Wrap a data loader so that each batch's fetch is the ``data`` phase of the step that consumes it.

        ``for batch in tracker.data(loader):`` with ``with tracker.step():`` or ``tracker.start_step()`` at the top
        of the body: the fetch happens before the step opens, so it is held and the step opened next starts where
        the fetch started (:class:`_DataIterator` has the rules). ``len()`` is the loader's; each ``iter()`` iterates
        the loader anew (one wrapper serves every epoch). The loader's batches and exceptions pass unchanged.
        """
        self._data_explicit = True
        return _Data(self, loader)

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

        Between a :meth:`data` fetch and the step it opens (``for batch in tracker.data(loader):``, then
        ``data_stats`` before ``with tracker.step()``) the numbers are held for that step; otherwise, outside a step,
        they are ignored.

        Args:
            sequence_lengths: token count of every sequence (a list or a 1-D integer tensor). Gives tokens
                (the sum), sequences, the longest sequence and the attention work Σ s² (tokens²).
            tokens: tokens, when lengths are not at hand (adds to the step's count).
            sequences: sequences, when lengths are not at hand.
        """
        st = self._ops.step
        if st is None or self._boundary is not None:
            if st is None and self._fetch_ns is None:
                return
            if self._held_stats is None:
                self._held_stats = StepState(0, 0, None)
            st = self._held_stats
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
            self._measurements.fields["job"] = dict(description)
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

            self._measurements.fields["model_state"] = count_model_state(modules, optimizer)
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
        st = self._ops.step
        if st is None or self._steps_finished >= ACTIVATION_STEPS or self._closed:
            return _NULL_CONTEXT
        try:
            from meshscope.sdk.measuring import ActivationScope  # noqa: PLC0415

            return ActivationScope(module, self._measurements.activation_counter(name, st.step))
        except Exception as exc:  # noqa: BLE001
            self.fault("saved_activations", exc)
            return _NULL_CONTEXT

    def _send_measurements(self) -> None:
        self._send_control("measurements", measurements=self._measurements.payload())

    def _counters_dict(self) -> dict[str, int]:
        """:meth:`counters` as the ``sdk`` object of a record, without the dataclass (built every step)."""
        return {
            "records_sent": self._sent,
            "records_dropped": self._dropped,
            "hook_errors": sum(self._faults.values()),
            "unattributed_ops": self._ops.unattributed,
            "incomplete_ops": self._incomplete,
            "phases_outside_step": self._outside,
            "uncaptured_ddp": self._ops.uncaptured_ddp,
            "unmatched_end_steps": self._unmatched_ends,
            "compiled_graphs": _compiled_graphs(),
            "background_ops": self._ops.background,
        }

    def counters(self) -> TrackerCounters:
        """A snapshot of the drop and failure counters."""
        return TrackerCounters(
            records_sent=self._sent,
            records_dropped=self._dropped,
            hook_errors=sum(self._faults.values()),
            unattributed_ops=self._ops.unattributed,
            incomplete_ops=self._incomplete,
            phases_outside_step=self._outside,
            uncaptured_ddp=self._ops.uncaptured_ddp,
            unmatched_end_steps=self._unmatched_ends,
            compiled_graphs=_compiled_graphs(),
            background_ops=self._ops.background,
        )

    def _cut_short(self, exc_type: type[BaseException]) -> None:
        """The open step was cut short by an exception of ``exc_type`` (its record's ``raised``).

        For a framework's callback that hears of the exception (Lightning's ``on_exception``) before it ends the step.
        """
        st = self._ops.step
        if st is not None:
            st.raised = _type_name(exc_type)

    def close_at_exit(self) -> None:
        """:meth:`close` as the interpreter exits (atexit): a step still open when the program died of an exception.

        An exception that ended the program (``sys.last_exc``, ``sys.last_value`` before Python 3.12: set by the
        interpreter, and by ``meshscope run``'s fork launcher, for an exception nothing caught) cut the open step
        short: its record says so (``raised``), as a ``with tracker.step()`` block left by one does. A loop of
        :meth:`start_step` and the Trainer callbacks have no block to see it leave.
        """
        with contextlib.suppress(Exception):
            st = self._ops.step
            died_of = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
            if st is not None and isinstance(died_of, BaseException) and not isinstance(died_of, SystemExit):
                st.raised = _type_name(type(died_of))
        self.close()

    def close(self) -> None:
        """Finish an open step, send what is pending, say goodbye, remove the patches. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._ops.step is not None and not self._split_at_boundary():
                self._end_step()
            self._flush(final=True)
            if self._measurements:
                self._send_measurements()
        except Exception as exc:  # noqa: BLE001
            self.fault("close", exc)
        after = self._after_last_step()
        with contextlib.suppress(Exception):
            if not self._ops.identity_known:
                self._ops.take_identity()  # a process group still up at close, never seen at a step
            self._send_control("close", process_group_size=self._ops.group_size, **after)
        with contextlib.suppress(Exception):
            self._capture.uninstall()
        for handle in self._optimizer_hooks:
            with contextlib.suppress(Exception):
                handle.remove()
        self._sender.close()
        self._rss.close()
        self._sched.close()

    def _after_last_step(self) -> dict[str, Any]:
        """The close message's ``after_last_step_us`` and ``after_last_step``.

        The time since the last step ended (host clock), and what of it phases timed, per ``between_steps`` key
        (``comm`` as there): a final save or evaluation after the loop is in no record. Empty where no step ended.
        """
        try:
            if self._prev_end_ns is None or self._ops.step is not None:
                return {}
            now = time.perf_counter_ns()
            timed = dict(self._between_ns)
            for between, _, _, a, b in self._pre_step:  # a fetch held for a step that never came
                timed[between] = timed.get(between, 0) + (b - a)
            blocked = self._ops.between_comm_ns + self._ops.held_comm_ns
            if blocked:
                timed[BETWEEN_COMM] = blocked
            return {"after_last_step_us": max(0, now - self._prev_end_ns) // 1000, "after_last_step": between_us(timed)}
        except Exception as exc:  # noqa: BLE001 - never raises
            self.fault("close", exc)
            return {}

    @property
    def in_step(self) -> bool:
        """Whether a step is open."""
        return self._ops.step is not None

    @property
    def on_device(self) -> bool:
        """Whether marks of device work are CUDA events (``False``: everything is host time)."""
        return self._ops.on_device

    @property
    def _step(self) -> StepState | None:
        """The open step (held by the operation log, which the capture patches append to)."""
        return self._ops.step

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

    def _choose_clock(self) -> None:
        self._clock_chosen = True
        torch = self._torch
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                from meshscope.sdk.clocks import CudaClock  # noqa: PLC0415

                self._ops.use_device_clock(CudaClock(torch))
                self._head = None  # the record's gpu field follows LOCAL_RANK on CUDA
        except Exception as exc:  # noqa: BLE001
            self.fault("cuda clock", exc)

    # ------------------------------------------------------------------ groups

    # ------------------------------------------------------------------ steps and phases

    def _number(self, step: int | None) -> tuple[int, int | None]:
        """The record's step number and the loop's own number where it differs (``user_step``).

        The loop's number is kept while the numbers increase (a resumed job may start at 1000); one that repeats or
        goes backwards gets the previous record's number + 1, so ``(rank, step)`` stays unique. Every rank that makes
        the same calls gets the same numbers.
        """
        last = self._last_step
        following = 0 if last is None else last + 1
        if step is None:
            return following, None
        try:
            n = operator.index(step)
            if n < 0:
                raise ValueError(f"step {n} is below 0")  # noqa: TRY301 - one handler for every bad number
        except (TypeError, ValueError) as exc:
            self.fault("step number", exc)
            return following, None
        if last is None or n > last:
            return n, None
        return following, n

    def _start_step(self, step: int | None, *, explicit: bool) -> StepState | None:
        if self._closed:
            return None
        ops = self._ops
        if ops.step is not None:
            self.fault("step", RuntimeError(f"step {step} opened inside step {ops.step.step}; ignored"))
            return None
        if not self._clock_chosen:
            self._choose_clock()
        if not ops.identity_known:
            ops.take_identity()
        number, user_step = self._number(step)
        self._last_step = number
        self._ended_by_loader = False
        self._capture.patch_loaded_modules()
        self._capture.reset_attention_depth()
        self._step_thread = ops.step_thread = threading.get_ident()
        ops.clock.on_step_start(self._steps_finished)
        self._reset_peak_memory()
        now = _perf_ns()
        stack = self._stack
        rq = self._run_delay() if stack else -1
        if stack and stack[-1].step is None:  # a phase open since before the step: its time until now
            self._between_piece(stack[-1], now, rq)
        self._settle_loader_hold()
        st = StepState(number, now if self._fetch_ns is None else self._fetch_ns, ops.device_mark(now))
        st.sched_ns = self._sched.read() if self._fetch_ns is None else self._fetch_sched_ns
        if not ops.on_device:
            st.phased_rq_ns = 0
        st.user_step = user_step
        st.declared_compute = False  # until a training compute phase owns time in it
        self._take_between(st, explicit=explicit)
        ops.step = st
        for frame in stack:  # phases opened before the step count from its start
            if frame.step is None:
                frame.step, frame.seg_start, frame.seg_rq = st, self._mark_for(frame.kind, now), rq
                if frame.declares and _trains(frame.kind, frame.between):
                    st.declared_compute = True
        return st

    def _settle_loader_hold(self) -> None:
        """As a step opens: a held ``DataLoader`` fetch is let go where the previous step fetched another inside."""
        inside = self._fetched_inside = [self._fetched_inside[1], None]
        if inside[0] is not None and self._fetch_ns is not None and self._fetch_from is not inside[0]:
            self._release_held()  # the loop fetches inside its steps: another loader's fetch since is not this one's

    def _reset_peak_memory(self) -> None:
        """Start the step's peak memory: the device's allocator's, or on the host the resident set's."""
        if self._ops.on_device:
            self._torch.cuda.reset_peak_memory_stats()
        else:
            self._rss.reset()

    def _take_between(self, st: StepState, *, explicit: bool) -> None:
        """Give the step opening now what happened since the previous one: its gap, a held fetch and its stats."""
        if self._prev_end_ns is not None:
            st.gap_ns = max(0, st.start_ns - self._prev_end_ns)
            st.between_ns = self._between_ns
            if self._ops.between_comm_ns:
                st.between_ns[BETWEEN_COMM] = self._ops.between_comm_ns
        self._between_ns = {}
        self._ops.between_comm_ns = 0
        held = self._held_stats
        if held is not None:
            st.tokens, st.sequences, st.longest, st.work = held.tokens, held.sequences, held.longest, held.work
            self._held_stats = None
        if self._pre_step:  # what ran since the held fetch started belongs to this step (host marks)
            st.segments.extend((kind, phase, a, b) for _, kind, phase, a, b in self._pre_step)
            if any(_trains(kind, between) for between, kind, _, _, _ in self._pre_step):
                st.declared_compute = True
            self._pre_step = []
        if st.phased_rq_ns is not None:
            st.phased_rq_ns += self._pre_step_rq[0]
            st.compute_rq_ns += self._pre_step_rq[1]
            st.data_rq_ns += self._pre_step_rq[2]
            st.optimizer_rq_ns += self._pre_step_rq[3]
        self._pre_step_rq = [0, 0, 0, 0]
        carried: list[tuple[list[Any], list[Any], list[Any]]] = []
        if self._carried is not None:  # what a boundary fetch issued (a loader's own collectives) comes with it
            carried.append(self._carried)
            self._carried = None
        held = self._ops.held
        self._ops.held_comm_ns = 0  # blocked inside the held fetch: in this step, which starts where the fetch did
        if held is not None:  # and what a held fetch issued (the Trainer's gather of the batch's token count)
            self._ops.held = None
            carried.append((held.ops, held.windows, held.attention))
        for ops_, windows, attention in reversed(carried):
            st.ops[:0], st.windows[:0], st.attention[:0] = ops_, windows, attention
        self._fed_by = self._fetch_from if explicit and self._fetch_ns is not None else None
        self._fetch_ns = self._fetch_from = None

    def _end_step(self, now: int | None = None, sched_ns: tuple[int, int] | None = None) -> None:
        """End the open step at host ``now`` (default: now); ``sched_ns``: :class:`SchedStat` read then, if it was."""
        ops = self._ops
        st = ops.step
        if st is None:
            return
        if now is None:
            now = _perf_ns()
        if self._boundary is not None:  # a fetch that turned out to be this step's: its stats too
            self._boundary = None
            self._settle_held_stats(st)
        if st.sched_ns is not None and sched_ns is None:
            sched_ns = self._sched.read()
        rq = -1 if sched_ns is None or ops.on_device else sched_ns[1]
        self._close_optimizer_frames(None, now)  # an optimizer step() that raised: its phase ends with the step
        if self._stack and self._stack[-1].step is st:  # only the innermost open phase owns the time now
            top = self._stack[-1]
            st.segments.append((top.kind, top.phase, top.seg_start, self._mark_for(top.kind, now)))
            self._add_rq(st, top.kind, top.seg_rq, rq)
        for frame in self._stack:
            if frame.step is st:  # still open: timed between steps from now on
                frame.step, frame.seg_start, frame.seg_rq = None, now, rq
        ops.step = None
        self._prev_end_ns = now
        self._fed_by = None
        st.end_ns = now
        st.end_mark = ops.device_mark(now)
        if st.sched_ns is not None and sched_ns is not None:
            st.on_cpu_ns = max(0, sched_ns[0] - st.sched_ns[0])
            st.runqueue_wait_ns = max(0, sched_ns[1] - st.sched_ns[1])
        st.peak_memory_bytes = self._peak_memory()
        ops.end_unwaited(st)
        self._steps_finished += 1
        if self._steps_finished == ACTIVATION_STEPS and self._measurements.activations:
            self._send_measurements()
        st.finished_at = self._steps_finished
        self._pending.append(st)
        self._flush(final=False)

    # ------------------------------------------------------------------ optimizers

    def _hook_optimizers(self) -> None:
        """Time every ``torch.optim`` optimizer's ``step()`` as an ``optimizer`` phase, phases declared or not.

        PyTorch's global optimizer step hooks (``register_optimizer_step_pre_hook`` / ``_post_hook``) run around the
        ``step()`` of every optimizer built on ``torch.optim.Optimizer``, unless given a closure (which runs forward
        and backward inside the step). Only where no phase is open: inside one
        (``tracker.phase("optimizer")``, the Trainer callbacks' phases, which Lightning's ``step(closure)`` runs
        forward and backward in, an optimizer stepping an inner one such as ``ZeroRedundancyOptimizer``) the phases
        the script opened decide, and a phase opened here could be closed by the script's next exit.
        """
        try:
            from torch.optim.optimizer import (  # noqa: PLC0415
                register_optimizer_step_post_hook,
                register_optimizer_step_pre_hook,
            )

            self._optimizer_hooks = [
                register_optimizer_step_pre_hook(self._optimizer_begins),
                register_optimizer_step_post_hook(self._optimizer_ends),
            ]
        except Exception as exc:  # noqa: BLE001
            self.fault("optimizer hooks", exc)

    def _optimizer_begins(self, optimizer: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            if self._closed or self._capture.compiling():
                return
            key = id(optimizer)
            frames = self._optimizer_frames
            if any(k == key for k, _ in frames):  # its previous step() raised: what was opened for it is over
                self._close_optimizer_frames(key)
            stack = self._stack
            # step(closure) runs the model's forward and backward inside (LBFGS, SAM-style optimizers): not the
            # optimizer's own time, which cannot be told apart from it here
            # (the hooks get step()'s own arguments, the optimizer first)
            closure = kwargs.get("closure") if kwargs else (args[1] if len(args) > 1 else None)
            if stack or closure is not None:
                frames.append((key, None))
                return
            self._push(OPTIMIZER, None, BETWEEN_KIND_OF_PHASE["optimizer"], count=False)
            frames.append((key, stack[-1]))
        except Exception as exc:  # noqa: BLE001 - never into the training loop
            self.fault("optimizer phase", exc)

    def _checkpointing(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # noqa: ANN401
        """Run a checkpoint function (``torch.save``, ``torch.distributed.checkpoint``'s) as the checkpoint phase.

        Only where no phase is open and on the thread that runs the steps, as the optimizer's phase: inside a phase
        (the script's own ``checkpoint`` phase, DCP's writers calling ``torch.save``) the open phases decide, and a
        save on another thread (an asynchronous checkpoint's writer) blocks no step. Between steps its time goes to
        the next record's ``between_steps["checkpoint"]``.
        """
        frame = None
        try:
            if not self._closed and not self._stack and threading.get_ident() == self._step_thread:
                self._push("checkpoint", None, BETWEEN_KIND_OF_PHASE["checkpoint"], count=False)
                frame = self._stack[-1]
        except Exception as exc:  # noqa: BLE001 - never into the training loop
            self.fault("checkpoint phase", exc)
        try:
            return fn(*args, **kwargs)
        finally:
            if frame is not None:
                try:
                    if self._stack and self._stack[-1] is frame:
                        self._pop()
                except Exception as exc:  # noqa: BLE001
                    self.fault("checkpoint phase", exc)

    def _optimizer_ends(self, optimizer: object, _args: object, _kwargs: object) -> None:
        try:
            if self._optimizer_frames and self._optimizer_frames[-1][0] == id(optimizer):
                self._close_optimizer_frames(id(optimizer))
        except Exception as exc:  # noqa: BLE001
            self.fault("optimizer phase", exc)

    def _close_optimizer_frames(self, key: int | None, now: int | None = None) -> None:
        """Close the optimizer phases opened for ``key`` and every one opened after it (``None``: all of them).

        At host ``now`` (default: now).
        """
        frames = self._optimizer_frames
        while frames:
            k, frame = frames.pop()
            if frame is not None and self._stack and self._stack[-1] is frame:
                self._pop(now)
            if k == key:
                return

    def _run_delay(self) -> int:
        """The training thread's run delay so far, ns; -1 where not measured (on a GPU, no ``schedstat``)."""
        return -1 if self._ops.on_device else self._sched.run_delay()

    @staticmethod
    def _add_rq(st: StepState, kind: str, since: int, now: int) -> None:
        """A piece of ``kind`` closed in ``st``: the run delay from ``since`` to ``now`` (ns, -1 unknown) was in it."""
        if st.phased_rq_ns is not None and 0 <= since <= now:
            st.phased_rq_ns += now - since
            if kind == COMPUTE:
                st.compute_rq_ns += now - since
            elif kind == DATA:
                st.data_rq_ns += now - since
            elif kind == OPTIMIZER:
                st.optimizer_rq_ns += now - since

    def _between_piece(self, frame: _Frame, now: int, rq: int) -> None:
        """The piece ``frame`` owned between steps, from its ``seg_start`` (host ns) to ``now``; run delay ``rq``."""
        if self._fetch_ns is not None:
            self._pre_step.append((frame.between, frame.kind, frame.phase, frame.seg_start, now))
            if 0 <= frame.seg_rq <= rq:
                self._pre_step_rq[0] += rq - frame.seg_rq
                if frame.kind == COMPUTE:
                    self._pre_step_rq[1] += rq - frame.seg_rq
                elif frame.kind == DATA:
                    self._pre_step_rq[2] += rq - frame.seg_rq
                elif frame.kind == OPTIMIZER:
                    self._pre_step_rq[3] += rq - frame.seg_rq
        else:
            self._between_ns[frame.between] = self._between_ns.get(frame.between, 0) + (now - frame.seg_start)

    def _label(self, name: str) -> _PhaseContext | _NullContext:
        """A phase the SDK opens by itself (a pipelining stage's forward and backward chunks).

        It names its time, as :meth:`phase` does, but does not declare the step's compute: a step whose script opened
        no training compute phase keeps its time outside phases as compute
        (:func:`~meshscope.sdk.steps.implicit_compute`). Before, a pipelining stage's labels made a loop that marks
        only its steps count its loss and its schedule's own code as ``other``.
        """
        return self._labels.get(name, _NULL_CONTEXT)

    def _push(
        self,
        kind: str,
        phase: str | None,
        between: str,
        now: int | None = None,
        *,
        count: bool = True,
        declares: bool = True,
    ) -> None:
        if now is None:
            now = _perf_ns()
        st = self._ops.step
        rq = self._run_delay()
        if st is None:
            if count:
                self._outside += 1
            if self._stack and self._stack[-1].step is None:
                self._between_piece(self._stack[-1], now, rq)
            self._stack.append(_Frame(kind, phase, between, now, None, seg_rq=rq, declares=declares))
            return
        if self._stack:
            top = self._stack[-1]
            if top.step is st:
                st.segments.append((top.kind, top.phase, top.seg_start, self._mark_for(top.kind, now)))
                self._add_rq(st, top.kind, top.seg_rq, rq)
        if declares and _trains(kind, between):
            st.declared_compute = True
        self._stack.append(_Frame(kind, phase, between, self._mark_for(kind, now), st, seg_rq=rq, declares=declares))

    def _pop(self, now: int | None = None) -> None:
        if not self._stack:
            return
        if now is None:
            now = _perf_ns()
        frame = self._stack.pop()
        st = self._ops.step
        rq = self._run_delay()
        if frame.step is None:  # between steps
            if st is None:
                self._between_piece(frame, now, rq)
                if self._stack and self._stack[-1].step is None:
                    self._stack[-1].seg_start, self._stack[-1].seg_rq = now, rq
            return
        if st is None or frame.step is not st:
            return
        st.segments.append((frame.kind, frame.phase, frame.seg_start, self._mark_for(frame.kind, now)))
        self._add_rq(st, frame.kind, frame.seg_rq, rq)
        if self._stack and self._stack[-1].step is st:
            top = self._stack[-1]
            top.seg_start, top.seg_rq = self._mark_for(top.kind, now), rq

    # ------------------------------------------------------------------ data loaders

    def _fetch_begin(self, source: object) -> int | None:
        """Before a fetch of ``source``: ``None`` (not timed), or :data:`_IN_STEP`, :data:`_HELD`, :data:`_BOUNDARY`."""
        if self._closed:
            return None
        now = _perf_ns()
        st = self._ops.step
        if st is not None:
            if self._fed_by is not source:
                self._push("data", None, "data", now)
                return _IN_STEP
            # the loop came back for a batch: the next step's, or (accumulation) this one's (_Boundary)
            b = self._boundary
            if b is not None and not self._quiet_since(b, st):
                self._boundary = None  # the earlier fetch was this step's own
                self._settle_held_stats(st)
                b = None
            self._push("data", None, "data", now)
            if b is None:
                self._boundary = _Boundary(source, now, self._sched.read(), st)
            return _BOUNDARY
        self._push("data", None, "data", now, count=False)
        if self._fetch_ns is None:
            self._fetch_ns, self._fetch_from = now, source
            self._fetch_sched_ns = self._sched.read()
        if self._ops.held is None:  # what the fetch issues (a Trainer's token-count gather) goes with it
            self._ops.held = StepState(0, now, None)
        return _HELD

    def _fetch_end(self, token: int | None, *, failed: bool) -> None:
        """After the fetch begun with ``token``; a failed one (the loader's end, its error) is no step's."""
        if token is None:
            return
        try:
            self._pop()
            if token == _BOUNDARY:
                pending, st = self._boundary, self._ops.step
                if pending is None or st is None:
                    return
                pending.after = self._lengths(st)
                if not failed:
                    return
                # the loader's end (or its error) ends the step where the fetch began; the fetch is no step's
                if not self._split_at_boundary():
                    self._boundary = None
                    self._settle_held_stats(st)
                    return
                self._carried = None
                self._ended_by_loader = True
            if token != _IN_STEP and failed:
                self._release_held()
        except Exception as exc:  # noqa: BLE001
            self.fault("data", exc)

    def _release_held(self) -> None:
        """The fetches held for the next step were no step's: their time goes back to the time between steps."""
        for between, _, _, a, b in self._pre_step:
            self._between_ns[between] = self._between_ns.get(between, 0) + (b - a)
        self._pre_step = []
        self._pre_step_rq = [0, 0, 0, 0]
        self._fetch_ns = self._fetch_from = None
        self._held_stats = None
        held, self._ops.held = self._ops.held, None
        self._ops.between_comm_ns += self._ops.held_comm_ns  # blocked in collectives between steps, then
        self._ops.held_comm_ns = 0
        if held is not None:  # its operations were no step's either
            self._ops.release(held)

    def _fetching(self, fetch: Callable[[Any], _T], it: object) -> _T:
        """A ``DataLoader`` iterator's ``next()`` (``fetch(it)``), timed as :meth:`data` times a fetch.

        So that ``for batch in loader:`` and ``batch = next(it)`` inside a step need no :meth:`data`: a batch's fetch
        is the ``data`` phase of the step that uses it, not compute, and not unlabelled time between steps. Only on
        the thread that runs the steps, and only while the script times no fetch of its own (:meth:`data` or a
        Trainer's callback decide then). A fetch held between steps is not the next step's when it was not the last
        loader's to fetch (an evaluation over a few batches of the validation loader, then the training loader's
        fetch), nor when the steps fetch their batches inside themselves (``next(it)`` under ``with tracker.step()``:
        what was fetched between two of them was an evaluation's); it is time between steps then, as ``data``.
        """
        token = None
        if (
            not self._data_explicit
            and not self._fetching_depth
            and not self._closed
            and threading.get_ident() == self._step_thread
        ):
            try:
                if self._fetch_ns is not None and self._fetch_from is not it and self._ops.step is None:
                    self._release_held()
                token = self._fetch_begin(it)
                if token == _IN_STEP:
                    self._fetched_inside[1] = it
            except Exception as exc:  # noqa: BLE001 - never into the training loop
                self.fault("data", exc)
                token = None
        if token is None:
            return fetch(it)
        self._fetching_depth += 1
        try:
            batch = fetch(it)
        except BaseException:  # StopIteration and the loader's own errors go on to the loop unchanged
            self._fetching_depth -= 1
            self._fetch_end(token, failed=True)
            raise
        self._fetching_depth -= 1
        self._fetch_end(token, failed=False)
        return batch

    def _mark_now(self) -> StretchMark:
        """Host ns, the training thread's time on a CPU and run delay, and the ns timed between steps so far, now.

        Where a stretch between steps begins that a caller names once it has ended (:meth:`_claim_between`,
        :meth:`_claim_fetch`).
        """
        return _perf_ns(), self._sched.read(), sum(self._between_ns.values())

    def _claim_between(self, kind: str, since: StretchMark) -> None:
        """The time from ``since`` (:meth:`_mark_now`) to now was ``kind`` (a ``between_steps`` key) between steps.

        For a caller that learns what a stretch was only when it ends (a Trainer's save after an evaluation). Less
        what phases timed between steps in that stretch (a ``torch.save`` inside it, the checkpoint phase by
        itself): counted once. Nothing happens when a step is open or a fetch is held: the time is theirs.
        """
        if self._ops.step is None and self._fetch_ns is None:
            timed = sum(self._between_ns.values()) - since[2]
            self._between_ns[kind] = self._between_ns.get(kind, 0) + max(0, _perf_ns() - since[0] - timed)

    def _claim_fetch(self, since: StretchMark, source: object) -> None:
        """The time from ``since`` (:meth:`_mark_now`) to now fetched the next step's batches.

        Held for that step, as a :meth:`data` fetch that began then. Nothing happens when a step is open or a fetch
        is held.
        """
        if self._closed or self._ops.step is not None or self._fetch_ns is not None:
            return
        start_ns, sched_ns, _ = since
        self._fetch_ns, self._fetch_from, self._fetch_sched_ns = start_ns, source, sched_ns
        self._pre_step.append(("data", "data", None, start_ns, _perf_ns()))
        rq = self._run_delay()
        if sched_ns is not None and 0 <= sched_ns[1] <= rq:
            self._pre_step_rq[0] += rq - sched_ns[1]
            self._pre_step_rq[2] += rq - sched_ns[1]

    def _lengths(self, st: StepState) -> tuple[int, ...]:
        return len(st.segments), len(st.ops), len(st.windows), len(st.attention), len(self._stack)

    def _quiet_since(self, b: _Boundary, st: StepState) -> bool:
        """Whether nothing but the boundary fetch (and ``data_stats``) happened in ``st`` since it began."""
        return b.after is not None and b.after == self._lengths(st)

    def _split_at_boundary(self) -> bool:
        """End the open step where a pending boundary fetch began, when nothing followed it; ``False``: no split.

        The fetch (its data interval, run delay, held stats, anything it issued) goes to the step opened next.
        """
        b, st = self._boundary, self._ops.step
        if b is None or st is None:
            return False
        if not self._quiet_since(b, st) or (self._stack and self._stack[-1].step is st):
            return False  # the step ends now, the fetch its own (_end_step settles it)
        self._boundary = None
        fetched = st.segments[b.segments :]
        self._carried = (st.ops[b.ops :], st.windows[b.windows :], st.attention[b.attention :])
        del st.segments[b.segments :], st.ops[b.ops :], st.windows[b.windows :], st.attention[b.attention :]
        phased_then, compute_then, data_then, optimizer_then = b.rq_ns
        if st.phased_rq_ns is not None and phased_then is not None:  # the fetch's run delay goes with it
            self._pre_step_rq = [
                st.phased_rq_ns - phased_then,
                st.compute_rq_ns - compute_then,
                st.data_rq_ns - data_then,
                st.optimizer_rq_ns - optimizer_then,
            ]
            st.phased_rq_ns, st.compute_rq_ns = phased_then, compute_then
            st.data_rq_ns, st.optimizer_rq_ns = data_then, optimizer_then
        self._end_step(b.start_ns, b.sched_ns)
        self._fetch_ns, self._fetch_from, self._fetch_sched_ns = b.start_ns, b.source, b.sched_ns
        self._pre_step.extend(("data", kind, phase, a, e) for kind, phase, a, e in fetched)
        return True

    @staticmethod
    def _add_stats(st: StepState, more: StepState) -> None:
        """Add the data statistics of ``more`` to ``st``'s (sums, and the longest sequence's maximum)."""
        if more.tokens is not None:
            st.tokens = (st.tokens or 0) + more.tokens
        if more.sequences is not None:
            st.sequences = (st.sequences or 0) + more.sequences
        if more.longest is not None:
            st.longest = max(st.longest or 0, more.longest)
        if more.work is not None:
            st.work = (st.work or 0.0) + more.work

    def _settle_held_stats(self, st: StepState) -> None:
        """Statistics held since a boundary fetch that turned out to be ``st``'s own: they are ``st``'s."""
        if self._held_stats is not None:
            self._add_stats(st, self._held_stats)
            self._held_stats = None

    def _mark_for(self, kind: str, now: int) -> Mark:
        return self._ops.device_mark(now) if kind in DEVICE_KINDS else now

    def _peak_memory(self) -> int | None:
        try:
            if self._ops.on_device:
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
                intervals = StepIntervals(st, self._ops.clock, device=self._ops.on_device)
                self._incomplete += intervals.incomplete
                data = encode_record(st, intervals, header=self._record_header(), sdk=self._counters_dict())
            except Exception as exc:  # noqa: BLE001
                self.fault("record", exc)
                continue
            finally:
                self._release(st)
            if self._sender.send_record(data):
                self._sent += 1
            else:
                self._dropped += 1

    def _release(self, st: StepState) -> None:
        """Forget a flushed step's operations; a failure there costs no record (this one's or a later step's)."""
        try:
            self._ops.release(st)
        except Exception as exc:  # noqa: BLE001
            self.fault("record", exc)

    def _ready(self, st: StepState) -> bool:
        if any(rec[END] is None for rec in st.ops) or any(w[1] is None for w in st.windows):
            return False
        if not self._ops.on_device:
            return True
        ready = self._ops.clock.ready
        return ready(st.end_mark) and all(ready(rec[END]) for rec in st.ops) and all(ready(w[1]) for w in st.windows)

    def _coord(self) -> dict[str, int]:
        if self._coord_cache is None:
            s = self.settings
            if s.layout is not None:
                coord = s.layout.coord(s.rank).as_dict()
                if self._mesh_wins:
                    coord.update(self._mesh_coord)
            elif self._mesh_coord:
                coord = {a.value: self._mesh_coord.get(a.value, 0) for a in AXES}
            else:
                coord = {a.value: 0 for a in AXES}
                coord["dp"] = s.rank
            self._coord_cache = coord
        return self._coord_cache

    def _record_header(self) -> RecordHeader:
        """The encoded identity fields; encoded again after what they depend on changed (a mesh, the CUDA clock)."""
        self._adopt_identity()
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
        gpu = s.gpu if s.gpu is not None else (s.local_rank if self._ops.on_device else None)
        if gpu is not None:
            header["gpu"] = gpu
        header["attempt_start_us"] = self._attempt_start_us
        return header

    def _adopt_identity(self) -> None:
        """Take the rank and world size the process group told (:meth:`Operations.take_identity`), once."""
        if self._ops.settings is self.settings:
            return
        self.settings = self._ops.settings
        self._head = self._coord_cache = None
        self._send_control("hello")  # the collector learns the rank it is

    def _send_control(self, event: str, **extra: Any) -> None:  # noqa: ANN401 - JSON-ready values
        self._adopt_identity()
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


_ACTIVE_TRACKER: list[Tracker] = []

EXIT_DRAIN_S: Final = 0.1
"""Seconds the process lets the backend's threads run at exit, before Python finalizes (:func:`_drain_at_exit`)."""
_DRAIN_REGISTERED = [False]


def _drain_at_exit() -> None:
    """At interpreter exit, before Python finalizes: let the backend's threads finish releasing collectives' work.

    PyTorch (2.13 here) keeps a Python object in the thread-local state a collective's work captures when it is
    issued inside a backward pass (the autograd engine's stashed ``contextvars`` context), and runs Python future
    callbacks (a Python DDP comm hook, as the SDK installs to time the buckets) on the backend's threads. A work whose
    last reference goes on such a thread after the main thread began finalizing needs the GIL there; Python ends that
    thread, its C++ unwind aborts the process ("terminate called without an active exception", exit code -6: torchrun
    reports the rank failed). A 2-rank gloo DDP loop with PyTorch's own Python ``allreduce_hook`` and no meshscope did
    so in 1 of 30 runs; with the SDK's hook, 3 of 20 (a barrier right before exit). Sleeping here releases the GIL
    while Python still runs threads, so that the works the backend has finished with are released in time.
    """
    deadline = time.monotonic() + EXIT_DRAIN_S
    while time.monotonic() < deadline:
        time.sleep(0.005)


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
    if not _DRAIN_REGISTERED[0]:  # registered before the close: atexit runs last-in first, the close first
        _DRAIN_REGISTERED[0] = True
        atexit.register(_drain_at_exit)
    atexit.register(tracker.close_at_exit)
    return tracker


def _layout_in_mesh_order(
    layout: ParallelLayout, names: tuple[str, ...], shape: tuple[int, ...]
) -> ParallelLayout | None:
    """``layout`` in the rank order of a mesh whose dims are axes of matching degrees (``None`` where none fits).

    The mesh's last dim varies fastest, so its dims reversed are the order's first axes; the layout's other axes
    follow in their own order.
    """
    axes = {a.value for a in AXES}
    if len(names) != len(shape) or not set(names) <= axes or len(set(names)) != len(names):
        return None
    if any(layout.degree(MeshAxis(n)) != size for n, size in zip(names, shape, strict=True)):
        return None
    first = [MeshAxis(n) for n in reversed(names)]
    order = (*first, *(a for a in layout.order if a not in first))
    try:
        return replace(layout, order=order)
    except (ValueError, TypeError):  # LayoutError among them: an order the layout cannot take (ep beside dp)
        return None


def _mesh_positions(ranks: Any, ndim: int) -> list[tuple[int, tuple[int, ...]]]:  # noqa: ANN401 - nested lists
    """Every global rank of a mesh (its ranks nested ``ndim`` deep, as ``DeviceMesh.mesh.tolist()``) with its index."""
    out: list[tuple[int, tuple[int, ...]]] = []

    def walk(node: Any, where: tuple[int, ...]) -> None:  # noqa: ANN401
        if len(where) == ndim:
            out.append((int(node), where))
            return
        for i, child in enumerate(node):
            walk(child, (*where, i))

    walk(ranks, ())
    return out


def _mesh_shape(placed: list[tuple[int, tuple[int, ...]]], ndim: int) -> tuple[int, ...]:
    """The mesh's size along each dim, from its positions."""
    return tuple(1 + max(where[d] for _, where in placed) for d in range(ndim)) if placed else ()

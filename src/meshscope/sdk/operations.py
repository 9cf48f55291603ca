"""The operations of a rank's open step as the capture patches report them: collectives, sends, waits, attention.

Why it exists: :mod:`meshscope.sdk.capture` sees every ``ProcessGroup`` call, functional collective, ``Work.wait``,
DDP bucket and attention call; something must turn each into an entry of the open step (its group, axis, sequence
number, bytes, issue and end marks) and know which ``Work`` or output tensor ends it. That is :class:`Operations`,
the :class:`~meshscope.sdk.capture.CaptureSink` the patches call. The tracker (:mod:`meshscope.sdk.tracker`) owns the
steps and phases and sets :attr:`Operations.step` when a step opens and closes; records are built from the step's
entries after it ends (:mod:`meshscope.sdk.steps`).

Hot path, per captured operation: one dict lookup for the group (cached per ProcessGroup object or group name), one
``next()`` for its sequence number, one small list (``steps``' op layout) appended to the step, one dict entry keyed
by the id of what ends it, and two clock reads; a wait adds one window tuple. No per-op dicts, objects or keyword
calls. It must not import torch at module level (the tracker hands it ``torch.distributed``) and must not raise into
the training loop (the patches wrap every call; failures go to ``fault``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import sys
import threading
import time
from dataclasses import replace
from threading import get_ident
from typing import TYPE_CHECKING, Any, Final

from meshscope.sdk.clocks import HostClock
from meshscope.sdk.groups import (
    GroupInfo,
    axis_of_name,
    dispatch_axis_of,
    dispatch_group_id,
    implied_layout,
    infer_from_layout,
    infer_sub_axis,
    make_group,
    p2p_axis,
    p2p_group_id,
    sub_group_name,
)
from meshscope.sdk.steps import END, HANDLE, ISSUED, START, WAIT, OpMeta
from meshscope.topology import MeshAxis

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from contextlib import AbstractContextManager

    from torch import Tensor
    from torch.distributed import ProcessGroup, Work
    from torch.futures import Future

    from meshscope.sdk.clocks import CudaClock, Mark
    from meshscope.sdk.settings import TrackerSettings
    from meshscope.sdk.steps import StepState

log = logging.getLogger("meshscope.sdk")
_perf_ns = time.perf_counter_ns

_SEQUENCES: Final = (list, tuple)

SYNC_GAP_NS: Final = 100_000
"""A wait that starts within this many ns of its operation's issue makes the whole issue..return span blocked."""


class _Group:
    """A process group as the hot path sees it: attribution, sequence counters, and one :class:`OpMeta` per op."""

    __slots__ = ("axis", "counter", "counters", "dispatch", "info", "metas", "pg", "size")

    def __init__(
        self, pg: object, info: GroupInfo, counter: Iterator[int], dispatch: Iterator[int] | None = None
    ) -> None:
        self.pg = pg
        self.info = info
        self.axis = info.axis.value if info.axis is not None else None
        """The axis' name; ``None``: unattributed (counted, not recorded)."""
        self.size = info.size
        """Members."""
        self.counter = counter
        """Sequence numbers of the group id (shared by every road that reaches the group)."""
        self.dispatch = dispatch
        """Sequence numbers of its all-to-alls' id where they are another axis' (:attr:`GroupInfo.dispatch_axis`)."""
        self.metas: dict[str, OpMeta] = {}
        self.counters: dict[str, Iterator[int]] = {}
        """Op -> the counter its sequence numbers come from (filled with :attr:`metas`)."""

    def meta(self, op: str) -> OpMeta:
        """The interval meta of ``op`` on this (attributed) group; its counter goes into :attr:`counters`."""
        meta = self.metas.get(op)
        if meta is None:
            info = self.info
            if op == "all_to_all" and info.dispatch_axis is not None and self.dispatch is not None:
                # the experts' dispatch on a group dp and ep share: ep's, under ep's id (a group is one axis')
                axis, gid, counter = info.dispatch_axis.value, dispatch_group_id(info), self.dispatch
            else:
                axis, gid, counter = str(self.axis), info.group_id, self.counter
            meta = OpMeta(kind="comm", axis=axis, op=op, group=gid, group_size=info.size, peer=None)
            self.metas[op] = meta
            self.counters[op] = counter
        return meta


class Operations:
    """The capture patches' sink: every operation of the open step, and what ends it.

    Thread-safety: the callbacks run on the training thread, autograd's and backend threads; they only append to
    lists, set attributes and add or pop dict entries.
    """

    def __init__(
        self,
        settings: TrackerSettings,
        dist: Any,  # noqa: ANN401 - torch.distributed, typed loosely to keep torch lazy
        *,
        phase: Callable[[str], AbstractContextManager[None]],
        fault: Callable[[str, BaseException], None],
        checkpointing: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any] | None = None,
        fetching: Callable[[Callable[[Any], Any], Any], Any] | None = None,
    ) -> None:
        """An empty log on the host clock; the tracker sets :attr:`step` and may switch to a device clock.

        Args:
            settings: who this rank is (rank and layout attribute groups and sends).
            dist: ``torch.distributed``.
            phase: opens a phase the SDK labels by itself (the pipelining patches' forward and backward chunks):
                it names the time and declares no compute (``Tracker._label``).
            fault: counts a failure inside meshscope (the tracker's :meth:`~meshscope.sdk.Tracker.fault`).
            checkpointing: runs a checkpoint function as the tracker's checkpoint phase (default: just runs it).
            fetching: runs a ``DataLoader`` iterator's ``__next__`` as the tracker's fetch (default: just runs it).
        """
        self.settings = settings
        self.checkpointing = checkpointing or _just_run
        self.fetching = fetching or _just_fetch
        self._dist = dist
        self.phase = phase
        self.fault = fault
        self.step: StepState | None = None
        """The open step (the tracker sets it); ``None``: operations are counted in their groups, not recorded."""
        self.held: StepState | None = None
        """Where operations go while no step is open but a fetch is held for the next one (the tracker sets and takes
        it): a loader's, a Trainer's collectives there (the Trainer's token-count gather) are that step's."""
        self.clock: HostClock = HostClock()
        self.on_device = False
        """Whether marks of device work are CUDA events (``False``: everything is host time)."""
        self.mark_end: Callable[[], Mark] = time.perf_counter_ns
        """How a completion callback marks an operation's end (the CUDA clock's event recorder on GPU)."""
        self.unattributed = 0
        """Operations on groups that map to no axis (or receives from any source): counted, not recorded."""
        self.between_comm_ns = 0
        """Host ns the step thread spent blocked in collectives' waits while no step was open (an evaluation's metric
        all-reduce, a barrier): the next record's ``between_steps["comm"]`` (the tracker takes and resets it)."""
        self.held_comm_ns = 0
        """The same while a fetch is held for the next step (:attr:`held`): that step's if the fetch is (its start is
        the fetch's), time between steps if it is released as no step's (a validation loader's)."""
        self.step_thread = threading.get_ident()
        """The thread that runs the steps (the tracker sets it when a step opens)."""
        self.background = 0
        """Operations issued, or waited on, by a thread that neither runs the steps nor executes a backward pass (an
        asynchronous checkpoint's writer, a logging thread): counted, not recorded (:meth:`elsewhere`)."""
        torch_c = getattr(sys.modules.get("torch"), "_C", None)
        self._graph_task: Callable[[], int] = getattr(torch_c, "_current_graph_task_id", None) or _no_graph_task
        self.uncaptured_ddp = 0
        """DDP models that kept a comm hook of the user's (each logged): their buckets are not fully captured."""
        self._groups: dict[int, _Group] = {}
        """By ``id()`` of the ProcessGroup object (checked against :attr:`_Group.pg`)."""
        self._by_name: dict[str, _Group] = {}
        """By c10d group name (the functional collectives' road)."""
        self._ddp_ops: list[list[Any]] = []
        """DDP's bucket reductions issued since its last bucket of the previous backward (ended by its wait)."""
        self._p2p: dict[tuple[str, str, int], OpMeta] = {}
        self._registered: dict[str, tuple[str, MeshAxis | None]] = {}
        self._seq: dict[str, Iterator[int]] = {}
        self._by_work: dict[int, list[Any]] = {}
        self.identity_known = False
        """Whether rank and world size were checked against the default process group (:meth:`take_identity`)."""
        self.group_size: int | None = None
        """The default process group's size once one was seen (``None``: never, the rank trained alone)."""
        """Operations in flight by ``id()`` of their ``Work`` (held in the operation, so the id stays unique)."""
        self._by_storage: dict[int, list[Any]] = {}
        """Functional collectives in flight by the storage address of their outputs (held in the operation, so the
        address stays theirs). The storage, as in c10d's own registry, so that a wait on a view finds them too."""

    @property
    def in_step(self) -> bool:
        """Whether a step is open."""
        return self.step is not None

    # ------------------------------------------------------------------ marks

    def device_mark(self, host_ns: int) -> Mark:
        """A mark for device work: ``host_ns`` itself on CPU, a CUDA event on GPU (``host_ns`` if recording fails)."""
        if self.on_device:
            try:
                return self.clock.device_mark()
            except Exception as exc:  # noqa: BLE001 - a host mark is a valid mark on the CUDA clock too
                self.fault("device mark", exc)
        return host_ns

    def use_device_clock(self, clock: CudaClock) -> None:
        """Mark device work with CUDA events of ``clock`` from now on."""
        self.clock = clock
        self.on_device = True
        self.mark_end = clock.device_mark

    # ------------------------------------------------------------------ groups

    def register(self, group: object, name: str, axis: MeshAxis | None) -> None:
        """Attribute ``group`` (a ``ProcessGroup`` or a 1-D ``DeviceMesh``) to ``axis`` under ``name``."""
        try:
            pg: Any = group
            if hasattr(group, "get_group") and not hasattr(group, "group_name"):  # a 1-D DeviceMesh
                pg = pg.get_group()
            if not self._registered and self.settings.layout is None:  # resolved under the implied layout: again
                self._groups.clear()
                self._by_name.clear()
            self._registered[pg.group_name] = (name, axis)
            self._groups.pop(id(pg), None)
            self._by_name.pop(pg.group_name, None)
            self._p2p.clear()
            self._group_of_pg(pg)
        except Exception as exc:  # noqa: BLE001
            self.fault("register_groups", exc)

    def relayout(self, settings: TrackerSettings) -> None:
        """Take ``settings`` with another layout: every group is resolved again under it.

        Its name, axis and id: a group resolved under the old layout kept an id that clashed with a namesake of the
        new one (a mesh's dp group beside the world group the old layout made dp's: ``dp:0~1``).
        """
        self.settings = settings
        self._groups.clear()
        self._by_name.clear()
        self._p2p.clear()

    def _group_of_pg(self, pg: ProcessGroup) -> _Group:
        group = self._groups.get(id(pg))
        if group is not None and group.pg is pg:
            return group
        info = self._resolve(pg)
        counter = self._seq.get(info.group_id)
        if counter is None:
            counter = self._seq.setdefault(info.group_id, itertools.count())
        dispatch = None
        if info.dispatch_axis is not None:
            dispatch = self._seq.setdefault(dispatch_group_id(info), itertools.count())
        group = _Group(pg, info, counter, dispatch)
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

    def take_identity(self) -> bool:
        """Take rank and world size from the default process group once it exists; ``True``: they changed.

        The environment says who a rank is when ``torchrun`` or ``meshscope run`` started it, but a script may start
        its own processes (``torch.multiprocessing.spawn``: every child inherits the parent's ``RANK``) or take its
        rank from elsewhere (``SLURM_PROCID``) and pass it to ``init_process_group``: the group is then the truth. A
        layout (``MESHSCOPE_LAYOUT``) for another world size is dropped (each rank then reports ``dp = rank``).
        """
        if self.identity_known:
            return False
        dist = self._dist
        if not (dist.is_available() and dist.is_initialized()):
            return False
        self.identity_known = True
        s = self.settings
        rank, world = int(dist.get_rank()), int(dist.get_world_size())
        self.group_size = world
        if (rank, world) == (s.rank, s.world_size):
            return False
        layout = s.layout
        if layout is not None and layout.world_size != world:
            log.warning(
                "meshscope: the layout %s is for %d ranks but the process group has %d; ignored",
                layout.describe(),
                layout.world_size,
                world,
            )
            layout = None
        if s.rank != rank:
            log.warning(
                "meshscope: the environment says rank %d of %d, the process group rank %d of %d: recorded as rank %d",
                s.rank,
                s.world_size,
                rank,
                world,
                rank,
            )
        self.settings = replace(s, rank=rank, world_size=world, layout=layout)
        return True

    def _resolve(self, pg: ProcessGroup) -> GroupInfo:
        """The group's :class:`GroupInfo`; its id told apart from an earlier-created group's of the same members.

        Two groups of one name and first rank (the world group beside a DeepSpeed or logging group of the same ranks)
        would share an id; the one torch created later gets ``"~<its group name>"`` appended. Creation order, not
        first use: every member created the groups in the same order (torch requires it), so every member and every
        run of the script gives each group the same id, whichever a rank happens to use first.
        """
        self.take_identity()
        info = self._describe(pg)
        pg_name = str(pg.group_name)
        if self._created_before(pg_name, info):
            info = replace(info, group_id=f"{info.group_id}~{pg_name}")
        return info

    def _created_before(self, pg_name: str, info: GroupInfo) -> bool:
        """Whether this rank is in a group torch created before ``pg_name`` whose id would be ``info``'s."""
        order = _creation_order(pg_name)
        try:
            known = list(self._dist.distributed_c10d._world.pg_names.items())  # noqa: SLF001 - torch's group registry
        except Exception:  # noqa: BLE001 - no registry: nothing created before can be named
            known = []
        for other, other_name in known:
            name = str(other_name)
            if name == pg_name or _creation_order(name) >= order:
                continue
            if self._namesake(other, info):
                return True
        return False

    def _namesake(self, pg: ProcessGroup, info: GroupInfo) -> bool:
        """Whether this rank is in ``pg`` and ``pg``'s id (no suffix) is ``info``'s."""
        try:
            other = self._describe(pg)
        except Exception:  # noqa: BLE001 - a group torch cannot describe here is not one of this rank's
            return False
        return other.group_id == info.group_id and self.settings.rank in other.ranks

    def _describe(self, pg: ProcessGroup) -> GroupInfo:
        """Name, axis, members and id of ``pg`` from its registration, description or the layout (no suffix)."""
        ranks = tuple(int(r) for r in self._dist.get_process_group_ranks(pg))
        pg_name = str(pg.group_name)
        registered = self._registered.get(pg_name)
        dispatch = None
        if registered is not None:
            name, axis = registered
            layout = self.settings.layout
            if layout is not None and axis is not None and len(ranks) > 1:
                dispatch = dispatch_axis_of(layout, axis, ranks)
                if dispatch is not None and axis is MeshAxis.EP:
                    # Registered as ep while the layout makes it dp's group too (ep carved out of all of dp): the
                    # dense gradients' all-reduce on it is dp's, its all-to-alls the experts' dispatch.
                    name, axis = MeshAxis.DP.value, MeshAxis.DP
        else:
            desc = str(getattr(pg, "group_desc", "") or "")
            axis = axis_of_name(desc) if desc else None
            name = re.sub(r"^mesh_", "", desc) if axis is not None else (desc or "group")
            layout = self.settings.layout
            given = layout is not None or bool(self._registered)  # else dp over the world is only assumed
            if layout is None and not self._registered:
                layout = implied_layout(self.settings.world_size)
            if axis is None and layout is not None:
                inferred = infer_from_layout(layout, ranks)
                if inferred is not None:
                    name, axis = inferred
                    if len(ranks) >= 2:  # dp's and ep's group alike: its all-to-alls are the experts' dispatch
                        dispatch = dispatch_axis_of(layout, axis, ranks)
                elif given and (sub := infer_sub_axis(layout, ranks)) is not None:  # a part of one axis's group
                    axis = sub
                    name = sub_group_name(sub, ranks, desc)
            if len(ranks) < 2:
                axis = None
        return make_group(name, axis, ranks, dispatch_axis=dispatch)

    def _next_seq(self, group_id: str) -> int:
        counter = self._seq.get(group_id)
        if counter is None:
            counter = self._seq.setdefault(group_id, itertools.count())
        return next(counter)

    def elsewhere(self) -> bool:
        """Whether the calling thread is a background thread: not the steps' and not executing a backward pass.

        Autograd runs a GPU's backward, and DDP's and FSDP's hooks with it, on a thread of its own: that is the
        step's work. A background thread's collectives do not block a step, which goes on computing while they run:
        an asynchronous checkpoint (``torch.distributed.checkpoint.async_save``) writes and coordinates on a thread of
        its own. Recorded, they would cut the training thread's compute with another thread's waits and land in
        whichever step was open on each rank. They are counted (:attr:`background`), not recorded, and take no
        sequence number: every rank skips the same ones, so the step thread's operations keep joining across ranks.
        """
        return get_ident() != self.step_thread and self._graph_task() < 0

    # ------------------------------------------------------------------ the patches' callbacks (hot path)
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
        if get_ident() != self.step_thread and self.elsewhere():
            self.background += 1
            return
        group = self._groups.get(id(pg))
        if group is None or group.pg is not pg:
            group = self._group_of_pg(pg)
        if group.axis is None:
            if group.size > 1:
                self.unattributed += 1
            return
        meta = group.metas.get(op) or group.meta(op)
        seq = next(group.counters[op])
        st = self.step or self.held
        if st is None:
            return
        rec = [start, None, meta, seq, size_of(args, group.size), work, _perf_ns(), None]
        st.ops.append(rec)
        if work is None:
            rec[END] = self.mark_end()
            return
        self._by_work[id(work)] = rec
        if completion:
            self._ddp_ops.append(rec)
            _on_completion(work, rec, self.mark_end)

    def on_blocking(self, pg: ProcessGroup, op: str, nbytes: int, m0: Mark) -> None:
        """A collective issued at mark ``m0`` that ran to completion inside one call returned now.

        ``dist._broadcast_coalesced`` (DDP's buffer broadcast before every forward): c10d waits for it in C++, so the
        rank was blocked from its issue to now, as in a synchronous call whose ``Work.wait`` returned now.
        """
        if self.step is None and not self.on_device and not self.elsewhere():  # host marks: blocked since its issue
            self._blocked_between(_perf_ns() - m0)
        st = self.step or self.held
        recorded = len(st.ops) if st is not None else 0
        self.on_collective(pg, op, lambda _args, _size: nbytes, (), None, m0, completion=False)
        if st is not None and len(st.ops) > recorded:
            rec = st.ops[-1]
            rec[WAIT] = m0
            st.windows.append((m0, rec[END]))

    def on_p2p(  # noqa: PLR0917 - positionals on the hot path
        self, pg: ProcessGroup, op: str, peer_in_group: int | None, nbytes: int | None, work: Work | None, start: Mark
    ) -> None:
        """A ``send``/``recv`` issued at mark ``start`` was accepted by the backend, which returned ``work``.

        ``peer_in_group`` is the other side's rank in ``pg`` (``None`` for a receive from any source: unattributed).
        """
        if get_ident() != self.step_thread and self.elsewhere():
            self.background += 1
            return
        group = self._groups.get(id(pg))
        if group is None or group.pg is not pg:
            group = self._group_of_pg(pg)
        if peer_in_group is None:  # recv_anysource: no peer to join with
            self.unattributed += 1
            return
        peer = group.info.global_rank(peer_in_group)
        key = (op, group.info.group_id, peer)
        meta = self._p2p.get(key)
        if meta is None:
            rank = self.settings.rank
            axis = group.info.axis if group.info.axis is not None else p2p_axis(self.settings.layout, rank, peer)
            if axis is None:
                self.unattributed += 1
                return
            src, dst = (rank, peer) if op == "send" else (peer, rank)
            gid = p2p_group_id(axis, src, dst)
            meta = OpMeta(kind="p2p", axis=axis.value, op=op, group=gid, group_size=None, peer=peer)
            self._p2p[key] = meta
        seq = self._next_seq(meta.group)
        st = self.step or self.held
        if st is None:
            return
        rec = [start, None, meta, seq, nbytes, work, _perf_ns(), None]
        st.ops.append(rec)
        if work is None:
            rec[END] = self.mark_end()
        else:
            self._by_work[id(work)] = rec

    def on_wait(self, work: Work, t0: int, m0: Mark) -> None:
        """A ``Work.wait`` that started at ``t0`` (host ns) / ``m0`` (mark) returned now."""
        if get_ident() != self.step_thread and self.elsewhere():  # the step thread was not blocked
            return
        t1 = _perf_ns()
        m1 = self.device_mark(t1) if self.on_device else t1
        rec = self._by_work.pop(id(work), None) if self._by_work else None
        if rec is not None and rec[HANDLE] is work:
            rec[HANDLE] = None
            if rec[END] is None:
                rec[END] = m1
            if t0 - rec[ISSUED] < SYNC_GAP_NS:  # a synchronous call: blocked from its issue
                m0 = rec[START]
            rec[WAIT] = m0
        st = self.step or self.held
        if st is not None:
            st.windows.append((m0, m1))
        if self.step is None:
            self._blocked_between(t1 - t0)

    def _blocked_between(self, ns: int) -> None:
        """The step thread was blocked ``ns`` in a collective while no step was open."""
        if self.held is None:
            self.between_comm_ns += ns
        else:
            self.held_comm_ns += ns

    def on_tensor_wait(self, tensor: Tensor | None, t0: int, m0: Mark) -> None:
        """A functional ``wait_tensor`` that started at ``t0`` / ``m0`` returned now."""
        if get_ident() != self.step_thread and self.elsewhere():
            return
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
                rec[WAIT] = m0
        st = self.step or self.held
        if st is not None:
            st.windows.append((m0, m1))
        if self.step is None:
            self._blocked_between(t1 - t0)

    def _forget_outputs(self, rec: list[Any]) -> None:
        """Drop a functional collective's outputs (held since issue) and their lookup entries."""
        outs = rec[HANDLE]
        rec[HANDLE] = None
        by_storage = self._by_storage
        for out in outs if isinstance(outs, _SEQUENCES) else (outs,):
            try:
                key = _storage_key(out)
            except RuntimeError:  # no data behind it any more (a tensor tracing made): found by the record instead
                for key in [k for k, r in by_storage.items() if r is rec]:
                    del by_storage[key]
                continue
            if by_storage.get(key) is rec:
                del by_storage[key]

    def on_functional(
        self, op: str, group_name: object, nbytes: int | None, out: Tensor | list[Tensor], start: Mark
    ) -> None:
        """A functional collective (``torch.ops._c10d_functional``) on ``group_name``, issued at ``start``, returned.

        ``out`` is its output; the first ``wait_tensor`` on it ends the operation.
        """
        if get_ident() != self.step_thread and self.elsewhere():
            self.background += 1
            return
        group = self._by_name.get(group_name)  # type: ignore[call-overload]
        if group is None:
            group = self._group_of_name(group_name)
        if group.axis is None:
            if group.size > 1:
                self.unattributed += 1
            return
        meta = group.metas.get(op) or group.meta(op)
        seq = next(group.counters[op])
        st = self.step or self.held
        if st is None:
            return
        rec = [start, None, meta, seq, nbytes, out, _perf_ns(), None]
        st.ops.append(rec)
        for tensor in out if isinstance(out, _SEQUENCES) else (out,):
            self._by_storage[_storage_key(tensor)] = rec

    def on_ddp_last_bucket(self, future: Future[object], queue_callback: Callable[[Callable[[], None]], None]) -> None:
        """DDP issued its last bucket: at the end of backward its reducer waits for every bucket's reduction.

        That wait is DDP's ``finalize_backward``, an autograd final callback queued right after this hook returns.
        ``queue_callback`` (autograd's ``queue_callback``) puts one callback before it, which marks the start of the
        wait and queues another, which runs right after it: the end of the wait, before ``backward()`` returns. The
        window between the two is blocked; every bucket of this backward has its wait start there and ends no later
        than its end (a completion callback on the backend's thread may run after the waiter woke, even after the
        optimizer began). Where no final callback can be queued, the window runs from now to the last bucket's
        completion, as the backend reports it.
        """
        ops, self._ddp_ops = self._ddp_ops, []
        st = self.step
        if st is None:
            return
        wait = _DdpWait(self, ops, queue_callback)
        st.windows.append(wait.window)
        try:
            queue_callback(wait.started)
        except Exception:  # noqa: BLE001 - not inside a backward pass (autograd refuses): the backend's completion
            wait.start(self.device_mark(_perf_ns()))
            future.then(wait.completed)

    def on_attention_forward(self, m0: Mark) -> None:
        """An attention call that started at ``m0`` returned now."""
        st = self.step or self.held
        if st is not None:
            st.attention.append((m0, self.device_mark(_perf_ns())))

    def on_attention_backward(self, start: Mark) -> None:
        """An attention backward that started at ``start`` finished now."""
        st = self.step or self.held
        if st is not None and start is not None:
            st.attention.append((start, self.device_mark(_perf_ns())))

    def uncaptured(self, what: str, why: str) -> None:
        """Count (and log) something whose communication the patches cannot see: ``what`` = ``ddp``."""
        if what == "ddp":
            self.uncaptured_ddp += 1
        log.warning("meshscope: cannot capture all the communication of %s", why)

    def release(self, st: StepState) -> None:
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

    def end_unwaited(self, st: StepState) -> None:
        """Let their completion end the step's asynchronous operations nobody waited on (the step just closed)."""
        work_type = self._dist.Work
        for rec in st.ops:
            if rec[END] is None and isinstance(rec[HANDLE], work_type):
                _on_completion(rec[HANDLE], rec, self.mark_end)


class _DdpWait:
    """DDP's wait for its buckets at the end of one backward: a blocked window, and the end of every bucket in it."""

    __slots__ = ("ops", "queue", "sink", "window")

    def __init__(self, sink: Operations, ops: list[list[Any]], queue: Callable[[Callable[[], None]], None]) -> None:
        self.sink = sink
        self.queue = queue
        self.ops = ops
        """The bucket reductions of this backward."""
        self.window: list[Mark] = [None, None]
        """The blocked window, as ``StepState.windows`` holds it; its ends are ``None`` until marked."""

    def start(self, mark: Mark) -> None:
        """The wait starts at ``mark``: every bucket still running is waited on from there."""
        self.window[0] = mark
        for rec in self.ops:
            rec[WAIT] = mark

    def started(self) -> None:
        """Autograd final callback, right before the reducer's wait: mark it, and queue :meth:`finished` after it."""
        try:
            self.start(self.sink.device_mark(_perf_ns()))
            self.queue(self.finished)
        except Exception as exc:  # noqa: BLE001 - this runs inside backward: never raise into it
            self.window[1] = self.window[0]
            self.sink.fault("ddp wait start", exc)

    def finished(self) -> None:
        """Autograd final callback, right after the reducer's wait: no bucket's reduction ends later.

        The last bucket to complete ends here: the step thread was blocked in the reducer's wait until now, and a
        wake-up the host delays after the backend's completion (host marks; 4.3 ms in 3 of 29 steps of a compiled
        DDP model on 2 shared cores) was time in no interval, "outside phases and collectives", and once a
        transient straggler. Device marks keep the completion: there the wait's end is the host's, not the GPU's.
        """
        try:
            end = self.sink.mark_end()
            self.window[1] = end
            last: list[Any] | None = None
            for rec in self.ops:
                e = rec[END]
                if e is None or (type(e) is int and type(end) is int and e > end):
                    rec[END] = end
                if type(rec[END]) is int and (last is None or rec[END] >= last[END]):
                    last = rec
            if last is not None and type(end) is int:
                last[END] = end
        except Exception as exc:  # noqa: BLE001
            self.sink.fault("ddp wait end", exc)

    def completed(self, _future: Future[object]) -> None:
        """The last bucket's completion, as the backend reports it (where no final callback could be queued)."""
        self.window[1] = self.sink.mark_end()


def _no_graph_task() -> int:
    """``torch._C._current_graph_task_id`` where torch has none: never inside a backward pass."""
    return -1


def _just_run(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # noqa: ANN401
    return fn(*args, **kwargs)


def _just_fetch(fetch: Callable[[Any], Any], it: Any) -> Any:  # noqa: ANN401
    return fetch(it)


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
            end = mark()
            if rec[END] is None:  # checked again: DDP's wait may have ended it meanwhile, earlier
                rec[END] = end

    with contextlib.suppress(RuntimeError):
        work.get_future().then(done)


def _creation_order(pg_name: str) -> tuple[int, int, str]:
    """Sort key of a torch group name by creation order.

    ``"0"`` (the world), ``"1"``, ... are counted up by ``new_group`` alike on every rank; hashed names (of the
    members, alike on every rank too) come after them, by name.
    """
    return (0, int(pg_name), "") if pg_name.isdecimal() else (1, 0, pg_name)

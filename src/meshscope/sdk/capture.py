"""The patches that let the tracker see every collective, point-to-point op and attention call without code changes.

Why it exists: collectives reach the backend along four roads, and each needs its own tap (reference:
``cpu-testbed.md`` §6):

1. **Python callers** (``torch.distributed.*``, FSDP2, ``torch.distributed.pipelining``, Megatron-style manual code)
   all end in a method of ``ProcessGroup`` (``allreduce``, ``all_gather_single``, ``send`` ...). Those pybind methods
   are wrapped on the class, so every caller is seen however it imported ``torch.distributed``. ``Work.wait`` is
   wrapped to time waits; collectives also get a completion callback (``Work.get_future().then``), which gloo does not
   offer for send/recv, whose end is the return of their wait.
2. **Functional collectives** (DTensor, ``torch.distributed._functional_collectives``) call the
   ``torch.ops._c10d_functional`` operators directly; those op packets are replaced by thin wrappers on the namespace,
   and ``wait_tensor`` marks their end.
3. **DDP**'s C++ reducer talks to the backend directly. A comm hook that averages exactly as the reducer does
   without one (:func:`_ddp_average`) is registered at construction -- or, for models wrapped before the tracker
   started, at install (found once among the live objects) -- so its bucket all-reduces take road 1, starting at
   the bucket's issue; a user's later ``register_comm_hook`` replaces the inner hook instead of failing. The last
   bucket queues autograd final callbacks around the reducer's wait for its buckets (backward blocked on the
   reduction): that window is exact, and no bucket ends after it. A model that got a hook of the user's before the
   tracker started is reported to the sink.
4. ``torch.nn.functional.scaled_dot_product_attention`` is wrapped to time attention (forward by the call, backward
   between gradient hooks on its output and on its first input).
5. **Compiled code** (inductor's wrapper, AOTAutograd's graphs) calls the functional collectives, their waits and the
   fused attention kernels by overload (``....all_reduce_.default(...)``): the builtin behind those overloads is
   replaced (:class:`_CompiledCall`), so what a compiled block runs is captured as roads 2 and 4 capture it eagerly.

Pipelining stages also get their forward and backward chunks labelled as phases, and ``torch.save`` and
``torch.distributed.checkpoint``'s saves and loads run as the checkpoint phase where the script opened none.

The patches report to a :class:`CaptureSink` (the tracker's :class:`~meshscope.sdk.operations.Operations`), never to
the tracker itself: this module knows only the callbacks below. Every wrapper calls the original unconditionally and
touches the sink inside ``try`` blocks: a failure in meshscope is counted (``sink.fault``) and never reaches the
training loop; the user's own errors propagate untouched. Patches are
installed only when a real tracker starts (``MESHSCOPE_DISABLE=1`` installs nothing) and are removed by
:func:`uninstall`. Imports torch: load this module only from a real tracker.
"""

# ruff: noqa: ANN401 - every wrapper here forwards arbitrary arguments and results of torch callables unchanged

from __future__ import annotations

import contextlib
import functools
import sys
import time
from typing import TYPE_CHECKING, Any, Final, Protocol

import torch
import torch.distributed as dist
import torch.utils.data.dataloader

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    from torch.distributed import ProcessGroup, Work
    from torch.futures import Future

    from meshscope.sdk.clocks import Mark


class CaptureSink(Protocol):
    """What the patches report to: one call per captured operation, with positional arguments (the hot path)."""

    on_device: bool
    """Whether marks of device work are CUDA events."""

    @property
    def in_step(self) -> bool:
        """Whether a step is open (attention backward hooks are set only then)."""

    def device_mark(self, host_ns: int) -> Mark:
        """A mark for device work at host time ``host_ns``."""

    def fault(self, where: str, exc: BaseException) -> None:
        """Count a failure inside meshscope."""

    def phase(self, name: str) -> AbstractContextManager[None]:
        """A phase of the open step that the SDK opens by itself (a pipelining stage's forward and backward chunks).

        It names its time and does not declare the step's compute, as a script's own phase would.
        """

    def on_collective(  # noqa: PLR0917 - positionals on the hot path
        self,
        pg: ProcessGroup,
        op: str,
        size_of: Callable[[tuple[Any, ...], int], int],
        args: tuple[Any, ...],
        work: Work | None,
        start: Mark,
        completion: bool,  # noqa: FBT001
    ) -> None:
        """A ``ProcessGroup`` collective issued at ``start`` was accepted by the backend, which returned ``work``."""

    def on_p2p(  # noqa: PLR0917 - positionals on the hot path
        self, pg: ProcessGroup, op: str, peer_in_group: int | None, nbytes: int | None, work: Work | None, start: Mark
    ) -> None:
        """A ``send``/``recv`` issued at ``start`` was accepted by the backend."""

    def on_wait(self, work: Work, t0: int, m0: Mark) -> None:
        """A ``Work.wait`` that started at host ns ``t0`` / mark ``m0`` returned now."""

    def on_blocking(self, pg: ProcessGroup, op: str, nbytes: int, m0: Mark) -> None:
        """A collective issued at mark ``m0`` that ran to completion inside one call returned now."""

    def on_tensor_wait(self, tensor: torch.Tensor | None, t0: int, m0: Mark) -> None:
        """A functional ``wait_tensor`` that started at ``t0`` / ``m0`` returned now."""

    def on_functional(
        self, op: str, group_name: object, nbytes: int | None, out: torch.Tensor | list[torch.Tensor], start: Mark
    ) -> None:
        """A functional collective on ``group_name``, issued at ``start``, returned ``out``."""

    def on_ddp_last_bucket(self, future: Future[object], queue_callback: Callable[[Callable[[], None]], None]) -> None:
        """DDP issued its last bucket; ``queue_callback`` queues an autograd final callback (before DDP's wait)."""

    def uncaptured(self, what: str, why: str) -> None:
        """Something whose communication cannot be captured: ``what`` (e.g. ``ddp``) and why, for people."""

    def checkpointing(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``fn(*args, **kwargs)``, a checkpoint function (``torch.save``, DCP's), as a checkpoint phase.

        Opened only where no phase is open; returns what ``fn`` returns and raises what it raises.
        """

    def fetching(self, fetch: Callable[[Any], Any], it: Any) -> Any:
        """Run ``fetch(it)``, a ``DataLoader`` iterator's own ``__next__``, timed as a fetch of the step's batch.

        Returns what ``fetch`` returns and raises what it raises (``StopIteration`` at the loader's end).
        """

    def on_attention_forward(self, m0: Mark) -> None:
        """An attention call that started at ``m0`` returned now."""

    def on_attention_backward(self, start: Mark) -> None:
        """An attention backward that started at ``start`` finished now."""


_perf_ns = time.perf_counter_ns

ACTIVE: CaptureSink | None = None
"""The sink the wrappers report to; ``None``: wrappers pass straight through."""

_in_ddp_hook = 0
"""Depth of meshscope's DDP comm hook: its collectives are never waited on from Python, so they get a completion
callback at once (every other asynchronous operation gets one only if it is still unwaited when its step ends)."""
_ddp_issue: list[Any] = [None]
"""The mark at which DDP issued the bucket whose hook runs now, taken before the inner hook's own Python: the first
collective the hook issues starts there."""
_collective_depth = 0
"""Functional collectives being issued now: a dispatch that calls the op again inside by its overload (an
``AsyncCollectiveTensor`` input, which waits for it, then calls the op again; AOTAutograd's alias check on a compiled
graph's first run; a FLOP counter) is not recorded twice. Waits inside (that input's) are recorded: they end other
operations."""
_attention_depth = 0
"""Eager attention calls and fused backward spans open now: a fused kernel they reach through Python (DTensor's
dispatch, a dispatch mode) is timed by them, not again by :class:`_CompiledAttention`."""
_saved: list[tuple[Any, str, Any]] = []
"""(owner, attribute, original) of every patch in place, for :func:`uninstall`."""


_Tensor = torch.Tensor

_tracing = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
"""``True`` while ``torch.compile`` traces (``False`` in eager, ~30 ns): a wrapper that ``torch.compile`` may trace
(attention, functional collectives, inside a compiled model) then calls the original and nothing else, so that
Dynamo folds it into the graph instead of breaking the graph at our clock reads (a graph break splits the compiled
model: it would run slower because meshscope is there). What runs inside a compiled graph is not timed."""
compiling = _tracing
"""The same, for the hooks of the Trainer callbacks (a model's forward pre-hook runs inside a compiled model)."""

_TRACED_TYPES: dict[type, bool] = {}
"""Tensor subclass -> whether ``torch.compile`` traces with its instances (decided once per type)."""


def _traced_type(kind: type) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor  # noqa: PLC0415
    from torch._subclasses.functional_tensor import FunctionalTensor  # noqa: PLC0415

    return issubclass(kind, (FakeTensor, FunctionalTensor))


def _traced(x: object) -> bool:
    """Whether ``x`` (a tensor or a list of them) is what ``torch.compile`` traces with, not data.

    Dynamo folds a wrapper into its graph (:data:`_tracing`), but AOTAutograd then traces that graph again, outside
    Dynamo, with fake and functional tensors: a functional collective in a compiled model (DTensor's tensor
    parallelism) reaches its wrapper once per compile that way, with no data behind it (``data_ptr()`` raises).
    """
    kind = type(x)
    if kind is _Tensor:
        return False
    if kind is list or kind is tuple:
        return bool(x) and _traced(x[0])  # type: ignore[index]
    traced = _TRACED_TYPES.get(kind)
    if traced is None:
        try:
            traced = _traced_type(kind)
        except Exception:  # noqa: BLE001 - a torch without these classes traces with neither
            traced = False
        _TRACED_TYPES[kind] = traced
    return traced


def _no_data(x: object) -> bool:
    """Whether ``x`` (a tensor or a list of them) is what tracing computes with: fake, functional or meta tensors.

    Compiled code calls ops by their overloads (:class:`_CompiledCall`), and so does tracing: a fake tensor's
    dispatch runs the op on meta tensors, AOTAutograd's graphs on functional ones. Neither is a call of the job's.
    """
    kind = type(x)
    if kind is list or kind is tuple:
        if not x:
            return False
        x = x[0]  # type: ignore[index]
        kind = type(x)
    if kind is _Tensor:
        return x.is_meta  # type: ignore[attr-defined,no-any-return]
    return kind is not None and _traced(x)


def _nbytes(x: Any) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list or tuple; 0 for anything else."""
    tx = type(x)
    if tx is _Tensor:  # the common cases first: one plain tensor, a list of them
        return x.nbytes  # type: ignore[no-any-return]
    if tx is list or tx is tuple:
        total = 0
        for y in x:
            total += y.nbytes if type(y) is _Tensor else _nbytes(y)
        return total
    if isinstance(x, _Tensor):
        return int(x.nbytes)
    return 0


# op name, bytes from (positional args, group size); the conventions of meshscope.plan.comms: the whole buffer of an
# all-reduce, the gathered (unsharded) buffer of all-gather and reduce-scatter, the send buffer of an all-to-all.
# The common case (one plain tensor) is inlined: a call less per captured operation.
def _arg0(a: tuple[Any, ...], _n: int) -> int:
    if not a:
        return 0
    x = a[0]
    return x.nbytes if type(x) is _Tensor else _nbytes(x)


def _arg1(a: tuple[Any, ...], _n: int) -> int:
    if len(a) < 2:  # the second positional argument
        return 0
    x = a[1]
    return x.nbytes if type(x) is _Tensor else _nbytes(x)


def _arg0_times_n(a: tuple[Any, ...], n: int) -> int:
    return _nbytes(a[0]) * n if a else 0


def _arg1_times_n(a: tuple[Any, ...], n: int) -> int:
    return _nbytes(a[1]) * n if len(a) > 1 else 0


def _zero(_a: tuple[Any, ...], _n: int) -> int:
    return 0


COLLECTIVE_METHODS: dict[str, tuple[str, Callable[[tuple[Any, ...], int], int]]] = {
    "allreduce": ("all_reduce", _arg0),
    "allreduce_coalesced": ("all_reduce", _arg0),
    "allgather": ("all_gather", _arg1_times_n),
    "allgather_coalesced": ("all_gather", _arg1_times_n),
    "all_gather_single": ("all_gather", _arg0),
    "_allgather_base": ("all_gather", _arg0),
    "allgather_into_tensor_coalesced": ("all_gather", _arg0),
    "all_gather_single_coalesced": ("all_gather", _arg0),
    "reduce_scatter": ("reduce_scatter", _arg0_times_n),
    "reduce_scatter_single": ("reduce_scatter", _arg1),
    "_reduce_scatter_base": ("reduce_scatter", _arg1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", _arg1),
    "reduce_scatter_single_coalesced": ("reduce_scatter", _arg1),
    "alltoall": ("all_to_all", _arg1),
    "alltoall_base": ("all_to_all", _arg1),
    "all_to_all_single": ("all_to_all", _arg1),
    "broadcast": ("broadcast", _arg0),
    "reduce": ("reduce", _arg0),
    "gather": ("gather", _arg1_times_n),
    "scatter": ("scatter", _arg0_times_n),
    "barrier": ("barrier", _zero),
    "monitored_barrier": ("barrier", _zero),
}
"""``ProcessGroup`` methods that run a collective: the recorded op and how its bytes are computed."""

P2P_METHODS: dict[str, str] = {"send": "send", "recv": "recv", "recv_anysource": "recv"}
"""``ProcessGroup`` methods that run a point-to-point op."""


# name -> (op, bytes from (args, output)); the group name is the last positional argument (or kwarg group_name)
FUNCTIONAL_OPS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
"""``torch.ops._c10d_functional`` operators (and their ``_c10d_functional_autograd`` twins) that run a collective."""
_GATHERS = frozenset({"all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"})


# ====================================================================== ProcessGroup and Work


# The wrappers below read the clock before calling the original (the operation's issue, this rank's arrival) and
# report to the tracker once the original has returned, in one call with positional arguments. The end of a
# ProcessGroup operation is the return of its ``Work.wait`` (dist.* calls wait at once when synchronous); a completion
# callback costs ~9 us on gloo and runs Python on the backend's thread, so it is attached at issue only inside DDP's
# hook (never waited on from Python), and to others only if their step ends with them still unwaited.


def _collective_wrapper(orig: Any, op: str, size_of: Callable[[tuple[Any, ...], int], int]) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = ACTIVE
        if t is None:
            return orig(self, *args, **kwargs)
        t0 = _perf_ns()
        m0 = t.device_mark(t0) if t.on_device else t0
        work = orig(self, *args, **kwargs)
        try:
            ddp = _in_ddp_hook > 0
            if ddp and _ddp_issue[0] is not None:  # a bucket's reduction starts at its issue, before the hook's Python
                m0, _ddp_issue[0] = _ddp_issue[0], None
            t.on_collective(self, op, size_of, args, work, m0, ddp)
        except Exception as exc:  # noqa: BLE001 - meshscope must never break the training loop
            t.fault("collective capture", exc)
        return work

    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapper


def _p2p_wrapper(orig: Any, op: str, *, any_source: bool) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = ACTIVE
        if t is None:
            return orig(self, *args, **kwargs)
        t0 = _perf_ns()
        m0 = t.device_mark(t0) if t.on_device else t0
        work = orig(self, *args, **kwargs)
        try:  # send(tensors, dst, tag), recv(tensors, src, tag); recv_anysource(tensors, tag) has no peer
            peer = None if any_source or len(args) < 2 or type(args[1]) is not int else args[1]
            t.on_p2p(self, op, peer, _nbytes(args[0]) if args else None, work, m0)
        except Exception as exc:  # noqa: BLE001
            t.fault("p2p capture", exc)
        return work

    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapper


def _wait_wrapper(orig: Any) -> Any:
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = ACTIVE
        if t is None:
            return orig(self, *args, **kwargs)
        t0 = _perf_ns()
        m0 = t.device_mark(t0) if t.on_device else t0
        try:
            return orig(self, *args, **kwargs)
        finally:
            try:
                t.on_wait(self, t0, m0)
            except Exception as exc:  # noqa: BLE001
                t.fault("wait capture", exc)

    wait.__wrapped__ = orig  # type: ignore[attr-defined]
    return wait


# ====================================================================== functional collectives


def _direct_call(packet: Any) -> Any:
    """What ``packet(...)`` runs, without the Python frame of ``OpOverloadPacket.__call__``.

    That frame only calls ``self._op(...)`` unless the op has a torchbind overload (no functional collective has), so
    calling ``_op`` directly saves the frame our wrapper adds.
    """
    op = getattr(packet, "_op", None)
    if op is None or getattr(packet, "_has_torchbind_op_overload", True):
        return packet
    return op


def _issue(t: CaptureSink, call: Callable[..., Any], op: str, gather: bool, args: Any, kwargs: Any) -> Any:  # noqa: FBT001, PLR0917 - the hot path
    """Run a functional collective ``call(*args, **kwargs)`` (``op``; ``gather``: sized by its output) and report it."""
    global _collective_depth  # noqa: PLW0603
    t0 = _perf_ns()
    m0 = t.device_mark(t0) if t.on_device else t0
    _collective_depth += 1  # a dispatch that calls the op again inside is not recorded again
    try:
        out = call(*args, **kwargs)
    finally:
        _collective_depth -= 1
    try:
        if type(out) is not _Tensor and _traced(out):  # AOTAutograd compiling it: not a call of the job's
            return out
        if kwargs:  # (input(s), ..., group_name): the group name is the last positional or a keyword
            name = kwargs.get("group_name", args[-1] if args else None)
            first = args[0] if args else kwargs.get("input")
        else:
            name = args[-1]
            first = args[0]
        sized = out if gather else first
        t.on_functional(op, name, sized.nbytes if type(sized) is _Tensor else _nbytes(sized), out, m0)
    except Exception as exc:  # noqa: BLE001
        t.fault("functional collective capture", exc)
    return out


def _await(t: CaptureSink, call: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Run a ``wait_tensor`` ``call(*args, **kwargs)`` and report its wait."""
    tensor = args[0] if args else kwargs.get("tensor")
    if type(tensor) is not _Tensor and _traced(tensor):  # AOTAutograd compiling it: no wait of the job's
        return call(*args, **kwargs)
    t0 = _perf_ns()
    m0 = t.device_mark(t0) if t.on_device else t0
    try:
        return call(*args, **kwargs)
    finally:
        try:
            t.on_tensor_wait(tensor, t0, m0)
        except Exception as exc:  # noqa: BLE001
            t.fault("functional wait capture", exc)


class _FunctionalOp:
    """Stands in for an ``OpOverloadPacket`` on ``torch.ops._c10d_functional``; everything else is forwarded."""

    def __init__(self, packet: Any, op: str, gather: bool) -> None:  # noqa: FBT001
        self._packet = packet
        self._call = _direct_call(packet)
        self._op = op
        self._gather = gather

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = ACTIVE
        if t is None or _collective_depth:
            return self._call(*args, **kwargs)
        if _tracing():  # inside torch.compile: the packet itself, which Dynamo puts in the graph
            return self._packet(*args, **kwargs)
        return _issue(t, self._call, self._op, self._gather, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)


class _WaitTensor(_FunctionalOp):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = ACTIVE
        if t is None:
            return self._call(*args, **kwargs)
        if _tracing():
            return self._packet(*args, **kwargs)
        return _await(t, self._call, args, kwargs)


# ====================================================================== compiled code


class _CompiledCall:
    """Stands in for the builtin behind an ``OpOverload`` (its ``_op``), which compiled code calls.

    Inductor's wrapper code and AOTAutograd's graphs call ops by their overloads
    (``torch.ops._c10d_functional.all_reduce_.default(...)``), whose ``__call__`` is ``self._op(...)``: replacing
    that attribute on the few overloads meshscope times reaches compiled code without touching the overload object,
    whose identity and type inductor checks (``type(op) is OpOverload``). An overload hashes by its ``_op``: this
    one hashes as the builtin, so every table keyed by the overload still finds it. Eager calls never come here: the
    packets and ``F.scaled_dot_product_attention`` dispatch in C++.
    """

    __slots__ = ("_builtin",)

    def __init__(self, builtin: Callable[..., Any]) -> None:
        self._builtin = builtin

    def __hash__(self) -> int:
        return hash(self._builtin)

    def __eq__(self, other: object) -> bool:
        return other is self or other == self._builtin

    def __getattr__(self, name: str) -> Any:
        return getattr(self._builtin, name)


class _CompiledCollective(_CompiledCall):
    __slots__ = ("_gather", "_name")

    def __init__(self, builtin: Callable[..., Any], op: str, gather: bool) -> None:  # noqa: FBT001
        super().__init__(builtin)
        self._name = op
        self._gather = gather

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = ACTIVE
        if t is None or _collective_depth or _tracing() or _no_data(args[0] if args else kwargs.get("input")):
            return self._builtin(*args, **kwargs)
        return _issue(t, self._builtin, self._name, self._gather, args, kwargs)


class _CompiledWait(_CompiledCall):
    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # a wait reached again inside a timed one adds a window the step's windows merge with it: no guard needed
        t = ACTIVE
        if t is None or _tracing() or _no_data(args[0] if args else kwargs.get("tensor")):
            return self._builtin(*args, **kwargs)
        return _await(t, self._builtin, args, kwargs)


class _CompiledAttention(_CompiledCall):
    """A fused attention kernel called by compiled code: its forward or its backward, timed alike."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        global _attention_depth  # noqa: PLW0603
        t = ACTIVE
        if t is None or _attention_depth or _tracing() or not t.in_step or (args and _no_data(args[0])):
            return self._builtin(*args, **kwargs)  # inside an eager attention call or span: timed there
        t0 = _perf_ns()
        m0 = t.device_mark(t0) if t.on_device else t0
        _attention_depth += 1
        try:
            out = self._builtin(*args, **kwargs)
        finally:
            _attention_depth -= 1
        try:
            t.on_attention_forward(m0)
        except Exception as exc:  # noqa: BLE001
            t.fault("attention capture", exc)
        return out


ATTENTION_KERNELS: Final = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)
"""``torch.ops.aten`` fused attention kernels (each with its ``_backward``) that compiled code calls by overload."""


def _patch_overloads(packet: Any, make: Callable[[Callable[..., Any]], _CompiledCall]) -> None:
    for name in packet.overloads():
        overload = getattr(packet, name)
        builtin = overload.__dict__.get("_op")
        if builtin is not None and not isinstance(builtin, _CompiledCall):
            _set(overload, "_op", make(builtin))


def _patch_compiled_calls() -> None:
    """Time what compiled code calls by overload: functional collectives, their waits, fused attention kernels."""
    functional = torch.ops._c10d_functional  # noqa: SLF001
    for name, op in FUNCTIONAL_OPS.items():
        with contextlib.suppress(AttributeError, RuntimeError):
            _patch_overloads(
                getattr(functional, name), functools.partial(_CompiledCollective, op=op, gather=name in _GATHERS)
            )
    with contextlib.suppress(AttributeError, RuntimeError):
        _patch_overloads(functional.wait_tensor, _CompiledWait)
    for name in ATTENTION_KERNELS:
        for kernel in (name, f"{name}_backward"):
            with contextlib.suppress(AttributeError, RuntimeError):
                _patch_overloads(getattr(torch.ops.aten, kernel), _CompiledAttention)


# ====================================================================== DDP


class _HookHolder:
    """State of meshscope's DDP comm hook: the inner hook it delegates to (the default, or the user's)."""

    __slots__ = ("hook", "state")

    def __init__(self, state: Any, hook: Callable[[Any, Any], Any]) -> None:
        self.state = state
        self.hook = hook


class _Average:
    """State of :func:`_ddp_average`: the group, and where each gradient was before backward accumulated into it."""

    __slots__ = ("group", "join_work", "kept", "scale", "size")

    def __init__(self, ddp: Any) -> None:
        self.group = ddp.process_group
        self.size = self.group.size()
        self.scale = 1.0 / self.size
        self.join_work: Any = None
        """Under ``Join`` with ``divide_by_initial_world_size=False``: the forward's all-reduce of ones that counts
        the ranks not yet joined (``Join.notify_join_context``), which the reducer divides by; else ``None``."""
        self.kept: dict[Any, int] | None = None
        """``id(param)`` -> the address of its gradient before accumulation (0: none); only where it decides."""
        if self.size & (self.size - 1):
            self.watch(ddp)

    def watch(self, ddp: Any) -> None:
        """Tell the gradients that were a bucket's views before backward from those copied in (only there)."""
        if self.kept is None and getattr(ddp, "gradient_as_bucket_view", False):
            self.kept = {}
            for param in ddp.module.parameters():
                if param.requires_grad:
                    self._watch(param)

    def _watch(self, param: Any) -> None:
        kept = self.kept
        assert kept is not None
        key = id(param)

        def before_accumulation(_grad_outputs: Any) -> None:
            kept[key] = 0
            with contextlib.suppress(Exception):  # a hook must never raise into backward
                grad = param.grad
                if grad is not None and grad.layout is torch.strided:  # a sparse gradient has no address
                    kept[key] = grad.data_ptr()

        # The parameter's AccumulateGrad node, the one DDP's reducer holds: its pre-hook runs before the gradient is
        # accumulated, i.e. before the reducer sees it.
        with torch.enable_grad():
            node = param.view_as(param).grad_fn.next_functions[0][0]
        node.register_prehook(before_accumulation)


def _reduced(fut: Future[Any]) -> Any:
    return fut.value()[0]


def _ddp_average(state: _Average, bucket: Any) -> Future[Any]:
    """Average a bucket's gradients over the group exactly as DDP does without a comm hook.

    DDP's reducer without a hook (``Reducer::mark_variable_ready_dense``, torch/csrc/distributed/c10d/reducer.cpp)
    multiplies each gradient by ``1 / world`` while it copies it into the bucket, and divides it by ``world`` where the
    gradient already is the bucket's view (``gradient_as_bucket_view=True`` with gradients kept between steps) and
    where it is sparse (``mark_variable_ready_sparse``); then it sums. With a hook the reducer only copies. PyTorch's
    ``allreduce_hook`` divides every bucket, which differs from the multiplication in the last bit wherever ``world``
    is not a power of two: a tracked job would not compute what the untracked one does. So: multiply, and divide the
    gradients that were the bucket's views already (known from a pre-hook on their accumulation, only kept where the
    two differ) and sparse ones. Under ``Join`` with ``divide_by_initial_world_size=False`` the reducer divides by the
    ranks not yet joined, which the forward's all-reduce counted (``Reducer::set_divide_factor`` waits for it): so
    does this.
    """
    tensor = bucket.buffer()
    size, scale = state.size, state.scale
    if state.join_work is not None:
        size = _ranks_not_joined(state.join_work)
        scale = 1.0 / size
    kept = state.kept
    if tensor.is_sparse:  # a sparse gradient is a bucket of its own, which the reducer divides
        tensor.div_(size)
    elif kept is None:
        tensor.mul_(scale)
    else:
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            if kept.get(id(param)) == grad.data_ptr():
                grad.div_(size)
            else:
                grad.mul_(scale)
    work: Any = dist.all_reduce(tensor, group=state.group, async_op=True)
    return work.get_future().then(_reduced)  # type: ignore[no-any-return]


def _ranks_not_joined(work: Any) -> int:
    """The count a ``Join`` forward's all-reduce of ones returned (waited for, as the reducer does)."""
    work.wait()
    value = work.get_future().value()
    return int((value[0] if isinstance(value, list) else value).item())


def _notify_join_wrapper(orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def notify_join_context(joinable: Any) -> Any:
        work = orig(joinable)
        with contextlib.suppress(Exception):  # a DDP forward must not fail because of meshscope
            holder = joinable.__dict__.get("_meshscope_hook_holder")
            state = getattr(holder, "state", None)
            if type(state) is _Average:
                counted = work is not None and not getattr(joinable, "_divide_by_initial_world_size", True)
                if counted:
                    state.watch(joinable)
                state.join_work = work if counted else None
        return work

    notify_join_context.__wrapped__ = orig  # type: ignore[attr-defined]
    return notify_join_context


def _follow_join() -> None:
    """Let every hooked DDP see the count of ranks not yet joined that its forward asks ``Join`` for.

    Put in place once, for good: meshscope's comm hook stays on a model after its tracker closed, and so must what
    it divides by. The wrapper only passes the work handle on.
    """
    from torch.distributed.algorithms.join import Join  # noqa: PLC0415

    orig = Join.__dict__["notify_join_context"].__func__
    if not hasattr(orig, "__wrapped__"):
        Join.notify_join_context = staticmethod(_notify_join_wrapper(orig))  # type: ignore[assignment,method-assign]


def _queue_final_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass has finished its graph, after callbacks queued before it."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # noqa: SLF001


def _ddp_hook(holder, bucket):  # type: ignore[no-untyped-def] # noqa: ANN001, ANN202 - DDP rejects annotated hooks
    # DDP's _check_comm_hook refuses a ``bucket`` annotation other than GradBucket and a return annotation other
    # than Future[Tensor]; under ``from __future__ import annotations`` every annotation is a string, so none here.
    global _in_ddp_hook  # noqa: PLW0603 - DDP runs its hooks one at a time on the autograd thread
    t = ACTIVE
    if t is not None:
        t0 = _perf_ns()
        try:
            _ddp_issue[0] = t.device_mark(t0) if t.on_device else t0
        except Exception as exc:  # noqa: BLE001
            t.fault("ddp capture", exc)
    _in_ddp_hook += 1
    try:
        fut = holder.hook(holder.state, bucket)
    finally:
        _in_ddp_hook -= 1
        _ddp_issue[0] = None
    if t is not None:
        try:
            if bucket.is_last():
                t.on_ddp_last_bucket(fut, _queue_final_callback)
        except Exception as exc:  # noqa: BLE001
            t.fault("ddp capture", exc)
    return fut


def _hook_ddp(ddp: Any, register: Callable[..., Any]) -> str | None:
    """Register meshscope's comm hook on ``ddp`` with DDP's own ``register``; why it cannot be, or ``None``.

    A reducer takes one comm hook, once: a DDP whose user registered a hook before the tracker started keeps it. A
    Python hook's collectives still reach the patched ``ProcessGroup`` methods, but its buckets' issue and the
    reducer's wait are not seen; a builtin hook's all-reduces leave from C++ and are not seen at all.
    """
    if getattr(ddp, "_meshscope_hook_holder", None) is not None:
        return None
    if getattr(ddp, "_comm_hooks", None):
        names = ", ".join(getattr(h, "__qualname__", repr(h)) for h, _ in ddp._comm_hooks)  # noqa: SLF001
        return (
            f"it got a comm hook of the user's ({names}) before the tracker started: the hook's collectives are "
            "captured, but not the reducer's wait for them at the end of backward (it reads as compute)"
        )
    try:
        builtin = ddp._get_ddp_logging_data().get("comm_hook")  # noqa: SLF001
    except Exception:  # noqa: BLE001 - only a hint; registering below tells for sure
        builtin = None
    if builtin:
        return (
            f"it got a builtin comm hook ({builtin}) before the tracker started: its gradient all-reduces leave "
            "from C++ and are not captured"
        )
    holder = _HookHolder(_Average(ddp), _ddp_average)
    try:
        register(ddp, holder, _ddp_hook)
    except Exception as exc:  # noqa: BLE001 - the reducer refuses (e.g. a hook registered through C++)
        return f"its reducer refused meshscope's comm hook ({exc})"
    ddp._meshscope_hook_holder = holder  # noqa: SLF001
    _follow_join()
    return None


def _hook_live_ddp(sink: CaptureSink, ddp_type: type, register: Callable[..., Any]) -> None:
    """Give meshscope's comm hook to every DDP built before the tracker started (found once among live objects)."""
    if not (dist.is_available() and dist.is_initialized()):
        return  # no process group yet: no DDP can exist
    for obj in live_instances(ddp_type):
        why = _hook_ddp(obj, register)
        if why is not None:
            sink.uncaptured("ddp", f"a DistributedDataParallel model: {why}")


def live_instances(*types: type) -> list[Any]:
    """Every live instance of ``types`` and their subclasses (classes defined in Python), found once.

    An instance of a class defined in Python refers to its class, so the referrers of the classes hold every live
    instance: found in C, about 7x faster than looping over ``gc.get_objects()`` in Python (hundreds of ms on a rank
    that imported torch), and without an ``isinstance()`` on every object (lazy module proxies warn on it).
    """
    import gc  # noqa: PLC0415

    kinds: set[type] = set()
    todo = list(types)
    while todo:
        kind = todo.pop()
        if kind not in kinds:
            kinds.add(kind)
            todo.extend(kind.__subclasses__())
    return [obj for obj in gc.get_referrers(*kinds) if type(obj) in kinds]


def _patch_ddp() -> tuple[type, Callable[..., Any]]:
    """Patch DDP's construction and hook registration; returns the class and its own ``register_comm_hook``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817, PLC0415

    orig_init = DDP.__init__
    orig_register = DDP.register_comm_hook
    orig_builtin = DDP._register_builtin_comm_hook  # noqa: SLF001

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        orig_init(self, *args, **kwargs)
        t = ACTIVE
        if t is None:
            return
        try:
            why = _hook_ddp(self, orig_register)
            if why is not None:
                t.uncaptured("ddp", f"a DistributedDataParallel model: {why}")
        except Exception as exc:  # noqa: BLE001
            t.fault("ddp comm hook", exc)

    def register_comm_hook(self: Any, state: Any, hook: Callable[[Any, Any], Any]) -> None:
        holder = getattr(self, "_meshscope_hook_holder", None)
        if holder is None:
            return orig_register(self, state, hook)  # type: ignore[no-any-return,unused-ignore]
        holder.state, holder.hook = state, hook
        return None

    def register_builtin(self: Any, comm_hook_type: Any) -> None:
        holder = getattr(self, "_meshscope_hook_holder", None)
        if holder is None:
            return orig_builtin(self, comm_hook_type)  # type: ignore[no-any-return,no-untyped-call,unused-ignore]
        builtin = getattr(dist, "BuiltinCommHookType")  # noqa: B009 - not re-exported in torch's stubs
        if comm_hook_type == builtin.FP16_COMPRESS:
            holder.state, holder.hook = self.process_group, default_hooks.fp16_compress_hook
        else:
            holder.state, holder.hook = self.process_group, default_hooks.allreduce_hook
        return None

    __init__.__wrapped__ = orig_init  # type: ignore[attr-defined]
    _set(DDP, "__init__", __init__)
    _set(DDP, "register_comm_hook", register_comm_hook)
    _set(DDP, "_register_builtin_comm_hook", register_builtin)
    return DDP, orig_register


# ====================================================================== attention


class _AttentionSpan:
    """One attention call's backward span.

    A fused attention kernel (the CPU flash path; flash, memory-efficient and cuDNN on CUDA) leaves one autograd node
    per call as its output's ``grad_fn``: a pre-hook and a post-hook on that node bracket its backward exactly. Node
    hooks die with the graph, so nothing has to be removed. Registering two hooks is most of the SDK's cost per
    attention call (~8 µs on this machine's CPU for node hooks, ~12 µs for tensor hooks). Where attention runs as
    several ops (the math fallback), the span runs from the output's gradient hook to the gradient hook of its first
    non-leaf input; those tensor hooks remove themselves when they fire (a persistent tensor would collect one hook
    per call otherwise).
    """

    __slots__ = ("handles", "start_mark", "tracker")

    def __init__(self, tracker: CaptureSink) -> None:
        self.tracker = tracker
        self.start_mark: Any = None
        self.handles: list[Any] = []

    def opened(self, *_grads: Any) -> None:
        global _attention_depth  # noqa: PLW0603 - autograd runs one node at a time per device thread
        with contextlib.suppress(Exception):  # a hook must never raise into backward; the span is then left out
            self.start_mark = self.tracker.device_mark(_perf_ns())
            _attention_depth += 1

    def closed(self, *_grads: Any) -> None:
        global _attention_depth  # noqa: PLW0603
        with contextlib.suppress(Exception):
            if self.start_mark is not None and _attention_depth > 0:
                _attention_depth -= 1
            self.tracker.on_attention_backward(self.start_mark)
            for handle in self.handles:
                handle.remove()
            self.handles.clear()


_FUSED_NODES: dict[type, bool] = {}
"""Autograd node type -> whether it is one fused attention kernel's backward (decided once per type by its name)."""


def _attention_backward_hooks(t: CaptureSink, args: tuple[Any, ...], out: Any) -> None:
    node = out.grad_fn
    if node is None:
        return
    fused = _FUSED_NODES.get(type(node))
    if fused is None:
        fused = _FUSED_NODES.setdefault(type(node), str(node.name()).startswith("ScaledDotProduct"))
    span = _AttentionSpan(t)
    if fused:
        node.register_prehook(span.opened)
        node.register_hook(span.closed)
        return
    first = next((x for x in args[:3] if type(x) is _Tensor and x.grad_fn is not None), None)
    if first is not None:
        opened = out.register_hook(span.opened)
        closed = first.register_hook(span.closed)  # type: ignore[no-untyped-call]
        span.handles = [opened, closed]


def _sdpa_wrapper(orig: Any) -> Any:
    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
        t = ACTIVE
        if t is None or _tracing() or not t.in_step:
            return orig(*args, **kwargs)
        global _attention_depth  # noqa: PLW0603
        t0 = _perf_ns()
        m0 = t.device_mark(t0) if t.on_device else t0
        _attention_depth += 1
        try:
            out = orig(*args, **kwargs)
        finally:
            _attention_depth -= 1
        try:
            t.on_attention_forward(m0)
            if type(out) is _Tensor and out.requires_grad:
                _attention_backward_hooks(t, args, out)
        except Exception as exc:  # noqa: BLE001
            t.fault("attention capture", exc)
        return out

    scaled_dot_product_attention.__wrapped__ = orig  # type: ignore[attr-defined]
    return scaled_dot_product_attention


# ====================================================================== pipelining phases


def _phase_wrapper(orig: Any, phase: str) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = ACTIVE
        if t is None or not t.in_step:
            return orig(*args, **kwargs)
        with t.phase(phase):
            return orig(*args, **kwargs)

    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapper


def _patch_pipelining(module: Any) -> None:
    """Label pipeline stages' forward and backward chunks as phases (``torch.distributed.pipelining.stage``)."""
    base = getattr(module, "_PipelineStageBase", None)
    for name, phase in (
        ("forward_maybe_with_nosync", "forward"),
        ("backward_maybe_with_nosync", "backward"),
        ("backward_weight_one_chunk", "backward"),
    ):
        if base is not None and hasattr(base, name):
            _set(base, name, _phase_wrapper(getattr(base, name), phase))


# ====================================================================== checkpoints

CHECKPOINT_FUNCTIONS: Final = ("save", "async_save", "load", "save_state_dict", "load_state_dict")
"""``torch.distributed.checkpoint``'s saving and loading functions (``async_save``: its blocking part, the staging
and planning it does before it returns its future)."""


def _coalesced_broadcast_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    """A wrapper of ``dist._broadcast_coalesced`` that records its broadcast as one blocking collective.

    DDP's buffer broadcast at every forward (``broadcast_buffers=True``, the default: a model with buffers,
    BatchNorm's statistics or a registered causal mask, broadcasts them from rank 0 before each forward), its
    parameter broadcast at the wrap, FSDP's ``sync_module_states``. It runs c10d's broadcasts in C++ and waits for
    them there, past the ``ProcessGroup`` methods patched here: uncaptured, a late rank's wait landed in its peers'
    forward as compute and the rank that made them wait went unnamed.
    """

    @functools.wraps(orig)
    def _broadcast_coalesced(process_group: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        t = ACTIVE
        if t is None:
            return orig(process_group, tensors, *args, **kwargs)
        t0 = _perf_ns()
        m0 = t.device_mark(t0) if t.on_device else t0
        out = orig(process_group, tensors, *args, **kwargs)
        try:
            t.on_blocking(process_group, "broadcast", sum(_nbytes(x) for x in tensors), m0)
        except Exception as exc:  # noqa: BLE001 - meshscope must never break the training loop
            t.fault("coalesced broadcast capture", exc)
        return out

    return _broadcast_coalesced


def _patch_coalesced_broadcast() -> None:
    if hasattr(dist, "_broadcast_coalesced"):
        _set(dist, "_broadcast_coalesced", _coalesced_broadcast_wrapper(dist._broadcast_coalesced))  # noqa: SLF001


def _checkpoint_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)  # the signature and docs stay the original's
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = ACTIVE
        if t is None or _tracing():
            return orig(*args, **kwargs)
        return t.checkpointing(orig, args, kwargs)

    return wrapper


def _loader_next_wrapper(orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``_BaseDataLoaderIter.__next__``: every ``DataLoader``'s batches, in any loop, pass through the sink."""

    @functools.wraps(orig)
    def __next__(self: Any) -> Any:  # noqa: N807 - it stands in for the iterator's __next__
        t = ACTIVE
        if t is None:
            return orig(self)
        return t.fetching(orig, self)

    return __next__


def _patch_loaders() -> None:
    """Time every ``DataLoader``'s ``next()`` (its iterators' common base, which the subclasses do not override)."""
    loader_iter = getattr(torch.utils.data.dataloader, "_BaseDataLoaderIter", None)
    if loader_iter is not None and "__next__" in loader_iter.__dict__:
        _set(loader_iter, "__next__", _loader_next_wrapper(loader_iter.__next__))


def _patch_checkpoints(module: Any) -> None:
    """Time ``torch.distributed.checkpoint``'s saves and loads as checkpoints."""
    for name in CHECKPOINT_FUNCTIONS:
        fn = module.__dict__.get(name)
        if callable(fn):
            _set(module, name, _checkpoint_wrapper(fn))


_WHEN_LOADED: Final = {
    "torch.distributed.pipelining.stage": _patch_pipelining,
    "torch.distributed.checkpoint": _patch_checkpoints,
}
"""Patches of modules a script may import after the tracker started: put in place once each is loaded."""
_patched_modules: set[str] = set()


def patch_loaded_modules() -> None:
    """Put the patches of :data:`_WHEN_LOADED` in place for the modules loaded by now (each once)."""
    if len(_patched_modules) == len(_WHEN_LOADED):
        return
    for name, patch in _WHEN_LOADED.items():
        module = sys.modules.get(name)
        if module is not None and name not in _patched_modules:
            _patched_modules.add(name)
            patch(module)


# ====================================================================== install / uninstall


def _set(owner: Any, name: str, value: Any) -> None:
    _saved.append((owner, name, owner.__dict__.get(name, getattr(owner, name))))
    setattr(owner, name, value)


def reset_attention_depth() -> None:
    """Forget attention spans left open (a backward that raised): called as a step starts."""
    global _attention_depth  # noqa: PLW0603
    _attention_depth = 0


def install(tracker: CaptureSink) -> None:
    """Put every patch in place and route them to ``tracker`` (its sink). Idempotent for the same sink."""
    global ACTIVE  # noqa: PLW0603 - the wrappers read one process-wide pointer
    if _saved:
        ACTIVE = tracker
        return
    _patch_compiled_calls()
    pg = dist.ProcessGroup
    for name, (op, size_of) in COLLECTIVE_METHODS.items():
        if hasattr(pg, name):
            _set(pg, name, _collective_wrapper(getattr(pg, name), op, size_of))
    for name, op in P2P_METHODS.items():
        if hasattr(pg, name):
            _set(pg, name, _p2p_wrapper(getattr(pg, name), op, any_source=name == "recv_anysource"))
    _set(dist.Work, "wait", _wait_wrapper(dist.Work.wait))
    for ns_name in ("_c10d_functional", "_c10d_functional_autograd"):
        ns = getattr(torch.ops, ns_name)
        for name, op in FUNCTIONAL_OPS.items():
            try:
                packet = getattr(ns, name)
            except (AttributeError, RuntimeError):
                continue
            _set(ns, name, _FunctionalOp(packet, op, name in _GATHERS))
    functional = torch.ops._c10d_functional  # noqa: SLF001
    _set(functional, "wait_tensor", _WaitTensor(functional.wait_tensor, "wait", gather=False))
    ddp_type, ddp_register = _patch_ddp()
    try:  # capture must not depend on whether the model was wrapped before the tracker started
        _hook_live_ddp(tracker, ddp_type, ddp_register)
    except Exception as exc:  # noqa: BLE001
        tracker.fault("ddp comm hook on a live model", exc)
    _set(
        torch.nn.functional,
        "scaled_dot_product_attention",
        _sdpa_wrapper(torch.nn.functional.scaled_dot_product_attention),
    )
    _set(torch, "save", _checkpoint_wrapper(torch.save))
    _patch_coalesced_broadcast()
    _patch_loaders()
    patch_loaded_modules()
    ACTIVE = tracker


def uninstall() -> None:
    """Restore every original, in reverse order, and detach the tracker."""
    global ACTIVE  # noqa: PLW0603
    ACTIVE = None
    while _saved:
        owner, name, original = _saved.pop()
        with contextlib.suppress(AttributeError, TypeError):
            setattr(owner, name, original)
    _patched_modules.clear()


def installed() -> bool:
    """Whether the patches are in place."""
    return bool(_saved)

"""The NCCL debug log's line grammar: one pure function from a line (bytes or str) to typed events.

Exists so that every NCCL version's lines (``NCCL_DEBUG=INFO``, ``NCCL_DEBUG_SUBSYS=INIT,COLL``) are read in one
place, fast enough for a COLL-heavy log (one line per NCCL call), and so that the follower
(:mod:`~meshscope_sidecar.sources.nccl_log`) and the communicator registry
(:mod:`~meshscope_sidecar.sources.nccl_comms`) never look at text. It must not do I/O, keep state between lines or
raise on any input: a line it cannot read becomes a :class:`Malformed` or :class:`Fragment` event the caller counts.

Formats (NVIDIA/nccl ``src/``, read at 5067397c and at the release tags named; ``../shared/reference/telemetry.md``
§1):

- prefix (``src/debug.cc``): ``<host>:<pid>:<tid> [<cudaDev>] NCCL INFO <message>``; the host is cut at the first
  ``.``; NCCL's own ``[%F %T] `` timestamp (2.23+) may come first, launchers put their own text in front
  (``(RayTrainWorker pid=…) ``, ``pod: ``, ``[1,0]<stdout>:``, ``[default0]:``, container timestamps), so the prefix
  is found anywhere in the line. ``[cudaDev]`` is the logging thread's device, not the rank.
- Init lines (``src/init.cc``): ``comm %p rank %d nranks %d cudaDev %d [nvmlDev %d] [busId %lx] [commId 0x%llx] -
  Init COMPLETE`` up to 2.17 (2.4: ``nvmlDev`` and no ``busId``; 2.6-2.16: ``busId`` and no ``nvmlDev``; 2.17:
  ``commId`` on COMPLETE); 2.18.3 adds ``Init START`` with ``nvmlDev`` and ``commId``; 2.21.5 puts the function name
  in front (``ncclCommInitRank``, ``ncclCommInitRankConfig``, ``ncclCommInitAll``, ``ncclCommSplit``, …) and split
  communicators print ``parent %p color %d key %d`` (2.21/2.22 with ``commId``, 2.23+ without, 2.27 with
  ``splitCount %d``, current with ``childCount %d``; START lines of splits read ``key %d- Init START``); the current
  source prints ``[Rank %d]`` before the function name on Init START. Read as key/value pairs, so every one of these
  is the same grammar.
- comm shape (2.20.3+): ``comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d``.
- Init timings: ``Init timings: rank %d nranks %d total %.2f (kernels %.2f, …)`` (2.22.3), ``Init timings - %s: …``
  (2.23.4+, with ``alloc``).
- MNNVL: ``MNNVL busId 0x%lx fabric UUID %lx.%lx cliqueId 0x%x state %d healthMask 0x%x`` (init.cc) and ``MNNVL %d
  cliqueId %x cliqueSize %d cliqueRank %d[ nvlDomainSize %d]`` (init.cc 2.21-2.2x with a trailing space, mnnvl.cc
  now).
- COLL (``src/enqueue.cc``, stable since 2.4.6): ``%s: opCount %lx sendbuff %p recvbuff %p count %zu datatype %d op
  %d root %d comm %p [nranks=%d] stream %p``; glibc prints a NULL ``%p`` as ``(nil)``; RCCL appends ``task %d
  globalrank %d``.
- Messages were built in a 1024-byte buffer (``src/debug.cc``): a longer line is cut and still ends with a newline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, NamedTuple

from meshscope.records import CommOp

MARKER: Final = b" NCCL INFO "
"""What every INFO line carries between its prefix and its message; the cheap prefilter of the hot path."""

TRUNCATED_LINE_BYTES: Final = 1000
"""An unread NCCL line this long (from its host) is taken as cut at NCCL's 1024-byte message buffer (``debug.cc``:
1023 bytes before the newline in 2.x up to 2.18, 1022 after; NCCL's own timestamp and launcher text come in front)."""

DATATYPE_BYTES: Final[dict[int, int]] = {
    0: 1,  # ncclInt8 / ncclChar
    1: 1,  # ncclUint8
    2: 4,  # ncclInt32 / ncclInt
    3: 4,  # ncclUint32
    4: 8,  # ncclInt64
    5: 8,  # ncclUint64
    6: 2,  # ncclFloat16 / ncclHalf
    7: 4,  # ncclFloat32 / ncclFloat
    8: 8,  # ncclFloat64 / ncclDouble
    9: 2,  # ncclBfloat16
    10: 1,  # ncclFloat8e4m3
    11: 1,  # ncclFloat8e5m2
}
"""Bytes per element of each ``ncclDataType_t`` (``src/nccl.h.in``: ``ncclNumTypes = 12``)."""

DATATYPE_NAMES: Final[dict[int, str]] = {
    0: "int8",
    1: "uint8",
    2: "int32",
    3: "uint32",
    4: "int64",
    5: "uint64",
    6: "float16",
    7: "float32",
    8: "float64",
    9: "bfloat16",
    10: "fp8_e4m3",
    11: "fp8_e5m2",
}
"""Names of the ``ncclDataType_t`` values (``src/nccl.h.in``)."""

REDUCTION_NAMES: Final[dict[int, str]] = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
"""Built-in ``ncclRedOp_t`` values (``src/nccl.h.in``); 5 and above are user-made ops (``ncclRedOpCreate*``)."""

OTHER_OP: Final = "other"
"""The ``op`` label of NCCL calls that are none of :class:`~meshscope.records.CommOp` (signals, puts, ...)."""

OP_LABELS: Final[dict[str, str]] = {
    "AllReduce": CommOp.ALL_REDUCE.value,
    "AllGather": CommOp.ALL_GATHER.value,
    "AllGatherV": CommOp.ALL_GATHER.value,
    "ReduceScatter": CommOp.REDUCE_SCATTER.value,
    "AlltoAll": CommOp.ALL_TO_ALL.value,
    "All2All": CommOp.ALL_TO_ALL.value,
    "Broadcast": CommOp.BROADCAST.value,
    "Reduce": CommOp.REDUCE.value,
    "Gather": CommOp.GATHER.value,
    "Scatter": CommOp.SCATTER.value,
    "Send": CommOp.SEND.value,
    "Recv": CommOp.RECV.value,
}
"""NCCL's op names (``src/collectives.cc`` ``opName``; Inspector's ``ncclFuncToString``) -> the ``op`` label, the
vocabulary of the SDK's records (:class:`~meshscope.records.CommOp`); anything else is :data:`OTHER_OP`."""


def op_label(op_name: str) -> str:
    """The bounded ``op`` label of an NCCL op name (``AllReduce`` -> ``all_reduce``; unknown -> ``other``)."""
    return OP_LABELS.get(op_name, OTHER_OP)


# ----------------------------------------------------------------------------------------------------- events


class Collective(NamedTuple):
    """One COLL line: one NCCL call on one communicator of one process.

    A ``NamedTuple``, not a frozen dataclass like the other events: it is built once per logged call (the hot path),
    and a frozen dataclass costs about four times as much to build. Immutable all the same.

    Message bytes (:attr:`message_bytes`) are ``count × sizeof(datatype)``, what NCCL's ``count`` means per op
    (``src/collectives.cc``): AllReduce, Broadcast, Reduce: the whole buffer; **AllGather: the per-rank send count**
    (the gathered buffer is ``nranks`` times larger); **ReduceScatter: the per-rank receive count** (the input is
    ``nranks`` times larger); Send/Recv: the message to or from ``root`` (the peer); AlltoAll: the per-peer count.
    """

    host: str
    """Host name as NCCL prints it (cut at the first ``.``)."""
    pid: int
    """Process id (unique only on its host)."""
    tid: int
    """Thread id of the logging thread."""
    op_name: str
    """NCCL's op name as printed (``AllReduce``, ``Send``, ...)."""
    op: str
    """The bounded ``op`` label (:func:`op_label`)."""
    op_count: int
    """NCCL's ``opCount`` (hex in the log). Not a sequence number: it stays 0 on single-node communicators since
    NCCL 2.27 (NVIDIA/nccl PR #2021) and stepped by 2 for Send/Recv in older versions."""
    sendbuff: int | None
    """Send buffer address; ``None`` for ``(nil)``."""
    recvbuff: int | None
    """Receive buffer address; ``None`` for ``(nil)``."""
    element_count: int
    """NCCL's ``count``: elements (see the class docstring for what it counts per op; ``count`` itself is a tuple
    method)."""
    datatype: int
    """``ncclDataType_t`` value (:data:`DATATYPE_BYTES`)."""
    reduction: int
    """``ncclRedOp_t`` value (:data:`REDUCTION_NAMES`); meaningless for non-reducing ops."""
    root: int
    """Root rank, or the peer for Send/Recv."""
    comm: int
    """Communicator address: unique only inside one process."""
    nranks: int
    """Ranks in the communicator (``[nranks=%d]``)."""
    stream: int | None
    """CUDA stream address; ``None`` for ``(nil)`` (the default stream)."""
    task: int | None = None
    """RCCL's ``task`` suffix; ``None`` for NCCL."""
    global_rank: int | None = None
    """RCCL's ``globalrank`` suffix; ``None`` for NCCL."""

    @property
    def element_bytes(self) -> int | None:
        """Bytes per element, ``None`` for a datatype this table does not know."""
        return DATATYPE_BYTES.get(self.datatype)

    @property
    def message_bytes(self) -> int | None:
        """``count × sizeof(datatype)``; ``None`` when the datatype is unknown."""
        size = DATATYPE_BYTES.get(self.datatype)
        return None if size is None else self.element_count * size


@dataclass(frozen=True, slots=True, kw_only=True)
class InitLine:
    """An ``Init START`` or ``Init COMPLETE`` line, of any NCCL version."""

    host: str
    """Host name as NCCL prints it."""
    pid: int
    """Process id."""
    tid: int
    """Thread id of the logging thread (the init job's thread: the comm shape and MNNVL lines follow on it)."""
    complete: bool
    """``True`` for ``Init COMPLETE``, ``False`` for ``Init START``."""
    comm: int
    """Communicator address."""
    rank: int
    """Rank in the communicator."""
    nranks: int
    """Ranks in the communicator."""
    cuda_dev: int
    """The communicator's CUDA device (the ``cudaDev`` field, not the prefix's)."""
    func: str | None = None
    """Function name (2.21.5+): ``ncclCommInitRank``, ``ncclCommSplit``, ...; ``None`` before."""
    logged_rank: int | None = None
    """The ``[Rank %d]`` in front of Init START (current source); ``None`` when absent."""
    nvml_dev: int | None = None
    """``nvmlDev``; absent in 2.6-2.17."""
    bus_id: int | None = None
    """``busId`` (hex); absent in 2.4."""
    comm_id: int | None = None
    """``commId`` (hash of the unique id, shared by every member); absent before 2.17 and on most split lines."""
    parent: int | None = None
    """Parent communicator address of a split communicator (same process)."""
    split_count: int | None = None
    """``childCount`` (current) or ``splitCount`` (2.27): which child of the parent this is."""
    color: int | None = None
    """Split color."""
    key: int | None = None
    """Split key."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CommShape:
    """``comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d`` (2.20.3+)."""

    host: str
    """Host name."""
    pid: int
    """Process id."""
    tid: int
    """Thread id."""
    comm: int
    """Communicator address."""
    rank: int
    """Rank in the communicator."""
    nranks: int
    """Ranks in the communicator."""
    n_nodes: int
    """Nodes the communicator spans."""
    local_ranks: int
    """Members on this node."""
    local_rank: int
    """This member's index among them."""
    mnnvl: int
    """Whether multi-node NVLink is used (0/1)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class InitTimings:
    """``Init timings: rank …`` (2.22.3) or ``Init timings - <func>: rank …`` (2.23.4+), seconds."""

    host: str
    """Host name."""
    pid: int
    """Process id."""
    tid: int
    """Thread id (the init job's: the timings belong to the communicator that thread just initialised)."""
    rank: int
    """Rank in the communicator."""
    nranks: int
    """Ranks in the communicator."""
    total_s: float
    """Total init time, seconds."""
    parts_s: tuple[tuple[str, float], ...]
    """The parenthesised parts (``kernels``, ``alloc``, ``bootstrap``, ...), seconds, in printed order."""
    func: str | None = None
    """Function name (2.23.4+)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MnnvlFabric:
    """``MNNVL busId 0x%lx fabric UUID %lx.%lx cliqueId 0x%x state %d healthMask 0x%x``: one GPU's fabric."""

    host: str
    """Host name."""
    pid: int
    """Process id."""
    tid: int
    """Thread id."""
    bus_id: int
    """The GPU's PCI bus id."""
    fabric_uuid: str
    """Cluster UUID as printed (``hi.lo`` hex); ``0.0`` on machines without multi-node NVLink."""
    clique_id: int
    """Clique id; 0 without multi-node NVLink."""
    state: int
    """Fabric state."""
    health_mask: int
    """Health mask."""

    @property
    def nvlink_domain(self) -> tuple[str, int] | None:
        """The NVLink domain key ``(fabric UUID, cliqueId)``; ``None`` for non-MNNVL machines (``0.0``, ``0x0``)."""
        if self.fabric_uuid == "0.0" and self.clique_id == 0:
            return None
        return (self.fabric_uuid, self.clique_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class MnnvlClique:
    """``MNNVL %d cliqueId %x cliqueSize %d cliqueRank %d[ nvlDomainSize %d]``: the clique a communicator uses."""

    host: str
    """Host name."""
    pid: int
    """Process id."""
    tid: int
    """Thread id (the init job's)."""
    mnnvl: int
    """Whether multi-node NVLink is used (0/1)."""
    clique_id: int
    """Clique id."""
    clique_size: int
    """Members of the communicator in the clique."""
    clique_rank: int
    """This member's index in the clique."""
    nvl_domain_size: int | None = None
    """``nvlDomainSize`` (current source); ``None`` before."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Malformed:
    """A line that has NCCL's prefix and the shape of a line this module reads, but fields that do not parse."""

    kind: str
    """What it looked like: ``prefix``, ``coll``, ``init``, ``shape``, ``timings``, ``mnnvl``."""
    reason: str
    """Why it was rejected, in words."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Fragment:
    """Part of a line: cut at NCCL's buffer, cut by another process' output, or the tail of such a cut."""

    reason: str
    """``truncated`` (cut at 1024 bytes), ``interleaved`` (another NCCL prefix started inside it), ``cut`` (a
    known line's shape ends early) or ``orphan`` (a tail of a known line without its prefix)."""


NcclEvent = Collective | InitLine | CommShape | InitTimings | MnnvlFabric | MnnvlClique | Malformed | Fragment
"""What :func:`parse_line` returns, zero or more per line."""

# ----------------------------------------------------------------------------------------------------- parsing

_NOTHING: Final[tuple[NcclEvent, ...]] = ()
_HOST_CHARS: Final = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_" + bytes(range(0x80, 0x100))
"""What a host name NCCL prints (``gethostname()``) is made of: a name outside RFC 1123's letters (``nöde-1``, in
UTF-8) is read whole, not cut to its ASCII tail."""
_HOST_TAIL: Final = re.compile(rb"[A-Za-z0-9_\x80-\xff-]+\Z")
_ANSI: Final = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]")
"""A terminal escape sequence (CSI: colours, cursor moves), as Ray and colouring log shippers wrap lines in."""
_COLL_WORDS: Final = [b"opCount", b"sendbuff", b"recvbuff", b"count", b"datatype", b"op", b"root", b"comm"]
_RCCL_WORDS: Final = [b"task", b"globalrank"]
_NIL: Final = b"(nil)"
_OP_NAMES: dict[bytes, tuple[str, str]] = {}  # op name bytes -> (name, label): decoded once per name, bounded below
_OP_NAMES_MAX: Final = 256
# The text before the marker -> its prefix: one process' lines repeat it, so the hot path reads it once. Bounded:
# launcher timestamps make every line's text different, and then the cache is cleared when full.
_PREFIXES: dict[bytes, _Prefix | None] = {}
_PREFIXES_MAX: Final = 4096
_ORPHAN_MARKS: Final = (b"[nranks=", b"- Init ")
_TIMINGS: Final = re.compile(
    rb"Init timings(?: - (?P<func>\S+))?: rank (?P<rank>\d+) nranks (?P<nranks>\d+) total (?P<total>\d+\.?\d*)"
    rb" \((?P<parts>[^)]*)\)\Z"
)
_TIMING_PART: Final = re.compile(rb"\A(?P<name>[a-z]+) (?P<value>\d+\.?\d*)\Z")


class _Prefix(NamedTuple):
    start: int
    host: str
    pid: int
    tid: int


def _before_timestamp(line: bytes, marker: int, lo: int) -> int | None:
    """Where ``host:pid:tid [dev]`` ends when a timestamp of digits stands between it and ``marker`` (old RCCL)."""
    digits = marker
    while digits > lo and 0x30 <= line[digits - 1] <= 0x39:
        digits -= 1
    if digits == marker or line[digits - 2 : digits] != b"] ":
        return None
    return digits - 1


def _prefix(line: bytes, marker: int, lo: int, hosts: frozenset[str]) -> _Prefix | None:
    """NCCL's ``host:pid:tid [dev]`` ending at ``marker``, not starting before ``lo``; ``None`` if absent.

    Old RCCL releases wrote a timestamp in µs between the device and the marker (``host:pid:tid [1] 1558545003174220
    NCCL INFO AllReduce: ...``, as ROCm's rocm-timeline-generator reads them): the prefix then ends before it.
    """
    if line[marker - 1 : marker] != b"]":
        before = _before_timestamp(line, marker, lo)
        if before is None:
            return None
        marker = before
    bracket = line.rfind(b" [", lo, marker)
    if bracket < 0 or not line[bracket + 2 : marker - 1].isdigit():
        return None
    start = max(lo, line.rfind(b" ", lo, bracket) + 1)
    parts = line[start:bracket].rsplit(b":", 2)
    if len(parts) != 3:
        return None
    host_raw, pid, tid = parts
    if not (pid.isdigit() and tid.isdigit()):
        return None
    named = _host(host_raw, hosts)
    if named is None:
        return None
    host, host_bytes = named
    return _Prefix(bracket - host_bytes - len(pid) - len(tid) - 2, host, int(pid), int(tid))


def _host(raw: bytes, hosts: frozenset[str]) -> tuple[str, int] | None:
    """The host name that ends ``raw`` (the text before ``:pid:tid``) and its length in bytes; ``None`` if none."""
    host_b = raw.rpartition(b":")[2]  # mpirun's "[1,0]<stdout>:" and torchrun's "[default0]:" end in ':'
    if host_b.translate(None, _HOST_CHARS):
        tail = _HOST_TAIL.search(host_b)
        host_b = tail.group() if tail else b""
    if not host_b:
        return None
    host = host_b.decode("utf-8", "replace")
    if hosts and host not in hosts:  # glued to the cut line before it: take the known host it ends with
        for known in hosts:
            known_b = known.encode("utf-8", "surrogateescape")
            if host_b.endswith(known_b):
                return known, len(known_b)
    return host, len(host_b)


def parse_line(line: bytes | str, hosts: frozenset[str] = frozenset()) -> tuple[NcclEvent, ...]:
    """Read one log line: the NCCL events in it, wherever NCCL's prefix starts.

    Lines of other programs and NCCL lines this module does not read (channels, rings, tuning, ...) give no event.
    A line where a second NCCL prefix starts is split there (several ranks writing one stream); each part is read
    on its own, and a part that no longer reads is a :class:`Fragment`.

    Args:
        line: one line, with or without its newline; bytes as read from the file (str is encoded as UTF-8).
        hosts: host names seen so far (optional): when a prefix is glued to the cut line before it
            (``…sendbufnode-0:12:13 [0] NCCL INFO …``), the host is taken as the known name it ends with.

    Returns:
        The events, in line order; empty for a line with nothing to read. Never raises.
    """
    try:
        return _parse(line, hosts)
    except (ValueError, IndexError, UnicodeError) as exc:  # e.g. a 5,000-digit pid: int() refuses it
        return (Malformed(kind="line", reason=f"{type(exc).__name__}: {str(exc)[:80]}"),)


def _cleaned(line: bytes | str) -> bytes:
    """The line as bytes, without its newline and terminal escapes (an escape glued to the last token broke it)."""
    if isinstance(line, str):
        line = line.encode("utf-8", "surrogateescape")
    line = line.rstrip(b"\r\n")
    return _ANSI.sub(b"", line) if b"\x1b[" in line else line


def _parse(line: bytes | str, hosts: frozenset[str]) -> tuple[NcclEvent, ...]:
    """:func:`parse_line` without its safety net."""
    line = _cleaned(line)
    first = line.find(MARKER)
    if first < 0:
        for mark in _ORPHAN_MARKS:
            if mark in line:
                return (Fragment(reason="orphan"),)
        return _NOTHING
    if line.find(MARKER, first + 11) < 0:
        head = line[:first]
        prefix = _PREFIXES.get(head)
        if prefix is None:
            prefix = _prefix(line, first, 0, hosts)
            if len(_PREFIXES) >= _PREFIXES_MAX:
                _PREFIXES.clear()
            _PREFIXES[head] = prefix
        if prefix is None:
            return (Malformed(kind="prefix", reason="no host:pid:tid [dev] before NCCL INFO"),)
        body = line[first + 11 :]
        colon = body.find(b": opCount ")
        if 0 < colon <= 32:  # the hot path: a COLL line, read without the dispatch
            return (_collective(body, prefix),)
        event = _message(line, prefix, first + 11, len(line))
        return _NOTHING if event is None else (event,)
    return _split(line, first, hosts)


def _split(line: bytes, first: int, hosts: frozenset[str]) -> tuple[NcclEvent, ...]:
    """Read a line with several NCCL prefixes: one part per prefix, every part but the last cut by the next."""
    markers = [first]
    at = line.find(MARKER, first + 11)
    while at >= 0:
        markers.append(at)
        at = line.find(MARKER, at + 11)
    prefixes: list[tuple[int, _Prefix | None]] = []
    lo = 0
    for m in markers:
        p = _prefix(line, m, lo, hosts)
        prefixes.append((m, p))
        lo = m + 11
    ends = _part_ends(line, prefixes)
    events: list[NcclEvent] = []
    unreadable = False
    for i, (m, p) in enumerate(prefixes):
        end = ends[i]
        while end > m + 11 and line[end - 1] == 0x20:  # the space before the next prefix
            end -= 1
        if p is None:
            if not unreadable:  # one per line: a garbage line of many markers is one error, not thousands
                events.append(Malformed(kind="prefix", reason="no host:pid:tid [dev] before NCCL INFO"))
                unreadable = True
            continue
        event = _message(line, p, m + 11, end)
        if i < len(prefixes) - 1 and (event is None or isinstance(event, Malformed | Fragment)):
            events.append(Fragment(reason="interleaved"))  # cut by the next prefix and no longer readable
        elif event is not None:
            events.append(event)
    return tuple(events)


def _part_ends(line: bytes, prefixes: list[tuple[int, _Prefix | None]]) -> list[int]:
    """Where each part of a line with several markers ends.

    At the start of the next readable prefix (past markers without one), else at the last marker; the last part at
    the line's end. Found from the right in one pass: a line of thousands of bare markers took seconds, quadratically.
    """
    last = len(prefixes) - 1
    ends = [len(line)] * len(prefixes)
    following: int | None = None  # where the first readable prefix after the current part starts
    for i in range(last - 1, -1, -1):
        p_next = prefixes[i + 1][1]
        if p_next is not None:
            following = p_next.start
        ends[i] = following if following is not None else prefixes[last][0]
    return ends


def _message(line: bytes, p: _Prefix, start: int, end: int) -> NcclEvent | None:  # noqa: PLR0911 - one per shape
    """Dispatch one message (``line[start:end]``) on its shape; ``None`` for a line this module does not read."""
    body = line[start:end]
    colon = body.find(b": opCount ")
    if 0 < colon <= 32:
        return _collective(body, p)
    if body.endswith((b"Init START", b"Init COMPLETE")):
        return _init(body, p)
    if body.startswith(b"comm ") and b" nRanks " in body:
        return _shape(body, p)
    if body.startswith(b"MNNVL "):
        return _mnnvl(body, p)
    if body.startswith(b"Init timings"):
        return _timings(body, p)
    if end - p.start >= TRUNCATED_LINE_BYTES:
        return Fragment(reason="truncated")
    if b"- Init " in body:  # an Init line cut before its end
        return Fragment(reason="cut")
    return None


def _ptr(token: bytes) -> int | None:
    """A ``%p``: ``0x…`` or ``(nil)``. Raises ValueError otherwise."""
    if token == _NIL:
        return None
    if token[:2] != b"0x":
        raise ValueError("not a pointer")
    return int(token, 16)


def _collective(body: bytes, p: _Prefix) -> Collective | Malformed | Fragment:  # noqa: PLR0911 - one per rule
    """Read a COLL line; positions are fixed by the format, so one split and fixed indices read it."""
    t = body.split(b" ")
    n = len(t)
    if n not in {20, 24} or t[1:17:2] != _COLL_WORDS or t[18] != b"stream":
        k = min(n - 1, 17) // 2  # the words before the last (maybe cut) token
        if n < 20 and t[1 : 2 * k : 2] == _COLL_WORDS[:k]:
            return Fragment(reason="cut")
        return Malformed(kind="coll", reason="not the COLL line's fields")
    nranks_tok = t[17]
    if nranks_tok[:8] != b"[nranks=" or nranks_tok[-1:] != b"]":
        return Malformed(kind="coll", reason="no [nranks=N]")
    try:
        name = _OP_NAMES.get(t[0])
        if name is None:
            name = _op_name(t[0])
        count = int(t[8])
        nranks = int(nranks_tok[8:-1])
        root = int(t[14])
        if count < 0 or nranks < 1 or root < -1:
            return Malformed(kind="coll", reason="negative count or root, or no ranks")
        task = global_rank = None
        if n == 24:
            if t[20:24:2] != _RCCL_WORDS:
                return Malformed(kind="coll", reason="unknown suffix after stream")
            task, global_rank = int(t[21]), int(t[23])
        comm_tok = t[16]
        if comm_tok[:2] != b"0x":
            return Malformed(kind="coll", reason="comm is not an address")
        comm = int(comm_tok, 16)
        send, recv, stream = t[4], t[6], t[19]
        return Collective(
            p.host,
            p.pid,
            p.tid,
            name[0],
            name[1],
            int(t[2], 16),
            None if send == _NIL else int(send, 16),
            None if recv == _NIL else int(recv, 16),
            count,
            int(t[10]),
            int(t[12]),
            root,
            comm,
            nranks,
            None if stream == _NIL else int(stream, 16),
            task,
            global_rank,
        )
    except ValueError as exc:
        return Malformed(kind="coll", reason=f"bad number: {exc}")


def _op_name(token: bytes) -> tuple[str, str]:
    """Decode and check an op name (``AllReduce:``); cached, the cache bounded. Raises ValueError."""
    raw = token[:-1]
    if not raw.isalnum() or not raw[:1].isalpha():
        raise ValueError("op name is not a word")
    name = raw.decode("ascii")
    entry = (name, op_label(name))
    if len(_OP_NAMES) < _OP_NAMES_MAX:
        _OP_NAMES[token] = entry
    return entry


_INIT_INT_KEYS: Final = {
    b"rank": "rank",
    b"nranks": "nranks",
    b"cudaDev": "cuda_dev",
    b"nvmlDev": "nvml_dev",
    b"color": "color",
    b"key": "key",
    b"childCount": "split_count",
    b"splitCount": "split_count",
}
_INIT_HEX_KEYS: Final = {b"busId": "bus_id", b"commId": "comm_id"}
_INIT_PTR_KEYS: Final = {b"comm": "comm", b"parent": "parent"}


def _init(body: bytes, p: _Prefix) -> InitLine | Malformed:  # noqa: C901, PLR0911, PLR0912 - one rule after another
    """Read an Init START / COMPLETE line of any version as ``[Rank N] [func] key value … - Init X``."""
    complete = body.endswith(b"COMPLETE")
    text = body[: -len(b"Init COMPLETE" if complete else b"Init START")].rstrip()
    if not text.endswith(b"-"):
        return Malformed(kind="init", reason="no ' - ' before Init")
    tokens = text[:-1].split()
    logged_rank: int | None = None
    try:
        if tokens[:1] == [b"[Rank"]:
            if len(tokens) < 2 or tokens[1][-1:] != b"]":
                return Malformed(kind="init", reason="[Rank N] not closed")
            logged_rank = int(tokens[1][:-1])
            tokens = tokens[2:]
        func: str | None = None
        if tokens[:1] != [b"comm"]:
            if not tokens or not tokens[0].isalnum():
                return Malformed(kind="init", reason="no comm field")
            func = tokens[0].decode("ascii")
            tokens = tokens[1:]
        if len(tokens) % 2:
            return Malformed(kind="init", reason="a field without a value")
        fields: dict[str, int | None] = {}
        for k, v in zip(tokens[::2], tokens[1::2], strict=True):
            if k in _INIT_INT_KEYS:
                fields[_INIT_INT_KEYS[k]] = int(v)
            elif k in _INIT_HEX_KEYS:
                fields[_INIT_HEX_KEYS[k]] = int(v, 16)
            elif k in _INIT_PTR_KEYS:
                fields[_INIT_PTR_KEYS[k]] = _ptr(v)
            # other keys: fields of a later version, skipped
    except ValueError as exc:
        return Malformed(kind="init", reason=f"bad number: {exc}")
    comm, rank, nranks, cuda_dev = fields.get("comm"), fields.get("rank"), fields.get("nranks"), fields.get("cuda_dev")
    if comm is None or rank is None or nranks is None or cuda_dev is None:
        return Malformed(kind="init", reason="comm, rank, nranks or cudaDev missing")
    if not 0 <= rank < nranks:
        return Malformed(kind="init", reason=f"rank {rank} outside [0, {nranks})")
    return InitLine(
        host=p.host,
        pid=p.pid,
        tid=p.tid,
        complete=complete,
        comm=comm,
        rank=rank,
        nranks=nranks,
        cuda_dev=cuda_dev,
        func=func,
        logged_rank=logged_rank,
        nvml_dev=fields.get("nvml_dev"),
        bus_id=fields.get("bus_id"),
        comm_id=fields.get("comm_id"),
        parent=fields.get("parent"),
        split_count=fields.get("split_count"),
        color=fields.get("color"),
        key=fields.get("key"),
    )


_SHAPE_WORDS: Final = [b"comm", b"rank", b"nRanks", b"nNodes", b"localRanks", b"localRank", b"MNNVL"]


def _shape(body: bytes, p: _Prefix) -> CommShape | Malformed:
    """Read ``comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d``."""
    t = body.split()
    if len(t) != 14 or t[0::2] != _SHAPE_WORDS:
        return Malformed(kind="shape", reason="not the comm shape line's fields")
    try:
        comm = _ptr(t[1])
        rank, nranks, n_nodes, local_ranks, local_rank, mnnvl = (int(x) for x in t[3::2])
    except ValueError as exc:
        return Malformed(kind="shape", reason=f"bad number: {exc}")
    if comm is None or not 0 <= rank < nranks or not 0 <= local_rank < local_ranks or not 1 <= n_nodes <= nranks:
        return Malformed(kind="shape", reason="fields out of range")
    return CommShape(
        host=p.host,
        pid=p.pid,
        tid=p.tid,
        comm=comm,
        rank=rank,
        nranks=nranks,
        n_nodes=n_nodes,
        local_ranks=local_ranks,
        local_rank=local_rank,
        mnnvl=mnnvl,
    )


_FABRIC_WORDS: Final = [b"MNNVL", b"busId", b"fabric", b"UUID", b"cliqueId", b"state", b"healthMask"]


def _mnnvl(body: bytes, p: _Prefix) -> MnnvlFabric | MnnvlClique | Malformed | None:  # noqa: PLR0911 - one per rule
    """Read the MNNVL fabric line (per GPU) or clique line (per communicator); other MNNVL lines give nothing."""
    t = body.split()
    try:
        if t[1:2] == [b"busId"]:
            if len(t) != 12 or [t[0], t[1], t[3], t[4], t[6], t[8], t[10]] != _FABRIC_WORDS:
                return Malformed(kind="mnnvl", reason="not the fabric line's fields")
            hi, dot, lo = t[5].partition(b".")
            if not dot:
                return Malformed(kind="mnnvl", reason="fabric UUID is not hi.lo")
            uuid = f"{int(hi, 16):x}.{int(lo, 16):x}"
            return MnnvlFabric(
                host=p.host,
                pid=p.pid,
                tid=p.tid,
                bus_id=int(t[2], 16),
                fabric_uuid=uuid,
                clique_id=int(t[7], 16),
                state=int(t[9]),
                health_mask=int(t[11], 16),
            )
        if t[2:3] == [b"cliqueId"]:
            if len(t) not in {8, 10} or t[4] != b"cliqueSize" or t[6] != b"cliqueRank":
                return Malformed(kind="mnnvl", reason="not the clique line's fields")
            if len(t) == 10 and t[8] != b"nvlDomainSize":
                return Malformed(kind="mnnvl", reason="unknown field after cliqueRank")
            return MnnvlClique(
                host=p.host,
                pid=p.pid,
                tid=p.tid,
                mnnvl=int(t[1]),
                clique_id=int(t[3], 16),
                clique_size=int(t[5]),
                clique_rank=int(t[7]),
                nvl_domain_size=int(t[9]) if len(t) == 10 else None,
            )
    except ValueError as exc:
        return Malformed(kind="mnnvl", reason=f"bad number: {exc}")
    return None


def _timings(body: bytes, p: _Prefix) -> InitTimings | Malformed:
    """Read ``Init timings[ - func]: rank %d nranks %d total %.2f (name %.2f, …)``."""
    m = _TIMINGS.match(body)
    if m is None:
        return Malformed(kind="timings", reason="not the Init timings line's fields")
    parts: list[tuple[str, float]] = []
    for raw in m["parts"].split(b", "):
        pm = _TIMING_PART.match(raw)
        if pm is None:
            return Malformed(kind="timings", reason="a part is not 'name seconds'")
        parts.append((pm["name"].decode("ascii"), float(pm["value"])))
    rank, nranks = int(m["rank"]), int(m["nranks"])
    if not 0 <= rank < nranks:
        return Malformed(kind="timings", reason=f"rank {rank} outside [0, {nranks})")
    return InitTimings(
        host=p.host,
        pid=p.pid,
        tid=p.tid,
        rank=rank,
        nranks=nranks,
        total_s=float(m["total"]),
        parts_s=tuple(parts),
        func=m["func"].decode("ascii", "replace") if m["func"] else None,
    )

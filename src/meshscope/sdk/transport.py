"""The local record transport: one datagram per record, from each training rank to a collector on the same host.

Why it exists: the SDK must hand every rank's step record to someone (``meshscope run``'s in-process collector, the
per-pod sidecar's training-loop source) without ever slowing the training loop. A Unix datagram socket in
non-blocking mode gives exactly that contract: a send either completes at once or fails at once, so when nobody
listens, or the listener is behind and its queue is full, the record is **dropped and counted**, never queued in the
training process and never waited for. Datagrams keep record boundaries, so a reader never sees half a record. The
protocol has one reader, :class:`RecordReader`, with a pluggable :class:`RecordSink`: ``meshscope run`` writes a
file (:class:`RecordCollector`), the sidecar keeps a bounded buffer of recent steps.

Protocol (``docs/sdk.md``, "Transport"):

* address: ``unix:/absolute/path`` (a filesystem socket) or ``unix:@name`` (Linux abstract namespace); a bare
  absolute path is accepted too. ``meshscope run`` gives every rank its own socket, so one rank's burst cannot fill
  another's queue. ``file:/directory`` is no socket: each rank appends its records to its own file there
  (:class:`RecordFile`), for jobs launched without ``meshscope run`` or a sidecar (``torchrun``, SLURM's ``srun``).
* one datagram = one JSON object, UTF-8. A payload over :data:`COMPRESS_ABOVE_BYTES` is sent zlib-compressed; a reader
  tells the two apart by the first byte (``{`` for JSON, ``0x78`` for zlib).
* a record has ``"schema": "meshscope.step/1"`` (``docs/records.md``) plus an ``"sdk"`` object of cumulative counters
  (``dropped_records``, ...): whatever was dropped before is reported by the next record that gets through. Control
  messages have ``"schema": "meshscope.sdk/1"`` and an ``"event"`` (``hello`` at start, ``close`` at exit, with the
  final counters; ``measurements`` with the job's description, model-state and activation bytes).

This module is pure standard library: it must not import torch, must not raise into its caller on the sending side
(every failure becomes a counter), and must not parse records beyond the few fields it tallies (the sinks do).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import selectors
import socket
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol, TypeGuard

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

log = logging.getLogger("meshscope.sdk")

RECORD_SCHEMA = "meshscope.step/1"
"""Schema tag of a step record."""
CONTROL_SCHEMA = "meshscope.sdk/1"
"""Schema tag of a control message (hello, close)."""
COMPRESS_ABOVE_BYTES = 48 * 1024
"""Payloads larger than this many bytes are zlib-compressed before sending."""
SEND_BUFFER_BYTES = 4 * 1024 * 1024
"""Requested ``SO_SNDBUF``, bytes (the kernel caps it at ``net.core.wmem_max``); bounds the largest datagram."""
RECEIVE_BUFFER_BYTES = 4 * 1024 * 1024
"""Requested ``SO_RCVBUF`` of a collector socket, bytes."""
MAX_DATAGRAM_BYTES = 4 * 1024 * 1024
"""Largest datagram a collector reads, bytes."""
MAX_PIDS = 4096
"""Processes whose latest ``hello`` a reader remembers (:attr:`RecordReader.rank_of_pid`), the newest kept."""

_ZLIB_FIRST_BYTE = 0x78
_FAST_PREFIX = b'{"schema":"meshscope.step/1","job":'
_FAST_HEAD = re.compile(rb'\{"schema":"meshscope\.step/1","job":"(?:[^"\\]|\\.)*","step":\d+,"rank":(\d+),')
_FAST_SPAN = re.compile(rb'"start_us":(-?\d+),"end_us":(-?\d+),"intervals":')


class AddressError(ValueError):
    """A collector address that is not ``unix:/path``, ``unix:@name``, an absolute path or ``file:/directory``."""


FILE_SCHEME = "file:"
"""A collector address that names a directory of per-rank record files (:class:`RecordFile`)."""


def parse_address(address: str) -> str | bytes:
    """The ``AF_UNIX`` address of ``unix:/path``, ``unix:@name`` or ``/path``.

    Returns:
        A filesystem path (``str``) or an abstract-namespace name (``bytes`` starting with NUL).

    Raises:
        AddressError: for anything else.
    """
    text = address.strip()
    if text.startswith("unix:"):
        text = text[len("unix:") :]
        text = text.removeprefix("//")
    if text.startswith("@") and len(text) > 1:
        return b"\0" + text[1:].encode()
    if text.startswith("/"):
        return text
    raise AddressError(f"collector address {address!r} is not 'unix:/absolute/path', 'unix:@name' or an absolute path")


def encode(message: dict[str, Any]) -> bytes:
    """One datagram for ``message``: compact JSON, zlib-compressed above :data:`COMPRESS_ABOVE_BYTES`."""
    return pack(json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode())


def pack(data: bytes) -> bytes:
    """One datagram for encoded JSON ``data``: itself, or zlib-compressed above :data:`COMPRESS_ABOVE_BYTES`."""
    if len(data) > COMPRESS_ABOVE_BYTES:
        return zlib.compress(data, 1)
    return data


def decode(datagram: bytes) -> dict[str, Any]:
    """The JSON object of one datagram (decompressing it when it starts with the zlib header byte).

    Raises:
        ValueError: if the datagram is not one JSON object (``zlib.error`` and ``json.JSONDecodeError`` are both
            ``ValueError``-compatible here).
    """
    if datagram[:1] == bytes([_ZLIB_FIRST_BYTE]):
        try:
            datagram = zlib.decompress(datagram)
        except zlib.error as exc:
            raise ValueError(f"corrupt compressed datagram: {exc}") from None
    obj = json.loads(datagram)
    if not isinstance(obj, dict):
        raise ValueError(f"datagram holds a JSON {type(obj).__name__}, not an object")  # noqa: TRY004 - bad input
    return obj


class RecordSender:
    """The training side: sends datagrams without ever blocking, counting what it had to drop.

    Not thread-safe by design: one tracker sends from one place (step end) at a time.
    """

    def __init__(self, address: str | None) -> None:
        """Open a non-blocking datagram socket towards ``address`` (``None``: drop everything, counted).

        Never raises: a bad address or a socket failure is logged once and every later record counts as dropped.
        """
        self.sent = 0
        """Datagrams the kernel accepted."""
        self.dropped = 0
        """Datagrams dropped: no listener, queue full, too large, or no address."""
        self.oversize = 0
        """Of :attr:`dropped`, those the kernel refused as too large."""
        self.last_error: str | None = None
        """The reason of the most recent drop, for people."""
        self._target: str | bytes | None = None
        self._sock: socket.socket | None = None
        if address is None:
            self.last_error = "no collector address (MESHSCOPE_COLLECTOR unset)"
            return
        try:
            self._target = parse_address(address)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)  # noqa: FBT003 - the socket API
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            self._sock = sock
        except (OSError, AddressError) as exc:
            self.last_error = str(exc)
            log.warning("meshscope: records will be dropped: %s", exc)

    def send(self, message: dict[str, Any]) -> bool:
        """Encode and send ``message``; ``False`` (and counted) when it was dropped. Never raises, never blocks."""
        try:
            data = encode(message)
        except (TypeError, ValueError) as exc:
            self.dropped += 1
            self.last_error = f"record not encodable: {exc}"
            return False
        return self.send_bytes(data)

    def send_record(self, data: bytes) -> bool:
        """Send one step record (its JSON, the ``sdk`` counters last); ``False`` (and counted) when dropped."""
        return self.send_bytes(pack(data))

    def send_bytes(self, data: bytes) -> bool:
        """Send one datagram; ``False`` (and counted) when it was dropped. Never raises, never blocks."""
        if self._sock is None or self._target is None:
            self.dropped += 1
            return False
        try:
            self._sock.sendto(data, self._target)
        except OSError as exc:
            self.dropped += 1
            if exc.errno == errno.EMSGSIZE:
                self.oversize += 1
            elif exc.errno in {errno.EACCES, errno.EPERM} and not self.last_error:
                log.warning(
                    "meshscope: the collector's socket %s refuses this process (%s): its records are dropped; a "
                    "collector of meshscope 0.1.0 or later (meshscope run, the sidecar) lets any user of the pod "
                    "send: upgrade it, or run the training process as the collector's user",
                    self._target,
                    exc.strerror or exc,
                )
            self.last_error = f"{type(exc).__name__}: {exc.strerror or exc}"
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        """Close the socket; later sends count as dropped."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


class RecordFile:
    """The training side without a collector: each rank appends its step records to its own file in a directory.

    ``MESHSCOPE_COLLECTOR=file:/shared/run-7`` on every rank of a job launched by ``torchrun`` or ``srun``; then
    ``meshscope analyze /shared/run-7``. The file is ``rank-NNNNN.jsonl``, one record per line exactly as a collector
    writes it (without the ``sdk`` counters), opened at the first record: the rank is known by then even where the
    environment had it wrong (``Operations.take_identity``). A write that fails is dropped and counted like a
    datagram; control messages are not written (a file has no one to greet). Same interface as
    :class:`RecordSender`.
    """

    def __init__(self, directory: str, rank: Callable[[], int]) -> None:
        """Write under ``directory`` (made if missing) the records of the rank that ``rank()`` names at the first one.

        Never raises: a directory that cannot be made is logged once and every record counts as dropped.
        """
        self.sent = 0
        self.dropped = 0
        self.oversize = 0
        self.last_error: str | None = None
        # A relative directory is the rank's working directory's, taken now (``file:recs`` as typed beside torchrun):
        # a script that changes directory later still writes where the user looks.
        self._directory = Path(directory).absolute()
        self._rank = rank
        self._file: IO[bytes] | None = None
        self._closed = False

    @property
    def path(self) -> Path | None:
        """The rank's file, once the first record opened it."""
        return None if self._file is None else Path(self._file.name)

    def send(self, message: dict[str, Any]) -> bool:  # noqa: ARG002 - RecordSender's interface
        """A control message: nothing to write (``True``)."""
        return True

    def send_record(self, data: bytes) -> bool:
        """Append one record as a line; ``False`` (and counted) when it could not be written."""
        cut = data.rfind(b',"sdk":{')
        line = (data[:cut] + b"}\n") if cut >= 0 and data.endswith(b"}}") else data + b"\n"
        try:
            if self._file is None:
                if self._closed or not self._directory.is_absolute():
                    raise OSError("closed" if self._closed else "not an absolute path")  # noqa: TRY301
                self._directory.mkdir(parents=True, exist_ok=True)
                self._file = (self._directory / f"rank-{self._rank():05d}.jsonl").open("ab")
            self._file.write(line)
            self._file.flush()
        except OSError as exc:
            self.dropped += 1
            if self.last_error is None:
                log.warning("meshscope: records will be dropped: cannot write under %s: %s", self._directory, exc)
            self.last_error = f"cannot write under {self._directory}: {exc}"
            return False
        self.sent += 1
        return True

    def send_bytes(self, data: bytes) -> bool:
        """A datagram of another kind: nothing is written (counted as dropped)."""
        del data
        self.dropped += 1
        return False

    def close(self) -> None:
        """Close the file; later records count as dropped."""
        self._closed = True
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


def open_sender(address: str | None, rank: Callable[[], int]) -> RecordSender | RecordFile:
    """The sending side for ``address``: a :class:`RecordFile` for ``file:/directory``, else a :class:`RecordSender`."""
    if address is not None and address.strip().startswith(FILE_SCHEME):
        return RecordFile(address.strip()[len(FILE_SCHEME) :], rank)
    return RecordSender(address)


# ====================================================================== receiving side


class RecordSink(Protocol):
    """Where a :class:`RecordReader` puts every step record it receives (a file, the sidecar's step buffer)."""

    def write_record(self, rank: int, line: bytes) -> None:
        """Take one step record of ``rank``, without its ``sdk`` counters: one JSON object and a newline.

        Called by the reading thread, one record at a time, with the reader's :attr:`RecordReader.lock` held; must
        not block (the kernel queue behind the reader fills, and the ranks' SDKs drop and count, while it does), and
        a lock it takes must never be held by a thread that waits for the reader's lock (a deadlock: the sidecar's
        training-loop source reads the reader's tallies under the reader's lock alone).
        """


class FileSink:
    """A :class:`RecordSink` that appends every record line to a JSON-lines file (``meshscope run``)."""

    def __init__(self, path: str | Path) -> None:
        """Create (truncate) ``path``.

        Raises:
            OSError: if the file cannot be created.
        """
        self.path = Path(path)
        self._out: IO[bytes] = self.path.open("wb")

    def write_record(self, rank: int, line: bytes) -> None:  # noqa: ARG002 - the protocol's signature
        """Append ``line``."""
        self._out.write(line)

    def close_inherited(self) -> None:
        """In a forked child: release the inherited descriptor without flushing the parent's buffer into it."""
        with contextlib.suppress(OSError):
            os.close(self._out.fileno())

    def close(self) -> None:
        """Flush, sync and close the file; idempotent."""
        if not self._out.closed:
            with contextlib.suppress(OSError):
                self._out.flush()
                os.fsync(self._out.fileno())
            self._out.close()


@dataclass(slots=True)
class RankTally:
    """What a collector saw from one rank (mutable, updated by the receiving thread)."""

    records: int = 0
    """Step records received."""
    counters: dict[str, int] = field(default_factory=dict)
    """The rank's latest cumulative SDK counters (from its last record or its close message)."""
    hello: bool = False
    """Whether the rank announced itself."""
    closed: bool = False
    """Whether the rank said goodbye (its tracker closed cleanly)."""
    pid: int | None = None
    """The rank's process id, from its latest ``hello`` (a restarted rank says hello again with a new one)."""
    step_times_us: list[int] = field(default_factory=list)
    """``end_us - start_us`` of every record received, in arrival order (empty where the reader keeps none)."""
    measurements: dict[str, Any] = field(default_factory=dict)
    """The rank's latest ``measurements`` message: ``job``, ``model_state``, ``activations`` (``docs/sdk.md``)."""
    process_group_size: int | None = None
    """From the rank's ``close``: the size of the default process group it joined; ``None``: it never joined one, or
    it did not say (no close, or an older SDK)."""
    after_last_step_us: int | None = None
    """From the rank's ``close``: microseconds from the end of its last step to the close (a final save, evaluation
    or test after the loop: in no record); ``None``: not said (no step ended, no close, or an older SDK)."""
    after_last_step: dict[str, int] = field(default_factory=dict)
    """What of that time the rank's phases timed, microseconds per ``between_steps`` key (``checkpoint``, ``eval``,
    ..., ``comm``)."""


def _tally_control(tally: RankTally, msg: dict[str, Any]) -> None:
    """What a control message (``hello``, ``close``, ``measurements``) tells about its rank."""
    event = msg.get("event")
    tally.hello = tally.hello or event == "hello"
    tally.closed = tally.closed or event == "close"
    size = msg.get("process_group_size")
    if event == "close" and isinstance(size, int) and not isinstance(size, bool):
        tally.process_group_size = size
    after, kinds = msg.get("after_last_step_us"), msg.get("after_last_step")
    if event == "close" and _whole(after):
        tally.after_last_step_us = after
        if isinstance(kinds, dict):  # garbage is skipped, never fatal
            tally.after_last_step = {str(k): v for k, v in kinds.items() if _whole(v)}
    pid = msg.get("pid")
    if event == "hello" and isinstance(pid, int) and not isinstance(pid, bool):
        tally.pid = pid
    measured = msg.get("measurements")
    if event == "measurements" and isinstance(measured, dict):
        tally.measurements = measured


def _whole(value: object) -> TypeGuard[int]:
    """Whether a message's value is a whole number >= 0 (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


SOCKET_MODE = 0o666
"""The mode of a bound socket file: any user of the pod may send (the ranks' user need not be the collector's)."""


def _bind(address: str | bytes | Path) -> socket.socket:
    """A non-blocking ``SOCK_DGRAM`` socket bound at a filesystem path (replacing a stale one) or an abstract name."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        if isinstance(address, bytes):
            sock.bind(address)
        else:
            with contextlib.suppress(FileNotFoundError):
                Path(address).unlink()
            sock.bind(str(address))
            # Sending to a datagram socket needs write permission on its file, which bind() leaves at 0777 & ~umask
            # (0755): a training container running as another user than the sidecar's (uid 65532) was refused every
            # datagram (EACCES), counted as drops and nothing else. The socket lives in the pod's own volume.
            Path(address).chmod(SOCKET_MODE)
        sock.setblocking(False)  # noqa: FBT003 - the socket API
    except OSError:
        sock.close()
        raise
    return sock


class RecordReader:
    """The one reader of the wire protocol: binds the sockets, reads datagrams, tallies ranks, hands records on.

    ``meshscope run``'s :class:`RecordCollector` (a file sink) and the sidecar's training-loop source (its step
    buffer) are this class with different sinks, so the protocol has one reader. The sockets are bound at
    construction (so that nothing sent early is lost) and read by a thread from :meth:`start` on, which wakes as soon
    as a datagram arrives: Linux queues only ``net.unix.max_dgram_qlen`` datagrams per socket (10 by default), so a
    reader that polled on a period would make the ranks drop. A record the SDK wrote takes the fast path
    (:meth:`_handle_fast`: the rank, the span and the counters are read at the datagram's ends, the rest is passed on
    as it is); anything else is decoded whole. Datagrams that are not a JSON object with a known schema and a rank
    are counted in :attr:`garbage` and skipped.

    Memory is bounded by the caller's choices: ``keep_step_times=False`` keeps no per-record list, and
    ``max_ranks`` bounds the tallies (datagrams of further ranks are counted in :attr:`untallied` and skipped); the
    sink bounds what it keeps.
    """

    def __init__(
        self,
        addresses: Sequence[str | bytes | Path],
        sink: RecordSink,
        *,
        keep_step_times: bool = True,
        max_ranks: int | None = None,
    ) -> None:
        """Bind a socket at every address (a filesystem path, or an abstract name as ``bytes`` starting with NUL).

        Raises:
            OSError: if a socket cannot be bound (the ones already bound are closed).
        """
        self.ranks: dict[int, RankTally] = {}
        """Per-rank tallies, keyed by rank."""
        self.garbage = 0
        """Datagrams that were not a JSON object with a known schema and a rank."""
        self.untallied = 0
        """Datagrams skipped because they came from a rank beyond ``max_ranks`` distinct ranks."""
        self.lines = 0
        """Record lines handed to the sink."""
        self.lock = threading.Lock()
        """Held while a datagram is handled (tallies and the sink); take it to read the tallies from another thread."""
        self.rank_of_pid: dict[int, int] = {}
        """The rank each process said it is in its latest ``hello`` (a tracker says hello again when the process
        group names another rank than its environment did): two processes with one rank make colliding records."""
        self._sink = sink
        self._keep_step_times = keep_step_times
        self._max_ranks = max_ranks
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._selector = selectors.DefaultSelector()
        self._socks: list[socket.socket] = []
        self._paths = [Path(a) for a in addresses if not isinstance(a, bytes)]
        try:
            for address in addresses:
                sock = _bind(address)
                self._socks.append(sock)
                self._selector.register(sock, selectors.EVENT_READ)
        except OSError:
            self.close()
            raise

    def start(self) -> None:
        """Start the reading thread (after forking ranks: a child must not inherit a running thread)."""
        self._thread = threading.Thread(target=self._run, name="meshscope-collector", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.05):
                self._drain(key.fileobj)  # type: ignore[arg-type]

    def _drain(self, sock: socket.socket) -> int:
        n = 0
        while True:
            try:
                data = sock.recv(MAX_DATAGRAM_BYTES)
            except (BlockingIOError, InterruptedError):
                return n
            except OSError:
                return n
            n += 1
            self.handle(data)

    def drain_now(self) -> int:
        """Read whatever is queued on every socket, in the calling thread; returns datagrams read."""
        return sum(self._drain(s) for s in self._socks)

    def _tally(self, rank: int) -> RankTally | None:
        tally = self.ranks.get(rank)
        if tally is None:
            if self._max_ranks is not None and len(self.ranks) >= self._max_ranks:
                self.untallied += 1
                return None
            tally = self.ranks[rank] = RankTally()
        return tally

    def handle(self, datagram: bytes) -> None:
        """Process one datagram (public for tests and for readers that poll their own sockets)."""
        if self._handle_fast(datagram):
            return
        try:
            msg = decode(datagram)
        except (ValueError, TypeError, UnicodeDecodeError):
            msg = {}
        schema = msg.get("schema")
        rank = msg.get("rank")
        if (
            schema not in {RECORD_SCHEMA, CONTROL_SCHEMA}
            or not isinstance(rank, int)
            or isinstance(rank, bool)
            or rank < 0
        ):
            with self.lock:
                self.garbage += 1
            return
        if schema == RECORD_SCHEMA:
            counters = msg.pop("sdk", None)
            start, end = msg.get("start_us"), msg.get("end_us")
            line = json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
        else:
            counters = msg.get("counters")
            line = b""
        with self.lock:
            tally = self._tally(rank)
            if tally is None:
                return
            if isinstance(counters, dict):
                tally.counters = {k: v for k, v in counters.items() if isinstance(v, int)}
            if line:
                self._sink.write_record(rank, line)
                self.lines += 1
                tally.records += 1
                if self._keep_step_times and isinstance(start, int) and isinstance(end, int):
                    tally.step_times_us.append(end - start)
            else:
                _tally_control(tally, msg)
                self._remember_pid(msg, rank)

    def _remember_pid(self, msg: dict[str, Any], rank: int) -> None:
        """Keep the rank a ``hello`` says its process is (the newest :data:`MAX_PIDS` processes)."""
        pid = msg.get("pid")
        if msg.get("event") != "hello" or not isinstance(pid, int) or isinstance(pid, bool):
            return
        self.rank_of_pid.pop(pid, None)
        self.rank_of_pid[pid] = rank  # newest last
        if len(self.rank_of_pid) > MAX_PIDS:  # a long-lived reader (the sidecar) sees restarts
            del self.rank_of_pid[next(iter(self.rank_of_pid))]

    def claimed_twice(self) -> dict[int, list[int]]:
        """Ranks that more than one process says it is (latest ``hello`` of each), with their process ids."""
        with self.lock:
            pids_of: dict[int, list[int]] = {}
            for pid, rank in self.rank_of_pid.items():
                pids_of.setdefault(rank, []).append(pid)
        return {rank: sorted(pids) for rank, pids in sorted(pids_of.items()) if len(pids) > 1}

    def _handle_fast(self, datagram: bytes) -> bool:
        """A record exactly as the SDK writes it, passed on without decoding it whole; ``False``: take the slow path.

        The SDK writes ``schema``, ``job``, ``step``, ``rank`` first and ``sdk`` last, so the rank, the step span
        and the counters sit at the ends of the datagram. Anything else (another writer, compression) goes through
        :func:`decode`.
        """
        if not datagram.startswith(_FAST_PREFIX) or not datagram.endswith(b"}}"):
            return False
        cut = datagram.rfind(b',"sdk":{')
        head = _FAST_HEAD.match(datagram, 0, 4096)
        if cut < 0 or head is None:
            return False
        try:
            counters = json.loads(datagram[cut + 7 : -1])
        except ValueError:
            return False
        if not isinstance(counters, dict):
            return False
        span = _FAST_SPAN.search(datagram, 0, 4096) if self._keep_step_times else None
        with self.lock:
            tally = self._tally(int(head.group(1)))
            if tally is None:
                return True
            tally.counters = {k: v for k, v in counters.items() if isinstance(v, int)}
            self._sink.write_record(int(head.group(1)), datagram[:cut] + b"}\n")
            self.lines += 1
            tally.records += 1
            if span is not None:
                tally.step_times_us.append(int(span.group(2)) - int(span.group(1)))
        return True

    def close_inherited(self) -> None:
        """In a forked child: release the inherited descriptors without touching the parent's sockets or files."""
        for sock in self._socks:
            with contextlib.suppress(OSError):
                os.close(sock.detach())
        self._socks = []
        self._paths = []
        with contextlib.suppress(OSError):
            self._selector.close()

    def stop(self) -> None:
        """Stop the thread, read what is still queued, and close the sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        with contextlib.suppress(OSError):
            self.drain_now()
        self.close()

    def close(self) -> None:
        """Close the sockets (removing their files); idempotent."""
        for sock in self._socks:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            with contextlib.suppress(OSError):
                sock.close()
        self._socks = []
        for p in self._paths:
            with contextlib.suppress(OSError):
                p.unlink()
        self._paths = []
        with contextlib.suppress(OSError):
            self._selector.close()


class RecordCollector(RecordReader):
    """``meshscope run``'s collector: a :class:`RecordReader` whose sink is a JSON-lines file (:class:`FileSink`).

    Records are written without their ``sdk`` counters (the record schema is fixed); the counters are kept per rank
    in :attr:`ranks`. Garbage datagrams are counted in :attr:`garbage` and skipped.
    """

    def __init__(self, paths: Sequence[str | Path], records_path: str | Path) -> None:
        """Open ``records_path`` for writing and bind a ``SOCK_DGRAM`` socket at every path.

        Raises:
            OSError: if a socket cannot be bound or the file cannot be created.
        """
        self.records_path = Path(records_path)
        self._file = FileSink(self.records_path)
        try:
            super().__init__([Path(p) for p in paths], self._file)
        except OSError:
            self._file.close()
            raise

    def close_inherited(self) -> None:
        """In a forked child: release the inherited descriptors without touching the parent's sockets or file."""
        super().close_inherited()
        self._file.close_inherited()

    def close(self) -> None:
        """Close sockets (removing their files) and flush and close the records file; idempotent."""
        super().close()
        self._file.close()

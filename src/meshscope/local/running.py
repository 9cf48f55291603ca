"""``meshscope run``: launch a training command on local ranks, collect their step records, report at the end.

Why it exists: local mode (DESIGN.md) must show the whole product on one machine. This module launches ``--nproc``
ranks with the environment ``torchrun`` would give them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) plus meshscope's (``MESHSCOPE_JOB``, ``MESHSCOPE_LAYOUT``,
``MESHSCOPE_COLLECTOR``, ``MESHSCOPE_NODE`` ...), runs the record collector in process (one Unix datagram socket per
rank, :mod:`meshscope.sdk.transport`), writes ``OUT/records.jsonl`` and ``OUT/measurements.json``, and when every rank
has exited hands a :class:`RunOutcome` to a report hook (the CLI's is :func:`meshscope.local.summarizing.report_run`:
the cost table with the plan's expectations, the findings, the per-stage expected-vs-measured comparison, what was lost
as partial data, ``OUT/report.html`` and ``OUT/trace.json``).

Two launchers: ``exec`` starts any command as a subprocess; ``fork`` (chosen automatically for ``python script.py``,
``python -m module`` and ``python -c code`` run by this very interpreter) imports torch once and forks the ranks,
which saves each rank the 1.5-2 s of ``import torch`` (``cpu-testbed.md`` §5.1: 5.7 s instead of 20 s for 8 ranks).

A crashing rank or Ctrl-C stops every rank (SIGTERM to its process group, SIGKILL after a grace period) and ends
with one line naming the rank and its exit code, and a non-zero exit code. This module imports torch only inside the
fork launcher, and never at module level.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import json
import os
import re
import resource
import select
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import types
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, Self, TypeAlias

from meshscope.errors import LayoutError, MeshscopeError
from meshscope.local.cpus import CpuCapacity, CpuUse, affinity_cpus, measure_capacity, read_busy_seconds
from meshscope.local.tails import StderrTails, fix_for, shown_tail
from meshscope.sdk import (
    ENV_COLLECTOR,
    ENV_DISABLE,
    ENV_JOB,
    ENV_LAYOUT,
    ENV_LAYOUT_IMPLIED,
    ENV_NETWORK_TIER,
    ENV_NODE,
    ENV_NVLINK_DOMAIN,
    RecordCollector,
)
from meshscope.topology import ParallelLayout, Placement, layout_text, parse_layout

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Sequence

    from meshscope.jobs import JobSpec

FinishedHook: TypeAlias = "Callable[[Path, JobSpec | ParallelLayout], int]"
"""``on_finished(records_path, spec_or_layout) -> exit code``, called once every rank has exited successfully."""

POLL_S = 0.05
"""How often the launcher looks at its ranks, seconds."""
CLOSE_WAIT_S = 2.0
"""How long, after the last rank exits, the collector waits for ranks' goodbye messages, seconds."""

Launcher = Literal["auto", "fork", "exec"]

EXIT_NO_ANALYSIS = 4
"""``meshscope run``'s exit code when every rank exited 0 but no analysis could be written (no step records, records
that cannot be read or analysed); the records stay in ``OUT/records.jsonl``."""
RUN_FILES = (
    "records.jsonl",
    "collector.json",
    "measurements.json",
    "analysis.json",
    "plan.json",
    "report.html",
    "trace.json",
    "ranks",
)
"""What a run writes into ``OUT`` (:func:`keep_earlier_run` moves an earlier run's aside; the script's files stay)."""
EARLIER_RUNS = "earlier"
"""``OUT/earlier/<UTC time>/``: where an earlier run's files in the same ``OUT`` are kept."""
BARE_PYTHONS = frozenset({"python", "python3"})
"""Command names that mean "a python": they run under meshscope's own interpreter (``sys.executable``)."""


class RunError(MeshscopeError):
    """A ``meshscope run`` command line that cannot be launched (bad command, impossible layout)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSettings:
    """One local run, built from the command line once."""

    nproc: int
    """Ranks to launch (the world size)."""
    command: tuple[str, ...]
    """The training command, e.g. ``("python", "train.py", "--steps", "10")``."""
    layout: ParallelLayout
    """Layout passed to the ranks as ``MESHSCOPE_LAYOUT``."""
    layout_given: bool = True
    """Whether the user gave it (``--layout``, a spec's); ``False``: the default, data parallelism over every rank,
    which the ranks' registered DeviceMesh replaces (``MESHSCOPE_LAYOUT_IMPLIED``)."""
    out_dir: Path
    """Where ``records.jsonl`` and ``collector.json`` go."""
    job: str = "local"
    """Job name (``MESHSCOPE_JOB``)."""
    spec: JobSpec | None = None
    """The TrainingJob the run stands for, if one was given (passed to ``on_finished``)."""
    spec_path: Path | None = None
    """The ``--spec`` file ``spec`` was loaded from."""
    launcher: Launcher = "auto"
    """``fork`` (python only, torch imported once), ``exec`` (any command), ``auto`` (fork where possible)."""
    grace_s: float = 5.0
    """Seconds between SIGTERM and SIGKILL when stopping ranks."""
    gpus_per_node: int | None = None
    """Ranks per emulated node for ``MESHSCOPE_NODE`` names; ``None``: the spec's hardware, else one node."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More environment for every rank."""
    quiet: bool = False
    """``--quiet``: the end-of-run report shows no progress on stderr (:mod:`meshscope.progress`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankExit:
    """How one rank ended."""

    rank: int
    """Global rank."""
    code: int
    """Exit status as ``subprocess`` reports it: >= 0 an exit code, < 0 the killing signal."""

    def describe(self) -> str:
        """``exited with code 3`` or ``was killed by signal 9 (SIGKILL)``."""
        if self.code >= 0:
            return f"exited with code {self.code}"
        sig = -self.code
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {sig} ({name})"

    @property
    def shell_code(self) -> int:
        """The code a shell would show: the exit code, or 128 + signal."""
        return self.code if self.code >= 0 else 128 - self.code


# ====================================================================== rank processes


class _RankProcess:
    """A launched rank: a forked child or a subprocess, always the leader of its own process group."""

    def __init__(self, rank: int, pid: int, popen: Any = None) -> None:  # noqa: ANN401 - subprocess.Popen or None
        self.rank = rank
        self.pid = pid
        self._popen = popen
        self.code: int | None = None
        self.cpu_s: float | None = None
        """User + system CPU seconds of the rank (and the children it waited for), once it has exited."""

    def poll(self) -> int | None:
        if self.code is not None:
            return self.code
        try:  # wait4 for both kinds, for the rank's rusage; a Popen is told its returncode below
            pid, status, usage = os.wait4(self.pid, os.WNOHANG)
        except ChildProcessError:
            self.code = self._popen.returncode if self._popen is not None else None
            if self.code is None:
                self.code = -signal.SIGKILL
            return self.code
        if pid == 0:
            return None
        self.code = os.waitstatus_to_exitcode(status)
        self.cpu_s = usage.ru_utime + usage.ru_stime
        if self._popen is not None:
            self._popen.returncode = self.code
        return self.code

    def signal_group(self, sig: int) -> None:
        if self.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


def _python_form(command: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """How to run ``command`` in a forked child, or ``None`` when only the exec launcher can run it.

    Returns:
        ``(kind, target, args)`` for ``python script.py ...``, ``python -m mod ...`` and ``python -c code ...`` when
        ``python`` is this very interpreter (same path, symlinks not resolved: a venv's python is a symlink).
    """
    if len(command) < 2:
        return None
    exe = shutil.which(command[0]) if os.sep not in command[0] else command[0]
    if exe is None or os.path.abspath(exe) != os.path.abspath(sys.executable):  # noqa: PTH100 - symlinks not resolved on purpose (a venv's python is a symlink)
        return None
    first, rest = command[1], list(command[2:])
    if first in {"-m", "-c"}:
        if not rest:
            return None
        return ("module" if first == "-m" else "code"), rest[0], rest[1:]
    if first.startswith("-"):
        return None
    return "script", first, rest


def resolve_python(command: Sequence[str]) -> tuple[tuple[str, ...], str | None]:
    """The command to launch, and the interpreter it runs under (``None`` for a command that is not a python).

    A bare ``python`` or ``python3`` becomes :data:`sys.executable` (the interpreter meshscope runs under, whose
    environment has meshscope, and torch with the demo extra), not whatever ``python`` is first on ``PATH``; any other
    name or path is used as given.
    """
    if not command:
        return (), None
    first = command[0]
    if first in BARE_PYTHONS and sys.executable:
        return (sys.executable, *command[1:]), sys.executable
    name = os.path.basename(first)  # noqa: PTH119
    if re.fullmatch(r"python[0-9.]*", name):
        return tuple(command), (shutil.which(first) or first) if os.sep not in first else first
    return tuple(command), None


def _python_line(given: str, python: str | None) -> str:
    """What the start line says about the interpreter."""
    if python is None:
        return f"running {given!r}"
    if given in BARE_PYTHONS:
        on_path = shutil.which(given)
        same = on_path is not None and os.path.abspath(on_path) == os.path.abspath(python)  # noqa: PTH100
        where = "" if same or on_path is None else f"; {given!r} on PATH is {on_path}"
        return f"python = {python} (meshscope's own interpreter{where})"
    own = os.path.abspath(python) == os.path.abspath(sys.executable)  # noqa: PTH100
    return f"python = {python} (as given: meshscope's own interpreter)" if own else f"python = {python} (as given)"


def _preimport_torch() -> None:
    """Import torch and the distributed stacks once, before forking (the children share them copy-on-write)."""
    import importlib  # noqa: PLC0415

    for name in (
        "torch",
        "torch.distributed",
        "torch.distributed.tensor",
        "torch.distributed.tensor.parallel",
        "torch.distributed.pipelining",
        "torch.distributed.fsdp",
        "torch.distributed.checkpoint",
        "torch.nn.parallel",
    ):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


_KEPT: list[object] = []
"""The rank program's namespace and process groups, kept until the forked rank ends (atexit handlers, then
``os._exit``): they are never destroyed, as in any child that ends with ``os._exit``.

Destroying a gloo process group from a Python object's deallocation hangs ranks: a ``DistributedDataParallel``
freed after ``destroy_process_group`` releases the group's last reference from its reducer, whose destructor joins
the group's worker threads while holding the GIL, while a worker destroying its last work waits for the GIL (the
work's thread-local state holds a Python object: the context PyTorch 2.13 stashes for every backward). Seen with
and without the SDK: 6 of 12 runs of a DDP script on a loaded 2-core machine before the namespace was kept, and
with the namespace kept, once in about 6 runs of a script whose model is a local of ``main()`` (freed when it
returns, stack read with py-spy). So both the namespace and every process group outlive the program
(:func:`_keep_process_groups`)."""


def _keep_process_groups() -> None:
    """Make ``destroy_process_group`` keep a reference to the groups it destroys (see :data:`_KEPT`).

    The groups leave torch's registry as usual (the program can create new ones), but their C++ objects live until
    the rank's ``os._exit``, so no Python deallocation ever runs a gloo group's blocking destructor.
    """
    try:
        import torch.distributed as dist  # noqa: PLC0415
        from torch.distributed import distributed_c10d  # noqa: PLC0415
    except ImportError:
        return
    original = distributed_c10d.destroy_process_group
    if getattr(original, "__meshscope_keeps__", False):
        return

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - forwards torch's own
        with contextlib.suppress(Exception):
            _KEPT.extend(distributed_c10d._world.pg_map)  # noqa: SLF001 - the registry of live groups
        return original(*args, **kwargs)

    destroy_process_group.__meshscope_keeps__ = True  # type: ignore[attr-defined]
    distributed_c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def _refuse_another_world_size() -> None:
    """Make ``init_process_group`` in this rank refuse a ``world_size`` other than the ranks ``meshscope run`` started.

    A script that asks for more ranks than were started waits in the rendezvous for ones that never come, with no
    word (Lightning's ``devices=2`` under ``--nproc 1``: "MEMBER: 1/2", then nothing); one that asks for fewer fails
    somewhere inside its framework. Either way the fix is ``--nproc``. Only in the process the launcher started: a
    script's own children (``torch.multiprocessing`` with the fork start method) take their world from it.
    """
    try:
        import torch.distributed as dist  # noqa: PLC0415
        from torch.distributed import distributed_c10d  # noqa: PLC0415
    except ImportError:
        return
    original = distributed_c10d.init_process_group
    if getattr(original, "__meshscope_world__", False):
        return
    launched = os.getpid()

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - forwards torch's own
        asked = kwargs.get("world_size", args[3] if len(args) > 3 else -1)  # world_size is its 4th parameter
        started = os.environ.get("WORLD_SIZE", "")
        if (
            os.getpid() == launched
            and isinstance(asked, int)
            and asked > 0
            and started.isdigit()
            and asked != int(started)
        ):
            raise RuntimeError(
                f"meshscope run started {started} rank{'' if started == '1' else 's'} (--nproc {started}), but the "
                f"script asks init_process_group for world_size={asked}: it would wait for ranks that never start. "
                f"Run it with --nproc {asked} (Lightning: devices x num_nodes must equal --nproc; devices='auto' "
                "takes the launcher's)"
            )
        return original(*args, **kwargs)

    init_process_group.__meshscope_world__ = True  # type: ignore[attr-defined]
    distributed_c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def _run_as_main(code: types.CodeType, path: str | None) -> None:
    """Run ``code`` as ``python path`` (or ``python -c``) would: in a ``__main__`` module that outlives it."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    if path is not None:
        main.__file__ = path
    _KEPT.append(main)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)  # noqa: S102 - running the rank's program is this function's job


def _run_in_child(kind: str, target: str, args: list[str], env: dict[str, str]) -> int:
    """Body of a forked rank: become the rank and run its program; returns its exit code."""
    import runpy  # noqa: PLC0415
    import traceback  # noqa: PLC0415

    os.environ.clear()
    os.environ.update(env)
    with contextlib.suppress(ImportError, ValueError):
        import torch  # noqa: PLC0415

        torch.set_num_threads(max(1, int(env.get("OMP_NUM_THREADS", "1"))))
        _keep_process_groups()
        _refuse_another_world_size()
    code = 0
    try:
        if kind == "script":
            sys.argv = [target, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # noqa: PTH120, PTH100 - as python does
            if os.path.isfile(target):  # noqa: PTH113
                with open(target, "rb") as f:  # noqa: PTH123 - the program's own file
                    source = f.read()
                _run_as_main(compile(source, target, "exec"), target)
            else:  # a directory or zip file with a __main__.py
                _KEPT.append(runpy.run_path(target, run_name="__main__"))
        elif kind == "module":
            sys.argv = [target, *args]
            sys.path.insert(0, os.getcwd())  # noqa: PTH109
            _KEPT.append(runpy.run_module(target, run_name="__main__", alter_sys=True))
        else:
            sys.argv = ["-c", *args]
            _run_as_main(compile(target, "<string>", "exec"), None)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            sys.stderr.write(f"{exc.code}\n")
            code = 1
    except BaseException as exc:  # noqa: BLE001 - a rank's crash becomes its exit code, like an interpreter's
        traceback.print_exc()
        # as the interpreter does for an exception nothing caught: the atexit handlers (a tracker's close) see it
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        if sys.version_info >= (3, 12):
            sys.last_exc = exc
        code = 1
    return code


def _fork_rank(form: tuple[str, str, list[str]], env: dict[str, str], close: Callable[[], None], stderr_fd: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    # the child: never return into the launcher's code
    code = 1
    try:
        os.setsid()
        close()
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        code = _run_in_child(*form, env)
        import atexit  # noqa: PLC0415

        atexit._run_exitfuncs()  # noqa: SLF001 - os._exit skips them, and trackers flush there
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code & 0xFF)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _placement(settings: RunSettings) -> Placement:
    n = settings.nproc
    if settings.gpus_per_node is not None:
        per = settings.gpus_per_node
        return Placement.default(n, gpus_per_node=per, nvlink_domain_gpus=per, nodes_per_network_block=1 << 20)
    if settings.spec is not None:
        hw = settings.spec.hardware
        with contextlib.suppress(LayoutError):
            return Placement.for_hardware(n, hw)
    return Placement.default(n, gpus_per_node=n, nvlink_domain_gpus=n, nodes_per_network_block=1)


def rank_env(settings: RunSettings, rank: int, *, port: int, collector: str, placement: Placement) -> dict[str, str]:
    """The environment of one rank (the launcher's own environment plus torchrun's and meshscope's variables)."""
    node = int(placement.node_of_rank[rank])
    per_node = int((placement.node_of_rank == node).sum())
    local_rank = int((placement.node_of_rank[:rank] == node).sum())
    env = dict(os.environ)
    env.update(settings.extra_env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(settings.nproc),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": str(node),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            ENV_JOB: settings.job,
            ENV_LAYOUT: layout_text(settings.layout),
            ENV_LAYOUT_IMPLIED: "0" if settings.layout_given else "1",
            ENV_COLLECTOR: f"unix:{collector}",
            ENV_NODE: placement.node_name(node),
            ENV_NVLINK_DOMAIN: f"nvl-{int(placement.domain_of_node[node])}",
            ENV_NETWORK_TIER: f"block-{int(placement.block_of_node[node])}",
        }
    )
    return env


# ====================================================================== the run


def _say(message: str) -> None:
    sys.stderr.write(f"meshscope run: {message}\n")
    sys.stderr.flush()


def _stop_all(procs: list[_RankProcess], grace_s: float, held: dict[int, Any] | None = None) -> None:
    """SIGTERM to every rank's process group, SIGKILL after ``grace_s``; wait for them all.

    ``held``: the signals the run stops on (:func:`_stop_on_signals`): while the ranks are being stopped a second one
    (a scheduler's repeated SIGTERM) is ignored, so that no rank is left running.
    """
    for sig in held or ():
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_IGN)
    for p in procs:
        p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)
    for p in procs:
        p.signal_group(signal.SIGKILL)
    for p in procs:
        while p.poll() is None:
            time.sleep(POLL_S / 5)


def _launch(
    settings: RunSettings, envs: list[dict[str, str]], collector: RecordCollector, tails: StderrTails
) -> list[_RankProcess]:
    form = _python_form(settings.command)
    use_fork = settings.launcher == "fork" or (settings.launcher == "auto" and form is not None)
    if use_fork and form is None:
        raise RunError(
            f"--launcher fork needs 'python SCRIPT', 'python -m MODULE' or 'python -c CODE' run by {sys.executable}; "
            f"got {' '.join(settings.command)!r} (use --launcher exec)"
        )
    procs: list[_RankProcess] = []
    if use_fork and form is not None:
        _preimport_torch()

        for rank, env in enumerate(envs):

            def close_inherited(rank: int = rank) -> None:
                collector.close_inherited()
                tails.close_in_child(rank)

            pid = _fork_rank(form, env, close_inherited, tails.write_fd(rank))
            tails.launched(rank)
            procs.append(_RankProcess(rank, pid))
        return procs
    import subprocess  # noqa: PLC0415

    for rank, env in enumerate(envs):
        try:
            popen = subprocess.Popen(  # noqa: S603
                list(settings.command), env=env, start_new_session=True, stderr=tails.write_fd(rank)
            )
        except OSError as exc:
            _stop_all(procs, settings.grace_s)
            raise RunError(f"cannot start {settings.command[0]!r}: {exc}") from None
        tails.launched(rank)
        procs.append(_RankProcess(rank, popen.pid, popen))
    return procs


def _monitor(procs: list[_RankProcess], grace_s: float) -> tuple[RankExit | None, int]:
    """Wait for every rank; on the first failure stop the others.

    The first failure is the rank that exited first, not the lowest rank found exited: once a rank dies its peers
    fail in their next collective (gloo's "connection closed by peer"), and on a loaded machine several can have
    exited by the time the launcher looks. So it sleeps in ``poll`` on the ranks' pidfds (woken as one exits), and
    takes the exited ranks in the order they exited (:func:`_exit_order`).

    Returns:
        The first failed rank (or ``None``) and how many ranks the stop ended (a rank still running when the stop
        began can fail by itself before its signal lands: gloo's error after its peer's death; it is not counted,
        and the ``failed:`` line lists it).
    """
    with _ExitWatch(procs) as watch:
        while True:
            for p in _exit_order(procs):
                code = p.poll()
                if code is not None and code != 0:
                    failed = RankExit(rank=p.rank, code=code)
                    others = [q for q in procs if q.poll() is None]
                    _stop_all(others, grace_s)
                    return failed, sum(q.code in _STOP_CODES for q in others)
            if all(p.poll() is not None for p in procs):
                return None, 0
            watch.wait(POLL_S)


def _exit_order(procs: list[_RankProcess]) -> list[_RankProcess]:
    """The ranks that have exited and are not reaped yet, the first to exit first.

    A dead child stays a zombie until it is reaped, and its ``/proc/PID/sched`` (Linux with scheduler statistics)
    still says when it last ran (``se.exec_start``): its exit, on the clock of the CPU it last ran on
    (:func:`_exit_stamp`). Those clocks are per CPU and drift apart (they leave out the time the CPU spent in
    interrupts or taken by the hypervisor: the two CPUs of a virtual machine were 0.87 s apart after 19 hours up),
    so stamps from different CPUs are put on one clock first (:func:`_cpu_clock_offsets_ms`). Where that cannot be
    done the ranks keep their order.
    """
    exited: list[tuple[tuple[int, float] | None, _RankProcess]] = []
    for p in procs:
        if p.code is not None:
            continue
        try:
            info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere (a Popen's own wait): its poll() says how it ended
            exited.append((None, p))
            continue
        if info is not None:
            exited.append((_exit_stamp(p.pid), p))
    known = [(stamp, p) for stamp, p in exited if stamp is not None]
    if len(exited) < 2 or len(known) < len(exited):
        return [p for _, p in exited]
    cpus = {cpu for (cpu, _), _ in known}
    offsets = _cpu_clock_offsets_ms(cpus) if len(cpus) > 1 else dict.fromkeys(cpus, 0.0)
    if offsets is None:
        return [p for _, p in exited]
    order = sorted((at_ms - offsets[cpu], p.rank, p) for (cpu, at_ms), p in known)
    return [p for _, _, p in order]


def _exit_stamp(pid: int) -> tuple[int, float] | None:
    """The CPU process ``pid`` last ran on and when (``se.exec_start``, ms of that CPU's scheduler clock).

    ``None`` where the kernel does not say (no ``/proc``, no scheduler statistics).
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cpu = int(stat[stat.rindex(")") + 2 :].split()[_STAT_PROCESSOR - 3])
        with Path(f"/proc/{pid}/sched").open() as f:
            for line in f:
                if line.startswith("se.exec_start"):
                    return cpu, float(line.rsplit(":", 1)[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


_STAT_PROCESSOR = 39
"""The field of ``/proc/PID/stat`` (1-based, proc(5)) that holds the CPU the process last ran on."""


def _cpu_clock_offsets_ms(cpus: set[int]) -> dict[int, float] | None:
    """Each CPU's scheduler clock minus ``CLOCK_MONOTONIC``, ms; ``None`` where one cannot be measured.

    A thread pinned to the CPU sleeps a moment (so that it has just been put on that CPU, which sets its
    ``se.exec_start`` to that CPU's clock) and reads its own ``/proc/thread-self/sched`` beside ``time.monotonic``.
    Good to a few microseconds plus a scheduler tick where the kernel updates the clock between the two reads.
    """
    offsets: dict[int, float] = {}

    def measure() -> None:
        for cpu in sorted(cpus):
            try:
                os.sched_setaffinity(0, {cpu})  # this thread only (Linux: 0 is the calling thread)
                time.sleep(0.0005)
                now_ms = time.monotonic_ns() / 1e6
                with Path("/proc/thread-self/sched").open() as f:
                    start = next(float(line.rsplit(":", 1)[1]) for line in f if line.startswith("se.exec_start"))
            except (AttributeError, OSError, ValueError, StopIteration):
                return
            offsets[cpu] = start - now_ms

    worker = threading.Thread(target=measure, name="meshscope-cpu-clocks", daemon=True)
    worker.start()
    worker.join(timeout=5.0)
    return offsets if set(offsets) == cpus else None


class _ExitWatch:
    """The ranks' pidfds (Linux 5.3+): ``wait`` sleeps until a rank exits; without pidfds it sleeps the timeout."""

    def __init__(self, procs: list[_RankProcess]) -> None:
        self._poller = select.poll()
        self._fds: list[int] = []
        opener = getattr(os, "pidfd_open", None)
        for p in procs:
            try:
                fd = opener(p.pid) if opener is not None else None
            except OSError:  # an old kernel, or the rank already reaped: its poll() says how it ended
                fd = None
            if fd is not None:
                self._fds.append(fd)
                self._poller.register(fd, select.POLLIN)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def wait(self, timeout_s: float) -> None:
        """Sleep until a rank exits or ``timeout_s`` passes (a rank seen exited is not waited for again)."""
        if not self._fds:
            time.sleep(timeout_s)
            return
        for fd, _ in self._poller.poll(timeout_s * 1000):
            with contextlib.suppress(KeyError, ValueError):
                self._poller.unregister(fd)


def run_job(
    settings: RunSettings,
    *,
    on_finished: Callable[[Path, JobSpec | ParallelLayout], int] | None = None,
    report: Callable[[RunOutcome], int] | None = None,
    capacity: CpuCapacity | None = None,
) -> int:
    """Launch the ranks, collect their records into ``OUT/records.jsonl``, and report.

    A bare ``python`` (or ``python3``) at the start of the command runs under this interpreter
    (:func:`resolve_python`); the start line names the interpreter and the cores. Every rank's stderr goes through to
    meshscope's (its tail is kept in ``OUT/ranks/rank-N.stderr``); a failed rank, or ranks that sent no record, end
    with the tail of the first one's stderr and the likely fix.

    Args:
        settings: the run.
        on_finished: called with the records file and the spec (or layout) once every rank exited with 0; its
            return value is the exit code.
        report: called with the :class:`RunOutcome` when the ranks have exited, also after a failed rank (on what
            was collected); the CLI passes :func:`meshscope.local.summarizing.report_run` (the cost table, findings,
            expected vs measured, report and trace). Without either hook the run only collects.
        capacity: the cores the ranks can run on; ``None`` measures them (:func:`measure_capacity`).

    Returns:
        The exit code: the failed rank's (128 + signal for a killed rank), 130 on Ctrl-C, else the hook's (0
        without one; :data:`EXIT_NO_ANALYSIS` from ``report_run`` when no analysis could be written).

    Raises:
        RunError: when the command cannot be launched.
    """
    given = settings.command[0] if settings.command else ""
    command, python = resolve_python(settings.command)
    settings = replace(settings, command=command)
    cpu = capacity if capacity is not None else measure_capacity()
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    kept = keep_earlier_run(settings.out_dir)
    if kept is not None:
        _say(f"{settings.out_dir} held an earlier run: its files are kept in {kept}")
    records_path = settings.out_dir / "records.jsonl"
    sock_dir = Path(tempfile.mkdtemp(prefix="meshscope-"))
    paths = [sock_dir / f"rank-{r}.sock" for r in range(settings.nproc)]
    collector = RecordCollector(paths, records_path)
    tails = StderrTails(settings.nproc)
    placement = _placement(settings)
    port = _free_port()
    envs = [
        rank_env(settings, r, port=port, collector=str(paths[r]), placement=placement) for r in range(settings.nproc)
    ]
    meter = _CpuMeter(CpuUse(ranks=settings.nproc, capacity=cpu, wall_s=0.0))
    _say(f"{_python_line(given, python)}; {meter.use.headline()}")
    started = time.monotonic()
    procs, failed, stopped, interrupted = _run_ranks(settings, envs, collector, tails, meter)
    with contextlib.suppress(OSError):
        sock_dir.rmdir()
    wall_s = time.monotonic() - started
    use = meter.finish(procs)
    how = None
    if interrupted is not None:
        how = "interrupted" if interrupted == signal.SIGINT else f"stopped by {signal.Signals(interrupted).name}"
    elif failed is not None:
        how = f"rank {failed.rank} {failed.describe()}"
    _write_run_files(settings, collector, procs, wall_s, use, tails, ended_by=how)
    if interrupted is not None:
        _say(
            f"{how}; stopped {len(procs)} ranks; what they sent is in {records_path} (meshscope analyze "
            f"{settings.out_dir} analyses it)"
        )
        return 128 + int(interrupted)
    _say_end(settings, stopped, failed, collector, use, wall_s)
    _explain_failure(settings, procs=procs, failed=failed, collector=collector, tails=tails, python=python)
    if on_finished is not None and failed is None:
        return on_finished(records_path, settings.spec if settings.spec is not None else settings.layout)
    if report is None:
        return failed.shell_code or 1 if failed is not None else 0
    outcome = _outcome(settings, collector, failed, wall_s, use)
    code = _call_report(report, outcome)
    if failed is not None:
        return failed.shell_code or 1
    return code


class _Signalled(BaseException):
    """SIGTERM or SIGHUP reached the launcher (``timeout``, ``kill``, a CI runner or scheduler, a closed terminal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a run as Ctrl-C does: every rank's process group stopped, what was collected written, exit
128 + the signal. Before, SIGTERM killed the launcher alone and its ranks ran on, orphaned."""


def _raise_signalled(signum: int, _frame: object) -> None:
    raise _Signalled(signum)


def _stop_on_signals() -> dict[int, Any]:
    """Stop the run on :data:`STOP_SIGNALS` (the main thread only: elsewhere Python cannot take signals)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[int, Any] = {}
    for sig in STOP_SIGNALS:
        with contextlib.suppress(OSError, ValueError):
            previous[sig] = signal.signal(sig, _raise_signalled)
    return previous


def _restore_signals(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        with contextlib.suppress(OSError, ValueError, TypeError):
            signal.signal(sig, handler)


def _run_ranks(
    settings: RunSettings, envs: list[dict[str, str]], collector: RecordCollector, tails: StderrTails, meter: _CpuMeter
) -> tuple[list[_RankProcess], RankExit | None, int, int | None]:
    """Launch the ranks and watch them until they have all exited, one failed, or a signal stopped the run.

    Returns the ranks, the one that failed (if any), how many the launcher stopped, and the signal that stopped the
    run (``None`` if none did: Ctrl-C is SIGINT, :data:`STOP_SIGNALS` the others). The collector has stopped.
    """
    procs: list[_RankProcess] = []
    failed: RankExit | None = None
    stopped = 0
    interrupted: int | None = None
    previous = _stop_on_signals()
    try:
        procs = _launch(settings, envs, collector, tails)
        meter.start()  # after the fork launcher's import of torch: the ranks' own time starts here
        collector.start()  # after forking: the children must not inherit a running thread
        tails.start()
        failed, stopped = _monitor(procs, settings.grace_s)
    except KeyboardInterrupt:
        interrupted = signal.SIGINT
        _stop_all(procs, settings.grace_s, previous)
    except _Signalled as sig:
        interrupted = sig.signum
        _stop_all(procs, settings.grace_s, previous)
    finally:
        _restore_signals(previous)
        tails.stop()
        if interrupted is None and failed is None:
            _wait_for_goodbyes(collector, settings.nproc)
        collector.stop()
    return procs, failed, stopped, interrupted


def _outcome(
    settings: RunSettings, collector: RecordCollector, failed: RankExit | None, wall_s: float, cpu: CpuUse
) -> RunOutcome:
    return RunOutcome(
        settings=settings,
        records_path=settings.out_dir / "records.jsonl",
        failed=failed,
        ranks={
            rank: RankReceipt(
                records=t.records,
                hello=t.hello,
                closed=t.closed,
                counters=dict(t.counters),
                measurements=t.measurements,
                after_last_step_us=t.after_last_step_us,
                after_last_step=dict(t.after_last_step),
                median_step_us=statistics.median(t.step_times_us) if t.step_times_us else None,
            )
            for rank, t in collector.ranks.items()
        },
        unreadable_datagrams=collector.garbage,
        claimed_twice=collector.claimed_twice(),
        wall_s=wall_s,
        cpu=cpu,
    )


def _call_report(report: Callable[[RunOutcome], int], outcome: RunOutcome) -> int:
    """The report hook's exit code; a report that raises says so in one line (no analysis: non-zero)."""
    try:
        return report(outcome)
    except Exception as exc:  # noqa: BLE001 - the job's own exit code must survive a failing report
        if os.environ.get("MESHSCOPE_DEBUG"):
            import traceback  # noqa: PLC0415

            traceback.print_exc()
        if isinstance(exc, MeshscopeError):
            _say(f"no analysis: {exc} (the records are kept in {outcome.records_path})")
            return EXIT_NO_ANALYSIS
        _say(f"the report failed: {type(exc).__name__}: {exc} (set MESHSCOPE_DEBUG=1 for the traceback)")
        return 1


def _say_end(  # noqa: PLR0917 - private, one caller
    settings: RunSettings, stopped: int, failed: RankExit | None, collector: RecordCollector, use: CpuUse, wall_s: float
) -> None:
    """The lines that end a run: the failed rank, what was received, the CPU the ranks used."""
    if failed is not None:
        others = "" if not stopped else f"; stopped the other {stopped} rank{'' if stopped == 1 else 's'}"
        _say(f"rank {failed.rank} {failed.describe()}{others}")
    _say(_received_line(collector, settings.nproc, wall_s, failed=failed is not None))
    if use.usage():
        _say(use.usage() + (f"; {use.foreign()}" if use.foreign() else ""))
    if use.foreign_load and not use.oversubscribed:
        _say("foreign CPU load on these cores: timings include CPU contention, and the findings say so")
    _say_uncaptured(collector)
    _say_background(collector)
    alone = ranks_alone(collector, settings.nproc)
    if alone:
        _say(alone)
    twice = collector.claimed_twice()
    if twice:
        shown = "; ".join(f"rank {r}: pids {', '.join(map(str, pids))}" for r, pids in list(twice.items())[:4])
        _say(
            f"{len(twice)} ranks were claimed by more than one process ({shown}): their records collide. The script "
            f"starts ranks of its own (torch.multiprocessing.spawn) in each of the {settings.nproc} processes "
            "meshscope run started: run it as one process, meshscope run --nproc 1 -- ..."
        )


def ranks_alone(collector: RecordCollector, nproc: int) -> str | None:
    """What to say when several ranks ran but none joined a process group (each trained alone), else ``None``.

    Their trackers say so when they close (``process_group_size``). A script that decides from the device whether to
    go distributed stays single-process on a machine without GPUs unless told: every rank then trains the whole job
    alone, and the run's dp rows read zero for a reason no note about capture explains.
    """
    closed = [t for t in collector.ranks.values() if t.closed]
    if nproc < 2 or len(closed) < 2 or any(t.process_group_size is not None for t in closed):
        return None
    return (
        f"the {len(closed)} ranks never joined a process group: each trained alone, and nothing was communicated. "
        "A script that goes distributed only on GPUs stays single-process on CPU unless told: "
        "Accelerator(cpu=True), TrainingArguments(use_cpu=True), Lightning's accelerator='cpu' with devices=N, or "
        "torch.distributed.init_process_group('gloo') in a plain script"
    )


def _own_cpu_seconds() -> float:
    """This process's user + system CPU-seconds so far (every thread: the collector, the tails, the monitor)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _CpuMeter:
    """The ranks' CPU, the affinity cores' busy time and the launcher's own CPU from the launch to the last exit."""

    def __init__(self, use: CpuUse) -> None:
        self.use = use
        self._cores = affinity_cpus()
        self._launched = time.monotonic()
        self._busy0: float | None = None
        self._own0 = 0.0

    def start(self) -> None:
        self._launched = time.monotonic()
        self._busy0, self._own0 = read_busy_seconds(cpus=self._cores), _own_cpu_seconds()

    def finish(self, procs: list[_RankProcess]) -> CpuUse:
        """The run's :class:`CpuUse` (the machine's busy time unknown if never started or unreadable)."""
        busy1 = read_busy_seconds(cpus=self._cores)
        busy = None if self._busy0 is None or busy1 is None else max(0.0, busy1 - self._busy0)
        return replace(
            self.use,
            wall_s=time.monotonic() - self._launched,
            cpu_s=_cpu_seconds(procs),
            machine_busy_s=busy,
            own_cpu_s=_own_cpu_seconds() - self._own0,
        )


def _cpu_seconds(procs: list[_RankProcess]) -> float | None:
    times = [p.cpu_s for p in procs]
    return sum(t for t in times if t is not None) if procs and None not in times else None


_STOP_CODES = frozenset({-signal.SIGTERM, -signal.SIGKILL})
"""How a rank the launcher stopped ends (``Popen.returncode`` of a process killed by its signal)."""


def _failed_ranks(procs: list[_RankProcess], first: RankExit | None) -> dict[int, int]:
    """Ranks that failed by themselves (not stopped by the launcher's SIGTERM or SIGKILL): rank -> exit status."""
    out = {p.rank: p.code for p in procs if p.code not in (None, 0) and p.code not in _STOP_CODES}
    if first is not None:
        out[first.rank] = first.code
    return {r: c for r, c in sorted(out.items()) if c is not None}


def _explain_failure(
    settings: RunSettings,
    *,
    procs: list[_RankProcess],
    failed: RankExit | None,
    collector: RecordCollector,
    tails: StderrTails,
    python: str | None,
) -> None:
    """After a failed rank, or ranks that sent no record: which ranks, the first one's stderr tail, the likely fix."""
    bad = _failed_ranks(procs, failed)
    silent = [r for r in range(settings.nproc) if r not in collector.ranks or not collector.ranks[r].records]
    if not bad and not silent:
        return
    disabled = {**os.environ, **settings.extra_env}.get(ENV_DISABLE, "").strip().lower() in {"1", "true", "yes", "on"}
    if not bad and disabled:
        _say(f"{_ranks_text(silent)} sent no step record: {ENV_DISABLE} is set (the SDK is off)")
        return
    if bad:
        by_code: dict[str, list[int]] = {}
        for rank, code in bad.items():
            by_code.setdefault(RankExit(rank=rank, code=code).describe(), []).append(rank)
        parts = [f"{_ranks_text(ranks)} {how}" for how, ranks in by_code.items()]
        _say("failed: " + "; ".join(parts))
        first = failed.rank if failed is not None else next(iter(bad))
    else:
        first = next((r for r in silent if tails.tail(r).strip()), silent[0])
    tail = tails.tail(first)
    where = settings.out_dir / "ranks" / f"rank-{first}.stderr"
    if tail.strip():
        shown = shown_tail(tail)
        _say(f"the end of rank {first}'s stderr ({where}):\n" + "\n".join(f"  | {line}" for line in shown.splitlines()))
    else:
        _say(f"rank {first} wrote nothing to stderr")
    fix = fix_for(tail, python=python)
    if fix is None and not bad:
        fix = _no_record_fix(silent, collector)
    if fix is not None:
        _say(f"fix: {fix}")


def _no_record_fix(silent: list[int], collector: RecordCollector) -> str:
    """Why ranks that exited 0 sent no step record, told apart by what their trackers said to the collector.

    A rank never heard from never started the tracker; one whose tracker said hello but whose hooks failed (the
    ``hook_errors`` counter of its close message) lost its records to meshscope, not to the script; one whose close
    message counts records sent lost them on the way; one heard from without either ended no step.
    """
    heard = [r for r in silent if r in collector.ranks and (collector.ranks[r].hello or collector.ranks[r].closed)]
    never = [r for r in silent if r not in heard]
    errors = sum(collector.ranks[r].counters.get("hook_errors", 0) for r in heard)
    failing = [r for r in heard if collector.ranks[r].counters.get("hook_errors", 0) > 0]
    lost = [r for r in heard if r not in failing and collector.ranks[r].counters.get("records_sent", 0) > 0]
    idle = [r for r in heard if r not in failing and r not in lost]
    parts = []
    if lost:
        parts.append(
            f"{_ranks_text(lost)} ended steps and sent their records, but none arrived (lost between the ranks and "
            "the collector: the loss notes say how many)"
        )
    if failing:
        parts.append(
            f"{_ranks_text(failing)} started meshscope's tracker, but its hooks failed {errors:,} "
            f"time{'' if errors == 1 else 's'} and no step record was sent (the error is in the ranks' stderr, "
            f"above): a fault of meshscope's, not of the script; {ENV_DISABLE}=1 trains without it, and the error "
            "is worth reporting"
        )
    if idle:
        parts.append(
            f"{_ranks_text(idle)} started meshscope's tracker but ended no step: wrap each step in 'with "
            "tracker.step(n):', or pair tracker.start_step() with tracker.end_step() (docs/sdk.md §1)"
        )
    if never:
        parts.append(
            f"{_ranks_text(never)} sent no step record: the script never started meshscope's tracker: call "
            "meshscope.sdk.tracker_from_env() and wrap each step in 'with tracker.step(n):' (docs/sdk.md §1)"
        )
    return "; ".join(parts)


def _ranks_text(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8]) + (", ..." if len(ranks) > 8 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


def _write_run_files(  # noqa: PLR0917 - private, one caller
    settings: RunSettings,
    collector: RecordCollector,
    procs: list[_RankProcess],
    wall_s: float,
    cpu: CpuUse,
    tails: StderrTails,
    *,
    ended_by: str | None,
) -> None:
    """``OUT/collector.json``, ``OUT/measurements.json`` and the ranks' stderr tails."""
    _write_collector_report(settings, collector, procs, wall_s, cpu, ended_by=ended_by)
    _write_tails(settings.out_dir, tails)


def keep_earlier_run(out_dir: Path) -> Path | None:
    """Move an earlier run's files in ``out_dir`` (:data:`RUN_FILES`) to ``out_dir/earlier/<UTC time>/``.

    A crashed run and its resumed run, or two tries of one script, given the same ``--out``: the second would
    overwrite the first's records and leave its ranks' stderr beside its own. The time is the earlier records'
    (their file's modification), so the folders sort by run.

    Returns:
        The folder the files went to; ``None`` where ``out_dir`` held none.

    Raises:
        RunError: when they cannot be moved (the run would overwrite them).
    """
    found = [out_dir / name for name in RUN_FILES if (out_dir / name).exists()]
    if not found:
        return None
    anchor = out_dir / "records.jsonl" if (out_dir / "records.jsonl").exists() else found[0]
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(anchor.stat().st_mtime))
    target = out_dir / EARLIER_RUNS / stamp
    suffix = 1
    while target.exists():
        suffix += 1
        target = out_dir / EARLIER_RUNS / f"{stamp}-{suffix}"
    try:
        target.mkdir(parents=True)
        for path in found:
            path.rename(target / path.name)
    except OSError as exc:
        msg = f"--out {out_dir} holds an earlier run that cannot be moved to {target} ({exc}); give another --out"
        raise RunError(msg) from exc
    return target


def _write_tails(out_dir: Path, tails: StderrTails) -> None:
    """``OUT/ranks/rank-N.stderr``: the kept tail of every rank that wrote to stderr."""
    for rank in range(tails.nproc):
        tail = tails.tail(rank)
        if not tail:
            continue
        with contextlib.suppress(OSError):
            (out_dir / "ranks").mkdir(exist_ok=True)
            (out_dir / "ranks" / f"rank-{rank}.stderr").write_text(tail)


def _wait_for_goodbyes(collector: RecordCollector, nproc: int) -> None:
    deadline = time.monotonic() + CLOSE_WAIT_S
    while time.monotonic() < deadline:
        hello = [t for t in collector.ranks.values() if t.hello]
        if all(t.closed for t in hello) and (len(hello) >= nproc or not hello):
            return
        time.sleep(POLL_S)


def _dropped(collector: RecordCollector) -> int:
    return sum(t.counters.get("records_dropped", 0) for t in collector.ranks.values())


def _received_line(collector: RecordCollector, nproc: int, wall_s: float, *, failed: bool = False) -> str:
    silent = sum(1 for r in range(nproc) if r not in collector.ranks)
    beyond = sorted(r for r in collector.ranks if r >= nproc)
    heard = f"{len(collector.ranks)} ranks" if beyond else f"{len(collector.ranks)} of {nproc} ranks"
    parts = [
        f"{collector.lines} records from {heard} in {wall_s:.1f} s (start-up included)",
        f"{_dropped(collector)} dropped",
    ]
    if collector.garbage:
        parts.append(f"{collector.garbage} unreadable datagrams skipped")
    if silent:
        parts.append(f"{silent} ranks sent nothing" + (" (ranks failed: below)" if failed else " (below)"))
    if beyond:
        parts.append(
            f"{_ranks_text(beyond)} {'is' if len(beyond) == 1 else 'are'} beyond the {nproc} launched: the script "
            "started processes of its own (torch.multiprocessing.spawn) and each took its rank from the process "
            "group; --nproc counts the processes meshscope run starts"
        )
    return "; ".join(parts)


def _say_uncaptured(collector: RecordCollector) -> None:
    """One line on communication the ranks' SDK could not capture (its ``uncaptured_ddp`` counters), if any."""
    ranks = sorted(r for r, t in collector.ranks.items() if t.counters.get("uncaptured_ddp", 0))
    if not ranks:
        return
    models = sum(collector.ranks[r].counters["uncaptured_ddp"] for r in ranks)
    shown = ", ".join(str(r) for r in ranks[:8]) + (", ..." if len(ranks) > 8 else "")
    _say(
        f"{models} DDP models on ranks {shown} got a comm hook before the tracker started: their gradient "
        "reductions are captured only in part (start the tracker before registering the hook; see the ranks' logs)"
    )


def _say_background(collector: RecordCollector) -> None:
    """One line on collectives the ranks ran on background threads (their ``background_ops`` counters), if any."""
    counts = {r: t.counters.get("background_ops", 0) for r, t in collector.ranks.items()}
    total = sum(counts.values())
    if not total:
        return
    _say(
        f"{total} collectives on {sum(1 for n in counts.values() if n)} ranks ran on threads other than the training "
        "loop's (an asynchronous checkpoint's writer, a logging thread): counted, not recorded, as they block no step"
    )


def _write_collector_report(
    settings: RunSettings,
    collector: RecordCollector,
    procs: list[_RankProcess],
    wall_s: float,
    cpu: CpuUse,
    *,
    ended_by: str | None,
) -> None:
    report = {
        "job": settings.job,
        "nproc": settings.nproc,
        "layout": layout_text(settings.layout),
        "layout_given": settings.layout_given,
        "command": list(settings.command),
        "wall_seconds": round(wall_s, 3),
        "records": collector.lines,
        "unreadable_datagrams": collector.garbage,
        "exit_codes": {str(p.rank): p.code for p in procs},
        "ended_by": ended_by,
        "cpu": cpu.to_dict(),
        "ranks": {
            str(rank): {
                "records": t.records,
                "closed": t.closed,
                "counters": t.counters,
                "process_group_size": t.process_group_size,
                "after_last_step_us": t.after_last_step_us,
                "after_last_step": t.after_last_step,
            }
            for rank, t in sorted(collector.ranks.items())
        },
    }
    with contextlib.suppress(OSError):
        (settings.out_dir / "collector.json").write_text(json.dumps(report, indent=2) + "\n")
    measurements = {str(rank): t.measurements for rank, t in sorted(collector.ranks.items()) if t.measurements}
    with contextlib.suppress(OSError, TypeError, ValueError):
        (settings.out_dir / "measurements.json").write_text(json.dumps(measurements, indent=1) + "\n")


# ====================================================================== what a run leaves for its report


@dataclass(frozen=True, slots=True, kw_only=True)
class RankReceipt:
    """What the collector got from one rank."""

    records: int
    """Step records received."""
    hello: bool
    """The rank's tracker announced itself."""
    closed: bool
    """The rank's tracker said goodbye (it closed cleanly)."""
    counters: dict[str, int]
    """The rank's latest SDK counters (``records_dropped`` ...)."""
    measurements: dict[str, Any]
    """Its latest ``measurements`` message (job description, model state, activations)."""
    after_last_step_us: int | None = None
    """From its close: microseconds from the end of its last step to the close; ``None``: not said."""
    after_last_step: dict[str, int] = field(default_factory=dict)
    """What of that time its phases timed, microseconds per ``between_steps`` key."""
    median_step_us: float | None = None
    """The median of its received records' step times (``None``: none received)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOutcome:
    """How a local run ended and what it left, for :func:`report_run`."""

    settings: RunSettings
    """The run."""
    records_path: Path
    """``OUT/records.jsonl``."""
    failed: RankExit | None
    """The first rank that failed (the others were stopped), or ``None``."""
    ranks: dict[int, RankReceipt]
    """Per rank that sent anything."""
    unreadable_datagrams: int = 0
    """Datagrams the collector could not read."""
    wall_s: float = 0.0
    """Seconds from launch to the last exit."""
    cpu: CpuUse | None = None
    """The cores the ranks ran on and the CPU time they used (``None``: not measured)."""
    claimed_twice: dict[int, list[int]] = field(default_factory=dict)
    """Ranks that more than one process said it was, with their process ids: their records collide."""


# ====================================================================== the command line


_LAUNCHERS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("torchrun",): ("--nproc-per-node", "--nproc_per_node"),
    ("torch.distributed.run",): ("--nproc-per-node", "--nproc_per_node"),
    ("torch.distributed.launch",): ("--nproc-per-node", "--nproc_per_node"),
    ("accelerate", "launch"): ("--num_processes", "--num-processes"),
    ("deepspeed",): ("--num_gpus", "--num-gpus"),
}
"""Launchers that start the ranks themselves, and their option that says how many (per node)."""


def launcher_in(command: Sequence[str], nproc: int | None = None) -> str | None:
    """Why ``command`` cannot run under ``meshscope run`` when it starts a launcher of its own, else ``None``.

    ``meshscope run`` is the launcher: every rank it starts gets torchrun's environment and its own collector socket.
    ``meshscope run --nproc 4 -- torchrun --nproc-per-node 4 train.py`` would start 16 processes, four per rank,
    each claiming that rank's records. The message gives the command to run instead, with ``nproc`` (the run's own
    ``--nproc``) where the launcher's options do not say how many.
    """
    words = list(command)
    program = Path(words[0]).name if words else ""
    rest: list[str] = []
    found: tuple[str, ...] | None = None
    if program in {"python", "python3"} or program.startswith("python3."):
        if len(words) >= 3 and words[1] == "-m" and (words[2],) in _LAUNCHERS:
            found, rest = (words[2],), words[3:]
    elif (program,) in _LAUNCHERS:
        found, rest = (program,), words[1:]
    elif program == "accelerate" and words[1:2] == ["launch"]:
        found, rest = ("accelerate", "launch"), words[2:]
    if found is None:
        return None
    count, script, args = None, None, []
    options = _LAUNCHERS[found]
    for i, word in enumerate(rest):
        name, _, value = word.partition("=")
        if name in options:
            count = value or (rest[i + 1] if i + 1 < len(rest) else None)
        if word.endswith(".py") and not word.startswith("-"):
            script, args = word, rest[i + 1 :]
            break
    name = " ".join(found)
    ranks = count if count and count.isdigit() else (str(nproc) if nproc else "N")
    instead = f"meshscope run --nproc {ranks} -- python " + " ".join([script or "SCRIPT.py", *args])
    return (
        f"'{name}' is a launcher: meshscope run is one too (it starts every rank with torchrun's environment, "
        f"RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, and gives each its own collector), so the two "
        f"would start ranks twice over. Run the script directly: {instead} (for several machines, the operator: "
        "docs/operator.md)"
    )


def _command_of(args: argparse.Namespace) -> list[str]:
    """The command after ``--``, checked: there is one, and it is not a launcher (:func:`launcher_in`)."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise RunError("run needs a command after '--', e.g. meshscope run --nproc 8 -- python train.py")
    launcher = launcher_in(command, getattr(args, "nproc", None))
    if launcher is not None:
        raise RunError(launcher)
    script = _script_of(command)
    if script is not None and not os.path.exists(script):  # noqa: PTH110 - a path as python takes it
        raise RunError(
            f"{command[0]}: cannot open the script {script!r}: no such file or directory (from {os.getcwd()}); "  # noqa: PTH109
            "give its path, relative to the current directory or absolute"
        )
    return command


_PYTHON_FLAGS_WITH_VALUE = frozenset({"-X", "-W", "--check-hash-based-pycs"})
"""Interpreter options that take the next word as their value."""


def _script_of(command: Sequence[str]) -> str | None:
    """The script a ``python [options] script.py ...`` command runs; ``None`` for another command or ``-m``/``-c``."""
    if not re.fullmatch(r"python[0-9.]*", os.path.basename(command[0])):  # noqa: PTH119
        return None
    words = iter(command[1:])
    for word in words:
        if word in {"-m", "-c", "-", "--"} or (word.startswith(("-m", "-c")) and len(word) > 2):
            return None
        if word in _PYTHON_FLAGS_WITH_VALUE:
            next(words, None)
            continue
        if word.startswith("-"):
            continue
        return word
    return None


def settings_from_args(args: argparse.Namespace) -> RunSettings:
    """Build :class:`RunSettings` from parsed ``meshscope run`` arguments.

    Raises:
        RunError: for a missing command or a bad count.
        LayoutError: for a layout that does not fit ``--nproc``.
    """
    command = _command_of(args)
    if args.nproc < 1:
        raise RunError(f"--nproc must be >= 1, got {args.nproc}")
    spec = None
    if args.spec:
        from meshscope.jobs import load_spec  # noqa: PLC0415

        spec = load_spec(args.spec)
    if args.layout:
        layout = parse_layout(args.layout, world_size=args.nproc)
        if spec is not None and spec.layout != layout:
            raise LayoutError(
                f"--layout {layout.describe()} differs from the spec's {spec.layout.describe()}; give one of them"
            )
    elif spec is not None:
        layout = spec.layout
        if layout.world_size != args.nproc:
            raise LayoutError(
                f"the spec's layout {layout.describe()} has {layout.world_size} ranks but --nproc is {args.nproc}"
            )
    else:
        layout = parse_layout("", world_size=args.nproc)
    given = bool(args.layout) or spec is not None
    if args.gpus_per_node is not None and (args.gpus_per_node < 1 or args.nproc % args.gpus_per_node):
        raise RunError(f"--gpus-per-node {args.gpus_per_node} does not divide --nproc {args.nproc}")
    job = args.job or (spec.name if spec is not None else "local")
    out = Path(args.out) if args.out else Path.cwd() / time.strftime("meshscope-run-%Y%m%d-%H%M%S")
    return RunSettings(
        nproc=args.nproc,
        command=tuple(command),
        layout=layout,
        layout_given=given,
        out_dir=out,
        job=job,
        spec=spec,
        spec_path=Path(args.spec) if args.spec else None,
        launcher=args.launcher,
        grace_s=max(0.0, args.grace),
        gpus_per_node=args.gpus_per_node,
        quiet=args.quiet,
    )


# ====================================================================== the demo job


def demo_layout(*, cp: bool = False, ep: bool = False, imbalance: bool = False) -> ParallelLayout:
    """The demo's 8-rank layout: pp=2, dp=2, tp=2; ``cp`` swaps dp for cp=2; ``ep`` adds ep=2 (MoE) with etp=1.

    ``train_tiny`` runs experts without tensor parallelism (etp=1: Megatron-core's expert rank generator then puts
    each tp pair in one ep group), docs/expected-vs-measured.md §4.

    With ``imbalance`` tp gives way to data parallelism (pp=2, dp=4; with ``cp``: pp=2, dp=2, cp=2): a replica with
    more tokens can only be told from a majority of normal replicas (docs/cost-table.md, "What can be identified").
    """
    tp = 1 if imbalance else 2
    cp_degree = 2 if cp else 1
    dp = 8 // (2 * tp * cp_degree)
    return ParallelLayout(dp=dp, cp=cp_degree, tp=tp, pp=2, ep=2 if ep else 1, etp=1 if ep else None)


def demo_settings(
    out_dir: Path,
    *,
    steps: int = 10,
    cp: bool = False,
    ep: bool = False,
    straggler: str | None = None,
    imbalance: str | None = None,
    block_ms: float | None = None,
    quiet: bool = False,
) -> RunSettings:
    """The run ``meshscope demo`` launches: the bundled ``train_tiny`` on 8 local CPU ranks, emulated accelerator.

    Layout :func:`demo_layout` (data-parallel heavy with ``imbalance``) on two emulated nodes of 4 ranks; every
    transformer block sleeps its FLOPs on an emulated accelerator (:data:`meshscope.local.emulation.DEMO_BLOCK_MS` per
    block forward), so timings are deterministic on shared cores.

    Args:
        out_dir: where records, report and trace go.
        steps: training steps.
        cp: the context-parallel variant (pp=2, cp=2, tp=2).
        ep: the expert-parallel variant (MoE in every layer, ep=2).
        straggler: ``RANK:FACTOR`` passed to ``--straggler``.
        imbalance: ``RANK:FACTOR`` passed to ``--imbalance``.
        block_ms: emulated forward ms of one block; default :data:`meshscope.local.emulation.DEMO_BLOCK_MS`.
        quiet: ``--quiet``: no progress of the end-of-run report on stderr.
    """
    from meshscope.local.bundled import data_root  # noqa: PLC0415
    from meshscope.local.emulation import DEMO_BLOCK_MS  # noqa: PLC0415

    script = data_root("examples") / "train_tiny.py"
    command = [sys.executable, str(script), "--steps", str(steps), "--emulate", f"{block_ms or DEMO_BLOCK_MS:g}"]
    if ep:
        command.append("--moe")
    if straggler:
        command += ["--straggler", straggler]
    if imbalance:
        command += ["--imbalance", imbalance]
    return RunSettings(
        nproc=8,
        command=tuple(command),
        layout=demo_layout(cp=cp, ep=ep, imbalance=imbalance is not None),
        out_dir=out_dir,
        job="demo",
        gpus_per_node=4,
        extra_env={"PYTHONWARNINGS": "ignore"},
        quiet=quiet,
    )

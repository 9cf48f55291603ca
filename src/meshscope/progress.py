"""Progress of long work: which phase runs and how far it is (bytes, records or steps done, and the rate).

Why it exists: ``meshscope analyze`` of a large records file, a large ``simulate`` or ``report`` run for tens of
seconds; on a terminal the person waiting should see what is being done. The core functions that run long
(:func:`meshscope.records.read_table`, :func:`meshscope.analysis.analyze`, :func:`meshscope.simulation.simulate`,
the report writers) take a :class:`Progress` argument whose default, :data:`NO_PROGRESS`, does nothing: **the library
never prints by itself**. Only the commands make a visible one, through :func:`command_progress`: a
:class:`TerminalProgress` (drawn with ``rich`` on stderr) when stderr is a terminal and ``--quiet`` is not given,
else :data:`NO_PROGRESS`. Results (stdout) never pass through here.

Hot loops report a chunk at a time (every few MiB, a batch of rows, a step), never per record, and
:class:`TerminalProgress` passes amounts on to the display at most every :data:`MIN_INTERVAL_S` seconds (and always
at the end of a phase), so reporting costs next to nothing. This module imports only the standard library and
:mod:`meshscope.formatting` at import time; ``rich`` loads when a terminal reporter is made.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from meshscope.formatting import human_bytes

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from contextlib import AbstractContextManager
    from typing import TextIO

BYTES = "bytes"
"""The unit of phases that count bytes: amounts are shown in binary units (MiB), the rate in MiB/s."""
MIN_INTERVAL_S = 0.1
"""Seconds between two updates a :class:`TerminalProgress` phase passes on to the display (the end always is)."""


class Phase(Protocol):
    """One running phase of a :class:`Progress`: what a loop tells it as it goes."""

    def advance(self, amount: int = 1) -> None:
        """Count ``amount`` more units (bytes, records, steps) done."""


class Progress(Protocol):
    """Where long work reports its phases. Implementations: :data:`NO_PROGRESS`, :class:`TerminalProgress`."""

    def phase(self, name: str, *, total: int | None = None, unit: str = "") -> AbstractContextManager[Phase]:
        """A phase, as a context manager: entered when it starts, left when it is done.

        Args:
            name: what is being done, a gerund ("reading records", "joining collectives").
            total: units the phase will have done when it ends; ``None`` when not known (or not counted).
            unit: what :meth:`Phase.advance` counts: :data:`BYTES` (shown as MiB and MiB/s), or a plural noun
                ("records", "steps"); ``""`` for a phase that is not counted.
        """
        ...


class _NullPhase:
    __slots__ = ()

    def advance(self, amount: int = 1) -> None:
        """Nothing: nobody is watching."""


class NullProgress:
    """Progress nobody sees: every call does nothing. The default of every core function (:data:`NO_PROGRESS`)."""

    __slots__ = ()

    @contextmanager
    def phase(self, name: str, *, total: int | None = None, unit: str = "") -> Iterator[Phase]:  # noqa: ARG002
        """A phase that reports nowhere."""
        yield _NULL_PHASE


_NULL_PHASE = _NullPhase()
NO_PROGRESS: Progress = NullProgress()
"""The silent reporter: what the library uses unless a caller passes another."""


class _TerminalPhase:
    """A phase of a :class:`TerminalProgress`: counts locally, passes the count on at most every ``interval_s``."""

    __slots__ = ("_bar", "_clock", "_done", "_interval_s", "_next", "_shown", "_task", "updates")

    def __init__(self, bar: Any, task: Any, clock: Callable[[], float], interval_s: float) -> None:  # noqa: ANN401 - rich's Progress and TaskID
        self._bar = bar
        self._task = task
        self._clock = clock
        self._interval_s = interval_s
        self._done = 0
        self._shown = 0
        self._next = clock() + interval_s
        self.updates = 0
        """Updates passed on to the display so far (the tests count them)."""

    def advance(self, amount: int = 1) -> None:
        """Count ``amount`` more; the display hears of it when ``interval_s`` has passed since it last did."""
        self._done += amount
        now = self._clock()
        if now >= self._next:
            self._next = now + self._interval_s
            self._show()

    @property
    def done(self) -> int:
        """Units counted so far."""
        return self._done

    def finish(self) -> None:
        """Pass on the final count (the display shows where the phase ended, however short it was)."""
        self._show()

    def _show(self) -> None:
        if self._done != self._shown or not self.updates:
            self._bar.update(self._task, completed=self._done)
            self._shown = self._done
            self.updates += 1


class TerminalProgress:
    """Progress drawn on a terminal with ``rich``: one line per running phase (spinner, name, bar, amount, rate, time).

    The display starts when the outermost phase starts and is erased when it ends (``transient``), so that what a
    command prints between phases, and its results after them, are never mixed with it. It never touches stdout.
    """

    def __init__(
        self,
        stream: TextIO,
        *,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = MIN_INTERVAL_S,
        width: int | None = None,
    ) -> None:
        """Draw on ``stream``.

        Args:
            stream: where to draw (the command line passes stderr, a terminal).
            clock: seconds, for the rates and for when to pass updates on (tests pass a fake one).
            interval_s: least seconds between two updates of one phase passed on to the display.
            width: columns of the display; default the terminal's.
        """
        from rich.console import Console  # noqa: PLC0415 - loaded only when progress is shown
        from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn  # noqa: PLC0415
        from rich.progress import Progress as RichProgress  # noqa: PLC0415

        self._clock = clock
        self._interval_s = interval_s
        self._depth = 0
        console = Console(file=stream, width=width, force_terminal=True, highlight=False)
        self._bar = RichProgress(
            SpinnerColumn(finished_text="✓"),
            TextColumn("{task.description}"),
            BarColumn(bar_width=24),
            _amount_column(),
            _rate_column(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            redirect_stdout=False,  # stdout carries the results: never rewritten, never delayed
            redirect_stderr=False,
            get_time=clock,
        )

    @contextmanager
    def phase(self, name: str, *, total: int | None = None, unit: str = "") -> Iterator[Phase]:
        """A phase shown as one line while it runs (see :meth:`Progress.phase`)."""
        if self._depth == 0:
            self._bar.start()
        self._depth += 1
        task = self._bar.add_task(name, total=total, unit=unit)
        ticker = _TerminalPhase(self._bar, task, self._clock, self._interval_s)
        try:
            yield ticker
            ticker.finish()
            if total is None:  # a phase of unknown length is done when it ends
                self._bar.update(task, total=max(ticker.done, 1), completed=max(ticker.done, 1))
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._bar.stop()  # draws the final state once more, then erases the display
                for old in list(self._bar.task_ids):
                    self._bar.remove_task(old)


def _amount_column() -> Any:  # noqa: ANN401 - a rich ProgressColumn, whose module loads only here
    from rich.progress import ProgressColumn  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    class AmountColumn(ProgressColumn):
        """``12.00 MiB / 890.00 MiB``, ``3 / 20 steps``, ``1,024 records``; nothing for an uncounted phase."""

        def render(self, task: Any) -> Text:  # noqa: ANN401 - rich's Task
            unit = task.fields.get("unit", "")
            if not unit:
                return Text("")
            done = task.completed
            if unit == BYTES:
                text = human_bytes(done) + (f" / {human_bytes(task.total)}" if task.total is not None else "")
            else:
                text = f"{done:,.0f}" + (f" / {task.total:,.0f}" if task.total is not None else "") + f" {unit}"
            return Text(text, style="progress.download")

    return AmountColumn()


def _rate_column() -> Any:  # noqa: ANN401 - a rich ProgressColumn, whose module loads only here
    from rich.progress import ProgressColumn  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    class RateColumn(ProgressColumn):
        """``72.10 MiB/s``, ``3.2 steps/s``; nothing before a rate is known or for an uncounted phase."""

        def render(self, task: Any) -> Text:  # noqa: ANN401 - rich's Task
            unit = task.fields.get("unit", "")
            speed = task.finished_speed or task.speed
            if not unit or not speed:
                return Text("")
            text = f"{human_bytes(speed)}/s" if unit == BYTES else f"{speed:,.1f} {unit}/s"
            return Text(text, style="progress.data.speed")

    return RateColumn()


def command_progress(*, quiet: bool, stream: TextIO | None = None) -> Progress:
    """The reporter a command uses: drawn on ``stream`` (default stderr) if it is a terminal and not ``quiet``.

    Args:
        quiet: the command's ``--quiet``: no progress at all.
        stream: where progress would be drawn; default ``sys.stderr``.

    Returns:
        A :class:`TerminalProgress`, or :data:`NO_PROGRESS` when nobody would see it (stderr redirected to a file or a
        pipe, ``--quiet``) or the terminal cannot redraw a line (``TERM=dumb``).
    """
    stream = sys.stderr if stream is None else stream
    if quiet or not _is_terminal(stream) or os.environ.get("TERM") == "dumb":
        return NO_PROGRESS
    return TerminalProgress(stream)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False

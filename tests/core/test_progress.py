"""The progress layer: the silent default, the terminal reporter's chunked updates, and what the core reports."""

from __future__ import annotations

import io
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import meshscope.records.reading as reading_module
from meshscope.analysis import analyze
from meshscope.progress import BYTES, NO_PROGRESS, NullProgress, TerminalProgress, command_progress
from meshscope.records import read_table, write_records
from meshscope.simulation import load_scenario, simulate

SCENARIO = Path(__file__).resolve().parents[2] / "examples" / "scenarios" / "dp8-handmade.yaml"


@dataclass
class RecordedPhase:
    name: str
    total: int | None
    unit: str
    advances: list[int] = field(default_factory=list)
    ended: bool = False

    def advance(self, amount: int = 1) -> None:
        assert not self.ended, f"{self.name}: advanced after it ended"
        self.advances.append(amount)


@dataclass
class RecordingProgress:
    """A reporter that keeps every phase and every amount it was told (the real interface, nothing drawn)."""

    phases: list[RecordedPhase] = field(default_factory=list)

    @contextmanager
    def phase(self, name: str, *, total: int | None = None, unit: str = ""):
        recorded = RecordedPhase(name, total, unit)
        self.phases.append(recorded)
        yield recorded
        recorded.ended = True

    def named(self, prefix: str) -> RecordedPhase:
        found = [p for p in self.phases if p.name.startswith(prefix)]
        assert len(found) == 1, [p.name for p in self.phases]
        return found[0]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def simulated():
    return simulate(load_scenario(SCENARIO), steps=4)


# ---------------------------------------------------------------------------- the reporters


def test_the_silent_reporter_takes_every_call_and_shows_nothing() -> None:
    assert isinstance(NO_PROGRESS, NullProgress)
    with NO_PROGRESS.phase("reading records", total=10, unit=BYTES) as phase:
        phase.advance(4)
        phase.advance()


def test_terminal_phase_passes_updates_on_per_interval_and_always_at_the_end() -> None:
    clock = FakeClock()
    out = FakeTerminal()
    progress = TerminalProgress(out, clock=clock, interval_s=0.5, width=120)
    with progress.phase("simulating 8 ranks", total=100, unit="steps") as phase:
        for _ in range(10):
            phase.advance(5)  # the clock stands still: nothing reaches the display
        assert phase.updates == 0
        clock.now = 0.5
        phase.advance(5)
        assert phase.updates == 1
        clock.now = 0.7
        phase.advance(5)  # within the interval of the last update
        assert phase.updates == 1
        clock.now = 1.0
        phase.advance(5)
        assert phase.updates == 2
        phase.advance(35)
    assert phase.updates == 3  # the final count, however little time passed
    drawn = out.getvalue()
    assert "simulating 8 ranks" in drawn
    assert "100 / 100 steps" in drawn


def test_terminal_progress_draws_bytes_in_binary_units_with_a_rate() -> None:
    clock = FakeClock()
    out = FakeTerminal()
    progress = TerminalProgress(out, clock=clock, width=120)
    with progress.phase("reading records", total=8 << 20, unit=BYTES) as phase:
        for _ in range(8):
            clock.now += 0.5
            phase.advance(1 << 20)
    drawn = out.getvalue()
    assert "reading records" in drawn
    assert "8.00 MiB / 8.00 MiB" in drawn
    assert "2.00 MiB/s" in drawn  # 8 MiB in 4 s of the fake clock


def test_terminal_progress_shows_an_uncounted_phase_and_nested_phases() -> None:
    out = FakeTerminal()
    progress = TerminalProgress(out, clock=FakeClock(), width=120)
    with progress.phase("analysing"), progress.phase("diagnosing"):
        pass
    drawn = out.getvalue()
    assert "analysing" in drawn
    assert "diagnosing" in drawn


def test_command_progress_is_drawn_only_on_a_terminal_and_not_quiet(monkeypatch) -> None:
    monkeypatch.setenv("TERM", "xterm")
    assert isinstance(command_progress(quiet=False, stream=FakeTerminal()), TerminalProgress)
    assert command_progress(quiet=True, stream=FakeTerminal()) is NO_PROGRESS
    assert command_progress(quiet=False, stream=io.StringIO()) is NO_PROGRESS  # a file or a pipe
    monkeypatch.setenv("TERM", "dumb")
    assert command_progress(quiet=False, stream=FakeTerminal()) is NO_PROGRESS


# ---------------------------------------------------------------------------- what the core reports


def test_simulate_counts_its_steps(tmp_path) -> None:
    progress = RecordingProgress()
    result = simulate(load_scenario(SCENARIO), steps=4, progress=progress)
    sim = progress.named("simulating")
    assert (sim.total, sim.unit, sim.advances) == (4, "steps", [1, 1, 1, 1])
    assert progress.named("building the records table").ended
    writing = RecordingProgress()
    lines = write_records(tmp_path / "r.jsonl", result.table, progress=writing)
    phase = writing.named("writing records")
    assert (phase.total, phase.unit, sum(phase.advances)) == (result.table.n_rows, "records", lines)


@pytest.mark.parametrize("name", ["records.jsonl", "records.jsonl.gz"], ids=["plain", "gzip"])
def test_reading_counts_every_byte_of_the_files(tmp_path, simulated, name) -> None:
    path = tmp_path / name
    write_records(path, simulated.table)
    progress = RecordingProgress()
    table = read_table(path, progress=progress)
    assert table.n_rows == simulated.table.n_rows
    reading = progress.named("reading records")
    assert (reading.total, reading.unit) == (path.stat().st_size, BYTES)
    assert sum(reading.advances) == path.stat().st_size
    assert progress.named("checking the table").ended


def test_reading_counts_every_byte_with_worker_processes(tmp_path, simulated, monkeypatch) -> None:
    monkeypatch.setattr(reading_module, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(reading_module, "_CHUNK_MIN_BYTES", 4096)  # several work items
    path = tmp_path / "records.jsonl"
    write_records(path, simulated.table)
    progress = RecordingProgress()
    used = []
    parallel = reading_module._read_parallel
    monkeypatch.setattr(reading_module, "_read_parallel", lambda *a, **k: used.append(parallel(*a, **k)) or used[-1])
    table = read_table(path, workers=2, progress=progress)
    assert used[0] is not None  # read by the workers, not again in this process
    assert table.n_rows == simulated.table.n_rows
    reading = progress.named("reading records")
    assert sum(reading.advances) == reading.total == path.stat().st_size  # counted by the workers, in the parent
    assert [p.name for p in progress.phases] == [
        "reading records",
        "merging the workers' columns",
        "checking the table",
    ]


def test_analyze_reports_its_phases_in_order(simulated) -> None:
    progress = RecordingProgress()
    quiet = analyze(simulated.table, spec=simulated.scenario.spec)
    told = analyze(simulated.table, spec=simulated.scenario.spec, progress=progress)
    assert told.to_dict() == quiet.to_dict()
    names = [p.name.split(" ")[0] for p in progress.phases]
    assert names == ["aligning", "joining", "breaking", "following", "costing", "diagnosing"]
    assert all(p.ended for p in progress.phases)
    assert progress.phases[2].name.startswith(f"breaking down {simulated.table.n_rows:,} rank-steps")

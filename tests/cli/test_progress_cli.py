"""Progress of ``analyze``, ``report`` and ``simulate`` on a real pseudo-terminal: shown on stderr, never on stdout.

Each command runs as its own process (``python -m meshscope``) with stderr (and, in one case, stdout) connected to a
pseudo-terminal from ``os.openpty``, and again with plain pipes; stdout must be the same bytes either way, and stderr
must be empty without a terminal or with ``--quiet``. Nothing here depends on the machine's speed: every phase draws
its final state when it ends, however short it was.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "tests" / "data" / "pp2_tp2_dp2_straggler" / "records.jsonl"
SCENARIO = ROOT / "examples" / "scenarios" / "dp8-handmade.yaml"
ANALYZE_PHASES = ("reading records", "checking the table", "aligning clocks", "joining collectives", "breaking down")
ANALYZE_PHASES_LATE = ("costing", "diagnosing")

pytestmark = pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs pseudo-terminals")


def _drain(fd: int, into: bytearray) -> None:
    """Read a pty master until every writer has closed the other end (Linux then says EIO)."""
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            return
        if not data:
            return
        into.extend(data)


def meshscope(*argv: str, stdout_tty: bool = False, stderr_tty: bool = False) -> tuple[int, bytes, bytes]:
    """Run ``meshscope ARGV``; return its exit code, stdout and stderr (a pty's bytes where asked for)."""
    env = {k: v for k, v in os.environ.items() if k not in {"NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE"}}
    env.update(TERM="xterm", COLUMNS="160", LINES="40")
    ends: dict[str, int] = {}
    masters: dict[str, int] = {}
    for name, tty in (("stdout", stdout_tty), ("stderr", stderr_tty)):
        if tty:
            masters[name], ends[name] = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshscope", *argv],
        stdin=subprocess.DEVNULL,
        stdout=ends.get("stdout", subprocess.PIPE),
        stderr=ends.get("stderr", subprocess.PIPE),
        env=env,
        cwd=ROOT,
    )
    for fd in ends.values():
        os.close(fd)  # the child holds them now
    got = {name: bytearray() for name in masters}
    readers = [threading.Thread(target=_drain, args=(fd, got[name])) for name, fd in masters.items()]
    for reader in readers:
        reader.start()
    out, err = proc.communicate(timeout=120)
    for reader in readers:
        reader.join(timeout=30)
    for fd in masters.values():
        os.close(fd)
    if stdout_tty:
        out = bytes(got["stdout"]).replace(b"\r\n", b"\n")  # the terminal's line discipline turns \n into \r\n
    if stderr_tty:
        err = bytes(got["stderr"])
    return proc.returncode, out or b"", err or b""


def test_analyze_shows_its_phases_on_a_terminal_and_prints_the_same_json(tmp_path) -> None:
    code, plain_out, plain_err = meshscope("analyze", "--json", str(RECORDS))
    assert code == 0, plain_err
    assert plain_err == b""  # no terminal: no progress
    code, tty_out, tty_err = meshscope("analyze", "--json", str(RECORDS), stderr_tty=True)
    assert code == 0, tty_err
    assert tty_out == plain_out  # byte for byte
    shown = tty_err.decode()
    for phase in (*ANALYZE_PHASES, *ANALYZE_PHASES_LATE):
        assert phase in shown, phase
    assert shown.index("reading records") < shown.index("joining collectives") < shown.index("diagnosing")
    assert re.search(r"\d+\.\d\d KiB / \d+\.\d\d KiB", shown)  # bytes read of the file's bytes
    assert "\x1b[" in shown  # drawn, then erased (transient)


def test_analyze_json_parses_when_stdout_and_stderr_are_terminals() -> None:
    _, plain_out, _ = meshscope("analyze", "--json", str(RECORDS))
    code, out, err = meshscope("analyze", "--json", str(RECORDS), stdout_tty=True, stderr_tty=True)
    assert code == 0, err
    assert b"\x1b" not in out  # progress never reaches stdout
    assert out == plain_out
    assert "reading records" in err.decode()


def test_analyze_table_is_the_same_with_and_without_a_terminal() -> None:
    _, plain_out, _ = meshscope("analyze", str(RECORDS))
    code, tty_out, tty_err = meshscope("analyze", str(RECORDS), stderr_tty=True)
    assert code == 0, tty_err
    assert tty_out == plain_out
    assert "diagnosing" in tty_err.decode()


@pytest.mark.parametrize("flag", ["--quiet", "-q"])
def test_quiet_shows_nothing_on_a_terminal(flag: str) -> None:
    _, plain_out, _ = meshscope("analyze", "--json", str(RECORDS))
    code, out, err = meshscope("analyze", "--json", flag, str(RECORDS), stderr_tty=True)
    assert code == 0, err
    assert err == b""
    assert out == plain_out


def test_errors_still_reach_a_terminal_with_quiet(tmp_path) -> None:
    code, out, err = meshscope("analyze", "--quiet", str(tmp_path / "nope.jsonl"), stderr_tty=True)
    assert code == 2
    assert out == b""
    assert "no such records file" in err.decode()


def test_a_directory_stands_for_its_records_files(tmp_path) -> None:
    import shutil  # noqa: PLC0415

    _, from_file, _ = meshscope("analyze", "--json", str(RECORDS))
    shutil.copy(RECORDS, tmp_path / RECORDS.name)
    (tmp_path / "notes.txt").write_text("not records")
    code, from_dir, err = meshscope("analyze", "--json", str(tmp_path))
    assert code == 0, err
    assert from_dir == from_file
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = meshscope("analyze", str(empty))
    assert (code, out) == (2, b"")
    assert f"no records files (*.jsonl, *.jsonl.gz) in the directory {empty}" in err.decode()


def test_report_shows_its_phases_and_prints_the_same_paths(tmp_path) -> None:
    out_dir = tmp_path / "report"
    code, plain_out, plain_err = meshscope("report", str(RECORDS), "--out", str(out_dir))
    assert code == 0, plain_err
    assert plain_err == b""
    html = (out_dir / "report.html").read_bytes()
    code, tty_out, tty_err = meshscope("report", str(RECORDS), "--out", str(out_dir), stderr_tty=True)
    assert code == 0, tty_err
    assert tty_out == plain_out
    assert (out_dir / "report.html").read_bytes() == html
    shown = tty_err.decode()
    for phase in ("reading records", "joining collectives", "diagnosing", "writing the report", "writing the trace"):
        assert phase in shown, phase
    code, _, quiet_err = meshscope("report", str(RECORDS), "--out", str(out_dir), "--quiet", stderr_tty=True)
    assert code == 0
    assert quiet_err == b""


def _without_timings(out: bytes) -> bytes:
    """``simulate`` prints how long it took: the one part of its output that differs between two runs."""
    return re.sub(rb"in \d+\.\d\d s", b"in <t> s", out)


def test_simulate_counts_steps_on_a_terminal_and_writes_the_same_records(tmp_path) -> None:
    plain, tty = tmp_path / "plain.jsonl", tmp_path / "tty.jsonl"
    code, plain_out, plain_err = meshscope("simulate", str(SCENARIO), "--steps", "5", "--out", str(plain))
    assert code == 0, plain_err
    assert plain_err == b""
    code, tty_out, tty_err = meshscope("simulate", str(SCENARIO), "--steps", "5", "--out", str(tty), stderr_tty=True)
    assert code == 0, tty_err
    assert _without_timings(tty_out).replace(b"tty.jsonl", b"plain.jsonl") == _without_timings(plain_out)
    assert tty.read_bytes() == plain.read_bytes()
    shown = tty_err.decode()
    assert "simulating 8 ranks" in shown
    assert "5 / 5 steps" in shown
    assert "building the records table" in shown
    assert "writing records" in shown
    code, _, quiet_err = meshscope("simulate", str(SCENARIO), "--steps", "5", "--out", str(tty), "-q", stderr_tty=True)
    assert code == 0
    assert quiet_err == b""


TRAIN = """
import time

from meshscope import sdk

tracker = sdk.tracker_from_env()
for step in range(4):
    with tracker.step(step), tracker.phase("forward"):
        time.sleep(0.01)
tracker.close()
"""


@pytest.mark.slow
def test_run_shows_the_end_of_run_analysis_unless_quiet(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    command = ["run", "--nproc", "2", "--out", str(tmp_path / "out"), "--", sys.executable, str(script)]
    code, _, err = meshscope(*command, stderr_tty=True)
    assert code == 0, err[-3000:]
    shown = err.decode()
    assert "8 records from 2 of 2 ranks" in shown
    for phase in ("reading the collected records", "joining collectives", "diagnosing", "writing the report"):
        assert phase in shown, phase
    code, _, err = meshscope(command[0], "--quiet", *command[1:], stderr_tty=True)
    assert code == 0, err[-3000:]
    shown = err.decode()
    assert "8 records from 2 of 2 ranks" in shown  # what run says is not progress: --quiet keeps it
    assert "diagnosing" not in shown
    assert "\x1b[" not in shown

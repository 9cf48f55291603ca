"""The HTML report in a real headless Chromium: it renders (a non-blank screenshot of the requested size, in the
report's colours) and the rendered DOM holds the cost table and the timeline SVG with its hatch pattern.

Chromium is required, not optional: without it this test fails and says how to install it (Debian's ``chromium``).
The PNG is decoded here with zlib and numpy (no imaging library).
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from meshscope.analysis.breakdown import break_down
from meshscope.records import read_table
from meshscope.reports.pages import write_report

RECORDS = Path(__file__).parent.parent / "data" / "pp2_tp2_dp2_straggler" / "records.jsonl"
WIDTH, HEIGHT = 1400, 2000
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = (
    "the browser test needs a real headless Chromium and none was found on PATH (tried "
    f"{', '.join(BROWSERS)}). Install it: `apt-get update && apt-get install -y chromium` (Debian/Ubuntu; "
    "the Makefile's setup step does this)"
)
TIMEOUT_S = 90


def browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(INSTALL_HINT, pytrace=False)


def run_chromium(page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        browser(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        *extra,
        page.resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {proc.stderr[-2000:]}"
    return proc


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    table = read_table(RECORDS)
    analysis = json.loads(RECORDS.with_name("analysis.json").read_text(encoding="utf-8"))
    return write_report(tmp_path_factory.mktemp("report") / "report.html", table, break_down(table), analysis)


# ---------------------------------------------------------------------------- a small PNG reader


def read_png(data: bytes) -> np.ndarray:
    """Decode an 8-bit, non-interlaced PNG (grey, RGB or RGBA) into an array of shape (height, width, channels)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos, idat, header = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in chunk {kind!r}"
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    assert header is not None, "no IHDR chunk"
    width, height, depth, color, _, _, interlace = header
    assert depth == 8, f"bit depth {depth}"
    assert interlace == 0, "interlaced PNG"
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    stride = width * channels
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        kind, line = int(raw[y, 0]), raw[y, 1:]
        if kind == 0:  # None
            cur = line.copy()
        elif kind == 1:  # Sub: a running sum per channel, mod 256
            cur = np.cumsum(line.reshape(-1, channels), axis=0, dtype=np.uint8).reshape(-1)
        elif kind == 2:  # Up
            cur = line + prev
        else:  # Average, Paeth: sequential along the line
            cur = unfilter_sequential(kind, line, prev, channels)
        out[y] = cur
        prev = cur
    return out.reshape(height, width, channels)


def unfilter_sequential(kind: int, line: np.ndarray, prev: np.ndarray, bpp: int) -> np.ndarray:
    """Average (3) and Paeth (4): each byte depends on the decoded byte to its left, so this loops in Python."""
    cur, up = bytearray(line.tobytes()), prev.tobytes()
    n = len(cur)
    if kind == 3:
        for i in range(bpp):
            cur[i] = (cur[i] + (up[i] >> 1)) & 0xFF
        for i in range(bpp, n):
            cur[i] = (cur[i] + ((cur[i - bpp] + up[i]) >> 1)) & 0xFF
    elif kind == 4:
        for i in range(bpp):
            cur[i] = (cur[i] + up[i]) & 0xFF  # a = c = 0: Paeth picks b
        for i in range(bpp, n):
            a, b, c = cur[i - bpp], up[i], up[i - bpp]
            pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
            cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    else:
        pytest.fail(f"unknown PNG filter type {kind}")
    return np.frombuffer(bytes(cur), dtype=np.uint8)


def pixels_near(image: np.ndarray, hex_color: str, tolerance: int = 6) -> int:
    rgb = np.array([int(hex_color[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
    return int(np.count_nonzero(np.abs(image[:, :, :3].astype(np.int16) - rgb).max(axis=2) <= tolerance))


# ---------------------------------------------------------------------------- the tests


def test_png_reader_decodes_every_filter():
    """The reader itself: a 3x3 RGB image encoded with every filter type (None, Sub, Up, Average, Paeth)."""
    image = np.array(
        [[[10, 20, 30], [40, 50, 60], [70, 80, 90]], [[15, 25, 35], [45, 55, 65], [75, 85, 95]]], dtype=np.uint8
    )
    image = np.concatenate([image, image[:1] + 100], axis=0)

    def png(filters: list[int]) -> bytes:
        rows = []
        prev = np.zeros(9, dtype=np.int16)
        for f, row in zip(filters, image.reshape(3, 9).astype(np.int16), strict=True):
            left = np.concatenate([[0, 0, 0], row[:-3]])
            upleft = np.concatenate([[0, 0, 0], prev[:-3]])
            if f == 0:
                pred = np.zeros(9, dtype=np.int16)
            elif f == 1:
                pred = left
            elif f == 2:
                pred = prev
            elif f == 3:
                pred = (left + prev) >> 1
            else:
                p = left + prev - upleft
                pa, pb, pc = abs(p - left), abs(p - prev), abs(p - upleft)
                pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, prev, upleft))
            rows.append(bytes([f]) + ((row - pred) % 256).astype(np.uint8).tobytes())
            prev = row

        def chunk(kind: bytes, body: bytes) -> bytes:
            return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

        ihdr = struct.pack(">IIBBBBB", 3, 3, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"".join(rows)))
            + chunk(b"IEND", b"")
        )

    for filters in ([1, 2, 4], [0, 3, 4], [4, 4, 3]):
        np.testing.assert_array_equal(read_png(png(filters)), image)


def test_screenshot_renders_the_report(report: Path, tmp_path: Path):
    shot = tmp_path / "report.png"
    run_chromium(report, tmp_path / "profile", f"--screenshot={shot}", f"--window-size={WIDTH},{HEIGHT}")
    assert shot.is_file(), "chromium wrote no screenshot"
    image = read_png(shot.read_bytes())
    assert image.shape[:2] == (HEIGHT, WIDTH)
    gray = image[:, :, :3].astype(np.float64).mean(axis=2)
    assert gray.std() > 10, f"the screenshot is (nearly) blank: pixel standard deviation {gray.std():.2f}"
    rgb = image[:, :, :3].astype(np.uint32)
    colours = np.unique((rgb[:, :, 0] << 16) | (rgb[:, :, 1] << 8) | rgb[:, :, 2])
    assert len(colours) > 100, f"only {len(colours)} distinct colours: nothing much was drawn"
    # The report's own colours are on screen: page background, backward compute, dp comm, data wait.
    for name, hex_color, at_least in (
        ("page background", "#f6f7f9", 100_000),
        ("backward compute", "#2f6fb3", 2_000),
        ("dp communication", "#e8743b", 500),
        ("data wait", "#e9b949", 200),
    ):
        found = pixels_near(image, hex_color)
        assert found >= at_least, f"{name} ({hex_color}): {found} pixels, expected >= {at_least}"


def test_rendered_dom_has_the_cost_table_and_the_hatched_timeline(report: Path, tmp_path: Path):
    dom = run_chromium(report, tmp_path / "profile", "--dump-dom").stdout
    assert '<table class="cost">' in dom
    cost = dom.split('<table class="cost">')[1].split("</table>")[0]
    assert len(re.findall(r"<tr>", cost.split("<tbody>")[1])) >= 5
    assert "measured median" in cost
    timelines = re.findall(r'<svg class="tl".*?</svg>', dom, flags=re.DOTALL)
    assert len(timelines) == 2  # slowest and median step
    for svg in timelines:
        assert len(re.findall(r">rank \d+<", svg)) == 8
    assert '<pattern id="ms-hatch"' in dom
    assert re.search(r'class="k-wait"', timelines[0]), "no hatched sync wait in the slowest step"
    assert "Slowest step: step 2" in dom
    assert "Findings (1)" in dom
